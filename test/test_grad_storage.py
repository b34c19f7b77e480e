# Owner(s): ["module: moe"]
"""The reused storage of the CPU kernels' weight gradients (torch_moe.cpu,
torch_moe._native.grad_storage):
reused where nothing else holds it, never written while anything does, results unchanged."""

import torch
from torch.testing._internal.common_utils import run_tests, TestCase

import torch_moe
from torch_moe._native import grad_storage
from torch_moe.nn import MoE, MoEConfig


def _layer():
    torch.manual_seed(0)
    # w1 / w2 / w3 [16, 64, 256] fp32: 1 MiB each, at the pooling threshold
    return MoE(MoEConfig(dim=64, hidden_dim=256, num_experts=16, top_k=2))


def _backward(layer, x):
    layer(x).square().sum().backward()


class TestGradStorage(TestCase):
    def setUp(self):
        super().setUp()
        torch_moe.cpu.set_grad_storage_reuse(True)
        self.addCleanup(torch_moe.cpu.set_grad_storage_reuse, True)
        torch_moe.cpu.empty_cache()
        self.x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))

    def test_reused_after_set_to_none_with_the_same_values(self):
        layer = _layer()
        torch_moe.cpu.set_grad_storage_reuse(False)
        _backward(layer, self.x)
        want = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        torch_moe.cpu.set_grad_storage_reuse(True)
        ptrs = []
        for _ in range(3):
            _backward(layer, self.x)
            for n, p in layer.named_parameters():
                self.assertEqual(p.grad, want[n], atol=0, rtol=0, msg=n)
            ptrs.append(layer.experts.w1.grad.data_ptr())
            layer.zero_grad(set_to_none=True)
        # the first backward allocates, the next ones find it free: AccumulateGrad adopted the
        # pooled tensor as .grad rather than a copy of it
        self.assertEqual(ptrs[1], ptrs[0])
        self.assertEqual(ptrs[2], ptrs[0])

    def test_a_held_gradient_is_never_written(self):
        layer = _layer()
        _backward(layer, self.x)
        held = layer.experts.w1.grad  # the user keeps it (e.g. for a gradient-norm history)
        kept = held.clone()
        layer.zero_grad(set_to_none=True)
        _backward(layer, 2 * self.x)
        self.assertNotEqual(layer.experts.w1.grad.data_ptr(), held.data_ptr())
        self.assertEqual(held, kept, atol=0, rtol=0)
        # a view keeps the storage in use too
        view = layer.experts.w2.grad[3]
        kept_view = view.clone()
        layer.zero_grad(set_to_none=True)
        _backward(layer, 3 * self.x)
        self.assertEqual(view, kept_view, atol=0, rtol=0)

    def test_accumulation_into_a_kept_grad(self):
        layer = _layer()
        _backward(layer, self.x)
        once = {n: p.grad.clone() for n, p in layer.named_parameters()}
        for _ in range(2):
            _backward(layer, self.x)  # set_to_none=False: autograd adds into .grad
        for n, p in layer.named_parameters():
            self.assertEqual(p.grad, 3 * once[n], msg=n)

    def test_empty_cache_and_disable(self):
        layer = _layer()
        _backward(layer, self.x)
        total, free = torch_moe.cpu.cached_bytes()
        self.assertEqual(total, 3 * (1 << 20))  # w1, w2, w3 grads, held as .grad
        self.assertEqual(free, 0)
        layer.zero_grad(set_to_none=True)
        self.assertEqual(torch_moe.cpu.cached_bytes(), (total, total))
        torch_moe.cpu.empty_cache()
        self.assertEqual(torch_moe.cpu.cached_bytes(), (0, 0))
        torch_moe.cpu.set_grad_storage_reuse(False)
        _backward(layer, self.x)
        self.assertEqual(torch_moe.cpu.cached_bytes(), (0, 0))

    def test_small_and_empty_gradients_are_not_pooled(self):
        t = grad_storage.empty_strided((4, 8), (8, 1), torch.float32, "cpu")
        self.assertEqual(t.shape, (4, 8))
        e = grad_storage.empty_strided((0, 1 << 20), (1 << 20, 1), torch.float32, "cpu")
        self.assertEqual(e.shape, (0, 1 << 20))
        self.assertEqual(torch_moe.cpu.cached_bytes(), (0, 0))
        big = grad_storage.empty_strided((2, 1 << 18), (1, 2), torch.float32, "cpu")
        self.assertEqual(big.stride(), (1, 2))
        self.assertEqual(torch_moe.cpu.cached_bytes()[0], 2 << 20)


if __name__ == "__main__":
    run_tests()
