"""Scalar references of the FP8 / MXFP8 quantizers, written from the definitions.

Everything is plain Python arithmetic on exact rationals (``fractions.Fraction``) element by
element: the spec's ``floor(log2(amax)) - emax`` for FLOOR, "the smallest power of two not
below fl32(amax * fl32(1 / max))" for RCEIL, and round-to-nearest-even onto the finite values
of the element format, found by search in the table of all its codes. No bit tricks, so the
kernels' integer arithmetic is checked against an independent derivation. Slow: small inputs.
"""

import math
import struct
from fractions import Fraction

import torch

__all__ = ["quantize_mxfp8", "quantize_fp8_rowwise", "fl32"]

_FORMATS = {torch.float8_e4m3fn: (448, 8), torch.float8_e5m2: (57344, 15)}


def fl32(x: float) -> float:
    """Round a Python float to the nearest fp32 (ties to even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _finite_codes(dtype):
    """[(value as Fraction, code)] of every finite non-negative value of an FP8 format."""
    codes = torch.arange(128, dtype=torch.uint8)
    values = codes.view(dtype).float().tolist()
    return sorted((Fraction(v), c) for v, c in zip(values, range(128)) if math.isfinite(v))


_TABLES = {}


def _round_to_elem(v: float, scale_exponent: int, dtype) -> int:
    """Code of ``v / 2**scale_exponent`` rounded to nearest (ties to the even code) with
    saturation; the sign of ``v`` is kept (-0.0 and values that round to zero give -0)."""
    table = _TABLES.setdefault(dtype, _finite_codes(dtype))
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = abs(Fraction(v)) / Fraction(2) ** scale_exponent
    if a >= table[-1][0]:
        return sign | table[-1][1]
    for (lo, lo_code), (hi, hi_code) in zip(table, table[1:]):
        if lo <= a <= hi:
            if a - lo < hi - a:
                return sign | lo_code
            if a - lo > hi - a:
                return sign | hi_code
            return sign | (lo_code if lo_code % 2 == 0 else hi_code)
    raise AssertionError("unreachable")


def _nan_code() -> int:
    # the positive NaN code of both formats (E5M2 also has 0x7D, 0x7E)
    return 0x7F


def _scale_exponent(amax: float, dtype, scale_mode: str) -> int:
    max_normal, emax = _FORMATS[dtype]
    if scale_mode == "floor":
        e = math.floor(math.log2(Fraction(amax))) if amax >= 2.0**-126 else -127
        # log2 of a Fraction goes through float; correct it exactly
        if amax >= 2.0**-126:
            while Fraction(2) ** (e + 1) <= Fraction(amax):
                e += 1
            while Fraction(2) ** e > Fraction(amax):
                e -= 1
        return min(max(e - emax, -127), 127)
    d = Fraction(fl32(amax * fl32(1.0 / max_normal)))
    e = -127
    while Fraction(2) ** e < d:
        e += 1
    return e


def quantize_mxfp8(x: torch.Tensor, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
    """Blocks of 32 along the last dim of a 2-D ``x``: ``(data bytes [R, K], scale bytes [R, K/32])``
    as lists of ints."""
    rows = x.float().tolist()
    data, scales = [], []
    for row in rows:
        drow, srow = [], []
        for b0 in range(0, len(row), 32):
            block = row[b0:b0 + 32]
            if not all(math.isfinite(v) for v in block):
                srow.append(255)
                drow.extend([_nan_code()] * len(block))
                continue
            amax = max(abs(v) for v in block)
            e = _scale_exponent(amax, elem_dtype, scale_mode)
            srow.append(e + 127)
            drow.extend(_round_to_elem(v, e, elem_dtype) for v in block)
        data.append(drow)
        scales.append(srow)
    return data, scales


def quantize_fp8_rowwise(x: torch.Tensor):
    """Per row of a 2-D ``x``: ``(data bytes [R, K], scale [R] as floats)``: the scale is the
    smallest power of two s >= 2**-126 with amax / s <= 448 (NaN for a non-finite row)."""
    data, scales = [], []
    for row in x.float().tolist():
        if not all(math.isfinite(v) for v in row):
            scales.append(float("nan"))
            data.append([_nan_code()] * len(row))
            continue
        amax = Fraction(max(abs(v) for v in row))
        e = -126
        while amax / Fraction(2) ** e > 448:
            e += 1
        scales.append(2.0**e)
        data.append([_round_to_elem(v, e, torch.float8_e4m3fn) for v in row])
    return data, scales
