# Owner(s): ["module: moe"]
"""DTensor sharding strategies of torch_moe checked through real collectives: 2 processes, gloo.

LocalTensorMode (``test_moe_sharding.py``) runs every rank in one process and computes the
collectives on the local tensors. These tests spawn real processes instead, so that the rules
are exercised exactly as training uses them: every rank runs the op only on its own shard,
the sharding propagation cache lives in each process, autograd runs through the registered
derivative formulas on DTensors, and Partial / Shard / _StridedShard outputs are reduced and
gathered by the gloo all-reduce and all-gather.

Each test costs a process spawn plus a gloo rendezvous (about 7-9 s on 2 CPU cores), so there
are only three:

* expert tensor parallelism of ``grouped_ffn`` (F sharded), forward and backward, for the
  gated (w1/w3 and fused w13) and the non-gated layouts;
* ``quantized_grouped_mm`` with recipe ``mxfp8`` and the weight sharded along N, forward
  and backward;
* DTensors on different device meshes are rejected with a clear error, not run.

Run: ``python -m pytest test/distributed/tensor/test_moe_gloo.py -q`` from the repo root, or
``python test/distributed/tensor/test_moe_gloo.py``.
"""

import gc
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)

HAS_GLOO = dist.is_available() and dist.is_gloo_available()

if HAS_GLOO:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )

    import torch_moe.distributed.tensor  # noqa: F401  (registers the sharding strategies)
else:  # keep the module importable so that the class below is reported as skipped
    DTensorTestBase = TestCase

    def with_comms(func):
        return func


ops = torch.ops.torch_moe

# fp32 results whose sharded form only reorders fp32 sums (a Partial all-reduce, a GEMM of a
# different width): a few ulps of values of magnitude O(1)-O(10)
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}


@unittest.skipIf(not HAS_GLOO, "torch.distributed with the gloo backend is not available")
class TestMoEGloo(DTensorTestBase):
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

    # -----------------------------------------------------------------------------------------
    # (1) expert tensor parallel grouped_ffn
    # -----------------------------------------------------------------------------------------

    def _check_grouped_ffn_etp(self, mesh, layout: str) -> None:
        """grouped_ffn with F sharded (w1/w3 Shard(2), w2 Shard(1); a fused w13 as
        _StridedShard(2, 2)) against the single-process op: out, hidden and all five grads."""
        torch.manual_seed(0)  # same global tensors on every rank
        T, k, E, D, F = 16, 2, 4, 8, 8
        activation = "gelu" if layout == "gelu" else "swiglu"
        x = torch.randn(T, D)
        topk_ids = torch.randint(0, E, (T, k))
        topk_weights = torch.rand(T, k)
        sorted_ids, offs, _ = ops.token_sort(topk_ids, E)
        scale_in, scale_out = D**-0.5, F**-0.5
        if layout == "w1_w3":
            w1, w3 = torch.randn(E, D, F) * scale_in, torch.randn(E, D, F) * scale_in
            w_places = [Shard(2), Shard(1), Shard(2)]
        elif layout == "w13":  # fused cat(gate, up): a rank holds cat(gate_r, up_r)
            w1, w3 = torch.randn(E, D, 2 * F) * scale_in, None
            w_places = [_StridedShard(2, split_factor=2), Shard(1)]
        else:
            w1, w3 = torch.randn(E, D, F) * scale_in, None
            w_places = [Shard(2), Shard(1)]
        w2 = torch.randn(E, F, D) * scale_out
        grad_out = torch.randn(T, D)
        args = (activation, 1.702, 7.0)

        # single-process reference
        leaves = [t.clone().requires_grad_() for t in (x, topk_weights, w1, w2, w3) if t is not None]
        w3_ref = leaves[4] if w3 is not None else None
        ref_out, ref_hidden = ops.grouped_ffn(
            leaves[0], sorted_ids, offs, leaves[1], leaves[2], leaves[3], w3_ref, *args
        )
        (ref_out * grad_out).sum().backward()

        # DTensors: routing and activations replicated, the expert FFN dim F sharded
        R = Replicate()
        places = [R, R, *w_places]
        d_leaves = [
            distribute_tensor(t, mesh, [p]).requires_grad_()
            for t, p in zip([t for t in (x, topk_weights, w1, w2, w3) if t is not None], places)
        ]
        d_sorted_ids = distribute_tensor(sorted_ids, mesh, [R])
        d_offs = distribute_tensor(offs, mesh, [R])
        d_w3 = d_leaves[4] if w3 is not None else None
        out, hidden = ops.grouped_ffn(
            d_leaves[0], d_sorted_ids, d_offs, d_leaves[1], d_leaves[2], d_leaves[3], d_w3, *args
        )
        msg = f"grouped_ffn expert TP, {layout}"
        self.assertEqual(out.placements, (Partial(),), msg=msg)
        gated = activation == "swiglu"
        expected_hidden = _StridedShard(1, split_factor=2) if gated else Shard(1)
        self.assertEqual(hidden.placements, (expected_hidden,), msg=msg)
        self.assertEqual(hidden.to_local().shape, (ref_hidden.size(0), ref_hidden.size(1) // 2), msg=msg)

        # the loss reads the all-reduced output; its backward runs grouped_ffn_backward on DTensors
        full_out = out.redistribute(mesh, [R]).to_local()
        (full_out * grad_out).sum().backward()

        self.assertEqual(full_out, ref_out, **FP32_TOL, msg=f"{msg}: out")
        self.assertEqual(hidden.full_tensor(), ref_hidden, **FP32_TOL, msg=f"{msg}: hidden")
        names = ["x", "topk_weights", "w1", "w2", "w3"]
        for name, d, ref, p in zip(names, d_leaves, leaves, places):
            grad = d.grad
            self.assertIsInstance(grad, DTensor, msg=f"{msg}: grad {name}")
            # grads of replicated inputs are partial sums, grads of weights sharded like them
            self.assertEqual(grad.placements, (Partial() if p == R else p,), msg=f"{msg}: grad {name}")
            self.assertEqual(grad.full_tensor(), ref.grad, **FP32_TOL, msg=f"{msg}: grad {name}")

    @with_comms
    def test_grouped_ffn_expert_tensor_parallel_fwd_bwd(self):
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        for layout in ("w1_w3", "w13", "gelu"):
            self._check_grouped_ffn_etp(mesh, layout)

    # -----------------------------------------------------------------------------------------
    # (2) quantized_grouped_mm, MXFP8, N sharded
    # -----------------------------------------------------------------------------------------

    @with_comms
    def test_quantized_grouped_mm_mxfp8_n_sharded_fwd_bwd(self):
        """out [M, N] = input [M, K] @ weight [G, K, N] with weight Shard(2).

        Sharding does not change a single quantized value: MXFP8 scales come from blocks of 32
        along one dim, and N = 2 x 64 splits into whole blocks, so every block (along K in the
        forward, along N in dgrad, along M per group in wgrad) is the same block on one rank as
        in the unsharded op. What differs is fp32 summation order only where the sharded dim is
        contracted: dgrad (dx = dy @ W^T contracts N) is a Partial sum of two halves added by
        the all-reduce. The forward and wgrad contract K and M, which are whole on every rank,
        so each rank computes its columns from the same quantized operands (bit-identical on
        this CPU; asserted to fp32 tolerance, because a BLAS may block a narrower GEMM
        differently). A block split across ranks would instead change scales and shift results
        by the quantization error, over 100 times the tolerance: checked at the end.
        """
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        torch.manual_seed(0)
        M, K, N = 128, 64, 128
        offs = torch.tensor([32, 96, 128], dtype=torch.int32)  # groups of 32, 64 and 32 rows
        G = offs.numel()
        x = torch.randn(M, K)
        w = torch.randn(G, K, N)
        grad_out = torch.randn(M, N)

        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref_out = ops.quantized_grouped_mm(ref_x, ref_w, offs, "mxfp8")
        (ref_out * grad_out).sum().backward()

        R = Replicate()
        d_x = distribute_tensor(x, mesh, [R]).requires_grad_()
        d_w = distribute_tensor(w, mesh, [Shard(2)]).requires_grad_()
        out = ops.quantized_grouped_mm(d_x, d_w, distribute_tensor(offs, mesh, [R]), "mxfp8")
        self.assertEqual(out.placements, (Shard(1),))
        full_out = out.redistribute(mesh, [R]).to_local()
        (full_out * grad_out).sum().backward()

        self.assertEqual(full_out, ref_out, **FP32_TOL, msg="forward")
        self.assertEqual(d_x.grad.placements, (Partial(),))
        self.assertEqual(d_x.grad.full_tensor(), ref_x.grad, **FP32_TOL, msg="dgrad")
        self.assertEqual(d_w.grad.placements, (Shard(2),))
        self.assertEqual(d_w.grad.full_tensor(), ref_w.grad, **FP32_TOL, msg="wgrad")

        # the comparison above can tell a wrong quantization from fp32 rounding
        hp_out = ops.grouped_mm(x, w, offs)
        quant_err = (ref_out - hp_out).abs().max().item()
        tol = FP32_TOL["atol"] + FP32_TOL["rtol"] * hp_out.abs().max().item()
        self.assertGreater(quant_err, 100 * tol)

    # -----------------------------------------------------------------------------------------
    # (3) mismatched device meshes
    # -----------------------------------------------------------------------------------------

    @with_comms
    def test_mismatched_meshes_raise(self):
        """Activations on the world mesh, weights on another mesh of the same ranks: a TP
        submesh of a 2-D (ep, tp) mesh, or the ranks in the other order (where a silent run
        would pair the wrong shards). Both ranks raise before any collective runs."""
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        mesh_2d = init_device_mesh(self.device_type, (1, self.world_size), mesh_dim_names=("ep", "tp"))
        reversed_mesh = DeviceMesh(self.device_type, list(reversed(range(self.world_size))))
        torch.manual_seed(0)
        T, k, E, D, F = 8, 2, 2, 4, 4
        sorted_ids, offs, _ = ops.token_sort(torch.randint(0, E, (T, k)), E)
        R = Replicate()
        x, tw, ids, o = (
            distribute_tensor(t, mesh, [R]) for t in (torch.randn(T, D), torch.rand(T, k), sorted_ids, offs)
        )
        for other in (mesh_2d["tp"], reversed_mesh):
            w1, w3 = (distribute_tensor(torch.randn(E, D, F), other, [Shard(2)]) for _ in range(2))
            w2 = distribute_tensor(torch.randn(E, F, D), other, [Shard(1)])
            with self.assertRaisesRegex(
                RuntimeError, r"Cannot run torch_moe\.grouped_ffn\.default on inputs with different meshes"
            ):
                ops.grouped_ffn(x, ids, o, tw, w1, w2, w3, "swiglu", 1.702, 7.0)
            with self.assertRaisesRegex(RuntimeError, "different meshes"):
                ops.grouped_mm(ops.permute(x, ids, k), w1, o)
        # the process group is still in step: a collective after the errors completes
        self.assertEqual(distribute_tensor(torch.ones(2), mesh, [Shard(0)]).full_tensor(), torch.ones(2))


if __name__ == "__main__":
    run_tests()
