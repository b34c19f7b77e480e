"""The CPU kernel of ``torch_moe::grouped_ffn`` in each expert GEMM form, as the extern kernels
the lowering offers Inductor's autotuning (``mode="max-autotune"``).

The fused kernel runs its expert GEMMs one per expert (``"per_group"``) or as one ``bmm`` over
runs of experts padded to the longest (``"batched"``); which is faster depends on the CPU's GEMM
kernels at a few tens of rows per expert (:mod:`torch_moe._native._expert_blocks`). Eager code
picks with ``torch_moe.cpu.set_expert_form``; under max-autotune Inductor measures both on the
shapes of the graph. An autotuning choice has one output, and the op has two (``out [T, D]``
and ``hidden [S, H]``, both of x's dtype), so each kernel here returns one flat buffer
``[T * D + S * H]`` whose two parts the lowering views as the op's outputs; the kernel writes
them in place (no copy). Numerics are the op's in that form: bit for bit in ``"per_group"``,
the batched form's summation order otherwise.

Benchmark inputs: Inductor fills integer inputs with zeros, which routes nothing. The lowering
gives it a routing of balanced groups (:func:`balanced_sorted_ids`, :func:`balanced_offs`).
"""

import torch

from torch_moe._checks import GATED_ACTIVATIONS
from torch_moe._native import cpu as native_cpu
from torch_moe._native._expert_blocks import use_form

__all__ = ["FORMS", "OPTIONAL", "flat_kernel", "kernel_name", "balanced_sorted_ids",
           "balanced_offs"]

# The forms offered: the two GEMM forms (the "auto" rule chooses between them without
# measuring, which is what autotuning replaces).
FORMS = ("per_group", "batched")
# The optional tensor arguments of the op, in order; an extern call passes tensors positionally
# and cannot pass None, so there is one kernel per subset present.
OPTIONAL = ("w3", "b1", "b2", "b3")


def kernel_name(form: str, present: tuple) -> str:
    """``torch_moe_grouped_ffn_<form>[_w3][_b1]...``: the name the generated code calls."""
    return "torch_moe_grouped_ffn_" + form + "".join(
        "_" + name for name, p in zip(OPTIONAL, present) if p)


def flat_kernel(form: str, present: tuple):
    """The op in ``form`` with only the optional tensors in ``present`` as positional
    arguments, returning ``flat [T * D + S * H]``: ``out`` then ``hidden``, row-major."""

    def kernel(x, sorted_ids, offs, topk_weights, w1, w2, *optional, activation, alpha, limit):
        it = iter(optional)
        w3, b1, b2, b3 = (next(it) if p else None for p in present)
        T, D = x.shape
        S = sorted_ids.size(0)
        H = (2 if activation in GATED_ACTIVATIONS else 1) * w2.size(1)
        flat = x.new_empty((T * D + S * H,))
        with use_form(form):
            native_cpu.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                                   alpha, limit, b1, b2, b3, out=flat[: T * D].view(T, D),
                                   hidden=flat[T * D :].view(S, H))
        return flat

    kernel.__name__ = kernel_name(form, present)
    return kernel


def balanced_sorted_ids(num_slots: int, num_assignments: int, dtype, device) -> torch.Tensor:
    """``sorted_ids [num_slots]`` of a valid routing: slot ``i`` holds assignment ``i``, and the
    slots past ``num_assignments`` (``T * k``) are padding (-1)."""
    ids = torch.full((num_slots,), -1, dtype=dtype, device=device)
    n = min(num_slots, num_assignments)
    ids[:n] = torch.arange(n, dtype=dtype, device=device)
    return ids


def balanced_offs(num_slots: int, num_experts: int, dtype, device) -> torch.Tensor:
    """``offs [num_experts]`` splitting ``num_slots`` slots into groups as equal as they go."""
    ends = [(e + 1) * num_slots // num_experts for e in range(num_experts)]
    return torch.tensor(ends, dtype=dtype, device=device)
