"""CUDA kernel of ``torch_moe.scaled_grouped_mm``.

This module converts the op's canonical operands (see
:mod:`torch_moe.quantization._scaled_grouped_mm`) to what aten's scaled grouped GEMM requires and
calls it through the ops adapter, :func:`torch_moe._compat.scaled_grouped_mm`: the public
``torch.nn.functional.scaled_grouped_mm`` with the recipe spelled out (``ScalingType.RowWise``;
``ScalingType.BlockWise1x32`` with ``SwizzleType.SWIZZLE_32_4_4``) where torch has it, else the
private ``torch._scaled_grouped_mm``. Both reach the same kernels with the same operand checks.
Where the device or the shapes have no kernel it falls back to an emulation.

Canonical operands (``offs [G]`` int32 group ends, ``B = 32``):

    2D x 3D   a [M, K] @ b [G, K, N] -> [M, N]       MXFP8: scale_a [M, K/B], scale_b [G, K/B, N]
                                                     FP8:   scale_a [M, 1],   scale_b [G, 1, N]
    2D x 2D   a [K, M] @ b [M, N]    -> [G, K, N]    MXFP8: scale_a [K, M/B], scale_b [M/B, N]
                                                     FP8:   scale_a [K, G],   scale_b [G, N]

What aten's scaled grouped GEMM takes (``torch._scaled_grouped_mm`` and its public
counterpart; checks of the CUDA kernels and the meta kernel of ``torch._scaled_grouped_mm``,
torch 2.13):

* ``mat_a`` row-major, ``mat_b`` column-major (its last two dims), both e4m3 with 16-byte
  aligned strides; the fbgemm MXFP8 kernel also assumes packed rows / experts, so both are
  made dense in that layout;
* FP8 rowwise: fp32 *dequantization* scales; 2D x 3D ``scale_a (M,)`` and ``scale_b (G, N)``;
  2D x 2D ``scale_a (G * K,)`` and ``scale_b (G * N,)``, group-major (group ``g`` of ``scale_a``
  is ``scale_a[g * K:(g + 1) * K]``);
* MXFP8: ``float8_e8m0fnu`` scales in the 128x4 swizzled layout
  (:func:`torch_moe.quantization.swizzle_mx_scale`). The 3D operand's scale is swizzled per
  expert, ``(G, round_up(K/B, 4) * round_up(N, 128))``. A 2D operand's scale is swizzled per
  group, each group's block padded on its own (:func:`to_blocked_row_groups`,
  :func:`to_blocked_col_groups`);
* ``out_dtype`` bf16 only.

Which path runs is decided by :func:`native_kernel_supported` (device and recipe) and
:func:`native_shapes_supported` (shapes); everything else goes to
:func:`scaled_grouped_mm_emulated_triton` (exact dequantization, to bf16 for a bf16 output,
and the Triton grouped GEMM of :mod:`torch_moe._triton`), or without triton to
:func:`scaled_grouped_mm_emulated_bf16`. On an H100 / H200 that is MXFP8 and the FP8 rowwise
weight gradient; on a B200 FP8 rowwise. None of it reads a tensor value on the host.
"""

import functools
import importlib.util
import math

import torch

from torch_moe import _compat
from torch_moe.quantization import _checks as C
from torch_moe.quantization import _quantize as Q
from torch_moe.quantization import _scaled_grouped_mm as S
from torch_moe.quantization._formats import BLOCK_SIZE

__all__ = [
    "native_kernel_supported",
    "native_shapes_supported",
    "to_blocked_row_groups",
    "to_blocked_col_groups",
    "native_operands",
    "scaled_grouped_mm_native",
    "scaled_grouped_mm_emulated_bf16",
    "scaled_grouped_mm_cuda",
    "register",
]

_OP = "torch_moe.scaled_grouped_mm"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
ops = torch.ops.torch_moe

# The op promises fp32 accumulation. With fast accumulation the SM90 FP8 kernel accumulates in
# the tensor core's reduced-precision accumulator without promotion, so it stays off.
USE_FAST_ACCUM = False

# 128x4 tiles of the swizzled scale layout.
_TILE_ROWS, _TILE_COLS = 128, 4
_TILE_BYTES = _TILE_ROWS * _TILE_COLS
# Both grouped kernels set up their per-group arguments with one thread block of G threads;
# the SM90 FP8 kernel rejects 1024 groups or more.
_MAX_GROUPS = 1023
# TMA needs 16-byte aligned strides; e4m3 elements are one byte.
_ALIGN_ELEMS = 16


def _round_up(n, m):
    return (n + m - 1) // m * m


# ---------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------


def native_kernel_supported(
    recipe: str, layout: str, capability: tuple[int, int], built_with_mslk: bool = True
) -> bool:
    """Whether ``torch._scaled_grouped_mm`` has a kernel for ``recipe`` in ``layout``
    (``"2d_3d"`` or ``"2d_2d"``) on a CUDA device of compute ``capability``.

    * MXFP8: the fbgemm/MSLK tcgen05 kernel, SM100-class devices (capability ``(10, x)``) and
      only in builds with MSLK.
    * FP8 rowwise: the CUTLASS SM90 kernel, 2D x 3D only. torch accepts capability 10 too, but
      its own tests enable FP8 grouped GEMMs on SM90 only (``SM90OrLater and not
      SM100OrLater``). 2D x 2D is excluded because the kernel's argument setup asserts on the
      device that every group is non-empty ("CUTLASS cannot handle delta=0") when ``mat_a`` is
      row-major and ``mat_b`` column-major, the only layouts the FP8 API accepts; an expert
      without tokens is routine in MoE training and the assert would kill the CUDA context.

    ``torch._scaled_grouped_mm`` rejects every capability other than 9.x and 10.x.
    """
    major = capability[0]
    if recipe == "mxfp8":
        return major == 10 and built_with_mslk
    return major == 9 and layout == "2d_3d"


def native_shapes_supported(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> bool:
    """Shape requirements of ``torch._scaled_grouped_mm`` beyond what the op itself checks:
    the contraction and N multiples of 16 (2D x 3D: K and N; 2D x 2D: M and N) and fewer than
    1024 groups."""
    contraction = mat_a.size(1)  # K of a [M, K], M of a [K, M]
    n = mat_b.size(-1)
    return (
        contraction % _ALIGN_ELEMS == 0
        and n % _ALIGN_ELEMS == 0
        and offs.size(0) <= _MAX_GROUPS
    )


@functools.cache
def _built_with_mslk() -> bool:
    # The MXFP8 grouped GEMM is compiled in only with MSLK (formerly FBGEMM GenAI); torch's
    # tests detect it the same way.
    return "USE_MSLK" in torch.__config__.show()


def _use_native(recipe: str, layout: str, mat_a, mat_b, offs) -> bool:
    if mat_a.device.type != "cuda" or torch.version.hip is not None:
        # ROCm takes e4m3fnuz and unswizzled MX scales: not the layouts built here.
        return False
    capability = torch.cuda.get_device_capability(mat_a.device)
    return native_kernel_supported(recipe, layout, capability, _built_with_mslk()) and (
        native_shapes_supported(mat_a, mat_b, offs)
    )


# ---------------------------------------------------------------------------------------------
# Scale layouts
# ---------------------------------------------------------------------------------------------


def _as_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


def _check_blocked_input(fn: str, scale: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    torch._check(
        scale.dim() == 2,
        lambda: f"{fn}: expected scale [rows, cols], but got shape {tuple(scale.shape)}",
    )
    torch._check(
        scale.dtype in (torch.uint8, torch.float8_e8m0fnu),
        lambda: f"{fn}: expected scale to hold E8M0 bytes (uint8 or float8_e8m0fnu), but got "
        f"{scale.dtype}",
    )
    torch._check(
        group_ends.dim() == 1 and not group_ends.is_floating_point(),
        lambda: f"{fn}: expected group_ends to be a 1D integer tensor, but got "
        f"{group_ends.dim()}D {group_ends.dtype}",
    )
    return _as_bytes(scale)


def _group_of(ends: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For positions 0..n-1 along a grouped dim: (group index clamped to G - 1, offset inside
    the group, mask of positions past ``ends[-1]``, which belong to no group)."""
    pos = torch.arange(n, device=ends.device, dtype=torch.int64)
    g = torch.searchsorted(ends, pos, right=True)
    outside = g >= ends.size(0)
    g = g.clamp_(max=ends.size(0) - 1)
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    return g, pos - starts.index_select(0, g), outside


def _in_tile_row(r: torch.Tensor) -> torch.Tensor:
    # Inside a 128x4 tile, row r sits at (r % 32) * 16 + (r // 32 % 4) * 4 (4 bytes per row).
    return (r % 32) * 16 + (r % _TILE_ROWS) // 32 * 4


def _in_stripe_col(c: torch.Tensor) -> torch.Tensor:
    # Column c of a stripe of tiles: tile c // 4 (512 bytes each), byte c % 4 of the row.
    return (c // _TILE_COLS) * _TILE_BYTES + c % _TILE_COLS


def to_blocked_row_groups(scale: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """Swizzles the scale of a 2D operand whose groups run along its scale *rows* (``mat_a`` of
    2D x 3D, groups of tokens), one group at a time.

    ``scale`` uint8 / e8m0 ``[R, C]``, ``group_ends [G]`` cumulative group ends in rows
    -> uint8 ``[R + 128 * G, round_up(C, 4)]``.

    Group ``g`` (rows ``ends[g-1]:ends[g]``) becomes ``swizzle_mx_scale(scale[ends[g-1]:ends[g]])``
    and starts at byte ``P_g * round_up(C, 4)``, ``P_g`` the sum of the earlier groups' sizes
    rounded up to 128. The kernel finds each group there from ``offs`` alone. Every group adds
    at most 127 padding rows, so ``R + 128 * G`` rows always suffice and the size needs no group
    sizes on the host (no synchronisation). Bytes outside the group blocks, and the rows past
    ``group_ends[-1]``, are zero.
    """
    fn = "to_blocked_row_groups"
    b = _check_blocked_input(fn, scale, group_ends)
    R, Cn = b.shape
    G = group_ends.size(0)
    Cp = _round_up(Cn, _TILE_COLS)
    rows = R + _TILE_ROWS * G
    if G == 0 or b.numel() == 0:
        return b.new_zeros((rows, Cp))
    ends = group_ends.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + _TILE_ROWS - 1) // _TILE_ROWS * _TILE_ROWS
    block_start = torch.cumsum(padded, 0) - padded  # P_g, in rows
    g, lr, outside = _group_of(ends, R)
    # Byte offset = row part + column part: a row's stripe of tiles is 128 * Cp bytes long.
    row_off = (block_start.index_select(0, g) + lr // _TILE_ROWS * _TILE_ROWS) * Cp
    row_off = row_off + _in_tile_row(lr)
    # Rows of no group go to a scratch tile past the end, sliced off below.
    row_off = torch.where(outside, rows * Cp, row_off)
    col_off = _in_stripe_col(torch.arange(Cn, device=b.device, dtype=torch.int64))
    dest = row_off.unsqueeze(1) + col_off.unsqueeze(0)
    flat = b.new_zeros((rows + _TILE_ROWS) * Cp)
    flat.index_put_((dest.reshape(-1),), b.reshape(-1))
    return flat.narrow(0, 0, rows * Cp).view(rows, Cp)


def to_blocked_col_groups(scale: torch.Tensor, group_ends: torch.Tensor) -> torch.Tensor:
    """Swizzles the scale of a 2D operand whose groups run along its scale *columns* (both
    operands of 2D x 2D, whose blocks of 32 run along the grouped contraction), one group at a
    time.

    ``scale`` uint8 / e8m0 ``[R, C]``, ``group_ends [G]`` cumulative group ends in scale
    columns (the op's ``offs // 32``) -> uint8 ``[round_up(R, 128), C + 4 * G]``.

    Group ``g`` becomes ``swizzle_mx_scale(scale[:, ends[g-1]:ends[g]])`` and starts at byte
    ``round_up(R, 128) * Q_g``, ``Q_g`` the sum of the earlier groups' column counts rounded up
    to 4. As for :func:`to_blocked_row_groups`, the size is an upper bound known without the
    group sizes, and bytes outside the group blocks are zero.
    """
    fn = "to_blocked_col_groups"
    b = _check_blocked_input(fn, scale, group_ends)
    R, Cn = b.shape
    G = group_ends.size(0)
    Rp = _round_up(R, _TILE_ROWS)
    cols = Cn + _TILE_COLS * G
    if G == 0 or b.numel() == 0:
        return b.new_zeros((Rp, cols))
    ends = group_ends.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (sizes + _TILE_COLS - 1) // _TILE_COLS * _TILE_COLS
    block_start = torch.cumsum(padded, 0) - padded  # Q_g, in columns
    g, lc, outside = _group_of(ends, Cn)
    # Inside group g a stripe of 128 rows is 128 * padded[g] bytes long, so the row term
    # depends on the column's group: byte = col_base + (r // 128) * stripe + in_tile_row(r).
    col_base = block_start.index_select(0, g) * Rp + _in_stripe_col(lc)
    stripe = padded.index_select(0, g) * _TILE_ROWS
    # Columns of no group go to a scratch tile past the end, sliced off below.
    col_base = torch.where(outside, Rp * cols, col_base)
    stripe = torch.where(outside, 0, stripe)
    r = torch.arange(R, device=b.device, dtype=torch.int64)
    row_term = (r // _TILE_ROWS).unsqueeze(1) * stripe.unsqueeze(0) + _in_tile_row(r).unsqueeze(1)
    dest = col_base.unsqueeze(0) + row_term
    flat = b.new_zeros(Rp * cols + _TILE_BYTES)
    flat.index_put_((dest.reshape(-1),), b.reshape(-1))
    return flat.narrow(0, 0, Rp * cols).view(Rp, cols)


# ---------------------------------------------------------------------------------------------
# Native path: aten's scaled grouped GEMM
# ---------------------------------------------------------------------------------------------


def _aligned(t: torch.Tensor) -> bool:
    # TMA also needs a 16-byte aligned base address; the caching allocator aligns storages, so
    # the storage offset decides.
    return t.storage_offset() * t.element_size() % 16 == 0


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Dense row-major copy of a 2D ``t`` unless it already is one."""
    if t.is_contiguous() and _aligned(t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (``[..., R, C]``) with dense column-major last two dims (and packed leading dims)."""
    tt = t.transpose(-2, -1)
    if tt.is_contiguous() and _aligned(tt):
        return t
    return tt.clone(memory_format=torch.contiguous_format).transpose(-2, -1)


def native_operands(mat_a, mat_b, scale_a, scale_b, offs, recipe: str):
    """The ``(mat_a, mat_b, scale_a, scale_b)`` that ``torch._scaled_grouped_mm`` takes for the
    canonical operands of ``scaled_grouped_mm`` (layouts in the module docstring).

    2D x 3D, ``a [M, K]``, ``b [G, K, N]``:
        FP8:   a row-major, b column-major, scale_a fp32 ``(M,)``, scale_b fp32 ``(G, N)``
        MXFP8: scale_a e8m0 ``(M + 128 G, round_up(K/32, 4))`` swizzled per token group,
               scale_b e8m0 ``(G, round_up(N, 128) * round_up(K/32, 4))`` swizzled per expert
    2D x 2D, ``a [K, M]``, ``b [M, N]``:
        FP8:   scale_a fp32 ``(G * K,)``, scale_b fp32 ``(G * N,)``, group-major
        MXFP8: scale_a e8m0 ``(round_up(K, 128), M/32 + 4 G)``,
               scale_b e8m0 ``(round_up(N, 128), M/32 + 4 G)``, swizzled per group of M
    """
    a, b = _row_major(mat_a), _column_major(mat_b)
    G = offs.size(0)
    if recipe == "fp8_rowwise":
        if mat_b.dim() == 3:
            sa = scale_a.reshape(mat_a.size(0))
            sb = scale_b.reshape(G, mat_b.size(2))
        else:
            sa = scale_a.t().reshape(-1)  # [K, G] -> [G * K]
            sb = scale_b.reshape(-1)  # [G, N] -> [G * N]
        return a, b, sa.contiguous(), sb.contiguous()
    if mat_b.dim() == 3:
        # The kernel reads expert g's scale as the swizzled (N, K/32) matrix of its columns.
        sa = to_blocked_row_groups(scale_a, offs)
        sb = ops.swizzle_mx_scale(scale_b.transpose(1, 2))
    else:
        ends = offs // BLOCK_SIZE  # group ends in blocks of the contraction
        sa = to_blocked_col_groups(scale_a, ends)  # [K, M/32]
        sb = to_blocked_col_groups(scale_b.t(), ends)  # [N, M/32]
    return a, b, _as_bytes(sa).view(torch.float8_e8m0fnu), _as_bytes(sb).view(torch.float8_e8m0fnu)


def _zero_outside_groups_(
    out: torch.Tensor, offs: torch.Tensor, two_d_three_d: bool
) -> torch.Tensor:
    """Zeros what no group writes: rows past ``offs[-1]`` (2D x 3D) or the matrices of empty
    groups (2D x 2D). The grouped kernels leave them as allocated (uninitialised), while the
    op promises zeros; without host synchronisation this costs one masked pass over ``out``."""
    if two_d_three_d:
        rows = torch.arange(out.size(0), device=out.device, dtype=offs.dtype)
        return out.masked_fill_((rows >= offs.select(0, -1)).unsqueeze(1), 0)
    empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
    return out.masked_fill_(empty.view(-1, 1, 1), 0)


def scaled_grouped_mm_native(mat_a, mat_b, scale_a, scale_b, offs, recipe: str) -> torch.Tensor:
    """aten's scaled grouped GEMM (:func:`torch_moe._compat.scaled_grouped_mm`) on the converted
    operands; bf16 output, zero outside the groups. Offsets must already be validated."""
    offs = offs.contiguous()  # the grouped kernels read offs[g] at offs + g
    a, b, sa, sb = native_operands(mat_a, mat_b, scale_a, scale_b, offs, recipe)
    out = _compat.scaled_grouped_mm(
        a, b, sa, sb, recipe=recipe, offs=offs, out_dtype=torch.bfloat16,
        use_fast_accum=USE_FAST_ACCUM,
    )
    return _zero_outside_groups_(out, offs, mat_b.dim() == 3)


# ---------------------------------------------------------------------------------------------
# Fallback: dequantize to bf16, aten's grouped GEMM
# ---------------------------------------------------------------------------------------------


def _dequantize_operands(recipe, mat_a, mat_b, scale_a, scale_b, offs, dtype):
    """Both operands dequantized to ``dtype`` along their contraction dims (per group in 2D x 2D)."""

    def dq(data, scale, dim, group_offs):
        if recipe == "mxfp8":
            return ops.dequantize_mxfp8(data, scale, dim, out_dtype=dtype)
        return ops.dequantize_fp8_rowwise(data, scale, dim, group_offs, out_dtype=dtype)

    if mat_b.dim() == 3:
        return dq(mat_a, scale_a, 1, None), dq(mat_b, scale_b, 1, None)
    return dq(mat_a, scale_a, 1, offs), dq(mat_b, scale_b, 0, offs)


def scaled_grouped_mm_emulated_bf16(
    mat_a, mat_b, scale_a, scale_b, offs, recipe: str
) -> torch.Tensor:
    """Fallback for devices and shapes without a scaled grouped GEMM kernel: dequantize both
    operands to bf16 and run aten's grouped GEMM (:func:`torch_moe._compat.grouped_mm`; fp32
    accumulation, one rounding to bf16). Output bf16, zero outside the groups; offsets must
    already be validated.

    Dequantizing to bf16 is exact: an e4m3 value has at most 4 significant bits and the scale is
    a power of two, so the product fits bf16's 8 bits, and bf16 has fp32's exponent range. The
    only exception is a value finer than bf16's subnormal step 2**-133, which takes a scale
    below 2**-124 (a block or row whose absolute maximum is below about 2**-116). The result
    then equals the fp32 emulation of the CPU kernel up to the order of the fp32 accumulation.
    """
    a, b = _dequantize_operands(recipe, mat_a, mat_b, scale_a, scale_b, offs, torch.bfloat16)
    if mat_b.dim() == 2:
        # a column-major and b row-major: the one 2D x 2D layout whose CUTLASS setup accepts
        # empty groups (the others assert on the device).
        a = a.t().contiguous().t()
        b = b.contiguous()
    out = _compat.grouped_mm(a, b, offs=offs, out_dtype=torch.bfloat16)
    return _zero_outside_groups_(out, offs, mat_b.dim() == 3)


def scaled_grouped_mm_emulated_triton(
    mat_a, mat_b, scale_a, scale_b, offs, recipe: str, out_dtype: torch.dtype
) -> torch.Tensor:
    """Fallback with the Triton grouped GEMM of :mod:`torch_moe._triton`, for GPUs and shapes
    without a native kernel (FP8 rowwise off SM90, MXFP8 off SM100, the FP8 weight gradient):
    both operands dequantized, fp32 accumulation, one rounding to ``out_dtype``: the CPU
    kernel's contract. Zero outside the groups; offsets must already be validated. It runs on
    CPU tensors too under ``TRITON_INTERPRET=1``, which is how it is tested.

    For a bf16 output the operands are dequantized to bf16, exact as explained in
    :func:`scaled_grouped_mm_emulated_bf16`: half the bytes of fp32, and a bf16 GEMM runs on the
    tensor cores, where an fp32 one without TF32 does not. fp16 and fp32 outputs dequantize to
    fp32 (fp16 cannot hold the scales' range). FP8 rowwise scales that are constant along the
    contraction (the token rows' in 2D x 3D, both in 2D x 2D) are applied to the result instead:
    the GEMM reads the E4M3 values cast as they are, and multiplying the once-rounded result by
    a power of two is exact (outside bf16's subnormal range, as above)."""
    from torch_moe._triton import cuda_kernel

    triton_grouped_mm = cuda_kernel("grouped_mm")  # the Triton kernel, a triton_op
    dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    if recipe == "mxfp8":
        a, b = _dequantize_operands(recipe, mat_a, mat_b, scale_a, scale_b, offs, dtype)
        out = triton_grouped_mm(a, b, offs)
    elif mat_b.dim() == 3:
        # A's scale is one per row: it factors out of the contraction, so the GEMM takes A's
        # E4M3 values cast to ``dtype`` unscaled (exact; the Triton GEMM multiplies operands of
        # one dtype, so this is a copy of the tokens, but no dequantization pass over them) and
        # the result is scaled by rows in place, by a power of two (exact). Rows past offs[-1]
        # stay zero whatever their scale (a NaN one included).
        b = ops.dequantize_fp8_rowwise(mat_b, scale_b, 1, out_dtype=dtype)
        out = triton_grouped_mm(mat_a.to(dtype), b, offs)
        out.mul_(scale_a.to(dtype))  # [M, 1]
        rows = torch.arange(out.size(0), device=out.device, dtype=offs.dtype)
        out.masked_fill_((rows >= offs.select(0, -1)).unsqueeze(1), 0)
    else:
        # Both scales are one per group and row of the output (scale_a [K, G], scale_b
        # [G, N]): dW[g] = diag(scale_a[:, g]) (a_g @ b_g) diag(scale_b[g]) on the E4M3 values
        # cast unscaled (copies of both operands in ``dtype``, as above). The two scalings are
        # applied in place through broadcast views, so the only [G, K, N] tensor is the result;
        # each multiplies by a power of two, exact while the partly scaled value stays in the
        # normal range (fp32's range, bf16's too). Empty groups stay zero whatever their scales.
        out = triton_grouped_mm(mat_a.to(dtype), mat_b.to(dtype), offs)
        out.mul_(scale_a.t().unsqueeze(2).to(dtype))  # [G, K, 1]
        out.mul_(scale_b.unsqueeze(1).to(dtype))  # [G, 1, N]
        empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
        out.masked_fill_(empty.view(-1, 1, 1), 0)
    return out if out.dtype == out_dtype else out.to(out_dtype)


# ---------------------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------------------


def scaled_grouped_mm_cuda(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
    """CUDA kernel of ``torch_moe.scaled_grouped_mm`` (layouts in the module docstring).

    Runs aten's scaled grouped GEMM (:func:`scaled_grouped_mm_native`) where
    :func:`native_kernel_supported` and :func:`native_shapes_supported` allow (bf16 output, cast
    to ``out_dtype``: an fp32 or fp16 result is rounded to bf16 first), else
    :func:`scaled_grouped_mm_emulated_triton` (one rounding to ``out_dtype``), or
    :func:`scaled_grouped_mm_emulated_bf16` without triton. No host synchronisation: the offsets
    are checked with an on-device assert and every size is known from the shapes.
    """
    recipe = S.check_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    two_d_three_d = mat_b.dim() == 3
    grouped = mat_a.size(0) if two_d_three_d else mat_a.size(1)
    C.check_group_offsets(_OP, offs, grouped, C.GROUP_ALIGNMENT[recipe])
    if recipe == "fp8_rowwise":
        C.check_rowwise_scale_values(_OP, "scale_a", scale_a)
        C.check_rowwise_scale_values(_OP, "scale_b", scale_b)
    shape = S.output_shape(mat_a, mat_b, offs)
    # Nothing to multiply (no groups, an empty contraction) or nothing to write: the kernels'
    # stride checks reject zero sizes, and the answer is zeros anyway.
    if math.prod(shape) == 0 or mat_a.size(1) == 0 or offs.size(0) == 0:
        return torch.zeros(shape, dtype=out_dtype, device=mat_a.device)
    layout = "2d_3d" if two_d_three_d else "2d_2d"
    if _use_native(recipe, layout, mat_a, mat_b, offs):
        out = scaled_grouped_mm_native(mat_a, mat_b, scale_a, scale_b, offs, recipe)
    elif _HAS_TRITON and mat_a.device.type != "cpu":
        # Triton launches on every device but the CPU (there only in its interpreter; CPU
        # tensors reach this CUDA kernel only when it is called directly). The test names the
        # CPU rather than CUDA so that the meta tensors which stand for CUDA ones, where the
        # CUDA path is checked for host synchronisation on a machine without a GPU, take the
        # path a GPU takes; no other caller gives this function meta tensors.
        return scaled_grouped_mm_emulated_triton(mat_a, mat_b, scale_a, scale_b, offs, recipe,
                                                 out_dtype)
    else:
        out = scaled_grouped_mm_emulated_bf16(mat_a, mat_b, scale_a, scale_b, offs, recipe)
    return out if out_dtype == torch.bfloat16 else out.to(out_dtype)


_registered = False


def register() -> None:
    """Registers :func:`scaled_grouped_mm_cuda` as the CUDA kernel of
    ``torch_moe::scaled_grouped_mm`` (once; a second call is a no-op)."""
    global _registered
    if not _registered:
        torch.library.impl("torch_moe::scaled_grouped_mm", "CUDA")(scaled_grouped_mm_cuda)
        _registered = True
