"""The routed-expert FFN with FP8 rowwise or MXFP8 expert GEMMs.

Counterpart of ``torch_moe.grouped_ffn`` for quantized training. The three expert GEMMs
(gate/up, down) run through :func:`torch_moe.quantization.quantized_grouped_mm`; everything
around them stays in high precision: the router (fp32), the token permutation, the activation
and the weighted combine (fp32 accumulation in ``unpermute``).

Groups must be padded to the recipe's alignment (``GROUP_ALIGNMENT``: 16 FP8, 32 MXFP8), i.e.
``sorted_ids`` / ``offs`` come from ``token_sort(topk_ids, E, align=GROUP_ALIGNMENT[precision])``;
the padding slots are zero rows that never reach the output.

Expert biases are added in the input dtype to the outputs of the scaled GEMMs, one row per
sorted slot (its expert's), and never to padding slots: those stay zero rows, so they move no
quantization scale (an MXFP8 block of the weight gradient spans 32 slots of a group).
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
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
) -> Tensor:
    """``out [T, D] = sum_j topk_weights[t, j] * (act(x[t] @ w1[e] + b1[e], x[t] @ w3[e] + b3[e])
    @ w2[e] + b2[e])`` with the expert GEMMs in ``precision`` (``"fp8_rowwise"`` or ``"mxfp8"``).

    ``w1`` may be the fused gate/up projection ``[E, D, 2F]`` when ``w3`` is None and the
    activation is gated (gate in ``[..., :F]``); its bias b1 is then ``[E, 2F]``. The biases
    (b1 ``[E, F]``, b3 ``[E, F]``, b2 ``[E, D]``) are optional, in the dtype of the weights.
    """
    if precision not in RECIPES:
        raise ValueError(f"quantized_expert_ffn: expected precision in {RECIPES}, but got {precision!r}")
    gated = activation in GATED_ACTIVATIONS
    _check_shapes(x_TD, w1_EDF, w2_EFD, w3_EDF, gated)
    _check_biases(w1_EDF, w2_EFD, w3_EDF, gated, b1, b2, b3)

    def gmm(a, w):
        return ops.quantized_grouped_mm(a, w, offs_E, precision, scale_mode, wgrad_high_precision)

    def add_bias(out_SN, b_EN):
        return out_SN if b_EN is None else out_SN + _slot_rows(b_EN, sorted_ids_S, offs_E)

    top_k = topk_weights_TK.size(1)
    xs_SD = ops.permute(x_TD, sorted_ids_S, top_k)  # padding slots are zero rows
    h_SF = add_bias(gmm(xs_SD, w1_EDF), b1)
    if gated:
        if w3_EDF is None:
            gate, up = h_SF.chunk(2, dim=-1)
        else:
            gate, up = h_SF, add_bias(gmm(xs_SD, w3_EDF), b3)
        a_SF = act_fn(activation, gate, up, alpha=alpha, limit=limit)
    else:
        a_SF = act_fn(activation, h_SF, alpha=alpha, limit=limit)
    # the routing weights of unpermute scale the down bias too (gpt-oss)
    y_SD = add_bias(gmm(a_SF, w2_EFD), b2)
    return ops.unpermute(y_SD, sorted_ids_S, topk_weights_TK)


def _slot_rows(b_EN: Tensor, sorted_ids_S: Tensor, offs_E: Tensor) -> Tensor:
    """``[S, N]``: row ``b[e]`` for each sorted slot of group ``e``, zero for the padding slots
    (-1 in ``sorted_ids``, those past ``offs[-1]`` included). Differentiable in ``b``, with no
    host synchronisation: the group of slot ``i`` is the number of group ends ``<= i``."""
    E = b_EN.size(0)
    slots = torch.arange(sorted_ids_S.size(0), device=offs_E.device, dtype=offs_E.dtype)
    expert_S = torch.searchsorted(offs_E, slots, right=True).clamp_(max=E - 1)
    rows = b_EN.index_select(0, expert_S)
    return torch.where((sorted_ids_S >= 0).unsqueeze(1), rows, 0)


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


def _check_biases(w1, w2, w3, gated: bool, b1, b2, b3) -> None:
    op = "quantized_expert_ffn"
    E, F, D = w2.shape
    fused = gated and w3 is None
    if b3 is not None and w3 is None:
        raise ValueError(f"{op}: b3 is the bias of the up projection w3, but w3 is None")
    expected = {"b1": (E, 2 * F) if fused else (E, F), "b2": (E, D), "b3": (E, F)}
    for name, b in (("b1", b1), ("b2", b2), ("b3", b3)):
        if b is None:
            continue
        if tuple(b.shape) != expected[name]:
            raise ValueError(f"{op}: expected {name} of shape {expected[name]}, but got "
                             f"{tuple(b.shape)}")
        if b.dtype != w1.dtype or b.device != w1.device:
            raise TypeError(f"{op}: expected {name} in the dtype and on the device of w1 "
                            f"({w1.dtype}, {w1.device}), but got {b.dtype} on {b.device}")


def group_alignment(precision: str) -> int:
    """Group-size multiple the expert GEMMs of ``precision`` need (1 for high precision)."""
    return GROUP_ALIGNMENT.get(precision, 1)
