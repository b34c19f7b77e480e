# Owner(s): ["module: moe"]
"""ParallelStyles for experts with biases (``MoEConfig(ffn_bias=True)``) and with a fused
gate/up weight (``fused_gate_up=True``), in one process (threaded ranks, as
``test_parallel_style.py``).

Every rank builds the same ``MoE`` (with nonzero biases) and the same global tokens, keeps its
own tokens and compares the parallelized layer with the unsharded one
(``_parallel_style_common.compare_with_layer``: output, token gradient, every expert parameter's
gradient, biases included, as a DTensor placed like its parameter):

* ``ExpertParallel`` at EP=4 and EP=2 (a 2 x 2 mesh): biases ``Shard(0)`` like the weights,
  separate w1 / w3 with b1 / b2 / b3, the fused w13 with its ``[E, 2F]`` b1 (swiglu_oai), an
  ungated kind;
* ``TensorParallelExperts`` at TP=4 and ``ExpertTensorParallel`` on a 2 x 2 mesh with biases:
  b1 / b3 sharded on F, b2 replicated and counted once over the F shards;
* parameter placements after ``parallelize_module``;
* what the styles refuse at parallelize time: ``fused_gate_up`` with the tensor-parallel
  styles, biases with replicas of hot experts.

Run: ``python -m pytest test/distributed/test_parallel_style_bias.py -q`` from the repo root.
"""

import copy
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests


HAS_DIST = dist.is_available()

if HAS_DIST:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase

    from torch_moe.distributed.dispatch import reset_dispatch_counters
    from torch_moe.distributed.parallel import (
        ExpertParallel,
        ExpertTensorParallel,
        TensorParallelExperts,
    )
else:  # keep the module importable so that the class below is reported as skipped
    DTensorOpTestBase = TestCase

from _parallel_style_common import _INIT_LOCK, compare_with_layer, make_moe

# (activation, fused_gate_up)
LAYOUTS = (("swiglu", False), ("swiglu_oai", True), ("gelu", False))


def make_biased_moe(activation: str = "swiglu", fused_gate_up: bool = False, **overrides):
    """``make_moe`` with expert biases, set to nonzero values (they start at zero)."""
    moe = make_moe(activation=activation, fused_gate_up=fused_gate_up, ffn_bias=True,
                   **overrides)
    with _INIT_LOCK, torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name in ("b1", "b2", "b3"):
            b = getattr(moe.experts, name)
            if b is not None:
                b.copy_(torch.randn(b.shape, generator=g))
    return moe


@unittest.skipIf(not HAS_DIST, "torch.distributed is not available")
class TestParallelStyleBias(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @property
    def device_type(self) -> str:
        return "cpu"

    def test_placements(self):
        mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        E, D, F = 8, 8, 12
        expected = {
            ExpertParallel: (mesh1, {"b1": (Shard(0),), "b2": (Shard(0),), "b3": (Shard(0),)},
                             {"b1": (2, F), "b2": (2, D), "b3": (2, F)}),
            ExpertTensorParallel: (mesh2, {"b1": (Shard(0), Shard(1)),
                                           "b2": (Shard(0), Replicate()),
                                           "b3": (Shard(0), Shard(1))},
                                   {"b1": (4, 6), "b2": (4, D), "b3": (4, 6)}),
            TensorParallelExperts: (mesh1, {"b1": (Shard(1),), "b2": (Replicate(),),
                                            "b3": (Shard(1),)},
                                    {"b1": (E, 3), "b2": (E, D), "b3": (E, 3)}),
        }
        for style, (mesh, placements, local_shapes) in expected.items():
            moe = make_biased_moe()
            ref = copy.deepcopy(moe)
            parallelize_module(moe, mesh, style())
            for name in ("b1", "b2", "b3"):
                with self.subTest(style=style.__name__, bias=name):
                    b = getattr(moe.experts, name)
                    self.assertIsInstance(b, DTensor)
                    self.assertEqual(b.placements, placements[name])
                    self.assertEqual(tuple(b.to_local().shape), local_shapes[name])
                    self.assertEqual(b.full_tensor(), getattr(ref.experts, name), atol=0, rtol=0)
        # the fused layout under expert parallelism: w1 [E, D, 2F] and b1 [E, 2F] by expert
        moe = make_biased_moe("swiglu_oai", fused_gate_up=True)
        parallelize_module(moe, mesh1, ExpertParallel())
        self.assertIsNone(moe.experts.w3)
        self.assertIsNone(moe.experts.b3)
        self.assertEqual(tuple(moe.experts.w1.to_local().shape), (2, D, 2 * F))
        self.assertEqual(tuple(moe.experts.b1.to_local().shape), (2, 2 * F))

    def test_refused(self):
        mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        fused = "fused_gate_up=True is not supported"
        cases = [
            (make_moe(activation="swiglu", fused_gate_up=True), mesh1, TensorParallelExperts(),
             fused),
            (make_biased_moe("swiglu_oai", fused_gate_up=True), mesh2, ExpertTensorParallel(),
             fused),
            (make_biased_moe(), mesh1, ExpertParallel(slots_per_rank=3),
             r"expert biases \(ffn_bias=True\) are not supported with replicas"),
        ]
        for module, mesh, style, msg in cases:
            with self.subTest(style=repr(style), msg=msg):
                with self.assertRaisesRegex(NotImplementedError, msg):
                    parallelize_module(module, mesh, style)
                # nothing was distributed
                self.assertFalse(any(isinstance(p, DTensor) for p in module.parameters()))

    def test_expert_parallel_with_biases(self):
        for ep in (4, 2):
            for activation, fused in LAYOUTS:
                with self.subTest(ep=ep, activation=activation, fused_gate_up=fused):
                    reset_dispatch_counters()
                    moe = make_biased_moe(activation, fused, num_shared_experts=1)
                    ref = copy.deepcopy(moe)
                    if ep == 4:
                        ep_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
                        group_ranks = [0, 1, 2, 3]
                    else:
                        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
                        ep_mesh = mesh["ep"]
                        group_ranks = ep_mesh.mesh.tolist()
                    parallelize_module(moe, ep_mesh, ExpertParallel())
                    compare_with_layer(self, moe, ref, lambda r: r, group_ranks,
                                       ep_mesh.get_group())

    def test_tensor_parallel_experts_with_biases(self):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        for activation in ("swiglu", "gelu"):
            with self.subTest(activation=activation):
                moe = make_biased_moe(activation, num_shared_experts=1)
                ref = copy.deepcopy(moe)
                parallelize_module(moe, mesh, TensorParallelExperts())
                # the same tokens on every rank
                compare_with_layer(self, moe, ref, lambda r: 0, [0], None)

    def test_expert_tensor_parallel_with_biases(self):
        for activation in ("swiglu", "gelu"):
            with self.subTest(activation=activation):
                reset_dispatch_counters()
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
                moe = make_biased_moe(activation, num_shared_experts=1)
                ref = copy.deepcopy(moe)
                parallelize_module(moe, mesh, ExpertTensorParallel())
                ep_ranks = mesh.mesh[:, mesh.get_coordinate()[1]].tolist()
                compare_with_layer(self, moe, ref, lambda r: r // 2, [r // 2 for r in ep_ranks],
                                   mesh["ep"].get_group())


if __name__ == "__main__":
    run_tests()
