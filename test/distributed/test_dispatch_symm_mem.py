# Owner(s): ["module: moe"]
"""The dispatcher's ``backend="symm_mem"`` (``symm_mem::all_to_all_vdev``, split sizes on the
device) under the threaded process group, with the symmetric-memory op emulated.

NVSHMEM needs CUDA devices; what runs here is everything of the backend around the op: the
send buffers sized by bounds, the split sizes that stay tensors, the receive buffers of fixed
size whose rows past those received are masked, the reverse exchanges of the combine and of the
backward, the counters. The emulation keeps the op's contract (``in_splits`` and
``out_splits_offsets`` on the device, rows packed in rank order, nothing written past the rows
received) and fills every buffer with NaN and garbage ids at allocation, so a row the layer
reads without having received it shows. A real two-GPU run is in
``test_dispatch_nccl.py``.

Run: ``python -m pytest test/distributed/test_dispatch_symm_mem.py -q`` from the repo root.
"""

import copy
import threading
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import run_tests

import torch_moe  # noqa: F401
from torch_moe.distributed import _dispatch_checks, _symm_mem_exchange
from torch_moe.distributed.dispatch import (
    expert_parallel_moe_ffn,
    read_dispatch_counters,
    reset_dispatch_counters,
)
from torch_moe.distributed.parallel import ExpertParallel
from torch_moe.nn.functional import moe_ffn

from _parallel_style_common import make_moe

TOL = {"atol": 1e-6, "rtol": 1e-5}

_GARBAGE_ID = 1 << 20


class _PerThread(threading.local):
    """The backend's buffer cache, one per simulated rank: the threads share a group name,
    processes do not share memory."""

    def __init__(self):
        self.buffers = {}


class _Buffers:
    def __init__(self):
        self._local = _PerThread()

    def get(self, key):
        return self._local.buffers.get(key)

    def __setitem__(self, key, value):
        self._local.buffers[key] = value


def _symm_empty(shape, dtype, device, group):
    _allocations.log.append((tuple(shape), dtype))
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, _GARBAGE_ID, dtype=dtype, device=device)


def _all_to_all_vdev(inp, out, in_splits, out_splits_offsets, group):
    """symm_mem::all_to_all_vdev's contract, over the process group. The op passes a barrier
    after writing the split sizes into its peers' buffers and none at its end: two exchanges
    in a row on the same buffers race on a GPU, which is checked here."""
    buffers = {t.data_ptr() for t in (inp, out, in_splits, out_splits_offsets)}
    assert not buffers & _allocations.last_exchange, "two exchanges in a row on one buffer"
    _allocations.last_exchange = buffers
    recv = torch.empty_like(in_splits)
    dist.all_to_all_single(recv, in_splits, group=group)
    send_list, recv_list = in_splits.tolist(), recv.tolist()
    assert sum(send_list) <= inp.size(0) and sum(recv_list) <= out.size(0), \
        (send_list, inp.shape, recv_list, out.shape)
    received = out.new_empty((sum(recv_list), *out.shape[1:]))
    dist.all_to_all_single(received, inp[:sum(send_list)].contiguous(), recv_list, send_list,
                           group=group)
    out[:sum(recv_list)] = received
    out_splits_offsets[0] = recv
    out_splits_offsets[1] = torch.cumsum(recv, 0) - recv


class _Allocations(threading.local):
    def __init__(self):
        self.log = []
        self.last_exchange = set()


_allocations = _Allocations()


def _global_data(E, D, F, T, k, R, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R * T, D, generator=g)
    ids = (torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(R * T)]) if T
           else torch.empty(0, k, dtype=torch.int64))
    w = torch.rand(R * T, k, generator=g)
    w1 = torch.randn(E, D, F, generator=g) / D**0.5
    w2 = torch.randn(E, F, D, generator=g) / F**0.5
    w3 = torch.randn(E, D, F, generator=g) / D**0.5
    return x, ids, w, w1, w2, w3


class _Threads(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 4

    def setUp(self):
        super().setUp()
        self._spawn_threads()


class TestSymmMemBackend(_Threads):
    """The backend with the op emulated. The patches are made before the rank threads start
    and undone after they end (a patch made by several threads at once can outlive them)."""

    def setUp(self):
        self._patches = [
            mock.patch.multiple(_symm_mem_exchange, _BUFFERS=_Buffers(),
                                symm_mem_empty=_symm_empty, all_to_all_vdev=_all_to_all_vdev),
            mock.patch.object(_dispatch_checks, "symm_mem_unavailable_reason",
                              lambda device, num_ranks: None),
        ]
        for p in self._patches:
            p.start()
        super().setUp()

    def tearDown(self):
        super().tearDown()
        for p in reversed(self._patches):
            p.stop()

    def _compare(self, E=8, D=8, F=6, T=10, k=3, **options):
        R, rank, G = 4, dist.get_rank(), E // 4
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, R)
        ref = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        ref_out = moe_ffn(ref[0], ids, *ref[1:])
        grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(5))
        ref_out.backward(grad)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        counters = {}
        for backend in ("c10d", "symm_mem"):
            local = [t[s].clone().requires_grad_()
                     for t, s in zip((x, w, w1, w2, w3), (mine, mine, experts, experts, experts))]
            reset_dispatch_counters()
            out = expert_parallel_moe_ffn(local[0], ids[mine], *local[1:], num_experts=E,
                                          backend=backend, **options)
            self.assertEqual(out, ref_out[mine], **TOL)
            out.backward(grad[mine])
            for name, lt, rt, s in zip(("x", "weights", "w1", "w2", "w3"), local, ref,
                                       (mine, mine, experts, experts, experts)):
                self.assertEqual(lt.grad, rt.grad[s], **TOL, msg=f"{backend}: grad of {name}")
            counters[backend] = read_dispatch_counters()
        self.assertEqual(counters["symm_mem"], counters["c10d"])

    def test_matches_moe_ffn_and_the_c10d_backend(self):
        for options in ({}, {"dedup": True}, {"num_chunks": 3}, {"dedup": True, "num_chunks": 2}):
            with self.subTest(**options):
                self._compare(**options)
        # chunks without tokens, and no tokens at all
        self._compare(T=2, k=2, num_chunks=5)
        self._compare(T=0, k=2, dedup=True)

    def test_skewed_routing_fills_a_receive_buffer(self):
        # every token of every rank on the experts of rank 1: its buffer's bound is reached
        T, k = 6, 2
        ids = torch.tensor([[2, 3]] * (4 * T))
        x, _, w, w1, w2, w3 = _global_data(8, 8, 6, T, k, 4)
        rank = dist.get_rank()
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * 2, (rank + 1) * 2)
        out = expert_parallel_moe_ffn(x[mine], ids[mine], w[mine], w1[experts],
                                      w2[experts], w3[experts], num_experts=8,
                                      backend="symm_mem")
        self.assertEqual(out, moe_ffn(x, ids, w, w1, w2, w3)[mine], **TOL)

    def test_buffers_are_allocated_once_with_the_same_sizes_on_every_rank(self):
        _allocations.log = []
        self._compare()
        first = list(_allocations.log)
        self._compare()  # same shapes: the buffers are reused
        self.assertEqual(_allocations.log, first)
        logs = [None] * 4
        dist.all_gather_object(logs, [(s, str(d)) for s, d in first])
        self.assertEqual(len({str(log) for log in logs}), 1)

    def test_expert_parallel_style_with_the_symm_mem_backend(self):
        moe = make_moe()
        ref = copy.deepcopy(moe)
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        parallelize_module(moe, mesh,
                           ExpertParallel(dispatch_options={"backend": "symm_mem"}))
        g = torch.Generator().manual_seed(1)
        xs = torch.randn(4, 6, 8, generator=g)  # the same T on every rank
        gs = torch.randn(4, 6, 8, generator=g)
        rank = dist.get_rank()
        x = xs[rank].clone().requires_grad_()
        moe(x).backward(gs[rank])
        ref_x = xs.flatten(0, 1).clone().requires_grad_()
        ref_y = ref(ref_x)
        ref_y.backward(gs.flatten(0, 1))
        self.assertEqual(x.grad, ref_x.grad[rank * 6:(rank + 1) * 6], **TOL)

    def test_ranks_with_different_token_counts_raise_on_every_rank(self):
        rank = dist.get_rank()
        T = 4 + (rank == 2)
        x, ids, w, w1, w2, w3 = _global_data(8, 4, 4, T, 2, 1)
        with self.assertRaisesRegex(RuntimeError, "the same number of tokens with "
                                    "sync_free=True or backend='symm_mem'"):
            expert_parallel_moe_ffn(x, ids, w, w1[:2], w2[:2], w3[:2], num_experts=8,
                                    backend="symm_mem")


class TestSymmMemBackendChecks(_Threads):
    def test_unavailable_or_combined_with_capacity_mode(self):
        x, ids, w, w1, w2, w3 = _global_data(8, 4, 4, 4, 2, 1)
        args = (x, ids, w, w1[:2], w2[:2], w3[:2])
        # no CUDA here: every rank raises the reason, its own message
        with self.assertRaisesRegex(ValueError, "backend='symm_mem' cannot run here: it needs "
                                    "CUDA tensors, but got tensors on cpu"):
            expert_parallel_moe_ffn(*args, num_experts=8, backend="symm_mem")
        with self.assertRaisesRegex(ValueError, "expected backend='symm_mem' without "
                                    "capacity_factor and sync_free"):
            expert_parallel_moe_ffn(*args, num_experts=8, backend="symm_mem",
                                    capacity_factor=2.0)
        with self.assertRaisesRegex(ValueError, r"expected backend in \('c10d', 'symm_mem'\), "
                                    "but got 'nvshmem'"):
            expert_parallel_moe_ffn(*args, num_experts=8, backend="nvshmem")


if __name__ == "__main__":
    run_tests()
