"""Functional MoE layers (counterpart of ``torch/nn/functional.py``)."""

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from torch_moe._checks import ACTIVATIONS
from torch_moe.quantization import PRECISIONS, SCALE_MODES
from torch_moe.quantization.ffn import group_alignment, quantized_expert_ffn

__all__ = [
    "moe_ffn",
    "route",
    "load_balancing_loss",
    "sequence_balance_loss",
    "router_z_loss",
    "token_sort_with_capacity",
    "activation",
]


def moe_ffn(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Optional[Tensor] = None,
    *,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    precision: str = "bf16",
    scale_mode: str = "rceil",
    wgrad_high_precision: bool = False,
) -> Tensor:
    """The routed-expert computation of an MoE layer.

    ``y[t] = sum_j topk_weights[t, j] * FFN_e(x[t])`` with ``e = topk_ids[t, j]`` and
    ``FFN_e(x) = act(x @ w1[e], x @ w3[e]) @ w2[e]`` (gated) or ``act(x @ w1[e]) @ w2[e]``.

    Args:
        x: tokens ``[T, D]``.
        topk_ids: expert of each (token, slot), ``[T, k]``, int32 or int64 in ``[0, E)``.
        topk_weights: routing weight of each (token, slot), ``[T, k]``; any floating dtype
            (fp32 router outputs are fine with bf16 tokens). Differentiable.
        w1: gate projection ``[E, D, F]``, or the fused gate/up projection ``[E, D, 2F]``
            (gate in ``[..., :F]``, up in ``[..., F:]``) when ``w3`` is None and the activation
            is gated. Weights are in GEMM layout (``x @ w``); a module that stores
            ``nn.Linear``-style ``[E, F, D]`` weights passes ``w.transpose(-2, -1)``.
        w2: down projection ``[E, F, D]``.
        w3: up projection ``[E, D, F]`` for gated activations, else None.
        activation: ``"swiglu"``, ``"geglu"``, ``"swiglu_oai"`` (gpt-oss: gate clamped at
            ``limit``, up clamped to ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha *
            gate)``), ``"gelu"`` or ``"relu"``.

    Memory: the backward saves ``x``, the weights, the routing (``sorted_ids``, ``offs``,
    ``topk_weights``) and one pre-activation tensor ``hidden [T * k, 2F]`` (``[T * k, F]`` when
    not gated). The activation output, the permuted tokens ``[T * k, D]`` and the unweighted
    expert outputs are never stored: backward gathers each expert's rows again (one gather per
    expert) and recomputes the activation from ``hidden``, which costs a few elementwise passes
    over ``[T * k, F]`` against the ``[T * k, D] + 3 [T * k, F]`` a plain autograd composition
    keeps alive.
    """
    # Plain raises rather than torch._check: Dynamo traces this wrapper, and a torch._check
    # message closure that captures tensors would break the graph.
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"moe_ffn: expected activation to be one of {ACTIVATIONS}, but got {activation!r}"
        )
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            "moe_ffn: expected topk_ids and topk_weights of the same shape [T, k], but got "
            f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
        )
    if w1.dim() != 3:
        raise ValueError(f"moe_ffn: expected w1 to be 3-D [E, D, F], but got shape {tuple(w1.shape)}")
    if precision not in PRECISIONS:
        raise ValueError(f"moe_ffn: expected precision in {PRECISIONS}, but got {precision!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"moe_ffn: expected scale_mode in {SCALE_MODES}, but got {scale_mode!r}")
    if type(x).__name__ == "DTensor":
        # every rank routes its own tokens: see torch_moe.distributed.tensor._token_parallel
        from torch_moe.distributed.tensor._token_parallel import token_parallel_moe_ffn

        local = functools.partial(
            moe_ffn, activation=activation, alpha=alpha, limit=limit, precision=precision,
            scale_mode=scale_mode, wgrad_high_precision=wgrad_high_precision,
        )
        return token_parallel_moe_ffn(x, topk_ids, topk_weights, w1, w2, w3, local)
    if precision != "bf16":
        sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(
            topk_ids, w1.size(0), group_alignment(precision)
        )
        return quantized_expert_ffn(
            x, sorted_ids, offs, topk_weights, w1, w2, w3, activation=activation, alpha=alpha,
            limit=limit, precision=precision, scale_mode=scale_mode,
            wgrad_high_precision=wgrad_high_precision,
        )
    sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(topk_ids, w1.size(0))
    out, _ = torch.ops.torch_moe.grouped_ffn(
        x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit
    )
    return out


# ---------------------------------------------------------------------------------------------
# Routing and its auxiliary losses
# ---------------------------------------------------------------------------------------------


def _stable_topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dim with ties broken towards the lowest index.

    ``torch.topk`` leaves the order of equal values unspecified, so bf16 scores (where ties are
    common) could route differently from run to run or across backends. A stable descending
    sort keeps equal values in index order.
    """
    sorted_values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return sorted_values[..., :k], order[..., :k]


def route(
    logits: Tensor,
    top_k: int,
    *,
    score_func: str = "softmax",
    topk_before_score: bool = False,
    expert_bias: Optional[Tensor] = None,
    num_groups: Optional[int] = None,
    topk_groups: Optional[int] = None,
    normalize: bool = False,
    scale: float = 1.0,
    check_finite: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Picks ``top_k`` experts per token from router ``logits [T, E]``, in fp32.

    Returns ``(topk_ids [T, k] int64, topk_weights [T, k] fp32, scores [T, E] fp32)``.

    - ``score_func``: ``"softmax"`` or ``"sigmoid"`` over the logits.
    - ``topk_before_score``: pick the top-k logits first and apply the score function to those k
      only (softmax over the selected logits: Mixtral's weights after renormalisation, gpt-oss);
      otherwise score all experts and pick the top-k scores (DeepSeek, Qwen3-MoE).
    - ``expert_bias [E]``: added to the scores for *selection only* (aux-loss-free balancing,
      DeepSeek-V3); the weights are the unbiased scores.
    - ``num_groups`` / ``topk_groups``: group-limited routing: experts form ``num_groups`` equal
      groups, a group's score is the sum of its top-2 (biased) scores, and each token picks its
      experts from its ``topk_groups`` best groups only.
    - ``normalize``: renormalise the k weights to sum to one; ``scale``: multiply them by this.

    Ties are broken towards the lowest expert id. With ``check_finite`` a NaN or Inf in the
    logits raises (an on-device assert, no host synchronisation) instead of silently routing
    every token to expert 0.
    """
    if logits.dim() != 2:
        raise ValueError(f"route: expected logits [T, E], but got shape {tuple(logits.shape)}")
    E = logits.size(1)
    if not 1 <= top_k <= E:
        raise ValueError(f"route: expected 1 <= top_k <= num_experts ({E}), but got {top_k}")
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"route: expected score_func 'softmax' or 'sigmoid', but got {score_func!r}")
    if check_finite:
        torch._assert_async(
            torch.isfinite(logits).all(), "route: router logits contain NaN or Inf"
        )
    logits = logits.float()
    score = torch.softmax if score_func == "softmax" else (lambda t, dim: torch.sigmoid(t))
    if topk_before_score:
        if expert_bias is not None or num_groups is not None:
            raise ValueError("route: expert_bias and group-limited routing need topk_before_score=False")
        top_logits, topk_ids = _stable_topk(logits, top_k)
        topk_weights = score(top_logits, dim=-1)
        scores = score(logits, dim=-1)
    else:
        scores = score(logits, dim=-1)
        select = scores if expert_bias is None else scores + expert_bias.float()
        if num_groups is not None and num_groups > 1:
            select = _mask_to_top_groups(select, num_groups, topk_groups)
        _, topk_ids = _stable_topk(select, top_k)
        topk_weights = scores.gather(1, topk_ids)
    if normalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        topk_weights = topk_weights * scale
    return topk_ids, topk_weights, scores


def _mask_to_top_groups(select: Tensor, num_groups: int, topk_groups: int) -> Tensor:
    T, E = select.shape
    grouped = select.view(T, num_groups, E // num_groups)
    per_group = min(2, E // num_groups)
    group_scores = grouped.topk(per_group, dim=-1).values.sum(dim=-1)  # [T, n]
    _, top_groups = _stable_topk(group_scores, topk_groups)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)


def _assignment_counts(topk_ids: Tensor, num_experts: int) -> Tensor:
    counts = torch.zeros(num_experts, dtype=torch.float32, device=topk_ids.device)
    return counts.index_add_(0, topk_ids.reshape(-1), torch.ones(topk_ids.numel(), device=topk_ids.device))


def load_balancing_loss(scores: Tensor, topk_ids: Tensor, num_experts: int) -> Tensor:
    """Switch / GShard load-balancing loss, 1.0 under perfectly uniform routing.

    ``L = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``T * k`` assignments that go
    to expert e (no gradient) and ``P_e`` the mean over tokens of the routing probability of e
    (scores renormalised to sum to one per token, so sigmoid scores work too).
    """
    T = scores.size(0)
    if T == 0:
        return scores.new_zeros(())
    f = _assignment_counts(topk_ids, num_experts) / topk_ids.numel()
    p = scores / scores.sum(dim=-1, keepdim=True)
    return num_experts * (f * p.mean(dim=0)).sum()


def sequence_balance_loss(scores: Tensor, topk_ids: Tensor, num_experts: int, seq_len: int) -> Tensor:
    """DeepSeek-V3's sequence-wise balance loss, averaged over sequences.

    For each sequence of ``seq_len`` tokens: ``f_e = E / (k * L) * #{t : e in topk(t)}`` and
    ``P_e = mean_t s'_{t,e}`` with ``s'`` the scores normalised per token; the loss is
    ``sum_e f_e P_e`` (1.0 under uniform routing). ``scores [B * L, E]``, ``topk_ids [B * L, k]``.
    """
    T, k = topk_ids.shape
    if T == 0:
        return scores.new_zeros(())
    if T % seq_len:
        raise ValueError(f"sequence_balance_loss: {T} tokens are not a whole number of sequences of {seq_len}")
    B = T // seq_len
    hits = torch.zeros(B, num_experts, dtype=torch.float32, device=scores.device)
    hits.scatter_add_(1, topk_ids.reshape(B, seq_len * k), torch.ones(B, seq_len * k, device=scores.device))
    f = hits * (num_experts / (k * seq_len))
    p = (scores / scores.sum(dim=-1, keepdim=True)).view(B, seq_len, num_experts).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (in fp32)."""
    if logits.size(0) == 0:
        return logits.new_zeros((), dtype=torch.float32)
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


def token_sort_with_capacity(
    topk_ids: Tensor, topk_weights: Tensor, num_experts: int, capacity: int, align: int = 1
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``token_sort`` that keeps at most ``capacity`` assignments per expert.

    Beyond capacity, an expert drops its lowest-weighted assignments (ties: the later
    assignment ``t * k + j`` is dropped), deterministically and without host synchronisation.
    Returns ``(sorted_ids [S], offs [E], kept_per_expert [E], num_dropped [])``; the slots of
    dropped assignments sit after ``offs[-1]`` and hold -1, so kernels skip them. With
    ``align > 1`` every group starts on a multiple of ``align`` (as ``token_sort(align=)``:
    ``S = T * k + E * (align - 1)``, padding slots hold -1).
    """
    if capacity < 0:
        raise ValueError(f"token_sort_with_capacity: expected capacity >= 0, but got {capacity}")
    if align < 1:
        raise ValueError(f"token_sort_with_capacity: expected align >= 1, but got {align}")
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1)
    n = ids.numel()
    # order by expert, then weight (descending), then assignment index: two stable sorts
    by_weight = torch.sort(weights.detach(), descending=True, stable=True).indices
    order = by_weight[torch.sort(ids[by_weight], stable=True).indices]
    counts = torch.bincount(ids, minlength=num_experts)
    starts = counts.cumsum(0) - counts
    rank = torch.arange(n, device=ids.device) - starts[ids[order]]
    keep = rank < capacity
    kept_first = torch.sort((~keep).to(torch.uint8), stable=True).indices
    sorted_ids = torch.where(keep[kept_first], order[kept_first], -1)
    kept = counts.clamp(max=capacity)
    if align == 1:
        return sorted_ids, kept.cumsum(0).to(torch.int32), kept, n - kept.sum()
    # Move the i-th kept assignment of expert e from start[e] + i to padded_start[e] + i.
    kept_ends = kept.cumsum(0)
    padded = torch.div(kept + (align - 1), align, rounding_mode="floor").mul_(align)
    padded_ends = padded.cumsum(0)
    shift = (padded_ends - padded) - (kept_ends - kept)
    pos = torch.arange(n, device=ids.device)
    expert = torch.searchsorted(kept_ends, pos, right=True)  # E for the dropped tail
    is_kept = expert < num_experts
    S = n + num_experts * (align - 1)
    dest = torch.where(is_kept, pos + shift[expert.clamp(max=num_experts - 1)], S)
    aligned = torch.full((S + 1,), -1, dtype=torch.int64, device=ids.device)
    aligned.scatter_(0, dest, torch.where(is_kept, sorted_ids, -1))
    return aligned[:S], padded_ends.to(torch.int32), kept, n - kept.sum()


def activation(kind: str, gate: Tensor, up: Optional[Tensor] = None, *, alpha: float = 1.702,
               limit: float = 7.0) -> Tensor:
    """The expert activations of :func:`moe_ffn` on plain tensors (used by dense FFNs, such as
    shared experts). ``up`` is required by the gated kinds and ignored by the others."""
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate) * up
    if kind == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
    if kind == "gelu":
        return F.gelu(gate)
    if kind == "relu":
        return F.relu(gate)
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, but got {kind!r}")
