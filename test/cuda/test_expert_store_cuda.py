# Owner(s): ["module: moe"]
"""The CUDA tier of :mod:`torch_moe.nn.expert_store` (``@onlyCUDA``: runs on a GPU only).

A model whose MoE layers live on the GPU, offloaded with a cache of C experts per layer on the
GPU: the tier there by default is the experts read once into pinned host memory and copied into
the slots on a side stream (``StreamLoader``), or on the compute stream without prefetch. Against
the resident model on the same GPU, for cache sizes from one expert per layer to all of them, LRU
and LFU, prefetch off / router / previous, over training steps:

* outputs and the gradients of everything trainable (tokens, routers, the shared expert) agree
  to fp32 rounding. Not bit for bit as on the CPU: the store's passes call the fused ops on the
  rows of a pass's experts only, and the Triton kernels pick their tile configuration by shape,
  which may sum an expert's products in another order than the resident call;
* the slots are on the GPU, the host tier is pinned, the loader is the one asked for;
* the counters: no expert read twice within a step, bytes moved are whole experts, requests are
  hits plus misses, and the stall is 0 (the host never waits for a copy: the compute stream does).
"""

import copy
import os
import sys
import tempfile

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    parametrize,
    run_tests,
)

from torch_moe.nn.expert_store import HostTier, offload_experts, save_experts
from torch_moe.nn.expert_store._loader import InlineLoader, StreamLoader

# the CPU tests' model and gradient helper (test/ is not on the path of a run of test/cuda alone)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_expert_store import E, _Model, _trainable_grads  # noqa: E402


class TestExpertStoreDevice(TestCase):
    def setUp(self):
        super().setUp()
        self._dir = tempfile.TemporaryDirectory()
        self.addCleanup(self._dir.cleanup)

    @onlyCUDA
    @parametrize("cache_experts", [1, 3, E])
    @parametrize("policy", ["lru", "lfu"])
    @parametrize("prefetch", [None, "router", "previous"])
    def test_matches_resident(self, device, cache_experts, policy, prefetch):
        torch.manual_seed(0)
        resident = _Model(dim=32, hidden_dim=16, top_k=3, num_shared_experts=1).to(device)
        path = os.path.join(self._dir.name, "experts.safetensors")
        save_experts(resident, path)
        offloaded = copy.deepcopy(resident)
        store = offload_experts(offloaded, path, cache_experts=cache_experts, policy=policy,
                                prefetch=prefetch)
        self.addCleanup(store.close)
        for p in resident.parameters():
            if p.dim() == 3:  # the routed experts: frozen in both
                p.requires_grad_(False)

        self.assertIsInstance(store.tier, HostTier)
        self.assertIsInstance(store.loader, StreamLoader if prefetch else InlineLoader)
        for layer, cache in store.caches.items():
            self.assertTrue(store.tier.tensors[layer]["w1"].is_pinned())
            self.assertEqual(cache.slot_weights["w1"][0].device.type, "cuda")

        gen = torch.Generator(device=device).manual_seed(1)
        for step in range(3):
            x = torch.randn(7, 32, generator=gen, device=device)
            outs, grads = [], []
            for m in (resident, offloaded):
                m.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_(True)
                y = m(xi)
                (y * torch.linspace(-1, 1, y.numel(), device=device).view(y.shape)).sum().backward()
                outs.append(y.detach())
                grads.append({"x": xi.grad, **_trainable_grads(m)})
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"step {step}, outputs: {m}")
            self.assertEqual(grads[0].keys(), grads[1].keys())
            self.assertGreater(len(grads[0]), 1)
            for name in grads[0]:
                torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"step {step}, grad of {name}: {m}")
            for m in (resident, offloaded):  # one SGD step of everything trainable
                with torch.no_grad():
                    for p in m.parameters():
                        if p.grad is not None:
                            p -= 0.1 * p.grad

        stats = store.stats()
        spec = next(iter(store.caches.values())).spec
        self.assertLessEqual(stats.max_reads_per_step, 1)
        self.assertEqual(stats.bytes_moved, stats.loads * spec.nbytes())
        self.assertEqual(stats.requests, stats.hits + stats.misses)
        self.assertGreater(stats.requests, 0)
        if cache_experts == E:
            self.assertEqual(stats.loads, len(store.caches) * E)  # each read once, kept
        if prefetch is not None:
            self.assertEqual(stats.stall_s, 0.0)


instantiate_device_type_tests(TestExpertStoreDevice, globals(), only_for="cuda")

if __name__ == "__main__":
    run_tests()
