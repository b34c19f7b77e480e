# Owner(s): ["module: moe"]
"""``MoE`` and ``GroupedExperts`` under FSDP2 (``fully_shard``) when the caller modifies their
output in place (``y = moe(h); y += shared(h)``, ``y.mul_(2)``).

``fully_shard`` registers its pre-backward hook (the all-gather of the resharded parameters)
on the module's output. An in-place op on an output that is a view rebases the view's history
and drops that hook: the backward then runs on freed parameters. So neither module may return
a view, FSDP must not warn about one, and the gradients with an in-place op on the output
must be those of the unsharded layer.

The ranks are threads (``DTensorOpTestBase``, two of them), each with its own tokens; the
reference is the unsharded layer run on every rank's tokens, its parameter gradients divided
by the number of ranks (FSDP's mean).
"""

import contextlib
import copy
import unittest
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_utils import run_tests, TestCase


HAS_DIST = dist.is_available()

if HAS_DIST:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase

    from torch_moe.distributed.dispatch import reset_dispatch_counters
    from torch_moe.distributed.parallel import (
        ExpertParallel, ExpertTensorParallel, TensorParallelExperts)
else:  # keep the module importable so that the class below is reported as skipped
    DTensorOpTestBase = TestCase

from _parallel_style_common import _INIT_LOCK, global_tokens, make_moe

_VIEW_WARNING = "returned a view tensor"


class _Block(nn.Module):
    """``moe(h)`` followed by an in-place op on its output."""

    def __init__(self, in_place: str, **moe_cfg):
        super().__init__()
        self.in_place = in_place
        self.moe = make_moe(**moe_cfg)
        with _INIT_LOCK:
            torch.manual_seed(3)
            self.proj = nn.Linear(8, 8)

    def forward(self, h):
        y = self.moe(h)
        if self.in_place == "add_":
            y += self.proj(h)
        else:
            y.mul_(2)
            y = y + self.proj(h)
        return torch.tanh(y)


@unittest.skipIf(not HAS_DIST, "torch.distributed is not available")
class TestFSDPOutputViews(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 2

    @property
    def device_type(self) -> str:
        return "cpu"

    @contextlib.contextmanager
    def _view_warnings(self):
        """The FSDP view warnings of every rank. ``warnings.catch_warnings`` swaps process-wide
        state, so one thread (rank 0) enters it for all of them, between barriers."""
        found = []
        dist.barrier()
        with warnings.catch_warnings(record=True) if self.rank == 0 else contextlib.nullcontext() as rec:
            if self.rank == 0:
                warnings.simplefilter("always")
            dist.barrier()
            yield found
            dist.barrier()
        if self.rank == 0:
            found.extend(str(w.message) for w in rec if _VIEW_WARNING in str(w.message))

    def _check(self, model, ref, shape):
        """Forward / backward of ``model`` on this rank's tokens (``shape``) against ``ref``."""
        xs, gs = global_tokens(self.world_size)
        xs = [x[:4].reshape(shape) for x in xs]
        gs = [g[:4].reshape(shape) for g in gs]
        x = xs[self.rank].clone().requires_grad_()
        with self._view_warnings() as found:
            y = model(x)
            y.backward(gs[self.rank])
        self.assertEqual(found, [], msg=f"fully_shard warned: {found}")

        ref_xs = [t.clone().requires_grad_() for t in xs]
        for ref_x, g in zip(ref_xs, gs):
            ref(ref_x).backward(g)
        self.assertEqual(x.grad, ref_xs[self.rank].grad, atol=1e-6, rtol=1e-6)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.assertEqual(grad, ref_params[name].grad / self.world_size, atol=1e-6,
                             rtol=1e-6, msg=name)

    def test_expert_parallel_recipe(self):
        # the style module's recipe at (edp, ep) = 1 x 2: experts expert parallel over ep and
        # fully_shard over edp, the block over edp x ep; the attached aux loss reaches the
        # router through the dispatcher's gradient of the routing weights
        for in_place in ("add_", "mul_"):
            for shared in (0, 1):
                with self.subTest(in_place=in_place, shared=shared):
                    reset_dispatch_counters()
                    model = _Block(in_place, num_shared_experts=shared,
                                   load_balance_coeff=0.1)
                    ref = copy.deepcopy(model)
                    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "ep"))
                    parallelize_module(model.moe, mesh["ep"], ExpertParallel())
                    fully_shard(model.moe.experts, mesh=mesh["edp"],
                                shard_placement_fn=lambda p: Shard(1))
                    fully_shard(model, mesh=mesh["edp", "ep"]._flatten("dp"))
                    self._check(model, ref, (4, 8))

    def test_tensor_parallel_experts_recipe(self):
        # the experts' output is summed over tp by the styles' output function: with fully_shard
        # on the experts it must not be a view either
        for in_place in ("add_", "mul_"):
            with self.subTest(in_place=in_place):
                model = _Block(in_place, num_shared_experts=1, load_balance_coeff=0.1)
                ref = copy.deepcopy(model)
                mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("edp", "tp"))
                parallelize_module(model.moe, mesh["tp"], TensorParallelExperts())
                fully_shard(model.moe.experts, mesh=mesh["edp"],
                            shard_placement_fn=lambda p: Shard(1))
                fully_shard(model, mesh=mesh["edp"])
                self._check_replicated(model, ref, (4, 8))

    def test_expert_tensor_parallel_recipe(self):
        for in_place in ("add_", "mul_"):
            with self.subTest(in_place=in_place):
                reset_dispatch_counters()
                model = _Block(in_place, num_shared_experts=1, load_balance_coeff=0.1)
                ref = copy.deepcopy(model)
                mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("edp", "ep", "tp"))
                parallelize_module(model.moe, mesh["ep", "tp"], ExpertTensorParallel())
                fully_shard(model.moe.experts, mesh=mesh["edp"],
                            shard_placement_fn=lambda p: Shard(1))
                fully_shard(model, mesh=mesh["edp"])
                self._check_replicated(model, ref, (4, 8))

    def _check_replicated(self, model, ref, shape):
        """Forward / backward of ``model`` on tokens replicated over the tensor-parallel ranks
        against the unsharded ``ref`` on the same tokens."""
        xs, gs = global_tokens(self.world_size)
        x0, g0 = xs[0][:4].reshape(shape), gs[0][:4].reshape(shape)
        x = x0.clone().requires_grad_()
        with self._view_warnings() as found:
            y = model(x)
            y.backward(g0)
        self.assertEqual(found, [], msg=f"fully_shard warned: {found}")
        ref_x = x0.clone().requires_grad_()
        ref(ref_x).backward(g0)
        self.assertEqual(x.grad, ref_x.grad, atol=1e-6, rtol=1e-6)
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.assertEqual(grad, ref_params[name].grad, atol=1e-6, rtol=1e-6, msg=name)

    def test_fully_shard_moe_and_experts(self):
        # data parallel, every module of the layer its own FSDP unit; [B, L, D] tokens and
        # attached aux losses
        for in_place in ("add_", "mul_"):
            for shared in (0, 1):
                with self.subTest(in_place=in_place, shared=shared):
                    model = _Block(in_place, num_shared_experts=shared, load_balance_coeff=0.1)
                    ref = copy.deepcopy(model)
                    mesh = init_device_mesh("cpu", (2,))
                    fully_shard(model.moe.experts, mesh=mesh)
                    fully_shard(model.moe, mesh=mesh)
                    fully_shard(model, mesh=mesh)
                    self._check(model, ref, (2, 2, 8))


if __name__ == "__main__":
    run_tests()
