"""The adapter of torch_moe's Inductor support to the private parts of Inductor and Dynamo.

Every ``torch._inductor.*`` and ``torch._dynamo.*`` name that :mod:`torch_moe._inductor` needs is
reached through this module, so that a torch release that moves one breaks one place. Each entry
detects what it needs (an attribute, a keyword of a signature) instead of comparing versions.

Importing this module imports nothing of Inductor: ``import torch_moe`` uses it to decide when to
register, and Inductor costs seconds to import. The registration modules (``lowering.py``,
``decomposition.py``) call the functions below, which import Inductor on first use.
"""

from __future__ import annotations

import inspect
import sys
from typing import Callable, Optional, Sequence

import torch

__all__ = [
    "LOWERING_MODULE",
    "lowering_module_loaded",
    "register_lowering",
    "make_fallback",
    "register_decomposition",
    "realize_inputs",
    "fixed_layout",
    "extern_kernel_choice",
    "extern_kernel_node",
    "autotune_select_algorithm",
    "max_autotune_enabled",
    "size_hint",
    "counters",
    "fallback_handler",
    "strided_view",
]

# The module whose import makes Inductor read its lowering and decomposition tables: torch_moe
# registers no later than right after it loads.
LOWERING_MODULE = "torch._inductor.lowering"


def lowering_module_loaded() -> bool:
    return LOWERING_MODULE in sys.modules


def register_lowering(op: torch._ops.OpOverload) -> Callable:
    """A decorator registering the lowering of ``op``, with no type promotion of its inputs
    (the fake kernel states the output dtype)."""
    from torch._inductor.lowering import register_lowering as register

    return register(op, type_promotion_kind=None)


def make_fallback(op: torch._ops.OpOverload) -> None:
    """Makes ``op`` an extern call of its kernel, also where a decomposition of it is registered
    (the decomposition returns ``NotImplemented`` for the calls it does not cover)."""
    from torch._inductor.lowering import make_fallback as fallback

    kwargs = {"warn": False}
    if "override_decomp" in inspect.signature(fallback).parameters:
        kwargs["override_decomp"] = True
    fallback(op, **kwargs)


def register_decomposition(op: torch._ops.OpOverload) -> Callable:
    """A decorator adding a decomposition of ``op`` to Inductor's table."""
    from torch._inductor.decomposition import register_decomposition as register

    return register(op)


def realize_inputs(*nodes):
    """The IR nodes as buffers (what an extern kernel takes), one per argument."""
    from torch._inductor.select_algorithm import realize_inputs as realize

    out = realize(*nodes)
    return [out] if len(nodes) == 1 else list(out)


def fixed_layout(like, size: Sequence, stride: Optional[Sequence] = None):
    """A fixed, contiguous (or ``stride``) layout with the device and dtype of the node ``like``."""
    from torch._inductor.ir import FixedLayout

    if stride is None:
        stride = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            stride[i] = stride[i + 1] * size[i + 1]
    return FixedLayout(like.get_device(), like.get_dtype(), list(size), list(stride))


def extern_kernel_choice(kernel: Callable, name: str, op_overload: torch._ops.OpOverload):
    """The autotuning choice that calls ``kernel`` (a function returning a new tensor), created
    once per process under ``name`` (the name the generated code calls it by,
    ``extern_kernels.<name>``)."""
    from torch._inductor.select_algorithm import ExternKernelChoice, extern_kernels

    lookup = getattr(ExternKernelChoice, "lookup", None)
    existing = lookup(name) if lookup is not None else None
    if existing is not None:
        return existing
    if hasattr(extern_kernels, name):
        raise RuntimeError(f"torch_moe: an Inductor extern kernel named {name} already exists")
    return ExternKernelChoice(kernel, name=name, has_out_variant=False, op_overload=op_overload)


def extern_kernel_node(choice, input_nodes: list, layout, **kwargs):
    """The IR node of one call of the extern ``choice``: no autotuning."""
    return choice.bind(input_nodes, layout, **kwargs).output_node()


def autotune_select_algorithm(name: str, choices: list, input_nodes: list, layout,
                              input_gen_fns: Optional[dict[int, Callable]] = None):
    """The IR node of the fastest of ``choices`` (benchmarked on inputs that ``input_gen_fns``
    makes, by argument index, and random ones for the others); a single choice is taken without
    benchmarking."""
    from torch._inductor.select_algorithm import autotune_select_algorithm as select

    kwargs = {}
    if input_gen_fns is not None:
        kwargs["input_gen_fns"] = input_gen_fns
    out = select(name, choices, input_nodes, layout, **kwargs)
    # some releases return (node, choice), others the node
    return out[0] if isinstance(out, tuple) else out


def max_autotune_enabled() -> bool:
    """Whether the compile asked Inductor to benchmark GEMM choices (``mode="max-autotune"``)."""
    from torch._inductor import config

    return bool(getattr(config, "max_autotune", False) or getattr(config, "max_autotune_gemm", False))


def size_hint(expr) -> int:
    """The value Inductor assumes for a size while it compiles (an int for a static size, the
    example's value for a symbolic one, Inductor's fallback for a data-dependent one): what
    benchmark inputs are made with."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    sizevars = V.graph.sizevars
    # renamed from size_hint to optimization_hint
    hint = getattr(sizevars, "optimization_hint", None) or sizevars.size_hint
    kwargs = {}
    fallback = getattr(config, "unbacked_symint_fallback", None)
    if fallback is not None and "fallback" in inspect.signature(hint).parameters:
        kwargs["fallback"] = fallback
    return int(hint(expr, **kwargs))


def counters():
    """Dynamo's counters, the ones compile statistics are read from: the lowerings count their
    calls in ``counters()["torch_moe"]``."""
    from torch._dynamo.utils import counters as dynamo_counters

    return dynamo_counters


def fallback_handler(op: torch._ops.OpOverload) -> Callable:
    """What Inductor lowers an op without a lowering to, one extern call of the op's kernel,
    for a lowering that takes some calls itself and leaves the others to it."""
    from torch._inductor.lowering import fallback_handler as handler

    return handler(op, add_to_fallback_set=False)


def strided_view(node, size: Sequence, stride: Sequence, offset):
    """A view of the realised buffer ``node`` of ``size`` and ``stride`` at element ``offset``
    of its storage (what ``aten.as_strided`` lowers to: no copy)."""
    from torch._inductor.lowering import lowerings

    return lowerings[torch.ops.aten.as_strided.default](node, size, stride, offset)
