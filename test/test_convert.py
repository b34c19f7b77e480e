# Owner(s): ["module: moe"]
"""HuggingFace weight conversion: an :class:`MoE` loaded from a Mixtral, Qwen3-MoE (with and
without a Qwen2-MoE shared expert) or DeepSeek-V3 block computes what that block computes,
checked against a per-token reference written here on the original per-expert HF weights; the
conversion round-trips bit for bit; bad checkpoints fail with pinned messages
(``EXPECTTEST_ACCEPT=1`` rewrites them)."""

import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe.nn import MoE, MoEConfig, hf_moe_state_dict, load_hf_moe_state_dict

D, FFN = 16, 8  # model dim, expert FFN dim

# name -> (style, prefix, MoEConfig arguments beyond dim/hidden_dim/top_k); the configs are the
# ones that reproduce each model's routing
CASES = {
    "mixtral": ("mixtral", "model.layers.0.block_sparse_moe.",
                dict(num_experts=8, score_func="softmax", topk_before_score=True)),
    "qwen3_moe": ("qwen3_moe", "model.layers.1.mlp.",
                  dict(num_experts=6, score_func="softmax", normalize_topk=True)),
    "qwen3_moe_shared": ("qwen3_moe", "model.layers.2.mlp.",
                         dict(num_experts=4, score_func="softmax", normalize_topk=True,
                              num_shared_experts=1, shared_hidden_dim=12, shared_expert_gate=True)),
    "deepseek_v3": ("deepseek_v3", "model.layers.3.mlp.",
                    dict(num_experts=8, score_func="sigmoid", normalize_topk=True, route_scale=2.5,
                         num_expert_groups=4, topk_groups=2, load_balance_bias=True,
                         num_shared_experts=1)),
    "deepseek_v3_two_shared": ("deepseek_v3", "",
                               dict(num_experts=8, score_func="sigmoid", normalize_topk=True,
                                    route_scale=2.5, num_expert_groups=2, topk_groups=1,
                                    load_balance_bias=True, num_shared_experts=2)),
}

# HF names of an expert's (gate, up, down) projections, and of the shared-expert module
PROJ = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
        "deepseek_v3": ("gate_proj", "up_proj", "down_proj")}
SHARED = {"qwen3_moe": "shared_expert", "deepseek_v3": "shared_experts"}


def make_config(**kwargs) -> MoEConfig:
    return MoEConfig(dim=D, hidden_dim=FFN, top_k=2, **kwargs)


def make_moe(case: str, dtype=torch.float64) -> MoE:
    return MoE(make_config(**CASES[case][2]), dtype=dtype).eval()


def random_hf_state_dict(case: str, dtype=torch.float64, seed: int = 0) -> dict:
    """An HF block's weights for ``case``: ``nn.Linear`` weights ``[out, in]``, one per expert."""
    style, prefix, kw = CASES[case]
    g = torch.Generator().manual_seed(seed)

    def linear(out_features, in_features):
        w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
        return w.to(dtype)

    E = kw["num_experts"]
    gate, up, down = PROJ[style]
    sd = {f"{prefix}gate.weight": linear(E, D) * 4}  # wide logits spread the routing
    if style == "deepseek_v3":
        sd[f"{prefix}gate.e_score_correction_bias"] = 0.1 * torch.randn(E, generator=g)
    for i in range(E):
        sd[f"{prefix}experts.{i}.{gate}.weight"] = linear(FFN, D)
        sd[f"{prefix}experts.{i}.{up}.weight"] = linear(FFN, D)
        sd[f"{prefix}experts.{i}.{down}.weight"] = linear(D, FFN)
    n_shared = kw.get("num_shared_experts", 0)
    if n_shared:
        Fs = n_shared * kw.get("shared_hidden_dim", FFN)
        p = f"{prefix}{SHARED[style]}."
        sd[f"{p}{gate}.weight"] = linear(Fs, D)
        sd[f"{p}{up}.weight"] = linear(Fs, D)
        sd[f"{p}{down}.weight"] = linear(D, Fs)
    if kw.get("shared_expert_gate"):
        sd[f"{prefix}shared_expert_gate.weight"] = linear(1, D)
    return sd


def loaded_moe(case: str, dtype=torch.float64) -> tuple[MoE, dict]:
    sd = random_hf_state_dict(case, dtype)
    moe = make_moe(case, dtype)
    load_hf_moe_state_dict(moe, sd, prefix=CASES[case][1], style=CASES[case][0])
    return moe, sd


# Per-token reference of the HF blocks -----------------------------------------------------------


def top(values, k, candidates=None):
    """Indices of the ``k`` largest ``values`` among ``candidates``, largest first."""
    candidates = range(len(values)) if candidates is None else candidates
    return sorted(candidates, key=lambda e: -float(values[e]))[:k]


def route_softmax(logits, k, normalize):
    # Mixtral and Qwen3-MoE: softmax over all experts, keep the top-k, optionally renormalise
    probs = torch.softmax(logits, dim=-1)
    ids = top(probs, k)
    weights = probs[ids]
    return ids, weights / weights.sum() if normalize else weights


def route_deepseek_v3(logits, k, bias, n_groups, topk_groups, scale):
    scores = torch.sigmoid(logits)
    choice = scores + bias  # the bias picks experts but does not weight them
    size = len(scores) // n_groups
    group_scores = [sum(sorted(choice[g * size:(g + 1) * size].tolist(), reverse=True)[:2])
                    for g in range(n_groups)]
    groups = top(group_scores, topk_groups)
    ids = top(choice, k, [e for e in range(len(scores)) if e // size in groups])
    weights = scores[ids]
    return ids, weights / (weights.sum() + 1e-20) * scale


def hf_mlp(x, gate_FD, up_FD, down_DF):
    return (F.silu(x @ gate_FD.T) * (x @ up_FD.T)) @ down_DF.T


def reference_forward(case: str, sd: dict, x_TD):
    style, prefix, kw = CASES[case]
    gate, up, down = PROJ[style]
    k = 2
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.size(0)):
        x = x_TD[t]
        logits = x.float() @ sd[f"{prefix}gate.weight"].float().T  # routers run in fp32
        if style == "deepseek_v3":
            ids, weights = route_deepseek_v3(
                logits, k, sd[f"{prefix}gate.e_score_correction_bias"].float(),
                kw["num_expert_groups"], kw["topk_groups"], kw["route_scale"])
        else:
            # Mixtral always renormalises; Qwen3-MoE does when norm_topk_prob is set
            normalize = style == "mixtral" or kw["normalize_topk"]
            ids, weights = route_softmax(logits, k, normalize)
        for e, w in zip(ids, weights):
            p = f"{prefix}experts.{e}."
            y = hf_mlp(x, sd[f"{p}{gate}.weight"], sd[f"{p}{up}.weight"], sd[f"{p}{down}.weight"])
            out[t] += w.to(x.dtype) * y
        if kw.get("num_shared_experts", 0):
            p = f"{prefix}{SHARED[style]}."
            y = hf_mlp(x, sd[f"{p}{gate}.weight"], sd[f"{p}{up}.weight"], sd[f"{p}{down}.weight"])
            if kw.get("shared_expert_gate"):
                y = torch.sigmoid(x @ sd[f"{prefix}shared_expert_gate.weight"].T) * y
            out[t] += y
    return out


class TestHFConversion(TestCase):
    @parametrize("case", list(CASES))
    def test_matches_hf_reference(self, case):
        moe, sd = loaded_moe(case)
        x = torch.randn(2, 7, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            y = moe(x)
        expected = reference_forward(case, sd, x.view(-1, D)).view_as(x)
        # the routing weights are fp32 on both sides, the expert GEMMs fp64
        self.assertEqual(y, expected, atol=1e-6, rtol=1e-6)

    @parametrize("case", list(CASES))
    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_round_trip_is_exact(self, case, dtype):
        moe, sd = loaded_moe(case, dtype)
        out = hf_moe_state_dict(moe, prefix=CASES[case][1], style=CASES[case][0])
        self.assertEqual(sorted(out), sorted(sd))
        for key, value in sd.items():
            self.assertEqual(out[key], value, atol=0, rtol=0, exact_dtype=True, msg=key)
            self.assertTrue(out[key].is_contiguous())

    def test_export_is_detached_from_moe(self):
        moe, _ = loaded_moe("mixtral")
        out = hf_moe_state_dict(moe, prefix="p.", style="mixtral")
        out["p.gate.weight"].zero_()
        out["p.experts.0.w1.weight"].zero_()
        self.assertNotEqual(moe.router.weight.abs().sum().item(), 0)
        self.assertNotEqual(moe.experts.w1[0].abs().sum().item(), 0)
        self.assertFalse(out["p.gate.weight"].requires_grad)

    def test_load_converts_dtype_and_keeps_parameters(self):
        sd = random_hf_state_dict("deepseek_v3", torch.bfloat16)
        moe = make_moe("deepseek_v3", torch.float32)
        params = dict(moe.named_parameters())
        load_hf_moe_state_dict(moe, sd, prefix=CASES["deepseek_v3"][1], style="deepseek_v3")
        for name, p in moe.named_parameters():
            self.assertIs(p, params[name])
            self.assertEqual(p.dtype, torch.float32)
            self.assertTrue(p.requires_grad)
        self.assertEqual(moe.router.expert_bias.dtype, torch.float32)
        p = CASES["deepseek_v3"][1]
        self.assertEqual(moe.experts.w2[5], sd[f"{p}experts.5.down_proj.weight"].float().T,
                         atol=0, rtol=0)
        self.assertEqual(moe.router.expert_bias, sd[f"{p}gate.e_score_correction_bias"],
                         atol=0, rtol=0)

    def test_ignores_keys_outside_the_block(self):
        sd = random_hf_state_dict("mixtral")
        whole = dict(sd)
        whole["model.layers.0.self_attn.q_proj.weight"] = torch.randn(D, D)
        whole["model.layers.0.input_layernorm.weight"] = torch.randn(D)
        whole["model.layers.0.block_sparse_moe_extra.weight"] = torch.randn(D)
        whole["model.layers.1.block_sparse_moe.gate.weight"] = torch.randn(3, 3)
        moe = make_moe("mixtral")
        load_hf_moe_state_dict(moe, whole, prefix=CASES["mixtral"][1], style="mixtral")
        self.assertEqual(moe.router.weight, sd[f"{CASES['mixtral'][1]}gate.weight"], atol=0, rtol=0)

    def test_non_strict_skips_missing_and_unexpected_keys(self):
        # one shard of a checkpoint: the router and experts 0-1 of 8, plus a key of a newer format
        sd = {k: v for k, v in random_hf_state_dict("qwen3_moe").items()
              if "experts." not in k or ".experts.0." in k or ".experts.1." in k}
        p = CASES["qwen3_moe"][1]
        sd[f"{p}gate.bias"] = torch.zeros(6)
        moe = make_moe("qwen3_moe")
        w1_before = moe.experts.w1.detach().clone()
        load_hf_moe_state_dict(moe, sd, prefix=p, style="qwen3_moe", strict=False)
        self.assertEqual(moe.experts.w1[1], sd[f"{p}experts.1.gate_proj.weight"].T, atol=0, rtol=0)
        self.assertEqual(moe.experts.w1[2:], w1_before[2:], atol=0, rtol=0)


class TestHFConversionErrors(TestCase):
    def message(self, fn, *args, **kwargs):
        with self.assertRaises((KeyError, ValueError)) as ctx:
            fn(*args, **kwargs)
        return ctx.exception.args[0]

    def load_error(self, case, sd, moe=None, **kwargs):
        style, prefix, _ = CASES[case]
        moe = make_moe(case) if moe is None else moe
        kwargs = dict(prefix=prefix, style=style) | kwargs
        return self.message(load_hf_moe_state_dict, moe, sd, **kwargs)

    def test_unknown_style(self):
        moe = make_moe("mixtral")
        self.assertExpectedInline(
            self.message(load_hf_moe_state_dict, moe, {}, style="llama"),
            """load_hf_moe_state_dict: expected style in ('mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe', 'deepseek_v3', 'gpt_oss'), but got 'llama'""",
        )
        self.assertExpectedInline(
            self.message(hf_moe_state_dict, moe, style="Mixtral"),
            """hf_moe_state_dict: expected style in ('mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe', 'deepseek_v3', 'gpt_oss'), but got 'Mixtral'""",
        )

    def test_prefix_without_dot(self):
        self.assertExpectedInline(
            self.load_error("mixtral", random_hf_state_dict("mixtral"),
                            prefix="model.layers.0.block_sparse_moe"),
            """load_hf_moe_state_dict: expected prefix to be empty or end with '.', but got 'model.layers.0.block_sparse_moe'""",
        )

    def test_missing_key(self):
        sd = random_hf_state_dict("mixtral")
        del sd["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
        with self.assertRaises(KeyError):
            load_hf_moe_state_dict(make_moe("mixtral"), sd, prefix=CASES["mixtral"][1])
        self.assertExpectedInline(
            self.load_error("mixtral", sd),
            """load_hf_moe_state_dict: missing keys for style 'mixtral' (checkpoint layout) under prefix 'model.layers.0.block_sparse_moe.': ['model.layers.0.block_sparse_moe.experts.3.w2.weight']; pass strict=False to load the others and get the missing keys back""",
        )

    def test_many_missing_keys_are_elided(self):
        sd = {k: v for k, v in random_hf_state_dict("mixtral").items() if not k.endswith("w3.weight")}
        self.assertExpectedInline(
            self.load_error("mixtral", sd),
            """load_hf_moe_state_dict: missing keys for style 'mixtral' (checkpoint layout) under prefix 'model.layers.0.block_sparse_moe.': ['model.layers.0.block_sparse_moe.experts.0.w3.weight', 'model.layers.0.block_sparse_moe.experts.1.w3.weight', 'model.layers.0.block_sparse_moe.experts.2.w3.weight', 'model.layers.0.block_sparse_moe.experts.3.w3.weight', 'model.layers.0.block_sparse_moe.experts.4.w3.weight', 'model.layers.0.block_sparse_moe.experts.5.w3.weight', ... (2 more)]; pass strict=False to load the others and get the missing keys back""",
        )

    def test_missing_shared_expert(self):
        moe = MoE(make_config(num_experts=6, num_shared_experts=1, shared_expert_gate=True))
        self.assertExpectedInline(
            self.load_error("qwen3_moe", random_hf_state_dict("qwen3_moe"), moe=moe),
            """load_hf_moe_state_dict: missing keys for style 'qwen3_moe' (checkpoint layout) under prefix 'model.layers.1.mlp.': ['model.layers.1.mlp.shared_expert.down_proj.weight', 'model.layers.1.mlp.shared_expert.gate_proj.weight', 'model.layers.1.mlp.shared_expert.up_proj.weight', 'model.layers.1.mlp.shared_expert_gate.weight']; pass strict=False to load the others and get the missing keys back""",
        )

    def test_unexpected_key(self):
        sd = random_hf_state_dict("mixtral")
        sd["model.layers.0.block_sparse_moe.gate.bias"] = torch.zeros(8)
        self.assertExpectedInline(
            self.load_error("mixtral", sd),
            """load_hf_moe_state_dict: unexpected keys for style 'mixtral' (checkpoint layout) under prefix 'model.layers.0.block_sparse_moe.': ['model.layers.0.block_sparse_moe.gate.bias']""",
        )

    def test_unexpected_shared_expert(self):
        # a Qwen2-MoE checkpoint into a layer built without shared experts
        sd = random_hf_state_dict("qwen3_moe_shared")
        self.assertExpectedInline(
            self.load_error("qwen3_moe_shared", sd, moe=MoE(make_config(num_experts=4))),
            """load_hf_moe_state_dict: unexpected keys for style 'qwen3_moe' (checkpoint layout) under prefix 'model.layers.2.mlp.': ['model.layers.2.mlp.shared_expert.down_proj.weight', 'model.layers.2.mlp.shared_expert.gate_proj.weight', 'model.layers.2.mlp.shared_expert.up_proj.weight', 'model.layers.2.mlp.shared_expert_gate.weight']""",
        )

    def test_shape_mismatch(self):
        sd = random_hf_state_dict("qwen3_moe")
        key = "model.layers.1.mlp.experts.2.up_proj.weight"
        sd[key] = sd[key].T.contiguous()  # stored [in, out]
        self.assertExpectedInline(
            self.load_error("qwen3_moe", sd),
            """load_hf_moe_state_dict: expected 'model.layers.1.mlp.experts.2.up_proj.weight' of shape [8, 16] ([F, D]), but got [16, 8]""",
        )

    def test_shape_mismatch_raises_without_strict(self):
        sd = random_hf_state_dict("mixtral")
        sd["model.layers.0.block_sparse_moe.gate.weight"] = torch.randn(8, D + 1)
        self.assertExpectedInline(
            self.load_error("mixtral", sd, strict=False),
            """load_hf_moe_state_dict: expected 'model.layers.0.block_sparse_moe.gate.weight' of shape [8, 16] ([E, D]), but got [8, 17]""",
        )

    def test_shared_expert_width_mismatch(self):
        # two DeepSeek shared experts are one FFN of width 2 * hidden_dim
        sd = random_hf_state_dict("deepseek_v3")
        sd = {k.removeprefix(CASES["deepseek_v3"][1]): v for k, v in sd.items()}
        self.assertExpectedInline(
            self.load_error("deepseek_v3_two_shared", sd),
            """load_hf_moe_state_dict: expected 'shared_experts.gate_proj.weight' of shape [16, 16] ([Fs, D]), but got [8, 16]""",
        )

    def test_more_experts_than_the_moe(self):
        sd = random_hf_state_dict("mixtral")  # 8 experts
        moe = MoE(make_config(num_experts=4, topk_before_score=True))
        self.assertExpectedInline(
            self.load_error("mixtral", sd, moe=moe),
            """load_hf_moe_state_dict: expected 4 experts (experts.0 to experts.3) under prefix 'model.layers.0.block_sparse_moe.', but the state dict has 8 (experts.0 to experts.7)""",
        )
        self.assertExpectedInline(
            self.load_error("mixtral", sd, moe=moe, strict=False),
            """load_hf_moe_state_dict: expected 4 experts (experts.0 to experts.3) under prefix 'model.layers.0.block_sparse_moe.', but the state dict has 8 (experts.0 to experts.7)""",
        )

    def test_fewer_experts_than_the_moe(self):
        sd = random_hf_state_dict("qwen3_moe_shared")  # 4 experts
        moe = MoE(make_config(num_experts=8, num_shared_experts=1, shared_hidden_dim=12,
                              shared_expert_gate=True))
        self.assertExpectedInline(
            self.load_error("qwen3_moe_shared", sd, moe=moe),
            """load_hf_moe_state_dict: expected 8 experts (experts.0 to experts.7) under prefix 'model.layers.2.mlp.', but the state dict has 4 (experts.0 to experts.3)""",
        )

    def test_non_contiguous_expert_ids(self):
        sd = {k.replace(".experts.3.", ".experts.5."): v
              for k, v in random_hf_state_dict("qwen3_moe_shared").items()}
        self.assertExpectedInline(
            self.load_error("qwen3_moe_shared", sd,
                            moe=MoE(make_config(num_experts=4, num_shared_experts=1,
                                                shared_hidden_dim=12, shared_expert_gate=True))),
            """load_hf_moe_state_dict: expected 4 experts (experts.0 to experts.3) under prefix 'model.layers.2.mlp.', but the state dict has 4 (experts [0, 1, 2, 5])""",
        )

    def test_correction_bias_needs_load_balance_bias(self):
        kw = dict(CASES["deepseek_v3"][2], load_balance_bias=False)
        sd = random_hf_state_dict("deepseek_v3")
        for strict in (True, False):
            self.assertExpectedInline(
                self.load_error("deepseek_v3", sd, moe=MoE(make_config(**kw)), strict=strict),
                """load_hf_moe_state_dict: the state dict has 'model.layers.3.mlp.gate.e_score_correction_bias' (an expert-selection bias), but the MoE was built with load_balance_bias=False; build it with MoEConfig(load_balance_bias=True)""",
            )

    def test_configs_the_style_cannot_hold(self):
        self.assertExpectedInline(
            self.load_error("mixtral", {}, moe=MoE(make_config(num_experts=8, num_shared_experts=1))),
            """load_hf_moe_state_dict: style 'mixtral' has no shared experts, but the MoE has num_shared_experts=1""",
        )
        self.assertExpectedInline(
            self.load_error("mixtral", {}, moe=MoE(make_config(num_experts=8, activation="gelu"))),
            """load_hf_moe_state_dict: style 'mixtral' has SiLU-gated experts (gate and up projections), but the MoE has activation='gelu'; use activation='swiglu'""",
        )
        self.assertExpectedInline(
            self.load_error("qwen3_moe", {}, moe=MoE(make_config(num_experts=8, router_bias=True))),
            """load_hf_moe_state_dict: style 'qwen3_moe' has no biases, but the MoE has router_bias=True""",
        )
        moe = MoE(make_config(num_experts=8, num_shared_experts=1, shared_expert_gate=True))
        self.assertExpectedInline(
            self.message(hf_moe_state_dict, moe, style="deepseek_v3"),
            """hf_moe_state_dict: style 'deepseek_v3' has no shared-expert gate, but the MoE has shared_expert_gate=True""",
        )

    def test_export_of_a_bias_the_style_cannot_hold(self):
        moe = MoE(make_config(num_experts=4, load_balance_bias=True))
        self.assertEqual(len(hf_moe_state_dict(moe, style="qwen3_moe")), 13)  # a zero bias is fine
        moe.router.expert_bias.fill_(0.5)
        self.assertExpectedInline(
            self.message(hf_moe_state_dict, moe, style="qwen3_moe"),
            """hf_moe_state_dict: style 'qwen3_moe' has no key for router.expert_bias, but it is non-zero; its effect on expert selection would be lost""",
        )

    def test_failed_load_leaves_the_moe_unchanged(self):
        sd = random_hf_state_dict("mixtral")
        sd["model.layers.0.block_sparse_moe.experts.7.w2.weight"] = torch.randn(FFN, D)
        moe = make_moe("mixtral")
        before = {k: v.clone() for k, v in moe.state_dict().items()}
        with self.assertRaises(ValueError):
            load_hf_moe_state_dict(moe, sd, prefix=CASES["mixtral"][1])
        for k, v in moe.state_dict().items():
            self.assertEqual(v, before[k], atol=0, rtol=0)


instantiate_parametrized_tests(TestHFConversion)

if __name__ == "__main__":
    run_tests()
