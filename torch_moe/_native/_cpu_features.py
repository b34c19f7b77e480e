"""Which dtypes the CPU kernels compute their GEMMs in.

The CPU kernels run GEMMs in the input dtype only where the CPU has native instructions for it.
Without AVX512-BF16 / AMX (e.g. an AVX2-only CPU), ``torch.mm`` on bf16 or fp16 falls to a
scalar path about a hundred times slower than fp32 GEMM; there the kernels convert operands to
fp32, which is also what a native bf16 GEMM accumulates in, so results only get more accurate.
"""

import torch

from torch_moe._compat import mkldnn_native_gemm_dtypes

__all__ = ["gemm_compute_dtype"]


def gemm_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a CPU GEMM on ``dtype`` operands is computed."""
    if dtype in (torch.float32, torch.float64) or dtype in mkldnn_native_gemm_dtypes():
        return dtype
    return torch.float32


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of sums across experts (combine, grad_x): never below fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
