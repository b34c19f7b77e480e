# Owner(s): ["module: moe"]
"""Malformed calls of the quantization entry points: the FP8 rowwise / MXFP8 quantize and
dequantize ops, the scale swizzle, ``scaled_grouped_mm``, ``quantized_grouped_mm`` and the
quantized precisions of ``moe_ffn``. Misaligned groups, wrong scale dtypes and shapes, and
NaN / Inf where they matter (a non-finite block or row is NaN, a bad scale raises)."""

import math

import torch
from torch.testing._internal.common_utils import run_tests

from _malformed import Case, malformed_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe import quantization as Q
from torch_moe.nn import functional as F

E4M3 = torch.float8_e4m3fn
NAN, INF = float("nan"), float("inf")


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _shape(*shape):
    def check(result):
        out = result[0] if isinstance(result, tuple) else result
        assert tuple(out.shape) == shape, f"expected shape {shape}, got {tuple(out.shape)}"
    return check


def _all(pred, what):
    def check(result):
        assert bool(pred(result)), what
    return check


QMX = "torch_moe.quantize_mxfp8"
DQMX = "torch_moe.dequantize_mxfp8"
QRW = "torch_moe.quantize_fp8_rowwise"
DQRW = "torch_moe.dequantize_fp8_rowwise"
SWZ = "torch_moe.swizzle_mx_scale"
USWZ = "torch_moe.unswizzle_mx_scale"

QUANTIZE_CASES = [
    Case(QMX, "int_input", lambda: Q.quantize_mxfp8(torch.ones(4, 32, dtype=torch.int64)), RuntimeError,
         ("x", "float32", "int64")),
    Case(QMX, "complex_input", lambda: Q.quantize_mxfp8(torch.ones(4, 32, dtype=torch.complex64)),
         RuntimeError, ("x", "float32", "complex64")),
    Case(QMX, "float64_input", lambda: Q.quantize_mxfp8(_x(4, 32, dtype=torch.float64)), RuntimeError,
         ("x", "float32", "float64")),
    Case(QMX, "unblocked_dim", lambda: Q.quantize_mxfp8(_x(4, 33)), RuntimeError,
         ("x.size(1)", "32", "33")),
    Case(QMX, "dim_out_of_range", lambda: Q.quantize_mxfp8(_x(4, 32), dim=2), RuntimeError,
         ("dim", "[-2, 2)", "2")),
    Case(QMX, "dim_float", lambda: Q.quantize_mxfp8(_x(4, 32), dim=1.0), RuntimeError,
         ("dim", "int", "float")),
    Case(QMX, "scalar_input", lambda: Q.quantize_mxfp8(torch.ones(())), RuntimeError, ("dim", "-1")),
    Case(QMX, "int_elem_dtype", lambda: Q.quantize_mxfp8(_x(4, 32), elem_dtype=torch.int8), RuntimeError,
         ("elem_dtype", "float8_e4m3fn", "int8")),
    Case(QMX, "unknown_scale_mode", lambda: Q.quantize_mxfp8(_x(4, 32), scale_mode="round"), RuntimeError,
         ("scale_mode", "'rceil'", "'round'")),
    Case(QMX, "no_rows", lambda: Q.quantize_mxfp8(_x(0, 32)), check=_shape(0, 32)),
    Case(QMX, "meta_input", lambda: Q.quantize_mxfp8(_x(4, 64).to("meta"))[1], check=_shape(4, 2)),
    Case(QMX, "inf_block_is_nan", lambda: Q.quantize_mxfp8(torch.full((1, 32), INF))[1],
         check=_all(lambda s: (s == 255).all(), "a block holding Inf must get the NaN scale 255")),
    Case(QMX, "nan_block_is_nan", lambda: Q.dequantize_mxfp8(*Q.quantize_mxfp8(
        torch.cat([torch.full((1, 1), NAN), torch.ones(1, 31)], 1))),
         check=_all(lambda y: y.isnan().all(), "a block holding NaN must dequantize to NaN")),
    Case(DQMX, "float_scale", lambda: Q.dequantize_mxfp8(_x(4, 32).to(E4M3), torch.ones(4, 1)),
         RuntimeError, ("scale", "uint8", "float32")),
    Case(DQMX, "scale_shape",
         lambda: Q.dequantize_mxfp8(_x(4, 32).to(E4M3), torch.ones(4, 2, dtype=torch.uint8)),
         RuntimeError, ("scale", "(4, 1)", "(4, 2)")),
    Case(DQMX, "unquantized_data", lambda: Q.dequantize_mxfp8(_x(4, 32), torch.ones(4, 1, dtype=torch.uint8)),
         RuntimeError, ("data", "float8_e4m3fn", "float32")),
    Case(DQMX, "int_out_dtype",
         lambda: Q.dequantize_mxfp8(_x(4, 32).to(E4M3), torch.ones(4, 1, dtype=torch.uint8),
                                                          out_dtype=torch.int32),
         RuntimeError, ("out_dtype", "float32", "int32")),
    Case(DQMX, "scale_other_device",
         lambda: Q.dequantize_mxfp8(_x(4, 32).to(E4M3), torch.ones(4, 1, dtype=torch.uint8, device="meta")),
         RuntimeError, ("scale", "cpu", "meta")),
    Case(QRW, "int_input", lambda: Q.quantize_fp8_rowwise(torch.ones(4, 8, dtype=torch.int32)), RuntimeError,
         ("x", "float32", "int32")),
    Case(QRW, "empty_reduced_dim", lambda: Q.quantize_fp8_rowwise(_x(4, 0)), RuntimeError,
         ("x.size(1)", "non-empty", "0")),
    Case(QRW, "int64_offs", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, torch.tensor([16, 32])),
         RuntimeError,
         ("offs", "int32", "int64")),
    Case(QRW, "offs_2d", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, torch.ones(2, 2, dtype=torch.int32)),
         RuntimeError, ("offs", "1-D", "(2, 2)")),
    Case(QRW, "offs_decreasing", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, i32(16, 8)), RuntimeError,
         ("offs", "non-decreasing", "offs[1] = 8")),
    Case(QRW, "offs_negative", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, i32(-16, 32)), RuntimeError,
         ("offs", "non-negative", "-16")),
    Case(QRW, "offs_past_rows", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, i32(16, 48)), RuntimeError,
         ("offs[-1]", "32", "48")),
    Case(QRW, "offs_other_device", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, i32(16, 32).to("meta")),
         RuntimeError, ("offs", "cpu", "meta")),
    Case(QRW, "no_groups", lambda: Q.quantize_fp8_rowwise(_x(32, 4), 0, i32())[1], check=_shape(0, 4)),
    Case(QRW, "no_rows", lambda: Q.quantize_fp8_rowwise(_x(0, 32))[1], check=_shape(0, 1)),
    Case(QRW, "nan_row_has_nan_scale",
         lambda: Q.quantize_fp8_rowwise(torch.tensor([[1.0, NAN], [1.0, 2.0]]))[1],
         check=_all(lambda s: s[0].isnan().all() and s[1].isfinite().all(),
                    "only the row holding NaN may get a NaN scale")),
    Case(QRW, "inf_row_has_nan_scale", lambda: Q.quantize_fp8_rowwise(torch.tensor([[1.0, -INF]]))[1],
         check=_all(lambda s: s.isnan().all(), "a row holding Inf must get a NaN scale")),
    Case(DQRW, "float64_scale",
         lambda: Q.dequantize_fp8_rowwise(_x(4, 32).to(E4M3), torch.ones(4, 1, dtype=torch.float64)),
         RuntimeError, ("scale", "float32", "float64")),
    Case(DQRW, "scale_shape", lambda: Q.dequantize_fp8_rowwise(_x(4, 32).to(E4M3), torch.ones(4, 2)),
         RuntimeError, ("scale", "(4, 1)", "(4, 2)")),
    Case(DQRW, "grouped_scale_shape",
         lambda: Q.dequantize_fp8_rowwise(_x(32, 4).to(E4M3), torch.ones(1, 4), 0,
                                                                      i32(16, 32)),
         RuntimeError, ("scale", "(2, 4)", "(1, 4)")),
    Case(DQRW, "unquantized_data", lambda: Q.dequantize_fp8_rowwise(_x(4, 32), torch.ones(4, 1)),
         RuntimeError,
         ("data", "float8_e4m3fn", "float32")),
    Case(SWZ, "scale_1d", lambda: Q.swizzle_mx_scale(torch.ones(4, dtype=torch.uint8)), RuntimeError,
         ("scale", "[..., rows, cols]", "(4,)")),
    Case(SWZ, "float_scale", lambda: Q.swizzle_mx_scale(torch.ones(4, 4)), RuntimeError,
         ("scale", "uint8", "float32")),
    Case(SWZ, "no_rows", lambda: Q.swizzle_mx_scale(torch.ones(0, 4, dtype=torch.uint8)), check=_shape(0)),
    Case(USWZ, "negative_rows", lambda: Q.unswizzle_mx_scale(torch.ones(512, dtype=torch.uint8), -1, 4),
         RuntimeError, ("rows", ">= 0", "-1")),
    Case(USWZ, "float_rows", lambda: Q.unswizzle_mx_scale(torch.ones(512, dtype=torch.uint8), 4.0, 4),
         RuntimeError, ("rows", "int", "float")),
    Case(USWZ, "wrong_length", lambda: Q.unswizzle_mx_scale(torch.ones(500, dtype=torch.uint8), 4, 4),
         RuntimeError, ("swizzled", "512", "(500,)")),
    Case(USWZ, "absurd_sizes", lambda: Q.unswizzle_mx_scale(torch.ones(512, dtype=torch.uint8), 2**62, 2**62),
         RuntimeError, ("swizzled", str(2**62), "(512,)")),
]


def _sgm(a_rows=32, K=32, N=16, offs=(16, 32), scale_a=None, scale_b=None, mx=False,
         out_dtype=torch.bfloat16):
    def call():
        a = _x(a_rows, K).to(E4M3)
        b = _x(len(offs), K, N, seed=1).to(E4M3)
        if mx:
            sa = torch.full((a_rows, K // 32), 127, dtype=torch.uint8) if scale_a is None else scale_a
            sb = torch.full((len(offs), K // 32, N), 127, dtype=torch.uint8) if scale_b is None else scale_b
        else:
            sa = torch.ones(a_rows, 1) if scale_a is None else scale_a
            sb = torch.ones(len(offs), 1, N) if scale_b is None else scale_b
        return Q.scaled_grouped_mm(a, b, sa, sb, i32(*offs), out_dtype)
    return call


SGM = "torch_moe.scaled_grouped_mm"
SGM_CASES = [
    Case(SGM, "fp8_misaligned_group", _sgm(offs=(8, 32)), RuntimeError, ("offs", "16", "group 0", "8 rows")),
    Case(SGM, "mxfp8_misaligned_group", _sgm(mx=True, offs=(16, 32)), RuntimeError,
         ("offs", "32", "group 0", "16 rows")),
    Case(SGM, "offs_past_rows", _sgm(offs=(16, 48)), RuntimeError, ("offs[-1]", "32", "48")),
    Case(SGM, "offs_decreasing", _sgm(offs=(32, 16)), RuntimeError, ("offs", "non-decreasing", "16")),
    Case(SGM, "float64_scales", _sgm(scale_a=torch.ones(32, 1, dtype=torch.float64),
                                     scale_b=torch.ones(2, 1, 16, dtype=torch.float64)),
         RuntimeError, ("scales", "float32", "float64")),
    Case(SGM, "mixed_scale_recipes", _sgm(scale_b=torch.ones(2, 1, 16, dtype=torch.uint8)), RuntimeError,
         ("scales", "float32", "uint8")),
    Case(SGM, "rowwise_scale_shape", _sgm(scale_a=torch.ones(32, 2)), RuntimeError,
         ("scale_a", "(32, 1)", "(32, 2)")),
    Case(SGM, "mx_scale_shape", _sgm(mx=True, offs=(0, 32), scale_b=torch.ones(2, 2, 16, dtype=torch.uint8)),
         RuntimeError, ("scale_b", "(2, 1, 16)", "(2, 2, 16)")),
    Case(SGM, "mx_unblocked_contraction",
         _sgm(mx=True, K=16, offs=(0, 32), scale_a=torch.ones(32, 1, dtype=torch.uint8),
                                               scale_b=torch.ones(2, 1, 16, dtype=torch.uint8)),
         RuntimeError, ("mat_a.size(1)", "32", "16")),
    Case(SGM, "inf_scale", _sgm(scale_a=torch.full((32, 1), INF)), RuntimeError,
         ("scale_a", "positive finite", "inf")),
    Case(SGM, "zero_scale", _sgm(scale_b=torch.zeros(2, 1, 16)), RuntimeError,
         ("scale_b", "positive finite", "0.0")),
    Case(SGM, "negative_scale", _sgm(scale_a=-torch.ones(32, 1)), RuntimeError,
         ("scale_a", "positive finite", "-1.0")),
    Case(SGM, "int_out_dtype", _sgm(out_dtype=torch.int32), RuntimeError, ("out_dtype", "bfloat16", "int32")),
    Case(SGM, "group_count", lambda: Q.scaled_grouped_mm(_x(32, 32).to(E4M3), _x(2, 32, 16).to(E4M3),
                                                         torch.ones(32, 1), torch.ones(2, 1, 16), i32(32)),
         RuntimeError, ("mat_b", "[1, 32, N]", "(2, 32, 16)")),
    Case(SGM, "unquantized_operand",
         lambda: Q.scaled_grouped_mm(_x(32, 32), _x(2, 32, 16).to(E4M3), torch.ones(32, 1),
                                     torch.ones(2, 1, 16), i32(16, 32)),
         RuntimeError, ("mat_a", "float8_e4m3fn", "float32")),
    Case(SGM, "int64_offs",
         lambda: Q.scaled_grouped_mm(_x(32, 32).to(E4M3), _x(2, 32, 16).to(E4M3), torch.ones(32, 1),
                                     torch.ones(2, 1, 16), torch.tensor([16, 32])),
         RuntimeError, ("offs", "int32", "int64")),
    Case(SGM, "scale_other_device", _sgm(scale_b=torch.ones(2, 1, 16, device="meta")), RuntimeError,
         ("one device", "cpu", "meta")),
    Case(SGM, "no_rows", _sgm(a_rows=0, offs=(0, 0)), check=_shape(0, 16)),
    Case(SGM, "nan_scale_row_is_nan", _sgm(scale_a=torch.ones(32, 1).index_fill(0, torch.tensor([3]), NAN),
                                           out_dtype=torch.float32),
         check=_all(lambda y: y[3].isnan().all() and y[torch.arange(32) != 3].isfinite().all(),
                    "only the row with a NaN scale may be NaN")),
]


def _qgm(M=32, K=32, N=32, offs=(16, 32), recipe="fp8_rowwise", dtype=torch.float32, backward=False, **kw):
    def call():
        x = _x(M, K, dtype=dtype).requires_grad_(backward)
        w = (_x(len(offs), K, N, dtype=dtype, seed=1) / math.sqrt(K)).requires_grad_(backward)
        out = Q.quantized_grouped_mm(x, w, i32(*offs), recipe, **kw)
        if backward:
            out.sum().backward()
            return w.grad
        return out
    return call


QGM = "torch_moe.quantized_grouped_mm"
QGM_CASES = [
    Case(QGM, "fp8_misaligned_group", _qgm(offs=(8, 32)), RuntimeError, ("offs", "16", "group 0", "8 rows")),
    Case(QGM, "mxfp8_misaligned_group", _qgm(recipe="mxfp8", offs=(16, 32)), RuntimeError,
         ("offs", "32", "group 0", "16 rows")),
    Case(QGM, "offs_past_rows", _qgm(offs=(16, 48)), RuntimeError, ("offs[-1]", "32", "48")),
    Case(QGM, "unknown_recipe", _qgm(recipe="fp4"), RuntimeError, ("recipe", "'fp8_rowwise'", "'fp4'")),
    Case(QGM, "unknown_scale_mode", _qgm(recipe="mxfp8", offs=(0, 32), scale_mode="up"), RuntimeError,
         ("scale_mode", "'rceil'", "'up'")),
    Case(QGM, "float64_input", _qgm(dtype=torch.float64), RuntimeError, ("input", "float32", "float64")),
    Case(QGM, "int_input",
         lambda: Q.quantized_grouped_mm(torch.ones(32, 32, dtype=torch.int64),
                                        torch.ones(2, 32, 32, dtype=torch.int64), i32(16, 32), "fp8_rowwise"),
         RuntimeError, ("input", "float32", "int64")),
    Case(QGM, "mixed_dtypes", lambda: Q.quantized_grouped_mm(_x(32, 32, dtype=torch.bfloat16), _x(2, 32, 32),
                                                             i32(16, 32), "fp8_rowwise"),
         RuntimeError, ("weight", "bfloat16", "float32")),
    Case(QGM, "contraction_mismatch", lambda: Q.quantized_grouped_mm(_x(32, 16), _x(2, 32, 32), i32(16, 32),
                                                                     "fp8_rowwise"),
         RuntimeError, ("input.size(1)", "32", "16")),
    Case(QGM, "group_count",
         lambda: Q.quantized_grouped_mm(_x(32, 32), _x(2, 32, 32), i32(32), "fp8_rowwise"),
         RuntimeError, ("offs.size(0)", "2", "1")),
    Case(QGM, "mxfp8_unblocked_weight", _qgm(recipe="mxfp8", K=16, offs=(0, 32)), RuntimeError,
         ("weight.size(1)", "32", "16")),
    Case(QGM, "no_rows", _qgm(M=0, offs=(0, 0)), check=_shape(0, 32)),
    Case(QGM, "no_rows_backward", _qgm(M=0, offs=(0, 0), backward=True),
         check=_all(lambda g: (g == 0).all(), "experts without rows must get zero gradients")),
    Case(QGM, "rows_past_offs_backward", _qgm(M=40, offs=(16, 32), backward=True), check=_shape(2, 32, 32)),
    Case(QGM, "meta_tensors", lambda: Q.quantized_grouped_mm(_x(32, 32).to("meta"), _x(2, 32, 32).to("meta"),
                                                             i32(16, 32).to("meta"), "mxfp8"),
         check=_shape(32, 32)),
    Case(QGM, "nan_row_stays_in_its_row",
         lambda: Q.quantized_grouped_mm(_x(32, 32).index_fill(0, torch.tensor([5]), NAN), _x(2, 32, 32),
                                        i32(16, 32), "fp8_rowwise"),
         check=_all(lambda y: y[5].isnan().all() and y[torch.arange(32) != 5].isfinite().all(),
                    "a NaN token row must not spread to other rows")),
]


def _ffn(precision, T=6, D=32, FF=32, E=4, k=2, dtype=torch.float32, **kw):
    def call():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, D, generator=g).to(dtype)
        ids = torch.randint(0, E, (T, k), generator=g)
        w = torch.rand(T, k, generator=g)
        w1, w3 = (torch.randn(E, D, FF, generator=g).to(dtype) / D**0.5 for _ in range(2))
        w2 = torch.randn(E, FF, D, generator=g).to(dtype) / FF**0.5
        return F.moe_ffn(x, ids, w, w1, w2, w3, precision=precision, **kw)
    return call


FFN = "torch_moe.nn.functional.moe_ffn"
FFN_CASES = [
    Case(FFN, "mxfp8_unblocked_model_dim", _ffn("mxfp8", D=48), ValueError, ("x.size(1)", "32", "48")),
    Case(FFN, "mxfp8_unblocked_ffn_dim", _ffn("mxfp8", FF=40), ValueError, ("w2.size(1)", "32", "40")),
    Case(FFN, "fp8_rowwise_float64", _ffn("fp8_rowwise", dtype=torch.float64), TypeError,
         ("x", "float32", "float64")),
    Case(FFN, "mxfp8_float64", _ffn("mxfp8", dtype=torch.float64), TypeError, ("x", "float32", "float64")),
    Case(FFN, "mxfp8_unknown_scale_mode", _ffn("mxfp8", scale_mode="nearest"), ValueError,
         ("scale_mode", "'nearest'")),
    Case(FFN, "fp8_rowwise_bf16", _ffn("fp8_rowwise", dtype=torch.bfloat16), check=_shape(6, 32)),
    Case(FFN, "mxfp8_floor", _ffn("mxfp8", scale_mode="floor"), check=_shape(6, 32)),
    Case(FFN, "mxfp8_one_token", _ffn("mxfp8", T=1), check=_shape(1, 32)),
    Case(FFN, "fp8_rowwise_wgrad_high_precision", _ffn("fp8_rowwise", wgrad_high_precision=True),
         check=_shape(6, 32)),
]

CASES = QUANTIZE_CASES + SGM_CASES + QGM_CASES + FFN_CASES

TestMalformedQuantization = malformed_tests(CASES, "TestMalformedQuantization")

if __name__ == "__main__":
    run_tests()
