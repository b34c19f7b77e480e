"""MoE modules (counterpart of ``torch/nn/modules``)."""

from torch_moe.nn.modules.moe import GroupedExperts, MoE, MoEConfig, SharedExperts, TopKRouter

__all__ = ["MoEConfig", "TopKRouter", "GroupedExperts", "SharedExperts", "MoE"]
