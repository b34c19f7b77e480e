"""ParallelStyles for Mixture-of-Experts layers (counterpart of
``torch.distributed.tensor.parallel``): :class:`ExpertParallel`, :class:`ExpertTensorParallel`
and :class:`TensorParallelExperts`, applied with
:func:`torch.distributed.tensor.parallel.parallelize_module`. See
:mod:`torch_moe.distributed.parallel.style` for the layouts and a worked example."""

from torch_moe.distributed.parallel.style import (
    ExpertParallel,
    ExpertTensorParallel,
    TensorParallelExperts,
)

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallelExperts"]
