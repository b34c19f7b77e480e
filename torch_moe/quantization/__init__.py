"""FP8 rowwise and MXFP8 quantization for MoE training.

Ops (``torch.ops.torch_moe``):

* ``quantize_mxfp8`` / ``dequantize_mxfp8``: OCP MX v1.0 blocks of 32 with E8M0 scale bytes,
  scale rules ``"rceil"`` (cuBLAS / TransformerEngine, the default) and ``"floor"`` (the spec);
* ``quantize_fp8_rowwise`` / ``dequantize_fp8_rowwise``: E4M3 with power-of-two fp32 scales
  per row, per column or per group;
* ``swizzle_mx_scale`` / ``unswizzle_mx_scale``: the 128x4 scale layout of Blackwell GEMMs;
* ``scaled_grouped_mm``: grouped GEMM on quantized operands;
* ``quantized_grouped_mm``: the trainable grouped GEMM that quantizes on the fly.

``torch_moe.nn.functional.moe_ffn(..., precision=)`` and ``MoEConfig(precision=)`` use them.
"""

import importlib.util

import torch

from torch_moe.quantization import _ops  # noqa: F401  (schemas first)
from torch_moe.quantization import _grouped_mm, _quantize, _scaled_grouped_mm
from torch_moe.quantization._checks import GROUP_ALIGNMENT, RECIPES
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

# "bf16": no quantization, GEMMs in the parameters' dtype.
PRECISIONS = ("bf16",) + RECIPES


def _register():
    def fake(name):
        return torch.library.register_fake(f"torch_moe::{name}")

    # Device-generic reference kernels (any backend may override them).
    generic = {
        "quantize_mxfp8": _quantize.quantize_mxfp8,
        "dequantize_mxfp8": _quantize.dequantize_mxfp8,
        "quantize_fp8_rowwise": _quantize.quantize_fp8_rowwise,
        "dequantize_fp8_rowwise": _quantize.dequantize_fp8_rowwise,
        "swizzle_mx_scale": _quantize.swizzle_mx_scale,
        "unswizzle_mx_scale": _quantize.unswizzle_mx_scale,
        "quantized_grouped_mm": _grouped_mm.quantized_grouped_mm,
    }
    for name, fn in generic.items():
        torch.library.impl(f"torch_moe::{name}", "CompositeExplicitAutograd")(fn)
    torch.library.impl("torch_moe::scaled_grouped_mm", "CPU")(
        _scaled_grouped_mm.scaled_grouped_mm_emulated
    )

    @fake("quantize_mxfp8")
    def _(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
        from torch_moe.quantization._checks import mx_scale_shape

        d = _quantize.check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
        return (
            torch.empty(x.shape, dtype=elem_dtype, device=x.device),
            torch.empty(mx_scale_shape(x.shape, d), dtype=torch.uint8, device=x.device),
        )

    @fake("dequantize_mxfp8")
    def _(data, scale, dim=-1, out_dtype=torch.float32):
        _quantize.check_dequantize_mxfp8(data, scale, dim, out_dtype)
        return torch.empty(data.shape, dtype=out_dtype, device=data.device)

    @fake("quantize_fp8_rowwise")
    def _(x, dim=-1, offs=None):
        from torch_moe.quantization._checks import rowwise_scale_shape

        d, G = _quantize.check_quantize_fp8_rowwise(x, dim, offs)
        return (
            torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
            torch.empty(rowwise_scale_shape(x.shape, d, G), dtype=torch.float32, device=x.device),
        )

    @fake("dequantize_fp8_rowwise")
    def _(data, scale, dim=-1, offs=None, out_dtype=torch.float32):
        _quantize.check_dequantize_fp8_rowwise(data, scale, dim, offs, out_dtype)
        return torch.empty(data.shape, dtype=out_dtype, device=data.device)

    @fake("swizzle_mx_scale")
    def _(scale):
        _quantize.check_swizzle(scale)
        *batch, R, Cn = scale.shape
        n = _quantize._round_up(R, 128) * _quantize._round_up(Cn, 4)
        return torch.empty((*batch, n), dtype=torch.uint8, device=scale.device)

    @fake("unswizzle_mx_scale")
    def _(swizzled, rows, cols):
        _quantize.check_unswizzle(swizzled, rows, cols)
        return torch.empty((*swizzled.shape[:-1], rows, cols), dtype=torch.uint8, device=swizzled.device)

    @fake("scaled_grouped_mm")
    def _(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
        _scaled_grouped_mm.check_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
        shape = _scaled_grouped_mm.output_shape(mat_a, mat_b, offs)
        return torch.empty(shape, dtype=out_dtype, device=mat_a.device)

    fake("quantized_grouped_mm")(_grouped_mm.quantized_grouped_mm_meta)
    torch.library.register_autograd(
        "torch_moe::quantized_grouped_mm", _grouped_mm._backward, setup_context=_grouped_mm._setup_context
    )


_register()


quantize_mxfp8 = torch.ops.torch_moe.quantize_mxfp8
dequantize_mxfp8 = torch.ops.torch_moe.dequantize_mxfp8
quantize_fp8_rowwise = torch.ops.torch_moe.quantize_fp8_rowwise
dequantize_fp8_rowwise = torch.ops.torch_moe.dequantize_fp8_rowwise
swizzle_mx_scale = torch.ops.torch_moe.swizzle_mx_scale
unswizzle_mx_scale = torch.ops.torch_moe.unswizzle_mx_scale
scaled_grouped_mm = torch.ops.torch_moe.scaled_grouped_mm
quantized_grouped_mm = torch.ops.torch_moe.quantized_grouped_mm

from torch_moe.quantization import _cuda  # noqa: E402  (CUDA kernel of scaled_grouped_mm)

_cuda.register()

if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    from torch_moe.quantization._triton import register_cuda_kernels
    register_cuda_kernels()
