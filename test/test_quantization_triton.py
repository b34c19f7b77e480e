# Owner(s): ["module: moe"]
"""The Triton kernels of ``quantize_mxfp8`` / ``quantize_fp8_rowwise``
(:mod:`torch_moe.quantization._triton`) against the reference kernels, bit for bit: data bytes,
E8M0 scale bytes and fp32 scale bits, on random data and on the boundaries of the scale rules
and of FP8 rounding (saturation, subnormal amax, zero / Inf / NaN blocks), for both element
dtypes, both scale rules, blocked along rows and along columns.

The kernels run on CPU tensors under ``TRITON_INTERPRET=1``, in a subprocess per test: the
variable must be set before triton is imported, and must not leak into other tests (it would
turn every Triton kernel in this process into the interpreter). Shapes are kept small, since
the interpreter is slow. The subprocess imports this file and runs one of the ``_check_*``
functions below.

Data bytes of NaN blocks compare as NaN of either sign: the kernels write 0x7F, the reference's
sign of NaN varies with ATen's CPU vector paths (its vectorized clamp returns a negative NaN,
its scalar tail a positive one). Scale bytes and fp32 scales compare bit for bit.
"""

import importlib.util
import os
import subprocess
import sys
import unittest

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

HAS_TRITON = importlib.util.find_spec("triton") is not None
_TEST_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_DIR = os.path.dirname(_TEST_DIR)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ELEM_DTYPES = (E4M3, E5M2)
SCALE_MODES = ("rceil", "floor")


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` as an integer tensor (NaN compares equal to the same NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_bits_equal(actual, expected, what: str, nan_sign: bool = True) -> None:
    """Bitwise equality; with ``nan_sign=False`` a NaN matches a NaN of either sign."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a, e = _bits(actual.contiguous()), _bits(expected.contiguous())
    differ = a != e
    if not nan_sign:
        differ &= ~(actual.float().isnan() & expected.float().isnan())
    bad = differ.nonzero()
    if bad.numel():
        first = [(tuple(i.tolist()), hex(int(a[tuple(i)])), hex(int(e[tuple(i)]))) for i in bad[:5]]
        raise AssertionError(
            f"{what}: {bad.size(0)} of {a.numel()} differ; (index, triton, reference): {first}"
        )


def _compare_mxfp8(x, dim, elem_dtype, scale_mode, what) -> None:
    from torch_moe.quantization import _triton

    data, scale = _triton.mxfp8_quantize(x, dim, elem_dtype, scale_mode)
    ref_data, ref_scale = torch.ops.torch_moe.quantize_mxfp8(x, dim, elem_dtype, scale_mode)
    what = f"{what} {x.dtype} {tuple(x.shape)} dim={dim} {elem_dtype} {scale_mode}"
    _assert_bits_equal(scale, ref_scale, f"mxfp8 scale {what}")
    _assert_bits_equal(data, ref_data, f"mxfp8 data {what}", nan_sign=False)


def _compare_rowwise(x, dim, what, offs=None) -> None:
    from torch_moe.quantization import _triton

    data, scale = _triton.fp8_rowwise_quantize(x, dim, offs)
    ref_data, ref_scale = torch.ops.torch_moe.quantize_fp8_rowwise(x, dim, offs)
    what = f"{what} {x.dtype} {tuple(x.shape)} dim={dim} offs={offs}"
    _assert_bits_equal(scale, ref_scale, f"fp8 rowwise scale {what}")
    _assert_bits_equal(data, ref_data, f"fp8 rowwise data {what}", nan_sign=False)


def _f32(bits) -> torch.Tensor:
    """fp32 tensor of the given bit patterns."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


# Block amaxes at the edges of the scale rules and of FP8 rounding, as fp32 bit patterns.
_BOUNDARY_AMAX_BITS = [
    0x43E00000,  # 448, the e4m3 max: RCEIL lands exactly on 2**0 or one binade up
    0x43DFFFFF, 0x43E00001,  # 448 -+ 1 ulp
    0x43F00000,  # 480, past the e4m3 max
    0x47600000, 0x47700000,  # 57344 (e5m2 max), 61440
    0x7F7FFFFF,  # fp32 max: the largest finite scales (Inf in bf16)
    0x7F7F0000,  # bf16 max
    0x43FFFFFF,  # 511.99997: FLOOR's binade edge
    0x40600001,  # 3.5 + 1 ulp: mantissa bits past the e4m3 ones
    0x00800000,  # 2**-126, the smallest normal fp32
    0x00010000,  # 2**-133, the smallest bf16 subnormal
    0x00000001,  # 2**-149, the smallest fp32 subnormal
    # RCEIL products fl32(amax / max_normal) about 2**-127 (byte 0 | 1, a subnormal product) and
    # 2**-126 (byte 1 | 2): amax about 448 * 2**-127, 448 * 2**-126 (e4m3), 57344 * ... (e5m2)
    0x045FFFFF, 0x04600000, 0x04600001, 0x04600002,
    0x04DFFFFF, 0x04E00000, 0x04E00001,
    0x07DFFFFF, 0x07E00000, 0x07E00001, 0x07E00002,
    0x085FFFFF, 0x08600000, 0x08600001,
    0x3F800000,  # 1.0
    0x00000000,  # an all-zero block
    0x7F800000, 0xFF800000,  # +Inf, -Inf: the block is NaN
    0x7FC00000, 0xFFC00000,  # NaN, -NaN: the block is NaN
    0xC3E00000, 0xBF800000,  # -448, -1: amax from a negative value
]


def _boundary_matrix(dtype: torch.dtype) -> torch.Tensor:
    """[n, 64]: row i is two blocks of 32, the first with amax ``_BOUNDARY_AMAX_BITS[i]``
    (converted to ``dtype``), the second 2**-20 times smaller (so a row has two scales)."""
    g = torch.Generator().manual_seed(0)
    amax = _f32(_BOUNDARY_AMAX_BITS).to(dtype).float()
    n = amax.numel()
    u = torch.rand(n, 64, generator=g) * 2 - 1
    finite = torch.isfinite(amax)
    scale = torch.where(finite, amax.abs(), 1.0)[:, None]
    x = u * scale * torch.cat([torch.ones(32), torch.full((32,), 2.0**-20)])
    x[:, 7] = torch.where(finite, amax, 1.0)  # the amax itself, sign included
    x[:, 3] = torch.where(finite, x[:, 3], amax)  # Inf / NaN inside an otherwise finite block
    x[:, 40] = x[:, 40].abs().neg()  # a negative value in every second block
    return x.to(dtype)


def _midpoint_matrix(elem_dtype: torch.dtype) -> torch.Tensor:
    """Blocks of 32: max_normal, then FP8 values, midpoints between neighbours (ties to even)
    and the fp32 values next to them, both signs. FLOOR gives such a block the factor 1."""
    fp8 = torch.arange(256, dtype=torch.uint8).view(elem_dtype).float()
    fp8 = fp8[torch.isfinite(fp8) & (fp8 >= 0)].sort().values
    mids = ((fp8[1:].double() + fp8[:-1].double()) / 2).float()
    below, above = torch.nextafter(mids, torch.zeros(())), torch.nextafter(mids, fp8[-1])
    vals = torch.cat([fp8, mids, below, above])
    vals = torch.cat([vals, -vals])
    vals = torch.cat([vals, vals.new_zeros(-vals.numel() % 31)]).view(-1, 31)
    return torch.cat([vals.new_full((vals.size(0), 1), fp8[-1].item()), vals], 1)


def _random_matrix(shape, dtype, seed) -> torch.Tensor:
    """Normal values times a power of two per row, from 2**-24 to 2**24 (2**-12 to 2**12 for
    fp16, which must not overflow to Inf)."""
    g = torch.Generator().manual_seed(seed)
    e = 12 if dtype == torch.float16 else 24
    mag = 2.0 ** torch.randint(-e, e + 1, (shape[0],) + (1,) * (len(shape) - 1), generator=g)
    return (torch.randn(shape, generator=g) * mag).to(dtype)


def _check_mxfp8_random() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        rows = _random_matrix((8, 64), dtype, 0)
        cols = _random_matrix((64, 8), dtype, 1)
        cube = _random_matrix((2, 64, 3), dtype, 2)
        for elem_dtype in ELEM_DTYPES:
            for mode in SCALE_MODES:
                _compare_mxfp8(rows, -1, elem_dtype, mode, "random rows")
                _compare_mxfp8(cols, 0, elem_dtype, mode, "random columns")
                _compare_mxfp8(cube, 1, elem_dtype, mode, "random 3-D")
                _compare_mxfp8(cube.transpose(1, 2).contiguous(), 2, elem_dtype, mode, "random 3-D")
                # transposed views: the kernel writes the transposed copy
                _compare_mxfp8(cols.t(), 1, elem_dtype, mode, "random transposed")
                _compare_mxfp8(cube.transpose(1, 2), 2, elem_dtype, mode, "random 3-D transposed")


def _check_mxfp8_boundary() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = _boundary_matrix(dtype)
        for elem_dtype in ELEM_DTYPES:
            for mode in SCALE_MODES:
                _compare_mxfp8(x, -1, elem_dtype, mode, "boundary rows")
                _compare_mxfp8(x.t().contiguous(), 0, elem_dtype, mode, "boundary columns")
    # every bf16 smallest subnormal / fp32 smallest subnormal block is scaled by 2**127 exactly
    tiny = torch.tensor([[2.0**-133] * 32, [2.0**-149] * 32])
    for mode in SCALE_MODES:
        _compare_mxfp8(tiny, -1, E4M3, mode, "tiny")
    for elem_dtype in ELEM_DTYPES:
        x = _midpoint_matrix(elem_dtype)
        _compare_mxfp8(x, -1, elem_dtype, "floor", "midpoints rows")
        _compare_mxfp8(x[:8].t().contiguous(), 0, elem_dtype, "floor", "midpoints columns")


def _check_fp8_rowwise() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        _compare_rowwise(_random_matrix((8, 48), dtype, 3), -1, "random rows")
        _compare_rowwise(_random_matrix((48, 8), dtype, 4), 0, "random columns")
        _compare_rowwise(_random_matrix((2, 40, 3), dtype, 5), 1, "random 3-D")
    for dtype in (torch.bfloat16, torch.float32):
        x = _boundary_matrix(dtype)
        _compare_rowwise(x, -1, "boundary rows")
        _compare_rowwise(x.t().contiguous(), 0, "boundary columns")
        # one boundary value per row, alone (the row's amax is that value)
        _compare_rowwise(x[:, :32].contiguous(), -1, "boundary rows, one block")
    _compare_rowwise(_midpoint_matrix(E4M3), -1, "midpoints")
    # rows longer than one tile step: the amax pass and the quantize pass loop
    _compare_rowwise(_random_matrix((3, 2100), torch.bfloat16, 6), -1, "long rows")
    # transposed views (the kernel writes the transposed copy)
    _compare_rowwise(_random_matrix((48, 8), torch.float32, 9).t(), 1, "transposed")
    _compare_rowwise(_random_matrix((2, 40, 3), torch.float16, 10).transpose(1, 2), 2, "3-D transposed")


def _check_fp8_rowwise_grouped() -> None:
    """One scale per group of ``dim`` (the weight-gradient operands): empty groups, one group
    holding everything, all groups empty, a tail past offs[-1] (zeros), T = 0, transposed views,
    the boundary values (Inf / NaN rows) inside groups."""
    cases = [(16, 16, 40, 41), (0, 48, 48, 48), (0, 0, 0, 0), (48,)]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _random_matrix((48, 8), dtype, 11)
        for ends in cases:
            offs = torch.tensor(ends, dtype=torch.int32)
            _compare_rowwise(x, 0, "grouped columns", offs)
            _compare_rowwise(x.t(), 1, "grouped, transposed view", offs)
        _compare_rowwise(x[:0], 0, "grouped, T = 0", torch.zeros(4, dtype=torch.int32))
        _compare_rowwise(_random_matrix((2, 40, 3), dtype, 12), 1, "grouped 3-D",
                         torch.tensor([8, 8, 32], dtype=torch.int32))
    for dtype in (torch.bfloat16, torch.float32):
        x = _boundary_matrix(dtype)  # [n, 64]
        offs = torch.tensor([16, 16, 40, 41], dtype=torch.int32)
        _compare_rowwise(x.t(), 0, "grouped boundary columns", offs)
        _compare_rowwise(x, 1, "grouped boundary rows", offs)
    # offs as a strided view (every second element of a longer tensor): read by its strides
    x = _random_matrix((48, 8), torch.float32, 14)
    for ends in cases[:2]:
        spaced = torch.tensor(ends, dtype=torch.int32).repeat_interleave(2)
        spaced[1::2] = 47  # the elements between must not be read
        _compare_rowwise(x, 0, "grouped, strided offs", spaced[::2])
        _compare_rowwise(x.t(), 1, "grouped, transposed view, strided offs", spaced[::2])
    # long groups: the amax pass and the quantize pass loop
    x = _random_matrix((3, 2100), torch.bfloat16, 13)
    _compare_rowwise(x, 1, "long groups", torch.tensor([1000, 2048], dtype=torch.int32))


def _check_cuda_registration() -> None:
    """The Triton quantizers are the CUDA kernels of the ops, registered lazily (the registered
    wrapper imports the kernel module on its first call); the kernels take every input whose
    dims other than the quantized one collapse into two strided runs (transposed views
    included) and route the rest, and empty inputs, to the reference kernels (called here on
    CPU tensors, the routing being device independent)."""
    from unittest import mock

    from torch_moe.quantization import _kernels, _quantize, _triton

    _kernels.register_cuda_kernels()
    _kernels.register_cuda_kernels()  # a second call is a no-op
    for op in ("quantize_mxfp8", "quantize_fp8_rowwise"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"torch_moe::{op}", "CUDA"), op
        assert _kernels.triton_kernel(op) is _triton.KERNELS[op]

    x = _random_matrix((64, 64), torch.bfloat16, 7)
    # dims 0 and 1 of this view are not nested: three runs besides the last dim
    x4 = _random_matrix((4, 4, 4, 64), torch.float32, 8).permute(1, 0, 2, 3)
    offs = torch.tensor([16, 48], dtype=torch.int32)
    mx, rw = _triton.mxfp8_quantize, _triton.fp8_rowwise_quantize
    cases = [  # (CUDA kernel, arguments, launches a Triton kernel)
        (mx, (x, 0, E5M2, "floor"), True),
        (mx, (x.t(), 1, E4M3, "rceil"), True),  # transposed view: quantize + transpose
        (mx, (x4, 3, E4M3, "rceil"), False),
        (mx, (x[:0], 1, E4M3, "rceil"), False),  # empty
        (rw, (x, -1), True),
        (rw, (x[:, ::2], 0), True),  # strided
        (rw, (x, 0, offs), True),  # grouped
        (rw, (x.t(), 1, offs), True),  # grouped, transposed
        (rw, (x4, 3), False),
    ]
    reference = {mx: _quantize.quantize_mxfp8, rw: _quantize.quantize_fp8_rowwise}
    kernel = {mx: "_mxfp8_quantize_kernel", rw: "_fp8_rowwise_quantize_kernel"}
    for fn, args, launches in cases:
        launched = []
        real = _triton.wrap_triton
        with mock.patch.object(_triton, "wrap_triton", side_effect=lambda k: launched.append(k) or real(k)):
            out = fn(*args)
        assert [k.fn.__name__ for k in launched] == [kernel[fn]] * launches, (fn.__name__, args[1:])
        for a, e in zip(out, reference[fn](*args)):
            _assert_bits_equal(a, e, f"{fn.__name__} {args[1:]}")
            assert a.is_contiguous(), (fn.__name__, args[1:])
    # invalid input fails with the reference's message
    for fn, ref_fn in reference.items():
        msgs = []
        for f in (fn, ref_fn):
            try:
                f(x.double())
            except RuntimeError as e:
                msgs.append(str(e))
        assert len(msgs) == 2 and msgs[0] == msgs[1], msgs


def _check_scaled_grouped_mm_fallback() -> None:
    """The CUDA fallback of scaled_grouped_mm (fp32 dequantization + the Triton grouped GEMM)
    against the CPU kernel, both layouts, both recipes, fp32 and bf16 outputs, with an empty
    group and rows past offs[-1]."""
    sys.path.insert(0, os.path.join(_TEST_DIR, "cuda"))
    from _interpreter import patch_interpreter_bf16_dot

    # a bf16 output multiplies bf16 operands, which the interpreter's tl.dot gets wrong
    patch_interpreter_bf16_dot()
    import torch_moe  # noqa: F401
    from torch_moe.quantization._cuda import scaled_grouped_mm_emulated_triton

    ops = torch.ops.torch_moe
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([32, 32, 64], dtype=torch.int32)
    for recipe in ("mxfp8", "fp8_rowwise"):
        a, b = torch.randn(96, 64, generator=g), torch.randn(3, 64, 32, generator=g)
        x, dy = torch.randn(64, 32, generator=g), torch.randn(64, 48, generator=g)
        if recipe == "mxfp8":
            (qa, sa), (qb, sb) = ops.quantize_mxfp8(a, 1), ops.quantize_mxfp8(b, 1)
            (qx, sx), (qy, sy) = ops.quantize_mxfp8(x, 0), ops.quantize_mxfp8(dy, 0)
        else:
            (qa, sa), (qb, sb) = ops.quantize_fp8_rowwise(a, 1), ops.quantize_fp8_rowwise(b, 1)
            (qx, sx), (qy, sy) = (ops.quantize_fp8_rowwise(x, 0, offs),
                                  ops.quantize_fp8_rowwise(dy, 0, offs))
        for args in ((qa, qb, sa, sb), (qx.t(), qy, sx.t(), sy)):
            for out_dtype in (torch.float32, torch.bfloat16):
                got = scaled_grouped_mm_emulated_triton(*args, offs, recipe, out_dtype)
                want = ops.scaled_grouped_mm(*args, offs, out_dtype)
                tol = 1e-4 if out_dtype == torch.float32 else 1e-2
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# The tests (parent process)
# ---------------------------------------------------------------------------------------------


@unittest.skipIf(not HAS_TRITON, "triton is not installed: the Triton kernels cannot run, not even "
                 "in the interpreter")
class TestQuantizationTriton(TestCase):
    def _run_interpreted(self, check: str) -> None:
        code = (
            f"import sys; sys.path[:0] = [{_TEST_DIR!r}, {_REPO_DIR!r}]; "
            f"import test_quantization_triton as t; t.{check}()"
        )
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=_REPO_DIR, capture_output=True, text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            self.fail(f"{check} failed under TRITON_INTERPRET=1:\n{proc.stderr[-6000:]}")

    def test_mxfp8_random(self):
        self._run_interpreted("_check_mxfp8_random")

    def test_mxfp8_boundary(self):
        self._run_interpreted("_check_mxfp8_boundary")

    def test_fp8_rowwise(self):
        self._run_interpreted("_check_fp8_rowwise")

    def test_fp8_rowwise_grouped(self):
        self._run_interpreted("_check_fp8_rowwise_grouped")

    def test_cuda_registration(self):
        self._run_interpreted("_check_cuda_registration")

    def test_scaled_grouped_mm_triton_fallback(self):
        self._run_interpreted("_check_scaled_grouped_mm_fallback")


if __name__ == "__main__":
    run_tests()
