# Owner(s): ["module: moe"]
"""OpInfo-driven tests of the torch_moe ops: references, opcheck, gradcheck, fake kernels,
determinism and the fixes over ``aten::_grouped_mm``."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests,
    ops,
)
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
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


instantiate_device_type_tests(TestMoEOps, globals(), only_for="cpu")

if __name__ == "__main__":
    run_tests()
