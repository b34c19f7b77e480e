# Owner(s): ["module: moe"]
"""ParallelStyles for the experts (``torch_moe.distributed.parallel``), in one process.

The ranks are threads (``DTensorOpTestBase``: four of them, the threaded process group, whose
``all_to_all_single`` and ``all_reduce`` are real exchanges between the threads), so these
tests are fast. Every rank builds the same ``MoE`` and the same global tokens, keeps its own
tokens and compares the parallelized layer with the unsharded one on the tokens of all the
ranks that share its experts: output, token gradient, every expert weight gradient (a DTensor
placed like its weight, compared after ``full_tensor()``) and the router and shared-expert
gradients (this rank's own, averaged over the ranks), all against the unsharded layer's
gradients divided by the number of data-parallel token sets: the mean DDP and FSDP take.

* parallelize-time errors: module type, mesh rank, divisibility, already parallelized,
  precision, capacity factor, unknown dispatch options;
* weight placements after ``parallelize_module``;
* a style sets nothing on the experts but their parameters and hooks (and ``distribute_module``'s
  mark), and a forward, also one that raises, leaves the DTensor parameters registered;
* ``ExpertParallel`` at EP=4 (1-D mesh) and EP=2 (the ``ep`` dim of a 2 x 2 mesh), gated and
  non-gated, with shared experts, and the per-rank ``tokens_per_expert``; with the
  dispatcher's ``dedup`` / ``num_chunks`` options when it has them;
* ``ExpertTensorParallel`` on a 2 x 2 ``(ep, tp)`` mesh behind tensor-parallel attention
  (``ColwiseParallel`` / ``RowwiseParallel``), and on a 2 x 2 mesh without dim names;
* ``TensorParallelExperts`` at TP=4;
* ``ExpertParallel`` with FSDP2 as the style module documents it, with FSDP's default
  gradient division (and with the gloo recipe's forced SUM reductions), at
  ``(edp, ep) = 2 x 2, 1 x 4, 2 x 4``;
* the worked example of the style module on 8 ranks ``(edp, ep, tp) = 2 x 2 x 2``:
  tensor-parallel attention, ``ExpertTensorParallel`` and FSDP2 (``fully_shard`` of the
  experts over ``edp`` on a dim EP and TP leave whole, of the block over ``edp x ep``).

Run: ``python -m pytest test/distributed/test_parallel_style.py -q`` from the repo root, or
``python test/distributed/test_parallel_style.py``.
"""

import copy
import inspect
import unittest

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_utils import TestCase, run_tests


HAS_DIST = dist.is_available()

if HAS_DIST:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        parallelize_module,
        RowwiseParallel,
    )
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase

    from torch_moe.distributed.dispatch import expert_parallel_moe_ffn, reset_dispatch_counters
    from torch_moe.distributed.parallel import (
        ExpertParallel,
        ExpertTensorParallel,
        TensorParallelExperts,
    )
else:  # keep the module importable so that the class below is reported as skipped
    DTensorOpTestBase = TestCase

from _parallel_style_common import _INIT_LOCK, compare_with_layer, global_tokens, make_moe

from torch_moe.nn import GroupedExperts


class _Attention(nn.Module):
    """Enough of an attention block for Colwise/Rowwise TP: per-head projections, a per-head
    nonlinearity (standing in for softmax(QK^T)V, which TP leaves local too) and wo."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        with _INIT_LOCK:
            torch.manual_seed(2)
            self.wq = nn.Linear(dim, dim, bias=False)
            self.wv = nn.Linear(dim, dim, bias=False)
            self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        return self.wo(torch.tanh(self.wq(x)) * self.wv(x))


class _Block(nn.Module):
    def __init__(self, **moe_cfg):
        super().__init__()
        self.attn = _Attention(8, 2)
        self.moe = make_moe(**moe_cfg)

    def forward(self, x):
        h = x + self.attn(x)
        return h + self.moe(h)


@unittest.skipIf(not HAS_DIST, "torch.distributed is not available")
class TestParallelStyle(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @property
    def device_type(self) -> str:
        return "cpu"

    # -----------------------------------------------------------------------------------------
    # parallelize-time checks and placements
    # -----------------------------------------------------------------------------------------

    def test_parallelize_errors(self):
        mesh1 = init_device_mesh("cpu", (4,))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        cases = [
            (nn.Linear(8, 8), mesh1, ExpertParallel(), ValueError,
             "expected a torch_moe MoE or GroupedExperts module, but got Linear"),
            (make_moe(), mesh2, ExpertParallel(), ValueError,
             r"expected a 1-D device mesh, but got a 2-D mesh of shape \(2, 2\)"),
            (make_moe(), mesh1, ExpertTensorParallel(), ValueError,
             r"expected a 2-D device mesh, but got a 1-D mesh of shape \(4,\)"),
            (make_moe(num_experts=6), mesh1, ExpertParallel(), ValueError,
             r"num_experts \(6\) to be divisible by the expert-parallel degree \(4\)"),
            (make_moe(hidden_dim=6), mesh1, TensorParallelExperts(), ValueError,
             r"hidden_dim \(6\) to be divisible by the tensor-parallel degree \(4\)"),
            (make_moe(hidden_dim=5), mesh2, ExpertTensorParallel(), ValueError,
             r"hidden_dim \(5\) to be divisible by the tensor-parallel \(mesh dim 1\) "
             r"degree \(2\)"),
            (make_moe(precision="fp8_rowwise"), mesh1, ExpertParallel(), NotImplementedError,
             "expected precision='bf16'"),
            (make_moe(capacity_factor=1.25), mesh1, ExpertParallel(), NotImplementedError,
             "expected capacity_factor=None, but got 1.25"),
        ]
        for module, mesh, style, exc, msg in cases:
            with self.subTest(style=repr(style), msg=msg), self.assertRaisesRegex(exc, msg):
                parallelize_module(module, mesh, style)

        moe = make_moe()
        parallelize_module(moe, mesh1, ExpertParallel())
        for again in (moe, moe.experts):
            with self.assertRaisesRegex(ValueError, "already parallelized"):
                parallelize_module(again, mesh1, TensorParallelExperts())
        with self.assertRaisesRegex(ValueError, r"unknown dispatch_options \['bogus'\]"):
            ExpertParallel(dispatch_options={"bogus": 1})
        with self.assertRaisesRegex(ValueError, "expected topk_ids, but got None"):
            moe.experts(torch.randn(3, 8), None, None, torch.ones(3, 2))

    def test_placements(self):
        mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        E, D, F = 8, 8, 12
        expected = {
            ExpertParallel: (mesh1, {"w1": (Shard(0),), "w2": (Shard(0),), "w3": (Shard(0),)},
                             {"w1": (2, D, F), "w2": (2, F, D), "w3": (2, D, F)}),
            ExpertTensorParallel: (mesh2, {"w1": (Shard(0), Shard(2)), "w2": (Shard(0), Shard(1)),
                                           "w3": (Shard(0), Shard(2))},
                                   {"w1": (4, D, 6), "w2": (4, 6, D), "w3": (4, D, 6)}),
            TensorParallelExperts: (mesh1, {"w1": (Shard(2),), "w2": (Shard(1),),
                                            "w3": (Shard(2),)},
                                    {"w1": (E, D, 3), "w2": (E, 3, D), "w3": (E, D, 3)}),
        }
        for style, (mesh, placements, local_shapes) in expected.items():
            for target in ("moe", "experts"):
                moe = make_moe()
                ref = copy.deepcopy(moe)
                module = moe if target == "moe" else moe.experts
                self.assertIs(parallelize_module(module, mesh, style()), module)
                # distribute_module partitions the weights and installs the style's hooks
                self.assertTrue(getattr(moe.experts, "_distribute_module_applied", False))
                self.assertNotIsInstance(moe.router.weight, DTensor)
                for name in ("w1", "w2", "w3"):
                    with self.subTest(style=style.__name__, target=target, weight=name):
                        w = getattr(moe.experts, name)
                        self.assertIsInstance(w, nn.Parameter)
                        self.assertIsInstance(w, DTensor)
                        self.assertEqual(w.placements, placements[name])
                        self.assertEqual(tuple(w.to_local().shape), local_shapes[name])
                        self.assertEqual(w.full_tensor(), getattr(ref.experts, name),
                                         atol=0, rtol=0)

    def test_styles_set_no_attribute_on_the_module(self):
        # a style acts through the weights it partitions and the hooks it registers: nothing
        # else of the experts' instance state changes, at parallelize time or in a forward,
        # but distribute_module's own mark
        mesh1 = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        internals = {"_parameters", "_forward_pre_hooks", "_forward_hooks",
                     "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
                     "_forward_pre_hooks_with_kwargs"}
        cases = ((ExpertParallel, mesh1), (ExpertTensorParallel, mesh2),
                 (TensorParallelExperts, mesh1))
        xs, gs = global_tokens(self.world_size)
        for style, mesh in cases:
            with self.subTest(style=style.__name__):
                moe = make_moe()
                state = dict(vars(moe.experts))
                parallelize_module(moe, mesh, style())
                after = vars(moe.experts)
                self.assertEqual(set(after) - set(state), {"_distribute_module_applied"})
                self.assertEqual(set(state) - set(after), set())
                changed = {k for k in state if k not in internals and after[k] is not state[k]}
                self.assertEqual(changed, set())
                self.assertIs(type(moe.experts), GroupedExperts)
                # a forward and backward leave the DTensor parameters registered
                params = dict(moe.experts.named_parameters())
                keys = set(after)
                moe(xs[0]).backward(gs[0])  # the same tokens on every rank: tp peers need them
                self.assertEqual(set(vars(moe.experts)), keys)
                self.assertEqual(dict(moe.experts.named_parameters()), params)
                for name, p in params.items():
                    self.assertIs(moe.experts._parameters[name], p)
                    self.assertIsInstance(p.grad, DTensor)

    def test_expert_parallel_forward_that_raises_restores_the_parameters(self):
        # the local shards stand in for the parameters only during a forward, even one that
        # fails between the pre-hook and the forward hook
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        moe = make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        params = dict(moe.experts.named_parameters())
        xs, _ = global_tokens(self.world_size)
        # a pre-hook registered after the style's runs after the tokens were exchanged and
        # before the experts' forward: it fails on every rank
        def fail(module, inputs):
            raise RuntimeError("expert kernel failed")

        handle = moe.experts.register_forward_pre_hook(fail)
        with self.assertRaisesRegex(RuntimeError, "expert kernel failed"):
            moe(xs[self.rank])
        handle.remove()
        for name, p in params.items():
            self.assertIs(moe.experts._parameters[name], p)
            self.assertIsInstance(p, DTensor)
        # and the layer works again
        self.assertEqual(moe(xs[self.rank]).shape, xs[self.rank].shape)

    def test_expert_parallel_after_an_interrupted_forward(self):
        # A KeyboardInterrupt skips the always-called forward hook that puts the parameters
        # back; the next forward must still compute on (and send gradients to) the DTensor
        # parameters, as a layer that was never interrupted does.
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        moe, fresh = make_moe(), make_moe()
        parallelize_module(moe, mesh, ExpertParallel())
        parallelize_module(fresh, mesh, ExpertParallel())
        params = dict(moe.experts.named_parameters())
        xs, gs = global_tokens(self.world_size)

        def interrupt(module, inputs):
            raise KeyboardInterrupt

        handle = moe.experts.register_forward_pre_hook(interrupt)
        with self.assertRaises(KeyboardInterrupt):
            moe(xs[self.rank])
        handle.remove()
        y, y_fresh = moe(xs[self.rank]), fresh(xs[self.rank])
        y.backward(gs[self.rank])
        y_fresh.backward(gs[self.rank])
        self.assertEqual(y, y_fresh)
        for name, p in params.items():
            self.assertIs(moe.experts._parameters[name], p)
            fresh_p = dict(fresh.experts.named_parameters())[name]
            self.assertIsInstance(p.grad, DTensor, msg=name)
            self.assertEqual(p.grad.full_tensor(), fresh_p.grad.full_tensor(), msg=name)

    # -----------------------------------------------------------------------------------------
    # numerics against the unsharded layer
    # -----------------------------------------------------------------------------------------

    def _compare(self, model, ref, tokens_of, token_ids, dp_group):
        compare_with_layer(self, model, ref, tokens_of, token_ids, dp_group)

    def test_expert_parallel_matches_moe(self):
        for ep, activation, shared in ((4, "swiglu", 1), (2, "gelu", 0), (2, "swiglu_oai", 1)):
            with self.subTest(ep=ep, activation=activation):
                # the dispatcher's per-expert counters are sized by the experts per rank
                reset_dispatch_counters()
                moe = make_moe(activation=activation, num_shared_experts=shared)
                ref = copy.deepcopy(moe)
                if ep == 4:
                    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
                    ep_mesh, group_ranks = mesh, [0, 1, 2, 3]
                else:
                    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
                    ep_mesh = mesh["ep"]
                    group_ranks = ep_mesh.mesh.tolist()
                parallelize_module(moe, ep_mesh, ExpertParallel())
                # router / shared experts are data parallel over the EP group
                self._compare(moe, ref, lambda r: r, group_ranks, ep_mesh.get_group())

                # the counts are those of this rank's tokens
                xs, _ = global_tokens(self.world_size)
                with torch.no_grad():
                    ids = ref.router(xs[self.rank])[0]
                expected = torch.bincount(ids.reshape(-1), minlength=8)
                self.assertEqual(moe.tokens_per_expert, expected, atol=0, rtol=0)

    def test_expert_parallel_dispatch_options(self):
        # forwarded to expert_parallel_moe_ffn as given; only the options that keep the result
        # exact (capacity mode drops assignments)
        accepted = inspect.signature(expert_parallel_moe_ffn).parameters
        options = {k: v for k, v in (("dedup", True), ("num_chunks", 2)) if k in accepted}
        if not options:
            self.skipTest("expert_parallel_moe_ffn takes no dedup / num_chunks options")
        reset_dispatch_counters()
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        moe = make_moe()
        ref = copy.deepcopy(moe)
        style = ExpertParallel(dispatch_options=options)
        self.assertEqual(style.dispatch_options, options)
        parallelize_module(moe, mesh, style)
        self._compare(moe, ref, lambda r: r, [0, 1, 2, 3], mesh.get_group())

    def test_expert_tensor_parallel_with_tp_attention(self):
        # mesh (ep, tp) = 2 x 2: tokens per ep rank, replicated over tp
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        model = _Block()
        ref = copy.deepcopy(model)
        parallelize_module(model.attn, mesh["tp"], {
            "wq": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()})
        parallelize_module(model.moe, mesh, ExpertTensorParallel())
        ep_ranks = mesh.mesh[:, mesh.get_coordinate()[1]].tolist()  # my ep group
        # the ranks of an ep group hold different tokens (ep coordinate r // 2); tp peers hold
        # the same ones. Attention and router are data parallel over ep.
        self._compare(model, ref, lambda r: r // 2, [r // 2 for r in ep_ranks],
                      mesh["ep"].get_group())

    def test_expert_tensor_parallel_unnamed_mesh(self):
        # a 2-D mesh without dim names: the tp groups come from the mesh's process groups
        mesh = init_device_mesh("cpu", (2, 2))
        moe = make_moe(num_shared_experts=1)
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh, ExpertTensorParallel())
        ep_ranks = mesh.mesh[:, mesh.get_coordinate()[1]].tolist()
        self._compare(moe, ref, lambda r: r // 2, [r // 2 for r in ep_ranks], mesh.get_group(0))

    def _fsdp_expert_parallel(self, edp: int, ep: int, force_sum: bool):
        """The documented recipe without tensor parallelism, with FSDP's default gradient
        division: experts on ``mesh["ep"]``, sharded once more over ``edp`` on dim 1, the rest
        of the layer over the flattened ``edp x ep`` mesh. All ranks hold different tokens."""
        mesh = init_device_mesh("cpu", (edp, ep), mesh_dim_names=("edp", "ep"))
        dp_mesh = mesh["edp", "ep"]._flatten("dp")
        moe = make_moe(num_shared_experts=1)
        ref = copy.deepcopy(moe)
        parallelize_module(moe, mesh["ep"], ExpertParallel())
        fully_shard(moe.experts, mesh=mesh["edp"], shard_placement_fn=lambda p: Shard(1))
        fully_shard(moe, mesh=dp_mesh)
        if force_sum:  # the gloo recipe: SUM collectives, FSDP's own division kept
            for m in (moe, moe.experts):
                m.set_force_sum_reduction_for_comms(True)
        self._compare(moe, ref, lambda r: r, list(range(edp * ep)), None)

    def test_expert_parallel_fsdp2_default_divide_factor(self):
        # FSDP divides the expert gradients by edp and the others by edp * ep; the expert
        # gradients must still be the mean over all edp * ep token sets, not ep times it
        for edp, ep in ((2, 2), (1, 4)):
            for force_sum in (False, True):
                with self.subTest(edp=edp, ep=ep, force_sum=force_sum):
                    reset_dispatch_counters()
                    self._fsdp_expert_parallel(edp, ep, force_sum)

    def test_tensor_parallel_experts_matches_moe(self):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        # gated (hidden = cat(gate, up) sharded in two halves) and not gated
        for activation in ("swiglu", "gelu"):
            with self.subTest(activation=activation):
                moe = make_moe(num_shared_experts=1, activation=activation)
                ref = copy.deepcopy(moe)
                parallelize_module(moe, mesh, TensorParallelExperts())
                # the same tokens on every rank: plain gradients are already whole
                self._compare(moe, ref, lambda r: 0, [0], None)


@unittest.skipIf(not HAS_DIST, "torch.distributed is not available")
class TestParallelStyleWorkedExample(DTensorOpTestBase):
    """The worked example of ``torch_moe.distributed.parallel.style`` on 8 ranks."""

    @property
    def world_size(self) -> int:
        return 8

    @property
    def device_type(self) -> str:
        return "cpu"

    _compare = TestParallelStyle._compare
    _fsdp_expert_parallel = TestParallelStyle._fsdp_expert_parallel

    def test_fsdp2_tp_attention_expert_tensor_parallel(self):
        # ranks (edp, ep, tp) = 2 x 2 x 2; tokens differ along edp and ep (dp index r // 2)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("edp", "ep", "tp"))
        dp_mesh = mesh["edp", "ep"]._flatten("dp")
        model = _Block()
        ref = copy.deepcopy(model)
        parallelize_module(model.attn, mesh["tp"], {
            "wq": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()})
        parallelize_module(model.moe, mesh["ep", "tp"], ExpertTensorParallel())
        experts = model.moe.experts
        # shard the model dim D, which neither ep (dim 0) nor tp (F) shards
        fully_shard(experts, mesh=mesh["edp"],
                    shard_placement_fn=lambda p: Shard(2 if p is experts.w2 else 1))
        fully_shard(model, mesh=dp_mesh)
        # FSDP's default gradient division: every gradient is the mean over the four
        # data-parallel token sets
        self.assertEqual(experts.w1.placements, (Shard(1), Shard(0), Shard(2)))
        self.assertEqual(experts.w2.placements, (Shard(2), Shard(0), Shard(1)))
        self.assertEqual(experts.w1.device_mesh.mesh_dim_names, ("edp", "ep", "tp"))
        # every gradient is reduced by FSDP: whole after full_tensor()
        self._compare(model, ref, lambda r: r // 2, [0, 1, 2, 3], None)

    def test_expert_parallel_fsdp2_2x4_default_divide_factor(self):
        # ep = 4 with two FSDP shards of every expert
        reset_dispatch_counters()
        self._fsdp_expert_parallel(2, 4, force_sum=False)


if __name__ == "__main__":
    run_tests()
