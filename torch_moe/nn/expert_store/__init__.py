"""Experts larger than memory: tiered expert storage with a cache and prefetch.

The routed experts of an MoE model are most of its bytes, and a token uses few of them. An
expert store keeps every expert in a slow tier (a memory-mapped safetensors file on CPU, pinned
host memory for a GPU) and a fixed number per layer in fast memory (slots: preallocated buffers
on a GPU, the experts' own mapped pages on a CPU), loading what each step needs, and prefetching
what the next layer will need while the current one computes::

    from torch_moe.nn.expert_store import save_experts, offload_experts

    save_experts(model, "experts.safetensors")       # once
    store = offload_experts(model, "experts.safetensors", cache_experts=16, policy="lru")
    y = model(x)                                     # same bits as the resident model (fp32)
    print(store.stats())                             # hits, misses, bytes moved, stall time

Modules: :mod:`._format` (the safetensors file), :mod:`.tiers` (slow tiers), :mod:`.policy`
(LRU, LFU), :mod:`._loader` (background thread / CUDA copy stream), :mod:`.cache` (the slots),
:mod:`.experts` (the MoE integration: experts computed as their loads land, bit-exact),
:mod:`.offload` (entry points).
"""

from torch_moe.nn.expert_store.cache import CacheStats, ExpertCache
from torch_moe.nn.expert_store.experts import OffloadedExperts
from torch_moe.nn.expert_store.offload import (
    ExpertStore,
    load_experts,
    offload_experts,
    save_experts,
)
from torch_moe.nn.expert_store.tiers import ExpertSpec, FileTier, HostTier

__all__ = [
    "CacheStats",
    "ExpertCache",
    "ExpertSpec",
    "ExpertStore",
    "FileTier",
    "HostTier",
    "OffloadedExperts",
    "load_experts",
    "offload_experts",
    "save_experts",
]
