"""The one adapter of the private torch APIs of the dispatcher: ``torch.distributed.
_functional_collectives`` and the asynchronous device assertion.

Functional collectives are what the dispatcher needs on both of its paths:

* in eager mode they return an ``AsyncCollectiveTensor``: the exchange runs in the background
  (gloo's worker threads, NCCL's stream) and the first use of the result waits for it, which is
  how chunked dispatch overlaps one chunk's all-to-all with another chunk's expert compute;
* ``all_to_all_single_autograd`` is differentiable (its backward is the reverse exchange);
* ``torch.compile`` traces them as ``_c10d_functional`` ops, so a capacity-mode layer (static
  split sizes) can be captured whole.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_to_all", "all_to_all_differentiable", "assert_on_device", "default_device",
           "wait"]


def _funcol():
    import torch.distributed._functional_collectives as funcol

    return funcol


def all_to_all_differentiable(
    t: Tensor, output_splits: Optional[list[int]], input_splits: Optional[list[int]],
    group: dist.ProcessGroup,
) -> Tensor:
    """``all_to_all_single`` along dim 0 whose backward is the reverse exchange. The result may
    still be in flight: it waits on first use. ``None`` splits mean equal splits."""
    return _funcol().all_to_all_single_autograd(t.contiguous(), output_splits, input_splits, group)


def all_to_all(
    t: Tensor, output_splits: Optional[list[int]], input_splits: Optional[list[int]],
    group: dist.ProcessGroup,
) -> Tensor:
    """Non-differentiable ``all_to_all_single`` (expert ids, counts); may still be in flight."""
    return _funcol().all_to_all_single(t.contiguous(), output_splits, input_splits, group)


def wait(t: Tensor) -> Tensor:
    """The plain tensor of a possibly in-flight non-differentiable collective result (a
    differentiable one waits by itself when an op first uses it)."""
    return t.trigger_wait() if isinstance(t, _funcol().AsyncCollectiveTensor) else t


def assert_on_device(condition: Tensor, message: str) -> None:
    """Fails with ``message`` where the bool tensor ``condition`` is False, without a host read:
    a ``RuntimeError`` at once on CPU, a device-side assertion on CUDA (``torch._assert_async``,
    which also traces into a graph)."""
    torch._assert_async(condition, message)


def default_device(group: dist.ProcessGroup) -> torch.device:
    """The device whose tensors ``group`` exchanges without a tensor to take it from: its one
    backend's device, or the CPU when it has several and one of them is the CPU's (as
    ``all_gather_object`` chooses). A CUDA device is the current one."""
    from torch.distributed.distributed_c10d import _get_object_coll_device

    return torch.device(_get_object_coll_device(group))
