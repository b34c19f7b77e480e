# Owner(s): ["module: moe"]
"""Tests of ``torch_moe.nn.MoE``: routing options against the per-token reference, auxiliary
losses against their formulas, aux-loss-free balancing, capacity, and bad configurations."""

import math

import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.testing._internal.common_utils import (
    IS_CI,
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe import _refs
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn import functional as F_moe


def _moe(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    defaults = dict(dim=8, hidden_dim=6, num_experts=8, top_k=2)
    defaults.update(kw)
    return MoE(MoEConfig(**defaults), dtype=dtype)


@st.composite
def configs(draw):
    E = draw(st.sampled_from([1, 2, 4, 6, 8]))
    k = draw(st.integers(1, E))
    kw = dict(num_experts=E, top_k=k)
    kw["score_func"] = draw(st.sampled_from(["softmax", "sigmoid"]))
    kw["topk_before_score"] = draw(st.booleans())
    kw["normalize_topk"] = draw(st.booleans())
    kw["route_scale"] = draw(st.sampled_from([1.0, 2.5]))
    kw["activation"] = draw(st.sampled_from(["swiglu", "geglu", "swiglu_oai", "gelu", "relu"]))
    kw["swiglu_limit"] = 1.0
    if not kw["topk_before_score"]:
        kw["load_balance_bias"] = draw(st.booleans())
        divisors = [n for n in range(2, E + 1) if E % n == 0]
        if divisors and draw(st.booleans()):
            n = draw(st.sampled_from(divisors))
            m_min = max(1, -(-k // (E // n)))
            kw["num_expert_groups"] = n
            kw["topk_groups"] = draw(st.integers(m_min, n))
    if draw(st.booleans()):
        kw["capacity_factor"] = draw(st.sampled_from([0.5, 1.0, 1.25]))
    kw["num_shared_experts"] = draw(st.integers(0, 2))
    kw["shared_expert_gate"] = kw["num_shared_experts"] > 0 and draw(st.booleans())
    kw["router_bias"] = draw(st.booleans())
    return kw


class TestMoEReference(TestCase):
    @settings(max_examples=40, deadline=None, derandomize=IS_CI, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(configs(), st.integers(0, 12), st.integers(0, 2**16))
    def test_matches_per_token_reference(self, kw, T, seed):
        moe = _moe(seed=seed, **kw)
        g = torch.Generator().manual_seed(seed)
        if moe.router.expert_bias is not None:
            moe.router.expert_bias.copy_(torch.randn(kw["num_experts"], generator=g) * 0.1)
        if moe.router.bias is not None:
            with torch.no_grad():
                moe.router.bias.copy_(torch.randn(kw["num_experts"], generator=g))
        moe.eval()
        x = torch.randn(T, 8, generator=g, dtype=torch.float64)
        # routing runs in fp32 by design: weights agree to fp32 precision
        self.assertEqual(moe(x), _refs.moe_layer(x, moe), atol=1e-6, rtol=1e-6)

    def test_bf16_parameters_compute_in_bf16(self):
        moe = _moe(dtype=torch.bfloat16)
        x = torch.randn(4, 3, 8, dtype=torch.bfloat16)
        y = moe(x)
        self.assertEqual((y.dtype, y.shape), (torch.bfloat16, x.shape))
        self.assertEqual(y.float(), _refs.moe_layer(x.view(-1, 8), moe).view(4, 3, 8).float(),
                         atol=3e-2, rtol=3e-2)

    def test_fp32_parameters_compute_in_fp32(self):
        moe = _moe(dtype=torch.float32)
        x = torch.randn(16, 8)
        self.assertEqual(moe(x), _refs.moe_layer(x, moe).float(), atol=1e-5, rtol=1e-5)


class TestRouting(TestCase):
    def test_ties_go_to_lowest_expert(self):
        logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], dtype=torch.bfloat16)
        ids, _, _ = F_moe.route(logits, 2)
        self.assertEqual(ids.tolist(), [[1, 2]])
        ids, _, _ = F_moe.route(logits, 3, topk_before_score=True)
        self.assertEqual(ids.tolist(), [[1, 2, 4]])

    def test_scores_in_fp32(self):
        ids, weights, scores = F_moe.route(torch.randn(4, 6, dtype=torch.bfloat16), 2)
        self.assertEqual((weights.dtype, scores.dtype), (torch.float32, torch.float32))

    def test_nan_logits_raise(self):
        logits = torch.randn(3, 4)
        logits[1, 2] = float("nan")
        with self.assertRaisesRegex(RuntimeError, "router logits contain NaN or Inf"):
            F_moe.route(logits, 2)

    def test_bias_changes_selection_not_weights(self):
        logits = torch.tensor([[2.0, 1.0, 0.0]])
        bias = torch.tensor([0.0, 0.0, 1.0])
        ids, weights, scores = F_moe.route(logits, 1, expert_bias=bias)
        self.assertEqual(ids.tolist(), [[2]])
        self.assertEqual(weights, scores[:, 2:3])


def _task_loss(y):
    # a loss that is not a plain sum, so that its gradient differs from token to token
    return (y * torch.linspace(-1.0, 2.0, y.size(-1), dtype=y.dtype)).square().mean()


class TestAuxLosses(TestCase):
    def test_load_balancing_loss_uniform_is_one(self):
        # 4 tokens, 2 experts, k=1, perfectly balanced and uniform probabilities
        scores = torch.full((4, 2), 0.5)
        ids = torch.tensor([[0], [1], [0], [1]])
        self.assertEqual(F_moe.load_balancing_loss(scores, ids, 2), torch.tensor(1.0))

    def test_load_balancing_loss_hand_example(self):
        scores = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1]])
        ids = torch.tensor([[0, 1], [0, 2]])
        # f = [2, 1, 1] / 4, P = [0.65, 0.25, 0.1]; E * sum(f * P) = 3 * (0.325 + 0.0625 + 0.025)
        self.assertEqual(F_moe.load_balancing_loss(scores, ids, 3), torch.tensor(3 * 0.4125))

    def test_sequence_balance_loss_hand_example(self):
        # two sequences of 2 tokens, E = 2, k = 1
        scores = torch.tensor([[0.8, 0.2], [0.6, 0.4], [0.5, 0.5], [0.1, 0.9]])
        ids = torch.tensor([[0], [0], [0], [1]])
        # seq 0: f = 2/(1*2) * [2, 0] = [2, 0], P = [0.7, 0.3] -> 1.4
        # seq 1: f = [1, 1], P = [0.3, 0.7] -> 1.0; mean 1.2
        self.assertEqual(F_moe.sequence_balance_loss(scores, ids, 2, 2), torch.tensor(1.2))

    def test_z_loss_hand_example(self):
        logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
        # logsumexp: log 2 and log 4
        expected = (math.log(2.0) ** 2 + math.log(4.0) ** 2) / 2
        self.assertEqual(F_moe.router_z_loss(logits), torch.tensor(expected))

    def test_losses_reach_router_gradient_once_per_microbatch(self):
        # attached losses give the same router gradient as adding them to the loss by hand,
        # and accumulate across micro-batches like the main loss does
        kw = dict(load_balance_coeff=0.1, seq_balance_coeff=0.05, z_loss_coeff=0.01)
        moe = _moe(**kw)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        for _ in range(2):
            moe(x).sum().backward()
        got = moe.router.weight.grad.clone()

        moe.zero_grad()
        for _ in range(2):
            x_TD = x.view(-1, 8)
            ids, w, scores, logits = moe.router(x_TD)
            s, offs, _ = torch.ops.torch_moe.token_sort(ids, 8)
            y = moe.experts(x_TD, s, offs, w)
            aux = (0.1 * F_moe.load_balancing_loss(scores, ids, 8)
                   + 0.05 * F_moe.sequence_balance_loss(scores, ids, 8, 5)
                   + 0.01 * F_moe.router_z_loss(logits))
            (y.sum() + aux).backward()
        self.assertEqual(got, moe.router.weight.grad)

    _AUX_COEFFS = {"load_balance": "load_balance_coeff", "seq_balance": "seq_balance_coeff",
                   "z_loss": "z_loss_coeff"}

    def _explicit_router_grad(self, moe, x, aux, coeff, loss_scale):
        # the reference: loss_scale * (loss + coeff * aux) built by hand from the submodules
        x_TD = x.view(-1, 8)
        ids, w, scores, logits = moe.router(x_TD)
        s, offs, _ = torch.ops.torch_moe.token_sort(ids, 8)
        y = moe.experts(x_TD, s, offs, w).view(x.shape)
        aux_value = {
            "load_balance": lambda: F_moe.load_balancing_loss(scores, ids, 8),
            "seq_balance": lambda: F_moe.sequence_balance_loss(scores, ids, 8, x.size(1)),
            "z_loss": lambda: F_moe.router_z_loss(logits),
        }[aux]()
        moe.zero_grad()
        (loss_scale * (_task_loss(y) + coeff * aux_value)).backward()
        return moe.router.weight.grad.clone()

    @parametrize("aux", ["load_balance", "seq_balance", "z_loss"])
    @parametrize("mechanism", ["attached", "attached_tensor_scale", "returned"])
    def test_aux_loss_under_loss_scaling_is_the_explicit_sum(self, aux, mechanism):
        # (scale * loss).backward(), as a GradScaler does: the aux loss must act as if it were
        # added to the loss before scaling, or it is `scale` times too weak after unscaling
        loss_scale, coeff = 1024.0, 0.1
        moe = _moe(**{self._AUX_COEFFS[aux]: coeff})
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        expected = self._explicit_router_grad(moe, x, aux, coeff, loss_scale)
        moe.zero_grad()
        if mechanism == "returned":
            y, aux_loss = moe(x, return_aux_loss=True)
            (loss_scale * (_task_loss(y) + aux_loss)).backward()
        else:
            moe.aux_loss_scale = (loss_scale if mechanism == "attached"
                                  else torch.tensor(loss_scale, dtype=torch.float64))
            (loss_scale * _task_loss(moe(x))).backward()
        self.assertEqual(moe.router.weight.grad, expected, atol=1e-9, rtol=1e-9)

    def test_returned_aux_loss_with_grad_scaler(self):
        # the returned aux loss goes through torch.amp.GradScaler like any other loss term
        kw = dict(load_balance_coeff=0.1, seq_balance_coeff=0.05, z_loss_coeff=0.01)
        moe = _moe(**kw)
        x = torch.randn(2, 5, 8, dtype=torch.float64)
        y, aux_loss = moe(x, return_aux_loss=True)
        (_task_loss(y) + aux_loss).backward()
        expected = moe.router.weight.grad.clone()
        moe.zero_grad()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        optimizer = torch.optim.SGD(moe.parameters(), lr=0.0)
        y, aux_loss = moe(x, return_aux_loss=True)
        scaler.scale(_task_loss(y) + aux_loss).backward()
        scaler.unscale_(optimizer)
        self.assertEqual(moe.router.weight.grad, expected, atol=1e-9, rtol=1e-9)

    def test_returned_aux_loss_is_not_attached(self):
        moe = _moe(load_balance_coeff=0.1)
        x = torch.randn(6, 8, dtype=torch.float64)
        y, aux_loss = moe(x, return_aux_loss=True)
        y.sum().backward()  # without the aux loss in the loss, it contributes nothing
        got = moe.router.weight.grad.clone()
        moe.zero_grad()
        moe.eval()
        moe(x).sum().backward()
        self.assertEqual(got, moe.router.weight.grad)
        self.assertEqual(aux_loss.shape, ())

    def test_returned_aux_loss_is_zero_without_aux_losses_or_in_eval(self):
        x = torch.randn(6, 8, dtype=torch.float64)
        _, aux_loss = _moe()(x, return_aux_loss=True)
        self.assertEqual(aux_loss, torch.zeros((), dtype=torch.float32))
        _, aux_loss = _moe(z_loss_coeff=0.1).eval()(x, return_aux_loss=True)
        self.assertEqual(aux_loss, torch.zeros((), dtype=torch.float32))

    def test_losses_are_logged(self):
        moe = _moe(load_balance_coeff=0.1, z_loss_coeff=0.01)
        moe(torch.randn(6, 8, dtype=torch.float64))
        self.assertEqual(sorted(moe.aux_losses), ["load_balance", "z_loss"])


class TestBalancing(TestCase):
    def test_bias_update_moves_load_toward_balance(self):
        # a skewed stream: token features make experts 0 and 1 far more attractive
        torch.manual_seed(0)
        moe = _moe(dtype=torch.float32, num_experts=8, top_k=2, load_balance_bias=True,
                   bias_update_rate=0.02)
        with torch.no_grad():
            moe.router.weight[:2] += 0.5
        stream = [torch.randn(64, 8) + 0.5 for _ in range(200)]

        def imbalance(load):
            load = load.float()
            return (load.max() / load.mean()).item()

        moe(stream[0])
        first = imbalance(moe.update_expert_bias())
        for x in stream[1:-10]:
            moe(x)
            moe.update_expert_bias()
        for x in stream[-10:]:
            moe(x)
        last = imbalance(moe.tokens_per_expert)
        self.assertGreater(first, 2.0)
        self.assertLess(last, 1.5)
        self.assertLess(last, first / 2)

    def test_update_without_bias_raises(self):
        with self.assertRaisesRegex(RuntimeError, "load_balance_bias=False"):
            _moe().update_expert_bias()

    def test_bf16_module_keeps_exact_stats_and_fp32_bias(self):
        moe = _moe(dtype=torch.float32, load_balance_bias=True).to(torch.bfloat16)
        self.assertEqual((moe.router.expert_bias.dtype, moe.tokens_per_expert.dtype),
                         (torch.float32, torch.int64))
        moe(torch.randn(1000, 8, dtype=torch.bfloat16))
        self.assertEqual(moe.tokens_per_expert.sum().item(), 2000)

    def test_load_stats_count_training_assignments(self):
        moe = _moe(num_experts=4, top_k=2)
        moe(torch.randn(10, 8, dtype=torch.float64))
        self.assertEqual(moe.tokens_per_expert.sum().item(), 20.0)
        moe.eval()
        moe(torch.randn(10, 8, dtype=torch.float64))
        self.assertEqual(moe.tokens_per_expert.sum().item(), 20.0)


class TestCapacity(TestCase):
    def test_drops_lowest_weights_deterministically(self):
        ids = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
        weights = torch.tensor([[0.9, 0.1], [0.5, 0.5], [0.7, 0.3], [0.6, 0.4]])
        sorted_ids, offs, kept, dropped = F_moe.token_sort_with_capacity(ids, weights, 3, 2)
        self.assertExpectedInline(
            str((sorted_ids.tolist(), offs.tolist(), kept.tolist(), dropped.item())),
            """([0, 4, 6, 5, 3, -1, -1, -1], [2, 4, 5], [2, 2, 1], 3)""",
        )

    def test_reports_dropped(self):
        moe = _moe(num_experts=4, top_k=1, capacity_factor=0.5)
        with torch.no_grad():
            moe.router.weight.zero_()  # every token ties; all go to expert 0
        moe(torch.randn(8, 8, dtype=torch.float64))
        # capacity ceil(0.5 * 8 / 4) = 1: 7 of 8 assignments dropped
        self.assertEqual(moe.num_dropped.item(), 7)

    def test_large_capacity_is_dropless(self):
        moe = _moe(capacity_factor=100.0)
        x = torch.randn(12, 8, dtype=torch.float64)
        dropless = _moe()
        dropless.load_state_dict(moe.state_dict())
        self.assertEqual(moe(x), dropless(x))


class TestBadConfig(TestCase):
    def message(self, **kw):
        with self.assertRaises(ValueError) as ctx:
            MoEConfig(**{**dict(dim=8, hidden_dim=4, num_experts=8, top_k=2), **kw})
        return str(ctx.exception)

    def test_k_greater_than_e(self):
        self.assertExpectedInline(self.message(top_k=9), """MoEConfig: expected top_k <= num_experts, but got top_k=9 > num_experts=8""")

    def test_groups_do_not_divide(self):
        self.assertExpectedInline(self.message(num_expert_groups=3, topk_groups=1), """MoEConfig: expected num_expert_groups to divide num_experts (8), but got 3""")

    def test_m_greater_than_n(self):
        self.assertExpectedInline(self.message(num_expert_groups=4, topk_groups=5), """MoEConfig: expected 1 <= topk_groups <= num_expert_groups (4), but got 5""")

    def test_groups_too_few_experts(self):
        self.assertExpectedInline(self.message(num_expert_groups=8, topk_groups=1), """MoEConfig: topk_groups=1 groups of 1 experts hold fewer than top_k=2 experts""")

    def test_negative_capacity(self):
        self.assertExpectedInline(self.message(capacity_factor=-1.0), """MoEConfig: expected capacity_factor > 0 and finite (or None for dropless), but got -1.0""")

    def test_unknown_score_func(self):
        self.assertExpectedInline(self.message(score_func="tanh"), """MoEConfig: expected score_func 'softmax' or 'sigmoid', but got 'tanh'""")

    def test_wrong_input_dim(self):
        with self.assertRaisesRegex(ValueError, r"expected input \[B, L, 8\] or \[T, 8\], but got \(3, 5\)"):
            _moe()(torch.randn(3, 5, dtype=torch.float64))


class TestOutputIsNotAView(TestCase):
    """``MoE`` returns a tensor of its own, never a view of another: ``fully_shard`` hooks a
    module's output, and an in-place op on a view (``y += shared(x)``) rebases the view's
    history and loses that hook; an identity autograd.Function's view may not be modified in
    place at all."""

    @parametrize("shape", [(6, 8), (2, 3, 8)])
    @parametrize("shared", [0, 1])
    @parametrize("aux", [False, True])
    @parametrize("x_dtype", [torch.float64, torch.float32])
    def test_in_place_op_on_output(self, shape, shared, aux, x_dtype):
        moe = _moe(num_shared_experts=shared, load_balance_coeff=0.1 if aux else 0.0)
        x = torch.randn(shape, dtype=x_dtype, requires_grad=True)
        other = torch.randn(shape, dtype=x_dtype)

        y = moe(x)
        base = y._base
        self.assertEqual((y.shape, y.dtype), (x.shape, x_dtype))
        y += other
        y.mul_(2)
        y.sum().backward()
        got = [x.grad] + [p.grad for p in moe.parameters()]

        x.grad = None
        moe.zero_grad()
        y = moe(x)
        (2 * (y + other)).sum().backward()
        expected = [x.grad] + [p.grad for p in moe.parameters()]
        self.assertEqual(got, expected, atol=0, rtol=0)
        self.assertIsNone(base)


class TestCompile(TestCase):
    def test_fullgraph_forward_backward(self):
        moe = _moe(dtype=torch.float32, load_balance_coeff=0.01, load_balance_bias=True,
                   capacity_factor=1.5, num_shared_experts=1)
        x = torch.randn(2, 6, 8, requires_grad=True)
        compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")
        y = compiled(x)
        y.sum().backward()
        got = (y.detach(), x.grad.clone(), moe.router.weight.grad.clone())
        x.grad = None
        moe.zero_grad()
        y = moe(x)
        y.sum().backward()
        self.assertEqual(got, (y.detach(), x.grad, moe.router.weight.grad))



class TestRouterDtype(TestCase):
    """``router_dtype`` keeps the router's parameters (and gradients) in their dtype through
    ``module.to``, unrounded; without it they follow the module."""

    def _moe(self, **kw):
        torch.manual_seed(0)
        return MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, router_bias=True, **kw))

    def test_kept_through_to(self):
        moe = self._moe(router_dtype=torch.float32)
        w = moe.router.weight.detach().clone()
        moe(torch.randn(5, 16)).sum().backward()
        g = moe.router.weight.grad.clone()
        moe.to(torch.bfloat16)
        self.assertEqual(moe.experts.w1.dtype, torch.bfloat16)
        for p in (moe.router.weight, moe.router.bias, moe.router.weight.grad):
            self.assertEqual(p.dtype, torch.float32)
        # restored from the unconverted tensors: bit-exact, not rounded through bf16
        self.assertEqual(moe.router.weight.detach(), w, atol=0, rtol=0)
        self.assertEqual(moe.router.weight.grad, g, atol=0, rtol=0)
        self.assertNotEqual(w.bfloat16().float(), w)
        moe(torch.randn(5, 16, dtype=torch.bfloat16)).sum().backward()

    def test_follows_module_without_it(self):
        moe = self._moe().to(torch.bfloat16)
        self.assertEqual(moe.router.weight.dtype, torch.bfloat16)
        self.assertEqual(moe.router.bias.dtype, torch.bfloat16)

    def test_built_in_router_dtype(self):
        moe = MoE(MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2,
                            router_dtype=torch.float32), dtype=torch.bfloat16)
        self.assertEqual(moe.router.weight.dtype, torch.float32)
        self.assertEqual(moe.experts.w2.dtype, torch.bfloat16)

    def test_bad_router_dtype(self):
        with self.assertRaisesRegex(TypeError, "router_dtype to be a torch.dtype"):
            MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, router_dtype="float32")
        with self.assertRaisesRegex(ValueError, "floating-point dtype, but got torch.int64"):
            MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, router_dtype=torch.int64)


class TestFusedGateUp(TestCase):
    """``fused_gate_up`` stores ``w1 = [gate | up]`` and computes what the separate weights do."""

    def test_matches_separate_weights(self):
        kw = dict(dim=16, hidden_dim=8, num_experts=4, top_k=2)
        torch.manual_seed(0)
        sep = MoE(MoEConfig(**kw))
        fused = MoE(MoEConfig(**kw, fused_gate_up=True))
        self.assertIsNone(fused.experts.w3)
        self.assertEqual(fused.experts.w1.shape, (4, 16, 16))
        with torch.no_grad():
            fused.router.weight.copy_(sep.router.weight)
            fused.experts.w1.copy_(torch.cat([sep.experts.w1, sep.experts.w3], dim=-1))
            fused.experts.w2.copy_(sep.experts.w2)
        x = torch.randn(7, 16)
        self.assertEqual(fused(x), sep(x))

    def test_needs_gated_activation(self):
        with self.assertRaisesRegex(ValueError, "fused_gate_up needs a gated activation"):
            MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, activation="gelu",
                      fused_gate_up=True)
        with self.assertRaisesRegex(TypeError, "fused_gate_up to be a bool"):
            MoEConfig(dim=16, hidden_dim=8, num_experts=4, top_k=2, fused_gate_up=1)


instantiate_parametrized_tests(TestAuxLosses)
instantiate_parametrized_tests(TestOutputIsNotAView)

if __name__ == "__main__":
    run_tests()
