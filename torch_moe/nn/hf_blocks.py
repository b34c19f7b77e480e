"""transformers' MoE blocks computed by torch_moe, in place.

:func:`swap_hf_moe_block` turns a transformers-5 MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3, gpt-oss) into an instance of a subclass of its own class whose ``forward`` is
torch_moe's: routing by :func:`torch_moe.nn.functional.route` on fp32 logits, ``token_sort`` and
one fused ``grouped_ffn`` (memory-efficient backward) over the block's own expert weights. Its
submodules (router, experts, shared experts), parameters, buffers and state-dict keys stay
exactly where they are: ``save_pretrained`` writes the original layout, ``from_pretrained``
reloads it, an optimizer built before the swap stays valid, and nothing is copied:

* Mixtral, Qwen, OLMoE, DeepSeek-V3 keep ``experts.gate_up_proj [E, 2F, D]`` (gate rows first)
  and ``experts.down_proj [E, D, F]``; the experts read them as the transposed views
  ``w13 [E, D, 2F]`` and ``w2 [E, F, D]``.
* gpt-oss keeps ``gate_up_proj [E, D, 2F]`` with the gate and up columns interleaved: its even
  and odd columns (and bias entries) are the strided views ``w1`` and ``w3 [E, D, F]``.

The router module is not called (its top-k would be computed twice); its forward hooks are run
with its output tuple ``(logits, weights, ids)``, so that transformers' ``output_router_logits``
still collects the logits for the model's auxiliary loss.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn, Tensor

from torch_moe.nn import functional as F_moe
from torch_moe.nn.modules.moe import MoEConfig

__all__ = ["HF_BLOCK_CLASSES", "is_swapped_hf_block", "swap_hf_moe_block"]

# transformers class name of the block -> the attribute of its router module
HF_BLOCK_CLASSES = {
    "MixtralSparseMoeBlock": "gate",
    "Qwen2MoeSparseMoeBlock": "gate",
    "Qwen3MoeSparseMoeBlock": "gate",
    "OlmoeSparseMoeBlock": "gate",
    "DeepseekV3MoE": "gate",
    "GptOssMLP": "router",
}


def _run_forward_hooks(module: nn.Module, args: tuple, output) -> None:
    """Runs ``module``'s forward hooks as if it had returned ``output`` for ``args``."""
    for key, hook in list(module._forward_hooks.items()):
        if key in module._forward_hooks_with_kwargs:
            hook(module, args, {}, output)
        else:
            hook(module, args, output)


class _TorchMoEBlockMixin:
    """The forward of a swapped block (the first base of the swapped class)."""

    moe_config: MoEConfig

    def _router(self) -> nn.Module:
        return getattr(self, HF_BLOCK_CLASSES[self._hf_class_name])

    def _expert_weights(self) -> tuple[Tensor, Tensor, Optional[Tensor], dict]:
        """``(w1, w2 [E, F, D], w3, biases)`` in ``grouped_ffn``'s layout: ``w1 = w13 [E, D, 2F]``
        and ``w3 = None``, or gate and up ``[E, D, F]`` apart."""
        ex = self.experts
        if self.moe_config.ffn_bias:
            # gpt-oss: interleaved gate / up columns in GEMM layout, with biases; the gate and
            # up weights are the even and odd columns, strided views of its one tensor
            w, b = ex.gate_up_proj, ex.gate_up_proj_bias
            biases = {"b1": b[..., ::2], "b3": b[..., 1::2], "b2": ex.down_proj_bias}
            return w[..., ::2], ex.down_proj, w[..., 1::2], biases
        return ex.gate_up_proj.transpose(1, 2), ex.down_proj.transpose(1, 2), None, {}

    def forward(self, hidden_states: Tensor):
        c = self.moe_config
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        router = self._router()
        bias = getattr(router, "bias", None)
        logits = F.linear(x_TD.float(), router.weight.float(),
                          None if bias is None else bias.float())
        topk_ids, topk_weights, _ = F_moe.route(
            logits, c.top_k, score_func=c.score_func, topk_before_score=c.topk_before_score,
            expert_bias=getattr(router, "e_score_correction_bias", None),
            num_groups=c.num_expert_groups, topk_groups=c.topk_groups, normalize=c.normalize_topk,
            scale=c.route_scale,
        )
        if router._forward_hooks:
            # the logits in the dtype transformers' router returns them (its weight's, fp32
            # for DeepSeek-V3)
            hf_dtype = torch.promote_types(x_TD.dtype, router.weight.dtype)
            _run_forward_hooks(router, (x_TD,), (logits.to(hf_dtype), topk_weights, topk_ids))
        w1, w2, w3, biases = self._expert_weights()
        sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(topk_ids, c.num_experts)
        y_TD, _ = torch.ops.torch_moe.grouped_ffn(
            x_TD.to(w1.dtype), sorted_ids, offs, topk_weights, w1, w2, w3, c.activation,
            c.swiglu_alpha, c.swiglu_limit, **biases)
        y_TD = y_TD.to(hidden_states.dtype)
        if hasattr(self, "shared_expert"):  # Qwen2-MoE: a sigmoid-gated shared expert
            gate = torch.sigmoid(self.shared_expert_gate(x_TD))
            y_TD = y_TD + gate * self.shared_expert(x_TD)
        y = y_TD.reshape(shape)
        if hasattr(self, "shared_experts"):  # DeepSeek-V3
            y = y + self.shared_experts(hidden_states)
        if self._hf_class_name == "GptOssMLP":  # its block also returns the routing weights
            return y, topk_weights.to(hidden_states.dtype)
        return y


_SWAPPED: dict[type, type] = {}


def _swapped_class(cls: type, hf_name: str) -> type:
    """The swapped class of ``cls``, a subclass of (or) transformers' ``hf_name`` block."""
    if cls not in _SWAPPED:
        _SWAPPED[cls] = type(f"TorchMoE{cls.__name__}", (_TorchMoEBlockMixin, cls),
                             {"_hf_class_name": hf_name, "__module__": __name__})
    return _SWAPPED[cls]


def is_swapped_hf_block(module: nn.Module) -> bool:
    return isinstance(module, _TorchMoEBlockMixin)


def _hf_block_name(module: nn.Module) -> Optional[str]:
    """The supported transformers class ``module`` is an instance of (by MRO, so a subclass of a
    supported block is recognised), or None."""
    for klass in type(module).__mro__:
        if klass.__name__ in HF_BLOCK_CLASSES and klass.__module__.startswith("transformers."):
            return klass.__name__
    return None


def swap_hf_moe_block(block: nn.Module, config=None, **overrides) -> MoEConfig:
    """Makes the transformers MoE ``block`` compute with torch_moe, in place; returns its
    :class:`MoEConfig` (``MoEConfig.from_hf(config, **overrides)``, stored as
    ``block.moe_config``).

    Args:
        block: a transformers-5 block of :data:`HF_BLOCK_CLASSES`.
        config: the model's transformers config; by default the block's experts' (transformers
            gives every experts module the model config).
        overrides: :class:`MoEConfig` fields on top. Only fields that keep the block's
            function are meaningful here (e.g. none of its weights' shapes).

    Raises:
        TypeError: ``block`` is no supported transformers block, or is already swapped.
        ValueError: the config is one torch_moe cannot reproduce (see ``MoEConfig.from_hf``),
            or hooks would be bypassed (accelerate's ``_hf_hook`` on the experts).
    """
    name = _hf_block_name(block)
    if is_swapped_hf_block(block):
        raise TypeError(f"swap_hf_moe_block: the {type(block).__name__} is already swapped")
    if name is None:
        raise TypeError(f"swap_hf_moe_block: expected a transformers MoE block (one of "
                        f"{tuple(HF_BLOCK_CLASSES)}), but got {type(block).__name__}")
    experts = block.experts
    if config is None:
        config = getattr(experts, "config", None) or getattr(block, "config", None)
        if config is None:
            raise ValueError(f"swap_hf_moe_block: the {name} holds no config; pass config=")
    for module in (block, experts, getattr(block, HF_BLOCK_CLASSES[name])):
        if getattr(module, "_hf_hook", None) is not None or (
                module is experts and module._forward_hooks):
            # an offloading hook would never see its weights used; a hook on the experts
            # would never run, since the swapped forward does not call them
            raise ValueError(f"swap_hf_moe_block: the {name}'s {type(module).__name__} has "
                             f"forward hooks that the swapped forward would bypass")
    moe_config = MoEConfig.from_hf(config, **overrides)
    # what the swapped forward does not compute must not be accepted silently
    unsupported = {"precision": "bf16", "capacity_factor": None, "load_balance_coeff": 0.0,
                   "seq_balance_coeff": 0.0, "z_loss_coeff": 0.0}
    for field, default in unsupported.items():
        if getattr(moe_config, field) != default:
            raise ValueError(f"swap_hf_moe_block: a swapped transformers block computes "
                             f"{field}={default!r} only, but got {getattr(moe_config, field)!r}")
    E = moe_config.num_experts
    got = experts.gate_up_proj.size(0)
    if got != E:
        raise ValueError(f"swap_hf_moe_block: the config has {E} experts, but the {name}'s "
                         f"experts.gate_up_proj has {got}")
    block.moe_config = moe_config
    block.__class__ = _swapped_class(type(block), name)
    return moe_config
