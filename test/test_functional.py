# Owner(s): ["module: moe"]
"""Tests of ``torch_moe.nn.functional.moe_ffn``: what it saves for backward, its weight layouts,
its CPU compute paths, and how it composes with autograd and tracing."""

import os
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._dynamo.testing import CompileCounterWithBackend
from torch.testing._internal.common_utils import (
    DeterministicGuard,
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe import _refs
from torch_moe._native import _cpu_features
from torch_moe.nn.functional import moe_ffn


def make_layer(T=16, D=8, F=4, E=4, k=2, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype).requires_grad_()
    scores = torch.randn(T, E, generator=g)
    vals, ids = scores.topk(k, dim=1)
    w = vals.softmax(-1).requires_grad_()
    w1 = (torch.randn(E, D, F, generator=g) / D**0.5).to(dtype).requires_grad_()
    w3 = (torch.randn(E, D, F, generator=g) / D**0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, F, D, generator=g) / F**0.5).to(dtype).requires_grad_()
    return x, ids, w, w1, w2, w3


class TestMoEFFN(TestCase):
    def test_saved_for_backward(self):
        # only the pre-activation `hidden` [T * k, 2F] is saved besides inputs and routing
        x, ids, w, w1, w2, w3 = make_layer(T=16, D=8, F=4, E=4, k=2)
        inputs = {id(t.untyped_storage()): n for n, t in
                  dict(x=x, topk_weights=w, w1=w1, w2=w2, w3=w3).items()}
        saved = []

        def pack(t):
            saved.append(inputs.get(id(t.untyped_storage()), "") + str(tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            moe_ffn(x, ids, w, w1, w2, w3)
        self.assertExpectedInline(
            " ".join(saved),
            """x(16, 8) (32,) (4,) topk_weights(16, 2) w1(4, 8, 4) w2(4, 4, 8) w3(4, 8, 4) (32, 8)""",
        )

    def test_fused_w13_matches_separate(self):
        x, ids, w, w1, w2, w3 = make_layer(dtype=torch.float64)
        w13 = torch.cat([w1, w3], dim=2).detach().requires_grad_()
        out = moe_ffn(x, ids, w, w1, w2, w3)
        out_fused = moe_ffn(x, ids, w, w13, w2)
        self.assertEqual(out, out_fused)
        g = torch.randn_like(out)
        g1, g3 = torch.autograd.grad(out, (w1, w3), g)
        (g13,) = torch.autograd.grad(out_fused, (w13,), g)
        self.assertEqual(torch.cat([g1, g3], dim=2), g13)

    def test_linear_layout_weights(self):
        # nn.Linear-style [E, out, in] weights are passed as transposed views
        x, ids, w, w1, w2, w3 = make_layer(dtype=torch.float64)
        w1_lin, w2_lin, w3_lin = (t.detach().transpose(1, 2).contiguous().requires_grad_()
                                  for t in (w1, w2, w3))
        out = moe_ffn(x, ids, w, w1_lin.transpose(1, 2), w2_lin.transpose(1, 2),
                      w3_lin.transpose(1, 2))
        self.assertEqual(out, moe_ffn(x, ids, w, w1, w2, w3))
        out.sum().backward()
        self.assertEqual(w1_lin.grad.shape, w1_lin.shape)

    @parametrize("native", [False, True])
    def test_low_precision_compute_paths(self, native):
        # bf16 GEMMs either run natively or in fp32; both agree with the fp64 reference
        key = "TORCH_MOE_CPU_NATIVE_LOW_PRECISION_GEMM"
        with mock.patch.dict(os.environ, {key: "1" if native else "0"}):
            _cpu_features._native_reduced_precision_gemm.cache_clear()
            try:
                self.assertEqual(
                    _cpu_features.gemm_compute_dtype(torch.bfloat16),
                    torch.bfloat16 if native else torch.float32,
                )
                x, ids, w, w1, w2, w3 = make_layer(dtype=torch.bfloat16)
                out = moe_ffn(x, ids, w, w1, w2, w3)
                grads = torch.autograd.grad(out, (x, w, w1, w2, w3), torch.ones_like(out))
            finally:
                _cpu_features._native_reduced_precision_gemm.cache_clear()
        leaves = [t.detach().double().requires_grad_() for t in (x, w, w1, w2, w3)]
        ref = _refs.moe_ffn(leaves[0], ids, *leaves[1:4], leaves[4])
        ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref))
        self.assertEqual(out, ref.bfloat16(), atol=2e-2, rtol=2e-2)
        for got, expected in zip(grads, ref_grads):
            self.assertEqual(got, expected.to(got.dtype), atol=5e-2, rtol=5e-2)

    def test_fp32_router_weights_with_bf16_tokens(self):
        x, ids, w, w1, w2, w3 = make_layer(dtype=torch.bfloat16)
        self.assertEqual(w.dtype, torch.float32)
        out = moe_ffn(x, ids, w, w1, w2, w3)
        out.float().sum().backward()
        self.assertEqual((out.dtype, w.grad.dtype, x.grad.dtype),
                         (torch.bfloat16, torch.float32, torch.bfloat16))

    def test_fake_tensor(self):
        with FakeTensorMode():
            x, ids, w, w1, w2, w3 = make_layer(T=1024, D=64, F=32, E=8, k=2, dtype=torch.bfloat16)
            out = moe_ffn(x, ids, w, w1, w2, w3)
            out.sum().backward()
        self.assertEqual((out.shape, w1.grad.shape), (torch.Size([1024, 64]), w1.shape))

    @parametrize("activation", ["swiglu", "swiglu_oai", "gelu"])
    @parametrize("fused", [False, True])
    @parametrize("align", [1, 4])
    def test_opcheck_grouped_ffn(self, activation, fused, align):
        x, ids, w, w1, w2, w3 = make_layer(T=9, D=6, F=3, E=4, k=2)
        gated = activation != "gelu"
        if gated and fused:
            w1, w3 = torch.cat([w1, w3], dim=2).detach().requires_grad_(), None
        elif not gated:
            w3 = None
        sorted_ids, offs, _ = torch.ops.torch_moe.token_sort(ids, 4, align)
        torch.library.opcheck(
            torch.ops.torch_moe.grouped_ffn.default,
            (x, sorted_ids, offs, w, w1, w2, w3, activation, 1.702, 0.5),
        )

    def test_opcheck_permute_out(self):
        x = torch.randn(5, 3)
        sorted_ids, _, _ = torch.ops.torch_moe.token_sort(torch.randint(0, 3, (5, 1)), 3, 2)
        out = torch.empty(sorted_ids.numel(), 3)
        torch.library.opcheck(torch.ops.torch_moe.permute.out, (x, sorted_ids, 1), {"out": out})

    def test_bitwise_across_thread_counts(self):
        # per-expert GEMMs and fp32 accumulation in a fixed order: the thread count does not
        # change a single bit
        x, ids, w, w1, w2, w3 = make_layer(T=64, D=32, F=16, E=8, k=2, dtype=torch.bfloat16)
        runs = []
        threads = torch.get_num_threads()
        try:
            for n in (1, threads):
                torch.set_num_threads(n)
                out = moe_ffn(x, ids, w, w1, w2, w3)
                runs.append((out, *torch.autograd.grad(out, (x, w, w1, w2, w3), torch.ones_like(out))))
        finally:
            torch.set_num_threads(threads)
        for a, b in zip(*runs):
            self.assertTrue(torch.equal(a, b))

    def test_deterministic_algorithms_mode(self):
        x, ids, w, w1, w2, w3 = make_layer()
        with DeterministicGuard(True):
            moe_ffn(x, ids, w, w1, w2, w3).sum().backward()
        self.assertIsNotNone(w1.grad)

    def test_compile_dynamic_no_recompile(self):
        # the token count varies from call to call; one dynamic graph serves them all
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(moe_ffn, fullgraph=True, dynamic=True, backend=counter)
        frames = []
        for T in (16, 24, 40):
            x, ids, w, w1, w2, w3 = make_layer(T=T)
            out = compiled(x, ids, w, w1, w2, w3)
            self.assertEqual(out, moe_ffn(x, ids, w, w1, w2, w3))
            out.sum().backward()
            frames.append(counter.frame_count)
        self.assertEqual(frames[1:], frames[:1] * 2)

    def test_compile_fullgraph_matches_eager(self):
        x, ids, w, w1, w2, w3 = make_layer()
        compiled = torch.compile(moe_ffn, fullgraph=True, backend="aot_eager")
        out = compiled(x, ids, w, w1, w2, w3)
        self.assertEqual(out, moe_ffn(x, ids, w, w1, w2, w3))
        grads = torch.autograd.grad(out.sum(), (x, w, w1))
        expected = torch.autograd.grad(moe_ffn(x, ids, w, w1, w2, w3).sum(), (x, w, w1))
        self.assertEqual(grads, expected)


instantiate_parametrized_tests(TestMoEFFN)

if __name__ == "__main__":
    run_tests()
