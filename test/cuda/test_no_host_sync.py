# Owner(s): ["module: moe"]
"""No host synchronisation on the CUDA path of the MoE layer, forward and backward.

On a machine without a GPU the layer runs on fake tensors under :class:`CudaPathMode`
(``_host_sync.py``, which says why their device is ``meta``): every torch_moe op goes through its
CUDA implementation, and any op that would make the host wait for the GPU (a value read, a
data-dependent output size, a copy to the host) fails the test with the op and the line that
called it. This covers the dropless layer (the
static slot bound ``T * k + E * (align - 1)``), the capacity layer (whose token sort once counted
with ``bincount``), shared experts, the auxiliary losses and the quantized recipes.

On a GPU, the device tests check the same for real: ``torch.cuda.set_sync_debug_mode("error")``
over forward and backward, capture of the layer in a CUDA graph, and ``torch.compile`` with
``fullgraph=True`` (no ``capture_scalar_outputs``). On CPU, ``torch.compile(fullgraph=True)`` of
the capacity layer checks that no graph break is left in the layer's own code.
"""

import contextlib
import unittest

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import TestCase, parametrize, run_tests

from _host_sync import CudaPathMode, HostSync
from _interpreter import requires_triton

from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.functional import moe_ffn, token_sort_with_capacity


def _config(**overrides) -> MoEConfig:
    base = dict(dim=64, hidden_dim=32, num_experts=8, top_k=2, load_balance_coeff=0.01,
                z_loss_coeff=0.001)
    base.update(overrides)
    return MoEConfig(**base)


_LAYERS = {
    "dropless": _config(),
    "capacity": _config(capacity_factor=1.0),
    "shared_experts_sigmoid_grouped": _config(
        num_shared_experts=1, score_func="sigmoid", num_expert_groups=4, topk_groups=2,
        load_balance_bias=True, seq_balance_coeff=0.01),
    "capacity_fp8_rowwise": _config(capacity_factor=1.25, precision="fp8_rowwise"),
    "mxfp8": _config(precision="mxfp8"),
}


# the device of the fake tensors that stand for CUDA ones (see _host_sync.py)
DEVICE = "meta"


@contextlib.contextmanager
def _fake_cuda():
    with FakeTensorMode(), CudaPathMode() as mode:
        yield mode


@requires_triton
class TestNoHostSyncOnFakeCuda(TestCase):
    @parametrize("layer", list(_LAYERS))
    def test_moe_forward_backward(self, layer):
        config = _LAYERS[layer]
        with _fake_cuda() as mode:
            moe = MoE(config, device=DEVICE, dtype=torch.bfloat16)
            x = torch.randn(4, 16, config.dim, device=DEVICE, dtype=torch.bfloat16,
                            requires_grad=True)
            y, aux = moe(x, return_aux_loss=True)
            (y.float().square().mean() + aux).backward()
            self.assertEqual(x.grad.shape, x.shape)
        # the layer took the CUDA path it was meant to: its token sort and expert FFN, forward
        # and backward, ran through the Triton implementations
        if config.precision == "bf16":
            self.assertGreater(mode.calls["grouped_ffn"], 0)
            self.assertGreater(mode.calls["grouped_ffn_backward"], 0)
        if config.capacity_factor is None:
            self.assertGreater(mode.calls["token_sort"], 0)

    def test_moe_ffn_fused_w13(self):
        with _fake_cuda() as mode:
            T, D, F, E, k = 24, 32, 16, 4, 2
            x = torch.randn(T, D, device=DEVICE, requires_grad=True)
            ids = torch.randint(0, E, (T, k), device=DEVICE)
            w = torch.rand(T, k, device=DEVICE, requires_grad=True)
            w13 = torch.randn(E, D, 2 * F, device=DEVICE, requires_grad=True)
            w2 = torch.randn(E, F, D, device=DEVICE, requires_grad=True)
            moe_ffn(x, ids, w, w13, w2, activation="swiglu_oai").sum().backward()
        self.assertEqual(mode.calls["grouped_ffn_backward"], 1)

    def test_token_sort_with_capacity(self):
        with _fake_cuda():
            ids = torch.randint(0, 8, (32, 2), device=DEVICE)
            weights = torch.rand(32, 2, device=DEVICE)
            sorted_ids, offs, kept, dropped = token_sort_with_capacity(ids, weights, 8, 5, align=4)
        self.assertEqual(sorted_ids.shape, (32 * 2 + 8 * 3,))
        self.assertEqual(offs.shape, (8,))

    def test_checker_fails_on_host_syncs(self):
        # the checker must be able to fail: each of these makes the host wait for the GPU
        syncs = {
            ".item()": lambda t: t.sum().item(),
            "bool()": lambda t: bool(t.sum() > 0),
            "nonzero": lambda t: torch.nonzero(t),
            "bincount": lambda t: torch.bincount(t.long().abs()),
            "boolean mask": lambda t: t[t > 0],
            ".cpu()": lambda t: t.cpu(),
            "torch.unique": lambda t: torch.unique(t),
        }
        for what, fn in syncs.items():
            with self.subTest(what), _fake_cuda():
                t = torch.randn(8, device=DEVICE)
                with self.assertRaises(HostSync):
                    fn(t)


class TestCompileCapacityLayer(TestCase):
    def test_fullgraph_without_capture_scalar_outputs(self):
        # Dynamo would graph-break (and fullgraph raise) at a data-dependent op such as bincount
        torch._dynamo.reset()
        moe = MoE(_config(capacity_factor=1.0))
        x = torch.randn(2, 8, 64)
        with torch._dynamo.config.patch(capture_scalar_outputs=False,
                                        capture_dynamic_output_shape_ops=False):
            compiled = torch.compile(moe, backend="aot_eager", fullgraph=True)
            torch.testing.assert_close(compiled(x), moe(x))


class TestNoHostSyncCUDA(TestCase):
    """On a GPU: the same layers for real."""

    @onlyCUDA
    @parametrize("layer", ["dropless", "capacity", "capacity_fp8_rowwise"])
    def test_sync_debug_mode_error(self, device, layer):
        config = _LAYERS[layer]
        if config.precision != "bf16" and torch.cuda.get_device_capability() < (8, 9):
            raise unittest.SkipTest("FP8 needs sm_89 or newer")
        moe = MoE(config, device=device, dtype=torch.bfloat16)
        x = torch.randn(4, 256, config.dim, device=device, dtype=torch.bfloat16,
                        requires_grad=True)
        moe(x)  # first call: kernels compile, caches fill
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            y, aux = moe(x, return_aux_loss=True)
            (y.float().square().mean() + aux).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")

    @onlyCUDA
    @parametrize("layer", ["dropless", "capacity"])
    def test_cuda_graph_capture(self, device, layer):
        moe = MoE(_LAYERS[layer], device=device, dtype=torch.bfloat16).eval()
        x = torch.randn(512, 64, device=device, dtype=torch.bfloat16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad():
            for _ in range(2):
                moe(x)  # warm-up off the capture: compile and autotune kernels, fill caches
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            out = moe(x)
        # replayed on new tokens, which route differently: routing must not be baked in
        for seed in range(2):
            new_x = torch.randn(x.shape, device=device, dtype=x.dtype,
                                generator=torch.Generator(device).manual_seed(seed))
            x.copy_(new_x)
            graph.replay()
            with torch.no_grad():
                expected = moe(new_x)
            torch.testing.assert_close(out, expected)

    @onlyCUDA
    @parametrize("layer", ["dropless", "capacity"])
    def test_compile_fullgraph(self, device, layer):
        torch._dynamo.reset()
        moe = MoE(_LAYERS[layer], device=device, dtype=torch.bfloat16)
        x = torch.randn(4, 128, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        with torch._dynamo.config.patch(capture_scalar_outputs=False,
                                        capture_dynamic_output_shape_ops=False):
            compiled = torch.compile(moe, fullgraph=True)
            y = compiled(x)
            y.float().sum().backward()
        torch.testing.assert_close(y, moe(x), atol=2e-2, rtol=2e-2)


from torch.testing._internal.common_utils import instantiate_parametrized_tests  # noqa: E402

instantiate_parametrized_tests(TestNoHostSyncOnFakeCuda)
instantiate_device_type_tests(TestNoHostSyncCUDA, globals(), only_for="cuda")

if __name__ == "__main__":
    run_tests()
