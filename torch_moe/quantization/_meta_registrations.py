"""Fake (meta) kernels of the quantization ops (counterpart of ``torch/_meta_registrations.py``).

Each runs the metadata checks its device kernels run and returns empty tensors of the exact
output shapes and dtypes; every output size is a function of the input sizes.
"""

import torch

from torch_moe.quantization import _grouped_mm, _quantize, _scaled_grouped_mm
from torch_moe.quantization._checks import mx_scale_shape, rowwise_scale_shape


def _register(name):
    return torch.library.register_fake(f"torch_moe::{name}")


@_register("quantize_mxfp8")
def quantize_mxfp8_meta(x, dim=-1, elem_dtype=torch.float8_e4m3fn, scale_mode="rceil"):
    d = _quantize.check_quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    return (
        torch.empty(x.shape, dtype=elem_dtype, device=x.device),
        torch.empty(mx_scale_shape(x.shape, d), dtype=torch.uint8, device=x.device),
    )


@_register("dequantize_mxfp8")
def dequantize_mxfp8_meta(data, scale, dim=-1, out_dtype=torch.float32):
    _quantize.check_dequantize_mxfp8(data, scale, dim, out_dtype)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


@_register("quantize_fp8_rowwise")
def quantize_fp8_rowwise_meta(x, dim=-1, offs=None):
    d, G = _quantize.check_quantize_fp8_rowwise(x, dim, offs)
    return (
        torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
        torch.empty(rowwise_scale_shape(x.shape, d, G), dtype=torch.float32, device=x.device),
    )


@_register("dequantize_fp8_rowwise")
def dequantize_fp8_rowwise_meta(data, scale, dim=-1, offs=None, out_dtype=torch.float32):
    _quantize.check_dequantize_fp8_rowwise(data, scale, dim, offs, out_dtype)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


@_register("swizzle_mx_scale")
def swizzle_mx_scale_meta(scale):
    # scale [..., R, C] -> [..., round_up(R, 128) * round_up(C, 4)]
    _quantize.check_swizzle(scale)
    *batch, R, Cn = scale.shape
    n = _quantize._round_up(R, 128) * _quantize._round_up(Cn, 4)
    return torch.empty((*batch, n), dtype=torch.uint8, device=scale.device)


@_register("unswizzle_mx_scale")
def unswizzle_mx_scale_meta(swizzled, rows, cols):
    _quantize.check_unswizzle(swizzled, rows, cols)
    return torch.empty((*swizzled.shape[:-1], rows, cols), dtype=torch.uint8, device=swizzled.device)


@_register("scaled_grouped_mm")
def scaled_grouped_mm_meta(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
    _scaled_grouped_mm.check_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    shape = _scaled_grouped_mm.output_shape(mat_a, mat_b, offs)
    return torch.empty(shape, dtype=out_dtype, device=mat_a.device)


@_register("quantized_grouped_mm")
def quantized_grouped_mm_meta(input, weight, offs, recipe, scale_mode="rceil",
                              wgrad_high_precision=False):
    # input [M, K] @ weight [G, K, N] -> [M, N]
    _grouped_mm.check_quantized_grouped_mm(input, weight, offs, recipe, scale_mode)
    return input.new_empty((input.size(0), weight.size(2)))
