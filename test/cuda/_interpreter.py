"""What the tests of the Triton kernels share: a subprocess per check, under ``TRITON_INTERPRET=1``.

Why a subprocess: ``TRITON_INTERPRET`` is read when ``triton.jit`` decorates a kernel, so it must
be set before the kernel modules are imported and must not leak into the other tests (nor may the
patches below). A check is a module-level function ``_check_*`` of a test file in this directory;
the subprocess imports that file and calls it, and the parent test fails with its stderr.

Shapes in the checks are tiny: the interpreter runs every program of a grid in Python.
"""

import contextlib
import importlib.util
import os
import subprocess
import sys
import unittest

import torch

__all__ = [
    "HAS_TRITON",
    "requires_triton",
    "run_check",
    "patch_interpreter_bf16_dot",
    "deterministic",
    "assert_matches",
    "sm90_target",
    "use_sm90_target",
]

HAS_TRITON = importlib.util.find_spec("triton") is not None
TEST_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(os.path.dirname(TEST_DIR))

requires_triton = unittest.skipIf(
    not HAS_TRITON,
    "triton is not installed: the Triton kernels cannot run, not even in the interpreter",
)


def run_check(
    testcase: unittest.TestCase, module: str, check: str, *, interpret: bool = True,
    timeout: float = 300,
) -> None:
    """Runs ``<module>.<check>()`` (a test file of this directory) in a fresh interpreter."""
    code = (
        f"import sys; sys.path[:0] = [{TEST_DIR!r}, {REPO_DIR!r}]; "
        f"import {module} as t; t.{check}()"
    )
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_DIR, capture_output=True, text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        testcase.fail(
            f"{module}.{check} failed (TRITON_INTERPRET={int(interpret)}):\n{proc.stderr[-6000:]}"
        )


def patch_interpreter_bf16_dot() -> None:
    """The interpreter of triton 3.8 / 3.9 stores bf16 as its uint16 bit patterns and ``tl.dot``
    multiplies those integers. Widen bf16 operands to fp32 first: exact, and what a bf16 MMA
    does (exact products, fp32 accumulation)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widen(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        bits = t.data.astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = patched


@contextlib.contextmanager
def deterministic():
    """Deterministic algorithms, which also fill fresh ``torch.empty`` memory with NaN
    (``torch.utils.deterministic.fill_uninitialized_memory``): an output row a kernel fails to
    write cannot pass for a zero row."""
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` (a kernel's output, in its own dtype) against ``expected`` (the CPU op on the
    same values in fp32 / fp64)."""
    if actual.dtype in (torch.bfloat16, torch.float16):
        # one rounding of the fp32 result: at most one ulp (2**-7 relative for bf16, 2**-10 for
        # fp16; the interpreter truncates where a GPU rounds to nearest even, which is within half
        # an ulp); atol covers summation-order differences of the fp32 accumulation
        rtol = 2**-7 if actual.dtype == torch.bfloat16 else 2**-10
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-4, msg=what)
    elif actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected.float(), rtol=1e-5, atol=1e-5, msg=what)
    elif actual.dtype == torch.float64:
        torch.testing.assert_close(actual, expected.double(), rtol=1e-12, atol=1e-12, msg=what)
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=what)


def sm90_target():
    """Triton's compilation target of an H100 / H200."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


def use_sm90_target() -> None:
    """Makes the Triton frontend target sm_90 on a machine with no GPU (for the rest of the
    process): torch's mutation analysis of a ``wrap_triton`` kernel builds its TTIR, and
    ``triton.compile`` builds PTX, both of which need a target."""
    import triton

    class _Sm90Driver:
        def get_current_target(self):
            return sm90_target()

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def is_active(self):
            return True

    triton.runtime.driver.set_active(_Sm90Driver())
