"""Schemas of the torch_moe quantization ops (FP8 rowwise, MXFP8 and scaled grouped GEMMs).

Shape legend: as in :mod:`torch_moe._ops`; in addition ``B = 32`` is the MX block size and
``G`` the number of groups (experts) of a grouped GEMM.

Scale conventions (one for every op here, device independent):

* MXFP8 scales are E8M0 *bytes* (``uint8``; view them as ``torch.float8_e8m0fnu`` where an API
  wants that dtype). ``quantize_mxfp8(x, dim)`` returns a scale of ``x``'s shape with
  ``x.size(dim)`` replaced by ``x.size(dim) // 32``: one byte per block of 32 along ``dim``.
* FP8 rowwise scales are fp32 powers of two, *dequantization* scales (``x ~ data * scale``).
  ``quantize_fp8_rowwise(x, dim)`` reduces the whole of ``dim`` (scale size 1 along ``dim``);
  with ``offs`` it reduces each group of ``dim`` separately (scale size ``G`` along ``dim``).
* ``scaled_grouped_mm`` takes each operand's scale blocked (MXFP8) or reduced (FP8) along that
  operand's *contraction* dim, in the unswizzled layout above; device kernels that need the
  swizzled 128x4 layout build it themselves.
"""

import torch

from torch_moe._ops import lib

_PT2 = (torch.Tag.pt2_compliant_tag,)

#   x [..., K, ...] -> data [..., K, ...] (elem_dtype), scale uint8 [..., K / 32, ...]
lib.define(
    "quantize_mxfp8(Tensor x, int dim=-1, ScalarType elem_dtype=float8_e4m3fn, "
    "str scale_mode='rceil') -> (Tensor data, Tensor scale)",
    tags=_PT2,
)
lib.define(
    "dequantize_mxfp8(Tensor data, Tensor scale, int dim=-1, ScalarType out_dtype=float32) -> Tensor",
    tags=_PT2,
)
#   x [..., K, ...] -> data float8_e4m3fn [..., K, ...], scale fp32 [..., 1 or G, ...]
lib.define(
    "quantize_fp8_rowwise(Tensor x, int dim=-1, Tensor? offs=None) -> (Tensor data, Tensor scale)",
    tags=_PT2,
)
lib.define(
    "dequantize_fp8_rowwise(Tensor data, Tensor scale, int dim=-1, Tensor? offs=None, "
    "ScalarType out_dtype=float32) -> Tensor",
    tags=_PT2,
)
# The 128x4 tiled ("swizzled") scale layout of Blackwell block-scaled GEMMs:
#   scale uint8 [..., R, C] <-> [..., round_up(R, 128) * round_up(C, 4)]
lib.define("swizzle_mx_scale(Tensor scale) -> Tensor", tags=_PT2)
lib.define("unswizzle_mx_scale(Tensor swizzled, SymInt rows, SymInt cols) -> Tensor", tags=_PT2)

# Grouped GEMM on quantized operands, fp32 accumulation, one rounding to out_dtype:
#   2D x 3D: a [M, K] @ b [G, K, N] -> [M, N]      scale_a [M, K/32 | 1], scale_b [G, K/32 | 1, N]
#   2D x 2D: a [K, M] @ b [M, N]    -> [G, K, N]   scale_a [K, M/32 | G], scale_b [M/32 | G, N]
# offs [G] int32 group ends along M; every group a multiple of 32 (MXFP8) or 16 (FP8 rowwise).
lib.define(
    "scaled_grouped_mm(Tensor mat_a, Tensor mat_b, Tensor scale_a, Tensor scale_b, Tensor offs, "
    "ScalarType out_dtype=bfloat16) -> Tensor",
    tags=_PT2,
)

# Trainable grouped GEMM (2D x 3D) that quantizes its operands on the fly, along the
# contraction dim of each of its three GEMMs:
#   out [M, N] = input [M, K] @ weight [G, K, N]  (rows of input split by offs)
# recipe: 'fp8_rowwise' or 'mxfp8'; scale_mode: 'rceil' or 'floor' (MXFP8);
# wgrad_high_precision: compute grad_weight in the input dtype instead of FP8.
lib.define(
    "quantized_grouped_mm(Tensor input, Tensor weight, Tensor offs, str recipe, "
    "str scale_mode='rceil', bool wgrad_high_precision=False) -> Tensor",
    tags=_PT2,
)
