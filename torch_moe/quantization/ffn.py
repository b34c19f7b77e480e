"""The routed-expert FFN with FP8 rowwise or MXFP8 expert GEMMs.

Counterpart of ``torch_moe.grouped_ffn`` for quantized training. The three expert GEMMs
(gate/up, down) run through :func:`torch_moe.quantization.quantized_grouped_mm`; everything
around them stays in high precision: the router (fp32), the token permutation, the activation
and the weighted combine (fp32 accumulation in ``unpermute``).

Groups must be padded to the recipe's alignment (``GROUP_ALIGNMENT``: 16 FP8, 32 MXFP8), i.e.
``sorted_ids`` / ``offs`` come from ``token_sort(topk_ids, E, align=GROUP_ALIGNMENT[precision])``;
the padding slots are zero rows that never reach the output.
"""

from typing import Optional

import torch
from torch import Tensor

from torch_moe._checks import GATED_ACTIVATIONS
from torch_moe._native.activation import activation as act_fn
from torch_moe.quantization._checks import GROUP_ALIGNMENT, RECIPES

__all__ = ["quantized_expert_ffn"]

ops = torch.ops.torch_moe


def quantized_expert_ffn(
    x_TD: Tensor,
    sorted_ids_S: Tensor,
    offs_E: Tensor,
    topk_weights_TK: Tensor,
    w1_EDF: Tensor,
    w2_EFD: Tensor,
    w3_EDF: Optional[Tensor],
    *,
    activation: str,
    alpha: float,
    limit: float,
    precision: str,
    scale_mode: str = "rceil",
    wgrad_high_precision: bool = False,
) -> Tensor:
    """``out [T, D] = sum_j topk_weights[t, j] * act(x[t] @ w1[e], x[t] @ w3[e]) @ w2[e]`` with
    the expert GEMMs in ``precision`` (``"fp8_rowwise"`` or ``"mxfp8"``).

    ``w1`` may be the fused gate/up projection ``[E, D, 2F]`` when ``w3`` is None and the
    activation is gated (gate in ``[..., :F]``).
    """
    if precision not in RECIPES:
        raise ValueError(f"quantized_expert_ffn: expected precision in {RECIPES}, but got {precision!r}")
    _check_shapes(x_TD, w1_EDF, w2_EFD, w3_EDF, activation in GATED_ACTIVATIONS)

    def gmm(a, w):
        return ops.quantized_grouped_mm(a, w, offs_E, precision, scale_mode, wgrad_high_precision)

    top_k = topk_weights_TK.size(1)
    xs_SD = ops.permute(x_TD, sorted_ids_S, top_k)  # padding slots are zero rows
    h_SF = gmm(xs_SD, w1_EDF)
    if activation in GATED_ACTIVATIONS:
        if w3_EDF is None:
            gate, up = h_SF.chunk(2, dim=-1)
        else:
            gate, up = h_SF, gmm(xs_SD, w3_EDF)
        a_SF = act_fn(activation, gate, up, alpha=alpha, limit=limit)
    else:
        a_SF = act_fn(activation, h_SF, alpha=alpha, limit=limit)
    y_SD = gmm(a_SF, w2_EFD)
    return ops.unpermute(y_SD, sorted_ids_S, topk_weights_TK)


def _check_shapes(x, w1, w2, w3, gated: bool) -> None:
    # Plain raises (Dynamo traces this function; torch._check message closures would break the
    # graph). The GEMM ops check their own operands; these are the cross-GEMM contracts that no
    # single op sees.
    op = "quantized_expert_ffn"
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{op}: expected x [T, D], w1 [E, D, F] and w2 [E, F, D], but got shapes "
                         f"{tuple(x.shape)}, {tuple(w1.shape)} and {tuple(w2.shape)}")
    E, D = w1.size(0), x.size(1)
    F = w1.size(2) // 2 if gated and w3 is None else w1.size(2)
    if w3 is not None and w3.shape != w1.shape:
        raise ValueError(f"{op}: expected w3 of the shape of w1 {tuple(w1.shape)}, but got {tuple(w3.shape)}")
    if w1.size(1) != D or tuple(w2.shape) != (E, F, D):
        raise ValueError(f"{op}: expected w1 [{E}, {D}, F] and w2 [{E}, {F}, {D}] for x [T, {D}], but "
                         f"got w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}")


def group_alignment(precision: str) -> int:
    """Group-size multiple the expert GEMMs of ``precision`` need (1 for high precision)."""
    return GROUP_ALIGNMENT.get(precision, 1)
