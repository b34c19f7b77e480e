"""The expert activations of torch_moe, forward and backward: the one place their math lives.

Two forms of the same formulas:

* :func:`activation`, an autograd composition on ``gate`` / ``up`` of any shape: the dense
  paths (:func:`torch_moe.nn.functional.activation`, the quantized expert FFN) differentiate
  through it.
* :func:`activation_forward` / :func:`activation_backward`, the fused kernels' form: they read
  one pre-activation buffer ``h [n, 2F]`` whose first half is the gate ``g = x @ w1`` and second
  half the up projection ``u = x @ w3`` (``h [n, F]`` when not gated), write into buffers given
  by the caller, and state the derivative by hand. Backward recomputes from ``h`` (the only
  tensor saved), so no activation output is ever stored.

Formulas (``L`` = ``limit``):

    swiglu      silu(g) * u
    geglu       gelu(g) * u                                   (exact, erf-based gelu)
    swiglu_oai  (clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g'),  g' = clamp(g, max=L)  (gpt-oss)
    gelu        gelu(h)
    relu        relu(h)
"""

from typing import Optional

import torch
import torch.nn.functional as F_

from torch_moe._checks import GATED_ACTIVATIONS

__all__ = ["activation", "activation_forward", "activation_backward"]


def activation(kind: str, gate: torch.Tensor, up: Optional[torch.Tensor] = None, *,
               alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """``act(gate, up)`` out of place, differentiable by autograd; ``up`` (of the shape of
    ``gate``) is read by the gated kinds only. The caller has checked ``kind`` and ``up``."""
    if kind == "swiglu":
        return F_.silu(gate) * up
    if kind == "geglu":
        return F_.gelu(gate) * up
    if kind == "swiglu_oai":
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * gate * torch.sigmoid(alpha * gate)
    if kind == "gelu":
        return F_.gelu(gate)
    return F_.relu(gate)


def _split(h: torch.Tensor, gated: bool):
    if not gated:
        return h, None
    f = h.size(1) // 2
    return h[:, :f], h[:, f:]


def activation_forward(kind: str, h: torch.Tensor, out: torch.Tensor, alpha: float, limit: float):
    """Writes act(h) into ``out [n, F]`` and returns it."""
    g, u = _split(h, kind in GATED_ACTIVATIONS)
    if kind == "swiglu":
        # into ``out``: no [n, F] temporary per block; silu computes g * sigmoid(g) in fp32
        # for bf16 / fp16 and rounds once, as F.silu does
        torch.ops.aten.silu.out(g, out=out).mul_(u)
    elif kind == "geglu":
        torch.mul(F_.gelu(g), u, out=out)
    elif kind == "swiglu_oai":
        gc = g.clamp(max=limit)
        glu = torch.sigmoid(gc * alpha).mul_(gc)
        torch.mul(u.clamp(-limit, limit).add_(1.0), glu, out=out)
    elif kind == "gelu":
        out.copy_(F_.gelu(g))
    else:  # relu
        torch.clamp(g, min=0, out=out)
    return out


def activation_backward(
    kind: str, grad: torch.Tensor, h: torch.Tensor, grad_h: torch.Tensor, alpha: float, limit: float
):
    """Writes d act / d h applied to ``grad [n, F]`` into ``grad_h`` (the shape of ``h``)."""
    gated = kind in GATED_ACTIVATIONS
    g, u = _split(h, gated)
    dg, du = _split(grad_h, gated)
    if kind == "swiglu":
        # in place in the output halves, four passes over [n, F], no temporary: du = grad *
        # silu(g) and dg = silu_backward(grad * u, g), the fused kernel of d silu / dg = s * (1 +
        # g * (1 - s)), s = sigmoid(g). These are the ops autograd runs through F.silu(g) * u:
        # the same bits wherever ATen's vectorised loops cover both (F a multiple of 16).
        torch.ops.aten.silu.out(g, out=du).mul_(grad)
        torch.ops.aten.silu_backward.grad_input(torch.mul(grad, u, out=dg), g, grad_input=dg)
    elif kind == "geglu":
        torch.mul(grad, F_.gelu(g), out=du)
        dg.copy_(torch.ops.aten.gelu_backward(grad * u, g))
    elif kind == "swiglu_oai":
        gc = g.clamp(max=limit)
        s = torch.sigmoid(gc * alpha)
        glu = gc * s
        uc = u.clamp(-limit, limit)
        # clamp passes the gradient where the input lies inside [min, max] (bounds included)
        torch.mul(grad * glu, (u >= -limit) & (u <= limit), out=du)
        dglu = s * (1 + alpha * gc * (1 - s))
        torch.mul(grad * (uc + 1), dglu * (g <= limit), out=dg)
    elif kind == "gelu":
        dg.copy_(torch.ops.aten.gelu_backward(grad, g))
    else:  # relu
        torch.mul(grad, g > 0, out=dg)
    return grad_h
