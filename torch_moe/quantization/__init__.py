"""FP8 rowwise and MXFP8 quantization for MoE training.

Ops (``torch.ops.torch_moe``):

* ``quantize_mxfp8`` / ``dequantize_mxfp8``: OCP MX v1.0 blocks of 32 with E8M0 scale bytes,
  scale rules ``"rceil"`` (cuBLAS / TransformerEngine, the default) and ``"floor"`` (the spec);
* ``quantize_fp8_rowwise`` / ``dequantize_fp8_rowwise``: E4M3 with power-of-two fp32 scales
  per row, per column or per group;
* ``swizzle_mx_scale`` / ``unswizzle_mx_scale``: the 128x4 scale layout of Blackwell GEMMs;
* ``scaled_grouped_mm``: grouped GEMM on quantized operands;
* ``quantized_grouped_mm``: the trainable grouped GEMM that quantizes on the fly.

Laid out like the core ops: schemas in ``_ops``, fake kernels in ``_meta_registrations``,
kernels registered by ``_kernels``, the derivative of ``quantized_grouped_mm`` in ``_autograd``.
``torch_moe.nn.functional.moe_ffn(..., precision=)`` and ``MoEConfig(precision=)`` use them.
"""

import torch

from torch_moe.quantization import _ops  # noqa: F401  (defines the schemas first)
from torch_moe.quantization import _meta_registrations  # noqa: F401
from torch_moe.quantization import _kernels  # noqa: F401
from torch_moe.quantization import _autograd  # noqa: F401
from torch_moe.quantization._checks import GROUP_ALIGNMENT, PRECISIONS, RECIPES
from torch_moe.quantization._formats import BLOCK_SIZE, ELEM_DTYPES, SCALE_MODES

__all__ = [
    "BLOCK_SIZE",
    "ELEM_DTYPES",
    "GROUP_ALIGNMENT",
    "PRECISIONS",
    "RECIPES",
    "SCALE_MODES",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "quantize_fp8_rowwise",
    "dequantize_fp8_rowwise",
    "swizzle_mx_scale",
    "unswizzle_mx_scale",
    "scaled_grouped_mm",
    "quantized_grouped_mm",
]

quantize_mxfp8 = torch.ops.torch_moe.quantize_mxfp8
dequantize_mxfp8 = torch.ops.torch_moe.dequantize_mxfp8
quantize_fp8_rowwise = torch.ops.torch_moe.quantize_fp8_rowwise
dequantize_fp8_rowwise = torch.ops.torch_moe.dequantize_fp8_rowwise
swizzle_mx_scale = torch.ops.torch_moe.swizzle_mx_scale
unswizzle_mx_scale = torch.ops.torch_moe.unswizzle_mx_scale
scaled_grouped_mm = torch.ops.torch_moe.scaled_grouped_mm
quantized_grouped_mm = torch.ops.torch_moe.quantized_grouped_mm
