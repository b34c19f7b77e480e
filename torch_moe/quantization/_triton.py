"""Triton kernels of ``quantize_mxfp8`` and ``quantize_fp8_rowwise`` for CUDA tensors.

They compute exactly what the reference kernels of :mod:`torch_moe.quantization._quantize` do,
bit for bit: scale bytes come from integer operations on the fp32 bit pattern of the block
amax (:mod:`torch_moe.quantization._formats`), the multiplication by the power of two
``2 ** (127 - b)`` is exact (the factor is built from its bits, byte 0 gives ``2 ** 127``), and
the fp32 -> FP8 rounding (round to nearest even after saturation to the largest finite value)
is written in integer operations too. The integer rounding needs no native FP8 conversion (so
it runs on every GPU) and is exact under ``TRITON_INTERPRET=1``, whose FP8 conversion does not
round to nearest even: the interpreter runs the very code a GPU runs.

Layout: a contiguous ``x`` with the quantized dim ``dim`` of size ``R`` is viewed as
``[outer, R, inner]`` (``outer`` / ``inner``: the products of the sizes before / after
``dim``). When ``inner == 1`` (``dim`` is the last dim) a kernel program handles a tile of
``outer`` rows, contiguous along ``R``; otherwise a tile of ``inner`` columns, contiguous across
the tile, of one ``outer`` slice. These are the "lanes": the positions that get their own
scales. The Triton paths need a contiguous ``x`` and no ``offs``; everything else runs the
reference kernels (see :func:`register_cuda_kernels`).
"""

import contextlib
import math
import struct
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from torch_moe.quantization import _quantize
from torch_moe.quantization._checks import mx_scale_shape, rowwise_scale_shape
from torch_moe.quantization._formats import BLOCK_SIZE, max_normal

__all__ = ["mxfp8_quantize", "fp8_rowwise_quantize", "register_cuda_kernels"]

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

    grid = (lane_tiles * batch, cdiv(n_red, BLOCK_R)); ``data`` has ``x``'s strides, ``scale``
    its own (the blocked dim of size n_red // 32).
    """
    NB: tl.constexpr = BLOCK_R // 32
    pid = tl.program_id(0)
    batch = (pid // lane_tiles).to(tl.int64)
    lanes = (pid % lane_tiles) * BLOCK_L + tl.arange(0, BLOCK_L)
    red = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    lane_ok = lanes < n_lanes
    mask = lane_ok[:, None] & (red < n_red)[None, :]
    lanes64 = lanes.to(tl.int64)
    offs = (
        batch * x_stride_batch
        + lanes64[:, None] * x_stride_lane
        + red.to(tl.int64)[None, :] * x_stride_red
    )

    bits = tl.reshape(_load_fp32_bits(x_ptr + offs, mask), (BLOCK_L, NB, 32))
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
        + lanes64[:, None] * s_stride_lane
        + blocks.to(tl.int64)[None, :] * s_stride_block
    )
    s_mask = lane_ok[:, None] & (blocks * 32 < n_red)[None, :]
    tl.store(scale_ptr + s_offs, byte.to(tl.uint8), mask=s_mask)

    q = _quantize_elements(
        bits, _pow2(127 - byte)[:, :, None], nan_block[:, :, None], MAX_BITS, MANT_BITS, EXP_BIAS
    )
    tl.store(data_ptr + offs, tl.reshape(q, (BLOCK_L, BLOCK_R)), mask=mask)


@triton.jit
def _fp8_rowwise_quantize_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    n_lanes,
    n_red,
    lane_tiles,
    x_stride_batch,
    x_stride_lane,
    x_stride_red,
    s_stride_batch,
    MANT_BITS: tl.constexpr,
    EXP_BIAS: tl.constexpr,
    MAX_BITS: tl.constexpr,
    RECIP_BITS: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: BLOCK_L lanes, each reduced over all n_red positions in BLOCK_R steps (one
    pass for the amax, one to quantize). grid = (lane_tiles * batch,); ``scale`` holds one fp32
    per lane, lanes contiguous."""
    pid = tl.program_id(0)
    batch = (pid // lane_tiles).to(tl.int64)
    lanes = (pid % lane_tiles) * BLOCK_L + tl.arange(0, BLOCK_L)
    lane_ok = lanes < n_lanes
    base = batch * x_stride_batch + lanes.to(tl.int64) * x_stride_lane

    amax = tl.zeros([BLOCK_L], dtype=tl.int32)
    for start in range(0, n_red, BLOCK_R):
        red = start + tl.arange(0, BLOCK_R)
        mask = lane_ok[:, None] & (red < n_red)[None, :]
        offs = base[:, None] + red.to(tl.int64)[None, :] * x_stride_red
        bits = _load_fp32_bits(x_ptr + offs, mask)
        amax = tl.maximum(amax, tl.max(bits & 0x7FFFFFFF, axis=1))

    # The RCEIL byte, at least 1 so that the scale stays a normal fp32; NaN for NaN/Inf rows.
    nan_row = amax >= 0x7F800000
    byte = tl.maximum(_rceil_byte(amax, RECIP_BITS), 1)
    scale = tl.where(nan_row, 0x7FC00000, byte << 23).to(tl.float32, bitcast=True)
    tl.store(scale_ptr + batch * s_stride_batch + lanes, scale, mask=lane_ok)

    factor = _pow2(127 - byte)[:, None]
    for start in range(0, n_red, BLOCK_R):
        red = start + tl.arange(0, BLOCK_R)
        mask = lane_ok[:, None] & (red < n_red)[None, :]
        offs = base[:, None] + red.to(tl.int64)[None, :] * x_stride_red
        bits = _load_fp32_bits(x_ptr + offs, mask)
        q = _quantize_elements(bits, factor, nan_row[:, None], MAX_BITS, MANT_BITS, EXP_BIAS)
        tl.store(data_ptr + offs, q, mask=mask)


# ---------------------------------------------------------------------------------------------
# Host side
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


class _Lanes(NamedTuple):
    """A contiguous tensor as ``batch`` slices of ``n_lanes`` lanes of ``n_red`` positions each:
    element (b, l, r) at ``b * x_stride_batch + l * x_stride_lane + r * x_stride_red``."""

    batch: int
    n_lanes: int
    n_red: int
    x_stride_batch: int
    x_stride_lane: int
    x_stride_red: int


def _lanes(shape, dim: int) -> _Lanes:
    """Lanes of a contiguous tensor of ``shape`` reduced / blocked along ``dim``."""
    outer, n_red, inner = math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])
    if inner == 1:
        return _Lanes(1, outer, n_red, 0, n_red, 1)
    return _Lanes(outer, inner, n_red, n_red * inner, 1, inner)


def _pow2_at_most(n: int, cap: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), cap)


def _mxfp8_tiles(v: _Lanes) -> tuple:
    """(BLOCK_L, BLOCK_R): long along the contiguous axis, ~_TILE elements."""
    if v.x_stride_red == 1:
        block_r = _pow2_at_most(v.n_red, 128)
        return _pow2_at_most(v.n_lanes, _TILE // block_r), block_r
    block_l = _pow2_at_most(v.n_lanes, 128)
    return block_l, max(_pow2_at_most(v.n_red, _TILE // block_l), BLOCK_SIZE)


def _rowwise_tiles(v: _Lanes) -> tuple:
    if v.x_stride_red == 1:
        block_r = _pow2_at_most(v.n_red, 1024)
        return _pow2_at_most(v.n_lanes, _TILE // block_r), block_r
    block_l = _pow2_at_most(v.n_lanes, 256)
    return block_l, _pow2_at_most(v.n_red, _TILE // block_l)


def _kernel_input(x: torch.Tensor) -> torch.Tensor:
    # bf16 goes in as its bits (see _load_fp32_bits)
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


def _device_guard(x: torch.Tensor):
    # Triton launches on the current device's stream; make that x's device.
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _mxfp8_grid(v: _Lanes) -> tuple:
    block_l, block_r = _mxfp8_tiles(v)
    lane_tiles = triton.cdiv(v.n_lanes, block_l)
    return (lane_tiles * v.batch, triton.cdiv(v.n_red, block_r)), lane_tiles, block_l, block_r


def _rowwise_grid(v: _Lanes) -> tuple:
    block_l, block_r = _rowwise_tiles(v)
    lane_tiles = triton.cdiv(v.n_lanes, block_l)
    return (lane_tiles * v.batch,), lane_tiles, block_l, block_r


def _fits(grid: tuple) -> bool:
    return grid[0] <= _MAX_GRID_0 and all(n <= _MAX_GRID_1 for n in grid[1:])


def mxfp8_quantize(
    x: torch.Tensor,
    dim: int = -1,
    elem_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_mode: str = "rceil",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_mxfp8`` of a contiguous ``x`` with the Triton kernel.

    Args:
        x: contiguous bf16 / fp16 / fp32 ``[..., K, ...]``, ``K = x.size(dim)`` a multiple of
            32, on any device Triton runs on (CPU tensors under ``TRITON_INTERPRET=1``).
        dim: the blocked dim.
        elem_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale_mode: ``"rceil"`` or ``"floor"``.

    Returns:
        ``data`` (``elem_dtype``, ``x``'s shape) and ``scale`` (uint8 E8M0 bytes,
        ``[..., K / 32, ...]``), both contiguous, bit for bit those of the reference kernel.
    """
    d = _quantize.check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    torch._check(x.is_contiguous(), lambda: "mxfp8_quantize: expected a contiguous x")
    if x.numel() == 0:  # nothing to launch
        return _quantize.quantize_mxfp8(x, d, elem_dtype, scale_mode)
    v = _lanes(x.shape, d)
    data = torch.empty(x.shape, dtype=elem_dtype, device=x.device)
    scale = torch.empty(mx_scale_shape(x.shape, d), dtype=torch.uint8, device=x.device)
    grid, lane_tiles, block_l, block_r = _mxfp8_grid(v)
    torch._check(_fits(grid), lambda: f"mxfp8_quantize: grid {grid} exceeds the launch limits")
    nb = v.n_red // BLOCK_SIZE
    if v.x_stride_red == 1:  # scale [outer, nb]
        s_strides = (0, nb, 1)
    else:  # scale [outer, nb, inner]
        s_strides = (nb * v.n_lanes, 1, v.n_lanes)
    with _device_guard(x):
        _mxfp8_quantize_kernel[grid](
            _kernel_input(x),
            data.view(torch.uint8),
            scale,
            v.n_lanes,
            v.n_red,
            lane_tiles,
            v.x_stride_batch,
            v.x_stride_lane,
            v.x_stride_red,
            *s_strides,
            RCEIL=scale_mode == "rceil",
            BLOCK_L=block_l,
            BLOCK_R=block_r,
            **_format_constants(elem_dtype),
        )
    return data, scale


def fp8_rowwise_quantize(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_rowwise`` (no ``offs``) of a contiguous ``x`` with the Triton kernel.

    Args:
        x: contiguous bf16 / fp16 / fp32 ``[..., K, ...]``, on any device Triton runs on.
        dim: the reduced dim.

    Returns:
        ``data`` (``float8_e4m3fn``, ``x``'s shape) and ``scale`` (fp32 powers of two,
        ``[..., 1, ...]``), both contiguous, bit for bit those of the reference kernel.
    """
    d, _ = _quantize.check_quantize_fp8_rowwise(x, dim, None)
    torch._check(x.is_contiguous(), lambda: "fp8_rowwise_quantize: expected a contiguous x")
    if x.numel() == 0:  # nothing to launch
        return _quantize.quantize_fp8_rowwise(x, d)
    v = _lanes(x.shape, d)
    data = torch.empty(x.shape, dtype=_FP8_ROWWISE_DTYPE, device=x.device)
    scale = torch.empty(rowwise_scale_shape(x.shape, d, 1), dtype=torch.float32, device=x.device)
    grid, lane_tiles, block_l, block_r = _rowwise_grid(v)
    torch._check(
        _fits(grid), lambda: f"fp8_rowwise_quantize: grid {grid} exceeds the launch limits"
    )
    consts = _format_constants(_FP8_ROWWISE_DTYPE)
    del consts["EMAX"]
    with _device_guard(x):
        _fp8_rowwise_quantize_kernel[grid](
            _kernel_input(x),
            data.view(torch.uint8),
            scale,
            v.n_lanes,
            v.n_red,
            lane_tiles,
            v.x_stride_batch,
            v.x_stride_lane,
            v.x_stride_red,
            v.n_lanes,  # scale [outer, 1, inner]: one outer slice holds n_lanes scales
            BLOCK_L=block_l,
            BLOCK_R=block_r,
            **consts,
        )
    return data, scale


# ---------------------------------------------------------------------------------------------
# Registration for CUDA
# ---------------------------------------------------------------------------------------------


def _quantize_mxfp8_cuda(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
    d = _quantize.check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    if x.is_contiguous() and x.numel() > 0 and _fits(_mxfp8_grid(_lanes(x.shape, d))[0]):
        return mxfp8_quantize(x, d, elem_dtype, scale_mode)
    return _quantize.quantize_mxfp8(x, dim, elem_dtype, scale_mode)


def _quantize_fp8_rowwise_cuda(x, dim=-1, offs=None):
    d, _ = _quantize.check_quantize_fp8_rowwise(x, dim, offs)
    if (
        offs is None
        and x.is_contiguous()
        and x.numel() > 0
        and _fits(_rowwise_grid(_lanes(x.shape, d))[0])
    ):
        return fp8_rowwise_quantize(x, d)
    return _quantize.quantize_fp8_rowwise(x, dim, offs)


_registered = False


def register_cuda_kernels() -> None:
    """Registers the Triton kernels as the CUDA kernels of ``torch_moe::quantize_mxfp8`` and
    ``torch_moe::quantize_fp8_rowwise`` (they take precedence over the reference kernels
    registered for ``CompositeExplicitAutograd``). Inputs the Triton kernels do not take
    (non-contiguous, empty, grouped with ``offs``) still run the reference kernels. Calling it
    again does nothing."""
    global _registered
    if _registered:
        return
    torch.library.impl("torch_moe::quantize_mxfp8", "CUDA")(_quantize_mxfp8_cuda)
    torch.library.impl("torch_moe::quantize_fp8_rowwise", "CUDA")(_quantize_fp8_rowwise_cuda)
    _registered = True
