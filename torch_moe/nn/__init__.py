"""Neural-network building blocks for Mixture-of-Experts (counterpart of ``torch.nn``)."""

from torch_moe.nn import functional  # noqa: F401
from torch_moe.nn.convert import hf_moe_state_dict, load_hf_moe_state_dict  # noqa: F401
from torch_moe.nn.modules import GroupedExperts, MoE, MoEConfig, SharedExperts, TopKRouter
from torch_moe.nn.replace import replace_moe_blocks

__all__ = [
    "functional",
    "MoEConfig",
    "TopKRouter",
    "GroupedExperts",
    "SharedExperts",
    "MoE",
    "load_hf_moe_state_dict",
    "hf_moe_state_dict",
    "replace_moe_blocks",
]
