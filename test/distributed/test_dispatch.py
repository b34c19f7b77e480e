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

import copy
import math
import re
import threading

import torch
import torch._dynamo
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.testing._internal.common_utils import run_tests, TestCase
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase
from torch.utils._python_dispatch import TorchDispatchMode

import torch_moe  # noqa: F401
from torch_moe.distributed._dispatch_plan import rank_limited_topk, send_counts
from torch_moe.distributed.dispatch import (
    _Layer,
    _order_rows,
    _pack,
    _Splits,
    expert_parallel_moe_ffn,
    read_dispatch_counters,
    reset_dispatch_counters,
)
from torch_moe.distributed.parallel import ExpertParallel
from torch_moe.nn.functional import moe_ffn

from _parallel_style_common import global_tokens, make_moe

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

    def _raises_the_same_on_every_rank(self, exc_type, regex, fn):
        """``fn`` raises ``exc_type`` matching ``regex`` here, with the message of every rank."""
        with self.assertRaisesRegex(exc_type, regex) as ctx:
            fn()
        messages = [None] * dist.get_world_size()
        dist.all_gather_object(messages, str(ctx.exception))
        self.assertEqual(len(set(messages)), 1, msg=messages)

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
        with self.assertRaisesRegex(ValueError, r"pass the same dedup, but got True on ranks "
                                    r"\[0\] and False on ranks \[1, 2, 3\]; the same pairs "
                                    r"per row W"):
            expert_parallel_moe_ffn(x[:T], ids[:T], w[:T], w1[:2], w2[:2], w3[:2],
                                    num_experts=E, dedup=rank == 0)
        d = 4 if rank == 0 else 3  # ranks 1-3 pass a model dim of 3
        with self.assertRaisesRegex(ValueError, r"pass the same x.size\(1\), but got 4 on ranks "
                                    r"\[0\] and 3 on ranks \[1, 2, 3\]"):
            expert_parallel_moe_ffn(x[:T, :d], ids[:T], w[:T], w1[:2, :d], w2[:2, :, :d],
                                    w3[:2, :d], num_experts=E)

    def test_ranks_disagreeing_on_num_chunks_raise_the_same_error(self):
        E, T, k = 8, 4, 2
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        rank = dist.get_rank()
        for capacity_factor in (None, 2.0):
            self._raises_the_same_on_every_rank(
                ValueError, r"expected every rank of the expert-parallel group to pass the same "
                r"num_chunks, but got 1 on ranks \[0\] and 2 on ranks \[1, 2, 3\]",
                lambda: expert_parallel_moe_ffn(
                    x[:T], ids[:T], w[:T], w1[:2], w2[:2], w3[:2], num_experts=E,
                    num_chunks=1 if rank == 0 else 2, capacity_factor=capacity_factor))

    def test_capacity_mode_ranks_disagreeing_on_the_layer_raise_the_same_error(self):
        E, D, T, k = 8, 4, 4, 2
        x, ids, w, w1, w2, w3 = _global_data(E, D, 4, T, k, 4)
        rank = dist.get_rank()
        ws = (w1[:2], w2[:2], w3[:2])
        d = D if rank == 0 else D - 1
        cases = [
            (r"x.size\(1\), but got 4 on ranks \[0\] and 3 on ranks \[1, 2, 3\]",
             (x[:T, :d], ids[:T], w[:T], ws[0][:, :d], ws[1][:, :, :d], ws[2][:, :d]), {}),
            (r"x.dtype, but got torch.float64 on ranks \[0\] and torch.float32 on ranks",
             (x[:T].double(), ids[:T], w[:T], *(t.double() for t in ws)) if rank == 0
             else (x[:T], ids[:T], w[:T], *ws), {}),
            (r"capacity_factor, but got 4.0 on ranks \[0\] and 2.0 on ranks \[1, 2, 3\]",
             (x[:T], ids[:T], w[:T], *ws), {"capacity_factor": 4.0 if rank == 0 else 2.0}),
            (r"capacity_factor, but got None on ranks \[0\] and 2.0 on ranks \[1, 2, 3\]",
             (x[:T], ids[:T], w[:T], *ws), {"capacity_factor": None if rank == 0 else 2.0}),
            (r"dedup, but got True on ranks \[0\] and False on ranks \[1, 2, 3\]",
             (x[:T], ids[:T], w[:T], *ws), {"dedup": rank == 0}),
            (r"activation, but got 'gelu' on ranks \[0\] and 'swiglu' on ranks \[1, 2, 3\]",
             (x[:T], ids[:T], w[:T], *ws[:2], None if rank == 0 else ws[2]),
             {"activation": "gelu" if rank == 0 else "swiglu"}),
        ]
        for regex, args, options in cases:
            options = {"capacity_factor": 2.0, **options}
            with self.subTest(regex):
                # every case runs after the errors of the ones before: the group stays in step
                self._raises_the_same_on_every_rank(
                    ValueError, "expected every rank of the expert-parallel group to pass the "
                    "same " + regex,
                    lambda: expert_parallel_moe_ffn(*args, num_experts=E, **options))

    def test_capacity_mode_ids_out_of_range_raise_on_every_rank(self):
        E, T, k = 8, 4, 2
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        rank = dist.get_rank()
        mine = ids[rank * T:(rank + 1) * T].clone()
        if rank == 2:
            mine[1, 0] = -1
        # the flag travels with the signature and is asserted on the device of every rank
        self._raises_the_same_on_every_rank(
            RuntimeError, r"expected expert ids in \[0, 8\)",
            lambda: expert_parallel_moe_ffn(x[:T], mine, w[:T], w1[:2], w2[:2], w3[:2],
                                            num_experts=E, capacity_factor=2.0))

    def test_dedup_duplicate_ids_raise_on_every_rank(self):
        # G = 2 experts per rank and k = 3: a token with distinct ids has at most 2 pairs in
        # its row for a rank; [0, 0, 1] would need 3
        E, T, k = 8, 4, 3
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        rank = dist.get_rank()
        mine = ids[rank * T:(rank + 1) * T].clone()
        if rank == 1:
            mine[2] = torch.tensor([0, 0, 1])
        for capacity_factor, exc_type in ((None, ValueError), (2.0, RuntimeError)):
            self._raises_the_same_on_every_rank(
                exc_type, r"expected distinct expert ids per token",
                lambda: expert_parallel_moe_ffn(x[:T], mine, w[:T], w1[:2], w2[:2], w3[:2],
                                                num_experts=E, dedup=True,
                                                capacity_factor=capacity_factor))

    def test_capacity_mode_with_different_token_counts_per_rank(self):
        # T_r = 2 r + 1 tokens on rank r (rank 0: 1 token); capacity 8.0 drops nothing, so the
        # result is moe_ffn's; each source pads its rows for a destination to its own capacity
        E, D, F, k, R = 8, 4, 4, 2, 4
        rank, G = dist.get_rank(), 2
        counts = [2 * r + 1 for r in range(R)]
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, sum(counts), k, 1, seed=7)
        start = sum(counts[:rank])
        mine, experts = slice(start, start + counts[rank]), slice(rank * G, (rank + 1) * G)
        ref = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        ref_out = moe_ffn(ref[0], ids, *ref[1:])
        grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(8))
        ref_out.backward(grad)
        for dedup in (False, True):
            local = [t[s].clone().requires_grad_()
                     for t, s in zip((x, w, w1, w2, w3), (mine, mine, experts, experts, experts))]
            reset_dispatch_counters()
            out = expert_parallel_moe_ffn(local[0], ids[mine], *local[1:], num_experts=E,
                                          capacity_factor=8.0, dedup=dedup, num_chunks=2)
            self.assertEqual(out, ref_out[mine], **TOL)
            out.backward(grad[mine])
            for lt, rt, s in zip(local, ref, (mine, mine, experts, experts, experts)):
                self.assertEqual(lt.grad, rt.grad[s], **TOL)
            c = read_dispatch_counters()
            self.assertEqual(c["dropped"], 0)
            self.assertEqual(c["rows_sent"],
                             int(send_counts(ids[mine], E, R, dedup).sum()))
            # capacity per chunk: ceil(8 T_chunk k / R), at most the rows a chunk can have for
            # one destination (T_chunk with dedup, T_chunk k without)
            W = min(k, G) if dedup else 1
            def cap(t):
                return max(1, min(math.ceil(8.0 * t * k / R), t if dedup else t * k))
            chunk_caps = [[cap(t // 2), cap(t - t // 2)] for t in counts]
            sent_rows = (R - 1) * sum(chunk_caps[rank])
            received_rows = sum(sum(chunk_caps[r]) for r in range(R) if r != rank)
            row, back = D * 4 + W * 8, D * 4
            self.assertEqual(c["bytes_sent"], sent_rows * row + received_rows * back)
            self.assertEqual(c["bytes_received"], received_rows * row + sent_rows * back)

    def test_bad_arguments(self):
        x, ids, w, w1, w2, w3 = _global_data(8, 4, 4, 4, 2, 1)
        cases = [
            (dict(num_experts=6), "expected num_experts divisible by the 4 ranks of the "
             "group, but got num_experts=6"),
            (dict(num_experts=8, num_chunks=0), r"expected num_chunks to be an int in \[1, 16\], "
             "but got 0"),
            (dict(num_experts=8, capacity_factor=-1.0), "expected capacity_factor to be a finite "
             "number > 0 or None, but got -1.0"),
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


# a rank left waiting in a collective fails the test after this many seconds instead of hanging it
_ALL_ENDED_S = 5.0
_FN = "expert_parallel_moe_ffn"


class TestArgumentErrorsOnSomeRanks(_Base):
    """Arguments that fail the local checks on some ranks only: the ranks that fail still take
    part in the header exchange, so every rank raises the same exception type and none is left
    waiting in a collective. A failing rank raises its own message, the others one that names
    the failing ranks and carries their messages."""

    @property
    def world_size(self):
        return 4

    def setUp(self):
        # shared by the rank threads, which run their own instances of the class
        type(self)._all_ended = threading.Barrier(self.world_size, timeout=_ALL_ENDED_S)
        super().setUp()

    def _wait_for_every_rank(self):
        try:
            type(self)._all_ended.wait()
        except threading.BrokenBarrierError:
            ProcessLocalGroup.exception_handle(RuntimeError("a rank is still waiting"))
            self.fail(f"a rank is still waiting in a collective after {_ALL_ENDED_S} s")

    def _every_rank_raises(self, exc_type, own, fn):
        """``fn()`` raises ``exc_type`` on every rank; ``own`` maps the failing ranks to a regex
        of their own messages."""
        rank = dist.get_rank()
        try:
            with self.assertRaises(exc_type) as ctx:
                fn()
        finally:
            self._wait_for_every_rank()
        message = str(ctx.exception)
        if rank in own:
            self.assertRegex(message, "^" + own[rank])
            return
        failing = sorted(own)
        self.assertRegex(message, "^" + re.escape(
                         f"expert_parallel_moe_ffn: ranks {failing} of the expert-parallel group "
                         "passed invalid arguments; ")
                         + "; ".join(f"rank {r}: {own[r].removeprefix(_FN + ': ')}"
                                     for r in failing) + "$")

    def _layer(self, T=4, k=2):
        E, G, rank = 8, 2, dist.get_rank()
        x, ids, w, w1, w2, w3 = _global_data(E, 4, 4, T, k, 4)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        return [x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts]]

    def _call(self, bad_ranks=(2,), edit=None, **options):
        """A call on every rank; ``edit(args, options)`` changes the arguments of ``bad_ranks``."""
        args, kw = self._layer(), dict(num_experts=8, **options)
        if dist.get_rank() in bad_ranks and edit is not None:
            edit(args, kw)
        return lambda: expert_parallel_moe_ffn(*args, **kw)

    def test_one_rank_with_a_bad_shape_dtype_or_option(self):
        def arg(i, f):
            def edit(args, kw):
                args[i] = f(args[i])
            return edit

        def option(**bad):
            return lambda args, kw: kw.update(bad)

        def both(*edits):
            def edit(args, kw):
                for e in edits:
                    e(args, kw)
            return edit

        cases = [
            (ValueError, r"expected x to be 2-D \[T, D\], but got shape \(4,\)",
             arg(0, lambda x: x[:, 0]), {}),
            (ValueError, r"expected a floating topk_weights, but got torch.int64",
             arg(2, lambda w: w.long()), {"capacity_factor": 2.0}),
            (ValueError, r"expected top-k = topk_ids.size\(1\) in \[1, num_experts = 8\], "
             r"but got 12", both(*(arg(i, lambda t: t.repeat(1, 6)) for i in (1, 2))),
             {"dedup": True}),
            (ValueError, r"expected num_chunks to be an int in \[1, 16\], but got 0",
             option(num_chunks=0), {}),
            (ValueError, r"expected activation in .*, but got 'tanh'",
             option(activation="tanh"), {"capacity_factor": 2.0, "num_chunks": 2}),
            (TypeError, r"expected w2_local to be a Tensor, but got None",
             arg(4, lambda w: None), {}),
        ]
        for exc_type, regex, edit, options in cases:
            with self.subTest(regex):
                # every case runs after the errors of the ones before: the group stays in step
                self._every_rank_raises(exc_type, {2: "expert_parallel_moe_ffn: " + regex},
                                        self._call(edit=edit, **options))
        self._compare(E=8, D=4, F=4, T=4, k=2, num_chunks=2)

    def test_ranks_failing_different_checks(self):
        def edit(args, kw):
            if dist.get_rank() == 1:
                args[3] = None  # a TypeError
            else:
                args[0] = args[0][None]  # a ValueError
        # every rank raises the type of the first failing rank
        self._every_rank_raises(TypeError, {
            1: r"expert_parallel_moe_ffn: expected w1_local to be a Tensor, but got None",
            3: r"expert_parallel_moe_ffn: expected x to be 2-D \[T, D\], but got shape "
               r"\(1, 4, 4\)",
        }, self._call(bad_ranks=(1, 3), edit=edit))

    def test_every_rank_failing_raises_its_own_message(self):
        # the common single-process mistake, repeated on every rank: no one else to blame
        rank = dist.get_rank()
        self._every_rank_raises(ValueError, {r: "expert_parallel_moe_ffn: expected num_chunks "
                                             rf"to be an int in \[1, 16\], but got {17 + r}$"
                                             for r in range(4)},
                                self._call(bad_ranks=range(4),
                                           edit=lambda args, kw: kw.update(num_chunks=17 + rank)))

    def test_group_of_the_wrong_type_raises_locally(self):
        args = self._layer()
        with self.assertRaisesRegex(TypeError, "expert_parallel_moe_ffn: expected group to be "
                                    "a ProcessGroup or None, but got str"):
            expert_parallel_moe_ffn(*args, num_experts=8, group="world")


_in_kernel = threading.local()

# ops whose output shape, or whose result on the host, depends on tensor values
_DATA_DEPENDENT = {
    torch.ops.aten.nonzero.default, torch.ops.aten.argwhere.default,
    torch.ops.aten.masked_select.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default, torch.ops.aten.unique_dim.default,
    torch.ops.aten.bincount.default, torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.equal.default, torch.ops.aten.is_nonzero.default,
}


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(i is not None and i.dtype == torch.bool for i in indices)


class _NoDataDependentOps(TorchDispatchMode):
    """Fails on any op whose output shape or host result depends on tensor values, outside the
    ``torch_moe`` kernels (the CPU expert kernel reads its group offsets on the host; that is
    the kernel, on a GPU the offsets stay on the device)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "torch_moe":
            _in_kernel.active = True
            try:
                return func(*args, **kwargs)
            finally:
                _in_kernel.active = False
        if not getattr(_in_kernel, "active", False):
            packet = func.overloadpacket
            if (func in _DATA_DEPENDENT
                    or (packet in (torch.ops.aten.index, torch.ops.aten.index_put,
                                   torch.ops.aten.index_put_, torch.ops.aten._index_put_impl_)
                        and _has_bool_index(args))
                    or (packet is torch.ops.aten.repeat_interleave
                        and kwargs.get("output_size") is None)):
                raise AssertionError(f"data-dependent op {func} in capacity mode")
        return func(*args, **kwargs)


def _static_graph(gm, example_inputs):
    """A ``torch.compile`` backend that fails on any value of data-dependent size or value
    (an unbacked symbol: boolean indexing, nonzero, item, ...). torch 2.13 captures such ops
    even with ``capture_dynamic_output_shape_ops`` and ``capture_scalar_outputs`` off, so the
    graph itself is checked."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves(node.meta.get("example_value")):
            if free_unbacked_symbols(value):
                raise AssertionError(f"data-dependent value in the graph: {node.format_node()}")
    return gm.forward


class TestCapacityModeHasNoDataDependentShapes(_Base):
    """Capacity mode: no op with a data-dependent shape, and one host read per call, of the
    fixed-size header (layer signature and capacities: shapes and arguments, no token values).
    ``Tensor.tolist`` does not go through the dispatcher, so it is wrapped for the test."""

    @property
    def world_size(self):
        return 2

    def setUp(self):
        self._tolist = torch.Tensor.tolist
        original = self._tolist

        def tolist(t):
            values = original(t)
            reads = getattr(_in_kernel, "reads", None)
            if reads is not None and not getattr(_in_kernel, "active", False):
                reads.append(values)
            return values

        torch.Tensor.tolist = tolist
        super().setUp()

    def tearDown(self):
        torch.Tensor.tolist = self._tolist
        super().tearDown()

    def _host_reads(self, seed, T, **options):
        x, ids, w, w1, w2, w3 = _global_data(4, 4, 4, T, 2, 1, seed=seed)
        _in_kernel.reads = []
        try:
            with _NoDataDependentOps():
                expert_parallel_moe_ffn(x, ids, w, w1[:2], w2[:2], w3[:2], num_experts=4,
                                        **options)
            return _in_kernel.reads
        finally:
            del _in_kernel.reads

    def test_the_check_sees_data_dependent_ops(self):
        x = torch.randn(6)
        for f in (lambda: x[x > 0], lambda: x.nonzero(), lambda: int(x.sum() > 0),
                  lambda: torch.repeat_interleave(torch.tensor([1, 2]))):
            with self.assertRaisesRegex(AssertionError, "data-dependent op"), \
                    _NoDataDependentOps():
                f()

    def test_capacity_mode_reads_only_the_signature_on_the_host(self):
        options = dict(capacity_factor=2.0, num_chunks=2, dedup=True)
        first = self._host_reads(seed=0, T=6, **options)
        # other token values and routing, same shapes: the same single read, same values
        self.assertEqual(len(first), 1)
        self.assertEqual(self._host_reads(seed=1, T=6, **options), first)
        # other shapes: still one read of the same size
        other = self._host_reads(seed=2, T=3, **options)
        self.assertEqual(len(other), 1)
        self.assertEqual(len(other[0]), len(first[0]))
        self.assertEqual([len(r) for r in other[0]], [len(r) for r in first[0]])

    def test_sync_free_capacity_mode_reads_nothing_on_the_host(self):
        for options in ({}, {"dedup": True, "num_chunks": 2}):
            with self.subTest(**options):
                self.assertEqual(self._host_reads(seed=0, T=6, capacity_factor=2.0,
                                                  sync_free=True, **options), [])

    def test_sync_free_capacity_mode_compiles_whole(self):
        # header exchange included: rank 0 runs the whole call compiled into one graph without
        # data-dependent shapes or scalars, rank 1 eagerly
        E, D, F, T, k = 4, 4, 4, 6, 2
        rank = dist.get_rank()
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, 2, seed=3)
        ref = moe_ffn(x, ids, w, w1, w2, w3)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * 2, (rank + 1) * 2)

        def layer(x, topk_ids, topk_weights, w1, w2, w3):
            return expert_parallel_moe_ffn(x, topk_ids, topk_weights, w1, w2, w3, num_experts=E,
                                           dedup=True, num_chunks=2, capacity_factor=8.0,
                                           sync_free=True)

        fn = layer
        if rank == 0:
            torch._dynamo.reset()
            fn = torch.compile(layer, fullgraph=True, backend=_static_graph)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False,
                                        capture_scalar_outputs=False):
            for _ in range(2):  # eagerly (rank 1), the second call finds the cached header rows
                out = fn(x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts])
                self.assertEqual(out, ref[mine], **TOL)

    def test_static_graph_backend_sees_data_dependent_ops(self):
        x = torch.randn(6)
        for f in (lambda x: x[x > 0], lambda x: x.nonzero(), lambda x: x.sum().item() + 1):
            torch._dynamo.reset()
            with self.assertRaisesRegex(Exception, "data-dependent"):
                torch.compile(f, fullgraph=True, backend=_static_graph)(x)

    def test_capacity_math_compiles_without_dynamic_shapes(self):
        # the dispatch math after the signature exchange: row plan, pack, functional
        # all-to-alls, local experts, combine. Rank 0 runs it compiled (one graph, no
        # data-dependent shapes or scalars), rank 1 eagerly: the collectives pair up
        from torch_moe.distributed import dispatch

        E, D, F, T, k = 4, 4, 4, 6, 2
        rank = dist.get_rank()
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, 2, seed=3)
        ref = moe_ffn(x, ids, w, w1, w2, w3)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * 2, (rank + 1) * 2)
        layer = dispatch._Layer.of(x[mine], ids[mine], num_experts=E, group=dist.group.WORLD,
                                   activation="swiglu", alpha=1.702, limit=7.0, dedup=True,
                                   num_chunks=2, capacity_factor=8.0)
        plan = dispatch._plan_rows(ids[mine], layer)
        splits = dispatch._exchange_header(layer, plan.rows_per_dest_Rn, plan.id_flags)

        def capacity_math(x, topk_ids, topk_weights, w1, w2, w3):
            plan = dispatch._plan_rows(topk_ids, layer)
            return dispatch._dispatch_compute_combine(
                x, topk_ids, topk_weights, dispatch._LocalExperts(w1, w2, w3), layer, plan,
                splits)[0]

        fn = capacity_math
        if rank == 0:
            torch._dynamo.reset()
            fn = torch.compile(capacity_math, fullgraph=True, backend=_static_graph)
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=False,
                                        capture_scalar_outputs=False):
            out = fn(x[mine], ids[mine], w[mine], w1[experts], w2[experts], w3[experts])
        self.assertEqual(out, ref[mine], **TOL)


class TestSyncFreeCapacityMode(TestArgumentErrorsOnSomeRanks):
    """``sync_free=True``: capacity mode with every rank's splits known without the header's
    host read. The header is still exchanged and checked on the device: on CPU every rank
    whose arguments passed raises the same ``RuntimeError`` before any later collective (none
    is left waiting), and a rank whose arguments failed raises its own error."""

    @property
    def world_size(self):
        return 4

    def test_matches_moe_ffn_forward_and_backward(self):
        for options in ({}, {"dedup": True, "num_chunks": 2}, {"num_chunks": 3}):
            with self.subTest(**options):
                self._compare(E=8, D=8, F=6, T=10, k=3, capacity_factor=8.0, sync_free=True,
                              **options)
        # capacity 1.0 drops rows: the same drops as the capacity mode with a host read
        x, ids, w, w1, w2, w3 = self._layer(T=8)
        outs = [expert_parallel_moe_ffn(x, ids, w, w1, w2, w3, num_experts=8,
                                        capacity_factor=0.5, sync_free=sync_free)
                for sync_free in (False, True)]
        self.assertEqual(outs[0], outs[1], atol=0, rtol=0)

    def _sync_free(self, args=None, **options):
        args = self._layer() if args is None else args
        return lambda: expert_parallel_moe_ffn(*args, num_experts=8, capacity_factor=2.0,
                                               sync_free=True, **options)

    def _every_rank_raises_the_same(self, exc_type, regex, fn):
        try:
            self._raises_the_same_on_every_rank(exc_type, regex, fn)
        finally:
            self._wait_for_every_rank()

    def test_ranks_with_different_token_counts_raise_on_every_rank(self):
        args = self._layer(T=4 + (dist.get_rank() == 3))
        self._every_rank_raises_the_same(
            RuntimeError, "expected every rank of the expert-parallel group to pass the same "
            "number of tokens with sync_free=True or backend=.symm_mem.", self._sync_free(args))

    def test_ranks_disagreeing_on_the_layer_raise_on_every_rank(self):
        rank = dist.get_rank()
        for options in ({"dedup": rank == 0}, {"num_chunks": 1 + (rank == 1)}):
            with self.subTest(**options):
                self._every_rank_raises_the_same(
                    RuntimeError, "expected every rank of the expert-parallel group to pass the "
                    "same num_experts, .*dedup", self._sync_free(**options))

    def test_ids_out_of_range_raise_on_every_rank(self):
        args = self._layer()
        if dist.get_rank() == 2:
            args[1] = args[1].clone()
            args[1][0, 0] = 8
        self._every_rank_raises_the_same(RuntimeError, r"expected expert ids in \[0, 8\)",
                                         self._sync_free(args))

    def test_a_rank_with_bad_arguments(self):
        rank = dist.get_rank()
        args = self._layer()
        if rank == 1:
            args[2] = args[2].long()
        try:
            if rank == 1:
                with self.assertRaisesRegex(ValueError, "expected a floating topk_weights"):
                    self._sync_free(args)()
            else:
                with self.assertRaisesRegex(RuntimeError, "a rank did not .that rank raised"):
                    self._sync_free(args)()
        finally:
            self._wait_for_every_rank()
        # the group stays in step
        self._compare(E=8, D=4, F=4, T=4, k=2, capacity_factor=8.0, sync_free=True)

    def test_a_rank_without_sync_free(self):
        # the rank that reads the header names the argument; the others assert on the device
        rank = dist.get_rank()
        fn = lambda: expert_parallel_moe_ffn(*self._layer(), num_experts=8, capacity_factor=2.0,
                                             sync_free=rank != 0)
        try:
            with self.assertRaisesRegex(
                    ValueError if rank == 0 else RuntimeError,
                    r"the same sync_free, but got False on ranks \[0\] and True on ranks"
                    if rank == 0 else "to pass the same num_experts"):
                fn()
        finally:
            self._wait_for_every_rank()

    def test_sync_free_needs_a_capacity_factor(self):
        self._every_rank_raises(
            ValueError, {r: "expert_parallel_moe_ffn: expected a capacity_factor with "
                         r"sync_free=True" for r in range(4)},
            self._call(bad_ranks=range(4), sync_free=True))
        self._every_rank_raises(
            ValueError, {2: r"expert_parallel_moe_ffn: expected sync_free to be a bool, but got 1"},
            self._call(edit=lambda args, kw: kw.update(sync_free=1)))


class TestExpertParallelCapacityMode(DTensorOpTestBase):
    """``ExpertParallel`` with the dispatcher's capacity mode and a different number of tokens
    on every rank (5 + rank), as the style documents."""

    @property
    def world_size(self):
        return 4

    def test_expert_parallel_capacity_factor_with_uneven_tokens(self):
        moe = make_moe()
        ref = copy.deepcopy(moe)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        # capacity 8 per pair of ranks drops nothing: the layer equals the unsharded one
        parallelize_module(moe, mesh, ExpertParallel(dispatch_options={"capacity_factor": 8.0}))
        xs, gs = global_tokens(self.world_size)
        rank = dist.get_rank()
        x = xs[rank].clone().requires_grad_()
        y = moe(x)
        y.backward(gs[rank])
        ref_x = torch.cat(xs).requires_grad_()
        ref_y = ref(ref_x)
        ref_y.backward(torch.cat(gs))
        start = sum(t.size(0) for t in xs[:rank])
        mine = slice(start, start + x.size(0))
        self.assertEqual(y, ref_y[mine], **TOL)
        self.assertEqual(x.grad, ref_x.grad[mine], **TOL)


class TestExpertParallelSyncFree(DTensorOpTestBase):
    """``ExpertParallel`` with sync-free capacity mode: the same number of tokens on every
    rank, the style's exchange without a host read."""

    @property
    def world_size(self):
        return 4

    def test_expert_parallel_sync_free_capacity_mode(self):
        moe = make_moe()
        ref = copy.deepcopy(moe)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        parallelize_module(moe, mesh, ExpertParallel(dispatch_options={
            "capacity_factor": 8.0, "sync_free": True, "dedup": True, "num_chunks": 2}))
        g = torch.Generator().manual_seed(1)
        xs, gs = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
        rank = dist.get_rank()
        x = xs[rank].clone().requires_grad_()
        y = moe(x)
        y.backward(gs[rank])
        ref_x = xs.flatten(0, 1).clone().requires_grad_()
        ref_y = ref(ref_x)
        ref_y.backward(gs.flatten(0, 1))
        mine = slice(rank * 6, (rank + 1) * 6)
        self.assertEqual(y, ref_y[mine], **TOL)
        self.assertEqual(x.grad, ref_x.grad[mine], **TOL)


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
            counts = torch.stack([p.rows_per_dest for p in plans])  # [source, destination]
            self.assertEqual(counts, torch.stack([send_counts(ids[r * T:(r + 1) * T], E, R, dedup)
                                                  for r in range(R)]))
            layer = _Layer(None, R, 0, E, G, D, k, W, torch.float32, dedup, 1, None, "swiglu",
                           1.702, 7.0, ((0, T),))
            chunks = [_pack(ids[r * T:(r + 1) * T], w[r * T:(r + 1) * T], plans[r], layer,
                            _Splits(counts[r].tolist(), counts[:, r].tolist(), None))
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
