# Owner(s): ["module: inductor"]
"""torch.compile of the MoE layer and the torch_moe ops with Inductor on CPU.

Every test runs with fresh Inductor caches (``torch._inductor.test_case.TestCase``), so the
generated code it inspects comes from the lowerings and decompositions registered by
``import torch_moe``, not from a cache entry of an earlier run.
"""

import re

import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch._dynamo.utils import counters
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.utils import run_and_get_code, run_fw_bw_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.common_utils import IS_CI

import torch_moe  # noqa: F401
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.functional import moe_ffn


def moe_settings(max_examples):
    return settings(max_examples=max_examples, deadline=None, derandomize=IS_CI, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

ops = torch.ops.torch_moe


def routing(T, E, k, skew, seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skew == "one_expert":
        scores[:, 0] += 2.0
    elif skew == "unused_experts" and E > k:
        scores[:, torch.randperm(E, generator=g)[: E - k]] -= 2.0
    return scores.topk(k, dim=1).indices, torch.rand(T, k, generator=g)


def cpp_kernels(code: str) -> int:
    return len(re.findall(r"^cpp_fused\w* = ", code, flags=re.M))


class TestCompileMoE(TestCase):
    def setUp(self):
        super().setUp()
        counters.clear()
        torch._dynamo.reset()

    def test_layer_fullgraph_dynamic_no_recompile(self):
        # five batches with different token counts and expert loads: one graph, no breaks
        torch.manual_seed(0)
        moe = MoE(MoEConfig(dim=32, hidden_dim=48, num_experts=8, top_k=2, num_shared_experts=1,
                            load_balance_coeff=0.01))
        # token dims marked dynamic (dynamic=True would also make the parameters' and buffers'
        # dims symbolic, and duck sizing could tie one to the sequence length)
        compiled = torch.compile(moe, fullgraph=True)
        for i, skew in enumerate(["uniform", "one_expert", "unused_experts", "uniform", "one_expert"]):
            x = torch.randn(2, 8 + 4 * i, 32)
            torch._dynamo.mark_dynamic(x, 1)
            if skew == "one_expert":
                x = x + 3 * moe.router.weight[0].detach()  # push every token to expert 0
            xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
            torch._dynamo.mark_dynamic(xc, 1)
            ye, yc = moe(xe), compiled(xc)
            self.assertEqual(yc, ye, atol=1e-5, rtol=1e-5)
            g = torch.randn_like(ye)
            ye.backward(g)
            ge = [p.grad.clone() for p in moe.parameters()]
            moe.zero_grad()
            yc.backward(g)
            self.assertEqual(xc.grad, xe.grad, atol=1e-5, rtol=1e-5)
            for p, q in zip(ge, moe.parameters()):
                self.assertEqual(q.grad, p, atol=1e-5, rtol=1e-5)
            moe.zero_grad()
        self.assertEqual(counters["stats"]["unique_graphs"], 1)
        self.assertEqual(len(counters["graph_break"]), 0)

    def test_routing_is_fused_and_sort_decomposed(self):
        # router softmax + top-k + token_sort's histogram become C++ kernels; token_sort is no
        # longer an extern call; its range check is an on-device assert (no host sync); the
        # expert FFN stays the fused torch_moe kernel
        torch.manual_seed(0)
        moe = MoE(MoEConfig(dim=32, hidden_dim=48, num_experts=8, top_k=2)).eval()
        x = torch.randn(64, 32)
        with torch.no_grad():
            out, (code,) = run_and_get_code(torch.compile(moe, fullgraph=True), x)
            self.assertEqual(out, moe(x))
        FileCheck().check_not("torch.ops.torch_moe.token_sort").run(code)
        FileCheck().check("torch_moe.token_sort: expected topk_ids values in [0, 8)").run(code)
        FileCheck().check("torch.ops.torch_moe.grouped_ffn.default(").run(code)
        FileCheck().check_not(".item()").check_not(".tolist()").run(code)
        self.assertEqual(cpp_kernels(code), 4)

    def test_grouped_mm_lowering(self):
        a, b = torch.randn(40, 16), torch.randn(3, 16, 24)
        offs = torch.tensor([8, 8, 32], dtype=torch.int32)
        f = lambda a, b, offs: ops.grouped_mm(a, b, offs).relu()
        for mode in ("default", "max-autotune"):
            torch._dynamo.reset()
            counters.clear()
            out, (code,) = run_and_get_code(torch.compile(f, mode=mode), a, b, offs)
            self.assertEqual(out, f(a, b, offs))
            FileCheck().check("extern_kernels.torch_moe_grouped_mm(").run(code)
            self.assertEqual(counters["torch_moe"]["grouped_mm_lowering"], 1)

    def test_indexed_grouped_mm_lowering(self):
        torch.manual_seed(0)
        x, w = torch.randn(10, 16), torch.randn(3, 16, 8)
        ids, wts = routing(10, 3, 2, "uniform", 0)
        sorted_ids, offs, _ = ops.token_sort(ids, 3)

        def f(x, w, sorted_ids, offs, wts):
            rows = sorted_ids // 2
            return ops.indexed_grouped_mm(x, w, offs, rows, rows, wts.reshape(-1)[sorted_ids], 10)

        out, (code,) = run_and_get_code(torch.compile(f), x, w, sorted_ids, offs, wts)
        self.assertEqual(out, f(x, w, sorted_ids, offs, wts), atol=1e-5, rtol=1e-5)
        FileCheck().check("extern_kernels.torch_moe_indexed_grouped_mm_gi_si_sw(").run(code)

    def test_permute_unpermute_fuse(self):
        torch.manual_seed(0)
        ids, wts = routing(12, 4, 2, "uniform", 1)
        sorted_ids, _, _ = ops.token_sort(ids, 4, 4)
        x = torch.randn(12, 16)

        def f(x, sorted_ids, wts):
            y = ops.permute(x, sorted_ids, 2) * 2.0
            return ops.unpermute(y, sorted_ids, wts)

        out, (code,) = run_and_get_code(torch.compile(f), x, sorted_ids, wts)
        self.assertEqual(out, f(x, sorted_ids, wts), atol=1e-5, rtol=1e-5)
        FileCheck().check_not("torch.ops.torch_moe.permute").check_not("torch.ops.torch_moe.unpermute").run(code)

    def test_mxfp8_activation_and_quantize_fuse(self):
        # quantized_grouped_mm decomposes into its quantizers (fused with their producers) and
        # the scaled grouped GEMM (extern). Inductor's vectorized silu differs from eager's by
        # an ulp here and there, which can move an element across an FP8 rounding boundary, so
        # compiled equals eager to fp32 accuracy, not bit for bit.
        torch.manual_seed(0)
        T, D, F, E = 32, 64, 64, 4
        x = torch.randn(T, D)
        ids, wts = routing(T, E, 2, "uniform", 2)
        w1, w3 = torch.randn(E, D, F) / 8, torch.randn(E, D, F) / 8
        w2 = torch.randn(E, F, D) / 8
        f = lambda x: moe_ffn(x, ids, wts, w1, w2, w3, precision="mxfp8")
        out, (code,) = run_and_get_code(torch.compile(f, fullgraph=True), x)
        self.assertEqual(out, f(x), atol=1e-5, rtol=1e-4)
        FileCheck().check_not("torch.ops.torch_moe.quantize_mxfp8").run(code)
        FileCheck().check("torch.ops.torch_moe.scaled_grouped_mm.default(").run(code)
        # the silu of the gate and the e4m3 cast of the activation in one kernel
        kernels = re.findall(r"cpp_fused\w* = .*?'''\)", code, flags=re.S)
        self.assertTrue(any("exp" in k and "Float8_e4m3fn" in k for k in kernels))

    def test_backward_code(self):
        torch.manual_seed(0)
        T, D, F, E = 16, 8, 12, 4
        x = torch.randn(T, D, requires_grad=True)
        ids, wts = routing(T, E, 2, "uniform", 3)
        w1, w2, w3 = (torch.randn(E, D, F, requires_grad=True), torch.randn(E, F, D, requires_grad=True),
                      torch.randn(E, D, F, requires_grad=True))
        f = lambda x, w1, w2, w3: moe_ffn(x, ids, wts, w1, w2, w3)
        out, (fw, bw) = run_fw_bw_and_get_code(lambda: torch.compile(f)(x, w1, w2, w3).sum())
        FileCheck().check("torch.ops.torch_moe.grouped_ffn_backward.default(").run(bw)

    @moe_settings(8)
    @given(st.integers(1, 24), st.integers(1, 6), st.data(),
           st.sampled_from(["uniform", "one_expert", "unused_experts"]),
           st.sampled_from([torch.float32, torch.bfloat16]))
    def test_compiled_equals_eager(self, T, E, data, skew, dtype):
        k = data.draw(st.integers(1, E))
        D, F = 8, 12
        ids, wts = routing(T, E, k, skew, T * 7 + E)
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, D, generator=g).to(dtype)
        ws = [torch.randn(E, D, F, generator=g).to(dtype), torch.randn(E, F, D, generator=g).to(dtype),
              torch.randn(E, D, F, generator=g).to(dtype)]
        f = lambda x, *ws: moe_ffn(x, ids, wts, *ws)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        we = [w.clone().requires_grad_() for w in ws]
        wc = [w.clone().requires_grad_() for w in ws]
        ye = f(xe, *we)
        yc = torch.compile(f, dynamic=True)(xc, *wc)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        self.assertEqual(yc, ye, **tol)
        grad = torch.randn_like(ye)
        ye.backward(grad)
        yc.backward(grad)
        for a, b in zip([xc, *wc], [xe, *we]):
            self.assertEqual(a.grad, b.grad, **tol)


if __name__ == "__main__":
    run_tests()
