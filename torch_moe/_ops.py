"""Schemas of the ``torch_moe`` operator library.

This module is the counterpart of ``aten/src/ATen/native/native_functions.yaml``: every op is
defined here with a schema string in the same language as a ``func:`` line, and nothing else.
Kernels live in :mod:`torch_moe._native`, fake (meta) kernels in
:mod:`torch_moe._meta_registrations` and derivative formulas in :mod:`torch_moe._autograd`.

Shape legend used throughout torch_moe:
    T  tokens                      k  experts per token (top-k)
    E  experts (= groups G)        S  sorted slots (T * k, plus alignment padding)
    D  model (hidden) dim          F  expert FFN dim
    M, K, N  generic GEMM dims (out[M, N] = a[M, K] @ b[K, N])
"""

import torch

__all__ = ["lib"]

lib = torch.library.Library("torch_moe", "DEF")

_PT2 = (torch.Tag.pt2_compliant_tag,)

# Routing: group the (token, slot) assignments by expert.
#   topk_ids [T, k] -> sorted_ids [S] int64 (flat assignment index t * k + j, -1 for padding),
#                      offs [E] int32 (cumulative group ends), tokens_per_expert [E] int64
lib.define(
    "token_sort(Tensor topk_ids, int num_experts, int align=1) "
    "-> (Tensor sorted_ids, Tensor offs, Tensor tokens_per_expert)",
    tags=_PT2,
)

# Materialised copies in expert order and back.
#   permute:   x [T, D] -> [S, D],  out[i] = x[sorted_ids[i] // top_k] (zero row for padding)
#   unpermute: y [S, D] -> [T, D],  out[t] = sum_j topk_weights[t, j] * y[slot of t * k + j]
lib.define("permute(Tensor x, Tensor sorted_ids, int top_k) -> Tensor", tags=_PT2)
# The out= form returns nothing: a custom op whose output aliases an input cannot be
# functionalized, while a pure mutation is (auto_functionalized).
lib.define(
    "permute.out(Tensor x, Tensor sorted_ids, int top_k, *, Tensor(a!) out) -> ()",
    tags=_PT2,
)
lib.define("permute_backward(Tensor grad, Tensor sorted_ids, int top_k, SymInt num_tokens) -> Tensor", tags=_PT2)
lib.define("unpermute(Tensor y, Tensor sorted_ids, Tensor topk_weights) -> Tensor", tags=_PT2)
# Backward ops take the output_mask of aten::convolution_backward: an output whose entry is False
# is not computed and is returned as an empty tensor of shape [0].
lib.define(
    "unpermute_backward(Tensor grad, Tensor y, Tensor sorted_ids, Tensor topk_weights, "
    "bool[2] output_mask) -> (Tensor grad_y, Tensor grad_topk_weights)",
    tags=_PT2,
)

# Grouped GEMM with the layouts of aten::_grouped_mm (offs: int32 cumulative group ends).
#   2D x 3D: a [M, K]  @ b [G, K, N] -> [M, N]     (rows of a split by offs)
#   3D x 2D: a [G, M, K] @ b [K, N]  -> [M, N]     (columns of b split by offs)
#   2D x 2D: a [M, K]  @ b [K, N]    -> [G, M, N]  (the contraction K split by offs)
lib.define("grouped_mm(Tensor self, Tensor mat2, Tensor offs) -> Tensor", tags=_PT2)

# Index-aware grouped GEMM (2D x 3D), the fused form of ScatterMoE / fused_moe:
#   row i of group g:  v_i = input[gather_index[i] or i] @ weight[g] (* scatter_weight[i])
#   out[scatter_index[i] or i] (+)= v_i ; index -1 marks a padded slot, which reads no row of
#   input or weight (an exact zero row / nothing added).
lib.define(
    "indexed_grouped_mm(Tensor input, Tensor weight, Tensor offs, Tensor? gather_index=None, "
    "Tensor? scatter_index=None, Tensor? scatter_weight=None, SymInt num_out_rows=-1) -> Tensor",
    tags=_PT2,
)
lib.define(
    "indexed_grouped_mm_backward(Tensor grad, Tensor input, Tensor weight, Tensor offs, "
    "Tensor? gather_index, Tensor? scatter_index, Tensor? scatter_weight, bool[3] output_mask) "
    "-> (Tensor grad_input, Tensor grad_weight, Tensor grad_scatter_weight)",
    tags=_PT2,
)

# The expert FFN of an MoE layer over tokens grouped by token_sort, fused end to end:
#   out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w1[e] + b1[e], x[t] @ w3[e] + b3[e]) @ w2[e]
#                                       + b2[e]),  e = expert of (t, j)
# w1 [E, D, F] (gate), w3 [E, D, F] (up), w2 [E, F, D]; or w1 = w13 [E, D, 2F] with w3 = None.
# The expert biases are optional, each on its own: b1 [E, F] ([E, 2F] with a fused w13),
# b3 [E, F] (with a separate w3 only), b2 [E, D]; the routing weight scales the down bias too
# (gpt-oss). `hidden` [S, 2F] (gated) or [S, F] holds the pre-activation values, biases
# included, saved for backward.
lib.define(
    "grouped_ffn(Tensor x, Tensor sorted_ids, Tensor offs, Tensor topk_weights, Tensor w1, "
    "Tensor w2, Tensor? w3, str activation='swiglu', float alpha=1.702, float limit=7.0, "
    "Tensor? b1=None, Tensor? b2=None, Tensor? b3=None) -> (Tensor out, Tensor hidden)",
    tags=_PT2,
)
# output_mask entries 5..7 are the biases; an absent bias gets an empty gradient.
lib.define(
    "grouped_ffn_backward(Tensor grad, Tensor x, Tensor sorted_ids, Tensor offs, "
    "Tensor topk_weights, Tensor w1, Tensor w2, Tensor? w3, Tensor hidden, str activation, "
    "float alpha, float limit, bool[8] output_mask, Tensor? b1=None, Tensor? b2=None, "
    "Tensor? b3=None) "
    "-> (Tensor grad_x, Tensor grad_topk_weights, Tensor grad_w1, Tensor grad_w2, Tensor grad_w3, "
    "Tensor grad_b1, Tensor grad_b2, Tensor grad_b3)",
    tags=_PT2,
)
