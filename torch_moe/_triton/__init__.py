"""CUDA kernels of the torch_moe ops, in Triton (counterpart of ``aten/src/ATen/native/cuda``).

:func:`register_cuda_kernels` registers a CUDA kernel for every op of :mod:`torch_moe._ops`. It
is called by :mod:`torch_moe._native` wherever triton is installed, with or without a GPU, so that
a machine without one still checks what a GPU would dispatch to. It imports no triton: the kernel
registered for an op imports the module that implements it on its first call, so importing
torch_moe stays cheap (importing the kernel modules costs about a second, mostly torch's Triton
integration).

The contract of a kernel module ``torch_moe._triton.<module>`` (:data:`CUDA_KERNEL_MODULES`): it
defines ``KERNELS``, a dict from the public op's overload name (``"permute"``, ``"permute.out"``)
to a callable with that overload's arguments, which launches Triton kernels through
:func:`torch.library.wrap_triton` (directly, or through ``torch.library.triton_op``\\ s) and uses
ATen ops for the rest. None of it may read a tensor value on the host: every output size is a
function of input sizes (the fake kernels' promise), and a host read would synchronise the GPU
and break CUDA graph capture.

Dispatch of an op on CUDA tensors:

* eagerly, the CUDA dispatch key runs the module's kernel under a device guard of the tensors'
  device (Triton launches on the current device);
* while AOTAutograd traces (``torch.compile``), a FunctionalTensorMode rule calls the module's
  kernel instead of the op, so that Inductor sees the ``triton_kernel_wrapper_functional`` nodes
  and ATen ops it is made of, and compiles the Triton kernels as user-defined kernels rather than
  calling back into Python. ``torch.export`` keeps the public op.
"""

import importlib
from typing import Callable

import torch
from torch import Tensor

from torch_moe._compat import (
    functional_tensor_mode,
    is_plain_or_tracing_tensor_type,
    triton_op_decomposition_disabled,
)

__all__ = ["CUDA_KERNEL_MODULES", "cuda_kernel", "register_cuda_kernels"]

# overload of torch_moe::<op> -> the module of torch_moe._triton whose KERNELS implement it
CUDA_KERNEL_MODULES: dict[str, str] = {
    "token_sort": "token_sort",
    "permute": "permute",
    "permute.out": "permute",
    "permute_backward": "permute",
    "unpermute": "permute",
    "unpermute_backward": "permute",
    "grouped_mm": "grouped_mm",
    "indexed_grouped_mm": "grouped_mm",
    "indexed_grouped_mm_backward": "grouped_mm",
    "grouped_ffn": "grouped_ffn",
    "grouped_ffn_backward": "grouped_ffn",
}


def cuda_kernel(overload: str) -> Callable:
    """The Triton implementation of ``torch_moe::<overload>`` (imports its module, and so triton).

    It takes the op's arguments and runs on the current CUDA device; on fake tensors it launches
    nothing, so tracing it shows every ATen op the CUDA path runs.
    """
    module = importlib.import_module(f"torch_moe._triton.{CUDA_KERNEL_MODULES[overload]}")
    return module.KERNELS[overload]


def _first_tensor(args, kwargs) -> Tensor:
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            return a
    raise AssertionError("every torch_moe op takes a tensor")


def _eager_kernel(overload: str) -> Callable:
    def kernel(*args, **kwargs):
        with torch.cuda.device(_first_tensor(args, kwargs).device):
            return cuda_kernel(overload)(*args, **kwargs)

    kernel.__name__ = f"{overload.replace('.', '_')}_cuda"
    kernel.__qualname__ = kernel.__name__
    return kernel


def _plain_cuda_tensors(types, args, kwargs) -> bool:
    """Whether every tensor argument is on CUDA and none is a tensor subclass (other than the
    fake and functional tensors of tracing)."""
    if not all(is_plain_or_tracing_tensor_type(t) for t in types):
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
    return all(t.device.type == "cuda" for t in tensors)


def _decomposition_rule(overload: str) -> Callable:
    """A FunctionalTensorMode rule that runs the Triton implementation of ``overload`` in place
    of the op on CUDA tensors (see the module docstring); other devices keep the op."""

    def rule(mode, func, types, args, kwargs):
        if not triton_op_decomposition_disabled() and _plain_cuda_tensors(types, args, kwargs):
            with mode:
                return cuda_kernel(overload)(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    return rule


_registered = False


def register_cuda_kernels() -> None:
    """Registers the CUDA kernel and the tracing rule of every op in :data:`CUDA_KERNEL_MODULES`.
    Calling it again does nothing."""
    global _registered
    if _registered:
        return
    functional_mode = functional_tensor_mode()
    for overload in CUDA_KERNEL_MODULES:
        qualname = f"torch_moe::{overload}"
        torch.library.impl(qualname, "CUDA")(_eager_kernel(overload))
        torch.library.register_torch_dispatch(
            qualname, functional_mode, _decomposition_rule(overload)
        )
    _registered = True
