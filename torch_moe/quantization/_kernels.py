"""Registers the kernels of the quantization ops with the dispatcher.

* device-generic reference kernels (``CompositeExplicitAutograd``; a backend may override
  them): the quantizers of :mod:`torch_moe.quantization._quantize` and the trainable
  ``quantized_grouped_mm`` of :mod:`torch_moe.quantization._grouped_mm`;
* ``scaled_grouped_mm``: dequantize-and-GEMM emulation on CPU
  (:mod:`torch_moe.quantization._scaled_grouped_mm`);
* CUDA (:func:`register_cuda_kernels`): the scaled grouped GEMM of
  :mod:`torch_moe.quantization._cuda` (aten's kernel where the GPU has one, else a Triton or a
  bf16 emulation), wherever triton is installed, with or without a GPU, the Triton quantizers
  of :mod:`torch_moe.quantization._triton`, and the reference kernels for the other ops. Registering them imports no triton: the
  kernel registered for an op imports ``_triton`` on its first call, so ``import torch_moe``
  stays free of it, and a machine without a GPU still sees what a GPU dispatches to.
"""

import contextlib
import importlib.util
from typing import Callable

import torch

from torch_moe.quantization import _cuda, _grouped_mm, _quantize, _scaled_grouped_mm

__all__ = ["TRITON_KERNELS", "triton_kernel", "register_cuda_kernels"]

_DEVICE_GENERIC_KERNELS = {
    "quantize_mxfp8": _quantize.quantize_mxfp8,
    "dequantize_mxfp8": _quantize.dequantize_mxfp8,
    "quantize_fp8_rowwise": _quantize.quantize_fp8_rowwise,
    "dequantize_fp8_rowwise": _quantize.dequantize_fp8_rowwise,
    "swizzle_mx_scale": _quantize.swizzle_mx_scale,
    "unswizzle_mx_scale": _quantize.unswizzle_mx_scale,
    "quantized_grouped_mm": _grouped_mm.quantized_grouped_mm,
}

# the ops whose CUDA kernel is in torch_moe.quantization._triton (its KERNELS)
TRITON_KERNELS = ("quantize_mxfp8", "quantize_fp8_rowwise")
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_kernel(name: str) -> Callable:
    """The Triton implementation of ``torch_moe::<name>`` (imports ``_triton``, and so triton).
    It takes the op's arguments and runs on the current CUDA device; on fake tensors it launches
    nothing."""
    from torch_moe.quantization import _triton

    return _triton.KERNELS[name]


def _eager_kernel(name: str) -> Callable:
    def kernel(x, *args, **kwargs):
        # Triton launches on the current device. (The meta tensors that stand for CUDA ones,
        # where the CUDA path is checked for host synchronisation without a GPU, reach this
        # kernel too: they have no CUDA device to make current.)
        guard = torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            return triton_kernel(name)(x, *args, **kwargs)

    kernel.__name__ = kernel.__qualname__ = f"{name}_cuda"
    return kernel


_registered = False


def register_cuda_kernels() -> None:
    """Registers a CUDA kernel for every quantization op: ``scaled_grouped_mm``'s, the Triton
    quantizers (:data:`TRITON_KERNELS`) where triton is installed, and the reference kernels
    for the rest. Calling it again does nothing."""
    global _registered
    if _registered:
        return
    _cuda.register()
    triton_kernels = TRITON_KERNELS if _HAS_TRITON else ()
    for name, fn in _DEVICE_GENERIC_KERNELS.items():
        # the reference kernel, named for CUDA too, where no Triton kernel replaces it: what
        # runs on CUDA is then the CUDA key's kernel for every op, which is what tools that
        # follow the CUDA path (the tests' host-synchronisation walk) dispatch to
        kernel = _eager_kernel(name) if name in triton_kernels else fn
        torch.library.impl(f"torch_moe::{name}", "CUDA")(kernel)
    _registered = True


for _name, _fn in _DEVICE_GENERIC_KERNELS.items():
    torch.library.impl(f"torch_moe::{_name}", "CompositeExplicitAutograd")(_fn)

torch.library.impl("torch_moe::scaled_grouped_mm", "CPU")(_scaled_grouped_mm.scaled_grouped_mm_emulated)

register_cuda_kernels()
