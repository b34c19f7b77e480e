"""Inductor support for the torch_moe ops (counterpart of ``torch/_inductor/``).

* ``lowering.py``: lowerings of the grouped GEMMs and of the fused expert FFN. Under
  ``mode="max-autotune"`` on CPU, ``grouped_mm`` of ``[M, K] x [G, K, N]`` lets
  ``autotune_select_algorithm`` pick between two extern kernels, one GEMM per group and one
  padded ``bmm`` over all groups (``padded_bmm.py``), and ``grouped_ffn`` between its kernel's
  per-group and batched expert GEMM forms (``ffn_forms.py``); every other call is one extern
  call of the op's kernel, with no autotuning and no template;
* ``decomposition.py``: decompositions of the routing, permutation and quantize ops into ATen
  ops that Inductor fuses (e.g. the routing softmax, top-k and expert histogram in one C++
  kernel; the activation and the MXFP8 quantizer of the next GEMM in one).

They must be registered before the first compile (Inductor caches its decomposition table on
first use), but importing Inductor costs seconds that eager users should not pay. So
``import torch_moe`` registers them at once if Inductor is already loaded, and otherwise when
``torch._inductor.lowering`` is first imported (:mod:`torch_moe._import_hook`).
Inductor and Dynamo are reached through one adapter, :mod:`torch_moe._inductor._compat`.

Registering also adds a hash of torch_moe's sources to ``torch.compiler.config.cache_key_tag``.
The decompositions are traced into the compiled graphs, but the AOTAutograd cache keys a graph
by what Dynamo captured, before decomposition: without the tag, a process running a newer
torch_moe would load the code compiled from the older decompositions and silently compute what
they computed. A tag set after ``import torch_moe`` replaces this one; append to it instead.
"""

import hashlib
import pathlib

import torch

from torch_moe._inductor import _compat as inductor

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
    if inductor.lowering_module_loaded():
        register()
    else:
        from torch_moe._import_hook import call_after_import

        call_after_import(inductor.LOWERING_MODULE, register)
