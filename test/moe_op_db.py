"""OpInfo entries for the torch_moe ops (the counterpart of ``custom_op_db.py`` upstream).

Every sample is small enough for fp64 ``gradcheck`` and for the loop references of
``torch_moe._refs``. The samples cover: empty experts, all tokens on one expert, ``T = 0``,
``E = 1``, ``k = E``, alignment padding, and non-contiguous inputs (strided tokens, transposed
weights).
"""

import functools

import torch
from torch.testing._internal.common_dtype import floating_types_and
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import torch_moe
from torch_moe import _refs

ops = torch.ops.torch_moe

# (T, D, F, E, k, routing): routing "random" (distinct experts per token), "one" (every token
# on expert 0 first), "skip" (experts 1 and 3 unused)
ROUTING_CASES = [
    (7, 5, 3, 4, 2, "random"),
    (6, 4, 3, 3, 1, "one"),
    (5, 3, 2, 5, 2, "skip"),
    (4, 3, 2, 1, 1, "random"),  # E = 1
    (3, 4, 2, 3, 3, "random"),  # k = E
    (0, 4, 3, 3, 2, "random"),  # T = 0
]


def make_topk_ids(T, E, k, routing, device, generator=None):
    if routing == "one":
        scores = torch.rand(T, E, generator=generator)
        scores[:, 0] = 2.0
    elif routing == "skip":
        scores = torch.rand(T, E, generator=generator)
        scores[:, [1, 3] if E > 3 else [min(1, E - 1)]] = -1.0
    else:
        scores = torch.rand(T, E, generator=generator)
    return scores.topk(k, dim=1).indices.to(device)


def _make(shape, dtype, device, requires_grad, noncontiguous=False, scale=1.0):
    if noncontiguous and len(shape) >= 2:
        # a transposed view with the same logical shape
        t = torch.randn(*shape[:-2], shape[-1], shape[-2], dtype=torch.float64) * scale
        t = t.transpose(-2, -1)
    else:
        t = torch.randn(*shape, dtype=torch.float64) * scale
    t = t.to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def _strided_rows(T, D, dtype, device, requires_grad):
    """x [T, D] that is a column slice of a wider tensor (row stride != D)."""
    base = torch.randn(T, D + 3, dtype=torch.float64).to(device=device, dtype=dtype)
    return base[:, 1 : D + 1].requires_grad_(requires_grad)


def sample_inputs_token_sort(op_info, device, dtype, requires_grad, **kwargs):
    for T, _, _, E, k, routing in ROUTING_CASES:
        ids = make_topk_ids(T, E, k, routing, device)
        for align in (1, 4):
            yield SampleInput(ids.to(dtype), args=(E, align))


def sample_inputs_permute(op_info, device, dtype, requires_grad, **kwargs):
    for i, (T, D, _, E, k, routing) in enumerate(ROUTING_CASES):
        ids = make_topk_ids(T, E, k, routing, device)
        for align in (1, 4):
            sorted_ids, _, _ = ops.token_sort(ids, E, align)
            x = _strided_rows(T, D, dtype, device, requires_grad) if i % 2 else _make(
                (T, D), dtype, device, requires_grad
            )
            yield SampleInput(x, args=(sorted_ids, k))


def sample_inputs_unpermute(op_info, device, dtype, requires_grad, **kwargs):
    for T, D, _, E, k, routing in ROUTING_CASES:
        ids = make_topk_ids(T, E, k, routing, device)
        for align in (1, 4):
            sorted_ids, _, _ = ops.token_sort(ids, E, align)
            y = _make((sorted_ids.numel(), D), dtype, device, requires_grad)
            w = _make((T, k), dtype, device, requires_grad)
            yield SampleInput(y, args=(sorted_ids, w))


def _offs(sizes, device):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def sample_inputs_grouped_mm(op_info, device, dtype, requires_grad, **kwargs):
    make = functools.partial(_make, dtype=dtype, device=device, requires_grad=requires_grad)
    # group sizes: uneven with an empty group; a tail past offs[-1]; one group; all empty
    for sizes, tail in (([3, 0, 4, 2], 0), ([2, 3], 2), ([5], 0), ([0, 0], 3)):
        M = sum(sizes) + tail
        G = len(sizes)
        offs = _offs(sizes, device)
        for nc in (False, True):
            yield SampleInput(make((M, 4), noncontiguous=nc), args=(make((G, 4, 3), noncontiguous=nc), offs))
            yield SampleInput(make((G, 3, 4), noncontiguous=nc), args=(make((4, M), noncontiguous=nc), offs))
            yield SampleInput(make((3, M), noncontiguous=nc), args=(make((M, 4), noncontiguous=nc), offs))


def sample_inputs_indexed_grouped_mm(op_info, device, dtype, requires_grad, **kwargs):
    for T, D, F, E, k, routing in ROUTING_CASES:
        ids = make_topk_ids(T, E, k, routing, device)
        for align in (1, 4):
            sorted_ids, offs, _ = ops.token_sort(ids, E, align)
            S = sorted_ids.numel()
            tokens = torch.where(sorted_ids >= 0, sorted_ids // k, -1)
            x = _make((T, D), dtype, device, requires_grad)
            w_up = _make((E, D, F), dtype, device, requires_grad, noncontiguous=align > 1)
            # gather form: h = x[tokens] @ w_up[g]
            yield SampleInput(x, args=(w_up, offs), kwargs={"gather_index": tokens})
            # scatter form with routing weights: y[token] += w * (h @ w_down[g])
            h = _make((S, F), dtype, device, requires_grad)
            w_down = _make((E, F, D), dtype, device, requires_grad)
            weights = _make((S,), dtype, device, requires_grad)
            yield SampleInput(
                h,
                args=(w_down, offs),
                kwargs={"scatter_index": tokens, "scatter_weight": weights, "num_out_rows": T},
            )
            # sorted in, sorted out
            yield SampleInput(h, args=(w_down, offs))


def _moe_ffn_op(x, topk_ids, topk_weights, w1, w2, w3=None, activation="swiglu"):
    return torch_moe.nn.functional.moe_ffn(
        x, topk_ids, topk_weights, w1, w2, w3, activation=activation, limit=0.75
    )


def _moe_ffn_ref(x, topk_ids, topk_weights, w1, w2, w3=None, activation="swiglu"):
    return _refs.moe_ffn(
        x, topk_ids, topk_weights, w1, w2, w3, activation_kind=activation, limit=0.75
    )


def sample_inputs_moe_ffn(op_info, device, dtype, requires_grad, **kwargs):
    make = functools.partial(_make, dtype=dtype, device=device, requires_grad=requires_grad)
    activations = ("swiglu", "geglu", "swiglu_oai", "gelu", "relu")
    for i, (T, D, F, E, k, routing) in enumerate(ROUTING_CASES):
        ids = make_topk_ids(T, E, k, routing, device)
        weights = make((T, k))
        act = activations[i % len(activations)]
        gated = act in ("swiglu", "geglu", "swiglu_oai")
        x = _strided_rows(T, D, dtype, device, requires_grad) if i % 2 else make((T, D))
        w2 = make((E, F, D), noncontiguous=i % 3 == 0)
        if gated:
            # separate gate / up weights, then the fused [E, D, 2F] layout
            yield SampleInput(x, args=(ids, weights, make((E, D, F)), w2, make((E, D, F))),
                              kwargs={"activation": act})
            yield SampleInput(x, args=(ids, weights, make((E, D, 2 * F)), w2),
                              kwargs={"activation": act})
        else:
            yield SampleInput(x, args=(ids, weights, make((E, D, F)), w2),
                              kwargs={"activation": act})


def _ref_in_fp64(ref):
    """Runs ``ref`` in fp64 on detached copies and casts the result back."""

    def wrapper(*args, **kwargs):
        def up(a):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                return a.detach().to(torch.float64)
            return a

        out = ref(*[up(a) for a in args], **{k: up(v) for k, v in kwargs.items()})
        dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
        return out.to(dtype)

    return wrapper


_FLOATS = floating_types_and(torch.bfloat16, torch.float16)

moe_op_db = [
    OpInfo(
        "torch_moe.token_sort",
        op=ops.token_sort.default,
        ref=_refs.token_sort,
        sample_inputs_func=sample_inputs_token_sort,
        dtypes=(torch.int32, torch.int64),
        supports_out=False,
        supports_autograd=False,
    ),
    OpInfo(
        "torch_moe.permute",
        op=ops.permute.default,
        ref=_refs.permute,
        sample_inputs_func=sample_inputs_permute,
        dtypes=_FLOATS,
        supports_out=False,
    ),
    OpInfo(
        "torch_moe.unpermute",
        op=ops.unpermute.default,
        ref=_ref_in_fp64(_refs.unpermute),
        sample_inputs_func=sample_inputs_unpermute,
        dtypes=_FLOATS,
        supports_out=False,
    ),
    OpInfo(
        "torch_moe.grouped_mm",
        op=ops.grouped_mm.default,
        ref=_ref_in_fp64(_refs.grouped_mm),
        sample_inputs_func=sample_inputs_grouped_mm,
        dtypes=_FLOATS,
        supports_out=False,
    ),
    OpInfo(
        "torch_moe.indexed_grouped_mm",
        op=ops.indexed_grouped_mm.default,
        ref=_ref_in_fp64(_refs.indexed_grouped_mm),
        sample_inputs_func=sample_inputs_indexed_grouped_mm,
        dtypes=_FLOATS,
        supports_out=False,
    ),
    OpInfo(
        "torch_moe.moe_ffn",
        op=_moe_ffn_op,
        ref=_ref_in_fp64(_moe_ffn_ref),
        sample_inputs_func=sample_inputs_moe_ffn,
        dtypes=_FLOATS,
        supports_out=False,
    ),
]

# Differentiable references (the loop references of torch_moe._refs, in the sample's dtype),
# for gradient comparisons.
_AUTOGRAD_REFS = {
    "torch_moe.permute": _refs.permute,
    "torch_moe.unpermute": _refs.unpermute,
    "torch_moe.grouped_mm": _refs.grouped_mm,
    "torch_moe.indexed_grouped_mm": _refs.indexed_grouped_mm,
    "torch_moe.moe_ffn": _moe_ffn_ref,
}
for _op in moe_op_db:
    _op.autograd_ref = _AUTOGRAD_REFS.get(_op.name)
