# Owner(s): ["module: moe"]
"""Malformed calls of ``torch_moe.nn``: the functional layer (``moe_ffn``, ``route``, the
auxiliary losses, ``token_sort_with_capacity``, ``activation``), ``MoEConfig``, the modules
(``MoE``, ``TopKRouter``, ``GroupedExperts``, ``SharedExperts``) and the HuggingFace
checkpoint conversion. Each case either raises an error that names the argument, the value
expected and the value given, or returns a defined result."""

import torch
from torch.testing._internal.common_utils import run_tests

from _malformed import Case, malformed_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe.nn import (
    GroupedExperts,
    MoE,
    MoEConfig,
    SharedExperts,
    TopKRouter,
    hf_moe_state_dict,
    load_hf_moe_state_dict,
)
from torch_moe.nn import functional as F

T, D, FF, E, K = 6, 8, 4, 4, 2
NAN, INF = float("nan"), float("inf")


def _logits(T=T, E=8, dtype=torch.float32):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(0)).to(dtype)


def _ids(T=T, k=K, E=E):
    return torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(0))


def _weights(T=T, k=K):
    return torch.rand(T, k, generator=torch.Generator().manual_seed(1))


def _ffn_args(T=T, dtype=torch.float32, D=D, FF=FF):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, D, generator=g).to(dtype)
    w1 = torch.randn(E, D, FF, generator=g).to(dtype)
    w2 = torch.randn(E, FF, D, generator=g).to(dtype)
    w3 = torch.randn(E, D, FF, generator=g).to(dtype)
    return x, _ids(T), _weights(T), w1, w2, w3


def _config(**kw):
    return MoEConfig(**{**dict(dim=D, hidden_dim=FF, num_experts=E, top_k=K), **kw})


def _moe(**kw):
    torch.manual_seed(0)
    return MoE(_config(**kw))


def _expect(shape, dtype=None, zero=False, value=None):
    def check(result):
        out = result[0] if isinstance(result, tuple) else result
        assert tuple(out.shape) == tuple(shape), f"expected shape {tuple(shape)}, got {tuple(out.shape)}"
        if dtype is not None:
            assert out.dtype == dtype, f"expected {dtype}, got {out.dtype}"
        if zero:
            assert out.device.type == "meta" or not bool(out.any()), "expected zeros"
        if value is not None:
            assert float(out) == value, f"expected {value}, got {float(out)}"
    return check


def _check_empty_sort(num_experts, align):
    def check(result):
        sorted_ids, offs, kept, dropped = result
        assert sorted_ids.numel() == num_experts * (align - 1), sorted_ids.shape
        assert bool((sorted_ids == -1).all())
        assert offs.tolist() == [0] * num_experts and offs.dtype == torch.int32
        assert kept.tolist() == [0] * num_experts and int(dropped) == 0
    return check


def _check_all_dropped(result):
    sorted_ids, offs, kept, dropped = result
    assert bool((sorted_ids == -1).all()) and offs.tolist() == [0] * E
    assert kept.tolist() == [0] * E and int(dropped) == T * K


def _same_as_dropless(result, dropless):
    for got, expected in zip(result, dropless):
        assert torch.equal(got, expected), f"expected {expected.tolist()}, got {got.tolist()}"


def _route(*args, **kw):
    return lambda: F.route(*args, **kw)


ROUTE = "torch_moe.nn.functional.route"
ROUTE_CASES = [
    Case(ROUTE, "logits_1d", _route(torch.randn(8), 2), ValueError, ("logits", "[T, E]", "(8,)")),
    Case(ROUTE, "logits_3d", _route(torch.randn(2, 3, 8), 2), ValueError, ("logits", "[T, E]", "(2, 3, 8)")),
    Case(ROUTE, "logits_complex", _route(_logits(dtype=torch.complex64), 2), TypeError,
         ("logits", "float32", "complex64")),
    Case(ROUTE, "logits_int", _route(_logits().long(), 2), TypeError, ("logits", "float32", "int64")),
    Case(ROUTE, "logits_bool", _route(_logits() > 0, 2), TypeError, ("logits", "float32", "bool")),
    Case(ROUTE, "logits_nan", _route(_logits().index_fill(0, torch.tensor([1]), NAN), 2),
         RuntimeError, ("logits", "NaN or Inf")),
    Case(ROUTE, "logits_inf", _route(_logits().index_fill(0, torch.tensor([1]), -INF), 2),
         RuntimeError, ("logits", "NaN or Inf")),
    Case(ROUTE, "top_k_zero", _route(_logits(), 0), ValueError, ("top_k", "[1, 8]", "but got 0")),
    Case(ROUTE, "top_k_greater_than_num_experts", _route(_logits(), 9), ValueError,
         ("top_k", "[1, 8]", "but got 9")),
    Case(ROUTE, "top_k_negative", _route(_logits(), -1), ValueError, ("top_k", "[1, 8]", "but got -1")),
    Case(ROUTE, "top_k_float", _route(_logits(), 2.5), TypeError, ("top_k", "int", "2.5")),
    Case(ROUTE, "top_k_bool", _route(_logits(), True), TypeError, ("top_k", "int", "True")),
    Case(ROUTE, "score_func_unknown", _route(_logits(), 2, score_func="tanh"), ValueError,
         ("score_func", "'softmax'", "'tanh'")),
    Case(ROUTE, "scale_nan", _route(_logits(), 2, scale=NAN), ValueError, ("scale", "finite", "nan")),
    Case(ROUTE, "scale_inf", _route(_logits(), 2, scale=INF), ValueError, ("scale", "finite", "inf")),
    Case(ROUTE, "expert_bias_nan", _route(_logits(), 2, expert_bias=torch.full((8,), NAN)),
         RuntimeError, ("expert_bias", "NaN or Inf")),
    Case(ROUTE, "expert_bias_inf",
         _route(_logits(), 2, expert_bias=torch.zeros(8).index_fill(0, torch.tensor([3]), INF)),
         RuntimeError, ("expert_bias", "NaN or Inf")),
    Case(ROUTE, "expert_bias_wrong_length", _route(_logits(), 2, expert_bias=torch.zeros(7)),
         ValueError, ("expert_bias", "[8]", "(7,)")),
    Case(ROUTE, "expert_bias_2d", _route(_logits(), 2, expert_bias=torch.zeros(1, 8)),
         ValueError, ("expert_bias", "[8]", "(1, 8)")),
    Case(ROUTE, "expert_bias_int", _route(_logits(), 2, expert_bias=torch.zeros(8, dtype=torch.int64)),
         TypeError, ("expert_bias", "float32", "int64")),
    Case(ROUTE, "expert_bias_complex",
         _route(_logits(), 2, expert_bias=torch.zeros(8, dtype=torch.complex64)),
         TypeError, ("expert_bias", "float32", "complex64")),
    Case(ROUTE, "expert_bias_other_device", _route(_logits(), 2, expert_bias=torch.zeros(8, device="meta")),
         ValueError, ("expert_bias", "cpu", "meta")),
    Case(ROUTE, "expert_bias_with_topk_before_score",
         _route(_logits(), 2, topk_before_score=True, expert_bias=torch.zeros(8)), ValueError,
         ("expert_bias", "topk_before_score=False", "True")),
    Case(ROUTE, "groups_with_topk_before_score",
         _route(_logits(), 2, topk_before_score=True, num_groups=2, topk_groups=1), ValueError,
         ("num_groups", "topk_before_score=False", "True")),
    Case(ROUTE, "topk_groups_zero", _route(_logits(), 2, num_groups=4, topk_groups=0), ValueError,
         ("topk_groups", "[1, 4]", "but got 0")),
    Case(ROUTE, "topk_groups_greater_than_num_groups", _route(_logits(), 2, num_groups=4, topk_groups=5),
         ValueError, ("topk_groups", "[1, 4]", "but got 5")),
    Case(ROUTE, "topk_groups_float", _route(_logits(), 2, num_groups=4, topk_groups=1.5), TypeError,
         ("topk_groups", "int", "1.5")),
    Case(ROUTE, "topk_groups_missing", _route(_logits(), 2, num_groups=4), ValueError,
         ("topk_groups", "[1, 4]", "None")),
    Case(ROUTE, "topk_groups_without_num_groups", _route(_logits(), 2, topk_groups=2), ValueError,
         ("num_groups", "topk_groups=2", "None")),
    Case(ROUTE, "num_groups_zero", _route(_logits(), 2, num_groups=0, topk_groups=1), ValueError,
         ("num_groups", "divide", "8", "but got 0")),
    Case(ROUTE, "num_groups_negative", _route(_logits(), 2, num_groups=-2, topk_groups=1), ValueError,
         ("num_groups", "divide", "8", "but got -2")),
    Case(ROUTE, "num_groups_not_dividing", _route(_logits(), 2, num_groups=3, topk_groups=1), ValueError,
         ("num_groups", "divide", "8", "but got 3")),
    Case(ROUTE, "num_groups_more_than_experts", _route(_logits(), 2, num_groups=16, topk_groups=1),
         ValueError, ("num_groups", "divide", "8", "but got 16")),
    Case(ROUTE, "groups_too_small_for_top_k", _route(_logits(), 4, num_groups=4, topk_groups=1),
         ValueError, ("topk_groups", "top_k", "4", "1 * 2 = 2")),
    Case(ROUTE, "no_tokens", _route(_logits(T=0), 2), check=_expect((0, 2), torch.int64)),
    Case(ROUTE, "no_tokens_grouped", _route(_logits(T=0), 2, num_groups=4, topk_groups=2,
                                            expert_bias=torch.zeros(8)), check=_expect((0, 2))),
    Case(ROUTE, "meta_logits", _route(_logits().to("meta"), 2, num_groups=2, topk_groups=1),
         check=_expect((T, 2), torch.int64)),
    Case(ROUTE, "bf16_logits_route_in_fp32", lambda: F.route(_logits(dtype=torch.bfloat16), 2)[1],
         check=_expect((T, 2), torch.float32)),
]


def _capacity(ids=None, weights=None, num_experts=E, capacity=2, align=1):
    ids = _ids() if ids is None else ids
    weights = _weights() if weights is None else weights
    return lambda: F.token_sort_with_capacity(ids, weights, num_experts, capacity, align)


CAP = "torch_moe.nn.functional.token_sort_with_capacity"
CAPACITY_CASES = [
    Case(CAP, "expert_id_too_large", _capacity(ids=torch.tensor([[0, 9], [1, 2]]), weights=_weights(2)),
         ValueError, ("topk_ids", "[0, 4)", "[0, 9]")),
    Case(CAP, "expert_id_equal_to_num_experts", _capacity(ids=torch.tensor([[0, 4]]), weights=_weights(1)),
         ValueError, ("topk_ids", "[0, 4)", "[0, 4]")),
    Case(CAP, "negative_expert_id", _capacity(ids=torch.tensor([[-1, 2]]), weights=_weights(1)),
         ValueError, ("topk_ids", "[0, 4)", "[-1, 2]")),
    Case(CAP, "float_ids", _capacity(ids=_ids().float()), TypeError, ("topk_ids", "int64", "float32")),
    Case(CAP, "bool_ids", _capacity(ids=_ids() > 0), TypeError, ("topk_ids", "int64", "bool")),
    Case(CAP, "ids_1d", _capacity(ids=_ids().flatten(), weights=_weights().flatten()), ValueError,
         ("topk_ids", "[T, k]", "(12,)")),
    Case(CAP, "k_greater_than_num_experts",
         _capacity(ids=torch.zeros(T, 5, dtype=torch.int64), weights=torch.rand(T, 5)), ValueError,
         ("top-k", "num_experts", "5", "4")),
    Case(CAP, "weights_shape_mismatch", _capacity(weights=torch.rand(T, 3)), ValueError,
         ("topk_weights", "(6, 2)", "(6, 3)")),
    Case(CAP, "weights_int", _capacity(weights=torch.ones(T, K, dtype=torch.int64)), TypeError,
         ("topk_weights", "float32", "int64")),
    Case(CAP, "weights_complex", _capacity(weights=torch.ones(T, K, dtype=torch.complex64)), TypeError,
         ("topk_weights", "float32", "complex64")),
    Case(CAP, "weights_other_device", _capacity(weights=_weights().to("meta")), ValueError,
         ("topk_weights", "cpu", "meta")),
    Case(CAP, "capacity_float", _capacity(capacity=1.5), TypeError, ("capacity", "int", "1.5")),
    Case(CAP, "capacity_bool", _capacity(capacity=True), TypeError, ("capacity", "int", "True")),
    Case(CAP, "capacity_tensor", _capacity(capacity=torch.tensor(2)), TypeError,
         ("capacity", "int", "Tensor")),
    Case(CAP, "capacity_negative", _capacity(capacity=-1), ValueError, ("capacity", ">= 0", "-1")),
    Case(CAP, "align_zero", _capacity(align=0), ValueError, ("align", ">= 1", "0")),
    Case(CAP, "align_float", _capacity(align=16.0), TypeError, ("align", "int", "16.0")),
    Case(CAP, "num_experts_zero", _capacity(ids=torch.zeros(0, 2, dtype=torch.int64),
                                            weights=torch.zeros(0, 2), num_experts=0),
         ValueError, ("num_experts", "[1, 2147483647]", "but got 0")),
    Case(CAP, "num_experts_absurd", _capacity(num_experts=2**40), ValueError,
         ("num_experts", "[1, 2147483647]", str(2**40))),
    Case(CAP, "slots_overflow_int32_offs", _capacity(num_experts=2**20, align=2**12), ValueError,
         ("align", "2147483647", "int32")),
    Case(CAP, "no_tokens", _capacity(ids=torch.zeros(0, 2, dtype=torch.int64), weights=torch.zeros(0, 2)),
         check=_check_empty_sort(E, 1)),
    Case(CAP, "no_tokens_aligned", _capacity(ids=torch.zeros(0, 2, dtype=torch.int64),
                                             weights=torch.zeros(0, 2), align=16),
         check=_check_empty_sort(E, 16)),
    Case(CAP, "zero_capacity_drops_everything", _capacity(capacity=0), check=_check_all_dropped),
    Case(CAP, "capacity_beyond_int64_is_dropless", _capacity(capacity=2**70),
         check=lambda r: _same_as_dropless(r, F.token_sort_with_capacity(_ids(), _weights(), E, T * K))),
    Case(CAP, "nan_weights_drop_deterministically",
         lambda: F.token_sort_with_capacity(torch.zeros(4, 1, dtype=torch.int64),
                                            torch.tensor([[NAN], [1.0], [NAN], [2.0]]), 2, 2)[0],
         check=lambda s: None if s.tolist() == [0, 2, -1, -1] else (_ for _ in ()).throw(
             AssertionError(f"expected the NaN-weighted assignments kept first, got {s.tolist()}"))),
]

LBL = "torch_moe.nn.functional.load_balancing_loss"
SBL = "torch_moe.nn.functional.sequence_balance_loss"
ZL = "torch_moe.nn.functional.router_z_loss"
_SCORES = torch.rand(T, E, generator=torch.Generator().manual_seed(3))
LOSS_CASES = [
    Case(LBL, "expert_id_out_of_range", lambda: F.load_balancing_loss(_SCORES, torch.full((T, 1), 7), E),
         ValueError, ("topk_ids", "[0, 4)", "[7, 7]")),
    Case(LBL, "negative_expert_id", lambda: F.load_balancing_loss(_SCORES, torch.full((T, 1), -1), E),
         ValueError, ("topk_ids", "[0, 4)", "[-1, -1]")),
    Case(LBL, "float_ids", lambda: F.load_balancing_loss(_SCORES, _ids().float(), E), TypeError,
         ("topk_ids", "int64", "float32")),
    Case(LBL, "scores_1d", lambda: F.load_balancing_loss(_SCORES[0], _ids(), E), ValueError,
         ("scores", "[T, 4]", "(4,)")),
    Case(LBL, "scores_num_experts_mismatch", lambda: F.load_balancing_loss(_SCORES, _ids(), 8),
         ValueError, ("scores", "[T, 8]", "(6, 4)")),
    Case(LBL, "token_count_mismatch", lambda: F.load_balancing_loss(_SCORES, _ids(T=3), E), ValueError,
         ("topk_ids", "[6, k]", "(3, 2)")),
    Case(LBL, "scores_int", lambda: F.load_balancing_loss(_SCORES.long(), _ids(), E), TypeError,
         ("scores", "float32", "int64")),
    Case(LBL, "scores_complex", lambda: F.load_balancing_loss(_SCORES.to(torch.complex64), _ids(), E),
         TypeError, ("scores", "float32", "complex64")),
    Case(LBL, "num_experts_float", lambda: F.load_balancing_loss(_SCORES, _ids(), 4.0), TypeError,
         ("num_experts", "int", "4.0")),
    Case(LBL, "no_tokens", lambda: F.load_balancing_loss(_SCORES[:0], _ids(T=0), E),
         check=_expect((), value=0.0)),
    Case(SBL, "seq_len_zero", lambda: F.sequence_balance_loss(_SCORES, _ids(), E, 0), ValueError,
         ("seq_len", ">= 1", "but got 0")),
    Case(SBL, "seq_len_negative", lambda: F.sequence_balance_loss(_SCORES, _ids(), E, -3), ValueError,
         ("seq_len", ">= 1", "but got -3")),
    Case(SBL, "seq_len_float", lambda: F.sequence_balance_loss(_SCORES, _ids(), E, 3.0), TypeError,
         ("seq_len", "int", "3.0")),
    Case(SBL, "seq_len_not_dividing", lambda: F.sequence_balance_loss(_SCORES, _ids(), E, 4), ValueError,
         ("seq_len", "6", "4")),
    Case(SBL, "expert_id_out_of_range", lambda: F.sequence_balance_loss(_SCORES, _ids() + E, E, 3),
         ValueError, ("topk_ids", "[0, 4)", "[4, 7]")),
    Case(SBL, "scores_num_experts_mismatch", lambda: F.sequence_balance_loss(_SCORES, _ids(), 8, 3),
         ValueError, ("scores", "[T, 8]", "(6, 4)")),
    Case(SBL, "scores_bool", lambda: F.sequence_balance_loss(_SCORES > 0, _ids(), E, 3), TypeError,
         ("scores", "float32", "bool")),
    Case(SBL, "no_tokens", lambda: F.sequence_balance_loss(_SCORES[:0], _ids(T=0), E, 3),
         check=_expect((), value=0.0)),
    Case(ZL, "logits_1d", lambda: F.router_z_loss(torch.randn(4)), ValueError, ("logits", "[T, E]", "(4,)")),
    Case(ZL, "logits_int", lambda: F.router_z_loss(torch.ones(4, 4, dtype=torch.int64)), TypeError,
         ("logits", "float32", "int64")),
    Case(ZL, "logits_complex", lambda: F.router_z_loss(torch.ones(4, 4, dtype=torch.complex64)), TypeError,
         ("logits", "float32", "complex64")),
    Case(ZL, "no_tokens", lambda: F.router_z_loss(torch.zeros(0, 4)),
         check=_expect((), torch.float32, value=0.0)),
    Case(ZL, "no_tokens_bf16", lambda: F.router_z_loss(torch.zeros(0, 4, dtype=torch.bfloat16)),
         check=_expect((), torch.float32, value=0.0)),
]


def _ffn(*, T=T, dtype=torch.float32, D=D, FF=FF, change=None, **kw):
    def call():
        args = list(_ffn_args(T, dtype, D, FF))
        if change is not None:
            change(args)
        return F.moe_ffn(*args, **kw)
    return call


def _set(i, fn):
    def change(args):
        args[i] = fn(args[i])
    return change


FFN = "torch_moe.nn.functional.moe_ffn"
FFN_CASES = [
    Case(FFN, "int_tokens", _ffn(change=_set(0, lambda x: x.long())), RuntimeError,
         ("x", "float32", "int64")),
    Case(FFN, "complex_tokens", _ffn(change=_set(0, lambda x: x.to(torch.complex64))), RuntimeError,
         ("x", "float32", "complex64")),
    Case(FFN, "float_ids", _ffn(change=_set(1, lambda i: i.float())), RuntimeError,
         ("topk_ids", "int64", "float32")),
    Case(FFN, "expert_id_out_of_range", _ffn(change=_set(1, lambda i: i + E)), RuntimeError,
         ("topk_ids", "[0, 4)", "[4, 7]")),
    Case(FFN, "negative_expert_id", _ffn(change=_set(1, lambda i: i - E)), RuntimeError,
         ("topk_ids", "[0, 4)", "[-4, -1]")),
    Case(FFN, "weights_shape_mismatch", _ffn(change=_set(2, lambda w: w[:, :1])), ValueError,
         ("topk_weights", "(6, 2)", "(6, 1)")),
    Case(FFN, "int_weights", _ffn(change=_set(2, lambda w: w.long())), RuntimeError,
         ("topk_weights", "float32", "int64")),
    Case(FFN, "w1_2d", _ffn(change=_set(3, lambda w: w[0])), ValueError, ("w1", "[E, D, F]", "(8, 4)")),
    Case(FFN, "unknown_activation", _ffn(activation="tanh"), ValueError, ("activation", "'tanh'")),
    Case(FFN, "swiglu_oai_limit_zero", _ffn(activation="swiglu_oai", limit=0.0), ValueError,
         ("limit", "> 0", "0.0")),
    Case(FFN, "swiglu_oai_limit_nan", _ffn(activation="swiglu_oai", limit=NAN), ValueError,
         ("limit", "> 0", "nan")),
    Case(FFN, "swiglu_oai_alpha_inf", _ffn(activation="swiglu_oai", alpha=INF), ValueError,
         ("alpha", "finite", "inf")),
    Case(FFN, "unknown_precision", _ffn(precision="fp4"), ValueError, ("precision", "'fp4'")),
    Case(FFN, "unknown_scale_mode", _ffn(precision="mxfp8", scale_mode="up"), ValueError,
         ("scale_mode", "'up'")),
    Case(FFN, "fp8_float64_tokens", _ffn(dtype=torch.float64, precision="fp8_rowwise"), TypeError,
         ("x", "precision='fp8_rowwise'", "float32", "float64")),
    Case(FFN, "mxfp8_model_dim_not_blocked", _ffn(precision="mxfp8"), ValueError,
         ("x.size(1)", "precision='mxfp8'", "32", "8")),
    Case(FFN, "mxfp8_hidden_dim_not_blocked", _ffn(D=32, precision="mxfp8"), ValueError,
         ("w2.size(1)", "precision='mxfp8'", "32", "4")),
    Case(FFN, "no_tokens", _ffn(T=0), check=_expect((0, D), torch.float32)),
    Case(FFN, "no_tokens_fp8", _ffn(T=0, precision="fp8_rowwise"), check=_expect((0, D), torch.float32)),
    Case(FFN, "no_tokens_mxfp8", _ffn(T=0, D=32, FF=32, precision="mxfp8"), check=_expect((0, 32))),
    Case(FFN, "meta_tensors", lambda: F.moe_ffn(*(t.to("meta") for t in _ffn_args())),
         check=_expect((T, D))),
    Case(FFN, "fp8_rowwise_small_groups_are_padded", _ffn(T=3, precision="fp8_rowwise"),
         check=_expect((3, D), torch.float32)),
]

ACT = "torch_moe.nn.functional.activation"
_GATE = torch.randn(T, FF)
ACT_CASES = [
    Case(ACT, "gated_without_up", lambda: F.activation("swiglu", _GATE), ValueError,
         ("up", "'swiglu'", "None")),
    Case(ACT, "up_shape_mismatch", lambda: F.activation("geglu", _GATE, _GATE[:, :1]), ValueError,
         ("up", "(6, 4)", "(6, 1)")),
    Case(ACT, "unknown_kind", lambda: F.activation("tanh", _GATE), ValueError, ("kind", "'tanh'")),
    Case(ACT, "ungated_ignores_up", lambda: F.activation("relu", _GATE, None), check=_expect((T, FF))),
]

CFG = "torch_moe.nn.MoEConfig"
CONFIG_CASES = [
    Case(CFG, "swiglu_limit_zero", lambda: _config(activation="swiglu_oai", swiglu_limit=0.0), ValueError,
         ("swiglu_limit", "> 0", "0.0")),
    Case(CFG, "swiglu_limit_negative", lambda: _config(swiglu_limit=-7.0), ValueError,
         ("swiglu_limit", "> 0", "-7.0")),
    Case(CFG, "swiglu_limit_nan", lambda: _config(swiglu_limit=NAN), ValueError, ("swiglu_limit", "nan")),
    Case(CFG, "swiglu_alpha_inf", lambda: _config(swiglu_alpha=INF), ValueError,
         ("swiglu_alpha", "finite", "inf")),
    Case(CFG, "shared_hidden_dim_zero", lambda: _config(num_shared_experts=1, shared_hidden_dim=0),
         ValueError, ("shared_hidden_dim", ">= 1", "None", "but got 0")),
    Case(CFG, "shared_hidden_dim_negative", lambda: _config(num_shared_experts=1, shared_hidden_dim=-4),
         ValueError, ("shared_hidden_dim", ">= 1", "but got -4")),
    Case(CFG, "shared_hidden_dim_float", lambda: _config(num_shared_experts=1, shared_hidden_dim=4.5),
         TypeError, ("shared_hidden_dim", "int", "4.5")),
    Case(CFG, "dim_float", lambda: _config(dim=8.5), TypeError, ("dim", "int", "8.5")),
    Case(CFG, "hidden_dim_bool", lambda: _config(hidden_dim=True), TypeError, ("hidden_dim", "int", "True")),
    Case(CFG, "num_experts_zero", lambda: _config(num_experts=0, top_k=0), ValueError,
         ("num_experts", "[1, 2147483647]", "but got 0")),
    Case(CFG, "num_experts_beyond_int32_offs", lambda: _config(dim=1, hidden_dim=1, num_experts=2**31),
         ValueError, ("num_experts", "[1, 2147483647]", str(2**31))),
    Case(CFG, "top_k_greater_than_num_experts", lambda: _config(top_k=5), ValueError,
         ("top_k", "num_experts", "5", "4")),
    Case(CFG, "top_k_float", lambda: _config(top_k=2.0), TypeError, ("top_k", "int", "2.0")),
    Case(CFG, "num_shared_experts_float", lambda: _config(num_shared_experts=1.0), TypeError,
         ("num_shared_experts", "int", "1.0")),
    Case(CFG, "num_shared_experts_negative", lambda: _config(num_shared_experts=-1), ValueError,
         ("num_shared_experts", ">= 0", "-1")),
    Case(CFG, "num_expert_groups_float", lambda: _config(num_expert_groups=2.0, topk_groups=1),
         TypeError, ("num_expert_groups", "int", "2.0")),
    Case(CFG, "topk_groups_zero", lambda: _config(num_expert_groups=2, topk_groups=0), ValueError,
         ("topk_groups", "num_expert_groups", "but got 0")),
    Case(CFG, "topk_groups_missing", lambda: _config(num_expert_groups=2), ValueError,
         ("num_expert_groups", "topk_groups")),
    Case(CFG, "route_scale_nan", lambda: _config(route_scale=NAN), ValueError,
         ("route_scale", "finite", "nan")),
    Case(CFG, "route_scale_inf", lambda: _config(route_scale=INF), ValueError,
         ("route_scale", "finite", "inf")),
    Case(CFG, "load_balance_coeff_inf", lambda: _config(load_balance_coeff=INF), ValueError,
         ("load_balance_coeff", "finite", "inf")),
    Case(CFG, "z_loss_coeff_nan", lambda: _config(z_loss_coeff=NAN), ValueError, ("z_loss_coeff", "nan")),
    Case(CFG, "seq_balance_coeff_negative", lambda: _config(seq_balance_coeff=-0.1), ValueError,
         ("seq_balance_coeff", ">= 0", "-0.1")),
    Case(CFG, "bias_update_rate_inf", lambda: _config(bias_update_rate=INF), ValueError,
         ("bias_update_rate", "finite", "inf")),
    Case(CFG, "capacity_factor_inf", lambda: _config(capacity_factor=INF), ValueError,
         ("capacity_factor", "finite", "inf")),
    Case(CFG, "capacity_factor_zero", lambda: _config(capacity_factor=0.0), ValueError,
         ("capacity_factor", "> 0", "0.0")),
    Case(CFG, "unknown_activation", lambda: _config(activation="tanh"), ValueError, ("activation", "'tanh'")),
    Case(CFG, "unknown_precision", lambda: _config(precision="int4"), ValueError, ("precision", "'int4'")),
    Case(CFG, "mxfp8_unblocked_dim", lambda: _config(precision="mxfp8"), ValueError, ("dim", "32", "8")),
    Case(CFG, "expert_weights_overflow_int64",
         lambda: _config(dim=2**40, hidden_dim=2**40, num_experts=2**20),
         ValueError, ("num_experts * dim * hidden_dim", str(2**100))),
    Case(CFG, "shared_weights_overflow_int64",
         lambda: _config(num_shared_experts=2**30, shared_hidden_dim=2**30, dim=2**10), ValueError,
         ("num_shared_experts * shared_hidden_dim * dim", str(2**70))),
    Case(CFG, "shared_hidden_dim_none_is_hidden_dim",
         lambda: SharedExperts(_config(num_shared_experts=2)).w1, check=_expect((D, 2 * FF))),
]

MOE = "torch_moe.nn.MoE"


def _bad_state_dict(fn):
    def call():
        moe = _moe()
        sd = moe.state_dict()
        fn(sd)
        return moe.load_state_dict(sd)
    return call


def _with_aux_loss_scale(scale, load_balance_coeff=0.1):
    moe = _moe(load_balance_coeff=load_balance_coeff)
    moe.aux_loss_scale = scale
    return moe(_ffn_args()[0])


MOE_CASES = [
    Case(MOE, "int_tokens", lambda: _moe()(torch.ones(T, D, dtype=torch.int64)), TypeError,
         ("x", "floating", "int64")),
    Case(MOE, "bool_tokens", lambda: _moe()(torch.ones(T, D, dtype=torch.bool)), TypeError,
         ("x", "floating", "bool")),
    Case(MOE, "complex_tokens", lambda: _moe()(torch.ones(T, D, dtype=torch.complex64)), TypeError,
         ("x", "floating", "complex64")),
    Case(MOE, "wrong_model_dim", lambda: _moe()(torch.randn(T, D + 1)), ValueError,
         ("[T, 8]", "(6, 9)")),
    Case(MOE, "tokens_1d", lambda: _moe()(torch.randn(D)), ValueError, ("[B, L, 8]", "(8,)")),
    Case(MOE, "tokens_4d", lambda: _moe()(torch.randn(1, 2, 3, D)), ValueError,
         ("[B, L, 8]", "(1, 2, 3, 8)")),
    Case(MOE, "nan_tokens", lambda: _moe()(torch.full((T, D), NAN)), RuntimeError, ("logits", "NaN or Inf")),
    Case(MOE, "no_tokens", lambda: _moe()(torch.zeros(0, D)), check=_expect((0, D))),
    Case(MOE, "aux_loss_scale_nan", lambda: _with_aux_loss_scale(NAN), ValueError,
         ("aux_loss_scale", ">= 0 and finite", "nan")),
    Case(MOE, "aux_loss_scale_negative", lambda: _with_aux_loss_scale(-1.0), ValueError,
         ("aux_loss_scale", ">= 0 and finite", "-1.0")),
    Case(MOE, "aux_loss_scale_str", lambda: _with_aux_loss_scale("1024"), TypeError,
         ("aux_loss_scale", "float", "str")),
    Case(MOE, "aux_loss_scale_vector", lambda: _with_aux_loss_scale(torch.ones(2)), ValueError,
         ("aux_loss_scale", "0-dim", "(2,)")),
    Case(MOE, "aux_loss_scale_int_tensor", lambda: _with_aux_loss_scale(torch.tensor(4)), TypeError,
         ("aux_loss_scale", "floating", "int64")),
    Case(MOE, "aux_loss_scale_ignored_without_aux_losses",
         lambda: _with_aux_loss_scale(NAN, load_balance_coeff=0.0), check=_expect((T, D))),
    Case(MOE, "no_tokens_3d_with_aux_losses",
         lambda: _moe(load_balance_coeff=0.1, seq_balance_coeff=0.1, z_loss_coeff=0.1,
                      num_shared_experts=1)(torch.zeros(2, 0, D), return_aux_loss=True)[1],
         check=_expect((), value=0.0)),
    Case(MOE, "no_tokens_with_capacity", lambda: _moe(capacity_factor=1.0)(torch.zeros(0, D)),
         check=_expect((0, D))),
    Case(MOE, "huge_capacity_factor_is_dropless",
         lambda: (_moe(capacity_factor=1e30)(_ffn_args()[0]), _moe()(_ffn_args()[0])),
         check=lambda r: _same_as_dropless(r[:1], r[1:])),
    Case(MOE, "load_complex_state_dict",
         _bad_state_dict(lambda sd: sd.update({"router.weight": sd["router.weight"].to(torch.complex64)})),
         TypeError, ("router.weight", "float32", "complex64")),
    Case(MOE, "load_complex_expert_weights",
         _bad_state_dict(lambda sd: sd.update({"experts.w2": sd["experts.w2"].to(torch.complex128)})),
         TypeError, ("experts.w2", "float32", "complex128")),
    Case(MOE, "load_int_state_dict",
         _bad_state_dict(lambda sd: sd.update({"experts.w1": sd["experts.w1"].to(torch.int8)})),
         TypeError, ("experts.w1", "float32", "int8")),
    Case(MOE, "load_bool_expert_bias",
         lambda: MoE(_config(load_balance_bias=True)).load_state_dict(
             {**MoE(_config(load_balance_bias=True)).state_dict(),
              "router.expert_bias": torch.ones(E, dtype=torch.bool)}),
         TypeError, ("router.expert_bias", "float32", "bool")),
    Case(MOE, "load_wrong_shape",
         _bad_state_dict(lambda sd: sd.update({"experts.w1": torch.zeros(E, D, FF + 1)})),
         RuntimeError, ("experts.w1", "size mismatch", "[4, 8, 5]")),
    Case(MOE, "load_bf16_state_dict_is_cast",
         lambda: _moe().load_state_dict({k: v.bfloat16() for k, v in _moe().state_dict().items()}),
         check=lambda r: None),
]

ROUTER = "torch_moe.nn.TopKRouter"
EXPERTS = "torch_moe.nn.GroupedExperts"
SHARED = "torch_moe.nn.SharedExperts"
MODULE_CASES = [
    Case(ROUTER, "wrong_model_dim", lambda: TopKRouter(_config())(torch.randn(T, D + 1)), ValueError,
         ("x", "[T, 8]", "(6, 9)")),
    Case(ROUTER, "tokens_3d", lambda: TopKRouter(_config())(torch.randn(2, 3, D)), ValueError,
         ("x", "[T, 8]", "(2, 3, 8)")),
    Case(ROUTER, "int_tokens", lambda: TopKRouter(_config())(torch.ones(T, D, dtype=torch.int64)), TypeError,
         ("x", "floating", "int64")),
    Case(ROUTER, "no_tokens", lambda: TopKRouter(_config())(torch.zeros(0, D)), check=_expect((0, K))),
    Case(EXPERTS, "int_tokens",
         lambda: GroupedExperts(_config())(torch.ones(T, D, dtype=torch.int64),
                                           *torch.ops.torch_moe.token_sort(_ids(), E)[:2], _weights()),
         TypeError, ("x", "floating", "int64")),
    Case(EXPERTS, "sorted_ids_int32",
         lambda: GroupedExperts(_config())(torch.randn(T, D), torch.arange(T * K, dtype=torch.int32),
                                           torch.tensor([3, 6, 9, 12], dtype=torch.int32), _weights()),
         RuntimeError, ("sorted_ids", "int64", "int32")),
    Case(EXPERTS, "offs_past_slots",
         lambda: GroupedExperts(_config())(torch.randn(T, D), torch.arange(T * K),
                                           torch.tensor([3, 6, 9, 13], dtype=torch.int32), _weights()),
         RuntimeError, ("offs[-1]", "12", "13")),
    Case(EXPERTS, "no_tokens",
         lambda: GroupedExperts(_config())(torch.zeros(0, D), torch.zeros(0, dtype=torch.int64),
                                           torch.zeros(E, dtype=torch.int32), torch.zeros(0, K)),
         check=_expect((0, D), zero=True)),
    Case(SHARED, "int_tokens",
         lambda: SharedExperts(_config(num_shared_experts=1))(torch.ones(T, D, dtype=torch.int64)),
         TypeError, ("x", "floating", "int64")),
    Case(SHARED, "wrong_model_dim",
         lambda: SharedExperts(_config(num_shared_experts=1))(torch.randn(T, D + 1)),
         ValueError, ("x", "[T, 8]", "(6, 9)")),
    Case(SHARED, "no_tokens", lambda: SharedExperts(_config(num_shared_experts=1))(torch.zeros(0, D)),
         check=_expect((0, D))),
]


def _hf(moe=None, style="mixtral"):
    moe = _moe() if moe is None else moe
    return moe, hf_moe_state_dict(moe, style=style)


def _load_changed(key, fn, style="mixtral", **kw):
    def call():
        moe, sd = _hf(style=style)
        sd[key] = fn(sd[key])
        return load_hf_moe_state_dict(moe, sd, style=style, **kw)
    return call


LOAD = "torch_moe.nn.load_hf_moe_state_dict"
SAVE = "torch_moe.nn.hf_moe_state_dict"
CONVERT_CASES = [
    Case(LOAD, "complex_tensor", _load_changed("gate.weight", lambda t: t.to(torch.complex64)), TypeError,
         ("'gate.weight'", "float32", "complex64")),
    Case(LOAD, "int_tensor", _load_changed("experts.0.w1.weight", lambda t: t.to(torch.int32)), TypeError,
         ("'experts.0.w1.weight'", "float32", "int32")),
    Case(LOAD, "bool_tensor", _load_changed("experts.3.w2.weight", lambda t: t > 0), TypeError,
         ("'experts.3.w2.weight'", "float32", "bool")),
    Case(LOAD, "not_a_tensor", _load_changed("experts.1.w3.weight", lambda t: t.tolist()), TypeError,
         ("'experts.1.w3.weight'", "Tensor", "list")),
    Case(LOAD, "wrong_shape", _load_changed("experts.0.w2.weight", lambda t: t.t()), ValueError,
         ("'experts.0.w2.weight'", "[8, 4]", "[4, 8]")),
    Case(LOAD, "unknown_style", lambda: load_hf_moe_state_dict(_moe(), {}, style="llama"), ValueError,
         ("style", "'mixtral'", "'llama'")),
    Case(LOAD, "prefix_without_dot", lambda: load_hf_moe_state_dict(_moe(), {}, prefix="model"), ValueError,
         ("prefix", "'.'", "'model'")),
    Case(LOAD, "missing_keys", lambda: load_hf_moe_state_dict(_moe(), {"gate.weight": torch.zeros(E, D)},
                                                              strict=True), ValueError,
         ("experts", "4", "none")),
    Case(LOAD, "extra_expert",
         lambda: load_hf_moe_state_dict(_moe(), {**_hf()[1], "experts.4.w1.weight": torch.zeros(FF, D)}),
         ValueError, ("4 experts", "experts.4")),
    Case(LOAD, "ungated_moe", lambda: load_hf_moe_state_dict(_moe(activation="gelu"), {}), ValueError,
         ("activation", "'gelu'")),
    Case(LOAD, "empty_non_strict_is_a_no_op", lambda: load_hf_moe_state_dict(_moe(), {}, strict=False),
         check=lambda r: None),
    Case(LOAD, "bf16_tensors_are_cast", _load_changed("gate.weight", lambda t: t.bfloat16()),
         check=lambda r: None),
    Case(SAVE, "unknown_style", lambda: hf_moe_state_dict(_moe(), style="llama"), ValueError,
         ("style", "'mixtral'", "'llama'")),
    Case(SAVE, "prefix_without_dot", lambda: hf_moe_state_dict(_moe(), prefix="layers.0"), ValueError,
         ("prefix", "'.'", "'layers.0'")),
    Case(SAVE, "shared_experts_for_mixtral", lambda: hf_moe_state_dict(_moe(num_shared_experts=1)),
         ValueError, ("num_shared_experts", "1")),
]

CASES = (ROUTE_CASES + CAPACITY_CASES + LOSS_CASES + FFN_CASES + ACT_CASES + CONFIG_CASES + MOE_CASES
         + MODULE_CASES + CONVERT_CASES)

TestMalformedNN = malformed_tests(CASES, "TestMalformedNN")

if __name__ == "__main__":
    run_tests()
