"""Reused storage for the expert-weight gradients of the CPU kernels.

A weight gradient of an MoE layer is large (``[E, D, F]``, 64 MiB for E=64, D=1024, F=256 in
fp32), far above glibc's largest mmap threshold (32 MiB): every allocation of one is a fresh
mapping whose pages fault in one by one (a fault per 4 KiB, each zero-filled by the kernel) and
every free returns it to the system. A training loop that sets ``.grad`` to None after each step
(``zero_grad(set_to_none=True)``, the default) therefore pays tens of thousands of page faults per
step for gradients of the same sizes as the step before: on a small batch (a decode-like step of
a few hundred tokens), more time than the expert GEMMs themselves.

This module keeps the storage of such gradients for reuse, as CUDA's caching allocator keeps
device memory: a buffer is handed out again only when nothing else refers to its storage (the
pool's own reference is the only one left), so a gradient still held as a ``.grad``, by an
optimizer, or anywhere else is never written into. AccumulateGrad adopts the returned tensor as
``.grad`` without a copy (its strides are the parameter's, see :mod:`._layouts`), so after
``zero_grad(set_to_none=True)`` the next backward finds it free. With ``set_to_none=False`` the
``.grad`` stays in use and the temporary gradient that autograd adds into it is what is reused.

Freed gradients stay cached, at most as many bytes as were live at once, until
:func:`empty_cache`. Only CPU buffers of at least :data:`MIN_BYTES` are pooled: smaller ones are
reused by malloc itself.
"""

import threading
from typing import Sequence

import torch

from torch_moe._compat import storage_use_count

__all__ = ["MIN_BYTES", "empty_strided", "empty_cache", "cached_bytes", "set_enabled",
           "is_enabled"]

# 1 MiB: below glibc's dynamic mmap threshold (128 KiB .. 32 MiB) a freed block goes back to the
# heap and is reused without faults once the threshold has adapted; above it, never.
MIN_BYTES = 1 << 20

_lock = threading.Lock()
_pool: dict[int, list[torch.UntypedStorage]] = {}  # bytes -> storages of exactly that size
_enabled = True


def _span_bytes(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of the storage a non-empty ``empty_strided(size, stride)`` needs."""
    elements = 1 + sum((n - 1) * s for n, s in zip(size, stride))
    return elements * dtype.itemsize


def empty_strided(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """``torch.empty_strided(size, stride)``, on pooled storage where it is large enough.

    Uninitialised, as ``empty_strided`` is: the caller writes every element it hands on."""
    device = torch.device(device)
    if not _enabled or device.type != "cpu" or 0 in size:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    nbytes = _span_bytes(size, stride, dtype)
    if nbytes < MIN_BYTES:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    with _lock:
        # under the lock from the check to the new tensor's reference: two threads can never
        # both see one storage free
        storages = _pool.setdefault(nbytes, [])
        storage = next((s for s in storages if storage_use_count(s) == 1), None)
        if storage is None:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
            storages.append(storage)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, size, stride)


def empty_cache() -> None:
    """Releases every cached storage that nothing else uses (as ``torch.cuda.empty_cache``)."""
    with _lock:
        for nbytes in list(_pool):
            kept = [s for s in _pool[nbytes] if storage_use_count(s) > 1]
            if kept:
                _pool[nbytes] = kept
            else:
                del _pool[nbytes]


def cached_bytes() -> tuple[int, int]:
    """``(total, free)``: bytes of the storages the pool holds, and of those nothing else uses."""
    with _lock:
        total = sum(nbytes * len(s) for nbytes, s in _pool.items())
        free = sum(nbytes for nbytes, s in _pool.items() for st in s
                   if storage_use_count(st) == 1)
    return total, free


def set_enabled(enabled: bool) -> None:
    """Turns pooling on (the default) or off; turning it off forgets every cached storage."""
    global _enabled
    with _lock:
        _enabled = bool(enabled)
        if not _enabled:
            # storages still in use are then freed by their last user, not kept for reuse
            _pool.clear()


def is_enabled() -> bool:
    return _enabled
