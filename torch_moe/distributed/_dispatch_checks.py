"""The local argument checks of the expert-parallel dispatcher: what one rank can tell of its
own arguments (types, shapes, dtypes, devices, options) before the header exchange, which
carries a failure to every rank."""

from __future__ import annotations

import math
import numbers
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe._checks import ACTIVATIONS, GATED_ACTIVATIONS
from torch_moe.distributed._compat import symm_mem_unavailable_reason
from torch_moe.distributed._dispatch_header import _DTYPES, _FN, _MAX_CHUNKS, BACKENDS


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _as_float(v) -> Optional[float]:
    """``float(v)`` for a real number other than a bool that a float can hold, else None."""
    if not isinstance(v, numbers.Real) or isinstance(v, bool):
        return None
    try:
        return float(v)
    except OverflowError:  # an int beyond the range of a double
        return None


def _resolve_group(group) -> tuple[dist.ProcessGroup, int]:
    """The expert-parallel group and its size. Its errors are raised locally: without a group
    there is no one to tell."""
    if group is None:
        if not dist.is_initialized():
            raise ValueError(f"{_FN}: expected a process group, or group=None with an "
                             "initialized default process group (init_process_group), but got "
                             "group=None and no default process group")
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{_FN}: expected group to be a ProcessGroup or None, but got "
                        f"{type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError(f"{_FN}: expected this process to be a member of group, but got a "
                         f"group of the global ranks {dist.get_process_group_ranks(group)} "
                         f"without {dist.get_rank()}")
    return group, dist.get_world_size(group)


def _check_tensors(x, topk_ids, topk_weights, num_experts, num_ranks):
    for name, t in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{_FN}: expected {name} to be a Tensor, but got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{_FN}: expected x to be 2-D [T, D], but got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{_FN}: expected x.dtype in {list(_DTYPES)}, but got {x.dtype}")
    if x.device.type == "meta":
        raise ValueError(f"{_FN}: expected x on a device with data (its rows are sent to other "
                         "ranks), but got meta")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"{_FN}: expected topk_ids and topk_weights of the same shape [T, k], but got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.size(0) != x.size(0):
        raise ValueError(f"{_FN}: expected topk_ids.size(0) == x.size(0) = {x.size(0)} tokens, "
                         f"but got {topk_ids.size(0)}")
    dt = topk_ids.dtype
    if dt.is_floating_point or dt.is_complex or dt == torch.bool:
        raise ValueError(f"{_FN}: expected an integer topk_ids, but got {dt}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"{_FN}: expected a floating topk_weights, but got {topk_weights.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{_FN}: expected {name} on the device of x ({x.device}), but got "
                             f"{t.device}")
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"{_FN}: expected num_experts to be a positive int, but got "
                         f"{num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"{_FN}: expected num_experts divisible by the {num_ranks} ranks of "
                         f"the group, but got num_experts={num_experts}")
    k = topk_ids.size(1)
    if not 1 <= k <= num_experts:
        raise ValueError(f"{_FN}: expected top-k = topk_ids.size(1) in [1, num_experts = "
                         f"{num_experts}], but got {k}")


def _check_experts(w1, w2, w3, x, G, activation):
    D = x.size(1)
    for name, w in (("w1_local", w1), ("w2_local", w2), ("w3_local", w3)):
        if w is None and name != "w3_local":
            raise TypeError(f"{_FN}: expected {name} to be a Tensor, but got None")
        if w is not None and not isinstance(w, Tensor):
            raise TypeError(f"{_FN}: expected {name} to be a Tensor, but got {type(w).__name__}")
        if w is not None and (w.dtype != x.dtype or w.device != x.device):
            raise ValueError(f"{_FN}: expected {name} on {x.device} in {x.dtype} like x, but "
                             f"got {w.device} {w.dtype}")
    if w1.dim() != 3 or w1.size(0) != G or w1.size(1) != D:
        raise ValueError(f"{_FN}: expected w1_local [{G}, {D}, F] (num_experts / world_size "
                         f"experts of dim D), but got {tuple(w1.shape)}")
    if w2.dim() != 3 or w2.size(0) != G or w2.size(2) != D:
        raise ValueError(f"{_FN}: expected w2_local [{G}, F, {D}], but got {tuple(w2.shape)}")
    F = w2.size(1)
    gated = activation in GATED_ACTIVATIONS
    if w3 is not None and not gated:
        raise ValueError(f"{_FN}: expected w3_local=None for activation {activation!r}, which "
                         f"is not gated, but got {tuple(w3.shape)}")
    if w3 is not None and w3.shape != w1.shape:
        raise ValueError(f"{_FN}: expected w3_local of the shape of w1_local {tuple(w1.shape)}, "
                         f"but got {tuple(w3.shape)}")
    want = 2 * F if gated and w3 is None else F
    if w1.size(2) != want:
        raise ValueError(f"{_FN}: expected w1_local.size(2) = {want} ("
                         f"{'2 * ' if want != F else ''}w2_local.size(1)), but got {w1.size(2)}")


def _check_options(activation, dedup, num_chunks, capacity_factor, alpha, limit, sync_free,
                   backend):
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_FN}: expected activation in {ACTIVATIONS}, but got {activation!r}")
    if not isinstance(dedup, bool):
        raise ValueError(f"{_FN}: expected dedup to be a bool, but got {dedup!r}")
    if not _is_int(num_chunks) or not 1 <= num_chunks <= _MAX_CHUNKS:
        raise ValueError(f"{_FN}: expected num_chunks to be an int in [1, {_MAX_CHUNKS}], but "
                         f"got {num_chunks!r}")
    factor = _as_float(capacity_factor)
    if capacity_factor is not None and not (
            factor is not None and math.isfinite(factor) and factor > 0):
        raise ValueError(f"{_FN}: expected capacity_factor to be a finite number > 0 or None, "
                         f"but got {capacity_factor!r}")
    if not isinstance(sync_free, bool):
        raise ValueError(f"{_FN}: expected sync_free to be a bool, but got {sync_free!r}")
    if sync_free and capacity_factor is None:
        raise ValueError(f"{_FN}: expected a capacity_factor with sync_free=True (only capacity "
                         "mode has split sizes that every rank knows without an exchange), but "
                         "got capacity_factor=None")
    if backend not in BACKENDS:
        raise ValueError(f"{_FN}: expected backend in {BACKENDS}, but got {backend!r}")
    if backend == "symm_mem" and (capacity_factor is not None or sync_free):
        raise ValueError(f"{_FN}: expected backend='symm_mem' without capacity_factor and "
                         "sync_free (it runs the exact mode without a host read; capacity mode "
                         "has static split sizes, which the default backend exchanges with "
                         f"sync_free=True), but got capacity_factor={capacity_factor!r}, "
                         f"sync_free={sync_free!r}")
    for name, v in (("alpha", alpha), ("limit", limit)):
        value = _as_float(v)
        if value is None or math.isnan(value):
            raise ValueError(f"{_FN}: expected {name} to be a number (not NaN, within the range "
                             f"of a float), but got {v!r}")


def _local_check_error(x, topk_ids, topk_weights, w1, w2, w3, *, num_experts, num_ranks,
                       activation, alpha, limit, dedup, num_chunks,
                       capacity_factor, sync_free, backend) -> Optional[Exception]:
    """The error of the first local check (shapes, dtypes, devices, options) that this rank's
    arguments fail, or None. It is raised with the group (:func:`_raise_with_the_group`)."""
    try:
        _check_tensors(x, topk_ids, topk_weights, num_experts, num_ranks)
        _check_options(activation, dedup, num_chunks, capacity_factor, alpha, limit, sync_free,
                       backend)
        if backend == "symm_mem":
            reason = symm_mem_unavailable_reason(x.device, num_ranks)
            if reason is not None:
                raise ValueError(f"{_FN}: backend='symm_mem' cannot run here: {reason}")
        _check_experts(w1, w2, w3, x, num_experts // num_ranks, activation)
    except (TypeError, ValueError) as e:
        return e
    return None
