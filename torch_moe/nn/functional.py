"""Functional MoE layers (counterpart of ``torch/nn/functional.py``)."""

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor

from torch_moe._checks import ACTIVATIONS, GATED_ACTIVATIONS, token_sort_num_slots
from torch_moe._compat import assert_async
from torch_moe._native.activation import activation as _activation
from torch_moe._native.padded_groups import padded_group_layout
from torch_moe.nn import _checks as C
from torch_moe.nn._subclass_hooks import subclass_handlers
from torch_moe.quantization import BLOCK_SIZE, PRECISIONS, SCALE_MODES
from torch_moe.quantization._checks import QUANTIZABLE_DTYPES
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
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
) -> Tensor:
    """The routed-expert computation of an MoE layer.

    ``y[t] = sum_j topk_weights[t, j] * FFN_e(x[t])`` with ``e = topk_ids[t, j]`` and
    ``FFN_e(x) = act(x @ w1[e] + b1[e], x @ w3[e] + b3[e]) @ w2[e] + b2[e]`` (gated) or
    ``act(x @ w1[e] + b1[e]) @ w2[e] + b2[e]``, each bias optional.

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
        b1, b2, b3: expert biases (gpt-oss's ``gate_up_proj_bias`` and ``down_proj_bias``), in
            the dtype and on the device of the weights, differentiable: b1 ``[E, F]`` of the
            gate projection (``[E, 2F]``, gate then up, with a fused w13), b3 ``[E, F]`` of the
            up projection (with a separate w3 only), b2 ``[E, D]`` of the down projection, which
            the routing weight scales with the rest of the expert's output.

    Memory: the backward saves ``x``, the weights, the routing (``sorted_ids``, ``offs``,
    ``topk_weights``) and one pre-activation tensor ``hidden [T * k, 2F]`` (``[T * k, F]`` when
    not gated). The activation output, the permuted tokens ``[T * k, D]`` and the unweighted
    expert outputs are never stored: backward gathers each expert's rows again (one gather per
    expert) and recomputes the activation from ``hidden``, which costs a few elementwise passes
    over ``[T * k, F]`` against the ``[T * k, D] + 3 [T * k, F]`` a plain autograd composition
    keeps alive.

    Tensor subclasses: a ``DTensor`` ``x`` (with DTensor routing tensors and weights) runs
    token parallel, each rank routing its own tokens, through the handlers that
    :mod:`torch_moe.distributed` registers; any other subclass computes through its own
    ``__torch_dispatch__`` of each op unless its owner registered handlers
    (:mod:`torch_moe.nn._subclass_hooks`).
    """
    kwargs = dict(activation=activation, alpha=alpha, limit=limit, precision=precision,
                  scale_mode=scale_mode, wgrad_high_precision=wgrad_high_precision)
    biases = dict(b1=b1, b2=b2, b3=b3)
    _check_moe_ffn(x, topk_ids, topk_weights, w1, w2, **kwargs)
    _check_biases(x, w1, w2, w3, activation, **biases)
    handlers = subclass_handlers(x)
    if handlers is not None:
        # the subclass's owner runs the layer (a DTensor: every rank routes its own tokens),
        # calling back into the plain computation on its local tensors; biases, as keywords,
        # only to handlers that take them
        local = functools.partial(_local_moe_ffn, **kwargs)
        if b1 is None and b2 is None and b3 is None:
            return handlers.moe_ffn(x, topk_ids, topk_weights, w1, w2, w3, local)
        _check_handler_takes_biases(handlers.moe_ffn, type(x))
        return handlers.moe_ffn(x, topk_ids, topk_weights, w1, w2, w3, local, **biases)
    return _routed_experts(x, topk_ids, topk_weights, w1, w2, w3, **kwargs, **biases)


def _local_moe_ffn(x, topk_ids, topk_weights, w1, w2, w3, *, b1=None, b2=None, b3=None,
                   **kwargs) -> Tensor:
    """:func:`moe_ffn` on the local tensors a subclass handler passes (its checks again, on the
    local shapes, then the routed experts)."""
    _check_moe_ffn(x, topk_ids, topk_weights, w1, w2, **kwargs)
    _check_biases(x, w1, w2, w3, kwargs["activation"], b1=b1, b2=b2, b3=b3)
    return _routed_experts(x, topk_ids, topk_weights, w1, w2, w3, b1=b1, b2=b2, b3=b3, **kwargs)


def _check_handler_takes_biases(handler, cls: type) -> None:
    params = inspect.signature(handler).parameters
    takes = all(n in params for n in ("b1", "b2", "b3")) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if not takes:
        raise NotImplementedError(f"moe_ffn: the moe_ffn handler registered for {cls.__name__} "
                                  "takes no expert biases (b1, b2, b3)")


def _check_biases(x, w1, w2, w3, activation, *, b1, b2, b3) -> None:
    """b1 ``[E, F]`` (``[E, 2F]`` with a fused w13), b3 ``[E, F]`` (with a separate w3 only),
    b2 ``[E, D]``, each a floating tensor in the dtype and on the device of w1."""
    fn = "moe_ffn"
    fused = activation in GATED_ACTIVATIONS and w3 is None
    if b3 is not None and w3 is None:
        raise ValueError(f"{fn}: b3 is the bias of the up projection w3, but w3 is None"
                         + (" (with a fused gate/up w1, pass both biases in b1 [E, 2F])"
                            if fused else ""))
    E, F, D = w1.size(0), w2.size(-2), x.size(-1)
    expected = {"b1": ((E, 2 * F), "[E, 2F]: gate and up of a fused w1") if fused
                else ((E, F), "[E, F]"),
                "b2": ((E, D), "[E, D]"), "b3": ((E, F), "[E, F]")}
    for name, b in (("b1", b1), ("b2", b2), ("b3", b3)):
        if b is None:
            continue
        C.check_float_tensor(fn, name, b)
        C.check_shape(fn, name, b, *expected[name])
        if b.dtype != w1.dtype:
            raise TypeError(f"{fn}: expected {name} in the dtype of w1 ({w1.dtype}), but got "
                            f"{b.dtype}")
        C.check_same_device(fn, name, b, "w1", w1)


def _check_moe_ffn(x, topk_ids, topk_weights, w1, w2, *, activation, alpha, limit, precision,
                   scale_mode, wgrad_high_precision) -> None:
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
    if activation == "swiglu_oai":
        C.check_real("moe_ffn", "alpha", alpha)
        C.check_real("moe_ffn", "limit", limit, low=0, strict=True)
    if precision != "bf16":
        _check_quantized_operands(x, w2, precision)


def _routed_experts(x, topk_ids, topk_weights, w1, w2, w3, *, activation, alpha, limit,
                    precision, scale_mode, wgrad_high_precision, b1, b2, b3) -> Tensor:
    """Token sort and the expert FFN of :func:`moe_ffn` on checked plain tensors."""
    if precision != "bf16":
        sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(
            topk_ids, w1.size(0), group_alignment(precision)
        )
        return quantized_expert_ffn(
            x, sorted_ids, offs, topk_weights, w1, w2, w3, activation=activation, alpha=alpha,
            limit=limit, precision=precision, scale_mode=scale_mode,
            wgrad_high_precision=wgrad_high_precision, b1=b1, b2=b2, b3=b3,
        )
    sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(topk_ids, w1.size(0))
    out, _ = torch.ops.torch_moe.grouped_ffn(
        x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit, b1, b2, b3
    )
    return out


def _check_quantized_operands(x: Tensor, w2: Tensor, precision: str) -> None:
    # What the quantized GEMMs need, said in moe_ffn's terms (the ops would name their own
    # operands, which the caller never passed).
    if x.dtype not in QUANTIZABLE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in QUANTIZABLE_DTYPES)
        raise TypeError(f"moe_ffn: precision={precision!r} expects x to be {names}, but got {x.dtype}")
    if precision != "mxfp8":
        return
    for name, size in (("x.size(1)", x.size(-1)), ("w2.size(1)", w2.size(-2))):
        if size % BLOCK_SIZE:
            raise ValueError(f"moe_ffn: precision='mxfp8' expects {name} (the model dim, the FFN dim) "
                             f"to be a multiple of the MX block size {BLOCK_SIZE}, but got {size}")


# ---------------------------------------------------------------------------------------------
# Routing and its auxiliary losses
# ---------------------------------------------------------------------------------------------


def _stable_topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k along the last dim with ties broken towards the lowest index: ``values [..., n]``
    -> ``(top values [..., k], their indices [..., k] int64)``, in descending order.

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
      experts from its ``topk_groups`` best groups only. Both are given or neither;
      ``num_groups`` divides E and the kept groups hold at least ``top_k`` experts.
    - ``normalize``: renormalise the k weights to sum to one; ``scale``: multiply them by this.

    Ties are broken towards the lowest expert id. With ``check_finite`` a NaN or Inf in the
    logits or in ``expert_bias`` raises (an on-device assert, no host synchronisation) instead
    of silently routing every token to expert 0.
    """
    _check_route(logits, top_k, score_func, topk_before_score, expert_bias, num_groups,
                 topk_groups, scale)
    if check_finite:
        assert_async(
            torch.isfinite(logits).all(),
            "route: expected finite logits, but the router logits contain NaN or Inf",
        )
        if expert_bias is not None:
            assert_async(
                torch.isfinite(expert_bias).all(),
                "route: expected expert_bias to be finite, but it contains NaN or Inf",
            )
    logits = logits.float()
    score = torch.softmax if score_func == "softmax" else (lambda t, dim: torch.sigmoid(t))
    if topk_before_score:
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


def _check_route(logits, top_k, score_func, topk_before_score, expert_bias, num_groups,
                 topk_groups, scale) -> None:
    fn = "route"
    C.check_float_tensor(fn, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"{fn}: expected logits [T, E], but got shape {tuple(logits.shape)}")
    E = logits.size(1)
    C.check_int(fn, "top_k", top_k, 1, E)
    if score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"{fn}: expected score_func 'softmax' or 'sigmoid', but got {score_func!r}")
    C.check_real(fn, "scale", scale)
    if expert_bias is not None:
        if topk_before_score:
            raise ValueError(f"{fn}: expert_bias needs topk_before_score=False, but got "
                             "topk_before_score=True")
        C.check_float_tensor(fn, "expert_bias", expert_bias)
        if expert_bias.dim() != 1 or expert_bias.size(0) != E:
            raise ValueError(f"{fn}: expected expert_bias [{E}] (one per expert), but got shape "
                             f"{tuple(expert_bias.shape)}")
        C.check_same_device(fn, "expert_bias", expert_bias, "logits", logits)
    if num_groups is None:
        if topk_groups is not None:
            raise ValueError(f"{fn}: topk_groups={topk_groups} needs num_groups, but got "
                             "num_groups=None")
        return
    if topk_before_score:
        raise ValueError(f"{fn}: group-limited routing (num_groups={num_groups}) needs "
                         "topk_before_score=False, but got topk_before_score=True")
    C.check_int(fn, "num_groups", num_groups)
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"{fn}: expected num_groups to divide the number of experts ({E}), but "
                         f"got {num_groups}")
    if topk_groups is None:
        raise ValueError(f"{fn}: expected topk_groups in [1, {num_groups}] with "
                         f"num_groups={num_groups}, but got None")
    C.check_int(fn, "topk_groups", topk_groups, 1, num_groups)
    per_group = E // num_groups
    if topk_groups * per_group < top_k:
        raise ValueError(f"{fn}: expected topk_groups * experts per group >= top_k ({top_k}), but "
                         f"got {topk_groups} * {per_group} = {topk_groups * per_group}")


def _mask_to_top_groups(select: Tensor, num_groups: int, topk_groups: int) -> Tensor:
    """Group-limited routing: ``select [T, E]`` with the experts outside each token's
    ``topk_groups`` best groups set to -inf. The E experts form ``num_groups`` equal groups of
    consecutive ids; a group scores the sum of its top-2 values (its only value for groups of
    one); ties between groups go to the lower group id."""
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


def _check_routing_stats(fn: str, scores: Tensor, topk_ids: Tensor, num_experts: int) -> None:
    """``scores [T, E]`` floating, ``topk_ids [T, k]`` integer ids in ``[0, E)``."""
    C.check_int(fn, "num_experts", num_experts, 1)
    C.check_float_tensor(fn, "scores", scores)
    if scores.dim() != 2 or scores.size(1) != num_experts:
        raise ValueError(f"{fn}: expected scores [T, {num_experts}] (num_experts={num_experts}), "
                         f"but got shape {tuple(scores.shape)}")
    C.check_index_tensor(fn, "topk_ids", topk_ids)
    if topk_ids.dim() != 2 or topk_ids.size(0) != scores.size(0):
        raise ValueError(f"{fn}: expected topk_ids [{scores.size(0)}, k] (T = scores.size(0)), but "
                         f"got shape {tuple(topk_ids.shape)}")
    C.check_same_device(fn, "topk_ids", topk_ids, "scores", scores)
    C.check_expert_ids(fn, topk_ids, num_experts)


def load_balancing_loss(scores: Tensor, topk_ids: Tensor, num_experts: int) -> Tensor:
    """Switch / GShard load-balancing loss, 1.0 under perfectly uniform routing.

    ``L = E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``T * k`` assignments that go
    to expert e (no gradient) and ``P_e`` the mean over tokens of the routing probability of e
    (scores renormalised to sum to one per token, so sigmoid scores work too).
    """
    _check_routing_stats("load_balancing_loss", scores, topk_ids, num_experts)
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
    fn = "sequence_balance_loss"
    _check_routing_stats(fn, scores, topk_ids, num_experts)
    C.check_int(fn, "seq_len", seq_len)
    T, k = topk_ids.shape
    if T == 0:  # also what a [B, 0, D] input gives, with seq_len = 0
        return scores.new_zeros(())
    C.check_int(fn, "seq_len", seq_len, 1)
    if T % seq_len:
        raise ValueError(f"{fn}: expected seq_len to divide the number of tokens ({T}), but got "
                         f"seq_len={seq_len}")
    B = T // seq_len
    hits = torch.zeros(B, num_experts, dtype=torch.float32, device=scores.device)
    hits.scatter_add_(1, topk_ids.reshape(B, seq_len * k), torch.ones(B, seq_len * k, device=scores.device))
    f = hits * (num_experts / (k * seq_len))
    p = (scores / scores.sum(dim=-1, keepdim=True)).view(B, seq_len, num_experts).mean(dim=1)
    return (f * p).sum(dim=-1).mean()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2`` (in fp32)."""
    C.check_float_tensor("router_z_loss", "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"router_z_loss: expected logits [T, E], but got shape {tuple(logits.shape)}")
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
    _check_token_sort_with_capacity(topk_ids, topk_weights, num_experts, capacity, align)
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1)
    n = ids.numel()
    # No expert can hold more than all n assignments: a larger capacity (a huge
    # capacity_factor) is dropless, and past int64 it could not be compared with tensors.
    capacity = torch.sym_min(capacity, n)
    # order by expert, then weight (descending), then assignment index: two stable sorts
    by_weight = torch.sort(weights.detach(), descending=True, stable=True).indices
    order = by_weight[torch.sort(ids[by_weight], stable=True).indices]
    # a scatter-add, not bincount: bincount's output size is max(ids) + 1, read on the host
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids))
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
    padded_ends, shift = padded_group_layout(kept, align)
    pos = torch.arange(n, device=ids.device)
    expert = torch.searchsorted(kept_ends, pos, right=True)  # E for the dropped tail
    is_kept = expert < num_experts
    S = token_sort_num_slots(n, num_experts, align)
    dest = torch.where(is_kept, pos + shift[expert.clamp(max=num_experts - 1)], S)
    aligned = torch.full((S + 1,), -1, dtype=torch.int64, device=ids.device)
    aligned.scatter_(0, dest, torch.where(is_kept, sorted_ids, -1))
    return aligned[:S], padded_ends.to(torch.int32), kept, n - kept.sum()


def _check_token_sort_with_capacity(topk_ids, topk_weights, num_experts, capacity, align) -> None:
    fn = "token_sort_with_capacity"
    C.check_int(fn, "num_experts", num_experts, 1, C.MAX_EXPERTS)
    C.check_int(fn, "capacity", capacity, 0)
    C.check_int(fn, "align", align, 1)
    C.check_index_tensor(fn, "topk_ids", topk_ids)
    if topk_ids.dim() != 2:
        raise ValueError(f"{fn}: expected topk_ids [T, k], but got shape {tuple(topk_ids.shape)}")
    k = topk_ids.size(1)
    if k > num_experts:
        raise ValueError(f"{fn}: expected top-k ({k}) <= num_experts ({num_experts}): a token "
                         "cannot pick the same expert twice")
    C.check_float_tensor(fn, "topk_weights", topk_weights)
    C.check_shape(fn, "topk_weights", topk_weights, topk_ids.shape, "the shape of topk_ids")
    C.check_same_device(fn, "topk_weights", topk_weights, "topk_ids", topk_ids)
    slots = token_sort_num_slots(topk_ids.numel(), num_experts, align)
    if slots > C.MAX_SLOTS:
        raise ValueError(f"{fn}: expected T * k + num_experts * (align - 1) sorted slots to fit the "
                         f"int32 offs (<= {C.MAX_SLOTS}), but got {slots} with num_experts="
                         f"{num_experts} and align={align}")
    C.check_expert_ids(fn, topk_ids, num_experts)


def activation(kind: str, gate: Tensor, up: Optional[Tensor] = None, *, alpha: float = 1.702,
               limit: float = 7.0) -> Tensor:
    """The expert activations of :func:`moe_ffn` on plain tensors (used by dense FFNs, such as
    shared experts). ``up`` is required by the gated kinds and ignored by the others. The
    formulas are those of the fused kernels (:mod:`torch_moe._native.activation`)."""
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation: expected kind to be one of {ACTIVATIONS}, but got {kind!r}")
    if kind in GATED_ACTIVATIONS:
        if up is None:
            raise ValueError(f"activation: kind={kind!r} is gated and needs up of the shape of gate "
                             f"{tuple(gate.shape)}, but got None")
        if up.shape != gate.shape:
            raise ValueError(f"activation: expected up of the shape of gate {tuple(gate.shape)}, but "
                             f"got {tuple(up.shape)}")
    return _activation(kind, gate, up, alpha=alpha, limit=limit)
