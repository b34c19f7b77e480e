"""Packaging for torch_moe (pure Python).

torch is required as ``torch>=2.13`` so that an existing installation is always kept: pip never
replaces an installed torch that satisfies the range. On a machine without torch, install the
build you want first (e.g. ``pip install torch==2.13.0`` for the CPU wheel), as the README does.
"""

from setuptools import find_packages, setup

setup(
    name="torch_moe",
    version="0.1.0",
    description="Mixture-of-Experts operators, modules and parallelism for PyTorch",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_moe", "torch_moe.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.13"],
    extras_require={
        # torch.testing._internal.common_utils imports NumPy, which the torch wheel leaves out
        # triton: the Triton kernels' tests run under TRITON_INTERPRET=1 on the CPU; the range
        # admits the triton that each supported torch's CUDA wheel pins (3.8 for 2.14, 3.9 for
        # 2.15), so pip never has to replace it
        "test": ["expecttest>=0.3", "hypothesis>=6.100", "pytest>=8", "numpy>=1.24",
                 "triton>=3.8,<3.10"],
        # torch warns at every import without NumPy; torch_moe and the demo do not need it
        "demo": ["numpy>=1.24"],
        "triton": ["triton>=3.8"],
        # optional comparison in benchmarks/ops.py; torchtitan pins its own torch, so install it
        # only where that torch is the one you want
        # torchtitan 0.3.0 imports triton at import time
        "bench": ["torchtitan==0.3.0", "triton>=3.8", "matplotlib>=3.7"],
        # the tests and benchmarks against transformers' own MoE blocks (test/test_hf_models.py,
        # benchmarks/hf_models.py); 5.24 is the first with every block's experts fused in memory
        # as the swapped blocks read them. transformers does not depend on torch, so it never
        # replaces the installed one
        "hf": ["transformers>=5.24,<6"],
        # the PNGs of benchmarks/sparsity_sweep.py, without torchtitan
        "plots": ["matplotlib>=3.7"],
    },
    license="BSD-3-Clause",
)
