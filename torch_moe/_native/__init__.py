"""Device kernels of the torch_moe ops (counterpart of ``aten/src/ATen/native/``).

``cpu`` holds ATen compositions tuned for CPU; they are registered for the CPU dispatch key.
The CUDA kernels are Triton kernels (:mod:`torch_moe._triton`), registered at the end wherever
triton is installed.
"""

import importlib.util

import torch

from torch_moe._native import cpu

_CPU_KERNELS = {
    "token_sort": cpu.token_sort,
    "permute": cpu.permute,
    "permute.out": cpu.permute_out_,
    "permute_backward": cpu.permute_backward,
    "unpermute": cpu.unpermute,
    "unpermute_backward": cpu.unpermute_backward,
    "grouped_mm": cpu.grouped_mm,
    "indexed_grouped_mm": cpu.indexed_grouped_mm,
    "indexed_grouped_mm_backward": cpu.indexed_grouped_mm_backward,
    "grouped_ffn": cpu.grouped_ffn,
    "grouped_ffn_backward": cpu.grouped_ffn_backward,
}

for _name, _fn in _CPU_KERNELS.items():
    torch.library.impl(f"torch_moe::{_name}", "CPU")(_fn)

# CUDA kernels wherever triton is installed, GPU or not: registering them imports no triton (see
# torch_moe._triton), and a machine without a GPU can then check what a GPU would run.
if importlib.util.find_spec("triton") is not None:
    from torch_moe._triton import register_cuda_kernels

    register_cuda_kernels()
