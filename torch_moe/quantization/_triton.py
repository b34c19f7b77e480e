"""Triton kernels of ``quantize_mxfp8`` and ``quantize_fp8_rowwise`` for CUDA tensors.

They compute exactly what the reference kernels of :mod:`torch_moe.quantization._quantize` do,
bit for bit: scale bytes come from integer operations on the fp32 bit pattern of the block
amax (:mod:`torch_moe.quantization._formats`), the multiplication by the power of two
``2 ** (127 - b)`` is exact (the factor is built from its bits, byte 0 gives ``2 ** 127``), and
the fp32 -> FP8 rounding (round to nearest even after saturation to the largest finite value)
is written in integer operations too. The integer rounding needs no native FP8 conversion (so
it runs on every GPU) and is exact under ``TRITON_INTERPRET=1``, whose FP8 conversion does not
round to nearest even: the interpreter runs the very code a GPU runs.

Layout: ``x`` is addressed as ``(batch, lane, red)``, ``red`` the quantized dim and ``lane`` /
``batch`` the other dims collapsed into two strided runs, each tensor with its own strides
(:class:`_Layout`). A program handles a tile of lanes; the lanes get their own scales. ``x`` may
have any strides that collapse so, while ``data`` and ``scale`` are always contiguous: quantizing
a transposed view writes the transposed copy in the same pass, which is how the weight-gradient
GEMM gets its operands (``x.t()`` quantized along the tokens, row-major, in one kernel).

FP8 rowwise takes ``offs`` too (one scale per group of ``dim``, the weight-gradient recipe): one
program per lane tile and group, which reads the group's ends on the device; the rows past
``offs[-1]`` quantize to zeros, as in the reference.

Nothing here reads a tensor value on the host, and every launch goes through
:func:`torch.library.wrap_triton`, so the functions run on fake tensors (launching nothing)
and under tracing. :data:`KERNELS` are the CUDA kernels of the public ops; the current CUDA
device must be the tensors' (the registered wrappers of :mod:`torch_moe.quantization._kernels`
set it).
"""

import struct
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from torch_moe.quantization import _checks as C
from torch_moe.quantization import _quantize
from torch_moe.quantization._checks import mx_scale_shape, rowwise_scale_shape
from torch_moe.quantization._formats import BLOCK_SIZE, max_normal

__all__ = ["KERNELS", "mxfp8_quantize", "fp8_rowwise_quantize"]

# (mantissa bits, exponent bias) of the OCP FP8 element formats
_FP8_FIELDS = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
_FP8_ROWWISE_DTYPE = torch.float8_e4m3fn

# CUDA grid limits: 2**31 - 1 programs along axis 0, 65535 along axes 1 and 2.
_MAX_GRID_0 = 2**31 - 1
_MAX_GRID_1 = 65535
# Elements per program tile: large enough to amortize the index math, small enough for
# registers.
_TILE = 4096


# ---------------------------------------------------------------------------------------------
# Device helpers (all values are fp32 bit patterns held in int32 unless said otherwise)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _load_fp32_bits(ptrs, mask):
    """fp32 bit patterns (int32) of the values at ``ptrs``: bf16 (passed as its int16 bits),
    fp16 or fp32. Masked-off positions read 0 (+0.0), which changes no amax."""
    v = tl.load(ptrs, mask=mask, other=0)
    if v.dtype == tl.int16:
        # bf16 is the high half of an fp32: widening by a shift is exact for every value,
        # subnormals included (the interpreter's bf16 -> fp32 conversion flushes them).
        return v.to(tl.int32) << 16
    else:
        return v.to(tl.float32).to(tl.int32, bitcast=True)


@triton.jit
def _pow2(k):
    """fp32 ``2.0 ** k`` for integers k in [-127, 127], from its bits; -127 is the subnormal
    0x00400000 (never flushed). Values below -127 give 2**-127 (only used under a NaN mask)."""
    biased = k + 127
    return tl.where(biased > 0, biased << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _rceil_byte(amax, RECIP_BITS: tl.constexpr):
    """RCEIL E8M0 byte of finite amax bits: the smallest power of two >= fl32(amax * r), with
    r = fl32(1 / max_normal) given as its bits ``RECIP_BITS``, read off the product's exponent
    and mantissa fields. Non-finite amax gives 255."""
    recip = tl.full([], RECIP_BITS, tl.int32).to(tl.float32, bitcast=True)
    p = (amax.to(tl.float32, bitcast=True) * recip).to(tl.int32, bitcast=True)
    exponent = p >> 23
    mantissa = p & 0x7FFFFF
    normal = exponent + (mantissa != 0).to(tl.int32)
    # subnormal products: (2**-127, 2**-126] -> byte 1 (2**-126), [0, 2**-127] -> byte 0
    subnormal = (mantissa > 0x00400000).to(tl.int32)
    return tl.minimum(tl.where(exponent > 0, normal, subnormal), 255)


@triton.jit
def _floor_byte(amax, EMAX: tl.constexpr):
    """FLOOR (OCP spec) E8M0 byte: exponent(amax) - emax_elem, clamped to [0, 254]; the
    exponent field of an fp32 is floor(log2) of a normal value, and zeros / subnormals land on
    the smallest scale."""
    return tl.minimum(tl.maximum((amax >> 23) - EMAX, 0), 254)


@triton.jit
def _round_to_fp8(a, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """FP8 bits (int32, sign not included) of the non-negative finite fp32 bits ``a``, rounded
    to nearest even; ``a`` must not exceed the format's largest finite value."""
    exponent = a >> 23
    # Normal result: drop 23 - MANT_BITS mantissa bits with round-to-nearest-even (a carry
    # into the exponent field is the right result), then rebias the exponent.
    drop = 23 - MANT_BITS
    normal = (a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) >> drop
    normal -= (127 - EXP_BIAS) << MANT_BITS
    # Subnormal result: the number of subnormal steps 2**(1 - EXP_BIAS - MANT_BITS) in
    # sig * 2**(e - 150), rounded to nearest even; rounding up to 2**MANT_BITS steps yields the
    # smallest normal's encoding, as it should. Shifts past 31 round to 0 like shift 31 does
    # (sig < 2**24 is below half a step), so clamp them to keep every shift defined.
    sig = (a & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = (151 - EXP_BIAS - MANT_BITS) - tl.maximum(exponent, 1)
    shift = tl.minimum(tl.maximum(shift, drop + 1), 31)
    half = 1 << (shift - 1)
    subnormal = (sig + (half - 1) + ((sig >> shift) & 1)) >> shift
    return tl.where(exponent >= 128 - EXP_BIAS, normal, subnormal)


@triton.jit
def _quantize_elements(
    bits, factor, nan_block, MAX_BITS: tl.constexpr, MANT_BITS: tl.constexpr, EXP_BIAS: tl.constexpr
):
    """FP8 bytes (uint8) of ``clamp(x * factor, +-max_normal)`` for x given as fp32 ``bits``;
    ``factor`` is a power of two, so the product is exact unless it is an fp32 subnormal, whose
    rounding the FP8 result (0) does not see. Where ``nan_block`` the byte is the positive NaN
    0x7F (the reference makes such blocks NaN too, with a sign that varies with ATen's CPU
    vector paths)."""
    q = (bits.to(tl.float32, bitcast=True) * factor).to(tl.int32, bitcast=True)
    sign = (q >> 24) & 0x80
    # Saturate: non-negative fp32 bit patterns are ordered as their values.
    magnitude = tl.minimum(q & 0x7FFFFFFF, MAX_BITS)
    byte = _round_to_fp8(magnitude, MANT_BITS, EXP_BIAS) | sign
    return tl.where(nan_block, 0x7F, byte).to(tl.uint8)


# ---------------------------------------------------------------------------------------------
# Kernels
#
# Every tensor is addressed as (batch, lane, red) with its own three strides: ``red`` is the
# quantized dim, ``lane`` and ``batch`` the other dims collapsed (see _Layout). ``x`` may have any
# such strides while ``data`` and ``scale`` are contiguous, so a kernel that reads a transposed
# view writes the transposed copy: quantize and transpose in one pass.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _mxfp8_quantize_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    n_lanes,
    n_red,
    lane_tiles,
    x_stride_batch,
    x_stride_lane,
    x_stride_red,
    d_stride_batch,
    d_stride_lane,
    d_stride_red,
    s_stride_batch,
    s_stride_lane,
    s_stride_block,
    MANT_BITS: tl.constexpr,
    EXP_BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    EMAX: tl.constexpr,
    RECIP_BITS: tl.constexpr,
    RCEIL: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: a [BLOCK_L lanes, BLOCK_R] tile, BLOCK_R // 32 MX blocks per lane.
    grid = (lane_tiles * batch, cdiv(n_red, BLOCK_R))."""
    NB: tl.constexpr = BLOCK_R // 32
    pid = tl.program_id(0)
    batch = (pid // lane_tiles).to(tl.int64)
    lanes = (pid % lane_tiles) * BLOCK_L + tl.arange(0, BLOCK_L)
    red = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    lane_ok = lanes < n_lanes
    mask = lane_ok[:, None] & (red < n_red)[None, :]
    lanes64 = lanes.to(tl.int64)[:, None]
    red64 = red.to(tl.int64)[None, :]
    x_offs = batch * x_stride_batch + lanes64 * x_stride_lane + red64 * x_stride_red
    d_offs = batch * d_stride_batch + lanes64 * d_stride_lane + red64 * d_stride_red

    bits = tl.reshape(_load_fp32_bits(x_ptr + x_offs, mask), (BLOCK_L, NB, 32))
    # amax on |x|'s bits: integer order is value order, and NaN (> Inf) wins the max as the
    # reference's NaN-propagating amax does.
    amax = tl.max(bits & 0x7FFFFFFF, axis=2)
    if RCEIL:
        byte = _rceil_byte(amax, RECIP_BITS)
    else:
        byte = _floor_byte(amax, EMAX)
    nan_block = amax >= 0x7F800000
    byte = tl.where(nan_block, 255, byte)

    blocks = tl.program_id(1) * NB + tl.arange(0, NB)
    s_offs = (
        batch * s_stride_batch
        + lanes64 * s_stride_lane
        + blocks.to(tl.int64)[None, :] * s_stride_block
    )
    s_mask = lane_ok[:, None] & (blocks * 32 < n_red)[None, :]
    tl.store(scale_ptr + s_offs, byte.to(tl.uint8), mask=s_mask)

    q = _quantize_elements(
        bits, _pow2(127 - byte)[:, :, None], nan_block[:, :, None], MAX_BITS, MANT_BITS, EXP_BIAS
    )
    tl.store(data_ptr + d_offs, tl.reshape(q, (BLOCK_L, BLOCK_R)), mask=mask)


@triton.jit
def _fp8_rowwise_quantize_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    offs_ptr,
    n_lanes,
    n_red,
    n_groups,
    lane_tiles,
    x_stride_batch,
    x_stride_lane,
    x_stride_red,
    d_stride_batch,
    d_stride_lane,
    d_stride_red,
    s_stride_batch,
    s_stride_lane,
    s_stride_group,
    MANT_BITS: tl.constexpr,
    EXP_BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    RECIP_BITS: tl.constexpr,
    GROUPED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: BLOCK_L lanes of one segment of the reduced dim, in BLOCK_R steps (one pass
    for the amax, one to quantize). grid = (lane_tiles * batch, segments).

    Without ``GROUPED`` the one segment is the whole of ``n_red``. With it, segment ``g < G`` is
    group ``g``, ``[offs[g-1], offs[g])``, and segment ``G`` the tail ``[offs[-1], n_red)``,
    which belongs to no group and is written as zeros (no scale). The group ends are read on the
    device and clamped to ``[0, n_red]``, so invalid offsets never address out of bounds."""
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    batch = (pid // lane_tiles).to(tl.int64)
    lanes = (pid % lane_tiles) * BLOCK_L + tl.arange(0, BLOCK_L)
    lane_ok = lanes < n_lanes
    lanes64 = lanes.to(tl.int64)[:, None]
    x_base = batch * x_stride_batch + lanes64 * x_stride_lane
    d_base = batch * d_stride_batch + lanes64 * d_stride_lane

    if GROUPED:
        start = tl.load(offs_ptr + seg - 1, mask=seg > 0, other=0)
        end = tl.load(offs_ptr + seg, mask=seg < n_groups, other=n_red)
        start = tl.minimum(tl.maximum(start, 0), n_red)
        end = tl.minimum(tl.maximum(end, start), n_red)
        amax_end = tl.where(seg < n_groups, end, start)  # the tail needs no amax
    else:
        start = 0
        end = n_red
        amax_end = n_red
    # per lane: whether the segment is a group (False for the tail)
    in_group = (tl.zeros([BLOCK_L], dtype=tl.int32) + seg) < n_groups

    amax = tl.zeros([BLOCK_L], dtype=tl.int32)
    for step in range(start, amax_end, BLOCK_R):
        red = step + tl.arange(0, BLOCK_R)
        mask = lane_ok[:, None] & (red < end)[None, :]
        bits = _load_fp32_bits(x_ptr + x_base + red.to(tl.int64)[None, :] * x_stride_red, mask)
        amax = tl.maximum(amax, tl.max(bits & 0x7FFFFFFF, axis=1))

    # The RCEIL byte, at least 1 so that the scale stays a normal fp32; NaN for NaN/Inf rows.
    nan_row = amax >= 0x7F800000
    byte = tl.maximum(_rceil_byte(amax, RECIP_BITS), 1)
    scale = tl.where(nan_row, 0x7FC00000, byte << 23).to(tl.float32, bitcast=True)
    s_offs = batch * s_stride_batch + lanes.to(tl.int64) * s_stride_lane + seg * s_stride_group
    tl.store(scale_ptr + s_offs, scale, mask=lane_ok & in_group)

    # the tail reads nothing (zeros) and scales by 0: zero bytes
    factor = tl.where(in_group, _pow2(127 - byte), 0.0)[:, None]
    for step in range(start, end, BLOCK_R):
        red = step + tl.arange(0, BLOCK_R)
        mask = lane_ok[:, None] & (red < end)[None, :]
        red64 = red.to(tl.int64)[None, :]
        bits = _load_fp32_bits(x_ptr + x_base + red64 * x_stride_red, mask & in_group[:, None])
        q = _quantize_elements(bits, factor, nan_row[:, None], MAX_BITS, MANT_BITS, EXP_BIAS)
        tl.store(data_ptr + d_base + red64 * d_stride_red, q, mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side (no tensor values are read: everything here runs on fake tensors too)
# ---------------------------------------------------------------------------------------------


def _f32_bits(value: float) -> int:
    """Bits (as a signed int32) of ``value`` rounded to fp32 (round to nearest even)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _format_constants(elem_dtype: torch.dtype) -> dict:
    mant_bits, exp_bias = _FP8_FIELDS[elem_dtype]
    max_bits = _f32_bits(max_normal(elem_dtype))
    return dict(
        MANT_BITS=mant_bits,
        EXP_BIAS=exp_bias,
        MAX_BITS=max_bits,
        # the reference's fl32(1 / max_normal): the double quotient rounded once to fp32
        RECIP_BITS=_f32_bits(1.0 / max_normal(elem_dtype)),
        EMAX=(max_bits >> 23) - 127,
    )


def _contiguous_strides(shape) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return strides[::-1]


class _Layout(NamedTuple):
    """``x`` (and its contiguous ``data`` and ``scale``) as ``batch`` slices of ``n_lanes`` lanes
    of ``n_red`` positions: element (b, l, r) of ``x`` at ``b * x[0] + l * x[1] + r * x[2]``
    (``x`` the strides), likewise for ``data`` and ``scale`` (``scale``'s third stride steps
    from one block / group to the next)."""

    batch: int
    n_lanes: int
    n_red: int
    x: tuple
    data: tuple
    scale: tuple


def _layout(x: torch.Tensor, dim: int, scale_shape) -> Optional[_Layout]:
    """The (batch, lane, red) view of ``x`` quantized along ``dim``, or None when the dims other
    than ``dim`` do not collapse into two strided runs (the reference kernel takes those).

    The dims before ``dim`` and those after it collapse separately (in ``data`` and ``scale``
    they are never adjacent); a run is a sequence of dims that ``x``'s strides nest."""
    data_strides = _contiguous_strides(x.shape)
    scale_strides = _contiguous_strides(scale_shape)
    runs = []  # [size, x stride, data stride, scale stride]
    for side in (range(dim), range(dim + 1, x.dim())):
        prev = None
        for i in side:
            n = x.size(i)
            if n == 1:
                continue
            if prev is not None and prev[1] == x.stride(i) * n:
                prev[0] *= n
                prev[1:] = [x.stride(i), data_strides[i], scale_strides[i]]
            else:
                prev = [n, x.stride(i), data_strides[i], scale_strides[i]]
                runs.append(prev)
    if len(runs) > 2:
        return None
    runs = [[1, 0, 0, 0]] * (2 - len(runs)) + runs
    batch, lane = runs
    if batch[1] == 1:  # the lanes are the run that x holds contiguously
        batch, lane = lane, batch
    return _Layout(
        batch[0], lane[0], x.size(dim),
        (batch[1], lane[1], x.stride(dim)),
        (batch[2], lane[2], data_strides[dim]),
        (batch[3], lane[3], scale_strides[dim]),
    )


def _pow2_at_most(n: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), cap)


def _tiles(v: _Layout, max_red: int, max_lanes: int, min_red: int) -> tuple:
    """(BLOCK_L, BLOCK_R), about _TILE elements, long along the axis ``x`` is contiguous on; a
    square tile when ``x`` and ``data`` are contiguous along different axes (a transposing
    quantize: both the loads and the stores stay coalesced)."""
    if v.x[1] == 1 and v.data[2] == 1:
        return _pow2_at_most(v.n_lanes, 64), max(_pow2_at_most(v.n_red, 64), min_red)
    if v.x[2] == 1 or v.x[1] != 1:
        block_r = max(_pow2_at_most(v.n_red, max_red), min_red)
        return _pow2_at_most(v.n_lanes, _TILE // block_r), block_r
    block_l = _pow2_at_most(v.n_lanes, max_lanes)
    return block_l, max(_pow2_at_most(v.n_red, _TILE // block_l), min_red)


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    # bf16 goes in as its bits (see _load_fp32_bits)
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _fits(grid: tuple) -> bool:
    return grid[0] <= _MAX_GRID_0 and all(n <= _MAX_GRID_1 for n in grid[1:])


def _mxfp8_launch(x: torch.Tensor, d: int):
    """(layout, grid, tiles) of the MXFP8 kernel for ``x``, or None if it cannot take ``x``."""
    if x.numel() == 0:
        return None
    v = _layout(x, d, mx_scale_shape(x.shape, d))
    if v is None:
        return None
    block_l, block_r = _tiles(v, 128, 128, BLOCK_SIZE)
    lane_tiles = triton.cdiv(v.n_lanes, block_l)
    grid = (lane_tiles * v.batch, triton.cdiv(v.n_red, block_r))
    return (v, grid, lane_tiles, block_l, block_r) if _fits(grid) else None


def _rowwise_launch(x: torch.Tensor, d: int, num_groups: Optional[int]):
    """(layout, grid, tiles) of the FP8 rowwise kernel (``num_groups``: None without offs)."""
    if x.numel() == 0:
        return None
    grouped = num_groups is not None
    v = _layout(x, d, rowwise_scale_shape(x.shape, d, num_groups if grouped else 1))
    if v is None:
        return None
    block_l, block_r = _tiles(v, 1024, 256, 1)
    lane_tiles = triton.cdiv(v.n_lanes, block_l)
    grid = (lane_tiles * v.batch, num_groups + 1 if grouped else 1)
    return (v, grid, lane_tiles, block_l, block_r) if _fits(grid) else None


def mxfp8_quantize(
    x: torch.Tensor,
    dim: int = -1,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_mxfp8`` with the Triton kernel.

    Args:
        x: bf16 / fp16 / fp32 ``[..., K, ...]``, ``K = x.size(dim)`` a multiple of 32, on any
            device Triton runs on (CPU tensors under ``TRITON_INTERPRET=1``). Any strides with
            which the dims before ``dim`` and those after it collapse into two strided runs (a
            transposed view of a contiguous tensor does): the contiguous outputs are then its
            transposed copy. Other inputs, and empty ones, go to the reference kernel.
        dim: the blocked dim.
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_mode: ``"rceil"`` or ``"floor"``.

    Returns:
        ``data`` (``elem_dtype``, ``x``'s shape) and ``scale`` (uint8 E8M0 bytes,
        ``[..., K / 32, ...]``), both contiguous, bit for bit those of the reference kernel.
    """
    d = _quantize.check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    launch = _mxfp8_launch(x, d)
    if launch is None:
        return _quantize.quantize_mxfp8(x, d, elem_dtype, scale_mode)
    v, grid, lane_tiles, block_l, block_r = launch
    data = torch.empty(x.shape, dtype=elem_dtype, device=x.device)
    scale = torch.empty(mx_scale_shape(x.shape, d), dtype=torch.uint8, device=x.device)
    wrap_triton(_mxfp8_quantize_kernel)[grid](
        _kernel_input(x),
        data.view(torch.uint8),
        scale,
        v.n_lanes,
        v.n_red,
        lane_tiles,
        *v.x,
        *v.data,
        *v.scale,
        RCEIL=scale_mode == "rceil",
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        **_format_constants(elem_dtype),
    )
    return data, scale


def fp8_rowwise_quantize(
    x: torch.Tensor, dim: int = -1, offs: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_rowwise`` with the Triton kernel.

    Args:
        x: bf16 / fp16 / fp32 ``[..., K, ...]`` on any device Triton runs on, strides as for
            :func:`mxfp8_quantize` (a transposed view gives its transposed copy).
        dim: the reduced dim.
        offs: optional int32 ``[G]`` cumulative group ends along ``dim``, any stride: one scale
            per group (its values are checked with a device assert and read on the device only).

    Returns:
        ``data`` (``float8_e4m3fn``, ``x``'s shape) and ``scale`` (fp32 powers of two,
        ``[..., 1 or G, ...]``), both contiguous, bit for bit those of the reference kernel.
    """
    d, G = _quantize.check_quantize_fp8_rowwise(x, dim, offs)
    if offs is not None:
        C.check_group_offsets("torch_moe.quantize_fp8_rowwise", offs, x.size(d))
        # the kernel reads offs[g] at offs_ptr + g
        offs = offs.contiguous()
    launch = _rowwise_launch(x, d, None if offs is None else G)
    if launch is None:
        return _quantize.quantize_fp8_rowwise(x, d, offs)
    v, grid, lane_tiles, block_l, block_r = launch
    data = torch.empty(x.shape, dtype=_FP8_ROWWISE_DTYPE, device=x.device)
    scale = torch.empty(rowwise_scale_shape(x.shape, d, G), dtype=torch.float32, device=x.device)
    consts = _format_constants(_FP8_ROWWISE_DTYPE)
    del consts["EMAX"]
    wrap_triton(_fp8_rowwise_quantize_kernel)[grid](
        _kernel_input(x),
        data.view(torch.uint8),
        scale,
        offs if offs is not None else scale,  # unread without GROUPED
        v.n_lanes,
        v.n_red,
        G,
        lane_tiles,
        *v.x,
        *v.data,
        *v.scale,
        GROUPED=offs is not None,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        **consts,
    )
    return data, scale


# ---------------------------------------------------------------------------------------------
# The CUDA kernels of the public ops (registered by torch_moe.quantization._kernels, which
# imports this module on their first call). Every launch is inside a triton_op, so that tracing
# (torch.compile without Inductor's decomposition, a dispatch mode over fake tensors) sees an op
# with a fake kernel rather than the Triton launch.
# ---------------------------------------------------------------------------------------------



@triton_op("torch_moe::_triton_quantize_mxfp8", mutates_args=())
def _triton_quantize_mxfp8(
    x: Tensor,
    dim: int = -1,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
) -> tuple[Tensor, Tensor]:
    # Also the fake kernel (triton_op traces the body), so it must not read tensor values.
    return mxfp8_quantize(x, dim, elem_dtype, scale_mode)


@triton_op("torch_moe::_triton_quantize_fp8_rowwise", mutates_args=())
def _triton_quantize_fp8_rowwise(
    x: Tensor, dim: int = -1, offs: Optional[Tensor] = None
) -> tuple[Tensor, Tensor]:
    return fp8_rowwise_quantize(x, dim, offs)


KERNELS = {
    "quantize_mxfp8": torch.ops.torch_moe._triton_quantize_mxfp8.default,
    "quantize_fp8_rowwise": torch.ops.torch_moe._triton_quantize_fp8_rowwise.default,
}
