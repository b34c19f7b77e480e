"""Training with replicated experts: the replica layout of an expert-parallel layer, the
reduction of replica gradients, rebalancing from observed loads, and checkpoints.

``ExpertParallel(slots_per_rank=S)`` (or ``placement=``) of
:mod:`torch_moe.distributed.parallel` stores the stacked expert weights of a layer as
*physical* weights ``w1, w3 [P, D, F]``, ``w2 [P, F, D]`` with ``P = R * S >= E`` slots:
``Shard(0)`` DTensors over the ``R`` ranks of the 1-D ``ep`` mesh, slot ``p`` on rank ``p // S``
(the slot order of :mod:`torch_moe.distributed.placement`). Slot p holds logical expert
``placement.phys_to_logical[p]``; a hot expert has several slots, its *replicas*, which hold the
same weights. The router picks logical experts; the experts' input hook sends each assignment to
one replica (:func:`~torch_moe.distributed.placement.route_to_replicas`, the replicas of an
expert get equal shares) and dispatches over the ``P`` slots. ``MoE.tokens_per_expert`` stays
logical, ``[E]``.

This module owns what a training loop calls on such layers, every rank the same calls in the
same order (each is collective over the ``ep`` group):

* :func:`reduce_replica_grads_`, once per optimizer step, after the last backward of the step
  (all micro-batches) and before gradient clipping and ``optimizer.step()``: every replica of an
  expert receives a disjoint share of the expert's tokens, so its gradient is a part of the
  expert's; the function replaces the gradient of every replica by the sum over the replicas,
  one ``all_reduce`` for all layers of a group and dtype. With the style's ``1 / ep`` scaling
  the sum is the gradient the non-replicated layer gives the expert. An explicit call rather
  than a gradient hook: a hook would run per backward and count an accumulated gradient once
  per micro-batch. (``optimizer.register_step_pre_hook(lambda *_: reduce_replica_grads_(m))``
  is the one-line way to make it automatic when nothing reads the gradients before the step.)
  Equal weights, equal gradients and equal optimizer state give equal updates: the replicas
  stay identical, bit for bit, through the optimizer step.
* :func:`rebalance_experts_`, every few hundred steps, after ``optimizer.step()`` and
  ``optimizer.zero_grad()``: re-plans the placement from the global logical load
  (:func:`~torch_moe.distributed.placement.plan_placement`, same ``S``) and moves the weights and
  the per-slot optimizer state (Adam's ``exp_avg`` / ``exp_avg_sq``, ...) to it in place, with
  :func:`~torch_moe.distributed.placement.rebalance_distributed_`; the parameters and their
  storages stay the same objects, so the optimizer keeps working on them.
* :func:`clip_grad_norm_`, in place of ``torch.nn.utils.clip_grad_norm_`` (after
  :func:`reduce_replica_grads_`): the norm of the logical model's gradient, every expert
  counted once. ``torch.nn.utils.clip_grad_norm_`` over the physical parameters would count an
  expert with ``n`` replicas ``n`` times and clip by a norm that depends on the placement.
* :func:`logical_expert_weights` gathers the logical ``[E, ...]`` weights (tests, export).
* Checkpoints: the physical DTensors are ordinary ``Shard(0)`` DTensors of global size ``P``,
  saved and loaded by DCP (``model.state_dict()``, ``get_state_dict``) like any other, with the
  optimizer state. They are laid out by the placement of the moment, so a checkpoint also stores
  the placement tables: :func:`placement_state_dict` gives them (one ``[P]`` int64 tensor per
  layer, the same on every rank), to be saved in the same ``dcp.save`` and loaded in the same
  ``dcp.load`` (in place, into a fresh ``placement_state_dict`` of the resumed model), after
  which :func:`load_placement_state_dict_` makes them the layers' placements. Resuming this way
  needs the same ``R`` and ``S``, and is bit-exact. To change them, save logical experts with
  :func:`torch_moe.distributed.checkpoint.logical_expert_state_dict` instead.

Not supported: FSDP or any other sharding of the physical weights beyond ``Shard(0)`` on the
1-D ``ep`` mesh (the functions check the placements), and re-initialising the weights after
parallelizing (``reset_parameters`` would give the replicas different values).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn, Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from torch_moe.distributed.placement import (
    Placement,
    plan_placement,
    rebalance_distributed_,
)
from torch_moe.nn.modules.moe import GroupedExperts, MoE

__all__ = [
    "clip_grad_norm_",
    "expert_placement",
    "load_placement_state_dict_",
    "logical_expert_weights",
    "placement_state_dict",
    "Rebalanced",
    "rebalance_experts_",
    "reduce_replica_grads_",
]

_WEIGHTS = ("w1", "w2", "w3")


class _ReplicaLayout:
    """The current placement of one replicated :class:`GroupedExperts` and its ``ep`` group.
    Kept beside the module (see :data:`_LAYOUTS`), not on it: the style sets nothing on the
    experts but their parameters and hooks."""

    def __init__(self, placement: Placement, mesh: DeviceMesh):
        self.placement = placement
        self.mesh = mesh
        self.group = mesh.get_group(0)
        self.rank = mesh.get_local_rank(0)

    def local_experts(self) -> Tensor:
        """``[S]`` the logical expert of each local slot."""
        S = self.placement.slots_per_rank
        return self.placement.phys_to_logical[self.rank * S:(self.rank + 1) * S]


# GroupedExperts -> _ReplicaLayout, for the experts parallelized with replicas
_LAYOUTS: "weakref.WeakKeyDictionary[GroupedExperts, _ReplicaLayout]" = (
    weakref.WeakKeyDictionary())


def _register_layout(experts: GroupedExperts, placement: Placement, mesh: DeviceMesh) -> None:
    _LAYOUTS[experts] = _ReplicaLayout(placement, mesh)


def _layout(experts: nn.Module) -> Optional[_ReplicaLayout]:
    """The replica layout of ``experts``, None when they are not parallelized with replicas."""
    return _LAYOUTS.get(experts)


def _physical_weight(logical: Tensor, placement: Placement) -> Tensor:
    """``[P, ...]``: row p is the row of logical expert ``phys_to_logical[p]`` of ``logical
    [E, ...]``."""
    return logical.detach().index_select(0, placement.phys_to_logical.to(logical.device))


def _experts_of(fn: str, module) -> GroupedExperts:
    experts = module.experts if isinstance(module, MoE) else module
    if not isinstance(experts, GroupedExperts) or _layout(experts) is None:
        raise ValueError(f"{fn}: expected a MoE or GroupedExperts parallelized by "
                         "ExpertParallel with replicas (slots_per_rank or placement), but got "
                         f"{type(module).__name__} without replicas")
    return experts


def _replicated_in(fn: str, modules) -> list:
    """Every replicated GroupedExperts in ``modules`` (a module or an iterable of modules,
    searched with ``.modules()``), in order, each once."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    elif not isinstance(modules, Iterable):
        raise ValueError(f"{fn}: expected a module or an iterable of modules, but got "
                         f"{type(modules).__name__}")
    found, seen = [], set()
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"{fn}: expected modules, but got a {type(m).__name__}")
        for sub in m.modules():
            if id(sub) not in seen and _layout(sub) is not None:
                seen.add(id(sub))
                found.append(sub)
    return found


def _weights(experts: GroupedExperts) -> dict:
    return {w: experts._parameters[w] for w in _WEIGHTS if experts._parameters.get(w) is not None}


def _check_physical(fn: str, name: str, t: Tensor, layout: _ReplicaLayout) -> Tensor:
    """The local ``[S, ...]`` tensor of a physical DTensor ``t`` (weight, gradient or optimizer
    state), after checking that it is ``Shard(0)`` on the layer's 1-D ``ep`` mesh."""
    P = layout.placement.num_physical
    if not (isinstance(t, DTensor) and t.device_mesh == layout.mesh
            and tuple(t.placements) == (Shard(0),) and t.size(0) == P):
        what = (f"a DTensor of shape {tuple(t.shape)} placed {tuple(t.placements)} on mesh "
                f"{t.device_mesh}" if isinstance(t, DTensor)
                else f"a {type(t).__name__} of shape {tuple(t.shape)}")
        raise NotImplementedError(
            f"{fn}: expected {name} to be a Shard(0) DTensor [{P}, ...] on the expert-parallel "
            f"mesh of the layer (no FSDP or other sharding of replicated experts), but got "
            f"{what}")
    return t.to_local()


@torch.no_grad()
def reduce_replica_grads_(modules: Union[nn.Module, Iterable[nn.Module]]) -> None:
    """Sums the gradients of the replicas of every logical expert, in place.

    Call it once per optimizer step, on every rank of the ``ep`` group, after the last backward
    of the step and before anything reads the expert gradients (clipping, ``optimizer.step()``).
    After it every replica of expert e holds ``sum_r grad(replica r)``, which is the gradient the
    layer without replicas gives expert e (each token's assignment to e went to one replica).
    Only experts with more than one replica are reduced: one ``all_reduce`` over the ``ep``
    group per dtype, for all the layers that share the group. A replicated expert weight
    without a gradient gets a zero one, so that every rank takes part.

    Args:
        modules: a module (the model) or modules; every replicated
            :class:`~torch_moe.nn.GroupedExperts` among their submodules is reduced. Modules
            without replicated experts are allowed (nothing to do).
    """
    fn = "reduce_replica_grads_"
    # (group, dtype, device) -> [group, [(local grad [S, ...], local slots, buffer rows, n)]]
    buckets: dict = {}
    for experts in _replicated_in(fn, modules):
        layout = _layout(experts)
        placement = layout.placement
        multi_E = placement.num_replicas > 1
        num_multi = int(multi_E.sum())
        if num_multi == 0:
            continue

        def slots_and_rows():
            row_of_E = torch.cumsum(multi_E, 0) - 1  # buffer row of each replicated expert
            local = layout.local_experts()
            slots = multi_E[local].nonzero().flatten()  # local slots of replicated experts
            return slots, row_of_E[local[slots]]

        for name, p in _weights(experts).items():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grad = _check_physical(fn, f"the gradient of {name}", p.grad, layout)
            slots, rows = placement._on_device(("reduce", layout.rank), grad.device,
                                               slots_and_rows)
            key = (id(layout.group), grad.dtype, grad.device)
            bucket = buckets.setdefault(key, [layout.group, []])
            bucket[1].append((grad, slots, rows, num_multi))
    for group, entries in buckets.values():
        sizes = [n * g[0].numel() for g, _, _, n in entries]
        grad0 = entries[0][0]
        flat = torch.zeros(sum(sizes), dtype=grad0.dtype, device=grad0.device)
        parts = [part.view(n, *g.shape[1:]) for part, (g, _, _, n)
                 in zip(flat.split(sizes), entries)]
        for part, (g, slots, rows, _) in zip(parts, entries):
            part.index_add_(0, rows, g.index_select(0, slots))
        dist.all_reduce(flat, group=group)
        for part, (g, slots, rows, _) in zip(parts, entries):
            g.index_copy_(0, slots, part.index_select(0, rows))


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` for a model with replicated
    experts: scales every gradient of ``model`` in place so that the ``norm_type``-norm of the
    gradient of the *logical* model is at most ``max_norm``; returns that norm (before
    clipping), a plain 0-dim tensor, the same on every rank.

    The norm counts every logical expert once: a replicated layer's physical gradient
    ``[P, ...]`` contributes ``sum_p |g_p|^q / n(p)`` (``q = norm_type``, ``n(p)`` the replicas of
    slot p's expert; the maximum for ``inf``), which after :func:`reduce_replica_grads_` is the
    norm of the gradient without replicas. Other gradients count as in torch (a DTensor by its
    full tensor; a plain tensor as it is, which for data-parallel replicated parameters is the
    same on every rank). Collective over the ``ep`` group of every replicated layer: every rank
    calls it.
    """
    fn = "clip_grad_norm_"
    if not isinstance(model, nn.Module):
        raise ValueError(f"{fn}: expected the model, an nn.Module, but got "
                         f"{type(model).__name__}")
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"{fn}: expected norm_type > 0 (or inf), but got {norm_type}")
    inf = norm_type == float("inf")
    physical, parts = set(), []  # parts: each gradient's norm (inf) or norm ** norm_type
    for experts in _replicated_in(fn, model):
        layout = _layout(experts)
        for name, p in _weights(experts).items():
            physical.add(id(p))
            if p.grad is None:
                continue
            g_SX = _check_physical(fn, f"the gradient of {name}", p.grad, layout)
            copies, = layout.placement._on_device(
                ("copies", layout.rank), g_SX.device,
                lambda: (layout.placement.num_replicas[layout.local_experts()],))
            slot_norms = torch.linalg.vector_norm(g_SX.flatten(1).float(), norm_type, dim=1)
            local = slot_norms.max() if inf else (slot_norms.pow(norm_type) / copies).sum()
            dist.all_reduce(local, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                            group=layout.group)
            parts.append(local)
    for p in model.parameters():
        if id(p) in physical or p.grad is None:
            continue
        g = p.grad
        norm = torch.linalg.vector_norm(g, norm_type)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        parts.append(norm.float() if inf else norm.float().pow(norm_type))
    if not parts:
        return torch.zeros(())
    device = parts[0].device
    stacked = torch.stack([t.to(device) for t in parts])
    total = stacked.max() if inf else stacked.sum().pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"{fn}: the total norm of order {norm_type} of the gradients is "
                           f"{total.item()}, so it cannot clip them")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            g.mul_(coef.to(g.device, g.dtype))
    return total


class Rebalanced(NamedTuple):
    """What :func:`rebalance_experts_` did to one layer. The imbalances are the most loaded
    rank over the mean rank load (:meth:`Placement.imbalance`) for the given load."""

    imbalance_before: float  # under the old placement
    imbalance_after: float  # under the placement now in use
    moved: bool  # False when the old placement was kept (nothing was moved)
    placement: Placement  # the placement now in use


def _gather_check(fn: str, loads_NE: Optional[Tensor], error: Optional[str], shape: tuple,
                  group, device: torch.device) -> None:
    """Every rank of ``group`` checks that every rank passes the same loads, or raises the same
    error: one all_gather of ``[1 + N * E]`` float64 (a flag, then the loads) on ``device``,
    the device of the expert weights (which the group's backend sends from)."""
    numel = 1 + shape[0] * shape[1]
    mine = torch.zeros(numel, dtype=torch.float64)
    if error is not None:
        mine[0] = 1
    else:
        mine[1:] = loads_NE.reshape(-1)
    world = dist.get_world_size(group)
    gathered = [torch.empty(numel, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device), group=group)
    gathered = [t.cpu() for t in gathered]
    failed = [r for r, t in enumerate(gathered) if t[0] != 0]
    if failed:
        if error is not None:
            raise ValueError(error)
        raise ValueError(f"{fn}: the arguments of ranks {failed} of the expert-parallel group "
                         "are invalid (see the error on those ranks)")
    differ = [r for r, t in enumerate(gathered) if not torch.equal(t, gathered[0])]
    if differ:
        raise ValueError(f"{fn}: expected the same global load on every rank of the "
                         f"expert-parallel group (all-reduce it over the data-parallel ranks "
                         f"first), but ranks {differ} differ from rank 0")


def _check_loads(fn: str, loads, num_layers: int, num_experts: int):
    """``loads`` as ``[N, E]`` float64 on the CPU, or an error message."""
    if isinstance(loads, Tensor):
        rows = list(loads) if loads.dim() == 2 else None
    elif isinstance(loads, Sequence):
        rows = list(loads)
    else:
        rows = None
    if rows is None or len(rows) != num_layers or not all(
            isinstance(r, Tensor) and r.shape == (num_experts,) for r in rows):
        what = (f"shape {tuple(loads.shape)}" if isinstance(loads, Tensor)
                else type(loads).__name__)
        return None, (f"{fn}: expected loads to be a [{num_layers}, {num_experts}] tensor or "
                      f"{num_layers} tensors [{num_experts}] (the global logical load of each "
                      f"layer), but got {what}")
    out = torch.stack([r.detach().to("cpu", torch.float64) for r in rows])
    if not torch.isfinite(out).all() or (out < 0).any():
        return None, f"{fn}: expected finite, non-negative loads, but got {out.tolist()}"
    return out, None


def _per_slot_state(fn: str, optimizer, name: str, p: Tensor, layout: _ReplicaLayout) -> dict:
    """The optimizer state of ``p`` that has one row per physical slot (the tensors placed like
    ``p``), as local tensors; 0-dim tensors (``step``) and non-tensors stay where they are."""
    out = {}
    if optimizer is None:
        return out
    for key, value in optimizer.state.get(p, {}).items():
        if not isinstance(value, Tensor) or value.dim() == 0:
            continue
        out[key] = _check_physical(fn, f"optimizer state {key!r} of {name}", value, layout)
    return out


@torch.no_grad()
def rebalance_experts_(modules: Sequence[nn.Module], loads,
                       optimizer: Optional[torch.optim.Optimizer] = None) -> list[Rebalanced]:
    """Re-plans the placement of replicated layers from their loads and moves the weights and
    the optimizer state to it, in place.

    For each layer: ``new = plan_placement(load, R, S)`` (``S`` unchanged); when it balances
    ``load`` better than the current placement (a lower max / mean rank load; the planner is a
    greedy heuristic, and a placement planned for an earlier load can be better), every
    physical weight and every per-slot optimizer state tensor (the
    tensors placed like the weight: Adam's ``exp_avg``, ``exp_avg_sq``, ...; ``step`` and other
    0-dim state are shared by all slots and stay) is laid out under ``new`` with
    :func:`~torch_moe.distributed.placement.rebalance_distributed_` (each new slot takes the
    row of its expert's first old replica) and copied back into the same storage, so the
    parameters and the optimizer's references to them stay valid. Bit-exact; every rank of the
    ``ep`` group must call it with the same loads (checked: one all_gather per call, every rank
    raises the same error).

    Call it after ``optimizer.step()`` and ``optimizer.zero_grad()`` (with the default
    ``set_to_none=True``): the expert weights must have no gradient, which would otherwise be
    laid out under the old placement.

    Args:
        modules: the replicated layers (:class:`~torch_moe.nn.MoE` or their experts), all on the
            same ``ep`` group and with the same number of experts ``E``.
        loads: ``[N, E]`` or ``N`` tensors ``[E]``, integer or floating, for the ``N`` modules:
            the assignments each logical expert received since the last rebalance, summed over
            all data-parallel ranks (``MoE.tokens_per_expert``, all-reduced; the ``ep`` ranks
            are data-parallel ranks too), the same on every rank.
        optimizer: the optimizer of the parameters, whose per-slot state moves with them; None
            when there is none yet.

    Returns:
        One :class:`Rebalanced` per module: max / mean rank load before and after, whether
        anything moved, and the placement now in use.
    """
    fn = "rebalance_experts_"
    if isinstance(modules, nn.Module) or not isinstance(modules, Sequence) or not modules:
        raise ValueError(f"{fn}: expected a non-empty sequence of replicated MoE layers, but "
                         f"got {type(modules).__name__}")
    layers = [_experts_of(fn, m) for m in modules]
    layouts = [_layout(e) for e in layers]
    group = layouts[0].group
    E = layouts[0].placement.num_logical
    for i, layout in enumerate(layouts):
        if layout.group is not group or layout.placement.num_logical != E:
            raise ValueError(f"{fn}: expected modules of {E} experts on one expert-parallel "
                             f"group, but module {i} has {layout.placement.num_logical} "
                             "experts or another group")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"{fn}: expected optimizer to be a torch.optim.Optimizer or None, but "
                         f"got {type(optimizer).__name__}")
    with_grad = [f"module {i} {n}" for i, e in enumerate(layers)
                 for n, p in _weights(e).items() if p.grad is not None]
    loads_NE, error = _check_loads(fn, loads, len(layers), E)
    if error is None and with_grad:
        error = (f"{fn}: expected the expert weights to have no gradient (rebalance after "
                 f"optimizer.step() and optimizer.zero_grad()), but {with_grad} have one")
    device = next(iter(_weights(layers[0]).values())).device
    _gather_check(fn, loads_NE, error, (len(layers), E), group, device)

    results = []
    for experts, layout, load_E in zip(layers, layouts, loads_NE):
        old = layout.placement
        new = plan_placement(load_E, old.num_ranks, old.slots_per_rank)
        before, after = old.imbalance(load_E), new.imbalance(load_E)
        # plan_placement is a greedy heuristic: a placement planned for an earlier load can
        # serve this one better than the new plan; keep it then, and move nothing
        moved = after < before
        if moved:
            state = {}
            for name, p in _weights(experts).items():
                state[(name, None)] = _check_physical(fn, name, p, layout)
                for key, t in _per_slot_state(fn, optimizer, name, p, layout).items():
                    state[(name, key)] = t
            rows = rebalance_distributed_(dict(state), old, new, group)
            for key, t in state.items():
                t.copy_(rows[key])
            layout.placement = new
        results.append(Rebalanced(before, after if moved else before, moved,
                                  layout.placement))
    return results


def expert_placement(module: nn.Module) -> Placement:
    """The current :class:`Placement` of a replicated layer (a MoE or its experts)."""
    return _layout(_experts_of("expert_placement", module)).placement


@torch.no_grad()
def logical_expert_weights(module: nn.Module) -> dict[str, Tensor]:
    """The logical expert weights of a replicated layer: ``{"w1": [E, D, F], "w2": [E, F, D],
    "w3": [E, D, F]}`` (``w3`` when gated), plain tensors, the same on every rank. Expert e is
    read from its first replica. Collective (one all-gather per weight): every rank of the
    ``ep`` group calls it."""
    fn = "logical_expert_weights"
    experts = _experts_of(fn, module)
    layout = _layout(experts)
    primary = layout.placement.logical_to_phys[:, 0]
    out = {}
    for name, p in _weights(experts).items():
        _check_physical(fn, name, p, layout)
        full = p.full_tensor()
        out[name] = full.index_select(0, primary.to(full.device))
    return out


def placement_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """``{fqn of each replicated GroupedExperts in model: phys_to_logical [P] int64}``, copies
    of the current placement tables, for a checkpoint (see the module docstring). The tensors
    are the same on every rank."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"placement_state_dict: expected an nn.Module, but got "
                         f"{type(model).__name__}")
    return {name: _layout(m).placement.phys_to_logical.clone()
            for name, m in model.named_modules() if _layout(m) is not None}


def load_placement_state_dict_(model: nn.Module, state_dict: dict[str, Tensor]) -> None:
    """Makes the placements of ``state_dict`` (from :func:`placement_state_dict`, saved and
    loaded with the physical weights) those of the replicated layers of ``model``. Moves no
    weight: the weights loaded with them are already laid out by them. Every replicated layer of
    ``model`` must have an entry, of its ``P`` slots and ``E`` experts."""
    fn = "load_placement_state_dict_"
    if not isinstance(model, nn.Module) or not isinstance(state_dict, dict):
        raise ValueError(f"{fn}: expected an nn.Module and a dict, but got "
                         f"{type(model).__name__} and {type(state_dict).__name__}")
    layouts = {name: _layout(m) for name, m in model.named_modules() if _layout(m) is not None}
    if set(layouts) != set(state_dict):
        raise ValueError(f"{fn}: expected entries for the replicated layers "
                         f"{sorted(layouts)}, but got {sorted(state_dict)}")
    new = {}
    for name, layout in layouts.items():
        old = layout.placement
        t = state_dict[name]
        if not isinstance(t, Tensor) or t.shape != (old.num_physical,):
            raise ValueError(f"{fn}: expected {name!r} to be a [{old.num_physical}] tensor, "
                             f"but got {t!r}")
        new[name] = Placement.from_phys_to_logical(t, old.num_ranks, old.num_logical)
    for name, placement in new.items():
        layouts[name].placement = placement
