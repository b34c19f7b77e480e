# Owner(s): ["module: moe"]
"""The Triton kernels of the permute family (:mod:`torch_moe._triton.permute`).

* Numerics (``TRITON_INTERPRET=1``, a subprocess per check, see ``_interpreter.py``): the kernel
  entries run on small CPU tensors and are compared with the CPU kernels of ``torch_moe::permute``,
  ``permute.out``, ``permute_backward``, ``unpermute`` and ``unpermute_backward`` on the same
  values and dtypes (bf16, fp16, fp32, fp64): routings with padding (``align=4``), dropped
  assignments (``token_sort_with_capacity``), all tokens on one expert, top-k 1 and 3, no tokens;
  NaN in every value that must not be read (padded rows of ``grad`` and ``y``, weights of dropped
  assignments); every ``output_mask``; strided operands; two tile configurations. Copies are
  compared bitwise, sums within one rounding (``assert_matches``). All of it runs in deterministic
  mode, which fills fresh outputs with NaN: a row the kernels fail to write shows.
  Duplicate and out-of-range ids raise, as on CPU, and trip the device asserts of
  ``TRITON_DEBUG=1``.
* Graph capture (no interpreter): the CUDA callables run on fake CUDA tensors with the fake
  kernels' shapes, dtypes and strides; the public ops, ``permute.out`` included (into a fresh
  buffer and into a mutated graph input), traced by AOTAutograd with fake CUDA inputs, become
  ``triton_kernel_wrapper_functional`` nodes that write outputs and scratch only; the kernels
  compile for sm_90 (with a stub driver: no GPU is needed to build PTX).
* On a GPU (``TestTritonPermuteCUDA``): the public ops on CUDA tensors at realistic shapes
  against the CPU ops, forward and backward through autograd, and under ``torch.compile``.
"""

import contextlib
import re

import torch
from torch.testing._internal.common_device_type import (
    dtypes as for_dtypes,
    instantiate_device_type_tests,
    onlyCUDA,
)
from torch.testing._internal.common_utils import TestCase, parametrize, run_tests

from _interpreter import (
    assert_matches,
    deterministic,
    requires_triton,
    run_check,
    sm90_target,
    use_sm90_target,
)

import torch_moe  # noqa: F401  (registers the ops)

ops = torch.ops.torch_moe

E, D = 4, 24
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
NAN = float("nan")


# ---------------------------------------------------------------------------------------------
# Routings (CPU), shared by the checks and the device tests
# ---------------------------------------------------------------------------------------------


def _topk_ids(T, k, num_experts, generator):
    """[T, k] random expert ids, distinct for each token."""
    return torch.argsort(torch.rand(T, num_experts, generator=generator), dim=1)[:, :k]


def _routings(generator, num_experts=E, sizes=((10, 2), (7, 1), (6, 3))):
    """(name, sorted_ids [S], top_k, T, topk_weights [T, k] fp32 with NaN where dropped)."""
    out = []
    for T, k in sizes:
        ids = _topk_ids(T, k, num_experts, generator)
        weights = torch.rand(T, k, generator=generator)
        sid, _, _ = ops.token_sort(ids, num_experts)
        out.append((f"T={T} k={k}", sid, k, T, weights))
        sid, _, _ = ops.token_sort(ids, num_experts, 4)
        out.append((f"T={T} k={k} align=4", sid, k, T, weights))
        # half the mean load per expert: some assignments are dropped (no slot holds them);
        # their weights are NaN, which must not be read
        from torch_moe.nn.functional import token_sort_with_capacity

        capacity = max(1, T * k // num_experts // 2)
        sid, _, _, dropped = token_sort_with_capacity(ids, weights, num_experts, capacity,
                                                      align=2)
        assert int(dropped) > 0
        w = weights.clone().view(-1)
        present = torch.zeros(T * k, dtype=torch.bool)
        present[sid[sid >= 0]] = True
        w[~present] = NAN
        out.append((f"T={T} k={k} capacity={capacity} align=2", sid, k, T, w.view(T, k)))
    # every token on expert 0 (top-1), or on experts 0 and 1 (top-2): the other experts empty
    T = 9
    for k in (1, 2):
        ids = torch.arange(k).expand(T, k)
        sid, _, _ = ops.token_sort(ids, num_experts, 4)
        out.append((f"one expert k={k} align=4", sid, k, T, torch.rand(T, k, generator=generator)))
    # no tokens: every slot is padding
    sid, _, _ = ops.token_sort(torch.empty(0, 2, dtype=torch.long), num_experts, 4)
    out.append(("T=0 align=4", sid, 2, 0, torch.rand(0, 2, generator=generator)))
    out.append(("T=0 S=0", torch.empty(0, dtype=torch.long), 2, 0, torch.rand(0, 2)))
    return out


def _with_nan_padding(t, sorted_ids):
    """``t`` (``[S, D]``) with NaN in the rows of padded slots, which must not be read."""
    t = t.clone()
    t[sorted_ids < 0] = NAN
    return t


def _strided(t):
    """The same values, not contiguous: every other row of a buffer twice as tall, or the
    transpose of a column-major copy for a 2-D tensor with one row or none."""
    if t.dim() == 1:
        buf = torch.empty(2 * t.size(0), dtype=t.dtype)
        buf[::2] = t
        return buf[::2]
    buf = t.new_empty((t.size(1), t.size(0))).t()
    buf.copy_(t)
    return buf


def _assert_equal(actual, expected, what):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        what, actual.dtype, actual.shape, expected.dtype, expected.shape)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def _configs():
    from torch_moe._triton.permute import RowConfig

    # several programs along both dimensions (masked tail columns, 24 = 16 + 8) and in the
    # inverse map; None: the default (one program for these shapes), through the registered ops
    return {"small": RowConfig(block_rows=8, block_d=16, block_slots=16), "default": None}


def _entry(name, config):
    """The Triton implementation of ``name``: the module's function with ``config``, or for the
    default the module's CUDA kernel (the triton_op)."""
    from torch_moe._triton import permute as P

    if config is not None:
        fn = {"permute": P.permute, "permute.out": P.permute_out,
              "permute_backward": P.permute_backward, "unpermute": P.unpermute,
              "unpermute_backward": P.unpermute_backward}[name]
        return lambda *args, **kwargs: fn(*args, **kwargs, config=config)
    return P.KERNELS[name]


def _cases(seed):
    """(what, config, routing..., dtype, generator): every routing in every dtype with the
    default tiles (the registered op), and in bf16 and fp32 with small ones (the tiling does not
    depend on the dtype, and the interpreter's time grows with the number of programs)."""
    g = torch.Generator().manual_seed(seed)
    configs = _configs()
    for name, sid, k, T, weights in _routings(g):
        for config_name, dtypes in (("default", FLOAT_DTYPES),
                                    ("small", (torch.bfloat16, torch.float32))):
            for dtype in dtypes:
                yield f"{name} {dtype} config={config_name}", configs[config_name], sid, k, T, \
                    weights, dtype, g


def _check_outputs(what, outs, refs):
    for out, ref, part in zip(outs, refs, ("grad_y", "grad_w")):
        p_what = f"{what} {part}"
        assert out.dtype == ref.dtype, p_what
        assert out.shape == ref.shape, (p_what, out.shape, ref.shape)
        assert out.is_contiguous(), p_what
        assert not out.isnan().any(), p_what
        assert_matches(out, ref, p_what)


def _check_permute() -> None:
    """permute, permute.out (strided operands, into a strided buffer) and permute_backward (NaN
    in the padded rows of grad; contiguous and strided)."""
    for what, config, sid, k, T, _, dtype, g in _cases(0):
        S = sid.size(0)
        x = torch.randn(T, D, generator=g).to(dtype)
        with deterministic():
            out = _entry("permute", config)(x, sid, k)
        _assert_equal(out, ops.permute(x, sid, k), f"permute {what}")
        assert out.is_contiguous(), what

        # into a column-major buffer, which the kernel writes in place
        buf = torch.full((D, S), 7.0, dtype=dtype).t()
        with deterministic():
            res = _entry("permute.out", config)(_strided(x), _strided(sid), k, out=buf)
        assert res is None, what
        _assert_equal(buf, ops.permute(x, sid, k), f"permute.out {what}")

        if dtype == torch.float32 and config is None:
            # permute copies any dtype, as index_select does; fp8 against the CPU op on its
            # bits (the CPU op cannot zero fp8 rows, nor can deterministic mode fill them)
            for other in (torch.int32, torch.bool, torch.float8_e4m3fn):
                xo = (torch.randn(T, D, generator=g) * 4).to(other)
                fp8 = other == torch.float8_e4m3fn
                with deterministic() if not fp8 else contextlib.nullcontext():
                    out = _entry("permute", config)(xo, sid, k)
                assert out.dtype == other, (what, other)
                bits = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
                _assert_equal(bits(out), ops.permute(bits(xo), sid, k), f"permute {what} {other}")

        grad = _with_nan_padding(torch.randn(S, D, generator=g).to(dtype), sid)
        for strided in (False, True):
            args = (grad, sid) if not strided else (_strided(grad), _strided(sid))
            with deterministic():
                out = _entry("permute_backward", config)(*args, k, T)
            ref = ops.permute_backward(grad, sid, k, T)
            b_what = f"permute_backward {what} strided={strided}"
            assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), b_what
            assert not out.isnan().any(), b_what
            assert_matches(out, ref, b_what)


def _check_unpermute() -> None:
    """unpermute with fp32 weights and with weights of the rows' dtype, contiguous and strided;
    NaN in the padded rows of y and in the weights of dropped assignments."""
    for what, config, sid, k, T, weights, dtype, g in _cases(1):
        y = _with_nan_padding(torch.randn(sid.size(0), D, generator=g).to(dtype), sid)
        for w, strided in ((weights, False), (weights.to(dtype), True)):
            args = (y, sid, w) if not strided else tuple(map(_strided, (y, sid, w)))
            with deterministic():
                out = _entry("unpermute", config)(*args)
            ref = ops.unpermute(y, sid, w)
            w_what = f"unpermute {what} weights={w.dtype} strided={strided}"
            assert out.dtype == dtype and out.shape == ref.shape and out.is_contiguous(), w_what
            assert not out.isnan().any(), w_what
            assert_matches(out, ref, w_what)


def _check_unpermute_backward() -> None:
    """unpermute_backward, every output_mask; strided operands; NaN in the padded rows of y and
    in the weights of dropped assignments."""
    for what, config, sid, k, T, weights, dtype, g in _cases(2):
        grad = torch.randn(T, D, generator=g).to(dtype)
        y = _with_nan_padding(torch.randn(sid.size(0), D, generator=g).to(dtype), sid)
        # grad_y is scaled by the weight rounded to the rows' dtype, and the interpreter rounds
        # to 16-bit floats by truncation, where the CPU (and a GPU) rounds to nearest: fp32
        # weights that the rows' dtype holds exactly keep the difference to the one rounding of
        # the product (the device tests take any fp32 weights)
        w32 = weights.to(dtype).to(weights.dtype)
        runs = [(w32, [True, True], False), (weights.to(dtype), [True, True], True),
                (w32, [True, False], False), (w32, [False, True], True),
                (w32, [False, False], False)]
        for w, mask, strided in runs:
            args = (grad, y, sid, w) if not strided else tuple(map(_strided, (grad, y, sid, w)))
            with deterministic():
                outs = _entry("unpermute_backward", config)(*args, mask)
            refs = ops.unpermute_backward(grad, y, sid, w, mask)
            _check_outputs(f"unpermute_backward {what} w={w.dtype} {mask=} {strided=}", outs, refs)


def _check_invalid_ids_raise() -> None:
    """Duplicate and out-of-range ids raise (here at once: the device-side check is an
    ``_assert_async`` on CPU tensors), for every op and in both configurations."""
    T, k = 5, 2
    x = torch.randn(T, D)
    w = torch.rand(T, k)
    bad = {
        "duplicate": (torch.tensor([3, 1, -1, 0, 3, 2]), "at most once"),
        "too large": (torch.tensor([3, 1, -1, 0, T * k, 2]), r"values in \[-1, 10\)"),
        "below -1": (torch.tensor([3, 1, -2, 0, 4, 2]), r"values in \[-1, 10\)"),
    }
    for config_name, config in _configs().items():
        for case, (sid, pattern) in bad.items():
            S = sid.size(0)
            calls = {
                "permute": lambda: _entry("permute", config)(x, sid, k),
                "permute.out": lambda: _entry("permute.out", config)(
                    x, sid, k, out=x.new_empty((S, D))),
                "permute_backward": lambda: _entry("permute_backward", config)(
                    torch.randn(S, D), sid, k, T),
                "unpermute": lambda: _entry("unpermute", config)(torch.randn(S, D), sid, w),
                "unpermute_backward": lambda: _entry("unpermute_backward", config)(
                    x, torch.randn(S, D), sid, w, [False, False]),
            }
            for op, call in calls.items():
                _assert_raises(call, pattern, f"{op} {case} config={config_name}")
            # as the CPU op does
            _assert_raises(lambda: ops.permute(x, sid, k), "", f"CPU permute {case}")
    # with no tokens, every id but -1 is out of range
    _assert_raises(lambda: _entry("permute", None)(x[:0], torch.tensor([-1, 0]), k),
                   r"values in \[-1, 0\)", "permute T=0")


def _assert_raises(call, pattern, what, error=RuntimeError):
    try:
        call()
    except error as e:
        assert re.search(pattern, str(e)), (what, str(e))
    else:
        raise AssertionError(f"{what}: no error")


def _check_device_asserts() -> None:
    """With ``TRITON_DEBUG=1`` the inverse-map kernel asserts on the device where it meets a bad
    id. (The interpreter ignores ``TRITON_DEBUG``: the check turns on its debug option.)"""
    import dataclasses

    from triton.runtime import interpreter

    from torch_moe._triton import permute as P

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, debug=True)
    x = torch.randn(5, D)
    cases = [(torch.tensor([3, 1, -1, 0, 3, 2]), "occurs twice"),
             (torch.tensor([3, 1, -1, 0, 10, 2]), r"out of \[-1, top_k \* num_tokens\)"),
             (torch.tensor([3, -2, -1, 0, 4, 2]), r"out of \[-1, top_k \* num_tokens\)")]
    for sid, pattern in cases:
        _assert_raises(lambda: P.permute(x, sid, 2), pattern, f"device assert {sid}",
                       error=interpreter.InterpreterError)
    P.permute(x, torch.tensor([3, 1, -1, 0, 4, 2]), 2)  # valid ids pass


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (no interpreter)
# ---------------------------------------------------------------------------------------------


def _no_launch():
    from torch_moe._triton import permute as P

    def launched(*args, **kwargs):
        raise AssertionError("tracing launched a Triton kernel")

    for kernel in (P._inverse_map_kernel, P._gather_rows_kernel, P._combine_rows_kernel,
                   P._weight_grad_kernel):
        kernel.run = launched


def _fake_cuda_inputs():
    from torch._subclasses.fake_tensor import FakeTensorMode

    T, k, S = 10, 2, 32
    mode = FakeTensorMode()
    with mode:
        def t(*shape, dtype=torch.bfloat16):
            return torch.empty(shape, dtype=dtype, device="cuda")

        return dict(x=t(T, D), sid=t(S, dtype=torch.int64), w=t(T, k, dtype=torch.float32),
                    grad=t(T, D), y=t(S, D), out=t(S, D), k=k, T=T, mode=mode)


def _check_fake_cuda() -> None:
    """Every CUDA callable runs on fake CUDA tensors (no host read, no launch) with the fake
    kernels' outputs: same shapes, dtypes and strides."""
    from torch_moe import _meta_registrations as M
    from torch_moe._triton import CUDA_KERNEL_MODULES, cuda_kernel, permute as P

    _no_launch()
    i = _fake_cuda_inputs()
    k, T = i["k"], i["T"]
    for overload, module in CUDA_KERNEL_MODULES.items():
        if module == "permute":
            assert cuda_kernel(overload) is P.KERNELS[overload], overload
    cuda_kernel = P.KERNELS.__getitem__

    def same(a, b, what):
        assert (a.shape, a.dtype, a.stride(), a.device) == (b.shape, b.dtype, b.stride(),
                                                            b.device), (what, a, b)

    with i["mode"]:
        x0 = torch.empty(0, D, device="cuda")
        for x in (i["x"], x0):
            same(cuda_kernel("permute")(x, i["sid"], k), M.permute_meta(x, i["sid"], k), "permute")
        assert cuda_kernel("permute.out")(i["x"], i["sid"], k, out=i["out"]) is None
        same(cuda_kernel("permute_backward")(i["y"], i["sid"], k, T),
             M.permute_backward_meta(i["y"], i["sid"], k, T), "permute_backward")
        same(cuda_kernel("unpermute")(i["y"], i["sid"], i["w"]),
             M.unpermute_meta(i["y"], i["sid"], i["w"]), "unpermute")
        for mask in ([True, True], [True, False], [False, True], [False, False]):
            args = (i["grad"], i["y"], i["sid"], i["w"], mask)
            for a, b in zip(cuda_kernel("unpermute_backward")(*args),
                            M.unpermute_backward_meta(*args)):
                same(a, b, f"unpermute_backward {mask}")


def _check_graph_capture() -> None:
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    from torch_moe._triton import permute as P

    _no_launch()
    use_sm90_target()
    i = _fake_cuda_inputs()
    k = i["k"]

    class PermuteOut(torch.nn.Module):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def forward(self, x, sid):
            out = x.new_empty((sid.size(0), x.size(1)))
            self.op(x, sid, k, out=out)
            return (out,)

    class PermuteOutInput(PermuteOut):
        # mutates a graph input: the graph returns its new value
        def forward(self, x, sid, out):
            self.op(x, sid, k, out=out)
            return (x.sum(),)

    class All(torch.nn.Module):
        def forward(self, x, sid, w, grad, y):
            return (
                ops.permute(x, sid, k),
                ops.permute_backward(y, sid, k, x.size(0)),
                ops.unpermute(y, sid, w),
                *ops.unpermute_backward(grad, y, sid, w, [True, True]),
            )

    del i["mode"]
    # permute.out: the public op (the FunctionalTensorMode rule calls the module's callable in
    # its place) and that callable itself
    out_ops = {"callable": P.KERNELS["permute.out"], "op": ops.permute.out}
    cases = [("all", All(), (i["x"], i["sid"], i["w"], i["grad"], i["y"]))]
    for how, op in out_ops.items():
        cases += [
            (f"permute.out ({how})", PermuteOut(op), (i["x"], i["sid"])),
            (f"permute.out into an input ({how})", PermuteOutInput(op),
             (i["x"], i["sid"], i["out"])),
        ]
    for name, module, args in cases:
        gm, sig = aot_export_module(module, args, trace_joint=False)
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert not any(str(n.target).startswith("torch_moe.") for n in nodes), (name, gm.code)
        wrappers = [n for n in nodes if n.target is triton_kernel_wrapper_functional]
        assert wrappers, (name, gm.code)
        for n in wrappers:
            # the kernels write their outputs and the inverse map's buffers, nothing else
            assert set(n.kwargs["tensors_to_clone"]) <= {"out_ptr", "slot_ptr", "errors_ptr"}, (
                name, n.kwargs)
        if name.startswith("permute.out into an input"):
            assert list(sig.user_inputs_to_mutate.values()) == ["arg2_1"], (name, sig)


def _check_compiles_for_sm90() -> None:
    """The kernels compile to PTX (no GPU needed), with 16-byte vector accesses along D for
    16-byte aligned rows."""
    import triton
    from triton.compiler import ASTSource

    from torch_moe._triton import permute as P

    target = sm90_target()

    def compile_(kernel, types, constexprs):
        names = list(types)
        aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
                   if types[n] != "constexpr" and (n.endswith("_ptr") or n in ("D",)
                                                   or n.startswith("stride_"))}
        src = ASTSource(fn=kernel, signature=types, attrs=aligned,
                        constexprs={(names.index(n),): v for n, v in constexprs.items()})
        return triton.compile(src, target=target).asm["ptx"]

    def sig(kernel, ptrs, **constexprs):
        types = {}
        for n in kernel.arg_names:
            if n in constexprs:
                types[n] = "constexpr"
            elif n in ptrs:
                types[n] = ptrs[n]
            else:
                types[n] = "i64" if n == "num_assignments" else "i32"
        return types

    ptx = compile_(P._inverse_map_kernel,
                   sig(P._inverse_map_kernel, {"ids_ptr": "*i64", "slot_ptr": "*i32",
                                              "errors_ptr": "*i32"}, BLOCK=1024),
                   {"BLOCK": 1024})
    assert "atom.global" in ptx
    tiles = dict(BLOCK_M=4, BLOCK_D=1024, stride_sd=1, stride_od=1)
    for dtype, vec in (("bf16", "v4.b32"), ("fp32", "v4.b32"), ("fp64", "v2.b64")):
        for has_weight in (False, True):
            for kernel, idx in ((P._gather_rows_kernel, "ids_ptr"),
                                (P._combine_rows_kernel, "slot_ptr")):
                ptrs = {"src_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                        idx: "*i64" if idx == "ids_ptr" else "*i32", "weight_ptr": "*fp32"}
                ce = dict(tiles, HAS_WEIGHT=has_weight)
                if not has_weight:
                    ce["weight_ptr"] = None
                ptx = compile_(kernel, sig(kernel, ptrs, **ce), ce)
                accesses = set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))
                what = (kernel.fn.__name__, dtype, has_weight, accesses)
                assert f"ld.global.{vec}" in accesses and f"st.global.{vec}" in accesses, what
        ce = dict(BLOCK_M=4, BLOCK_D=1024, stride_gd=1, stride_yd=1)
        ptx = compile_(P._weight_grad_kernel,
                       sig(P._weight_grad_kernel, {"grad_ptr": f"*{dtype}", "y_ptr": f"*{dtype}",
                                                   "slot_ptr": "*i32", "out_ptr": "*fp32"}, **ce),
                       ce)
        assert f"ld.global.{vec}" in ptx, dtype


# ---------------------------------------------------------------------------------------------
# The tests (parent process)
# ---------------------------------------------------------------------------------------------


@requires_triton
class TestTritonPermute(TestCase):
    def _run(self, check: str, interpret: bool = True) -> None:
        run_check(self, "test_triton_permute", check, interpret=interpret)

    def test_permute_interpreted(self):
        self._run("_check_permute")

    def test_unpermute_interpreted(self):
        self._run("_check_unpermute")

    def test_unpermute_backward_interpreted(self):
        self._run("_check_unpermute_backward")

    def test_invalid_ids_raise_interpreted(self):
        self._run("_check_invalid_ids_raise")

    def test_device_asserts_interpreted(self):
        self._run("_check_device_asserts")

    def test_fake_cuda(self):
        self._run("_check_fake_cuda", interpret=False)

    def test_graph_capture(self):
        self._run("_check_graph_capture", interpret=False)

    def test_compiles_for_sm90(self):
        self._run("_check_compiles_for_sm90", interpret=False)


class TestTritonPermuteCUDA(TestCase):
    """On a GPU: the public ops on CUDA tensors (the Triton kernels) against the CPU ops."""

    def _routing(self, T, k, num_experts, kind, generator):
        ids = _topk_ids(T, k, num_experts, generator)
        weights = torch.rand(T, k, generator=generator)
        if kind == "capacity":
            from torch_moe.nn.functional import token_sort_with_capacity

            sid = token_sort_with_capacity(ids, weights, num_experts, T * k // num_experts // 2,
                                           align=8)[0]
        else:
            sid = ops.token_sort(ids, num_experts, 8 if kind == "align" else 1)[0]
        return sid, weights

    @onlyCUDA
    @for_dtypes(torch.bfloat16, torch.float32)
    @parametrize("kind", ["dropless", "align", "capacity"])
    @parametrize("shape", [(512, 2, 1024), (300, 1, 96), (64, 4, 8192)])
    def test_ops_match_cpu(self, device, dtype, kind, shape):
        T, k, dim = shape
        g = torch.Generator().manual_seed(0)
        sid, w = self._routing(T, k, 8, kind, g)
        S = sid.size(0)
        x = torch.randn(T, dim, generator=g).to(dtype)
        y = _with_nan_padding(torch.randn(S, dim, generator=g).to(dtype), sid)
        grad = torch.randn(T, dim, generator=g).to(dtype)
        dev = lambda *ts: [t.to(device) for t in ts]  # noqa: E731
        x_d, sid_d, w_d, y_d, grad_d = dev(x, sid, w, y, grad)
        with deterministic():
            self.assertEqual(ops.permute(x_d, sid_d, k).cpu(), ops.permute(x, sid, k),
                             atol=0, rtol=0)
            out = torch.empty(S, dim, dtype=dtype, device=device)
            ops.permute.out(x_d, sid_d, k, out=out)
            self.assertEqual(out.cpu(), ops.permute(x, sid, k), atol=0, rtol=0)
            assert_matches(ops.permute_backward(y_d, sid_d, k, T).cpu(),
                           ops.permute_backward(y, sid, k, T), "permute_backward")
            assert_matches(ops.unpermute(y_d, sid_d, w_d).cpu(), ops.unpermute(y, sid, w),
                           "unpermute")
            for mask in ([True, True], [True, False], [False, True]):
                for a, b in zip(ops.unpermute_backward(grad_d, y_d, sid_d, w_d, mask),
                                ops.unpermute_backward(grad, y, sid, w, mask)):
                    assert_matches(a.cpu(), b, f"unpermute_backward {mask}")
        # the same result on every run (no atomic adds in the sums)
        a = ops.unpermute(y_d, sid_d, w_d)
        self.assertEqual(a, ops.unpermute(y_d, sid_d, w_d), atol=0, rtol=0)

    @onlyCUDA
    def test_autograd_and_compile(self, device):
        g = torch.Generator().manual_seed(0)
        T, k, dim = 256, 2, 512
        sid, w = self._routing(T, k, 8, "align", g)
        sid, w = sid.to(device), w.to(device)
        x = torch.randn(T, dim, device=device, dtype=torch.bfloat16)

        def f(x, w):
            return ops.unpermute(ops.permute(x, sid, k) * 2, sid, w)

        results = []
        for fn in (f, torch.compile(f, fullgraph=True)):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = fn(xr, wr)
            out.float().square().sum().backward()
            results.append((out, xr.grad, wr.grad))
        for a, b in zip(*results):
            self.assertEqual(a, b, atol=2e-2, rtol=2e-2)


from torch.testing._internal.common_utils import instantiate_parametrized_tests  # noqa: E402

instantiate_parametrized_tests(TestTritonPermute)
instantiate_device_type_tests(TestTritonPermuteCUDA, globals(), only_for="cuda")


if __name__ == "__main__":
    run_tests()
