"""Expert-parallel MoE FFN on ``torch.distributed``: all-to-all token dispatch and combine.

Layout (as in :mod:`torch_moe.distributed._dispatch_plan`). ``E`` experts are placed on the
``R`` ranks of the expert-parallel group in contiguous blocks of ``G = E // R``: expert ``e``
lives on group rank ``e // G`` as local expert ``e % G``. Every rank holds its own tokens
``x [T, D]`` (``T`` may differ between ranks, and may be zero) with their routing
``topk_ids / topk_weights [T, k]``, and the weights of its ``G`` experts.

One call of :func:`expert_parallel_moe_ffn`:

1. computes the destination rank of every (token, slot) assignment and sorts the ``T * k``
   assignments by destination (stable, so each destination receives them in source order);
2. exchanges the per-destination counts with ``torch.distributed.all_to_all_single``. The
   split sizes of the following exchanges must be Python ints, so the counts are copied to
   the host: **this mode synchronises the host with the device once per call** (and the
   shapes of the received buffers are data-dependent);
3. sends one unweighted token row per assignment, together with its local expert id, with
   the differentiable ``torch.distributed.nn.functional.all_to_all_single`` (the ids travel
   through the plain, non-differentiable collective);
4. on the destination, runs the local experts on the received rows with ``k = 1`` routing
   to the local expert ids and weight one (``torch_moe.token_sort`` + ``grouped_ffn``, the
   machinery of :func:`torch_moe.nn.functional.moe_ffn`);
5. sends the per-row expert outputs back with the reverse all-to-all, and
6. combines them on the source rank: ``y[t] = sum_j topk_weights[t, j] * out[t, j]``
   accumulated in fp32 and cast to ``x.dtype``. The routing weights never leave the source
   rank, so the gradient of ``topk_weights`` is computed locally.

Autograd runs through both exchanges (the backward of each is the reverse all-to-all), so
gradients of ``x``, ``topk_weights`` and the local weight shards are those of the
single-process :func:`~torch_moe.nn.functional.moe_ffn` on the concatenated data. Every rank
of the group must call the function (and run backward) the same number of times, also with
``T = 0``.

Counters. :data:`dispatch_counters` is a module-level dict of this process's counts, updated
by every forward call (the backward moves the same rows in the opposite direction and is not
counted again): ``calls``; ``rows_sent`` / ``rows_received`` (token rows placed in / taken
from the dispatch buffers, the rank's own copies included, as in ``_dispatch_plan``), their
``*_remote`` variants that leave out the copies a rank sends to itself, and ``last_rows_sent``
/ ``last_rows_received`` of the latest call. The combine exchange sends back exactly the rows
that were received. :func:`reset_dispatch_counters` zeroes them.

Not implemented: deduplicated dispatch (one copy per (token, destination rank), fanned out on
the receiver: every assignment is sent as its own row), chunked or overlapped exchanges,
capacity mode (fixed-size buffers without the host synchronisation, dropping overflow
tokens), quantised payloads and precisions other than the ``moe_ffn`` default (the local
experts run ``grouped_ffn`` in the dtype of ``x``), fused ``w13`` weights being sharded
differently from ``w1``, and DTensor inputs (plain local tensors only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from torch_moe.distributed._dispatch_plan import destination_ranks

__all__ = ["dispatch_counters", "expert_parallel_moe_ffn", "reset_dispatch_counters"]

_COUNTER_KEYS = (
    "calls",
    "rows_sent",
    "rows_received",
    "rows_sent_remote",
    "rows_received_remote",
    "last_rows_sent",
    "last_rows_received",
)

#: Per-process dispatch counters, see the module docstring.
dispatch_counters: dict[str, int] = dict.fromkeys(_COUNTER_KEYS, 0)


def reset_dispatch_counters() -> None:
    """Set every entry of :data:`dispatch_counters` to zero."""
    for key in _COUNTER_KEYS:
        dispatch_counters[key] = 0


def _differentiable_all_to_all_single():
    # torch.distributed.nn.functional.all_to_all_single(output, input, output_split_sizes,
    # input_split_sizes, group) exists in torch 2.13; its backward is the reverse exchange.
    from torch.distributed.nn.functional import all_to_all_single

    return all_to_all_single


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
) -> Tensor:
    """Routed-expert FFN with the experts sharded over the ranks of ``group``.

    Args:
        x: this rank's tokens ``[T, D]``.
        topk_ids: ``[T, k]`` global expert ids in ``[0, num_experts)`` (not validated).
        topk_weights: ``[T, k]`` routing weights, any floating dtype; differentiable.
        w1_local: ``[E / R, D, F]`` (or fused ``[E / R, D, 2F]``), the experts
            ``rank * E / R ... (rank + 1) * E / R - 1`` of this rank.
        w2_local: ``[E / R, F, D]``.
        w3_local: ``[E / R, D, F]`` for gated activations with a separate ``w1``, else None.
        num_experts: ``E``, divisible by the group size ``R``.
        group: the expert-parallel process group; the default group when None.
        activation, alpha, limit: as in :func:`torch_moe.nn.functional.moe_ffn`.

    Returns:
        ``[T, D]`` in the dtype of ``x``: ``sum_j topk_weights[t, j] * FFN_{topk_ids[t, j]}(x[t])``.

    Synchronises the host once (the all-to-all split sizes); see the module docstring.
    """
    if x.dim() != 2:
        raise ValueError(f"expert_parallel_moe_ffn: expected x [T, D], got {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            "expert_parallel_moe_ffn: expected topk_ids and topk_weights of the same shape "
            f"[T, k], but got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if topk_ids.size(0) != x.size(0):
        raise ValueError(
            f"expert_parallel_moe_ffn: x has {x.size(0)} tokens but topk_ids has "
            f"{topk_ids.size(0)} rows"
        )
    if w1_local.dim() != 3:
        raise ValueError(
            f"expert_parallel_moe_ffn: expected w1_local [E/R, D, F], got {tuple(w1_local.shape)}"
        )
    num_ranks = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"expert_parallel_moe_ffn: num_experts={num_experts} is not divisible by the "
            f"{num_ranks} ranks of the group"
        )
    experts_per_rank = num_experts // num_ranks
    if w1_local.size(0) != experts_per_rank:
        raise ValueError(
            f"expert_parallel_moe_ffn: w1_local holds {w1_local.size(0)} experts, expected "
            f"num_experts / world_size = {experts_per_rank}"
        )

    a2a = _differentiable_all_to_all_single()
    num_tokens, k = topk_ids.shape
    hidden_dim = x.size(1)
    device = x.device

    # (1) destination of every assignment; stable sort by destination
    dest = destination_ranks(topk_ids, num_experts, num_ranks).reshape(-1)  # [T*k]
    order = torch.sort(dest, stable=True).indices  # [T*k]
    send_rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # [T*k, D]
    sorted_dest = dest.index_select(0, order)
    send_local_ids = topk_ids.reshape(-1).long().index_select(0, order) - sorted_dest * experts_per_rank

    # (2) counts; split sizes to the host (synchronises)
    send_counts = torch.zeros(num_ranks, dtype=torch.long, device=device)
    send_counts.scatter_add_(0, dest, torch.ones_like(dest))
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    input_splits = send_counts.tolist()
    output_splits = recv_counts.tolist()
    num_sent = num_tokens * k
    num_recv = sum(output_splits)

    # (3) dispatch: token rows (differentiable) and local expert ids
    recv_rows = a2a(
        x.new_empty(num_recv, hidden_dim), send_rows.contiguous(), output_splits, input_splits,
        group,
    )
    recv_local_ids = torch.empty(num_recv, dtype=torch.long, device=device)
    dist.all_to_all_single(
        recv_local_ids, send_local_ids.contiguous(), output_splits, input_splits, group=group
    )

    # (4) local experts, k = 1 routing with weight one
    sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(
        recv_local_ids.unsqueeze(1), experts_per_rank
    )
    ones = torch.ones(num_recv, 1, dtype=torch.float32, device=device)
    expert_out, _ = torch.ops.torch_moe.grouped_ffn(
        recv_rows, sorted_ids, offs, ones, w1_local, w2_local, w3_local, activation, alpha,
        limit,
    )

    # (5) combine exchange: the received rows go back where they came from
    back = a2a(
        expert_out.new_empty(num_sent, hidden_dim), expert_out.contiguous(), input_splits,
        output_splits, group,
    )

    # (6) undo the sort and weight on the source rank, fp32 accumulation
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    per_assignment = back.index_select(0, inverse).view(num_tokens, k, hidden_dim)
    y = (per_assignment.float() * topk_weights.float().unsqueeze(-1)).sum(dim=1)

    self_copies = input_splits[rank]
    dispatch_counters["calls"] += 1
    dispatch_counters["rows_sent"] += num_sent
    dispatch_counters["rows_received"] += num_recv
    dispatch_counters["rows_sent_remote"] += num_sent - self_copies
    dispatch_counters["rows_received_remote"] += num_recv - output_splits[rank]
    dispatch_counters["last_rows_sent"] = num_sent
    dispatch_counters["last_rows_received"] = num_recv
    return y.to(x.dtype)
