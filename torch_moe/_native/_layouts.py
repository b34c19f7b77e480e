"""The memory layout of the weight-gradient buffers that the kernels allocate.

A weight is often a permuted view of its storage: HuggingFace stores an expert projection as
``[E, F, D]`` (``nn.Linear`` style) and torch_moe computes with its transpose ``[E, D, F]``.
AccumulateGrad keeps a gradient whose strides match its parameter's and otherwise copies it into
the parameter's layout: a gradient allocated contiguous for such a view costs a transposing copy
of every weight gradient on every step. So every kernel (CPU, fake, Triton) allocates a weight
gradient in its weight's strides when those describe a dense, non-overlapping tensor (every
element of one block of memory, in some order of the dims), and contiguous otherwise (an
expanded or sliced weight, whose strides cannot be allocated as they are). The CPU and the fake
kernels share this function, so their strides agree.
"""

from typing import Optional

import torch

__all__ = ["empty_weight_grad", "is_dense_permutation", "weight_grad_strides"]


def is_dense_permutation(t: torch.Tensor) -> bool:
    """Whether the strides of ``t`` are the contiguous strides of some permutation of its dims:
    ``t`` then covers one block of ``t.numel()`` elements exactly once.

    Dims of size 1 take any stride (they never step); a tensor without elements is not dense.
    """
    if t.numel() == 0:
        return False
    dims = [d for d in range(t.dim()) if t.size(d) != 1]
    # innermost first: the dim of the smallest stride must step by one element, each next one by
    # the extent of the dims inside it
    dims.sort(key=lambda d: t.stride(d))
    extent = 1
    for d in dims:
        if t.stride(d) != extent:
            return False
        extent *= t.size(d)
    return True


def weight_grad_strides(weight: torch.Tensor) -> tuple[int, ...]:
    """The strides of a gradient for ``weight``: the weight's own where it is dense and
    non-overlapping (:func:`is_dense_permutation`), contiguous otherwise."""
    if is_dense_permutation(weight):
        return weight.stride()
    strides, step = [], 1
    for n in reversed(weight.shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def empty_weight_grad(weight: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """An uninitialised gradient for ``weight`` (in ``dtype``, default the weight's), in the
    strides of :func:`weight_grad_strides`."""
    dtype = weight.dtype if dtype is None else dtype
    return torch.empty_strided(weight.size(), weight_grad_strides(weight), dtype=dtype,
                               device=weight.device)
