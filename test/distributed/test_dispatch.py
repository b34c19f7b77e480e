# Owner(s): ["module: moe"]
"""Expert-parallel dispatch (``torch_moe.distributed.dispatch``) under the threaded process group.

One thread per rank (``MultiThreadedTestCase``): the collectives are real exchanges between the
threads, so the dispatch logic (row planning, deduplication, chunking, capacity, counters,
collective errors) runs at 2, 4 and 64 ranks (the last takes about half a minute; at 256 ranks
the plan is checked in one process with a simulated exchange). Every rank
builds the same global data from a per-thread generator (the global RNG is shared by the
threads) and compares its slice with the single-process ``moe_ffn``. Real gloo processes are in
``test_dispatch_gloo.py``.

Run: ``python -m pytest test/distributed/test_dispatch.py -q`` from the repo root.
"""

import math
import threading

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.utils._python_dispatch import TorchDispatchMode

import torch_moe  # noqa: F401
from torch_moe.distributed._dispatch_plan import rank_limited_topk, send_counts
from torch_moe.distributed.dispatch import (
    _order_rows,
    _pack,
    expert_parallel_moe_ffn,
    read_dispatch_counters,
    reset_dispatch_counters,
)
from torch_moe.nn.functional import moe_ffn

TOL = {"atol": 1e-6, "rtol": 1e-5}


def _global_data(E, D, F, T, k, R, seed=0, gated=True, scores=None):
    """Tokens of all R ranks (T each), distinct top-k ids, weights, and expert weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R * T, D, generator=g)
    if scores is None:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(R * T)]) if T \
            else torch.empty(0, k, dtype=torch.int64)
    else:
        ids = scores
    w = torch.rand(R * T, k, generator=g)
    w1 = torch.randn(E, D, F, generator=g) / D**0.5
    w2 = torch.randn(E, F, D, generator=g) / F**0.5
    w3 = torch.randn(E, D, F, generator=g) / D**0.5 if gated else None
    return x, ids, w, w1, w2, w3


class _Base(MultiThreadedTestCase):
    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def _compare(self, E, D, F, T, k, ids=None, gated=True, seed=0, backward=True, **options):
        """This rank's output and gradients against moe_ffn on the full data."""
        R, rank = dist.get_world_size(), dist.get_rank()
        G = E // R
        x, topk_ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, R, seed, gated, ids)
        ref = [t.clone().requires_grad_() if t is not None else None for t in (x, w, w1, w2, w3)]
        ref_out = moe_ffn(ref[0], topk_ids, ref[1], ref[2], ref[3], ref[4],
                          activation="swiglu" if gated else "gelu")
        grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed + 1))
        if backward:
            ref_out.backward(grad)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        local = [t[s].clone().requires_grad_() if t is not None else None
                 for t, s in zip((x, w, w1, w2, w3), (mine, mine, experts, experts, experts))]
        out = expert_parallel_moe_ffn(local[0], topk_ids[mine], local[1], *local[2:],
                                      num_experts=E, activation="swiglu" if gated else "gelu",
                                      **options)
        self.assertEqual(out, ref_out[mine], **TOL)
        if backward:
            out.backward(grad[mine])
            for name, lt, rt, s in zip(("x", "weights", "w1", "w2", "w3"), local, ref,
                                       (mine, mine, experts, experts, experts)):
                if lt is not None:
                    self.assertEqual(lt.grad, rt.grad[s], **TOL, msg=f"grad of {name}")
        return topk_ids, mine


class TestDispatch4Ranks(_Base):
    @property
    def world_size(self):
        return 4

    def test_modes_match_moe_ffn_forward_and_backward(self):
        for options in ({}, {"dedup": True}, {"num_chunks": 3}, {"dedup": True, "num_chunks": 2},
                        {"capacity_factor": 8.0}, {"capacity_factor": 8.0, "dedup": True,
                                                   "num_chunks": 2}):
            with self.subTest(**options):
                self._compare(E=8, D=8, F=6, T=10, k=3, **options)
        self._compare(E=8, D=8, F=6, T=10, k=3, gated=False, dedup=True)

    def test_chunks_larger_than_tokens_and_no_tokens(self):
        self._compare(E=8, D=4, F=4, T=2, k=2, num_chunks=5)
        self._compare(E=8, D=4, F=4, T=0, k=2, dedup=True)

    def test_counters_plain_and_dedup(self):
        E, D, F, T, k = 8, 8, 6, 12, 4
        R, rank, G = 4, dist.get_rank(), 2
        for dedup in (False, True):
            reset_dispatch_counters()
            topk_ids, mine = self._compare(E, D, F, T, k, dedup=dedup, backward=False)
            c = read_dispatch_counters()
            sent = send_counts(topk_ids[mine], E, R, dedup)  # [R], own copies included
            received = sum(send_counts(topk_ids[r * T:(r + 1) * T], E, R, dedup)[rank]
                           for r in range(R))
            W = min(k, G) if dedup else 1
            row_bytes, back_bytes = D * 4 + W * 8, D * 4
            remote_sent = int(sent.sum() - sent[rank])
            remote_recv = int(received - send_counts(topk_ids[mine], E, R, dedup)[rank])
            self.assertEqual(c["calls"], 1)
            self.assertEqual(c["rows_sent"], int(sent.sum()))
            self.assertEqual(c["rows_received"], int(received))
            self.assertEqual(c["rows_sent_remote"], remote_sent)
            self.assertEqual(c["rows_received_remote"], remote_recv)
            self.assertEqual(c["bytes_sent"], remote_sent * row_bytes + remote_recv * back_bytes)
            self.assertEqual(c["bytes_received"], remote_recv * row_bytes + remote_sent * back_bytes)
            self.assertEqual(c["last_expert_load"], torch.bincount(
                topk_ids.flatten(), minlength=E)[rank * G:(rank + 1) * G].tolist())
            if dedup:
                self.assertLess(c["rows_sent"], plain_rows)
            plain_rows = c["rows_sent"]

    def test_rank_limited_routing_bounds_copies(self):
        # every token's experts on at most m = 2 of the 4 ranks: dedup sends <= 2 rows per token
        E, T, k, m = 16, 16, 4, 2
        g = torch.Generator().manual_seed(3)
        scores = torch.randn(4 * T, E, generator=g)
        topk_ids = rank_limited_topk(scores, k, 4, m)[0]
        reset_dispatch_counters()
        self._compare(E, D=8, F=4, T=T, k=k, ids=topk_ids, dedup=True)
        self.assertLessEqual(read_dispatch_counters()["rows_sent"], T * m)

    def test_capacity_mode_drops_overflow_rows(self):
        # capacity C = ceil(0.5 * T * k / R) = 3 rows per (source, destination); the rows are
        # kept in token order, so the reference zeroes the weights of the later ones
        E, D, F, T, k, R = 8, 4, 4, 12, 2, 4
        rank, G = dist.get_rank(), 2
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, R, seed=5)
        C = math.ceil(0.5 * T * k / R)
        kept_w = w.clone()
        dropped = 0
        for src in range(R):
            used = [0] * R
            for t in range(src * T, (src + 1) * T):
                for j in range(k):  # plain: one row per assignment, in (token, slot) order
                    d = int(ids[t, j]) // G
                    if used[d] >= C:
                        kept_w[t, j] = 0
                        dropped += src == rank
                    used[d] += 1
        ref = moe_ffn(x, ids, kept_w, w1, w2, w3)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        reset_dispatch_counters()
        out = expert_parallel_moe_ffn(x[mine], ids[mine], w[mine], w1[experts], w2[experts],
                                      w3[experts], num_experts=E, capacity_factor=0.5)
        self.assertEqual(out, ref[mine], **TOL)
        c = read_dispatch_counters()
        self.assertEqual(c["dropped"], dropped)
        self.assertEqual(c["rows_sent"], T * k - dropped)
        wire = (R - 1) * C * (D * 4 + 8 + D * 4)
        self.assertEqual((c["bytes_sent"], c["bytes_received"]), (wire, wire))

    def test_ids_out_of_range_raise_on_every_rank(self):
        E, T, k = 8, 4, 2
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        rank = dist.get_rank()
        mine = ids[rank * T:(rank + 1) * T].clone()
        if rank == 2:
            mine[1, 0] = E  # only rank 2 is wrong; the others must not wait for it
        with self.assertRaisesRegex(ValueError, r"expected expert ids in \[0, 8\), but ranks "
                                    r"\[2\] of the expert-parallel group"):
            expert_parallel_moe_ffn(x[:T], mine, w[:T], w1[:2], w2[:2], w3[:2], num_experts=E)

    def test_ranks_disagreeing_on_the_layer_raise_on_every_rank(self):
        E, T, k = 8, 4, 2
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        rank = dist.get_rank()
        with self.assertRaisesRegex(ValueError, "disagree on the layer: pairs per row"):
            expert_parallel_moe_ffn(x[:T], ids[:T], w[:T], w1[:2], w2[:2], w3[:2],
                                    num_experts=E, dedup=rank == 0)
        d = 4 if rank == 0 else 3  # ranks 1-3 pass a model dim of 3
        with self.assertRaisesRegex(ValueError, "disagree on the layer: dim"):
            expert_parallel_moe_ffn(x[:T, :d], ids[:T], w[:T], w1[:2, :d], w2[:2, :, :d],
                                    w3[:2, :d], num_experts=E)

    def test_bad_arguments(self):
        x, ids, w, w1, w2, w3 = _global_data(8, 4, 4, 4, 2, 1)
        cases = [
            (dict(num_experts=6), "num_experts=6 is not divisible by the 4 ranks"),
            (dict(num_experts=8, num_chunks=0), "expected num_chunks to be a positive int"),
            (dict(num_experts=8, capacity_factor=-1.0), "expected capacity_factor > 0"),
        ]
        for kwargs, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                expert_parallel_moe_ffn(x, ids, w, w1[:2], w2[:2], w3[:2], **kwargs)
        with self.assertRaisesRegex(ValueError, r"expected w1_local \[2, 4, F\]"):
            expert_parallel_moe_ffn(x, ids, w, w1[:3], w2[:2], w3[:2], num_experts=8)
        with self.assertRaisesRegex(ValueError, r"expected topk_ids and topk_weights of the same"):
            expert_parallel_moe_ffn(x, ids, w[:, :1], w1[:2], w2[:2], w3[:2], num_experts=8)
        with self.assertRaisesRegex(ValueError, "expected w2_local on cpu in torch.float32"):
            expert_parallel_moe_ffn(x, ids, w, w1[:2], w2[:2].double(), w3[:2], num_experts=8)


_forbid = threading.local()


class _HostReads(TorchDispatchMode):
    """Counts ``.item()`` / ``int()`` style reads (``_local_scalar_dense``) in this thread,
    outside the ``torch_moe`` kernels: the CPU kernels read their offsets on the host, which on
    a GPU happens on the device."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func.namespace != "torch_moe":
            return func(*args, **(kwargs or {}))
        _forbid.in_kernel = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            _forbid.in_kernel = False


class TestCapacityModeHasNoHostSync(_Base):
    """``Tensor.tolist`` does not go through the dispatcher, so it is wrapped for the test."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        self._tolist = torch.Tensor.tolist
        counted = self._tolist

        def tolist(t):
            if not getattr(_forbid, "in_kernel", False):
                _forbid.tolists = getattr(_forbid, "tolists", 0) + 1
            return counted(t)

        torch.Tensor.tolist = tolist
        super().setUp()

    def tearDown(self):
        torch.Tensor.tolist = self._tolist
        super().tearDown()

    def _host_reads(self, **options):
        x, ids, w, w1, w2, w3 = _global_data(4, 4, 4, 6, 2, 1)
        _forbid.tolists = 0
        with _HostReads() as mode:
            expert_parallel_moe_ffn(x, ids, w, w1[:2], w2[:2], w3[:2], num_experts=4, **options)
        return mode.reads + _forbid.tolists

    def test_capacity_mode_reads_nothing_on_the_host(self):
        self.assertGreater(self._host_reads(), 0)  # the synchronising mode is seen
        self.assertEqual(self._host_reads(capacity_factor=2.0, num_chunks=2, dedup=True), 0)


class TestDispatchAtScale(_Base):
    """DeepSeek-V3-like routing (E = 256, k = 8) over 64 ranks; every mode against moe_ffn."""

    @property
    def world_size(self):
        return 64

    def test_deepseek_like_routing_on_64_ranks(self):
        E, T, k = 256, 4, 8
        for options in ({"dedup": True}, {"capacity_factor": 16.0}):
            reset_dispatch_counters()
            topk_ids, mine = self._compare(E, D=4, F=2, T=T, k=k, backward=False, **options)
            dedup = options.get("dedup", False)
            self.assertEqual(read_dispatch_counters()["rows_sent"],
                             int(send_counts(topk_ids[mine], E, 64, dedup).sum()))


class TestDispatchPlan256Ranks(TestCase):
    """The row plan at 256 ranks (E = 512, k = 8), in one process: a thread per rank costs
    minutes at this size, so the exchange is simulated by slicing every rank's send buffer and
    the experts run per receiving rank as the dispatcher runs them."""

    def test_plan_exchange_and_combine_on_256_ranks(self):
        E, D, F, T, k, R = 512, 4, 2, 2, 8, 256
        G = E // R
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, R)
        ref = moe_ffn(x, ids, w, w1, w2, w3)
        for dedup in (False, True):
            W = min(k, G) if dedup else 1
            plans = [_order_rows(ids[r * T:(r + 1) * T], G, R, dedup) for r in range(R)]
            counts = torch.stack([p[-1] for p in plans])  # [source, destination]
            self.assertEqual(counts, torch.stack([send_counts(ids[r * T:(r + 1) * T], E, R, dedup)
                                                  for r in range(R)]))
            chunks = [_pack(ids[r * T:(r + 1) * T], w[r * T:(r + 1) * T], plans[r], G, R, W,
                            None, (counts[r].tolist(), counts[:, r].tolist()))
                      for r in range(R)]
            starts = torch.cumsum(counts, 1) - counts  # [source, destination] row offsets
            back = [torch.zeros(int(counts[r].sum()), D) for r in range(R)]
            for dst in range(R):
                pieces = [(src, int(starts[src, dst]), int(counts[src, dst])) for src in range(R)]
                rows = torch.cat([x[src * T:(src + 1) * T].index_select(
                    0, chunks[src].token_N[a:a + n]) for src, a, n in pieces])
                rid = torch.cat([chunks[src].ids_NW[a:a + n] for src, a, n in pieces])
                rw = torch.cat([chunks[src].weights_NW[a:a + n] for src, a, n in pieces])
                sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(rid, G + 1)
                out, _ = torch.ops.torch_moe.grouped_ffn(
                    rows, sorted_ids, offs[:G], rw, w1[dst * G:(dst + 1) * G],
                    w2[dst * G:(dst + 1) * G], w3[dst * G:(dst + 1) * G], "swiglu", 1.702, 7.0)
                at = 0
                for src, a, n in pieces:
                    back[src][a:a + n] = out[at:at + n]
                    at += n
            y = torch.cat([torch.zeros(T, D).index_add(0, chunks[r].token_N, back[r])
                           for r in range(R)])
            self.assertEqual(y, ref, **TOL)


if __name__ == "__main__":
    run_tests()
