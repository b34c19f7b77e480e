"""The header exchange of the expert-parallel dispatcher, and its argument errors.

Before any collective whose size depends on the data, every rank of the group sends every other
rank one fixed-width int64 header row (one ``all_to_all_single``): the layer signature (the
arguments every rank must pass alike), the sender's argument error (the type of the error its
local checks raised, and the length of its message), one column per chunk (rows for that
destination, or the sender's capacity in capacity mode) and two flags of the expert ids. Its
width depends on no argument, so that ranks that disagree still pair up in it; every rank then
takes the same decision from the same rows: the same error, or the split sizes of every
chunk. See :mod:`torch_moe.distributed.dispatch` ("Argument errors") for what each rank raises.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NoReturn, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe._checks import ACTIVATIONS
from torch_moe._compat import assert_async
from torch_moe.distributed._compat import (
    all_to_all_single,
    object_collective_device,
    wait_tensor,
)

_FN = "expert_parallel_moe_ffn"

# The header exchange has a fixed width, so that ranks disagreeing on num_chunks still pair up
# in it; it carries one column per chunk, hence the bound.
_MAX_CHUNKS = 16

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# the transports of the row exchanges: all_to_all_single, or symm_mem::all_to_all_vdev
BACKENDS = ("c10d", "symm_mem")


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
    sync_free: bool = False  # capacity mode checked on the device, without a host read
    backend: str = "c10d"  # one of BACKENDS

    @classmethod
    def of(cls, x: Tensor, topk_ids: Tensor, *, num_experts: int, group, activation: str,
           alpha: float, limit: float, dedup: bool, num_chunks: int,
           capacity_factor: Optional[float], sync_free: bool = False,
           backend: str = "c10d") -> "_Layer":
        group = group if group is not None else dist.group.WORLD
        R = dist.get_world_size(group)
        G = num_experts // R
        T, k = topk_ids.shape
        bounds = [T * c // num_chunks for c in range(num_chunks + 1)]
        return cls(group, R, dist.get_rank(group), num_experts, G, x.size(1), k,
                   min(k, G) if dedup else 1, x.dtype, dedup, num_chunks,
                   None if capacity_factor is None else float(capacity_factor), activation,
                   float(alpha), float(limit), tuple(zip(bounds[:-1], bounds[1:])), sync_free,
                   backend)

    def capacity(self, num_tokens: int) -> int:
        """Rows per destination of a chunk of ``num_tokens`` tokens in capacity mode:
        ``ceil(c * T_chunk * k / R)``, at most the rows such a chunk can have for one destination
        (``T_chunk`` with dedup, ``T_chunk * k`` without) and at least 1."""
        most = num_tokens if self.dedup else num_tokens * self.k
        wanted = min(float(most), self.capacity_factor * num_tokens * self.k / self.R)
        return max(1, math.ceil(wanted))


    def rows_bound(self, num_tokens: int) -> int:
        """``backend="symm_mem"``: the most rows a chunk of ``num_tokens`` tokens sends to one
        destination (every assignment there, or with dedup every token), at least 1."""
        return max(1, num_tokens if self.dedup else num_tokens * self.k)

    def send_bound(self, num_tokens: int) -> int:
        """``backend="symm_mem"``: the most rows a chunk of ``num_tokens`` tokens sends (one per
        assignment, or with dedup one per token and destination), at least 1."""
        return max(1, num_tokens * (min(self.k, self.R) if self.dedup else self.k))


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
    ("sync_free", lambda L: int(L.sync_free), bool),
    ("backend", lambda L: BACKENDS.index(L.backend), lambda c: BACKENDS[c]),
)
_S = len(_SIGNATURE)
_SYNC_FREE, _BACKEND = _S - 2, _S - 1
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

    @property
    def num_send(self) -> int:
        """Rows of the send buffer."""
        return sum(self.send)

    @property
    def num_recv(self) -> int:
        """Rows of the receive buffer."""
        return sum(self.recv)


@dataclass
class _DeviceSplits:
    """One chunk's exchange with ``backend="symm_mem"``: the rows for every destination stay on
    the device, and so do the rows received (which the exchange returns), in buffers of
    host-known bounds."""

    send: Tensor  # [R] int64, rows to every destination
    num_send: int  # rows of the send buffer: at least send.sum(), the rest padding
    num_recv: int  # rows of the receive buffer: the most this rank can receive
    recv: Optional[Tensor] = None  # [R] int64, rows from every source: set by the rows exchange
    capacity = None  # exact mode: nothing dropped


def _exchange_header(layer: _Layer, rows_per_dest: Tensor, id_flags: Tensor) -> list[_Splits]:
    """The first collective of a call: one all-to-all of an int64 header ``[R, S + 2 + 16 + 2]``
    per rank, whose width depends on no argument, then (but with ``sync_free``) one
    device-to-host copy.

    ``rows_per_dest [R, num_chunks]`` int64 are this rank's rows for every destination and
    chunk (exact mode; unused in capacity mode), ``id_flags [2]`` bool say whether an expert id
    is out of range and whether a row would hold more than ``W`` pairs (a repeated id).

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
    CUDA). With ``sync_free`` or ``backend="symm_mem"`` nothing is copied: see
    :func:`_check_on_device`; the splits of ``symm_mem`` are :class:`_DeviceSplits`."""
    R, n = layer.R, layer.num_chunks
    device = id_flags.device
    # the signature, then no argument error: type code 0, message of 0 bytes
    codes = tuple(code(layer) for _, code, _ in _SIGNATURE) + (0, 0)
    if layer.backend == "symm_mem":
        # the tokens of every chunk, which must agree: they bound the buffers of every rank
        send_prefix = _constant_rows(codes + tuple(e - s for s, e in layer.spans), R, device)
    elif layer.capacity_factor is None:
        columns = rows_per_dest
        send_prefix = torch.cat([_constant_rows(codes, R, device), columns], 1)
    else:
        caps = [layer.capacity(e - s) for s, e in layer.spans]
        send_prefix = _constant_rows(codes + tuple(caps), R, device)
    send = torch.cat([
        send_prefix,
        send_prefix.new_zeros(R, _MAX_CHUNKS - n),
        id_flags.long().view(1, 2).expand(R, 2),
    ], 1)  # row r goes to rank r
    recv = wait_tensor(all_to_all_single(send, None, None, layer.group))
    out_of_range, repeated = _id_errors(layer.num_experts, layer.W)
    if layer.backend == "symm_mem":
        _check_on_device(send, recv, out_of_range, repeated)
        return [_DeviceSplits(rows_per_dest[:, c].contiguous(), layer.send_bound(e - s),
                              R * layer.rows_bound(e - s))
                for c, (s, e) in enumerate(layer.spans)]
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
    if layer.sync_free:
        _check_on_device(send, recv, out_of_range, repeated)
        return [_Splits([caps[c]] * R, [caps[c]] * R, caps[c]) for c in range(n)]
    received = recv[:, :_OUT_OF_RANGE].tolist()  # the one host read: shapes and arguments
    _raise_argument_errors(received, layer.group, device)
    _check_signatures([row[:_S] for row in received])
    _assert_no_id_errors(recv, out_of_range, repeated)
    return [_Splits([caps[c]] * R, [row[_CHUNK + c] for row in received], caps[c])
            for c in range(n)]


# The constant part of a header, keyed by its values: built once per device, so that a
# steady-state call copies nothing from the host (a blocking host-to-device copy waits for the
# device, and cannot be captured in a CUDA graph). Entries are never dropped: a captured graph
# reads its rows without holding a reference to them, and each is a few hundred bytes.
_CONSTANT_ROWS_CACHE: dict = {}


def _constant_rows(values: tuple, R: int, device: torch.device) -> Tensor:
    """``[R, len(values)]`` int64 on ``device``, every row ``values``."""
    if torch.compiler.is_compiling():
        # a traced graph holds the values as constants; the cache would only add guards on it
        return torch.tensor(values, dtype=torch.int64).to(device).expand(R, len(values))
    key = (values, R, device)
    rows = _CONSTANT_ROWS_CACHE.get(key)
    if rows is None:
        rows = torch.tensor(values, dtype=torch.int64).to(device).expand(R, len(values))
        _CONSTANT_ROWS_CACHE[key] = rows
    return rows


def _assert_no_id_errors(recv: Tensor, out_of_range: str, repeated: str) -> None:
    assert_async(recv[:, _OUT_OF_RANGE].eq(0).all(),
                 f"{out_of_range}, but a rank of the expert-parallel group passed an id "
                 "outside that range")
    assert_async(recv[:, _REPEATED].eq(0).all(),
                 f"{repeated}, but a rank of the expert-parallel group repeated an id "
                 "within a token")


def _check_on_device(send: Tensor, recv: Tensor, out_of_range: str, repeated: str) -> None:
    """The header checks of a ``sync_free`` or ``backend="symm_mem"`` call, as asynchronous
    assertions on the device (a ``RuntimeError`` on every rank on CPU, where the assertion is
    checked at once, before the next collective; a device-side assertion on CUDA): every rank's
    header must be the one this rank sent (the same signature, the same capacities or chunk
    sizes, hence the same number of tokens) and flag no argument error and no bad id. Every
    rank receives every rank's header, so every rank that passed its local checks fails the same
    assertion; a rank that failed them raises its own error (:func:`_raise_with_the_group`)."""
    # the rows received; the row this rank sent (every row of send is the same up to here)
    got, want = recv[:, :_OUT_OF_RANGE], send[:1, :_OUT_OF_RANGE]
    assert_async(got[:, _ERROR_TYPE].eq(0).all(),
                 f"{_FN}: expected every rank of the expert-parallel group to pass arguments "
                 "that pass the local checks, but a rank did not (that rank raised the error)")
    assert_async(got[:, :_S].eq(want[:, :_S]).all(),
                 f"{_FN}: expected every rank of the expert-parallel group to pass the same "
                 f"{', '.join(name for name, _, _ in _SIGNATURE)}, but a rank did not "
                 "(checked on the device, without naming the values)")
    assert_async(got[:, _CHUNK:].eq(want[:, _CHUNK:]).all(),
                 f"{_FN}: expected every rank of the expert-parallel group to pass the same "
                 "number of tokens with sync_free=True or backend='symm_mem' (every rank then "
                 "knows the buffer sizes of every other), but a rank did not")
    _assert_no_id_errors(recv, out_of_range, repeated)


def _raise_argument_errors(received: list[list[int]], group, device) -> None:
    """Raises on a rank whose arguments passed the local checks when the header rows
    ``received`` say that other ranks' did not."""
    error = _argument_error(received, None, group, device)
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
    raise _argument_error(recv[:, :_CHUNK].tolist(), error, group, device)


def _carried(error: Exception) -> bytes:
    """The bytes of ``error``'s message that the other ranks receive."""
    message = str(error)
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + " ..."
    return message.encode()


def _argument_error(rows: list[list[int]], own: Optional[Exception], group,
                    device) -> Optional[Exception]:
    """The exception to raise when some ranks' arguments failed their local checks, else None.

    ``rows[src]`` is (at least the signature and argument error of) rank ``src``'s header;
    ``own`` is this rank's error, None when its arguments passed. Every rank raises the type of
    the lowest failing rank: a failing rank with its own message, the others with one that
    names the failing ranks and carries their messages, which one more exchange brings them (on
    this path only, and only when some rank passed: every rank knows from the header whether it
    comes). A rank that passed with ``sync_free`` or ``backend="symm_mem"`` reads no header on
    the host and takes no part in that exchange (its device assertion fails instead): when one
    did, which every rank sees in its signature, the messages stay where they are."""
    failing = [src for src, row in enumerate(rows) if row[_ERROR_TYPE]]
    if not failing:
        return None
    exc_type = _ERROR_TYPES[rows[failing[0]][_ERROR_TYPE]]
    passing = [row for row in rows if not row[_ERROR_TYPE]]
    messages = None
    if passing and not any(row[_SYNC_FREE] or BACKENDS[row[_BACKEND]] == "symm_mem"
                           for row in passing):
        messages = _exchange_messages(own, [row[_ERROR_BYTES] for row in rows], group, device)
    if own is not None:
        if type(own) is exc_type:
            return own
        error = exc_type(str(own))
        error.__cause__ = own
        return error
    if messages is None:
        return exc_type(f"{_FN}: ranks {failing} of the expert-parallel group passed invalid "
                        "arguments (their messages are raised there: a rank of the group checks "
                        "the header on the device, sync_free or backend='symm_mem', and "
                        "exchanges no message)")
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


def _header_device(x, group: dist.ProcessGroup) -> torch.device:
    """The device of the header of a rank whose arguments failed: that of ``x`` as on the other
    ranks, or the group's default device when ``x`` is not a tensor with data."""
    if isinstance(x, Tensor) and x.device.type != "meta":
        return x.device
    return object_collective_device(group)
