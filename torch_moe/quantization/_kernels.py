"""Registers the kernels of the quantization ops with the dispatcher.

* device-generic reference kernels (``CompositeExplicitAutograd``; a backend may override
  them): the quantizers of :mod:`torch_moe.quantization._quantize` and the trainable
  ``quantized_grouped_mm`` of :mod:`torch_moe.quantization._grouped_mm`;
* ``scaled_grouped_mm``: dequantize-and-GEMM emulation on CPU
  (:mod:`torch_moe.quantization._scaled_grouped_mm`), the cuBLAS-backed kernel on CUDA
  (:mod:`torch_moe.quantization._cuda`);
* Triton quantizers on CUDA (:mod:`torch_moe.quantization._triton`), only where CUDA is
  available and triton installed, so that importing torch_moe never imports triton on a
  machine that cannot run it.
"""

import importlib.util

import torch

from torch_moe.quantization import _cuda, _grouped_mm, _quantize, _scaled_grouped_mm

_DEVICE_GENERIC_KERNELS = {
    "quantize_mxfp8": _quantize.quantize_mxfp8,
    "dequantize_mxfp8": _quantize.dequantize_mxfp8,
    "quantize_fp8_rowwise": _quantize.quantize_fp8_rowwise,
    "dequantize_fp8_rowwise": _quantize.dequantize_fp8_rowwise,
    "swizzle_mx_scale": _quantize.swizzle_mx_scale,
    "unswizzle_mx_scale": _quantize.unswizzle_mx_scale,
    "quantized_grouped_mm": _grouped_mm.quantized_grouped_mm,
}

for _name, _fn in _DEVICE_GENERIC_KERNELS.items():
    torch.library.impl(f"torch_moe::{_name}", "CompositeExplicitAutograd")(_fn)

torch.library.impl("torch_moe::scaled_grouped_mm", "CPU")(_scaled_grouped_mm.scaled_grouped_mm_emulated)

_cuda.register()

if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    from torch_moe.quantization._triton import register_cuda_kernels

    register_cuda_kernels()
