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
message, as a single process would. Raised on the calling rank alone, before any collective,
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
tensors; the ParallelStyles of :mod:`torch_moe.distributed.parallel` wrap this function).
"""

from __future__ import annotations

import math
import numbers
import struct
import threading
from dataclasses import dataclass
from typing import NamedTuple, NoReturn, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe._checks import ACTIVATIONS, GATED_ACTIVATIONS
from torch_moe._compat import assert_async
from torch_moe.distributed._compat import (
    all_to_all_single,
    all_to_all_single_autograd,
    object_collective_device,
    wait_tensor,
)

__all__ = [
    "expert_parallel_moe_ffn",
    "read_dispatch_counters",
    "reset_dispatch_counters",
]

_FN = "expert_parallel_moe_ffn"

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

# The header exchange has a fixed width, so that ranks disagreeing on num_chunks still pair up
# in it; it carries one column per chunk, hence the bound.
_MAX_CHUNKS = 16

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class _Layer:
    """One call as every rank of the group must see it (the signature), and this rank's place."""

    group: dist.ProcessGroup
    R: int  # ranks of the group
    rank: int
    num_experts: int
    G: int  # experts per rank
    D: int
    k: int
    W: int  # (local expert id, weight) pairs per row
    dtype: torch.dtype
    dedup: bool
    num_chunks: int
    capacity_factor: Optional[float]
    activation: str
    alpha: float
    limit: float
    spans: tuple  # ((start, end), ...): the tokens of every chunk

    @classmethod
    def of(cls, x: Tensor, topk_ids: Tensor, *, num_experts: int, group, activation: str,
           alpha: float, limit: float, dedup: bool, num_chunks: int,
           capacity_factor: Optional[float]) -> "_Layer":
        group = group if group is not None else dist.group.WORLD
        R = dist.get_world_size(group)
        G = num_experts // R
        T, k = topk_ids.shape
        bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
        return cls(group, R, dist.get_rank(group), num_experts, G, x.size(1), k,
                   min(k, G) if dedup else 1, x.dtype, dedup, num_chunks,
                   None if capacity_factor is None else float(capacity_factor), activation,
                   float(alpha), float(limit), tuple(zip(bounds[:-1], bounds[1:])))

    def capacity(self, num_tokens: int) -> int:
        """Rows per destination of a chunk of ``num_tokens`` tokens in capacity mode:
        ``ceil(c * T_chunk * k / R)``, at most the rows such a chunk can have for one destination
        (``T_chunk`` with dedup, ``T_chunk * k`` without) and at least 1."""
        most = num_tokens if self.dedup else num_tokens * self.k
        wanted = min(float(most), self.capacity_factor * num_tokens * self.k / self.R)
        return max(1, math.ceil(wanted))


# ---------------------------------------------------------------------------------------------
# Step 2, header exchange: the layer signature, argument errors and split sizes of every rank
# ---------------------------------------------------------------------------------------------


def _float_code(v: float) -> int:
    return struct.unpack("<q", struct.pack("<d", v))[0]


def _float_of(code: int) -> float:
    return struct.unpack("<d", struct.pack("<q", code))[0]


# The layer signature: (name in errors, code of a layer, the value a code stands for). A
# capacity_factor of None is coded 0 (the code of 0.0, which is not a valid factor).
_SIGNATURE = (
    ("num_experts", lambda L: L.num_experts, int),
    ("x.size(1)", lambda L: L.D, int),
    ("x.dtype", lambda L: _DTYPES.index(L.dtype), lambda c: _DTYPES[c]),
    ("num_chunks", lambda L: L.num_chunks, int),
    ("capacity_factor", lambda L: _float_code(L.capacity_factor or 0.0),
     lambda c: _float_of(c) or None),
    ("dedup", lambda L: int(L.dedup), bool),
    ("pairs per row W (min(k, num_experts / R) with dedup, else 1)", lambda L: L.W, int),
    ("activation", lambda L: ACTIVATIONS.index(L.activation), lambda c: ACTIVATIONS[c]),
    ("alpha", lambda L: _float_code(L.alpha), _float_of),
    ("limit", lambda L: _float_code(L.limit), _float_of),
)
_S = len(_SIGNATURE)
# A header row: the signature; the sender's argument error (the code of its type in
# _ERROR_TYPES, 0 when its arguments passed the local checks, and the length of its message in
# bytes); one column per chunk; then the flags of the ids.
_ERROR_TYPE, _ERROR_BYTES = _S, _S + 1
_CHUNK = _S + 2
_OUT_OF_RANGE, _REPEATED = _CHUNK + _MAX_CHUNKS, _CHUNK + _MAX_CHUNKS + 1
_WIDTH = _REPEATED + 1
_ERROR_TYPES = (None, ValueError, TypeError)
# the other ranks receive at most this many characters of a failing rank's message
_MAX_MESSAGE = 1000


def _check_signatures(signatures: list[list[int]]) -> None:
    """Raises the same ``ValueError`` on every rank when the ranks' signatures differ (every
    rank holds every rank's signature)."""
    problems = []
    for i, (name, _, decode) in enumerate(_SIGNATURE):
        ranks_of = {}
        for src, sig in enumerate(signatures):
            ranks_of.setdefault(sig[i], []).append(src)
        if len(ranks_of) > 1:
            got = [f"{decode(code)!r} on ranks {ranks}" for code, ranks in ranks_of.items()]
            problems.append(f"the same {name}, but got {', '.join(got[:-1])} and {got[-1]}")
    if problems:
        raise ValueError(f"{_FN}: expected every rank of the expert-parallel group to pass "
                         + "; ".join(problems))


def _id_errors(num_experts: int, W: int) -> tuple[str, str]:
    return (f"{_FN}: expected expert ids in [0, {num_experts})",
            f"{_FN}: expected distinct expert ids per token (with dedup a row holds at most "
            f"W = {W} of a token's experts)")


@dataclass
class _Splits:
    """Rows per rank of one chunk's exchange: ``send[d]`` to rank d, ``recv[s]`` from rank s.
    ``capacity`` is ``C`` in capacity mode (then ``send == [C] * R``), else None."""

    send: list[int]
    recv: list[int]
    capacity: Optional[int]


def _exchange_header(layer: _Layer, plan: _Plan) -> list[_Splits]:
    """The first collective of a call: one all-to-all of an int64 header ``[R, S + 2 + 16 + 2]``
    per rank, whose width depends on no argument, then one device-to-host copy.

    A header row holds the layer signature, the argument error of the sender (none here: this
    rank's arguments passed the local checks; see :func:`_raise_with_the_group`), one column per
    chunk (the rows for that destination in exact mode, this rank's capacity ``C`` in capacity
    mode) and the flags of the expert ids (out of range, repeated). Every rank receives every
    rank's header, so every rank takes the same decision: the same error, or the splits of every
    chunk. Ranks that failed their local checks come first (:func:`_argument_error`), then
    signatures that differ. Exact mode copies the whole header to the host and raises a
    ``ValueError`` naming the ranks with bad ids. Capacity mode copies all but the flags of the
    ids (no value that depends on the tokens) and asserts on the flags on the device (an
    asynchronous assertion: a ``RuntimeError`` on every rank on CPU, a device-side assertion on
    CUDA)."""
    R, n = layer.R, layer.num_chunks
    device = plan.out_of_range.device
    if layer.capacity_factor is None:
        columns = torch.stack([p.rows_per_dest for p in plan.chunks], 1)  # [R, n]
    else:
        caps = [layer.capacity(e - s) for s, e in layer.spans]
        columns = torch.tensor(caps, dtype=torch.int64, device=device).expand(R, n)
    # the signature, then no argument error: type code 0, message of 0 bytes
    signature = torch.tensor([code(layer) for _, code, _ in _SIGNATURE] + [0, 0],
                             dtype=torch.int64, device=device)
    send = torch.cat([
        signature.expand(R, _CHUNK),
        columns,
        columns.new_zeros(R, _MAX_CHUNKS - n),
        torch.stack([plan.out_of_range, plan.repeated]).long().view(1, 2).expand(R, 2),
    ], 1)  # row r goes to rank r
    recv = wait_tensor(all_to_all_single(send, None, None, layer.group))
    out_of_range, repeated = _id_errors(layer.num_experts, layer.W)
    if layer.capacity_factor is None:
        sent, received = torch.stack([send, recv]).tolist()  # the host synchronisation
        _raise_argument_errors(received, layer.group, device)
        _check_signatures([row[:_S] for row in received])
        for flag, message in ((_OUT_OF_RANGE, out_of_range), (_REPEATED, repeated)):
            ranks = [src for src, row in enumerate(received) if row[flag]]
            if ranks:
                raise ValueError(f"{message}, but ranks {ranks} of the expert-parallel group "
                                 "passed ids that are not")
        return [_Splits([row[_CHUNK + c] for row in sent], [row[_CHUNK + c] for row in received],
                        None)
                for c in range(n)]
    received = recv[:, :_OUT_OF_RANGE].tolist()  # the one host read: shapes and arguments
    _raise_argument_errors(received, layer.group, device)
    _check_signatures([row[:_S] for row in received])
    assert_async(recv[:, _OUT_OF_RANGE].eq(0).all(),
                 f"{out_of_range}, but a rank of the expert-parallel group passed an id "
                 "outside that range")
    assert_async(recv[:, _REPEATED].eq(0).all(),
                 f"{repeated}, but a rank of the expert-parallel group repeated an id "
                 "within a token")
    return [_Splits([caps[c]] * R, [row[_CHUNK + c] for row in received], caps[c])
            for c in range(n)]


def _raise_argument_errors(received: list[list[int]], group, device) -> None:
    """Raises on a rank whose arguments passed the local checks when the header rows
    ``received`` say that other ranks' did not."""
    error = _argument_error([row[_ERROR_TYPE:_CHUNK] for row in received], None, group, device)
    if error is not None:
        raise error


def _raise_with_the_group(error: Exception, group, device) -> NoReturn:
    """The header exchange of a rank whose arguments failed the local checks (``error``): it
    takes part with a header of the same width, without a signature, that flags the error, so
    that no rank is left waiting for it; then it raises with the others (see
    :func:`_argument_error`)."""
    R = dist.get_world_size(group)
    send = torch.zeros(R, _WIDTH, dtype=torch.int64, device=device)
    send[:, _ERROR_TYPE] = _ERROR_TYPES.index(TypeError if isinstance(error, TypeError)
                                              else ValueError)
    send[:, _ERROR_BYTES] = len(_carried(error))
    recv = wait_tensor(all_to_all_single(send, None, None, group))
    raise _argument_error(recv[:, _ERROR_TYPE:_CHUNK].tolist(), error, group, device)


def _carried(error: Exception) -> bytes:
    """The bytes of ``error``'s message that the other ranks receive."""
    message = str(error)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + " ..."
    return message.encode()


def _argument_error(errors: list[list[int]], own: Optional[Exception], group,
                    device) -> Optional[Exception]:
    """The exception to raise when some ranks' arguments failed their local checks, else None.

    ``errors[src]`` is the (type code, message bytes) pair of rank ``src``'s header; ``own`` is
    this rank's error, None when its arguments passed. Every rank raises the type of the lowest
    failing rank: a failing rank with its own message, the others with one that names the
    failing ranks and carries their messages, which one more exchange brings them (on this path
    only, and only when some rank passed: every rank knows from the header whether it comes)."""
    failing = [src for src, (code, _) in enumerate(errors) if code]
    if not failing:
        return None
    exc_type = _ERROR_TYPES[errors[failing[0]][0]]
    messages = None
    if len(failing) < len(errors):
        messages = _exchange_messages(own, [n for _, n in errors], group, device)
    if own is not None:
        if type(own) is exc_type:
            return own
        error = exc_type(str(own))
        error.__cause__ = own
        return error
    # "rank 1: expected x to be 2-D ...": the name of the function comes once, in front
    reasons = [f"rank {src}: {messages[src].removeprefix(_FN + ': ')}" for src in failing]
    return exc_type(f"{_FN}: ranks {failing} of the expert-parallel group passed invalid "
                    f"arguments; {'; '.join(reasons)}")


def _exchange_messages(own: Optional[Exception], lengths: list[int], group,
                       device) -> list[str]:
    """Every rank's carried error message (empty for a rank without an error), from every rank,
    whose lengths in bytes the header told every rank: one all-to-all of equal splits, every
    message zero-padded to the longest, in int64 words."""
    R, words = len(lengths), -(-max(lengths) // 8)
    mine = _carried(own) if own is not None else b""
    payload = torch.frombuffer(bytearray((mine + bytes(8 * words - len(mine))) * R),
                               dtype=torch.int64).to(device)
    received = wait_tensor(all_to_all_single(payload, None, None, group))
    data = bytes(received.cpu().view(torch.uint8).tolist())
    return [data[8 * words * src:8 * words * src + n].decode(errors="replace")
            for src, n in enumerate(lengths)]


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
        num_rows = sum(splits.send)
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


def _send_rows(x_chunk: Tensor, buffers: _SendBuffers, group) -> _Received:
    """Starts the exchange of one chunk: its rows (differentiable), local expert ids and
    routing weights (differentiable), with functional all-to-alls that run in the
    background."""
    sp = buffers.splits
    rows = x_chunk.index_select(0, buffers.token_N)
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
                     layer: _Layer) -> _Computed:
    """Waits for a chunk's ids, runs the local experts on its rows with the travelling weights
    (``k = W``; the unused id ``G`` sorts past the last group and is skipped) and starts the
    results back to their sources: the reverse of the chunk's exchange."""
    G = layer.G
    ids = wait_tensor(received.ids_MW)
    sorted_ids, offs, counts = torch.ops.torch_moe.token_sort(ids, G + 1)
    out, _ = torch.ops.torch_moe.grouped_ffn(
        received.rows_MD, sorted_ids, offs[:G], received.weights_MW, *experts,
        layer.activation, layer.alpha, layer.limit)
    returning = all_to_all_single_autograd(out, splits.send, splits.recv, layer.group)
    return _Computed(returning, ids, counts[:G])


# ---------------------------------------------------------------------------------------------
# Step 5, combine: the returned rows added into the output of their tokens
# ---------------------------------------------------------------------------------------------


def _combine(x: Tensor, layer: _Layer, buffers: list[_SendBuffers],
             computed: list[_Computed]) -> Tensor:
    """``y [T, D]`` in ``x.dtype``: the returned rows of every token added in fp32."""
    ys = []
    for (s, e), buf, back in zip(layer.spans, buffers, computed):
        # an empty chunk still has its padding rows in capacity mode: they add zeros to a
        # spare row, so that the returned rows stay in the graph of every rank's backward
        y = torch.zeros(max(e - s, 1), layer.D, dtype=torch.float32, device=x.device)
        y = y.index_add(0, buf.token_N, back.returning_ND.float())
        # a non-empty chunk's sum is used whole, so the result is a tensor of its own (a module
        # wrapped by fully_shard must not return a view); only an empty chunk slices its spare
        # row away
        ys.append(y if e > s else y[:0])
    y = torch.cat(ys) if len(ys) > 1 else ys[0]
    return y.to(x.dtype)


def _call_counts(layer: _Layer, buffers: list[_SendBuffers],
                 computed: list[_Computed]) -> dict[str, Tensor]:
    """The device counters of this call: ``last_expert_load``, and in capacity mode the row
    counts and ``dropped``, which only the device knows (padding rows carry the unused id
    ``G`` alone)."""
    rank = layer.rank
    stats: dict[str, Tensor] = {}
    for buf, c in zip(buffers, computed):
        _add(stats, "last_expert_load", c.load_G)
        sp = buf.splits
        if sp.capacity is None:
            continue
        used = (c.ids_MW < layer.G).any(1).long()
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


def _check_options(activation, dedup, num_chunks, capacity_factor, alpha, limit):
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
    for name, v in (("alpha", alpha), ("limit", limit)):
        value = _as_float(v)
        if value is None or math.isnan(value):
            raise ValueError(f"{_FN}: expected {name} to be a number (not NaN, within the range "
                             f"of a float), but got {v!r}")


def _local_check_error(x, topk_ids, topk_weights, w1, w2, w3, *, num_experts, num_ranks,
                       activation, alpha, limit, dedup, num_chunks,
                       capacity_factor) -> Optional[Exception]:
    """The error of the first local check (shapes, dtypes, devices, options) that this rank's
    arguments fail, or None. It is raised with the group (:func:`_raise_with_the_group`)."""
    try:
        _check_tensors(x, topk_ids, topk_weights, num_experts, num_ranks)
        _check_options(activation, dedup, num_chunks, capacity_factor, alpha, limit)
        _check_experts(w1, w2, w3, x, num_experts // num_ranks, activation)
    except (TypeError, ValueError) as e:
        return e
    return None


def _header_device(x, group: dist.ProcessGroup) -> torch.device:
    """The device of the header of a rank whose arguments failed: that of ``x`` as on the other
    ranks, or the group's default device when ``x`` is not a tensor with data."""
    if isinstance(x, Tensor) and x.device.type != "meta":
        return x.device
    return object_collective_device(group)


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

    Every argument but the tokens and their routing (``T`` may differ) must agree on every
    rank; the ranks compare their signatures first and all raise the same ``ValueError``
    when they do not. Arguments that fail the local checks on some ranks make every rank raise
    (see the module's "Argument errors"); only the errors of ``group`` itself are raised on the
    calling rank alone.

    Returns:
        ``[T, D]`` in the dtype of ``x``: ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``
        (dropped assignments excluded in capacity mode).
    """
    group, R = _resolve_group(group)
    error = _local_check_error(x, topk_ids, topk_weights, w1_local, w2_local, w3_local,
                               num_experts=num_experts, num_ranks=R, activation=activation,
                               alpha=alpha, limit=limit, dedup=dedup, num_chunks=num_chunks,
                               capacity_factor=capacity_factor)
    if error is not None:
        _raise_with_the_group(error, group, _header_device(x, group))
    layer = _Layer.of(x, topk_ids, num_experts=num_experts, group=group, activation=activation,
                      alpha=alpha, limit=limit, dedup=dedup, num_chunks=num_chunks,
                      capacity_factor=capacity_factor)
    # 1. plan the rows of every chunk; 2. exchange the header (the host synchronisation)
    plan = _plan_rows(topk_ids, layer)
    splits = _exchange_header(layer, plan)
    y, counts = _dispatch_compute_combine(x, topk_ids, topk_weights,
                                          _LocalExperts(w1_local, w2_local, w3_local), layer,
                                          plan, splits)
    _record_traffic(layer, splits, counts, x.element_size(), x.device)
    return y


def _dispatch_compute_combine(x: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                              experts: _LocalExperts, layer: _Layer, plan: _Plan,
                              splits: list[_Splits]) -> tuple[Tensor, dict[str, Tensor]]:
    """Steps 3 to 5 of a call, given the host-known splits of every chunk: ``y [T, D]`` in
    ``x.dtype`` and the device counters of the call (:func:`_call_counts`). In capacity mode
    every shape here follows from the splits: no op has a data-dependent shape and nothing is
    read on the host, so this part traces into one graph."""
    # 3. exchange: start every chunk's rows towards their experts
    buffers = [_pack(topk_ids[s:e], topk_weights[s:e], p, layer, sp)
               for (s, e), p, sp in zip(layer.spans, plan.chunks, splits)]
    received = [_send_rows(_chunk_tokens(x, s, e), buf, layer.group)
                for (s, e), buf in zip(layer.spans, buffers)]
    # 4. expert compute, chunk by chunk, each result sent back at once: with several chunks
    # the exchanges of one overlap the expert compute of another
    computed = [_compute_experts(r, sp, experts, layer) for r, sp in zip(received, splits)]
    # 5. combine
    return _combine(x, layer, buffers, computed), _call_counts(layer, buffers, computed)


def _record_traffic(layer: _Layer, splits: list[_Splits], stats: dict, elem_bytes: int,
                    device) -> None:
    rank, D, W = layer.rank, layer.D, layer.W
    dispatch_row = D * elem_bytes + W * (torch.finfo(_WEIGHT_DTYPE).bits // 8
                                         + torch.iinfo(_ID_DTYPE).bits // 8)
    combine_row = D * elem_bytes
    _count("calls", 1, device)
    for sp in splits:
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
                 "dropped"):
        if name in stats:
            _count(name, stats[name], device)
    _counters()["last_expert_load"] = stats["last_expert_load"]
