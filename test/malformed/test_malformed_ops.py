# Owner(s): ["module: moe"]
"""Malformed calls of the ``torch.ops.torch_moe`` operators and of their ``torch_moe.*`` exports
(``token_sort``, ``permute``, ``unpermute``, ``grouped_mm``, ``indexed_grouped_mm``).

Each case either raises an error that names the argument, the value expected and the value
given, or returns a defined result: no rows to read (no tokens, only padding slots) gives zeros,
padding next to NaN and Inf stays exactly zero, and dtypes an op merely copies are copied.
Shapes are tiny; every call answers at once, absurd sizes included.
"""

import torch
from torch.testing._internal.common_utils import run_tests

from _malformed import Case, malformed_tests

import torch_moe

ops = torch.ops.torch_moe
NAN, INF = float("nan"), float("inf")
ERR = RuntimeError

# T tokens, k experts per token, E experts, D model dim, F expert FFN dim
T, K, E, D, F = 4, 2, 3, 5, 3
# assignments t * k + j grouped by expert: expert 0 <- 0, 5, 6; 1 <- 1, 2; 2 <- 3, 4, 7
TOPK_IDS = ((0, 1), (1, 2), (2, 0), (0, 2))
S = T * K


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=_gen(seed)).to(dtype)


def _topk_ids():
    return torch.tensor(TOPK_IDS)


def _routing(align=1):
    """(sorted_ids [S'], offs [E]) of TOPK_IDS."""
    sorted_ids, offs, _ = ops.token_sort(_topk_ids(), E, align)
    return sorted_ids, offs


def _ids(*values):
    return torch.tensor(values, dtype=torch.int64)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _tw(T=T, k=K, dtype=torch.float32):
    return torch.rand(T, k, generator=_gen(1)).to(dtype)


def _expect(shape, dtype=torch.float32, zero=False, finite=False):
    def check(result):
        t = result[0] if isinstance(result, tuple) else result
        assert tuple(t.shape) == tuple(shape), (tuple(t.shape), shape)
        assert t.dtype == dtype, (t.dtype, dtype)
        if zero:
            assert t.device.type == "meta" or bool((t == 0).all()), t
        if finite:
            assert bool(torch.isfinite(t).all()), t

    return check


def _expect_all(*checks):
    """A check for a tuple result: one check per output."""
    def check(result):
        assert len(result) == len(checks), (len(result), len(checks))
        for r, c in zip(result, checks):
            c(r)

    return check


def _equal(expected_fn):
    def check(result):
        expected = expected_fn()
        torch.testing.assert_close(result, expected, atol=0, rtol=0, equal_nan=True)

    return check


def _cases(entry, *specs):
    """Cases of one entry point from (name, call, needles) and (name, call, check=fn) specs."""
    out = []
    for spec in specs:
        name, call, rest = spec[0], spec[1], spec[2]
        if callable(rest):
            out.append(Case(entry, name, call, check=rest))
        else:
            out.append(Case(entry, name, call, ERR, tuple(rest)))
    return out


# ---------------------------------------------------------------------------------------------
# token_sort
# ---------------------------------------------------------------------------------------------


def _token_sort_specs(fn):
    ids = _topk_ids
    return [
        ("ids_1d", lambda: fn(torch.zeros(3, dtype=torch.long), E), ("topk_ids", "2-D", "1-D")),
        ("ids_3d", lambda: fn(torch.zeros(2, 2, 1, dtype=torch.long), E), ("topk_ids", "2-D", "3-D")),
        ("ids_float", lambda: fn(ids().float(), E), ("topk_ids", "int32 or int64", "torch.float32")),
        ("ids_bool", lambda: fn(ids().bool(), E), ("topk_ids", "int32 or int64", "torch.bool")),
        ("ids_complex", lambda: fn(ids().to(torch.complex64), E),
         ("topk_ids", "int32 or int64", "torch.complex64")),
        ("ids_int8", lambda: fn(ids().to(torch.int8), E), ("topk_ids", "int32 or int64", "torch.int8")),
        ("negative_id", lambda: fn(torch.tensor([[0, -1], [1, 2]]), E),
         ("topk_ids", "[0, 3)", "[-1, 2]")),
        ("id_equal_to_num_experts", lambda: fn(torch.tensor([[0, 3], [1, 2]]), E),
         ("topk_ids", "[0, 3)", "[0, 3]")),
        ("huge_id", lambda: fn(torch.tensor([[0, 2**40]]), E), ("topk_ids", "[0, 3)", str(2**40))),
        ("k_greater_than_num_experts", lambda: fn(torch.zeros(2, 4, dtype=torch.long), E),
         ("top-k (4)", "num_experts (3)")),
        ("num_experts_zero", lambda: fn(torch.zeros(2, 0, dtype=torch.long), 0),
         ("num_experts", "[1, 2147483647]", "0")),
        ("num_experts_negative", lambda: fn(ids(), -2), ("num_experts", "[1, 2147483647]", "-2")),
        ("num_experts_absurd", lambda: fn(ids(), 2**40), ("num_experts", "[1, 2147483647]", str(2**40))),
        ("align_zero", lambda: fn(ids(), E, 0), ("align", "[1, 2147483647]", "0")),
        ("align_negative", lambda: fn(ids(), E, -16), ("align", "[1, 2147483647]", "-16")),
        ("align_absurd", lambda: fn(ids(), E, 2**40), ("align", "[1, 2147483647]", str(2**40))),
        ("slots_past_int32", lambda: fn(ids(), 2**20, 2**12),
         ("num_experts * (align - 1)", "2147483647", str(8 + 2**20 * (2**12 - 1)))),
        ("no_tokens", lambda: fn(torch.zeros(0, 2, dtype=torch.long), E),
         _expect_all(_expect((0,), torch.int64), _expect((E,), torch.int32, zero=True),
                     _expect((E,), torch.int64, zero=True))),
        ("no_tokens_aligned", lambda: fn(torch.zeros(0, 2, dtype=torch.long), E, 4),
         _expect_all(_equal(lambda: torch.full((9,), -1)), _expect((E,), torch.int32, zero=True),
                     _expect((E,), torch.int64, zero=True))),
        ("k_zero", lambda: fn(torch.zeros(3, 0, dtype=torch.long), E),
         _expect_all(_expect((0,), torch.int64), _expect((E,), torch.int32, zero=True),
                     _expect((E,), torch.int64, zero=True))),
        ("int32_ids", lambda: fn(ids().int(), E)[0], _equal(lambda: fn(ids(), E)[0])),
        ("noncontiguous_ids", lambda: fn(torch.tensor(TOPK_IDS).t().contiguous().t(), E)[0],
         _equal(lambda: fn(ids(), E)[0])),
        ("same_expert_twice_in_a_row", lambda: fn(torch.tensor([[1, 1], [0, 2]]), E),
         _expect_all(_equal(lambda: _ids(2, 0, 1, 3)), _equal(lambda: _i32(1, 3, 4)),
                     _equal(lambda: _ids(1, 2, 1)))),
        ("meta_ids", lambda: fn(torch.empty(4, 2, dtype=torch.long, device="meta"), E, 4),
         _expect_all(_expect((8 + 9,), torch.int64), _expect((E,), torch.int32),
                     _expect((E,), torch.int64))),
    ]


TOKEN_SORT_CASES = (
    _cases("torch.ops.torch_moe.token_sort", *_token_sort_specs(ops.token_sort))
    + _cases("torch_moe.token_sort", *_token_sort_specs(torch_moe.token_sort))
)


# ---------------------------------------------------------------------------------------------
# permute, permute.out, permute_backward
# ---------------------------------------------------------------------------------------------


def _x(T=T, dtype=torch.float32):
    return _randn(T, D, seed=2, dtype=dtype)


def _permute_specs(fn):
    sid = lambda: _routing()[0]
    pad = lambda: _routing(4)[0]
    return [
        ("x_1d", lambda: fn(torch.randn(T), sid(), K), ("x", "2-D", "1-D")),
        ("x_3d", lambda: fn(torch.randn(T, D, 1), sid(), K), ("x", "2-D", "3-D")),
        ("sorted_ids_int32", lambda: fn(_x(), sid().int(), K), ("sorted_ids", "int64", "torch.int32")),
        ("sorted_ids_float", lambda: fn(_x(), sid().float(), K), ("sorted_ids", "int64", "torch.float32")),
        ("sorted_ids_bool", lambda: fn(_x(), sid().bool(), K), ("sorted_ids", "int64", "torch.bool")),
        ("sorted_ids_2d", lambda: fn(_x(), sid().view(2, 4), K), ("sorted_ids", "1-D", "2-D")),
        ("sorted_ids_past_assignments", lambda: fn(_x(), _ids(0, 1, 8), K),
         ("sorted_ids", "[-1, 8)", "[0, 8]")),
        ("sorted_ids_below_padding", lambda: fn(_x(), _ids(0, -2, 3), K),
         ("sorted_ids", "[-1, 8)", "[-2, 3]")),
        ("duplicate_assignment", lambda: fn(_x(), _ids(0, 3, 3, 1), K),
         ("sorted_ids", "at most once", "assignment 3 appears 2 times")),
        ("top_k_zero", lambda: fn(_x(), sid(), 0), ("top_k", ">= 1", "0")),
        ("top_k_negative", lambda: fn(_x(), sid(), -2), ("top_k", ">= 1", "-2")),
        ("meta_x_cpu_ids", lambda: fn(_x().to("meta"), sid(), K), ("one device", "meta", "cpu")),
        ("no_tokens_only_padding", lambda: fn(torch.randn(0, D), torch.full((5,), -1), K),
         _expect((5, D), zero=True)),
        ("no_slots", lambda: fn(_x(), _ids(), K), _expect((0, D))),
        ("padding_next_to_nan", lambda: fn(_x().index_fill(0, _ids(0), NAN), pad(), K)[pad() < 0],
         _expect(((pad() < 0).sum(), D), zero=True)),
        ("int64_x_is_copied", lambda: fn(torch.arange(T * D).view(T, D), sid(), K),
         _equal(lambda: torch.arange(T * D).view(T, D)[sid() // K])),
        ("bool_x_is_copied", lambda: fn(torch.ones(T, D, dtype=torch.bool), pad(), K),
         _equal(lambda: (pad() >= 0).unsqueeze(1).expand(-1, D).contiguous())),
        ("complex_x_is_copied", lambda: fn(_x().to(torch.complex64), sid(), K),
         _equal(lambda: _x().to(torch.complex64)[sid() // K])),
        ("huge_top_k", lambda: fn(_x(), _ids(0, 5, 7), 2**62), _equal(lambda: _x()[[0, 0, 0]])),
        ("huge_top_k_huge_ids", lambda: fn(_x(), _ids(2**62 + 1, 0, 2**63 - 1), 2**62),
         _equal(lambda: _x()[[1, 0, 1]])),
        ("huge_top_k_duplicate", lambda: fn(_x(), _ids(2**62 + 1, 0, 2**62 + 1), 2**62),
         ("sorted_ids", "at most once", f"assignment {2**62 + 1} appears 2 times")),
        ("meta", lambda: fn(_x().to("meta"), pad().to("meta"), K), _expect((17, D))),
    ]


def _permute_out_specs(fn):
    sid = lambda: _routing()[0]
    return [
        ("out_wrong_rows", lambda: fn(_x(), sid(), K, torch.empty(S - 1, D)),
         ("out", f"({S}, {D})", f"({S - 1}, {D})")),
        ("out_wrong_cols", lambda: fn(_x(), sid(), K, torch.empty(S, D + 1)),
         ("out", f"({S}, {D})", f"({S}, {D + 1})")),
        ("out_wrong_dtype", lambda: fn(_x(), sid(), K, torch.empty(S, D, dtype=torch.float64)),
         ("out", "torch.float32", "torch.float64")),
        ("out_on_meta", lambda: fn(_x(), sid(), K, torch.empty(S, D, device="meta")),
         ("out", "cpu", "meta")),
        ("out_filled_with_nan", lambda: fn(_x(), _routing(4)[0], K, torch.full((17, D), NAN)),
         _expect((17, D), finite=True)),
        ("out_duplicate_assignment", lambda: fn(_x(), _ids(0, 3, 3, 1), K, torch.empty(4, D)),
         ("sorted_ids", "at most once", "assignment 3 appears 2 times")),
    ]


def _export_permute_out(x, sorted_ids, top_k, out):
    return torch_moe.permute(x, sorted_ids, top_k, out=out)


def _op_permute_out(x, sorted_ids, top_k, out):
    ops.permute.out(x, sorted_ids, top_k, out=out)
    return out


def _permute_backward_specs():
    fn = ops.permute_backward
    sid = lambda: _routing()[0]
    return [
        ("grad_1d", lambda: fn(torch.randn(S), sid(), K, T), ("grad", "2-D", "1-D")),
        ("grad_int", lambda: fn(torch.ones(S, D, dtype=torch.long), sid(), K, T),
         ("grad", "float32", "torch.int64")),
        ("grad_complex", lambda: fn(torch.ones(S, D, dtype=torch.complex64), sid(), K, T),
         ("grad", "float32", "torch.complex64")),
        ("grad_rows", lambda: fn(torch.randn(S - 1, D), sid(), K, T),
         ("grad.size(0)", f"sorted_ids.size(0) ({S})", str(S - 1))),
        ("sorted_ids_int32", lambda: fn(torch.randn(S, D), sid().int(), K, T),
         ("sorted_ids", "int64", "torch.int32")),
        ("num_tokens_negative", lambda: fn(torch.randn(S, D), sid(), K, -1),
         ("num_tokens", ">= 0", "-1")),
        ("num_tokens_absurd", lambda: fn(torch.randn(S, D), sid(), K, 2**62),
         ("num_tokens", "addressable", str(2**62))),
        ("num_tokens_too_few", lambda: fn(torch.randn(S, D), sid(), K, T - 1),
         ("sorted_ids", f"[-1, {(T - 1) * K})", f"[0, {S - 1}]")),
        ("top_k_zero", lambda: fn(torch.randn(S, D), sid(), 0, T), ("top_k", ">= 1", "0")),
        ("huge_top_k", lambda: fn(_randn(3, D), _ids(0, 2**62 + 1, 5), 2**62, T),
         _equal(lambda: torch.stack([_randn(3, D)[[0, 2]].sum(0), _randn(3, D)[1],
                                     torch.zeros(D), torch.zeros(D)]))),
        ("duplicate_assignment", lambda: fn(torch.randn(4, D), _ids(0, 3, 3, 1), K, T),
         ("sorted_ids", "at most once", "assignment 3 appears 2 times")),
        ("meta_grad_cpu_ids", lambda: fn(torch.randn(S, D, device="meta"), sid(), K, T),
         ("one device", "meta", "cpu")),
        ("no_slots", lambda: fn(torch.randn(0, D), _ids(), K, T), _expect((T, D), zero=True)),
        ("only_padding", lambda: fn(torch.randn(3, D), _ids(-1, -1, -1), K, T),
         _expect((T, D), zero=True)),
        ("no_tokens", lambda: fn(torch.randn(3, D), _ids(-1, -1, -1), K, 0), _expect((0, D))),
        ("padding_rows_nan", lambda: fn(torch.randn(17, D).masked_fill(
            (_routing(4)[0] < 0).unsqueeze(1), NAN), _routing(4)[0], K, T),
         _expect((T, D), finite=True)),
        ("meta", lambda: fn(torch.randn(S, D, device="meta"), sid().to("meta"), K, T),
         _expect((T, D))),
    ]


PERMUTE_CASES = (
    _cases("torch.ops.torch_moe.permute", *_permute_specs(ops.permute))
    + _cases("torch_moe.permute", *_permute_specs(torch_moe.permute))
    + _cases("torch.ops.torch_moe.permute.out", *_permute_out_specs(_op_permute_out))
    + _cases("torch_moe.permute", *_permute_out_specs(_export_permute_out))
    + _cases("torch.ops.torch_moe.permute_backward", *_permute_backward_specs())
)


# ---------------------------------------------------------------------------------------------
# unpermute, unpermute_backward
# ---------------------------------------------------------------------------------------------


def _y(rows=S, dtype=torch.float32):
    return _randn(rows, D, seed=3, dtype=dtype)


def _unpermute_specs(fn):
    sid = lambda: _routing()[0]
    pad = lambda: _routing(4)[0]
    dropped = lambda: sid().masked_fill(sid() == 5, -1)  # assignment 5 (token 2, slot 1) dropped
    return [
        ("y_1d", lambda: fn(torch.randn(S), sid(), _tw()), ("y", "2-D", "1-D")),
        ("y_int", lambda: fn(torch.ones(S, D, dtype=torch.long), sid(), _tw()),
         ("y", "float32", "torch.int64")),
        ("y_bool", lambda: fn(torch.ones(S, D, dtype=torch.bool), sid(), _tw()),
         ("y", "float32", "torch.bool")),
        ("y_complex", lambda: fn(_y().to(torch.complex64), sid(), _tw()),
         ("y", "float32", "torch.complex64")),
        ("topk_weights_int", lambda: fn(_y(), sid(), torch.ones(T, K, dtype=torch.long)),
         ("topk_weights", "float32", "torch.int64")),
        ("topk_weights_1d", lambda: fn(_y(), sid(), torch.rand(S)), ("topk_weights", "2-D", "1-D")),
        ("y_rows", lambda: fn(_y(S + 1), sid(), _tw()),
         ("y.size(0)", f"sorted_ids.size(0) ({S})", str(S + 1))),
        ("sorted_ids_int32", lambda: fn(_y(), sid().int(), _tw()), ("sorted_ids", "int64", "torch.int32")),
        ("sorted_ids_past_assignments", lambda: fn(_y(3), _ids(0, 1, 8), _tw()),
         ("sorted_ids", "[-1, 8)", "[0, 8]")),
        ("sorted_ids_below_padding", lambda: fn(_y(3), _ids(0, -3, 1), _tw()),
         ("sorted_ids", "[-1, 8)", "[-3, 1]")),
        ("duplicate_assignment", lambda: fn(_y(4), _ids(0, 3, 3, 1), _tw()),
         ("sorted_ids", "at most once", "assignment 3 appears 2 times")),
        ("meta_y_cpu_ids", lambda: fn(_y().to("meta"), sid(), _tw()), ("one device", "meta", "cpu")),
        ("no_slots", lambda: fn(torch.randn(0, D), _ids(), _tw()), _expect((T, D), zero=True)),
        ("only_padding", lambda: fn(_y(3), _ids(-1, -1, -1), _tw()), _expect((T, D), zero=True)),
        ("no_tokens", lambda: fn(_y(3), _ids(-1, -1, -1), torch.rand(0, K)), _expect((0, D))),
        ("padding_rows_nan", lambda: fn(torch.randn(17, D).masked_fill(
            (pad() < 0).unsqueeze(1), NAN), pad(), _tw()), _expect((T, D), finite=True)),
        ("dropped_assignment_nan_weight_and_row", lambda: fn(
            _y().index_fill(0, _ids(int((sid() == 5).nonzero())), INF), dropped(),
            _tw().index_put((_ids(2), _ids(1)), torch.tensor(NAN))), _expect((T, D), finite=True)),
        ("bf16_y_fp32_weights", lambda: fn(_y(dtype=torch.bfloat16), sid(), _tw()),
         _expect((T, D), torch.bfloat16)),
        ("meta", lambda: fn(_y().to("meta"), sid().to("meta"), _tw().to("meta")), _expect((T, D))),
    ]


def _unpermute_backward_specs():
    fn = ops.unpermute_backward
    sid = lambda: _routing()[0]
    both = [True, True]
    return [
        ("grad_cols", lambda: fn(torch.randn(T, D + 1), _y(), sid(), _tw(), both),
         ("grad.size(1)", f"y.size(1) ({D})", str(D + 1))),
        ("grad_rows", lambda: fn(torch.randn(T + 1, D), _y(), sid(), _tw(), both),
         ("grad.size(0)", f"topk_weights.size(0) ({T})", str(T + 1))),
        ("grad_dtype", lambda: fn(torch.randn(T, D, dtype=torch.float64), _y(), sid(), _tw(), both),
         ("grad", "torch.float32", "torch.float64")),
        ("y_rows", lambda: fn(torch.randn(T, D), _y(S - 1), sid(), _tw(), both),
         ("y.size(0)", f"sorted_ids.size(0) ({S})", str(S - 1))),
        ("y_int", lambda: fn(torch.ones(T, D, dtype=torch.long), torch.ones(S, D, dtype=torch.long),
                             sid(), _tw(), both), ("y", "float32", "torch.int64")),
        ("mask_length", lambda: fn(torch.randn(T, D), _y(), sid(), _tw(), [True]),
         ("output_mask", "length 2", "length 1")),
        ("duplicate_assignment", lambda: fn(torch.randn(T, D), _y(4), _ids(0, 3, 3, 1), _tw(), both),
         ("sorted_ids", "at most once", "assignment 3 appears 2 times")),
        ("sorted_ids_past_assignments", lambda: fn(torch.randn(T, D), _y(3), _ids(0, 1, 8), _tw(),
                                                   both), ("sorted_ids", "[-1, 8)", "[0, 8]")),
        ("meta_grad", lambda: fn(torch.randn(T, D, device="meta"), _y(), sid(), _tw(), both),
         ("one device", "cpu", "meta")),
        ("no_slots", lambda: fn(torch.randn(T, D), torch.randn(0, D), _ids(), _tw(), both),
         _expect_all(_expect((0, D)), _expect((T, K), zero=True))),
        ("no_tokens", lambda: fn(torch.randn(0, D), _y(3), _ids(-1, -1, -1), torch.rand(0, K), both),
         _expect_all(_expect((3, D), zero=True), _expect((0, K)))),
        ("nothing_requested", lambda: fn(torch.randn(T, D), _y(), sid(), _tw(), [False, False]),
         _expect_all(_expect((0,)), _expect((0,)))),
        ("meta", lambda: fn(torch.randn(T, D, device="meta"), _y().to("meta"), sid().to("meta"),
                            _tw().to("meta"), both),
         _expect_all(_expect((S, D)), _expect((T, K)))),
    ]


UNPERMUTE_CASES = (
    _cases("torch.ops.torch_moe.unpermute", *_unpermute_specs(ops.unpermute))
    + _cases("torch_moe.unpermute", *_unpermute_specs(torch_moe.unpermute))
    + _cases("torch.ops.torch_moe.unpermute_backward", *_unpermute_backward_specs())
)


# ---------------------------------------------------------------------------------------------
# grouped_mm
# ---------------------------------------------------------------------------------------------


def _grouped_mm_specs(fn):
    a, b = lambda: _randn(8, 4, seed=4), lambda: _randn(2, 4, 3, seed=5)
    offs = lambda: _i32(3, 8)
    return [
        ("3d_x_3d", lambda: fn(torch.randn(2, 8, 4), b(), offs()), ("self", "2-D x 3-D", "3-D x 3-D")),
        ("1d_self", lambda: fn(torch.randn(4), b(), offs()), ("self", "2-D x 3-D", "1-D x 3-D")),
        ("int_self", lambda: fn(a().long(), b().long(), offs()), ("self", "float32", "torch.int64")),
        ("bool_self", lambda: fn(a().bool(), b().bool(), offs()), ("self", "float32", "torch.bool")),
        ("complex_self", lambda: fn(a().to(torch.complex64), b().to(torch.complex64), offs()),
         ("self", "float32", "torch.complex64")),
        ("mixed_dtypes", lambda: fn(a(), b().double(), offs()),
         ("mat2", "torch.float32", "torch.float64")),
        ("offs_int64", lambda: fn(a(), b(), offs().long()), ("offs", "int32", "torch.int64")),
        ("offs_float", lambda: fn(a(), b(), offs().float()), ("offs", "int32", "torch.float32")),
        ("offs_2d", lambda: fn(a(), b(), offs().view(1, 2)), ("offs", "1-D", "2-D")),
        ("offs_count", lambda: fn(a(), b(), _i32(2, 5, 8)),
         ("offs.size(0)", "mat2.size(0) (2)", "3")),
        ("offs_decreasing", lambda: fn(a(), b(), _i32(5, 3)), ("offs", "non-decreasing", "offs[1] = 3")),
        ("offs_negative", lambda: fn(a(), b(), _i32(-1, 8)), ("offs", "non-negative", "-1")),
        ("offs_past_rows", lambda: fn(a(), b(), _i32(3, 9)), ("offs[-1]", "self.size(0) (8)", "9")),
        ("offs_past_columns_3d_x_2d", lambda: fn(torch.randn(2, 8, 4), torch.randn(4, 6), _i32(3, 7)),
         ("offs[-1]", "mat2.size(1) (6)", "7")),
        ("offs_past_contraction_2d_x_2d", lambda: fn(torch.randn(3, 8), torch.randn(8, 2), _i32(3, 9)),
         ("offs[-1]", "self.size(1) (8)", "9")),
        ("contraction_mismatch", lambda: fn(a(), torch.randn(2, 5, 3), offs()),
         ("self.size(-1) is 4", "mat2.size(-2) is 5")),
        ("meta_mat2", lambda: fn(a(), b().to("meta"), offs()), ("one device", "cpu", "meta")),
        ("meta_offs", lambda: fn(a(), b(), offs().to("meta")), ("one device", "cpu", "meta")),
        ("no_rows", lambda: fn(torch.randn(0, 4), b(), _i32(0, 0)), _expect((0, 3))),
        ("all_groups_empty", lambda: fn(a(), b(), _i32(0, 0)), _expect((8, 3), zero=True)),
        ("no_groups_2d_x_2d", lambda: fn(torch.randn(3, 8), torch.randn(8, 2), _i32()),
         _expect((0, 3, 2))),
        ("empty_contraction_2d_x_2d", lambda: fn(torch.randn(3, 0), torch.randn(0, 2), _i32(0, 0)),
         _expect((2, 3, 2), zero=True)),
        ("rows_past_last_group_nan", lambda: fn(a().index_fill(0, _ids(7), NAN), b(), _i32(3, 7))[7],
         _expect((3,), zero=True)),
        ("meta", lambda: fn(a().to("meta"), b().to("meta"), offs().to("meta")), _expect((8, 3))),
    ]


GROUPED_MM_CASES = (
    _cases("torch.ops.torch_moe.grouped_mm", *_grouped_mm_specs(ops.grouped_mm))
    + _cases("torch_moe.grouped_mm", *_grouped_mm_specs(torch_moe.grouped_mm))
)


# ---------------------------------------------------------------------------------------------
# indexed_grouped_mm, indexed_grouped_mm_backward
# ---------------------------------------------------------------------------------------------

# S = 6 slots in E = 2 groups; gather rows of a [4, 4] input, scatter into 5 output rows
I_OFFS = (3, 6)
GATHER = (0, 3, -1, 1, 2, -1)
SCATTER = (1, 0, -1, 4, 2, 3)


def _w(E=2, K_=4, N=3, seed=6, dtype=torch.float32):
    return _randn(E, K_, N, seed=seed, dtype=dtype)


def _indexed_specs(fn):
    inp, w, offs = lambda: _randn(4, 4, seed=7), _w, lambda: _i32(*I_OFFS)
    gi, si = lambda: _ids(*GATHER), lambda: _ids(*SCATTER)
    sw = lambda: torch.rand(6, generator=_gen(8))
    return [
        ("input_1d", lambda: fn(torch.randn(4), w(), offs()), ("input", "2-D", "1-D")),
        ("weight_2d", lambda: fn(inp(), torch.randn(4, 3), offs()), ("weight", "3-D", "2-D")),
        ("input_int", lambda: fn(inp().long(), w().long(), offs()), ("input", "float32", "torch.int64")),
        ("input_complex", lambda: fn(inp().to(torch.complex64), w().to(torch.complex64), offs()),
         ("input", "float32", "torch.complex64")),
        ("mixed_dtypes", lambda: fn(inp(), w(dtype=torch.bfloat16), offs()),
         ("weight", "torch.float32", "torch.bfloat16")),
        ("offs_int64", lambda: fn(inp(), w(), offs().long()), ("offs", "int32", "torch.int64")),
        ("offs_count", lambda: fn(inp(), w(), _i32(1, 2, 4)),
         ("offs.size(0)", "weight.size(0) (2)", "3")),
        ("weight_rows", lambda: fn(inp(), w(K_=5), offs()), ("weight.size(1)", "input.size(1) (4)", "5")),
        ("gather_int32", lambda: fn(inp(), w(), offs(), gi().int()), ("gather_index", "int64", "torch.int32")),
        ("gather_float", lambda: fn(inp(), w(), offs(), gi().float()),
         ("gather_index", "int64", "torch.float32")),
        ("gather_2d", lambda: fn(inp(), w(), offs(), gi().view(2, 3)), ("gather_index", "1-D", "2-D")),
        ("gather_past_rows", lambda: fn(inp(), w(), offs(), _ids(0, 1, 4, 2, 3, 0)),
         ("gather_index", "[-1, 4)", "[0, 4]")),
        ("gather_below_padding", lambda: fn(inp(), w(), offs(), _ids(0, 1, -5, 2, 3, 0)),
         ("gather_index", "[-1, 4)", "[-5, 3]")),
        ("offs_past_slots", lambda: fn(inp(), w(), _i32(3, 7), gi()),
         ("offs[-1]", "the number of sorted slots (6)", "7")),
        ("offs_decreasing", lambda: fn(inp(), w(), _i32(4, 2), gi()),
         ("offs", "non-decreasing", "offs[1] = 2")),
        ("scatter_without_num_out_rows", lambda: fn(inp(), w(), offs(), gi(), si()),
         ("num_out_rows", ">= 0", "-1")),
        ("num_out_rows_without_scatter", lambda: fn(inp(), w(), offs(), gi(), None, None, 5),
         ("num_out_rows", "(5)", "scatter_index")),
        ("num_out_rows_absurd", lambda: fn(inp(), w(), offs(), gi(), si(), None, 2**62),
         ("num_out_rows", "addressable", str(2**62))),
        ("scatter_past_rows", lambda: fn(inp(), w(), offs(), gi(), si(), None, 4),
         ("scatter_index", "[-1, 4)", "[-1, 4]")),
        ("scatter_int32", lambda: fn(inp(), w(), offs(), gi(), si().int(), None, 5),
         ("scatter_index", "int64", "torch.int32")),
        ("scatter_length", lambda: fn(inp(), w(), offs(), gi(), si()[:5], None, 5),
         ("scatter_index.size(0)", "the number of sorted slots (6)", "5")),
        ("scatter_weight_int", lambda: fn(inp(), w(), offs(), gi(), si(), torch.ones(6, dtype=torch.long), 5),
         ("scatter_weight", "float32", "torch.int64")),
        ("scatter_weight_length", lambda: fn(inp(), w(), offs(), gi(), si(), sw()[:4], 5),
         ("scatter_weight.size(0)", "the number of sorted slots (6)", "4")),
        ("scatter_weight_2d", lambda: fn(inp(), w(), offs(), gi(), si(), sw().view(2, 3), 5),
         ("scatter_weight", "1-D", "2-D")),
        ("meta_weight", lambda: fn(inp(), w().to("meta"), offs()), ("one device", "cpu", "meta")),
        ("meta_gather", lambda: fn(inp(), w(), offs(), gi().to("meta")), ("one device", "cpu", "meta")),
        ("no_input_rows_only_padding", lambda: fn(torch.randn(0, 4), w(), offs(), torch.full((6,), -1)),
         _expect((6, 3), zero=True)),
        ("no_output_rows_only_padding", lambda: fn(inp(), w(), offs(), gi(), torch.full((6,), -1),
                                                   sw(), 0), _expect((0, 3))),
        ("nothing_at_all", lambda: fn(torch.randn(0, 4), w(), _i32(0, 0)), _expect((0, 3))),
        ("padding_next_to_nan", lambda: fn(inp().index_fill(0, _ids(0), NAN), w(), _i32(0, 6),
                                           _ids(1, -1, 2, -1, 3, -1)),
         _expect((6, 3), finite=True)),
        ("padded_group_weight_inf", lambda: fn(inp(), w().index_fill(0, _ids(1), INF), offs(),
                                               _ids(0, 1, 2, -1, -1, -1)),
         _equal(lambda: torch.cat([inp()[:3] @ w()[0], torch.zeros(3, 3)]))),
        ("dropped_slots_nan_scale", lambda: fn(inp(), w(), offs(), gi(), si(),
                                               sw().masked_fill(_ids(*SCATTER) < 0, NAN), 5),
         _expect((5, 3), finite=True)),
        ("meta", lambda: fn(inp().to("meta"), w().to("meta"), offs().to("meta"), gi().to("meta"),
                            si().to("meta"), sw().to("meta"), 5), _expect((5, 3))),
    ]


def _indexed_backward_specs():
    fn = ops.indexed_grouped_mm_backward
    inp, w, offs = lambda: _randn(4, 4, seed=7), _w, lambda: _i32(*I_OFFS)
    gi, si = lambda: _ids(*GATHER), lambda: _ids(*SCATTER)
    sw = lambda: torch.rand(6, generator=_gen(8))
    grad_out = lambda rows=5, N=3: _randn(rows, N, seed=9)
    all3 = [True, True, True]
    return [
        ("grad_cols", lambda: fn(grad_out(N=4), inp(), w(), offs(), gi(), si(), sw(), all3),
         ("grad.size(1)", "weight.size(2) (3)", "4")),
        ("grad_rows_unscattered", lambda: fn(grad_out(rows=5), inp(), w(), offs(), gi(), None, None,
                                             all3), ("grad.size(0)", "sorted slots (6)", "5")),
        ("grad_dtype", lambda: fn(grad_out().double(), inp(), w(), offs(), gi(), si(), sw(), all3),
         ("grad", "torch.float32", "torch.float64")),
        ("grad_1d", lambda: fn(torch.randn(5), inp(), w(), offs(), gi(), si(), sw(), all3),
         ("grad", "2-D", "1-D")),
        ("weight_rows", lambda: fn(grad_out(), inp(), w(K_=3), offs(), gi(), si(), sw(), all3),
         ("weight.size(1)", "input.size(1) (4)", "3")),
        ("weight_groups", lambda: fn(grad_out(), inp(), w(E=3), offs(), gi(), si(), sw(), all3),
         ("offs.size(0)", "weight.size(0) (3)", "2")),
        ("mask_length", lambda: fn(grad_out(), inp(), w(), offs(), gi(), si(), sw(), [True, True]),
         ("output_mask", "length 3", "length 2")),
        ("scatter_past_grad_rows", lambda: fn(grad_out(rows=4), inp(), w(), offs(), gi(), si(), sw(),
                                              all3), ("scatter_index", "[-1, 4)", "[-1, 4]")),
        ("gather_past_rows", lambda: fn(grad_out(), inp()[:3], w(), offs(), gi(), si(), sw(), all3),
         ("gather_index", "[-1, 3)", "[-1, 3]")),
        ("meta_grad", lambda: fn(grad_out().to("meta"), inp(), w(), offs(), gi(), si(), sw(), all3),
         ("one device", "cpu", "meta")),
        ("only_padding_no_rows", lambda: fn(torch.randn(0, 3), torch.randn(0, 4), w(), offs(),
                                            torch.full((6,), -1), torch.full((6,), -1), sw(), all3),
         _expect_all(_expect((0, 4)), _expect((2, 4, 3), zero=True), _expect((6,), zero=True))),
        ("nothing_requested", lambda: fn(grad_out(), inp(), w(), offs(), gi(), si(), sw(),
                                         [False, False, False]),
         _expect_all(_expect((0,)), _expect((0,)), _expect((0,)))),
        ("grad_nan_on_unreached_row", lambda: fn(grad_out().index_fill(0, _ids(0), NAN), inp(), w(),
                                                 offs(), gi(), _ids(1, 2, -1, 4, 2, 3), sw(), all3),
         _expect_all(_expect((4, 4), finite=True), _expect((2, 4, 3), finite=True),
                     _expect((6,), finite=True))),
        ("meta", lambda: fn(grad_out().to("meta"), inp().to("meta"), w().to("meta"),
                            offs().to("meta"), gi().to("meta"), si().to("meta"), sw().to("meta"),
                            all3),
         _expect_all(_expect((4, 4)), _expect((2, 4, 3)), _expect((6,)))),
    ]


INDEXED_CASES = (
    _cases("torch.ops.torch_moe.indexed_grouped_mm", *_indexed_specs(ops.indexed_grouped_mm))
    + _cases("torch_moe.indexed_grouped_mm", *_indexed_specs(torch_moe.indexed_grouped_mm))
    + _cases("torch.ops.torch_moe.indexed_grouped_mm_backward", *_indexed_backward_specs())
)


# ---------------------------------------------------------------------------------------------
# grouped_ffn, grouped_ffn_backward
# ---------------------------------------------------------------------------------------------


def _ffn_weights(dtype=torch.float32, fused=True):
    w1 = _randn(E, D, 2 * F if fused else F, seed=10, dtype=dtype)
    w2 = _randn(E, F, D, seed=11, dtype=dtype)
    w3 = None if fused else _randn(E, D, F, seed=12, dtype=dtype)
    return w1, w2, w3


def _ffn(x=None, sorted_ids=None, offs=None, tw=None, w1=None, w2=None, w3=None, fused=True,
         activation="swiglu"):
    """grouped_ffn's arguments, the defaults replaced by the given ones."""
    sid, offs_ = _routing()
    dw1, dw2, dw3 = _ffn_weights(fused=fused)
    return (
        _x() if x is None else x,
        sid if sorted_ids is None else sorted_ids,
        offs_ if offs is None else offs,
        _tw() if tw is None else tw,
        dw1 if w1 is None else w1,
        dw2 if w2 is None else w2,
        dw3 if w3 is None else w3,
        activation,
    )


def _grouped_ffn_specs():
    fn = lambda *a: ops.grouped_ffn(*a)
    w1, w2, w3 = _ffn_weights(fused=False)
    pad_sid, pad_offs = _routing(4)
    return [
        ("unknown_activation", lambda: fn(*_ffn(activation="silu")),
         ("activation", "'swiglu'", "'silu'")),
        ("x_1d", lambda: fn(*_ffn(x=torch.randn(D))), ("x", "2-D", "1-D")),
        ("x_int", lambda: fn(*_ffn(x=_x().long())), ("x", "float32", "torch.int64")),
        ("x_complex", lambda: fn(*_ffn(x=_x().to(torch.complex64))), ("x", "float32", "torch.complex64")),
        ("topk_weights_int", lambda: fn(*_ffn(tw=torch.ones(T, K, dtype=torch.long))),
         ("topk_weights", "float32", "torch.int64")),
        ("topk_weights_rows", lambda: fn(*_ffn(tw=_tw(T + 1))),
         ("topk_weights.size(0)", "x.size(0) (4)", "5")),
        ("weights_dtype", lambda: fn(*_ffn(w1=_ffn_weights(torch.float64)[0])),
         ("w1", "torch.float32", "torch.float64")),
        ("w1_2d", lambda: fn(*_ffn(w1=torch.randn(D, 2 * F))), ("w1", "3-D", "2-D")),
        ("w1_model_dim", lambda: fn(*_ffn(w1=torch.randn(E, D + 1, 2 * F))),
         ("w1.size(1)", "x.size(1) (5)", "6")),
        ("fused_width", lambda: fn(*_ffn(w1=torch.randn(E, D, F))),
         ("w1.size(2)", "2 * w2.size(1)", "(6)", "3")),
        ("w2_experts", lambda: fn(*_ffn(w2=torch.randn(E + 1, F, D))),
         ("w2.size(0)", "w1.size(0) (3)", "4")),
        ("w2_model_dim", lambda: fn(*_ffn(w2=torch.randn(E, F, D - 1))),
         ("w2.size(2)", "x.size(1) (5)", "4")),
        ("w3_for_relu", lambda: fn(*_ffn(w1=w1, w2=w2, w3=w3, activation="relu")),
         ("w3", "gated", "'relu'")),
        ("w3_shape", lambda: fn(*_ffn(w1=w1, w2=w2, w3=torch.randn(E, D, F + 1))),
         ("w3", f"{(E, D, F)}", f"{(E, D, F + 1)}")),
        ("sorted_ids_int32", lambda: fn(*_ffn(sorted_ids=_routing()[0].int())),
         ("sorted_ids", "int64", "torch.int32")),
        ("offs_int64", lambda: fn(*_ffn(offs=_routing()[1].long())), ("offs", "int32", "torch.int64")),
        ("offs_count", lambda: fn(*_ffn(offs=_i32(2, 8))), ("offs.size(0)", "w1.size(0) (3)", "2")),
        ("offs_past_slots", lambda: fn(*_ffn(offs=_i32(3, 5, 9))),
         ("offs[-1]", "sorted_ids.size(0) (8)", "9")),
        ("offs_decreasing", lambda: fn(*_ffn(offs=_i32(3, 2, 8))),
         ("offs", "non-decreasing", "offs[1] = 2")),
        ("sorted_ids_past_assignments", lambda: fn(*_ffn(sorted_ids=_ids(0, 5, 6, 1, 2, 3, 4, 8))),
         ("sorted_ids", "[-1, 8)", "[0, 8]")),
        ("sorted_ids_below_padding", lambda: fn(*_ffn(sorted_ids=_ids(0, 5, 6, 1, 2, 3, 4, -4))),
         ("sorted_ids", "[-1, 8)", "[-4, 6]")),
        ("duplicate_assignment", lambda: fn(*_ffn(sorted_ids=_ids(0, 5, 5, 1, 2, 3, 4, 7))),
         ("sorted_ids", "at most once", "assignment 5 appears 2 times")),
        ("meta_w2", lambda: fn(*_ffn(w2=_ffn_weights()[1].to("meta"))), ("one device", "cpu", "meta")),
        ("no_tokens_only_padding", lambda: fn(*_ffn(x=torch.randn(0, D), tw=torch.rand(0, K),
                                                    sorted_ids=torch.full((6,), -1),
                                                    offs=_i32(2, 4, 6))),
         _expect_all(_expect((0, D)), _expect((6, 2 * F), zero=True))),
        ("no_slots", lambda: fn(*_ffn(sorted_ids=_ids(), offs=_i32(0, 0, 0))),
         _expect_all(_expect((T, D), zero=True), _expect((0, 2 * F)))),
        ("all_dropped", lambda: fn(*_ffn(sorted_ids=torch.full((S,), -1))),
         _expect_all(_expect((T, D), zero=True), _expect((S, 2 * F), zero=True))),
        ("padding_next_to_nan", lambda: fn(*_ffn(x=_x().index_fill(0, _ids(3), NAN), tw=_tw(),
                                                 sorted_ids=pad_sid.masked_fill(pad_sid // K == 3, -1),
                                                 offs=pad_offs)),
         _expect_all(_expect((T, D)), _expect((17, 2 * F), finite=True))),
        ("meta", lambda: fn(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in _ffn()]),
         _expect_all(_expect((T, D)), _expect((S, 2 * F)))),
    ]


def _ffn_backward(grad=None, hidden=None, mask=(True,) * 8, **kw):
    args = _ffn(**kw)
    x, sid, offs, tw, w1, w2, w3, act = args
    if hidden is None:
        _, hidden = ops.grouped_ffn(*_ffn(x=x, sorted_ids=sid, offs=offs, tw=tw,
                                          fused=w3 is None, activation=act))
    grad = torch.randn_like(x) if grad is None else grad
    return (grad, x, sid, offs, tw, w1, w2, w3, hidden, act, 1.702, 7.0, list(mask))


def _grouped_ffn_backward_specs():
    fn = lambda *a: ops.grouped_ffn_backward(*a)
    return [
        ("grad_shape", lambda: fn(*_ffn_backward(grad=torch.randn(T - 1, D))),
         ("grad", f"{(T, D)}", f"{(T - 1, D)}")),
        ("grad_dtype", lambda: fn(*_ffn_backward(grad=torch.randn(T, D, dtype=torch.float64))),
         ("grad", "torch.float32", "torch.float64")),
        ("grad_int", lambda: fn(*_ffn_backward(grad=torch.ones(T, D, dtype=torch.long))),
         ("grad", "torch.float32", "torch.int64")),
        ("hidden_width", lambda: fn(*_ffn_backward(hidden=torch.randn(S, F))),
         ("hidden.size(1)", f"({2 * F})", str(F))),
        ("hidden_rows", lambda: fn(*_ffn_backward(hidden=torch.randn(S - 1, 2 * F))),
         ("hidden.size(0)", f"sorted_ids.size(0) ({S})", str(S - 1))),
        ("hidden_1d", lambda: fn(*_ffn_backward(hidden=torch.randn(S))), ("hidden", "2-D", "1-D")),
        ("w2_ffn_dim", lambda: fn(*_ffn_backward(w2=torch.randn(E, F - 1, D))),
         ("w1.size(2)", f"2 * w2.size(1) for a fused gate/up weight ({2 * (F - 1)})", str(2 * F))),
        ("w2_model_dim", lambda: fn(*_ffn_backward(w2=torch.randn(E, F, D + 1))),
         ("w2.size(2)", f"x.size(1) ({D})", str(D + 1))),
        ("w1_experts", lambda: fn(*_ffn_backward(w1=torch.randn(E - 1, D, 2 * F))),
         ("offs.size(0)", f"w1.size(0) ({E - 1})", str(E))),
        ("w1_dtype", lambda: fn(*_ffn_backward(w1=torch.randn(E, D, 2 * F, dtype=torch.float64))),
         ("w1", "torch.float32", "torch.float64")),
        ("mask_length", lambda: fn(*_ffn_backward(mask=(True,) * 5)),
         ("output_mask", "length 8", "length 5")),
        ("unknown_activation", lambda: fn(*_ffn_backward()[:9], "silu", 1.702, 7.0, [True] * 8),
         ("activation", "'swiglu'", "'silu'")),
        ("duplicate_assignment", lambda: fn(*_ffn_backward(sorted_ids=_ids(0, 5, 5, 1, 2, 3, 4, 7))),
         ("sorted_ids", "at most once", "assignment 5 appears 2 times")),
        ("sorted_ids_past_assignments", lambda: fn(*_ffn_backward(
            hidden=torch.randn(S, 2 * F), sorted_ids=_ids(0, 5, 6, 1, 2, 3, 4, 8))),
         ("sorted_ids", "[-1, 8)", "[0, 8]")),
        ("meta_grad", lambda: fn(*_ffn_backward(grad=torch.randn(T, D, device="meta"))),
         ("one device", "cpu", "meta")),
        ("no_tokens_only_padding", lambda: fn(*_ffn_backward(
            x=torch.randn(0, D), tw=torch.rand(0, K), sorted_ids=torch.full((6,), -1),
            offs=_i32(2, 4, 6))),
         _expect_all(_expect((0, D)), _expect((0, K)), _expect((E, D, 2 * F), zero=True),
                     _expect((E, F, D), zero=True), *[_expect((0,))] * 4)),
        ("nothing_requested", lambda: fn(*_ffn_backward(mask=(False,) * 8)),
         _expect_all(*[_expect((0,))] * 8)),
        ("frozen_experts", lambda: fn(*_ffn_backward(mask=(True, True) + (False,) * 6)),
         _expect_all(_expect((T, D), finite=True), _expect((T, K), finite=True),
                     *[_expect((0,))] * 6)),
        ("grad_nan_on_dropped_token", lambda: fn(*_ffn_backward(
            grad=torch.randn(T, D).index_fill(0, _ids(3), NAN),
            sorted_ids=_routing()[0].masked_fill(_routing()[0] // K == 3, -1))),
         _expect_all(_expect((T, D), finite=True), _expect((T, K), finite=True),
                     _expect((E, D, 2 * F), finite=True), _expect((E, F, D), finite=True),
                     *[_expect((0,))] * 4)),
    ]


FFN_CASES = (
    _cases("torch.ops.torch_moe.grouped_ffn", *_grouped_ffn_specs())
    + _cases("torch.ops.torch_moe.grouped_ffn_backward", *_grouped_ffn_backward_specs())
)

CASES = TOKEN_SORT_CASES + PERMUTE_CASES + UNPERMUTE_CASES + GROUPED_MM_CASES + INDEXED_CASES + FFN_CASES

TestMalformedOps = malformed_tests(CASES, "TestMalformedOps")

if __name__ == "__main__":
    run_tests()
