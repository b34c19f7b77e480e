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

Symmetric memory (``torch.distributed._symmetric_memory``, NVSHMEM on CUDA) is the dispatcher's
``backend="symm_mem"``: ``symm_mem::all_to_all_vdev`` moves rows whose split sizes live on the
device, so that a dropless exchange needs no host synchronisation. Its buffers are allocated
collectively and must be of the same size on every rank.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "all_to_all_single",
    "all_to_all_single_autograd",
    "wait_tensor",
    "object_collective_device",
    "symm_mem_unavailable_reason",
    "prepare_symm_mem",
    "symm_mem_empty",
    "all_to_all_vdev",
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


def _symm_mem():
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem


def symm_mem_unavailable_reason(device: torch.device, num_ranks: int) -> Optional[str]:
    """Why ``all_to_all_vdev`` cannot run on ``device`` over ``num_ranks`` ranks, or None when
    it can: it needs a CUDA device, a torch built with NVSHMEM, NVSHMEM as the symmetric-memory
    backend of the device (``torch.distributed._symmetric_memory.set_backend("NVSHMEM")``
    before the first symmetric allocation) and ``TORCH_SYMMMEM_NBLOCKS`` = ``num_ranks``: the
    kernel splits every peer's bytes evenly over its blocks and asserts when they do not divide,
    which for arbitrary row counts only one block per peer guarantees."""
    if device.type != "cuda":
        return f"it needs CUDA tensors, but got tensors on {device}"
    try:
        symm_mem = _symm_mem()
    except ImportError:
        return "this torch has no torch.distributed._symmetric_memory"
    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        return "this torch has no symm_mem::all_to_all_vdev"
    if not symm_mem.is_nvshmem_available():
        return "this torch was built without NVSHMEM"
    backend = symm_mem.get_backend(device)
    if backend is not None and backend != "NVSHMEM":
        return (f"the symmetric-memory backend of {device} is {backend!r}; call "
                "torch.distributed._symmetric_memory.set_backend('NVSHMEM') before the first "
                "symmetric allocation")
    blocks = os.environ.get("TORCH_SYMMMEM_NBLOCKS")
    if blocks != str(num_ranks):
        return (f"it needs TORCH_SYMMMEM_NBLOCKS={num_ranks} (one thread block per rank of the "
                f"group, set before the first exchange), but got {blocks!r}: the kernel asserts "
                "when a peer's bytes do not divide evenly over its blocks")
    return None


def prepare_symm_mem(device: torch.device, num_ranks: int) -> Optional[str]:
    """Sets up this process for ``backend="symm_mem"`` over groups of ``num_ranks`` ranks where
    torch has NVSHMEM: NVSHMEM as the symmetric-memory backend, and ``TORCH_SYMMMEM_NBLOCKS``
    (unless set already). Call it before the first symmetric allocation and exchange of the
    process. Returns :func:`symm_mem_unavailable_reason` afterwards."""
    if device.type == "cuda":
        symm_mem = _symm_mem()
        if symm_mem.is_nvshmem_available():
            if symm_mem.get_backend(device) != "NVSHMEM":
                symm_mem.set_backend("NVSHMEM")
            os.environ.setdefault("TORCH_SYMMMEM_NBLOCKS", str(num_ranks))
    return symm_mem_unavailable_reason(device, num_ranks)


def symm_mem_empty(shape: tuple, dtype: torch.dtype, device: torch.device,
                   group: dist.ProcessGroup) -> Tensor:
    """A symmetric-memory tensor of ``shape`` on ``device``, rendezvoused over ``group``
    (collective: every rank of ``group`` allocates the same shape)."""
    symm_mem = _symm_mem()
    t = symm_mem.empty(*shape, dtype=dtype, device=device)
    symm_mem.rendezvous(t, group.group_name)
    return t


def all_to_all_vdev(input: Tensor, out: Tensor, in_splits: Tensor, out_splits_offsets: Tensor,
                    group: dist.ProcessGroup) -> None:
    """``symm_mem::all_to_all_vdev`` along dim 0: ``input`` holds the rows for every destination
    packed in rank order, ``in_splits[d]`` of them for rank ``d`` (rows past their sum are not
    sent); writes into ``out`` the rows from every source packed in rank order and into
    ``out_splits_offsets [2, R]`` how many came from every source and where they start. All
    four are symmetric-memory tensors (:func:`symm_mem_empty`); the split sizes never leave the
    device."""
    torch.ops.symm_mem.all_to_all_vdev(input, out, in_splits, out_splits_offsets,
                                       group.group_name)
