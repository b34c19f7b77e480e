"""Documented Python entry points for the ``torch.ops.torch_moe`` ops.

Shape legend: T tokens, k experts per token, E experts, S sorted slots, D model dim.
"""

from typing import Optional

import torch
from torch import Tensor

__all__ = ["token_sort", "permute", "unpermute", "grouped_mm", "indexed_grouped_mm"]

_ops = torch.ops.torch_moe


def token_sort(topk_ids: Tensor, num_experts: int, align: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """Groups the (token, slot) assignments of ``topk_ids [T, k]`` by expert.

    Returns ``(sorted_ids [S], offs [E], tokens_per_expert [E])``:

    - ``sorted_ids`` (int64): flat assignment indices ``t * k + j``, grouped by expert and in
      ascending order inside each expert (a stable sort, so the result is deterministic);
    - ``offs`` (int32): cumulative group ends, the ``torch._grouped_mm`` convention;
    - ``tokens_per_expert`` (int64): the number of assignments of each expert.

    With ``align > 1`` every group is padded to a multiple of ``align`` (16 for FP8, 32 for
    MXFP8 grouped GEMMs) and ``S = T * k + E * (align - 1)``, a static bound; padded slots and
    the unused tail hold ``-1``, which every torch_moe kernel reads as a zero row. No host
    synchronisation is needed: all sizes are known from the input shapes.
    """
    return _ops.token_sort(topk_ids, num_experts, align)


def permute(x: Tensor, sorted_ids: Tensor, top_k: int, *, out: Optional[Tensor] = None) -> Tensor:
    """Copies token rows into expert order: ``out[i] = x[sorted_ids[i] // top_k]``, ``[S, D]``.

    Padded slots (``-1``) give zero rows. An assignment appears at most once in ``sorted_ids``. ``out=`` writes into an existing buffer, which avoids a
    fresh (page-faulting) allocation for large token batches.
    """
    if out is not None:
        _ops.permute.out(x, sorted_ids, top_k, out=out)
        return out
    return _ops.permute(x, sorted_ids, top_k)


def unpermute(y: Tensor, sorted_ids: Tensor, topk_weights: Tensor) -> Tensor:
    """Combines expert outputs ``y [S, D]`` back into tokens, weighted by ``topk_weights [T, k]``.

    ``out[t] = sum_j topk_weights[t, j] * y[i]`` where ``sorted_ids[i] == t * k + j``; the sum is
    accumulated in fp32 (fp64 for fp64 inputs) and rounded once.
    """
    return _ops.unpermute(y, sorted_ids, topk_weights)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Grouped matrix multiply with the layouts of ``torch._grouped_mm``.

    ``offs`` (int32, ``[G]``) holds cumulative group ends. Unlike ``torch._grouped_mm`` in 2.13,
    offs are validated, rows (columns) past ``offs[-1]`` are zero, fp64 and stride-0 gradients
    are supported, and the fake kernel accepts every floating dtype.

    - 2D x 3D: ``a [M, K] @ b [G, K, N] -> [M, N]``, the rows of ``a`` split by ``offs``;
    - 3D x 2D: ``a [G, M, K] @ b [K, N] -> [M, N]``, the columns of ``b`` split by ``offs``;
    - 2D x 2D: ``a [M, K] @ b [K, N] -> [G, M, N]``, the contraction split by ``offs``
      (the weight-gradient form).
    """
    return _ops.grouped_mm(a, b, offs)


def indexed_grouped_mm(
    input: Tensor,
    weight: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor] = None,
    scatter_index: Optional[Tensor] = None,
    scatter_weight: Optional[Tensor] = None,
    num_out_rows: int = -1,
) -> Tensor:
    """Grouped GEMM that gathers its input rows and scatters its output rows through indices.

    For sorted slot ``i`` of group ``g`` (``offs[g-1] <= i < offs[g]``)::

        v_i = input[gather_index[i] if gather_index is given else i] @ weight[g]
        v_i = v_i * scatter_weight[i]                      (if scatter_weight is given)
        out[scatter_index[i]] += v_i   (out: [num_out_rows, N], zero-initialised), or
        out[i] = v_i                   (out: [S, N], rows past offs[-1] zero)

    An index of ``-1`` marks a padded slot, which reads no row of ``input`` or ``weight``: a
    gathered one gives an exact zero row (whatever the weights of its group hold), a scattered
    one adds nothing.
    This is the fused form of ScatterMoE / fused_moe: an MoE layer never materialises the
    permuted copy of its tokens, and the backward builds each group's gathered rows once.
    """
    return _ops.indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows
    )
