"""Inductor decompositions of the torch_moe routing, permutation and quantize ops (counterpart
of ``torch/_inductor/decomposition.py``).

Eager runs these ops as tuned ATen compositions (``torch_moe._native``); under
``torch.compile`` Inductor does better with the ATen ops themselves, which it fuses with their
neighbours: the router's softmax / top-k with ``token_sort``'s histogram, the expert activation
with the MXFP8 quantizer of the next GEMM, the combine with the routing weights. Each
decomposition computes exactly what the eager kernel computes; the eager kernels' value checks
(expert ids in range) become on-device asserts, so a compiled graph never syncs with the host.

A decomposition returns ``NotImplemented`` where it does not apply (e.g. per-group FP8 scales,
whose offsets the eager kernel validates on the host); the op then stays an extern call.
"""

import torch
from torch._inductor.decomposition import register_decomposition

from torch_moe import _checks
from torch_moe.quantization import _grouped_mm as QG
from torch_moe.quantization import _quantize as Q

ops = torch.ops.torch_moe


# ---------------------------------------------------------------------------------------------
# Routing and permutation
# ---------------------------------------------------------------------------------------------


@register_decomposition(ops.token_sort.default)
def token_sort(topk_ids, num_experts, align=1):
    _checks.check_token_sort(topk_ids, num_experts, align)
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    torch._assert_async(
        ((ids >= 0) & (ids < num_experts)).all(),
        f"torch_moe.token_sort: expected topk_ids values in [0, {num_experts})",
    )
    # the histogram as a scatter-add (bincount's output size depends on the values)
    counts = ids.new_zeros(num_experts).scatter_add(0, ids, torch.ones_like(ids))
    expert_sorted, order = torch.sort(ids, stable=True)
    if align == 1:
        return order, counts.cumsum(0).to(torch.int32), counts
    padded = torch.div(counts + (align - 1), align, rounding_mode="floor") * align
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)
    dest = torch.arange(n, device=ids.device) + shift[expert_sorted]
    S = _checks.token_sort_num_slots(n, num_experts, align)
    sorted_ids = torch.full((S,), -1, dtype=torch.int64, device=ids.device)
    return sorted_ids.scatter(0, dest, order), ends.to(torch.int32), counts


def _rows(sorted_ids, top_k):
    valid = sorted_ids >= 0
    return valid, torch.where(valid, sorted_ids, 0) // top_k


@register_decomposition(ops.permute.default)
def permute(x, sorted_ids, top_k):
    _checks.check_permute(x, sorted_ids, top_k)
    valid, rows = _rows(sorted_ids, top_k)
    return torch.where(valid[:, None], x[rows], 0)


@register_decomposition(ops.unpermute.default)
def unpermute(y, sorted_ids, topk_weights):
    _checks.check_unpermute(y, sorted_ids, topk_weights)
    T, k = topk_weights.shape
    n = T * k
    valid = sorted_ids >= 0
    # slot of assignment t * k + j (S for assignments that have none: dropped by capacity)
    S = sorted_ids.size(0)
    slot = torch.full((n + 1,), S, dtype=torch.int64, device=y.device)
    slot = slot.scatter(0, torch.where(valid, sorted_ids, n),
                        torch.arange(S, device=y.device))[:n]
    has = (slot < S).view(T, k, 1)
    rows = y[slot.clamp(max=S - 1)].view(T, k, -1).float()
    w = topk_weights.float().view(T, k, 1)
    return torch.where(has, w * rows, 0).sum(1).to(y.dtype)


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
    # the forward body: the quantizers decompose further and fuse with the producer of input
    return QG.quantized_grouped_mm(input, weight, offs, recipe, scale_mode, wgrad_high_precision)
