"""Triton kernels of ``torch_moe::grouped_mm``, ``torch_moe::indexed_grouped_mm`` and
``torch_moe::indexed_grouped_mm_backward``.

Two kernels cover every layout, both with fp32 accumulation (fp64 for fp64 operands), one
rounding to the output dtype, and no host synchronisation (``offs`` is read on the device only):

* ``_grouped_mm_rows_kernel``: rows split by ``offs``, ``out[rows_g] = x[rows_g] @ w[g]``, with an
  optional gather of input rows, scatter of output rows and per-row scale. It is the forward of
  ``indexed_grouped_mm``, ``grouped_mm`` 2D x 3D (no indices), and ``grouped_mm`` 3D x 2D through
  the transposed problem ``out.T[cols_g] = b.T[cols_g] @ a[g].T``; on the transposed weights, the
  input gradient of ``indexed_grouped_mm``, with the routing weights' gradient (a row-wise dot
  product with the input rows) in its epilogue.
* ``_grouped_mm_k_kernel``: the contraction split by ``offs``, over rows that may be gathered,
  ``out[g] = sum_{i in group g} a_rows[a_index[i]]^T (outer) b_rows[b_index[i]] * b_scale[i]``:
  the weight gradients (of ``indexed_grouped_mm`` and the fused FFN, with gathers and routing
  weights), and ``grouped_mm`` 2D x 2D, ``out[g] = a[:, ks_g] @ b[ks_g, :]`` (``a_rows = a.T``).

Tiling of the rows kernel. The rows ``[0, S)`` are cut into segments: group ``g`` is
``[offs[g-1], offs[g])`` and, when the output is not scattered, segment ``E`` is the tail
``[offs[-1], S)``, whose rows are written as zeros. Each segment is cut into tiles of ``BLOCK_M``
rows, so a tile never straddles two groups and multiplies by one weight matrix. The number of
tiles depends on ``offs``, so the grid is launched for a bound that depends on sizes only,
``cdiv(S, BLOCK_M) + E`` row tiles (the ``E + 1`` segments hold at most one partial tile each, and
their partial tiles together at most ``E`` more than ``S`` rows need), times the column tiles.
Each program finds its segment with a prefix sum of the per-segment tile counts (``E + 1``
integers, negligible next to the tile's GEMM); programs past the last tile write nothing.

Scatter. ``out[scatter_index[i]] += v_i`` may hit one output row from several slots (the combine of
an MoE layer, top-k > 1), so rows are accumulated with atomic adds into an fp32 (fp64) buffer,
zero-initialised, and rounded once at the end: the result is that of the CPU kernel up to the order
of the additions, which varies from run to run. Under ``torch.use_deterministic_algorithms(True)``
the rows are written unscattered and summed with ``index_add_``, which is deterministic on CUDA
in that mode, at the cost of an ``[S, N]`` fp32 intermediate.

Tiles. Without an explicit ``config``, a launch takes its tiles from the shape-keyed table of
:mod:`torch_moe._triton._configs` and ``triton.autotune`` measures a few candidates around that
pick on the GPU (only the pick runs without one, as under ``TRITON_INTERPRET=1``, and during CUDA
graph capture, where measuring would synchronise inside the capture). The scattered
launch, which accumulates, is reset to zero before each measured run (``reset_to_zero``, which
torch.compile supports for user-defined kernels); the launch with the row-dot epilogue keeps the
table's pick, since its partial sums have one row per column tile.

Value checks, those of the CPU kernel (``offs`` non-negative and non-decreasing with
``offs[-1]`` at most the split dimension, indices in ``[-1, bound)``): a few reductions of
``offs`` and the indices checked with :func:`torch_moe._compat.assert_async`, a device-side
assertion that does not synchronise the host (on CPU tensors, under ``TRITON_INTERPRET=1``, it
raises at once as the CPU op does). With ``TRITON_DEBUG=1`` the kernels also assert where the bad
value is met. Invalid values never address memory: out-of-range indices are treated as padding and
offsets are clamped to ``[0, S]``. A padded slot (-1) reads no input row and writes no output row:
a gathered one gives an exact zero row, a scattered one adds nothing.

The 1-D operands (``offs``, the indices, the per-slot scales) are made contiguous on the host
(free when they already are): the kernels read them with unit stride.

Every launch goes through :func:`torch.library.wrap_triton` inside a
:func:`torch.library.triton_op` (``torch_moe::_triton_grouped_mm``,
``torch_moe::_triton_indexed_grouped_mm``, ``torch_moe::_triton_indexed_grouped_mm_backward``):
under ``torch.compile`` the AOT graph holds
``triton_kernel_wrapper_functional`` nodes, which Inductor compiles as user-defined Triton kernels
in its generated code instead of calling back into Python. :data:`KERNELS` makes these ops the
CUDA kernels of the public ops (see :mod:`torch_moe._triton`).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from torch_moe import _checks
from torch_moe._compat import assert_async
from torch_moe._native._layouts import empty_weight_grad
from torch_moe._triton._configs import (
    _block,
    autotune_candidates,
    device_arch,
    GemmConfig,
    pick_config,
)

__all__ = [
    "GemmConfig",
    "KERNELS",
    "grouped_mm",
    "indexed_grouped_mm",
    "indexed_grouped_mm_backward",
]


# ---------------------------------------------------------------------------------------------
# Device code
# ---------------------------------------------------------------------------------------------


@triton.jit
def _acc_zeros(x_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The accumulator tile: fp64 for fp64 operands, fp32 otherwise."""
    if x_ptr.dtype.element_ty == tl.float64:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _row_tile(starts, ends, tile, num_rows, num_groups, HAS_TAIL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The rows of row tile ``tile`` of a launch over ``num_rows`` slots split by offs.

    ``starts`` / ``ends`` ``[BLOCK_E]``: ``offs[g - 1]`` / ``offs[g]`` for the groups
    ``g < num_groups`` (anything past them). Segments ``0 .. num_groups - 1`` are the groups and,
    with ``HAS_TAIL``, segment ``num_groups`` is the tail ``[offs[-1], num_rows)``; each is cut into
    tiles of ``BLOCK_M`` rows, so a tile never straddles two segments. Offsets are clamped to
    ``[0, num_rows]``, so invalid ones cannot address rows out of bounds.

    Returns ``(seg, first_row, end_row, rows [BLOCK_M] int64, row_ok [BLOCK_M])``: the tile's
    segment (``num_groups`` for the tail, ``BLOCK_E`` past the last tile, whose rows are empty),
    its segment's bounds, and the tile's rows with the mask of those inside the segment.
    """
    segs = tl.arange(0, BLOCK_E)
    in_groups = segs < num_groups
    tl.device_assert((starts <= ends) | (segs >= num_groups), "offs must be non-decreasing")
    tl.device_assert((ends <= num_rows) | (segs >= num_groups),
                     "offs[-1] must not exceed the number of rows")
    if HAS_TAIL:
        ends = tl.where(in_groups, ends, num_rows)
    else:
        ends = tl.where(in_groups, ends, 0)
    starts = tl.minimum(tl.maximum(starts, 0), num_rows)
    ends = tl.minimum(tl.maximum(ends, 0), num_rows)
    sizes = tl.where(segs <= num_groups, tl.maximum(ends - starts, 0), 0)
    seg_tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(seg_tiles, 0)
    # Empty segments end where their predecessor does, so they are counted and skipped here; past
    # the last tile, seg is BLOCK_E and the rows are empty.
    seg = tl.sum((tiles_end <= tile).to(tl.int32), 0)
    pick = segs == seg
    first_row = tl.sum(tl.where(pick, starts, 0), 0)
    end_row = tl.sum(tl.where(pick, ends, 0), 0)
    first_tile = tl.sum(tl.where(pick, tiles_end - seg_tiles, 0), 0)
    rows = first_row + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < end_row
    return seg, first_row, end_row, rows.to(tl.int64), row_ok


@triton.jit
def _grouped_mm_rows_kernel(
    x_ptr,
    w_ptr,
    offs_ptr,
    gather_ptr,
    scatter_ptr,
    scale_ptr,
    out_ptr,
    dot_x_ptr,
    dot_index_ptr,
    dot_ptr,
    bias_ptr,
    num_rows,
    num_in_rows,
    num_out_rows,
    num_dot_rows,
    N,
    K,
    num_groups,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_om,
    stride_on,
    stride_dm,
    stride_dn,
    stride_be,
    stride_bn,
    HAS_GATHER: tl.constexpr,
    HAS_SCATTER: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_ROW_DOT: tl.constexpr,
    HAS_DOT_INDEX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program: a ``[BLOCK_M, BLOCK_N]`` tile of one segment (see the module docstring).

    Shapes: x ``[num_in_rows, K]``, w ``[num_groups, K, N]``, offs ``[num_groups]`` int32;
    gather / scatter / scale ``[num_rows]`` (int64, int64, float); out ``[num_rows, N]``, or
    ``[num_out_rows, N]`` accumulated in fp32 / fp64 with ``HAS_SCATTER``, or nothing without
    ``HAS_OUT``.

    ``HAS_ROW_DOT`` (the gradient of the scale): before scaling, the row-wise dot products of the
    tile with ``dot_x[dot_index[i]]`` (``[num_dot_rows, N]``; identity without ``HAS_DOT_INDEX``)
    are stored to ``dot[col_tile, i]`` (``[cdiv(N, BLOCK_N), num_rows]``, zero-initialised, in
    the accumulation dtype), one partial sum per column tile for a fixed-order sum by the
    caller: no atomics. A slot padded on any side (gather, scatter or dot index) gives 0.

    ``HAS_BIAS``: ``bias[g]`` (``[num_groups, N]``, any float dtype) is added to the rows of group
    ``g`` in the accumulation dtype, after the row-dot products and before the scale: the
    down projection of an FFN with a bias, ``scale_i * (x_i @ w[g] + bias[g])``. Padded slots and
    the tail get no bias.
    grid = ``((cdiv(num_rows, BLOCK_M) + num_groups) * cdiv(N, BLOCK_N),)``.
    """
    pid = tl.program_id(0)
    col_tiles = tl.cdiv(N, BLOCK_N)
    tile = pid // col_tiles
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    # 64-bit offsets: a row or column index times a stride can pass 2**31 elements
    cols = cols.to(tl.int64)

    # The segment of this row tile: segments 0 .. num_groups - 1 are the groups, segment
    # num_groups the tail past offs[-1], empty when the output is scattered (nothing to zero).
    # (The bounds are loaded here and the helper takes their values: torch.compile's mutation
    # analysis takes every pointer argument of a called helper as a possible store target.)
    segs = tl.arange(0, BLOCK_E)
    ends = tl.load(offs_ptr + segs, mask=segs < num_groups, other=0)
    starts = tl.load(offs_ptr + segs - 1, mask=(segs > 0) & (segs <= num_groups), other=0)
    seg, first_row, end_row, rows, row_ok = _row_tile(
        starts, ends, tile, num_rows, num_groups, not HAS_SCATTER, BLOCK_M, BLOCK_E
    )

    if HAS_GATHER:
        src = tl.load(gather_ptr + rows, mask=row_ok, other=-1)
        tl.device_assert((src >= -1) & (src < num_in_rows), "gather_index out of range")
        src_ok = row_ok & (src >= 0) & (src < num_in_rows)
    else:
        src = rows
        src_ok = row_ok
    if HAS_SCATTER:
        dst = tl.load(scatter_ptr + rows, mask=row_ok, other=-1)
        tl.device_assert((dst >= -1) & (dst < num_out_rows), "scatter_index out of range")
        dst_ok = row_ok & (dst >= 0) & (dst < num_out_rows)
        # a dropped slot reads no input row either
        src_ok = src_ok & dst_ok

    # The tail segment and programs past the last tile skip the main loop: zero tile.
    is_group = seg < num_groups
    k_end = tl.where(is_group, K, 0)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src[:, None] * stride_xm + ks[None, :] * stride_xk
    w_ptrs = (
        w_ptr + seg.to(tl.int64) * stride_we + ks[:, None] * stride_wk + cols[None, :] * stride_wn
    )
    acc = _acc_zeros(x_ptr, BLOCK_M, BLOCK_N)
    for k in range(0, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=src_ok[:, None], other=0.0)
            b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < K - k
            a = tl.load(x_ptrs, mask=src_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # the rows of a group (the tail's rows read nothing: no weight)
    in_group = rows < tl.where(is_group, end_row, first_row)
    if HAS_ROW_DOT:
        if HAS_DOT_INDEX:
            dot_src = tl.load(dot_index_ptr + rows, mask=row_ok, other=-1)
            tl.device_assert((dot_src >= -1) & (dot_src < num_dot_rows), "index out of range")
            dot_ok = src_ok & in_group & (dot_src >= 0) & (dot_src < num_dot_rows)
        else:
            dot_src = rows
            dot_ok = src_ok & in_group
        dot_x = tl.load(
            dot_x_ptr + dot_src[:, None] * stride_dm + cols[None, :] * stride_dn,
            mask=dot_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        # where, not a product with a zero row: the tile's rows of padded slots may be NaN
        dots = tl.where(dot_ok, tl.sum(acc * dot_x.to(acc.dtype), 1), 0.0)
        # 64-bit: the column tile times the number of rows can pass 2**31
        col_tile = (pid % col_tiles).to(tl.int64)
        tl.store(dot_ptr + col_tile * num_rows + rows, dots, mask=row_ok)
    if HAS_BIAS:
        # the rows of the group that read a row (a padded slot stays an exact zero row, even
        # against an Inf bias); the tail and programs past the last tile load nothing
        # (a comparison, not col_ok & is_group, which the interpreter cannot use as a mask)
        bias = tl.load(bias_ptr + seg.to(tl.int64) * stride_be + cols * stride_bn,
                       mask=cols < tl.where(is_group, N, 0), other=0.0)
        acc = acc + tl.where((src_ok & in_group)[:, None], bias.to(acc.dtype)[None, :], 0.0)
    if HAS_SCALE:
        # not loaded on the tail, which stays exactly zero whatever the scale holds there
        scale = tl.load(scale_ptr + rows, mask=in_group, other=0.0)
        acc = acc * scale.to(acc.dtype)[:, None]
    if HAS_GATHER:
        # A padded slot's row is zero, not the product of a zero row: that product is NaN when
        # the group's weights hold an Inf, and so is its scale times zero when the scale is NaN.
        acc = tl.where(src_ok[:, None], acc, 0.0)
    if HAS_OUT:
        if HAS_SCATTER:
            out_ptrs = out_ptr + dst[:, None] * stride_om + cols[None, :] * stride_on
            # relaxed: the adds only need to be atomic, not ordered with other memory operations
            tl.atomic_add(out_ptrs, acc, mask=dst_ok[:, None] & col_ok[None, :], sem="relaxed")
        else:
            out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
            out_mask = row_ok[:, None] & col_ok[None, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _grouped_mm_k_kernel(
    a_ptr,
    b_ptr,
    offs_ptr,
    a_index_ptr,
    b_index_ptr,
    b_scale_ptr,
    out_ptr,
    M,
    N,
    num_slots,
    num_a_rows,
    num_b_rows,
    stride_ar,
    stride_am,
    stride_br,
    stride_bn,
    stride_og,
    stride_om,
    stride_on,
    HAS_A_INDEX: tl.constexpr,
    HAS_B_INDEX: tl.constexpr,
    HAS_B_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program: a ``[BLOCK_M, BLOCK_N]`` tile of ``out[g] = sum_i outer(a_rows[a_index[i]],
    b_rows[b_index[i]] * b_scale[i])`` over the slots ``offs[g-1] <= i < offs[g]``.

    Shapes: a_rows ``[num_a_rows, M]``, b_rows ``[num_b_rows, N]``, offs ``[G]`` int32 splitting
    the ``num_slots`` slots, a_index / b_index ``[num_slots]`` int64 (identity without them),
    b_scale ``[num_slots]`` float, out ``[G, M, N]``. A slot whose index is -1 on either side
    reads no row of either operand; an empty group gives a zero matrix.
    grid = ``(G * cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)``, the tiles of one group consecutive.
    """
    pid = tl.program_id(0)
    row_tiles = tl.cdiv(M, BLOCK_M)
    col_tiles = tl.cdiv(N, BLOCK_N)
    g = pid // (row_tiles * col_tiles)
    tile = pid % (row_tiles * col_tiles)
    rows = (tile // col_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)

    k_start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    k_end = tl.load(offs_ptr + g)
    tl.device_assert(
        (k_start <= k_end) & (k_end <= num_slots), "offs must be non-decreasing and <= the slots"
    )
    k_start = tl.minimum(tl.maximum(k_start, 0), num_slots)
    k_end = tl.minimum(tl.maximum(k_end, k_start), num_slots)

    ks = tl.arange(0, BLOCK_K)
    acc = _acc_zeros(a_ptr, BLOCK_M, BLOCK_N)
    for k in range(k_start, k_end, BLOCK_K):
        slots = (k + ks).to(tl.int64)
        ok = slots < k_end
        if HAS_A_INDEX:
            ra = tl.load(a_index_ptr + slots, mask=ok, other=-1)
            tl.device_assert((ra >= -1) & (ra < num_a_rows), "a_index out of range")
            ok = ok & (ra >= 0) & (ra < num_a_rows)
        else:
            ra = slots
        if HAS_B_INDEX:
            rb = tl.load(b_index_ptr + slots, mask=ok, other=-1)
            tl.device_assert((rb >= -1) & (rb < num_b_rows), "b_index out of range")
            ok = ok & (rb >= 0) & (rb < num_b_rows)
        else:
            rb = slots
        # a slot padded on either side loads zeros on both: no 0 * Inf from the other operand
        a = tl.load(
            a_ptr + ra[None, :] * stride_ar + rows[:, None] * stride_am,
            mask=row_ok[:, None] & ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rb[:, None] * stride_br + cols[None, :] * stride_bn,
            mask=ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if HAS_B_SCALE:
            # scaled in the accumulation dtype, then rounded to the operand dtype for the MMA
            scale = tl.load(b_scale_ptr + slots, mask=ok, other=0.0).to(acc.dtype)
            b = (b.to(acc.dtype) * scale[:, None]).to(b_ptr.dtype.element_ty)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    out_ptrs = (
        out_ptr + g.to(tl.int64) * stride_og + rows[:, None] * stride_om + cols[None, :] * stride_on
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 GEMMs follow torch's TF32 setting as cuBLAS and Inductor's templates do (off by
    # default); it is read at launch, or at trace time under torch.compile. Other dtypes ignore it.
    if dtype == torch.float32 and torch.backends.cuda.matmul.fp32_precision == "tf32":
        return "tf32"
    return "ieee"


@functools.cache
def _autotuned(kernel, candidates: tuple, key: tuple, reset_to_zero: tuple):
    """``kernel`` under ``triton.autotune`` over ``candidates`` (GemmConfigs), one autotuner per
    candidate set: the set depends on the shape bucket, the measurement on ``key``."""
    configs = [
        triton.Config(
            {"BLOCK_M": c.block_m, "BLOCK_N": c.block_n, "BLOCK_K": c.block_k},
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
        for c in candidates
    ]
    return triton.autotune(configs=configs, key=list(key), reset_to_zero=list(reset_to_zero))(
        kernel
    )


def _contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None else None


def check_offs(op: str, offs: Tensor, limit, what: str) -> None:
    """The checks of the CPU kernel's ``_group_bounds``, on the device: ``offs`` non-negative
    and non-decreasing, ``offs[-1] <= limit`` (``what`` names the split dimension). Any number of
    groups, zero included."""
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    assert_async(
        (sizes >= 0).all(), f"{op}: expected offs to be non-decreasing and non-negative"
    )
    # for non-decreasing offs, the last one
    assert_async((offs <= limit).all(), f"{op}: expected offs[-1] <= {what}")


def check_index(op: str, name: str, index: Optional[Tensor], high) -> None:
    """The CPU kernel's ``_check_index_range`` with padding, on the device: values of
    ``index`` in ``[-1, high)``."""
    if index is not None:
        assert_async(
            ((index >= -1) & (index < high)).all(),
            f"{op}: expected {name} values in [-1, {high}) (-1 marks padding)",
        )


def _capturing() -> bool:
    # without an initialised CUDA context nothing is captured (and the query itself fails on a
    # build without CUDA)
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _launch(kernel, grid, args, flags, config, candidates, key, reset_to_zero=()):
    """Launches ``kernel`` with the explicit ``config``, or autotuned over ``candidates``.

    ``grid(block_m, block_n)`` gives the launch grid of a config. The explicit config is passed
    as the kernel's block sizes and launch parameters; an autotuned launch takes them from the
    autotuner (torch.compile's wrapper would otherwise apply num_warps / num_stages to every
    candidate). During CUDA graph capture the table's pick (``candidates[0]``) is launched
    instead: the autotuner would benchmark, and synchronise, inside the capture for a shape it
    has not seen.
    """
    if config is None and _capturing():
        config = candidates[0]
    if config is not None:
        wrap_triton(kernel)[(grid(config.block_m, config.block_n),)](
            *args,
            **flags,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    else:
        tuned = _autotuned(kernel, tuple(candidates), key, reset_to_zero)
        wrap_triton(tuned)[lambda meta: (grid(meta["BLOCK_M"], meta["BLOCK_N"]),)](*args, **flags)


def _launch_rows(
    x: Tensor,
    w: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor],
    scatter_index: Optional[Tensor],
    scale: Optional[Tensor],
    out: Optional[Tensor],
    num_rows,
    config: Optional[GemmConfig],
    *,
    dot_x: Optional[Tensor] = None,
    dot_index: Optional[Tensor] = None,
    dot_out: Optional[Tensor] = None,
    bias: Optional[Tensor] = None,
) -> None:
    """Launches the rows kernel: x ``[R, K]``, w ``[E, K, N]`` (any strides), ``num_rows`` = S
    slots; writes ``out`` (``[S, N]``) or, with ``scatter_index``, adds into it (None: nothing).
    ``bias`` ``[E, N]`` (any strides): added to each group's rows before ``scale``.
    Autotuned (``config=None``), a scattered launch zeroes ``out`` between its measured runs:
    ``out`` must then hold zeros on entry; accumulating onto other values needs a ``config``.

    With ``dot_out`` (``[cdiv(N, config.block_n), S]`` zeros in the accumulation dtype, so
    ``config`` must be given), also stores the partial row-wise dot products of the unscaled rows
    with ``dot_x[dot_index[i]]`` (``dot_x`` ``[Rd, N]``; ``dot_index`` ``[S]`` or None for the
    identity): ``dot_out.sum(0)[i] = <x[gather[i]] @ w[g], dot_x[dot_index[i]]>``, 0 for padding.
    """
    E, K, N = w.shape
    # the kernel reads the 1-D operands with unit stride
    offs, gather_index, scatter_index, scale, dot_index = (
        _contiguous(t) for t in (offs, gather_index, scatter_index, scale, dot_index)
    )
    torch._check(
        dot_out is None or config is not None,
        lambda: "_launch_rows: the row-wise dot products need an explicit config",
    )
    table = config if config is not None else _rows_table_config(x, num_rows, N, K, E)
    args = (
        x,
        w,
        offs,
        gather_index,
        scatter_index,
        scale,
        out,
        dot_x,
        dot_index,
        dot_out,
        bias,
        num_rows,
        x.size(0),
        out.size(0) if out is not None else 0,
        dot_x.size(0) if dot_x is not None else 0,
        N,
        K,
        E,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0) if out is not None else 0,
        out.stride(1) if out is not None else 0,
        dot_x.stride(0) if dot_x is not None else 0,
        dot_x.stride(1) if dot_x is not None else 0,
        bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0,
    )
    flags = dict(
        HAS_GATHER=gather_index is not None,
        HAS_SCATTER=scatter_index is not None,
        HAS_SCALE=scale is not None,
        HAS_OUT=out is not None,
        HAS_ROW_DOT=dot_out is not None,
        HAS_DOT_INDEX=dot_index is not None,
        HAS_BIAS=bias is not None,
        INPUT_PRECISION=_input_precision(x.dtype),
        # the candidates share the table's BLOCK_K; a guard, not a symbol, under dynamic shapes
        EVEN_K=bool(K % table.block_k == 0),
        BLOCK_E=_block(E + 1, 2, 2 ** 30),
    )

    def grid(block_m, block_n):
        return (triton.cdiv(num_rows, block_m) + E) * triton.cdiv(N, block_n)

    candidates = (
        None if config is not None
        else autotune_candidates(table, x.dtype, device_arch(x.device), None, N)
    )
    # the scattered launch accumulates into out: zeroed before each measured run
    reset = ("out_ptr",) if scatter_index is not None and out is not None else ()
    _launch(_grouped_mm_rows_kernel, grid, args, flags, config, candidates,
            ("N", "K", "num_groups"), reset)


def _rows_table_config(x: Tensor, num_rows, N, K, E) -> GemmConfig:
    """The table's config of a rows launch (x: its input rows; N output columns, K contraction,
    E groups over num_rows slots)."""
    return pick_config("rows", x.dtype, device_arch(x.device), num_rows, N, K, E)


def _launch_k(
    a: Tensor, b: Tensor, offs: Tensor, out: Tensor, config: Optional[GemmConfig]
) -> None:
    """Launches the contraction-split kernel: a ``[M, K]``, b ``[K, N]``, out ``[G, M, N]``,
    ``out[g] = a[:, ks_g] @ b[ks_g, :]`` with K split by offs."""
    _launch_k_rows(a.t(), b, offs, out, config)


def _launch_k_rows(
    a_rows: Tensor,
    b_rows: Tensor,
    offs: Tensor,
    out: Tensor,
    config: Optional[GemmConfig] = None,
    *,
    a_index: Optional[Tensor] = None,
    b_index: Optional[Tensor] = None,
    b_scale: Optional[Tensor] = None,
) -> None:
    """Launches the contraction-split kernel over gathered rows (a weight gradient)::

        out[g] = sum_{offs[g-1] <= i < offs[g]} outer(a_rows[a_index[i]],
                                                     b_rows[b_index[i]] * b_scale[i])

    a_rows ``[Ra, M]``, b_rows ``[Rb, N]`` (any strides, same dtype), offs int32 ``[G]`` group
    ends over the S slots, out ``[G, M, N]`` (written, not accumulated: empty groups give zeros).
    a_index / b_index: int64 ``[S]`` rows of a_rows / b_rows, or None for the identity (then that
    operand has exactly S rows); -1 (or any index out of range) skips the slot, which reads no row
    of either operand. b_scale: ``[S]`` float, multiplied in the accumulation dtype and rounded to
    the operand dtype before the MMA (exact for fp32 and fp64 operands).
    """
    G, M, N = out.shape
    # the kernel reads the 1-D operands with unit stride
    offs, a_index, b_index, b_scale = (
        _contiguous(t) for t in (offs, a_index, b_index, b_scale)
    )
    num_slots = a_index.size(0) if a_index is not None else a_rows.size(0)
    b_slots = b_index.size(0) if b_index is not None else b_rows.size(0)
    torch._check(
        b_slots == num_slots and (b_scale is None or b_scale.size(0) == num_slots),
        lambda: f"_launch_k_rows: expected a, b and b_scale to cover {num_slots} slots",
    )
    torch._check(
        a_rows.size(1) == M and b_rows.size(1) == N and offs.size(0) == G,
        lambda: "_launch_k_rows: expected out of shape [offs.size(0), a_rows.size(1), "
        f"b_rows.size(1)], but got {list(out.shape)}",
    )
    args = (
        a_rows,
        b_rows,
        offs,
        a_index,
        b_index,
        b_scale,
        out,
        M,
        N,
        num_slots,
        a_rows.size(0),
        b_rows.size(0),
        a_rows.stride(0),
        a_rows.stride(1),
        b_rows.stride(0),
        b_rows.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    flags = dict(
        HAS_A_INDEX=a_index is not None,
        HAS_B_INDEX=b_index is not None,
        HAS_B_SCALE=b_scale is not None,
        INPUT_PRECISION=_input_precision(a_rows.dtype),
    )

    def grid(block_m, block_n):
        return G * triton.cdiv(M, block_m) * triton.cdiv(N, block_n)

    candidates = None
    if config is None:
        arch = device_arch(a_rows.device)
        table = pick_config("k", a_rows.dtype, arch, M, N, num_slots, G)
        candidates = autotune_candidates(table, a_rows.dtype, arch, M, N)
    # every program writes its tile (nothing accumulates): measured runs need no reset
    _launch(_grouped_mm_k_kernel, grid, args, flags, config, candidates, ("M", "N"))


def grouped_mm(
    a: Tensor, b: Tensor, offs: Tensor, *, config: Optional[GemmConfig] = None
) -> Tensor:
    """``torch_moe::grouped_mm`` with the Triton kernels, for tensors on any device Triton runs on
    (CPU tensors under ``TRITON_INTERPRET=1``). The current device must be that of the tensors.

    Args:
        a, b: the operands in one of the layouts (offs: int32 ``[G]``, cumulative group ends)

            - 2D x 3D: a ``[M, K]``, b ``[G, K, N]`` -> ``[M, N]``, rows of a split by offs,
              rows past ``offs[-1]`` zero;
            - 3D x 2D: a ``[G, M, K]``, b ``[K, N]`` -> ``[M, N]``, columns of b split by offs,
              columns past ``offs[-1]`` zero;
            - 2D x 2D: a ``[M, K]``, b ``[K, N]`` -> ``[G, M, N]``, K split by offs, zero
              matrices for empty groups.

            Any strides; bf16, fp16, fp32 or fp64.
        config: tile sizes; by default chosen from the dtype and the sizes of b.

    Returns:
        A contiguous tensor in the dtype of ``a``.
    """
    _checks.check_grouped_mm(a, b, offs)
    op = "torch_moe.grouped_mm"
    if a.dim() == 2 and b.dim() == 3:
        check_offs(op, offs, a.size(0), "self.size(0)")
    elif a.dim() == 3 and b.dim() == 2:
        check_offs(op, offs, b.size(1), "mat2.size(1)")
    else:
        check_offs(op, offs, a.size(1), "self.size(1)")
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_empty((a.size(0), b.size(2)))
        if out.numel():
            _launch_rows(a, b, offs, None, None, None, out, a.size(0), config)
    elif a.dim() == 3 and b.dim() == 2:
        # out[:, cols_g] = a[g] @ b[:, cols_g] is, transposed, the 2D x 3D problem
        # out.T[cols_g] = b.T[cols_g] @ a[g].T; the kernel takes strides, so nothing is copied.
        out = a.new_empty((a.size(1), b.size(1)))
        if out.numel():
            _launch_rows(
                b.t(), a.transpose(1, 2), offs, None, None, None, out.t(), b.size(1), config
            )
    else:
        out = a.new_empty((offs.size(0), a.size(0), b.size(1)))
        if out.numel():
            _launch_k(a, b, offs, out, config)
    return out


def indexed_grouped_mm(
    input: Tensor,
    weight: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor] = None,
    scatter_index: Optional[Tensor] = None,
    scatter_weight: Optional[Tensor] = None,
    num_out_rows: int = -1,
    *,
    config: Optional[GemmConfig] = None,
) -> Tensor:
    """``torch_moe::indexed_grouped_mm`` with the Triton kernel, for tensors on any device Triton
    runs on (CPU tensors under ``TRITON_INTERPRET=1``). The current device must be that of the
    tensors.

    For sorted slot ``i`` of group ``g`` (``offs[g-1] <= i < offs[g]``)::

        v_i = input[gather_index[i] if gather_index is given else i] @ weight[g]
        v_i = v_i * scatter_weight[i]                      (if scatter_weight is given)
        out[scatter_index[i]] += v_i   (out: [num_out_rows, N], zero-initialised), or
        out[i] = v_i                   (out: [S, N], rows past offs[-1] zero)

    Args:
        input: ``[R, K]``; weight: ``[E, K, N]``, same dtype (bf16, fp16, fp32 or fp64), any
            strides; offs: int32 ``[E]``, cumulative group ends.
        gather_index: int64 ``[S]`` rows of ``input`` (-1: zero row); without it S = R.
        scatter_index: int64 ``[S]`` rows of the output (-1: dropped); duplicates accumulate.
        scatter_weight: ``[S]``, any floating dtype, applied in the accumulation dtype.
        num_out_rows: rows of the output with ``scatter_index``, else -1.
        config: tile sizes; by default chosen from the dtype and the sizes of ``weight``.

    Returns:
        A contiguous tensor in the dtype of ``input``: ``[S, N]``, or ``[num_out_rows, N]`` with
        ``scatter_index``.
    """
    S = _checks.check_indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows
    )
    op = "torch_moe.indexed_grouped_mm"
    check_offs(op, offs, S, "the number of sorted slots")
    check_index(op, "gather_index", gather_index, input.size(0))
    check_index(op, "scatter_index", scatter_index, num_out_rows)
    N = weight.size(2)
    acc_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    if scatter_index is None:
        out = input.new_empty((S, N))
        if out.numel():
            _launch_rows(input, weight, offs, gather_index, None, scatter_weight, out, S, config)
        return out
    if torch.are_deterministic_algorithms_enabled():
        # Rows in slot order, then a sum in a fixed order: index_add_ is deterministic on CUDA
        # in this mode, atomics are not.
        rows = input.new_empty((S, N), dtype=acc_dtype)
        if rows.numel():
            _launch_rows(input, weight, offs, gather_index, None, scatter_weight, rows, S, config)
        rows.masked_fill_((scatter_index < 0).unsqueeze(1), 0)
        acc = torch.zeros((num_out_rows, N), dtype=acc_dtype, device=input.device)
        if acc.size(0):
            # with no output rows every slot is dropped (-1): there is no row 0 to clamp to
            acc.index_add_(0, scatter_index.clamp(min=0), rows)
    else:
        acc = torch.zeros((num_out_rows, N), dtype=acc_dtype, device=input.device)
        if S > 0 and acc.numel():
            _launch_rows(
                input, weight, offs, gather_index, scatter_index, scatter_weight, acc, S, config
            )
    return acc if acc.dtype == input.dtype else acc.to(input.dtype)


def indexed_grouped_mm_backward(
    grad: Tensor,
    input: Tensor,
    weight: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor],
    scatter_index: Optional[Tensor],
    scatter_weight: Optional[Tensor],
    output_mask: list[bool],
    *,
    config: Optional[GemmConfig] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch_moe::indexed_grouped_mm_backward`` with the Triton kernels (see
    :func:`indexed_grouped_mm` for the forward, whose notation this follows)::

        u_i = grad[scatter_index[i] or i] @ weight[g]^T                       [S, K]
        grad_input[gather_index[i] or i] += u_i * scatter_weight[i]
        grad_weight[g] = sum_{i in g} outer(input[gather_index[i] or i],
                                            grad[scatter_index[i] or i] * scatter_weight[i])
        grad_scatter_weight[i] = <u_i, input[gather_index[i] or i]>

    A slot padded on either side (-1) takes no part: it reads no row and contributes zero, and
    its ``grad_scatter_weight`` is 0. Outputs that ``output_mask`` does not request are empty
    ``[0]`` tensors.

    Kernels: ``u`` is the rows kernel on the transposed weights, scattered into ``grad_input``
    through ``gather_index`` (atomic adds into fp32, or in deterministic mode rows in slot order
    then ``index_add_``), with ``grad_scatter_weight`` as its row-dot epilogue (partial sums per
    column tile, summed in a fixed order); ``grad_weight`` is the gathered contraction-split kernel,
    one program per output tile summing its group's slots in order, deterministic.
    """
    S = _checks.check_indexed_grouped_mm_backward(
        grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
    )
    op = "torch_moe.indexed_grouped_mm_backward"
    check_offs(op, offs, S, "the number of sorted slots")
    check_index(op, "gather_index", gather_index, input.size(0))
    check_index(op, "scatter_index", scatter_index, grad.size(0))
    want_input, want_weight, want_sw = output_mask
    want_sw = want_sw and scatter_weight is not None
    E, K, N = weight.shape
    acc_dtype = torch.float64 if input.dtype == torch.float64 else torch.float32
    # u = grad @ weight^T is the rows kernel of the transposed problem: its rows are read from
    # grad through scatter_index and written to grad_input through gather_index.
    weight_t = weight.transpose(1, 2)
    # the row-dot partial sums have one row per column tile: a fixed config, not autotuned
    cfg = config if config is not None else _rows_table_config(grad, S, K, N, E)
    grad_input = grad_sw = grad_input_acc = None
    rows_out = None
    if want_input and gather_index is None:
        # slot order: written in the input dtype, rows past offs[-1] zero
        grad_input = rows_out = input.new_empty(input.shape)
    elif want_input and torch.are_deterministic_algorithms_enabled():
        rows_out = input.new_empty((S, K), dtype=acc_dtype)
    elif want_input:
        grad_input_acc = rows_out = torch.zeros(input.shape, dtype=acc_dtype, device=input.device)
    dot_out = None
    if want_sw:
        dot_out = torch.zeros(
            (triton.cdiv(K, cfg.block_n), S), dtype=acc_dtype, device=input.device
        )
    if S > 0 and K > 0 and ((rows_out is not None and rows_out.numel()) or want_sw):
        _launch_rows(
            grad,
            weight_t,
            offs,
            scatter_index,
            gather_index if grad_input_acc is not None else None,
            scatter_weight,
            rows_out if rows_out is not None and rows_out.numel() else None,
            S,
            cfg if want_sw else config,
            dot_x=input if want_sw else None,
            dot_index=gather_index if want_sw else None,
            dot_out=dot_out,
        )
    if want_input and gather_index is not None:
        if grad_input_acc is None:
            # deterministic: the rows in slot order, summed by index_add_ (deterministic on CUDA
            # in this mode, atomics are not)
            rows_out.masked_fill_((gather_index < 0).unsqueeze(1), 0)
            grad_input_acc = torch.zeros(input.shape, dtype=acc_dtype, device=input.device)
            if grad_input_acc.size(0):
                # with no input rows every slot is padding: there is no row 0 to clamp to
                grad_input_acc.index_add_(0, gather_index.clamp(min=0), rows_out)
        grad_input = (
            grad_input_acc if grad_input_acc.dtype == input.dtype
            else grad_input_acc.to(input.dtype)
        )
    if want_sw:
        grad_sw = dot_out.sum(0).to(scatter_weight.dtype)
    grad_weight = None
    if want_weight:
        grad_weight = empty_weight_grad(weight)  # in weight's strides where dense
        if grad_weight.numel():
            _launch_k_rows(
                input, grad, offs, grad_weight, config,
                a_index=gather_index, b_index=scatter_index, b_scale=scatter_weight,
            )
    if not want_sw:
        grad_sw = (scatter_weight if scatter_weight is not None else input).new_empty((0,))
    return (
        grad_input if want_input else input.new_empty((0,)),
        grad_weight if want_weight else weight.new_empty((0,)),
        grad_sw,
    )


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------


@triton_op("torch_moe::_triton_grouped_mm", mutates_args=())
def _triton_grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    # Also the fake kernel (triton_op traces the body), so it must not read tensor values.
    return grouped_mm(a, b, offs)


@triton_op("torch_moe::_triton_indexed_grouped_mm", mutates_args=())
def _triton_indexed_grouped_mm(
    input: Tensor,
    weight: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor] = None,
    scatter_index: Optional[Tensor] = None,
    scatter_weight: Optional[Tensor] = None,
    num_out_rows: int = -1,
) -> Tensor:
    return indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows
    )


@triton_op("torch_moe::_triton_indexed_grouped_mm_backward", mutates_args=())
def _triton_indexed_grouped_mm_backward(
    grad: Tensor,
    input: Tensor,
    weight: Tensor,
    offs: Tensor,
    gather_index: Optional[Tensor],
    scatter_index: Optional[Tensor],
    scatter_weight: Optional[Tensor],
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    return indexed_grouped_mm_backward(
        grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
    )


# ---------------------------------------------------------------------------------------------
# The CUDA kernels of the public ops (see torch_moe._triton)
# ---------------------------------------------------------------------------------------------

KERNELS = {
    "grouped_mm": torch.ops.torch_moe._triton_grouped_mm.default,
    "indexed_grouped_mm": torch.ops.torch_moe._triton_indexed_grouped_mm.default,
    "indexed_grouped_mm_backward": torch.ops.torch_moe._triton_indexed_grouped_mm_backward.default,
}
