"""Inductor lowerings of the torch_moe grouped GEMMs (counterpart of
``torch/_inductor/kernel/mm_grouped.py``).

Each lowering realises its inputs and builds the output layout the fake kernel promises
(contiguous). What it then offers Inductor:

* ``grouped_mm``, ``a [M, K] x b [G, K, N]`` on CPU under ``mode="max-autotune"``: two choices
  that ``autotune_select_algorithm`` benchmarks, the per-group kernel of the op
  (``extern_kernels.torch_moe_grouped_mm``, one ``mm`` per group) and a padded batched GEMM
  (``extern_kernels.torch_moe_grouped_mm_padded_bmm``, :mod:`torch_moe._inductor.padded_bmm`),
  faster when the groups are many and small. They are benchmarked on groups of equal size
  (``offs`` split the rows evenly; random ``offs`` would be invalid, and all-zero ones, what
  Inductor makes for integer inputs, leave every group empty).
* ``grouped_ffn`` on CPU under ``mode="max-autotune"``: the fused kernel in its two expert GEMM
  forms (``extern_kernels.torch_moe_grouped_ffn_per_group...`` and ``..._batched...``,
  :mod:`torch_moe._inductor.ffn_forms`), benchmarked on a routing of balanced groups. A choice
  has one output: each returns one buffer holding ``out`` and ``hidden``, which the lowering
  views as the op's two outputs. ``grouped_ffn_backward`` (eight outputs of mixed dtypes) stays
  one extern call, in the form ``torch_moe.cpu.set_expert_form`` chose;
* every other case (the other layouts, the other devices, no max-autotune) and
  ``indexed_grouped_mm``: one extern call of the op's kernel, with no autotuning.

There is no template choice: Inductor has no CPU GEMM template for grouped problems, and on
CUDA the Triton kernels of :mod:`torch_moe._triton` reach Inductor through the decompositions
registered by :func:`torch_moe._triton.register_cuda_kernels` (as user-defined Triton kernels it
compiles), before any lowering runs.

Counters: ``counters["torch_moe"]["<op>_lowering"]`` counts lowered calls.
"""

import itertools

import torch

from torch_moe import _checks
from torch_moe._inductor import _compat as inductor
from torch_moe._inductor import ffn_forms
from torch_moe._inductor.padded_bmm import grouped_mm_padded_bmm

ops = torch.ops.torch_moe


# ---------------------------------------------------------------------------------------------
# grouped_mm: 2D x 3D, 3D x 2D, 2D x 2D
# ---------------------------------------------------------------------------------------------

_grouped_mm_per_group = inductor.extern_kernel_choice(
    ops.grouped_mm.default, "torch_moe_grouped_mm", ops.grouped_mm.default
)
_grouped_mm_padded_bmm = inductor.extern_kernel_choice(
    grouped_mm_padded_bmm, "torch_moe_grouped_mm_padded_bmm", ops.grouped_mm.default
)


def _even_offs(num_rows: int):
    """An ``offs`` input generator for benchmarking: ``G`` groups of (nearly) equal size."""

    def make(offs_node):
        G = inductor.size_hint(offs_node.get_size()[0])
        ends = [(g + 1) * num_rows // G for g in range(G)]
        return torch.tensor(ends, dtype=torch.int32, device=offs_node.get_device())

    return make


@inductor.register_lowering(ops.grouped_mm.default)
def tuned_grouped_mm(mat_a, mat_b, offs):
    mat_a, mat_b, offs = inductor.realize_inputs(mat_a, mat_b, offs)
    a, b = mat_a.get_size(), mat_b.get_size()
    if len(a) == 2 and len(b) == 3:
        size = [a[0], b[2]]
    elif len(a) == 3 and len(b) == 2:
        size = [a[1], b[1]]
    else:
        size = [offs.get_size()[0], a[0], b[1]]
    layout = inductor.fixed_layout(mat_a, size)
    nodes = [mat_a, mat_b, offs]
    inductor.counters()["torch_moe"]["grouped_mm_lowering"] += 1
    if not (len(a) == 2 and len(b) == 3 and mat_a.get_device().type == "cpu"
            and inductor.max_autotune_enabled()):
        return inductor.extern_kernel_node(_grouped_mm_per_group, nodes, layout)
    choices = [_grouped_mm_per_group.bind(nodes, layout),
               _grouped_mm_padded_bmm.bind(nodes, layout)]
    return inductor.autotune_select_algorithm(
        "torch_moe_grouped_mm", choices, nodes, layout,
        input_gen_fns={2: _even_offs(inductor.size_hint(a[0]))},
    )


# ---------------------------------------------------------------------------------------------
# indexed_grouped_mm: optional gather / scatter / row weights
# ---------------------------------------------------------------------------------------------

_OPTIONAL = ("gather_index", "scatter_index", "scatter_weight")


def _indexed_kernel(present: tuple[bool, bool, bool]):
    """The op with only the optional tensors in ``present`` as positional arguments (an extern
    call takes tensors positionally and cannot pass None for a tensor)."""

    def kernel(input, weight, offs, *tensors, num_out_rows=-1):
        it = iter(tensors)
        opt = [next(it) if p else None for p in present]
        return ops.indexed_grouped_mm(input, weight, offs, *opt, num_out_rows)

    return kernel


_indexed_externs = {
    present: inductor.extern_kernel_choice(
        _indexed_kernel(present),
        "torch_moe_indexed_grouped_mm" + "".join("_" + n.split("_")[0][0] + n.split("_")[1][0]
                                                 for n, p in zip(_OPTIONAL, present) if p),
        ops.indexed_grouped_mm.default,
    )
    for present in itertools.product((False, True), repeat=3)
}


@inductor.register_lowering(ops.indexed_grouped_mm.default)
def lower_indexed_grouped_mm(input, weight, offs, gather_index=None, scatter_index=None,
                             scatter_weight=None, num_out_rows=-1):
    optional = [gather_index, scatter_index, scatter_weight]
    present = tuple(t is not None for t in optional)
    nodes = inductor.realize_inputs(input, weight, offs, *[t for t in optional if t is not None])
    S = gather_index.get_size()[0] if gather_index is not None else input.get_size()[0]
    rows = S if scatter_index is None else num_out_rows
    layout = inductor.fixed_layout(input, [rows, weight.get_size()[2]])
    inductor.counters()["torch_moe"]["indexed_grouped_mm_lowering"] += 1
    return inductor.extern_kernel_node(_indexed_externs[present], nodes, layout,
                                       num_out_rows=num_out_rows)


# ---------------------------------------------------------------------------------------------
# grouped_ffn: the two expert GEMM forms of the fused CPU kernel
# ---------------------------------------------------------------------------------------------

_grouped_ffn_fallback = inductor.fallback_handler(ops.grouped_ffn.default)

_ffn_externs = {
    (form, present): inductor.extern_kernel_choice(
        ffn_forms.flat_kernel(form, present), ffn_forms.kernel_name(form, present),
        ops.grouped_ffn.default,
    )
    for form in ffn_forms.FORMS
    for present in itertools.product((False, True), repeat=len(ffn_forms.OPTIONAL))
}


@inductor.register_lowering(ops.grouped_ffn.default)
def tuned_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3=None, activation="swiglu",
                      alpha=1.702, limit=7.0, b1=None, b2=None, b3=None):
    inductor.counters()["torch_moe"]["grouped_ffn_lowering"] += 1
    if not (x.get_device().type == "cpu" and inductor.max_autotune_enabled()):
        return _grouped_ffn_fallback(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                                     alpha, limit, b1, b2, b3)
    optional = [w3, b1, b2, b3]
    present = tuple(t is not None for t in optional)
    nodes = inductor.realize_inputs(x, sorted_ids, offs, topk_weights, w1, w2,
                                    *[t for t in optional if t is not None])
    T, D = x.get_size()
    S = sorted_ids.get_size()[0]
    H = w2.get_size()[1] * (2 if activation in _checks.GATED_ACTIVATIONS else 1)
    layout = inductor.fixed_layout(x, [T * D + S * H])
    hint = inductor.size_hint
    num_assignments = hint(topk_weights.get_size()[0]) * hint(topk_weights.get_size()[1])
    input_gen_fns = {
        1: lambda node: ffn_forms.balanced_sorted_ids(
            hint(node.get_size()[0]), num_assignments, node.get_dtype(), node.get_device()),
        2: lambda node: ffn_forms.balanced_offs(
            hint(S), hint(node.get_size()[0]), node.get_dtype(), node.get_device()),
    }
    kwargs = dict(activation=activation, alpha=alpha, limit=limit)
    choices = [_ffn_externs[(form, present)].bind(nodes, layout, **kwargs)
               for form in ffn_forms.FORMS]
    flat = inductor.autotune_select_algorithm("torch_moe_grouped_ffn", choices, nodes, layout,
                                              input_gen_fns=input_gen_fns)
    out = inductor.strided_view(flat, [T, D], [D, 1], 0)
    hidden = inductor.strided_view(flat, [S, H], [H, 1], T * D)
    return out, hidden


# ---------------------------------------------------------------------------------------------
# Ops whose decomposition applies to some calls only
# ---------------------------------------------------------------------------------------------

# The FP8 rowwise quantizers decompose without per-group offsets only (decomposition.py); a call
# with offsets (the wgrad GEMM's operands) stays in the graph and needs this extern fallback, which
# Inductor does not create by itself for an op that also has a decomposition.
for _op in (ops.quantize_fp8_rowwise.default, ops.dequantize_fp8_rowwise.default):
    inductor.make_fallback(_op)
