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


def _to_elem(q: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even cast with saturation to the largest finite value; NaN stays NaN.

    The E4M3 cast of torch >= 2.12 saturates by itself (on every device); the E5M2 cast
    overflows to Inf, so it is clamped first (clamp keeps NaN).
    """
    if elem_dtype != torch.float8_e4m3fn:
        m = max_normal(elem_dtype)
        q = q.clamp(-m, m)
    return q.to(elem_dtype)


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    # Scaling by a power of two is exact in fp32 and in bf16 (the same exponent range); fp16
    # cannot hold the scales (up to 2**127). bf16 is kept as is: half the bytes to move, and
    # bf16 -> fp8 rounds once, like fp32 -> fp8.
    return torch.float32 if x.dtype == torch.float16 else x.dtype


def _abs_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along ``dim`` (keepdim, fp32), NaN if any element is NaN. aminmax reads the
    input once; abs().amax() would write and read a temporary of the input's size."""
    lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
    return torch.maximum(hi.float(), lo.float().neg())


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
    # contiguous outputs whatever the input strides (what the fake kernel promises)
    blocks = x.to(_work_dtype(x)).contiguous().unflatten(d, (-1, BLOCK_SIZE))  # [..., nb, B, ...]
    scale = scale_bytes(_abs_max(blocks, d + 1), elem_dtype, scale_mode)
    # x * 2**(127 - b) is exact (a power of two); a NaN reciprocal (b = 255) makes the whole
    # block NaN, as the spec asks of a NaN scale.
    recip = e8m0_reciprocal(scale).to(blocks.dtype)
    data = _to_elem(blocks * recip, elem_dtype).flatten(d, d + 1)
    return data, scale.squeeze(d + 1).to(torch.uint8)


def check_dequantize_mxfp8(data, scale, dim, out_dtype) -> int:
    op = "torch_moe.dequantize_mxfp8"
    C.check_elem_dtype(op, "data", data.dtype)
    C.check_out_dtype(op, out_dtype)
    d = C.wrap_dim(op, dim, data.dim())
    C.check_block_dim(op, "data", data, d)
    C.check_mx_scale(op, "scale", scale, C.mx_scale_shape(data.shape, d))
    C.check_same_device(op, data, scale, "data", "scale")
    return d


def dequantize_mxfp8(data, scale, dim=-1, out_dtype=torch.float32):
    d = check_dequantize_mxfp8(data, scale, dim, out_dtype)
    blocks = data.contiguous().float().unflatten(d, (-1, BLOCK_SIZE))
    factor = e8m0_to_float(_as_bytes(scale)).unsqueeze(d + 1)
    return (blocks * factor).flatten(d, d + 1).to(out_dtype)


def _as_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


# ---------------------------------------------------------------------------------------------
# FP8 rowwise: one power-of-two fp32 scale per row (the whole of `dim`) or per group of `dim`
# ---------------------------------------------------------------------------------------------


def check_quantize_fp8_rowwise(x, dim, offs) -> tuple:
    op = "torch_moe.quantize_fp8_rowwise"
    C.check_quantizable(op, "x", x)
    d = C.wrap_dim(op, dim, x.dim())
    torch._check(
        x.size(d) > 0 or offs is not None,
        lambda: f"{op}: expected a non-empty reduced dim, but x.size({d}) is 0 (a scale of "
        "nothing is undefined)",
    )
    G = 1
    if offs is not None:
        C.check_group_offsets_meta(op, offs)
        C.check_same_device(op, x, offs, "x", "offs")
        G = offs.size(0)
    return d, G


def _segment_lengths(offs: torch.Tensor, n: int) -> torch.Tensor:
    """Sizes of the G groups and of the tail past offs[-1] (G + 1 entries, on device)."""
    ends = torch.cat([offs.long(), offs.new_full((1,), n, dtype=torch.long)])
    return torch.diff(ends, prepend=ends.new_zeros(1))


def quantize_fp8_rowwise(x, dim=-1, offs=None):
    d, G = check_quantize_fp8_rowwise(x, dim, offs)
    xw = x.to(_work_dtype(x)).contiguous()
    if offs is None:
        scale = pow2_ceil_scale(_abs_max(xw, d), _FP8_ROWWISE_DTYPE)
        return _to_elem(xw * scale.reciprocal().to(xw.dtype), _FP8_ROWWISE_DTYPE), scale
    n = x.size(d)
    C.check_group_offsets("torch_moe.quantize_fp8_rowwise", offs, n)
    # Per group: max |x| over each group's slice of `dim`; the tail past offs[-1] is a group of
    # its own, which belongs to no GEMM group and quantizes to zero.
    lengths = _segment_lengths(offs, n)
    xt = xw.movedim(d, 0)
    # unsafe=True: the offsets were validated above; the safe mode reads them on the host
    amax = torch.segment_reduce(xt.abs(), "max", lengths=lengths, axis=0, unsafe=True)
    amax = amax.narrow(0, 0, G).float().clamp_(min=0)  # an empty group reduces to -inf
    scale_t = pow2_ceil_scale(amax, _FP8_ROWWISE_DTYPE)
    recip = torch.cat([scale_t.reciprocal(), scale_t.new_zeros((1, *scale_t.shape[1:]))])
    recip_rows = torch.repeat_interleave(recip.to(xw.dtype), lengths, dim=0, output_size=n)
    q = xt * recip_rows
    in_group = torch.arange(n, device=x.device) < offs.select(0, -1) if G else torch.zeros(n, dtype=torch.bool, device=x.device)
    q = torch.where(in_group.view(-1, *([1] * (q.dim() - 1))), q, 0)  # Inf * 0 would be NaN
    data = _to_elem(q, _FP8_ROWWISE_DTYPE).movedim(0, d).contiguous()
    return data, scale_t.movedim(0, d).contiguous()


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
    C.check_same_device(op, data, scale, "data", "scale")
    if offs is not None:
        C.check_same_device(op, data, offs, "data", "offs")
    return d


def dequantize_fp8_rowwise(data, scale, dim=-1, offs=None, out_dtype=torch.float32):
    d = check_dequantize_fp8_rowwise(data, scale, dim, offs, out_dtype)
    df = data.float()
    if offs is None:
        return (df * scale).to(out_dtype)
    n = data.size(d)
    C.check_group_offsets("torch_moe.dequantize_fp8_rowwise", offs, n)
    scale_t = scale.movedim(d, 0)
    padded = torch.cat([scale_t, scale_t.new_zeros((1, *scale_t.shape[1:]))])
    rows = torch.repeat_interleave(padded, _segment_lengths(offs, n), dim=0, output_size=n)
    return (df.movedim(d, 0) * rows).movedim(0, d).to(out_dtype).contiguous()


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
    tiles = tiles.permute(order).reshape(*batch, Rp, Cp)
    return tiles.narrow(-2, 0, rows).narrow(-1, 0, cols).contiguous()
