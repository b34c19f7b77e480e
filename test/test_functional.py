# Owner(s): ["module: moe"]
"""Tests of ``torch_moe.nn.functional.moe_ffn``: what it saves for backward, its weight layouts,
its CPU compute paths, and how it composes with autograd and tracing."""

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
from torch.testing._internal.two_tensor import TwoTensor

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe import _refs
from torch_moe._native import _cpu_features
from torch_moe._native import activation as fused_activation
from torch_moe.nn import _subclass_hooks, MoE, MoEConfig
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
        # (the CPU's answer to the probe replaced by each of the two answers)
        dtypes = frozenset((torch.bfloat16, torch.float16)) if native else frozenset()
        with mock.patch.object(_cpu_features, "mkldnn_native_gemm_dtypes", return_value=dtypes):
            self.assertEqual(
                _cpu_features.gemm_compute_dtype(torch.bfloat16),
                torch.bfloat16 if native else torch.float32,
            )
            x, ids, w, w1, w2, w3 = make_layer(dtype=torch.bfloat16)
            out = moe_ffn(x, ids, w, w1, w2, w3)
            grads = torch.autograd.grad(out, (x, w, w1, w2, w3), torch.ones_like(out))
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


    def test_parameter_tokens_take_the_plain_path(self):
        # eager and compiled (the subclass lookup is traced by Dynamo)
        x, ids, w, w1, w2, w3 = make_layer()
        p = torch.nn.Parameter(x.detach())
        expected = moe_ffn(x, ids, w, w1, w2, w3)
        self.assertEqual(moe_ffn(p, ids, w, w1, w2, w3), expected)
        compiled = torch.compile(moe_ffn, fullgraph=True, backend="aot_eager")
        self.assertEqual(compiled(p, ids, w, w1, w2, w3), expected)

    def test_tensor_subclass_without_handlers_runs_each_op_on_it(self):
        # a subclass that no package registered handlers for computes through its own
        # __torch_dispatch__: TwoTensor runs every op on both of its tensors
        x, ids, w, w1, w2, w3 = make_layer()
        x2 = torch.randn_like(x)
        out = moe_ffn(TwoTensor(x.detach(), x2), ids, w, w1, w2, w3)
        self.assertIsInstance(out, TwoTensor)
        self.assertEqual(out.a, moe_ffn(x, ids, w, w1, w2, w3))
        self.assertEqual(out.b, moe_ffn(x2, ids, w, w1, w2, w3))
        moe = MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=2)).eval()
        y = moe(TwoTensor(x.detach(), x2))
        self.assertIsInstance(y, TwoTensor)
        self.assertEqual(y.a, moe(x))
        self.assertEqual(y.b, moe(x2))

    def test_registered_subclass_handlers_run(self):
        # handlers apply to the registered type and its subclasses; the plain computation they
        # are given equals moe_ffn
        class Marked(TwoTensor):
            pass

        calls = []

        def ffn_handler(x, topk_ids, topk_weights, w1, w2, w3, local_moe_ffn):
            calls.append("moe_ffn")
            return local_moe_ffn(x.a, topk_ids, topk_weights, w1, w2, w3)

        def layer_handler(moe, x, return_aux_loss):
            calls.append(("MoE", return_aux_loss))
            return moe(x.a)

        x, ids, w, w1, w2, w3 = make_layer()
        saved = dict(_subclass_hooks._HANDLERS)
        try:
            _subclass_hooks.register_subclass_handlers(TwoTensor, moe_ffn=ffn_handler,
                                                       moe_layer=layer_handler)
            marked = Marked(x.detach(), x.detach().clone())
            out = moe_ffn(marked, ids, w, w1, w2, w3, activation="geglu")
            moe = MoE(MoEConfig(dim=8, hidden_dim=4, num_experts=4, top_k=2))
            y = moe(marked, return_aux_loss=True)
        finally:
            _subclass_hooks._HANDLERS.clear()
            _subclass_hooks._HANDLERS.update(saved)
        self.assertEqual(calls, ["moe_ffn", ("MoE", True)])
        self.assertEqual(out, moe_ffn(x, ids, w, w1, w2, w3, activation="geglu"))
        self.assertEqual(y, moe(x))
        with self.assertRaisesRegex(TypeError, "expected a subclass of torch.Tensor"):
            _subclass_hooks.register_subclass_handlers(torch.Tensor, moe_ffn=ffn_handler,
                                                       moe_layer=layer_handler)

    @parametrize("kind", ["swiglu", "geglu", "swiglu_oai", "gelu", "relu"])
    def test_activation_matches_reference(self, kind):
        # the library's activation (one module, shared by every path) against the reference's
        # own formulas, values and gradients, with gate / up values past the swiglu_oai limit
        g = torch.Generator().manual_seed(0)
        gate = (torch.randn(64, 5, generator=g, dtype=torch.float64) * 4).requires_grad_()
        up = (torch.randn(64, 5, generator=g, dtype=torch.float64) * 4).requires_grad_()
        gated = kind in ("swiglu", "geglu", "swiglu_oai")
        args = (gate, up) if gated else (gate,)
        out = torch_moe.nn.functional.activation(kind, *args, alpha=1.5, limit=3.0)
        ref = _refs.activation(kind, *args, alpha=1.5, limit=3.0)
        self.assertEqual(out, ref, atol=1e-12, rtol=1e-12)
        grad = torch.randn_like(out)
        self.assertEqual(torch.autograd.grad(out, args, grad), torch.autograd.grad(ref, args, grad),
                         atol=1e-12, rtol=1e-12)

    def test_fused_activation_backward_matches_reference(self):
        # the fused kernels' hand-written derivatives against autograd through the reference
        g = torch.Generator().manual_seed(1)
        for kind in ("swiglu", "geglu", "swiglu_oai", "gelu", "relu"):
            gated = kind in ("swiglu", "geglu", "swiglu_oai")
            h = torch.randn(32, 6 if gated else 3, generator=g, dtype=torch.float64) * 4
            grad = torch.randn(32, 3, generator=g, dtype=torch.float64)
            out = fused_activation.activation_forward(kind, h, torch.empty(32, 3, dtype=h.dtype),
                                                      1.5, 3.0)
            grad_h = fused_activation.activation_backward(kind, grad, h, torch.empty_like(h), 1.5, 3.0)
            hr = h.clone().requires_grad_()
            ref = _refs.activation(kind, *(hr.chunk(2, dim=1) if gated else (hr,)), alpha=1.5,
                                   limit=3.0)
            self.assertEqual(out, ref, atol=1e-12, rtol=1e-12, msg=kind)
            self.assertEqual(grad_h, torch.autograd.grad(ref, hr, grad)[0], atol=1e-12, rtol=1e-12,
                             msg=kind)

    @parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_fused_swiglu_backward_is_autograds(self, dtype):
        # the fused swiglu backward runs the ops autograd runs through F.silu(g) * u, so in fp32
        # and bf16 its bits are autograd's (F a multiple of 16: ATen's vectorised loops on both)
        g = torch.Generator().manual_seed(2)
        F_ = 64
        h = (torch.randn(40, 2 * F_, generator=g) * 4).to(dtype)
        grad = torch.randn(40, F_, generator=g).to(dtype)
        grad_h = fused_activation.activation_backward("swiglu", grad, h, torch.empty_like(h),
                                                      1.702, 7.0)
        gate, up = (t.clone().requires_grad_() for t in h.chunk(2, dim=1))
        (torch.nn.functional.silu(gate) * up).backward(grad)
        self.assertEqual(grad_h, torch.cat([gate.grad, up.grad], 1), atol=0, rtol=0)

instantiate_parametrized_tests(TestMoEFFN)

if __name__ == "__main__":
    run_tests()
