# Owner(s): ["module: moe"]
"""FP8 rowwise and MXFP8: quantizers bit-exact on the boundary cases of the formats, the 128x4
scale swizzle, the emulated scaled grouped GEMM, the trainable quantized grouped GEMM (SQNR
of each of its three GEMMs against the high-precision result) and the quantized MoE layer.

Byte values below are worked out by hand from the OCP MX v1.0 rules (FLOOR:
``b = clamp(exponent(amax) - emax_elem, 0, 254)``; RCEIL: ``b`` = the smallest power of two not
below ``fl32(amax * fl32(1 / max_normal))``; data = RNE(x * 2**(127 - b)), saturated), and the
comment on each test shows the arithmetic.
"""

import struct
import unittest

import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import TestCase, instantiate_parametrized_tests, parametrize, run_tests

import torch_moe
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.functional import moe_ffn
from torch_moe.quantization import _formats

ops = torch.ops.torch_moe
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
NAN_CODES = {0x7F, 0xFF}  # the two NaN encodings of E4M3 (and the ones E5M2 uses here)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


def block_with(value: float, dtype=torch.float32, others: float = 0.0) -> torch.Tensor:
    """One MX block (32 elements) whose first element is ``value``."""
    x = torch.full((32,), others, dtype=torch.float32)
    x[0] = value
    return x.to(dtype)


class TestMXFP8Boundaries(TestCase):
    """(scale byte, first data byte) of a block, in both scale modes."""

    def q(self, value, mode, dtype=torch.float32, elem=E4M3, others=0.0):
        data, scale = ops.quantize_mxfp8(block_with(value, dtype, others), -1, elem, mode)
        return int(scale[0]), int(data.view(torch.uint8)[0])

    def both(self, value, floor, rceil, **kw):
        self.assertEqual(self.q(value, "floor", **kw), floor)
        self.assertEqual(self.q(value, "rceil", **kw), rceil)

    def test_zero_block(self):
        # amax = 0: the smallest scale, 2**-127, and +0 elements
        self.both(0.0, (0, 0x00), (0, 0x00))
        data, _ = ops.quantize_mxfp8(torch.zeros(2, 64))
        self.assertTrue((data.view(torch.uint8) == 0).all())

    def test_fp8_max(self):
        # 448 = 1.75 * 2**8: FLOOR 8 + 127 - 8 = 127; RCEIL 448 / 448 = 1 -> 127; 448 -> 0x7E
        self.both(448.0, (127, 0x7E), (127, 0x7E))

    def test_above_fp8_max_saturates_in_floor_only(self):
        # 480: FLOOR keeps 2**0 and saturates 480 -> 448 (0x7E); RCEIL 480/448 > 1 -> 2**1,
        # 240 = 1.875 * 2**7 -> 0x77
        self.both(480.0, (127, 0x7E), (128, 0x77))

    def test_mantissa_above_1_75(self):
        # 0x43FFFFFF = 511.99997: FLOOR 2**0, saturated to 448; RCEIL 2**1, 255.99998 rounds to 256
        # = 2**8 -> 0x78
        self.both(f32(0x43FFFFFF), (127, 0x7E), (128, 0x78))

    def test_fp32_max(self):
        # 2**127 * (2 - 2**-23): FLOOR 254 - 8 = 246, element 511.99 saturates; RCEIL
        # fl32(max / 448) = 2**119.19 -> 2**120 -> 247, element 256 -> 0x78
        self.both(torch.finfo(torch.float32).max, (246, 0x7E), (247, 0x78))

    def test_rceil_one_ulp_above_power_of_two_ratio(self):
        # 3.5 + 1 ulp: d = 3.5000002 / 448 = 2**-7 * (1 + eps) rounds up to 2**-6 (121);
        # 3.5000002 * 64 = 224.00002 -> 224 = 1.75 * 2**7 -> 0x76. FLOOR: 2**(1 - 8) = 120,
        # 448.00003 -> 448 (0x7E). (An fp32 ceil(log2(d)) gets 120 here and saturates.)
        self.both(f32(0x40600001), (120, 0x7E), (121, 0x76))

    def test_smallest_normal(self):
        # 2**-126: FLOOR clamps 1 - 8 to 0; RCEIL d < 2**-127 -> 0; 2**-126 * 2**127 = 2 -> 0x40
        self.both(2.0**-126, (0, 0x40), (0, 0x40))

    def test_bf16_smallest_subnormal(self):
        # 2**-133 (bf16 subnormal) * 2**127 = 2**-6, the smallest E4M3 normal -> 0x08
        self.both(2.0**-133, (0, 0x08), (0, 0x08), dtype=torch.bfloat16)

    def test_fp32_smallest_subnormal(self):
        # 2**-149 * 2**127 = 2**-22 rounds to +0
        self.both(2.0**-149, (0, 0x00), (0, 0x00))

    def test_e4m3_subnormal_elements(self):
        # with 448 in the block (scale 2**0): 2**-8 = 2 * 2**-9 -> 0x02; 2**-10 is a tie between
        # 0 and 2**-9 and rounds to even (0); 3 * 2**-10 ties to 2 * 2**-9 -> 0x02
        x = torch.zeros(32)
        x[0], x[1], x[2], x[3] = 448.0, 2.0**-8, 2.0**-10, 3 * 2.0**-10
        for mode in ("floor", "rceil"):
            data, scale = ops.quantize_mxfp8(x, -1, E4M3, mode)
            self.assertEqual(int(scale[0]), 127)
            self.assertEqual(data.view(torch.uint8)[:4].tolist(), [0x7E, 0x02, 0x00, 0x02])

    def test_negative_values_keep_sign(self):
        self.both(-448.0, (127, 0xFE), (127, 0xFE))
        self.both(-480.0, (127, 0xFE), (128, 0xF7))

    def test_block_with_inf_is_nan(self):
        # any Inf in a block: scale 255 (NaN) and every element NaN
        for value in (float("inf"), float("-inf")):
            for mode in ("floor", "rceil"):
                data, scale = ops.quantize_mxfp8(block_with(value, others=1.0), -1, E4M3, mode)
                self.assertEqual(int(scale[0]), 255)
                self.assertTrue(set(data.view(torch.uint8).tolist()) <= NAN_CODES)

    def test_block_with_nan_is_nan(self):
        x = torch.randn(2, 64)
        x[1, 33] = float("nan")
        for mode in ("floor", "rceil"):
            data, scale = ops.quantize_mxfp8(x, -1, E4M3, mode)
            self.assertEqual(scale.tolist()[1][1], 255)
            self.assertTrue(set(data.view(torch.uint8)[1, 32:].tolist()) <= NAN_CODES)
            # the other blocks are untouched
            self.assertTrue(torch.isfinite(data[:, :32].float()).all())
            self.assertTrue(torch.isfinite(data[0].float()).all())

    def test_e5m2_max_and_saturation(self):
        # E5M2: emax 15, max 57344 = 1.75 * 2**15 (0x7B). 60000: FLOOR 2**0 saturates; RCEIL
        # 2**1, 30000 rounds to 28672 = 1.75 * 2**14 -> 0x77
        self.both(57344.0, (127, 0x7B), (127, 0x7B), elem=E5M2)
        self.both(60000.0, (127, 0x7B), (128, 0x77), elem=E5M2)

    def test_rceil_byte_rule_on_descale_bits(self):
        # round-up of d to a power of two, from d's fp32 bits: subnormal d <= 2**-127 -> 0,
        # just above -> 1; normal d with a non-zero mantissa -> exponent + 1; past 2**127 -> 255
        for bits, byte in [(0x00000000, 0), (0x00400000, 0), (0x00400001, 1), (0x00800000, 1),
                           (0x1F800000, 63), (0x1F800001, 64), (0x7F000000, 254),
                           (0x7F000001, 255)]:
            d = torch.tensor([bits], dtype=torch.int32).view(torch.float32)
            self.assertEqual(int(_formats.round_up_to_e8m0(d)), byte, msg=hex(bits))

    def test_blocks_along_other_dims(self):
        # blocks along dim 0 (columnwise) equal blocks along the last dim of the transpose
        x = torch.randn(64, 48, dtype=torch.bfloat16) * 10
        for mode in ("floor", "rceil"):
            d0, s0 = ops.quantize_mxfp8(x, 0, E4M3, mode)
            d1, s1 = ops.quantize_mxfp8(x.t().contiguous(), -1, E4M3, mode)
            self.assertEqual(d0.view(torch.uint8).t(), d1.view(torch.uint8))
            self.assertEqual(s0.t(), s1)
            w = torch.randn(3, 64, 32)
            d, s = ops.quantize_mxfp8(w, 1, E4M3, mode)
            self.assertEqual(s.shape, (3, 2, 32))
            dt, st = ops.quantize_mxfp8(w.transpose(1, 2).contiguous(), -1, E4M3, mode)
            self.assertEqual(d.view(torch.uint8), dt.view(torch.uint8).transpose(1, 2))

    def test_matches_scalar_reference(self):
        from torch_moe._refs import quantization as ref

        g = torch.Generator().manual_seed(0)
        x = torch.randn(6, 64, generator=g) * torch.tensor([1e-40, 1e-3, 1, 300, 1e30, 1])[:, None]
        x[5, 3], x[5, 40] = 480.0, 2.0**-133
        for elem in (E4M3, E5M2):
            for mode in ("floor", "rceil"):
                data, scale = ops.quantize_mxfp8(x, -1, elem, mode)
                ref_data, ref_scale = ref.quantize_mxfp8(x, elem, mode)
                self.assertEqual(data.view(torch.uint8).tolist(), ref_data)
                self.assertEqual(scale.tolist(), ref_scale)


class TestDequantize(TestCase):
    def test_e8m0_values(self):
        b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
        v = _formats.e8m0_to_float(b)
        self.assertEqual(v[:6].tolist(), [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127])
        self.assertTrue(torch.isnan(v[6]))
        # the same as torch's exact e8m0 -> fp32 conversion
        self.assertEqual(v, b.view(torch.float8_e8m0fnu).float(), equal_nan=True)

    def test_round_trip_of_representable_values(self):
        # P * 2**k with P an E4M3 value and a block max of 448 * 2**k is reproduced exactly
        p = torch.arange(0, 96, dtype=torch.uint8).view(E4M3).float()
        p[::32] = 448.0
        x = torch.stack([p * 2.0**k for k in (-20, 0, 30)])
        for mode in ("floor", "rceil"):
            data, scale = ops.quantize_mxfp8(x, -1, E4M3, mode)
            self.assertEqual(ops.dequantize_mxfp8(data, scale, -1), x, atol=0, rtol=0)

    def test_nan_scale_dequantizes_to_nan(self):
        data = torch.ones(1, 32).to(E4M3)
        scale = torch.tensor([[255]], dtype=torch.uint8)
        self.assertTrue(torch.isnan(ops.dequantize_mxfp8(data, scale)).all())

    def test_rceil_overflow_of_fp32_max(self):
        # RCEIL on +-fp32 max gives 256 * 2**120 = 2**128, which dequantizes to inf in fp32
        data, scale = ops.quantize_mxfp8(block_with(torch.finfo(torch.float32).max).view(1, 32))
        self.assertEqual(ops.dequantize_mxfp8(data, scale)[0, 0].item(), float("inf"))

    def test_dequantize_accepts_e8m0_dtype(self):
        x = torch.randn(4, 64)
        data, scale = ops.quantize_mxfp8(x)
        self.assertEqual(
            ops.dequantize_mxfp8(data, scale.view(torch.float8_e8m0fnu), -1, torch.bfloat16),
            ops.dequantize_mxfp8(data, scale, -1, torch.bfloat16),
        )


class TestFP8Rowwise(TestCase):
    def test_power_of_two_scales(self):
        x = torch.tensor([[448.0, 1.0], [449.0, -3.0], [1e-3, 0.0], [0.0, 0.0]])
        data, scale = ops.quantize_fp8_rowwise(x)
        self.assertEqual(scale.shape, (4, 1))
        # 448 -> 1; 449 -> 2 (no saturation: |data| <= 448); 1e-3 / 448 ~ 2**-18.8 -> 2**-18
        # (1e-3 * 2**18 = 262.1 -> 256 = 0x78);
        # an all-zero row keeps the smallest normal scale
        self.assertEqual(scale.flatten().tolist(), [1.0, 2.0, 2.0**-18, 2.0**-126])
        self.assertEqual(data.view(torch.uint8)[:, 0].tolist(), [0x7E, 0x76, 0x78, 0x00])

    def test_matches_scalar_reference(self):
        from torch_moe._refs import quantization as ref

        x = torch.randn(5, 40) * torch.tensor([1e-30, 1e-3, 1.0, 700.0, 1e30])[:, None]
        data, scale = ops.quantize_fp8_rowwise(x)
        ref_data, ref_scale = ref.quantize_fp8_rowwise(x)
        self.assertEqual(data.view(torch.uint8).tolist(), ref_data)
        self.assertEqual(scale.flatten().tolist(), ref_scale)

    def test_columnwise_and_per_group(self):
        x = torch.randn(48, 8, dtype=torch.bfloat16)
        data, scale = ops.quantize_fp8_rowwise(x, 0)
        self.assertEqual(scale.shape, (1, 8))
        dt, st = ops.quantize_fp8_rowwise(x.t().contiguous(), -1)
        self.assertEqual(data.view(torch.uint8), dt.view(torch.uint8).t())
        # groups of rows: [0, 16), [16, 16) (empty), [16, 48); rows past offs[-1] give 0
        offs = i32(16, 16, 40)
        data, scale = ops.quantize_fp8_rowwise(x, 0, offs)
        self.assertEqual(scale.shape, (3, 8))
        for g, (s, e) in enumerate([(0, 16), (16, 16), (16, 40)]):
            if e > s:
                dg, sg = ops.quantize_fp8_rowwise(x[s:e], 0)
                self.assertEqual(data[s:e].view(torch.uint8), dg.view(torch.uint8))
                self.assertEqual(scale[g], sg[0])
        self.assertEqual(scale[1], torch.full((8,), 2.0**-126))  # empty group
        self.assertEqual(data[40:].float(), torch.zeros(8, 8))
        back = ops.dequantize_fp8_rowwise(data, scale, 0, offs)
        self.assertEqual(back[:40], x[:40].float(), atol=0, rtol=2**-4)
        self.assertEqual(back[40:], torch.zeros(8, 8))

    def test_non_finite_row_is_nan(self):
        x = torch.ones(3, 16)
        x[1, 2] = float("inf")
        data, scale = ops.quantize_fp8_rowwise(x)
        self.assertTrue(torch.isnan(scale[1]).all())
        self.assertTrue(set(data[1].view(torch.uint8).tolist()) <= NAN_CODES)
        self.assertEqual(scale[[0, 2]].flatten().tolist(), [2.0**-8, 2.0**-8])


class TestSwizzle(TestCase):
    def test_layout_formula(self):
        for R, C in [(128, 4), (200, 7), (5, 1), (300, 9)]:
            s = torch.randint(0, 255, (R, C), dtype=torch.uint8)
            out = ops.swizzle_mx_scale(s)
            Rp, Cp = -(-R // 128) * 128, -(-C // 4) * 4
            self.assertEqual(out.shape, (Rp * Cp,))
            expected = torch.zeros(Rp * Cp, dtype=torch.uint8)
            for r in range(R):
                for c in range(C):
                    offset = ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 \
                        + ((r % 128) // 32) * 4 + c % 4
                    expected[offset] = s[r, c]
            self.assertEqual(out, expected)
            self.assertEqual(ops.unswizzle_mx_scale(out, R, C), s)

    def test_batched_per_expert(self):
        s = torch.randint(0, 255, (3, 96, 6), dtype=torch.uint8)
        out = ops.swizzle_mx_scale(s)
        self.assertEqual(out.shape, (3, 128 * 8))
        for e in range(3):
            self.assertEqual(out[e], ops.swizzle_mx_scale(s[e]))
        self.assertEqual(ops.unswizzle_mx_scale(out, 96, 6), s)


# SchemaCheckMode (opcheck's test_schema) compares inputs with torch.allclose, which has no
# CPU kernel for float8 dtypes in torch 2.13; ops that take FP8 tensors are checked for input
# mutation by comparing bytes instead.
_NO_SCHEMA = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def opcheck_fp8(test, op, args):
    before = [a.view(torch.uint8).clone() if isinstance(a, torch.Tensor) and a.element_size() == 1
              else (a.detach().clone() if isinstance(a, torch.Tensor) else None) for a in args]
    torch.library.opcheck(op, args, test_utils=_NO_SCHEMA)
    op(*args)
    for a, b in zip(args, before):
        if b is not None:
            test.assertEqual(a.view(torch.uint8) if a.element_size() == 1 else a.detach(), b,
                             atol=0, rtol=0, exact_dtype=True)


def _groups_ends(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


@instantiate_parametrized_tests
class TestScaledGroupedMM(TestCase):
    @parametrize("recipe", ["mxfp8", "fp8_rowwise"])
    def test_emulation_is_exact_2d_3d(self, recipe):
        g = torch.Generator().manual_seed(0)
        M, K, N = 128, 64, 48
        offs = _groups_ends([32, 0, 64])  # rows 96.. belong to no group
        a = torch.randn(M, K, generator=g)
        b = torch.randn(3, K, N, generator=g)
        if recipe == "mxfp8":
            qa, sa = ops.quantize_mxfp8(a, 1)
            qb, sb = ops.quantize_mxfp8(b, 1)
            da, db = ops.dequantize_mxfp8(qa, sa, 1), ops.dequantize_mxfp8(qb, sb, 1)
        else:
            qa, sa = ops.quantize_fp8_rowwise(a, 1)
            qb, sb = ops.quantize_fp8_rowwise(b, 1)
            da, db = ops.dequantize_fp8_rowwise(qa, sa, 1), ops.dequantize_fp8_rowwise(qb, sb, 1)
        for out_dtype in (torch.float32, torch.bfloat16):
            out = ops.scaled_grouped_mm(qa, qb, sa, sb, offs, out_dtype)
            ref = torch.zeros(M, N, dtype=torch.float64)
            ref[:32] = da[:32].double() @ db[0].double()
            ref[32:96] = da[32:96].double() @ db[2].double()
            # fp32 accumulation, one rounding to out_dtype
            self.assertEqual(out, ref.to(out_dtype), atol=1e-4 if out_dtype == torch.float32 else 0,
                             rtol=1e-5 if out_dtype == torch.float32 else 2**-8)
            self.assertEqual(out[96:], torch.zeros(32, N, dtype=out_dtype))

    @parametrize("recipe", ["mxfp8", "fp8_rowwise"])
    def test_emulation_2d_2d_per_group(self, recipe):
        g = torch.Generator().manual_seed(1)
        K, M, N = 16, 96, 24
        offs = _groups_ends([32, 0, 64])
        x = torch.randn(M, K, generator=g)
        dy = torch.randn(M, N, generator=g)
        if recipe == "mxfp8":
            qx, sx = ops.quantize_mxfp8(x, 0)
            qy, sy = ops.quantize_mxfp8(dy, 0)
        else:
            qx, sx = ops.quantize_fp8_rowwise(x, 0, offs)
            qy, sy = ops.quantize_fp8_rowwise(dy, 0, offs)
        out = ops.scaled_grouped_mm(qx.t(), qy, sx.t(), sy, offs, torch.float32)
        self.assertEqual(out.shape, (3, K, N))
        self.assertEqual(out[1], torch.zeros(K, N))
        for gi, (s, e) in ((0, (0, 32)), (2, (32, 96))):
            if recipe == "mxfp8":
                dx = ops.dequantize_mxfp8(qx[s:e], sx[s // 32:e // 32], 0)
                ddy = ops.dequantize_mxfp8(qy[s:e], sy[s // 32:e // 32], 0)
            else:
                dx = qx[s:e].float() * sx[gi]
                ddy = qy[s:e].float() * sy[gi]
            self.assertEqual(out[gi], dx.t() @ ddy, atol=1e-4, rtol=1e-5)


@instantiate_parametrized_tests
class TestQuantizedGroupedMM(TestCase):
    """SQNR of each GEMM against the same GEMM on the bf16 operands (fp32 accumulation).

    Thresholds: MXFP8 RCEIL >= 28 dB; FP8 rowwise >= 28 dB; MXFP8 FLOOR >= 27 dB (torchao's
    emulated MXFP8 grouped GEMM measures 28.4 / 28.5 / 28.4 dB RCEIL and 27.5 / 27.3 / 27.7 dB
    FLOOR on the same kind of inputs).
    """

    def _run(self, recipe, mode, wgrad_hp=False):
        g = torch.Generator().manual_seed(0)
        M, K, N, E = 256, 128, 96, 4
        offs = _groups_ends([64, 32, 0, 128])  # 224 rows in groups, 32 padding rows after
        x = torch.randn(M, K, generator=g).bfloat16().requires_grad_()
        w = (torch.randn(E, K, N, generator=g) / K**0.5).bfloat16().requires_grad_()
        dy = torch.randn(M, N, generator=g).bfloat16()
        out = ops.quantized_grouped_mm(x, w, offs, recipe, mode, wgrad_hp)
        out.backward(dy)
        xr = x.detach().float().requires_grad_()
        wr = w.detach().float().requires_grad_()
        ref = torch_moe.grouped_mm(xr, wr, offs)
        ref.backward(dy.float())
        return (out, x.grad, w.grad), (ref, xr.grad, wr.grad)

    @parametrize("recipe,mode,threshold", [
        ("mxfp8", "rceil", 28.0), ("mxfp8", "floor", 27.0), ("fp8_rowwise", "rceil", 28.0),
    ])
    def test_sqnr_of_each_gemm(self, recipe, mode, threshold):
        got, ref = self._run(recipe, mode)
        self.assertEqual(got[0].dtype, torch.bfloat16)
        for name, a, r in zip(("forward", "grad_input", "grad_weight"), got, ref):
            self.assertGreaterEqual(sqnr(r, a), threshold, msg=f"{recipe}/{mode} {name}")
        # padding rows past offs[-1] neither produce output nor gradient
        self.assertEqual(got[0][224:].float().abs().sum().item(), 0.0)
        self.assertEqual(got[1][224:].float().abs().sum().item(), 0.0)

    @parametrize("recipe", ["mxfp8", "fp8_rowwise"])
    def test_wgrad_high_precision(self, recipe):
        got, ref = self._run(recipe, "rceil", wgrad_hp=True)
        # the weight gradient is the bf16 grouped GEMM of the unquantized operands
        self.assertEqual(got[2], ref[2].bfloat16(), atol=0, rtol=2**-7)
        self.assertGreaterEqual(sqnr(ref[2], got[2]), 45.0)

    def test_rceil_beats_floor(self):
        rceil, ref = self._run("mxfp8", "rceil")
        floor, _ = self._run("mxfp8", "floor")
        self.assertGreater(sqnr(ref[0], rceil[0]), sqnr(ref[0], floor[0]))

    @parametrize("recipe", ["mxfp8", "fp8_rowwise"])
    def test_opcheck(self, recipe):
        g = torch.Generator().manual_seed(0)
        offs = _groups_ends([32, 0, 64])
        x = torch.randn(128, 64, generator=g, requires_grad=True)
        w = torch.randn(3, 64, 32, generator=g, requires_grad=True)
        opcheck_fp8(self, ops.quantized_grouped_mm, (x, w, offs, recipe, "rceil", False))
        qa, sa = (ops.quantize_mxfp8(x.detach(), 1) if recipe == "mxfp8"
                  else ops.quantize_fp8_rowwise(x.detach(), 1))
        qb, sb = (ops.quantize_mxfp8(w.detach(), 1) if recipe == "mxfp8"
                  else ops.quantize_fp8_rowwise(w.detach(), 1))
        opcheck_fp8(self, ops.scaled_grouped_mm, (qa, qb, sa, sb, offs, torch.bfloat16))

    @parametrize("recipe", ["mxfp8", "fp8_rowwise"])
    def test_each_gemm_is_the_documented_composition(self, recipe):
        # Bit for bit: every GEMM equals the fp32 grouped GEMM of its operands quantized along
        # that GEMM's contraction dim and dequantized, rounded once. A wrong quantization axis
        # changes the SQNR too little to be seen; this sees it.
        g = torch.Generator().manual_seed(0)
        M, K, N, E = 224, 64, 96, 3
        offs = _groups_ends([64, 0, 128])  # 32 rows past offs[-1]
        # weights whose magnitude varies along K and along N, so blocks along one or the
        # other differ
        w = (torch.randn(E, K, N, generator=g) * torch.logspace(-2, 2, K)[:, None]
             * torch.logspace(2, -2, N)).bfloat16().requires_grad_()
        x = torch.randn(M, K, generator=g).bfloat16().requires_grad_()
        dy = torch.randn(M, N, generator=g).bfloat16()
        out = ops.quantized_grouped_mm(x, w, offs, recipe, "rceil", False)
        out.backward(dy)

        def qdq(t, dim, offs=None):
            if recipe == "mxfp8":
                return ops.dequantize_mxfp8(*ops.quantize_mxfp8(t, dim), dim)
            return ops.dequantize_fp8_rowwise(*ops.quantize_fp8_rowwise(t, dim, offs), dim, offs)

        gmm = torch_moe.grouped_mm
        self.assertEqual(out, gmm(qdq(x, 1), qdq(w, 1), offs).bfloat16(), atol=0, rtol=0)
        dx = gmm(qdq(dy, 1), qdq(w, 2).transpose(1, 2), offs).bfloat16()
        self.assertEqual(x.grad, dx, atol=0, rtol=0)
        rows = M - M % 32
        dw = gmm(qdq(x[:rows], 0, offs).t(), qdq(dy[:rows], 0, offs), offs).bfloat16()
        self.assertEqual(w.grad, dw, atol=0, rtol=0)

    def test_opcheck_quantizers(self):
        x = torch.randn(64, 96, dtype=torch.bfloat16)
        for mode in ("rceil", "floor"):
            for elem in (E4M3, E5M2):
                torch.library.opcheck(ops.quantize_mxfp8, (x, 0, elem, mode))
        data, scale = ops.quantize_mxfp8(x, -1)
        opcheck_fp8(self, ops.dequantize_mxfp8, (data, scale, -1, torch.bfloat16))
        torch.library.opcheck(ops.quantize_fp8_rowwise, (x, -1))
        torch.library.opcheck(ops.quantize_fp8_rowwise, (x, 0, _groups_ends([16, 0, 32])))
        d, s = ops.quantize_fp8_rowwise(x, 0)
        opcheck_fp8(self, ops.dequantize_fp8_rowwise, (d, s, 0, None, torch.float32))
        # non-contiguous inputs give the contiguous outputs the fake kernels promise
        xt = torch.randn(96, 64, dtype=torch.bfloat16).t()
        torch.library.opcheck(ops.quantize_mxfp8, (xt, 1))
        torch.library.opcheck(ops.quantize_fp8_rowwise, (xt, 1))
        torch.library.opcheck(ops.quantize_fp8_rowwise, (xt.t(), 1, _groups_ends([16, 0, 48])))
        d2, s2 = ops.quantize_mxfp8(torch.randn(64, 64))
        opcheck_fp8(self, ops.dequantize_mxfp8, (d2.t(), s2.t(), 0, torch.float32))
        torch.library.opcheck(ops.swizzle_mx_scale, (scale,))
        torch.library.opcheck(ops.unswizzle_mx_scale, (ops.swizzle_mx_scale(scale), 64, 3))


def _torchao_style_layer(precision):
    """The MoE layer test setup of torchao's moe_training tests, scaled down to a CPU: one
    shared expert, top-1 softmax routing, weights ~ N(0, 0.02), an MSE loss against ones, and a
    bf16 reference model."""
    torch.manual_seed(42)
    cfg = MoEConfig(dim=256, hidden_dim=1024, num_experts=8, top_k=1, num_shared_experts=1)
    ref = MoE(cfg).bfloat16()
    for p in ref.parameters():
        torch.nn.init.trunc_normal_(p, std=0.02)
    model = MoE(MoEConfig(**{**cfg.__dict__, "precision": precision})).bfloat16()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 256, 256, dtype=torch.bfloat16)
    outs = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        y = m(xi)
        F.mse_loss(y, torch.ones_like(y)).backward()
        outs.append((y, xi.grad, [p.grad for p in m.parameters()]))
    return outs


@instantiate_parametrized_tests
class TestQuantizedMoE(TestCase):
    # torchao's thresholds for the same test (out, input grad, parameter grads)
    @parametrize("precision,min_out,min_dx,min_dw", [
        ("fp8_rowwise", 29.0, 29.0, 23.0), ("mxfp8", 28.0, 29.0, 21.0),
    ])
    def test_layer_sqnr_against_bf16(self, precision, min_out, min_dx, min_dw):
        (y_ref, dx_ref, dw_ref), (y, dx, dw) = _torchao_style_layer(precision)
        self.assertGreaterEqual(sqnr(y_ref, y), min_out)
        self.assertGreaterEqual(sqnr(dx_ref, dx), min_dx)
        for r, a in zip(dw_ref, dw):
            self.assertGreaterEqual(sqnr(r, a), min_dw)

    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_moe_ffn_precision(self, precision):
        g = torch.Generator().manual_seed(0)
        T, D, Fd, E, k = 40, 64, 96, 4, 2
        x = torch.randn(T, D, generator=g, dtype=torch.bfloat16)
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
        wts = torch.rand(T, k, generator=g)
        w1, w3 = (torch.randn(E, D, Fd, generator=g) / D**0.5 for _ in range(2))
        w2 = torch.randn(E, Fd, D, generator=g) / Fd**0.5
        ref = moe_ffn(x.float(), ids, wts, w1, w2, w3)
        out = moe_ffn(x, ids, wts, w1.bfloat16(), w2.bfloat16(), w3.bfloat16(), precision=precision)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertGreaterEqual(sqnr(ref, out), 22.0)
        # fused gate/up weight gives the same result as separate w1, w3
        fused = moe_ffn(x, ids, wts, torch.cat([w1, w3], -1).bfloat16(), w2.bfloat16(), None,
                        precision=precision)
        self.assertEqual(fused, out, atol=0, rtol=0)

    def test_capacity_with_alignment(self):
        # token_sort_with_capacity(align=) pads kept groups like token_sort(align=)
        from torch_moe.nn.functional import token_sort_with_capacity

        g = torch.Generator().manual_seed(0)
        ids = torch.rand(50, 4, generator=g).topk(2, dim=1).indices
        wts = torch.rand(50, 2, generator=g)
        s1, o1, k1, d1 = token_sort_with_capacity(ids, wts, 4, 20)
        s32, o32, k32, d32 = token_sort_with_capacity(ids, wts, 4, 20, align=32)
        self.assertEqual(k1, k32)
        self.assertEqual(d1, d32)
        self.assertEqual(s32.numel(), 100 + 4 * 31)
        self.assertTrue((torch.diff(o32, prepend=i32(0)) % 32 == 0).all())
        starts32 = torch.cat([i32(0), o32[:-1]])
        starts1 = torch.cat([i32(0), o1[:-1]])
        for e in range(4):
            n = int(k1[e])
            self.assertEqual(s32[starts32[e]:starts32[e] + n], s1[starts1[e]:starts1[e] + n])
            self.assertTrue((s32[starts32[e] + n:o32[e]] == -1).all())

    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_module_trains_and_compiles(self, precision):
        torch.manual_seed(0)
        cfg = MoEConfig(dim=64, hidden_dim=64, num_experts=4, top_k=2, precision=precision)
        moe = MoE(cfg)
        x = torch.randn(2, 16, 64)
        eager = moe(x)
        compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)(x)
        self.assertEqual(compiled, eager)
        compiled.sum().backward()
        self.assertTrue(all(p.grad is not None for p in moe.experts.parameters()))


class TestQuantizationBadInput(TestCase):
    def message(self, fn, *args, **kwargs):
        with self.assertRaises((RuntimeError, ValueError)) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception).splitlines()[0]

    def test_mx_block_not_multiple_of_32(self):
        self.assertExpectedInline(
            self.message(ops.quantize_mxfp8, torch.randn(4, 40)),
            """torch_moe.quantize_mxfp8: expected x.size(1) to be a multiple of the MX block size 32, but got 40""",
        )

    def test_mx_wrong_input_dtype(self):
        self.assertExpectedInline(
            self.message(ops.quantize_mxfp8, torch.randn(4, 32, dtype=torch.float64)),
            """torch_moe.quantize_mxfp8: expected x to be bfloat16, float16, float32, but got torch.float64""",
        )

    def test_mx_wrong_elem_dtype_and_mode(self):
        self.assertExpectedInline(
            self.message(ops.quantize_mxfp8, torch.randn(4, 32), -1, torch.bfloat16),
            """torch_moe.quantize_mxfp8: expected elem_dtype to be float8_e4m3fn, float8_e5m2, but got torch.bfloat16""",
        )
        self.assertExpectedInline(
            self.message(ops.quantize_mxfp8, torch.randn(4, 32), -1, E4M3, "ceil"),
            """torch_moe.quantize_mxfp8: expected scale_mode to be one of ('rceil', 'floor'), but got 'ceil'""",
        )

    def test_dequantize_wrong_scale_shape(self):
        data, scale = ops.quantize_mxfp8(torch.randn(4, 64))
        self.assertExpectedInline(
            self.message(ops.dequantize_mxfp8, data, scale.t().contiguous()),
            """torch_moe.dequantize_mxfp8: expected scale of shape (4, 2) (one byte per block of 32 along the blocked dim), but got (2, 4)""",
        )
        self.assertExpectedInline(
            self.message(ops.dequantize_mxfp8, data, scale.float()),
            """torch_moe.dequantize_mxfp8: expected scale to hold E8M0 bytes (uint8 or float8_e8m0fnu), but got torch.float32""",
        )

    def test_group_sizes_not_multiple_of_32(self):
        x = torch.randn(96, 64)
        w = torch.randn(2, 64, 32)
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, x, w, i32(40, 96), "mxfp8"),
            """torch_moe.quantized_grouped_mm: expected every group size to be a multiple of 32 (blocks must not straddle groups; pad groups with token_sort(..., align=32)), but group 0 has 40 rows (offs[0] = 40)""",
        )
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, x, w, i32(24, 96), "fp8_rowwise"),
            """torch_moe.quantized_grouped_mm: expected every group size to be a multiple of 16 (blocks must not straddle groups; pad groups with token_sort(..., align=16)), but group 0 has 24 rows (offs[0] = 24)""",
        )

    def test_non_monotonic_offsets(self):
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, torch.randn(96, 64), torch.randn(2, 64, 32),
                         i32(64, 32), "mxfp8"),
            """torch_moe.quantized_grouped_mm: expected offs to be non-decreasing and non-negative, but offs[1] = 32 < offs[0] = 64""",
        )

    def test_k_not_multiple_of_block(self):
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, torch.randn(64, 48), torch.randn(2, 48, 32),
                         i32(32, 64), "mxfp8"),
            """torch_moe.quantized_grouped_mm: expected weight.size(1) to be a multiple of the MX block size 32, but got 48""",
        )

    def test_bad_recipe_and_dtype(self):
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, torch.randn(64, 32), torch.randn(2, 32, 32),
                         i32(32, 64), "fp4"),
            """torch_moe.quantized_grouped_mm: expected recipe to be one of ('fp8_rowwise', 'mxfp8'), but got 'fp4'""",
        )
        self.assertExpectedInline(
            self.message(ops.quantized_grouped_mm, torch.randn(64, 32), torch.randn(2, 32, 32).bfloat16(),
                         i32(32, 64), "mxfp8"),
            """torch_moe.quantized_grouped_mm: expected weight to have the dtype of input (torch.float32), but got torch.bfloat16""",
        )

    def test_inf_scale(self):
        qa, sa = ops.quantize_fp8_rowwise(torch.randn(32, 16), 1)
        qb, sb = ops.quantize_fp8_rowwise(torch.randn(1, 16, 16), 1)
        sb[0, 0, 3] = float("inf")
        self.assertExpectedInline(
            self.message(ops.scaled_grouped_mm, qa, qb, sa, sb, i32(32)),
            """torch_moe.scaled_grouped_mm: expected scale_b to hold positive finite scales (or NaN for a non-finite row), but got inf at index (0, 0, 3)""",
        )

    def test_scaled_grouped_mm_mixed_scales(self):
        qa, sa = ops.quantize_mxfp8(torch.randn(32, 32), 1)
        qb, sb = ops.quantize_fp8_rowwise(torch.randn(1, 32, 16), 1)
        self.assertExpectedInline(
            self.message(ops.scaled_grouped_mm, qa, qb, sa, sb, i32(32)),
            """torch_moe.scaled_grouped_mm: expected both scales to be E8M0 bytes (uint8 or float8_e8m0fnu, MXFP8) or both float32 (FP8 rowwise), but got torch.uint8 and torch.float32""",
        )

    def test_scaled_grouped_mm_high_precision_operands(self):
        self.assertExpectedInline(
            self.message(ops.scaled_grouped_mm, torch.randn(32, 32), torch.randn(1, 32, 16),
                         torch.ones(32, 1), torch.ones(1, 1, 16), i32(32)),
            """torch_moe.scaled_grouped_mm: expected mat_a to be float8_e4m3fn, float8_e5m2, but got torch.float32""",
        )

    def test_empty_rowwise_dim(self):
        self.assertExpectedInline(
            self.message(ops.quantize_fp8_rowwise, torch.randn(4, 0), 1),
            """torch_moe.quantize_fp8_rowwise: expected a non-empty reduced dim, but x.size(1) is 0 (a scale of nothing is undefined)""",
        )

    def test_quantized_ffn_wrong_down_projection(self):
        x, ids, w = torch.randn(8, 64), torch.zeros(8, 1, dtype=torch.long), torch.ones(8, 1)
        self.assertExpectedInline(
            self.message(moe_ffn, x, ids, w, torch.randn(2, 64, 32), torch.randn(2, 32, 96),
                         torch.randn(2, 64, 32), precision="mxfp8"),
            """quantized_expert_ffn: expected w1 [2, 64, F] and w2 [2, 32, 64] for x [T, 64], but got w1 (2, 64, 32) and w2 (2, 32, 96)""",
        )

    def test_moe_config_and_moe_ffn(self):
        self.assertExpectedInline(
            self.message(MoEConfig, dim=100, hidden_dim=64, num_experts=4, top_k=2, precision="mxfp8"),
            """MoEConfig: precision='mxfp8' needs dim to be a multiple of the MX block size 32, but got 100""",
        )
        self.assertExpectedInline(
            self.message(MoEConfig, dim=64, hidden_dim=64, num_experts=4, top_k=2, precision="fp16"),
            """MoEConfig: expected precision in ('bf16', 'fp8_rowwise', 'mxfp8'), but got 'fp16'""",
        )
        x, ids, w = torch.randn(4, 32), torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)
        self.assertExpectedInline(
            self.message(moe_ffn, x, ids, w, torch.randn(2, 32, 32), torch.randn(2, 32, 32),
                         precision="int8"),
            """moe_ffn: expected precision in ('bf16', 'fp8_rowwise', 'mxfp8'), but got 'int8'""",
        )


if __name__ == "__main__":
    run_tests()
