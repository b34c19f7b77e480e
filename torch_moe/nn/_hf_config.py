"""``MoEConfig.from_hf``: the fields of the :class:`~torch_moe.nn.MoEConfig` that reproduces the MoE blocks of a
HuggingFace transformers model, read from its config.

Nothing here imports transformers: the config is read by attribute, so any object with the
fields of a transformers ``PretrainedConfig`` (or its ``to_dict()`` wrapped in a namespace) works.
The routing of each architecture, as transformers 5 computes it:

============  ======================================================================
model_type    routing and experts
============  ======================================================================
mixtral       softmax over all logits, top-k, renormalised (= softmax of the top-k
              logits); SiLU-gated experts
qwen2_moe     softmax, top-k, renormalised with ``norm_topk_prob``; one shared expert
              of width ``shared_expert_intermediate_size`` scaled by a sigmoid gate
qwen3_moe     softmax, top-k, ``norm_topk_prob``
olmoe         softmax, top-k, ``norm_topk_prob``
deepseek_v3   sigmoid, selection biased by ``e_score_correction_bias``, group-limited
              (``n_group`` / ``topk_group``), ``norm_topk_prob``, scaled by
              ``routed_scaling_factor``; ``n_shared_experts`` shared experts; the
              router kept in fp32
gpt_oss       top-k of the logits of a router with a bias, softmax of those k;
              experts with biases and the clamped ``swiglu_oai`` activation
============  ======================================================================

The experts are built with ``fused_gate_up=True``, the layout transformers 5 keeps in memory
(one ``gate_up_proj`` per layer), so that a swapped block can use its weights as views.
"""

from typing import Any

import torch

__all__ = ["moe_config_kwargs_from_hf", "HF_MODEL_TYPES"]


def _get(config, *names, default=None, required=True):
    """The first attribute of ``config`` among ``names``."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    if required and default is None:
        raise ValueError(f"MoEConfig.from_hf: the {type(config).__name__} has none of the fields "
                         f"{names}, which a {_model_type(config)!r} MoE block needs")
    return default


def _model_type(config) -> str:
    return getattr(config, "model_type", None) or ""


def _check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"MoEConfig.from_hf: expected hidden_act='silu' (SiLU-gated experts, "
                         f"activation='swiglu'), but the config has hidden_act={act!r}")


def _base(config) -> dict[str, Any]:
    _check_silu(config)
    return dict(dim=_get(config, "hidden_size"), top_k=_get(config, "num_experts_per_tok"),
                fused_gate_up=True)


def _mixtral(config) -> dict[str, Any]:
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter > 0:
        # the jitter multiplies the block's input by noise in training; torch_moe has no such
        # step, so a swapped model would train differently without a word
        raise ValueError(f"MoEConfig.from_hf: router_jitter_noise={jitter} is not supported "
                         f"(expected 0.0)")
    return dict(_base(config), hidden_dim=_get(config, "intermediate_size"),
                num_experts=_get(config, "num_local_experts", "num_experts"),
                score_func="softmax", topk_before_score=True)


def _softmax_topk(config, hidden_field: str) -> dict[str, Any]:
    return dict(_base(config), hidden_dim=_get(config, hidden_field),
                num_experts=_get(config, "num_experts", "num_local_experts"),
                score_func="softmax", normalize_topk=bool(getattr(config, "norm_topk_prob", False)))


def _qwen2_moe(config) -> dict[str, Any]:
    kw = _softmax_topk(config, "moe_intermediate_size")
    shared = _get(config, "shared_expert_intermediate_size", default=0, required=False)
    if shared:
        kw.update(num_shared_experts=1, shared_hidden_dim=shared, shared_expert_gate=True)
    return kw


def _qwen3_moe(config) -> dict[str, Any]:
    return _softmax_topk(config, "moe_intermediate_size")


def _olmoe(config) -> dict[str, Any]:
    return _softmax_topk(config, "intermediate_size")


def _deepseek_v3(config) -> dict[str, Any]:
    F = _get(config, "moe_intermediate_size")
    kw = dict(_base(config), hidden_dim=F,
              num_experts=_get(config, "n_routed_experts", "num_local_experts"),
              score_func="sigmoid", normalize_topk=bool(getattr(config, "norm_topk_prob", True)),
              route_scale=float(_get(config, "routed_scaling_factor", default=1.0)),
              load_balance_bias=True, router_dtype=torch.float32)
    n_group, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    if n_group is not None and n_group > 1:
        kw.update(num_expert_groups=n_group, topk_groups=topk_group)
    shared = getattr(config, "n_shared_experts", 0) or 0
    if shared:
        kw.update(num_shared_experts=shared, shared_hidden_dim=F)
    return kw


def _gpt_oss(config) -> dict[str, Any]:
    return dict(dim=_get(config, "hidden_size"), top_k=_get(config, "num_experts_per_tok"),
                hidden_dim=_get(config, "intermediate_size"),
                num_experts=_get(config, "num_local_experts", "num_experts"),
                score_func="softmax", topk_before_score=True, router_bias=True, ffn_bias=True,
                fused_gate_up=True, activation="swiglu_oai",
                swiglu_alpha=float(_get(config, "swiglu_alpha", default=1.702)),
                swiglu_limit=float(_get(config, "swiglu_limit", default=7.0)))


_BUILDERS = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}
HF_MODEL_TYPES = tuple(_BUILDERS)


def moe_config_kwargs_from_hf(config) -> dict[str, Any]:
    """The :class:`~torch_moe.nn.MoEConfig` fields of the MoE blocks of a transformers model
    with ``config`` (what ``MoEConfig.from_hf`` builds its config from).

    Args:
        config: a transformers config (``model.config``, ``AutoConfig.from_pretrained(...)``)
            whose ``model_type`` is one of :data:`HF_MODEL_TYPES`. A multimodal config is
            read through its ``text_config``.

    Auxiliary losses stay off (``load_balance_coeff=0``): a transformers model computes its
    router loss itself, from the router logits it collects (``output_router_logits=True``).
    """
    text = getattr(config, "text_config", None)
    if text is not None and _model_type(config) not in _BUILDERS:
        config = text
    model_type = _model_type(config)
    if model_type not in _BUILDERS:
        raise ValueError(f"MoEConfig.from_hf: expected a config of model_type in {HF_MODEL_TYPES}, "
                         f"but got {type(config).__name__} with model_type={model_type!r}")
    return _BUILDERS[model_type](config)
