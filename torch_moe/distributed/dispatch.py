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
2. exchanges a fixed-size header with every rank in one ``all_to_all_single`` before any
   data-sized collective: the layer signature (``num_experts``, ``D``, dtype, ``num_chunks``,
   ``capacity_factor``, ``dedup``, ``W``, activation, ``alpha``, ``limit``), the sender's
   argument error (see below), one column per chunk (row counts per destination; in capacity
   mode the sender's capacity) and two flags (expert ids out of range; ids repeated within a
   token, which would overflow a deduplicated row). Its width does not depend on any argument,
   so ranks that disagree still pair up in it, and every rank receives every rank's signature:
   when they differ, every rank raises the same ``ValueError`` naming the argument, its values
   and their ranks, and no rank is left in a later collective. This is **one host
   synchronisation per call**;
3. sends the rows (differentiable), the local expert ids and the routing weights
   (differentiable) of every chunk with functional all-to-alls, which run in the background;
4. for each chunk in turn, waits for its rows, runs the local experts and starts sending the
   results back: with ``num_chunks > 1`` the exchanges of one chunk overlap the expert compute
   of another;
5. adds the returned rows into the output of their tokens.

Capacity mode (``capacity_factor=c``): a source sends every destination exactly
``C = ceil(c * T_chunk * k / R)`` rows per chunk (at most the ``T_chunk`` rows, or
``T_chunk * k`` without dedup, that a chunk can have for one destination; at least 1), padded
with empty rows. Rows past ``C`` for a destination are dropped (their assignments contribute
zero, as with ``MoEConfig.capacity_factor``) and counted in the ``dropped`` counter. ``T``
may differ between ranks: each source pads to its own ``C``, which the header tells the
receivers. What capacity mode promises:

* no op with a data-dependent output shape (no boolean indexing, ``nonzero``, ``unique``,
  ``bincount``, ...): every shape follows from the shapes and arguments of the ranks' calls;
* one device-to-host copy per call, of the header's signature and capacities only (no value
  that depends on the tokens or their routing). On CUDA it waits for the work queued before
  the layer, so the layer as a whole is not captured by one CUDA graph;
* the expert ids are checked on the device: an asynchronous assertion on the flags of
  every rank, on every rank (a ``RuntimeError`` on every rank on CPU, a device-side assertion on
  CUDA), instead of the host-side ``ValueError`` of the exact mode;
* everything after the header (row plan, buffers, functional all-to-alls, experts, combine)
  traces into one graph with static shapes (``torch.compile(fullgraph=True)``). The CPU
  expert kernel reads its group offsets on the host: that is the kernel, not the dispatcher
  (on a GPU the offsets stay on the device).

Sync-free capacity mode (``capacity_factor=c, sync_free=True``): every rank passes the same
number of tokens ``T``, so every rank knows every other's capacity ``C`` and the splits of
every exchange without reading the header, and the call reads nothing on the host. The header
is still exchanged, and checked on the device (asynchronous assertions, as the ids above): the
same signature, the same capacities, no argument error and no bad id on any rank. On CPU these
raise a ``RuntimeError`` on every rank that passed its checks, before any later collective; a
rank whose arguments failed its local checks raises its own error. On CUDA they are device-side
assertions, which end the processes rather than return a wrong result. The constant part of
the header (signature, capacities) is built once per device, so a steady-state call copies
nothing from the host either: after a first call outside capture, the layer can be captured
in a CUDA graph, and its forward traces into one graph with ``torch.compile(fullgraph=True)``.

Symmetric memory (``backend="symm_mem"``, CUDA with NVSHMEM): the exact mode without a host
read. The row exchanges are ``symm_mem::all_to_all_vdev`` (through
:mod:`torch_moe.distributed._symm_mem_exchange`), whose split sizes are device tensors: the
rows per destination come from the row plan on the device, and the rows received from every
source are written on the device by the exchange. So no rank needs the counts on the host, and
the header is checked on the device as in sync-free capacity mode (the same number of tokens
on every rank, the same signature). The buffers have sizes fixed by bounds: a chunk of
``T_c`` tokens sends at most ``T_c * k`` rows (with dedup ``T_c * min(k, R)``) and a rank
receives at most ``R * T_c * k`` (with dedup ``R * T_c``), which is what every rank allocates;
the received rows past those of the call hold the unused id ``G`` and zero weights, which the
local experts skip, and the results go back with the received split sizes. The exchanges run
in the current stream, one after another (each exchange of a call, chunk by chunk, has buffers
of its own, which the next call reuses), so ``num_chunks > 1`` splits the work but does not
overlap it. Dropless only: capacity mode has
static split sizes, which the default backend exchanges without a host read
(``sync_free=True``). Before the first symmetric allocation of the process, NVSHMEM must be
the symmetric-memory backend and ``TORCH_SYMMMEM_NBLOCKS`` the group size
(``torch_moe.distributed._compat.prepare_symm_mem`` does both; the module docstring of
:mod:`~torch_moe.distributed._symm_mem_exchange` says why), and since NVSHMEM allocates over
every process of the job, every rank of the job must run the layer with the same number of
tokens.

Streams. With the default backend the exchanges are functional collectives: on NCCL they run
on the process group's communication stream, which waits for the work queued before them on
the current stream, and the first use of a result makes the current stream wait for the
collective (``wait_tensor``); NCCL keeps the inputs alive until the collective has run
(``record_stream`` on its stream). So with ``num_chunks > 1`` one chunk's exchanges run on the
communication stream while another chunk's experts run on the compute stream, with no host
wait; on gloo the same overlap comes from gloo's worker threads.

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

Argument errors. A rank whose arguments fail the local checks (the types, shapes, dtypes and
devices of its tensors, ``num_experts``, the options) still takes part in the header exchange,
with a header of the same width that carries no signature but the error's type and the length
of its message. Every rank then raises the type of the lowest failing rank (``ValueError`` or
``TypeError``): a failing rank with its own message, every other rank with one that names the
failing ranks and carries their messages (at most 1000 characters each), which one more
all-to-all brings them on this error path only. When every rank fails, each raises its own
message, as a single process would. With ``sync_free`` or ``backend="symm_mem"``, which read
no header on the host, the ranks that passed raise the ``RuntimeError`` of the device check
instead, and no message is exchanged. Raised on the calling rank alone, before any collective,
are the errors of the group itself: ``group=None`` without a default process group, a ``group``
that is not a ``ProcessGroup``, a process that is not a member of ``group``. The header of a
failing rank is on the device of its ``x``, or on the group's default device
(``all_gather_object``'s) when ``x`` is not a tensor or is on ``meta``: a device that the backend
cannot send from (a CPU ``x`` with NCCL) fails in the backend on that rank alone.

Every rank of the group must call the function (and run backward) the same number of times,
also with ``T = 0``. A rank that fails or leaves, or raises locally (above), makes the others'
collectives fail after the process group's timeout (``init_process_group(..., timeout=...)``)
instead of hanging.

Not implemented: quantised payloads, precisions other than the ``moe_ffn`` default (the local
experts run ``grouped_ffn`` in the dtype of the weights), and DTensor inputs (plain local
tensors). The ParallelStyles of :mod:`torch_moe.distributed.parallel` run the same steps
around the experts' own forward: steps 1 to 3 in its forward pre-hook (:func:`_dispatch_tokens`,
the rows of every chunk concatenated by :func:`_received_rows`), the expert compute in the
forward, on all received rows at once, and the sending back and step 5 in its forward hook
(:func:`_combine_rows`).
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe.distributed._compat import (
    all_to_all_single,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch_moe.distributed._dispatch_checks import _local_check_error, _resolve_group
from torch_moe.distributed._dispatch_header import (
    _DeviceSplits,
    _exchange_header,
    _header_device,
    _Layer,
    _raise_with_the_group,
    _Splits,
)
from torch_moe.distributed._symm_mem_exchange import exchange_rows

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


# ---------------------------------------------------------------------------------------------
# Step 1, plan: where every assignment of a chunk goes, before anything crosses the wire
# ---------------------------------------------------------------------------------------------


class _RowPlan(NamedTuple):
    """One chunk's assignments in (destination, token[, slot]) order, numbered into rows.

    ``A = T_chunk * k`` assignments; every field has a shape fixed by ``T_chunk, k, R``.
    """

    order_A: Tensor  # [A] int64, the flat assignment t * k + j at each position
    dest_A: Tensor  # [A] int64, its destination rank
    row_A: Tensor  # [A] int64, its row in the send buffer (rows of all destinations)
    col_A: Tensor  # [A] int64, its (id, weight) pair within that row
    rows_per_dest: Tensor  # [R] int64


class _Plan(NamedTuple):
    """The row plan of every chunk and the flags of the ids, which the header carries."""

    chunks: list[_RowPlan]
    out_of_range: Tensor  # [] bool, an expert id outside [0, num_experts)
    repeated: Tensor  # [] bool, a row with more than W pairs (dedup: an id named twice)

    @property
    def rows_per_dest_Rn(self) -> Tensor:
        """``[R, num_chunks]`` int64, the rows for every destination and chunk."""
        return torch.stack([p.rows_per_dest for p in self.chunks], 1)

    @property
    def id_flags(self) -> Tensor:
        """``[2]`` bool, (out of range, repeated)."""
        return torch.stack([self.out_of_range, self.repeated])


def _order_rows(topk_ids: Tensor, G: int, R: int, dedup: bool) -> _RowPlan:
    """Orders a chunk's assignments ``topk_ids [T, k]`` by (destination, token[, slot]) and
    numbers the rows: one per assignment, or with ``dedup`` one per (token, destination)."""
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
    is_first = torch.ones(T * k, dtype=torch.bool, device=device)  # starts its row
    is_first[1:] = skey[1:] != skey[:-1]
    row = torch.cumsum(is_first, 0) - 1
    start = torch.cummax(torch.where(is_first, ar, 0), 0).values  # first assignment of the row
    sdest = dest.index_select(0, order)
    rows_per_dest = torch.zeros(R, dtype=torch.int64, device=device).index_add_(
        0, sdest, is_first.long())
    return _RowPlan(order, sdest, row, ar - start, rows_per_dest)


def _plan_rows(topk_ids: Tensor, layer: _Layer) -> _Plan:
    """Every chunk's :class:`_RowPlan` and the flags of the ids."""
    chunks = [_order_rows(topk_ids[s:e], layer.G, layer.R, layer.dedup)
              for s, e in layer.spans]
    out_of_range = ((topk_ids < 0) | (topk_ids >= layer.num_experts)).any()
    repeated = torch.stack([(p.col_A >= layer.W).any() for p in chunks]).any()
    return _Plan(chunks, out_of_range, repeated)


# ---------------------------------------------------------------------------------------------
# Step 3, exchange: the send buffers of a chunk, and its rows on the way to their experts
# ---------------------------------------------------------------------------------------------


class _SendBuffers(NamedTuple):
    """The rows of one chunk of a source rank's tokens, in send-buffer order.

    ``N`` is the number of send-buffer rows: the exact row count in exact mode, ``R * C`` in
    capacity mode. Fields ending in ``_N`` are indexed by buffer row.
    """

    token_N: Tensor  # [N] int64, chunk-local token of each row (0 for an empty row)
    ids_NW: Tensor  # [N, W] int32 local expert ids, G where unused
    weights_NW: Tensor  # [N, W] fp32 routing weights, 0 where unused (differentiable)
    splits: _Splits
    kept_per_dest: Optional[Tensor]  # [R] rows kept per destination, capacity mode
    dropped: Optional[Tensor]  # [] assignments dropped, capacity mode


class _Received(NamedTuple):
    """One chunk's rows on the receiving rank, each of them possibly still in flight; ``M`` is
    ``sum(splits.recv)``."""

    rows_MD: Tensor  # [M, D] token values (differentiable)
    ids_MW: Tensor  # [M, W] int32 local expert ids, G where unused
    weights_MW: Tensor  # [M, W] fp32 routing weights, 0 where unused (differentiable)


def _pack(topk_ids: Tensor, topk_weights: Tensor, plan: _RowPlan, layer: _Layer,
          splits: _Splits) -> _SendBuffers:
    """Builds the send buffers of one chunk from its plan, with ops of static output shapes
    only (scatters into buffers of host-known size, no boolean indexing)."""
    G, R, W, capacity = layer.G, layer.R, layer.W, splits.capacity
    device = topk_ids.device
    if capacity is None:
        num_rows = splits.num_send  # with symm_mem a bound: the rows past the plan's are empty
        slot = plan.row_A
        kept_per_dest = dropped = None
    else:
        num_rows = R * capacity
        first_row_of_dest = torch.cumsum(plan.rows_per_dest, 0) - plan.rows_per_dest
        pos = plan.row_A - first_row_of_dest.index_select(0, plan.dest_A)
        kept = pos < capacity
        # dropped assignments land in one extra trash row, cut off below
        slot = torch.where(kept, plan.dest_A * capacity + pos, num_rows)
        kept_per_dest = plan.rows_per_dest.clamp(max=capacity)
        dropped = (~kept).sum()
    token = torch.div(plan.order_A, topk_ids.size(1), rounding_mode="floor")
    local = topk_ids.long().reshape(-1).index_select(0, plan.order_A) - plan.dest_A * G
    # bad ids (reported collectively) become the unused id G; repeated ones share a pair
    local = torch.where((local >= 0) & (local < G), local, G)
    col = plan.col_A.clamp(max=W - 1)
    # every assignment of a row has the row's token, so all of them may write it
    token_N = torch.zeros(num_rows + 1, dtype=torch.int64, device=device).index_put(
        (slot,), token)
    ids_NW = torch.full((num_rows + 1, W), G, dtype=_ID_DTYPE, device=device)
    ids_NW = ids_NW.index_put((slot, col), local.to(_ID_DTYPE))
    weights = topk_weights.reshape(-1).to(_WEIGHT_DTYPE).index_select(0, plan.order_A)
    weights_NW = weights.new_zeros(num_rows + 1, W).index_put((slot, col), weights)
    return _SendBuffers(token_N[:num_rows], ids_NW[:num_rows], weights_NW[:num_rows], splits,
                        kept_per_dest, dropped)


def _send_rows(x_chunk: Tensor, buffers: _SendBuffers, layer: _Layer, chunk: int) -> _Received:
    """Starts the exchange of one chunk: its rows (differentiable), local expert ids and
    routing weights (differentiable), with functional all-to-alls that run in the
    background, or with ``backend="symm_mem"`` exchanges in the current stream whose split
    sizes stay on the device (the rows past those received hold the unused id ``G``)."""
    sp, group = buffers.splits, layer.group
    rows = x_chunk.index_select(0, buffers.token_N)
    if isinstance(sp, _DeviceSplits):
        rows_MD, sp.recv = exchange_rows(rows, sp.send, sp.num_recv, group, ("rows", chunk))
        ids_MW, _ = exchange_rows(buffers.ids_NW, sp.send, sp.num_recv, group, ("ids", chunk),
                                  fill=layer.G)
        weights_MW, _ = exchange_rows(buffers.weights_NW, sp.send, sp.num_recv, group,
                                      ("weights", chunk))
        return _Received(rows_MD, ids_MW, weights_MW)
    return _Received(
        all_to_all_single_autograd(rows, sp.recv, sp.send, group),
        all_to_all_single(buffers.ids_NW, sp.recv, sp.send, group),
        all_to_all_single_autograd(buffers.weights_NW, sp.recv, sp.send, group),
    )


def _chunk_tokens(x: Tensor, s: int, e: int) -> Tensor:
    """``x[s:e]``, or one zero row for an empty chunk, which the padding rows of capacity mode
    point to; differentiable in ``x`` either way."""
    if e > s:
        return x[s:e]
    return torch.cat([x[s:e], x.new_zeros(1, x.size(1))])


# ---------------------------------------------------------------------------------------------
# Step 4, expert compute: the local experts on the received rows, sent back at once
# ---------------------------------------------------------------------------------------------


class _Computed(NamedTuple):
    """The local experts' result for one received chunk."""

    returning_ND: Tensor  # [N, D] x.dtype, the weighted expert sums of the rows this rank
    #                       sent, on their way back (differentiable, possibly in flight)
    ids_MW: Tensor  # [M, W] int32, the received local expert ids (waited for)
    load_G: Tensor  # [G] int64, assignments each local expert computed


class _LocalExperts(NamedTuple):
    """The weights of this rank's ``G`` experts, in the dtype of ``x``."""

    w1: Tensor  # [G, D, F], or fused [G, D, 2F]
    w2: Tensor  # [G, F, D]
    w3: Optional[Tensor]  # [G, D, F] for gated activations with a separate w1, else None


def _compute_experts(received: _Received, splits: _Splits, experts: _LocalExperts,
                     layer: _Layer, chunk: int) -> _Computed:
    """Waits for a chunk's ids, runs the local experts on its rows with the travelling weights
    (``k = W``; the unused id ``G`` sorts past the last group and is skipped) and starts the
    results back to their sources: the reverse of the chunk's exchange."""
    G = layer.G
    ids = wait_tensor(received.ids_MW)
    sorted_ids, offs, counts = torch.ops.torch_moe.token_sort(ids, G + 1)
    out, _ = torch.ops.torch_moe.grouped_ffn(
        received.rows_MD, sorted_ids, offs[:G], received.weights_MW, *experts,
        layer.activation, layer.alpha, layer.limit)
    return _Computed(_send_back(out, splits, layer, chunk), ids, counts[:G])


def _send_back(out_MD: Tensor, splits, layer: _Layer, chunk: int) -> Tensor:
    """Starts the weighted expert sums ``out_MD [M, D]`` of one received chunk back to their
    sources: ``[N, D]`` in the order of the sources' send buffers (the reverse exchange)."""
    if isinstance(splits, _DeviceSplits):
        return exchange_rows(out_MD, splits.recv, splits.num_send, layer.group,
                             ("combine", chunk))[0]
    return all_to_all_single_autograd(out_MD, splits.send, splits.recv, layer.group)


# ---------------------------------------------------------------------------------------------
# Step 5, combine: the returned rows added into the output of their tokens
# ---------------------------------------------------------------------------------------------


def _combine(x: Tensor, layer: _Layer, buffers: list[_SendBuffers],
             returning_ND: list[Tensor]) -> Tensor:
    """``y [T, D]`` in ``x.dtype``: the returned rows of every token added in fp32."""
    ys = []
    for (s, e), buf, back in zip(layer.spans, buffers, returning_ND):
        # an empty chunk still has its padding rows in capacity mode: they add zeros to a
        # spare row, so that the returned rows stay in the graph of every rank's backward
        y = torch.zeros(max(e - s, 1), layer.D, dtype=torch.float32, device=x.device)
        y = y.index_add(0, buf.token_N, back.float())
        # a non-empty chunk's sum is used whole, so the result is a tensor of its own (a module
        # wrapped by fully_shard must not return a view); only an empty chunk slices its spare
        # row away
        ys.append(y if e > s else y[:0])
    y = torch.cat(ys) if len(ys) > 1 else ys[0]
    return y.to(x.dtype)


def _call_counts(layer: _Layer, buffers: list[_SendBuffers], ids_MW: list[Tensor],
                 load_G: Tensor) -> dict[str, Tensor]:
    """The device counters of this call: ``last_expert_load`` (``load_G [G]``, the assignments
    each local expert computed), in capacity mode the row counts and ``dropped``, and with
    ``backend="symm_mem"`` the row and byte counts, which only the device knows (padding rows
    carry the unused id ``G`` alone); ``ids_MW`` are the received local expert ids of every
    chunk."""
    rank = layer.rank
    stats: dict[str, Tensor] = {"last_expert_load": load_G}
    dispatch_row, combine_row = _row_bytes(layer)
    for buf, ids in zip(buffers, ids_MW):
        sp = buf.splits
        if isinstance(sp, _DeviceSplits):
            sent, recv = sp.send.sum(), sp.recv.sum()
            sent_remote, recv_remote = sent - sp.send[rank], recv - sp.recv[rank]
            _add(stats, "rows_sent", sent)
            _add(stats, "rows_received", recv)
            _add(stats, "rows_sent_remote", sent_remote)
            _add(stats, "rows_received_remote", recv_remote)
            _add(stats, "bytes_sent", sent_remote * dispatch_row + recv_remote * combine_row)
            _add(stats, "bytes_received", recv_remote * dispatch_row + sent_remote * combine_row)
            continue
        if sp.capacity is None:
            continue
        used = (ids < layer.G).any(1).long()
        own = sum(sp.recv[:rank])
        own_used = used[own:own + sp.recv[rank]].sum()
        _add(stats, "rows_received", used.sum())
        _add(stats, "rows_received_remote", used.sum() - own_used)
        _add(stats, "rows_sent", buf.kept_per_dest.sum())
        _add(stats, "rows_sent_remote", buf.kept_per_dest.sum() - buf.kept_per_dest[rank])
        _add(stats, "dropped", buf.dropped)
    return stats


def _add(stats: dict, name: str, value: Tensor) -> None:
    stats[name] = stats[name] + value if name in stats else value


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
    sync_free: bool = False,
    backend: str = "c10d",
) -> Tensor:
    """Routed-expert FFN with the experts sharded over the ranks of ``group``.

    Args:
        x: this rank's tokens ``[T, D]``.
        topk_ids: ``[T, k]`` global expert ids in ``[0, num_experts)``; with ``dedup`` distinct
            within a token.
        topk_weights: ``[T, k]`` routing weights, any floating dtype; differentiable.
        w1_local: ``[E / R, D, F]`` (or fused ``[E / R, D, 2F]``), the experts
            ``rank * E / R ... (rank + 1) * E / R - 1`` of this rank, in the dtype of ``x``.
        w2_local: ``[E / R, F, D]``.
        w3_local: ``[E / R, D, F]`` for gated activations with a separate ``w1``, else None.
        num_experts: ``E``, divisible by the group size ``R``.
        group: the expert-parallel process group; the default group when None.
        activation, alpha, limit: as in :func:`torch_moe.nn.functional.moe_ffn`.
        dedup: send one row per (token, destination rank) instead of one per assignment.
        num_chunks: split the tokens into this many chunks (at most 16) whose exchanges
            overlap the expert compute of the others.
        capacity_factor: capacity mode (static shapes, overflow dropped and counted); None for
            the exact mode.
        sync_free: capacity mode without a host read (see "Sync-free capacity mode"): every
            rank must pass the same number of tokens; the header is checked on the device.
        backend: ``"c10d"``, the row exchanges are ``all_to_all_single`` of the group's
            backend (NCCL, gloo, ...); ``"symm_mem"``, ``symm_mem::all_to_all_vdev`` on CUDA
            with NVSHMEM: the exact mode without a host read (see "Symmetric memory").

    Every argument but the tokens and their routing (``T`` may differ, but with ``sync_free``
    or ``backend="symm_mem"``) must agree on every rank; the ranks compare their signatures
    first and all raise the same ``ValueError`` when they do not. Arguments that fail the local checks on some ranks make every rank raise
    (see the module's "Argument errors"); only the errors of ``group`` itself are raised on the
    calling rank alone.

    Returns:
        ``[T, D]`` in the dtype of ``x``: ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
        (dropped assignments excluded in capacity mode).
    """
    layer, plan, splits = _plan_and_exchange_header(
        x, topk_ids, topk_weights, w1_local, w2_local, w3_local, num_experts=num_experts,
        group=group, activation=activation, alpha=alpha, limit=limit, dedup=dedup,
        num_chunks=num_chunks, capacity_factor=capacity_factor, sync_free=sync_free,
        backend=backend)
    y, counts = _dispatch_compute_combine(x, topk_ids, topk_weights,
                                          _LocalExperts(w1_local, w2_local, w3_local), layer,
                                          plan, splits)
    _record_traffic(layer, splits, counts, x.device)
    return y


def _plan_and_exchange_header(x, topk_ids, topk_weights, w1_local, w2_local, w3_local, *,
                              num_experts, group, **options
                              ) -> tuple[_Layer, _Plan, list[_Splits]]:
    """The local checks of a call's arguments (a failing rank raises with the group, see
    "Argument errors"), then 1. the row plan of every chunk and 2. the header exchange, the
    host synchronisation: the call's layer, plan and the splits of every chunk."""
    group, R = _resolve_group(group)
    error = _local_check_error(x, topk_ids, topk_weights, w1_local, w2_local, w3_local,
                               num_experts=num_experts, num_ranks=R, **options)
    if error is not None:
        _raise_with_the_group(error, group, _header_device(x, group))
    layer = _Layer.of(x, topk_ids, num_experts=num_experts, group=group, **options)
    plan = _plan_rows(topk_ids, layer)
    splits = _exchange_header(layer, plan.rows_per_dest_Rn, plan.id_flags)
    return layer, plan, splits


class _Dispatched(NamedTuple):
    """A call after step 3: every chunk's rows on their way to their experts, and what the
    combine needs to bring the results back."""

    x: Tensor  # [T, D], the tokens (their dtype and device are the output's)
    layer: _Layer
    splits: list  # per chunk: _Splits (host-known), or _DeviceSplits with symm_mem
    buffers: list[_SendBuffers]  # per chunk
    received: list[_Received]  # per chunk, possibly in flight


def _start_exchange(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, layer: _Layer,
                    plan: _Plan, splits: list[_Splits]) -> _Dispatched:
    """Step 3: every chunk's send buffers, and its rows started towards their experts."""
    buffers = [_pack(topk_ids[s:e], topk_weights[s:e], p, layer, sp)
               for (s, e), p, sp in zip(layer.spans, plan.chunks, splits)]
    received = [_send_rows(_chunk_tokens(x, s, e), buf, layer, c)
                for c, ((s, e), buf) in enumerate(zip(layer.spans, buffers))]
    return _Dispatched(x, layer, splits, buffers, received)


def _dispatch_compute_combine(x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                              experts: _LocalExperts, layer: _Layer, plan: _Plan,
                              splits: list[_Splits]) -> tuple[Tensor, dict[str, Tensor]]:
    """Steps 3 to 5 of a call, given the host-known splits of every chunk: ``y [T, D]`` in
    ``x.dtype`` and the device counters of the call (:func:`_call_counts`). In capacity mode
    every shape here follows from the splits: no op has a data-dependent shape and nothing is
    read on the host, so this part traces into one graph."""
    # 3. exchange: start every chunk's rows towards their experts
    dispatched = _start_exchange(x, topk_ids, topk_weights, layer, plan, splits)
    # 4. expert compute, chunk by chunk, each result sent back at once: with several chunks
    # the exchanges of one overlap the expert compute of another
    computed = [_compute_experts(r, sp, experts, layer, c)
                for c, (r, sp) in enumerate(zip(dispatched.received, splits))]
    # 5. combine
    y = _combine(x, layer, dispatched.buffers, [c.returning_ND for c in computed])
    load_G = sum(c.load_G for c in computed)
    return y, _call_counts(layer, dispatched.buffers, [c.ids_MW for c in computed], load_G)


# ---------------------------------------------------------------------------------------------
# The same steps around an expert compute that runs elsewhere: the expert-parallel
# ParallelStyles dispatch in a module's forward pre-hook, compute in its forward and combine
# in its forward hook
# ---------------------------------------------------------------------------------------------


def _dispatch_tokens(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1_local: Tensor,
                     w2_local: Tensor, w3_local: Optional[Tensor], *, num_experts: int,
                     group: Optional[dist.ProcessGroup] = None, activation: str = "swiglu",
                     alpha: float = 1.702, limit: float = 7.0, dedup: bool = False,
                     num_chunks: int = 1, capacity_factor: Optional[float] = None,
                     sync_free: bool = False, backend: str = "c10d") -> _Dispatched:
    """Steps 1 to 3 of :func:`expert_parallel_moe_ffn` (same arguments, the same errors on
    every rank): the local checks, the row plan, the header exchange and the start of every
    chunk's exchange. The weights are checked here, not used."""
    layer, plan, splits = _plan_and_exchange_header(
        x, topk_ids, topk_weights, w1_local, w2_local, w3_local, num_experts=num_experts,
        group=group, activation=activation, alpha=alpha, limit=limit, dedup=dedup,
        num_chunks=num_chunks, capacity_factor=capacity_factor, sync_free=sync_free,
        backend=backend)
    return _start_exchange(x, topk_ids, topk_weights, layer, plan, splits)


def _received_rows(dispatched: _Dispatched) -> _Received:
    """The rows of every chunk, concatenated (this waits for all of them): ``[M, D]`` rows
    with their ``[M, W]`` local expert ids and routing weights, ``M`` summed over the
    chunks."""
    received = dispatched.received
    if len(received) == 1:
        r = received[0]
        return _Received(r.rows_MD, wait_tensor(r.ids_MW), r.weights_MW)
    return _Received(*(torch.cat(parts) for parts in zip(*received)))


def _combine_rows(dispatched: _Dispatched, out_MD: Tensor, ids_MW: Tensor,
                  load_G: Tensor) -> Tensor:
    """The rest of the call for rows computed all at once: ``out_MD [M, D]`` are the weighted
    expert sums of the rows of :func:`_received_rows`, ``ids_MW`` their ids and ``load_G [G]``
    the assignments each local expert computed. Every chunk's results go back to their
    sources and are added into ``y [T, D]`` in ``x.dtype``; the counters are recorded."""
    x, layer, splits, buffers = dispatched.x, dispatched.layer, dispatched.splits, \
        dispatched.buffers
    sizes = [sp.num_recv for sp in splits]
    returning = [_send_back(out, sp, layer, c)
                 for c, (out, sp) in enumerate(zip(out_MD.split(sizes), splits))]
    y = _combine(x, layer, buffers, returning)
    counts = _call_counts(layer, buffers, list(ids_MW.split(sizes)), load_G)
    _record_traffic(layer, splits, counts, x.device)
    return y


def _row_bytes(layer: _Layer) -> tuple[int, int]:
    """Bytes of a dispatched row (the token values, then W (id, weight) pairs) and of a
    returned one (the values)."""
    elem_bytes = layer.dtype.itemsize
    pair = torch.finfo(_WEIGHT_DTYPE).bits // 8 + torch.iinfo(_ID_DTYPE).bits // 8
    return layer.D * elem_bytes + layer.W * pair, layer.D * elem_bytes


def _record_traffic(layer: _Layer, splits: list, stats: dict, device) -> None:
    rank = layer.rank
    dispatch_row, combine_row = _row_bytes(layer)
    _count("calls", 1, device)
    for sp in splits:
        if isinstance(sp, _DeviceSplits):
            continue  # counted on the device, in stats
        # wire rows: the rows (padding included) to and from other ranks
        sent_remote = sum(sp.send) - sp.send[rank]
        recv_remote = sum(sp.recv) - sp.recv[rank]
        _count("bytes_sent", sent_remote * dispatch_row + recv_remote * combine_row, device)
        _count("bytes_received", recv_remote * dispatch_row + sent_remote * combine_row,
               device)
        if sp.capacity is None:
            _count("rows_sent", sum(sp.send), device)
            _count("rows_received", sum(sp.recv), device)
            _count("rows_sent_remote", sent_remote, device)
            _count("rows_received_remote", recv_remote, device)
    for name in ("rows_sent", "rows_received", "rows_sent_remote", "rows_received_remote",
                 "bytes_sent", "bytes_received", "dropped"):
        if name in stats:
            _count(name, stats[name], device)
    _counters()["last_expert_load"] = stats["last_expert_load"]
