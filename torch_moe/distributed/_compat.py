"""The adapter of torch_moe's distributed code to the private parts of ``torch.distributed``.

Every private distributed API that the dispatcher, the ParallelStyles and the tools need
(``torch.distributed._functional_collectives``, the helpers of ``distributed_c10d``) is reached
through this module, so that a new torch release that renames one breaks one place. The ops
adapter :mod:`torch_moe._compat` holds the core ones (``assert_async``); DTensor's
sharding-strategy internals are in :mod:`torch_moe.distributed.tensor._compat`.

Functional collectives are what the dispatcher needs on both of its paths:

* in eager mode they return an ``AsyncCollectiveTensor``: the exchange runs in the background
  (gloo's worker threads, NCCL's stream) and the first use of the result waits for it, which is
  how chunked dispatch overlaps one chunk's all-to-all with another chunk's expert compute;
* ``all_to_all_single_autograd`` is differentiable (its backward is the reverse exchange);
* ``torch.compile`` traces them as ``_c10d_functional`` ops, so a capacity-mode layer (static
  split sizes) can be captured whole.

PyTorch has no public spelling of either; the functions here keep the signatures of
``torch.distributed.all_to_all_single`` (split sizes along dim 0, ``None`` for equal splits).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_to_all_single",
    "all_to_all_single_autograd",
    "wait_tensor",
    "object_collective_device",
]


_FUNCOL = None


def _funcol():
    # Imported on first use: importing torch_moe must not initialise the collectives. A module
    # global rather than functools.cache, which Dynamo traces through with a warning.
    global _FUNCOL
    if _FUNCOL is None:
        import torch.distributed._functional_collectives as funcol

        _FUNCOL = funcol
    return _FUNCOL


def all_to_all_single_autograd(
    t: Tensor, output_split_sizes: Optional[list[int]], input_split_sizes: Optional[list[int]],
    group: dist.ProcessGroup,
) -> Tensor:
    """``all_to_all_single`` of ``t`` along dim 0 whose backward is the reverse exchange. The
    result may still be in flight: it waits on first use."""
    return _funcol().all_to_all_single_autograd(t.contiguous(), output_split_sizes,
                                                input_split_sizes, group)


def all_to_all_single(
    t: Tensor, output_split_sizes: Optional[list[int]], input_split_sizes: Optional[list[int]],
    group: dist.ProcessGroup,
) -> Tensor:
    """Non-differentiable ``all_to_all_single`` of ``t`` along dim 0; may still be in flight
    (:func:`wait_tensor`)."""
    return _funcol().all_to_all_single(t.contiguous(), output_split_sizes, input_split_sizes,
                                       group)


def wait_tensor(t: Tensor) -> Tensor:
    """The plain tensor of a possibly in-flight non-differentiable collective result (a
    differentiable one waits by itself when an op first uses it); ``t`` itself otherwise."""
    return t.trigger_wait() if isinstance(t, _funcol().AsyncCollectiveTensor) else t


def object_collective_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose tensors ``group`` exchanges when there is no tensor to take one from,
    as ``all_gather_object`` chooses it: the group's one backend's device, or the CPU when it
    has several and one of them is the CPU's. A CUDA device is the current one."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return torch.device(_get_object_coll_device(group))
