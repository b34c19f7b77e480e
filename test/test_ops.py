# Owner(s): ["module: moe"]
"""OpInfo-driven tests of the torch_moe ops: references, opcheck, gradcheck, fake kernels,
determinism and the fixes over ``aten::_grouped_mm``."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests,
    ops,
)
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_moe
import torch_moe._refs
from moe_op_db import moe_op_db, make_topk_ids

moe_ops = torch.ops.torch_moe
_differentiable = [op for op in moe_op_db if op.supports_autograd]
_custom_ops = [op for op in moe_op_db if isinstance(op.op, torch._ops.OpOverload)]

# bf16 / fp16 outputs are rounded once from fp32 (or better) accumulation; sums over up to k
# experts of O(1) values
_TOLS = {
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=2e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float64: dict(atol=1e-10, rtol=1e-10),
}


def _tols(dtype):
    return _TOLS.get(dtype, dict(atol=0, rtol=0))


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


class TestMoEOps(TestCase):
    @ops(moe_op_db)
    def test_reference(self, device, dtype, op):
        for sample in op.sample_inputs(device, dtype):
            out = op(sample.input, *sample.args, **sample.kwargs)
            ref = op.ref(sample.input, *sample.args, **sample.kwargs)
            if isinstance(out, tuple):
                for o, r in zip(out, ref):
                    self.assertEqual(o, r, exact_dtype=False, atol=0, rtol=0)
            else:
                self.assertEqual(out, ref, **_tols(dtype))

    @ops(_custom_ops, allowed_dtypes=(torch.float32, torch.bfloat16, torch.int64))
    def test_opcheck(self, device, dtype, op):
        # the first samples cover empty experts, padding and non-contiguous inputs
        for i, sample in enumerate(op.sample_inputs(device, dtype, requires_grad=op.supports_autograd)):
            if i >= 4:
                break
            torch.library.opcheck(op.op, (sample.input, *sample.args), sample.kwargs)

    @ops(_differentiable, allowed_dtypes=(torch.float64,))
    def test_gradcheck(self, device, dtype, op):
        for sample in op.sample_inputs(device, dtype, requires_grad=True):
            leaves = [
                t for t in [sample.input, *sample.args, *sample.kwargs.values()]
                if isinstance(t, torch.Tensor) and t.requires_grad
            ]

            def fn(*tensors):
                it = iter(tensors)
                swap = lambda a: next(it) if isinstance(a, torch.Tensor) and a.requires_grad else a
                args = [swap(a) for a in [sample.input, *sample.args]]
                kwargs = {k: swap(v) for k, v in sample.kwargs.items()}
                return op(*args, **kwargs)

            self.assertTrue(torch.autograd.gradcheck(fn, leaves, fast_mode=True))

    @ops(_differentiable, allowed_dtypes=(torch.float64,))
    def test_grad_against_reference(self, device, dtype, op):
        # gradients against autograd through the loop reference, for a stride-0 grad (from
        # .sum()) and for a dense random grad
        for sample in op.sample_inputs(device, dtype, requires_grad=True):
            args = [sample.input, *sample.args]
            leaves = [t for t in [*args, *sample.kwargs.values()]
                      if isinstance(t, torch.Tensor) and t.requires_grad]
            out = op(*args, **sample.kwargs)
            ref = op.autograd_ref(*args, **sample.kwargs)
            for grad_out in (None, torch.randn_like(out)):
                got, expected = (
                    # a reference with no rows does not depend on its inputs at all
                    torch.autograd.grad(o.sum() if grad_out is None else o, leaves, grad_out,
                                        retain_graph=True, allow_unused=True)
                    if o.requires_grad else [None] * len(leaves)
                    for o in (out, ref)
                )
                for g, e, leaf in zip(got, expected, leaves):
                    self.assertEqual(
                        g if g is not None else torch.zeros_like(leaf),
                        e if e is not None else torch.zeros_like(leaf),
                    )

    @ops(moe_op_db)
    def test_fake_matches_eager(self, device, dtype, op):
        # every dtype the op accepts has a fake kernel with the eager output's metadata
        for sample in op.sample_inputs(device, dtype):
            out = op(sample.input, *sample.args, **sample.kwargs)
            with FakeTensorMode(allow_non_fake_inputs=False) as mode:
                conv = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                fake = op(conv(sample.input), *[conv(a) for a in sample.args],
                          **{k: conv(v) for k, v in sample.kwargs.items()})
            outs = out if isinstance(out, tuple) else (out,)
            fakes = fake if isinstance(fake, tuple) else (fake,)
            for o, f in zip(outs, fakes):
                self.assertEqual((o.shape, o.stride(), o.dtype), (f.shape, f.stride(), f.dtype))

    @ops(moe_op_db, allowed_dtypes=(torch.bfloat16, torch.float32, torch.int64))
    def test_deterministic(self, device, dtype, op):
        for sample in op.sample_inputs(device, dtype, requires_grad=op.supports_autograd):
            runs = []
            for _ in range(2):
                out = _first(op(sample.input, *sample.args, **sample.kwargs))
                grads = ()
                if op.supports_autograd and out.requires_grad:
                    leaves = [t for t in [sample.input, *sample.args, *sample.kwargs.values()]
                              if isinstance(t, torch.Tensor) and t.requires_grad]
                    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
                runs.append((out.detach(), *grads))
            for a, b in zip(*runs):
                self.assertTrue(torch.equal(a, b))


class TestGroupedMMFixes(TestCase):
    """What ``aten::_grouped_mm`` gets wrong in torch 2.13 and torch_moe.grouped_mm does not."""

    def setUp(self):
        super().setUp()
        torch.manual_seed(0)

    def test_rows_past_last_group_are_zero(self):
        a = torch.randn(9, 4)
        b = torch.randn(2, 4, 3)
        out = moe_ops.grouped_mm(a, b, torch.tensor([2, 5], dtype=torch.int32))
        self.assertEqual(out[5:], torch.zeros(4, 3), atol=0, rtol=0)
        grad_a, = torch.autograd.grad(
            moe_ops.grouped_mm(a.requires_grad_(), b, torch.tensor([2, 5], dtype=torch.int32)).sum(), a
        )
        self.assertEqual(grad_a[5:], torch.zeros(4, 4), atol=0, rtol=0)

    def test_expanded_grad(self):
        # out.sum().backward() hands the op a stride-0 gradient
        a = torch.randn(6, 4, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(2, 4, 3, dtype=torch.bfloat16, requires_grad=True)
        moe_ops.grouped_mm(a, b, torch.tensor([1, 6], dtype=torch.int32)).sum().backward()
        ref_b = torch.stack([a[:1].float().sum(0), a[1:].float().sum(0)])[:, :, None].expand(2, 4, 3)
        self.assertEqual(b.grad.float(), ref_b, atol=2e-2, rtol=1e-2)

    def test_fake_fp32_fp16_fp64(self):
        for dtype in (torch.float16, torch.float32, torch.float64):
            with FakeTensorMode():
                out = moe_ops.grouped_mm(
                    torch.empty(8, 16, dtype=dtype), torch.empty(3, 16, 5, dtype=dtype),
                    torch.empty(3, dtype=torch.int32),
                )
            self.assertEqual((out.shape, out.dtype), (torch.Size([8, 5]), dtype))

    def test_unaligned_strides_and_fp64(self):
        # K = 13, N = 7: strides that are not multiples of 16 bytes
        a = torch.randn(10, 13, dtype=torch.float64)
        b = torch.randn(2, 13, 7, dtype=torch.float64)
        out = moe_ops.grouped_mm(a, b, torch.tensor([4, 10], dtype=torch.int32))
        self.assertEqual(out, torch.cat([a[:4] @ b[0], a[4:] @ b[1]]))

    def test_double_backward(self):
        a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
        b = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        offs = torch.tensor([2, 5], dtype=torch.int32)
        self.assertTrue(torch.autograd.gradgradcheck(lambda a, b: moe_ops.grouped_mm(a, b, offs), (a, b)))


class TestTokenSort(TestCase):
    def test_no_host_sync_under_fake(self):
        # every output size is static: tracing with unbacked-free fake tensors works
        with FakeTensorMode():
            ids = torch.empty(5, 2, dtype=torch.int64)
            s, offs, counts = moe_ops.token_sort(ids, 4, 8)
        self.assertEqual(s.shape, torch.Size([5 * 2 + 4 * 7]))

    def test_alignment_padding(self):
        ids = torch.tensor([[0, 2], [2, 1], [0, 2]])
        s, offs, counts = moe_ops.token_sort(ids, 4, 4)
        self.assertExpectedInline(
            str((s.tolist(), offs.tolist(), counts.tolist())),
            """([0, 4, -1, -1, 3, -1, -1, -1, 1, 2, 5, -1, -1, -1, -1, -1, -1, -1], [4, 8, 12, 12], [2, 1, 3, 0])""",
        )

    def test_large_stable(self):
        g = torch.Generator().manual_seed(0)
        ids = make_topk_ids(1000, 16, 4, "random", "cpu", g)
        s, offs, counts = moe_ops.token_sort(ids, 16)
        flat = ids.flatten()
        self.assertTrue(torch.equal(s, torch.argsort(flat, stable=True)))
        self.assertTrue(torch.equal(counts, torch.bincount(flat, minlength=16)))


class TestPaddingReadsNoRow(TestCase):
    """Padded slots (-1) and dropped assignments never read or write a real row.

    Every row that only padding could reach holds NaN or Inf (row 0 of the inputs, the weights of
    an expert whose group holds padding only, the routing weight of a dropped assignment, the
    gradient rows of outputs that no real slot writes); the results must equal the references,
    which skip padding, and be finite.
    """

    NAN, INF = float("nan"), float("inf")

    def assert_finite_equal(self, actual, expected, what):
        self.assertTrue(torch.isfinite(expected).all(), f"{what}: the reference is not finite")
        self.assertTrue(torch.isfinite(actual).all(), f"{what}: padding leaked NaN/Inf: {actual}")
        self.assertEqual(actual, expected, msg=what)

    # permute / unpermute: T = 3, k = 2; slot 0 and slot 5 are padding, assignment 4 is dropped
    def _routing(self):
        sorted_ids = torch.tensor([-1, 0, 3, 1, 2, -1, 5])
        topk_weights = torch.rand(3, 2, dtype=torch.float64)
        topk_weights.view(-1)[4] = self.NAN  # dropped: read by no slot
        return sorted_ids, topk_weights

    def test_permute(self):
        sorted_ids, _ = self._routing()
        x = torch.randn(3, 4, dtype=torch.float64)
        x[0] = self.NAN  # read by slot 1 (assignment 0), not by the padded slots 0 and 5
        expected = torch_moe._refs.permute(x, sorted_ids, 2)
        out = torch.full((7, 4), self.NAN, dtype=torch.float64)
        torch_moe.permute(x, sorted_ids, 2, out=out)
        for got in (moe_ops.permute(x, sorted_ids, 2), out):
            self.assertEqual(got, expected, equal_nan=True, atol=0, rtol=0)
            self.assertEqual(got[[0, 5]], torch.zeros(2, 4, dtype=torch.float64), atol=0, rtol=0)

    def test_permute_backward(self):
        sorted_ids, _ = self._routing()
        grad = torch.randn(7, 4, dtype=torch.float64)
        grad[0] = self.NAN  # slot 0 is padding
        grad[5] = self.INF  # slot 5 is padding
        x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
        (expected,) = torch.autograd.grad(torch_moe._refs.permute(x, sorted_ids, 2), x,
                                          grad.nan_to_num(0, 0, 0))
        out = moe_ops.permute_backward(grad, sorted_ids, 2, 3)
        self.assert_finite_equal(out, expected, "permute_backward")

    def test_unpermute(self):
        sorted_ids, topk_weights = self._routing()
        y = torch.randn(7, 4, dtype=torch.float64)
        y[0] = self.NAN
        y[5] = self.INF
        expected = torch_moe._refs.unpermute(y, sorted_ids, topk_weights)
        self.assert_finite_equal(moe_ops.unpermute(y, sorted_ids, topk_weights), expected,
                                 "unpermute")

    def test_unpermute_backward(self):
        sorted_ids, topk_weights = self._routing()
        y = torch.randn(7, 4, dtype=torch.float64)
        y[0] = self.NAN
        y[5] = self.INF
        grad = torch.randn(3, 4, dtype=torch.float64)
        grad_y, grad_w = moe_ops.unpermute_backward(grad, y, sorted_ids, topk_weights,
                                                  [True, True])
        # reference: autograd through the loop, with the unread values replaced by finite ones
        y_ref = y.nan_to_num(0, 0, 0).requires_grad_()
        w_ref = topk_weights.nan_to_num(0).requires_grad_()
        exp_y, exp_w = torch.autograd.grad(torch_moe._refs.unpermute(y_ref, sorted_ids, w_ref),
                                           (y_ref, w_ref), grad)
        self.assert_finite_equal(grad_y, exp_y, "unpermute_backward grad_y")
        self.assert_finite_equal(grad_w, exp_w, "unpermute_backward grad_topk_weights")

    # indexed_grouped_mm: S = 10 slots in E = 3 groups; group 1 holds padding only and its weight
    # is NaN; gather -1 reads no row (input row 0 is NaN and read by no real slot); scatter -1
    # writes no row (output row 0 is reached by no real slot, its gradient row is NaN)
    OFFS = (4, 7, 10)
    GATHER = (1, 2, -1, 3, -1, -1, -1, 4, 5, -1)
    SCATTER = (1, 2, -1, -1, -1, -1, -1, 3, 4, 5)

    def _indexed_case(self, gather: bool, scatter: bool, weighted: bool):
        g = torch.Generator().manual_seed(0)
        K, N, R = 5, 3, 6
        offs = torch.tensor(self.OFFS, dtype=torch.int32)
        gather_index = torch.tensor(self.GATHER) if gather else None
        scatter_index = torch.tensor(self.SCATTER) if scatter else None
        index = gather_index if gather else torch.arange(10)
        pad = index < 0
        if scatter:
            pad = pad | (scatter_index < 0)
        input = torch.randn(R if gather else 10, K, generator=g, dtype=torch.float64)
        if gather:
            input[0] = self.NAN
        # rows read only by slots whose output is dropped
        for i in pad.nonzero().flatten().tolist():
            if index[i] >= 0:
                input[index[i]] = self.INF
        weight = torch.randn(3, K, N, generator=g, dtype=torch.float64)
        weight[1] = self.NAN
        sw = torch.rand(10, generator=g, dtype=torch.float64) if weighted else None
        if weighted:
            sw[pad] = self.NAN
        rows = 6 if scatter else -1
        return input, weight, offs, gather_index, scatter_index, sw, rows, pad

    def _finite(self, t):
        """A finite copy of an input whose non-finite values only padding could read."""
        if t is None:
            return None
        return t.nan_to_num(0, 0, 0)

    @parametrize("indices", ["gather", "scatter", "gather_scatter"])
    @parametrize("weighted", [True, False])
    def test_indexed_grouped_mm(self, indices, weighted):
        gather, scatter = "gather" in indices, "scatter" in indices
        input, weight, offs, gi, si, sw, rows, pad = self._indexed_case(gather, scatter, weighted)
        out = moe_ops.indexed_grouped_mm(input, weight, offs, gi, si, sw, rows)
        ref_args = [self._finite(input), self._finite(weight), offs, gi, si, self._finite(sw), rows]
        expected = torch_moe._refs.indexed_grouped_mm(*ref_args)
        self.assert_finite_equal(out, expected, "indexed_grouped_mm")

        grad = torch.randn_like(expected)
        if scatter:
            grad[0] = self.NAN  # output row 0: written by padding only
        else:
            grad[pad] = self.NAN
        grads = moe_ops.indexed_grouped_mm_backward(grad, input, weight, offs, gi, si, sw,
                                                    [True, True, weighted])
        leaves = [a.requires_grad_() for a in ref_args[:2]]
        if weighted:
            leaves.append(ref_args[5].requires_grad_())
        expected = torch.autograd.grad(torch_moe._refs.indexed_grouped_mm(*ref_args), leaves,
                                       grad.nan_to_num(0, 0, 0))
        for got, exp, name in zip(grads, expected, ("input", "weight", "scatter_weight")):
            self.assert_finite_equal(got, exp, f"indexed_grouped_mm_backward grad_{name}")

    # grouped_ffn: token 0 is dropped (its slots are -1) and is the only token of expert 0, whose
    # group then holds padding only; x[0], the weights of expert 0 and grad[0] are NaN
    @parametrize("fused", [True, False])
    def test_grouped_ffn(self, fused):
        g = torch.Generator().manual_seed(0)
        T, k, E, D, F = 5, 2, 3, 4, 3
        topk_ids = torch.tensor([[0, 1], [1, 2], [2, 1], [1, 2], [2, 1]])
        topk_weights = torch.rand(T, k, generator=g, dtype=torch.float64)
        sorted_ids, offs, _ = moe_ops.token_sort(topk_ids, E, 4)
        sorted_ids = torch.where(sorted_ids // k == 0, -1, sorted_ids)  # drop token 0
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        w1 = torch.randn(E, D, 2 * F if fused else F, generator=g, dtype=torch.float64)
        w3 = None if fused else torch.randn(E, D, F, generator=g, dtype=torch.float64)
        w2 = torch.randn(E, F, D, generator=g, dtype=torch.float64)
        finite = [t.clone() if t is not None else None for t in (x, topk_weights, w1, w2, w3)]
        x[0] = self.NAN
        topk_weights[0] = self.NAN
        for w in (w1, w2, w3):
            if w is not None:
                w[0] = self.NAN

        out, hidden = moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3)
        leaves = [t[1:].requires_grad_() if i < 2 else t.requires_grad_()
                  for i, t in enumerate(finite) if t is not None]
        x_r, tw_r, w1_r, w2_r = leaves[:4]
        w3_r = leaves[4] if len(leaves) > 4 else None
        ref = torch_moe._refs.moe_ffn(x_r, topk_ids[1:], tw_r, w1_r, w2_r, w3_r)
        expected = torch.cat([torch.zeros(1, D, dtype=ref.dtype), ref.detach()])
        self.assert_finite_equal(out, expected, "grouped_ffn")
        self.assertTrue(torch.isfinite(hidden).all(), "grouped_ffn: padding leaked into hidden")

        grad = torch.randn(T, D, generator=g, dtype=torch.float64)
        grad[0] = self.NAN  # token 0 has no slot
        hidden = hidden.clone()
        hidden[sorted_ids < 0] = self.NAN  # the backward reads no padded row of hidden either
        got = moe_ops.grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3,
                                           hidden, "swiglu", 1.702, 7.0, [True] * 8)
        exp = torch.autograd.grad(ref, leaves, grad[1:])
        zero_row = lambda t: torch.cat([torch.zeros_like(t[:1]), t])
        exp = [zero_row(exp[0]), zero_row(exp[1]), *exp[2:]]
        names = ("x", "topk_weights", "w1", "w2", "w3")
        for i, (a, e) in enumerate(zip(got, exp)):
            self.assert_finite_equal(a, e, f"grouped_ffn_backward grad_{names[i]}")


instantiate_parametrized_tests(TestPaddingReadsNoRow)


class _CountGemms(TorchDispatchMode):
    """Counts the GEMMs (aten.mm / aten.addmm, any overload) run under it, also those inside the
    CPU kernels of torch_moe ops, which run with the mode pushed again."""

    def __init__(self):
        super().__init__()
        self.gemms = 0
        self.out_shapes = []  # the trailing [M, N] of each GEMM's output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "torch_moe":
            with self:
                cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
                return func.redispatch(cpu, *args, **kwargs)
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm,
                                   torch.ops.aten.baddbmm):
            self.gemms += 1
            self.out_shapes.append(tuple(out.shape[-2:]))
        return out


class TestOutputMask(TestCase):
    """The backward ops compute only the gradients that ``output_mask`` requests (aten's
    ``convolution_backward`` convention); the others are empty tensors, never allocated."""

    def _ffn(self, fused=False, requires_grad=(True, True, True)):
        g = torch.Generator().manual_seed(0)
        # D = 7: no GEMM but a weight gradient's has an output of [7, F] or [F, 7], as rows come
        # in multiples of the alignment (4)
        T, k, E, D, F = 12, 2, 4, 7, 6
        topk_ids = make_topk_ids(T, E, k, "random", "cpu", g)
        sorted_ids, offs, _ = moe_ops.token_sort(topk_ids, E, 4)
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        topk_weights = torch.rand(T, k, generator=g, dtype=torch.float64)
        w1 = torch.randn(E, D, 2 * F if fused else F, generator=g, dtype=torch.float64)
        w3 = None if fused else torch.randn(E, D, F, generator=g, dtype=torch.float64)
        w2 = torch.randn(E, F, D, generator=g, dtype=torch.float64)
        groups = int((torch.diff(offs, prepend=offs.new_zeros(1)) > 0).sum())
        return x, sorted_ids, offs, topk_weights, w1, w2, w3, groups

    def _backward_gemms(self, args, trainable: bool) -> tuple[int, int]:
        x, sorted_ids, offs, topk_weights, w1, w2, w3 = [
            a.detach().requires_grad_(a.is_floating_point() and (trainable or i in (0, 3)))
            if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)
        ]
        out, _ = moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3)
        with _CountGemms() as mode:
            out.backward(torch.ones_like(out))
        weight_shapes = {tuple(w.shape[1:]) for w in (w1, w2, w3) if w is not None}
        for w in (w1, w2, w3):
            if w is not None:
                self.assertEqual(w.grad is not None, trainable)
        weight_gemms = sum(shape in weight_shapes for shape in mode.out_shapes)
        return mode.gemms, weight_gemms

    @parametrize("form", ["per_group", "batched"])
    @parametrize("fused", [True, False])
    def test_grouped_ffn_frozen_experts_skip_weight_gradients(self, fused, form):
        *args, groups = self._ffn(fused)
        with torch_moe.cpu.expert_form(form):
            trainable, trainable_weight_gemms = self._backward_gemms(args, trainable=True)
            frozen, frozen_weight_gemms = self._backward_gemms(args, trainable=False)
        weights = 2 if fused else 3
        # one weight-gradient GEMM per weight and non-empty group in the per-group form (one
        # per weight and block batched), and frozen experts compute none of them, nothing else
        # skipped
        if form == "per_group":
            self.assertEqual(trainable_weight_gemms, weights * groups)
        else:
            self.assertEqual(trainable_weight_gemms % weights, 0)
            self.assertLess(trainable_weight_gemms, weights * groups)
        self.assertEqual(frozen_weight_gemms, 0)
        self.assertEqual(frozen, trainable - trainable_weight_gemms)

    @parametrize("fused", [True, False])
    def test_grouped_ffn_hidden_gets_no_gradient(self, fused):
        # `hidden` is non-differentiable: autograd must not allocate and fill a zero gradient
        # of its size ([S, H], the layer's largest activation) for backward to ignore
        x, sorted_ids, offs, topk_weights, w1, w2, w3, _ = self._ffn(fused)
        x.requires_grad_()
        out, hidden = moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3)
        self.assertFalse(hidden.requires_grad)
        with _CountGemms() as mode, torch.profiler.profile(record_shapes=True) as prof:
            out.backward(torch.ones_like(out))
        self.assertGreater(mode.gemms, 0)
        hidden_sized = [e.name for e in prof.events()
                        if e.name in ("aten::zeros_like", "aten::zero_", "aten::fill_")
                        and e.input_shapes and list(e.input_shapes[0]) == list(hidden.shape)]
        self.assertEqual(hidden_sized, [])

    def _check_masks(self, op, args, n, mask_arg=-1, fake=True):
        full = op(*args, [True] * n)
        for bits in range(2 ** n):
            mask = [bool(bits >> i & 1) for i in range(n)]
            got = op(*args, mask)
            for want, a, f in zip(mask, got, full):
                if want:
                    self.assertEqual(a, f, atol=0, rtol=0)
                else:
                    self.assertEqual(a.numel(), 0, f"{op}: output not requested by {mask}")
            if fake:
                with FakeTensorMode() as mode:
                    conv = lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                    fakes = op(*[conv(a) for a in args], mask)
                for a, f in zip(got, fakes):
                    self.assertEqual((a.shape, a.dtype), (f.shape, f.dtype))

    @parametrize("fused", [True, False])
    def test_grouped_ffn_backward(self, fused):
        x, sorted_ids, offs, topk_weights, w1, w2, w3, _ = self._ffn(fused)
        out, hidden = moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3)
        grad = torch.randn_like(out)
        args = (grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, "swiglu", 1.702, 7.0)
        self._check_masks(moe_ops.grouped_ffn_backward, args, 8)

    def test_indexed_grouped_mm_backward(self):
        g = torch.Generator().manual_seed(0)
        offs = torch.tensor([3, 3, 8], dtype=torch.int32)
        gather = torch.tensor([0, 4, -1, 2, 1, 3, -1, 0])
        scatter = torch.tensor([1, 0, 2, -1, 2, 3, 4, 1])
        input = torch.randn(5, 4, generator=g, dtype=torch.float64)
        weight = torch.randn(3, 4, 3, generator=g, dtype=torch.float64)
        sw = torch.rand(8, generator=g, dtype=torch.float64)
        grad = torch.randn(5, 3, generator=g, dtype=torch.float64)
        args = (grad, input, weight, offs, gather, scatter, sw)
        self._check_masks(moe_ops.indexed_grouped_mm_backward, args, 3)

    def test_unpermute_backward(self):
        g = torch.Generator().manual_seed(0)
        topk_ids = make_topk_ids(6, 3, 2, "random", "cpu", g)
        sorted_ids, _, _ = moe_ops.token_sort(topk_ids, 3, 4)
        y = torch.randn(sorted_ids.numel(), 5, generator=g, dtype=torch.float64)
        topk_weights = torch.rand(6, 2, generator=g, dtype=torch.float64)
        grad = torch.randn(6, 5, generator=g, dtype=torch.float64)
        self._check_masks(moe_ops.unpermute_backward, (grad, y, sorted_ids, topk_weights), 2)


instantiate_parametrized_tests(TestOutputMask)


def _stored_transposed(*shape, generator, dtype=torch.float64):
    """A [E, a, b] weight stored as [E, b, a] (HuggingFace's nn.Linear layout) and viewed
    transposed: dense, not contiguous."""
    E, a, b = shape
    return torch.randn(E, b, a, generator=generator, dtype=dtype).transpose(1, 2)


class _RecordBackwardBuffers(TorchDispatchMode):
    """The data pointers of the outputs of every grouped_ffn_backward call run under it."""

    def __init__(self):
        super().__init__()
        self.data_ptrs = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is moe_ops.grouped_ffn_backward.default:
            self.data_ptrs.update(t.data_ptr() for t in out if t.numel())
        return out


class TestWeightGradientLayout(TestCase):
    """The kernels allocate a weight gradient in its weight's strides where the weight is dense
    (an [E, F, D] storage viewed as [E, D, F]), so that AccumulateGrad keeps it instead of
    copying it into the weight's layout; the fake kernels give the same strides."""

    def _ffn(self, fused: bool, layout: str):
        g = torch.Generator().manual_seed(0)
        T, k, E, D, F = 10, 2, 4, 6, 5
        # expert 3 gets no token: its gradient rows are zero-filled in the strided buffer too
        topk_ids = torch.stack([torch.randperm(3, generator=g)[:k] for _ in range(T)])
        sorted_ids, offs, _ = moe_ops.token_sort(topk_ids, E, 4)
        x = torch.randn(T, D, generator=g, dtype=torch.float64)
        topk_weights = torch.rand(T, k, generator=g, dtype=torch.float64)
        H = 2 * F if fused else F
        if layout == "transposed":
            w1 = _stored_transposed(E, D, H, generator=g)
            w3 = None if fused else _stored_transposed(E, D, F, generator=g)
            w2 = _stored_transposed(E, F, D, generator=g)
        else:  # expert-minor storage [D, F, E] viewed as [E, D, F]: another dense permutation
            w1 = torch.randn(D, H, E, generator=g, dtype=torch.float64).permute(2, 0, 1)
            w3 = None if fused else torch.randn(D, F, E, generator=g,
                                                dtype=torch.float64).permute(2, 0, 1)
            w2 = torch.randn(F, D, E, generator=g, dtype=torch.float64).permute(2, 0, 1)
        return x, sorted_ids, offs, topk_weights, w1, w2, w3

    def _ffn_backward(self, args, weights):
        x, sorted_ids, offs, topk_weights = args[:4]
        w1, w2, w3 = weights
        out, hidden = moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3)
        grad = torch.ones_like(out)
        return moe_ops.grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3,
                                            hidden, "swiglu", 1.702, 7.0, [True] * 8)

    @parametrize("fused", [True, False])
    @parametrize("layout", ["transposed", "expert_minor"])
    def test_grouped_ffn_backward(self, fused, layout):
        args = self._ffn(fused, layout)
        weights = args[4:]
        self.assertFalse(any(w.is_contiguous() for w in weights if w is not None))
        got = self._ffn_backward(args, weights)
        contiguous = [w.contiguous() if w is not None else None for w in weights]
        expected = self._ffn_backward(args, contiguous)
        for i, w in zip((2, 3, 4), weights):
            if w is None:
                continue
            self.assertEqual(got[i].stride(), w.stride())
            self.assertEqual(got[i], expected[i])
            self.assertEqual(got[i][3], torch.zeros_like(got[i][3]), atol=0, rtol=0)
        with FakeTensorMode() as mode:
            conv = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = self._ffn_backward(conv, conv[4:])
        for a, f in zip(got, fake):
            self.assertEqual((a.shape, a.stride()), (f.shape, f.stride()))

    def test_indexed_grouped_mm_backward(self):
        g = torch.Generator().manual_seed(1)
        offs = torch.tensor([3, 3, 8], dtype=torch.int32)
        gather = torch.tensor([0, 4, -1, 2, 1, 3, -1, 0])
        input = torch.randn(5, 4, generator=g, dtype=torch.float64)
        weight = _stored_transposed(3, 4, 6, generator=g)
        grad = torch.randn(8, 6, generator=g, dtype=torch.float64)

        def backward(w, *, fake=None):
            a = (grad, input, w, offs, gather)
            if fake is not None:
                a = tuple(fake.from_tensor(t) for t in a)
            return moe_ops.indexed_grouped_mm_backward(*a, None, None, [True, True, False])[1]

        got = backward(weight)
        self.assertEqual(got.stride(), weight.stride())
        self.assertEqual(got, backward(weight.contiguous()))
        with FakeTensorMode() as mode:
            self.assertEqual(backward(weight, fake=mode).stride(), got.stride())

    def test_parameter_gradient_is_not_copied(self):
        # autograd end to end: AccumulateGrad keeps the buffers grouped_ffn_backward allocated
        # (no copy into the parameters' layout), with the values of the contiguous layer
        args = self._ffn(False, "transposed")
        x, sorted_ids, offs, topk_weights = args[:4]
        params = [torch.nn.Parameter(w) for w in args[4:]]
        dense = [torch.nn.Parameter(w.contiguous()) for w in args[4:]]
        with _RecordBackwardBuffers() as rec:
            moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, *params)[0].sum().backward()
        moe_ops.grouped_ffn(x, sorted_ids, offs, topk_weights, *dense)[0].sum().backward()
        for p, d in zip(params, dense):
            self.assertEqual(p.grad.stride(), p.stride())
            self.assertIn(p.grad.data_ptr(), rec.data_ptrs)
            self.assertEqual(p.grad, d.grad)

    def test_layouts_that_are_not_dense_get_contiguous_gradients(self):
        from torch_moe._native._layouts import empty_weight_grad, is_dense_permutation

        w = torch.randn(4, 5, 6)
        cases = {
            "expanded": (w[:1].expand(4, 5, 6), False),
            "sliced": (w[:, :, ::2], False),
            "transposed": (w.transpose(1, 2), True),
            "permuted": (w.permute(2, 0, 1), True),
            "size-1 dim, any stride": (torch.randn(4, 6).unsqueeze(1).as_strided(
                (4, 1, 6), (6, 99, 1)), True),
            "empty": (torch.randn(0, 5, 6).transpose(1, 2), False),
        }
        for name, (t, dense) in cases.items():
            self.assertEqual(is_dense_permutation(t), dense, msg=name)
            grad = empty_weight_grad(t)
            self.assertEqual(grad.shape, t.shape, msg=name)
            self.assertEqual(grad.stride(), t.stride() if dense else
                             torch.empty(t.shape).stride(), msg=name)
        self.assertEqual(empty_weight_grad(w.transpose(1, 2), torch.float64).dtype, torch.float64)


instantiate_parametrized_tests(TestWeightGradientLayout)



instantiate_device_type_tests(TestMoEOps, globals(), only_for="cpu")

if __name__ == "__main__":
    run_tests()
