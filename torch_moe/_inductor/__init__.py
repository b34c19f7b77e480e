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

Registering also adds a hash of torch_moe's sources to ``torch.compiler.config.cache_key_tag``.
The decompositions are traced into the compiled graphs, but the AOTAutograd cache keys a graph
by what Dynamo captured, before decomposition: without the tag, a process running a newer
torch_moe would load the code compiled from the older decompositions and silently compute what
they computed. A tag set after ``import torch_moe`` replaces this one; append to it instead.
"""

import hashlib
import pathlib
import sys

import torch

_registered = False


def source_hash() -> str:
    """A short hash of every Python source file of the torch_moe package."""
    root = pathlib.Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _tag_compile_caches() -> None:
    tag = f"torch_moe:{source_hash()}"
    current = torch.compiler.config.cache_key_tag
    if tag not in current:
        torch.compiler.config.cache_key_tag = f"{current}|{tag}" if current else tag


def register() -> None:
    """Registers the lowerings and decompositions (once) and tags the compile caches."""
    global _registered
    if _registered:
        return
    _registered = True
    _tag_compile_caches()
    from torch_moe._inductor import decomposition, lowering  # noqa: F401


def install() -> None:
    """Called by ``import torch_moe``: register now, or when Inductor's lowering module loads."""
    if "torch._inductor.lowering" in sys.modules:
        register()
    else:
        from torch_moe._inductor._import_hook import call_after_import

        call_after_import("torch._inductor.lowering", register)
