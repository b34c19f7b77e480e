"""Functional MoE layers (counterpart of ``torch/nn/functional.py``)."""

from typing import Optional

import torch
from torch import Tensor

from torch_moe._checks import ACTIVATIONS

__all__ = ["moe_ffn"]


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
    sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(topk_ids, w1.size(0))
    out, _ = torch.ops.torch_moe.grouped_ffn(
        x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit
    )
    return out
