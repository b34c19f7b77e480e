"""Token-parallel (and expert-tensor-parallel) execution of the MoE FFN on DTensors.

The routing ops have no exact token-sharded rule (their index maps are global, see
:mod:`torch_moe.distributed.tensor._ops._moe_ops`), but the routed FFN as a whole is exact on
token shards: a token's output depends on that token only. So when ``moe_ffn`` or ``MoE``
receives DTensors, every rank routes its own tokens and runs the local kernels through
:func:`torch.distributed.tensor.experimental.local_map`; no token crosses a rank. They reach
this module through the DTensor handlers it registers with :mod:`torch_moe.nn._subclass_hooks`
(``torch_moe`` imports it as soon as ``torch.distributed.tensor`` is imported).

Per mesh dimension the inputs must be in one of these layouts (anything else raises):

===============  ================================  ==============================  ============
mesh dim kind    tokens ``x`` (and routing tensors) expert weights                  routed out
===============  ================================  ==============================  ============
token parallel   ``Shard(d)``, ``d`` a token dim    ``Replicate``                   ``Shard(d)``
expert TP (ETP)  ``Replicate``                     w1, w3 ``Shard(2)``, w2 ``Shard(1)``  ``Partial``
replicated       ``Replicate``                     ``Replicate``                   ``Replicate``
===============  ================================  ==============================  ============

Gradients follow the same algebra (``in_grad_placements``): a parameter replicated over token
shards, or any replicated tensor on an ETP dim, receives a ``Partial`` gradient.

A fused gate/up weight ``w13 [E, D, 2F]`` (w3 None) is ``cat(gate, up)`` along its last dim: on
an ETP dim a rank needs ``cat(gate_r, up_r)``, ``_StridedShard(2, split_factor=2)``. The expert
biases follow their weights: on a token dim Replicate; on an ETP dim b1 / b3 ``Shard(1)`` (the
``[E, 2F]`` b1 of a fused w13 ``_StridedShard(1, split_factor=2)``) and b2 Replicate. b2 is added
after the down projection, which is a partial sum over the ETP dims, so each rank adds its
share ``b2 / n`` (``n`` the ranks of the ETP dims; exact for a power of two), and the sum holds
it once; its gradient, which every ETP rank sees whole, is Replicate there.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map

from torch_moe.distributed.tensor._compat import StridedShard
from torch_moe.nn._subclass_hooks import register_subclass_handlers

__all__ = ["MeshPlan", "plan_mesh", "share_of_replicated", "token_parallel_moe_ffn",
           "moe_layer_forward"]

R = Replicate()
_WEIGHTS = ("w1", "w2", "w3")
_BIASES = ("b1", "b2", "b3")
# the expert-tensor-parallel layout: the FFN dim F sharded in every expert weight and in the
# biases of the up projections, the down bias b2 whole (each rank adds its share)
_ETP = {"w1": Shard(2), "w2": Shard(1), "w3": Shard(2), "b1": Shard(1), "b2": R, "b3": Shard(1)}
# with a fused w13 [E, D, 2F] = cat(gate, up) and its b1 [E, 2F]: cat(gate_r, up_r) per rank
_ETP_FUSED = dict(_ETP, w1=StridedShard(2, split_factor=2), b1=StridedShard(1, split_factor=2))


class _ShareOfReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, b: torch.Tensor, n: int) -> torch.Tensor:
        return b / n

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def share_of_replicated(b: torch.Tensor, n: int) -> torch.Tensor:
    """``b / n``, a rank's share of a tensor replicated over ``n`` ranks that each add it to a
    partial sum; the backward passes the gradient unchanged.

    The loss depends on the sum of the ``n`` partial results, whose gradient ``g`` every rank
    receives whole: ``d loss / d b = sum_r g / n = g``, the same on every rank, as the gradient
    of a replicated tensor must be (no reduction needed). Exact for a power-of-two ``n``."""
    return b if n == 1 else _ShareOfReplicated.apply(b, n)


class MeshPlan:
    """What each mesh dimension does: ``kinds[i]`` is ``"token"``, ``"etp"`` or ``"replicate"``;
    ``token_dims[i]`` the tensor dim of ``x`` sharded on a token mesh dim."""

    def __init__(self, mesh, kinds: list[str], token_dims: list[Optional[int]],
                 etp_layout: Optional[dict] = None):
        self.mesh, self.kinds, self.token_dims = mesh, kinds, token_dims
        self.etp_layout = _ETP if etp_layout is None else etp_layout

    def etp(self, name: str):
        """The placement of expert parameter ``name`` (w1, ..., b3) on an ETP dim."""
        return self.etp_layout[name]

    def etp_degree(self) -> int:
        """The number of ranks over the ETP dims: the F shards whose outputs are summed."""
        n = 1
        for i, k in enumerate(self.kinds):
            if k == "etp":
                n *= self.mesh.size(i)
        return n

    def tokens(self) -> tuple:
        """Placements of a token-indexed tensor: sharded like x's token dim."""
        return tuple(Shard(d) if k == "token" else R for k, d in zip(self.kinds, self.token_dims))

    def out(self) -> tuple:
        """Placements of the routed output (token-indexed, partial over ETP dims)."""
        return tuple(
            Shard(d) if k == "token" else (Partial() if k == "etp" else R)
            for k, d in zip(self.kinds, self.token_dims)
        )

    def replicated(self) -> tuple:
        return (R,) * len(self.kinds)

    def replicated_grad(self) -> tuple:
        """Gradient placements of a tensor replicated on every mesh dim: local gradients are
        sums over the local tokens (token dims) or over the local F shard (ETP dims)."""
        return tuple(R if k == "replicate" else Partial() for k in self.kinds)

    def tokens_grad(self) -> tuple:
        """Gradient placements of a token-indexed input: partial over ETP dims."""
        return self.out()

    def expert_weight(self, etp_placement) -> tuple:
        return tuple(etp_placement if k == "etp" else R for k in self.kinds)

    def expert_weight_grad(self, etp_placement) -> tuple:
        return tuple(
            etp_placement if k == "etp" else (Partial() if k == "token" else R) for k in self.kinds
        )

    def counts(self) -> tuple:
        return tuple(Partial() if k == "token" else R for k in self.kinds)


def plan_mesh(op: str, x: DTensor, w1: DTensor, w2: DTensor, w3: Optional[DTensor],
              replicated: Sequence[tuple[str, Optional[torch.Tensor]]] = (),
              biases: Sequence[tuple[str, Optional[torch.Tensor]]] = ()) -> MeshPlan:
    """Classifies the mesh dims of ``x`` [..., D] and the expert weights (and biases), or
    raises."""
    mesh = x.device_mesh
    token_ndim = x.dim() - 1
    weights = {"w1": w1, "w2": w2, "w3": w3}
    # a fused gate/up weight: w1 [E, D, 2F] without w3 (an ungated w1 is [E, D, F])
    fused = w3 is None and w2.size(1) > 0 and w1.size(-1) == 2 * w2.size(1)
    layout = _ETP_FUSED if fused else _ETP
    for name, t in list(weights.items()) + list(replicated) + list(biases):
        if t is None:
            continue
        if not isinstance(t, DTensor):
            raise ValueError(
                f"{op}: x is a DTensor, so {name} must be a DTensor on the same mesh too, but got "
                f"a {type(t).__name__}"
            )
        if t.device_mesh != mesh:
            raise ValueError(
                f"{op}: expected {name} on the mesh of x ({mesh}), but it is on {t.device_mesh}"
            )
    kinds, token_dims = [], []
    for i, px in enumerate(x.placements):
        wp = {n: t.placements[i] for n, t in weights.items() if t is not None}
        if isinstance(px, Shard) and px.dim < token_ndim:
            kind = "token"
            bad = {n: p for n, p in wp.items() if not isinstance(p, Replicate)}
        elif isinstance(px, Replicate):
            kind = "etp" if all(p == layout[n] for n, p in wp.items()) else "replicate"
            bad = {} if kind == "etp" else {
                n: p for n, p in wp.items() if not isinstance(p, Replicate)
            }
        else:
            raise ValueError(
                f"{op}: on mesh dim {i}, expected x to be Shard(d) on a token dim (d < "
                f"{token_ndim}) or Replicate, but got {px}: the hidden dim of the tokens cannot "
                "be sharded across the expert FFN"
            )
        if bad:
            got = ", ".join(f"{n} {p}" for n, p in bad.items())
            if kind == "token":
                want = "Replicate (tokens are sharded on this mesh dim)"
            elif fused:
                want = ("all Replicate, or the fused w1 _StridedShard(2, split_factor=2) with w2 "
                        "Shard(1) (expert tensor parallel)")
            else:
                want = "all Replicate, or w1/w3 Shard(2) with w2 Shard(1) (expert tensor parallel)"
            raise ValueError(f"{op}: on mesh dim {i}, expected expert weights {want}, but got {got}")
        for name, t in biases:
            want = layout[name] if kind == "etp" else R
            if t is not None and t.placements[i] != want:
                raise ValueError(
                    f"{op}: on mesh dim {i}, expected the expert bias {name} to be {want} (as its "
                    f"weights are laid out), but got {t.placements[i]}"
                )
        for name, t in replicated:
            if t is not None and not isinstance(t.placements[i], Replicate):
                raise ValueError(
                    f"{op}: on mesh dim {i}, expected {name} to be Replicate, but got "
                    f"{t.placements[i]}"
                )
        kinds.append(kind)
        token_dims.append(px.dim if kind == "token" else None)
    return MeshPlan(mesh, kinds, token_dims, layout)


def token_parallel_moe_ffn(x: DTensor, topk_ids: DTensor, topk_weights: DTensor, w1: DTensor,
                           w2: DTensor, w3: Optional[DTensor], local_fn: Callable, *,
                           b1: Optional[DTensor] = None, b2: Optional[DTensor] = None,
                           b3: Optional[DTensor] = None) -> DTensor:
    """Runs ``local_fn(x, topk_ids, topk_weights, w1, w2, w3, b1=, b2=, b3=)`` (``moe_ffn`` on
    plain tensors) on every rank's tokens. ``x [T, D]``; ``topk_ids`` / ``topk_weights [T, k]``
    sharded like ``x``; the expert biases, if any, laid out as their weights (see the module
    docstring)."""
    op = "moe_ffn"
    biases = [(n, b) for n, b in (("b1", b1), ("b2", b2), ("b3", b3)) if b is not None]
    plan = plan_mesh(op, x, w1, w2, w3, biases=biases)
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if not isinstance(t, DTensor) or t.placements != plan.tokens():
            got = t.placements if isinstance(t, DTensor) else type(t).__name__
            raise ValueError(
                f"{op}: expected {name} to be a DTensor placed like the tokens of x "
                f"{plan.tokens()}, but got {got}"
            )
    weights = [("w1", w1), ("w2", w2)] + ([("w3", w3)] if w3 is not None else [])
    params = weights + biases
    in_pl = [plan.tokens(), plan.tokens(), plan.tokens()] + [
        plan.expert_weight(plan.etp(n)) for n, _ in params
    ]
    in_grad = [plan.tokens_grad(), plan.tokens(), plan.tokens_grad()] + [
        plan.expert_weight_grad(plan.etp(n)) for n, _ in params
    ]
    etp_degree = plan.etp_degree()

    def run(x_, ids_, tw_, *local):
        ws, bs = local[:len(weights)], local[len(weights):]
        # b2 is added to each F shard's partial output: a share per rank
        bs = {n: share_of_replicated(b, etp_degree) if n == "b2" else b
              for (n, _), b in zip(biases, bs)}
        return local_fn(x_, ids_, tw_, *ws, *([None] if w3 is None else []), **bs)

    fn = local_map(run, out_placements=(plan.out(),), in_placements=tuple(in_pl),
                   in_grad_placements=tuple(in_grad), device_mesh=plan.mesh)
    return fn(x, topk_ids, topk_weights, *(t for _, t in weights), *(b for _, b in biases))


class _Bound(torch.nn.Module):
    """Calls ``moe.<method>`` so that ``torch.func.functional_call`` can swap the layer's
    parameters for their local shards (parameter names are prefixed with ``moe.``)."""

    def __init__(self, moe, method: str):
        super().__init__()
        self.moe, self.method = moe, method

    def forward(self, *args):
        return getattr(self.moe, self.method)(*args)


def moe_layer_forward(moe, x: DTensor, return_aux_loss: bool = False) -> DTensor:
    """``MoE.forward`` on a DTensor ``x [B, L, D]`` or ``[T, D]`` with DTensor parameters:
    routing, routed experts and auxiliary losses run on each rank's tokens; shared experts run
    replicated on the tokens of each rank and are added in DTensor land (the routed output is
    Partial over expert-tensor-parallel dims, the shared one is not)."""
    op = "MoE"
    if return_aux_loss:
        raise NotImplementedError("MoE: expected return_aux_loss=False for a DTensor input (its "
                                  "aux losses are attached per shard), but got True")
    c = moe.config
    params = dict(moe.named_parameters())
    expert = {n: params.get(f"experts.{n}") for n in _WEIGHTS + _BIASES}
    others = [(n, p) for n, p in params.items() if not n.startswith("experts.")]
    plan = plan_mesh(op, x, expert["w1"], expert["w2"], expert["w3"], replicated=others,
                     biases=[(n, expert[n]) for n in _BIASES])
    seq_sharded = x.dim() == 3 and 1 in plan.token_dims
    if seq_sharded and c.seq_balance_coeff > 0:
        raise ValueError(
            f"{op}: the sequence-wise balance loss needs whole sequences on each rank, but x is "
            "sharded along the sequence dim"
        )
    routed_names = [n for n in params if n.startswith("router.") or n.startswith("experts.")]
    routed_in = [plan.tokens()] + [
        plan.expert_weight(plan.etp(n.split(".")[1])) if n.startswith("experts.")
        else plan.replicated()
        for n in routed_names
    ]
    routed_grad = [plan.tokens_grad()] + [
        plan.expert_weight_grad(plan.etp(n.split(".")[1])) if n.startswith("experts.")
        else plan.replicated_grad()
        for n in routed_names
    ]
    etp_degree = plan.etp_degree()
    seq_len_local = x.to_local().size(1) if x.dim() == 3 else x.to_local().size(0)
    routed = _Bound(moe, "routed_forward")

    def run_routed(x_local, *p_local):
        x_TD = x_local.reshape(-1, c.dim)
        # b2 is added to each F shard's partial output: a share per rank
        local = {f"moe.{n}": share_of_replicated(t, etp_degree) if n == "experts.b2" else t
                 for n, t in zip(routed_names, p_local)}
        y, counts, dropped = torch.func.functional_call(routed, local, (x_TD, seq_len_local))
        if dropped is None:
            dropped = counts.new_zeros(())
        return y.to(x_local.dtype).view(x_local.shape), counts, dropped

    y, counts, dropped = local_map(
        run_routed,
        out_placements=(plan.out(), plan.counts(), plan.counts()),
        in_placements=tuple(routed_in),
        in_grad_placements=tuple(routed_grad),
        device_mesh=plan.mesh,
    )(x, *(params[n] for n in routed_names))
    if moe.training:
        # the global counts, replicated: every rank records the same totals (MoE.record_load)
        moe.record_load(counts.full_tensor(),
                        dropped.full_tensor() if c.capacity_factor is not None else None)
    if moe.shared_experts is None:
        return y
    shared_names = [n for n in params if n.startswith("shared_experts.")]
    shared = _Bound(moe, "shared_experts")

    def run_shared(x_local, *p_local):
        local = {f"moe.{n}": t for n, t in zip(shared_names, p_local)}
        out = torch.func.functional_call(shared, local, (x_local.reshape(-1, c.dim),))
        return out.to(x_local.dtype).view(x_local.shape)

    # shared experts see every rank's own tokens with replicated weights: their gradients are
    # partial over token dims only
    shared_grad = tuple(Partial() if k == "token" else R for k in plan.kinds)
    y_shared = local_map(
        run_shared,
        out_placements=(plan.tokens(),),
        in_placements=(plan.tokens(),) + (plan.replicated(),) * len(shared_names),
        in_grad_placements=(tuple(Shard(d) if k == "token" else R
                                  for k, d in zip(plan.kinds, plan.token_dims)),)
        + (shared_grad,) * len(shared_names),
        device_mesh=plan.mesh,
    )(x, *(params[n] for n in shared_names))
    return y + y_shared


# moe_ffn and MoE reach this module through these handlers, never through an import from nn
register_subclass_handlers(DTensor, moe_ffn=token_parallel_moe_ffn, moe_layer=moe_layer_forward)
