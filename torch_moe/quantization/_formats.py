"""Number formats of FP8 training: element dtypes, E8M0 scale bytes and the scale rules.

Everything is computed with integer operations on the fp32 bit pattern, so the results are the
same on every device and do not depend on ``log2`` / ``exp2`` rounding (an fp32 ``log2`` of a
value a few ulps above a power of two rounds to the integer and gives a scale one binade too
small) or on the round-to-nearest of ``.to(torch.float8_e8m0fnu)``.

E8M0 byte ``b`` (OCP MX v1.0): ``2 ** (b - 127)`` for ``b`` in 0..254, NaN for 255.
"""

import struct

import torch

__all__ = [
    "BLOCK_SIZE",
    "ELEM_DTYPES",
    "SCALE_MODES",
    "max_normal",
    "scale_bytes",
    "round_up_to_e8m0",
    "e8m0_to_float",
    "e8m0_reciprocal",
    "pow2_ceil_scale",
]

BLOCK_SIZE = 32
E8M0_NAN = 255

# dtype -> (largest finite value, exponent of the largest normal binade "emax_elem")
_ELEM_FORMATS = {
    torch.float8_e4m3fn: (448.0, 8),
    torch.float8_e5m2: (57344.0, 15),
}
ELEM_DTYPES = tuple(_ELEM_FORMATS)
# fl32(1 / max_normal), the reciprocal the RCEIL kernels multiply by
_RECIPROCAL_MAX = {
    dtype: struct.unpack("<f", struct.pack("<f", 1.0 / m))[0] for dtype, (m, _) in _ELEM_FORMATS.items()
}
SCALE_MODES = ("rceil", "floor")

_MANT_BITS = 23
_MANT_MASK = (1 << _MANT_BITS) - 1
_HALF_MIN_NORMAL_MANT = 1 << (_MANT_BITS - 1)  # fp32 bits of 2**-127 (a subnormal)


def max_normal(elem_dtype: torch.dtype) -> float:
    return _ELEM_FORMATS[elem_dtype][0]


def _exponent_and_mantissa(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bits = t.view(torch.int32)  # a view of the same element size: any strides
    return (bits >> _MANT_BITS) & 0xFF, bits & _MANT_MASK


def _floor_bytes(amax: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    # OCP spec: X = 2 ** (floor(log2(amax)) - emax_elem); floor(log2) of a normal fp32 is its
    # unbiased exponent field, and zeros / subnormals land on the smallest scale.
    exponent, _ = _exponent_and_mantissa(amax)
    return (exponent - _ELEM_FORMATS[elem_dtype][1]).clamp(0, 254)


def round_up_to_e8m0(d: torch.Tensor) -> torch.Tensor:
    """E8M0 byte (int32) of the smallest power of two >= ``d`` (fp32, >= 0), from its bit
    fields (PTX ``cvt.rp.ue8m0x2.f32`` without ``.satfinite``): a normal ``d`` rounds up to
    ``2 ** (exponent + [mantissa != 0])``; a subnormal one to 2**-127 or 2**-126; past 2**127
    (and Inf / NaN) it is 255."""
    exponent, mantissa = _exponent_and_mantissa(d)
    normal = exponent + (mantissa != 0).to(torch.int32)
    subnormal = (mantissa > _HALF_MIN_NORMAL_MANT).to(torch.int32)  # (2**-127, 2**-126] -> 1
    return torch.where(exponent > 0, normal, subnormal).clamp(max=E8M0_NAN)


def _rceil_bytes(amax: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    # cuBLAS / TransformerEngine: the smallest power of two >= fl32(amax * fl32(1 / max_normal)).
    # (Multiplying by the rounded reciprocal or dividing by max_normal gives the same byte for
    # E4M3: fl(1/448) * 448 - 1 < 2**-24.)
    # A Python float already rounded to fp32: no host-to-device copy (and no sync) per call.
    return round_up_to_e8m0(amax * _RECIPROCAL_MAX[elem_dtype])


def scale_bytes(amax: torch.Tensor, elem_dtype: torch.dtype, scale_mode: str) -> torch.Tensor:
    """E8M0 scale byte (int32 tensor) of blocks with absolute maximum ``amax`` (fp32, >= 0).

    A block whose amax is NaN or Inf gets 255 (NaN): the whole block is NaN.
    """
    amax = amax.float()
    rule = _rceil_bytes if scale_mode == "rceil" else _floor_bytes
    return torch.where(torch.isfinite(amax), rule(amax, elem_dtype), E8M0_NAN)


def _pow2_from_exponent(unbiased: torch.Tensor) -> torch.Tensor:
    """``2.0 ** unbiased`` (fp32) for integer exponents in [-127, 127], built from bits."""
    biased = unbiased + 127
    bits = torch.where(biased > 0, biased << _MANT_BITS, _HALF_MIN_NORMAL_MANT)
    return bits.to(torch.int32).view(torch.float32)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 bytes: exact, byte 0 = 2**-127 (subnormal), 255 = NaN."""
    b = scale.to(torch.int32)
    value = _pow2_from_exponent(b - 127)
    return torch.where(b == E8M0_NAN, torch.nan, value)


def e8m0_reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``2 ** (127 - b)`` (fp32), exact for every byte 0..254 (no flush of byte 0 to 1.0)."""
    b = scale.to(torch.int32)
    return torch.where(b == E8M0_NAN, torch.nan, _pow2_from_exponent(127 - b))


def pow2_ceil_scale(amax: torch.Tensor, elem_dtype: torch.dtype) -> torch.Tensor:
    """FP8 rowwise dequantization scale: the smallest power of two ``s`` with
    ``amax / s <= max_normal`` (the RCEIL rule at row granularity, which is also torchao's
    ``2 ** floor(log2(max / amax))`` quantization scale inverted), kept a normal fp32
    (``s >= 2**-126``) so that no kernel flushes it. NaN when amax is NaN or Inf."""
    b = scale_bytes(amax, elem_dtype, "rceil").clamp(min=1)
    return e8m0_to_float(b)
