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
import itertools
import re

import torch
import torch_moe  # noqa: F401  (registers the ops)
from torch.testing._internal.common_device_type import (
    dtypes,
    instantiate_device_type_tests,
    onlyCUDA,
)
from torch.testing._internal.common_utils import TestCase, run_tests

from _interpreter import (
    HAS_TRITON,
    assert_matches,
    deterministic,
    patch_interpreter_bf16_dot,
    requires_triton,
    run_check,
    use_sm90_target,
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


def _check_k_rows() -> None:
    """The gathered contraction-split kernel (weight gradients) against a loop over slots:
    indices on either side with -1 (whose rows, NaN and Inf, must not be read), an empty group,
    slots past offs[-1], scales; bf16 with power-of-two scales, which the kernel's rounding of
    b * scale to bf16 keeps exact."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    S, Ra, Rb, M, Nk = 20, 9, 7, 24, 40
    offs = torch.tensor((5, 5, 17), dtype=torch.int32)
    a_index = torch.randint(1, Ra, (S,), generator=g)
    a_index[[1, 8]] = -1
    b_index = torch.randint(1, Rb, (S,), generator=g)
    b_index[[2, 9]] = -1
    # row 0 of each operand is read by padded slots only (their other index is -1)
    a_index[2], b_index[1] = 0, 0
    for dtype in (torch.float32, torch.bfloat16):
        scale = torch.rand(S, generator=g) if dtype == torch.float32 else (
            2.0 ** torch.randint(-2, 2, (S,), generator=g))
        a = torch.randn(Ra, M, generator=g).to(dtype)
        b = torch.randn(Rb, Nk, generator=g).to(dtype)
        a[0], b[0] = float("nan"), float("inf")
        for ai, bi, sc, config in [
            (a_index, b_index, scale, "small"),
            (a_index, b_index, None, "default"),
            (a_index, None, scale, "wide_k"),
            (None, b_index, scale, "small"),
        ]:
            # the NaN / Inf rows only where both sides are gathered (a row 0 read by slot 2,
            # whose b_index is -1, and the other way round for slot 1)
            both = ai is not None and bi is not None
            a_rows = (a if both else a.nan_to_num(0.0)) if ai is not None else (
                torch.randn(S, M, generator=g).to(dtype))
            b_rows = (b if both else b.nan_to_num(0.0, 0.0)) if bi is not None else (
                torch.randn(Nk, S, generator=g).to(dtype).t())  # strided
            with deterministic():  # the output starts as NaN: every tile must be written
                out = torch.empty(3, M, Nk, dtype=dtype)
                T._launch_k_rows(a_rows, b_rows, offs, out, cfg[config], a_index=ai,
                                 b_index=bi, b_scale=sc)
            ref = torch.zeros(3, M, Nk)
            start = 0
            for group, end in enumerate(offs.tolist()):
                for i in range(start, end):
                    ra = int(ai[i]) if ai is not None else i
                    rb = int(bi[i]) if bi is not None else i
                    if ra >= 0 and rb >= 0:
                        s = float(sc[i]) if sc is not None else 1.0
                        ref[group] += torch.outer(a_rows[ra].float(), b_rows[rb].float() * s)
                start = end
            what = (f"_launch_k_rows {dtype} a_index={ai is not None} b_index={bi is not None} "
                    f"scale={sc is not None} {config=}")
            assert_matches(out, ref, what)


_MASKS = ([True, True, True], [True, False, False], [False, True, False], [False, False, True],
          [False, False, False])


def _check_indexed_grouped_mm_backward() -> None:
    """``indexed_grouped_mm_backward`` against the CPU op: every gather / scatter / scale
    combination (fp32, atomic and deterministic paths), every output mask, bf16 and fp16, the
    default configs; padded slots next to NaN / Inf rows and weights; T = 0."""
    patch_interpreter_bf16_dot()
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    Kb, Nb = 24, 20
    offs = torch.tensor((6, 6, 13), dtype=torch.int32)  # an empty group and 3 tail slots
    S, R, T_out = 16, 10, 9
    gather = torch.randint(1, R, (S,), generator=g)
    gather[[2, 7]] = -1
    scatter = torch.randint(1, T_out, (S,), generator=g)
    scatter[[0, 9]] = -1
    # row 0 of input and of grad is read by padded slots only; the padded slots' scales are NaN
    gather[0], scatter[2] = 0, 0
    sw = torch.rand(S, generator=g)
    sw[[0, 2, 7, 9]] = float("nan")

    def run(args, config, in_order, what):
        with deterministic() if in_order else contextlib.nullcontext():
            out = T.indexed_grouped_mm_backward(*args, config=cfg[config])
        ref = torch.ops.torch_moe.indexed_grouped_mm_backward(*_upcast(args, torch.float32))
        for o, r, name in zip(out, ref, ("grad_input", "grad_weight", "grad_scatter_weight")):
            w = f"{what} {name} {config=} deterministic={in_order}"
            assert o.shape == r.shape and o.dtype == args[1 if name != "grad_scatter_weight"
                                                          else 6 if args[6] is not None
                                                          else 1].dtype, (w, o.shape, r.shape)
            if o.dtype != r.dtype:  # bf16 / fp16 against the fp32 CPU op
                assert_matches(o, r, w)
            else:
                assert torch.isfinite(r).all(), (w, r)
                assert_matches(o, r, w)

    def inputs(dtype, gi, si):
        x = torch.randn(R if gi is not None else S, Kb, generator=g).to(dtype)
        grad = torch.randn(T_out if si is not None else S, Nb, generator=g).to(dtype)
        if gi is not None and si is not None:  # else these rows are read by real slots
            x[0] = float("nan")
            grad[0] = float("inf")
        return x, grad

    w = torch.randn(E, Kb, Nb, generator=g)
    for gi, si, swi in itertools.product((None, gather), (None, scatter), (None, sw)):
        if swi is not None and (gi is None or si is None):
            swi = sw.nan_to_num(0.5)  # some padded slots are real here
        x, grad = inputs(torch.float32, gi, si)
        what = f"fp32 gather={gi is not None} scatter={si is not None} weight={swi is not None}"
        # deterministic mode changes the input gradient's path only where it is gathered
        for in_order in (False, True) if gi is not None else (False,):
            config = "small" if in_order or si is None else "default"
            run((grad, x, w, offs, gi, si, swi, [True, True, True]), config, in_order, what)
    x, grad = inputs(torch.float32, gather, scatter)
    for mask in _MASKS:
        run((grad, x, w, offs, gather, scatter, sw, mask), "default", False, f"fp32 {mask=}")
    # bf16 / fp16: scales that are powers of two (exact in the weight gradient's b * scale)
    sw_pow2 = torch.where(sw.isnan(), sw, 2.0 ** torch.randint(-2, 2, (S,), generator=g))
    for dtype in (torch.bfloat16, torch.float16):
        x, grad = inputs(dtype, gather, scatter)
        args = (grad, x, w.to(dtype), offs, gather, scatter, sw_pow2, [True, True, True])
        run(args, "wide_k", False, f"{dtype}")
        run(args, "default", True, f"{dtype}")
    # T = 0: no tokens and no output rows, every slot padded on both sides
    none = torch.full((S,), -1)
    args = (torch.randn(0, Nb), torch.randn(0, Kb), w, offs, none, none, sw, [True, True, True])
    for in_order in (False, True):
        run(args, "default", in_order, "T = 0")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` (1-D) as a view with stride 2, the column of a 2-D tensor."""
    wide = torch.full((t.size(0), 2), 7, dtype=t.dtype)
    wide[:, 0] = t
    return wide[:, 0]


def _check_strided_1d_operands() -> None:
    """``offs``, the indices and the scales as strided views (stride 2) give the results of
    their contiguous copies, forward and backward, in both kernels."""
    from torch_moe._triton import grouped_mm as T

    cfg = _configs()
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    S, R, T_out = 44, 40, 21
    gather = torch.randint(0, R, (S,), generator=g)
    gather[[3, 20]] = -1
    scatter = torch.randint(0, T_out, (S,), generator=g)
    scatter[[0, 15]] = -1
    scale = torch.rand(S, generator=g)
    x = torch.randn(R, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    a2 = torch.randn(40, 24, generator=g)
    with deterministic():
        out = T.grouped_mm(x, w, _strided(offs), config=cfg["small"])
        assert_matches(out, torch.ops.torch_moe.grouped_mm(x, w, offs), "grouped_mm 2D x 3D")
        out = T.grouped_mm(a2.t(), x, _strided(offs), config=cfg["small"])
        ref = torch.ops.torch_moe.grouped_mm(a2.t(), x, offs)
        assert_matches(out, ref, "grouped_mm 2D x 2D")
    for in_order in (False, True):
        args = (x, w, offs, gather, scatter, scale, T_out)
        strided = (x, w, _strided(offs), _strided(gather), _strided(scatter), _strided(scale),
                   T_out)
        with deterministic() if in_order else contextlib.nullcontext():
            out = T.indexed_grouped_mm(*strided, config=cfg["small"])
            assert_matches(out, torch.ops.torch_moe.indexed_grouped_mm(*args),
                           f"indexed_grouped_mm deterministic={in_order}")
            out = T.indexed_grouped_mm(x, w, _strided(offs), _strided(gather), None,
                                       _strided(scale), -1, config=cfg["small"])
            ref = torch.ops.torch_moe.indexed_grouped_mm(x, w, offs, gather, None, scale, -1)
            assert_matches(out, ref, f"indexed_grouped_mm unscattered deterministic={in_order}")
            grad = torch.randn(T_out, N, generator=g)
            mask = [True, True, True]
            out = T.indexed_grouped_mm_backward(grad, *strided[:-1], mask, config=cfg["small"])
            ref = torch.ops.torch_moe.indexed_grouped_mm_backward(grad, *args[:-1], mask)
            for o, r, name in zip(out, ref, ("grad_input", "grad_weight", "grad_scale")):
                assert_matches(o, r, f"indexed_grouped_mm_backward {name} {in_order=}")


def _check_no_autotuning_in_graph_capture() -> None:
    """During CUDA graph capture a launch takes the table's pick instead of the autotuner,
    which would measure (and synchronise) inside the capture; the capture query is False
    without CUDA and initialises nothing."""
    from torch_moe._triton import grouped_mm as T

    assert not T._capturing() and not torch.cuda.is_initialized()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(40, K, generator=g), torch.randn(E, K, N, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    ref = torch.ops.torch_moe.grouped_mm(x, w, offs)

    def autotuned(*args):
        raise AssertionError("autotuned during capture")

    T._capturing, T._autotuned = lambda: True, autotuned
    with deterministic():
        assert_matches(T.grouped_mm(x, w, offs), ref, "grouped_mm in capture")


def _check_invalid_values_raise() -> None:
    """The value checks of the CPU kernels: decreasing or negative offs, offs[-1] past the
    split dimension, indices outside [-1, bound), forward and backward (assert_async raises at
    once on CPU tensors)."""
    from torch_moe._triton import grouped_mm as T

    g = torch.Generator().manual_seed(0)
    S, R, T_out = 10, 8, 5
    x = torch.randn(R, K, generator=g)
    x_slots = torch.randn(S, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    grad = torch.randn(T_out, N, generator=g)
    gather = torch.randint(0, R, (S,), generator=g)
    scatter = torch.randint(0, T_out, (S,), generator=g)
    good = torch.tensor((3, 3, 8), dtype=torch.int32)
    bad_offs = {
        "non-decreasing and non-negative": [(4, 3, 8), (-1, 3, 8)],
        r"offs\[-1\] <=": [(3, 3, 11)],
    }
    mask = [True, True, True]

    def expect(message, fn, what):
        try:
            fn()
        except RuntimeError as e:
            assert re.search(message, str(e)), (what, str(e))
        else:
            raise AssertionError(f"{what}: no error")

    for message, values in bad_offs.items():
        for v in values:
            offs = torch.tensor(v, dtype=torch.int32)
            expect(message, lambda: T.grouped_mm(x_slots, w, offs), f"grouped_mm 2D x 3D {v}")
            expect(message, lambda: T.grouped_mm(x_slots.t(), x_slots, offs), f"2D x 2D {v}")
            expect(message, lambda: T.grouped_mm(w.transpose(1, 2), x_slots.t(), offs),
                   f"3D x 2D {v}")
            expect(message, lambda: T.indexed_grouped_mm(x, w, offs, gather), f"indexed {v}")
            expect(message, lambda: T.indexed_grouped_mm_backward(
                grad, x, w, offs, gather, scatter, None, mask), f"backward {v}")
    for bad in (-2, R):
        gi = gather.clone()
        gi[4] = bad
        expect(r"gather_index values in \[-1, 8\)",
               lambda: T.indexed_grouped_mm(x, w, good, gi, scatter, None, T_out),
               f"gather {bad}")
        expect(r"gather_index values in \[-1, 8\)",
               lambda: T.indexed_grouped_mm_backward(grad, x, w, good, gi, scatter, None, mask),
               f"backward gather {bad}")
    for bad in (-2, T_out):
        si = scatter.clone()
        si[4] = bad
        expect(r"scatter_index values in \[-1, 5\)",
               lambda: T.indexed_grouped_mm(x, w, good, gather, si, None, T_out),
               f"scatter {bad}")
        expect(r"scatter_index values in \[-1, 5\)",
               lambda: T.indexed_grouped_mm_backward(grad, x, w, good, gather, si, None, mask),
               f"backward scatter {bad}")
    # the CPU op raises on the same inputs, in the same words
    gi = gather.clone()
    gi[4] = R
    expect(r"gather_index values in \[-1, 8\)",
           lambda: torch.ops.torch_moe.indexed_grouped_mm(x, w, good, gi), "CPU op")
    # valid edge cases pass: one group, no slots
    T.grouped_mm(x_slots, w[:1], torch.tensor((S,), dtype=torch.int32))
    T.indexed_grouped_mm(x_slots[:0], w, torch.zeros(E, dtype=torch.int32))


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

    class Backward(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, grad, x, w, offs, gather, scatter, scale):
            return self.op(grad, x, w, offs, gather, scatter, scale, [True, True, True])

    def backward_inputs(device):
        with FakeTensorMode():
            def t(*shape, dtype=torch.bfloat16):
                return torch.empty(shape, dtype=dtype, device=device)

            return (t(21, N), t(40, K), t(E, K, N), t(E, dtype=torch.int32),
                    t(44, dtype=torch.int64), t(44, dtype=torch.int64), t(44, dtype=torch.float32))

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

    # the backward: the rows kernel (input and routing-weight gradients) and the
    # contraction-split kernel (weight gradient)
    gm = capture(Backward(torch.ops.torch_moe._triton_indexed_grouped_mm_backward.default),
                 backward_inputs("cpu"))
    targets = _graph_targets(gm)
    assert targets.count(triton_kernel_wrapper_functional) == 2, targets
    assert not any(str(t).startswith("torch_moe.") for t in targets), targets

    # 2. With a GPU target for the Triton frontend, the analysis must find that the kernels
    # write their output only (anything else would make Inductor clone inputs).
    use_sm90_target()
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
    targets = _graph_targets(capture(
        Backward(torch.ops.torch_moe.indexed_grouped_mm_backward.default),
        backward_inputs("cuda")))
    assert targets.count(triton_kernel_wrapper_functional) == 2, targets
    assert not any(str(t).startswith("torch_moe.") for t in targets), targets

    # 4. On an sm_90 GPU, launches without a config are autotuned over the table's candidates:
    # the captured kernel is the autotuner, with one grid per candidate, and the scattered
    # launch resets its accumulator between measured runs.
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    T.device_arch = lambda device: (9, 0)
    for name, reset in (("indexed", ["out_ptr"]), ("2D x 2D", [])):
        gm = capture(triton_ops[name], inputs("cpu")[name])
        (node,) = [n for n in gm.graph.nodes if n.target is triton_kernel_wrapper_functional]
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        assert isinstance(kernel, triton.runtime.autotuner.Autotuner), (name, kernel)
        assert len(kernel.configs) > 1 and len(node.kwargs["grid"]) == len(kernel.configs), name
        assert kernel.reset_to_zero == reset, (name, kernel.reset_to_zero)


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

    def test_k_rows_interpreted(self):
        self._run("_check_k_rows", interpret=True)

    def test_indexed_grouped_mm_backward_interpreted(self):
        self._run("_check_indexed_grouped_mm_backward", interpret=True)

    def test_strided_1d_operands_interpreted(self):
        self._run("_check_strided_1d_operands", interpret=True)

    def test_no_autotuning_in_graph_capture_interpreted(self):
        self._run("_check_no_autotuning_in_graph_capture", interpret=True)

    def test_invalid_values_raise_interpreted(self):
        self._run("_check_invalid_values_raise", interpret=True)

    def test_graph_capture(self):
        self._run("_check_graph_capture", interpret=False)


class TestGemmConfigs(TestCase):
    """The tile table and its autotuning candidates (plain Python: no GPU, no interpreter)."""

    def setUp(self):
        if not HAS_TRITON:
            self.skipTest("triton is not installed")
        from torch_moe._triton import _configs

        self.C = _configs

    def test_hopper_picks(self):
        C, bf16 = self.C, torch.bfloat16
        # Qwen3-30B-A3B up projection: 128 experts, ~256 rows each
        self.assertEqual(C.pick_config("rows", bf16, (9, 0), 32768, 1536, 2048, 128),
                         C.GemmConfig(128, 128, 64, 8, 4))
        # DeepSeek-V3 slice with few rows per expert: short row tiles
        self.assertEqual(C.pick_config("rows", bf16, (9, 0), 4096, 4096, 7168, 256).block_m, 32)
        self.assertEqual(C.pick_config("rows", bf16, (9, 0), 16384, 4096, 7168, 256).block_m, 64)
        # weight gradient of Mixtral's down projection: 128 x 128 x 64 tiles of the weight
        self.assertEqual(C.pick_config("k", bf16, (9, 0), 14336, 4096, 65536, 8),
                         C.GemmConfig(128, 128, 64, 8, 4))
        # fp32 halves the tiles' width
        self.assertLessEqual(C.pick_config("rows", torch.float32, (9, 0), 4096, 512, 512, 8)
                             .block_k, 32)

    def test_generic_and_narrow(self):
        C = self.C
        for arch in (None, (8, 0), (8, 9), (12, 0)):
            cfg = C.pick_config("rows", torch.bfloat16, arch, 4096, 48, 32, 8)
            # narrowed to N = 48 and K = 32
            self.assertEqual((cfg.block_n, cfg.block_k), (64, 32), arch)
            self.assertEqual(C.pick_config("rows", torch.bfloat16, arch, 4096, 4096, 4096, 8),
                             C.GemmConfig(64, 128, 64, 4, 3))

    def test_candidates(self):
        C = self.C
        for arch in ((9, 0), (8, 0), (8, 9)):
            for dtype in (torch.bfloat16, torch.float32):
                pick = C.pick_config("rows", dtype, arch, 32768, 4096, 7168, 128)
                cands = C.autotune_candidates(pick, dtype, arch, None, 4096)
                self.assertEqual(cands[0], pick)
                self.assertGreater(len(cands), 2)
                self.assertEqual(len(set(cands)), len(cands))
                for c in cands:
                    self.assertEqual(c.block_k, pick.block_k)
                    self.assertLessEqual(
                        c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n)
                        * dtype.itemsize, C.shared_memory_bytes(arch), (arch, c))
        # without a GPU (the interpreter): the pick alone
        pick = C.pick_config("k", torch.bfloat16, None, 64, 64, 640, 4)
        self.assertEqual(C.autotune_candidates(pick, torch.bfloat16, None, 64, 64), [pick])

    def test_picks_fit_shared_memory(self):
        """The table's pick fits the device's shared memory, also where the table takes the
        sm_90 rows for a capability with less of it (sm_103 here, 99 KiB assumed): launches
        that keep the pick without autotuning must not run out of resources."""
        C = self.C
        shapes = [("rows", 32768, 4096, 7168, 8), ("rows", 4096, 2048, 7168, 256),
                  ("k", 7168, 2048, 32768, 8), ("k", 7168, 2048, 1024, 64)]
        for arch in ((9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (8, 0), (8, 6), None):
            for dtype in (torch.bfloat16, torch.float32, torch.float64):
                for kind, m, n, k, groups in shapes:
                    for tiles in (1, 2):
                        c = C.pick_config(kind, dtype, arch, m, n, k, groups, weight_tiles=tiles)
                        used = c.num_stages * (c.block_m * c.block_k + tiles * c.block_k
                                               * c.block_n) * dtype.itemsize
                        self.assertLessEqual(used, C.shared_memory_bytes(arch),
                                             (arch, dtype, kind, tiles, c))
        # sm_103 takes the sm_90 row with a shorter contraction step; sm_90 keeps its pick
        hopper = C.pick_config("rows", torch.bfloat16, (9, 0), 32768, 4096, 7168, 8)
        self.assertEqual(hopper, C.GemmConfig(128, 128, 64, num_warps=8, num_stages=4))
        small = C.pick_config("rows", torch.bfloat16, (10, 3), 32768, 4096, 7168, 8)
        self.assertEqual(small, hopper._replace(block_k=32))
        # the smallest tile is returned as it is
        tiny = C.GemmConfig(16, 16, 16, num_stages=2)
        self.assertEqual(C.fit_shared_memory(tiny, torch.float64, None, 2), tiny)


# Realistic slices of MoE layers: (name, D, F, E, T, top_k)
_MODELS = [
    ("deepseek_v3", 7168, 2048, 16, 256, 8),  # 16 of the 256 experts
    ("qwen3_30b_a3b", 2048, 768, 128, 512, 8),
    ("mixtral", 4096, 14336, 8, 256, 2),
]


def _routing(T, k, E, device):
    """offs, and the token of each sorted slot, for random top-k routing with a hot expert 0."""
    g = torch.Generator().manual_seed(0)
    experts = torch.randint(0, E, (T * k,), generator=g)
    experts[: T * k // 4] = 0
    order = torch.sort(experts, stable=True).indices
    offs = torch.cumsum(torch.bincount(experts, minlength=E), 0).to(torch.int32)
    return offs.to(device), (order // k).to(device)


def _compare_models(device, dtype, models) -> None:
    """The forward and backward of indexed_grouped_mm (gather, scatter, routing weights) at the
    given layer shapes on ``device``, against the CPU ops in fp32, in both modes."""
    from torch_moe._triton import grouped_mm as G

    for name, D, F, E, T, k in models:
        offs, token = _routing(T, k, E, device)
        x = torch.randn(T, D, device=device, dtype=dtype)
        w = (torch.randn(E, D, F, device=device) / D ** 0.5).to(dtype)
        sw = torch.rand(T * k, device=device)
        grad = torch.randn(T, F, device=device, dtype=dtype)
        cpu = [t.cpu().float() if t.is_floating_point() else t.cpu()
               for t in (grad, x, w, offs, token, token, sw)]
        ref = torch.ops.torch_moe.indexed_grouped_mm(*cpu[1:], T)
        refs = torch.ops.torch_moe.indexed_grouped_mm_backward(*cpu, [True, True, True])
        for in_order in (False, True):
            with deterministic() if in_order else contextlib.nullcontext():
                out = G.indexed_grouped_mm(x, w, offs, token, token, sw, T)
                grads = G.indexed_grouped_mm_backward(
                    grad, x, w, offs, token, token, sw, [True, True, True])
            for a, r, what in zip((out, *grads), (ref, *refs),
                                  ("out", "grad_input", "grad_weight", "grad_scatter_weight")):
                # bf16 outputs (one rounding) and bf16 products of grad * scale in
                # grad_weight: errors relative to the output's scale
                torch.testing.assert_close(
                    a.float().cpu(), r, rtol=2e-2, atol=1e-2 * r.abs().max().item(),
                    msg=f"{name} {what} deterministic={in_order}")


class TestTritonGroupedMMCUDA(TestCase):
    """The kernels on a GPU at realistic shapes, against the CPU ops in fp32."""

    @onlyCUDA
    @dtypes(torch.bfloat16)
    def test_indexed_grouped_mm_models(self, device, dtype):
        _compare_models(device, dtype, _MODELS)


instantiate_device_type_tests(TestTritonGroupedMMCUDA, globals(), only_for="cuda")


if __name__ == "__main__":
    run_tests()
