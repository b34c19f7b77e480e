"""``MoEConfig.from_hf`` and the HF conversions against transformers' own MoE blocks: both expert
layouts (Hub checkpoints, transformers-5 in memory), both directions, bit-exact round trips,
partial loads that name what they left out, and the block's forward reproduced in fp32."""

import unittest

import torch
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.convert import hf_moe_state_dict, HFLoadResult, load_hf_moe_state_dict

try:
    import transformers
except ImportError:  # the optional `hf` extra
    transformers = None

ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def _hf_config(arch: str, layers: int = 1):
    common = dict(hidden_size=32, num_experts_per_tok=2, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    if arch == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=16, num_local_experts=6)
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, moe_intermediate_size=16, num_experts=6,
                                           shared_expert_intermediate_size=24, norm_topk_prob=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=16, num_experts=6,
                                           norm_topk_prob=True)
    if arch == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=16, num_experts=6)
    if arch == "deepseek_v3":
        common.update(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                      qk_nope_head_dim=8, v_head_dim=8)
        return transformers.DeepseekV3Config(**common, moe_intermediate_size=16,
                                             n_routed_experts=8, n_shared_experts=1, n_group=2,
                                             topk_group=1, routed_scaling_factor=2.5,
                                             first_k_dense_replace=0)
    return transformers.GptOssConfig(**common, intermediate_size=16, num_local_experts=6)


def _hf_block(arch: str, config):
    """transformers' MoE block of ``arch`` with random weights (transformers inits some at 0)."""
    mod = {
        "mixtral": transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock,
        "qwen2_moe": transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock,
        "qwen3_moe": transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock,
        "olmoe": transformers.models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock,
        "deepseek_v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE,
        "gpt_oss": transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP,
    }[arch]
    torch.manual_seed(0)
    block = mod(config)
    with torch.no_grad():
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            t.copy_(torch.randn_like(t) * (0.1 if "bias" in name else 0.3))
    return block


def _checkpoint_layout(sd: dict, prefix: str = "") -> dict:
    """The per-expert Hub layout of a transformers-5 block state dict (gate rows first)."""
    out = {}
    for key, value in sd.items():
        if key == "experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for i in range(value.size(0)):
                out[f"{prefix}experts.{i}.gate_proj.weight"] = gate[i].clone()
                out[f"{prefix}experts.{i}.up_proj.weight"] = up[i].clone()
        elif key == "experts.down_proj":
            for i in range(value.size(0)):
                out[f"{prefix}experts.{i}.down_proj.weight"] = value[i].clone()
        else:
            out[prefix + key] = value.clone()
    return out


@unittest.skipIf(transformers is None, "transformers is not installed (the `hf` extra)")
class TestHFConversion(TestCase):
    def _pair(self, arch, **overrides):
        config = _hf_config(arch)
        block = _hf_block(arch, config)
        moe = MoE(MoEConfig.from_hf(config, **overrides))
        return block, moe

    @parametrize("arch", ARCHS)
    @parametrize("fused", [True, False])
    def test_transformers_layout_round_trip_and_forward(self, arch, fused):
        if arch == "gpt_oss" and not fused:
            fused = True  # gpt-oss has one layout; fused_gate_up=False is covered by the others
        block, moe = self._pair(arch, fused_gate_up=fused)
        sd = block.state_dict()
        self.assertEqual(load_hf_moe_state_dict(moe, sd, style=arch), HFLoadResult([], []))
        back = hf_moe_state_dict(moe, style=arch, layout="transformers")
        self.assertEqual(back.keys(), sd.keys())
        for key in sd:
            self.assertEqual(back[key], sd[key], atol=0, rtol=0, msg=key)
            self.assertEqual(back[key].dtype, sd[key].dtype)
        x = torch.randn(2, 5, 32)
        want = block(x)
        want = want[0] if isinstance(want, tuple) else want
        self.assertEqual(moe(x), want, atol=1e-5, rtol=1e-5)

    @parametrize("arch", ("qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"))
    def test_checkpoint_layout_both_directions(self, arch):
        block, moe = self._pair(arch)
        ckpt = _checkpoint_layout(block.state_dict(), "model.layers.3.mlp.")
        load_hf_moe_state_dict(moe, ckpt, prefix="model.layers.3.mlp.", style=arch,
                               layout="checkpoint")
        back = hf_moe_state_dict(moe, prefix="model.layers.3.mlp.", style=arch)
        self.assertEqual(back.keys(), ckpt.keys())
        for key in ckpt:
            self.assertEqual(back[key], ckpt[key], atol=0, rtol=0, msg=key)
        # and the other way: the checkpoint read back in the transformers layout
        fused = hf_moe_state_dict(moe, style=arch, layout="transformers")
        for key, value in block.state_dict().items():
            self.assertEqual(fused[key], value, atol=0, rtol=0, msg=key)

    def test_fused_weights_are_views(self):
        # reading the transformers layout of a fused MoE costs no copy of the experts
        from torch_moe.nn.convert import _hf_entries, _STYLES

        _, moe = self._pair("qwen3_moe")
        entries = _hf_entries(moe, "", _STYLES["qwen3_moe"], "transformers")
        view = entries["experts.gate_up_proj"].read()
        self.assertEqual(view.data_ptr(), moe.experts.w1.data_ptr())
        self.assertEqual(view.shape, (6, 32, 32))

    def test_deepseek_router_stays_fp32(self):
        block, moe = self._pair("deepseek_v3")
        moe.to(torch.bfloat16)
        self.assertEqual(moe.router.weight.dtype, torch.float32)
        load_hf_moe_state_dict(moe, block.state_dict(), style="deepseek_v3")
        self.assertEqual(moe.router.weight, block.gate.weight, atol=0, rtol=0)

    def test_partial_load_names_what_it_left_out(self):
        block, moe = self._pair("mixtral")
        sd = {k: v for k, v in block.state_dict().items() if k != "experts.down_proj"}
        sd["experts.extra"] = torch.zeros(1)
        with self.assertRaisesRegex(ValueError, r"unexpected keys .*'experts.extra'"):
            load_hf_moe_state_dict(moe, sd, style="mixtral")
        del sd["experts.extra"]
        with self.assertRaisesRegex(KeyError, r"missing keys .*'experts.down_proj'.*strict=False"):
            load_hf_moe_state_dict(moe, sd, style="mixtral")
        before = moe.experts.w2.detach().clone()
        result = load_hf_moe_state_dict(moe, sd, style="mixtral", strict=False)
        self.assertEqual(result, HFLoadResult(["experts.down_proj"], []))
        self.assertEqual(moe.experts.w2, before, atol=0, rtol=0)
        self.assertEqual(moe.router.weight, block.gate.weight, atol=0, rtol=0)

    def test_layout_errors(self):
        block, moe = self._pair("qwen3_moe")
        sd = block.state_dict()
        with self.assertRaisesRegex(ValueError, r"layout='checkpoint' was asked, but the experts .* "
                                    r"'transformers' layout .*pass layout='transformers' or 'auto'"):
            load_hf_moe_state_dict(moe, sd, style="qwen3_moe", layout="checkpoint")
        mixed = dict(sd, **_checkpoint_layout({"experts.down_proj": sd["experts.down_proj"]}))
        with self.assertRaisesRegex(ValueError, "in both layouts"):
            load_hf_moe_state_dict(moe, mixed, style="qwen3_moe")
        with self.assertRaisesRegex(ValueError, "expected layout in"):
            load_hf_moe_state_dict(moe, sd, style="qwen3_moe", layout="fused")
        bad = dict(sd, **{"experts.gate_up_proj": sd["experts.gate_up_proj"][:, :16]})
        with self.assertRaisesRegex(ValueError, r"'experts.gate_up_proj' of shape \[6, 32, 32\] "
                                    r"\(\[E, 2F, D\]\), but got \[6, 16, 32\]"):
            load_hf_moe_state_dict(moe, bad, style="qwen3_moe")

    def test_gpt_oss_needs_its_config(self):
        config = _hf_config("gpt_oss")
        moe = MoE(MoEConfig.from_hf(config, ffn_bias=False))
        with self.assertRaisesRegex(ValueError, "style 'gpt_oss' needs a MoE with ffn_bias=True"):
            hf_moe_state_dict(moe, style="gpt_oss")
        with self.assertRaisesRegex(ValueError, "style 'mixtral' has SiLU-gated experts .* has activation='swiglu_oai'"):
            hf_moe_state_dict(MoE(MoEConfig.from_hf(config)), style="mixtral", layout="transformers")


@unittest.skipIf(transformers is None, "transformers is not installed (the `hf` extra)")
class TestFromHF(TestCase):
    def test_fields(self):
        c = MoEConfig.from_hf(_hf_config("deepseek_v3"))
        self.assertEqual((c.score_func, c.route_scale, c.num_expert_groups, c.topk_groups),
                         ("sigmoid", 2.5, 2, 1))
        self.assertEqual((c.router_dtype, c.load_balance_bias, c.num_shared_experts),
                         (torch.float32, True, 1))
        c = MoEConfig.from_hf(_hf_config("qwen2_moe"))
        self.assertEqual((c.num_shared_experts, c.shared_hidden_dim, c.shared_expert_gate),
                         (1, 24, True))
        c = MoEConfig.from_hf(_hf_config("gpt_oss"), precision="fp8_rowwise")
        self.assertEqual((c.activation, c.router_bias, c.ffn_bias, c.precision),
                         ("swiglu_oai", True, True, "fp8_rowwise"))

    def test_errors(self):
        with self.assertRaisesRegex(ValueError, r"model_type in \('mixtral'.*got LlamaConfig with "
                                    r"model_type='llama'"):
            MoEConfig.from_hf(transformers.LlamaConfig())
        with self.assertRaisesRegex(ValueError, "router_jitter_noise=0.1 is not supported"):
            MoEConfig.from_hf(transformers.MixtralConfig(router_jitter_noise=0.1))
        with self.assertRaisesRegex(ValueError, "expected hidden_act='silu'"):
            MoEConfig.from_hf(transformers.Qwen3MoeConfig(hidden_act="gelu"))
        with self.assertRaisesRegex(TypeError, r"unknown MoEConfig fields \['experts'\]"):
            MoEConfig.from_hf(_hf_config("olmoe"), experts=4)


instantiate_parametrized_tests(TestHFConversion)

if __name__ == "__main__":
    run_tests()
