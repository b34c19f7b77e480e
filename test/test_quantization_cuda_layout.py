# Owner(s): ["module: moe"]
"""The CUDA kernel of ``torch_moe.scaled_grouped_mm`` (:mod:`torch_moe.quantization._cuda`),
tested without a GPU.

* ``device="meta"``: the tensors the adapter builds satisfy the shape / stride / dtype contracts
  of ``torch._scaled_grouped_mm`` (its meta kernel runs on CPU), and the contracts the adapter
  relies on still reject what they rejected in torch 2.13, with the same messages. Building the
  operands on meta tensors also shows that it reads no tensor data on the host (``.item()`` and
  ``.tolist()`` raise on meta tensors), i.e. needs no synchronisation.
* CPU: the per-group swizzled scale layouts against a per-group loop over ``swizzle_mx_scale``,
  the capability dispatch, and the bf16 fallback against the op's CPU kernel.

What needs a GPU (the kernels themselves reading these layouts) is checked by
``benchmarks/scaled_grouped_mm_gpu.py --check``.
"""

import functools
import re
import unittest
from unittest import mock

import torch
import torch.nn.functional as F
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

import torch_moe  # noqa: F401  (registers the ops)
from torch_moe import _compat
from torch_moe.quantization import _cuda

ops = torch.ops.torch_moe
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
RECIPES = ("fp8_rowwise", "mxfp8")


def round_up(n, m):
    return (n + m - 1) // m * m


def group_ends(sizes, device="cpu"):
    return torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0).to(torch.int32).to(device)


def random_bytes(gen, *shape):
    return torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen)


def random_sizes(gen, groups, multiple, max_blocks=6, p_empty=0.3):
    """Random group sizes, multiples of ``multiple``, about ``p_empty`` of them empty."""
    blocks = torch.randint(1, max_blocks + 1, (groups,), generator=gen)
    blocks[torch.rand(groups, generator=gen) < p_empty] = 0
    return (blocks * multiple).tolist()


# ---------------------------------------------------------------------------------------------
# Per-group loop references, built from swizzle_mx_scale
# ---------------------------------------------------------------------------------------------


def loop_row_groups(scale, ends):
    """Each group of rows swizzled on its own, the blocks back to back, R + 128 G rows."""
    R, C = scale.shape
    Cp = round_up(C, 4)
    out = torch.zeros((R + 128 * len(ends)) * Cp, dtype=torch.uint8)
    pos = start = 0
    for end in ends.tolist():
        block = ops.swizzle_mx_scale(scale[start:end])
        out[pos : pos + block.numel()] = block
        pos, start = pos + block.numel(), end
    return out.view(-1, Cp)


def loop_col_groups(scale, ends):
    """Each group of columns swizzled on its own, the blocks back to back, C + 4 G columns."""
    R, C = scale.shape
    Rp = round_up(R, 128)
    out = torch.zeros(Rp * (C + 4 * len(ends)), dtype=torch.uint8)
    pos = start = 0
    for end in ends.tolist():
        block = ops.swizzle_mx_scale(scale[:, start:end])
        out[pos : pos + block.numel()] = block
        pos, start = pos + block.numel(), end
    return out.view(Rp, -1)


# ---------------------------------------------------------------------------------------------
# Canonical operands of scaled_grouped_mm
# ---------------------------------------------------------------------------------------------


def empty_operands(recipe, two_d_three_d, G, M, K, N, device="meta"):
    """Uninitialised canonical operands (layouts of ``_scaled_grouped_mm.py``'s docstring), with
    the strides ``quantized_grouped_mm`` produces: row-major data and scales, except that the
    2D x 2D operands are the transposed views its weight gradient passes."""
    kw = dict(device=device)
    offs = torch.empty(G, dtype=torch.int32, **kw)
    mx = recipe == "mxfp8"
    sdt = dict(dtype=torch.uint8 if mx else torch.float32, **kw)
    if two_d_three_d:
        a = torch.empty(M, K, dtype=E4M3, **kw)
        b = torch.empty(G, K, N, dtype=E4M3, **kw)
        sa = torch.empty(M, K // 32 if mx else 1, **sdt)
        sb = torch.empty(G, K // 32 if mx else 1, N, **sdt)
    else:  # a [K, M] = x.t() of x [M, K], b [M, N]
        a = torch.empty(M, K, dtype=E4M3, **kw).t()
        b = torch.empty(M, N, dtype=E4M3, **kw)
        sa = torch.empty(M // 32 if mx else G, K, **sdt).t()
        sb = torch.empty(M // 32 if mx else G, N, **sdt)
    return a, b, sa, sb, offs


def scaled_grouped_mm_meta(a, b, sa, sb, offs, out_dtype=torch.bfloat16):
    return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=out_dtype)


class TestScaledGroupedMMContracts(TestCase):
    """``torch._scaled_grouped_mm``'s meta kernel on exactly the tensors the adapter builds."""

    G, M, K, N = 4, 512, 96, 80  # K / 32 = 3 and N are not multiples of the tile sizes

    def build(self, recipe, two_d_three_d):
        a, b, sa, sb, offs = empty_operands(recipe, two_d_three_d, self.G, self.M, self.K, self.N)
        built = _cuda.native_operands(a, b, sa, sb, offs, recipe)
        return built, offs

    def assert_data_layouts(self, a, b):
        self.assertEqual(a.dtype, E4M3)
        self.assertEqual(b.dtype, E4M3)
        self.assertTrue(a.is_contiguous(), "mat_a must be dense row-major")
        self.assertTrue(b.transpose(-2, -1).is_contiguous(), "mat_b must be dense column-major")

    def test_fp8_rowwise_2d_3d(self):
        G, M, K, N = self.G, self.M, self.K, self.N
        (a, b, sa, sb), offs = self.build("fp8_rowwise", True)
        self.assert_data_layouts(a, b)
        self.assertEqual((a.shape, b.shape), ((M, K), (G, K, N)))
        self.assertEqual((sa.shape, sa.dtype, sa.stride()), ((M,), torch.float32, (1,)))
        self.assertEqual((sb.shape, sb.dtype, sb.stride()), ((G, N), torch.float32, (N, 1)))
        out = scaled_grouped_mm_meta(a, b, sa, sb, offs)
        self.assertEqual((out.shape, out.dtype), ((M, N), torch.bfloat16))

    def test_fp8_rowwise_2d_2d(self):
        G, M, K, N = self.G, self.M, self.K, self.N
        (a, b, sa, sb), offs = self.build("fp8_rowwise", False)
        self.assert_data_layouts(a, b)
        self.assertEqual((a.shape, b.shape), ((K, M), (M, N)))
        self.assertEqual((sa.shape, sa.dtype), ((G * K,), torch.float32))
        self.assertEqual((sb.shape, sb.dtype), ((G * N,), torch.float32))
        self.assertTrue(sa.is_contiguous() and sb.is_contiguous())
        out = scaled_grouped_mm_meta(a, b, sa, sb, offs)
        self.assertEqual((out.shape, out.dtype), ((G, K, N), torch.bfloat16))

    def test_mxfp8_2d_3d(self):
        G, M, K, N = self.G, self.M, self.K, self.N
        (a, b, sa, sb), offs = self.build("mxfp8", True)
        self.assert_data_layouts(a, b)
        self.assertEqual((sa.dtype, sb.dtype), (E8M0, E8M0))
        # token groups: each padded to 128 rows, upper bound M + 128 G; K/32 = 3 padded to 4
        self.assertEqual(sa.shape, (M + 128 * G, round_up(K // 32, 4)))
        self.assertTrue(sa.is_contiguous())
        # experts: (G, round_up(K/32, 4) * round_up(N, 128)), the size the meta kernel checks
        self.assertEqual(sb.shape, (G, round_up(K // 32, 4) * round_up(N, 128)))
        self.assertEqual(sb.stride(-1), 1)
        out = scaled_grouped_mm_meta(a, b, sa, sb, offs)
        self.assertEqual((out.shape, out.dtype), ((M, N), torch.bfloat16))

    def test_mxfp8_2d_2d(self):
        G, M, K, N = self.G, self.M, self.K, self.N
        (a, b, sa, sb), offs = self.build("mxfp8", False)
        self.assert_data_layouts(a, b)
        self.assertEqual((sa.dtype, sb.dtype), (E8M0, E8M0))
        # groups of the contraction: each padded to 4 scale columns, upper bound M/32 + 4 G;
        # rows: mat_a's K and mat_b's N, padded to 128 (the kernel checks scale.size(0) >= them)
        self.assertEqual(sa.shape, (round_up(K, 128), M // 32 + 4 * G))
        self.assertEqual(sb.shape, (round_up(N, 128), M // 32 + 4 * G))
        self.assertTrue(sa.is_contiguous() and sb.is_contiguous())
        out = scaled_grouped_mm_meta(a, b, sa, sb, offs)
        self.assertEqual((out.shape, out.dtype), ((G, K, N), torch.bfloat16))

    def test_operands_already_in_layout_are_not_copied(self):
        # dgrad passes mat_b = W_q.transpose(1, 2), already column-major
        G, M, K, N = self.G, self.M, self.K, self.N
        a = torch.empty(M, N, dtype=E4M3, device="meta")
        b = torch.empty(G, K, N, dtype=E4M3, device="meta").transpose(1, 2)
        sa = torch.empty(M, 1, device="meta")
        sb = torch.empty(G, 1, K, device="meta")
        offs = torch.empty(G, dtype=torch.int32, device="meta")
        a2, b2, _, _ = _cuda.native_operands(a, b, sa, sb, offs, "fp8_rowwise")
        self.assertIs(a2, a)
        self.assertIs(b2, b)

    # Contracts the adapter relies on: if torch relaxes or changes them, these fail and the
    # adapter's conversions should be revisited.

    def test_rejects_row_major_mat_b(self):
        (a, b, sa, sb), offs = self.build("fp8_rowwise", True)
        with self.assertRaisesRegex(
            RuntimeError,
            re.escape("Expected mat_b tensor to be column major in the last two dimensions"),
        ):
            scaled_grouped_mm_meta(a, b.contiguous(), sa, sb, offs)

    def test_rejects_fp32_out_dtype(self):
        (a, b, sa, sb), offs = self.build("fp8_rowwise", True)
        with self.assertRaisesRegex(
            RuntimeError, re.escape("If output dtype provided, it must be torch.bfloat16.")
        ):
            scaled_grouped_mm_meta(a, b, sa, sb, offs, out_dtype=torch.float32)

    def test_rejects_column_shaped_rowwise_scale(self):
        # the canonical [M, 1] scale of a 2D operand must be flattened to (M,)
        (a, b, sa, sb), offs = self.build("fp8_rowwise", True)
        with self.assertRaisesRegex(
            RuntimeError, re.escape("Expected scale_a to be 1D tensor, but got 2D tensor.")
        ):
            scaled_grouped_mm_meta(a, b, sa[:, None], sb, offs)

    def test_rejects_unswizzled_3d_mx_scale(self):
        # the expert scale must be swizzled and flattened per expert, not (G, N, K/32)
        G, K, N = self.G, self.K, self.N
        (a, b, sa, _), offs = self.build("mxfp8", True)
        unswizzled = torch.empty(G, N, K // 32, dtype=E8M0, device="meta")
        with self.assertRaisesRegex(
            RuntimeError,
            re.escape(
                "For MXFP8, 3d tensor should have 2d scales, but scale_b has mat.ndim=3 and "
                "scale.ndim=3"
            ),
        ):
            scaled_grouped_mm_meta(a, b, sa, unswizzled, offs)


class TestScaledGroupedMMCall(TestCase):
    """The call of aten's scaled grouped GEMM in ``scaled_grouped_mm_native``, through the ops
    adapter (``torch_moe._compat.scaled_grouped_mm``), end to end on ``device="meta"``.

    Public API (``torch.nn.functional.scaled_grouped_mm``, which calls
    ``aten._scaled_grouped_mm_v2``): torch 2.13 has no meta kernel for ``_scaled_grouped_mm_v2``,
    so the call is recorded and checked argument by argument (the recipe and swizzle enums, the
    tensors, the output dtype and fast-accumulation flag), and the tensors it got are run
    through the meta kernel of ``_scaled_grouped_mm``: both ops apply the same operand checks
    before reaching the same kernels (rowwise: fp32 scales, RowWise on both sides; MXFP8: e8m0
    scales, BlockWise1x32 with SWIZZLE_32_4_4, which ``_scaled_grouped_mm`` implies). Where torch
    has a meta kernel for ``_scaled_grouped_mm_v2``, the public call itself runs too.
    Private fallback (no public API): ``torch._scaled_grouped_mm``'s meta kernel runs.
    """

    G, M, K, N = 4, 512, 96, 80

    def operands(self, recipe, two_d_three_d):
        return empty_operands(recipe, two_d_three_d, self.G, self.M, self.K, self.N)

    def expected_shape(self, two_d_three_d):
        return (self.M, self.N) if two_d_three_d else (self.G, self.K, self.N)

    @parametrize("recipe", RECIPES)
    @parametrize("two_d_three_d", [True, False], name_fn=lambda v: "2d_3d" if v else "2d_2d")
    def test_public_api_arguments(self, recipe, two_d_three_d):
        if not hasattr(F, "scaled_grouped_mm"):
            self.skipTest("torch has no torch.nn.functional.scaled_grouped_mm")
        calls = []

        def record(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kwargs):
            calls.append((mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, kwargs))
            # the same operand checks, through the op that has a meta kernel
            return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=kwargs["offs"],
                                            out_dtype=kwargs["output_dtype"],
                                            use_fast_accum=kwargs["use_fast_accum"])

        a, b, sa, sb, offs = self.operands(recipe, two_d_three_d)
        _compat._public_scaled_grouped_mm.cache_clear()
        try:
            with mock.patch.object(F, "scaled_grouped_mm", record):
                out = _cuda.scaled_grouped_mm_native(a, b, sa, sb, offs, recipe)
        finally:
            _compat._public_scaled_grouped_mm.cache_clear()
        built = _cuda.native_operands(a, b, sa, sb, offs, recipe)
        self.assertEqual(len(calls), 1)
        mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, kwargs = calls[0]
        for got, want in zip((mat_a, mat_b, scale_a, scale_b), built):
            self.assertEqual((got.shape, got.stride(), got.dtype),
                             (want.shape, want.stride(), want.dtype))
        scaling = F.ScalingType.RowWise if recipe == "fp8_rowwise" else F.ScalingType.BlockWise1x32
        swizzle = None if recipe == "fp8_rowwise" else F.SwizzleType.SWIZZLE_32_4_4
        self.assertEqual((recipe_a, recipe_b), (scaling, scaling))
        self.assertEqual((kwargs["swizzle_a"], kwargs["swizzle_b"]), (swizzle, swizzle))
        self.assertIs(kwargs["offs"], offs)
        self.assertEqual(kwargs["output_dtype"], torch.bfloat16)
        self.assertIs(kwargs["use_fast_accum"], False)
        self.assertNotIn("bias", kwargs)
        self.assertEqual((out.shape, out.dtype), (self.expected_shape(two_d_three_d),
                                                  torch.bfloat16))

    @unittest.skipUnless(
        torch._C._dispatch_has_kernel_for_dispatch_key("aten::_scaled_grouped_mm_v2", "Meta"),
        "torch has no meta kernel for aten._scaled_grouped_mm_v2 (torch 2.13)",
    )
    @parametrize("recipe", RECIPES)
    @parametrize("two_d_three_d", [True, False], name_fn=lambda v: "2d_3d" if v else "2d_2d")
    def test_public_api_meta_kernel(self, recipe, two_d_three_d):
        a, b, sa, sb, offs = self.operands(recipe, two_d_three_d)
        out = _cuda.scaled_grouped_mm_native(a, b, sa, sb, offs, recipe)
        self.assertEqual((out.shape, out.dtype), (self.expected_shape(two_d_three_d),
                                                  torch.bfloat16))

    @parametrize("recipe", RECIPES)
    @parametrize("two_d_three_d", [True, False], name_fn=lambda v: "2d_3d" if v else "2d_2d")
    def test_private_fallback(self, recipe, two_d_three_d):
        a, b, sa, sb, offs = self.operands(recipe, two_d_three_d)
        with mock.patch.object(_compat, "_public_scaled_grouped_mm", lambda: None), \
                mock.patch.object(torch, "_scaled_grouped_mm",
                                  wraps=torch._scaled_grouped_mm) as private:
            out = _cuda.scaled_grouped_mm_native(a, b, sa, sb, offs, recipe)
        self.assertEqual(private.call_count, 1)
        args, kwargs = private.call_args
        built = _cuda.native_operands(a, b, sa, sb, offs, recipe)
        for got, want in zip(args, built):
            self.assertEqual((got.shape, got.stride(), got.dtype),
                             (want.shape, want.stride(), want.dtype))
        self.assertEqual((kwargs["out_dtype"], kwargs["use_fast_accum"]), (torch.bfloat16, False))
        self.assertEqual((out.shape, out.dtype), (self.expected_shape(two_d_three_d),
                                                  torch.bfloat16))


class TestBlockedScaleLayouts(TestCase):
    """The per-group swizzled layouts of the 2D operands' MX scales (CPU)."""

    def cases(self, seed):
        """(generator, group sizes in rows (multiples of 32, some empty), a small extent for the
        ungrouped dim) over several group counts and extents."""
        gen = torch.Generator().manual_seed(seed)
        for groups in (1, 3, 8):
            for extent in (1, 3, 4, 7, 9):
                yield gen, random_sizes(gen, groups, 32), extent

    def test_row_groups_match_loop(self):
        for gen, sizes, cols in self.cases(0):
            ends = group_ends(sizes)
            tail = 32 * int(torch.randint(0, 3, (), generator=gen))  # rows past offs[-1]
            scale = random_bytes(gen, sum(sizes) + tail, cols)
            with self.subTest(sizes=sizes, cols=cols, tail=tail):
                got = _cuda.to_blocked_row_groups(scale, ends)
                self.assertEqual(got, loop_row_groups(scale, ends), atol=0, rtol=0)
                # e8m0 input gives the same bytes
                from_e8m0 = _cuda.to_blocked_row_groups(scale.view(E8M0), ends)
                self.assertEqual(from_e8m0, got, atol=0, rtol=0)

    def test_col_groups_match_loop(self):
        for gen, sizes, extent in self.cases(1):
            blocks = [s // 32 for s in sizes]  # scale columns per group
            ends = group_ends(blocks)
            tail = int(torch.randint(0, 3, (), generator=gen))  # scale columns past the last group
            rows = extent * 37  # up to 333 rows: several 128-row tiles, the last one partial
            scale = random_bytes(gen, rows, sum(blocks) + tail)
            with self.subTest(blocks=blocks, rows=rows, tail=tail):
                got = _cuda.to_blocked_col_groups(scale, ends)
                self.assertEqual(got, loop_col_groups(scale, ends), atol=0, rtol=0)

    def test_groups_unswizzle_back(self):
        # Independent of the loop: each group's block, read where the kernel reads it (offset
        # from the padded sizes of the earlier groups), unswizzles to that group's scales.
        gen = torch.Generator().manual_seed(2)
        sizes = [96, 0, 160, 32, 0, 288]
        ends = group_ends(sizes)
        scale = random_bytes(gen, sum(sizes) + 64, 5)
        flat = _cuda.to_blocked_row_groups(scale, ends).reshape(-1)
        Cp, pos, start = 8, 0, 0
        for size in sizes:
            n = round_up(size, 128) * Cp
            block = ops.unswizzle_mx_scale(flat[pos : pos + n], size, 5)
            self.assertEqual(block, scale[start : start + size], atol=0, rtol=0)
            pos, start = pos + n, start + size
        self.assertFalse(flat[pos:].any(), "bytes past the last group block must be zero")

        cols = [3, 0, 5, 1]
        scale = random_bytes(gen, 200, sum(cols))
        flat = _cuda.to_blocked_col_groups(scale, group_ends(cols)).reshape(-1)
        pos = start = 0
        for c in cols:
            n = 256 * round_up(c, 4)
            block = ops.unswizzle_mx_scale(flat[pos : pos + n], 200, c)
            self.assertEqual(block, scale[:, start : start + c], atol=0, rtol=0)
            pos, start = pos + n, start + c

    def test_expert_scales_swizzled_per_expert(self):
        # 2D x 3D: expert g's scale is its (N, K/32) matrix swizzled on its own
        G, M, K, N = 3, 64, 96, 48
        gen = torch.Generator().manual_seed(3)
        a, b, _, _, offs = empty_operands("mxfp8", True, G, M, K, N, device="cpu")
        sa = random_bytes(gen, M, K // 32)
        sb = random_bytes(gen, G, K // 32, N)
        offs = group_ends([32, 0, 32])
        _, _, _, built = _cuda.native_operands(a, b, sa, sb, offs, "mxfp8")
        for g in range(G):
            expected = ops.swizzle_mx_scale(sb[g].t())
            self.assertEqual(built[g].view(torch.uint8), expected, atol=0, rtol=0)
            back = ops.unswizzle_mx_scale(built[g].view(torch.uint8), N, K // 32)
            self.assertEqual(back, sb[g].t(), atol=0, rtol=0)

    def test_rowwise_2d_2d_scales_group_major(self):
        # group g's scales of mat_a [K, M] are scale_a[:, g], at [g * K, (g + 1) * K)
        G, M, K, N = 3, 96, 48, 32
        a, b, _, _, offs = empty_operands("fp8_rowwise", False, G, M, K, N, device="cpu")
        sa = torch.arange(G * K, dtype=torch.float32).view(G, K).t()  # [K, G] view
        sb = torch.arange(G * N, dtype=torch.float32).view(G, N)
        _, _, fa, fb = _cuda.native_operands(a, b, sa, sb, group_ends([32, 32, 32]), "fp8_rowwise")
        for g in range(G):
            self.assertEqual(fa[g * K : (g + 1) * K], sa[:, g], atol=0, rtol=0)
            self.assertEqual(fb[g * N : (g + 1) * N], sb[g], atol=0, rtol=0)


class TestDispatch(TestCase):
    def test_native_kernel_supported(self):
        cases = {
            # (recipe, layout, capability): native?
            ("fp8_rowwise", "2d_3d", (9, 0)): True,  # H100 / H200
            ("fp8_rowwise", "2d_2d", (9, 0)): False,  # device assert on empty groups
            ("fp8_rowwise", "2d_3d", (10, 0)): False,  # torch enables FP8 grouped on SM90 only
            ("fp8_rowwise", "2d_3d", (8, 0)): False,
            ("fp8_rowwise", "2d_3d", (8, 9)): False,
            ("fp8_rowwise", "2d_3d", (12, 0)): False,  # rejected by torch._scaled_grouped_mm
            ("mxfp8", "2d_3d", (10, 0)): True,  # B200 / GB200
            ("mxfp8", "2d_2d", (10, 0)): True,
            ("mxfp8", "2d_3d", (10, 3)): True,
            ("mxfp8", "2d_3d", (9, 0)): False,
            ("mxfp8", "2d_2d", (9, 0)): False,
            ("mxfp8", "2d_3d", (11, 0)): False,
            ("mxfp8", "2d_3d", (12, 0)): False,
        }
        for (recipe, layout, cap), expected in cases.items():
            with self.subTest(recipe=recipe, layout=layout, capability=cap):
                self.assertEqual(_cuda.native_kernel_supported(recipe, layout, cap), expected)
        # without MSLK the MXFP8 grouped GEMM is not compiled in
        no_mslk = functools.partial(_cuda.native_kernel_supported, built_with_mslk=False)
        self.assertFalse(no_mslk("mxfp8", "2d_3d", (10, 0)))
        self.assertTrue(no_mslk("fp8_rowwise", "2d_3d", (9, 0)))

    def test_native_shapes_supported(self):
        def ok(two_d_three_d, G, M, K, N):
            a, b, _, _, offs = empty_operands("fp8_rowwise", two_d_three_d, G, M, K, N)
            return _cuda.native_shapes_supported(a, b, offs)

        self.assertTrue(ok(True, 4, 100, 64, 48))  # M need not be aligned in 2D x 3D
        self.assertFalse(ok(True, 4, 128, 40, 48))  # K % 16
        self.assertFalse(ok(True, 4, 128, 64, 40))  # N % 16
        self.assertTrue(ok(False, 4, 128, 40, 48))  # 2D x 2D: M and N, not K
        self.assertFalse(ok(False, 4, 136, 40, 40))
        self.assertTrue(ok(True, 1023, 128, 64, 48))
        self.assertFalse(ok(True, 1024, 128, 64, 48))

    def test_registered_for_cuda(self):
        self.assertTrue(
            torch._C._dispatch_has_kernel_for_dispatch_key("torch_moe::scaled_grouped_mm", "CUDA")
        )
        _cuda.register()  # idempotent


def quantized_operands(recipe, two_d_three_d, sizes, tail, K, N, seed=0):
    """Canonical operands of scaled_grouped_mm from ``quantize_*``, as quantized_grouped_mm
    builds them (2D x 3D: forward; 2D x 2D: weight gradient)."""
    gen = torch.Generator().manual_seed(seed)
    offs = group_ends(sizes)
    M = sum(sizes) + tail

    def quantize(t, dim, offs=None):
        if recipe == "mxfp8":
            return ops.quantize_mxfp8(t, dim)
        return ops.quantize_fp8_rowwise(t, dim, offs)

    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    if two_d_three_d:
        w = torch.randn(len(sizes), K, N, generator=gen).to(torch.bfloat16)
        a, sa = quantize(x, 1)
        b, sb = quantize(w, 1)
        return a, b, sa, sb, offs
    dy = torch.randn(M, N, generator=gen).to(torch.bfloat16)
    xq, sx = quantize(x, 0, offs)
    gq, sg = quantize(dy, 0, offs)
    return xq.t(), gq, sx.t(), sg, offs


class TestEmulatedFallback(TestCase):
    """The bf16 fallback, run on CPU tensors, against the op's fp32-emulation CPU kernel.

    Compared exactly: dequantizing to bf16 is exact for these scales (see
    ``scaled_grouped_mm_emulated_bf16``), and both sides round one fp32 accumulation per group
    to bf16 (torch._grouped_mm computes a bf16 group on CPU as an fp32 GEMM). A BLAS that sums
    in another order could move a result by one bf16 ulp; that would show up here first.
    """

    @parametrize("recipe", RECIPES)
    @parametrize("two_d_three_d", [True, False], name_fn=lambda v: "2d_3d" if v else "2d_2d")
    def test_matches_cpu_kernel(self, recipe, two_d_three_d):
        # empty groups and rows past offs[-1] (2D x 3D) / empty weight gradients (2D x 2D)
        sizes = [64, 0, 96, 32, 0, 128]
        tail = 32 if two_d_three_d else 0
        a, b, sa, sb, offs = quantized_operands(recipe, two_d_three_d, sizes, tail, K=160, N=48)
        expected = ops.scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
        got = _cuda.scaled_grouped_mm_emulated_bf16(a, b, sa, sb, offs, recipe)
        self.assertEqual(got.dtype, torch.bfloat16)
        self.assertEqual(got, expected, atol=0, rtol=0)
        if two_d_three_d:
            self.assertFalse(got[sum(sizes):].any())
        else:
            self.assertFalse(got[1].any() or got[4].any())

    @parametrize("recipe", RECIPES)
    def test_kernel_entry_on_cpu_tensors(self, recipe):
        # The registered function itself, called on CPU tensors: no CUDA device, so it takes the
        # fallback; the result is rounded to bf16 and then cast to out_dtype.
        a, b, sa, sb, offs = quantized_operands(recipe, True, [32, 0, 64], 16, K=64, N=32)
        expected = ops.scaled_grouped_mm(a, b, sa, sb, offs, torch.bfloat16)
        got = _cuda.scaled_grouped_mm_cuda(a, b, sa, sb, offs, torch.float32)
        self.assertEqual(got.dtype, torch.float32)
        self.assertEqual(got, expected.float(), atol=0, rtol=0)
        # all groups empty: every row is past offs[-1], so all zeros
        zero_offs = torch.zeros(3, dtype=torch.int32)
        got = _cuda.scaled_grouped_mm_cuda(a, b, sa, sb, zero_offs, torch.bfloat16)
        zeros = torch.zeros(a.size(0), b.size(2), dtype=torch.bfloat16)
        self.assertEqual(got, zeros, atol=0, rtol=0)

    def test_kernel_entry_empty_contraction(self):
        # K = 0: nothing to multiply, zeros without running a kernel
        M, G, N = 64, 2, 32
        a = torch.zeros(M, 0, dtype=E4M3)
        b = torch.zeros(G, 0, N, dtype=E4M3)
        sa = torch.zeros(M, 0, dtype=torch.uint8)
        sb = torch.zeros(G, 0, N, dtype=torch.uint8)
        got = _cuda.scaled_grouped_mm_cuda(a, b, sa, sb, group_ends([32, 32]), torch.float32)
        self.assertEqual(got, torch.zeros(M, N), atol=0, rtol=0)

    def test_kernel_entry_checks_offsets(self):
        a, b, sa, sb, _ = quantized_operands("mxfp8", True, [32, 64], 0, K=64, N=32)
        bad = torch.tensor([32, 80], dtype=torch.int32)  # group of 48 rows, not a multiple of 32
        with self.assertRaisesRegex(RuntimeError, "every group size to be a multiple of 32"):
            _cuda.scaled_grouped_mm_cuda(a, b, sa, sb, bad, torch.bfloat16)


instantiate_parametrized_tests(TestScaledGroupedMMCall)
instantiate_parametrized_tests(TestEmulatedFallback)


if __name__ == "__main__":
    run_tests()
