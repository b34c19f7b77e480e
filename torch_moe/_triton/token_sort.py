"""Triton kernels of ``torch_moe::token_sort``.

``token_sort(topk_ids [T, k], E, align)`` sorts the flat assignment indices ``i = t * k + j``
stably by expert ``topk_ids.view(-1)[i]``, pads each expert's group to a multiple of ``align``
slots (-1), and returns the slots ``sorted_ids [S]`` (int64, ``S = T * k + E * (align - 1)``, the
tail past ``offs[-1]`` also -1), the padded group ends ``offs [E]`` (int32) and the unpadded
counts ``tokens_per_expert [E]`` (int64): the CPU kernel's result, bit for bit. Every size is a
function of ``T``, ``k``, ``E`` and ``align``; nothing is read on the host.

A counting sort in two kernels over the same partition of the ``n = T * k`` assignments into
``P`` programs, each of which walks its contiguous range of blocks of ``BLOCK`` assignments in
order:

1. ``_count_kernel``: each block is sorted by the unique key ``expert * BLOCK + lane`` with
   ``tl.sort``, so that the assignments of one expert form a run; the length of each run is added
   to ``count[e, p]`` (an ``[E, P]`` int32 table). Only program ``p`` writes column ``p``, and the
   adds are of integers, so the table does not depend on their order (deterministic mode holds).
2. ATen, on the table: ``tokens_per_expert = count.sum(1)``; the padded layout of the groups
   (:func:`torch_moe._native.padded_groups.padded_group_layout`) gives ``offs`` and the per-expert
   shift from unpadded to padded slots; the exclusive cumulative sum of the table in
   expert-major order, plus the shift, is the first padded slot of each (expert, program) pair.
3. ``_scatter_kernel``: each program sorts its blocks again and writes assignment ``i`` of
   expert ``e`` to ``cursor[e, p] + r``, ``r`` its rank in its run (its position in the sorted
   block minus that of the run's first element); after each block the program advances its
   cursors by the run lengths. Blocks are taken in order and sorted by lane within an expert, so
   the order of ``i`` within an expert is kept: the sort is stable.

``sorted_ids`` starts as -1 (``torch.full``) when ``align > 1``; with ``align == 1`` every slot is
written and it starts empty.

Size of the table. With one block per program the table has ``E * cdiv(n, BLOCK)`` entries
(256 K for a million assignments and 256 experts). For many experts this would be large, so the
number of programs is capped at ``_TABLE_ENTRIES // E`` (at least one), each program then taking
several consecutive blocks: the table and the cursors stay within ``max(E, _TABLE_ENTRIES)``
entries whatever E.

Expert ids out of ``[0, E)``: the CPU kernel raises. Here a reduction over the ids feeds
:func:`torch_moe._compat.assert_async` (it raises at once on CPU tensors, as under the
interpreter, and is a device-side assertion on CUDA), the kernels assert under ``TRITON_DEBUG=1``,
and the kernels clamp the ids to ``[0, E)`` so that invalid ids never address memory out of bounds.

Every launch goes through :func:`torch.library.wrap_triton` inside the
:func:`torch.library.triton_op` ``torch_moe::_triton_token_sort``, so ``torch.compile`` sees the
kernels; :data:`KERNELS` makes it the CUDA kernel of ``torch_moe::token_sort`` (see
:mod:`torch_moe._triton`).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from torch_moe import _checks
from torch_moe._compat import assert_async
from torch_moe._native.padded_groups import padded_group_layout

__all__ = ["KERNELS", "token_sort"]

# Cap on the entries of the [E, P] count table (and of the cursors): 4 M, 16 MiB of int32.
_TABLE_ENTRIES = 2**22
_MAX_BLOCK = 1024


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sorted_runs(experts, BLOCK: tl.constexpr, WIDE_KEYS: tl.constexpr):
    """Sorts one block stably by expert.

    ``experts [BLOCK]``: the expert of each lane, ``num_experts`` past the last assignment (so
    that those lanes sort last). Returns, in sorted order, ``(expert, lane, rank, is_last)``:
    the expert and lane of each element, its rank in the run of its expert, and whether it ends
    that run.
    """
    lanes = tl.arange(0, BLOCK)
    # unique keys: sorting them is a stable sort by expert (lane order within an expert)
    if WIDE_KEYS:
        keys = experts.to(tl.int64) * BLOCK + lanes
    else:
        keys = experts.to(tl.int32) * BLOCK + lanes
    keys = tl.sort(keys, 0)
    expert = keys // BLOCK
    lane = (keys % BLOCK).to(tl.int32)
    pos = lanes
    prev = tl.gather(expert, tl.maximum(pos - 1, 0), 0)
    next = tl.gather(expert, tl.minimum(pos + 1, BLOCK - 1), 0)
    is_first = (pos == 0) | (expert != prev)
    is_last = (pos == BLOCK - 1) | (expert != next)
    run_start = tl.associative_scan(tl.where(is_first, pos, 0), 0, _max_combine)
    return expert, lane, pos - run_start, is_last


@triton.jit
def _count_kernel(
    ids_ptr,
    count_ptr,
    n,
    stride_ids,
    num_experts,
    num_programs,
    blocks_per_program,
    BLOCK: tl.constexpr,
    WIDE_KEYS: tl.constexpr,
):
    """Program ``p``: ``count[e, p]`` += assignments of expert ``e`` in its blocks.

    Shapes: ids ``[n]`` int32 / int64 (stride ``stride_ids``); count
    ``[num_experts, num_programs]`` int32, zeros.
    grid = ``(num_programs,)``; program ``p`` takes blocks ``[p * blocks_per_program,
    (p + 1) * blocks_per_program)`` of ``BLOCK`` assignments.
    """
    p = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    for i in range(0, blocks_per_program):
        idx = (p * blocks_per_program + i).to(tl.int64) * BLOCK + lanes
        valid = idx < n
        e = tl.load(ids_ptr + idx * stride_ids, mask=valid, other=0)
        tl.device_assert((e >= 0) & (e < num_experts), "topk_ids out of [0, num_experts)")
        # clamped: an invalid id must not address the table out of bounds
        e = tl.where(valid, tl.minimum(tl.maximum(e, 0), num_experts - 1), num_experts)
        expert, lane, rank, is_last = _sorted_runs(e, BLOCK, WIDE_KEYS)
        ok = is_last & (expert < num_experts)
        # integer adds to this program's column only: their order does not change the result
        tl.atomic_add(
            count_ptr + expert * num_programs + p, rank + 1, mask=ok, sem="relaxed"
        )


@triton.jit
def _scatter_kernel(
    ids_ptr,
    cursor_ptr,
    out_ptr,
    n,
    stride_ids,
    num_experts,
    num_programs,
    blocks_per_program,
    BLOCK: tl.constexpr,
    WIDE_KEYS: tl.constexpr,
):
    """Program ``p``: ``out[cursor[e, p] + r] = i`` for the ``r``-th assignment ``i`` of expert
    ``e`` in its blocks (the partition of ``_count_kernel``).

    Shapes: ids ``[n]``; cursor ``[num_experts, num_programs]`` int64, the first slot of each
    (expert, program), advanced here; out ``[S]`` int64.
    """
    p = tl.program_id(0)
    lanes = tl.arange(0, BLOCK)
    for i in range(0, blocks_per_program):
        first = (p * blocks_per_program + i).to(tl.int64) * BLOCK
        valid = first + lanes < n
        e = tl.load(ids_ptr + (first + lanes) * stride_ids, mask=valid, other=0)
        e = tl.where(valid, tl.minimum(tl.maximum(e, 0), num_experts - 1), num_experts)
        expert, lane, rank, is_last = _sorted_runs(e, BLOCK, WIDE_KEYS)
        ok = expert < num_experts
        cursors = cursor_ptr + expert * num_programs + p
        slot = tl.load(cursors, mask=ok, other=0)
        tl.store(out_ptr + slot + rank, first + lane, mask=ok)
        # every thread of the program has read the cursors of this block before any is moved,
        # and the moves are visible to the next block's reads
        tl.debug_barrier()
        tl.store(cursors, slot + rank + 1, mask=ok & is_last)
        tl.debug_barrier()


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _block(n) -> int:
    """The smallest power of two in [16, _MAX_BLOCK] that is >= n (comparisons only, so that a
    symbolic n gives guards)."""
    b = 16
    while b < _MAX_BLOCK and b < n:
        b *= 2
    return b


def token_sort(
    topk_ids: Tensor,
    num_experts: int,
    align: int = 1,
    *,
    block: Optional[int] = None,
    max_programs: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_moe::token_sort`` with the Triton kernels, for tensors on any device Triton runs
    on (CPU tensors under ``TRITON_INTERPRET=1``). The current device must be that of the ids.

    Args:
        topk_ids: ``[T, k]`` int32 or int64 expert ids in ``[0, num_experts)``, any strides.
        num_experts: E; align: every group is padded to a multiple of it.
        block: assignments per block (a power of two >= 16); by default the smallest in
            [16, 1024] holding all of them.
        max_programs: cap on the number of programs (each then walks several blocks); by
            default ``_TABLE_ENTRIES // num_experts``.

    Returns:
        ``(sorted_ids [S] int64, offs [E] int32, tokens_per_expert [E] int64)``,
        ``S = T * k + E * (align - 1)``.
    """
    _checks.check_token_sort(topk_ids, num_experts, align)
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    S = _checks.token_sort_num_slots(n, num_experts, align)
    device = ids.device
    if n > 0:
        lo, hi = torch.aminmax(ids)
        assert_async(
            (lo >= 0) & (hi < num_experts),
            f"torch_moe.token_sort: expected topk_ids values in [0, {num_experts})",
        )

    BLOCK = block if block is not None else _block(n)
    num_blocks = triton.cdiv(n, BLOCK)
    cap = max_programs if max_programs is not None else max(1, _TABLE_ENTRIES // num_experts)
    blocks_per_program = max(1, triton.cdiv(num_blocks, cap))
    P = triton.cdiv(num_blocks, blocks_per_program)
    # keys expert * BLOCK + lane, up to (E + 1) * BLOCK - 1
    wide_keys = (num_experts + 1) * BLOCK > 2**31 - 1

    count_EP = torch.zeros((num_experts, P), dtype=torch.int32, device=device)
    if n > 0:
        wrap_triton(_count_kernel)[(P,)](
            ids, count_EP, n, ids.stride(0), num_experts, P, blocks_per_program,
            BLOCK=BLOCK, WIDE_KEYS=wide_keys,
        )
    counts = count_EP.sum(1)
    ends, shift = padded_group_layout(counts, align)
    offs = ends.to(torch.int32)

    if align == 1:
        sorted_ids = torch.empty((S,), dtype=torch.int64, device=device)
    else:
        sorted_ids = torch.full((S,), -1, dtype=torch.int64, device=device)
    if n > 0:
        # first padded slot of each (expert, program): the exclusive scan of the table in
        # expert-major order (slot in the unpadded sort), moved by the expert's padding shift
        flat = count_EP.view(-1)
        cursor_EP = (flat.cumsum(0) - flat).view(num_experts, P) + shift.unsqueeze(1)
        wrap_triton(_scatter_kernel)[(P,)](
            ids, cursor_EP, sorted_ids, n, ids.stride(0), num_experts, P, blocks_per_program,
            BLOCK=BLOCK, WIDE_KEYS=wide_keys,
        )
    return sorted_ids, offs, counts


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------


@triton_op("torch_moe::_triton_token_sort", mutates_args=())
def _triton_token_sort(
    topk_ids: Tensor, num_experts: int, align: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    # Also the fake kernel (triton_op traces the body), so it must not read tensor values.
    return token_sort(topk_ids, num_experts, align)


# ---------------------------------------------------------------------------------------------
# The CUDA kernel of the public op (see torch_moe._triton)
# ---------------------------------------------------------------------------------------------

KERNELS = {"token_sort": torch.ops.torch_moe._triton_token_sort.default}
