# Owner(s): ["module: moe"]
"""Expert-parallel dispatch with CUDA tensors on NCCL: two processes, one GPU each.

The same checks as the gloo tests, on the devices users run: every mode of
``expert_parallel_moe_ffn`` (exact, dedup, chunked and overlapped, capacity, sync-free
capacity) and ``ExpertParallel`` against the single-process ``moe_ffn`` on the full data, on
CUDA (the local experts run torch_moe's Triton kernels); the sync-free capacity layer captured
in a CUDA graph and replayed on new tokens; ``backend="symm_mem"`` where torch has NVSHMEM.
Skipped without two GPUs and NCCL (``pytest test/distributed/test_dispatch_nccl.py`` on a
multi-GPU machine runs it).
"""

import copy
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import requires_nccl, skip_if_lt_x_gpu
from torch.testing._internal.common_utils import run_tests, TestCase

import torch_moe  # noqa: F401
from torch_moe.nn.functional import moe_ffn

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

HAS_NCCL = dist.is_available() and dist.is_nccl_available()

if HAS_NCCL:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )

    from torch_moe.distributed._compat import prepare_symm_mem
    from torch_moe.distributed.dispatch import (
        expert_parallel_moe_ffn,
        read_dispatch_counters,
        reset_dispatch_counters,
    )
    from torch_moe.distributed.parallel import ExpertParallel
    from torch_moe.nn import MoE, MoEConfig
else:
    DTensorTestBase = TestCase

    def with_comms(func):
        return func


# fp32 with IEEE products (the Triton kernels follow torch's TF32 setting, off by default): the
# distributed path only reorders the fp32 sums of the combine
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _global_data(E, D, F, T, k, R, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R * T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(R * T)])
    w = torch.rand(R * T, k, generator=g)
    w1 = torch.randn(E, D, F, generator=g) / D**0.5
    w2 = torch.randn(E, F, D, generator=g) / F**0.5
    w3 = torch.randn(E, D, F, generator=g) / D**0.5
    return [t.to(device) for t in (x, ids, w, w1, w2, w3)]


@unittest.skipIf(not (HAS_NCCL and HAS_TRITON), "needs NCCL and triton")
class TestDispatchNCCL(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @property
    def backend(self) -> str:
        return "nccl"

    @property
    def device_type(self) -> str:
        return "cuda"

    def _compare(self, E=8, D=32, F=48, T=64, k=2, **options):
        R, rank, G = self.world_size, self.rank, E // self.world_size
        device = torch.device("cuda", rank)
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, R, device)
        ref = [t.clone().requires_grad_() for t in (x, w, w1, w2, w3)]
        ref_out = moe_ffn(ref[0], ids, *ref[1:])
        grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1)).to(device)
        ref_out.backward(grad)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * G, (rank + 1) * G)
        local = [t[s].clone().requires_grad_()
                 for t, s in zip((x, w, w1, w2, w3), (mine, mine, experts, experts, experts))]
        reset_dispatch_counters()
        out = expert_parallel_moe_ffn(local[0], ids[mine], *local[1:], num_experts=E,
                                      **options)
        self.assertEqual(out.device, device)
        self.assertEqual(out, ref_out[mine], **TOL)
        out.backward(grad[mine])
        for name, lt, rt, s in zip(("x", "weights", "w1", "w2", "w3"), local, ref,
                                   (mine, mine, experts, experts, experts)):
            self.assertEqual(lt.grad, rt.grad[s], **TOL, msg=f"{options}: grad of {name}")
        counters = read_dispatch_counters()
        self.assertEqual(counters["calls"], 1)
        # nothing dropped: this rank's experts computed every assignment of every rank to them
        self.assertEqual(sum(counters["last_expert_load"]),
                         int(((ids >= rank * G) & (ids < (rank + 1) * G)).sum()))

    @skip_if_lt_x_gpu(2)
    @requires_nccl()
    @with_comms
    def test_every_mode_matches_moe_ffn_on_cuda(self):
        for options in ({}, {"dedup": True}, {"num_chunks": 4}, {"dedup": True, "num_chunks": 2},
                        {"capacity_factor": 8.0}, {"capacity_factor": 8.0, "sync_free": True,
                                                   "num_chunks": 2}):
            with self.subTest(**options):
                self._compare(**options)

    @skip_if_lt_x_gpu(2)
    @requires_nccl()
    @with_comms
    def test_expert_parallel_style_on_cuda(self):
        device = torch.device("cuda", self.rank)
        torch.manual_seed(0)
        moe = MoE(MoEConfig(dim=32, hidden_dim=48, num_experts=8, top_k=2)).to(device)
        ref = copy.deepcopy(moe)
        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("ep",))
        parallelize_module(moe, mesh, ExpertParallel(dispatch_options={"dedup": True}))
        g = torch.Generator().manual_seed(1)
        xs, gs = torch.randn(2, 40, 32, generator=g), torch.randn(2, 40, 32, generator=g)
        x = xs[self.rank].to(device).requires_grad_()
        moe(x).backward(gs[self.rank].to(device))
        ref_x = xs.flatten(0, 1).to(device).requires_grad_()
        ref(ref_x).backward(gs.flatten(0, 1).to(device))
        self.assertEqual(x.grad, ref_x.grad[self.rank * 40:(self.rank + 1) * 40], **TOL)

    @skip_if_lt_x_gpu(2)
    @requires_nccl()
    @with_comms
    def test_sync_free_capacity_layer_in_a_cuda_graph(self):
        E, D, F, T, k, rank = 8, 32, 48, 64, 2, self.rank
        device = torch.device("cuda", rank)
        x, ids, w, w1, w2, w3 = _global_data(E, D, F, T, k, 2, device)
        mine, experts = slice(rank * T, (rank + 1) * T), slice(rank * 4, (rank + 1) * 4)
        static = [x[mine].clone(), ids[mine].clone(), w[mine].clone()]
        weights = (w1[experts], w2[experts], w3[experts])

        def layer():
            return expert_parallel_moe_ffn(*static, *weights, num_experts=E,
                                           capacity_factor=8.0, sync_free=True)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: kernels compiled, tiles picked, header rows cached
                layer()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer()
        for seed in (3, 4):
            x2, ids2, w2_, *_ = _global_data(E, D, F, T, k, 2, device, seed=seed)
            for buf, new in zip(static, (x2[mine], ids2[mine], w2_[mine])):
                buf.copy_(new)
            graph.replay()
            ref = moe_ffn(x2, ids2, w2_, w1, w2, w3)[mine]
            self.assertEqual(out, ref, **TOL)

    @skip_if_lt_x_gpu(2)
    @requires_nccl()
    @with_comms
    def test_symm_mem_backend(self):
        import torch.distributed._symmetric_memory as symm_mem

        if not symm_mem.is_nvshmem_available():
            self.skipTest("backend='symm_mem': this torch was built without NVSHMEM")
        # with NVSHMEM the backend must run: a reason left after the set-up fails the test
        self.assertIsNone(prepare_symm_mem(torch.device("cuda", self.rank), self.world_size))
        for options in ({}, {"dedup": True, "num_chunks": 2}):
            with self.subTest(**options):
                self._compare(backend="symm_mem", **options)


if __name__ == "__main__":
    run_tests()
