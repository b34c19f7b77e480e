# Owner(s): ["module: moe"]
"""Property tests of the torch_moe ops against the loop references of ``torch_moe._refs``.

Hypothesis draws T, D, F, E, k, skew (uniform, all tokens on one expert, unused experts), the
alignment, the dtype and contiguity. Examples are bounded and, under CI, derandomised.
"""

import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch.testing._internal.common_utils import IS_CI, TestCase, run_tests

import torch_moe
from torch_moe import _refs
from torch_moe.nn.functional import moe_ffn


def moe_settings(max_examples):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=IS_CI,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@st.composite
def routings(draw, max_tokens=24, max_experts=8):
    T = draw(st.integers(0, max_tokens))
    E = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, E))
    skew = draw(st.sampled_from(["uniform", "one_expert", "unused_experts"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    if skew == "one_expert":
        scores[:, 0] += 2.0  # every token picks expert 0 first
    elif skew == "unused_experts" and E > k:
        unused = torch.randperm(E, generator=g)[: E - k]
        scores[:, unused] -= 2.0  # only k experts ever get tokens
    return T, E, k, scores.topk(k, dim=1).indices, g


def _tensor(shape, dtype, g, noncontiguous=False, scale=1.0):
    if noncontiguous and len(shape) >= 2:
        t = (torch.randn(*shape[:-2], shape[-1], shape[-2], generator=g, dtype=torch.float64)
             * scale).transpose(-2, -1)
    else:
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    return t.to(dtype)


_TOL = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}


class TestProperties(TestCase):
    @moe_settings(60)
    @given(routings(), st.sampled_from([1, 2, 4, 16, 32]))
    def test_token_sort(self, routing, align):
        T, E, k, ids, _ = routing
        sorted_ids, offs, counts = torch_moe.token_sort(ids, E, align)
        ref = _refs.token_sort(ids, E, align)
        self.assertEqual((sorted_ids, offs, counts), ref, atol=0, rtol=0)
        # invariants: every assignment exactly once; group sizes multiples of align
        valid = sorted_ids[sorted_ids >= 0]
        self.assertEqual(valid.sort().values, torch.arange(T * k), atol=0, rtol=0)
        sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
        self.assertTrue(bool((sizes % align == 0).all()))
        self.assertTrue(bool((sizes >= counts).all()))

    @moe_settings(40)
    @given(routings(), st.sampled_from([1, 4]), st.integers(1, 6),
           st.sampled_from([torch.float32, torch.bfloat16]))
    def test_permute_unpermute_roundtrip(self, routing, align, D, dtype):
        # unpermute(permute(x), w) == x * sum_j w[:, j]
        T, E, k, ids, g = routing
        sorted_ids, _, _ = torch_moe.token_sort(ids, E, align)
        x = _tensor((T, D), dtype, g)
        w = torch.rand(T, k, generator=g).to(dtype)
        y = torch_moe.permute(x, sorted_ids, k)
        self.assertEqual(y, _refs.permute(x, sorted_ids, k), atol=0, rtol=0)
        out = torch_moe.unpermute(y, sorted_ids, w)
        self.assertEqual(out, (x.double() * w.double().sum(1, keepdim=True)).to(dtype), **_TOL[dtype])

    @moe_settings(40)
    @given(st.lists(st.integers(0, 6), min_size=1, max_size=6), st.integers(0, 3),
           st.integers(1, 5), st.integers(1, 5), st.sampled_from(["2x3", "3x2", "2x2"]),
           st.booleans(), st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
           st.integers(0, 2**16))
    def test_grouped_mm(self, sizes, tail, K, N, layout, noncontiguous, dtype, seed):
        g = torch.Generator().manual_seed(seed)
        G, M = len(sizes), sum(sizes) + tail
        offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
        a_shape, b_shape = {
            "2x3": ((M, K), (G, K, N)), "3x2": ((G, N, K), (K, M)), "2x2": ((N, M), (M, K)),
        }[layout]
        a = _tensor(a_shape, dtype, g, noncontiguous).requires_grad_()
        b = _tensor(b_shape, dtype, g, noncontiguous).requires_grad_()
        out = torch_moe.grouped_mm(a, b, offs)
        a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
        ref = _refs.grouped_mm(a64, b64, offs)
        self.assertEqual(out, ref.to(dtype), **_TOL[dtype])
        grad = _tensor(out.shape, dtype, g)
        ga, gb = torch.autograd.grad(out, (a, b), grad)
        ra = rb = None  # a reference with no rows does not depend on its inputs
        if ref.requires_grad:
            ra, rb = torch.autograd.grad(ref, (a64, b64), grad.double(), allow_unused=True)
        self.assertEqual(ga, (ra if ra is not None else torch.zeros_like(a64)).to(dtype), **_TOL[dtype])
        self.assertEqual(gb, (rb if rb is not None else torch.zeros_like(b64)).to(dtype), **_TOL[dtype])

    @moe_settings(30)
    @given(routings(max_tokens=12, max_experts=6), st.integers(1, 6), st.integers(1, 5),
           st.sampled_from(["swiglu", "geglu", "swiglu_oai", "gelu", "relu"]),
           st.booleans(), st.booleans(),
           st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    def test_moe_ffn(self, routing, D, F, activation, fused, noncontiguous, dtype):
        T, E, k, ids, g = routing
        gated = activation in ("swiglu", "geglu", "swiglu_oai")
        x = _tensor((T, D), dtype, g, noncontiguous).requires_grad_()
        w = torch.rand(T, k, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        up_width = 2 * F if (gated and fused) else F
        w1 = _tensor((E, D, up_width), dtype, g, noncontiguous, D**-0.5).requires_grad_()
        w2 = _tensor((E, F, D), dtype, g, noncontiguous, F**-0.5).requires_grad_()
        w3 = (_tensor((E, D, F), dtype, g, noncontiguous, D**-0.5).requires_grad_()
              if gated and not fused else None)
        leaves = [t for t in (x, w, w1, w2, w3) if t is not None]
        out = moe_ffn(x, ids, w, w1, w2, w3, activation=activation, limit=1.5)
        ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
        rx, rw, r1, r2, *r3 = ref_leaves
        ref = _refs.moe_ffn(rx, ids, rw, r1, r2, r3[0] if r3 else None,
                            activation_kind=activation, limit=1.5)
        self.assertEqual(out, ref.to(dtype), **_TOL[dtype])
        if T == 0:
            return
        grad = _tensor(out.shape, dtype, g)
        grads = torch.autograd.grad(out, leaves, grad)
        ref_grads = torch.autograd.grad(ref, ref_leaves, grad.double(), allow_unused=True)
        for got, expected, leaf in zip(grads, ref_grads, ref_leaves):
            expected = expected if expected is not None else torch.zeros_like(leaf)
            self.assertEqual(got, expected.to(dtype), **_TOL[dtype])


if __name__ == "__main__":
    run_tests()
