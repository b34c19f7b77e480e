"""Expert-parallel MoE FFN on ``torch.distributed``: all-to-all token dispatch and combine.

Layout (as in :mod:`torch_moe.distributed._dispatch_plan`). ``E`` experts are placed on the
``R`` ranks of the expert-parallel group in contiguous blocks of ``G = E // R``: expert ``e``
lives on group rank ``e // G`` as local expert ``e % G``. Every rank holds its own tokens
``x [T, D]`` (``T`` may differ between ranks, and may be zero) with their routing
``topk_ids / topk_weights [T, k]``, and the weights of its ``G`` experts.

Rows. The unit that crosses the wire is a *row*: one copy of a token's ``D`` values together
with ``W`` (local expert id, routing weight) pairs for the receiving rank.

* plain dispatch: one row per (token, expert) assignment, ``W = 1``: ``k`` rows per token;
* deduplicated dispatch (``dedup=True``): one row per (token, destination rank),
  ``W = min(k, G)``: a token whose experts share a rank crosses the wire once to it.

The receiving rank runs its local experts on the received rows with the travelling weights
(``token_sort`` + ``grouped_ffn`` with ``k = W``; an unused pair holds the dummy expert id
``G``, which sorts past the last group and is skipped), so the rows it sends back are already
the weighted sums over its experts; the source rank adds the rows of each token, in fp32, and
casts to ``x.dtype``. Because the routing weights travel with the rows, their gradient is
computed where the expert output is and comes back through the reverse exchange.

One call of :func:`expert_parallel_moe_ffn`:

1. orders every chunk's assignments by (destination, token) and numbers the rows;
2. exchanges the per-destination row counts of every chunk in one ``all_to_all_single``,
   together with each rank's layer signature (E, D, W, dtype) and a flag for expert ids out of
   range, and copies them to the host: **one host synchronisation per call**, and every rank
   raises the same error if any rank's signature or ids are wrong (no rank is left waiting in
   a later collective). ``num_chunks`` sets the width of this exchange, so it must be equal
   on every rank, like every argument of a collective;
3. sends the rows (differentiable), the local expert ids and the routing weights
   (differentiable) of every chunk with functional all-to-alls, which run in the background;
4. for each chunk in turn, waits for its rows, runs the local experts and starts sending the
   results back: with ``num_chunks > 1`` the exchanges of one chunk overlap the expert compute
   of another;
5. adds the returned rows into the output of their tokens.

Capacity mode (``capacity_factor=c``): every (source, destination) pair exchanges exactly
``C = ceil(c * T_chunk * k / R)`` rows per chunk, padded with empty rows, so all split sizes
are static: there is **no host synchronisation** and ``torch.compile`` / CUDA graphs can capture
the layer. Rows past ``C`` for a destination are dropped (their assignments contribute zero,
as with ``MoEConfig.capacity_factor``) and counted in the ``dropped`` counter. All ranks
must call with the same ``T`` (and chunking), and the ids are checked with an asynchronous
device assertion instead of the host-side check.

Counters. Every forward call adds to int64 tensors on the device of ``x`` without host
synchronisation (the backward moves the same bytes in the opposite direction and is not
counted again). They are kept per thread: per rank in a real run, and per simulated rank under
the threaded process group of the tests. Read them with :func:`read_dispatch_counters`, zero
them with :func:`reset_dispatch_counters`:

* ``calls``;
* ``rows_sent`` / ``rows_received``: rows this rank placed in / took from the dispatch buffers
  (the rank's own rows included, padding excluded), and ``rows_sent_remote`` /
  ``rows_received_remote`` without the rank's own rows;
* ``bytes_sent`` / ``bytes_received``: bytes this rank put on / took off the wire to or from
  other ranks, dispatch (rows, ids, weights, and padding in capacity mode) and combine;
* ``dropped``: assignments dropped by capacity mode;
* ``last_expert_load``: ``[G]``, the assignments each local expert computed in the latest
  call (replaced, not accumulated: layers may differ in ``G``); its sum is the rank's load.

Every rank of the group must call the function (and run backward) the same number of times,
also with ``T = 0``. A rank that fails or leaves makes the others' collectives fail after the
process group's timeout (``init_process_group(..., timeout=...)``) instead of hanging.

Not implemented: quantised payloads, precisions other than the ``moe_ffn`` default (the local
experts run ``grouped_ffn`` in the dtype of the weights), and DTensor inputs (plain local
tensors; the ParallelStyles of :mod:`torch_moe.distributed.parallel` wrap this function).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe.distributed._collectives import all_to_all, all_to_all_differentiable, wait

__all__ = [
    "expert_parallel_moe_ffn",
    "read_dispatch_counters",
    "reset_dispatch_counters",
]

_SCALAR_COUNTERS = (
    "calls",
    "rows_sent",
    "rows_received",
    "rows_sent_remote",
    "rows_received_remote",
    "bytes_sent",
    "bytes_received",
    "dropped",
)

_local = threading.local()


def _counters() -> dict[str, Tensor]:
    if not hasattr(_local, "counters"):
        _local.counters = {}
    return _local.counters


def reset_dispatch_counters() -> None:
    """Forget this thread's counters; the next call starts them from zero."""
    _counters().clear()


def read_dispatch_counters() -> dict:
    """This thread's counters as Python numbers (``last_expert_load`` as a list); synchronises the
    host. Empty before the first call."""
    return {name: (t.tolist() if t.dim() else int(t)) for name, t in _counters().items()}


def _count(name: str, value, device, shape=()) -> None:
    counters = _counters()
    if name not in counters:
        counters[name] = torch.zeros(shape, dtype=torch.int64, device=device)
    counters[name].add_(value)


# Wire format of one dispatched row: the token values, then W (int32 id, fp32 weight) pairs.
_ID_DTYPE = torch.int32
_WEIGHT_DTYPE = torch.float32


@dataclass
class _Chunk:
    """The rows of one chunk of a source rank's tokens, in send-buffer order.

    ``N`` is the number of send-buffer rows: the exact row count in synchronising mode, ``R * C``
    in capacity mode. Attributes ending in ``_N`` are indexed by buffer row.
    """

    token_N: Tensor  # [N] int64, chunk-local token of each row (0 for an empty row)
    ids_NW: Tensor  # [N, W] int32 local expert ids, G where unused
    weights_NW: Tensor  # [N, W] fp32 routing weights, 0 where unused (differentiable)
    send_splits: Optional[list[int]]  # rows per destination; None = C each (capacity mode)
    recv_splits: Optional[list[int]]


def _order_rows(topk_ids: Tensor, G: int, R: int, dedup: bool):
    """Orders a chunk's assignments by (destination, token[, slot]) and numbers the rows.

    Returns, over the ``T * k`` assignments in that order: ``order`` (the flat assignment),
    ``dest``, ``row`` (buffer row, counted over all destinations), ``col`` (pair within the
    row), ``is_first`` (the assignment that starts its row), and ``rows_per_dest [R]``.
    """
    T, k = topk_ids.shape
    device = topk_ids.device
    ids = topk_ids.long().reshape(-1)
    # ids out of range are reported collectively by the caller; clamp so the plan stays valid
    dest = torch.div(ids, G, rounding_mode="floor").clamp_(0, R - 1)
    ar = torch.arange(T * k, device=device)
    token = torch.div(ar, k, rounding_mode="floor")
    # dedup: one row per (token, destination); plain: one per assignment (unique keys)
    key = dest * T + token if dedup else dest * (T * k) + ar
    order = torch.sort(key, stable=True).indices
    skey = key.index_select(0, order)
    is_first = torch.ones(T * k, dtype=torch.bool, device=device)
    is_first[1:] = skey[1:] != skey[:-1]
    row = torch.cumsum(is_first, 0) - 1
    start = torch.cummax(torch.where(is_first, ar, 0), 0).values  # first assignment of the row
    col = ar - start
    sdest = dest.index_select(0, order)
    rows_per_dest = torch.zeros(R, dtype=torch.int64, device=device).index_add_(
        0, sdest, is_first.long())
    return order, sdest, row, col, is_first, rows_per_dest


def _pack(topk_ids, topk_weights, planned, G, R, W, capacity: Optional[int], splits):
    """Builds the send buffers of one chunk from :func:`_order_rows`' plan."""
    order, sdest, row, col, is_first, rows_per_dest = planned
    T = topk_ids.size(0)
    device = topk_ids.device
    if capacity is None:
        num_rows = sum(splits[0])
        slot = row
        kept = None
    else:
        num_rows = R * capacity
        first_row_of_dest = torch.cumsum(rows_per_dest, 0) - rows_per_dest
        pos = row - first_row_of_dest.index_select(0, sdest)
        kept = pos < capacity
        # dropped assignments land in one extra trash row, cut off below
        slot = torch.where(kept, sdest * capacity + pos, num_rows)
        _count("dropped", (~kept).sum(), device)
    token = torch.div(order, topk_ids.size(1), rounding_mode="floor")
    local = topk_ids.long().reshape(-1).index_select(0, order) - sdest * G
    token_N = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
    token_N = token_N.index_put((slot[is_first],), token[is_first])
    ids_NW = torch.full((num_rows + 1, W), G, dtype=_ID_DTYPE, device=device)
    ids_NW = ids_NW.index_put((slot, col), local.to(_ID_DTYPE))
    weights = topk_weights.reshape(-1).to(_WEIGHT_DTYPE).index_select(0, order)
    weights_NW = weights.new_zeros(num_rows + 1, W).index_put((slot, col), weights)
    return _Chunk(token_N[:num_rows], ids_NW[:num_rows], weights_NW[:num_rows],
                  splits[0] if splits else None, splits[1] if splits else None)


_DTYPE_CODES = {dt: i for i, dt in enumerate(
    (torch.float32, torch.bfloat16, torch.float16, torch.float64))}
_SIGNATURE = ("num_experts", "dim", "pairs per row", "dtype")


def _exchange_counts(rows_per_dest: list[Tensor], signature: list[int], bad_ids: Tensor,
                     rank: int, group) -> list[tuple[list[int], list[int]]]:
    """One all-to-all of every chunk's row counts plus the layer signature and the bad-id flag.

    Returns per chunk (send_splits, recv_splits). Raises the same ``ValueError`` on every rank
    when a rank's signature differs or a rank has expert ids out of range."""
    R = len(rows_per_dest[0]) if rows_per_dest else dist.get_world_size(group)
    n = len(rows_per_dest)
    device = bad_ids.device
    extra = torch.tensor(signature, dtype=torch.int64, device=device)
    send = torch.cat([
        torch.stack(rows_per_dest, 1) if n else torch.zeros(R, 0, dtype=torch.int64, device=device),
        extra.expand(R, -1),
        bad_ids.long().view(1, 1).expand(R, 1),
    ], 1)  # [R, n + len(signature) + 1]: row r goes to rank r
    recv = wait(all_to_all(send, None, None, group))
    both = torch.stack([send, recv]).tolist()  # the host synchronisation
    sent, received = both
    for src, values in enumerate(received):
        theirs = values[n:n + len(signature)]
        if theirs != signature:
            diffs = ", ".join(f"{name} {mine} here and {other} on rank {src}"
                              for name, mine, other in zip(_SIGNATURE, signature, theirs)
                              if mine != other)
            raise ValueError(
                f"expert_parallel_moe_ffn: the ranks of the expert-parallel group disagree "
                f"on the layer: {diffs} (group rank {rank})")
    bad = [src for src, values in enumerate(received) if values[-1]]
    if bad:
        raise ValueError(
            f"expert_parallel_moe_ffn: expected expert ids in [0, {signature[0]}), but ranks "
            f"{bad} of the expert-parallel group passed ids out of range")
    return [([s[c] for s in sent], [r[c] for r in received]) for c in range(n)]


def _check_args(x, topk_ids, topk_weights, w1, w2, w3, num_experts, num_ranks, num_chunks,
                capacity_factor):
    fn = "expert_parallel_moe_ffn"
    if x.dim() != 2:
        raise ValueError(f"{fn}: expected x [T, D], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"{fn}: expected topk_ids and topk_weights of the same shape [T, k], but got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.size(0) != x.size(0):
        raise ValueError(f"{fn}: x has {x.size(0)} tokens but topk_ids has {topk_ids.size(0)} rows")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"{fn}: expected integer topk_ids, got {topk_ids.dtype}")
    if not topk_weights.dtype.is_floating_point:
        raise ValueError(f"{fn}: expected floating topk_weights, got {topk_weights.dtype}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"{fn}: num_experts={num_experts} is not divisible by the {num_ranks} "
                         "ranks of the group")
    if topk_ids.size(1) > num_experts:
        raise ValueError(f"{fn}: expected top-k ({topk_ids.size(1)}) <= num_experts "
                         f"({num_experts})")
    G, D = num_experts // num_ranks, x.size(1)
    if w1.dim() != 3 or w1.size(0) != G or w1.size(1) != D:
        raise ValueError(f"{fn}: expected w1_local [{G}, {D}, F] (num_experts / world_size "
                         f"experts of dim D), got {tuple(w1.shape)}")
    if w2.dim() != 3 or w2.size(0) != G or w2.size(2) != D:
        raise ValueError(f"{fn}: expected w2_local [{G}, F, {D}], got {tuple(w2.shape)}")
    if w3 is not None and w3.shape != w1.shape:
        raise ValueError(f"{fn}: expected w3_local of the shape of w1_local {tuple(w1.shape)}, "
                         f"got {tuple(w3.shape)}")
    for name, w in (("w1_local", w1), ("w2_local", w2), ("w3_local", w3)):
        if w is not None and (w.dtype != x.dtype or w.device != x.device):
            raise ValueError(f"{fn}: expected {name} on {x.device} in {x.dtype} like x, got "
                             f"{w.device} {w.dtype}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"{fn}: expected num_chunks to be a positive int, got {num_chunks!r}")
    if capacity_factor is not None and not (capacity_factor > 0 and math.isfinite(capacity_factor)):
        raise ValueError(f"{fn}: expected capacity_factor > 0 or None, got {capacity_factor!r}")
    if x.dtype not in _DTYPE_CODES:
        raise ValueError(f"{fn}: expected x in one of {list(_DTYPE_CODES)}, got {x.dtype}")


def expert_parallel_moe_ffn(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1_local: Tensor,
    w2_local: Tensor,
    w3_local: Optional[Tensor] = None,
    *,
    num_experts: int,
    group: Optional[dist.ProcessGroup] = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    dedup: bool = False,
    num_chunks: int = 1,
    capacity_factor: Optional[float] = None,
) -> Tensor:
    """Routed-expert FFN with the experts sharded over the ranks of ``group``.

    Args:
        x: this rank's tokens ``[T, D]``.
        topk_ids: ``[T, k]`` global expert ids in ``[0, num_experts)``.
        topk_weights: ``[T, k]`` routing weights, any floating dtype; differentiable.
        w1_local: ``[E / R, D, F]`` (or fused ``[E / R, D, 2F]``), the experts
            ``rank * E / R ... (rank + 1) * E / R - 1`` of this rank, in the dtype of ``x``.
        w2_local: ``[E / R, F, D]``.
        w3_local: ``[E / R, D, F]`` for gated activations with a separate ``w1``, else None.
        num_experts: ``E``, divisible by the group size ``R``.
        group: the expert-parallel process group; the default group when None.
        activation, alpha, limit: as in :func:`torch_moe.nn.functional.moe_ffn`.
        dedup: send one row per (token, destination rank) instead of one per assignment.
        num_chunks: split the tokens into this many chunks whose exchanges overlap the expert
            compute of the others.
        capacity_factor: capacity mode (static shapes, no host synchronisation, overflow
            dropped and counted); None for the exact, synchronising mode.

    Returns:
        ``[T, D]`` in the dtype of ``x``: ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
        (dropped assignments excluded in capacity mode).
    """
    num_ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    _check_args(x, topk_ids, topk_weights, w1_local, w2_local, w3_local, num_experts, num_ranks,
                num_chunks, capacity_factor)
    R, G = num_ranks, num_experts // num_ranks
    T, k = topk_ids.shape
    D = x.size(1)
    W = min(k, G) if dedup else 1
    device = x.device
    group = group if group is not None else dist.group.WORLD

    # (1) plan every chunk's rows
    bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
    spans = list(zip(bounds[:-1], bounds[1:]))
    planned = [_order_rows(topk_ids[s:e], G, R, dedup) for s, e in spans]
    bad_ids = ((topk_ids < 0) | (topk_ids >= num_experts)).any() if T else \
        torch.zeros((), dtype=torch.bool, device=device)

    # (2) counts, signature and id check: one host synchronisation (none in capacity mode)
    if capacity_factor is None:
        signature = [num_experts, D, W, _DTYPE_CODES[x.dtype]]
        splits = _exchange_counts([p[-1] for p in planned], signature, bad_ids, rank, group)
        capacities = [None] * len(spans)
    else:
        torch._assert_async(~bad_ids, "expert_parallel_moe_ffn: expert ids out of range")
        splits = [None] * len(spans)
        capacities = [max(1, math.ceil(capacity_factor * (e - s) * k / R)) for s, e in spans]
    chunks = [_pack(topk_ids[s:e], topk_weights[s:e], p, G, R, W, c, sp)
              for (s, e), p, c, sp in zip(spans, planned, capacities, splits)]

    # (3) start every chunk's dispatch
    in_flight = []
    for (s, e), ch in zip(spans, chunks):
        rows = x[s:e].index_select(0, ch.token_N)
        in_flight.append((
            all_to_all_differentiable(rows, ch.recv_splits, ch.send_splits, group),
            all_to_all(ch.ids_NW, ch.recv_splits, ch.send_splits, group),
            all_to_all_differentiable(ch.weights_NW, ch.recv_splits, ch.send_splits, group),
        ))

    # (4) local experts chunk by chunk; each result starts back at once
    returning, load = [], None
    for ch, (rows, ids, weights) in zip(chunks, in_flight):
        ids = wait(ids)
        sorted_ids, offs, counts = torch.ops.torch_moe.token_sort(ids, G + 1)
        out, _ = torch.ops.torch_moe.grouped_ffn(
            rows, sorted_ids, offs[:G], weights, w1_local, w2_local, w3_local, activation,
            alpha, limit)
        returning.append(all_to_all_differentiable(out, ch.send_splits, ch.recv_splits, group))
        load = load + counts[:G] if load is not None else counts[:G]
        if ch.recv_splits is None:
            _count("rows_received", (ids < G).any(1).sum(), device)
            _count("rows_received_remote", (ids.view(R, -1, W)[torch.arange(R, device=device) != rank] < G)
                   .any(2).sum(), device)

    # (5) combine: add the returned rows of each token, fp32
    ys = []
    for (s, e), ch, back in zip(spans, chunks, returning):
        y = torch.zeros(e - s, D, dtype=torch.float32, device=device)
        ys.append(y.index_add(0, ch.token_N, back.float()))
    y = torch.cat(ys) if len(ys) > 1 else ys[0]

    _record_traffic(chunks, planned, capacities, rank, R, D, W, x.element_size(), device)
    _counters()["last_expert_load"] = load
    return y.to(x.dtype)


def _record_traffic(chunks, planned, capacities, rank, R, D, W, elem_bytes, device):
    dispatch_row = D * elem_bytes + W * (torch.finfo(_WEIGHT_DTYPE).bits // 8
                                         + torch.iinfo(_ID_DTYPE).bits // 8)
    combine_row = D * elem_bytes
    _count("calls", 1, device)
    for ch, p, cap in zip(chunks, planned, capacities):
        rows_per_dest = p[-1]
        if cap is None:
            sent, recv = sum(ch.send_splits), sum(ch.recv_splits)
            sent_remote, recv_remote = sent - ch.send_splits[rank], recv - ch.recv_splits[rank]
            _count("rows_sent", sent, device)
            _count("rows_received", recv, device)
            _count("rows_sent_remote", sent_remote, device)
            _count("rows_received_remote", recv_remote, device)
            _count("bytes_sent", sent_remote * dispatch_row + recv_remote * combine_row, device)
            _count("bytes_received", recv_remote * dispatch_row + sent_remote * combine_row,
                   device)
        else:
            kept = rows_per_dest.clamp(max=cap)
            _count("rows_sent", kept.sum(), device)
            _count("rows_sent_remote", kept.sum() - kept[rank], device)
            wire = (R - 1) * cap * (dispatch_row + combine_row)
            _count("bytes_sent", wire, device)
            _count("bytes_received", wire, device)
