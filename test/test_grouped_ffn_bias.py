# Owner(s): ["module: moe"]
"""Expert biases of ``torch_moe::grouped_ffn`` (gpt-oss's ``gate_up_proj_bias`` and
``down_proj_bias``): the CPU kernel against the references and by gradcheck, its fake kernel,
``opcheck``, the checks of the op and of ``moe_ffn``, bf16 against fp32 within a bound derived
from the kernel's roundings, ``torch.compile``, and the FP8 expert FFN with biases.

The semantics, for the expert ``e`` of assignment ``(t, j)`` and its routing weight ``p``::

    h1 = x[t] @ w1[e] + b1[e]      (b1 [E, F], or [E, 2F] for a fused w13)
    h3 = x[t] @ w3[e] + b3[e]      (b3 [E, F], a separate w3 only)
    out[t] += p * (act(h1, h3) @ w2[e] + b2[e])
"""

import itertools

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
from torch_moe import _refs
from torch_moe.nn.functional import moe_ffn

ops = torch.ops.torch_moe

# layout -> (activation, limit): the fused w13 runs gpt-oss's swiglu_oai with a limit that the
# pre-activations cross, so its clamps take part
LAYOUTS = {"separate": ("swiglu", 7.0), "fused": ("swiglu_oai", 1.0), "plain": ("gelu", 7.0)}
BIAS_NAMES = ("b1", "b2", "b3")


def _problem(layout, biases, *, T=5, k=2, E=4, D=3, F=2, align=4, dtype=torch.float64, seed=0,
             empty_expert=2):
    """The operands of one expert FFN with the given biases ("b1 b2 b3", any subset). Expert
    ``empty_expert`` gets no token; token_sort(align) pads every group with -1 slots."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([e for e in range(E) if e != empty_expert])
    topk_ids = torch.stack([used[torch.randperm(used.numel(), generator=g)[:k]] for _ in range(T)])
    activation, limit = LAYOUTS[layout]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    w1 = randn(E, D, 2 * F if layout == "fused" else F, scale=D ** -0.5)
    w3 = randn(E, D, F, scale=D ** -0.5) if layout == "separate" else None
    w2 = randn(E, F, D, scale=F ** -0.5)
    b = {
        "b1": randn(E, w1.size(2)) if "b1" in biases else None,
        "b2": randn(E, D) if "b2" in biases else None,
        "b3": randn(E, F) if "b3" in biases and w3 is not None else None,
    }
    sorted_ids, offs, _ = ops.token_sort(topk_ids, E, align)
    return dict(
        x=randn(T, D), topk_ids=topk_ids, topk_weights=torch.rand(T, k, generator=g).to(dtype),
        w1=w1, w2=w2, w3=w3, **b, sorted_ids=sorted_ids, offs=offs, activation=activation,
        limit=limit,
    )


def _op(p, **override):
    """grouped_ffn on the operands of ``p`` (those in ``override`` replaced)."""
    q = {**p, **override}
    return ops.grouped_ffn(q["x"], q["sorted_ids"], q["offs"], q["topk_weights"], q["w1"],
                           q["w2"], q["w3"], q["activation"], 1.702, q["limit"], q["b1"],
                           q["b2"], q["b3"])


def _ref(p, **override):
    q = {**p, **override}
    return _refs.moe_ffn(q["x"], q["topk_ids"], q["topk_weights"], q["w1"], q["w2"], q["w3"],
                         activation_kind=q["activation"], limit=q["limit"], b1=q["b1"],
                         b2=q["b2"], b3=q["b3"])


DIFFERENTIABLE = ("x", "topk_weights", "w1", "w2", "w3", "b1", "b2", "b3")


def _leaves(p):
    """The differentiable operands of ``p`` that are present, as fresh leaves."""
    return {n: p[n].detach().clone().requires_grad_() for n in DIFFERENTIABLE if p[n] is not None}


def _backward_args(p, grad, hidden, mask):
    return (grad, p["x"], p["sorted_ids"], p["offs"], p["topk_weights"], p["w1"], p["w2"], p["w3"],
            hidden, p["activation"], 1.702, p["limit"], mask, p["b1"], p["b2"], p["b3"])


# each bias alone and all together, in every weight layout
CASES = [
    ("separate", "b1"), ("separate", "b2"), ("separate", "b3"), ("separate", "b1 b2 b3"),
    ("fused", "b1"), ("fused", "b2"), ("fused", "b1 b2"),
    ("plain", "b1"), ("plain", "b1 b2"),
]


@instantiate_parametrized_tests
class TestGroupedFFNBiasCPU(TestCase):
    @parametrize("layout,biases", CASES)
    def test_gradcheck(self, layout, biases):
        # fp64, padding slots (align 4) and an expert without tokens (whose bias gradient is 0)
        p = _problem(layout, biases)
        leaves = _leaves(p)

        def f(*tensors):
            return _op(p, **dict(zip(leaves, tensors)))[0]

        self.assertTrue(torch.autograd.gradcheck(f, tuple(leaves.values())))

    @parametrize("layout,biases", CASES)
    def test_matches_reference_fp32(self, layout, biases):
        p = _problem(layout, biases, T=16, D=8, F=6, dtype=torch.float32, seed=1)
        leaves = _leaves(p)
        out, hidden = _op(p, **leaves)
        ref = _ref(p, **leaves)
        self.assertEqual(out, ref)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, tuple(leaves.values()), grad)
        exp = torch.autograd.grad(ref, tuple(leaves.values()), grad)
        for name, a, e in zip(leaves, got, exp):
            self.assertEqual(a, e, msg=f"grad_{name}")
        # hidden holds the pre-activations with the biases, within the error bound of an fp32
        # dot product of D terms plus the bias (|error| <= (D + 1) 2^-24 (|x| @ |w| + |b|) to
        # first order); padding slots hold exact zeros
        h64, magnitude = self._hidden(p)
        err = (hidden.double() - h64).abs()
        self.assertTrue((err <= (p["x"].size(1) + 1) * 2.0 ** -24 * magnitude).all())

    def _hidden(self, p):
        """The pre-activation of every sorted slot in fp64 and its magnitude |x| @ |w| + |b|
        (zeros for the padding slots)."""
        k = p["topk_weights"].size(1)
        starts = torch.cat([p["offs"].new_zeros(1), p["offs"][:-1]])
        fused = p["w3"] is None
        rows, magnitudes = [], []
        for i, a in enumerate(p["sorted_ids"].tolist()):
            e = int((p["offs"] <= i).sum())
            width = p["w1"].size(2) * (1 if fused else 2)
            if a < 0 or e >= p["w1"].size(0) or i < starts[e]:
                rows.append(torch.zeros(width, dtype=torch.float64))
                magnitudes.append(torch.zeros(width, dtype=torch.float64))
                continue
            xt = p["x"][a // k].double()
            parts = [(p["w1"][e].double(), p["b1"])]
            if not fused:
                parts.append((p["w3"][e].double(), p["b3"]))
            bias = [b[e].double() if b is not None else torch.zeros(w.size(1), dtype=torch.float64)
                    for w, b in parts]
            rows.append(torch.cat([xt @ w + b for (w, _), b in zip(parts, bias)]))
            magnitudes.append(torch.cat([xt.abs() @ w.abs() + b.abs()
                                         for (w, _), b in zip(parts, bias)]))
        return torch.stack(rows), torch.stack(magnitudes)

    def test_padding_slots_and_empty_experts(self):
        # the biases reach no padding slot: its rows of hidden stay zero; an expert without
        # tokens is read by nothing (NaN in its weights and biases changes nothing) and gets
        # zero gradients
        p = _problem("separate", "b1 b2 b3", T=6, E=4, align=8, seed=2)
        out, hidden = _op(p)
        pad = p["sorted_ids"] < 0
        self.assertTrue(pad.any())
        self.assertEqual(hidden[pad], torch.zeros_like(hidden[pad]), atol=0, rtol=0)
        empty = 2
        nan = {n: p[n].clone().index_fill_(0, torch.tensor([empty]), float("nan"))
               for n in ("w1", "w2", "w3", "b1", "b2", "b3")}
        out_nan, hidden_nan = _op(p, **nan)
        self.assertEqual(out_nan, out, atol=0, rtol=0)
        self.assertEqual(hidden_nan, hidden, atol=0, rtol=0)
        grads = ops.grouped_ffn_backward(*_backward_args({**p, **nan}, torch.ones_like(out),
                                                         hidden, [True] * 8))
        for name, g in zip(("x", "topk_weights", "w1", "w2", "w3", "b1", "b2", "b3"), grads):
            self.assertTrue(torch.isfinite(g).all(), f"grad_{name}")
        for g in grads[2:]:
            # the expert without tokens: a zero gradient for each of its weights and biases
            self.assertEqual(g[empty], torch.zeros_like(g[empty]), atol=0, rtol=0)

    def test_output_mask(self):
        # every subset of the eight gradients; the unrequested ones are empty, the requested
        # ones equal those of the full mask; the fake kernel agrees on shapes and dtypes
        p = _problem("separate", "b1 b2 b3", T=8, D=4, F=3)
        out, hidden = _op(p)
        grad = torch.randn_like(out)
        full = ops.grouped_ffn_backward(*_backward_args(p, grad, hidden, [True] * 8))
        for mask in itertools.product((False, True), repeat=8):
            got = ops.grouped_ffn_backward(*_backward_args(p, grad, hidden, list(mask)))
            with FakeTensorMode() as mode:
                conv = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                        for n, t in p.items()}
                fake = ops.grouped_ffn_backward(*_backward_args(
                    conv, mode.from_tensor(grad), mode.from_tensor(hidden), list(mask)))
            for want, a, f, fk in zip(mask, got, full, fake):
                self.assertEqual((a.shape, a.dtype), (fk.shape, fk.dtype))
                if want:
                    self.assertEqual(a, f, atol=0, rtol=0)
                else:
                    self.assertEqual(a.shape, (0,))

    def test_absent_biases_get_empty_gradients(self):
        p = _problem("fused", "b2")
        out, hidden = _op(p)
        grads = ops.grouped_ffn_backward(*_backward_args(p, torch.ones_like(out), hidden,
                                                         [True] * 8))
        self.assertEqual([tuple(g.shape) for g in grads[4:]], [(0,), (0,), (4, 3), (0,)])

    def test_frozen_biases(self):
        # needs_input_grad drives output_mask: frozen biases (and weights) are not asked for;
        # the gradients asked for are those of a fully trained run
        p = _problem("separate", "b1 b2 b3")
        leaves = _leaves(p)
        frozen = {**leaves, "b1": p["b1"], "b3": p["b3"], "w3": p["w3"]}
        with _RecordMasks() as masks:
            _op(p, **frozen)[0].sum().backward()
        self.assertEqual(masks.seen, [[True, True, True, True, False, False, True, False]])
        trained = _leaves(p)
        _op(p, **trained)[0].sum().backward()
        for n in ("x", "topk_weights", "w1", "w2", "b2"):
            self.assertEqual(leaves[n].grad, trained[n].grad, atol=0, rtol=0, msg=n)

    @parametrize("layout,biases", [("separate", "b1 b2 b3"), ("fused", "b1 b2"), ("plain", "b2")])
    def test_fake_tensor(self, layout, biases):
        p = _problem(layout, biases)
        with FakeTensorMode() as mode:
            fp = {n: mode.from_tensor(t).requires_grad_(t.is_floating_point())
                  if isinstance(t, torch.Tensor) else t for n, t in p.items()}
            out, hidden = _op(fp)
            out.sum().backward()
        real_out, real_hidden = _op(p)
        self.assertEqual((out.shape, hidden.shape), (real_out.shape, real_hidden.shape))
        for name in BIAS_NAMES:
            if p[name] is not None:
                self.assertEqual(fp[name].grad.shape, p[name].shape, msg=name)
                self.assertEqual(fp[name].grad.dtype, p[name].dtype, msg=name)

    @parametrize("layout,biases", [("separate", "b1 b2 b3"), ("fused", "b1 b2"), ("plain", "b1")])
    def test_opcheck(self, layout, biases):
        p = _problem(layout, biases, T=6)
        leaves = _leaves(p)
        q = {**p, **leaves}
        torch.library.opcheck(
            ops.grouped_ffn.default,
            (q["x"], q["sorted_ids"], q["offs"], q["topk_weights"], q["w1"], q["w2"], q["w3"],
             q["activation"], 1.702, q["limit"], q["b1"], q["b2"], q["b3"]),
        )
        out, hidden = _op(p)
        torch.library.opcheck(ops.grouped_ffn_backward.default,
                              _backward_args(p, torch.randn_like(out), hidden, [True] * 8))

    def test_non_contiguous_biases(self):
        # any strides: a transposed and a sliced bias give the values of contiguous ones
        p = _problem("separate", "b1 b2 b3", seed=3)
        strided = {"b1": p["b1"].t().contiguous().t(),
                   "b2": torch.stack([p["b2"], p["b2"]], -1)[..., 0],
                   "b3": torch.stack([p["b3"], p["b3"]], -1)[..., 1]}
        self.assertFalse(any(b.is_contiguous() for b in strided.values()))
        for a, e in zip(_op(p, **strided), _op(p)):
            self.assertEqual(a, e, atol=0, rtol=0)

    def test_bf16_within_rounding_bound(self):
        # The bf16 kernel against fp64 on the same (bf16) values. With u = 2^-8 (bf16's unit
        # roundoff), first-order error analysis of the kernel's roundings gives, elementwise:
        #   hidden:  |dh| <= 2u Hm,  Hm = |x| @ |w| + |b|  (the GEMM output, then the bias add,
        #            each rounded at most once; fp32 accumulation is far below u)
        #   act:     |da| <= |d act/d g| |dg| + |d act/d u| |du| + 4u |act|  (the activation's
        #            elementwise steps, each rounded once)
        #   out:     |dout| <= sum_j |p| (|da| @ |w2| + 2u (|act| @ |w2| + |b2|))
        #                      + 2u sum_j |p| (|act| @ |w2| + |b2|)  (p rounded to bf16, and
        #                                                            the product with it)
        #                      + u |out|                             (the final rounding)
        #   grad_b2: |d| <= u |grad_b2| + S 2^-24 sum_rows |p| |grad|  (bf16 rows and weights
        #            are exact in fp32: the fp32 sum over at most S rows, then one rounding)
        p = _problem("separate", "b1 b2 b3", T=32, E=4, D=16, F=8, dtype=torch.bfloat16, seed=4)
        out, hidden = _op(p)
        p64 = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
               for n, t in p.items()}
        out64, hidden64 = _op(p64)
        u = 2.0 ** -8
        bound = self._bf16_bounds(p64, u)
        self.assertTrue(((hidden.double() - hidden64).abs() <= bound["hidden"]).all())
        self.assertTrue(((out.double() - out64).abs() <= bound["out"]).all())
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
        only_b2 = [False] * 6 + [True, False]
        gb2 = ops.grouped_ffn_backward(*_backward_args(p, grad, hidden, only_b2))[6]
        gb2_64 = ops.grouped_ffn_backward(*_backward_args(p64, grad.double(), hidden64,
                                                          only_b2))[6]
        gb2_bound = u * gb2_64.abs() + bound["grad_b2"](grad.double())
        self.assertTrue(((gb2.double() - gb2_64).abs() <= gb2_bound).all())
        # the bound is not vacuous: the bf16 output without its down bias is far outside it
        self.assertFalse(((_op(p, b2=None)[0].double() - out64).abs() <= bound["out"]).all())

    def _bf16_bounds(self, p, u):
        """The error bounds of test_bf16_within_rounding_bound, from fp64 values."""
        S = p["sorted_ids"].numel()
        k = p["topk_weights"].size(1)
        valid = p["sorted_ids"] >= 0
        token = p["sorted_ids"].clamp(min=0) // k
        expert = torch.searchsorted(p["offs"], torch.arange(S, dtype=torch.int32), right=True)
        expert = expert.clamp(max=p["w1"].size(0) - 1)
        x = p["x"][token]
        w = p["topk_weights"].reshape(-1)[p["sorted_ids"].clamp(min=0)] * valid
        Hm = [torch.einsum("sd,sdf->sf", x.abs(), wt[expert].abs()) + b[expert].abs()
              for wt, b in ((p["w1"], p["b1"]), (p["w3"], p["b3"]))]
        g = (torch.einsum("sd,sdf->sf", x, p["w1"][expert]) + p["b1"][expert]).requires_grad_()
        up = (torch.einsum("sd,sdf->sf", x, p["w3"][expert]) + p["b3"][expert]).requires_grad_()
        a = _refs.activation(p["activation"], g, up)
        # the activation is elementwise: the gradient of its sum is its derivative
        dg, du = (d.abs() for d in torch.autograd.grad(a.sum(), (g, up)))
        a = a.detach()
        da = dg * 2 * u * Hm[0] + du * 2 * u * Hm[1] + 4 * u * a.abs()
        w2, b2 = p["w2"][expert].abs(), p["b2"][expert].abs()
        mag = torch.einsum("sf,sfd->sd", a.abs(), w2) + b2
        # the down GEMM and its bias (2u), p (u) and the product with p (u)
        slot_err = (torch.einsum("sf,sfd->sd", da, w2) + 4 * u * mag) * w.abs().unsqueeze(1)
        out64 = _op(p)[0]
        out_err = torch.zeros_like(out64).index_add_(0, token, slot_err * valid.unsqueeze(1))
        out_err += u * out64.abs()
        hidden_err = torch.cat([2 * u * h for h in Hm], 1) * valid.unsqueeze(1)

        def grad_b2(grad):
            per_slot = w.abs().unsqueeze(1) * grad[token].abs()
            return S * 2.0 ** -24 * torch.zeros_like(p["b2"]).index_add_(0, expert, per_slot)

        return {"hidden": hidden_err, "out": out_err, "grad_b2": grad_b2}


class _RecordMasks(TorchDispatchMode):
    """Records the output_mask of every grouped_ffn_backward call run under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ops.grouped_ffn_backward.default:
            self.seen.append(list(args[12]))
        return func(*args, **(kwargs or {}))


def _messages(calls: dict, mode=None) -> str:
    lines = []
    for name, call in calls.items():
        try:
            call(mode)
        except (RuntimeError, ValueError, TypeError) as e:
            lines.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0]}")
        else:
            lines.append(f"{name}: no error")
    return "\n".join(lines)


class TestGroupedFFNBiasChecks(TestCase):
    def _calls(self):
        E, D, F = 2, 4, 3
        p = _problem("fused", "", T=3, E=E, D=D, F=F, dtype=torch.float32, empty_expert=-1)
        ps = _problem("separate", "", T=3, E=E, D=D, F=F, dtype=torch.float32, empty_expert=-1)

        def op(problem, **b):
            def call(mode):
                q = {**problem, **b}
                if mode is not None:
                    q = {n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                         for n, t in q.items()}
                return _op(q)
            return call

        def backward(**b):
            def call(mode):
                q = {**p, **b}
                hidden = torch.zeros(q["sorted_ids"].numel(), 2 * F)
                args = _backward_args(q, torch.zeros(3, D), hidden, [True] * 8)
                if mode is not None:
                    args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                            for t in args]
                return ops.grouped_ffn_backward(*args)
            return call

        return {
            "b1_unfused_width": op(p, b1=torch.zeros(E, F)),
            "b1_1d": op(p, b1=torch.zeros(2 * F)),
            "b3_without_w3": op(p, b3=torch.zeros(E, F)),
            "b3_separate_width": op(ps, b3=torch.zeros(E, 2 * F)),
            "b2_experts": op(p, b2=torch.zeros(E + 1, D)),
            "b2_ffn_dim": op(p, b2=torch.zeros(E, F)),
            "b2_dtype": op(p, b2=torch.zeros(E, D, dtype=torch.float64)),
            "b1_int": op(p, b1=torch.zeros(E, 2 * F, dtype=torch.int64)),
            "b2_meta": op(p, b2=torch.zeros(E, D, device="meta")),
            "backward_b1_width": backward(b1=torch.zeros(E, F)),
            "backward_b2_int": backward(b2=torch.zeros(E, D, dtype=torch.int32)),
        }

    def test_op_checks(self):
        calls = self._calls()
        eager = _messages(calls)
        with FakeTensorMode() as mode:
            fake = _messages(calls, mode)
        self.assertEqual(fake, eager)
        self.assertExpectedInline(eager, """\
b1_unfused_width: RuntimeError: torch_moe.grouped_ffn: expected b1 of shape [E, 2F] = (2, 6), but got (2, 3)
b1_1d: RuntimeError: torch_moe.grouped_ffn: expected b1 to be 2-D, but got 1-D tensor of shape (6,)
b3_without_w3: RuntimeError: torch_moe.grouped_ffn: b3 is the bias of the up projection w3, but w3 is None (the bias of a fused gate/up weight is b1 [E, 2F])
b3_separate_width: RuntimeError: torch_moe.grouped_ffn: expected b3 of shape [E, F] = (2, 3), but got (2, 6)
b2_experts: RuntimeError: torch_moe.grouped_ffn: expected b2 of shape [E, D] = (2, 4), but got (3, 4)
b2_ffn_dim: RuntimeError: torch_moe.grouped_ffn: expected b2 of shape [E, D] = (2, 4), but got (2, 3)
b2_dtype: RuntimeError: torch_moe.grouped_ffn: expected b2 to have the dtype of w1 (torch.float32), but got torch.float64
b1_int: RuntimeError: torch_moe.grouped_ffn: expected b1 to have the dtype of w1 (torch.float32), but got torch.int64
b2_meta: RuntimeError: torch_moe.grouped_ffn: expected all tensors on one device, but w1 is on cpu and b2 is on meta
backward_b1_width: RuntimeError: torch_moe.grouped_ffn_backward: expected b1 of shape [E, 2F] = (2, 6), but got (2, 3)
backward_b2_int: RuntimeError: torch_moe.grouped_ffn_backward: expected b2 to have the dtype of w1 (torch.float32), but got torch.int32""")

    def test_moe_ffn_checks(self):
        E, D, F = 2, 4, 3
        p = _problem("fused", "", T=3, E=E, D=D, F=F, dtype=torch.float32, empty_expert=-1)
        ps = _problem("separate", "", T=3, E=E, D=D, F=F, dtype=torch.float32, empty_expert=-1)

        def call(problem, **b):
            return lambda mode: moe_ffn(problem["x"], problem["topk_ids"],
                                        problem["topk_weights"], problem["w1"], problem["w2"],
                                        problem["w3"], activation=problem["activation"], **b)

        calls = {
            "b1_unfused_width": call(p, b1=torch.zeros(E, F)),
            "b3_without_w3": call(p, b3=torch.zeros(E, F)),
            "b1_separate_width": call(ps, b1=torch.zeros(E, 2 * F)),
            "b2_shape": call(p, b2=torch.zeros(D)),
            "b2_dtype": call(p, b2=torch.zeros(E, D, dtype=torch.bfloat16)),
            "b1_int": call(p, b1=torch.zeros(E, 2 * F, dtype=torch.int64)),
            "b2_meta": call(p, b2=torch.zeros(E, D, device="meta")),
            "b1_positional": lambda mode: moe_ffn(p["x"], p["topk_ids"], p["topk_weights"],
                                                  p["w1"], p["w2"], None, torch.zeros(E, 2 * F)),
        }
        self.assertExpectedInline(_messages(calls), """\
b1_unfused_width: ValueError: moe_ffn: expected b1 of shape (2, 6) ([E, 2F]: gate and up of a fused w1), but got (2, 3)
b3_without_w3: ValueError: moe_ffn: b3 is the bias of the up projection w3, but w3 is None (with a fused gate/up w1, pass both biases in b1 [E, 2F])
b1_separate_width: ValueError: moe_ffn: expected b1 of shape (2, 3) ([E, F]), but got (2, 6)
b2_shape: ValueError: moe_ffn: expected b2 of shape (2, 4) ([E, D]), but got (4,)
b2_dtype: TypeError: moe_ffn: expected b2 in the dtype of w1 (torch.float32), but got torch.bfloat16
b1_int: TypeError: moe_ffn: expected b1 to be bfloat16, float16, float32 or float64, but got torch.int64
b2_meta: ValueError: moe_ffn: expected b2 on the device of w1 (cpu), but got meta
b1_positional: TypeError: moe_ffn() takes from 5 to 6 positional arguments but 7 were given""")


@instantiate_parametrized_tests
class TestMoEFFNBias(TestCase):
    def _layer(self, dtype=torch.float32):
        p = _problem("fused", "b1 b2", T=12, E=4, D=8, F=6, dtype=dtype, seed=5)
        return p, _leaves(p)

    def test_moe_ffn_matches_reference(self):
        p, leaves = self._layer()
        out = moe_ffn(leaves["x"], p["topk_ids"], leaves["topk_weights"], leaves["w1"],
                      leaves["w2"], None, activation=p["activation"], limit=p["limit"],
                      b1=leaves["b1"], b2=leaves["b2"])
        ref = _ref(p, **leaves)
        self.assertEqual(out, ref)
        grads = torch.autograd.grad(out.sum(), (leaves["b1"], leaves["b2"]))
        exp = torch.autograd.grad(ref.sum(), (leaves["b1"], leaves["b2"]))
        self.assertEqual(grads, exp)

    def test_compile_fullgraph(self):
        p, leaves = self._layer()

        def f(x, tw, w1, w2, b1, b2):
            return moe_ffn(x, p["topk_ids"], tw, w1, w2, None, activation="swiglu_oai",
                           limit=p["limit"], b1=b1, b2=b2)

        names = ("x", "topk_weights", "w1", "w2", "b1", "b2")
        eager_in = [leaves[n] for n in names]
        compiled_in = [t.detach().clone().requires_grad_() for t in eager_in]
        eager = f(*eager_in)
        compiled = torch.compile(f, fullgraph=True)(*compiled_in)
        self.assertEqual(compiled, eager)
        grad = torch.randn_like(eager)
        eager.backward(grad)
        compiled.backward(grad)
        for n, a, b in zip(names, compiled_in, eager_in):
            self.assertEqual(a.grad, b.grad, msg=f"grad {n}")

    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_quantized_against_bf16(self, precision):
        # SQNR against the bf16 path, as test_quantization's moe_ffn test does (22 dB for the
        # output) and torchao's MoE test for the gradients (21 dB); the biases are of the scale
        # of the GEMM outputs, so a dropped or unweighted bias costs far more than that
        g = torch.Generator().manual_seed(0)
        T, D, F, E, k = 40, 64, 96, 4, 2
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
        tw = torch.rand(T, k, generator=g)
        w1, w3 = ((torch.randn(E, D, F, generator=g) / D ** 0.5).bfloat16() for _ in range(2))
        w2 = (torch.randn(E, F, D, generator=g) / F ** 0.5).bfloat16()
        b1, b3 = (torch.randn(E, F, generator=g).bfloat16() for _ in range(2))
        b2 = torch.randn(E, D, generator=g).bfloat16()
        tensors = {"x": x, "w1": w1, "w2": w2, "w3": w3, "b1": b1, "b2": b2, "b3": b3}
        grad = torch.randn(T, D, generator=g).bfloat16()

        def run(fused, **kw):
            leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
            if fused:
                w13 = torch.cat([leaves["w1"], leaves["w3"]], -1)
                b13 = torch.cat([leaves["b1"], leaves["b3"]], -1)
                out = moe_ffn(leaves["x"], ids, tw, w13, leaves["w2"], None, b1=b13,
                              b2=leaves["b2"], **kw)
            else:
                out = moe_ffn(leaves["x"], ids, tw, leaves["w1"], leaves["w2"], leaves["w3"],
                              b1=leaves["b1"], b2=leaves["b2"], b3=leaves["b3"], **kw)
            out.backward(grad)
            return out, {n: t.grad for n, t in leaves.items()}

        ref, ref_grads = run(False)
        out, grads = run(False, precision=precision)
        self.assertEqual(out.dtype, torch.bfloat16)
        self.assertGreaterEqual(_sqnr(ref, out), 22.0)
        for n in tensors:
            self.assertGreaterEqual(_sqnr(ref_grads[n], grads[n]), 21.0, msg=f"grad {n}")
        # a fused gate/up weight with its concatenated bias gives the same output (the
        # gradients differ: dgrad quantizes the rows of dH over 2F, not F)
        fused, _ = run(True, precision=precision)
        self.assertEqual(fused, out, atol=0, rtol=0)


class _RecordGemmInputs(TorchDispatchMode):
    """Records the row operand of every quantized_grouped_mm call run under it."""

    def __init__(self):
        super().__init__()
        self.inputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is ops.quantized_grouped_mm.default:
            self.inputs.append(args[0])
        return func(*args, **(kwargs or {}))


@instantiate_parametrized_tests
class TestQuantizedExpertFFNBiasPadding(TestCase):
    @parametrize("precision", ["fp8_rowwise", "mxfp8"])
    def test_padding_slots_stay_zero_rows(self, precision):
        # The biases reach no padding slot: every GEMM reads zero rows there, so a padding row
        # moves no quantization scale (an MXFP8 block of the weight gradient spans 32 slots)
        from torch_moe.quantization.ffn import group_alignment, quantized_expert_ffn

        g = torch.Generator().manual_seed(1)
        T, D, F, E, k = 20, 64, 64, 3, 2
        x = torch.randn(T, D, generator=g).bfloat16()
        ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
        tw = torch.rand(T, k, generator=g)
        w1, w3 = ((torch.randn(E, D, F, generator=g) / D ** 0.5).bfloat16() for _ in range(2))
        w2 = (torch.randn(E, F, D, generator=g) / F ** 0.5).bfloat16()
        b1, b3 = (torch.randn(E, F, generator=g).bfloat16() + 1 for _ in range(2))
        b2 = torch.randn(E, D, generator=g).bfloat16() + 1
        sorted_ids, offs, _ = ops.token_sort(ids, E, group_alignment(precision))
        pad = sorted_ids < 0
        self.assertTrue(pad.any())
        with _RecordGemmInputs() as rec:
            quantized_expert_ffn(x, sorted_ids, offs, tw, w1, w2, w3, activation="swiglu",
                                 alpha=1.702, limit=7.0, precision=precision, b1=b1, b2=b2,
                                 b3=b3)
        self.assertEqual(len(rec.inputs), 3)
        for a in rec.inputs:
            self.assertEqual(a[pad], torch.zeros_like(a[pad]), atol=0, rtol=0)


class TestMoEFFNBiasDTensor(TestCase):
    """moe_ffn with biases on DTensors, token parallel (the handler forwards the replicated
    biases), against the plain layer."""

    WORLD = 4

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch.distributed as dist
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (the "fake" backend)

        import torch_moe.distributed.tensor  # noqa: F401  (the DTensor handlers)

        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=cls.WORLD)

    @classmethod
    def tearDownClass(cls):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        super().tearDownClass()

    def test_token_parallel(self):
        from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        p = _problem("separate", "b1 b2 b3", T=16, E=4, D=8, F=6, dtype=torch.float32, seed=6)
        leaves = _leaves(p)
        names = ("w1", "w2", "w3", "b1", "b2", "b3")

        def run(x, tw, ids, **t):
            return moe_ffn(x, ids, tw, t["w1"], t["w2"], t["w3"], b1=t["b1"], b2=t["b2"],
                           b3=t["b3"])

        ref = run(leaves["x"], leaves["topk_weights"], p["topk_ids"],
                  **{n: leaves[n] for n in names})
        grad = torch.randn_like(ref)
        ref.backward(grad)

        def value(t):
            vals = list(t._local_tensors.values()) if isinstance(t, LocalTensor) else [t]
            for v in vals[1:]:
                self.assertEqual(v, vals[0], atol=0, rtol=0)
            return vals[0]

        with LocalTensorMode(frozenset(range(self.WORLD))):
            mesh = init_device_mesh("cpu", (self.WORLD,))
            tok, rep = [Shard(0)], [Replicate()]
            d = {n: distribute_tensor(leaves[n].detach(), mesh, tok if n in ("x", "topk_weights")
                                      else rep).requires_grad_() for n in leaves}
            out = run(d["x"], d["topk_weights"], distribute_tensor(p["topk_ids"], mesh, tok),
                      **{n: d[n] for n in names})
            self.assertEqual(out.placements, (Shard(0),))
            out.backward(distribute_tensor(grad, mesh, tok))
            got = {"out": value(out.full_tensor())}
            got.update({n: value(d[n].grad.full_tensor()) for n in leaves})
        self.assertEqual(got["out"], ref)
        for n in leaves:
            self.assertEqual(got[n], leaves[n].grad, msg=f"grad {n}")


def _sqnr(ref, actual) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


if __name__ == "__main__":
    run_tests()
