# Owner(s): ["module: inductor"]
"""Malformed calls of the torch_moe ops and ``moe_ffn`` under ``torch.compile`` (Inductor).

A compiled call must fail as the eager call does: the same exception type, naming the argument
and the value expected. Metadata errors (shapes, dtypes, devices) come from the fake kernels
while Dynamo traces, with the value given; value errors (ids out of range, an assignment in two
slots) are on-device asserts of the decompositions, which name the argument and the expected
range but not the values seen (printing those would need a host synchronisation). Unusual but
valid input (no tokens, only padding, NaN in a real row) must give eager's result.

Each compiled function is compiled once per input signature and reused by every case with that
signature, so a case costs a compilation only where its shapes or dtypes are new.
"""

import functools

import torch
from torch._inductor.utils import fresh_cache
from torch.testing._internal.common_utils import run_tests

from _malformed import Case, malformed_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe import _refs
from torch_moe.nn.functional import moe_ffn

ops = torch.ops.torch_moe
T, K, E, D, FF = 6, 2, 3, 4, 32
NAN, INF = float("nan"), float("inf")
COMPILE_S = 120.0  # the first compilation of a process takes 10-20 s on two cores


@functools.cache
def compiled(name: str):
    fns = {
        "token_sort": lambda ids, num_experts, align: ops.token_sort(ids, num_experts, align),
        "permute": lambda x, sorted_ids, top_k: ops.permute(x, sorted_ids, top_k),
        "permute_backward": lambda grad, sorted_ids, top_k, num_tokens: ops.permute_backward(
            grad, sorted_ids, top_k, num_tokens),
        "unpermute": lambda y, sorted_ids, w: ops.unpermute(y, sorted_ids, w),
        "unpermute_backward": lambda grad, y, sorted_ids, w: ops.unpermute_backward(
            grad, y, sorted_ids, w, [True, True]),
        "moe_ffn": lambda x, ids, w, w1, w2, w3, precision="bf16": moe_ffn(
            x, ids, w, w1, w2, w3, precision=precision),
    }
    # moe_ffn raises ValueError from Python for bad arguments; fullgraph would turn that into
    # Dynamo's Unsupported("Observed exception"), so it may break the graph there as eager raises
    return torch.compile(fns[name], fullgraph=name != "moe_ffn", dynamic=False)


def _sorted_ids(T=T, align=4):
    ids = torch.rand(T, E, generator=torch.Generator().manual_seed(0)).topk(K, dim=1).indices
    return ops.token_sort(ids, E, align)[0]


def _with(sorted_ids, index, value):
    out = sorted_ids.clone()
    out[index] = value
    return out


def _duplicate(sorted_ids):
    """A padding slot given the assignment of slot 0 as well."""
    return _with(sorted_ids, int((sorted_ids < 0).nonzero()[0]), int(sorted_ids[0]))


def _dropped(sorted_ids):
    """Assignment 1 (token 0, slot 1) loses its slot, as a capacity limit drops it."""
    return torch.where(sorted_ids == 1, -1, sorted_ids)


def _x(T=T, dtype=torch.float32):
    return torch.randn(T, D, generator=torch.Generator().manual_seed(1)).to(dtype)


def _y(S, dtype=torch.float32):
    return torch.randn(S, D, generator=torch.Generator().manual_seed(2)).to(dtype)


def _w(T=T, dtype=torch.float32):
    return torch.rand(T, K, generator=torch.Generator().manual_seed(3)).to(dtype)


def _ffn_weights():
    g = torch.Generator().manual_seed(4)
    return (torch.randn(E, FF, FF, generator=g) / 8, torch.randn(E, FF, FF, generator=g) / 8,
            torch.randn(E, FF, FF, generator=g) / 8)


def _ffn_ids(T=T):
    return torch.rand(T, E, generator=torch.Generator().manual_seed(5)).topk(K, dim=1).indices


def _equals(expected):
    def check(result):
        torch.testing.assert_close(result, expected, equal_nan=True, atol=1e-6, rtol=1e-6)

    return check


def _zeros(shape, dtype=torch.float32):
    return _equals(torch.zeros(shape, dtype=dtype))


def _case(op, name, call, **kw):
    return Case(f"compiled.torch_moe.{op}", name, call, timeout_s=COMPILE_S, **kw)


def _error(op, name, call, *needles, error=RuntimeError):
    return _case(op, name, call, error=error, needles=(f"torch_moe.{op}",) + needles)


S = _sorted_ids().numel()  # 6 * 2 + 3 * 3 = 21 slots
RANGE = f"expected sorted_ids values in [-1, {T * K})"
ONCE = "expected each assignment t * k + j at most once in sorted_ids"


def _permute_cases():
    p = compiled("permute")
    sid = _sorted_ids()
    return [
        _error("permute", "x_3d", lambda: p(_x().view(T, 2, 2), sid, K), "x", "2-D", "3-D"),
        _error("permute", "sorted_ids_int32", lambda: p(_x(), sid.int(), K),
               "sorted_ids", "int64", "torch.int32"),
        _error("permute", "sorted_ids_float", lambda: p(_x(), sid.float(), K),
               "sorted_ids", "int64", "torch.float32"),
        _error("permute", "sorted_ids_2d", lambda: p(_x(), sid.view(3, 7), K),
               "sorted_ids", "1-D", "2-D"),
        _error("permute", "top_k_zero", lambda: p(_x(), sid, 0), "top_k >= 1", "0"),
        _error("permute", "devices_differ", lambda: p(_x().to("meta"), sid, K),
               "one device", "meta", "cpu"),
        _error("permute", "id_too_large", lambda: p(_x(), _with(sid, 1, T * K), K),
               "sorted_ids", RANGE),
        _error("permute", "id_below_minus_one", lambda: p(_x(), _with(sid, 1, -2), K),
               "sorted_ids", RANGE),
        _error("permute", "duplicate_assignment", lambda: p(_x(), _duplicate(sid), K),
               "sorted_ids", ONCE),
        _case("permute", "no_tokens_only_padding", lambda: p(_x(0), _sorted_ids(0, 16), K),
              check=_zeros((E * 15, D))),
        _case("permute", "nan_row_not_read_by_padding",
              lambda: p(_x().index_fill(0, torch.tensor([0]), NAN), sid, K),
              check=_equals(_refs.permute(_x().index_fill(0, torch.tensor([0]), NAN), sid, K))),
    ]


def _unpermute_cases():
    u = compiled("unpermute")
    sid = _sorted_ids()
    y = _y(S)
    nan_y = y.index_fill(0, torch.tensor([0]), NAN)
    return [
        _error("unpermute", "y_int", lambda: u(y.long(), sid, _w()), "y", "float32", "torch.int64"),
        _error("unpermute", "y_bool", lambda: u(y.bool(), sid, _w()), "y", "float32", "torch.bool"),
        _error("unpermute", "weights_complex", lambda: u(y, sid, _w().to(torch.complex64)),
               "topk_weights", "float32", "torch.complex64"),
        _error("unpermute", "y_rows_differ", lambda: u(y[:-1], sid, _w()),
               "y.size(0)", f"({S})", f"{S - 1}"),
        _error("unpermute", "weights_1d", lambda: u(y, sid, _w().view(-1)),
               "topk_weights", "2-D", "1-D"),
        _error("unpermute", "id_too_large", lambda: u(y, _with(sid, 1, T * K), _w()),
               "sorted_ids", RANGE),
        _error("unpermute", "id_below_minus_one", lambda: u(y, _with(sid, 1, -5), _w()),
               "sorted_ids", RANGE),
        _error("unpermute", "duplicate_assignment", lambda: u(y, _duplicate(sid), _w()),
               "sorted_ids", ONCE),
        _case("unpermute", "no_tokens_only_padding",
              lambda: u(_y(E * 15), _sorted_ids(0, 16), _w(0)), check=_zeros((0, D))),
        _case("unpermute", "dropped_assignment_reads_no_row",
              lambda: u(nan_y, _dropped(sid), _w()),
              check=_equals(_refs.unpermute(nan_y, _dropped(sid), _w()))),
        _case("unpermute", "inf_weight_of_dropped_assignment",
              lambda: u(y, _dropped(sid), _w().index_put((torch.tensor([0]), torch.tensor([1])),
                                                         torch.tensor(INF))),
              check=_equals(_refs.unpermute(y, _dropped(sid), _w()))),
        _case("unpermute", "fp64_sums_in_fp64",
              lambda: u(y.double() * 1e6, sid, _w(dtype=torch.float64)),
              check=_equals(_refs.unpermute(y.double() * 1e6, sid, _w(dtype=torch.float64)))),
    ]


def _permute_grad_reference(grad, sorted_ids, num_tokens):
    x = torch.zeros(num_tokens, D, requires_grad=True)
    (_refs.permute(x, sorted_ids, K) * grad).sum().backward()
    return x.grad


def _backward_cases():
    pb, ub = compiled("permute_backward"), compiled("unpermute_backward")
    sid = _sorted_ids()
    grad_y, grad_x = _y(S), _x()
    nan_grad_y = grad_y.index_fill(0, torch.tensor([0]), NAN)
    return [
        _error("permute_backward", "id_too_large", lambda: pb(grad_y, _with(sid, 1, T * K), K, T),
               "sorted_ids", RANGE),
        _error("permute_backward", "duplicate_assignment",
               lambda: pb(grad_y, _duplicate(sid), K, T), "sorted_ids", ONCE),
        _case("permute_backward", "no_tokens_only_padding",
              lambda: pb(_y(E * 15), _sorted_ids(0, 16), K, 0), check=_zeros((0, D))),
        _case("permute_backward", "dropped_assignment_reads_no_row",
              lambda: pb(nan_grad_y, _dropped(sid), K, T),
              check=_equals(_permute_grad_reference(nan_grad_y, _dropped(sid), T))),
        _error("unpermute_backward", "id_below_minus_one",
               lambda: ub(grad_x, _y(S), _with(sid, 1, -2), _w()), "sorted_ids", RANGE),
        _error("unpermute_backward", "duplicate_assignment",
               lambda: ub(grad_x, _y(S), _duplicate(sid), _w()), "sorted_ids", ONCE),
        _case("unpermute_backward", "no_tokens_only_padding",
              lambda: ub(_x(0), _y(E * 15), _sorted_ids(0, 16), _w(0)),
              check=lambda r: (_zeros((E * 15, D))(r[0]), _zeros((0, K))(r[1]))),
    ]


def _token_sort_cases():
    ts = compiled("token_sort")
    ids = _ffn_ids()
    return [
        _error("token_sort", "ids_float", lambda: ts(ids.float(), E, 1),
               "topk_ids", "int32 or int64", "torch.float32"),
        _error("token_sort", "ids_bool", lambda: ts(ids.bool(), E, 1),
               "topk_ids", "int32 or int64", "torch.bool"),
        _error("token_sort", "ids_1d", lambda: ts(ids.view(-1), E, 1), "topk_ids", "2-D", "1-D"),
        _error("token_sort", "k_above_num_experts", lambda: ts(ids, 1, 1),
               "top-k (2) <= num_experts (1)"),
        _error("token_sort", "num_experts_zero", lambda: ts(ids, 0, 1),
               "expected num_experts", "but got 0"),
        _error("token_sort", "align_zero", lambda: ts(ids, E, 0), "expected align", "but got 0"),
        _error("token_sort", "id_too_large", lambda: ts(_with(ids, (0, 0), E), E, 4),
               "topk_ids", f"expected topk_ids values in [0, {E})"),
        _error("token_sort", "id_negative", lambda: ts(_with(ids, (0, 0), -1), E, 4),
               "topk_ids", f"expected topk_ids values in [0, {E})"),
        _error("token_sort", "slots_overflow_int32", lambda: ts(ids, 2**20, 2**12),
               "sorted slots", "2147483647", "4293918732"),
        _error("token_sort", "ids_int8", lambda: ts(ids.to(torch.int8), E, 1),
               "topk_ids", "int32 or int64", "torch.int8"),
        _case("token_sort", "no_tokens", lambda: ts(ids[:0], E, 4),
              check=lambda r: (_equals(torch.full((E * 3,), -1))(r[0]),
                               _equals(torch.zeros(E, dtype=torch.int32))(r[1]))),
    ]


def _moe_ffn_cases():
    f = compiled("moe_ffn")
    w1, w2, w3 = _ffn_weights()
    x = torch.randn(T, FF, generator=torch.Generator().manual_seed(6))
    ids, w = _ffn_ids(), _w()
    op = "moe_ffn"
    return [
        Case(f"compiled.{op}", "id_too_large", lambda: f(x, _with(ids, (0, 0), E), w, w1, w2, w3),
             error=RuntimeError, needles=("topk_ids", f"[0, {E})"), timeout_s=COMPILE_S),
        Case(f"compiled.{op}", "id_negative", lambda: f(x, _with(ids, (0, 0), -1), w, w1, w2, w3),
             error=RuntimeError, needles=("topk_ids", f"[0, {E})"), timeout_s=COMPILE_S),
        Case(f"compiled.{op}", "weights_shape_differs", lambda: f(x, ids, w[:, :1], w1, w2, w3),
             error=ValueError, needles=("topk_weights", "[T, k]", "(6, 1)"), timeout_s=COMPILE_S),
        Case(f"compiled.{op}", "k_above_num_experts",
             lambda: f(x, torch.zeros(T, E + 1, dtype=torch.int64), torch.rand(T, E + 1),
                       w1, w2, w3),
             error=RuntimeError, needles=("top-k (4) <= num_experts (3)",), timeout_s=COMPILE_S),
        Case(f"compiled.{op}", "unknown_precision", lambda: f(x, ids, w, w1, w2, w3, "fp4"),
             error=ValueError, needles=("precision", "'fp4'"), timeout_s=COMPILE_S),
        Case(f"compiled.{op}", "x_int", lambda: f(x.long(), ids, w, w1, w2, w3),
             error=RuntimeError, needles=("x", "float32", "torch.int64"), timeout_s=COMPILE_S),
    ] + [
        Case(f"compiled.{op}", f"no_tokens_{p}",
             lambda p=p: f(x[:0], ids[:0], w[:0], w1, w2, w3, p), check=_zeros((0, FF)),
             timeout_s=COMPILE_S)
        for p in ("bf16", "fp8_rowwise", "mxfp8")
    ]


CASES = (_permute_cases() + _unpermute_cases() + _backward_cases() + _token_sort_cases()
         + _moe_ffn_cases())

TestMalformedCompile = malformed_tests(CASES, "TestMalformedCompile")


def _fresh_caches(cls):
    # compiled results must come from the decompositions of this checkout, not a cache entry
    setup, teardown = cls.setUpClass.__func__, cls.tearDownClass.__func__

    def setUpClass(c):
        c._caches = fresh_cache()
        c._caches.__enter__()
        setup(c)

    def tearDownClass(c):
        teardown(c)
        c._caches.__exit__(None, None, None)

    cls.setUpClass, cls.tearDownClass = classmethod(setUpClass), classmethod(tearDownClass)
    return cls


_fresh_caches(TestMalformedCompile)


if __name__ == "__main__":
    run_tests()
