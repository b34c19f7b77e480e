"""Entry points: write a model's experts to a file, run the model with them offloaded, and
bring them back.

``save_experts(model, path)`` writes the routed experts of every :class:`~torch_moe.nn.MoE`
in ``model`` to a safetensors file; ``offload_experts(model, path, cache_experts=C)`` replaces
each layer's :class:`~torch_moe.nn.GroupedExperts` with :class:`OffloadedExperts` reading that
file through a cache of ``C`` experts per layer and returns the :class:`ExpertStore` (counters,
``close``); ``load_experts(model, path)`` puts resident ``GroupedExperts`` back.
"""

import json
from typing import Optional

import torch
from torch import nn

from torch_moe.nn import _checks as C
from torch_moe.nn.expert_store._loader import make_loader
from torch_moe.nn.expert_store.cache import CacheStats, ExpertCache
from torch_moe.nn.expert_store.experts import PREFETCH, OffloadedExperts
from torch_moe.nn.expert_store.tiers import ExpertSpec, FileTier, HostTier, expert_key
from torch_moe.nn.expert_store._format import write_safetensors
from torch_moe.nn.expert_store.policy import POLICIES
from torch_moe.nn.modules.moe import GroupedExperts, MoE

__all__ = ["ExpertStore", "save_experts", "offload_experts", "load_experts"]

_FORMAT = "torch_moe.expert_store"


def _moe_layers(model: nn.Module, fn: str) -> list:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: expected an nn.Module, but got {type(model).__name__}")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"{fn}: {type(model).__name__} holds no torch_moe.nn.MoE layer")
    return layers


def save_experts(model: nn.Module, path) -> list:
    """Writes the routed experts of every MoE layer of ``model`` (resident ``GroupedExperts``)
    to the safetensors file ``path``, one expert's tensors adjacent (``{layer}.experts.{e}.w1``,
    ``.w3``, ``.w2`` and biases, in the layer's GEMM layout: ``w1 [D, F]``, ``w2 [F, D]``).
    Returns the layer names."""
    fn = "save_experts"
    tensors, layers = {}, {}
    for name, moe in _moe_layers(model, fn):
        experts = moe.experts
        if not isinstance(experts, GroupedExperts):
            raise TypeError(f"{fn}: layer {name!r} has {type(experts).__name__} experts, not "
                            "resident GroupedExperts (already offloaded?)")
        if experts.w1.device.type == "meta":
            raise ValueError(f"{fn}: layer {name!r} has its experts on the meta device: nothing "
                             "to save")
        spec = ExpertSpec.of(experts)
        for e in range(spec.num_experts):
            for w in spec.shapes:
                tensors[expert_key(name, e, w)] = getattr(experts, w)[e].detach()
        layers[name] = {"num_experts": spec.num_experts, "tensors": list(spec.shapes)}
    write_safetensors(path, tensors, {"format": _FORMAT, "layers": json.dumps(layers)})
    return list(layers)


class ExpertStore:
    """The slow tier, the loader and the per-layer caches of an offloaded model.

    ``stats()`` sums the layers' :class:`CacheStats` (``stats(per_layer=True)``: by layer);
    ``reset_stats()``; ``drop_page_cache()`` (file tier: a cold start); ``close()`` stops the
    loader and unmaps the file (the model cannot run after it)."""

    def __init__(self, tier, loader, caches: dict, layers: dict):
        self.tier, self.loader, self.caches, self.layers = tier, loader, caches, layers

    def stats(self, per_layer: bool = False):
        for cache in self.caches.values():
            cache.drain()
        if per_layer:
            return {name: cache.stats for name, cache in self.caches.items()}
        total = CacheStats()
        for cache in self.caches.values():
            total = total + cache.stats
        return total

    def reset_stats(self) -> None:
        for cache in self.caches.values():
            cache.reset_stats()

    def seed_frequencies(self, layer: str, counts) -> None:
        """Prior request counts ``counts [E]`` of ``layer`` (e.g. ``MoE.tokens_per_expert`` of a
        calibration run) for the LFU policy; finite and non-negative."""
        cache = self.caches.get(layer)
        if cache is None:
            raise KeyError(f"ExpertStore.seed_frequencies: no offloaded layer {layer!r} (layers: "
                           f"{list(self.caches)})")
        E = cache.spec.num_experts
        t = torch.as_tensor(counts)
        if t.shape != (E,):
            raise ValueError(f"ExpertStore.seed_frequencies: expected counts [{E}], but got shape "
                             f"{tuple(t.shape)}")
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"ExpertStore.seed_frequencies: expected real counts, but got {t.dtype}")
        t = t.double()
        if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            raise ValueError("ExpertStore.seed_frequencies: expected finite, non-negative counts, "
                             f"but got {t.tolist()}")
        cache.policy.seed(t.tolist())

    def drop_page_cache(self) -> None:
        if isinstance(self.tier, FileTier):
            self.tier.file.drop_page_cache()

    def slot_bytes(self) -> int:
        """Bytes of all cache slots (the fast tier's budget)."""
        return sum(c.budget_bytes() for c in self.caches.values())

    def close(self) -> None:
        for cache in self.caches.values():
            cache.close()
        self.loader.close()
        self.tier.close()


def offload_experts(model: nn.Module, path, *, cache_experts: int, policy: str = "lru",
                    prefetch: Optional[str] = "router", device=None, tier: Optional[str] = None,
                    drop_page_cache: bool = False) -> ExpertStore:
    """Runs the routed experts of every MoE layer of ``model`` from the file ``path`` (written
    by :func:`save_experts`) through a cache of ``cache_experts`` experts per layer.

    Each layer's ``experts`` (``GroupedExperts``) is replaced in place by
    :class:`OffloadedExperts`; its weights are freed. Outputs and gradients (of the tokens and
    of the routing weights, hence of the router, the shared experts and the layers before) are
    bit-identical to the resident layer in fp32 for any cache size, the resident layer computing
    its experts one GEMM each (the default ``"per_group"`` form of ``torch_moe.cpu``, the form
    the store's passes always use); within fp32 rounding of the ``"auto"`` and ``"batched"``
    forms, which may batch small experts into one ``bmm``. The experts are frozen.

    Args:
        cache_experts: slots per layer, in ``[1, num_experts]``.
        policy: ``"lru"`` or ``"lfu"`` eviction.
        prefetch: ``"router"`` (the next layer's router applied to this layer's input predicts
            its experts), ``"previous"`` (the experts the next layer used last time) or None
            (no prefetch, every load on demand). Either kind also overlaps a pass's compute
            with the next pass's loads when a step needs more experts than the cache holds.
        device: where the cache slots live (default: the device of each layer's router).
        tier: ``"file"`` (the file, mapped: the CPU default) or ``"host"`` (the experts read
            into host memory once, pinned for a CUDA cache: the GPU default).
        drop_page_cache: file tier only: drop each expert's pages from the page cache after
            reading it, so that every miss reads the disk (a file larger than RAM).

    The model's ``state_dict`` then holds no routed experts (the file is their state; save the
    rest as usual), and the slots stay on ``device`` whatever ``model.to()`` does (offload
    after moving the model). Call ``store.close()`` when done (it stops the loader thread).
    Exactness rests on the fused op computing each expert's GEMMs from its own rows only (one
    GEMM per expert group): see :mod:`torch_moe.nn.expert_store.experts`.
    """
    fn = "offload_experts"
    layers = _moe_layers(model, fn)
    C.check_int(fn, "cache_experts", cache_experts, 1)
    if policy not in POLICIES:
        raise ValueError(f"{fn}: expected policy in {sorted(POLICIES)}, but got {policy!r}")
    if prefetch not in PREFETCH:
        raise ValueError(f"{fn}: expected prefetch in {PREFETCH}, but got {prefetch!r}")
    if tier not in (None, "file", "host"):
        raise ValueError(f"{fn}: expected tier 'file', 'host' or None, but got {tier!r}")
    specs, devices = {}, set()
    for name, moe in layers:
        c = moe.config
        if not isinstance(moe.experts, GroupedExperts):
            raise TypeError(f"{fn}: layer {name!r} has {type(moe.experts).__name__} experts, "
                            "not GroupedExperts (already offloaded?)")
        if c.precision != "bf16":
            raise NotImplementedError(f"{fn}: layer {name!r} has precision={c.precision!r}; "
                                      "offloaded experts compute in the weights' dtype only")
        if cache_experts > c.num_experts:
            raise ValueError(f"{fn}: expected cache_experts in [1, {c.num_experts}] (the experts "
                             f"of layer {name!r}), but got {cache_experts}")
        specs[name] = ExpertSpec.of(moe.experts)
        dev = torch.device(device) if device is not None else moe.router.weight.device
        if dev.type == "meta":
            raise ValueError(f"{fn}: layer {name!r} is on the meta device; pass device=")
        devices.add(dev)
    if len(devices) != 1:
        raise ValueError(f"{fn}: expected the layers on one device, but got {sorted(map(str, devices))}")
    (dev,) = devices
    tier = tier or ("host" if dev.type == "cuda" else "file")
    if tier == "host":
        if drop_page_cache:
            raise ValueError(f"{fn}: drop_page_cache applies to the file tier, not tier='host'")
        slow = HostTier.from_file(path, specs, pin_memory=dev.type == "cuda")
    else:
        slow = FileTier(path, drop_page_cache=drop_page_cache)
        try:
            for name, spec in specs.items():
                slow.check_layer(name, spec)
        except Exception:
            slow.close()
            raise
    loader = make_loader(dev, asynchronous=prefetch is not None)
    caches, offloaded = {}, []
    for name, moe in layers:
        cache = ExpertCache(name, specs[name], slow, cache_experts, dev, policy, loader)
        caches[name] = cache
        experts = OffloadedExperts(moe.config, cache, prefetch=prefetch)
        moe.experts = experts
        offloaded.append((moe, experts))
    # each layer prefetches for the one after it (forward) and the one before it (backward)
    for (moe_a, a), (moe_b, b) in zip(offloaded, offloaded[1:]):
        a.link(next_layer=b, next_router=moe_b.router)
        b.link(prev_layer=a)
    return ExpertStore(slow, loader, caches, {n: moe for n, moe in layers})


@torch.no_grad()
def load_experts(model: nn.Module, path) -> None:
    """Puts resident :class:`GroupedExperts` read from ``path`` back into every MoE layer of
    ``model`` (offloaded or not), on the device of its router."""
    fn = "load_experts"
    slow = FileTier(path)
    try:
        for name, moe in _moe_layers(model, fn):
            dev = moe.router.weight.device
            dtype = (moe.experts.cache.spec.dtype if isinstance(moe.experts, OffloadedExperts)
                     else moe.experts.w1.dtype)
            experts = GroupedExperts(moe.config, device="meta", dtype=dtype)
            spec = ExpertSpec.of(experts)
            slow.check_layer(name, spec)
            for w in spec.shapes:
                stacked = torch.empty((spec.num_experts, *spec.shapes[w]), dtype=dtype, device=dev)
                for e in range(spec.num_experts):
                    stacked[e].copy_(slow.file.get(expert_key(name, e, w)))
                setattr(experts, w, nn.Parameter(stacked))
            moe.experts = experts
    finally:
        slow.close()
