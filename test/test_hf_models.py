"""Whole transformers models with their MoE blocks swapped by ``replace_moe_blocks``, against the
same models unswapped: fp32 outputs, losses and every gradient, the experts picked, bf16 error
against an fp64 copy, 20 training steps, ``generate``, ``save_pretrained`` / ``from_pretrained``,
``output_router_logits``, and weights that are the model's own tensors (no copies)."""

import copy
import tempfile
import unittest

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_moe
from torch_moe.nn.hf_blocks import is_swapped_hf_block, swap_hf_moe_block

try:
    import transformers
    from test_hf_convert import _hf_config
except ImportError:  # the optional `hf` extra
    transformers = None

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
VOCAB = 64


def _set_experts_implementation(module, name: str) -> None:
    """Makes every submodule of ``module`` with a config compute its experts with ``name``."""
    for m in module.modules():
        if getattr(m, "config", None) is not None:
            m.config._experts_implementation = name


def _model(arch: str, dtype=torch.float32):
    """A tiny random 2-layer model (weights scaled up from transformers' small init, so that
    routing and experts matter)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch, layers=2),
                                                          attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "bias" in name:
                p.copy_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.05)
    return model.to(dtype)


def _swapped(model):
    twin = copy.deepcopy(model)
    names = torch_moe.nn.replace_moe_blocks(twin)
    return twin, names


def _record_topk(model) -> list:
    """Hooks every MoE block's router to record the experts each token picks."""
    picked = []

    def hook(module, args, output):
        picked.append(output[2].sort(dim=-1).values)
    for m in model.modules():
        router = getattr(m, "router", None) if type(m).__name__.endswith("MLP") else getattr(m, "gate", None)
        if router is not None and hasattr(router, "weight") and router.weight.dim() == 2 and (
                "Router" in type(router).__name__):
            router.register_forward_hook(hook)
    return picked


def _tokens(seed=1, shape=(2, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


@unittest.skipIf(transformers is None, "transformers is not installed (the `hf` extra)")
class TestHFModels(TestCase):
    @parametrize("arch", ARCHS)
    def test_fp32_outputs_gradients_and_experts(self, arch):
        model = _model(arch)
        twin, names = _swapped(model)
        self.assertEqual(names, ["model.layers.0.mlp", "model.layers.1.mlp"])
        self.assertTrue(all(is_swapped_hf_block(twin.get_submodule(n)) for n in names))
        picked, picked_twin = _record_topk(model), _record_topk(twin)
        ids = _tokens()
        out = model(ids, labels=ids, output_router_logits=True)
        out_twin = twin(ids, labels=ids, output_router_logits=True)
        self.assertEqual(out_twin.logits, out.logits, atol=1e-5, rtol=1e-5)
        self.assertEqual(out_twin.loss, out.loss, atol=0, rtol=1e-5)
        if getattr(out, "aux_loss", None) is not None:
            self.assertEqual(out_twin.aux_loss, out.aux_loss, atol=0, rtol=1e-5)
        self.assertEqual(len(picked), 2)
        self.assertEqual(len(picked_twin), 2)  # the router hooks still run
        for a, b in zip(picked, picked_twin):
            self.assertEqual(a, b, atol=0, rtol=0)
        out.loss.backward()
        out_twin.loss.backward()
        grads = 0
        for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
            if p.grad is None:
                self.assertIsNone(q.grad, msg=name)
                continue
            scale = p.grad.abs().max().item()
            self.assertEqual(q.grad, p.grad, atol=1e-5 * scale, rtol=1e-5, msg=name)
            grads += 1
        self.assertGreater(grads, 10)

    @parametrize("arch", ARCHS)
    def test_bf16_no_further_from_fp64_than_transformers(self, arch):
        # One bf16 block, swapped and not, against an fp64 copy of it on the same bf16 tokens,
        # in its two parts: the experts picked (tokens whose top-k set differs from fp64's), and
        # the output computed with the fp64 copy's routing (relative Frobenius error), so that
        # one token's routing flip does not hide or fake a difference of the expert arithmetic.
        # transformers' references are its per-expert loop ("eager") and its default on CPU,
        # "grouped_mm" (torch._grouped_mm, which has no fp64: the fp64 copy runs the loop).
        block = _model(arch).model.layers[0].mlp.to(torch.bfloat16)
        _set_experts_implementation(block, "eager")
        grouped = copy.deepcopy(block)
        _set_experts_implementation(grouped, "grouped_mm")
        exact = copy.deepcopy(block).double()
        ours = copy.deepcopy(block)
        swap_hf_moe_block(ours)
        x = torch.randn(2048, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
        router = "router" if arch == "gpt_oss" else "gate"
        with torch.no_grad():
            _, w_exact, ids_exact = getattr(exact, router)(x.double())
            _, _, ids_hf = getattr(block, router)(x)
            picked = {}
            hook = getattr(ours, router).register_forward_hook(
                lambda m, a, out: picked.setdefault("ids", out[2]))
            ours(x[None])
            hook.remove()
            def differ(ids):
                return int((ids.sort(-1).values != ids_exact.sort(-1).values).any(-1).sum())
            self.assertLessEqual(differ(picked["ids"]), differ(ids_hf))
            # the experts on the fp64 routing
            want = exact.experts(x.double(), ids_exact, w_exact)
            hf = block.experts(x, ids_exact.clone(), w_exact.float())
            hf_grouped = grouped.experts(x, ids_exact.clone(), w_exact.float())
            w1, w2, w3, biases = ours._expert_weights()
            s, o, _ = torch.ops.torch_moe.token_sort(ids_exact, w1.size(0))
            mine, _ = torch.ops.torch_moe.grouped_ffn(
                x, s, o, w_exact.float(), w1, w2, w3, ours.moe_config.activation,
                ours.moe_config.swiglu_alpha, ours.moe_config.swiglu_limit, **biases)
        def err(y):
            return ((y.double() - want).norm() / want.norm()).item()
        for name, theirs in (("eager", hf), ("grouped_mm", hf_grouped)):
            self.assertLessEqual(err(mine), err(theirs), msg=f"{arch}: torch_moe {err(mine):.3e} "
                                 f"vs transformers' {name} {err(theirs):.3e}")

    @parametrize("arch", ARCHS)
    def test_training_20_steps(self, arch):
        model = _model(arch)
        twin, _ = _swapped(model)
        losses = []
        for m in (model, twin):
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            run = []
            for step in range(20):
                ids = _tokens(seed=7)  # one batch: the losses fall as it is learned
                loss = m(ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                run.append(loss.item())
            losses.append(torch.tensor(run))
        self.assertLess(losses[0][-1], losses[0][0])  # the run trains
        self.assertEqual(losses[1], losses[0], atol=0, rtol=1e-5)

    @parametrize("arch", ARCHS)
    def test_generate_save_and_reload(self, arch):
        model = _model(arch).eval()
        twin, _ = _swapped(model)
        prompt = _tokens(shape=(1, 5))
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        self.assertEqual(twin.generate(prompt, **kw), model.generate(prompt, **kw))
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            model.save_pretrained(a)
            twin.save_pretrained(b)
            from safetensors.torch import load_file

            sa, sb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
            self.assertEqual(sorted(sa), sorted(sb))
            for key in sa:
                self.assertEqual(sb[key], sa[key], atol=0, rtol=0, msg=key)
            reloaded = type(model).from_pretrained(b, attn_implementation="eager").eval()
            torch_moe.nn.replace_moe_blocks(reloaded)
            self.assertEqual(reloaded.generate(prompt, **kw), model.generate(prompt, **kw))

    @parametrize("arch", ("qwen3_moe", "gpt_oss"))
    def test_weights_are_the_models_own(self, arch):
        model = _model(arch)
        before = {name: (p, p.data_ptr()) for name, p in model.named_parameters()}
        torch_moe.nn.replace_moe_blocks(model)
        after = dict(model.named_parameters())
        self.assertEqual(sorted(after), sorted(before))
        for name, (p, ptr) in before.items():
            self.assertIs(after[name], p)
            self.assertEqual(after[name].data_ptr(), ptr)
        # a second call finds the blocks swapped and leaves them alone
        self.assertEqual(torch_moe.nn.replace_moe_blocks(model), [])

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, "found no supported MoE block in the Linear"):
            torch_moe.nn.replace_moe_blocks(torch.nn.Linear(2, 2))
        with self.assertRaisesRegex(TypeError, "expected an nn.Module, but got dict"):
            torch_moe.nn.replace_moe_blocks({})
        model = _model("mixtral")
        block = model.model.layers[0].mlp
        swap_hf_moe_block(block)
        with self.assertRaisesRegex(TypeError, "already swapped"):
            swap_hf_moe_block(block)
        with self.assertRaisesRegex(TypeError, "expected a transformers MoE block"):
            swap_hf_moe_block(model.model.layers[0].self_attn)
        with self.assertRaisesRegex(ValueError, "computes precision='bf16' only, but got 'fp8_rowwise'"):
            torch_moe.nn.replace_moe_blocks(_model("olmoe"), precision="fp8_rowwise")
        with self.assertRaisesRegex(ValueError, "capacity_factor=None only, but got 1.25"):
            torch_moe.nn.replace_moe_blocks(_model("olmoe"), capacity_factor=1.25)
        other = _model("qwen3_moe")
        other.model.layers[0].mlp.experts.register_forward_hook(lambda *a: None)
        with self.assertRaisesRegex(ValueError, "forward hooks that the swapped forward would bypass"):
            torch_moe.nn.replace_moe_blocks(other)


instantiate_parametrized_tests(TestHFModels)

if __name__ == "__main__":
    run_tests()
