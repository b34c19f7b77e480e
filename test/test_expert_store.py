# Owner(s): ["module: moe"]
"""Tests of ``torch_moe.nn.expert_store``: the safetensors file, the cache and its policies, the
prefetcher, and the offloaded MoE layer against the all-resident one, bit for bit (fp32
outputs and the gradients of everything trainable) for every cache size, policy and prefetch
mode; and the errors of every entry point.

Bit-identity is to the resident layer computing in the fused CPU op's per-group form (one GEMM
per expert, each expert's rows computed from its rows alone), the form the store's passes always
use: a pass computes an expert among other neighbours than the resident call does. The resident
side of the exactness tests runs under ``torch_moe.cpu.expert_form("per_group")`` (the default,
made explicit); against the ``"auto"`` form, which batches runs of small experts into one padded
``bmm``, the two agree to fp32 rounding (``test_auto_form_within_rounding``)."""

import contextlib
import copy
import gc
import os
import struct
import sys
import tempfile
import threading
import time
import unittest
from unittest import mock

import torch
from torch import nn
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe.cpu
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.expert_store import (
    ExpertCache,
    ExpertSpec,
    FileTier,
    OffloadedExperts,
    load_experts,
    offload_experts,
    save_experts,
)
from torch_moe.nn.expert_store._format import SafetensorsFile, _pmd_size, write_safetensors
from torch_moe.nn.expert_store._loader import NEXT_LAYER, InlineLoader, ThreadLoader
from torch_moe.nn.expert_store.policy import LFU, LRU

E = 8


class _Model(nn.Module):
    """Three MoE layers on a residual stream (the next layer's router sees a related input, as
    in a transformer)."""

    def __init__(self, layers=3, **kw):
        super().__init__()
        cfg = dict(dim=16, hidden_dim=8, num_experts=E, top_k=2)
        cfg.update(kw)
        self.layers = nn.ModuleList(MoE(MoEConfig(**cfg)) for _ in range(layers))

    def forward(self, h):
        for layer in self.layers:
            h = h + layer(h)
        return h


def _trainable_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()
            if p.grad is not None and ".experts." not in n}


class _Files(TestCase):
    def setUp(self):
        super().setUp()
        self._dir = tempfile.TemporaryDirectory()
        self.addCleanup(self._dir.cleanup)

    def path(self, name="experts.safetensors"):
        return os.path.join(self._dir.name, name)


class TestFormat(_Files):
    def test_round_trip(self):
        tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16),
                   "c": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.empty(0, 4)}
        write_safetensors(self.path(), tensors, {"k": "v"})
        f = SafetensorsFile(self.path())
        self.assertEqual(f.metadata, {"k": "v"})
        for name, t in tensors.items():
            self.assertEqual(f.info(name), (t.dtype, tuple(t.shape)))
            self.assertTrue(torch.equal(f.get(name), t))
        # the data starts on a page boundary (so the experts' pages are their own)
        self.assertEqual(f.byte_range("a")[0] % 4096, 0)
        f.close()

    def test_mapping_outlives_close_while_viewed(self):
        # close() with views alive: the views stay readable, the mapping goes with the last one
        t = torch.randn(64, 64)
        write_safetensors(self.path(), {"a": t})
        f = SafetensorsFile(self.path(), huge_pages=True)
        view, address = f.get("a"), f.mapping_address()
        f.close()
        self.assertTrue(torch.equal(view, t))
        if sys.platform == "linux":
            self.assertTrue(_mapped(address))
            del view
            gc.collect()
            self.assertFalse(_mapped(address))

    def test_huge_pages_only_where_the_page_cache_has_large_folios(self):
        # MADV_HUGEPAGE is accepted everywhere THP is built in; only a file system with large
        # page-cache folios turns it into PMD-sized reads. Elsewhere the file keeps the
        # single-page path (POSIX_FADV_WILLNEED read-ahead), which huge_pages=False says.
        import torch_moe.nn.expert_store._format as fmt
        write_safetensors(self.path(), {"a": torch.randn(4, 4)})
        for fs, release, thp, expected in (("btrfs", "6.18.0", True, False),
                                           ("ext4", "6.12.9-amd64", True, False),
                                           ("ext4", "6.18.44-x", False, False),
                                           ("xfs", "6.1.0", True, True)):
            with mock.patch.object(fmt, "_file_system", return_value=fs), \
                 mock.patch.object(fmt, "_thp_enabled", return_value=thp), \
                 mock.patch.object(fmt.os, "uname",
                                   return_value=os.uname_result(("Linux", "h", release, "", ""))):
                self.assertEqual(fmt._large_folio_page_cache(0), expected, (fs, release, thp))
                if sys.platform == "linux":
                    f = SafetensorsFile(self.path(), huge_pages=True)
                    self.assertEqual(f.huge_pages, expected)
                    f.close()

    @unittest.skipUnless(sys.platform == "linux", "transparent huge pages and smaps: Linux")
    def test_huge_folios_map_only_the_pages_asked_for(self):
        # With huge pages the page cache holds the file in PMD-sized (2 MiB) folios, and a
        # mapping whose address agrees with the file offset modulo 2 MiB would map a whole
        # folio with one entry: populating one 1.5 MiB expert would map its neighbours, and
        # unmapping it would unmap theirs. The file's mapping is one page off that alignment:
        # the resident pages are those populated, and stay so when a neighbour is released.
        expert = 3 * 128 * 1024 * 4  # 1.5 MiB: 3 tensors of fp32
        write_safetensors(self.path(), {f"e{e}.{n}": torch.full((128, 1024), float(e))
                                        for e in range(8) for n in "abc"})
        f = SafetensorsFile(self.path(), huge_pages=True)
        if not f.huge_pages:
            f.close()
            self.skipTest("no large page-cache folios here (transparent huge pages off, or a "
                          "file system without them)")
        # (file offset 0 at an address off the PMD alignment: no folio is ever PMD-mappable)
        self.assertNotEqual(f.mapping_address() % _pmd_size(), 0)
        f.drop_page_cache()  # cold: the loads below fault the file in, in huge folios
        span = {e: (f.byte_range(f"e{e}.a")[0], expert) for e in range(8)}
        # fault-around (64 KiB by default) may map what the page cache holds on either side
        slack = 2 * (64 << 10)
        f.populate(*span[2])
        f.populate(*span[3])
        self.assertGreaterEqual(_mapping_rss(f.mapping_address()), 2 * expert)
        self.assertLessEqual(_mapping_rss(f.mapping_address()), 2 * (expert + slack))
        f.release(*span[2])
        self.assertGreaterEqual(_mapping_rss(f.mapping_address()), expert)
        self.assertLessEqual(_mapping_rss(f.mapping_address()), expert + slack)
        self.assertTrue(torch.equal(f.get("e3.b"), torch.full((128, 1024), 3.0)))
        f.close()

    def _write_raw(self, header: bytes, data: bytes = b""):
        with open(self.path(), "wb") as fh:
            fh.write(struct.pack("<Q", len(header)) + header + data)

    def test_malformed(self):
        cases = [
            (b"", "shorter than the 8-byte header length", False),
            (b'{"a": 1', "not JSON", True),
            (b'[1, 2]', "not a JSON object", True),
            (b'{"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype", True),
            (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}', "needs 8", True),
            (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', "leaves a hole", True),
            (b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}', "runs past", True),
        ]
        for header, msg, framed in cases:
            if framed:
                self._write_raw(header, b"\0" * 8)
            else:
                with open(self.path(), "wb") as fh:
                    fh.write(b"\1\2")
            with self.assertRaisesRegex(ValueError, msg):
                SafetensorsFile(self.path())
        with open(self.path(), "wb") as fh:
            fh.write(struct.pack("<Q", 1 << 40))
        with self.assertRaisesRegex(ValueError, "exceeds the file"):
            SafetensorsFile(self.path())
        with self.assertRaisesRegex(FileNotFoundError, "cannot open"):
            SafetensorsFile(self.path("missing"))


class TestPolicy(TestCase):
    def test_lru(self):
        p = LRU()
        for e in (3, 1, 2, 3):
            p.touch(e)
        self.assertEqual(p.victim([1, 2, 3]), 1)
        self.assertEqual(p.victim([2, 3]), 2)

    def test_lfu(self):
        p = LFU()
        for e in (1, 1, 2, 3, 3, 3, 1):
            p.touch(e)
        self.assertEqual(p.victim([1, 2, 3]), 2)
        p.seed([0, 0, 10, 0])
        # 1 and 3 tie at three requests; 3 was touched less recently
        self.assertEqual(p.victim([1, 2, 3]), 3)
        # ties: the least recently used
        q = LFU()
        for e in (4, 5):
            q.touch(e)
        self.assertEqual(q.victim([5, 4]), 4)


def _cache(num_slots=2, loader=None, policy="lru"):
    torch.manual_seed(0)
    weights = {"w": torch.randn(E, 4, 3)}
    from torch_moe.nn.expert_store.tiers import HostTier
    tier = HostTier(pin_memory=False)
    tier.tensors["l"] = weights
    spec = ExpertSpec(E, {"w": (4, 3)}, torch.float32)
    return ExpertCache("l", spec, tier, num_slots, torch.device("cpu"), policy,
                       loader or InlineLoader()), weights["w"]


class TestCache(TestCase):
    def test_prefetch_never_evicts_pinned_slots(self):
        for loader in (InlineLoader(), ThreadLoader()):
            cache, w = _cache(num_slots=3, loader=loader)
            cache.begin_step([5])
            (slot,) = cache.acquire([5])
            # the step's reservation over, only the pin protects expert 5 while it is in use
            cache.finished([5])
            cache.end_step()
            # a flood of prefetches while expert 5 is in use: the two free slots only
            issued = cache.prefetch([0, 1, 2, 3, 4, 6, 7], NEXT_LAYER, next_step=True)
            self.assertEqual(issued, 2)
            cache.drain()
            self.assertTrue(torch.equal(cache.slots["w"][slot], w[5]))
            self.assertTrue(cache.resident(5))
            cache.release([slot])
            # released, expert 5 may go: three new experts take all three slots
            self.assertEqual(cache.prefetch([2, 3, 4], NEXT_LAYER, next_step=True), 3)
            cache.drain()
            self.assertFalse(cache.resident(5))
            loader.close()

    def test_loads_land_in_their_slots(self):
        cache, w = _cache(num_slots=2, loader=ThreadLoader())
        for step in ([1, 2], [3, 1], [4, 5], [1, 5]):
            cache.begin_step(step)
            slots = cache.acquire(step)
            for e, s in zip(step, slots):
                self.assertTrue(torch.equal(cache.slots["w"][s], w[e]))
            cache.release(slots)
            cache.finished(step)
            cache.end_step()
        self.assertEqual(cache.stats.hits, 2)
        self.assertEqual(cache.stats.misses, 6)
        cache.loader.close()

    def test_release_without_acquire(self):
        cache, _ = _cache()
        with self.assertRaisesRegex(RuntimeError, "released more often than acquired"):
            cache.release([0])


class TestLoader(TestCase):
    def test_readahead_advises_queued_loads(self):
        # Before a load runs, the loader advises the tier of the loads queued behind it (up to
        # readahead of them), each once, so that the disk reads them while it works.
        loader = ThreadLoader(readahead=2)
        self.addCleanup(loader.close)
        log, gate = [], threading.Event()
        tickets = [loader.submit(lambda nb: gate.wait(), advise=lambda: log.append(("advise", 0)))]
        for i in range(1, 6):
            tickets.append(loader.submit(lambda nb, i=i: log.append(("run", i)),
                                         advise=lambda i=i: log.append(("advise", i))))
        gate.set()
        for t in tickets:
            loader.wait(t)
        advised = [i for kind, i in log if kind == "advise"]
        self.assertEqual(sorted(advised), list(range(6)))
        for i in range(1, 6):
            # the two behind it were advised before it ran
            for j in range(i, min(i + 3, 6)):
                self.assertLess(log.index(("advise", j)), log.index(("run", i)), log)


    def test_tickets_wait_for_their_load_once_and_for_all(self):
        # a ticket is ready only once its load has run, wait() blocks until then, and both
        # stay so after any number of waits; an error in the load reaches the waiter
        loader = ThreadLoader()
        self.addCleanup(loader.close)
        gate, ran = threading.Event(), []
        self.addCleanup(gate.set)  # (cleanups run last first: before the loader's close)
        ticket = loader.submit(lambda nb: (gate.wait(), ran.append(1)))
        time.sleep(0.05)
        self.assertFalse(loader.ready(ticket))
        threading.Timer(0.05, gate.set).start()
        loader.wait(ticket)
        self.assertEqual(ran, [1])
        self.assertTrue(loader.ready(ticket))
        self.assertEqual(loader.wait(ticket), 0.0)
        self.assertTrue(loader.ready(ticket))

        def fail(nb):
            raise OSError("disk gone")

        ticket = loader.submit(fail)
        with self.assertRaisesRegex(RuntimeError, "loading an expert failed: disk gone"):
            loader.wait(ticket)
        self.assertTrue(loader.ready(ticket))

    def test_loads_carry_advice_only_to_a_tier_that_takes_it(self):
        # the loader looks for advice to give only while a queued load carries some: with huge
        # pages the file tier takes none, and the loads are queued without it
        for takes in (False, True):
            loader = ThreadLoader()
            self.addCleanup(loader.close)
            cache, _ = _cache(num_slots=4, loader=loader)
            advised, submit = [], loader.submit

            def spy(job, priority=0, slot_key=None, advise=None):
                advised.append(advise is not None)
                return submit(job, priority, slot_key, advise)

            loader.submit = spy
            cache.tier.takes_advice = takes
            cache.tier.advise = lambda layer, e, names: advised.append(("given", e))
            cache.begin_step([0, 1, 2])
            cache.release(cache.acquire([0, 1, 2]))
            cache.end_step()
            self.assertEqual([a for a in advised if a in (True, False)], [takes] * 3)
            self.assertEqual(sorted(a[1] for a in advised if isinstance(a, tuple)),
                             [0, 1, 2] if takes else [])
            self.assertEqual(loader._advised, 0)

    def test_hints_are_advised_once_and_run_nothing(self):
        loader = ThreadLoader(readahead=2)
        self.addCleanup(loader.close)
        log, gate = [], threading.Event()
        first = loader.submit(lambda nb: gate.wait())
        for i in range(3):
            loader.hint(lambda i=i: log.append(("hint", i)))
        last = loader.submit(lambda nb: log.append(("run", 0)))
        gate.set()
        loader.wait(first)
        loader.wait(last)
        loader.submit(lambda nb: None)  # one more turn of the loop, for the last hint
        loader.close()
        # each hint advised once (the first two within the readahead of the load queued in
        # front of them), and nothing else run for them
        self.assertEqual(sorted(log), [("hint", 0), ("hint", 1), ("hint", 2), ("run", 0)])
        self.assertLess(log.index(("hint", 1)), log.index(("run", 0)))

    def test_file_tier_hints_only_when_the_page_cache_may_keep_them(self):
        # and only where POSIX_FADV_WILLNEED is how the tier reads ahead: with huge pages it
        # would leave single-page folios behind (huge_pages False: a kernel without them)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "e.safetensors")
            write_safetensors(path, {"experts.0.w1": torch.randn(4, 4)})
            for drop, huge, calls in ((False, False, 1), (False, True, 0), (True, False, 0)):
                tier = FileTier(path, drop_page_cache=drop)
                tier.file.huge_pages = huge
                seen = []
                tier.file.advise = lambda off, n: seen.append((off, n))
                tier.hint("", 0, ["w1"])
                tier.advise("", 0, ["w1"])
                self.assertEqual(len(seen), calls + (not huge))
                self.assertEqual(tier.takes_hints, bool(calls))
                self.assertEqual(tier.takes_advice, not huge)
                tier.close()


def _mapped(address) -> bool:
    """Whether a mapping starts at ``address`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        return any(line.split("-", 1)[0] == f"{address:x}" for line in f
                   if "-" in line.split()[0] and not line.split()[0].endswith(":"))


def _mapping_rss(address) -> int:
    """Rss of the mapping that starts at ``address`` (bytes), from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                found = int(head.split("-")[0], 16) == address
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


@instantiate_parametrized_tests
class TestOffloadedMoE(_Files):
    """The offloaded model against the resident one: torch.equal, not allclose."""

    def _compare(self, model, cache_experts, policy="lru", prefetch="router", steps=2,
                 tokens=6, tier=None, shape=None, train_steps=0):
        path = self.path()
        save_experts(model, path)
        resident = model
        offloaded = copy.deepcopy(model)
        store = offload_experts(offloaded, path, cache_experts=cache_experts, policy=policy,
                                prefetch=prefetch, tier=tier)
        self.addCleanup(store.close)
        for p in resident.parameters():
            if p.dim() == 3:  # the routed experts: frozen in both
                p.requires_grad_(False)
        gen = torch.Generator().manual_seed(1)
        D = model.layers[0].config.dim
        for step in range(steps):
            x = torch.randn(shape or (tokens, D), generator=gen)
            outs, grads = [], []
            for m in (resident, offloaded):
                m.zero_grad(set_to_none=True)
                xi = x.clone().requires_grad_(True)
                with (torch_moe.cpu.expert_form("per_group") if m is resident
                      else contextlib.nullcontext()):
                    y = m(xi)
                    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
                outs.append(y.detach())
                grads.append({"x": xi.grad, **_trainable_grads(m)})
            self.assertTrue(torch.equal(outs[0], outs[1]),
                            f"step {step}: outputs differ by {(outs[0] - outs[1]).abs().max()}")
            self.assertEqual(grads[0].keys(), grads[1].keys())
            self.assertGreater(len(grads[0]), 1)
            for name in grads[0]:
                self.assertTrue(torch.equal(grads[0][name], grads[1][name]),
                                f"step {step}: grad of {name} differs by "
                                f"{(grads[0][name] - grads[1][name]).abs().max()}")
            # SGD on everything trainable, so that the next step compares the trained models
            for _ in range(train_steps):
                for m in (resident, offloaded):
                    with torch.no_grad():
                        for p in m.parameters():
                            if p.grad is not None:
                                p -= 0.1 * p.grad
        stats = store.stats()
        # no expert is read twice for one step, and every byte moved is a whole expert
        self.assertLessEqual(stats.max_reads_per_step, 1)
        spec = store.caches[next(iter(store.caches))].spec
        self.assertEqual(stats.bytes_moved, stats.loads * spec.nbytes())
        self.assertEqual(stats.requests, stats.hits + stats.misses)
        if prefetch is None:
            # on demand only: exactly one load per miss (no resident expert is evicted and
            # read again within its step)
            self.assertEqual(stats.loads, stats.misses)
        return store

    @parametrize("cache_experts", [1, 2, 5, E])
    @parametrize("policy", ["lru", "lfu"])
    @parametrize("prefetch", [None, "router", "previous"])
    def test_exact(self, cache_experts, policy, prefetch):
        torch.manual_seed(0)
        model = _Model(num_shared_experts=1, top_k=3)
        self._compare(model, cache_experts, policy, prefetch)

    @parametrize("policy", ["lru", "lfu"])
    def test_exact_every_cache_size(self, policy):
        # every cache size from one expert per layer to all of them (router prefetch, an SGD
        # step after each step): below the 6 or so experts a step of 6 tokens at top-3 needs,
        # a step computes its experts in several calls
        for cache_experts in range(1, E + 1):
            with self.subTest(cache_experts=cache_experts):
                torch.manual_seed(0)
                self._compare(_Model(top_k=3), cache_experts, policy, steps=3, train_steps=1)

    @parametrize("cache_experts", [1, 3, E])
    @parametrize("top_k", [1, 2, E])
    def test_exact_top_k(self, cache_experts, top_k):
        torch.manual_seed(0)
        self._compare(_Model(top_k=top_k), cache_experts, tokens=9)

    @parametrize("variant", ["fused_gate_up", "ffn_bias", "gelu", "relu", "capacity",
                             "gated_shared",
                             "batched", "decode"])
    def test_exact_variants(self, variant):
        kw, extra = {}, {}
        if variant == "fused_gate_up":
            kw = dict(fused_gate_up=True)
        elif variant == "ffn_bias":
            kw = dict(ffn_bias=True)
        elif variant in ("gelu", "relu"):
            kw = dict(activation=variant)
        elif variant == "capacity":
            kw = dict(capacity_factor=0.5)
        elif variant == "gated_shared":
            kw = dict(num_shared_experts=2, shared_expert_gate=True, score_func="sigmoid",
                      normalize_topk=True)
        elif variant == "batched":
            extra = dict(shape=(2, 5, 16))
        elif variant == "decode":
            extra = dict(tokens=1, steps=4)
        torch.manual_seed(0)
        model = _Model(**kw)
        if variant == "ffn_bias":
            with torch.no_grad():
                for layer in model.layers:
                    for b in layer.experts.biases().values():
                        b.normal_()
        for cache_experts in (1, 3, E):
            self._compare(copy.deepcopy(model), cache_experts, **extra)

    @parametrize("activation", ["swiglu_oai", "geglu"])
    def test_within_rounding(self, activation):
        # Not bit-identical, by up to an ulp: these activations run elementwise kernels over the
        # whole block buffer whose result depends on an element's position in it (torch.sigmoid's
        # vector body and scalar tail differ in the last bit), and the store computes each expert
        # on its own rows, the resident kernel a block of several experts' rows.
        torch.manual_seed(0)
        model = _Model(activation=activation, ffn_bias=activation == "swiglu_oai")
        path = self.path()
        save_experts(model, path)
        for cache_experts in (1, 3, E):
            offloaded = copy.deepcopy(model)
            store = offload_experts(offloaded, path, cache_experts=cache_experts)
            self.addCleanup(store.close)
            x = torch.randn(6, 16, generator=torch.Generator().manual_seed(1))
            with torch.no_grad(), torch_moe.cpu.expert_form("per_group"):
                y = model(x)
            with torch.no_grad():
                y_off = offloaded(x)
            torch.testing.assert_close(y_off, y, rtol=4 * 2**-23, atol=1e-7)

    def test_exact_bf16_forward(self):
        # bf16 experts: the unweighted outputs are kept in fp32 and weighted there, as the
        # resident kernel weights them, whether the CPU's GEMMs run in bf16 or in fp32
        torch.manual_seed(0)
        model = _Model(num_shared_experts=1).to(torch.bfloat16)
        path = self.path()
        save_experts(model, path)
        x = torch.randn(7, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.no_grad(), torch_moe.cpu.expert_form("per_group"):
            y = model(x)
        for cache_experts in (1, 3, E):
            offloaded = copy.deepcopy(model)
            store = offload_experts(offloaded, path, cache_experts=cache_experts)
            self.addCleanup(store.close)
            with torch.no_grad():
                self.assertTrue(torch.equal(offloaded(x), y), f"cache {cache_experts}")

    @parametrize("form", ["auto", "batched"])
    def test_exact_whatever_the_process_form(self, form):
        # The store fixes the per-group form for its own kernel calls, over a process-wide
        # choice of another form.
        # (K = 1024: at this depth bmm and mm sum in different orders on x86 MKL, so a store
        # computing in the process's form would differ)
        self.addCleanup(torch_moe.cpu.set_expert_form, torch_moe.cpu.get_expert_form())
        torch_moe.cpu.set_expert_form(form)
        torch.manual_seed(0)
        for cache_experts in (3, E):
            self._compare(_Model(layers=2, dim=1024, hidden_dim=32, top_k=2), cache_experts,
                          tokens=64)

    def test_auto_form_within_rounding(self):
        # The resident layer in the auto form batches runs of small similar experts, whose bmm
        # may sum in another order than the store's per-group GEMMs: fp32 rounding, no more.
        torch.manual_seed(0)
        # (K = 1024: at this depth bmm and mm sum in different orders on x86 MKL)
        model = _Model(layers=1, dim=1024, hidden_dim=32, top_k=2)
        path = self.path()
        save_experts(model, path)
        offloaded = copy.deepcopy(model)
        store = offload_experts(offloaded, path, cache_experts=3)
        self.addCleanup(store.close)
        x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y_off, y_per_group = offloaded(x), model(x)
            with torch_moe.cpu.expert_form("auto"):
                y_auto = model(x)
        self.assertTrue(torch.equal(y_off, y_per_group))
        torch.testing.assert_close(y_off, y_auto, rtol=1.3e-6, atol=1e-5)

    @unittest.skipUnless(os.path.exists("/proc/self/smaps"), "needs /proc/self/smaps")
    def test_file_tier_resident_set_is_the_cache(self):
        # A CPU cache over the file maps its experts in place: after any step the mapping's
        # resident pages are those of the experts in the cache's slots, and never the whole
        # file. (Experts of whole pages: 768 KiB each, 24 in the file.) Mapping a page in maps
        # the neighbours the page cache holds too, the kernel's fault-around (64 KiB by
        # default): up to that much on either side of each expert.
        torch.manual_seed(0)
        for prefetch in (None, "router"):
            store = self._compare(_Model(dim=256, hidden_dim=256), 2, prefetch=prefetch,
                                  steps=3, tokens=5)
            address = store.tier.file.mapping_address()
            spec = store.caches["layers.0"].spec
            rss = _mapping_rss(address)
            self.assertGreater(rss, 0)
            self.assertEqual(store.slot_bytes(), 3 * 2 * spec.nbytes())
            self.assertLessEqual(rss, store.slot_bytes() + 3 * 2 * 2 * (64 << 10))
            self.assertLess(rss, 24 * spec.nbytes() / 2)
            self.assertTrue(all(c.mapped for c in store.caches.values()))

    def test_exact_host_tier(self):
        torch.manual_seed(0)
        for prefetch in (None, "router"):
            self._compare(_Model(num_shared_experts=1), 2, prefetch=prefetch, tier="host")

    def test_exact_while_training(self):
        # a few SGD steps of everything trainable: both models stay bit-identical
        torch.manual_seed(0)
        self._compare(_Model(num_shared_experts=1, load_balance_coeff=0.01), 2, steps=3,
                      train_steps=1)

    def test_stats(self):
        torch.manual_seed(0)
        store = self._compare(_Model(), E, steps=3, prefetch=None)
        s = store.stats()
        # all experts fit: after the first forward nothing is loaded again
        self.assertEqual(s.loads, s.misses)
        self.assertLessEqual(s.loads, 3 * E)
        self.assertGreater(s.hits, 0)
        per_layer = store.stats(per_layer=True)
        self.assertEqual(sorted(per_layer), ["layers.0", "layers.1", "layers.2"])
        store.reset_stats()
        self.assertEqual(store.stats().requests, 0)

    def test_router_prefetch_hits(self):
        torch.manual_seed(0)
        store = self._compare(_Model(layers=4), 4, steps=3, tokens=1, prefetch="router")
        s = store.stats()
        self.assertGreater(s.prefetches, 0)
        self.assertGreater(s.prefetch_hits, 0)

    def test_load_experts_round_trip(self):
        torch.manual_seed(0)
        model = _Model(num_shared_experts=1)
        before = copy.deepcopy(model.state_dict())
        path = self.path()
        save_experts(model, path)
        store = offload_experts(model, path, cache_experts=2)
        self.assertIsInstance(model.layers[0].experts, OffloadedExperts)
        self.assertFalse(any(".experts." in n for n, _ in model.named_parameters()))
        load_experts(model, path)
        store.close()
        after = model.state_dict()
        self.assertEqual(before.keys(), after.keys())
        for k in before:
            self.assertTrue(torch.equal(before[k], after[k]), k)


class TestErrors(_Files):
    def _saved(self, **kw):
        torch.manual_seed(0)
        model = _Model(**kw)
        save_experts(model, self.path())
        return model

    def test_cache_size(self):
        model = self._saved()
        for bad, err, msg in ((0, ValueError, r"cache_experts >= 1"),
                              (E + 1, ValueError, r"cache_experts in \[1, 8\]"),
                              (True, TypeError, "cache_experts to be an int"),
                              (2.0, TypeError, "cache_experts to be an int")):
            with self.assertRaisesRegex(err, msg):
                offload_experts(copy.deepcopy(model), self.path(), cache_experts=bad)

    def test_options(self):
        model = self._saved()
        with self.assertRaisesRegex(ValueError, "policy in"):
            offload_experts(model, self.path(), cache_experts=2, policy="fifo")
        with self.assertRaisesRegex(ValueError, "prefetch in"):
            offload_experts(model, self.path(), cache_experts=2, prefetch="oracle")
        with self.assertRaisesRegex(ValueError, "tier 'file', 'host'"):
            offload_experts(model, self.path(), cache_experts=2, tier="disk")
        with self.assertRaisesRegex(ValueError, "drop_page_cache applies to the file tier"):
            offload_experts(model, self.path(), cache_experts=2, tier="host",
                            drop_page_cache=True)
        with self.assertRaisesRegex(ValueError, "holds no torch_moe.nn.MoE"):
            offload_experts(nn.Linear(2, 2), self.path(), cache_experts=1)

    def test_file_mismatch(self):
        self._saved()
        with self.assertRaisesRegex(ValueError, r"expects torch.float32 \[16, 4\]"):
            offload_experts(_Model(hidden_dim=4), self.path(), cache_experts=2)
        with self.assertRaisesRegex(ValueError, "torch.float32 .* but the layer expects torch.float64"):
            offload_experts(_Model().double(), self.path(), cache_experts=2)
        with self.assertRaisesRegex(KeyError, "misses 'layers.0.experts.8.w1'"):
            offload_experts(_Model(num_experts=12), self.path(), cache_experts=2)
        with self.assertRaisesRegex(ValueError, "holds more than the 4 experts"):
            offload_experts(_Model(num_experts=4), self.path(), cache_experts=2)
        with self.assertRaisesRegex(KeyError, "holds no experts of layer 'layers.3'"):
            offload_experts(_Model(layers=4), self.path(), cache_experts=2)
        with self.assertRaisesRegex(FileNotFoundError, "cannot open"):
            offload_experts(_Model(), self.path("nope"), cache_experts=2)

    def test_frozen(self):
        model = self._saved()
        # the host tier: slots the cache owns (a mapped slot is a view no caller sees)
        store = offload_experts(model, self.path(), cache_experts=2, tier="host")
        self.addCleanup(store.close)
        store.caches["layers.1"].slots["w2"].requires_grad_(True)
        with self.assertRaisesRegex(RuntimeError, "are frozen, but slots\\['w2'\\] requires grad"):
            model(torch.randn(3, 16))

    def test_already_offloaded_and_precision(self):
        model = self._saved()
        store = offload_experts(model, self.path(), cache_experts=2)
        self.addCleanup(store.close)
        with self.assertRaisesRegex(TypeError, "already offloaded"):
            offload_experts(model, self.path(), cache_experts=2)
        with self.assertRaisesRegex(TypeError, "already offloaded"):
            save_experts(model, self.path("again"))
        with self.assertRaisesRegex(NotImplementedError, "precision='fp8_rowwise'"):
            offload_experts(_Model(precision="fp8_rowwise"), self.path(), cache_experts=2)

    def test_seed_frequencies(self):
        model = self._saved()
        store = offload_experts(model, self.path(), cache_experts=2, policy="lfu")
        self.addCleanup(store.close)
        store.seed_frequencies("layers.0", torch.arange(E))
        with self.assertRaisesRegex(ValueError, "finite, non-negative"):
            store.seed_frequencies("layers.0", torch.tensor([float("nan")] * E))
        with self.assertRaisesRegex(ValueError, "finite, non-negative"):
            store.seed_frequencies("layers.0", -torch.ones(E))
        with self.assertRaisesRegex(ValueError, r"expected counts \[8\]"):
            store.seed_frequencies("layers.0", torch.ones(3))
        with self.assertRaisesRegex(KeyError, "no offloaded layer 'layers.9'"):
            store.seed_frequencies("layers.9", torch.ones(E))

    def test_bad_routing(self):
        model = self._saved()
        store = offload_experts(model, self.path(), cache_experts=2)
        self.addCleanup(store.close)
        experts = model.layers[0].experts
        x = torch.randn(2, 16)
        w = torch.ones(2, 2)
        with self.assertRaisesRegex(ValueError, r"expected offs \[8\]"):
            experts(x, torch.arange(4), torch.tensor([4], dtype=torch.int32), w)
        with self.assertRaisesRegex(ValueError, "non-decreasing"):
            experts(x, torch.arange(4), torch.tensor([3, 1, 4, 4, 4, 4, 4, 4], dtype=torch.int32), w)
        with self.assertRaisesRegex(ValueError, "exceeds the 4 sorted slots"):
            experts(x, torch.arange(4), torch.full((8,), 5, dtype=torch.int32), w)
        with self.assertRaisesRegex(ValueError, r"sorted_ids in \[0, T \* k\)"):
            experts(x, torch.tensor([0, 1, 2, 9]), torch.full((8,), 4, dtype=torch.int32), w)


if __name__ == "__main__":
    run_tests()
