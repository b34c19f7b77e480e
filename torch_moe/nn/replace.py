"""``replace_moe_blocks``: a whole model's MoE blocks onto torch_moe in one call."""

import sys

from torch import nn

from torch_moe.nn.hf_blocks import _hf_block_name, is_swapped_hf_block, swap_hf_moe_block

__all__ = ["replace_moe_blocks"]


def replace_moe_blocks(model: nn.Module, **overrides) -> list[str]:
    """Swaps, in place, every supported MoE block of ``model`` to compute with torch_moe, keeping
    its parameters (no copies), state-dict keys and outputs; returns the swapped modules' names.

    * transformers 5 models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3, gpt-oss): see
      :mod:`torch_moe.nn.hf_blocks`; ``model.config`` (if it has one) gives the
      :class:`~torch_moe.nn.MoEConfig`, with ``overrides`` on top. ``model.generate``,
      training and ``save_pretrained`` (which writes the original layout) keep working.
    * torchtitan 0.3.0 models (its ``MoE`` layers, DeepSeek-V3 and Qwen3): see
      :func:`torch_moe.nn._torchtitan.swap_torchtitan_moe`, given ``overrides``.

    Blocks already swapped are left alone. Raises ``ValueError`` if ``model`` holds no
    supported MoE block, swapped or not.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_moe_blocks: expected an nn.Module, but got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is not None and not hasattr(config, "model_type"):
        config = None  # not a transformers config (a torchtitan model's, say)
    swapped, found = [], False
    for name, module in list(model.named_modules()):
        if is_swapped_hf_block(module):
            found = True
        elif _hf_block_name(module) is not None:
            swap_hf_moe_block(module, config, **overrides)
            swapped.append(name)
            found = True
    if "torchtitan.models.common.moe" in sys.modules:
        from torch_moe.nn._torchtitan import swap_torchtitan_moe

        titan = swap_torchtitan_moe(model, **overrides)
        swapped += titan
        found = found or bool(titan) or _has_swapped_torchtitan(model)
    if not found:
        raise ValueError(f"replace_moe_blocks: found no supported MoE block in the "
                         f"{type(model).__name__} (transformers' Mixtral, Qwen2-MoE, Qwen3-MoE, "
                         f"OLMoE, DeepSeek-V3, gpt-oss blocks; torchtitan 0.3's MoE)")
    return swapped


def _has_swapped_torchtitan(model: nn.Module) -> bool:
    from torch_moe.nn._torchtitan import _is_torchtitan_moe

    return any(_is_torchtitan_moe(m) for m in model.modules())
