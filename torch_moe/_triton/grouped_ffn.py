"""Triton kernels of ``torch_moe::grouped_ffn`` and ``torch_moe::grouped_ffn_backward``.

The expert FFN ``out[t] = sum_j topk_weights[t, j] * (act(x[t] @ w1[e] + b1[e], x[t] @ w3[e] +
b3[e]) @ w2[e] + b2[e])`` (each bias optional) over the sorted slots ``i`` (``sorted_ids[i] =
t * k + j``, expert ``e`` the group of ``i`` in ``offs``), with no permuted copy of ``x`` and no
host synchronisation.

Legend: T tokens, k = top_k, S sorted slots, E experts, D model dim, F FFN dim, H the width of the
pre-activation (``2F`` gated, ``F`` otherwise); ``token(i) = sorted_ids[i] // k``, ``w_i`` the
routing weight ``topk_weights.view(-1)[sorted_ids[i]]``.

Forward:

* ``_ffn_up_kernel``: one program computes a ``[BLOCK_M, BLOCK_N]`` tile of the gate and the up
  projection of the same columns (two accumulators; a fused ``w13 [E, D, 2F]`` is read at column
  offsets ``0`` and ``F``), gathering its rows of ``x`` through ``token(i)``. The epilogue adds
  the expert's biases (b1 and b3, or the ``[E, 2F]`` b1 of a fused w13 at the same column
  offsets) in fp32 and writes ``hidden [S, H]`` (the pre-activation, biases included, saved for
  the backward) and ``a = act(hidden) [S, F]``, computed in fp32 from the stored, rounded
  pre-activation, so the backward recomputes exactly what the forward used. ``a`` is a
  transient of the forward.
* the down projection is the rows kernel of :mod:`torch_moe._triton.grouped_mm` with a per-slot
  scale ``w_i``, b2 added in its epilogue before that scale, and a scatter to ``token(i)``:
  fp32 atomic adds and one rounding, or, under ``torch.use_deterministic_algorithms(True)``,
  rows in slot order and a fixed-order ``index_add_``.

Backward (saved: x, hidden, the routing, the weights and biases; the activation is
recomputed):

* ``_ffn_down_backward_kernel``: ``dA_i = grad[token(i)] @ w2[e]^T`` per ``[BLOCK_M, BLOCK_N]``
  tile of F, with an epilogue that recomputes ``a_i`` from ``hidden`` and writes, as requested,
  the partial sums of ``<dA_i, a_i>`` over the tile's columns (``d out / d w_i``, summed over the
  column tiles in a fixed order afterwards; with b2, ``<grad[token(i)], b2[e]>`` joins the first
  column tile's, accumulated from the rows of grad its K loop reads), ``a_i`` (an operand of
  ``grad_w2``) and ``dH_i = act'(hidden_i) applied to w_i * dA_i``.
* ``grad_w2[e] = sum_i a_i^T (w_i grad[token(i)])`` and ``grad_w1 / grad_w3[e] = sum_i
  x[token(i)]^T dH_i``: the gathered contraction-split kernel of grouped_mm over the slots of
  each group, which reads the token rows of grad and x through ``token(i)`` (no gathered copy).
* ``grad_x[t] = sum_{i: token(i) = t} dH_i @ w13[e]^T``: the rows kernel, scattered as the forward
  combine is (deterministic mode: rows, then ``index_add_``).
* the bias gradients, ``grad_b1 / grad_b3[e] = sum_i dH_i`` (gate / up columns) and
  ``grad_b2[e] = sum_i w_i grad[token(i)]`` over the slots of expert e: ``_group_sum_kernel``,
  one program per expert and column tile summing the group's rows in slot order in fp32
  (deterministic, no atomics), the rows of grad gathered through ``token(i)``.

Only what ``output_mask`` asks for is computed. Padded slots (-1 in ``sorted_ids``) read no row
and write zero rows (``hidden``, ``dH``), add nothing to ``out`` / ``grad_x`` / the weight
gradients and get no routing gradient; slots past ``offs[-1]`` are treated the same way.

Value checks, those of the CPU kernel: ``offs`` non-negative, non-decreasing and at most S, ids in
``[-1, T * k)``, each assignment at most once (the duplicate check is the inverse map of
:mod:`torch_moe._triton.permute`), all with :func:`torch_moe._compat.assert_async`, which does not
synchronise the host (and raises at once on CPU tensors, under ``TRITON_INTERPRET=1``). With
``TRITON_DEBUG=1`` the kernels also assert where the bad value is met. Out-of-range ids are
treated as padding and offsets are clamped, so invalid input reads or writes nothing out of
bounds. ``sorted_ids`` and ``offs`` are made contiguous on the host (free when they are): the
kernels read them with unit stride.

The activation formulas are those of :mod:`torch_moe._native.activation` (the reference), in
fp32 (fp64 for fp64 operands).
"""

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from torch_moe import _checks
from torch_moe._native._layouts import empty_weight_grad
from torch_moe._triton._configs import (
    _block,
    autotune_candidates,
    device_arch,
    fit_shared_memory,
    GemmConfig,
    pick_config,
    shared_memory_bytes,
)
from torch_moe._triton.grouped_mm import (
    _acc_zeros,
    check_offs,
    _input_precision,
    _launch,
    _launch_k_rows,
    _launch_rows,
    _row_tile,
    _rows_table_config,
)
from torch_moe._triton.permute import _default_config as _permute_config, _inverse_slots

__all__ = ["KERNELS", "grouped_ffn", "grouped_ffn_backward"]

# activation -> the constexpr code the kernels branch on
_ACTIVATION_CODES = {"swiglu": 0, "geglu": 1, "swiglu_oai": 2, "gelu": 3, "relu": 4}


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _gelu_cdf(v):
    return 0.5 * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _gelu_pdf(v):
    # exp(-v^2 / 2) / sqrt(2 pi)
    return tl.exp(-0.5 * v * v) * 0.3989422804014327


@triton.jit
def _act(g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """act(g, u) (``u`` unused by the ungated kinds), elementwise."""
    if ACTIVATION == 0:  # swiglu: silu(g) * u
        return g * _sigmoid(g) * u
    elif ACTIVATION == 1:  # geglu: gelu(g) * u
        return g * _gelu_cdf(g) * u
    elif ACTIVATION == 2:  # swiglu_oai
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return (uc + 1.0) * gc * _sigmoid(alpha * gc)
    elif ACTIVATION == 3:  # gelu
        return g * _gelu_cdf(g)
    else:  # relu
        return tl.where(g > 0, g, 0.0)


@triton.jit
def _act_backward(dy, g, u, alpha, limit, ACTIVATION: tl.constexpr):
    """(d act / d g, d act / d u) applied to ``dy``; the second is ``dy`` itself (unused) for
    the ungated kinds."""
    if ACTIVATION == 0:
        s = _sigmoid(g)
        return dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s
    elif ACTIVATION == 1:
        cdf = _gelu_cdf(g)
        return dy * u * (cdf + g * _gelu_pdf(g)), dy * g * cdf
    elif ACTIVATION == 2:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = _sigmoid(alpha * gc)
        # a clamp passes the gradient where its input lies inside the bounds (bounds included)
        dg = tl.where(g <= limit, dy * (uc + 1.0) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), dy * gc * s, 0.0)
        return dg, du
    elif ACTIVATION == 3:
        return dy * (_gelu_cdf(g) + g * _gelu_pdf(g)), dy
    else:
        return tl.where(g > 0, dy, 0.0), dy


@triton.jit
def _ffn_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    b1_ptr,
    b3_ptr,
    offs_ptr,
    ids_ptr,
    hidden_ptr,
    act_ptr,
    alpha,
    limit,
    num_rows,
    num_tokens,
    top_k,
    F,
    K,
    num_groups,
    up_col,
    up_bias_col,
    stride_xm,
    stride_xk,
    stride_w1e,
    stride_w1k,
    stride_w1n,
    stride_w3e,
    stride_w3k,
    stride_w3n,
    stride_b1e,
    stride_b1n,
    stride_b3e,
    stride_b3n,
    stride_hm,
    stride_hn,
    stride_am,
    stride_an,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    HAS_B1: tl.constexpr,
    HAS_B3: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: a ``[BLOCK_M, BLOCK_N]`` tile of columns ``cols`` of one segment of slots.

    Shapes: x ``[T, K]``; w1 ``[E, K, *]`` (gate at columns ``cols``), w3 ``[E, K, *]`` (up at
    columns ``up_col + cols``; w1 itself with ``up_col = F`` for a fused w13); offs ``[E]`` int32;
    ids ``[S]`` int64; hidden ``[S, H]`` (gate at ``cols``, up at ``F + cols``); act ``[S, F]``.
    The biases, with ``HAS_B1`` / ``HAS_B3``: b1 ``[E, *]`` (gate at columns ``cols``), b3
    ``[E, *]`` (up at columns ``up_bias_col + cols``; b1 itself with ``up_bias_col = F`` for the
    ``[E, 2F]`` bias of a fused w13), added in the accumulation dtype before ``hidden`` is
    rounded.
    The segments and the grid are those of the rows kernel of grouped_mm, tail included:
    grid = ``((cdiv(S, BLOCK_M) + E) * cdiv(F, BLOCK_N),)``.
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(F, BLOCK_N)
    tile = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    cols = cols.to(tl.int64)

    # The segment of this row tile, as in grouped_mm's rows kernel (the tail's rows are zeros).
    segs = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + segs, mask=segs < num_groups, other=0)
    starts = tl.load(offs_ptr + segs - 1, mask=(segs > 0) & (segs <= num_groups), other=0)
    seg, first_row, end_row, rows, row_ok = _row_tile(
        starts, ends, tile, num_rows, num_groups, True, BLOCK_M, BLOCK_E
    )
    is_group = seg < num_groups

    # the token row of each slot; padding, the tail and invalid ids read nothing
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1)
    tl.device_assert((ids >= -1) & (ids < num_tokens * top_k), "sorted_ids out of range")
    # rows of a group, not of the tail
    in_group = rows < tl.where(is_group, end_row, first_row)
    src_ok = in_group & (ids >= 0) & (ids < num_tokens * top_k)
    src = tl.where(src_ok, ids // top_k, 0)

    k_end = tl.where(is_group, K, 0)
    ks = tl.arange(0, BLOCK_K)
    e = seg.to(tl.int64)
    x_ptrs = x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk
    w1_ptrs = w1_ptr + e * stride_w1e + ks[:, None] * stride_w1k + cols[None, :] * stride_w1n
    w3_ptrs = (
        w3_ptr + e * stride_w3e + ks[:, None] * stride_w3k + (up_col + cols)[None, :] * stride_w3n
    )
    acc_g = _acc_zeros(x_ptr, BLOCK_M, BLOCK_N)
    acc_u = _acc_zeros(x_ptr, BLOCK_M, BLOCK_N)
    for k in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=src_ok[:, None], other=0.0)
            b1 = tl.load(w1_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k
            a = tl.load(x_ptrs, mask=src_ok[:, None] & k_ok[None, :], other=0.0)
            b1 = tl.load(w1_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc_g = tl.dot(a, b1, acc_g, input_precision=INPUT_PRECISION)
        if GATED:
            if EVEN_K:
                b3 = tl.load(w3_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                b3 = tl.load(w3_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_u = tl.dot(a, b3, acc_u, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w1_ptrs += BLOCK_K * stride_w1k
        w3_ptrs += BLOCK_K * stride_w3k

    # The biases of the tile's expert (none on the tail, nor past the last tile: no expert;
    # a comparison, not col_ok & is_group, which the interpreter cannot use as a mask)
    bias_ok = cols < tl.where(is_group, F, 0)
    if HAS_B1:
        bg = tl.load(b1_ptr + e * stride_b1e + cols * stride_b1n, mask=bias_ok, other=0.0)
        acc_g = acc_g + bg.to(acc_g.dtype)[None, :]
    if HAS_B3:
        bu = tl.load(b3_ptr + e * stride_b3e + (up_bias_col + cols) * stride_b3n, mask=bias_ok,
                     other=0.0)
        acc_u = acc_u + bu.to(acc_u.dtype)[None, :]

    # Padded slots store zeros (not the product of a zero row, NaN against an Inf weight); the
    # activation is computed from the stored, rounded pre-activation, as the backward sees it.
    out_ok = row_ok[:, None] & col_ok[None, :]
    h_ptrs = hidden_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
    hg = tl.where(src_ok[:, None], acc_g, 0.0).to(hidden_ptr.dtype.element_ty)
    tl.store(h_ptrs, hg, mask=out_ok)
    g = hg.to(acc_g.dtype)
    if GATED:
        hu = tl.where(src_ok[:, None], acc_u, 0.0).to(hidden_ptr.dtype.element_ty)
        tl.store(h_ptrs + F * stride_hn, hu, mask=out_ok)
        u = hu.to(acc_u.dtype)
    else:
        u = g
    act = tl.where(src_ok[:, None], _act(g, u, alpha, limit, ACTIVATION), 0.0)
    act_ptrs = act_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _ffn_down_backward_kernel(
    grad_ptr,
    w2_ptr,
    b2_ptr,
    offs_ptr,
    ids_ptr,
    topk_ptr,
    hidden_ptr,
    dh_ptr,
    act_ptr,
    part_ptr,
    alpha,
    limit,
    num_rows,
    num_tokens,
    top_k,
    F,
    K,
    num_groups,
    stride_gm,
    stride_gk,
    stride_w2e,
    stride_w2n,
    stride_w2k,
    stride_b2e,
    stride_b2k,
    stride_tt,
    stride_tj,
    stride_hm,
    stride_hn,
    stride_dm,
    stride_dn,
    stride_am,
    stride_an,
    stride_pm,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    NEED_DA: tl.constexpr,
    WRITE_DH: tl.constexpr,
    WRITE_ACT: tl.constexpr,
    WRITE_PART: tl.constexpr,
    HAS_B2: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: ``dA = grad[token] @ w2[e]^T`` on a ``[BLOCK_M, BLOCK_N]`` tile of columns of
    F, and its epilogue (see the module docstring).

    Shapes: grad ``[T, K]`` (K = D); w2 ``[E, F, K]``; topk ``[T, k]``; hidden, dh ``[S, H]``;
    act ``[S, F]``; part ``[S, cdiv(F, BLOCK_N)]`` fp32 / fp64, column ``pid % col_tiles``.
    With ``HAS_B2`` (b2 ``[E, K]``, only read with ``WRITE_PART``): ``d out / d w_i`` also has the
    term ``<grad[token(i)], b2[e]>``, accumulated over the K loop that reads those rows of grad
    and added to the partial sum of column tile 0.
    The grid is that of ``_ffn_up_kernel``; every row of every output is written (zeros for
    padding and the tail).
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(F, BLOCK_N)
    tile = pid // col_tiles
    col_tile = pid % col_tiles
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < F
    cols = cols.to(tl.int64)

    segs = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + segs, mask=segs < num_groups, other=0)
    starts = tl.load(offs_ptr + segs - 1, mask=(segs > 0) & (segs <= num_groups), other=0)
    seg, first_row, end_row, rows, row_ok = _row_tile(
        starts, ends, tile, num_rows, num_groups, True, BLOCK_M, BLOCK_E
    )
    is_group = seg < num_groups

    ids = tl.load(ids_ptr + rows, mask=row_ok, other=-1)
    tl.device_assert((ids >= -1) & (ids < num_tokens * top_k), "sorted_ids out of range")
    # rows of a group, not of the tail
    in_group = rows < tl.where(is_group, end_row, first_row)
    src_ok = in_group & (ids >= 0) & (ids < num_tokens * top_k)
    ids = tl.where(src_ok, ids, 0)
    src = ids // top_k
    weight = tl.load(
        topk_ptr + src * stride_tt + (ids % top_k) * stride_tj, mask=src_ok, other=0.0
    )

    acc = _acc_zeros(grad_ptr, BLOCK_M, BLOCK_N)
    # <grad[token(i)], b2[e]> per row, as [BLOCK_M, BLOCK_K] partial products summed at the end
    bias_dot = _acc_zeros(grad_ptr, BLOCK_M, BLOCK_K)
    if NEED_DA:
        k_end = tl.where(is_group, K, 0)
        ks = tl.arange(0, BLOCK_K)
        g_ptrs = grad_ptr + src[:, None] * stride_gm + ks[None, :] * stride_gk
        w_ptrs = (
            w2_ptr
            + seg.to(tl.int64) * stride_w2e
            + ks[:, None] * stride_w2k
            + cols[None, :] * stride_w2n
        )
        # offsets, not pointers: b2_ptr is None without HAS_B2
        b2_offs = seg.to(tl.int64) * stride_b2e + ks * stride_b2k
        for k in range(0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(g_ptrs, mask=src_ok[:, None], other=0.0)
                b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = ks < K - k
                a = tl.load(g_ptrs, mask=src_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
            if HAS_B2 and WRITE_PART:
                if EVEN_K:
                    bias = tl.load(b2_ptr + b2_offs)
                else:
                    bias = tl.load(b2_ptr + b2_offs, mask=k_ok, other=0.0)
                bias_dot += a.to(bias_dot.dtype) * bias.to(bias_dot.dtype)[None, :]
                b2_offs += BLOCK_K * stride_b2k
            g_ptrs += BLOCK_K * stride_gk
            w_ptrs += BLOCK_K * stride_w2k
        # a padded slot's dA is zero, whatever its group's weights hold
        acc = tl.where(src_ok[:, None], acc, 0.0)

    out_ok = row_ok[:, None] & col_ok[None, :]
    h_ptrs = hidden_ptr + rows[:, None] * stride_hm + cols[None, :] * stride_hn
    # hidden is read for real slots only: what the tail and padding hold is never used
    h_ok = src_ok[:, None] & col_ok[None, :]
    g = tl.load(h_ptrs, mask=h_ok, other=0.0).to(acc.dtype)
    if GATED:
        u = tl.load(h_ptrs + F * stride_hn, mask=h_ok, other=0.0).to(acc.dtype)
    else:
        u = g
    weight = weight.to(acc.dtype)
    if WRITE_PART or WRITE_ACT:
        act = tl.where(h_ok, _act(g, u, alpha, limit, ACTIVATION), 0.0)
        if WRITE_PART:
            part = tl.sum(acc * act, 1)
            if HAS_B2:
                # the bias term once per row, in the first column tile; none for padding
                bias_part = tl.where(src_ok, tl.sum(bias_dot, 1), 0.0)
                part += tl.where(col_tile == 0, bias_part, 0.0)
            tl.store(part_ptr + rows * stride_pm + col_tile, part, mask=row_ok)
        if WRITE_ACT:
            act_ptrs = act_ptr + rows[:, None] * stride_am + cols[None, :] * stride_an
            tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=out_ok)
    if WRITE_DH:
        dg, du = _act_backward(acc * weight[:, None], g, u, alpha, limit, ACTIVATION)
        dh_ptrs = dh_ptr + rows[:, None] * stride_dm + cols[None, :] * stride_dn
        tl.store(dh_ptrs, tl.where(h_ok, dg, 0.0).to(dh_ptr.dtype.element_ty), mask=out_ok)
        if GATED:
            du = tl.where(h_ok, du, 0.0).to(dh_ptr.dtype.element_ty)
            tl.store(dh_ptrs + F * stride_dn, du, mask=out_ok)


@triton.jit
def _group_sum_kernel(
    src_ptr,
    index_ptr,
    scale_ptr,
    offs_ptr,
    out_ptr,
    num_slots,
    num_src_rows,
    N,
    num_groups,
    stride_sm,
    stride_sn,
    stride_oe,
    stride_on,
    HAS_INDEX: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: columns ``cols`` of ``out[g] = sum_{offs[g-1] <= i < offs[g]} scale_i *
    src[index_i]`` (a bias gradient: the pre-activation gradient's rows, or the routing-weighted
    rows of the output gradient).

    Shapes: src ``[num_src_rows, N]`` (``num_slots`` rows without ``HAS_INDEX``), index / scale
    ``[num_slots]`` int64 / float, offs ``[num_groups]`` int32, out ``[num_groups, N]``. The
    group's rows are summed in order in the accumulation dtype and rounded once; a slot whose
    index is -1 (or out of range) adds nothing; an empty group gives zeros.
    grid = ``(num_groups * cdiv(N, BLOCK_N),)``.
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    g = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    cols = cols.to(tl.int64)

    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)
    start = tl.minimum(tl.maximum(start, 0), num_slots)
    end = tl.minimum(tl.maximum(end, start), num_slots)

    acc = _acc_zeros(src_ptr, BLOCK_M, BLOCK_N)
    for m in range(start, end, BLOCK_M):
        slots = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
        ok = slots < end
        if HAS_INDEX:
            src = tl.load(index_ptr + slots, mask=ok, other=-1)
            ok = ok & (src >= 0) & (src < num_src_rows)
        else:
            src = slots
        v = tl.load(src_ptr + src[:, None] * stride_sm + cols[None, :] * stride_sn,
                    mask=ok[:, None] & col_ok[None, :], other=0.0).to(acc.dtype)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + slots, mask=ok, other=0.0).to(acc.dtype)
            v = v * scale[:, None]
        acc += v
    total = tl.sum(acc, 0)
    out_ptrs = out_ptr + g.to(tl.int64) * stride_oe + cols * stride_on
    tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _token_index(sorted_ids: Tensor, num_tokens: int, top_k: int) -> Tensor:
    """token(i) for each slot, -1 for padding and out-of-range ids (which read and write
    nothing)."""
    valid = (sorted_ids >= 0) & (sorted_ids < num_tokens * top_k)
    return torch.where(valid, sorted_ids.div(max(top_k, 1), rounding_mode="floor"), -1)


def _check_routing(op: str, sorted_ids: Tensor, offs: Tensor, num_assignments) -> None:
    """The value checks of the CPU kernel on the device (see the module docstring)."""
    check_offs(op, offs, sorted_ids.size(0), "sorted_ids.size(0)")
    # ids in [-1, T * k) and each assignment at most once; the map itself is not needed
    _inverse_slots(op, sorted_ids, num_assignments, _permute_config(1))


def _slot_weights(topk_weights: Tensor, sorted_ids: Tensor, token: Tensor) -> Tensor:
    """``w_i`` per slot (the dtype of topk_weights), zero for padding; the kernels apply it in
    the accumulation dtype."""
    if topk_weights.numel() == 0:
        return torch.zeros(sorted_ids.size(0), device=sorted_ids.device)
    flat = topk_weights.reshape(-1)
    w = flat.index_select(0, sorted_ids.clamp(0, flat.size(0) - 1))
    return w.masked_fill_(token < 0, 0)


def _scatter_rows_sum(
    terms, offs: Tensor, token: Tensor, scale: Optional[Tensor], num_tokens: int, N: int,
    dtype: torch.dtype, config: Optional[GemmConfig], bias: Optional[Tensor] = None,
) -> Tensor:
    """``out[token(i)] += scale_i * (sum over (a, w) in terms of a_i @ w[e] + bias[e])`` (a
    ``[S, K]``, w ``[E, K, N]``, bias ``[E, N]`` or None), in fp32 / fp64, rounded once to
    ``dtype``. Atomic adds, or under deterministic algorithms rows in slot order and a
    fixed-order sum. (The bias rides on the first term's launch.)"""
    S = token.size(0)
    acc_dtype = _acc_dtype(dtype)
    acc = torch.zeros((num_tokens, N), dtype=acc_dtype, device=token.device)
    if torch.are_deterministic_algorithms_enabled():
        rows = None
        for a, w in terms:
            r = torch.empty((S, N), dtype=acc_dtype, device=token.device)
            if r.numel():
                _launch_rows(a, w, offs, None, None, scale, r, S, config,
                             bias=bias if rows is None else None)
            rows = r if rows is None else rows.add_(r)
        if acc.size(0):
            rows.masked_fill_((token < 0).unsqueeze(1), 0)
            acc.index_add_(0, token.clamp(min=0), rows)
    elif S > 0 and acc.numel():
        for n, (a, w) in enumerate(terms):
            # An autotuned scattered launch zeroes its output between its measured runs, which
            # would erase the terms added before it: only the first term may autotune.
            cfg = config
            if cfg is None and n > 0:
                cfg = _rows_table_config(a, S, w.size(2), w.size(1), w.size(0))
            _launch_rows(a, w, offs, None, token, scale, acc, S, cfg,
                         bias=bias if n == 0 else None)
    return acc if acc.dtype == dtype else acc.to(dtype)


def _up_candidates(table: GemmConfig, x: Tensor, F, gated: bool) -> list[GemmConfig]:
    """The autotuning candidates of the up kernel around the table's pick: those of
    grouped_mm's rows kernel whose stages fit in shared memory with a second weight tile (the up
    projection) when gated."""
    arch = device_arch(x.device)
    candidates = autotune_candidates(table, x.dtype, arch, None, F)
    if not gated:
        return candidates
    limit = shared_memory_bytes(arch)

    def stage_bytes(c: GemmConfig) -> int:
        return (c.block_m * c.block_k + 2 * c.block_k * c.block_n) * x.dtype.itemsize

    fitting = [c for c in candidates if c.num_stages * stage_bytes(c) <= limit]
    return fitting or [table]


def _rows_grid(S: int, E: int, F: int, cfg: GemmConfig):
    return ((triton.cdiv(S, cfg.block_m) + E) * triton.cdiv(F, cfg.block_n),)


def _ffn_config(x: Tensor, S, F, D, E, narrow: bool, weight_tiles: int = 1) -> GemmConfig:
    """The tiles of the FFN kernels: the table's rows-kernel pick for ``[S, F]`` outputs over a
    contraction of D, within shared memory with ``weight_tiles`` weight tiles per stage. The
    backward's kernel keeps it (the layout of its partial sums, one column per column tile, is
    chosen on the host from the config); the forward's is autotuned around it.

    ``narrow``: half the columns, for kernels with several live tiles per program (the gated up
    kernel's two accumulators and two weight tiles; the backward's epilogue, which holds dA, the
    pre-activation, the activation and its gradients), which keeps registers (and, with two
    weight tiles, shared memory) at the size of one plain GEMM tile."""
    arch = device_arch(x.device)
    cfg = pick_config("rows", x.dtype, arch, S, F, D, E)
    if narrow:
        cfg = cfg._replace(block_n=max(16, cfg.block_n // 2))
    return fit_shared_memory(cfg, x.dtype, arch, weight_tiles)


def _strides(t: Optional[Tensor]) -> tuple:
    """The strides of a 2-D operand, zeros for an absent one (its kernel branch is off)."""
    return (t.stride(0), t.stride(1)) if t is not None else (0, 0)


def _up_bias(b1: Optional[Tensor], b3: Optional[Tensor], gated: bool, F) -> tuple:
    """``(bias, column)``: the up projection's bias ``[E, *]`` and the column of it where the
    up bias starts: b3 at 0, or the ``[E, 2F]`` b1 of a fused w13 at F; (None, 0) without one."""
    if b3 is not None:
        return b3, 0
    if gated and b1 is not None and b1.size(1) == 2 * F:
        return b1, F
    return None, 0


def grouped_ffn(
    x: Tensor,
    sorted_ids: Tensor,
    offs: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Optional[Tensor] = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
    *,
    config: Optional[GemmConfig] = None,
) -> tuple[Tensor, Tensor]:
    """``torch_moe::grouped_ffn`` with the Triton kernels, for tensors on any device Triton runs
    on (CPU tensors under ``TRITON_INTERPRET=1``); the current device must be theirs.

    Args: those of the op (x ``[T, D]``, sorted_ids ``[S]``, offs ``[E]``, topk_weights
    ``[T, k]``, w1 ``[E, D, F]`` or fused ``[E, D, 2F]``, w2 ``[E, F, D]``, w3 ``[E, D, F]`` or
    None; the optional biases b1 ``[E, F]`` or fused ``[E, 2F]``, b2 ``[E, D]``, b3 ``[E, F]``,
    any strides); ``config``: the tiles of every GEMM (default: chosen from the dtype and
    sizes).

    Returns:
        ``(out [T, D], hidden [S, H])``, contiguous, in the dtype of x; ``hidden`` includes b1
        and b3.
    """
    _, F = _checks.check_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                                     b1=b1, b2=b2, b3=b3)
    # the kernels read the 1-D operands with unit stride
    sorted_ids, offs = sorted_ids.contiguous(), offs.contiguous()
    _check_routing("torch_moe.grouped_ffn", sorted_ids, offs, topk_weights.numel())
    gated = activation in _checks.GATED_ACTIVATIONS
    T, D = x.shape
    E = w1.size(0)
    k = topk_weights.size(1)
    S = sorted_ids.size(0)
    hidden = x.new_empty((S, 2 * F if gated else F))
    act = x.new_empty((S, F))
    if S > 0 and F > 0:
        table = (
            config if config is not None
            else _ffn_config(x, S, F, D, E, gated, weight_tiles=2 if gated else 1)
        )
        # a fused w13 holds the up projection in its columns F..2F, and its bias b1 [E, 2F] the
        # up bias in its columns F..2F
        w_up, up_col = (w3, 0) if w3 is not None else (w1, F)
        b_up, up_bias_col = _up_bias(b1, b3, gated, F)
        args = (
            x, w1, w_up, b1, b_up, offs, sorted_ids, hidden, act,
            float(alpha), float(limit),
            S, T, k, F, D, E, up_col, up_bias_col,
            x.stride(0), x.stride(1),
            w1.stride(0), w1.stride(1), w1.stride(2),
            w_up.stride(0), w_up.stride(1), w_up.stride(2),
            *_strides(b1), *_strides(b_up),
            hidden.stride(0), hidden.stride(1),
            act.stride(0), act.stride(1),
        )
        flags = dict(
            GATED=gated,
            ACTIVATION=_ACTIVATION_CODES[activation],
            HAS_B1=b1 is not None,
            HAS_B3=b_up is not None,
            INPUT_PRECISION=_input_precision(x.dtype),
            # the candidates share the table's BLOCK_K
            EVEN_K=bool(D % table.block_k == 0),
            BLOCK_E=_block(E + 1, 2, 2 ** 30),
        )

        def grid(block_m, block_n):
            return (triton.cdiv(S, block_m) + E) * triton.cdiv(F, block_n)

        # autotuned where no config is given: the kernel only writes its outputs, so measured
        # runs need no reset
        candidates = None if config is not None else _up_candidates(table, x, F, gated)
        _launch(_ffn_up_kernel, grid, args, flags, config, candidates, ("F", "K", "num_groups"))
    token = _token_index(sorted_ids, T, k)
    scale = _slot_weights(topk_weights, sorted_ids, token)
    # b2 in the down projection's epilogue, before the routing weight (which scales it too)
    out = _scatter_rows_sum([(act, w2)], offs, token, scale, T, D, x.dtype, config, bias=b2)
    return out, hidden


def grouped_ffn_backward(
    grad: Tensor,
    x: Tensor,
    sorted_ids: Tensor,
    offs: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Optional[Tensor],
    hidden: Tensor,
    activation: str,
    alpha: float,
    limit: float,
    output_mask: list[bool],
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
    *,
    config: Optional[GemmConfig] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``torch_moe::grouped_ffn_backward`` with the Triton kernels (see :func:`grouped_ffn`).

    Returns:
        ``(grad_x, grad_topk_weights, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3)``,
        each empty ``[0]`` where ``output_mask`` is False; grad_w3 is empty with a fused w13
        (whose gradient is grad_w1), and the bias gradients without biases.
    """
    _, F = _checks.check_grouped_ffn_backward(
        grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, activation, output_mask,
        b1=b1, b2=b2, b3=b3,
    )
    sorted_ids, offs = sorted_ids.contiguous(), offs.contiguous()
    _check_routing("torch_moe.grouped_ffn_backward", sorted_ids, offs, topk_weights.numel())
    want_x, want_topk, want_w1, want_w2, want_w3, want_b1, want_b2, want_b3 = output_mask
    want_w3 = want_w3 and w3 is not None
    want_b1, want_b2, want_b3 = (want and b is not None
                                 for want, b in ((want_b1, b1), (want_b2, b2), (want_b3, b3)))
    # b1 / b3 take the row sums of dH; b2 those of the weighted output gradient, and the
    # routing weights' gradient gains <grad, b2[e]> (read by the dA kernel with grad's rows)
    want_dH = want_x or want_w1 or want_w3 or want_b1 or want_b3
    want_dA = want_topk or want_dH
    topk_bias = want_topk and b2 is not None
    gated = activation in _checks.GATED_ACTIVATIONS
    T, D = x.shape
    E = w1.size(0)
    k = topk_weights.size(1)
    S = sorted_ids.size(0)
    acc_dtype = _acc_dtype(x.dtype)
    token = _token_index(sorted_ids, T, k)

    cfg = config if config is not None else _ffn_config(x, S, F, D, E, True)
    col_tiles = triton.cdiv(F, cfg.block_n)
    dH = x.new_empty(hidden.shape) if want_dH else None
    act = x.new_empty((S, F)) if want_w2 else None
    part = torch.empty((S, col_tiles), dtype=acc_dtype, device=x.device) if want_topk else None
    if S > 0 and F > 0 and (want_dA or want_w2):
        wrap_triton(_ffn_down_backward_kernel)[_rows_grid(S, E, F, cfg)](
            grad, w2, b2 if topk_bias else None, offs, sorted_ids, topk_weights, hidden, dH, act,
            part,
            float(alpha), float(limit),
            S, T, k, F, D, E,
            grad.stride(0), grad.stride(1),
            w2.stride(0), w2.stride(1), w2.stride(2),
            *_strides(b2 if topk_bias else None),
            topk_weights.stride(0), topk_weights.stride(1),
            hidden.stride(0), hidden.stride(1),
            dH.stride(0) if want_dH else 0, dH.stride(1) if want_dH else 0,
            act.stride(0) if want_w2 else 0, act.stride(1) if want_w2 else 0,
            part.stride(0) if want_topk else 0,
            GATED=gated,
            ACTIVATION=_ACTIVATION_CODES[activation],
            NEED_DA=want_dA,
            WRITE_DH=want_dH,
            WRITE_ACT=want_w2,
            WRITE_PART=want_topk,
            HAS_B2=topk_bias,
            INPUT_PRECISION=_input_precision(x.dtype),
            EVEN_K=bool(D % cfg.block_k == 0),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            BLOCK_E=_block(E + 1, 2, 2 ** 30),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )

    grad_topk = topk_weights.new_empty((0,))
    if want_topk:
        # the column tiles' partial sums in a fixed order, then each slot's sum to its
        # assignment (at most one slot each); padding goes to a spare entry that is dropped
        per_slot = part.sum(1)
        if topk_bias and F == 0:
            # no column tile carries the bias term
            per_slot = per_slot + _slot_bias_dot(grad, b2, offs, token, acc_dtype)
        n = T * k
        acc = torch.zeros(n + 1, dtype=acc_dtype, device=x.device)
        acc.index_add_(0, torch.where(token >= 0, sorted_ids, n), per_slot)
        grad_topk = acc.narrow(0, 0, n).view(T, k).to(topk_weights.dtype)

    # The weight gradients: the contraction over each group's slots, with the token rows of
    # grad and x gathered in the kernel (padding reads nothing)
    grad_w2 = w2.new_empty((0,))
    if want_w2:
        grad_w2 = empty_weight_grad(w2)  # in w2's strides where dense, as the fake kernel
        if grad_w2.numel():
            weight = _slot_weights(topk_weights, sorted_ids, token)
            _launch_k_rows(act, grad, offs, grad_w2, config, b_index=token, b_scale=weight)

    # dH splits into the gate half (w1) and the up half (w3) with a separate w3; a fused w13
    # takes all of it. (narrow, not indexing: Tensor.__getitem__ fails on fake CUDA tensors
    # without a CUDA build)
    if w3 is not None and want_dH:
        dH_parts = [(dH.narrow(1, 0, F), w1), (dH.narrow(1, F, F), w3)]
    else:
        dH_parts = [(dH, w1)]
    grad_w1, grad_w3 = w1.new_empty((0,)), w1.new_empty((0,))
    if want_w1:
        grad_w1 = empty_weight_grad(w1)
        if grad_w1.numel():
            _launch_k_rows(x, dH_parts[0][0], offs, grad_w1, config, a_index=token)
    if want_w3:
        grad_w3 = empty_weight_grad(w3)
        if grad_w3.numel():
            _launch_k_rows(x, dH_parts[1][0], offs, grad_w3, config, a_index=token)

    grad_x = x.new_empty((0,))
    if want_x:
        terms = [(d, w.transpose(1, 2)) for d, w in dH_parts]
        grad_x = _scatter_rows_sum(terms, offs, token, None, T, D, x.dtype, config)

    # The bias gradients: per-expert sums of rows, in the accumulation dtype. b1 takes the
    # gate columns of dH (all of them for the [E, 2F] bias of a fused w13, and with an
    # ungated activation), b3 the up columns.
    grad_b1, grad_b2, grad_b3 = (
        (b if b is not None else w1).new_empty((0,)) for b in (b1, b2, b3)
    )
    if want_b1:
        grad_b1 = torch.empty(b1.shape, dtype=b1.dtype, device=b1.device)
        _group_sum(dH.narrow(1, 0, b1.size(1)), offs, grad_b1, config)
    if want_b3:
        grad_b3 = torch.empty(b3.shape, dtype=b3.dtype, device=b3.device)
        _group_sum(dH.narrow(1, F, F), offs, grad_b3, config)
    if want_b2:
        grad_b2 = torch.empty(b2.shape, dtype=b2.dtype, device=b2.device)
        weight = _slot_weights(topk_weights, sorted_ids, token)
        _group_sum(grad, offs, grad_b2, config, index=token, scale=weight)
    return grad_x, grad_topk, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3


def _group_sum(
    src: Tensor, offs: Tensor, out: Tensor, config: Optional[GemmConfig], *,
    index: Optional[Tensor] = None, scale: Optional[Tensor] = None,
) -> None:
    """``out[g] = sum_{i in group g} scale_i * src[index_i]`` (:func:`_group_sum_kernel`):
    src ``[R, N]`` (``[S, N]`` without ``index``), index / scale ``[S]`` or None, out ``[E, N]``
    written (zeros for an empty group). Deterministic: each program sums its group in slot
    order. The tiles: the config's rows and columns, if given."""
    E, N = out.shape
    if out.numel() == 0:
        return
    num_slots = index.size(0) if index is not None else src.size(0)
    block_m = config.block_m if config is not None else 32
    block_n = config.block_n if config is not None else _block(N, 16, 128)
    wrap_triton(_group_sum_kernel)[(E * triton.cdiv(N, block_n),)](
        src, index, scale, offs, out,
        num_slots, src.size(0), N, E,
        src.stride(0), src.stride(1),
        out.stride(0), out.stride(1),
        HAS_INDEX=index is not None,
        HAS_SCALE=scale is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=4,
    )


def _slot_bias_dot(grad: Tensor, b2: Tensor, offs: Tensor, token: Tensor,
                   acc_dtype: torch.dtype) -> Tensor:
    """``<grad[token(i)], b2[e]>`` per slot ``i`` of expert ``e`` (0 for padding and the slots
    past ``offs[-1]``), with ATen ops: the term the dA kernel adds when there are columns of F."""
    S = token.size(0)
    if grad.size(0) == 0 or offs.size(0) == 0:
        # no token or no expert: every slot is padding
        return torch.zeros(S, dtype=acc_dtype, device=grad.device)
    slots = torch.arange(S, dtype=offs.dtype, device=offs.device)
    # the group of slot i: the number of group ends at or before it
    expert = torch.searchsorted(offs, slots, right=True)
    ok = (token >= 0) & (expert < offs.size(0))
    rows = grad.index_select(0, token.clamp(min=0)).to(acc_dtype)
    bias = b2.index_select(0, expert.clamp(max=offs.size(0) - 1)).to(acc_dtype)
    return torch.where(ok, (rows * bias).sum(1), 0.0)


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------


@triton_op("torch_moe::_triton_grouped_ffn", mutates_args=())
def _triton_grouped_ffn(
    x: Tensor,
    sorted_ids: Tensor,
    offs: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Optional[Tensor] = None,
    activation: str = "swiglu",
    alpha: float = 1.702,
    limit: float = 7.0,
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    # Also the fake kernel (triton_op traces the body), so it must not read tensor values.
    return grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit,
                       b1, b2, b3)


@triton_op("torch_moe::_triton_grouped_ffn_backward", mutates_args=())
def _triton_grouped_ffn_backward(
    grad: Tensor,
    x: Tensor,
    sorted_ids: Tensor,
    offs: Tensor,
    topk_weights: Tensor,
    w1: Tensor,
    w2: Tensor,
    w3: Optional[Tensor],
    hidden: Tensor,
    activation: str,
    alpha: float,
    limit: float,
    output_mask: list[bool],
    b1: Optional[Tensor] = None,
    b2: Optional[Tensor] = None,
    b3: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return grouped_ffn_backward(
        grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, activation, alpha, limit,
        output_mask, b1, b2, b3,
    )


# ---------------------------------------------------------------------------------------------
# The CUDA kernels of the public ops (see torch_moe._triton)
# ---------------------------------------------------------------------------------------------

KERNELS = {
    "grouped_ffn": torch.ops.torch_moe._triton_grouped_ffn.default,
    "grouped_ffn_backward": torch.ops.torch_moe._triton_grouped_ffn_backward.default,
}
