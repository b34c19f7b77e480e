# Owner(s): ["module: moe"]
"""Property tests of the FP8 / MXFP8 quantizers against the scalar references of
``torch_moe._refs.quantization`` and against the algebra of the formats.

Inputs are drawn as raw fp32 values over the whole range (zeros, subnormals, huge values and,
where stated, Inf / NaN), one magnitude per block so that blocks of very different scales meet
in one tensor. Examples are bounded and, under CI, derandomised.
"""

import math

import torch
from hypothesis import given, strategies as st
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401
from torch_moe import _refs
from torch_moe._refs import quantization as qref
from torch_moe.quantization import _formats

from test_properties import moe_settings as qsettings  # one hypothesis profile for the suite

ops = torch.ops.torch_moe
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_CODES = (0x7F, 0xFF)


@st.composite
def blocked_tensors(draw, allow_non_finite=False, max_rows=3, max_blocks=2):
    """[R, 32 * nb] fp32 (or bf16) with a random binade per block."""
    R = draw(st.integers(1, max_rows))
    nb = draw(st.integers(1, max_blocks))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, nb, 32, generator=g, dtype=torch.float64)
    exps = torch.tensor(draw(st.lists(st.integers(-140, 120), min_size=R * nb, max_size=R * nb)))
    x = (x * torch.pow(2.0, exps.double()).view(R, nb, 1)).clamp(-3e38, 3e38)
    x = x.view(R, nb * 32).float()
    if draw(st.booleans()):
        x[torch.rand(x.shape, generator=g) < 0.2] = 0.0
    if allow_non_finite and draw(st.booleans()):
        special = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = special
    if draw(st.booleans()):
        x = x.bfloat16()
    return x


def normalise_nan(codes):
    return [[0x7F if c in NAN_CODES else c for c in row] for row in codes]


class TestQuantizerProperties(TestCase):
    @qsettings(40)
    @given(blocked_tensors(allow_non_finite=True), st.sampled_from([E4M3, E5M2]),
           st.sampled_from(["rceil", "floor"]))
    def test_mxfp8_matches_scalar_reference(self, x, elem, mode):
        data, scale = ops.quantize_mxfp8(x, -1, elem, mode)
        ref_data, ref_scale = qref.quantize_mxfp8(x, elem, mode)
        self.assertEqual(scale.tolist(), ref_scale)
        got = normalise_nan(data.view(torch.uint8).tolist())
        if elem == E5M2:  # E5M2 NaNs have several encodings: compare decoded NaN-ness
            got = [[0x7F if math.isnan(v) else c for c, v in zip(row_c, row_v)]
                   for row_c, row_v in zip(data.view(torch.uint8).tolist(), data.float().tolist())]
        self.assertEqual(got, normalise_nan(ref_data))

    @qsettings(60)
    @given(blocked_tensors(), st.sampled_from(["rceil", "floor"]))
    def test_mxfp8_dequantize_error_per_block(self, x, mode):
        # |x - dq(q(x))| <= half an E4M3 ulp of the element (relative 2**-4 for normals,
        # 2**-10 * X for subnormals) ... plus, in FLOOR mode only, the saturation of the block
        # maximum to 448 * X.
        data, scale = ops.quantize_mxfp8(x, -1, E4M3, mode)
        back = ops.dequantize_mxfp8(data, scale, -1).double()
        xd = x.double()
        X = _formats.e8m0_to_float(scale).double().repeat_interleave(32, dim=-1)
        bound = torch.maximum(xd.abs() * 2.0**-4, X * 2.0**-10)
        if mode == "floor":
            bound = torch.maximum(bound, xd.abs() - 448 * X)
        else:
            # RCEIL never clips: every element fits 448 times its block scale
            finite = torch.isfinite(xd)
            self.assertTrue((xd.abs() <= 448 * X)[finite].all())
        self.assertTrue(((back - xd).abs() <= bound).all())

    @qsettings(60)
    @given(blocked_tensors())
    def test_floor_rceil_relation(self, x):
        # RCEIL = FLOOR + 1 exactly when the block amax has a mantissa above 1.75 (where FLOOR
        # saturates), for every amax >= 2**-118 (below, RCEIL's d is subnormal and both give 0)
        _, floor = ops.quantize_mxfp8(x, -1, E4M3, "floor")
        _, rceil = ops.quantize_mxfp8(x, -1, E4M3, "rceil")
        amax = x.float().abs().view(x.size(0), -1, 32).amax(-1)
        mant = amax.view(torch.int32) & 0x7FFFFF
        expected = floor.int() + (mant > 0x600000).int()
        big = amax >= 2.0**-118
        self.assertEqual(rceil.int()[big], expected[big])
        self.assertTrue((rceil.int() - floor.int()).abs().max() <= 1)

    @qsettings(60)
    @given(blocked_tensors(), st.sampled_from([E4M3, E5M2]), st.sampled_from(["rceil", "floor"]))
    def test_idempotent_on_representable_values(self, x, elem, mode):
        # A dequantized tensor is representable: quantizing it again reproduces its values
        # exactly. FLOOR also reproduces the bytes. RCEIL does too, except for a block whose
        # maximum rounded down to exactly max_normal / 2 (e.g. 225 -> 224 in E4M3): that block
        # now fits the next smaller scale, with every element doubled.
        data, scale = ops.quantize_mxfp8(x, -1, elem, mode)
        back = ops.dequantize_mxfp8(data, scale, -1)
        if not torch.isfinite(back).all():
            return  # RCEIL of fp32 max overflows fp32 on dequantization (2**128)
        data2, scale2 = ops.quantize_mxfp8(back, -1, elem, mode)
        self.assertEqual(ops.dequantize_mxfp8(data2, scale2, -1), back, atol=0, rtol=0)
        same = scale2 == scale
        if mode == "floor":
            self.assertTrue(same.all())
        else:
            half_max = _formats.max_normal(elem) / 2
            block_max = data.float().abs().view(*scale.shape, 32).amax(-1)
            self.assertTrue((same | ((scale2 == scale - 1) & (block_max == half_max))).all())
        same_bytes = same.repeat_interleave(32, dim=-1)
        self.assertEqual(data2.view(torch.uint8)[same_bytes], data.view(torch.uint8)[same_bytes])

    @qsettings(40)
    @given(blocked_tensors(allow_non_finite=True, max_blocks=1))
    def test_fp8_rowwise_matches_scalar_reference(self, x):
        data, scale = ops.quantize_fp8_rowwise(x)
        ref_data, ref_scale = qref.quantize_fp8_rowwise(x)
        self.assertEqual(scale.flatten().tolist(), ref_scale, equal_nan=True)
        self.assertEqual(normalise_nan(data.view(torch.uint8).tolist()), normalise_nan(ref_data))

    @qsettings(30)
    @given(st.integers(0, 2**16), st.lists(st.integers(0, 3), min_size=1, max_size=4),
           st.sampled_from(["mxfp8", "fp8_rowwise"]), st.booleans())
    def test_scaled_grouped_mm_against_reference(self, seed, blocks, recipe, wgrad_layout):
        # the emulated GEMM equals the loop reference on the dequantized operands
        g = torch.Generator().manual_seed(seed)
        sizes = [32 * b for b in blocks]
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
        M, K, N, G = sum(sizes) + 32, 32, 32, len(sizes)
        quant = ((lambda t, d: ops.quantize_mxfp8(t, d)) if recipe == "mxfp8"
                 else (lambda t, d, o=None: ops.quantize_fp8_rowwise(t, d, o)))
        if not wgrad_layout:
            a, b = torch.randn(M, K, generator=g), torch.randn(G, K, N, generator=g)
            (qa, sa), (qb, sb) = quant(a, 1), quant(b, 1)
            out = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, torch.float32)
            if recipe == "mxfp8":
                da, db = ops.dequantize_mxfp8(qa, sa, 1), ops.dequantize_mxfp8(qb, sb, 1)
            else:
                da, db = qa.float() * sa, qb.float() * sb
            ref = _refs.grouped_mm(da.double(), db.double(), offs)
        else:
            x, dy = torch.randn(M - 32, K, generator=g), torch.randn(M - 32, N, generator=g)
            if recipe == "mxfp8":
                (qx, sx), (qy, sy) = quant(x, 0), quant(dy, 0)
                dx, ddy = ops.dequantize_mxfp8(qx, sx, 0), ops.dequantize_mxfp8(qy, sy, 0)
            else:
                (qx, sx), (qy, sy) = quant(x, 0, offs), quant(dy, 0, offs)
                dx = ops.dequantize_fp8_rowwise(qx, sx, 0, offs)
                ddy = ops.dequantize_fp8_rowwise(qy, sy, 0, offs)
            out = ops.scaled_grouped_mm(qx.t(), qy, sx.t(), sy, offs, torch.float32)
            ref = _refs.grouped_mm(dx.t().double(), ddy.double(), offs)
        self.assertEqual(out, ref.float(), atol=1e-3, rtol=1e-5)


if __name__ == "__main__":
    run_tests()
