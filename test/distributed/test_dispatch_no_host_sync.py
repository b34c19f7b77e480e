# Owner(s): ["module: moe"]
"""No host synchronisation in the dispatcher's sync-free modes on the CUDA path, forward and
backward: sync-free capacity mode (``capacity_factor`` with ``sync_free=True``) and the exact
mode of ``backend="symm_mem"``.

Without a GPU, the call runs on fake tensors under ``CudaPathMode`` (``test/cuda/_host_sync.py``,
which says why their device is ``meta``), with a fake process group (``init_process_group("fake")``:
the functional collectives then only compute shapes): every torch_moe op goes through its CUDA
implementation (the Triton ``token_sort`` and ``grouped_ffn``), and any op that would make the
host wait for the GPU fails with the op and the line that called it. ``symm_mem::all_to_all_vdev``
is replaced by an emulation that, like the op, writes the received split sizes on the device.
What runs is everything after the local argument checks (which look at shapes on the host, and
refuse ``meta`` tensors for want of data): the row plan, the header exchange and its device
checks, the exchanges, the local experts, the combine and the counters.

Each check runs in a subprocess, whose default process group is the fake one.
"""

import os
import subprocess
import sys
import textwrap
import unittest
from pathlib import Path

from torch.testing._internal.common_utils import run_tests, TestCase

_ROOT = Path(__file__).resolve().parents[2]

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

_CHECK = """
import torch
import torch.distributed as dist
from unittest import mock
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import torch_moe  # noqa: F401
from _host_sync import CudaPathMode
from torch_moe.distributed import _symm_mem_exchange, dispatch

R, E, D, F, T, k = 2, 8, 16, 24, 12, 3
OPTIONS = dict(dict(dedup=False, num_chunks=1, capacity_factor=None), **{options})


def vdev(inp, out, in_splits, out_splits_offsets, group):
    # the op's writes, without reading anything: every rank sends what this one does
    out_splits_offsets[0].copy_(in_splits)
    out_splits_offsets[1].copy_(torch.cumsum(in_splits, 0) - in_splits)


dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=R)
with mock.patch.multiple(_symm_mem_exchange, all_to_all_vdev=vdev,
                         symm_mem_empty=lambda shape, dtype, device, group:
                         torch.empty(shape, dtype=dtype, device=device)), \\
        FakeTensorMode(), CudaPathMode() as mode:
    device = torch.device("meta")
    x = torch.randn(T, D, device=device, requires_grad=True)
    ids = torch.randint(0, E, (T, k), device=device)
    w = torch.rand(T, k, device=device, requires_grad=True)
    w1, w3 = (torch.randn(E // R, D, F, device=device, requires_grad=True) for _ in range(2))
    w2 = torch.randn(E // R, F, D, device=device, requires_grad=True)
    layer = dispatch._Layer.of(x, ids, num_experts=E, group=dist.group.WORLD,
                               activation="swiglu", alpha=1.702, limit=7.0, **OPTIONS)
    plan = dispatch._plan_rows(ids, layer)
    splits = dispatch._exchange_header(layer, plan.rows_per_dest_Rn, plan.id_flags)
    y, counts = dispatch._dispatch_compute_combine(
        x, ids, w, dispatch._LocalExperts(w1, w2, w3), layer, plan, splits)
    dispatch._record_traffic(layer, splits, counts, x.device)
    y.sum().backward()
    assert y.shape == (T, D) and x.grad.shape == (T, D) and w1.grad.shape == w1.shape
    calls = dict(mode.calls)
    for op in ("token_sort", "grouped_ffn", "grouped_ffn_backward"):
        assert calls.get(op, 0) > 0, (op, calls)
print("ok", sorted(calls.items()))
"""


@unittest.skipIf(not HAS_TRITON, "the CUDA kernels are written in Triton")
class TestSyncFreeDispatchHasNoHostSync(TestCase):
    def _run(self, options: dict) -> str:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(_ROOT / "test" / "cuda"), str(_ROOT), os.environ.get("PYTHONPATH", "")]))
        code = textwrap.dedent(_CHECK).replace("{options}", repr(options))
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=300)
        self.assertEqual(result.returncode, 0, msg=result.stdout + result.stderr[-4000:])
        return result.stdout

    def test_sync_free_capacity_mode(self):
        out = self._run(dict(capacity_factor=1.5, sync_free=True, dedup=True, num_chunks=2))
        self.assertIn("ok", out)

    def test_symm_mem_backend(self):
        out = self._run(dict(backend="symm_mem", num_chunks=2))
        self.assertIn("ok", out)

    def test_the_check_sees_the_host_read_of_the_capacity_mode(self):
        # the same call in capacity mode without sync_free reads the header on the host
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(_ROOT / "test" / "cuda"), str(_ROOT), os.environ.get("PYTHONPATH", "")]))
        code = textwrap.dedent(_CHECK).replace("{options}", repr(dict(capacity_factor=1.5)))
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env=env, timeout=300)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("HostSync: aten._local_scalar_dense.default synchronises the host",
                      result.stderr)


if __name__ == "__main__":
    run_tests()
