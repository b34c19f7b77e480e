# Owner(s): ["module: moe"]
"""Expert-parallel dispatch (``torch_moe.distributed.dispatch``) through real gloo collectives.

Two processes; every rank builds the same global tokens, routing and expert weights from a
fixed seed, keeps its slice of the tokens and its block of experts, runs
``expert_parallel_moe_ffn`` and compares the output and the gradients of its tokens, routing
weights and weight shards with the single-process ``moe_ffn`` on the full data.

Each test costs a process spawn plus a gloo rendezvous (about 8 s on 2 CPU cores), so there
are two:

* gated swiglu, tokens split unevenly, one expert receiving no tokens, and the counters; then
  the same data with deduplicated, chunked (overlapped) dispatch;
* non-gated gelu where rank 1 has no tokens and no token is routed to rank 1's experts
  (empty send, receive and expert buffers on one rank).

Run: ``python -m pytest test/distributed/test_dispatch_gloo.py -q`` from the repo root, or
``python test/distributed/test_dispatch_gloo.py``.
"""

import gc
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe.nn.functional import moe_ffn

HAS_GLOO = dist.is_available() and dist.is_gloo_available()

if HAS_GLOO:
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )

    from torch_moe.distributed.dispatch import (
        expert_parallel_moe_ffn,
        read_dispatch_counters,
        reset_dispatch_counters,
    )
else:  # keep the module importable so that the class below is reported as skipped
    DTensorTestBase = TestCase

    def with_comms(func):
        return func


# fp32; the distributed path only reorders the fp32 sums of the combine
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@unittest.skipIf(not HAS_GLOO, "torch.distributed with the gloo backend is not available")
class TestDispatchGloo(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @property
    def backend(self) -> str:
        return "gloo"

    def destroy_pg(self, device_id=None) -> None:
        # Free the autograd graphs' reference cycles (they hold tensors of the functional
        # collectives) while the interpreter is whole: freed at exit from gloo's threads they
        # abort the process now and then ("terminate called without an active exception").
        gc.collect()
        super().destroy_pg(device_id)

    @property
    def device_type(self) -> str:
        return "cpu"

    def _check(self, topk_ids, token_splits, activation, gated, **options):
        """Compare against moe_ffn on the full data; asserts the counters of plain dispatch."""
        torch.manual_seed(0)  # same global tensors on every rank
        E, D, F = 4, 8, 6
        T, k = topk_ids.shape
        R, rank = self.world_size, self.rank
        G = E // R
        x = torch.randn(T, D)
        weights = torch.rand(T, k)
        w1 = torch.randn(E, D, F) / D**0.5
        w2 = torch.randn(E, F, D) / F**0.5
        w3 = torch.randn(E, D, F) / D**0.5 if gated else None
        grad_out = torch.randn(T, D)

        # reference: single process, full data
        ref = [t.clone().requires_grad_() for t in (x, weights, w1, w2)]
        ref_w3 = w3.clone().requires_grad_() if gated else None
        ref_out = moe_ffn(ref[0], topk_ids, ref[1], ref[2], ref[3], ref_w3, activation=activation)
        ref_out.backward(grad_out)

        # distributed: this rank's tokens and experts
        start = sum(token_splits[:rank])
        rows = slice(start, start + token_splits[rank])
        experts = slice(rank * G, (rank + 1) * G)
        lx = x[rows].clone().requires_grad_()
        lw = weights[rows].clone().requires_grad_()
        lw1 = w1[experts].clone().requires_grad_()
        lw2 = w2[experts].clone().requires_grad_()
        lw3 = w3[experts].clone().requires_grad_() if gated else None
        reset_dispatch_counters()
        out = expert_parallel_moe_ffn(
            lx, topk_ids[rows], lw, lw1, lw2, lw3, num_experts=E, activation=activation,
            **options,
        )
        out.backward(grad_out[rows])

        self.assertEqual(out, ref_out[rows], **FP32_TOL)
        self.assertEqual(lx.grad, ref[0].grad[rows], **FP32_TOL)
        self.assertEqual(lw.grad, ref[1].grad[rows], **FP32_TOL)
        self.assertEqual(lw1.grad, ref[2].grad[experts], **FP32_TOL)
        self.assertEqual(lw2.grad, ref[3].grad[experts], **FP32_TOL)
        if gated:
            self.assertEqual(lw3.grad, ref_w3.grad[experts], **FP32_TOL)

        if options:
            return
        # counters: one row per assignment each way, own copies included
        owner = topk_ids // G
        local_owner = owner[rows]
        expected = {
            "calls": 1,
            "rows_sent": local_owner.numel(),
            "rows_received": int((owner == rank).sum()),
            "rows_sent_remote": int((local_owner != rank).sum()),
            "rows_received_remote": int((owner == rank).sum() - (local_owner == rank).sum()),
        }
        counters = read_dispatch_counters()
        self.assertEqual({name: counters[name] for name in expected}, expected)
        self.assertEqual(sum(counters["last_expert_load"]), expected["rows_received"])

    @with_comms
    def test_swiglu_matches_moe_ffn_with_idle_expert(self):
        # 11 tokens split 5 / 6, k = 2 over experts {0, 1, 2}: expert 3 (rank 1) gets nothing
        g = torch.Generator().manual_seed(1)
        topk_ids = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(11)])
        self.assertFalse(bool((topk_ids == 3).any()))
        self.assertTrue(bool((topk_ids // 2 == 1).any()))  # rank 1 still receives rows
        self._check(topk_ids, [5, 6], "swiglu", gated=True)
        # the same data deduplicated, in 3 chunks whose exchanges run in gloo's background
        # threads while another chunk computes
        self._check(topk_ids, [5, 6], "swiglu", gated=True, dedup=True, num_chunks=3)

    @with_comms
    def test_gelu_rank_without_tokens_or_routed_rows(self):
        # all 7 tokens on rank 0, routed to experts {0, 1} only: rank 1 sends and receives 0
        topk_ids = torch.tensor([[0, 1], [1, 0]] * 3 + [[1, 0]])
        self._check(topk_ids, [7, 0], "gelu", gated=False)


if __name__ == "__main__":
    run_tests()
