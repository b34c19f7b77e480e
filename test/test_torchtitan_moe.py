# Owner(s): ["module: moe"]
"""torchtitan 0.3.0's MoE layer computed by torch_moe (:mod:`torch_moe.nn._torchtitan`).

The layers are torchtitan's own, built by its DeepSeek-V3 and Qwen3-MoE model builders at tiny
sizes. The swapped layer is checked against torchtitan's own forward: in fp32 (torchtitan's
grouped experts with their bf16 casts disabled: its routing, dispatch, grouped GEMMs and combine
as they are) to 1e-5 for the output and every gradient, and with the default bf16 experts
against torchtitan's default to bf16 accuracy. Also: the parameters and buffers are torchtitan's
own tensors under torchtitan's names, state dicts and distributed checkpoints load both ways bit
for bit, torchtitan's optimizer hook updates the expert bias from the swapped layers' counts as
from its own, the converter and the override registry build the swapped layers, and unsupported
layers fail with a clear error.
"""

import contextlib
import copy
import subprocess
import sys
import tempfile
import unittest
import warnings
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_moe  # noqa: F401  (imported before torchtitan: the override registers on its import)
from torch_moe.nn import _torchtitan
from torch_moe.nn._torchtitan import from_torchtitan_moe, swap_torchtitan_moe

try:
    import torchtitan.models.deepseek_v3 as dsv3
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.config import derive
    from torchtitan.config.override import (
        _REGISTRY, apply_overrides, clear_overrides, OverrideConfig)
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.moe import GroupedExperts, MoE
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
    from torchtitan.models.qwen3.model import Qwen3Model
except ImportError as e:
    raise unittest.SkipTest(f"torchtitan 0.3.0 is not importable ({e}); .ci/run installs it with "
                            "its dependencies") from e

# Model dim and expert FFN dim multiples of 8: aten's CPU grouped GEMM, which torchtitan's
# experts run on, wants 16-byte strides in backward.
D, FFN, E, K, VOCAB = 16, 8, 8, 3, 32
B, L = 2, 5
OVERRIDE = "torch_moe.nn._torchtitan.torch_moe"


def deepseek_v3_config(**routing) -> "DeepSeekV3Model.Config":
    """DeepSeek-V3 with torchtitan's builder and inits: one dense layer, two MoE layers of E
    experts and 2 shared experts."""
    routing.setdefault("router_score_func", "sigmoid")
    layers = dsv3._build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=D, n_heads=2, q_lora_rank=0, kv_lora_rank=8,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, mscale=1.0, dense_hidden_dim=32,
        moe_hidden_dim=FFN, num_experts=E, num_shared_experts=2, router_top_k=K,
        attn_backend="flex", moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0), **routing)
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=D, layers=layers, mtp_layers=[],
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=D),
        norm=RMSNorm.Config(normalized_shape=D), lm_head=Linear.Config(in_features=D,
                                                                       out_features=VOCAB))


def qwen3_config() -> "Qwen3Model.Config":
    """Qwen3-MoE with torchtitan's builder: two MoE layers, softmax routing renormalised over
    the top k, no shared experts."""
    layers = qwen3._build_qwen3_moe_layers(
        n_layers=2, dim=D, n_heads=2, n_kv_heads=1, head_dim=8, moe_hidden_dim=FFN, num_experts=E,
        top_k=K, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=8, max_seq_len=64, theta=1e6))
    return Qwen3Model.Config(
        vocab_size=VOCAB, dim=D, layers=layers, norm=RMSNorm.Config(normalized_shape=D),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=D),
        lm_head=Linear.Config(in_features=D, out_features=VOCAB))


def _qwen3_gate_bias_config():
    cfg = qwen3_config()
    for layer in cfg.layers:
        layer.moe.router.gate.bias = True  # torchtitan's router supports it; its models do not
    return cfg


# the routing of torchtitan's flavors: 671B (sigmoid, group-limited, renormalised, scaled), 16B
# (softmax over all experts, 2 shared experts), Qwen3-MoE, and a router gate with a bias
CASES = {
    "deepseek_v3_671b": lambda: deepseek_v3_config(
        router_num_expert_groups=4, router_num_limited_groups=2, router_route_scale=2.5,
        router_route_norm=True),
    "deepseek_v3_16b": lambda: deepseek_v3_config(router_score_func="softmax"),
    "qwen3": qwen3_config,
    "qwen3_gate_bias": _qwen3_gate_bias_config,
}


def randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter N(0, 0.3^2), so that the routing depends on the tokens, and an expert bias
    (where there is one) large enough to change which experts are picked."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in module.named_buffers():
            if name.endswith("expert_bias_E"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return module


def build_model(case: str, seed: int = 0) -> nn.Module:
    return randomize_(CASES[case]().build(), seed)


def build_moe(case: str, seed: int = 0) -> MoE:
    """The last MoE layer of the case's model, built alone."""
    return randomize_(CASES[case]().layers[-1].moe.build(), seed)


@contextlib.contextmanager
def _bf16_casts_disabled():
    """``Tensor.bfloat16()`` leaves fp32 tensors as they are: torchtitan's GroupedExperts casts
    its operands with it unconditionally, and nothing else of its forward calls it, so its own
    forward then runs the expert GEMMs in fp32."""
    original = torch.Tensor.bfloat16

    def bfloat16(self, *args, **kwargs):
        return self if self.dtype == torch.float32 else original(self, *args, **kwargs)

    torch.Tensor.bfloat16 = bfloat16
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


def torchtitan_forward(moe: nn.Module, x: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    with warnings.catch_warnings(), (_bf16_casts_disabled() if fp32 else contextlib.nullcontext()):
        # its router asks for an fp32 autocast, which CPU autocast declines with a warning
        warnings.filterwarnings("ignore", "In CPU autocast, but the target dtype is not supported")
        return moe(x)


def output_and_grads(out, x, params, grad_out):
    return [out, *torch.autograd.grad(out, [x, *params], grad_out)]


class _OneProcess:
    """What torchtitan's load-balancing hook reads of its ParallelDims, for one process: no loss
    mesh, no expert or tensor parallelism (a real ParallelDims builds meshes, which need an
    initialised process group)."""

    ep_enabled = False
    tp = 1

    def get_optional_mesh(self, name):
        return None


class TestTorchtitanMoE(TestCase):
    def assert_close_to(self, actual, expected, rel: float, msg: str = ""):
        # relative to the tensor's largest magnitude: elements near zero carry the rounding of
        # their larger neighbours
        scale = expected.abs().max().item()
        torch.testing.assert_close(actual, expected, rtol=rel, atol=rel * scale, msg=msg or None)

    @parametrize("case", list(CASES))
    def test_fp32_output_and_gradients_match_torchtitan(self, case):
        tt = build_moe(case)
        swapped = from_torchtitan_moe(tt, expert_dtype=None)
        names, params = zip(*tt.named_parameters())
        g = torch.Generator().manual_seed(1)
        x = torch.randn(B, L, D, generator=g, requires_grad=True)
        grad_out = torch.randn(B, L, D, generator=g)
        expected = output_and_grads(torchtitan_forward(tt, x, fp32=True), x, params, grad_out)
        actual = output_and_grads(swapped(x), x, params, grad_out)
        for name, a, e in zip(("output", "x", *names), actual, expected):
            self.assertEqual(a.dtype, torch.float32)
            self.assert_close_to(a, e, 1e-5, msg=f"{case}: {name}")

    @parametrize("case", list(CASES))
    def test_default_bf16_experts_match_torchtitan(self, case):
        # torchtitan's own default: fp32 parameters and tokens, expert GEMMs in bf16
        tt = build_moe(case)
        swapped = from_torchtitan_moe(tt)
        self.assertEqual(swapped.expert_dtype, torch.bfloat16)
        names, params = zip(*tt.named_parameters())
        g = torch.Generator().manual_seed(2)
        x = torch.randn(B, L, D, generator=g, requires_grad=True)
        grad_out = torch.randn(B, L, D, generator=g)
        expected = output_and_grads(torchtitan_forward(tt, x), x, params, grad_out)
        actual = output_and_grads(swapped(x), x, params, grad_out)
        for name, a, e in zip(("output", "x", *names), actual, expected):
            self.assertEqual(a.dtype, torch.float32)
            self.assert_close_to(a, e, 1.6e-2, msg=f"{case}: {name}")
        # the experts did run in bf16: fp32 experts give a different output
        fp32 = from_torchtitan_moe(tt, expert_dtype=None)(x)
        self.assertGreater((fp32 - actual[0]).abs().max().item(), 1e-4 * fp32.abs().max().item())

    def test_holds_torchtitan_tensors_under_torchtitan_names(self):
        tt = build_moe("deepseek_v3_671b")
        swapped = from_torchtitan_moe(tt)
        self.assertIsInstance(swapped, MoE)
        self.assertEqual(list(swapped.state_dict()), list(tt.state_dict()))
        for (n1, a), (n2, b) in zip(swapped.named_parameters(), tt.named_parameters(), strict=True):
            self.assertEqual(n1, n2)
            self.assertIs(a, b)
        for (n1, a), (n2, b) in zip(swapped.named_buffers(), tt.named_buffers(), strict=True):
            self.assertEqual(n1, n2)
            self.assertIs(a, b)
        self.assertEqual(swapped.load_balance_coeff, tt.load_balance_coeff)
        self.assertIn("tokens_per_expert_E", swapped._non_persistent_buffers_set)
        # the experts keep torchtitan's nn.Linear layout; the forward reads transposed views
        experts = swapped.routed_experts.inner_experts
        self.assertEqual(experts.w1_EFD.shape, (E, FFN, D))
        self.assertEqual(experts.w2_EDF.shape, (E, D, FFN))

    def test_state_dicts_and_checkpoints_load_both_ways(self):
        for case in ("deepseek_v3_671b", "qwen3"):
            source = build_moe(case, seed=3)
            swapped = from_torchtitan_moe(build_moe(case, seed=4))
            swapped.load_state_dict(source.state_dict())
            for (k, a), (_, b) in zip(swapped.state_dict().items(), source.state_dict().items()):
                self.assertTrue(torch.equal(a, b), f"{case}: {k}")
            back = build_moe(case, seed=5)
            back.load_state_dict(swapped.state_dict())
            for (k, a), (_, b) in zip(back.state_dict().items(), source.state_dict().items()):
                self.assertTrue(torch.equal(a, b), f"{case}: {k}")

        # distributed checkpoints of whole models, one process: torchtitan's into a swapped model
        # and back
        with warnings.catch_warnings(), tempfile.TemporaryDirectory() as a, \
                tempfile.TemporaryDirectory() as b:
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            source = build_model("deepseek_v3_671b", seed=6)
            dcp.save(get_model_state_dict(source), checkpoint_id=a)
            swapped = build_model("deepseek_v3_671b", seed=7)
            self.assertEqual(swap_torchtitan_moe(swapped), ["layers.1.moe", "layers.2.moe"])
            sd = get_model_state_dict(swapped)
            self.assertEqual(sorted(sd), sorted(get_model_state_dict(source)))
            dcp.load(sd, checkpoint_id=a)
            set_model_state_dict(swapped, sd)
            dcp.save(get_model_state_dict(swapped), checkpoint_id=b)
            back = build_model("deepseek_v3_671b", seed=8)
            sd = get_model_state_dict(back)
            dcp.load(sd, checkpoint_id=b)
            set_model_state_dict(back, sd)
        for model in (swapped, back):
            for (k, x), (_, y) in zip(model.state_dict().items(), source.state_dict().items()):
                self.assertTrue(torch.equal(x, y), k)

    def test_expert_bias_update_by_torchtitan_hook(self):
        # torchtitan's trainer registers this hook after building the optimizer: it reads each
        # layer's tokens_per_expert_E, updates expert_bias_E and zeroes the counts
        model = build_model("deepseek_v3_671b")
        twin = copy.deepcopy(model)
        self.assertEqual(len(swap_torchtitan_moe(model, expert_dtype=None)), 2)
        optimizers = []
        for m in (model, twin):
            opt = torch.optim.SGD(m.parameters(), lr=0.0)
            register_moe_load_balancing_hook(opt, [m], _OneProcess())
            optimizers.append(opt)
        g = torch.Generator().manual_seed(9)
        for step in range(2):
            for name in ("1", "2"):
                x = torch.randn(B, L, D, generator=g)
                with torch.no_grad():
                    model.layers[name].moe(x)
                    torchtitan_forward(twin.layers[name].moe, x, fp32=True)
            before = model.layers["1"].moe.expert_bias_E.clone()
            for name in ("1", "2"):
                counts = model.layers[name].moe.tokens_per_expert_E
                self.assertEqual(counts.sum().item(), B * L * K)  # zeroed by each step
                self.assertEqual(counts, twin.layers[name].moe.tokens_per_expert_E, atol=0, rtol=0)
            for opt in optimizers:
                opt.step()
            for name in ("1", "2"):
                moe, ref = model.layers[name].moe, twin.layers[name].moe
                self.assertEqual(moe.expert_bias_E, ref.expert_bias_E, atol=0, rtol=0)
                self.assertEqual(moe.tokens_per_expert_E.count_nonzero().item(), 0)
            self.assertFalse(torch.equal(before, model.layers["1"].moe.expert_bias_E))
        # eval forwards count nothing
        model.eval()
        model.layers["1"].moe(torch.randn(B, L, D))
        self.assertEqual(model.layers["1"].moe.tokens_per_expert_E.count_nonzero().item(), 0)

    def test_swap_torchtitan_moe(self):
        for case, expected in (("deepseek_v3_16b", ["layers.1.moe", "layers.2.moe"]),
                               ("qwen3", ["layers.0.moe", "layers.1.moe"])):
            model = build_model(case)
            params = list(model.parameters())
            keys = list(model.state_dict())
            self.assertEqual(swap_torchtitan_moe(model, expert_dtype=torch.float32), expected)
            for name in expected:
                moe = model.get_submodule(name)
                self.assertIsInstance(moe, _torchtitan.TorchtitanMoE)
                self.assertEqual(moe.expert_dtype, torch.float32)
            # an optimizer built before the swap still holds the model's parameters
            for a, b in zip(model.parameters(), params, strict=True):
                self.assertIs(a, b)
            self.assertEqual(list(model.state_dict()), keys)
            model.verify_module_protocol()  # the check torchtitan's trainer runs after the build
            self.assertEqual(swap_torchtitan_moe(model), [])  # already swapped
        self.assertEqual(swap_torchtitan_moe(nn.Sequential(nn.Linear(2, 2))), [])

        # a layer reachable under two names is replaced under both, by one module
        layer = build_moe("qwen3")
        model = nn.ModuleDict({"a": layer, "b": nn.ModuleDict({"c": layer})})
        self.assertEqual(swap_torchtitan_moe(model), ["a", "b.c"])
        self.assertIs(model["a"], model["b"]["c"])

    def test_converter_builds_swapped_layers(self):
        # torchtitan's model-converter protocol, on the model config before the build, the way
        # its trainer builds: on the meta device, then to_empty and init_states
        converter = _torchtitan.TorchMoEConverter.Config(expert_dtype="float32").build()
        config = converter.convert(deepseek_v3_config(router_num_expert_groups=4,
                                                      router_num_limited_groups=2))
        with torch.device("meta"):
            model = config.build()
        model.verify_module_protocol()
        model.to_empty(device="cpu")
        model.init_states()
        moe = model.layers["2"].moe
        self.assertIsInstance(moe, _torchtitan.TorchtitanMoE)
        self.assertEqual(moe.expert_dtype, torch.float32)
        self.assertEqual(moe.expert_bias_E.count_nonzero().item(), 0)  # torchtitan's buffer init
        self.assertEqual(moe.tokens_per_expert_E.count_nonzero().item(), 0)
        self.assertTrue(moe.routed_experts.inner_experts.w1_EFD.isfinite().all())
        # computes what torchtitan's layer with its weights computes
        tt = deepseek_v3_config(router_num_expert_groups=4, router_num_limited_groups=2).build()
        tt.load_state_dict(randomize_(model).state_dict())
        x = torch.randn(B, L, D)
        self.assert_close_to(moe(x), torchtitan_forward(tt.layers["2"].moe, x, fp32=True), 1e-5)
        self.assertIs(converter.convert(config), config)  # converted layers are left alone

        # the converters= list of torchtitan's model registries
        for registry, flavor in ((qwen3.model_registry, "debugmodel_moe"),
                                 (dsv3.model_registry, "debugmodel")):
            spec = registry(flavor, converters=[_torchtitan.TorchMoEConverter.Config()])
            moes = [layer.moe for layer in spec.model.layers if layer.moe is not None]
            self.assertTrue(moes)
            for cfg in moes:
                self.assertIs(type(cfg), _torchtitan.TorchtitanMoE.Config)
                self.assertEqual(cfg.expert_dtype, "bfloat16")

    def test_override_registry(self):
        self.assertIn(OVERRIDE, _REGISTRY)
        spec = qwen3.model_registry("debugmodel_moe")
        lines = apply_overrides(
            OverrideConfig(imports=[(OVERRIDE, {"expert_dtype": None})]), spec)
        self.assertEqual(len(lines), len(spec.model.layers))
        for layer in spec.model.layers:
            self.assertIs(type(layer.moe), _torchtitan.TorchtitanMoE.Config)
            self.assertIsNone(layer.moe.expert_dtype)
        # torchtitan's tests clear the registry; registering again puts the override back
        saved = dict(_REGISTRY)
        try:
            clear_overrides()
            _torchtitan.install_torchtitan_converter()
            self.assertIn(OVERRIDE, _REGISTRY)
            _torchtitan.install_torchtitan_converter()  # a second registration is a no-op
        finally:
            _REGISTRY.clear()
            _REGISTRY.update(saved)

    def test_import_torch_moe_leaves_torchtitan_unimported(self):
        code = (
            "import sys, torch_moe\n"
            "assert not [m for m in sys.modules if m.startswith('torchtitan')], 'imported'\n"
            "import torchtitan.models.common.moe\n"
            "from torchtitan.config.override import _REGISTRY\n"
            f"assert {OVERRIDE!r} in _REGISTRY, sorted(_REGISTRY)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr[-2000:])


class _OtherExperts(GroupedExperts):
    """A grouped-experts subclass (as torchtitan's float8 / MXFP8 converters make)."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        pass


class _OtherMoE(MoE):
    @dataclass(kw_only=True, slots=True)
    class Config(MoE.Config):
        pass


class TestBadInput(TestCase):
    def test_not_a_torchtitan_layer(self):
        with self.assertRaisesRegex(TypeError, r"expected a torchtitan MoE .* got Linear"):
            from_torchtitan_moe(nn.Linear(2, 2))
        swapped = from_torchtitan_moe(build_moe("qwen3"))
        with self.assertRaisesRegex(TypeError, "already a TorchtitanMoE"):
            from_torchtitan_moe(swapped)
        with self.assertRaisesRegex(TypeError, "expected an nn.Module, but got str"):
            swap_torchtitan_moe("model")
        with self.assertRaisesRegex(ValueError, "no parent .* use from_torchtitan_moe"):
            swap_torchtitan_moe(build_moe("qwen3"))

    def test_bad_expert_dtype(self):
        tt = build_moe("qwen3")
        for bad in (torch.int32, "bfloat16"):
            with self.assertRaisesRegex(TypeError, "expected expert_dtype to be a floating-point"):
                from_torchtitan_moe(tt, expert_dtype=bad)
        cfg = qwen3_config().layers[0].moe
        with self.assertRaisesRegex(ValueError, r"expected expert_dtype in \('float32'"):
            _torchtitan.torch_moe(cfg, expert_dtype="bf16")
        with self.assertRaisesRegex(ValueError, r"expected expert_dtype in \('float32'"):
            _torchtitan.TorchMoEConverter.Config(expert_dtype="fp32").build()
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'dtype'"):
            swap_torchtitan_moe(nn.ModuleDict({"moe": tt}), dtype=torch.float32)

    def test_unsupported_torchtitan_layers(self):
        cfg = qwen3_config().layers[0].moe
        cfg.routed_experts.inner_experts = _OtherExperts.Config(dim=D, hidden_dim=FFN,
                                                                num_experts=E)
        with self.assertRaisesRegex(ValueError, "inner_experts to be torchtitan's GroupedExperts, "
                                                "but got _OtherExperts"):
            from_torchtitan_moe(cfg.build())
        with self.assertRaisesRegex(ValueError, "but got _OtherExperts"):
            _torchtitan.torch_moe(cfg).build()  # the override's config, at build time

        cfg = qwen3_config().layers[0].moe
        other = derive(cfg, _OtherMoE.Config)
        with self.assertRaisesRegex(ValueError, "subclass _OtherMoE"):
            from_torchtitan_moe(other.build())
        config = qwen3_config()
        config.layers[1].moe = other
        with self.assertRaisesRegex(ValueError, r"layers\.1\.moe is a _OtherMoE.Config"):
            _torchtitan.TorchMoEConverter.Config().build().convert(config)

        cfg = qwen3_config().layers[0].moe
        cfg.router._debug_force_load_balance = True
        with self.assertRaisesRegex(ValueError, "_debug_force_load_balance"):
            from_torchtitan_moe(cfg.build())
        for groups, limited in ((8, 2), (4, None), (3, 1)):
            cfg = qwen3_config().layers[0].moe
            cfg.router.num_expert_groups, cfg.router.num_limited_groups = groups, limited
            with self.assertRaisesRegex(ValueError, "group-limited routing needs"):
                from_torchtitan_moe(cfg.build())

    def test_parallelized_or_hooked_layer(self):
        tt = build_moe("qwen3")
        tt._parallelized = True  # what torchtitan's Module.parallelize sets
        with self.assertRaisesRegex(ValueError, "swap it before parallelizing"):
            from_torchtitan_moe(tt)
        tt = build_moe("qwen3")
        tt.register_forward_hook(lambda *args: None)
        with self.assertRaisesRegex(ValueError, "module hooks .*_forward_hooks"):
            from_torchtitan_moe(tt)
        # nothing was replaced: the bad layer stops the swap of the good one
        good = build_moe("qwen3")
        model = nn.ModuleDict({"good": good, "bad": tt})
        with self.assertRaises(ValueError):
            swap_torchtitan_moe(model)
        self.assertIs(model["good"], good)

    def test_bad_forward_input_and_expert_parallelism(self):
        swapped = from_torchtitan_moe(build_moe("qwen3"))
        with self.assertRaisesRegex(ValueError, r"expected input \[B, L, 16\], but got \(10, 16\)"):
            swapped(torch.randn(B * L, D))
        swapped.routed_experts.token_dispatcher.ep_mesh = object()  # wired for expert parallelism
        with self.assertRaisesRegex(NotImplementedError, "expert and tensor parallelism"):
            swapped(torch.randn(B, L, D))


instantiate_parametrized_tests(TestTorchtitanMoE)

if __name__ == "__main__":
    run_tests()
