"""The Mixture-of-Experts layer: ``MoE = TopKRouter + GroupedExperts (+ SharedExperts)``.

Shape legend: B batch, L sequence length, T = B * L tokens, D model dim, F expert FFN dim,
E experts, k experts per token.

Weight layout (GEMM layout, ``x @ w``; an ``nn.Linear`` stores the transpose):

    router.weight     [E, D]    logits = x @ router.weight^T      (nn.Linear layout)
    router.bias       [E]       with ``router_bias`` (gpt-oss)
    router.expert_bias [E]      buffer, aux-loss-free balancing (selection only)
    experts.w1        [E, D, F] gate projection; [E, D, 2F] gate and up with ``fused_gate_up``
    experts.w3        [E, D, F] up projection    (gated activations without ``fused_gate_up``)
    experts.w2        [E, F, D] down projection
    experts.b1/b3/b2  [E, F] / [E, F] / [E, D]   with ``ffn_bias`` (b1 [E, 2F] when fused)
    shared.w1/w3      [D, Fs], shared.w2 [Fs, D], shared.gate [1, D] (optional)
"""

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn, Tensor

from torch_moe._checks import ACTIVATIONS, GATED_ACTIVATIONS
from torch_moe.nn import _checks as C
from torch_moe.nn._hf_config import moe_config_kwargs_from_hf
from torch_moe.nn import functional as F_moe
from torch_moe.nn._subclass_hooks import subclass_handlers
from torch_moe.quantization import BLOCK_SIZE, PRECISIONS, SCALE_MODES
from torch_moe.quantization.ffn import group_alignment, quantized_expert_ffn

__all__ = ["MoEConfig", "TopKRouter", "GroupedExperts", "SharedExperts", "MoE"]


@dataclass
class MoEConfig:
    """Configuration of an :class:`MoE` layer.

    Attributes:
        dim: model dim D.
        hidden_dim: FFN dim F of each routed expert.
        num_experts: number of routed experts E.
        top_k: experts per token k.
        score_func: ``"softmax"`` or ``"sigmoid"``; scores are computed in fp32 whatever the
            input dtype.
        topk_before_score: pick the top-k logits, then score those k (Mixtral, gpt-oss); else
            score all experts, then pick the top-k scores (Qwen3-MoE, DeepSeek).
        normalize_topk: renormalise the k routing weights to sum to one.
        route_scale: multiply the routing weights by this (DeepSeek-V3: 2.5).
        num_expert_groups: group-limited routing: E experts in this many equal groups (n).
        topk_groups: tokens use experts of their best ``topk_groups`` groups only (m <= n).
        load_balance_bias: keep an expert bias that changes which experts are picked, not the
            weights (aux-loss-free balancing); :meth:`MoE.update_expert_bias` adjusts it.
        bias_update_rate: step of the sign rule of :meth:`MoE.update_expert_bias`.
        load_balance_coeff: weight of the Switch/GShard load-balancing loss (0 disables it).
        seq_balance_coeff: weight of DeepSeek-V3's sequence-wise balance loss (0 disables it);
            sequences are the rows of a ``[B, L, D]`` input.
        z_loss_coeff: weight of the router z-loss (0 disables it).
        capacity_factor: ``None`` is dropless; a number c caps each expert at
            ``ceil(c * T * k / E)`` assignments and drops the lowest-weighted ones beyond.
        num_shared_experts: shared (always-on) experts, fused into one FFN of width
            ``num_shared_experts * shared_hidden_dim``.
        shared_hidden_dim: FFN dim of one shared expert, >= 1; ``None`` (the default) means
            ``hidden_dim``. A layer without shared experts has ``num_shared_experts=0``.
        shared_expert_gate: scale the shared output by ``sigmoid(x @ gate)`` (Qwen2-MoE).
        activation: ``"swiglu"``, ``"geglu"``, ``"swiglu_oai"``, ``"gelu"`` or ``"relu"``.
        swiglu_alpha, swiglu_limit: constants of ``"swiglu_oai"`` (gpt-oss: 1.702, 7.0).
        router_bias: the router linear has a bias (gpt-oss).
        router_dtype: dtype the router's weight and bias keep whatever dtype the module is
            converted to (``module.to(torch.bfloat16)``): DeepSeek-V3 checkpoints keep the router
            in fp32 inside a bf16 model. ``None`` (the default) lets them follow the module.
        fused_gate_up: store the gate and up projections of the routed experts as one weight
            ``experts.w1 [E, D, 2F]`` (gate in ``[..., :F]``, up in ``[..., F:]``) and no
            ``experts.w3``, as transformers 5 keeps them (``experts.gate_up_proj``); the
            expert GEMMs then read one weight. Gated activations only.
        ffn_bias: the routed experts' projections have biases ``experts.b1 [E, F]`` (``[E, 2F]``
            with ``fused_gate_up``), ``experts.b3 [E, F]`` and ``experts.b2 [E, D]`` (gpt-oss);
            the routing weight scales the down projection's bias with its output.
        precision: expert GEMMs in ``"bf16"`` (the parameters' dtype, no quantization),
            ``"fp8_rowwise"`` or ``"mxfp8"`` (E4M3 operands quantized on the fly, forward and
            backward; see :func:`torch_moe.nn.functional.moe_ffn`). Router, shared experts and
            combine stay in high precision. Set per layer.
        quant_scale_mode: MXFP8 scale rule, ``"rceil"`` (default) or ``"floor"``.
        wgrad_high_precision: compute the expert weight gradients in high precision.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    topk_before_score: bool = False
    normalize_topk: bool = False
    route_scale: float = 1.0
    num_expert_groups: Optional[int] = None
    topk_groups: Optional[int] = None
    load_balance_bias: bool = False
    bias_update_rate: float = 1e-3
    load_balance_coeff: float = 0.0
    seq_balance_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: Optional[float] = None
    num_shared_experts: int = 0
    shared_hidden_dim: Optional[int] = None
    shared_expert_gate: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    router_bias: bool = False
    router_dtype: Optional[torch.dtype] = None
    fused_gate_up: bool = False
    ffn_bias: bool = False
    precision: str = "bf16"
    quant_scale_mode: str = "rceil"
    wgrad_high_precision: bool = False

    def __post_init__(self):
        fn = "MoEConfig"

        def need(cond, msg):
            if not cond:
                raise ValueError(f"{fn}: {msg}")

        C.check_int(fn, "dim", self.dim, 1)
        C.check_int(fn, "hidden_dim", self.hidden_dim, 1)
        C.check_int(fn, "num_experts", self.num_experts, 1, C.MAX_EXPERTS)
        C.check_int(fn, "top_k", self.top_k, 1)
        need(self.top_k <= self.num_experts,
             f"expected top_k <= num_experts, but got top_k={self.top_k} > num_experts={self.num_experts}")
        C.check_int(fn, "num_shared_experts", self.num_shared_experts, 0)
        if self.shared_hidden_dim is not None:
            C.check_int(fn, "shared_hidden_dim", self.shared_hidden_dim)
            need(self.shared_hidden_dim >= 1, "expected shared_hidden_dim >= 1 (or None for "
                 f"hidden_dim), but got {self.shared_hidden_dim}")
        need(self.score_func in ("softmax", "sigmoid"),
             f"expected score_func 'softmax' or 'sigmoid', but got {self.score_func!r}")
        need(self.activation in ACTIVATIONS,
             f"expected activation in {ACTIVATIONS}, but got {self.activation!r}")
        C.check_real(fn, "swiglu_alpha", self.swiglu_alpha)
        C.check_real(fn, "swiglu_limit", self.swiglu_limit, low=0, strict=True)
        C.check_real(fn, "route_scale", self.route_scale)
        if self.num_expert_groups is not None or self.topk_groups is not None:
            n, m = self.num_expert_groups, self.topk_groups
            need(n is not None and m is not None,
                 "group-limited routing needs both num_expert_groups and topk_groups, but got "
                 f"num_expert_groups={n} and topk_groups={m}")
            C.check_int(fn, "num_expert_groups", n)
            C.check_int(fn, "topk_groups", m)
            need(n >= 1 and self.num_experts % n == 0,
                 f"expected num_expert_groups to divide num_experts ({self.num_experts}), but got {n}")
            need(1 <= m <= n, f"expected 1 <= topk_groups <= num_expert_groups ({n}), but got {m}")
            need(m * (self.num_experts // n) >= self.top_k,
                 f"topk_groups={m} groups of {self.num_experts // n} experts hold fewer than "
                 f"top_k={self.top_k} experts")
            need(not self.topk_before_score, "group-limited routing needs topk_before_score=False")
        if self.load_balance_bias:
            need(not self.topk_before_score, "load_balance_bias needs topk_before_score=False")
        if self.router_dtype is not None:
            if not isinstance(self.router_dtype, torch.dtype):
                raise TypeError(f"{fn}: expected router_dtype to be a torch.dtype or None, but got "
                                f"{type(self.router_dtype).__name__} {self.router_dtype!r}")
            need(self.router_dtype.is_floating_point,
                 f"expected router_dtype to be a floating-point dtype, but got {self.router_dtype}")
        for name in ("fused_gate_up", "ffn_bias", "router_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{fn}: expected {name} to be a bool, but got "
                                f"{type(getattr(self, name)).__name__} {getattr(self, name)!r}")
        if self.fused_gate_up:
            need(self.gated, f"fused_gate_up needs a gated activation ({GATED_ACTIVATIONS}), but "
                 f"got activation={self.activation!r}")
        if self.capacity_factor is not None:
            C.check_real(fn, "capacity_factor", self.capacity_factor, low=0, strict=True,
                         extra=" (or None for dropless)")
        for name in ("load_balance_coeff", "seq_balance_coeff", "z_loss_coeff", "bias_update_rate"):
            C.check_real(fn, name, getattr(self, name), low=0)
        need(self.precision in PRECISIONS,
             f"expected precision in {PRECISIONS}, but got {self.precision!r}")
        need(self.quant_scale_mode in SCALE_MODES,
             f"expected quant_scale_mode in {SCALE_MODES}, but got {self.quant_scale_mode!r}")
        if self.precision == "mxfp8":
            for name in ("dim", "hidden_dim"):
                need(getattr(self, name) % BLOCK_SIZE == 0,
                     f"precision='mxfp8' needs {name} to be a multiple of the MX block size "
                     f"{BLOCK_SIZE}, but got {getattr(self, name)}")
        self._check_weight_sizes()

    def _check_weight_sizes(self) -> None:
        # A weight whose byte size overflows int64 has no storage: say which sizes are absurd
        # instead of letting the allocator fail on a wrapped-around byte count.
        sizes = {"num_experts * dim * hidden_dim": self.num_experts * self.dim * self.hidden_dim}
        if self.num_shared_experts > 0:
            sizes["num_shared_experts * shared_hidden_dim * dim"] = (
                self.num_shared_experts * self.shared_width_per_expert * self.dim)
        for what, numel in sizes.items():
            if numel > C.MAX_NUMEL:
                raise ValueError(f"MoEConfig: expected {what} <= {C.MAX_NUMEL} elements per weight "
                                 f"(a storage size in bytes must fit in int64), but got {numel}")

    @classmethod
    def from_hf(cls, config, **overrides) -> "MoEConfig":
        """The config that reproduces the MoE blocks of a HuggingFace transformers model
        (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss) from its ``config``
        (``model.config``), with ``overrides`` (fields of this class, e.g.
        ``precision="mxfp8"``) on top. See :mod:`torch_moe.nn._hf_config` for what each
        architecture maps to. Raises ``ValueError`` for another ``model_type`` or a setting
        torch_moe cannot reproduce, ``TypeError`` for an unknown override."""
        unknown = sorted(set(overrides) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"MoEConfig.from_hf: unknown MoEConfig fields {unknown}")
        return cls(**{**moe_config_kwargs_from_hf(config), **overrides})

    @property
    def shared_width_per_expert(self) -> int:
        """FFN dim of one shared expert: ``shared_hidden_dim``, or ``hidden_dim`` if None."""
        return self.hidden_dim if self.shared_hidden_dim is None else self.shared_hidden_dim

    @property
    def gated(self) -> bool:
        return self.activation in GATED_ACTIVATIONS


class TopKRouter(nn.Module):
    """Scores tokens against experts and picks ``top_k`` of them per token (fp32 throughout)."""

    def __init__(self, config: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        if config.router_dtype is not None:
            dtype = config.router_dtype
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.dim, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(config.num_experts, device=device, dtype=dtype))
                     if config.router_bias else None)
        # persistent: the bias is learned state (DeepSeek-V3's e_score_correction_bias)
        self.register_buffer(
            "expert_bias",
            torch.zeros(config.num_experts, device=device, dtype=torch.float32)
            if config.load_balance_bias else None,
        )
        self.reset_parameters()

    def _apply(self, fn, recurse=True):
        # ``module.to(torch.bfloat16)`` must not round the expert bias: its updates (1e-3 by
        # default) would vanish in bf16. It follows the module's device, never its dtype.
        # With ``router_dtype`` the weight and bias (and their gradients) keep their dtype the
        # same way: they are restored from the unconverted tensors, so nothing is rounded.
        expert_bias = self.expert_bias
        kept = {}
        if self.config.router_dtype is not None:
            # .data: a fresh alias, which a conversion in place (``p.data = fn(p)``) leaves alone
            kept = {name: (p.data, None if p.grad is None else p.grad.data)
                    for name, p in self.named_parameters(recurse=False)}
        module = super()._apply(fn, recurse)
        if expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = expert_bias.to(self.expert_bias.device)
        for name, (data, grad) in kept.items():
            p = getattr(self, name)
            if p.dtype != data.dtype:
                p.data = data.to(p.device)
            if grad is not None and p.grad is not None and p.grad.dtype != grad.dtype:
                p.grad = grad.to(p.grad.device)
        return module

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.expert_bias is not None:
            self.expert_bias.zero_()

    def logits(self, x_TD: Tensor) -> Tensor:
        C.check_tokens("TopKRouter", "x", x_TD, self.config.dim)
        logits = x_TD.float() @ self.weight.float().t()
        if self.bias is not None:
            logits = logits + self.bias.float()
        return logits

    def forward(self, x_TD: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Returns ``(topk_ids [T, k], topk_weights [T, k] fp32, scores [T, E], logits [T, E])``."""
        c = self.config
        logits = self.logits(x_TD)
        topk_ids, topk_weights, scores = F_moe.route(
            logits, c.top_k, score_func=c.score_func, topk_before_score=c.topk_before_score,
            expert_bias=self.expert_bias, num_groups=c.num_expert_groups,
            topk_groups=c.topk_groups, normalize=c.normalize_topk, scale=c.route_scale,
        )
        return topk_ids, topk_weights, scores, logits


def _init_expert_weight(w: Tensor, fan_in: int) -> None:
    bound = 1.0 / math.sqrt(fan_in)  # nn.Linear's default, per expert
    nn.init.uniform_(w, -bound, bound)


class GroupedExperts(nn.Module):
    """E expert FFNs as stacked weights, computed by :func:`torch_moe.nn.functional.moe_ffn`.

    The GEMMs run in the parameters' dtype (fp32 parameters compute in fp32); tokens are cast
    to it.

    ``forward`` is the grouped FFN of the rows it is given, whoever sorted them: it reads its
    weights at call time and knows nothing of where the rows came from. The ParallelStyles of
    :mod:`torch_moe.distributed.parallel` build on that with the forward hooks of
    :func:`~torch.distributed.tensor.distribute_module`. Under expert parallelism the weights
    are DTensors sharded on the expert dim; the pre-hook sends the tokens, by the router's
    ``topk_ids``, to the ranks that hold their experts and hands ``forward`` the rows that
    arrive, sorted by local expert; for the call it puts the local expert shards in place of
    the parameters. The post-hook sends the results back. Under tensor parallelism ``forward``
    runs on the DTensors themselves.
    """

    def __init__(self, config: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        E, D, F = config.num_experts, config.dim, config.hidden_dim
        kw = dict(device=device, dtype=dtype)
        # w1's columns: [gate | up] when fused, the gate alone otherwise (up in w3)
        F1 = 2 * F if config.fused_gate_up else F
        separate_up = config.gated and not config.fused_gate_up
        self.w1 = nn.Parameter(torch.empty(E, D, F1, **kw))
        self.w2 = nn.Parameter(torch.empty(E, F, D, **kw))
        self.w3 = nn.Parameter(torch.empty(E, D, F, **kw)) if separate_up else None
        bias = config.ffn_bias
        self.b1 = nn.Parameter(torch.empty(E, F1, **kw)) if bias else None
        self.b2 = nn.Parameter(torch.empty(E, D, **kw)) if bias else None
        self.b3 = nn.Parameter(torch.empty(E, F, **kw)) if bias and separate_up else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_expert_weight(self.w1, self.config.dim)
        _init_expert_weight(self.w2, self.config.hidden_dim)
        if self.w3 is not None:
            _init_expert_weight(self.w3, self.config.dim)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def biases(self) -> dict[str, Tensor]:
        """The biases the experts have, as keyword arguments of the expert ops (``b1``, ``b2``,
        ``b3``; none without ``ffn_bias``)."""
        named = {"b1": self.b1, "b2": self.b2, "b3": self.b3}
        return {name: b for name, b in named.items() if b is not None}

    def forward(self, x_TD, sorted_ids, offs, topk_weights, topk_ids=None) -> Tensor:
        """``y [T, D]`` of ``x [T, D]``: ``sorted_ids`` / ``offs`` from ``token_sort(...,
        align=group_alignment(precision))``, routing weights ``topk_weights [T, k]``.
        ``topk_ids [T, k]``, the router's expert ids, are not read here (the sort carries them):
        :class:`MoE` passes them for forward pre-hooks that move the tokens by expert."""
        C.check_tokens("GroupedExperts", "x", x_TD, self.config.dim)
        c = self.config
        if c.precision != "bf16":
            return quantized_expert_ffn(
                x_TD.to(self.w1.dtype), sorted_ids, offs, topk_weights, self.w1, self.w2, self.w3,
                activation=c.activation, alpha=c.swiglu_alpha, limit=c.swiglu_limit,
                precision=c.precision, scale_mode=c.quant_scale_mode,
                wgrad_high_precision=c.wgrad_high_precision, **self.biases(),
            )
        out, _ = torch.ops.torch_moe.grouped_ffn(
            x_TD.to(self.w1.dtype), sorted_ids, offs, topk_weights, self.w1, self.w2, self.w3,
            c.activation, c.swiglu_alpha, c.swiglu_limit, **self.biases(),
        )
        return out


class SharedExperts(nn.Module):
    """Always-on experts: one dense FFN of width ``num_shared_experts * shared_hidden_dim``,
    optionally scaled per token by ``sigmoid(x @ gate)``."""

    def __init__(self, config: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        D = config.dim
        Fs = config.num_shared_experts * config.shared_width_per_expert
        kw = dict(device=device, dtype=dtype)
        self.w1 = nn.Parameter(torch.empty(D, Fs, **kw))
        self.w2 = nn.Parameter(torch.empty(Fs, D, **kw))
        self.w3 = nn.Parameter(torch.empty(D, Fs, **kw)) if config.gated else None
        self.gate = nn.Parameter(torch.empty(1, D, **kw)) if config.shared_expert_gate else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_expert_weight(self.w1, self.w1.size(0))
        _init_expert_weight(self.w2, self.w2.size(0))
        if self.w3 is not None:
            _init_expert_weight(self.w3, self.w3.size(0))
        if self.gate is not None:
            _init_expert_weight(self.gate, self.gate.size(1))

    def forward(self, x_TD: Tensor) -> Tensor:
        # One expert that every token visits with weight 1: the fused expert kernel gives the
        # shared FFN the same memory-efficient backward and the same CPU compute path (fp32
        # GEMMs for bf16 on CPUs without bf16 instructions) as the routed experts.
        c = self.config
        C.check_tokens("SharedExperts", "x", x_TD, c.dim)
        x_TD = x_TD.to(self.w1.dtype)
        T = x_TD.size(0)
        slots = torch.arange(T, device=x_TD.device)
        offs = torch.full((1,), T, dtype=torch.int32, device=x_TD.device)
        ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
        w3 = self.w3.unsqueeze(0) if self.w3 is not None else None
        y, _ = torch.ops.torch_moe.grouped_ffn(
            x_TD, slots, offs, ones, self.w1.unsqueeze(0), self.w2.unsqueeze(0), w3,
            c.activation, c.swiglu_alpha, c.swiglu_limit,
        )
        if self.gate is not None:
            y = y * torch.sigmoid(x_TD.float() @ self.gate.float().t()).to(y.dtype)
        return y


def _check_state_dict_dtypes(module, state_dict, prefix, *args) -> None:
    """Rejects entries that ``copy_`` would silently convert into a floating-point parameter or
    buffer: complex values (the imaginary part would be dropped), integers and bools (quantized
    or mislabelled data). Runs before anything of ``module`` is loaded."""
    own = dict(module.named_parameters())
    own.update((name, b) for name, b in module.named_buffers() if b is not None)
    for name, tensor in own.items():
        value = state_dict.get(prefix + name)
        if not isinstance(value, Tensor) or not tensor.is_floating_point():
            continue
        if not value.is_floating_point():
            raise TypeError(f"MoE.load_state_dict: expected {prefix + name!r} to be a floating-point "
                            f"tensor like the {tensor.dtype} it is loaded into, but got {value.dtype}")


class _AttachAuxLoss(torch.autograd.Function):
    """Returns ``y`` unchanged; in backward, gives ``aux_loss`` the gradient ``loss_scale``.

    This adds an auxiliary loss to the training objective without returning it: the loss's
    gradient flows whenever ``y``'s does, once per micro-batch, which is what gradient
    accumulation needs, and nothing escapes the graph, which is what ``torch.compile`` needs.
    :class:`MoE` attaches it to the routing weights ``[T, k]``, which every expert output
    depends on: the output returned to the caller is then the experts' own tensor, which may
    be modified in place (the view an identity Function returns may not).

    The gradient cannot be derived from ``grad_y``: ``2 * y.sum()`` and ``y.sum()`` scaled by 2
    send ``y`` the same gradient, yet the aux loss of the second one must get twice the
    gradient. So the caller states the factor its loss is multiplied by, ``loss_scale`` (a
    float, or a 0-dim tensor read when backward runs).
    """

    @staticmethod
    def forward(ctx, y, aux_loss, loss_scale):
        ctx.loss_scale = loss_scale
        ctx.aux_shape, ctx.aux_dtype = aux_loss.shape, aux_loss.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):
        scale = ctx.loss_scale
        if isinstance(scale, Tensor):
            grad_aux = scale.to(device=grad_y.device, dtype=ctx.aux_dtype).expand(ctx.aux_shape)
        else:
            grad_aux = torch.full(ctx.aux_shape, scale, dtype=ctx.aux_dtype, device=grad_y.device)
        return grad_y, grad_aux, None


def _check_loss_scale(scale) -> None:
    # a NaN, Inf or negative scale would turn every router gradient into garbage
    name = "aux_loss_scale"
    if not isinstance(scale, Tensor):
        C.check_real("MoE", name, scale, low=0)
        return
    if not scale.is_floating_point():
        raise TypeError(f"MoE: expected {name} to be a float or a floating-point 0-dim tensor, but "
                        f"got {scale.dtype}")
    if scale.dim() != 0:
        raise ValueError(f"MoE: expected {name} to be a float or a 0-dim tensor, but got shape "
                         f"{tuple(scale.shape)}")


def _own_tensor(y: Tensor) -> Tensor:
    """``y``, or a copy of it if it is a view of another tensor.

    A module's output must not be a view: ``fully_shard`` registers its pre-backward hook (the
    all-gather of the parameters resharded after forward) on the output, and an in-place op of
    the caller on a view (``y += shared(x)``) rebases the view's history and drops the hook,
    so that the backward runs on freed parameters. The copy, ``y.numel()`` elements read and
    written once in forward and nothing in backward, is made only where no op of the layer
    produced the output in its final shape and dtype.
    """
    return y.clone() if y._base is not None else y


class MoE(nn.Module):
    """A Mixture-of-Experts FFN block that can stand in for the MoE blocks of Mixtral,
    Qwen3-MoE, DeepSeek-V3, gpt-oss and torchtitan.

    ``forward(x)`` takes ``[B, L, D]`` or ``[T, D]`` and returns the same shape. Auxiliary losses
    (with non-zero coefficients) reach the training objective in one of two ways:

    * attached (the default): their coefficient-weighted sum is attached to the output's
      backward, so it need not be returned or added to the loss. It receives the gradient
      :attr:`aux_loss_scale` (1.0), whatever gradient the output receives: autograd cannot
      see how the caller's loss scales the output. Set :attr:`aux_loss_scale` to the factor
      the loss is multiplied by before ``backward()``: ``1 / num_microbatches`` under gradient
      accumulation, times the current scale of a ``torch.amp.GradScaler``. A 0-dim tensor is
      read when backward runs. Left at 1.0 under a loss scale of 1024, the aux losses would be
      1024 times too weak after unscaling.
    * returned: ``y, aux_loss = moe(x, return_aux_loss=True)`` attaches nothing and returns
      the weighted sum (a 0-dim fp32 tensor, zero in eval or without aux losses) for the caller
      to add to its loss, ``loss = task_loss + aux_loss``: exactly a loss term, under any loss
      scaling or weighting.

    Their last values are in :attr:`aux_losses` (detached, for logging).

    Buffers: ``tokens_per_expert [E]`` (int64) accumulates the routed assignments of every
    training forward since the last :meth:`update_expert_bias` or :meth:`reset_load_stats`;
    ``num_dropped`` counts assignments dropped by the capacity limit.
    """

    def __init__(self, config: MoEConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.router = TopKRouter(config, device=device, dtype=dtype)
        self.experts = GroupedExperts(config, device=device, dtype=dtype)
        self.shared_experts = (SharedExperts(config, device=device, dtype=dtype)
                               if config.num_shared_experts > 0 else None)
        # int64 so that ``module.to(dtype)`` leaves the counts exact
        self.register_buffer("tokens_per_expert",
                             torch.zeros(config.num_experts, device=device, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("num_dropped", torch.zeros((), device=device, dtype=torch.int64),
                             persistent=False)
        self.aux_loss_scale = 1.0
        self.aux_losses: dict = {}
        self.register_load_state_dict_pre_hook(_check_state_dict_dtypes)

    def reset_parameters(self) -> None:
        self.router.reset_parameters()
        self.experts.reset_parameters()
        if self.shared_experts is not None:
            self.shared_experts.reset_parameters()

    def capacity(self, num_tokens: int) -> Optional[int]:
        c = self.config
        if c.capacity_factor is None:
            return None
        return math.ceil(c.capacity_factor * num_tokens * c.top_k / c.num_experts)

    def forward(self, x: Tensor, return_aux_loss: bool = False):
        """``y`` of the shape of ``x``, or ``(y, aux_loss [])`` with ``return_aux_loss``."""
        c = self.config
        C.check_tensor("MoE", "x", x)
        if not x.is_floating_point():
            raise TypeError(f"MoE: expected x to be a floating-point tensor of token features, but "
                            f"got {x.dtype}")
        if x.dim() not in (2, 3) or x.size(-1) != c.dim:
            raise ValueError(f"MoE: expected input [B, L, {c.dim}] or [T, {c.dim}], but got "
                             f"{tuple(x.shape)}")
        handlers = subclass_handlers(x)
        if handlers is not None:
            # the subclass's owner runs the layer (a DTensor: every rank routes its own tokens)
            return handlers.moe_layer(self, x, return_aux_loss)
        seq_len = x.size(1) if x.dim() == 3 else x.size(0)
        x_TD = x.reshape(-1, c.dim)
        y_TD, counts, dropped, aux_loss = self._routed(x_TD, seq_len, attach=not return_aux_loss)
        self.record_load(counts, dropped)
        y = self._output(y_TD, x_TD, x)
        if not return_aux_loss:
            return y
        return y, aux_loss if aux_loss is not None else x.new_zeros((), dtype=torch.float32)

    def _output(self, routed_TD: Tensor, x_TD: Tensor, x: Tensor) -> Tensor:
        """``routed [T, D] (+ shared experts of x [T, D])`` in the shape and dtype of ``x``, as
        a tensor of its own (see :func:`_own_tensor`): the sum with the shared experts and a
        dtype cast write it in its final shape; only the routed output alone of a ``[B, L, D]``
        input, in the parameters' dtype, is copied out of ``[T, D]``."""
        y = routed_TD if routed_TD.shape == x.shape else routed_TD.view(x.shape)
        if self.shared_experts is not None:
            shared = self.shared_experts(x_TD)
            y = y + (shared if shared.shape == x.shape else shared.view(x.shape))
        return _own_tensor(y.to(x.dtype))

    def routed_forward(self, x_TD: Tensor, seq_len: int) -> tuple[Tensor, Tensor, Optional[Tensor]]:
        """Router, token sort and routed experts on ``x [T, D]`` (no shared experts); attaches
        the auxiliary losses in training. Returns ``(y [T, D], tokens_per_expert [E] int64,
        num_dropped [] int64 or None)``; :meth:`record_load` adds the last two to the buffers."""
        y, counts, dropped, _ = self._routed(x_TD, seq_len, attach=True)
        return y, counts, dropped

    def _routed(self, x_TD: Tensor, seq_len: int, attach: bool):
        """:meth:`routed_forward`, attaching the aux losses only with ``attach``; also returns
        their weighted sum (None in eval or without aux losses)."""
        c = self.config
        topk_ids, topk_weights, scores, logits = self.router(x_TD)
        aux_loss = self._aux_loss(scores, topk_ids, logits, seq_len) if self.training else None
        if attach:
            topk_weights = self._attach_aux_loss(topk_weights, aux_loss)
        capacity = self.capacity(x_TD.size(0))
        align = group_alignment(c.precision)
        # Under expert parallelism (torch_moe.distributed.parallel) the experts' pre-hook sends
        # the tokens to other ranks by topk_ids and sorts the rows that arrive: this sort's ids
        # and offsets are then unused (one token_sort per call wasted, so that the layer need
        # not know how its experts run); its counts are this rank's assignments either way.
        if capacity is None:
            sorted_ids, offs, counts = torch.ops.torch_moe.token_sort(
                topk_ids, c.num_experts, align)
            dropped = None
        else:
            sorted_ids, offs, counts, dropped = F_moe.token_sort_with_capacity(
                topk_ids, topk_weights, c.num_experts, capacity, align)
        # topk_ids positionally: a forward pre-hook sees the positional inputs only
        y = self.experts(x_TD, sorted_ids, offs, topk_weights, topk_ids)
        return y, counts, dropped, aux_loss

    @torch.no_grad()
    def record_load(self, counts: Tensor, dropped: Optional[Tensor]) -> None:
        """Adds ``counts [E]`` to :attr:`tokens_per_expert` and ``dropped []`` (if not None) to
        :attr:`num_dropped`, in training.

        The sums are assigned (``copy_``), not added in place: a sharded layer records the same
        global counts on every rank, and where ranks share one buffer (ranks simulated in one
        process) each rank then writes the same total, where in-place adds would count the
        tokens once per rank."""
        if self.training:
            self.tokens_per_expert.copy_(self.tokens_per_expert + counts)
            if dropped is not None:
                self.num_dropped.copy_(self.num_dropped + dropped)

    def _aux_loss(self, scores, topk_ids, logits, seq_len) -> Optional[Tensor]:
        """The coefficient-weighted sum of the enabled aux losses (None if none is enabled);
        logs each one in :attr:`aux_losses`."""
        c = self.config
        losses = {}
        if c.load_balance_coeff > 0:
            losses["load_balance"] = (c.load_balance_coeff,
                                      F_moe.load_balancing_loss(scores, topk_ids, c.num_experts))
        if c.seq_balance_coeff > 0:
            losses["seq_balance"] = (c.seq_balance_coeff, F_moe.sequence_balance_loss(
                scores, topk_ids, c.num_experts, seq_len))
        if c.z_loss_coeff > 0:
            losses["z_loss"] = (c.z_loss_coeff, F_moe.router_z_loss(logits))
        self.aux_losses = {name: loss.detach() for name, (_, loss) in losses.items()}
        if not losses:
            return None
        return sum(coeff * loss for coeff, loss in losses.values())

    def _attach_aux_loss(self, topk_weights: Tensor, aux_loss: Optional[Tensor]) -> Tensor:
        """``topk_weights [T, k]`` with ``aux_loss`` attached (:class:`_AttachAuxLoss`)."""
        if aux_loss is None:
            return topk_weights
        _check_loss_scale(self.aux_loss_scale)
        return _AttachAuxLoss.apply(topk_weights, aux_loss, self.aux_loss_scale)

    @torch.no_grad()
    def update_expert_bias(self) -> Tensor:
        """Aux-loss-free balancing step; call it before ``optimizer.step()``.

        With ``c_e`` the assignments of expert e since the last call (``tokens_per_expert``)
        and ``mean`` their average, ``expert_bias[e] += rate * sign(mean - c_e)``: overloaded
        experts become less likely to be picked, underloaded ones more. The bias is then
        centred (its mean does not affect selection) and the counts reset. Returns the counts
        the step used. Under data parallelism all-reduce ``tokens_per_expert`` first.
        """
        if self.router.expert_bias is None:
            raise RuntimeError("MoE.update_expert_bias: the layer was built with load_balance_bias=False")
        load = self.tokens_per_expert.clone()
        loadf = load.float()
        self.router.expert_bias.add_(torch.sign(loadf.mean() - loadf), alpha=self.config.bias_update_rate)
        self.router.expert_bias.sub_(self.router.expert_bias.mean())
        self.reset_load_stats()
        return load

    @torch.no_grad()
    def reset_load_stats(self) -> None:
        self.tokens_per_expert.zero_()
        self.num_dropped.zero_()
