"""torchtitan's MoE layer computed by torch_moe.

:class:`TorchtitanMoE` is torchtitan 0.3.0's ``torchtitan.models.common.moe.MoE`` (the MoE layer
of its DeepSeek-V3 and Qwen3-MoE models) with a forward of torch_moe: the router scores in
fp32 and picks its experts with :func:`torch_moe.nn.functional.route`, the tokens are grouped by
``token_sort`` (no host synchronisation) and the routed experts run as one fused
``grouped_ffn``, which gathers and scatters its rows itself and keeps one pre-activation tensor
for backward. It subclasses torchtitan's class and keeps torchtitan's own submodules, buffers
and initialisation, so everything torchtitan knows of the layer still holds:

* parameters and buffers under torchtitan's names (``router.gate.weight``,
  ``routed_experts.inner_experts.w1_EFD`` / ``w2_EDF`` / ``w3_EFD``, ``shared_experts.*``,
  ``expert_bias_E``): the state dict and distributed-checkpoint keys are torchtitan's, and
  checkpoints load either way;
* the load-balancing buffers of torchtitan's trainer: training forwards add the routed
  assignments to ``tokens_per_expert_E`` (fp32), and the optimizer pre-step hook of
  ``torchtitan.components.optimizer.register_moe_load_balancing_hook`` updates
  ``expert_bias_E`` from them with ``load_balance_coeff``, as for torchtitan's layer;
* ``init_states`` / ``to_empty`` (torchtitan's meta-device build), and ``isinstance(m, MoE)``.

Weight layout. torchtitan keeps ``nn.Linear``-style expert weights, the torch_moe op takes the
GEMM layout (``x @ w``); the forward reads transposed views of the weights (of their bf16
casts with bf16 experts, as torchtitan casts), never a transposed copy (shape legend: T tokens,
D model dim, F expert FFN dim, E experts, k experts per token; the expert weights are under
``routed_experts.inner_experts``):

========================  =========  ===============================================
torchtitan parameter      layout     torch_moe operand
========================  =========  ===============================================
``router.gate.weight``    [E, D]     router weight, ``logits = x @ weight^T`` (fp32)
``w1_EFD`` (gate)         [E, F, D]  ``w1 [E, D, F] = w1_EFD.transpose(-2, -1)``
``w3_EFD`` (up)           [E, F, D]  ``w3 [E, D, F] = w3_EFD.transpose(-2, -1)``
``w2_EDF`` (down)         [E, D, F]  ``w2 [E, F, D] = w2_EDF.transpose(-2, -1)``
========================  =========  ===============================================

The shared experts (``FeedForward``) are torchtitan's module, called as it is.

Expert dtype. torchtitan's ``GroupedExperts`` casts tokens and weights to bf16 whatever their
dtype. ``expert_dtype`` (bf16 by default, as torchtitan) is the dtype of the expert GEMMs here;
``None`` computes them in the weights' own dtype (fp32 weights: fp32 experts). Routing weights
and the router stay fp32; the output has the input's dtype.

Three ways in:

* :func:`swap_torchtitan_moe` / :func:`from_torchtitan_moe`: swap the layers of a built model
  (or one layer) in place, before it is parallelized; the new layers hold the same parameter
  and buffer tensors, so an optimizer already built keeps working.
* torchtitan's config-override registry (``torchtitan.config.override``; torchtitan 0.3.0 has
  no named model-converter registry): ``import torch_moe`` registers the factory
  :func:`torch_moe` for every ``MoE.Config`` node of torchtitan's common MoE (exactly that
  class), activated with ``--override.imports torch_moe.nn._torchtitan.torch_moe``, or
  ``'torch_moe.nn._torchtitan.torch_moe={"expert_dtype": "float32"}'`` to pass arguments.
* torchtitan's ``ModelConfigConverter`` protocol: ``TorchMoEConverter.Config()`` in the
  ``converters=`` list of a model registry (``model_registry(flavor, converters=[...])``).

The last two replace the model config before the build, so the trainer builds
:class:`TorchtitanMoE` layers directly (on the meta device, initialised by ``init_states``).

Not supported (a clear error, not a silent difference): subclasses of torchtitan's MoE or of its
router and grouped experts (gpt-oss's layer, the float8 / MXFP8 grouped experts of torchtitan's
quantization converters), ``_debug_force_load_balance``, and expert or tensor parallelism of the
experts (DTensor expert weights, an expert-parallel token dispatcher). FSDP and data
parallelism hand the forward plain weights and are not rejected. torchtitan is imported only
by the functions here, never by ``import torch_moe``; ``TorchtitanMoE`` and
``TorchMoEConverter`` are made on first access.
"""

import functools
import sys
import types
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn, Tensor

from torch_moe._import_hook import call_after_import
from torch_moe.nn import functional as F_moe

__all__ = [
    "from_torchtitan_moe",
    "swap_torchtitan_moe",
    "install_torchtitan_converter",
    "torch_moe",
]
# and, made on first access (they subclass torchtitan's classes): TorchtitanMoE, TorchMoEConverter

_TT_MOE_MODULE = "torchtitan.models.common.moe"
# torchtitan's config dtype names (its TORCH_DTYPE_MAP), for ``expert_dtype`` in configs
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the hooks a swap cannot carry over from the torchtitan module it replaces
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def __getattr__(name: str):
    # The classes subclass torchtitan's: they exist once torchtitan is imported, on first use.
    if name in ("TorchtitanMoE", "TorchMoEConverter"):
        return getattr(_classes(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dtype_from_name(fn: str, name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in _DTYPE_NAMES:
        raise ValueError(f"{fn}: expected expert_dtype in {tuple(_DTYPE_NAMES)} or None, but got "
                         f"{name!r}")
    return _DTYPE_NAMES[name]


def _check_expert_dtype(fn: str, dtype) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{fn}: expected expert_dtype to be a floating-point torch.dtype or None, "
                        f"but got {dtype!r}")


@functools.cache
def _classes() -> types.SimpleNamespace:
    """Defines the classes that subclass torchtitan's (imports torchtitan)."""
    from torch.distributed.tensor import DTensor
    from torchtitan.config import derive
    from torchtitan.models.common.moe import GroupedExperts, MoE, TokenChoiceTopKRouter
    from torchtitan.protocols.model import ModelConfigConverter

    class TorchtitanMoE(MoE):
        """torchtitan's ``MoE`` whose forward is torch_moe's (see the module docstring).

        ``forward(x [B, L, D]) -> [B, L, D]``, as torchtitan's. Built from its config
        (``TorchtitanMoE.Config``: torchtitan's ``MoE.Config`` and ``expert_dtype``, the name of
        the expert GEMMs' dtype or None), or from a built torchtitan layer by
        :func:`from_torchtitan_moe`. ``expert_dtype`` (attribute) is a ``torch.dtype`` or None.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(MoE.Config):
            expert_dtype: Optional[str] = "bfloat16"

        def __init__(self, config: "TorchtitanMoE.Config"):
            super().__init__(config)
            self._check_torchtitan_layer("TorchtitanMoE")
            self.expert_dtype = _dtype_from_name("TorchtitanMoE", config.expert_dtype)

        @classmethod
        def _adopt(cls, tt_moe: MoE, expert_dtype: Optional[torch.dtype]) -> "TorchtitanMoE":
            """A layer holding ``tt_moe``'s submodules and buffers (the same objects), and the
            attributes torchtitan's ``MoE.__init__`` and ``Config.build`` set."""
            moe = cls.__new__(cls)
            nn.Module.__init__(moe)
            # in torchtitan's order, which is the order of the state dict keys
            moe.routed_experts = tt_moe.routed_experts
            moe.router = tt_moe.router
            moe.shared_experts = tt_moe.shared_experts
            moe.load_balance_coeff = tt_moe.load_balance_coeff
            if tt_moe.expert_bias_E is None:
                moe.expert_bias_E = None
            else:
                moe.register_buffer("expert_bias_E", tt_moe.expert_bias_E, persistent=True)
            moe.register_buffer("tokens_per_expert_E", tt_moe.tokens_per_expert_E,
                                persistent=False)
            for name in ("_param_init", "_sharding_config"):
                if name in vars(tt_moe):
                    setattr(moe, name, getattr(tt_moe, name))
            moe.train(tt_moe.training)
            moe._check_torchtitan_layer("from_torchtitan_moe")
            moe.expert_dtype = expert_dtype
            return moe

        def _check_torchtitan_layer(self, fn: str) -> None:
            """Rejects the torchtitan features this forward does not compute."""
            router, experts = self.router, self.routed_experts.inner_experts
            for what, module, cls_ in (("router", router, TokenChoiceTopKRouter),
                                       ("routed_experts.inner_experts", experts, GroupedExperts)):
                if type(module) is not cls_:
                    raise ValueError(
                        f"{fn}: expected {what} to be torchtitan's {cls_.__name__}, but got "
                        f"{type(module).__name__}; its subclasses (e.g. float8 / MXFP8 grouped "
                        "experts) compute differently and are not supported")
            gate = router.gate
            if not isinstance(gate, nn.Linear) or type(gate).forward is not nn.Linear.forward:
                raise ValueError(f"{fn}: expected router.gate to be a plain linear layer, but got "
                                 f"{type(gate).__name__}")
            if router._debug_force_load_balance:
                raise ValueError(f"{fn}: the router's _debug_force_load_balance (round-robin "
                                 "routing) is not supported")
            if router.score_func not in ("softmax", "sigmoid"):
                raise ValueError(f"{fn}: expected the router's score_func 'softmax' or 'sigmoid', "
                                 f"but got {router.score_func!r}")
            n = router.num_expert_groups
            if n is not None:
                # torchtitan's own conditions (which it checks in forward), said at build time
                E, m = router.num_experts, router.num_limited_groups
                if m is None or E % n or E // n < 2:
                    raise ValueError(
                        f"{fn}: group-limited routing needs num_limited_groups and "
                        f"num_expert_groups dividing num_experts into groups of at least 2, but "
                        f"got num_experts={E}, num_expert_groups={n}, num_limited_groups={m}")

        def _check_local(self, x: Tensor) -> None:
            experts = self.routed_experts.inner_experts
            dispatcher = self.routed_experts.token_dispatcher
            sharded = [name for name, t in (("x", x), ("w1_EFD", experts.w1_EFD),
                                            ("w2_EDF", experts.w2_EDF), ("w3_EFD", experts.w3_EFD),
                                            ("router.gate.weight", self.router.gate.weight))
                       if isinstance(t, DTensor)]
            if sharded or getattr(dispatcher, "ep_mesh", None) is not None:
                raise NotImplementedError(
                    "TorchtitanMoE: expert and tensor parallelism of torchtitan are not supported "
                    f"(DTensor {', '.join(sharded) or 'none'}; expert-parallel dispatcher: "
                    f"{getattr(dispatcher, 'ep_mesh', None) is not None}); FSDP and data "
                    "parallelism are")

        def forward(self, x_BLD: Tensor) -> Tensor:
            """``y [B, L, D]`` of ``x [B, L, D]``: shared experts plus the routed experts'
            outputs weighted by the router; counts the routed assignments in training."""
            self._check_local(x_BLD)
            router, experts = self.router, self.routed_experts.inner_experts
            if x_BLD.dim() != 3 or x_BLD.size(-1) != router.gate.in_features:
                raise ValueError(f"TorchtitanMoE: expected input [B, L, {router.gate.in_features}]"
                                 f", but got {tuple(x_BLD.shape)}")
            B, L, D = x_BLD.shape
            x_TD = x_BLD.reshape(B * L, D)
            gate = router.gate
            # fp32 router logits, as torchtitan's (its gate runs under an fp32 autocast)
            logits_TE = F.linear(x_TD.float(), gate.weight.float(),
                                 None if gate.bias is None else gate.bias.float())
            topk_ids_TK, topk_weights_TK, _ = F_moe.route(
                logits_TE, router.top_k, score_func=router.score_func,
                expert_bias=self.expert_bias_E, num_groups=router.num_expert_groups,
                topk_groups=router.num_limited_groups, normalize=router.route_norm,
                scale=router.route_scale,
            )
            sorted_ids_S, offs_E, counts_E = torch.ops.torch_moe.token_sort(
                topk_ids_TK, router.num_experts)
            if self.training:
                # read by torchtitan's optimizer pre-step hook, which updates expert_bias_E
                with torch.no_grad():
                    self.tokens_per_expert_E.add_(counts_E)
            dtype = experts.w1_EFD.dtype if self.expert_dtype is None else self.expert_dtype
            # nn.Linear-style [E, out, in] weights as GEMM-layout views [E, in, out]
            w1_EDF = experts.w1_EFD.to(dtype).transpose(-2, -1)
            w3_EDF = experts.w3_EFD.to(dtype).transpose(-2, -1)
            w2_EFD = experts.w2_EDF.to(dtype).transpose(-2, -1)
            routed_TD, _ = torch.ops.torch_moe.grouped_ffn(
                x_TD.to(dtype), sorted_ids_S, offs_E, topk_weights_TK, w1_EDF, w2_EFD, w3_EDF)
            out_BLD = routed_TD.to(x_BLD.dtype).view(B, L, D)
            if self.shared_experts is not None:
                out_BLD = out_BLD + self.shared_experts(x_BLD)
            return out_BLD

    class TorchMoEConverter(ModelConfigConverter):
        """torchtitan ``ModelConfigConverter``: every ``MoE.Config`` of torchtitan's common MoE
        in the model config becomes a ``TorchtitanMoE.Config`` (with ``expert_dtype``)."""

        @dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            expert_dtype: Optional[str] = "bfloat16"

        def __init__(self, config: "TorchMoEConverter.Config"):
            _dtype_from_name("TorchMoEConverter", config.expert_dtype)
            self.config = config

        def convert(self, model_config):
            for fqn, cfg, parent, attr in list(model_config.traverse(MoE.Config)):
                if type(cfg) is TorchtitanMoE.Config:
                    continue
                if type(cfg) is not MoE.Config:
                    raise ValueError(
                        f"TorchMoEConverter: {fqn or 'the model config'} is a "
                        f"{type(cfg).__qualname__}, a subclass of torchtitan's MoE.Config that "
                        "torch_moe does not compute")
                new = derive(cfg, TorchtitanMoE.Config, expert_dtype=self.config.expert_dtype)
                if parent is None:
                    model_config = new
                elif isinstance(parent, list):
                    parent[attr] = new
                else:
                    setattr(parent, attr, new)
            return model_config

    # found by pickle and by ``__getattr__`` of this module under these names
    for cls, name in ((TorchtitanMoE, "TorchtitanMoE"), (TorchMoEConverter, "TorchMoEConverter")):
        cls.__qualname__ = name
        cls.Config.__qualname__ = f"{name}.Config"
    return types.SimpleNamespace(TorchtitanMoE=TorchtitanMoE, TorchMoEConverter=TorchMoEConverter,
                                 MoE=MoE, DTensor=DTensor)


def _is_torchtitan_moe(module) -> bool:
    # A torchtitan MoE exists only once its module is imported; checking sys.modules first keeps
    # torchtitan unimported for everyone else.
    return _TT_MOE_MODULE in sys.modules and isinstance(module, sys.modules[_TT_MOE_MODULE].MoE)


def from_torchtitan_moe(tt_moe: nn.Module, *,
                        expert_dtype: Optional[torch.dtype] = torch.bfloat16) -> nn.Module:
    """A :class:`TorchtitanMoE` that stands in for the torchtitan layer ``tt_moe``.

    It holds ``tt_moe``'s submodules and buffers themselves (router, routed and shared experts,
    ``expert_bias_E``, ``tokens_per_expert_E``), so the parameters are shared with ``tt_moe``
    and keep their names, layouts and optimizer state; ``tt_moe`` itself is left unchanged.
    Its forward computes what torchtitan's does, on torch_moe (see the module docstring).

    Args:
        tt_moe: a ``torchtitan.models.common.moe.MoE`` (exactly that class), not parallelized
            and without module hooks.
        expert_dtype: dtype of the expert GEMMs; bf16 (the default) is torchtitan's, None
            computes them in the expert weights' dtype.

    Raises:
        TypeError: ``tt_moe`` is not a torchtitan MoE, is already a :class:`TorchtitanMoE`, or
            ``expert_dtype`` is not a floating-point dtype.
        ValueError: a torchtitan feature torch_moe does not compute (see the module docstring),
            or ``tt_moe`` was parallelized or has hooks (swap before ``parallelize``).
    """
    fn = "from_torchtitan_moe"
    _check_expert_dtype(fn, expert_dtype)
    if not _is_torchtitan_moe(tt_moe):
        raise TypeError(f"{fn}: expected a torchtitan MoE (torchtitan.models.common.moe.MoE), but "
                        f"got {type(tt_moe).__name__}")
    ns = _classes()
    if isinstance(tt_moe, ns.TorchtitanMoE):
        raise TypeError(f"{fn}: the layer is already a TorchtitanMoE (computed by torch_moe)")
    if type(tt_moe) is not ns.MoE:
        raise ValueError(f"{fn}: expected torchtitan's MoE itself, but got its subclass "
                         f"{type(tt_moe).__name__}, which computes differently")
    sharded = [name for name, t in (*tt_moe.named_parameters(), *tt_moe.named_buffers())
               if isinstance(t, ns.DTensor)]
    if getattr(tt_moe, "_parallelized", False) or "forward" in vars(tt_moe) or sharded:
        raise ValueError(f"{fn}: the layer is already parallelized (DTensor {sharded or 'none'}); "
                         "swap it before parallelizing the model (FSDP, TP, EP)")
    hooks = [name for name in _HOOK_DICTS if getattr(tt_moe, name, None)]
    if hooks:
        raise ValueError(f"{fn}: the layer has module hooks ({', '.join(hooks)}), which the "
                         "swapped layer would not have; swap it before registering them")
    return ns.TorchtitanMoE._adopt(tt_moe, expert_dtype)


def swap_torchtitan_moe(model: nn.Module, **overrides) -> list[str]:
    """Replaces every torchtitan MoE layer of ``model`` by :func:`from_torchtitan_moe` of it, in
    place, and returns the names of the replaced modules (in ``named_modules`` order; a layer
    reachable under several names is replaced under each, by one new module).

    ``overrides`` are passed to :func:`from_torchtitan_moe` (``expert_dtype``). Layers that are
    already :class:`TorchtitanMoE` are left alone; a model without torchtitan MoE layers is
    unchanged (``[]``). Every layer is converted before any is replaced: on error ``model`` is
    unchanged.
    """
    fn = "swap_torchtitan_moe"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: expected an nn.Module, but got {type(model).__name__}")
    if _is_torchtitan_moe(model) and not isinstance(model, _classes().TorchtitanMoE):
        raise ValueError(f"{fn}: the model is itself a torchtitan MoE, which has no parent to be "
                         "replaced in; use from_torchtitan_moe(model)")
    found = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
             if _is_torchtitan_moe(m) and not isinstance(m, _classes().TorchtitanMoE)]
    swapped: dict[int, nn.Module] = {}
    for _, m in found:
        if id(m) not in swapped:
            swapped[id(m)] = from_torchtitan_moe(m, **overrides)
    for name, m in found:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, swapped[id(m)])
    return [name for name, _ in found]


def torch_moe(cfg, *, expert_dtype: Optional[str] = "bfloat16"):
    """torchtitan config-override factory: ``cfg`` (torchtitan's ``MoE.Config``) as a
    ``TorchtitanMoE.Config`` with ``expert_dtype`` (``"bfloat16"``, ``"float16"``,
    ``"float32"`` or None: the expert weights' dtype). Registered by
    :func:`install_torchtitan_converter` as ``torch_moe.nn._torchtitan.torch_moe``."""
    from torchtitan.config import derive

    _dtype_from_name("torch_moe", expert_dtype)
    return derive(cfg, _classes().TorchtitanMoE.Config, expert_dtype=expert_dtype)


def _register_override() -> None:
    import importlib

    override_module = importlib.import_module("torchtitan.config.override")
    moe_module = sys.modules[_TT_MOE_MODULE]
    # torchtitan keys its registry by the factory's import path and refuses a second entry
    if f"{torch_moe.__module__}.{torch_moe.__name__}" in override_module._REGISTRY:
        return
    override_module.override(
        target=moe_module.MoE.Config, exact=True,
        description="torchtitan's MoE computed by torch_moe (router, token sort, fused experts)",
    )(torch_moe)


def install_torchtitan_converter() -> None:
    """Registers :func:`torch_moe` in torchtitan's config-override registry: now if torchtitan's
    MoE module is imported, else right after its first import (``import torch_moe`` calls this;
    torchtitan is never imported for it). Calling it again registers the factory again if the
    registry was cleared."""
    call_after_import(_TT_MOE_MODULE, _register_override)
