# Owner(s): ["module: moe"]
"""Replicated experts in training through real gloo collectives: four processes.

The training comparison of ``test_replicas.py`` (5 AdamW steps of two micro-batches with a
Zipf-skewed router, ``ExpertParallel(slots_per_rank=3)`` for E=8 on 4 ranks, a rebalance from
the all-reduced loads after step 2, against the single-process run: losses, logical parameters
and Adam moments within 1e-6, replicas bit-identical) with one process per rank, where the
threaded tests share one process: the gradient reduction, the rebalance's all-to-alls and the
load check go through gloo. One test: a spawn and a rendezvous cost about 7-9 s.

Run: ``python -m pytest test/distributed/test_replicas_gloo.py -q`` from the repo root.
"""

import gc
import unittest

import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests, TestCase

from test_replicas import check_training_matches_single_process

HAS_GLOO = dist.is_available() and dist.is_gloo_available()

if HAS_GLOO:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed._tensor.common_dtensor import (
        DTensorTestBase,
        with_comms,
    )
else:  # keep the module importable so that the class below is reported as skipped
    DTensorTestBase = TestCase

    def with_comms(func):
        return func


@unittest.skipIf(not HAS_GLOO, "gloo is not available")
class TestReplicasGloo(DTensorTestBase):
    @property
    def backend(self) -> str:
        return "gloo"

    @property
    def device_type(self) -> str:
        return "cpu"

    @property
    def world_size(self) -> int:
        return 4

    def destroy_pg(self, device_id=None) -> None:
        # free the autograd graphs' reference cycles (tensors of functional collectives) while
        # the interpreter is whole, as test_parallel_style_gloo.py does
        gc.collect()
        super().destroy_pg(device_id)

    @with_comms
    def test_training_matches_single_process(self):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        check_training_matches_single_process(self, mesh)


if __name__ == "__main__":
    run_tests()
