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
from torch.testing._internal.common_utils import IS_CI, instantiate_parametrized_tests, parametrize

import torch_moe  # noqa: F401
from torch_moe import _refs
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


def slots(T, E, k, align, seed, drop_every=0):
    """(sorted_ids [S], topk_weights [T, k]) of a random routing with groups padded to ``align``;
    with ``drop_every`` every such assignment loses its slot (-1), as a capacity limit drops it."""
    ids, wts = routing(T, E, k, "uniform", seed)
    sorted_ids, _, _ = ops.token_sort(ids, E, align)
    if drop_every:
        sorted_ids = torch.where(sorted_ids % drop_every == drop_every - 1, -1, sorted_ids)
    return sorted_ids, wts


def eager_message_head(fn, *args) -> str:
    """What eager's error says before the values it saw (", but got ...", ", but one appears
    ..."): the part a compiled graph's on-device assert says too (it cannot print values
    without a host sync)."""
    try:
        fn(*args)
    except RuntimeError as e:
        return str(e).split(", but ")[0]
    raise AssertionError("eager accepted the input")


def ffn_reference(x, sorted_ids, offs, topk_weights, w1, w2, w3):
    """grouped_ffn from the reference permute / unpermute and one swiglu FFN per group."""
    xs = _refs.permute(x, sorted_ids, topk_weights.size(1))
    ys, start = [], 0
    for e, end in enumerate(offs.tolist()):
        xe = xs[start:end]
        ys.append(_refs.activation("swiglu", xe @ w1[e], xe @ w3[e]) @ w2[e])
        start = end
    ys.append(xs.new_zeros((xs.size(0) - start, x.size(1))))
    return _refs.unpermute(torch.cat(ys), sorted_ids, topk_weights)


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
        # max-autotune picks the per-group kernel or the padded bmm (test_grouped_mm_choices.py)
        for mode, kernel in (("default", r"torch_moe_grouped_mm\("),
                             ("max-autotune", r"torch_moe_grouped_mm(_padded_bmm)?\(")):
            torch._dynamo.reset()
            counters.clear()
            out, (code,) = run_and_get_code(torch.compile(f, mode=mode), a, b, offs)
            self.assertEqual(out, f(a, b, offs))
            self.assertEqual(len(re.findall(r"extern_kernels\." + kernel, code)), 1)
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


class TestCompiledEqualsEagerOps(TestCase):
    """permute / unpermute and their backward ops under torch.compile, against eager: values
    for every token count (none included), dtype and group alignment, and the same errors."""

    def setUp(self):
        super().setUp()
        torch._dynamo.reset()

    # every pair of (token count, dtype), (token count, alignment), (alignment, dtype) once:
    # nine compilations instead of eighteen
    @parametrize("T,align,dtype", [
        (0, 1, torch.float32), (0, 16, torch.float64), (0, 1, torch.bfloat16),
        (1, 16, torch.float32), (1, 1, torch.float64), (1, 16, torch.bfloat16),
        (5, 1, torch.float32), (5, 16, torch.float64), (5, 16, torch.bfloat16),
    ], name_fn=lambda T, align, dtype: f"T_{T}_align_{align}_{str(dtype)[6:]}")
    def test_permute_unpermute_values(self, T, align, dtype):
        E, k, D = 4, 2, 8
        sorted_ids, wts = slots(T, E, k, align, seed=T + align, drop_every=3)
        wts = wts.to(dtype)
        x = torch.randn(T, D, dtype=dtype)

        def f(x, w):
            # + 1 makes the padding rows non-zero: unpermute must not read them
            return ops.unpermute(ops.permute(x, sorted_ids, k) * 2 + 1, sorted_ids, w)

        xe, we = x.clone().requires_grad_(), wts.clone().requires_grad_()
        xc, wc = x.clone().requires_grad_(), wts.clone().requires_grad_()
        ye, yc = f(xe, we), torch.compile(f, fullgraph=True)(xc, wc)
        tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
        self.assertEqual(yc, ye, atol=tol, rtol=tol)
        g = torch.randn_like(ye)
        ye.backward(g)
        yc.backward(g)
        self.assertEqual(xc.grad, xe.grad, atol=tol, rtol=tol)
        self.assertEqual(wc.grad, we.grad, atol=tol, rtol=tol)

    def test_unpermute_accumulates_fp64_in_fp64(self):
        # eager sums fp64 in fp64; a round trip through fp32 loses ~1e-7 relative
        sorted_ids, wts = slots(64, 8, 2, 1, seed=0)
        y = torch.randn(sorted_ids.numel(), 32, dtype=torch.float64) * 1e3
        wts = wts.double()
        out, (code,) = run_and_get_code(torch.compile(ops.unpermute), y, sorted_ids, wts)
        self.assertEqual(out, ops.unpermute(y, sorted_ids, wts), atol=1e-9, rtol=1e-12)
        FileCheck().check_not("convert<float").run(code)

    def test_no_tokens(self):
        # T = 0 with align > 1: every slot is padding and there is no row to read
        sorted_ids, wts = slots(0, 4, 2, 16, seed=0)
        self.assertEqual(sorted_ids.numel(), 4 * 15)
        x = torch.randn(0, 8, requires_grad=True)
        w = wts.requires_grad_()
        f = lambda x, w: ops.unpermute(ops.permute(x, sorted_ids, 2) + 1, sorted_ids, w)
        out, (fw, bw) = run_fw_bw_and_get_code(lambda: torch.compile(f)(x, w).sum())
        self.assertEqual(out, torch.zeros(()))
        self.assertEqual(x.grad, torch.zeros(0, 8))
        FileCheck().check_not("torch.ops.torch_moe").run(fw)
        FileCheck().check_not("torch.ops.torch_moe").run(bw)

    def test_padding_and_dropped_slots_read_no_real_row(self):
        # NaN in token 0 and slot 0, Inf in padding rows; an assignment whose slot is dropped
        # (-1) must get nothing, not 0 * row 0 (NaN). Reference: torch_moe._refs, autograd.
        T, E, k, D = 6, 3, 2, 4
        sorted_ids, wts = slots(T, E, k, 4, seed=0, drop_every=3)
        pad = (sorted_ids < 0).nonzero().flatten()
        x = torch.randn(T, D)
        x[0] = float("nan")
        y = torch.randn(sorted_ids.numel(), D)
        y[0], y[pad] = float("nan"), float("inf")
        grad_y = torch.randn(sorted_ids.numel(), D)
        grad_y[0], grad_y[pad] = float("nan"), float("inf")
        grad_out = torch.randn(T, D)
        grad_out[0] = float("nan")
        cases = [
            (lambda x: ops.permute(x, sorted_ids, k), lambda x: _refs.permute(x, sorted_ids, k),
             [x], grad_y),
            (lambda y, w: ops.unpermute(y, sorted_ids, w),
             lambda y, w: _refs.unpermute(y, sorted_ids, w), [y, wts], grad_out),
        ]
        for f, ref, inputs, grad in cases:
            torch._dynamo.reset()
            ins_c = [t.clone().requires_grad_() for t in inputs]
            ins_r = [t.clone().requires_grad_() for t in inputs]
            # (out * grad).sum() gives out the gradient grad
            out, (fw, bw) = run_fw_bw_and_get_code(lambda: torch.compile(f)(*ins_c) * grad)
            expected = ref(*ins_r)
            (expected * grad).sum().backward()
            self.assertEqual(out, expected * grad)
            for c, r in zip(ins_c, ins_r):
                self.assertEqual(c.grad, r.grad)
            # decomposed, forward and backward: no eager kernel that multiplies row 0 by zero
            FileCheck().check_not("torch.ops.torch_moe").run(fw)
            FileCheck().check_not("torch.ops.torch_moe").run(bw)

    def test_padding_and_dropped_slots_grouped_gemms(self):
        # the grouped GEMMs stay extern calls of the torch_moe kernels; their -1 slots must not
        # read or write a real row either (NaN in token 0, dropped assignments)
        T, E, k, D, F_ = 6, 3, 2, 4, 6
        ids, wts = routing(T, E, k, "uniform", 1)
        sorted_ids, offs, _ = ops.token_sort(ids, E, 4)
        sorted_ids = torch.where(sorted_ids % 3 == 2, -1, sorted_ids)
        x = torch.randn(T, D)
        x[0] = float("nan")
        rows = torch.where(sorted_ids >= 0, sorted_ids // k, -1)
        slot_w = torch.where(sorted_ids >= 0, wts.reshape(-1)[sorted_ids.clamp(min=0)], 0)
        w = torch.randn(E, D, F_)
        w1, w2, w3 = torch.randn(E, D, F_), torch.randn(E, F_, D), torch.randn(E, D, F_)
        cases = [
            (lambda x, w: ops.indexed_grouped_mm(x, w, offs, rows, rows, slot_w, T),
             lambda x, w: _refs.indexed_grouped_mm(x, w, offs, rows, rows, slot_w, T), [x, w]),
            (lambda x, w1, w2, w3, t: ops.grouped_ffn(x, sorted_ids, offs, t, w1, w2, w3)[0],
             lambda x, w1, w2, w3, t: ffn_reference(x, sorted_ids, offs, t, w1, w2, w3),
             [x, w1, w2, w3, wts]),
        ]
        for f, ref, inputs in cases:
            torch._dynamo.reset()
            ins_c = [t.clone().requires_grad_() for t in inputs]
            ins_r = [t.clone().requires_grad_() for t in inputs]
            out_c, out_r = torch.compile(f)(*ins_c), ref(*ins_r)
            self.assertEqual(out_c, out_r, atol=1e-4, rtol=1e-4)
            grad = torch.randn_like(out_r)
            grad[0] = float("nan")
            out_c.backward(grad)
            out_r.backward(grad)
            for c, r in zip(ins_c, ins_r):
                self.assertEqual(c.grad, r.grad, atol=1e-4, rtol=1e-4)

    def test_errors_equal_eager(self):
        # one compiled graph per op; the bad sorted_ids have the shapes of the good ones, so
        # every call below reuses it (no recompilation)
        T, k, D = 6, 2, 4
        good, wts = slots(T, 3, k, 4, seed=0)
        x, y = torch.randn(T, D), torch.randn(good.numel(), D)
        duplicate = good.clone()
        duplicate[(good < 0).nonzero()[0]] = good[0]
        too_large, below = good.clone(), good.clone()
        too_large[1], below[1] = T * k, -2
        unpermute = torch.compile(ops.unpermute, dynamic=False)
        permute = torch.compile(lambda x, s: ops.permute(x, s, k), dynamic=False)
        unpermute_backward = torch.compile(ops.unpermute_backward, dynamic=False)
        for bad in (duplicate, too_large, below):
            with self.assertRaisesRegex(RuntimeError, re.escape(
                    eager_message_head(ops.unpermute, y, bad, wts))):
                unpermute(y, bad, wts)
        for bad in (too_large, below):
            with self.assertRaisesRegex(RuntimeError, re.escape(
                    eager_message_head(ops.permute, x, bad, k))):
                permute(x, bad)
            with self.assertRaisesRegex(RuntimeError, re.escape(
                    eager_message_head(ops.unpermute_backward, x, y, bad, wts, [True, True]))):
                unpermute_backward(x, y, bad, wts, [True, True])
        with self.assertRaisesRegex(RuntimeError, re.escape(
                eager_message_head(ops.permute_backward, y, duplicate, k, T))):
            torch.compile(ops.permute_backward, dynamic=False)(y, duplicate, k, T)
        with self.assertRaisesRegex(RuntimeError, re.escape(
                eager_message_head(ops.permute, x, duplicate, k))):
            permute(x, duplicate)

    def test_token_sort_error_equals_eager(self):
        # an out-of-range expert id is reported by the assert, not by a bounds check of the
        # histogram's scatter or the padding's gather
        ids = torch.tensor([[0, 1], [2, 3]])
        f = torch.compile(lambda ids: ops.token_sort(ids, 3, 4), dynamic=False)
        for bad in (ids, -ids - 1):
            with self.assertRaisesRegex(RuntimeError, re.escape(
                    eager_message_head(ops.token_sort, bad, 3, 4))):
                f(bad)

    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_moe_ffn_no_tokens(self, precision):
        E, D, F_ = 4, 32, 32
        x = torch.randn(0, D, requires_grad=True)
        ids, wts = torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2, requires_grad=True)
        ws = [torch.randn(E, D, F_, requires_grad=True), torch.randn(E, F_, D, requires_grad=True),
              torch.randn(E, D, F_, requires_grad=True)]
        f = lambda x, w, *ws: moe_ffn(x, ids, w, *ws, precision=precision)
        out = torch.compile(f, fullgraph=True)(x, wts, *ws)
        self.assertEqual(out, torch.zeros(0, D))
        out.sum().backward()
        for t in [x, wts, *ws]:
            self.assertEqual(t.grad, torch.zeros_like(t))

    def test_moe_ffn_fp8_rowwise_backward(self):
        # the wgrad quantizers take per-group offsets, which their decomposition leaves to the
        # extern kernel: the backward graph needs that fallback
        T, E, D, F_ = 16, 4, 32, 32
        ids, wts = routing(T, E, 2, "uniform", 4)
        g = torch.Generator().manual_seed(4)
        inputs = [torch.randn(T, D, generator=g), torch.randn(E, D, F_, generator=g) / 8,
                  torch.randn(E, F_, D, generator=g) / 8, torch.randn(E, D, F_, generator=g) / 8]
        f = lambda x, *ws: moe_ffn(x, ids, wts, *ws, precision="fp8_rowwise")
        eager = [t.clone().requires_grad_() for t in inputs]
        compiled = [t.clone().requires_grad_() for t in inputs]
        ye, yc = f(*eager), torch.compile(f, fullgraph=True)(*compiled)
        self.assertEqual(yc, ye, atol=1e-5, rtol=1e-4)
        grad = torch.randn_like(ye)
        ye.backward(grad)
        yc.backward(grad)
        for c, e in zip(compiled, eager):
            self.assertEqual(c.grad, e.grad, atol=1e-4, rtol=1e-4)


_COMPILE_UNPERMUTE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import torch_moe
y = torch.arange(12, dtype=torch.float64).view(6, 2)
f = torch.compile(lambda y, i, w: torch.ops.torch_moe.unpermute(y, i, w))
print(f(y, torch.tensor([0, 2, 1, 3, 5, 4]), torch.ones(3, 2, dtype=torch.float64)).sum().item())
"""


class TestCompileCacheKey(TestCase):
    def test_cache_key_tag_holds_the_source_hash(self):
        import torch._inductor.lowering  # noqa: F401  (torch_moe registers when this loads)
        from torch_moe._inductor import source_hash

        self.assertIn(f"torch_moe:{source_hash()}", torch.compiler.config.cache_key_tag)

    def test_changed_decomposition_misses_the_compile_caches(self):
        # An upgraded torch_moe compiles the same user code again: the AOTAutograd cache keys the
        # graph Dynamo captured, before the decompositions run, so without the source hash in the
        # key the second process would load the first one's code and print its result.
        import os
        import shutil
        import subprocess
        import sys
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            package = os.path.join(tmp, "site")
            shutil.copytree(os.path.dirname(torch_moe.__file__),
                            os.path.join(package, "torch_moe"),
                            ignore=shutil.ignore_patterns("__pycache__"))
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "cache"))

            def compiled_sum():
                out = subprocess.run([sys.executable, "-c", _COMPILE_UNPERMUTE, package], env=env,
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(out.returncode, 0, out.stderr[-2000:])
                return float(out.stdout.split()[-1])

            self.assertEqual(compiled_sum(), 66.0)
            path = os.path.join(package, "torch_moe", "_inductor", "decomposition.py")
            with open(path) as f:
                source = f.read()
            old = "    return (w.unsqueeze(-1) * rows).sum(1).to(y.dtype)"
            self.assertIn(old, source)  # the line this test edits is still there
            with open(path, "w") as f:
                f.write(source.replace(old, old.replace("(w.unsqueeze", "(2 * w.unsqueeze")))
            self.assertEqual(compiled_sum(), 132.0)


instantiate_parametrized_tests(TestCompiledEqualsEagerOps)


if __name__ == "__main__":
    run_tests()
