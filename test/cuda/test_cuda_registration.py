# Owner(s): ["module: moe"]
"""Every torch_moe op runs on CUDA: a CUDA kernel or a composite one, registered on any machine
where triton is installed, with or without a GPU, and without importing triton at import time."""

import importlib
import subprocess
import sys

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

from _interpreter import REPO_DIR, requires_triton

import torch_moe  # noqa: F401  (registers the ops and their kernels)
import torch_moe._triton as cuda_kernels

_RUNS_ON_CUDA = ("CUDA", "CompositeExplicitAutograd", "CompositeImplicitAutograd")


def _torch_moe_ops() -> list[str]:
    """Every overload of the torch_moe namespace, as ``torch_moe::name[.overload]``."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("torch_moe::"))


@requires_triton
class TestCudaRegistration(TestCase):
    def setUp(self):
        # the kernel modules define the triton_ops the CUDA kernels launch: walk those too
        for module in set(cuda_kernels.CUDA_KERNEL_MODULES.values()):
            importlib.import_module(f"torch_moe._triton.{module}")

    def test_every_op_has_a_cuda_kernel(self):
        ops = _torch_moe_ops()
        # the 11 core overloads, the 8 quantization ops and the triton_ops behind the kernels
        self.assertGreaterEqual(len(ops), 19 + len(cuda_kernels.CUDA_KERNEL_MODULES))
        missing = [
            op for op in ops
            if not any(torch._C._dispatch_has_kernel_for_dispatch_key(op, k) for k in _RUNS_ON_CUDA)
        ]
        self.assertEqual(missing, [], msg="ops with neither a CUDA kernel nor a composite one")

    def test_kernel_modules_implement_their_table(self):
        for overload, module_name in cuda_kernels.CUDA_KERNEL_MODULES.items():
            module = importlib.import_module(f"torch_moe._triton.{module_name}")
            wanted = {o for o, m in cuda_kernels.CUDA_KERNEL_MODULES.items() if m == module_name}
            self.assertEqual(set(module.KERNELS), wanted, msg=module_name)
            kernel = cuda_kernels.cuda_kernel(overload)
            self.assertTrue(callable(kernel), overload)
            name, _, overload_name = overload.partition(".")
            public = getattr(getattr(torch.ops.torch_moe, name), overload_name or "default")
            # the public op would dispatch back to this kernel for ever
            self.assertIsNot(kernel, public, overload)

    def test_import_does_not_import_triton(self):
        code = "import sys, torch_moe; sys.exit('triton' in sys.modules)"
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_DIR, capture_output=True,
                              text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, msg=f"import torch_moe imported triton\n{proc.stderr}")


if __name__ == "__main__":
    run_tests()
