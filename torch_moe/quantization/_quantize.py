"""Quantize / dequantize kernels for FP8 rowwise and MXFP8, and the 128x4 scale swizzle.

Written in device-generic ATen ops and registered for ``CompositeExplicitAutograd``: they are
the reference semantics on every device (a backend may register a faster kernel, as the Triton
kernels of :mod:`torch_moe.quantization._triton` do for CUDA, and must match them bit for bit).

Shape legend: ``x [..., K, ...]`` with the blocked / reduced dim ``K`` at position ``dim``;
``B = 32`` (MX block), ``nb = K / B`` blocks, ``G`` groups.
"""

import torch

from torch_moe.quantization import _checks as C
from torch_moe.quantization._formats import (
    BLOCK_SIZE,
    e8m0_reciprocal,
    e8m0_to_float,
    max_normal,
    pow2_ceil_scale,
    scale_bytes,
)

__all__ = [
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "quantize_fp8_rowwise",
    "dequantize_fp8_rowwise",
    "swizzle_mx_scale",
    "unswizzle_mx_scale",
]

_FP8_ROWWISE_DTYPE = torch.float8_e4m3fn


def _to_elem(q_f32: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    # Saturate explicitly: the e5m2 cast overflows to Inf, and the e4m3 cast saturates only
    # since torch 2.12. clamp keeps NaN, so a NaN block stays NaN.
    m = max_normal(elem_dtype)
    return q_f32.clamp_(-m, m).to(elem_dtype)


# ---------------------------------------------------------------------------------------------
# MXFP8: blocks of 32 along `dim`, one E8M0 byte each
# ---------------------------------------------------------------------------------------------


def check_quantize_mxfp8(x, dim, elem_dtype, scale_mode) -> int:
    op = "torch_moe.quantize_mxfp8"
    C.check_quantizable(op, "x", x)
    C.check_elem_dtype(op, "elem_dtype", elem_dtype)
    C.check_scale_mode(op, scale_mode)
    d = C.wrap_dim(op, dim, x.dim())
    C.check_block_dim(op, "x", x, d)
    return d


def quantize_mxfp8(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
    d = check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    blocks = x.float().unflatten(d, (-1, BLOCK_SIZE))  # [..., nb, B, ...]
    amax = blocks.abs().amax(d + 1, keepdim=True)  # NaN propagates
    scale = scale_bytes(amax, elem_dtype, scale_mode)
    # x * 2**(127 - b) is exact (a power of two); a NaN reciprocal (b = 255) makes the whole
    # block NaN, as the spec asks of a NaN scale.
    data = _to_elem(blocks * e8m0_reciprocal(scale), elem_dtype).flatten(d, d + 1)
    return data, scale.squeeze(d + 1).to(torch.uint8)


def check_dequantize_mxfp8(data, scale, dim, out_dtype) -> int:
    op = "torch_moe.dequantize_mxfp8"
    C.check_elem_dtype(op, "data", data.dtype)
    C.check_out_dtype(op, out_dtype)
    d = C.wrap_dim(op, dim, data.dim())
    C.check_block_dim(op, "data", data, d)
    C.check_mx_scale(op, "scale", scale, C.mx_scale_shape(data.shape, d))
    return d


def dequantize_mxfp8(data, scale, dim=-1, out_dtype=torch.float32):
    d = check_dequantize_mxfp8(data, scale, dim, out_dtype)
    blocks = data.float().unflatten(d, (-1, BLOCK_SIZE))
    factor = e8m0_to_float(_as_bytes(scale)).unsqueeze(d + 1)
    return (blocks * factor).flatten(d, d + 1).to(out_dtype)


def _as_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


# ---------------------------------------------------------------------------------------------
# FP8 rowwise: one power-of-two fp32 scale per row (the whole of `dim`) or per group of `dim`
# ---------------------------------------------------------------------------------------------


def _group_index(offs: torch.Tensor, n: int) -> torch.Tensor:
    """Group of each position 0..n-1 along the grouped dim; G for positions past offs[-1]."""
    pos = torch.arange(n, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, pos, right=True)


def _along(index: torch.Tensor, d: int, ndim: int) -> torch.Tensor:
    return index.view([-1 if i == d else 1 for i in range(ndim)])


def check_quantize_fp8_rowwise(x, dim, offs) -> tuple:
    op = "torch_moe.quantize_fp8_rowwise"
    C.check_quantizable(op, "x", x)
    d = C.wrap_dim(op, dim, x.dim())
    G = 1
    if offs is not None:
        C.check_group_offsets_meta(op, offs)
        G = offs.size(0)
    return d, G


def quantize_fp8_rowwise(x, dim=-1, offs=None):
    d, G = check_quantize_fp8_rowwise(x, dim, offs)
    xf = x.float()
    if offs is None:
        scale = pow2_ceil_scale(xf.abs().amax(d, keepdim=True), _FP8_ROWWISE_DTYPE)
        return _to_elem(xf * scale.reciprocal(), _FP8_ROWWISE_DTYPE), scale
    C.check_group_offsets("torch_moe.quantize_fp8_rowwise", offs, x.size(d))
    # Per group: amax over each group's slice of `dim` (bucket G collects the positions past
    # offs[-1], which belong to no group and quantize to zero).
    gid = _along(_group_index(offs, x.size(d)), d, x.dim()).expand_as(xf)
    amax_shape = list(x.shape)
    amax_shape[d] = G + 1
    amax = xf.new_zeros(amax_shape).scatter_reduce_(d, gid, xf.abs(), "amax")
    scale = pow2_ceil_scale(amax.narrow(d, 0, G), _FP8_ROWWISE_DTYPE)
    recip = torch.cat([scale.reciprocal(), scale.new_zeros(rowwise_tail(scale, d))], d)
    return _to_elem(xf * recip.gather(d, gid), _FP8_ROWWISE_DTYPE), scale


def rowwise_tail(scale: torch.Tensor, d: int) -> list:
    shape = list(scale.shape)
    shape[d] = 1
    return shape


def check_dequantize_fp8_rowwise(data, scale, dim, offs, out_dtype) -> int:
    op = "torch_moe.dequantize_fp8_rowwise"
    C.check_elem_dtype(op, "data", data.dtype)
    C.check_out_dtype(op, out_dtype)
    d = C.wrap_dim(op, dim, data.dim())
    G = 1
    if offs is not None:
        C.check_group_offsets_meta(op, offs)
        G = offs.size(0)
    C.check_rowwise_scale(op, "scale", scale, C.rowwise_scale_shape(data.shape, d, G))
    return d


def dequantize_fp8_rowwise(data, scale, dim=-1, offs=None, out_dtype=torch.float32):
    d = check_dequantize_fp8_rowwise(data, scale, dim, offs, out_dtype)
    df = data.float()
    if offs is None:
        return (df * scale).to(out_dtype)
    C.check_group_offsets("torch_moe.dequantize_fp8_rowwise", offs, data.size(d))
    gid = _along(_group_index(offs, data.size(d)), d, data.dim()).expand_as(df)
    padded = torch.cat([scale, scale.new_zeros(rowwise_tail(scale, d))], d)
    return (df * padded.gather(d, gid)).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# 128x4 scale swizzle (cuBLAS / tcgen05 block-scaled layout)
# ---------------------------------------------------------------------------------------------


def _round_up(n, m):
    return (n + m - 1) // m * m


def check_swizzle(scale) -> None:
    op = "torch_moe.swizzle_mx_scale"
    torch._check(
        scale.dim() >= 2,
        lambda: f"{op}: expected scale [..., rows, cols], but got shape {tuple(scale.shape)}",
    )
    C.check_mx_scale(op, "scale", scale, scale.shape)


def swizzle_mx_scale(scale):
    """[..., R, C] -> [..., round_up(R, 128) * round_up(C, 4)]: byte (r, c) goes to
    ``((r // 128) * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``
    (padding bytes are 0)."""
    check_swizzle(scale)
    b = _as_bytes(scale)
    *batch, R, Cn = b.shape
    Rp, Cp = _round_up(R, 128), _round_up(Cn, 4)
    padded = torch.nn.functional.pad(b, (0, Cp - Cn, 0, Rp - R))
    tiles = padded.reshape(*batch, Rp // 128, 4, 32, Cp // 4, 4)
    n = len(batch)
    order = list(range(n)) + [n + i for i in (0, 3, 2, 1, 4)]  # (rb, cb, r32, r4, c4)
    return tiles.permute(order).reshape(*batch, Rp * Cp)


def check_unswizzle(swizzled, rows, cols) -> None:
    op = "torch_moe.unswizzle_mx_scale"
    torch._check(rows >= 0 and cols >= 0, lambda: f"{op}: expected rows, cols >= 0, got {rows}, {cols}")
    n = _round_up(rows, 128) * _round_up(cols, 4)
    torch._check(
        swizzled.dim() >= 1 and swizzled.size(-1) == n,
        lambda: f"{op}: expected swizzled [..., {n}] (round_up({rows}, 128) * round_up({cols}, 4)), "
        f"but got shape {tuple(swizzled.shape)}",
    )
    C.check_mx_scale(op, "swizzled", swizzled, swizzled.shape)


def unswizzle_mx_scale(swizzled, rows, cols):
    check_unswizzle(swizzled, rows, cols)
    b = _as_bytes(swizzled)
    *batch, _ = b.shape
    Rp, Cp = _round_up(rows, 128), _round_up(cols, 4)
    tiles = b.reshape(*batch, Rp // 128, Cp // 4, 32, 4, 4)
    n = len(batch)
    order = list(range(n)) + [n + i for i in (0, 3, 2, 1, 4)]  # back to (rb, r4, r32, cb, c4)
    return tiles.permute(order).reshape(*batch, Rp, Cp)[..., :rows, :cols].contiguous()
