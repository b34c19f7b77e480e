"""Inductor support for the torch_moe ops (counterpart of ``torch/_inductor/``).

* ``lowering.py``: lowerings of the grouped GEMMs that offer ``autotune_select_algorithm``
  choices (the torch_moe kernel as an extern choice everywhere; on CUDA with SM90+ also aten's
  persistent Triton grouped-GEMM template);
* ``decomposition.py``: decompositions of the routing, permutation and quantize ops into ATen
  ops that Inductor fuses (e.g. the routing softmax, top-k and expert histogram in one C++
  kernel; the activation and the MXFP8 quantizer of the next GEMM in one).

They must be registered before the first compile (Inductor caches its decomposition table on
first use), but importing Inductor costs seconds that eager users should not pay. So
``import torch_moe`` registers them at once if Inductor is already loaded, and otherwise when
``torch._inductor.lowering`` is first imported (:mod:`torch_moe._inductor._import_hook`).
"""

import sys

_registered = False


def register() -> None:
    """Registers the lowerings and decompositions (once)."""
    global _registered
    if _registered:
        return
    _registered = True
    from torch_moe._inductor import decomposition, lowering  # noqa: F401


def install() -> None:
    """Called by ``import torch_moe``: register now, or when Inductor's lowering module loads."""
    if "torch._inductor.lowering" in sys.modules:
        register()
    else:
        from torch_moe._inductor._import_hook import call_after_import

        call_after_import("torch._inductor.lowering", register)
