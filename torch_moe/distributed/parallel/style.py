"""ParallelStyles for the routed experts of :class:`torch_moe.nn.MoE`, for
:func:`torch.distributed.tensor.parallel.parallelize_module`.

Shape legend as in :mod:`torch_moe.nn.modules.moe`: T tokens of this rank, D model dim, F expert
FFN dim, E experts, k experts per token. Expert weights: ``w1, w3 [E, D, F]``, ``w2 [E, F, D]``
(``w1 [E, D, 2F]`` and no w3 with ``fused_gate_up``); with ``ffn_bias`` the biases ``b1 [E, F]``
(``[E, 2F]`` fused), ``b3 [E, F]``, ``b2 [E, D]``.

* :class:`ExpertParallel`, 1-D mesh ``ep``: every weight and bias ``Shard(0)`` (experts split
  over the ranks); each rank holds its own tokens, which travel to their experts and back
  (all-to-all).
* :class:`ExpertTensorParallel`, 2-D mesh ``(ep, tp)``: w1/w3 ``(Shard(0), Shard(2))``, w2
  ``(Shard(0), Shard(1))`` (experts split over ``ep``, F over ``tp``), b1/b3 ``(Shard(0),
  Shard(1))``, b2 ``(Shard(0), Replicate())``; the ranks of a ``tp`` group hold the same tokens.
* :class:`TensorParallelExperts`, 1-D mesh ``tp``: w1/w3 ``Shard(2)``, w2 ``Shard(1)`` (F split,
  all experts on every rank), b1/b3 ``Shard(1)``, b2 ``Replicate()``; all ranks hold the same
  tokens.

The down bias b2 is added to each expert output after the down projection, which with F
sharded is a partial sum over ``tp``: each ``tp`` rank adds ``b2 / tp`` (exact for a
power-of-two ``tp``; :class:`TensorParallelExperts` through the sharding strategy of
``grouped_ffn``, which takes b2 ``Partial``), so that the sum over ``tp`` holds b2 once; its
gradient is the whole one on every ``tp`` rank. The tensor-parallel styles do not take
``fused_gate_up`` (a ``Shard(2)`` of ``w1 [E, D, 2F]`` would give the first ranks gate columns
only): they raise at parallelize time.

A style applies to a :class:`~torch_moe.nn.GroupedExperts` or to a :class:`~torch_moe.nn.MoE`
(then to its ``experts``; router and shared experts stay plain, replicated modules). The layer
keeps taking and returning plain ``torch.Tensor`` s: each rank passes its own tokens and gets
their outputs. Like torch's own styles, each is a
:func:`~torch.distributed.tensor.distribute_module` of the experts, and sets nothing else on
the module: its partition function distributes the expert weights as DTensors, its input and
output functions (a forward pre-hook and a forward hook) do the communication around the
experts' own ``forward``, the plain grouped FFN, which :class:`~torch_moe.nn.MoE` calls with
``(x, sorted_ids, offs, topk_weights, topk_ids)`` whether its experts are parallel or not.

* Expert parallelism (:class:`ExpertParallel`, :class:`ExpertTensorParallel`) must know each
  token's experts: the input function takes the router's ``topk_ids`` (the local sort is not
  used) and runs the first steps of
  :func:`~torch_moe.distributed.dispatch.expert_parallel_moe_ffn` over the ``ep`` group: row
  plan, header exchange (the one host synchronisation; argument errors on every rank) and the
  all-to-all of the rows, which arrive at the rank of their experts. ``forward`` computes the
  local experts on the received rows. The output function sends every row's weighted expert
  sum back to its token's rank and adds them up (combine). For the forward the input function
  puts the local shards of the DTensor weights (``to_local()``, their gradients scaled by
  ``1 / ep``, see below) in place of the registered parameters, and a forward hook that runs
  even when the forward raises puts the parameters back: FSDP2 swaps its unsharded parameters
  in and out of a module around its forward the same way. ``fully_shard`` applied to the
  experts afterwards registers its pre-hook in front of the style's and its hook after the
  style's: the weights are all-gathered over ``edp`` before their ``ep`` shards are taken.
* Tensor parallelism over ``tp``: the inputs replicated over ``tp`` with their gradients
  summed over it, the partial outputs summed over it, with functional collectives.
  :class:`TensorParallelExperts` runs ``forward`` on DTensors, through the sharding
  strategies of the ops; :class:`ExpertTensorParallel` does this around the expert-parallel
  exchange, on local tensors.

Either way every weight gradient is a DTensor placed like its weight.

The ``ep`` ranks hold different tokens: they are data parallel, and gradients follow the
data-parallel convention of DDP and FSDP, the mean over the token sets of the data-parallel
ranks. For the plain parameters (router, shared experts) each rank's gradient is that of its
own tokens, to be averaged by the data-parallel wrapper (``fully_shard`` / DDP, with their
default gradient division) over a mesh that includes ``ep``. An expert shard receives in the
backward the contributions of the tokens of every ``ep`` rank, summed by the all-to-all; the
expert-parallel styles scale its gradient by ``1 / ep``, so that it is already the mean over
the ``ep`` token sets and a wrapper over the remaining data-parallel ranks (``edp``, which
FSDP divides by) completes the mean over all of them. Without a wrapper, the expert gradients
are the mean over the ``ep`` ranks' tokens. Over ``tp`` the plain parameters see the same
tokens and get the same, whole gradients. The counts
``MoE.tokens_per_expert`` are those of this rank's tokens. A DTensor input is not supported
(it would take the token-parallel path of :mod:`torch_moe.distributed.tensor`, which rejects
these placements): pass each rank's local tokens.

Replicas of hot experts (``ExpertParallel(slots_per_rank=S)`` or ``placement=``): the layer
keeps ``R * S >= E`` physical expert slots, ``Shard(0)`` DTensors ``[R * S, ...]`` whose extra
slots replicate hot experts; the input function routes the router's logical ids to the slots
and dispatches over them. What a training loop calls on such layers (the replica gradient
reduction, rebalancing, checkpoints of the placement) is in
:mod:`torch_moe.distributed.replicas`.

Not supported (raise at parallelize time): ``precision`` other than ``"bf16"`` (the
expert-parallel dispatcher runs the plain grouped FFN), ``capacity_factor`` (the styles are
dropless), ``fused_gate_up`` with the tensor-parallel styles, and ``ffn_bias`` with replicas of
hot experts (the replica gradient reduction and rebalancing move the weights only).

Worked example: a block with tensor-parallel attention and experts that are expert parallel
with expert tensor parallelism, on 8 ranks ``(edp, ep, tp) = (2, 2, 2)``. Tokens are split over
``edp`` and ``ep`` (data parallel) and replicated over ``tp``; attention is Megatron-style TP on
``tp`` (its output, the MoE input, is a plain tensor replicated over ``tp``); the experts are
sharded on ``ep`` and on their FFN dim over ``tp``; FSDP2 shards the experts once more over
``edp``, on the model dim D, which neither of them shards, and the rest of the block over the
flattened ``edp x ep`` mesh (``test/distributed/test_parallel_style.py`` runs this)::

    >>> # xdoctest: +SKIP("distributed")
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.fsdp import fully_shard
    >>> from torch.distributed.tensor import Shard
    >>> from torch.distributed.tensor.parallel import (
    ...     ColwiseParallel, RowwiseParallel, parallelize_module)
    >>> from torch_moe.distributed.parallel import ExpertTensorParallel
    >>> from torch_moe.nn import MoE, MoEConfig
    >>>
    >>> class Block(nn.Module):
    ...     def __init__(self, dim):
    ...         super().__init__()
    ...         self.attn = Attention(dim)  # nn.Linear projections wq, wk, wv, wo
    ...         self.moe = MoE(MoEConfig(dim=dim, hidden_dim=4 * dim, num_experts=8, top_k=2))
    ...
    ...     def forward(self, x):  # x [B, L, dim]: this data-parallel rank's tokens
    ...         h = x + self.attn(x)
    ...         return h + self.moe(h)
    >>>
    >>> mesh = init_device_mesh("cuda", (2, 2, 2), mesh_dim_names=("edp", "ep", "tp"))
    >>> dp_mesh = mesh["edp", "ep"]._flatten("dp")
    >>> block = Block(1024)
    >>> parallelize_module(block.attn, mesh["tp"], {
    ...     "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
    ...     "wo": RowwiseParallel()})
    >>> parallelize_module(block.moe, mesh["ep", "tp"], ExpertTensorParallel())
    >>> experts = block.moe.experts  # w1/w3 [E, D, F] and w2 [E, F, D]: D is dim 1 / dim 2
    >>> fully_shard(experts, mesh=mesh["edp"],
    ...             shard_placement_fn=lambda p: Shard(2 if p is experts.w2 else 1))
    >>> fully_shard(block, mesh=dp_mesh)  # attention (2-D with tp), router, shared experts

Without tensor parallelism the mesh is ``(edp, ep)``, the experts get
``parallelize_module(block.moe, mesh["ep"], ExpertParallel())`` and
``fully_shard(experts, mesh=mesh["edp"], shard_placement_fn=lambda p: Shard(1))`` (dim 1 of
every expert weight is whole under EP). Keep FSDP's default gradient divide factor (the size
of each module's reduce-scatter mesh): the styles account for ``ep``. On gloo, whose
reduce-scatter has no ``AVG`` or ``PREMUL_SUM``, call ``set_force_sum_reduction_for_comms(True)``
on both FSDP modules (``block`` and ``experts``): the reduction is then a ``SUM`` followed by
the same division.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, NamedTuple, Optional

import torch
from torch import nn, Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    distribute_module,
    distribute_tensor,
    DTensor,
    Partial,
    Replicate,
    Shard,
)
from torch.distributed.tensor.parallel import ParallelStyle

# the sharding strategies of torch_moe's ops, which TensorParallelExperts runs on DTensors
import torch_moe.distributed.tensor  # noqa: F401
from torch_moe.distributed._compat import wait_tensor
from torch_moe.distributed.dispatch import (
    _combine_rows,
    _Dispatched,
    _dispatch_tokens,
    _received_rows,
    expert_parallel_moe_ffn,
)
from torch_moe.distributed.placement import Placement, plan_placement, route_to_replicas
from torch_moe.distributed.tensor._token_parallel import share_of_replicated
from torch_moe.distributed.replicas import _layout, _physical_weight, _register_layout
from torch_moe.nn.modules.moe import GroupedExperts, MoE

__all__ = ["ExpertParallel", "ExpertTensorParallel", "TensorParallelExperts"]

_WEIGHTS = ("w1", "w2", "w3")
_BIASES = ("b1", "b2", "b3")
# every expert parameter a style distributes (an absent one is None)
_PARAMS = _WEIGHTS + _BIASES
# the FFN dim F of each weight and of the biases of the up projections: w1/w3 [E, D, F],
# w2 [E, F, D], b1/b3 [E, F]; b2 [E, D] has none (None: whole on every tensor-parallel rank)
_FFN_DIM = {"w1": 2, "w2": 1, "w3": 2, "b1": 1, "b2": None, "b3": 1}
# GroupedExperts.forward(x [T, D], sorted_ids, offs, topk_weights [T, k], topk_ids [T, k]): the
# positions of its inputs (MoE passes all five positionally, as a forward pre-hook sees only
# positional inputs); the plain grouped FFN reads the first four
_X, _TOPK_WEIGHTS, _TOPK_IDS = 0, 3, 4
_FFN_INPUTS = 4


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


def _tensor_parallel_placement(name: str) -> "Shard | Replicate":
    """The placement over ``tp`` of expert parameter ``name``: F sharded, b2 Replicate."""
    dim = _FFN_DIM[name]
    return Replicate() if dim is None else Shard(dim)


def _local_expert_shard(w: Optional[Tensor], ep_degree: int) -> Optional[Tensor]:
    """The local shard of an expert weight (``to_local()`` is differentiable: the gradient of
    the shard lands on the DTensor parameter), its gradient averaged over the ``ep_degree``
    ranks.

    The dispatcher's backward sums into this shard the gradients from the tokens of all
    ``ep_degree`` ranks of the group, which are data-parallel ranks: ``ep_degree`` times their
    mean. A data-parallel wrapper averages the expert gradients only over the ranks that hold
    the same experts (FSDP over ``edp``), the plain parameters over ``edp x ep``; the factor
    ``1 / ep_degree`` makes both the mean over every data-parallel rank's tokens.
    """
    if w is None:
        return None
    w = w.to_local() if isinstance(w, DTensor) else w
    return w if ep_degree == 1 else _ScaleGradient.apply(w, 1.0 / ep_degree)


def _submesh(mesh: DeviceMesh, dim: int) -> DeviceMesh:
    """The 1-D mesh of dim ``dim`` of ``mesh`` through this rank."""
    names = mesh.mesh_dim_names
    if names is not None:
        return mesh[names[dim]]
    return DeviceMesh.from_group(mesh.get_group(dim), mesh.device_type)


def _copy_to_tensor_parallel(t: Tensor, tp_mesh: DeviceMesh, use_local_output: bool) -> Tensor:
    """An input of the experts, the same on every rank of ``tp_mesh``, replicated over it with
    its gradient summed over it.

    The tokens ``x`` and the routing weights are the same on every ``tp`` rank, and each rank
    uses them with its own slice of F: the gradient of each is the sum of the ranks' shares. As
    DTensors (``use_local_output=False``: the experts run on DTensors) they are ``Replicate``
    and the sharding strategies make their gradients ``Partial``; as local tensors they say so
    with ``grad_placements``. Either way the backward of ``from_local`` reduces the gradient to
    ``Replicate``: an all-reduce with functional collectives. (The token sort, an index map
    without gradient, takes the same way as a DTensor.)
    """
    t = DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False)
    return t.to_local(grad_placements=[Partial()]) if use_local_output else t


def _reduce_from_tensor_parallel(y: Tensor, tp_mesh: DeviceMesh) -> Tensor:
    """The experts' output ``y [T, D]``, a partial sum over the F shards of ``tp_mesh`` (a
    ``Partial`` DTensor, or its local tensor), summed over it: a functional all-reduce. The sum
    is replicated, so the gradient of every rank's partial output is the gradient of the sum,
    unchanged.

    The result is copied out of ``to_local()``'s view: the experts' output must be a tensor of
    its own, because ``fully_shard`` registers its pre-backward hook on it and an in-place op on
    a view (``y += shared(x)``) would drop that hook. The copy waits for the all-reduce here,
    so it does not overlap the shared experts."""
    if not isinstance(y, DTensor):
        y = DTensor.from_local(y, tp_mesh, [Partial()], run_check=False)
    return y.redistribute(tp_mesh, [Replicate()]).to_local().clone()


def _check_divides(name: str, what: str, size: int, mesh_what: str, degree: int) -> None:
    if size % degree != 0:
        raise ValueError(
            f"{name}: expected {what} ({size}) to be divisible by the {mesh_what} degree "
            f"({degree})"
        )


def _check_dispatch_options(name: str, options: dict) -> dict:
    # checked here, not at the first forward: the accepted keywords follow the dispatcher
    if not isinstance(options, dict):
        raise ValueError(f"{name}: expected dispatch_options to be a dict of keyword arguments, "
                         f"but got {type(options).__name__}")
    accepted = {
        p.name for p in inspect.signature(expert_parallel_moe_ffn).parameters.values()
        if p.kind == inspect.Parameter.KEYWORD_ONLY
    } - {"num_experts", "group", "activation", "alpha", "limit"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"{name}: unknown dispatch_options {unknown}; expert_parallel_moe_ffn accepts "
            f"{sorted(accepted)}"
        )
    return dict(options)


def _check_config(name: str, c) -> None:
    """What the styles do not support in the experts' :class:`~torch_moe.nn.MoEConfig`."""
    if c.precision != "bf16":
        raise NotImplementedError(
            f"{name}: expected precision='bf16' (plain expert GEMMs in the weights' dtype), "
            f"but got precision={c.precision!r}"
        )
    if c.capacity_factor is not None:
        raise NotImplementedError(
            f"{name}: parallelized experts are dropless: expected capacity_factor=None, but "
            f"got {c.capacity_factor} (the dispatcher's own capacity, per pair of ranks, is "
            "a dispatch option of the expert-parallel styles)"
        )


def _refuse_fused_gate_up(name: str, c) -> None:
    if c.fused_gate_up:
        raise NotImplementedError(
            f"{name}: fused_gate_up=True is not supported: the fused w1 [E, D, 2F] holds the "
            "gate and up projections side by side, and sharding its last dim would give a "
            "rank gate columns only; use fused_gate_up=False (separate w1 and w3)"
        )


class _ExpertStyle(ParallelStyle):
    """What the expert styles share: the checks at parallelize time, the partition of the
    weights and :func:`~torch.distributed.tensor.distribute_module` with the style's input and
    output functions. A style names its mesh rank, its placements and its hooks."""

    _mesh_ndim: int = 1

    def _placements(self, name: str) -> list:
        raise NotImplementedError

    def _check_sizes(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        raise NotImplementedError

    def _check_features(self, experts: GroupedExperts) -> None:
        """Raises for what of the experts' config this style does not compute exactly."""

    def _input_fn(self, mesh: DeviceMesh):
        """``input_fn`` of :func:`distribute_module`, or None."""
        return None

    def _output_fn(self, mesh: DeviceMesh):
        """``output_fn`` of :func:`distribute_module`, or None."""
        return None

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not isinstance(module, GroupedExperts):
            return
        for w in _PARAMS:
            param = getattr(module, w, None)
            if param is None:
                continue
            dparam = distribute_tensor(param, device_mesh, self._placements(w),
                                       src_data_rank=self.src_data_rank)
            module.register_parameter(w, nn.Parameter(dparam, requires_grad=param.requires_grad))

    def _distribute(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        distribute_module(experts, mesh, self._partition_fn, self._input_fn(mesh),
                          self._output_fn(mesh))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        experts = self._experts_of(module)
        self._check(experts, device_mesh)
        self._distribute(experts, device_mesh)
        return module

    def _experts_of(self, module: nn.Module) -> GroupedExperts:
        if isinstance(module, MoE):
            return module.experts
        if isinstance(module, GroupedExperts):
            return module
        raise ValueError(f"{type(self).__name__}: expected a torch_moe MoE or GroupedExperts "
                         f"module, but got {type(module).__name__}")

    def _check(self, experts: GroupedExperts, device_mesh: DeviceMesh) -> None:
        name = type(self).__name__
        if any(isinstance(p, DTensor) for p in experts.parameters()):
            raise ValueError(
                f"{name}: the experts are already parallelized (their weights are DTensors); "
                "parallelize a module once"
            )
        if device_mesh.ndim != self._mesh_ndim:
            raise ValueError(
                f"{name}: expected a {self._mesh_ndim}-D device mesh, but got a "
                f"{device_mesh.ndim}-D mesh of shape {tuple(device_mesh.shape)}"
            )
        _check_config(name, experts.config)
        self._check_features(experts)
        self._check_sizes(experts, device_mesh)

    def __repr__(self) -> str:
        options = getattr(self, "dispatch_options", None)
        return f"{type(self).__name__}({'' if options is None else f'dispatch_options={options}'})"


def _route_to_slots(topk_ids: Tensor, placement: Placement) -> Tensor:
    """The physical slots ``[T, k]`` of the router's logical ``topk_ids [T, k]``
    (:func:`~torch_moe.distributed.placement.route_to_replicas`).

    An id outside ``[0, E)`` becomes ``P``, outside the dispatcher's range: the dispatcher's
    header then reports it on every rank, where ``route_to_replicas`` would raise on this rank
    alone and leave the others waiting in the exchange. Ids that are not a ``[T, k]`` integer
    tensor are passed on as they are, to the dispatcher's checks, for the same reason."""
    if not (isinstance(topk_ids, Tensor) and topk_ids.dim() == 2
            and topk_ids.dtype in (torch.int32, torch.int64)):
        return topk_ids
    valid = (topk_ids >= 0) & (topk_ids < placement.num_logical)
    slots = route_to_replicas(torch.where(valid, topk_ids, 0), placement)
    return torch.where(valid, slots, placement.num_physical)


class _PendingCall(NamedTuple):
    """One forward of expert-parallel experts between its input function and its end."""

    params: dict  # name -> the DTensor parameter whose local shard the forward computes on
    dispatched: Optional[_Dispatched]  # the tokens on their way (None until dispatched)
    ids_MW: Optional[Tensor]  # [M, W] the local expert ids of the received rows
    load_G: Optional[Tensor]  # [G] the assignments each local expert computes


class _ExpertParallelHooks:
    """The forward hooks of one module's expert-parallel experts, over the ``ep`` group of mesh
    dim 0 (and the ``tp`` mesh of dim 1 for :class:`ExpertTensorParallel`).

    * :meth:`input_fn` (``input_fn`` of :func:`distribute_module`, a forward pre-hook): takes
      ``(x [T, D], sorted_ids, offs, topk_weights [T, k], topk_ids [T, k])`` (the local sort is
      not used: tokens go by the router's ids; with replicas, the ids are mapped to physical
      slots first, :func:`_route_to_slots`), swaps the registered DTensor weights for their
      local shards (:func:`_local_expert_shard`), plans the rows, exchanges the header and the
      rows with the ``ep`` group and returns the inputs of the local experts: ``(rows [M, D],
      sorted_ids, offs [G], weights [M, W])``, the received rows sorted by local expert;
    * the experts' ``forward``, the plain grouped FFN, computes the ``G`` local experts on them;
    * :meth:`output_fn` (``output_fn``, a forward hook): sends every row's weighted expert sum
      back to its token's rank and adds them up: ``y [T, D]``;
    * :meth:`restore` (a forward hook that runs even when the forward raises): puts the DTensor
      parameters back, as FSDP2 swaps its unsharded parameters in and out around a forward.

    What a forward has in flight between its hooks is kept here, per thread (threads may be the
    ranks of one process), not on the module.
    """

    def __init__(self, style: "_DispatchingStyle", mesh: DeviceMesh):
        self.name = type(style).__name__
        self.options = dict(style.dispatch_options)  # checked at parallelize time
        self.ep_group = mesh.get_group(0)
        self.ep_degree = mesh.size(0)
        self.tp_mesh = _submesh(mesh, 1) if mesh.ndim == 2 else None
        self._calls = threading.local()

    def input_fn(self, module: GroupedExperts, inputs: tuple, device_mesh: DeviceMesh) -> tuple:
        if len(inputs) <= _TOPK_IDS or inputs[_TOPK_IDS] is None:
            raise ValueError(
                f"{self.name}: these experts are parallelized and route tokens themselves: "
                "expected topk_ids, but got None (the router's ids are the fifth positional "
                "input of GroupedExperts.forward, which MoE passes)")
        c = module.config
        _check_config(self.name, c)  # the config may have changed since parallelize time
        x, topk_weights, topk_ids = inputs[_X], inputs[_TOPK_WEIGHTS], inputs[_TOPK_IDS]
        num_experts = c.num_experts
        layout = _layout(module)
        if layout is not None:
            topk_ids = _route_to_slots(topk_ids, layout.placement)
            num_experts = layout.placement.num_physical
        if self.tp_mesh is not None:
            x = _copy_to_tensor_parallel(x, self.tp_mesh, True)
            topk_weights = _copy_to_tensor_parallel(topk_weights, self.tp_mesh, True)
        # A call whose hooks a KeyboardInterrupt (or another BaseException, which skips
        # always-called forward hooks) cut short left its local shards in place: put the
        # DTensor parameters back before reading them again.
        self.restore(module)
        call = _PendingCall({n: module._parameters[n] for n in _PARAMS
                             if module._parameters.get(n) is not None}, None, None, None)
        for name, param in call.params.items():
            local = _local_expert_shard(param, self.ep_degree)
            if name == "b2" and self.tp_mesh is not None:
                # added after the down projection, a partial sum over tp: a share per rank
                # (b2 / tp, exact for a power-of-two tp), whose gradient is the whole one
                local = share_of_replicated(local, self.tp_mesh.size())
            module._parameters[name] = local
        self._calls.pending = call
        try:
            w1, w2, w3 = (module._parameters.get(n) for n in _WEIGHTS)
            dispatched = _dispatch_tokens(
                x.to(w1.dtype), topk_ids, topk_weights, w1, w2, w3,
                num_experts=num_experts, group=self.ep_group, activation=c.activation,
                alpha=c.swiglu_alpha, limit=c.swiglu_limit, **self.options)
            call = self._calls.pending = call._replace(dispatched=dispatched)
            rows, ids, weights = _received_rows(dispatched)
            G = dispatched.layer.G
            # the unused id G of a row's spare pairs sorts past the last local expert: dropped
            # by offs[:G]
            sorted_ids, offs, counts = torch.ops.torch_moe.token_sort(ids, G + 1)
        except BaseException:
            self.restore(module)
            raise
        self._calls.pending = call._replace(ids_MW=ids, load_G=counts[:G])
        return rows, sorted_ids, offs[:G], weights

    def output_fn(self, module: GroupedExperts, out_MD: Tensor, device_mesh: DeviceMesh) -> Tensor:
        call = self._calls.pending
        y = _combine_rows(call.dispatched, out_MD, call.ids_MW, call.load_G)
        # the exchange is consumed: nothing of this call is in flight any more
        self._calls.pending = call._replace(dispatched=None)
        if self.tp_mesh is not None:
            y = _reduce_from_tensor_parallel(y, self.tp_mesh)
        return y

    def restore(self, module: GroupedExperts, inputs=None, output=None) -> None:
        """Puts back the parameters of a pending call, if any, and waits for the exchange of a
        call that did not reach its combine. Also the experts' last forward hook, called even
        when the forward raised an ``Exception``."""
        call = getattr(self._calls, "pending", None)
        if call is None:
            return
        module._parameters.update(call.params)
        self._calls.pending = None
        if call.dispatched is not None:
            # Every rank started this call's exchange: wait for it, so that no collective is
            # left in flight (c10d warns about those at exit).
            for received in call.dispatched.received:
                for t in received:
                    wait_tensor(t)


class _DispatchingStyle(_ExpertStyle):
    """The expert-parallel styles: experts sharded on mesh dim 0 (``ep``), tokens moved to them
    and back in the experts' forward hooks (:class:`_ExpertParallelHooks`), with the steps of
    :func:`~torch_moe.distributed.dispatch.expert_parallel_moe_ffn`.

    The hooks read the parameters at call time: ``fully_shard`` applied to the experts after
    the style registers its hooks in front of the style's pre-hook (all-gather over ``edp``
    first, then the local ``ep`` shard of the gathered weight) and after its hooks.
    """

    def __init__(self, *, dispatch_options: Optional[dict[str, Any]] = None):
        super().__init__()
        self.dispatch_options = _check_dispatch_options(
            type(self).__name__, {} if dispatch_options is None else dispatch_options)

    def _check_sizes(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        what = "expert-parallel" if mesh.ndim == 1 else "expert-parallel (mesh dim 0)"
        _check_divides(type(self).__name__, "num_experts", experts.config.num_experts, what,
                       mesh.size(0))

    def _distribute(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        hooks = _ExpertParallelHooks(self, mesh)
        distribute_module(experts, mesh, self._partition_fn, hooks.input_fn, hooks.output_fn)
        experts.register_forward_hook(hooks.restore, always_call=True)


class ExpertParallel(_DispatchingStyle):
    """Shard the experts on the expert dim over a 1-D expert-parallel mesh.

    Rank ``r`` of the ``R`` ranks holds experts ``r * E / R ... (r + 1) * E / R - 1``: every
    expert weight becomes a ``Shard(0)`` DTensor. In the forward each rank routes its own tokens
    ``x [T, D]`` (T may differ between ranks), sends every (token, expert) assignment to the
    rank of that expert and gets the expert outputs back, with the steps of
    :func:`torch_moe.distributed.dispatch.expert_parallel_moe_ffn` over ``device_mesh``'s
    process group, in the experts' forward hooks (one host synchronisation per layer call;
    every EP rank must call the layer the same number of times). The result and the token
    gradients equal the unsharded layer's on the tokens of all ranks; the expert weight
    gradients are the mean over the ranks' token sets (the unsharded layer's divided by ``R``),
    as data parallelism averages.

    Keyword Args:
        dispatch_options (dict, optional): extra keyword arguments of
            :func:`~torch_moe.distributed.dispatch.expert_parallel_moe_ffn`, passed as given;
            unknown keys raise at parallelize time. They mean what they mean there, with one
            difference in what ``num_chunks`` overlaps: every chunk's rows travel in all-to-alls
            of their own, all of them started before the first is waited for, so the chunks'
            exchanges are in flight together; but the experts' ``forward`` runs between the two
            hooks, on the rows of all chunks at once (one grouped FFN, after the last chunk has
            arrived), and the chunks' results start back after it. Under the style the
            exchanges therefore do not overlap the expert compute, as they do when
            ``expert_parallel_moe_ffn`` is called directly. The results do not depend on
            ``num_chunks``.
        slots_per_rank (int, optional): ``S``, physical expert slots per rank, with
            ``R * S >= E``: the layer keeps ``P = R * S`` physical experts, the ``P - E`` extra
            ones replicas of hot experts (see :mod:`torch_moe.distributed.replicas`). The
            initial placement is ``plan_placement(torch.ones(E), R, S)``.
        placement (Placement, optional): the initial
            :class:`~torch_moe.distributed.placement.Placement` of the ``E`` experts over the
            ``R`` ranks instead (e.g. planned from a measured load, or a checkpoint's).

    With replicas every expert weight is a ``Shard(0)`` DTensor of ``P`` physical slots
    (``w1 [P, D, F]``, ...), slot ``p`` on rank ``p // S`` holding logical expert
    ``placement.phys_to_logical[p]``, built from the logical ``[E, ...]`` weights; ``E`` need
    not divide by ``R``. The input function routes every assignment to one replica of its
    expert (:func:`~torch_moe.distributed.placement.route_to_replicas`) and dispatches over the
    ``P`` slots; ``MoE.tokens_per_expert`` counts logical experts. Outputs and token gradients
    are those of the layer without replicas; each replica's weight gradient covers the tokens it
    served, and :func:`~torch_moe.distributed.replicas.reduce_replica_grads_` (once per
    optimizer step) sums them into the expert's gradient, which is then the gradient without
    replicas. :func:`~torch_moe.distributed.replicas.rebalance_experts_` re-plans from the loads.
    Not supported with replicas: the dispatcher's capacity mode (``capacity_factor`` in
    ``dispatch_options``), and sharding the physical weights further (FSDP).

    Example::
        >>> # xdoctest: +SKIP("distributed")
        >>> ep_mesh = init_device_mesh("cuda", (4,), mesh_dim_names=("ep",))
        >>> moe = MoE(MoEConfig(dim=1024, hidden_dim=2048, num_experts=8, top_k=2))
        >>> parallelize_module(moe, ep_mesh, ExpertParallel())  # 2 experts per rank
        >>> y = moe(x)  # x: this rank's tokens [B, L, 1024]
        >>> # 3 slots per rank, 12 for 8 experts: 4 replicas of hot experts
        >>> parallelize_module(moe2, ep_mesh, ExpertParallel(slots_per_rank=3))
    """

    def __init__(self, *, dispatch_options: Optional[dict[str, Any]] = None,
                 slots_per_rank: Optional[int] = None, placement: Optional[Placement] = None):
        super().__init__(dispatch_options=dispatch_options)
        name = type(self).__name__
        if slots_per_rank is not None and (isinstance(slots_per_rank, bool) or not isinstance(
                slots_per_rank, int) or slots_per_rank < 1):
            raise ValueError(f"{name}: expected slots_per_rank to be a positive int or None, "
                             f"but got {slots_per_rank!r}")
        if placement is not None:
            if not isinstance(placement, Placement):
                raise ValueError(f"{name}: expected placement to be a Placement or None, but "
                                 f"got {type(placement).__name__}")
            if slots_per_rank is not None and slots_per_rank != placement.slots_per_rank:
                raise ValueError(f"{name}: slots_per_rank={slots_per_rank} disagrees with the "
                                 f"placement's {placement.slots_per_rank} slots per rank; pass "
                                 "one of them")
        replicated = slots_per_rank is not None or placement is not None
        if replicated and self.dispatch_options.get("capacity_factor") is not None:
            raise NotImplementedError(
                f"{name}: the capacity mode of the dispatcher (dispatch_options "
                "capacity_factor) is not supported with replicas (slots_per_rank / placement)")
        self.slots_per_rank = slots_per_rank
        self.placement = placement

    def _replicated(self) -> bool:
        return self.slots_per_rank is not None or self.placement is not None

    def _check_features(self, experts: GroupedExperts) -> None:
        if self._replicated() and experts.config.ffn_bias:
            raise NotImplementedError(
                f"{type(self).__name__}: expert biases (ffn_bias=True) are not supported with "
                "replicas of hot experts (slots_per_rank / placement): the replica gradient "
                "reduction and rebalancing move the expert weights only"
            )

    def _initial_placement(self, experts: GroupedExperts, mesh: DeviceMesh) -> Placement:
        if self.placement is not None:
            return self.placement
        # no load observed yet: an even load, whose extra slots go to the lowest expert ids
        E = experts.config.num_experts
        return plan_placement(torch.ones(E), mesh.size(0), self.slots_per_rank)

    def _check_sizes(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        if not self._replicated():
            return super()._check_sizes(experts, mesh)
        name, E, R = type(self).__name__, experts.config.num_experts, mesh.size(0)
        if self.placement is not None:
            pl = self.placement
            if pl.num_ranks != R or pl.num_logical != E:
                raise ValueError(f"{name}: expected a placement of the {E} experts over the "
                                 f"{R} ranks of the expert-parallel mesh, but got one of "
                                 f"{pl.num_logical} experts over {pl.num_ranks} ranks")
        elif R * self.slots_per_rank < E:
            raise ValueError(f"{name}: expected slots_per_rank ({self.slots_per_rank}) x the "
                             f"expert-parallel degree ({R}) >= num_experts ({E}), one slot "
                             f"per expert at least, but got {R * self.slots_per_rank} slots")

    def _partition_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        if not (self._replicated() and isinstance(module, GroupedExperts)):
            return super()._partition_fn(name, module, device_mesh)
        placement = self._initial_placement(module, device_mesh)
        for w in _WEIGHTS:
            param = getattr(module, w)
            if param is None:
                continue
            physical = distribute_tensor(_physical_weight(param, placement), device_mesh,
                                         [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(
                w, nn.Parameter(physical, requires_grad=param.requires_grad))
        _register_layout(module, placement, device_mesh)

    def _placements(self, name: str) -> list:
        return [Shard(0)]

    def __repr__(self) -> str:
        args = [f"dispatch_options={self.dispatch_options}"]
        if self.slots_per_rank is not None:
            args.append(f"slots_per_rank={self.slots_per_rank}")
        if self.placement is not None:
            args.append(f"placement=<{self.placement.num_logical} experts in "
                        f"{self.placement.num_physical} slots>")
        return f"{type(self).__name__}({', '.join(args)})"


class ExpertTensorParallel(_DispatchingStyle):
    """Expert parallel on mesh dim 0 (``ep``) with the FFN dim of every expert sharded on mesh
    dim 1 (``tp``): EP x TP on a 2-D mesh, e.g. ``mesh["ep", "tp"]``.

    Placements: w1 and w3 ``[Shard(0), Shard(2)]``, w2 ``[Shard(0), Shard(1)]``. The ranks of
    a ``tp`` group hold the same tokens (the output of tensor-parallel attention is replicated
    over ``tp``) and the same experts, each a slice of F. Every rank dispatches its tokens over
    its ``ep`` group, as in :class:`ExpertParallel`, to F-slices of the experts; the expert
    outputs are then partial sums over F, added up by an all-reduce over ``tp`` (the output
    function). In the backward, the gradients of the tokens and of the routing weights are
    all-reduced over ``tp`` (the input function: each F-slice contributes its share), so the
    router sees the full gradient. Both are functional collectives.

    Keyword Args:
        dispatch_options (dict, optional): as in :class:`ExpertParallel`.
    """

    _mesh_ndim = 2

    def _placements(self, name: str) -> list:
        return [Shard(0), _tensor_parallel_placement(name)]

    def _check_features(self, experts: GroupedExperts) -> None:
        _refuse_fused_gate_up(type(self).__name__, experts.config)

    def _check_sizes(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        super()._check_sizes(experts, mesh)
        _check_divides(type(self).__name__, "hidden_dim", experts.config.hidden_dim,
                       "tensor-parallel (mesh dim 1)", mesh.size(1))


class TensorParallelExperts(_ExpertStyle):
    """Tensor parallel for every expert, without expert parallelism, on a 1-D ``tp`` mesh.

    The name says what is sharded: each expert's FFN, the Megatron way (w1 and w3 column-wise
    ``Shard(2)``, w2 row-wise ``Shard(1)``), all experts on every rank. It is
    :class:`ExpertTensorParallel` with an expert-parallel degree of one, without the all-to-all:
    every rank runs all E experts on all its tokens (the same tokens on every ``tp`` rank)
    with its slice of F. The experts run on DTensors, as ``ColwiseParallel`` and
    ``RowwiseParallel`` run ``nn.Linear``: the input function makes the tokens, their sort and
    routing weights ``Replicate``, the sharding strategy of ``grouped_ffn`` makes the output
    ``Partial``, and the output function sums it over ``tp`` into a local tensor; the gradients
    of the tokens and routing weights are summed over ``tp`` in the backward.
    """

    def _placements(self, name: str) -> list:
        return [_tensor_parallel_placement(name)]

    def _check_features(self, experts: GroupedExperts) -> None:
        _refuse_fused_gate_up(type(self).__name__, experts.config)

    def _check_sizes(self, experts: GroupedExperts, mesh: DeviceMesh) -> None:
        _check_divides(type(self).__name__, "hidden_dim", experts.config.hidden_dim,
                       "tensor-parallel", mesh.size())

    def _input_fn(self, mesh: DeviceMesh):
        def input_fn(mod, inputs, device_mesh):
            # the FFN's inputs (x, sorted_ids, offs, topk_weights) as Replicate DTensors; the
            # router's topk_ids, which the FFN does not read, stay as they are
            return tuple(
                _copy_to_tensor_parallel(t, device_mesh, False)
                if i < _FFN_INPUTS and isinstance(t, Tensor) and not isinstance(t, DTensor)
                else t
                for i, t in enumerate(inputs))

        return input_fn

    def _output_fn(self, mesh: DeviceMesh):
        return lambda mod, y, device_mesh: _reduce_from_tensor_parallel(y, device_mesh)
