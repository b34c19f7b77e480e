# Owner(s): ["module: moe"]
"""Replicated experts in training (``ExpertParallel(slots_per_rank=...)`` and
``torch_moe.distributed.replicas``), on four threaded ranks.

The ranks are threads (``DTensorOpTestBase``, the threaded process group: its
``all_to_all_single``, ``all_reduce`` and ``all_gather`` are real exchanges between the
threads). Every rank builds the same ``MoE`` (E=8, k=2, fp32) with a Zipf-skewed router (a
router bias of ``-2 * 1.2 * log(rank of the expert)`` over a permutation of the experts, so the
hot experts are not the first ids) and compares with the unsharded layer in one process:

* parallelize-time errors (too few slots, a placement of other ranks or experts, options that
  disagree or are not supported) and the physical layout: ``Shard(0)`` DTensors ``[R * S, ...]``
  whose slots hold their logical experts' rows, logical ``tokens_per_expert``;
* one forward / backward: output and token gradient equal the unsharded layer's; after
  :func:`reduce_replica_grads_`, every replica's gradient is the logical expert's (the
  unsharded gradient over the number of data-parallel token sets) and replicas really
  received tokens;
* a training run of 5 AdamW steps of two micro-batches each, with a rebalance from the
  all-reduced loads after step 2: the losses and the logical parameters after the last step
  equal those of the single-process run on the same tokens, and the replicas stay bit-identical;
* a model of two replicated layers (different ``S``) and a plain one: one reduction, one
  rebalance of both, which keeps the logical weights bit for bit;
* rebalance errors (gradients present, loads that differ between ranks, wrong shape), raised
  the same on every rank;
* a DCP save and load of the physical weights, optimizer state and placement tables, bit-exact.

Run: ``python -m pytest test/distributed/test_replicas.py -q`` from the repo root.
"""

import tempfile
import unittest

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests, TestCase

HAS_DIST = dist.is_available()

if HAS_DIST:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorOpTestBase

    from torch_moe.distributed.parallel import ExpertParallel
    from torch_moe.distributed.placement import plan_placement
    from torch_moe.distributed.replicas import (
        clip_grad_norm_,
        expert_placement,
        load_placement_state_dict_,
        logical_expert_weights,
        placement_state_dict,
        rebalance_experts_,
        reduce_replica_grads_,
    )
else:  # keep the module importable so that the class below is reported as skipped
    DTensorOpTestBase = TestCase

from _parallel_style_common import _INIT_LOCK, make_moe, TOL

E, D, F, K = 8, 8, 12, 2
WEIGHTS = ("w1", "w2", "w3")


def skewed_moe():
    """The same MoE on every rank, its router skewed like a Zipf(1.2) load."""
    moe = make_moe(router_bias=True)
    with _INIT_LOCK, torch.no_grad():
        hotness = torch.randperm(E, generator=torch.Generator().manual_seed(3))
        moe.router.bias.copy_(-2.0 * 1.2 * torch.log1p(hotness.float()))
    return moe


def step_tokens(step: int, world: int, micro: int):
    """``(x, target)`` of every rank for one micro-batch, ``[T_r, D]`` with uneven T_r."""
    g = torch.Generator().manual_seed(100 * step + micro)
    xs = [torch.randn(6 + 2 * r, D, generator=g) for r in range(world)]
    ts = [torch.randn(6 + 2 * r, D, generator=g) for r in range(world)]
    return xs, ts


def loss_of(y, t):
    return ((y - t) ** 2).mean()


def assert_replicas_identical(test, moe, optimizer=None):
    """Every replica's weights (and optimizer state) equal its expert's first, bit for bit."""
    placement = expert_placement(moe)
    first = placement.logical_to_phys[:, 0][placement.phys_to_logical]
    for name in WEIGHTS:
        p = getattr(moe.experts, name)
        state = {} if optimizer is None else optimizer.state[p]
        for key, t in [("weight", p)] + [(k, v) for k, v in state.items() if v.dim() > 0]:
            full = t.full_tensor()
            test.assertEqual(full, full[first], atol=0, rtol=0, msg=f"{name} {key}")


def train_step(test, moe, optimizer, step, ep):
    """One step of two micro-batches; returns the loss of the step (mean over micro-batches
    and ranks). With ``ep`` the model is this rank's expert-parallel one; otherwise the
    single-process reference on every rank's tokens."""
    R, micro = test.world_size, 2
    losses = []
    for m in range(micro):
        xs, ts = step_tokens(step, R, m)
        if ep:
            loss = loss_of(moe(xs[test.rank]), ts[test.rank]) / micro
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total / R)
        else:
            loss = sum(loss_of(moe(x), t) for x, t in zip(xs, ts)) / (R * micro)
            loss.backward()
            losses.append(loss.detach())
    if ep:
        # the data-parallel mean of the replicated parameters (router); the experts' 1 / R
        # is the style's
        for p in moe.parameters():
            if not isinstance(p, DTensor) and p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad /= R
        reduce_replica_grads_(moe)
    optimizer.step()
    optimizer.zero_grad()
    return sum(losses)


def check_training_matches_single_process(test, mesh):
    """5 AdamW steps of two micro-batches on ``mesh`` (1-D, every rank), a rebalance from the
    all-reduced loads after step 2, against the single-process run on the same tokens: losses
    every step, logical parameters and Adam moments at the end, replicas (weights and moments)
    bit-identical."""
    moe, ref = skewed_moe(), skewed_moe()
    parallelize_module(moe, mesh, ExpertParallel(slots_per_rank=3))
    initial = expert_placement(moe)
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    for step in range(1, 6):
        loss = train_step(test, moe, opt, step, ep=True)
        ref_loss = train_step(test, ref, ref_opt, step, ep=False)
        test.assertEqual(loss, ref_loss, **TOL, msg=f"step {step}")
        if step == 2:
            # tokens_per_expert holds this rank's logical counts of the two steps
            load = moe.tokens_per_expert.clone()
            dist.all_reduce(load)
            moe.reset_load_stats()
            params = {n: getattr(moe.experts, n) for n in WEIGHTS}
            storages = {n: p.to_local().data_ptr() for n, p in params.items()}
            [result] = rebalance_experts_([moe], load[None], opt)
            test.assertTrue(result.moved)
            test.assertLess(result.imbalance_after, result.imbalance_before)
            test.assertEqual(result.imbalance_after, expert_placement(moe).imbalance(load))
            # the same parameters and storages: the optimizer's references stay valid
            for n, p in params.items():
                test.assertIs(getattr(moe.experts, n), p)
                test.assertEqual(p.to_local().data_ptr(), storages[n])
    test.assertFalse(torch.equal(expert_placement(moe).phys_to_logical,
                                 initial.phys_to_logical))
    assert_replicas_identical(test, moe, opt)
    logical = logical_expert_weights(moe)
    for name in WEIGHTS:
        test.assertEqual(logical[name], getattr(ref.experts, name), **TOL, msg=name)
    test.assertEqual(moe.router.weight, ref.router.weight, **TOL)
    test.assertEqual(moe.router.bias, ref.router.bias, **TOL)
    # the optimizer state moved with the weights: Adam's moments of every replica are
    # those of its expert in the reference
    placement = expert_placement(moe)
    for name in WEIGHTS:
        p, ref_p = getattr(moe.experts, name), getattr(ref.experts, name)
        for key in ("exp_avg", "exp_avg_sq"):
            test.assertEqual(opt.state[p][key].full_tensor(),
                             ref_opt.state[ref_p][key][placement.phys_to_logical],
                             **TOL, msg=f"{name} {key}")


@unittest.skipIf(not HAS_DIST, "torch.distributed is not available")
class TestReplicas(DTensorOpTestBase):
    @property
    def world_size(self) -> int:
        return 4

    @property
    def device_type(self) -> str:
        return "cpu"

    def mesh(self):
        return init_device_mesh("cpu", (self.world_size,), mesh_dim_names=("ep",))

    def test_parallelize_errors(self):
        mesh = self.mesh()
        other = plan_placement(torch.ones(E), 2, 5)
        fewer = plan_placement(torch.ones(6), 4, 2)
        cases = [
            (dict(slots_per_rank=1), ValueError,
             r"slots_per_rank \(1\) x the expert-parallel degree \(4\) >= num_experts \(8\)"),
            (dict(placement=other), ValueError,
             "a placement of the 8 experts over the 4 ranks of the expert-parallel mesh, but "
             "got one of 8 experts over 2 ranks"),
            (dict(placement=fewer), ValueError, "but got one of 6 experts over 4 ranks"),
        ]
        for kwargs, exc, msg in cases:
            with self.subTest(msg=msg), self.assertRaisesRegex(exc, msg):
                parallelize_module(skewed_moe(), mesh, ExpertParallel(**kwargs))
        with self.assertRaisesRegex(ValueError, "disagrees with the placement's 3 slots"):
            ExpertParallel(slots_per_rank=4, placement=plan_placement(torch.ones(E), 4, 3))
        with self.assertRaisesRegex(ValueError, "slots_per_rank to be a positive int"):
            ExpertParallel(slots_per_rank=0)
        with self.assertRaisesRegex(ValueError, "placement to be a Placement"):
            ExpertParallel(placement=torch.arange(8))
        with self.assertRaisesRegex(NotImplementedError, "capacity mode .* not supported with "
                                    "replicas"):
            ExpertParallel(slots_per_rank=3, dispatch_options=dict(capacity_factor=1.5))
        ExpertParallel(slots_per_rank=3, dispatch_options=dict(capacity_factor=None))
        # an expert id out of range on one rank: every rank raises (the dispatcher's check)
        moe = skewed_moe()
        parallelize_module(moe, mesh, ExpertParallel(slots_per_rank=3))
        ids = torch.tensor([[0, 1], [2, E if self.rank == 2 else 3]])
        with self.assertRaisesRegex(ValueError, "expert id"):
            moe.experts(torch.randn(2, D), None, None, torch.ones(2, K), ids)
        plain = make_moe()
        parallelize_module(plain, mesh, ExpertParallel())
        for fn in (expert_placement, logical_expert_weights):
            with self.assertRaisesRegex(ValueError, "parallelized by ExpertParallel with "
                                        "replicas"):
                fn(plain)
        # a model without replicated experts has nothing to reduce
        reduce_replica_grads_(plain)

    def test_physical_layout(self):
        # E = 8 on 4 ranks of 3 slots: 4 replicas; also E = 6 (not divisible by R) in 2 slots
        for num_experts, S in ((8, 3), (6, 2)):
            with self.subTest(E=num_experts, S=S):
                moe = make_moe(num_experts=num_experts)
                ref = {n: getattr(moe.experts, n).detach().clone() for n in WEIGHTS}
                style = ExpertParallel(slots_per_rank=S)
                parallelize_module(moe, self.mesh(), style)
                placement = expert_placement(moe)
                self.assertEqual(placement.num_physical, self.world_size * S)
                for name in WEIGHTS:
                    w = getattr(moe.experts, name)
                    self.assertIsInstance(w, DTensor)
                    self.assertEqual(w.placements, (Shard(0),))
                    self.assertEqual(w.shape[0], self.world_size * S)
                    self.assertEqual(w.full_tensor(), ref[name][placement.phys_to_logical],
                                     atol=0, rtol=0)
                    self.assertEqual(logical_expert_weights(moe)[name], ref[name],
                                     atol=0, rtol=0)
                y = moe(torch.randn(5, D))
                self.assertEqual(y.shape, (5, D))
                self.assertEqual(moe.tokens_per_expert.shape, (num_experts,))
                self.assertEqual(int(moe.tokens_per_expert.sum()), 5 * K)
                self.assertIn("slots_per_rank", repr(style))

    def test_forward_backward(self):
        for options in ({}, {"dedup": True, "num_chunks": 2}):
            with self.subTest(**options):
                self._check_forward_backward(options)

    def _check_forward_backward(self, options):
        R = self.world_size
        moe, ref = skewed_moe(), skewed_moe()
        # replicas of the hottest experts, so that they do receive tokens
        load = torch.exp(ref.router.bias.detach())
        placement = plan_placement(load, R, 3)
        self.assertGreater(int((placement.num_replicas > 1).sum()), 0)
        parallelize_module(moe, self.mesh(), ExpertParallel(placement=placement,
                                                            dispatch_options=options))

        xs, ts = step_tokens(0, R, 0)
        x = xs[self.rank].clone().requires_grad_()
        y = moe(x)
        loss_of(y, ts[self.rank]).backward()
        ref_x = torch.cat(xs).requires_grad_()
        ref_y = ref(ref_x)
        sum(loss_of(yr, t) for yr, t in zip(ref_y.split([t.size(0) for t in xs]), ts)) \
            .backward()
        start = sum(t.size(0) for t in xs[:self.rank])
        mine = slice(start, start + x.size(0))
        self.assertEqual(y, ref_y[mine], **TOL)
        self.assertEqual(x.grad, ref_x.grad[mine], **TOL)

        # before the reduction a replica's gradient covers only the tokens it served
        w1_full = moe.experts.w1.grad.full_tensor()
        served = [p for p in range(placement.num_physical)
                  if placement.num_replicas[placement.phys_to_logical[p]] > 1
                  and w1_full[p].abs().sum() > 0]
        self.assertGreater(len(served), 2)
        reduce_replica_grads_(moe)
        for name in WEIGHTS:
            grad = getattr(moe.experts, name).grad
            self.assertIsInstance(grad, DTensor)
            self.assertEqual(grad.placements, (Shard(0),))
            expected = getattr(ref.experts, name).grad / R
            self.assertEqual(grad.full_tensor(), expected[placement.phys_to_logical], **TOL,
                             msg=name)

    def test_clip_grad_norm_counts_every_expert_once(self):
        R = self.world_size
        moe, ref = skewed_moe(), skewed_moe()
        placement = plan_placement(torch.exp(ref.router.bias.detach()), R, 3)
        parallelize_module(moe, self.mesh(), ExpertParallel(placement=placement))
        xs, ts = step_tokens(0, R, 0)
        loss_of(moe(xs[self.rank]), ts[self.rank]).backward()
        sum(loss_of(ref(x), t) for x, t in zip(xs, ts)).backward()
        for p in moe.parameters():  # the data-parallel mean of the router's gradient
            if not isinstance(p, DTensor):
                dist.all_reduce(p.grad)
                p.grad /= R
        for p in ref.parameters():  # the mean over the R token sets
            p.grad /= R
        reduce_replica_grads_(moe)
        # torch's clip over the physical parameters counts a replicated expert once per replica
        physical = torch.nn.utils.get_total_norm(
            [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for p in moe.parameters()])
        for norm_type in (2.0, 1.0, float("inf")):
            expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()],
                                                     norm_type)
            if norm_type == 2.0:
                self.assertGreater(physical.item(), expected.item() * 1.01)
            with self.subTest(norm_type=norm_type):
                self.assertEqual(clip_grad_norm_(moe, float("inf"), norm_type), expected,
                                 atol=1e-6, rtol=1e-5)
        max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]).item()
        total = clip_grad_norm_(moe, max_norm)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        self.assertGreater(total.item(), max_norm)
        for name in WEIGHTS:
            self.assertEqual(getattr(moe.experts, name).grad.full_tensor(),
                             getattr(ref.experts, name).grad[placement.phys_to_logical], **TOL)
        self.assertEqual(moe.router.weight.grad, ref.router.weight.grad, **TOL)

    def test_training_matches_single_process(self):
        check_training_matches_single_process(self, self.mesh())

    def test_two_layers(self):
        # one reduction and one rebalance for a model of two replicated layers with different
        # slots (the gradients share one all_reduce buffer), and a layer without replicas
        R = self.world_size
        layers = [skewed_moe() for _ in range(3)]
        refs = [skewed_moe() for _ in range(3)]
        for moe, style in zip(layers, (ExpertParallel(slots_per_rank=3),
                                       ExpertParallel(slots_per_rank=4), ExpertParallel())):
            parallelize_module(moe, self.mesh(), style)
        model, ref = torch.nn.Sequential(*layers), torch.nn.Sequential(*refs)
        xs, ts = step_tokens(0, R, 0)
        loss_of(model(xs[self.rank]), ts[self.rank]).backward()
        sum(loss_of(ref(x), t) for x, t in zip(xs, ts)).backward()
        reduce_replica_grads_(model)
        for i in range(2):
            placement = expert_placement(layers[i])
            for name in WEIGHTS:
                expected = getattr(refs[i].experts, name).grad / R
                self.assertEqual(getattr(layers[i].experts, name).grad.full_tensor(),
                                 expected[placement.phys_to_logical], **TOL, msg=f"{i} {name}")
        model.zero_grad()
        loads = torch.stack([torch.exp(m.router.bias.detach()) * (100 + 10 * i)
                             for i, m in enumerate(layers[:2])]).round()
        before = [logical_expert_weights(m) for m in layers[:2]]
        results = rebalance_experts_(layers[:2], loads)
        self.assertEqual([r.moved for r in results], [True, True])
        for moe, result, weights in zip(layers, results, before):
            self.assertIs(expert_placement(moe), result.placement)
            self.assertEqual(result.placement.slots_per_rank,
                             moe.experts.w1.shape[0] // R)
            self.assertLessEqual(result.imbalance_after, result.imbalance_before)
            for name, w in logical_expert_weights(moe).items():
                self.assertEqual(w, weights[name], atol=0, rtol=0)
            assert_replicas_identical(self, moe)

    def test_rebalance_errors(self):
        moe = skewed_moe()
        parallelize_module(moe, self.mesh(), ExpertParallel(slots_per_rank=3))
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
        load = torch.arange(1, E + 1)
        with self.assertRaisesRegex(ValueError, r"expected loads to be a \[1, 8\] tensor"):
            rebalance_experts_([moe], load, opt)
        with self.assertRaisesRegex(ValueError, "expected a non-empty sequence"):
            rebalance_experts_(moe, load[None], opt)
        # a rank with another load: every rank raises
        with self.assertRaisesRegex(ValueError, r"same global load on every rank .* ranks \[3\]"):
            rebalance_experts_([moe], (load + (self.rank == 3))[None], opt)
        # a bad load on one rank: that rank raises its own error, the others name it
        bad = load.double()[None] * (-1 if self.rank == 1 else 1)
        msg = ("non-negative" if self.rank == 1
               else r"the arguments of ranks \[1\] of the expert-parallel group are invalid")
        with self.assertRaisesRegex(ValueError, msg):
            rebalance_experts_([moe], bad, opt)
        moe(torch.randn(4, D)).sum().backward()
        with self.assertRaisesRegex(ValueError, "expected the expert weights to have no "
                                    "gradient"):
            rebalance_experts_([moe], load[None], opt)
        opt.zero_grad()
        before = expert_placement(moe)
        [result] = rebalance_experts_([moe], load[None], opt)
        self.assertTrue(result.moved)
        self.assertIsNot(expert_placement(moe), before)
        # a placement that serves the load at least as well as a new plan is kept
        kept = expert_placement(moe)
        [again] = rebalance_experts_([moe], load[None], opt)
        self.assertFalse(again.moved)
        self.assertIs(expert_placement(moe), kept)
        self.assertIs(again.placement, kept)
        self.assertEqual(again.imbalance_after, again.imbalance_before)

    def test_checkpoint_save_load_bit_exact(self):
        moe = skewed_moe()
        parallelize_module(moe, self.mesh(), ExpertParallel(slots_per_rank=3))
        opt = torch.optim.AdamW(moe.parameters(), lr=1e-2)
        for step in range(1, 3):
            train_step(self, moe, opt, step, ep=True)
        load = torch.exp(moe.router.bias.detach()) * 1000
        rebalance_experts_([moe], load.round()[None], opt)
        # the same directory on every rank (threads of one process)
        path = [tempfile.mkdtemp() if self.rank == 0 else None]
        dist.broadcast_object_list(path)
        model_sd, optim_sd = get_state_dict(moe, opt)
        dcp.save({"model": model_sd, "optim": optim_sd,
                  "placement": placement_state_dict(moe)}, checkpoint_id=path[0])
        saved = {n: getattr(moe.experts, n).full_tensor() for n in WEIGHTS}
        saved_placement = expert_placement(moe).phys_to_logical.clone()

        fresh = skewed_moe()
        parallelize_module(fresh, self.mesh(), ExpertParallel(slots_per_rank=3))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        train_step(self, fresh, fresh_opt, 9, ep=True)  # create the optimizer state
        model_sd, optim_sd = get_state_dict(fresh, fresh_opt)
        state = {"model": model_sd, "optim": optim_sd, "placement": placement_state_dict(fresh)}
        dcp.load(state, checkpoint_id=path[0])
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        load_placement_state_dict_(fresh, state["placement"])
        self.assertEqual(expert_placement(fresh).phys_to_logical, saved_placement)
        for n in WEIGHTS:
            self.assertEqual(getattr(fresh.experts, n).full_tensor(), saved[n], atol=0, rtol=0)
        # both continue identically, bit for bit
        for step in (3, 4):
            a = train_step(self, moe, opt, step, ep=True)
            b = train_step(self, fresh, fresh_opt, step, ep=True)
            self.assertEqual(a, b, atol=0, rtol=0)
        for n in WEIGHTS:
            self.assertEqual(getattr(fresh.experts, n).full_tensor(),
                             getattr(moe.experts, n).full_tensor(), atol=0, rtol=0)


if __name__ == "__main__":
    run_tests()
