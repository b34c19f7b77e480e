"""Triton kernels of the permute family: ``torch_moe::permute`` (and ``permute.out``),
``permute_backward``, ``unpermute`` and ``unpermute_backward``.

Notation: T tokens, k = top_k, D columns, S sorted slots; ``sorted_ids [S]`` holds the flat
assignment ``a = t * k + j`` of each slot, or -1 for a padded (or dropped) slot.

Three row kernels, tiled over ``[rows, D]`` with 64-bit offsets (a row index times a stride can
pass 2**31 elements), masked along D so that any D works, and with the contiguous dimension
loaded as one vector per thread:

* ``_gather_rows_kernel``: one row per slot, ``out[i] = src[a_i // k]`` (times the routing
  weight of ``a_i`` for the ``grad_y`` of ``unpermute_backward``), an exact zero row for a padded
  slot. It is ``permute`` and the ``grad_y`` of ``unpermute_backward``.
* ``_combine_rows_kernel``: one row per token, ``out[t] = sum_j (w[t, j] *) src[slot[t * k + j]]``
  summed in fp32 (fp64 for fp64) in the order ``j = 0 .. k-1`` and rounded once. Each program
  owns its output tile, so there are no atomic adds and the result is the same on every run.
  It is ``permute_backward`` and ``unpermute``.
* ``_weight_grad_kernel``: one value per assignment, ``grad_w[a] = <grad[a // k], y[slot[a]]>``,
  zero for an absent assignment (``unpermute_backward``).

The combine and the weight gradient read the inverse map ``slot[a]`` (``[T * k]``, -1 for an
assignment that no slot holds: dropped by a capacity, or never routed), built by
``_inverse_map_kernel`` with one atomic exchange per slot. The exchange is also the duplicate check:
an assignment written twice returns a previous writer instead of -1. It is the only atomic of
these kernels, and for valid ids each entry is written once: the map, and so every output, is the
same on every run (``torch.use_deterministic_algorithms`` asks no more). That kernel counts, per
program, the ids out of ``[-1, T * k)`` and the duplicates; their sums are checked with
:func:`torch_moe._compat.assert_async`, a device-side assertion that does not synchronise the host
(on CPU tensors, under ``TRITON_INTERPRET=1``, it raises at once as the CPU op does). With
``TRITON_DEBUG=1`` the kernels also assert on the device where the bad value is met. Invalid ids
never address memory: an id out of range is read as padding, and the slot of a duplicated
assignment is one of its writers. Every op runs the check, so an op raises on the same input as
its CPU kernel.

Every id, slot and weight of an absent assignment is masked before it is used: a padded slot reads
no row, and neither the rows of a padded slot of ``grad`` nor the weight of a dropped assignment
(which may hold NaN) reach an output.

Each op is a :func:`torch.library.triton_op` (``torch_moe::_triton_<op>``) launching its kernels
through :func:`torch.library.wrap_triton`: under ``torch.compile`` the graph holds
``triton_kernel_wrapper_functional`` nodes, which Inductor compiles as user-defined kernels.
:data:`KERNELS` makes them the CUDA kernels of the public ops (see :mod:`torch_moe._triton`).
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from torch_moe import _checks
from torch_moe._compat import assert_async
from torch_moe._triton.grouped_mm import _acc_zeros

__all__ = [
    "KERNELS",
    "RowConfig",
    "permute",
    "permute_backward",
    "permute_out",
    "unpermute",
    "unpermute_backward",
]


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _inverse_map_kernel(
    ids_ptr,
    slot_ptr,
    errors_ptr,
    num_slots,
    num_assignments,
    stride_ids,
    num_programs,
    BLOCK: tl.constexpr,
):
    """``slot[ids[i]] = i`` for the ids in ``[0, num_assignments)``.

    Shapes: ids ``[num_slots]`` int64; slot ``[num_assignments]`` int32 (int64 past 2**31 - 1
    slots), -1 on entry; errors
    ``[2, num_programs]`` int32: per program, the ids out of ``[-1, num_assignments)`` (row 0) and
    the assignments found already written (row 1). grid = ``(cdiv(num_slots, BLOCK),)``.
    """
    pid = tl.program_id(0)
    slots = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    slot_ok = slots < num_slots
    ids = tl.load(ids_ptr + slots * stride_ids, mask=slot_ok, other=-1)
    in_range = (ids >= -1) & (ids < num_assignments)
    tl.device_assert(in_range, "sorted_ids out of [-1, top_k * num_tokens)")
    valid = slot_ok & (ids >= 0) & in_range
    # relaxed: each exchange only needs to be atomic; the kernel boundary orders it for readers
    previous = tl.atomic_xchg(
        slot_ptr + ids, slots.to(slot_ptr.dtype.element_ty), mask=valid, sem="relaxed"
    )
    duplicate = valid & (previous != -1)
    tl.device_assert(~duplicate, "an assignment t * k + j occurs twice in sorted_ids")
    tl.store(errors_ptr + pid, tl.sum((slot_ok & ~in_range).to(tl.int32), 0))
    tl.store(errors_ptr + num_programs + pid, tl.sum(duplicate.to(tl.int32), 0))


@triton.jit
def _gather_rows_kernel(
    src_ptr,
    ids_ptr,
    weight_ptr,
    out_ptr,
    num_slots,
    D,
    num_assignments,
    top_k,
    stride_ids,
    stride_sm,
    stride_sd,
    stride_wt,
    stride_wk,
    stride_om,
    stride_od,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: a ``[BLOCK_M, BLOCK_D]`` tile of ``out[i] = src[ids[i] // k]`` (``* w``).

    Shapes: src ``[T, D]``; ids ``[num_slots]`` int64 (``num_assignments = T * k``); weight
    ``[T, k]`` (any float dtype) with ``HAS_WEIGHT``; out ``[num_slots, D]``.
    grid = ``(cdiv(num_slots, BLOCK_M) * cdiv(D, BLOCK_D),)``.
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(D, BLOCK_D)
    rows = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ((pid % col_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    row_ok = rows < num_slots
    col_ok = cols < D

    ids = tl.load(ids_ptr + rows * stride_ids, mask=row_ok, other=-1)
    valid = row_ok & (ids >= 0) & (ids < num_assignments)
    ids = tl.where(valid, ids, 0)
    # top_k is 0 only for a [T, 0] topk_weights, where every slot is padding
    tokens = ids // tl.maximum(top_k, 1)
    mask = valid[:, None] & col_ok[None, :]
    vals = tl.load(
        src_ptr + tokens[:, None] * stride_sm + cols[None, :] * stride_sd, mask=mask, other=0
    )
    if HAS_WEIGHT:
        acc = _acc_zeros(src_ptr, BLOCK_M, BLOCK_D)
        w = tl.load(
            weight_ptr + tokens * stride_wt + (ids - tokens * top_k) * stride_wk,
            mask=valid,
            other=0.0,
        )
        # the CPU kernel scales by the weight rounded to the rows' dtype: the product of two
        # values of that dtype is exact in the accumulator, and rounded once below
        w = w.to(acc.dtype).to(out_ptr.dtype.element_ty).to(acc.dtype)
        vals = vals.to(acc.dtype) * w[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_od
    tl.store(out_ptrs, vals.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _combine_rows_kernel(
    src_ptr,
    slot_ptr,
    weight_ptr,
    out_ptr,
    num_tokens,
    D,
    top_k,
    stride_sm,
    stride_sd,
    stride_wt,
    stride_wk,
    stride_om,
    stride_od,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: a ``[BLOCK_M, BLOCK_D]`` tile of ``out[t] = sum_j (w[t, j] *) src[slot]``.

    Shapes: src ``[S, D]``; slot ``[num_tokens * top_k]`` int32 or int64 (-1: absent); weight
    ``[num_tokens, top_k]`` (any float dtype) with ``HAS_WEIGHT``; out ``[num_tokens, D]``.
    grid = ``(cdiv(num_tokens, BLOCK_M) * cdiv(D, BLOCK_D),)``.
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(D, BLOCK_D)
    tokens = (pid // col_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ((pid % col_tiles) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    token_ok = tokens < num_tokens
    col_ok = cols < D

    acc = _acc_zeros(src_ptr, BLOCK_M, BLOCK_D)
    for j in range(0, top_k):
        slots = tl.load(slot_ptr + tokens * top_k + j, mask=token_ok, other=-1).to(tl.int64)
        present = token_ok & (slots >= 0)
        rows = tl.load(
            src_ptr + slots[:, None] * stride_sm + cols[None, :] * stride_sd,
            mask=present[:, None] & col_ok[None, :],
            other=0.0,
        ).to(acc.dtype)
        if HAS_WEIGHT:
            # the weight of an absent assignment is not read: it may hold anything, NaN included
            w = tl.load(weight_ptr + tokens * stride_wt + j * stride_wk, mask=present, other=0.0)
            acc += rows * w.to(acc.dtype)[:, None]
        else:
            acc += rows
    out_ptrs = out_ptr + tokens[:, None] * stride_om + cols[None, :] * stride_od
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_grad_kernel(
    grad_ptr,
    y_ptr,
    slot_ptr,
    out_ptr,
    num_assignments,
    D,
    top_k,
    stride_gt,
    stride_gd,
    stride_ym,
    stride_yd,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program: ``out[a] = <grad[a // k], y[slot[a]]>`` for ``BLOCK_M`` assignments.

    Shapes: grad ``[T, D]``; y ``[S, D]``; slot ``[num_assignments]`` int32 or int64 (-1: absent,
    which gives 0); out ``[num_assignments]`` contiguous.
    grid = ``(cdiv(num_assignments, BLOCK_M),)``.
    """
    pid = tl.program_id(0)
    asg = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    asg_ok = asg < num_assignments
    slots = tl.load(slot_ptr + asg, mask=asg_ok, other=-1).to(tl.int64)
    present = asg_ok & (slots >= 0)
    tokens = asg // top_k

    acc = _acc_zeros(y_ptr, BLOCK_M, BLOCK_D)
    for d in range(0, D, BLOCK_D):
        cols = (d + tl.arange(0, BLOCK_D)).to(tl.int64)
        mask = present[:, None] & (cols < D)[None, :]
        g = tl.load(grad_ptr + tokens[:, None] * stride_gt + cols[None, :] * stride_gd,
                    mask=mask, other=0.0)
        y = tl.load(y_ptr + slots[:, None] * stride_ym + cols[None, :] * stride_yd,
                    mask=mask, other=0.0)
        acc += g.to(acc.dtype) * y.to(acc.dtype)
    dot = tl.sum(acc, 1)
    tl.store(out_ptr + asg, dot.to(out_ptr.dtype.element_ty), mask=asg_ok)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


class RowConfig(NamedTuple):
    """Tile sizes (powers of two) and launch parameters of the row kernels."""

    block_rows: int  # slots, tokens or assignments per program
    block_d: int  # columns per program (per step of the weight gradient's loop over D)
    block_slots: int = 1024  # slots per program of the inverse map
    num_warps: int = 4


def _block(n, low: int, high: int) -> int:
    """The smallest power of two in [low, high] that is >= n (``high`` if none is).

    Written with comparisons only, so that a symbolic ``n`` gives guards, not errors.
    """
    b = low
    while b < high and b < n:
        b *= 2
    return b


# elements of a program's tile: with 4 warps, 32 per thread, so a 16-bit row is read as four
# 16-byte vectors per thread and the fp32 accumulator of the combine fits in registers
_TILE_ELEMENTS = 4096


def _default_config(D) -> RowConfig:
    # Columns first (wide rows are read as full contiguous vectors), up to 1024: D up to 8192
    # takes a few column tiles; the rows fill the rest of the tile, so narrow rows still give a
    # program enough work. A memory-bound copy needs no search beyond this.
    block_d = _block(D, 16, 1024)
    return RowConfig(block_rows=_TILE_ELEMENTS // block_d, block_d=block_d)


def _inverse_slots(op: str, sorted_ids: Tensor, num_assignments, cfg: RowConfig) -> Tensor:
    """``slot [num_assignments]``: ``slot[a] = i`` where ``sorted_ids[i] == a``, else -1; int32
    (half the traffic of int64) unless there are more slots than an int32 counts.

    Also the value checks of the CPU kernel (``_check_index_range`` and
    ``_check_unique_assignments``), as device-side assertions: ids in ``[-1, num_assignments)``,
    each assignment at most once.
    """
    num_slots = sorted_ids.size(0)
    index_dtype = torch.int32 if num_slots <= 2**31 - 1 else torch.int64
    slot = torch.full((num_assignments,), -1, dtype=index_dtype, device=sorted_ids.device)
    if num_slots == 0:
        return slot
    programs = triton.cdiv(num_slots, cfg.block_slots)
    errors = sorted_ids.new_empty((2, programs), dtype=torch.int32)
    wrap_triton(_inverse_map_kernel)[(programs,)](
        sorted_ids,
        slot,
        errors,
        num_slots,
        num_assignments,
        sorted_ids.stride(0),
        programs,
        BLOCK=cfg.block_slots,
    )
    out_of_range, duplicates = errors.sum(1).unbind()
    assert_async(
        out_of_range == 0,
        f"{op}: expected sorted_ids values in [-1, {num_assignments}) (-1 marks padding)",
    )
    assert_async(
        duplicates == 0,
        f"{op}: expected each assignment t * k + j at most once in sorted_ids",
    )
    return slot


def _launch_gather(
    src: Tensor,
    sorted_ids: Tensor,
    top_k,
    num_assignments,
    weight: Optional[Tensor],
    out: Tensor,
    cfg: RowConfig,
) -> None:
    S, D = out.shape
    grid = (triton.cdiv(S, cfg.block_rows) * triton.cdiv(D, cfg.block_d),)
    wrap_triton(_gather_rows_kernel)[grid](
        src,
        sorted_ids,
        weight,
        out,
        S,
        D,
        num_assignments,
        top_k,
        sorted_ids.stride(0),
        src.stride(0),
        src.stride(1),
        weight.stride(0) if weight is not None else 0,
        weight.stride(1) if weight is not None else 0,
        out.stride(0),
        out.stride(1),
        HAS_WEIGHT=weight is not None,
        BLOCK_M=cfg.block_rows,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
    )


def _launch_combine(
    src: Tensor, slot: Tensor, top_k, weight: Optional[Tensor], out: Tensor, cfg: RowConfig
) -> None:
    T, D = out.shape
    grid = (triton.cdiv(T, cfg.block_rows) * triton.cdiv(D, cfg.block_d),)
    wrap_triton(_combine_rows_kernel)[grid](
        src,
        slot,
        weight,
        out,
        T,
        D,
        top_k,
        src.stride(0),
        src.stride(1),
        weight.stride(0) if weight is not None else 0,
        weight.stride(1) if weight is not None else 0,
        out.stride(0),
        out.stride(1),
        HAS_WEIGHT=weight is not None,
        BLOCK_M=cfg.block_rows,
        BLOCK_D=cfg.block_d,
        num_warps=cfg.num_warps,
    )


def permute_out(
    x: Tensor, sorted_ids: Tensor, top_k: int, *, out: Tensor, config: Optional[RowConfig] = None
) -> None:
    """``torch_moe::permute.out``: ``out[i] = x[sorted_ids[i] // top_k]``, a zero row where
    ``sorted_ids[i] == -1``, for tensors on any device Triton runs on (CPU tensors under
    ``TRITON_INTERPRET=1``).

    Args:
        x: ``[T, D]``, any dtype (float, integer, bool, fp8) and strides.
        sorted_ids: int64 ``[S]``, any stride, values in ``[-1, T * top_k)``, each assignment at
            most once (checked on the device).
        out: ``[S, D]`` of the dtype of x, any strides; written, nothing returned.
        config: tile sizes; by default chosen from D.
    """
    _checks.check_permute_out(x, sorted_ids, top_k, out)
    cfg = config if config is not None else _default_config(x.size(1))
    num_assignments = x.size(0) * top_k
    _inverse_slots("torch_moe.permute", sorted_ids, num_assignments, cfg)
    if x.dtype.is_floating_point and x.dtype.itemsize == 1:
        # fp8: the copy moves bits, and not every GPU has Triton's fp8 types (e4m3fn needs sm_89)
        x, out = x.view(torch.uint8), out.view(torch.uint8)
    if out.numel():
        _launch_gather(x, sorted_ids, top_k, num_assignments, None, out, cfg)


def permute(
    x: Tensor, sorted_ids: Tensor, top_k: int, *, config: Optional[RowConfig] = None
) -> Tensor:
    """``torch_moe::permute``: :func:`permute_out` into a new contiguous ``[S, D]`` tensor."""
    _checks.check_permute(x, sorted_ids, top_k)
    out = x.new_empty((sorted_ids.size(0), x.size(1)))
    permute_out(x, sorted_ids, top_k, out=out, config=config)
    return out


def permute_backward(
    grad: Tensor,
    sorted_ids: Tensor,
    top_k: int,
    num_tokens: int,
    *,
    config: Optional[RowConfig] = None,
) -> Tensor:
    """``torch_moe::permute_backward``: ``grad_x[t] = sum_j grad[slot of t * top_k + j]``.

    Args:
        grad: ``[S, D]`` float, any strides; its padded rows are not read (NaN there is fine).
        sorted_ids: int64 ``[S]``, values in ``[-1, num_tokens * top_k)``, each assignment at
            most once; an assignment that no slot holds contributes nothing.
        config: tile sizes; by default chosen from D.

    Returns:
        A contiguous ``[num_tokens, D]`` tensor in the dtype of grad, summed in fp32 (fp64 for
        fp64) and rounded once.
    """
    _checks.check_permute_backward(grad, sorted_ids, top_k, num_tokens)
    cfg = config if config is not None else _default_config(grad.size(1))
    slot = _inverse_slots("torch_moe.permute_backward", sorted_ids, num_tokens * top_k, cfg)
    out = grad.new_empty((num_tokens, grad.size(1)))
    if out.numel():
        _launch_combine(grad, slot, top_k, None, out, cfg)
    return out


def unpermute(
    y: Tensor, sorted_ids: Tensor, topk_weights: Tensor, *, config: Optional[RowConfig] = None
) -> Tensor:
    """``torch_moe::unpermute``: ``out[t] = sum_j topk_weights[t, j] * y[slot of t * k + j]``.

    Args:
        y: ``[S, D]`` float, any strides; its padded rows are not read.
        sorted_ids: int64 ``[S]``, values in ``[-1, T * k)``, each assignment at most once.
        topk_weights: ``[T, k]``, any float dtype and strides; the weight of an assignment that no
            slot holds (dropped) is not read.
        config: tile sizes; by default chosen from D.

    Returns:
        A contiguous ``[T, D]`` tensor in the dtype of y, combined in fp32 (fp64 for fp64 y) in
        the order ``j = 0 .. k-1`` and rounded once.
    """
    _checks.check_unpermute(y, sorted_ids, topk_weights)
    cfg = config if config is not None else _default_config(y.size(1))
    T, k = topk_weights.shape
    slot = _inverse_slots("torch_moe.unpermute", sorted_ids, T * k, cfg)
    out = y.new_empty((T, y.size(1)))
    if out.numel():
        _launch_combine(y, slot, k, topk_weights, out, cfg)
    return out


def unpermute_backward(
    grad: Tensor,
    y: Tensor,
    sorted_ids: Tensor,
    topk_weights: Tensor,
    output_mask,
    *,
    config: Optional[RowConfig] = None,
) -> tuple[Tensor, Tensor]:
    """``torch_moe::unpermute_backward``: the gradients of :func:`unpermute`.

    For slot ``i`` holding assignment ``a = t * k + j``::

        grad_y[i] = grad[t] * topk_weights[t, j]     (zero row for a padded slot)
        grad_topk_weights[t, j] = <grad[t], y[i]>     (zero for an assignment no slot holds)

    ``grad_y`` is scaled by the weight rounded to the dtype of grad, as the CPU kernel does; the
    dot products accumulate in fp32 (fp64). An output whose ``output_mask`` entry is False is not
    computed and is returned as an empty ``[0]`` tensor.

    Returns:
        ``(grad_y [S, D]`` in the dtype of grad, ``grad_topk_weights [T, k]`` in the dtype of
        topk_weights), both contiguous.
    """
    _checks.check_unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask)
    want_y, want_w = output_mask
    cfg = config if config is not None else _default_config(y.size(1))
    T, k = topk_weights.shape
    slot = _inverse_slots("torch_moe.unpermute_backward", sorted_ids, T * k, cfg)
    if want_y:
        grad_y = grad.new_empty((sorted_ids.size(0), grad.size(1)))
        if grad_y.numel():
            _launch_gather(grad, sorted_ids, k, T * k, topk_weights, grad_y, cfg)
    else:
        grad_y = y.new_empty((0,))
    if want_w:
        grad_w = topk_weights.new_empty((T, k))
        if grad_w.numel():
            wrap_triton(_weight_grad_kernel)[(triton.cdiv(T * k, cfg.block_rows),)](
                grad,
                y,
                slot,
                grad_w,
                T * k,
                y.size(1),
                k,
                grad.stride(0),
                grad.stride(1),
                y.stride(0),
                y.stride(1),
                BLOCK_M=cfg.block_rows,
                BLOCK_D=cfg.block_d,
                num_warps=cfg.num_warps,
            )
    else:
        grad_w = topk_weights.new_empty((0,))
    return grad_y, grad_w


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------
# The bodies are also the fake kernels (triton_op traces them), so they must not read values.


@triton_op("torch_moe::_triton_permute", mutates_args=())
def _triton_permute(x: Tensor, sorted_ids: Tensor, top_k: int) -> Tensor:
    return permute(x, sorted_ids, top_k)


@triton_op("torch_moe::_triton_permute_out", mutates_args=("out",))
def _triton_permute_out(x: Tensor, sorted_ids: Tensor, top_k: int, out: Tensor) -> None:
    permute_out(x, sorted_ids, top_k, out=out)


def _permute_out_kernel(x: Tensor, sorted_ids: Tensor, top_k: int, *, out: Tensor) -> None:
    # a custom op takes no keyword-only tensor, while the public overload takes out as one
    torch.ops.torch_moe._triton_permute_out(x, sorted_ids, top_k, out)


@triton_op("torch_moe::_triton_permute_backward", mutates_args=())
def _triton_permute_backward(
    grad: Tensor, sorted_ids: Tensor, top_k: int, num_tokens: int
) -> Tensor:
    return permute_backward(grad, sorted_ids, top_k, num_tokens)


@triton_op("torch_moe::_triton_unpermute", mutates_args=())
def _triton_unpermute(y: Tensor, sorted_ids: Tensor, topk_weights: Tensor) -> Tensor:
    return unpermute(y, sorted_ids, topk_weights)


@triton_op("torch_moe::_triton_unpermute_backward", mutates_args=())
def _triton_unpermute_backward(
    grad: Tensor, y: Tensor, sorted_ids: Tensor, topk_weights: Tensor, output_mask: list[bool]
) -> tuple[Tensor, Tensor]:
    return unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask)


# ---------------------------------------------------------------------------------------------
# The CUDA kernels of the public ops (see torch_moe._triton)
# ---------------------------------------------------------------------------------------------

KERNELS = {
    "permute": torch.ops.torch_moe._triton_permute.default,
    "permute.out": _permute_out_kernel,
    "permute_backward": torch.ops.torch_moe._triton_permute_backward.default,
    "unpermute": torch.ops.torch_moe._triton_unpermute.default,
    "unpermute_backward": torch.ops.torch_moe._triton_unpermute_backward.default,
}
