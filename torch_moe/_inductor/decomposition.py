"""Inductor decompositions of the torch_moe routing, permutation and quantize ops (counterpart
of ``torch/_inductor/decomposition.py``).

Eager runs these ops as tuned ATen compositions (``torch_moe._native``); under
``torch.compile`` Inductor does better with the ATen ops themselves, which it fuses with their
neighbours: the router's softmax / top-k with ``token_sort``'s histogram, the expert activation
with the MXFP8 quantizer of the next GEMM, the combine with the routing weights. Each
decomposition computes exactly what the eager kernel computes, summing in the same dtype. The
eager kernels' value checks (ids in range, each assignment in at most one slot) become
on-device asserts, so a compiled graph never syncs with the host; their messages are eager's
up to the values seen, which only a host read could print. Padded slots and dropped
assignments read an appended zero row (a masked load), never a real row.

A decomposition returns ``NotImplemented`` where it does not apply (e.g. per-group FP8 scales,
whose offsets the eager kernel validates on the host); the op then stays an extern call (the
fallbacks in ``lowering.py``).
"""

import torch
import torch.nn.functional as F

from torch_moe import _checks
from torch_moe._compat import assert_async
from torch_moe._native.padded_groups import padded_group_layout
from torch_moe._inductor._compat import register_decomposition
from torch_moe._native._cpu_features import accumulate_dtype
from torch_moe.quantization import _grouped_mm as QG
from torch_moe.quantization import _quantize as Q

ops = torch.ops.torch_moe


# ---------------------------------------------------------------------------------------------
# Routing and permutation
# ---------------------------------------------------------------------------------------------


def _bound(n, what: str) -> str:
    """``n`` as the message of an on-device assert shows it: the number when it is static (as
    eager prints it), else what it stands for."""
    return str(n) if isinstance(n, int) else what


@register_decomposition(ops.token_sort.default)
def token_sort(topk_ids, num_experts, align=1):
    _checks.check_token_sort(topk_ids, num_experts, align)
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    assert_async(
        ((ids >= 0) & (ids < num_experts)).all(),
        f"torch_moe.token_sort: expected topk_ids values in [0, {num_experts})",
    )
    # the histogram as a scatter-add (bincount's output size depends on the values)
    counts = ids.new_zeros(num_experts).scatter_add(0, ids, torch.ones_like(ids))
    expert_sorted, order = torch.sort(ids, stable=True)
    if align == 1:
        return order, counts.cumsum(0).to(torch.int32), counts
    ends, shift = padded_group_layout(counts, align)
    dest = torch.arange(n, device=ids.device) + shift[expert_sorted]
    S = _checks.token_sort_num_slots(n, num_experts, align)
    sorted_ids = torch.full((S,), -1, dtype=torch.int64, device=ids.device)
    return sorted_ids.scatter(0, dest, order), ends.to(torch.int32), counts


def _checked_assignments(op, sorted_ids, num_assignments, unique):
    """The assignment ids of the sorted slots, ``[S]``, with padding as ``n = num_assignments``.

    Asserts on device what the eager kernels check on the host: values in [-1, n) and, with
    ``unique``, each assignment in at most one slot. Index n is one past every real assignment:
    gathers through it read an appended zero row, never a real row, so NaN or Inf in a real row
    cannot leak into padding or a dropped assignment (0 * NaN would). Out-of-range values also
    map to n, so no gather or scatter indexes out of bounds before the assert reports them.
    """
    n = num_assignments
    in_range = (sorted_ids >= -1) & (sorted_ids < n)
    assert_async(
        in_range.all(),
        f"{op}: expected sorted_ids values in [-1, {_bound(n, 'num_tokens * top_k')}) "
        "(-1 marks padding)",
    )
    ids = torch.where(in_range & (sorted_ids >= 0), sorted_ids, n)
    if unique:
        uses = ids.new_zeros(n + 1).scatter_add(0, ids, torch.ones_like(ids))[:n]
        assert_async(
            (uses <= 1).all(),
            f"{op}: expected each assignment t * k + j at most once in sorted_ids",
        )
    return ids


def _slot_of_assignment(ids_S, num_assignments):
    """Inverse of ``ids_S``: the slot of each assignment ``[n]``, S where it has none (dropped)."""
    S = ids_S.size(0)
    slot = torch.full((num_assignments + 1,), S, dtype=torch.int64, device=ids_S.device)
    return slot.scatter(0, ids_S, torch.arange(S, device=ids_S.device))[:num_assignments]


def _with_zero_row(t):
    """``t [R, D]`` with a zero row R appended. Inductor lowers the pad to a masked load inside
    the consuming gather, so no copy of ``t`` is made and index R reads nothing."""
    return F.pad(t, (0, 0, 0, 1))


@register_decomposition(ops.permute.default)
def permute(x, sorted_ids, top_k):
    _checks.check_permute(x, sorted_ids, top_k)
    ids = _checked_assignments("torch_moe.permute", sorted_ids, x.size(0) * top_k, unique=True)
    # padding (id T * k) maps to row T, the appended zero row
    return _with_zero_row(x)[torch.div(ids, top_k, rounding_mode="floor")]


@register_decomposition(ops.permute_backward.default)
def permute_backward(grad, sorted_ids, top_k, num_tokens):
    # grad_x[t] = sum_j grad[slot of t * k + j], summed in the accumulation dtype like eager
    _checks.check_permute_backward(grad, sorted_ids, top_k, num_tokens)
    n = num_tokens * top_k
    ids = _checked_assignments("torch_moe.permute_backward", sorted_ids, n, unique=True)
    slot = _slot_of_assignment(ids, n)
    rows = _with_zero_row(grad)[slot].view(num_tokens, top_k, grad.size(1))
    return rows.to(accumulate_dtype(grad.dtype)).sum(1).to(grad.dtype)


@register_decomposition(ops.unpermute.default)
def unpermute(y, sorted_ids, topk_weights):
    _checks.check_unpermute(y, sorted_ids, topk_weights)
    T, k = topk_weights.shape
    ids = _checked_assignments("torch_moe.unpermute", sorted_ids, T * k, unique=True)
    slot = _slot_of_assignment(ids, T * k)
    acc = accumulate_dtype(y.dtype)
    rows = _with_zero_row(y)[slot].view(T, k, y.size(1)).to(acc)
    # a dropped assignment's weight is ignored, not multiplied by zero (it may be Inf)
    w = torch.where((slot < y.size(0)).view(T, k), topk_weights, 0).to(acc)
    return (w.unsqueeze(-1) * rows).sum(1).to(y.dtype)


@register_decomposition(ops.unpermute_backward.default)
def unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask):
    # grad_y[i] = w[a] * grad[a // k] for the assignment a of slot i (zero for padding);
    # grad_w[t, j] = <grad[t], y[slot of t * k + j]> (zero for a dropped assignment).
    # An output that output_mask does not request is an empty [0] tensor, as in eager.
    _checks.check_unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask)
    want_y, want_w = output_mask
    T, k = topk_weights.shape
    S, D = y.shape
    ids = _checked_assignments("torch_moe.unpermute_backward", sorted_ids, T * k, unique=True)
    acc = accumulate_dtype(y.dtype)
    grad_y, grad_w = y.new_empty((0,)), topk_weights.new_empty((0,))
    if want_y:
        w_slot = F.pad(topk_weights.reshape(-1), (0, 1))[ids].to(acc).to(grad.dtype)
        token = torch.div(ids, k, rounding_mode="floor")
        grad_y = _with_zero_row(grad)[token] * w_slot.unsqueeze(1)
    if want_w:
        slot = _slot_of_assignment(ids, T * k)
        y_rows = _with_zero_row(y)[slot].view(T, k, D).to(acc)
        dot = (grad.to(acc).unsqueeze(1) * y_rows).sum(-1)
        grad_w = torch.where((slot < S).view(T, k), dot, 0).to(topk_weights.dtype)
    return grad_y, grad_w


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------


@register_decomposition(ops.quantize_mxfp8.default)
def quantize_mxfp8(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
    return Q.quantize_mxfp8(x, dim, elem_dtype, scale_mode)


@register_decomposition(ops.dequantize_mxfp8.default)
def dequantize_mxfp8(data, scale, dim=-1, out_dtype=torch.float32):
    return Q.dequantize_mxfp8(data, scale, dim, out_dtype)


@register_decomposition(ops.quantize_fp8_rowwise.default)
def quantize_fp8_rowwise(x, dim=-1, offs=None):
    if offs is not None:
        return NotImplemented
    return Q.quantize_fp8_rowwise(x, dim)


@register_decomposition(ops.dequantize_fp8_rowwise.default)
def dequantize_fp8_rowwise(data, scale, dim=-1, offs=None, out_dtype=torch.float32):
    if offs is not None:
        return NotImplemented
    return Q.dequantize_fp8_rowwise(data, scale, dim, None, out_dtype)


@register_decomposition(ops.quantized_grouped_mm.default)
def quantized_grouped_mm(input, weight, offs, recipe, scale_mode="rceil", wgrad_high_precision=False):
    # the forward body: the quantizers decompose further and fuse with the producer of input.
    # The values of offs are checked by the scaled grouped GEMM (an extern call of the kernel):
    # the eager op's host-side check cannot read traced values.
    return QG.quantized_grouped_mm_forward(input, weight, offs, recipe, scale_mode)
