"""Triton kernels of the torch_moe ops for CUDA (counterpart of ``aten/src/ATen/native/cuda``).

Importing this package imports triton: :mod:`torch_moe._native` does so, and calls
:func:`register_cuda_kernels`, only where CUDA is available and triton is installed.
"""

from torch_moe._triton.grouped_mm import register_cuda_kernels

__all__ = ["register_cuda_kernels"]
