"""The row exchanges of the dispatcher's ``backend="symm_mem"``: split sizes that never leave
the device.

With ``all_to_all_single`` every rank must know on the host how many rows it receives, which
is what the dispatcher's header exchange reads in exact mode (one host synchronisation per
call). ``symm_mem::all_to_all_vdev`` (NVSHMEM) takes the split sizes as a device tensor and
writes the received ones into another: an exact (dropless) exchange with no host read. The
price is that the receive buffer has a size fixed in advance, the most rows a rank can
receive; the rows past those received are masked to zero here (ids to the unused local expert,
weights to zero), and their gradients never travel back.

Buffers. ``all_to_all_vdev`` reads and writes symmetric-memory tensors only, allocated
collectively and rendezvoused over the group. They are allocated on first use for a (group,
role, shape, dtype, device) and reused by every later call: each exchange copies its input into
its role's input buffer and its result out of the output buffer (the result is a tensor of its
own, as the next exchange of the role overwrites the buffer). A role is an exchange of one chunk
of a layer call (the rows, ids and weights of chunk c, their results back, and the same
backwards), so the exchanges of one call all have buffers of their own. That is what makes
reuse safe: an ``all_to_all_vdev`` writes the split sizes into its peers' buffers, passes a
barrier of the group, then pulls the rows from its peers' input buffers and ends without a
barrier. So rank A may write a role's buffers again only once every peer has finished the
role's previous exchange, which holds when another exchange's barrier lies between the two
uses: no peer passes that barrier before it has finished the kernels queued before it. Two
exchanges in a row on the same buffers, with no barrier between them, would race.

Requirements of the op, which the dispatcher checks (``symm_mem_unavailable_reason``):

* NVSHMEM as the symmetric-memory backend of the device;
* ``TORCH_SYMMMEM_NBLOCKS`` set to the group size ``R`` before the first exchange of the
  process: torch's kernel splits every peer's bytes evenly over its thread blocks and asserts
  on the device when they do not divide, which arbitrary row counts do not; with one block per
  peer they always do.

Sizes must agree on every rank before a collective allocation: NVSHMEM allocates over all the
processes of the job, not only the group's, so every rank of the job must run the layer with
the same number of tokens (pad otherwise). The dispatcher checks the header of every call on
the device (the same signature and number of tokens in the group); before allocating new
buffers the first call of a shape waits for the device, so that a failed check ends the call
(a device-side assertion) before the allocation rather than after. Buffers are never freed: a
new number of tokens allocates a new set, and pays that wait once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe.distributed._compat import all_to_all_vdev, symm_mem_empty

__all__ = ["exchange_rows"]

_BUFFERS: dict = {}


def _buffer(group: dist.ProcessGroup, role: tuple, shape: tuple, dtype: torch.dtype,
            device: torch.device) -> Tensor:
    key = (group.group_name, role, tuple(shape), dtype, device)
    t = _BUFFERS.get(key)
    if t is None:
        if device.type == "cuda":
            # a header check that failed must end the call before the collective allocation,
            # whose sizes it vouches for
            torch.cuda.current_stream(device).synchronize()
        t = _BUFFERS[key] = symm_mem_empty(shape, dtype, device, group)
    return t


def _exchange(t_N: Tensor, send_R: Tensor, num_out: int, group: dist.ProcessGroup,
              role: tuple, fill: int = 0) -> tuple[Tensor, Tensor]:
    """The rows of ``t_N [N, ...]``, packed in destination order with ``send_R [R]`` of them for
    every rank, to their ranks: ``(out [num_out, ...], recv_R [R])``, the rows from every source
    packed in rank order (``fill`` past ``recv_R.sum()``) and how many came from each."""
    R, device = send_R.numel(), t_N.device
    send_buf = _buffer(group, (role, "in"), t_N.shape, t_N.dtype, device)
    recv_buf = _buffer(group, (role, "out"), (num_out, *t_N.shape[1:]), t_N.dtype, device)
    in_splits = _buffer(group, (role, "in_splits"), (R,), torch.int64, device)
    out_splits_offsets = _buffer(group, (role, "out_splits_offsets"), (2, R), torch.int64,
                                 device)
    send_buf.copy_(t_N)
    in_splits.copy_(send_R)
    all_to_all_vdev(send_buf, recv_buf, in_splits, out_splits_offsets, group)
    recv_R = out_splits_offsets[0].clone()
    received = torch.arange(num_out, device=device) < recv_R.sum()
    out = torch.where(received.view(-1, *(1,) * (t_N.dim() - 1)), recv_buf,
                      recv_buf.new_full((), fill))
    return out, recv_R


class _ExchangeRows(torch.autograd.Function):
    """:func:`_exchange`, whose backward sends the gradients of the received rows back to
    their sources: the same exchange with the received split sizes."""

    @staticmethod
    def forward(ctx, t_N: Tensor, send_R: Tensor, num_out: int, group, role: tuple, fill: int):
        out, recv_R = _exchange(t_N, send_R, num_out, group, role, fill)
        ctx.save_for_backward(recv_R)
        ctx.num_in, ctx.group, ctx.role = t_N.size(0), group, role
        ctx.mark_non_differentiable(recv_R)
        return out, recv_R

    @staticmethod
    def backward(ctx, grad_out, _grad_recv):
        (recv_R,) = ctx.saved_tensors
        grad_in, _ = _exchange(grad_out.contiguous(), recv_R, ctx.num_in, ctx.group,
                               (*ctx.role, "grad"))
        return grad_in, None, None, None, None, None


def exchange_rows(t_N: Tensor, send_R: Tensor, num_out: int, group: dist.ProcessGroup,
                  role: tuple, fill: int = 0) -> tuple[Tensor, Tensor]:
    """Sends the first ``send_R[d]`` rows after those of the ranks before ``d`` to rank ``d``
    (``t_N [N, ...]`` packed in destination order, ``send_R [R]`` int64 on its device):
    ``(out [num_out, ...], recv_R [R] int64)``, the rows received from every source packed in
    rank order and ``fill`` after them, and how many came from each. Differentiable in ``t_N``:
    the gradient of each received row goes back to the row it came from. ``role`` names the
    exchange's buffers, distinct for the exchanges of a call (see the module docstring);
    ``num_out`` must bound the rows any rank can receive, and every size must be the same on
    every rank."""
    return _ExchangeRows.apply(t_N.contiguous(), send_R, num_out, group, role, fill)
