# Owner(s): ["module: moe"]
"""ParallelStyles for the experts (``torch_moe.distributed.parallel``) through real gloo
collectives: one process per rank.

Every rank builds the same ``MoE`` and the same global tokens from fixed seeds, keeps its own
tokens, runs the parallelized layer and compares, in fp32 and within 1e-6, with the unsharded
layer on the tokens of every rank: the output and ``x.grad`` of its tokens, each expert weight
gradient (a DTensor placed like its weight, compared after ``full_tensor()``) and the router
and shared-expert gradients (each rank's own, averaged with an all-reduce), against the
unsharded layer's gradients divided by the number of data-parallel token sets, the mean that
DDP and FSDP take.

Each test costs a process spawn plus a gloo rendezvous (about 7-9 s on 2 CPU cores), so there
are four:

* ``ExpertParallel`` at EP=2 (two processes) and EP=4 (four processes);
* ``ExpertTensorParallel`` on a 2 x 2 ``(ep, tp)`` mesh;
* ``ExpertParallel`` on the ``ep`` dim of a 2 x 2 ``(edp, ep)`` mesh composed with FSDP2:
  ``fully_shard(moe.experts, mesh=mesh["edp"], shard_placement_fn=lambda p: Shard(1))``.

A failing rank fails its test: the base class reports the child's exception and stops the
other ranks.

Run: ``python -m pytest test/distributed/test_parallel_style_gloo.py -q`` from the repo root,
or ``python test/distributed/test_parallel_style_gloo.py``.
"""

import copy
import functools
import gc
import unittest

import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

from _parallel_style_common import compare_with_layer
from _parallel_style_common import make_moe as _make_moe


HAS_GLOO = dist.is_available() and dist.is_gloo_available()

if HAS_GLOO:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )

    from torch_moe.distributed.parallel import ExpertParallel, ExpertTensorParallel
else:  # keep the module importable so that the classes below are reported as skipped
    DTensorTestBase = TestCase

    def with_comms(func):
        return func


# the layer of these tests has a shared expert (a replicated, data-parallel parameter)
make_moe = functools.partial(_make_moe, num_shared_experts=1)


class _GlooBase(DTensorTestBase):
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

    def check(self, moe, ref, tokens_of, token_ranks, dp_group):
        # the non-expert gradients are this rank's own: average them over the world by default
        compare_with_layer(self, moe, ref, tokens_of, token_ranks,
                           dp_group if dp_group is not None else dist.group.WORLD)


@unittest.skipIf(not HAS_GLOO, "torch.distributed with the gloo backend is not available")
class TestParallelStyleGloo2(_GlooBase):
    @property
    def world_size(self) -> int:
        return 2

    @with_comms
    def test_expert_parallel_ep2(self):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        moe = make_moe()
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh, ExpertParallel())
        self.check(moe, ref, lambda r: r, [0, 1], None)


@unittest.skipIf(not HAS_GLOO, "torch.distributed with the gloo backend is not available")
class TestParallelStyleGloo4(_GlooBase):
    @property
    def world_size(self) -> int:
        return 4

    @with_comms
    def test_expert_parallel_ep4(self):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        moe = make_moe(activation="gelu")  # non-gated: no w3
        ref = copy.deepcopy(moe)
        parallelize_module(moe.experts, mesh, ExpertParallel())
        self.check(moe, ref, lambda r: r, [0, 1, 2, 3], None)

    @with_comms
    def test_expert_tensor_parallel_2x2(self):
        # ranks (ep, tp): [[0, 1], [2, 3]]; tp peers hold the same tokens, ep peers different
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        moe = make_moe()
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh, ExpertTensorParallel())
        ep_coord, tp_coord = mesh.get_coordinate()
        ep_peers = mesh.mesh[:, tp_coord].tolist()
        self.check(moe, ref, lambda r: r // 2, [r // 2 for r in ep_peers],
                   mesh["ep"].get_group())

    @with_comms
    def test_expert_parallel_with_fsdp2_2x2(self):
        # ranks (edp, ep): [[0, 1], [2, 3]]; all four hold different tokens. The experts are
        # Shard(0) on ep, so FSDP shards them on dim 1 over edp.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
        moe = make_moe()
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh["ep"], ExpertParallel())
        fully_shard(moe.experts, mesh=mesh["edp"], shard_placement_fn=lambda p: Shard(1))
        # FSDP's default division (by edp), as a SUM reduce-scatter and a division apart: gloo
        # has no AVG reduce-scatter
        moe.experts.set_force_sum_reduction_for_comms(True)
        for name in ("w1", "w2", "w3"):
            w = getattr(moe.experts, name)
            self.assertEqual(w.placements, (Shard(1), Shard(0)), msg=name)
            self.assertEqual(w.device_mesh.mesh_dim_names, ("edp", "ep"), msg=name)
            self.assertEqual(w.full_tensor(), getattr(ref.experts, name), atol=0, rtol=0)
        # the router and shared experts are data parallel over all four ranks, averaged here
        self.check(moe, ref, lambda r: r, [0, 1, 2, 3], None)


if __name__ == "__main__":
    run_tests()
