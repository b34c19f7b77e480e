"""Inductor lowerings of the torch_moe grouped GEMMs (counterpart of
``torch/_inductor/kernel/mm_grouped.py``).

Each lowering realises its inputs, builds the output layout the fake kernel promises
(contiguous), and hands ``autotune_select_algorithm`` its choices: the torch_moe kernel as an
``ExternKernelChoice`` (the only choice on CPU, where Inductor cannot emit Triton). On CUDA the
Triton kernels of :mod:`torch_moe._triton` reach Inductor through the decompositions of
:mod:`torch_moe._inductor.decomposition` instead, as user-defined Triton kernels it can fuse
around.

Counters: ``torch._dynamo.utils.counters["torch_moe"]["<op>_lowering"]`` counts lowered calls.
"""

import itertools

import torch
from torch._dynamo.utils import counters
from torch._inductor.ir import FixedLayout
from torch._inductor.lowering import make_fallback, register_lowering
from torch._inductor.select_algorithm import (
    ExternKernelChoice,
    autotune_select_algorithm,
    realize_inputs,
)

ops = torch.ops.torch_moe


def _extern(name: str, kernel, op_overload) -> ExternKernelChoice:
    return ExternKernelChoice.lookup(name) or ExternKernelChoice(
        kernel, name=name, has_out_variant=False, op_overload=op_overload
    )


def _contiguous_layout(like, size) -> FixedLayout:
    stride = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        stride[i] = stride[i + 1] * size[i + 1]
    return FixedLayout(like.get_device(), like.get_dtype(), list(size), stride)


# ---------------------------------------------------------------------------------------------
# grouped_mm: 2D x 3D, 3D x 2D, 2D x 2D
# ---------------------------------------------------------------------------------------------

_grouped_mm_extern = _extern("torch_moe_grouped_mm", ops.grouped_mm.default, ops.grouped_mm.default)


@register_lowering(ops.grouped_mm.default, type_promotion_kind=None)
def tuned_grouped_mm(mat_a, mat_b, offs):
    mat_a, mat_b, offs = realize_inputs(mat_a, mat_b, offs)
    a, b = mat_a.get_size(), mat_b.get_size()
    if len(a) == 2 and len(b) == 3:
        size = [a[0], b[2]]
    elif len(a) == 3 and len(b) == 2:
        size = [a[1], b[1]]
    else:
        size = [offs.get_size()[0], a[0], b[1]]
    layout = _contiguous_layout(mat_a, size)
    counters["torch_moe"]["grouped_mm_lowering"] += 1
    choices = [_grouped_mm_extern.bind([mat_a, mat_b, offs], layout)]
    return autotune_select_algorithm("torch_moe_grouped_mm", choices, [mat_a, mat_b, offs], layout)[0]


# ---------------------------------------------------------------------------------------------
# indexed_grouped_mm: optional gather / scatter / row weights
# ---------------------------------------------------------------------------------------------

_OPTIONAL = ("gather_index", "scatter_index", "scatter_weight")


def _indexed_kernel(present: tuple[bool, bool, bool]):
    """The op with only the optional tensors in ``present`` as positional arguments (Inductor
    choices take tensors positionally and cannot pass None for a tensor)."""

    def kernel(input, weight, offs, *tensors, num_out_rows=-1):
        it = iter(tensors)
        opt = [next(it) if p else None for p in present]
        return ops.indexed_grouped_mm(input, weight, offs, *opt, num_out_rows)

    return kernel


_indexed_externs = {
    present: _extern(
        "torch_moe_indexed_grouped_mm" + "".join("_" + n.split("_")[0][0] + n.split("_")[1][0]
                                                 for n, p in zip(_OPTIONAL, present) if p),
        _indexed_kernel(present),
        ops.indexed_grouped_mm.default,
    )
    for present in itertools.product((False, True), repeat=3)
}


@register_lowering(ops.indexed_grouped_mm.default, type_promotion_kind=None)
def tuned_indexed_grouped_mm(input, weight, offs, gather_index=None, scatter_index=None,
                             scatter_weight=None, num_out_rows=-1):
    optional = [gather_index, scatter_index, scatter_weight]
    present = tuple(t is not None for t in optional)
    nodes = realize_inputs(input, weight, offs, *[t for t in optional if t is not None])
    S = gather_index.get_size()[0] if gather_index is not None else input.get_size()[0]
    rows = S if scatter_index is None else num_out_rows
    layout = _contiguous_layout(input, [rows, weight.get_size()[2]])
    counters["torch_moe"]["indexed_grouped_mm_lowering"] += 1
    choices = [_indexed_externs[present].bind(nodes, layout, num_out_rows=num_out_rows)]
    return autotune_select_algorithm("torch_moe_indexed_grouped_mm", choices, nodes, layout)[0]


# ---------------------------------------------------------------------------------------------
# Ops whose decomposition applies to some calls only
# ---------------------------------------------------------------------------------------------

# The FP8 rowwise quantizers decompose without per-group offsets only (decomposition.py); a call
# with offsets (the wgrad GEMM's operands) stays in the graph and needs this extern fallback, which
# Inductor does not create by itself for an op that also has a decomposition.
for _op in (ops.quantize_fp8_rowwise.default, ops.dequantize_fp8_rowwise.default):
    make_fallback(_op, warn=False, override_decomp=True)
