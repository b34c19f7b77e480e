# Owner(s): ["module: moe"]
"""The Triton grouped GEMM kernels (:mod:`torch_moe._triton.grouped_mm`) on a machine without a GPU.

Each test runs in a subprocess, for two reasons: ``TRITON_INTERPRET`` is read when ``triton.jit``
decorates a kernel, so it must be set (or not) before the kernel module is imported, and must not
leak into other tests; and the registrations and patches made below must not either.

* Numerics (``TRITON_INTERPRET=1``): the raw kernel entries (:func:`grouped_mm`,
  :func:`indexed_grouped_mm`, plain functions of tensors) run on small CPU tensors and are compared
  with the CPU kernels of ``torch_moe::grouped_mm`` / ``torch_moe::indexed_grouped_mm``: empty
  groups, rows past ``offs[-1]``, gathers with -1 padding, scatters with duplicates and -1,
  scatter weights, strided operands, several tile configurations, padding next to NaN and Inf
  values that it must not read. fp32 (and fp64) within
  summation-order noise of the CPU kernel; bf16 within one bf16 rounding (one ulp) of the CPU
  kernel run on the same values in fp32.
* Visibility (no interpreter): the triton_ops are captured with ``aot_export_module``, whose graph
  must hold ``triton_kernel_wrapper_functional`` and no opaque op. Capture runs the ops on fake
  tensors: the kernel is never launched (the test makes a launch fail loudly), which is why it
  works here, where a launch would fail with "0 active drivers". Where the Triton frontend needs a
  GPU target (the mutation analysis generates TTIR), a stub driver names an sm_90 one.

Shapes are tiny: the interpreter runs every program in Python.
"""

import contextlib

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from _interpreter import (
    assert_matches,
    deterministic,
    patch_interpreter_bf16_dot,
    requires_triton,
    run_check,
)

# sizes shared by the checks: K, N, E, and offs with an empty group and a tail
K, N, E = 32, 48, 3
OFFS = (12, 12, 37)


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def _configs():
    from torch_moe._triton.grouped_mm import GemmConfig

    # several row tiles per group and two K steps; one K step wider than K (masked loads);
    # None: the default, chosen from the dtype and sizes
    return {"small": GemmConfig(16, 16, 16), "wide_k": GemmConfig(16, 32, 64), "default": None}


def _upcast(args, dtype):
    return [
        a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    ]


def _check_grouped_mm() -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        def randn(*shape):
            return torch.randn(shape, generator=g).to(dtype)

        a_rows = randn(40, K)
        # column-major weights, a transposed operand: the kernels take any strides
        b_rows = randn(E, N, K).transpose(1, 2)
        cases = [
            ("2D x 3D", a_rows, b_rows, "small"),  # rows 37.. are the zero tail
            ("2D x 3D", a_rows, b_rows, "default"),
            ("3D x 2D", randn(E, 24, K), randn(K, 40), "wide_k"),  # zero columns 37..
            ("2D x 2D", randn(40, 24).t(), randn(40, N), "small"),  # zero matrix for group 1
        ]
        if dtype == torch.float32:
            cases.append(("2D x 3D fp64", a_rows.double(), b_rows.double(), "default"))
        for name, a, b, config in cases:
            hi = torch.float64 if a.dtype == torch.float64 else torch.float32
            with deterministic():
                out = T.grouped_mm(a, b, offs, config=cfg[config])
            ref = torch.ops.torch_moe.grouped_mm(a.to(hi), b.to(hi), offs)
            what = f"grouped_mm {name} {a.dtype} config={config}"
            assert out.shape == ref.shape and out.dtype == a.dtype, what
            assert_matches(out, ref, what)


def _check_indexed_grouped_mm() -> None:
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    S, R, T_out = 44, 40, 21
    # gather: input rows with -1 padding; scatter: tokens with duplicates (top-k > 1), -1
    # padding, and an output row (20) that no slot reaches
    gather = torch.randint(0, R, (S,), generator=g)
    gather[[3, 20, 21, 40]] = -1
    scatter = torch.randint(0, T_out - 1, (S,), generator=g)
    scatter[[0, 15, 30]] = -1
    scale = torch.rand(S, generator=g)  # fp32 also for bf16 operands, as router weights are
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(R, K, generator=g).to(dtype)
        x_slots = torch.randn(S, K, generator=g).to(dtype)
        w = torch.randn(E, K, N, generator=g).to(dtype)
        # (name, args, config, in_order): outputs that are not scattered are checked in
        # deterministic mode (NaN-filled before the kernel); scattered ones in both modes, which
        # take different paths (atomic adds; rows in slot order, then index_add_)
        cases = [
            ("gather", (x, w, offs, gather, None, None, -1), "small", True),
            ("gather+weight", (x, w, offs, gather, None, scale, -1), "wide_k", True),
            ("scatter+weight", (x_slots, w, offs, None, scatter, scale, T_out), "small", False),
            ("gather+scatter+weight", (x, w, offs, gather, scatter, scale, T_out), "wide_k", False),
            ("gather+scatter+weight", (x, w, offs, gather, scatter, scale, T_out), "small", True),
            ("gather+scatter", (x, w, offs, gather, scatter, None, T_out), "default", False),
        ]
        for name, args, config, in_order in cases:
            with deterministic() if in_order else contextlib.nullcontext():
                out = T.indexed_grouped_mm(*args, config=cfg[config])
            ref = torch.ops.torch_moe.indexed_grouped_mm(*_upcast(args, torch.float32))
            what = f"indexed_grouped_mm {name} {dtype} {config=} deterministic={in_order}"
            assert out.shape == ref.shape and out.dtype == dtype, what
            assert_matches(out, ref, what)
        # the triton_op runs the same kernel in eager (default config)
        args = (x, w, offs, gather, scatter, scale, T_out)
        out = torch.ops.torch_moe._triton_indexed_grouped_mm(*args)
        ref = torch.ops.torch_moe.indexed_grouped_mm(*_upcast(args, torch.float32))
        assert_matches(out, ref, f"_triton_indexed_grouped_mm {dtype}")


def _check_indexed_padding_reads_no_row() -> None:
    """Padded slots (-1) read no input row and no weight: the weights of a group holding padding
    only are Inf, input row 0 (read by no real slot) is NaN, and so is the scale of every padded
    slot; the outputs equal the CPU kernel on the same values and are finite."""
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor((4, 7, 10), dtype=torch.int32)  # group 1: slots 4..6, padding only
    gather = torch.tensor((1, 2, -1, 3, -1, -1, -1, 4, 5, -1))
    scatter = torch.tensor((1, 2, 0, -1, 3, 3, 3, 3, 4, -1))
    x = torch.randn(6, K, generator=g)
    x[0] = float("nan")
    x_dropped = x.clone()
    x_dropped[3] = float("inf")  # read by slot 3 only, whose scattered output is dropped
    w = torch.randn(E, K, N, generator=g)
    w[1] = float("inf")
    scale = torch.rand(10, generator=g)
    scale[gather < 0] = float("nan")
    scale_dropped = scale.clone()
    scale_dropped[scatter < 0] = float("nan")
    cases = [
        ("gather", (x, w, offs, gather, None, None, -1), True),
        ("gather+weight", (x, w, offs, gather, None, scale, -1), True),
        ("gather+scatter+weight", (x_dropped, w, offs, gather, scatter, scale_dropped, 5), False),
        ("gather+scatter+weight", (x_dropped, w, offs, gather, scatter, scale_dropped, 5), True),
        # every slot dropped, no output rows
        ("all dropped", (x, w, offs, gather, torch.full((10,), -1), scale, 0), True),
        ("all dropped", (x, w, offs, gather, torch.full((10,), -1), scale, 0), False),
    ]
    for name, args, in_order in cases:
        for config in ("small", "default"):
            with deterministic() if in_order else contextlib.nullcontext():
                out = T.indexed_grouped_mm(*args, config=cfg[config])
            ref = torch.ops.torch_moe.indexed_grouped_mm(*args)
            what = f"indexed_grouped_mm padding {name} {config=} deterministic={in_order}"
            assert torch.isfinite(ref).all(), (what, ref)
            assert torch.isfinite(out).all(), (what, out)
            assert_matches(out, ref, what)


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (no interpreter)
# ---------------------------------------------------------------------------------------------


def _graph_targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _check_graph_capture() -> None:
    import triton
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_moe._triton import grouped_mm as T

    def launched(*args, **kwargs):
        raise AssertionError("graph capture launched a Triton kernel")

    for kernel in (T._grouped_mm_rows_kernel, T._grouped_mm_k_kernel):
        kernel.run = launched

    class Indexed(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, x, w, offs, gather, scatter, scale):
            return (self.op(x, w, offs, gather, scatter, scale, 21),)

    class Grouped(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, a, b, offs):
            return (self.op(a, b, offs),)

    def inputs(device):
        with FakeTensorMode():
            def t(*shape, dtype=torch.bfloat16):
                return torch.empty(shape, dtype=dtype, device=device)

            offs = t(E, dtype=torch.int32)
            gather, scatter = t(44, dtype=torch.int64), t(44, dtype=torch.int64)
            scale = t(44, dtype=torch.float32)
            return {
                "indexed": (t(40, K), t(E, K, N), offs, gather, scatter, scale),
                "2D x 3D": (t(40, K), t(E, K, N), offs),
                "3D x 2D": (t(E, 24, K), t(K, 40), offs),
                "2D x 2D": (t(24, 40), t(40, N), offs),
            }

    def capture(module, args):
        return aot_export_module(module, args, trace_joint=False)[0]

    def modules(indexed_op, grouped_op):
        return {"indexed": Indexed(indexed_op), "2D x 3D": Grouped(grouped_op),
                "3D x 2D": Grouped(grouped_op), "2D x 2D": Grouped(grouped_op)}

    triton_ops = modules(
        torch.ops.torch_moe._triton_indexed_grouped_mm.default,
        torch.ops.torch_moe._triton_grouped_mm.default,
    )
    public_ops = modules(
        torch.ops.torch_moe.indexed_grouped_mm.default, torch.ops.torch_moe.grouped_mm.default
    )

    # 1. The triton_ops on CPU tensors decompose into the functional kernel wrapper. Without a
    # driver, torch's mutation analysis cannot build TTIR and assumes every input is written.
    cpu = inputs("cpu")
    for name, module in triton_ops.items():
        targets = _graph_targets(capture(module, cpu[name]))
        assert triton_kernel_wrapper_functional in targets, (name, targets)
        assert not any(str(t).startswith("torch_moe.") for t in targets), (name, targets)

    # 2. With a GPU target for the Triton frontend, the analysis must find that the kernels
    # write their output only (anything else would make Inductor clone inputs).
    from triton.backends.compiler import GPUTarget

    class _Sm90Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def is_active(self):
            return True

    triton.runtime.driver.set_active(_Sm90Driver())
    for name, module in triton_ops.items():
        gm = capture(module, cpu[name])
        (node,) = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
        assert node.kwargs["tensors_to_clone"] == ["out_ptr"], (name, node.kwargs)

    # 3. torch_moe registers the CUDA kernels wherever triton is installed, so the public ops
    # decompose into the Triton kernels when traced with CUDA tensors (fake ones here), and stay
    # as they are on CPU and under torch.export.
    cuda = inputs("cuda")
    for name, module in public_ops.items():
        targets = _graph_targets(capture(module, cuda[name]))
        assert triton_kernel_wrapper_functional in targets, (name, targets)
        assert not any(str(t).startswith("torch_moe.") for t in targets), (name, targets)
        assert module.op in _graph_targets(capture(module, cpu[name])), name
        exported = torch.export.export(module, cuda[name])
        assert module.op in _graph_targets(exported.graph_module), name


# ---------------------------------------------------------------------------------------------
# The tests (parent process)
# ---------------------------------------------------------------------------------------------


@requires_triton
class TestTritonGroupedMM(TestCase):
    def _run(self, check: str, interpret: bool) -> None:
        run_check(self, "test_triton_grouped_mm", check, interpret=interpret)

    def test_grouped_mm_interpreted(self):
        self._run("_check_grouped_mm", interpret=True)

    def test_indexed_grouped_mm_interpreted(self):
        self._run("_check_indexed_grouped_mm", interpret=True)

    def test_indexed_padding_reads_no_row_interpreted(self):
        self._run("_check_indexed_padding_reads_no_row", interpret=True)

    def test_graph_capture(self):
        self._run("_check_graph_capture", interpret=False)


if __name__ == "__main__":
    run_tests()
