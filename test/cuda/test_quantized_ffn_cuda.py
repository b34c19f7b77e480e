# Owner(s): ["module: moe"]
"""The CUDA path of the FP8 rowwise and MXFP8 training recipes (:mod:`torch_moe.quantization`).

* Interpreter (``TRITON_INTERPRET=1``, a subprocess per check): the Triton quantizers in the
  layouts the training path calls them with (activations along K, the weights through their
  transposed view, the weight-gradient operands transposed and, for FP8, grouped by ``offs``)
  bit for bit against the CPU reference kernels; the Triton emulation of the scaled grouped GEMM
  against the CPU kernel; and ``quantized_grouped_mm`` forward and backward with every torch_moe
  op routed to its CUDA implementation, against the CPU op. Aligned groups, empty groups, a tail
  past ``offs[-1]``, T = 0; bf16 / fp16 / fp32.
* Fake CUDA tensors (no interpreter; :class:`CudaPathMode` of ``_host_sync.py``, which fails on
  any host synchronisation): forward and backward of ``quantized_grouped_mm`` for both recipes,
  with and without ``wgrad_high_precision``, through the Triton quantizers and the emulated GEMM;
  the native operand path (aten's scaled grouped GEMM, as on SM90 / SM100) with aten's call
  replaced by a layout check.
* The value checks (misaligned groups, decreasing offsets, bad scales): they raise with the
  values on CPU, and are ``aten._assert_async.msg`` with the same message minus the values on
  fake CUDA tensors and while ``torch.compile`` traces.
* On a GPU (``@onlyCUDA``): the layer with each recipe, forward and backward, against the bf16
  layer; the quantizers and the scaled grouped GEMM against the CPU kernels; no host
  synchronisation under ``torch.cuda.set_sync_debug_mode("error")``.
"""

import contextlib
import re
import unittest
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)
from torch.utils._python_dispatch import TorchDispatchMode

from _host_sync import CudaPathMode
from _interpreter import patch_interpreter_bf16_dot, requires_triton, run_check

import torch_moe  # noqa: F401
from torch_moe.quantization import RECIPES, _checks, _cuda
from torch_moe.quantization._autograd import GROUP_ALIGNMENT

ops = torch.ops.torch_moe
aten = torch.ops.aten
MODULE = "test_quantized_ffn_cuda"


def _ends(sizes) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _randn(shape, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_same_bits(actual, expected, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype} {tuple(actual.shape)} != {expected.dtype} {tuple(expected.shape)}"
    )
    assert actual.is_contiguous(), f"{what}: not contiguous"
    differ = (_bits(actual) != _bits(expected)).sum().item()
    assert differ == 0, f"{what}: {differ} of {actual.numel()} elements differ"


# group sizes: aligned, with an empty group, and a tail of rows past offs[-1]
_SIZES = {"mxfp8": [32, 0, 64], "fp8_rowwise": [16, 0, 48, 16]}
_TAIL = 32


# ---------------------------------------------------------------------------------------------
# Interpreter checks (run in a subprocess with TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def _check_quantizers() -> None:
    """The Triton quantizers against the reference kernels, in the training path's layouts."""
    from torch_moe.quantization import _quantize, _triton

    for recipe in RECIPES:
        offs = _ends(_SIZES[recipe])
        M, K, N, G = int(offs[-1]) + _TAIL, 64, 32, offs.numel()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = _randn((M, K), dtype, 0)
            w = _randn((G, K, N), dtype, 1)
            dy = _randn((M, N), dtype, 2)
            rows = M - M % GROUP_ALIGNMENT[recipe]
            if recipe == "mxfp8":
                cases = [
                    ("x along K", x, 1, None),
                    ("W along K, transposed view", w.transpose(1, 2), 2, None),
                    ("W along N", w, 2, None),
                    ("x^T along M", x.narrow(0, 0, rows).t(), 1, None),
                    ("dy^T along M", dy.narrow(0, 0, rows).t(), 1, None),
                    ("T = 0", x.narrow(0, 0, 0), 1, None),
                ]
            else:
                empty = torch.zeros(G, dtype=torch.int32)
                cases = [
                    ("x along K", x, 1, None),
                    ("W along K, transposed view", w.transpose(1, 2), 2, None),
                    ("x^T along M per group", x.narrow(0, 0, rows).t(), 1, offs),
                    ("dy^T along M per group", dy.narrow(0, 0, rows).t(), 1, offs),
                    ("all groups empty", x.t(), 1, empty),
                    ("T = 0", x.narrow(0, 0, 0).t(), 1, empty),
                ]
            for what, t, dim, group_offs in cases:
                what = f"{recipe} {dtype} {what}"
                if recipe == "mxfp8":
                    got = _triton.mxfp8_quantize(t, dim)
                    want = _quantize.quantize_mxfp8(t, dim)
                else:
                    got = _triton.fp8_rowwise_quantize(t, dim, group_offs)
                    want = _quantize.quantize_fp8_rowwise(t, dim, group_offs)
                _assert_same_bits(got[0], want[0], f"{what}: data")
                _assert_same_bits(got[1], want[1], f"{what}: scale")


def _quantized_operands(recipe, two_d_three_d, M, K, N, offs, dtype=torch.bfloat16):
    """Canonical operands of scaled_grouped_mm as quantized_grouped_mm builds them."""
    G = offs.numel()
    if recipe == "mxfp8":
        def quantize(t, dim, group_offs=None):
            return ops.quantize_mxfp8(t, dim)
    else:
        def quantize(t, dim, group_offs=None):
            return ops.quantize_fp8_rowwise(t, dim, group_offs)
    if two_d_three_d:
        a, sa = quantize(_randn((M, K), dtype, 3), 1)
        bt, sbt = quantize(_randn((G, K, N), dtype, 4).transpose(1, 2), 2)
        return a, bt.transpose(1, 2), sa, sbt.transpose(1, 2)
    xt, sx = quantize(_randn((M, K), dtype, 5).t(), 1, offs)
    gt, sg = quantize(_randn((M, N), dtype, 6).t(), 1, offs)
    return xt, gt.t(), sx, sg.t()


def _check_scaled_grouped_mm() -> None:
    """The Triton emulation of scaled_grouped_mm against the CPU kernel: both layouts, both
    recipes, bf16 / fp16 / fp32 outputs, aligned and empty groups, a tail, T = 0."""
    patch_interpreter_bf16_dot()
    for recipe in RECIPES:
        for sizes, tail in ((_SIZES[recipe], _TAIL), ([0] * 3, 0), ([0] * 3, 32)):
            offs = _ends(sizes)
            M = int(offs[-1]) + tail
            for two_d_three_d in (True, False):
                args = _quantized_operands(recipe, two_d_three_d, M, 64, 32, offs)
                for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
                    got = _cuda.scaled_grouped_mm_emulated_triton(*args, offs, recipe, out_dtype)
                    want = ops.scaled_grouped_mm(*args, offs, out_dtype)
                    what = f"{recipe} {'2Dx3D' if two_d_three_d else '2Dx2D'} {sizes} {out_dtype}"
                    assert got.dtype == out_dtype and got.shape == want.shape, what
                    # bf16: one rounding of the fp32 accumulation (1 ulp); fp32: order only
                    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}
                    torch.testing.assert_close(got, want, rtol=tol[out_dtype], atol=1e-3,
                                               msg=what)
    # FP8 rowwise scales applied to the result: a non-finite row (NaN scale) inside a group is
    # NaN, one past offs[-1] stays zero; an empty group's NaN scales give zeros
    offs = _ends([16, 0, 16])
    x = _randn((48, 64), torch.bfloat16, 10)
    x[3, 5], x[40, 7] = float("inf"), float("nan")
    a, sa = ops.quantize_fp8_rowwise(x, 1)
    bt, sbt = ops.quantize_fp8_rowwise(_randn((3, 64, 32), torch.bfloat16, 11).transpose(1, 2), 2)
    xt, sx = ops.quantize_fp8_rowwise(x.t(), 1, offs)
    gt, sg = ops.quantize_fp8_rowwise(_randn((48, 32), torch.bfloat16, 12).t(), 1, offs)
    sx[:, 1], sg[:, 1] = float("nan"), float("nan")
    for args in ((a, bt.transpose(1, 2), sa, sbt.transpose(1, 2)), (xt, gt.t(), sx, sg.t())):
        got = _cuda.scaled_grouped_mm_emulated_triton(*args, offs, "fp8_rowwise", torch.bfloat16)
        want = ops.scaled_grouped_mm(*args, offs, torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3, equal_nan=True)
        if args[1].dim() == 3:
            assert got[3].isnan().all() and not got[32:].any()
        else:
            assert got[0].isnan().any() and not got[1].any()
        # offs as a strided view (every second element of a longer tensor): read by its strides
        spaced = offs.repeat_interleave(2)
        spaced[1::2] = 48  # the elements between must not be read
        strided = _cuda.scaled_grouped_mm_emulated_triton(*args, spaced[::2], "fp8_rowwise",
                                                          torch.bfloat16)
        torch.testing.assert_close(strided, got, rtol=0, atol=0, equal_nan=True)


class _CudaKernelsOnCpu(TorchDispatchMode):
    """Routes the torch_moe ops to their CUDA implementations on CPU tensors (the Triton
    kernels then run in the interpreter): the quantizers to ``_triton``, the scaled grouped
    GEMM to its checks and Triton emulation, the core ops to ``torch_moe._triton``."""

    def __init__(self):
        super().__init__()
        self.routed = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = self._impl(func)
        if impl is None:
            return func(*args, **kwargs)
        self.routed.add(func.name())
        with self:
            return impl(*args, **kwargs)

    @staticmethod
    def _impl(func):
        from torch_moe import _triton as core
        from torch_moe.quantization import _kernels, _scaled_grouped_mm

        if func.namespace != "torch_moe":
            return None
        name = func._schema.name.split("::", 1)[1]
        if name in _kernels.TRITON_KERNELS:
            return _kernels.triton_kernel(name)
        if name == "scaled_grouped_mm":
            def emulated(a, b, sa, sb, offs, out_dtype=torch.bfloat16):
                recipe = _scaled_grouped_mm.check_scaled_grouped_mm(a, b, sa, sb, offs, out_dtype)
                return _cuda.scaled_grouped_mm_emulated_triton(a, b, sa, sb, offs, recipe,
                                                               out_dtype)
            return emulated
        if name in core.CUDA_KERNEL_MODULES:
            return core.cuda_kernel(name)
        # the composite kernels (quantized_grouped_mm, the dequantizers), called here so that
        # the ops they call are routed too
        return _kernels._DEVICE_GENERIC_KERNELS.get(name)


def _check_quantized_grouped_mm() -> None:
    """quantized_grouped_mm forward and backward through the CUDA implementations against the
    CPU op: the quantizers are bitwise equal, so the GEMMs differ by summation order only."""
    patch_interpreter_bf16_dot()
    for recipe in RECIPES:
        for sizes, tail in ((_SIZES[recipe], _TAIL), ([0] * 3, 0)):
            offs = _ends(sizes)
            M, K, N, G = int(offs[-1]) + tail, 64, 32, offs.numel()
            x = _randn((M, K), torch.bfloat16, 7)
            w = (_randn((G, K, N), torch.float32, 8) / 8).bfloat16()
            dy = _randn((M, N), torch.bfloat16, 9)
            for hp in (False, True):
                cuda_path = _CudaKernelsOnCpu()
                results = []
                for mode in (cuda_path, contextlib.nullcontext()):
                    xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
                    with mode:
                        out = ops.quantized_grouped_mm(xi, wi, offs, recipe, "rceil", hp)
                        out.backward(dy)
                    results.append((out, xi.grad, wi.grad))
                quantizer = "quantize_mxfp8" if recipe == "mxfp8" else "quantize_fp8_rowwise"
                expected = {f"torch_moe::{quantizer}", "torch_moe::scaled_grouped_mm"}
                assert expected <= cuda_path.routed, cuda_path.routed
                for name, got, want in zip(("out", "grad_input", "grad_weight"), *results):
                    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3,
                                               msg=f"{recipe} {sizes} hp={hp} {name}")
                if tail:  # rows past offs[-1]: no output, no gradient
                    assert not results[0][0][int(offs[-1]):].any()
                    assert not results[0][1][int(offs[-1]):].any()


@requires_triton
class TestQuantizedPathInterpreted(TestCase):
    def test_quantizers(self):
        run_check(self, MODULE, "_check_quantizers")

    def test_scaled_grouped_mm(self):
        run_check(self, MODULE, "_check_scaled_grouped_mm")

    def test_quantized_grouped_mm(self):
        run_check(self, MODULE, "_check_quantized_grouped_mm")


# ---------------------------------------------------------------------------------------------
# Fake CUDA tensors: no host synchronisation (no interpreter; tensors on meta stand for CUDA
# ones, see _host_sync.py)
# ---------------------------------------------------------------------------------------------

DEVICE = "meta"


class _RecordingCudaPathMode(CudaPathMode):
    """:class:`CudaPathMode` that also records every op it sees (with its arguments)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def asserts(self) -> list:
        return [args[1] for func, args in self.ops if func is aten._assert_async.msg]


@contextlib.contextmanager
def _fake_cuda():
    with FakeTensorMode(), _RecordingCudaPathMode() as mode:
        yield mode


@requires_triton
class TestNoHostSyncQuantized(TestCase):
    @parametrize("recipe", RECIPES)
    @parametrize("wgrad_high_precision", [False, True])
    def test_quantized_grouped_mm_forward_backward(self, recipe, wgrad_high_precision):
        from torch_moe.quantization import _triton

        quantizer = "mxfp8_quantize" if recipe == "mxfp8" else "fp8_rowwise_quantize"
        spy = mock.patch.object(_triton, quantizer, wraps=getattr(_triton, quantizer))
        with spy as calls, _fake_cuda() as mode:
            S, K, N, G = 160, 64, 96, 4  # S: the static slot bound T * k + G * (align - 1)
            x = torch.randn(S, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(G, K, N, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            offs = torch.empty(G, device=DEVICE, dtype=torch.int32)
            out = ops.quantized_grouped_mm(x, w, offs, recipe, "rceil", wgrad_high_precision)
            out.sum().backward()
        self.assertEqual(out.shape, (S, N))
        self.assertEqual((x.grad.shape, w.grad.shape), (x.shape, w.shape))
        self.assertEqual(w.grad.dtype, torch.bfloat16)
        # forward: input and W; dgrad: dy and W; wgrad: x^T and dy^T unless in high precision
        self.assertEqual(calls.call_count, 4 if wgrad_high_precision else 6)
        self.assertEqual(mode.calls["scaled_grouped_mm"], 2 if wgrad_high_precision else 3)
        if wgrad_high_precision:
            self.assertEqual(mode.calls["grouped_mm"], 1)
        self.assertIn(
            f"torch_moe.quantized_grouped_mm: expected every group size to be a multiple of "
            f"{GROUP_ALIGNMENT[recipe]} (blocks must not straddle groups; pad groups with "
            f"token_sort(..., align={GROUP_ALIGNMENT[recipe]}))", mode.asserts())

    @parametrize("recipe", RECIPES)
    @parametrize("fused_w13", [True, False])
    def test_quantized_expert_ffn_forward_backward(self, recipe, fused_w13):
        # the whole quantized FFN: token sort with the recipe's alignment, permute, the three
        # quantized GEMMs, the activation, unpermute, and their backward
        from torch_moe.nn.functional import moe_ffn

        with _fake_cuda() as mode:
            T, D, F, E, k = 24, 64, 32, 4, 2
            x = torch.randn(T, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            ids = torch.randint(0, E, (T, k), device=DEVICE)
            weights = torch.rand(T, k, device=DEVICE, requires_grad=True)
            w1 = torch.randn(E, D, 2 * F if fused_w13 else F, device=DEVICE,
                             dtype=torch.bfloat16, requires_grad=True)
            w3 = None if fused_w13 else torch.randn_like(w1, requires_grad=True)
            w2 = torch.randn(E, F, D, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
            out = moe_ffn(x, ids, weights, w1, w2, w3, precision=recipe)
            out.float().sum().backward()
        self.assertEqual(out.shape, (T, D))
        self.assertEqual(x.grad.shape, x.shape)
        self.assertEqual(mode.calls["quantized_grouped_mm"], 2 if fused_w13 else 3)
        self.assertGreater(mode.calls["token_sort"], 0)

    @parametrize("recipe", RECIPES)
    def test_native_operands(self, recipe):
        # aten's scaled grouped GEMM (SM90 FP8 rowwise 2D x 3D, SM100 MXFP8) has no fake kernel
        # for CUDA in a CPU build of torch; check the layouts it is given and that everything
        # before it runs without a host synchronisation.
        seen = []

        def fake_aten(a, b, sa, sb, *, recipe, offs, out_dtype, use_fast_accum):
            seen.append((a, b, sa, sb))
            # the kernels read offs[g] at offs + g: a strided offs must arrive contiguous
            self.assertTrue(offs.is_contiguous())
            G = offs.size(0)
            shape = (a.size(0), b.size(-1)) if b.dim() == 3 else (G, a.size(0), b.size(1))
            return torch.empty(shape, dtype=out_dtype, device=a.device)

        from torch_moe.quantization._grouped_mm import quantize

        layouts = (True, False) if recipe == "mxfp8" else (True,)
        given = []
        with mock.patch.object(_cuda._compat, "scaled_grouped_mm", fake_aten), _fake_cuda():
            for two_d_three_d in layouts:
                G, K, N = 4, 64, 96
                M = 160
                offs = torch.empty(2 * G, device=DEVICE, dtype=torch.int32)[::2]  # strided
                if two_d_three_d:
                    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
                    w = torch.randn(G, K, N, device=DEVICE, dtype=torch.bfloat16)
                    a, sa = quantize(x, 1, recipe, "rceil")
                    bt, sbt = quantize(w.transpose(1, 2), 2, recipe, "rceil")
                    args = (a, bt.transpose(1, 2), sa, sbt.transpose(1, 2))
                else:
                    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
                    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
                    xt, sx = ops.quantize_mxfp8(x.t(), 1)
                    gt, sg = ops.quantize_mxfp8(dy.t(), 1)
                    args = (xt, gt.t(), sx, sg.t())
                out = _cuda.scaled_grouped_mm_native(*args, offs, recipe)
                self.assertEqual(out.dtype, torch.bfloat16)
                given.append(args)
        self.assertEqual(len(seen), len(layouts))
        for (a, b, sa, sb), (qa, qb, *_) in zip(seen, given):
            # row-major mat_a, column-major mat_b: the quantized tensors themselves, no copy
            self.assertIs(a, qa)
            self.assertIs(b, qb)
            self.assertTrue(b.transpose(-2, -1).is_contiguous())
            if recipe == "mxfp8":
                self.assertEqual((sa.dtype, sb.dtype), (torch.float8_e8m0fnu,) * 2)
            else:
                self.assertEqual((sa.shape, sb.shape), ((M,), (G, N)))



class _AllocatedBytes(TorchDispatchMode):
    """Sums the bytes of the new tensors that ops return (outputs that alias an input, of views
    and in-place ops, allocate nothing): an upper bound of the peak memory above the inputs.
    An op's own temporaries (inside the Triton GEMM's triton_op) are not seen."""

    def __init__(self):
        super().__init__()
        self.allocated = []  # (op, shape, dtype, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                self.allocated.append((func, tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return out

    @property
    def total(self) -> int:
        return sum(entry[-1] for entry in self.allocated)


@requires_triton
class TestEmulationMemory(TestCase):
    """The FP8 rowwise Triton emulation allocates its result, the copies of the E4M3 operands
    in the GEMM's dtype and index-sized temporaries, nothing else of the result's size (the
    scales are applied in place): checked on fake tensors at the size of Qwen3-30B-A3B's w13
    weight gradient (G = 128, K = 2048, N = 1536), which allocates nothing."""

    @parametrize("out_dtype", [torch.bfloat16, torch.float32])
    @parametrize("two_d_three_d", [True, False], name_fn=lambda v: "2d_3d" if v else "2d_2d")
    def test_fp8_rowwise_allocations(self, out_dtype, two_d_three_d):
        G, K, N, M = 128, 2048, 1536, 8192
        e4m3, f32 = torch.float8_e4m3fn, torch.float32
        with FakeTensorMode():
            offs = torch.empty(G, device=DEVICE, dtype=torch.int32)
            if two_d_three_d:
                args = (torch.empty(M, K, device=DEVICE, dtype=e4m3),
                        torch.empty(G, N, K, device=DEVICE, dtype=e4m3).transpose(1, 2),
                        torch.empty(M, 1, device=DEVICE, dtype=f32),
                        torch.empty(G, N, 1, device=DEVICE, dtype=f32).transpose(1, 2))
            else:
                args = (torch.empty(M, K, device=DEVICE, dtype=e4m3).t(),
                        torch.empty(N, M, device=DEVICE, dtype=e4m3).t(),
                        torch.empty(G, K, device=DEVICE, dtype=f32).t(),
                        torch.empty(N, G, device=DEVICE, dtype=f32).t())
            with _AllocatedBytes() as counted:
                out = _cuda.scaled_grouped_mm_emulated_triton(*args, offs, "fp8_rowwise",
                                                              out_dtype)
        gemm_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
        itemsize = torch.empty((), dtype=gemm_dtype).element_size()
        result = out.numel() * itemsize
        # the GEMM's operands: the E4M3 tokens cast (and, 2D x 3D, the dequantized weights)
        operands = (args[0].numel() + args[1].numel()) * itemsize
        # everything else is index-sized (scales, row / group masks)
        small = 4 * (M + G * (K + N)) * 4
        self.assertLessEqual(
            counted.total, result + operands + small,
            msg="\n".join(f"{op} {shape} {dtype}: {n / 2**20:.1f} MiB"
                           for op, shape, dtype, n in counted.allocated if n > 2**20),
        )


# ---------------------------------------------------------------------------------------------
# Value checks: raise on CPU (with the values), device asserts elsewhere (without them)
# ---------------------------------------------------------------------------------------------

_OP = "torch_moe.scaled_grouped_mm"
# (offs, limit, multiple, the CPU error message); the device message is its part before ", but"
_BAD_OFFS = [
    ((32, 80), 96, 32, f"{_OP}: expected every group size to be a multiple of 32 (blocks must "
     f"not straddle groups; pad groups with token_sort(..., align=32)), but group 1 has 48 rows "
     f"(offs[1] = 80)"),
    ((64, 32), 96, 32, f"{_OP}: expected offs to be non-decreasing and non-negative, but offs[1] "
     f"= 32 < offs[0] = 64"),
    ((-16, 16), 96, 32, f"{_OP}: expected offs to be non-decreasing and non-negative, but offs[0] "
     f"= -16 < 0"),
    ((32, 128), 96, 32, f"{_OP}: expected offs[-1] <= 96, but got 128"),
]
_BAD_SCALES = [
    (float("inf"), f"{_OP}: expected scale_a to hold positive finite scales (or NaN for a "
     f"non-finite row), but got inf at index (1, 0)"),
    (0.0, f"{_OP}: expected scale_a to hold positive finite scales (or NaN for a non-finite "
     f"row), but got 0.0 at index (1, 0)"),
]


def _device_message(cpu_message: str) -> str:
    return cpu_message.split(", but")[0]


class TestValueChecks(TestCase):
    def test_raise_on_cpu_with_values(self):
        for offs, limit, multiple, message in _BAD_OFFS:
            with self.subTest(offs=offs), self.assertRaises(RuntimeError) as ctx:
                _checks.check_group_offsets(_OP, torch.tensor(offs, dtype=torch.int32), limit,
                                            multiple)
            self.assertEqual(str(ctx.exception), message)
        for value, message in _BAD_SCALES:
            scale = torch.ones(4, 1)
            scale[1, 0] = value
            with self.subTest(value=value), self.assertRaises(RuntimeError) as ctx:
                _checks.check_rowwise_scale_values(_OP, "scale_a", scale)
            self.assertEqual(str(ctx.exception), message)

    @requires_triton
    def test_device_asserts_on_fake_cuda(self):
        # every check becomes an on-device assert with the message minus the values; the
        # values are never read (no host synchronisation: CudaPathMode would fail)
        with _fake_cuda() as mode:
            for offs, limit, multiple, _ in _BAD_OFFS:
                _checks.check_group_offsets(
                    _OP, torch.empty(len(offs), device=DEVICE, dtype=torch.int32), limit, multiple)
            _checks.check_rowwise_scale_values(_OP, "scale_a", torch.empty(4, 1, device=DEVICE))
        expected = {_device_message(m) for *_, m in _BAD_OFFS} | {
            _device_message(m) for _, m in _BAD_SCALES}
        self.assertEqual(set(mode.asserts()), expected)

    @requires_triton
    def test_scaled_grouped_mm_asserts_on_fake_cuda(self):
        # the CUDA kernel of the op checks offsets and FP8 scales on the device
        with _fake_cuda() as mode:
            M, K, N, G = 64, 32, 48, 2
            a = torch.empty(M, K, device=DEVICE, dtype=torch.float8_e4m3fn)
            b = torch.empty(G, K, N, device=DEVICE, dtype=torch.float8_e4m3fn)
            sa = torch.empty(M, 1, device=DEVICE)
            sb = torch.empty(G, 1, N, device=DEVICE)
            offs = torch.empty(G, device=DEVICE, dtype=torch.int32)
            ops.scaled_grouped_mm(a, b, sa, sb, offs)
        self.assertEqual(mode.calls["scaled_grouped_mm"], 1)
        self.assertIn(_device_message(_BAD_OFFS[0][3]).replace("32", "16"), mode.asserts())
        self.assertIn(_device_message(_BAD_SCALES[0][1]).replace("scale_a", "scale_b"),
                      mode.asserts())

    def test_device_asserts_while_compiling(self):
        # traced by Dynamo on CPU tensors: no value read (fullgraph), the assert raises at run
        def check(scale):
            _checks.check_rowwise_scale_values(_OP, "scale_a", scale)
            return scale * 2

        torch._dynamo.reset()
        compiled = torch.compile(check, backend="eager", fullgraph=True)
        compiled(torch.ones(4, 1))
        with self.assertRaisesRegex(RuntimeError, re.escape(_device_message(_BAD_SCALES[0][1]))):
            compiled(torch.tensor([[1.0], [float("inf")]]))
        # the offsets' checks take the same branch while compiling: the device messages
        with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
            for offs, limit, multiple, message in _BAD_OFFS:
                with self.subTest(offs=offs), self.assertRaises(RuntimeError) as ctx:
                    _checks.check_group_offsets(_OP, torch.tensor(offs, dtype=torch.int32),
                                                limit, multiple)
                self.assertEqual(str(ctx.exception), _device_message(message))


# ---------------------------------------------------------------------------------------------
# On a GPU
# ---------------------------------------------------------------------------------------------


def _sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


class TestQuantizedFFNCUDA(TestCase):
    """The recipes on a GPU (FP8 needs sm_89 or newer): whichever GEMM the device has, aten's
    native kernel (SM90 FP8 rowwise, SM100 MXFP8) or the Triton emulation."""

    def setUp(self):
        super().setUp()
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            raise unittest.SkipTest("FP8 needs sm_89 or newer")

    @staticmethod
    def _inputs(device):
        g = torch.Generator().manual_seed(0)
        T, D, F, E, k = 512, 256, 128, 8, 2
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.randint(0, E - 1, (T, k), generator=g)  # expert E - 1 gets no tokens
        weights = torch.rand(T, k, generator=g)
        w1 = (torch.randn(E, D, 2 * F, generator=g) / D**0.5).bfloat16()
        w2 = (torch.randn(E, F, D, generator=g) / F**0.5).bfloat16()
        dy = torch.randn(T, D, generator=g).bfloat16()
        return [t.to(device) for t in (x, ids, weights, w1, w2, dy)]

    @staticmethod
    def _run(inputs, precision, wgrad_high_precision=False):
        from torch_moe.nn.functional import moe_ffn

        x, ids, weights, w1, w2, dy = inputs
        params = [t.detach().requires_grad_() for t in (x, w1, w2)]
        out = moe_ffn(params[0], ids, weights, params[1], params[2], precision=precision,
                      wgrad_high_precision=wgrad_high_precision)
        out.backward(dy)
        return [out] + [p.grad for p in params]

    def _layer(self, device, precision, wgrad_high_precision=False):
        return self._run(self._inputs(device), precision, wgrad_high_precision)

    @onlyCUDA
    @parametrize("precision", RECIPES)
    @parametrize("wgrad_high_precision", [False, True])
    def test_layer_against_bf16(self, device, precision, wgrad_high_precision):
        # the CPU kernels measure 23.7 dB for every tensor (25 dB for the high-precision
        # weight gradients): four E4M3 roundings in a row (x, W1, the activation, W2)
        ref = self._layer(device, "bf16")
        got = self._layer(device, precision, wgrad_high_precision)
        for name, r, a in zip(("out", "grad_x", "grad_w1", "grad_w2"), ref, got):
            self.assertEqual(a.dtype, r.dtype)
            self.assertGreaterEqual(_sqnr(r, a), 21.0, msg=f"{precision} {name}")

    @onlyCUDA
    @parametrize("precision", RECIPES)
    def test_layer_matches_cpu_kernels(self, device, precision):
        # the same quantization bit for bit; the GEMMs differ by summation order (and the
        # native FP8 kernel's accumulation): close to the CPU result, far closer than to bf16
        got = self._layer(device, precision)
        want = self._layer("cpu", precision)
        for name, a, w in zip(("out", "grad_x", "grad_w1", "grad_w2"), got, want):
            self.assertGreaterEqual(_sqnr(w, a.cpu()), 35.0, msg=f"{precision} {name}")

    @onlyCUDA
    def test_quantizers_match_reference(self, device):
        from torch_moe.quantization import _quantize

        offs = _ends([128, 0, 256, 64])
        x = _randn((512, 256), torch.bfloat16, 0, device)
        for t, dim in ((x, 1), (x.t(), 1), (x.view(4, 128, 256).transpose(1, 2), 2)):
            for mode in ("rceil", "floor"):
                got = ops.quantize_mxfp8(t, dim, scale_mode=mode)
                want = _quantize.quantize_mxfp8(t.cpu(), dim, scale_mode=mode)
                for a, w in zip(got, want):
                    _assert_same_bits(a.cpu(), w, f"mxfp8 {tuple(t.shape)} {mode}")
        for t, dim, group_offs in ((x, 1, None), (x.t(), 1, offs), (x, 0, offs)):
            got = ops.quantize_fp8_rowwise(t, dim, None if group_offs is None else
                                           group_offs.to(device))
            want = _quantize.quantize_fp8_rowwise(t.cpu(), dim, group_offs)
            for a, w in zip(got, want):
                _assert_same_bits(a.cpu(), w, f"fp8 rowwise {tuple(t.shape)}")

    @onlyCUDA
    @parametrize("recipe", RECIPES)
    def test_scaled_grouped_mm_matches_cpu(self, device, recipe):
        offs = _ends([128, 0, 256, 128])
        for two_d_three_d in (True, False):
            M = int(offs[-1]) + (64 if two_d_three_d else 0)
            args = _quantized_operands(recipe, two_d_three_d, M, 256, 128, offs)
            want = ops.scaled_grouped_mm(*args, offs)
            got = ops.scaled_grouped_mm(*[t.to(device) for t in args], offs.to(device))
            torch.testing.assert_close(got.cpu(), want, rtol=2**-6, atol=1e-2)

    @onlyCUDA
    @parametrize("precision", RECIPES)
    def test_no_host_sync(self, device, precision):
        inputs = self._inputs(device)
        self._run(inputs, precision)  # first call: kernels compile, caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            self._run(inputs, precision)
        finally:
            torch.cuda.set_sync_debug_mode("default")


instantiate_parametrized_tests(TestNoHostSyncQuantized)
instantiate_parametrized_tests(TestEmulationMemory)
instantiate_device_type_tests(TestQuantizedFFNCUDA, globals(), only_for="cuda")

if __name__ == "__main__":
    run_tests()
