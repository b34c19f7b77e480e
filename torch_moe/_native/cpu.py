"""CPU kernels of the torch_moe ops: compositions of ATen ops chosen for speed on CPU.

Rules every kernel here follows (see the CPU notes in RFC.md):
- at most one GEMM per non-empty group and operand, no work at all for empty groups;
- no intermediate of the size of the permuted tokens ``[S, D]`` in the fused paths: rows are
  gathered and scattered per group through small buffers that stay in cache;
- sums across experts (the combine, ``grad_x``) accumulate in fp32 and round once;
- GEMMs on bf16 / fp16 run in fp32 where the CPU has no native instructions for them
  (:mod:`torch_moe._native._cpu_features`).

``offs`` is read on the host once per call (``tolist``). On CPU that is a plain memory read, not a
device synchronisation. No output size depends on a value read on the host (every size is a
function of input sizes); the CPU kernels read values only to validate them (expert ids in range,
offs monotonic), which a CUDA kernel would do with device-side asserts instead.
"""

import math

import torch

from torch_moe import _checks
from torch_moe._native._cpu_features import accumulate_dtype, gemm_compute_dtype
from torch_moe._native import grad_storage
from torch_moe._native._expert_blocks import Block, plan_blocks
from torch_moe._native._layouts import weight_grad_strides
from torch_moe._native.activation import activation_backward, activation_forward
from torch_moe._native.padded_groups import padded_group_layout

__all__ = [
    "token_sort",
    "permute",
    "permute_out",
    "permute_out_",
    "permute_backward",
    "unpermute",
    "unpermute_backward",
    "grouped_mm",
    "indexed_grouped_mm",
    "indexed_grouped_mm_backward",
    "grouped_ffn",
    "grouped_ffn_backward",
    "ExpertFFN",
]

# Rows per chunk for row-wise reductions, so temporaries stay small (well under the 32 MiB
# where glibc switches to fresh, page-faulting mmaps).
_ROW_CHUNK = 4096


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------


def _group_bounds(op: str, offs: torch.Tensor, limit: int, what: str):
    """Validates offs (cumulative group ends) and returns [(g, start, end)] of non-empty groups."""
    ends = offs.tolist()
    bounds = []
    start = 0
    for g, end in enumerate(ends):
        _checks.check(
            end >= start,
            lambda: f"{op}: expected offs to be non-decreasing and non-negative, but offs[{g}] = "
            f"{end} < {'offs[' + str(g - 1) + '] = ' if g else ''}{start}",
        )
        if end > start:
            bounds.append((g, start, end))
        start = end
    _checks.check(
        start <= limit,
        lambda: f"{op}: expected offs[-1] <= {what} ({limit}), but got offs[-1] = {start}",
    )
    return bounds, start


def _check_index_range(op: str, name: str, index: torch.Tensor, high: int, allow_pad: bool):
    """Checks ``index`` values lie in [0, high) (or are -1 padding); returns whether -1 occurs."""
    if index.numel() == 0:
        return False
    lo, hi = torch.aminmax(index)
    lo, hi = int(lo), int(hi)
    low_ok = lo >= (-1 if allow_pad else 0)
    _checks.check(
        low_ok and hi < high,
        lambda: f"{op}: expected {name} values in [{-1 if allow_pad else 0}, {high})"
        f"{' (-1 marks padding)' if allow_pad else ''}, but got values in [{lo}, {hi}]",
    )
    return lo < 0


def _check_unique_assignments(op: str, sorted_ids: torch.Tensor, num_assignments: int) -> None:
    """Each assignment t * k + j occurs at most once in ``sorted_ids`` (-1 padding any number of
    times): a duplicate would count a token twice in a sum that its backward cannot invert.

    ``sorted_ids`` is range-checked. One bincount, with padding shifted into a bin of its own,
    when its bins (up to the largest id) are few next to the slots, as they are for any routing
    (ids below T * k); otherwise, for an absurd ``top_k``, a sort of the slots."""
    if sorted_ids.numel() == 0 or num_assignments == 0:
        return
    largest = int(sorted_ids.max())
    if largest < 4 * sorted_ids.numel() + 1024:
        counts = torch.bincount(sorted_ids + 1)
        counts[0] = 0  # padding
        most, bin_ = (int(v) for v in torch.max(counts, 0))
        assignment = bin_ - 1
    else:
        ids = torch.sort(sorted_ids).values
        ids, counts = torch.unique_consecutive(ids[ids >= 0], return_counts=True)
        most, i = (int(v) for v in torch.max(counts, 0))
        assignment = int(ids[i])
    _checks.check(
        most <= 1,
        lambda: f"{op}: expected each assignment t * k + j at most once in sorted_ids, but "
        f"assignment {assignment} appears {most} times",
    )


def _token_rows(op: str, sorted_ids: torch.Tensor, top_k: int, num_tokens: int):
    """Token row of each sorted slot (0 for padding) and the padding mask (None if no padding)."""
    has_pad = _check_index_range(op, "sorted_ids", sorted_ids, num_tokens * top_k, True)
    _check_unique_assignments(op, sorted_ids, num_tokens * top_k)
    rows = torch.div(sorted_ids, top_k, rounding_mode="floor")
    if not has_pad:
        return rows, None
    pad = sorted_ids < 0
    return rows.clamp_(min=0), pad


def _slot_weights(topk_weights, sorted_ids, pad, dtype):
    """Routing weight of each sorted slot in ``dtype``, zero for padded slots."""
    if topk_weights.numel() == 0:
        return torch.zeros(sorted_ids.size(0), dtype=dtype, device=sorted_ids.device)
    weight = topk_weights.reshape(-1)[sorted_ids.clamp(min=0)].to(dtype)
    if pad is not None:
        weight.masked_fill_(pad, 0)
    return weight


def _inverse_slots(op: str, sorted_ids: torch.Tensor, num_assignments: int):
    """slot[a] = i where sorted_ids[i] == a, and whether every assignment has a slot.

    ``sorted_ids`` must be range-checked; assignments must appear at most once, or the inverse
    would be ambiguous.
    """
    _check_unique_assignments(op, sorted_ids, num_assignments)
    valid = sorted_ids >= 0
    ids = sorted_ids[valid] if not bool(valid.all()) else sorted_ids
    positions = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    if ids.numel() != sorted_ids.numel():
        positions = positions[valid]
    slot = torch.full((num_assignments,), -1, dtype=torch.int64, device=sorted_ids.device)
    slot[ids] = positions
    return slot, ids.numel() == num_assignments


def _index_add_rows_(acc: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """acc[rows[i]] += src[i]. With no rows in ``acc`` every slot is padding (the indices are
    range-checked), whose rows of ``src`` are zero: nothing to add."""
    if acc.size(0):
        acc.index_add_(0, rows, src if src.dtype == acc.dtype else src.to(acc.dtype))


def _empty_output(like: torch.Tensor) -> torch.Tensor:
    """An output that ``output_mask`` does not request: nothing computed, nothing allocated."""
    return like.new_empty((0,))


def _zero_rows_(t: torch.Tensor, pad) -> torch.Tensor:
    """t[i] = 0 where ``pad[i]`` (a bool mask) or for i in ``pad`` (int64 row indices), in
    place. Padded slots are set to zero rather than scaled by zero: a scaled row keeps the NaN or
    Inf of whatever real row or weight it was computed from."""
    if pad is None:
        return t
    if pad.dtype == torch.bool:
        return t.masked_fill_(pad.unsqueeze(1), 0)
    return t.index_fill_(0, pad, 0) if pad.numel() else t


def _either(a, b):
    """The union of two optional masks."""
    if a is None or b is None:
        return b if a is None else a
    return a | b


def _gemm_operand(t: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return t if t.dtype == cdt else t.to(cdt)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype, scratch=None):
    """out = a @ b computed in ``cdt``; ``scratch`` (an [M, N] ``cdt`` buffer) avoids a temporary."""
    if out.dtype == cdt:
        torch.mm(_gemm_operand(a, cdt), _gemm_operand(b, cdt), out=out)
    else:
        out.copy_(torch.mm(_gemm_operand(a, cdt), _gemm_operand(b, cdt), out=scratch))


def _empty_grad_like(w: torch.Tensor, bounds) -> torch.Tensor:
    """A gradient for the [E, ...] weight ``w``, in its strides where it is dense
    (:func:`torch_moe._native._layouts.weight_grad_strides`); only experts without rows are zeroed.

    Each expert with rows is fully written by its GEMM, so zero-filling it first would only add a
    pass over memory. The storage is reused from the step before where nothing holds it any more
    (:mod:`torch_moe._native.grad_storage`), instead of freshly mapped pages that fault.
    """
    grad = grad_storage.empty_strided(w.size(), weight_grad_strides(w), w.dtype, w.device)
    if len(bounds) < w.size(0):
        used = {g for g, _, _ in bounds}
        unused = [g for g in range(w.size(0)) if g not in used]
        # index_fill_ on dim 0 writes the unused experts' rows only; a boolean-mask assignment
        # would run masked_fill_ over the whole gradient, first-touching every page of it
        grad.index_fill_(0, torch.tensor(unused, dtype=torch.long, device=w.device), 0)
    return grad


class _Buffers:
    """Per-call scratch buffers, reused across groups so each group allocates nothing."""

    def __init__(self, device):
        self._device = device
        self._flat = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        need = rows * cols
        buf = self._flat.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = torch.empty(need, dtype=dtype, device=self._device)
            self._flat[name] = buf
        return buf[:need].view(rows, cols)


# ---------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------


def token_sort(topk_ids: torch.Tensor, num_experts: int, align: int = 1):
    op = "torch_moe.token_sort"
    _checks.check_token_sort(topk_ids, num_experts, align)
    ids = topk_ids.reshape(-1).long()
    n = ids.numel()
    S = _checks.token_sort_num_slots(n, num_experts, align)
    _check_index_range(op, "topk_ids", ids, num_experts, allow_pad=False)
    counts = torch.bincount(ids, minlength=num_experts)
    # A stable sort keeps, inside each expert, the order of t * k + j: deterministic and
    # reproducible whatever the number of threads.
    expert_sorted, order = torch.sort(ids, stable=True)
    if align == 1:
        return order, counts.cumsum(0).to(torch.int32), counts
    # slot of the r-th assignment of expert e: padded_start[e] + r
    ends, shift = padded_group_layout(counts, align)
    dest = torch.arange(n, device=ids.device).add_(shift[expert_sorted])
    sorted_ids = torch.full((S,), -1, dtype=torch.int64, device=ids.device)
    sorted_ids.scatter_(0, dest, order)
    return sorted_ids, ends.to(torch.int32), counts


# ---------------------------------------------------------------------------------------------
# Permute / unpermute
# ---------------------------------------------------------------------------------------------


def permute_out(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int, *, out: torch.Tensor):
    op = "torch_moe.permute"
    _checks.check_permute_out(x, sorted_ids, top_k, out)
    rows, pad = _token_rows(op, sorted_ids, top_k, x.size(0))
    return _gather_rows(x, rows, pad, out)


def _gather_rows(src: torch.Tensor, rows: torch.Tensor, pad, out: torch.Tensor) -> torch.Tensor:
    """out[i] = src[rows[i]], zero where ``pad`` (rows of padded slots are clamped to 0)."""
    if src.size(0) == 0:
        # no tokens: every slot is padding
        return out.zero_()
    torch.index_select(src, 0, rows, out=out)
    return _zero_rows_(out, pad)


def permute_out_(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int, *, out: torch.Tensor):
    """The kernel of ``permute.out``, whose schema returns nothing."""
    permute_out(x, sorted_ids, top_k, out=out)


def permute(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int):
    _checks.check_permute(x, sorted_ids, top_k)
    out = x.new_empty((sorted_ids.size(0), x.size(1)))
    return permute_out(x, sorted_ids, top_k, out=out)


def _combine(y: torch.Tensor, slot_TK: torch.Tensor, weight_TK, complete: bool, out_dtype):
    """out[t] = sum_j weight[t, j] * y[slot[t, j]]  (missing slots, -1, contribute nothing)."""
    T, k = slot_TK.shape
    acc = torch.zeros((T, y.size(1)), dtype=accumulate_dtype(y.dtype), device=y.device)
    if y.size(0) == 0:
        # no slots at all: every assignment is missing
        return acc if acc.dtype == out_dtype else acc.to(out_dtype)
    if weight_TK is None:
        weight_TK = torch.ones((T, k), dtype=acc.dtype, device=y.device)
    missing = None
    if not complete:
        # a dropped assignment reads neither a row of y nor its routing weight
        missing = slot_TK < 0
        weight_TK = weight_TK.masked_fill(missing, 0)
        slot_TK = slot_TK.clamp(min=0)
    rows = torch.empty((T, y.size(1)), dtype=y.dtype, device=y.device)
    for j in range(k):
        torch.index_select(y, 0, slot_TK[:, j], out=rows)
        _zero_rows_(rows, missing[:, j] if missing is not None else None)
        acc.addcmul_(rows, weight_TK[:, j : j + 1].to(acc.dtype))
    return acc if acc.dtype == out_dtype else acc.to(out_dtype)


def permute_backward(grad: torch.Tensor, sorted_ids: torch.Tensor, top_k: int, num_tokens: int):
    """grad_x[t] = sum of grad over the slots of t's assignments, accumulated in fp32 (fp64)
    slot by slot: O(S) whatever top_k, and padded slots add nothing."""
    op = "torch_moe.permute_backward"
    _checks.check_permute_backward(grad, sorted_ids, top_k, num_tokens)
    rows, pad = _token_rows(op, sorted_ids, top_k, num_tokens)
    acc = torch.zeros((num_tokens, grad.size(1)), dtype=accumulate_dtype(grad.dtype),
                      device=grad.device)
    for s in range(0, sorted_ids.size(0), _ROW_CHUNK):
        e = min(s + _ROW_CHUNK, sorted_ids.size(0))
        rows_grad = grad[s:e]
        if pad is not None:
            # a fresh chunk: the padded rows of grad (anything, NaN included) are not read
            rows_grad = torch.where(pad[s:e].unsqueeze(1), 0, rows_grad)
        _index_add_rows_(acc, rows[s:e], rows_grad)
    return acc if acc.dtype == grad.dtype else acc.to(grad.dtype)


def unpermute(y: torch.Tensor, sorted_ids: torch.Tensor, topk_weights: torch.Tensor):
    op = "torch_moe.unpermute"
    _checks.check_unpermute(y, sorted_ids, topk_weights)
    T, k = topk_weights.shape
    _check_index_range(op, "sorted_ids", sorted_ids, T * k, True)
    slot, complete = _inverse_slots(op, sorted_ids, T * k)
    return _combine(y, slot.view(T, k), topk_weights, complete, y.dtype)


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[i] = <a[i], b[i]> in ``dtype``, chunked so no [S, D] temporary is made."""
    out = torch.empty(a.size(0), dtype=dtype, device=a.device)
    for s in range(0, a.size(0), _ROW_CHUNK):
        e = min(s + _ROW_CHUNK, a.size(0))
        torch.sum(a[s:e].to(dtype) * b[s:e].to(dtype), dim=1, out=out[s:e])
    return out


def unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask):
    op = "torch_moe.unpermute_backward"
    _checks.check_unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask)
    want_y, want_w = output_mask
    T, k = topk_weights.shape
    rows, pad = _token_rows(op, sorted_ids, k, T)
    # grad_y = w * grad[token of slot]; the gathered rows also give grad_w = <grad[t], y[slot]>
    grad_y = grad_w = None
    if want_y or want_w:
        grad_y = _gather_rows(grad, rows, pad, grad.new_empty((sorted_ids.size(0), grad.size(1))))
    if want_w:
        dot = _rowwise_dot(grad_y, y, accumulate_dtype(y.dtype))
        if pad is not None:
            dot.masked_fill_(pad, 0)
        grad_w = torch.zeros(T * k, dtype=topk_weights.dtype, device=y.device)
        valid = sorted_ids >= 0
        grad_w[sorted_ids[valid]] = dot[valid].to(topk_weights.dtype)
        grad_w = grad_w.view(T, k)
    if want_y:
        weight = _slot_weights(topk_weights, sorted_ids, pad, accumulate_dtype(y.dtype))
        grad_y.mul_(weight.unsqueeze(1).to(grad_y.dtype))
    return (
        grad_y if want_y else _empty_output(y),
        grad_w if want_w else _empty_output(topk_weights),
    )


# ---------------------------------------------------------------------------------------------
# Grouped GEMM (layouts of aten::_grouped_mm)
# ---------------------------------------------------------------------------------------------


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    op = "torch_moe.grouped_mm"
    _checks.check_grouped_mm(a, b, offs)
    cdt = gemm_compute_dtype(a.dtype)
    if a.dim() == 2 and b.dim() == 3:
        # rows of a split by offs; rows past offs[-1] are zero
        out = a.new_empty((a.size(0), b.size(2)))
        bounds, last = _group_bounds(op, offs, a.size(0), "self.size(0)")
        for g, s, e in bounds:
            _mm_into(out[s:e], a[s:e], b[g], cdt)
        out[last:].zero_()
    elif a.dim() == 3 and b.dim() == 2:
        # columns of b split by offs; columns past offs[-1] are zero
        out = a.new_empty((a.size(1), b.size(1)))
        bounds, last = _group_bounds(op, offs, b.size(1), "mat2.size(1)")
        for g, s, e in bounds:
            _mm_into(out[:, s:e], a[g], b[:, s:e], cdt)
        out[:, last:].zero_()
    else:
        # the contraction split by offs; an empty group gives a zero matrix
        out = a.new_zeros((offs.size(0), a.size(0), b.size(1)))
        bounds, _ = _group_bounds(op, offs, a.size(1), "self.size(1)")
        for g, s, e in bounds:
            _mm_into(out[g], a[:, s:e], b[s:e], cdt)
    return out


# ---------------------------------------------------------------------------------------------
# Index-aware grouped GEMM
# ---------------------------------------------------------------------------------------------


def _slot_rows(op, name, index, high):
    """(rows, pad mask or None) for an optional gather / scatter index."""
    if index is None:
        return None, None
    has_pad = _check_index_range(op, name, index, high, True)
    if not has_pad:
        return index, None
    pad = index < 0
    return index.clamp(min=0), pad


def indexed_grouped_mm(
    input, weight, offs, gather_index=None, scatter_index=None, scatter_weight=None,
    num_out_rows=-1,
):
    op = "torch_moe.indexed_grouped_mm"
    S = _checks.check_indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows
    )
    cdt = gemm_compute_dtype(input.dtype)
    N = weight.size(2)
    bounds, last = _group_bounds(op, offs, S, "the number of sorted slots")
    g_rows, g_pad = _slot_rows(op, "gather_index", gather_index, input.size(0))
    s_rows, s_pad = _slot_rows(op, "scatter_index", scatter_index, max(num_out_rows, 0))
    # a slot padded on either side gives a zero row (or adds nothing to its clamped output row)
    pad = _either(g_pad, s_pad)
    # scatter weights in the accumulation dtype, so each weighted row is rounded at most once
    sw = (scatter_weight.to(accumulate_dtype(input.dtype)) if scatter_weight is not None
          else None)
    bufs = _Buffers(input.device)
    x_c = _gemm_operand(input, cdt) if gather_index is not None else input
    if scatter_index is not None:
        out_acc = torch.zeros((num_out_rows, N), dtype=accumulate_dtype(input.dtype),
                              device=input.device)
    else:
        out = input.new_empty((S, N))
        out[last:].zero_()
    for g, s, e in bounds:
        n = e - s
        if gather_index is not None:
            X = _gather_rows(x_c, g_rows[s:e], g_pad[s:e] if g_pad is not None else None,
                             bufs.get("x", n, input.size(1), cdt))
        else:
            X = _gemm_operand(input[s:e], cdt)
        V = torch.mm(X, _gemm_operand(weight[g], cdt), out=bufs.get("v", n, N, cdt))
        if sw is not None:
            if scatter_index is not None and V.dtype != out_acc.dtype:
                V = V.to(out_acc.dtype)
            V.mul_(sw[s:e].unsqueeze(1))
        _zero_rows_(V, pad[s:e] if pad is not None else None)
        if scatter_index is not None:
            _index_add_rows_(out_acc, s_rows[s:e], V)
        else:
            out[s:e].copy_(V)
    if scatter_index is not None:
        return out_acc if out_acc.dtype == input.dtype else out_acc.to(input.dtype)
    return out


def indexed_grouped_mm_backward(
    grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
):
    op = "torch_moe.indexed_grouped_mm_backward"
    S = _checks.check_indexed_grouped_mm_backward(
        grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
    )
    want_input, want_weight, want_sw = output_mask
    want_sw = want_sw and scatter_weight is not None
    cdt = gemm_compute_dtype(input.dtype)
    acc = accumulate_dtype(input.dtype)
    K = input.size(1)
    N = weight.size(2)
    bounds, _ = _group_bounds(op, offs, S, "the number of sorted slots")
    g_rows, g_pad = _slot_rows(op, "gather_index", gather_index, input.size(0))
    s_rows, s_pad = _slot_rows(op, "scatter_index", scatter_index, grad.size(0))
    # padded slots take no part: their rows of G, X and U are zeroed (not scaled by zero)
    pad = _either(g_pad, s_pad)
    sw = scatter_weight.to(acc) if scatter_weight is not None else None
    bufs = _Buffers(input.device)
    x_c = _gemm_operand(input, cdt) if gather_index is not None else None
    grad_c = _gemm_operand(grad, cdt)
    grad_in = grad_in_acc = grad_weight = grad_sw = None
    if want_input and gather_index is not None:
        grad_in_acc = torch.zeros(input.shape, dtype=acc, device=input.device)
    elif want_input:
        grad_in = torch.zeros_like(input, memory_format=torch.contiguous_format)
    if want_weight:
        grad_weight = _empty_grad_like(weight, bounds)
    if want_sw:
        grad_sw = torch.zeros(S, dtype=acc, device=input.device)
    for g, s, e in bounds if (want_input or want_weight or want_sw) else ():
        n = e - s
        pad_g = pad[s:e] if pad is not None else None
        # G: the output gradient of this group's rows (gathered once per group)
        if scatter_index is not None:
            G = _gather_rows(grad_c, s_rows[s:e], pad_g, bufs.get("g", n, N, cdt))
        elif pad_g is not None:
            G = _zero_rows_(bufs.get("g", n, N, cdt).copy_(grad_c[s:e]), pad_g)
        else:
            G = grad_c[s:e]
        # X: this group's input rows, built once and used by both grad_weight and grad_sw
        X = None
        if want_weight or want_sw:
            if gather_index is not None:
                X = _gather_rows(x_c, g_rows[s:e], pad_g, bufs.get("x", n, K, cdt))
            elif pad_g is not None:
                X = _zero_rows_(bufs.get("x", n, K, cdt).copy_(input[s:e]), pad_g)
            else:
                X = _gemm_operand(input[s:e], cdt)
        W = _gemm_operand(weight[g], cdt)
        # U = G @ W^T is the unweighted input gradient; <U_i, X_i> is the weight's gradient.
        if want_input or want_sw:
            U = _zero_rows_(torch.mm(G, W.t(), out=bufs.get("u", n, K, cdt)), pad_g)
            if want_sw:
                grad_sw[s:e] = _rowwise_dot(U, X, acc)
            if want_input:
                if sw is not None:
                    if gather_index is not None and U.dtype != acc:
                        U = U.to(acc)  # weighted once in fp32, rounded once by the sum
                    _zero_rows_(U.mul_(sw[s:e].unsqueeze(1)), pad_g)
                if gather_index is not None:
                    _index_add_rows_(grad_in_acc, g_rows[s:e], U)
                else:
                    grad_in[s:e].copy_(U)
        if want_weight:
            if sw is not None:
                G = _zero_rows_(torch.mul(G, sw[s:e].unsqueeze(1), out=bufs.get("gw", n, N, cdt)),
                                pad_g)
            _mm_into(grad_weight[g], X.t(), G, cdt)
    if grad_in_acc is not None:
        grad_in = grad_in_acc if grad_in_acc.dtype == input.dtype else grad_in_acc.to(input.dtype)
    if grad_sw is not None:
        if pad is not None:
            grad_sw.masked_fill_(pad, 0)
        grad_sw = grad_sw.to(scatter_weight.dtype)
    return (
        grad_in if want_input else _empty_output(input),
        grad_weight if want_weight else _empty_output(weight),
        grad_sw if want_sw else _empty_output(scatter_weight if scatter_weight is not None
                                              else input),
    )


# ---------------------------------------------------------------------------------------------
# Fused expert FFN
# ---------------------------------------------------------------------------------------------


class _ExpertWeight:
    """One ``[E, K, N]`` expert weight in the GEMM compute dtype, by expert (``one``) or by run
    of experts (``run``), optionally transposed to ``[E, N, K]``.

    When the compute dtype differs from the weight's (bf16 weights on a CPU without bf16 GEMM),
    the experts are converted into a reused buffer rather than into a fresh copy of the whole
    weight; a transposed weight is converted in its own orientation, then viewed transposed.
    """

    def __init__(self, w, cdt, bufs, name, transpose=False):
        self.w, self.cdt, self.bufs, self.name, self.transpose = w, cdt, bufs, name, transpose

    def _convert(self, w):
        if w.dtype == self.cdt:
            return w
        flat = self.bufs.get(self.name, 1, w.numel(), self.cdt)
        return flat.view(w.shape).copy_(w)

    def one(self, g):
        w = self._convert(self.w[g])
        return w.t() if self.transpose else w

    def run(self, g0, B):
        w = self._convert(self.w[g0 : g0 + B])
        return w.transpose(1, 2) if self.transpose else w


def _ffn_setup(op, x, sorted_ids, offs, topk_weights):
    T, k = topk_weights.shape
    S = sorted_ids.size(0)
    bounds, last = _group_bounds(op, offs, S, "sorted_ids.size(0)")
    rows, pad = _token_rows(op, sorted_ids, k, T)
    cdt = gemm_compute_dtype(x.dtype)
    # the routing weights stay in the accumulation dtype (not rounded to a bf16 / fp16 GEMM
    # dtype): each product with a weight is then rounded at most once
    weight = _slot_weights(topk_weights, sorted_ids, pad, accumulate_dtype(x.dtype))
    return plan_blocks(bounds, x.device), last, rows, pad, weight, cdt


def _up_projection(blk, X, w1, w3, b1, b3, h, F, bufs, cdt):
    """h = [X @ w1 (+ b1), X @ w3 (+ b3)] (gated, separate w3) or X @ w1 (+ b1), on the rows of
    one block."""
    if w3 is None:
        blk.mm(X, w1, h, b1)
    elif not blk.batched:
        # per-group GEMMs write the two halves of h in place
        blk.mm(X, w1, h[:, :F], b1)
        blk.mm(X, w3, h[:, F:], b3)
    else:
        # bmm into a strided half of h would take a slow path: contiguous halves, then copies
        n = blk.num_rows
        h[:, :F].copy_(blk.mm(X, w1, bufs.get("h_gate", n, F, cdt), b1))
        h[:, F:].copy_(blk.mm(X, w3, bufs.get("h_up", n, F, cdt), b3))


def _block_outputs(blk, X, pad_r, hidden, W1, W3, W2, b1, b3, b2, activation, alpha, limit, bufs,
                   cdt):
    """The unweighted expert outputs ``act(X @ w1, X @ w3) @ w2`` of one block (``cdt``, rows
    in slot order); writes the pre-activations of its slots into ``hidden`` (their rows of the
    op's ``hidden``). ``X``: the block's rows gathered in ``cdt``; ``pad_r``: its padding rows."""
    n, H, D = blk.num_rows, hidden.size(1), X.size(1)
    F = H // 2 if activation in _checks.GATED_ACTIVATIONS else H
    direct = not blk.batched and hidden.dtype == cdt
    h = hidden if direct else bufs.get("h", n, H, cdt)
    _up_projection(blk, X, W1, W3, b1, b3, h, F, bufs, cdt)
    # padded slots (and padding rows) store zeros, whatever the weights of their group hold
    _zero_rows_(h, pad_r)
    if not direct:
        # store, then continue from the stored (rounded) values so that the backward
        # recomputation sees exactly what the forward used
        hidden.copy_(blk.to_slots(h))
        if h.dtype != hidden.dtype:
            blk.to_rows_into(hidden, h)
    act = activation_forward(activation, h, bufs.get("a", n, F, cdt), alpha, limit)
    return blk.to_slots(blk.mm(act, W2, bufs.get("o", n, D, cdt), b2))


class ExpertFFN:
    """Experts on rows that the caller gathered: the computation of a block of
    :func:`grouped_ffn` in the per-group form (the same GEMMs and elementwise kernels, the GEMMs
    on the same rows, so the same bits), without the op's routing, checks and combine.

    For a caller that schedules experts itself and combines their outputs later (the expert
    store computes experts as soon as their weights have arrived). The weights are those of
    :func:`grouped_ffn`, ``w1 [E, D, F]`` ..., or sequences of per-expert tensors (``w1[g] [D,
    F]``, an expert store's slots), all in ``dtype``; the caller has checked their shapes and
    dtypes. The sequences are read at each call: their entries may change between calls.
    """

    def __init__(self, w1, w2, w3=None, activation="swiglu", alpha=1.702, limit=7.0, b1=None,
                 b2=None, b3=None, *, dtype=None):
        self.dtype = dtype if dtype is not None else w1.dtype
        cdt = gemm_compute_dtype(self.dtype)
        self.cdt, self.activation, self.alpha, self.limit = cdt, activation, alpha, limit
        self._bufs = _Buffers(torch.device("cpu"))  # a CPU kernel
        self._W1 = _ExpertWeight(w1, cdt, self._bufs, "w1")
        self._W3 = _ExpertWeight(w3, cdt, self._bufs, "w3") if w3 is not None else None
        self._W2 = _ExpertWeight(w2, cdt, self._bufs, "w2")
        self._biases = (b1, b2, b3)

    def _bias(self, b):
        # converted whole, as the op converts them (tiny next to the weights); a sequence
        # entry by entry (those of empty slots are None)
        if b is None or self.dtype == self.cdt:
            return b
        if isinstance(b, torch.Tensor):
            return _gemm_operand(b, self.cdt)
        return [v if v is None else _gemm_operand(v, self.cdt) for v in b]

    def __call__(self, groups: list, X: torch.Tensor, hidden: torch.Tensor,
                 out: torch.Tensor) -> None:
        """``groups = [(g, n_g)]``: expert ``g`` on the next ``n_g >= 1`` rows of ``X [n, D]``
        (``n`` the sum of the ``n_g``). ``hidden [n, H]`` gets the pre-activations, ``out [n,
        D]`` (any float dtype) the unweighted outputs."""
        bounds, start = [], 0
        for g, n in groups:
            bounds.append((g, start, start + n))
            start += n
        b1, b2, b3 = (self._bias(b) for b in self._biases)
        o = _block_outputs(Block(0, start, bounds), _gemm_operand(X, self.cdt), None, hidden,
                           self._W1, self._W3, self._W2, b1, b3, b2, self.activation,
                           self.alpha, self.limit, self._bufs, self.cdt)
        out.copy_(o)


def grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3=None, activation="swiglu",
                alpha=1.702, limit=7.0, b1=None, b2=None, b3=None, *, out=None, hidden=None):
    """The op's CPU kernel. ``out [T, D]`` and ``hidden [S, H]`` (contiguous, x's dtype;
    both or neither): storage to write the outputs into instead of allocating them (an Inductor
    choice returns them as views of one buffer)."""
    op = "torch_moe.grouped_ffn"
    _, F = _checks.check_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                                     b1=b1, b2=b2, b3=b3)
    blocks, last, rows, pad, weight, cdt = _ffn_setup(op, x, sorted_ids, offs, topk_weights)
    # [E, F | 2F | D] each, tiny next to the weights: converted whole, once
    b1_c, b2_c, b3_c = (_gemm_operand(b, cdt) if b is not None else None for b in (b1, b2, b3))
    gated = activation in _checks.GATED_ACTIVATIONS
    D = x.size(1)
    H = 2 * F if gated else F
    S = sorted_ids.size(0)
    bufs = _Buffers(x.device)
    W1 = _ExpertWeight(w1, cdt, bufs, "w1")
    W3 = _ExpertWeight(w3, cdt, bufs, "w3") if w3 is not None else None
    W2 = _ExpertWeight(w2, cdt, bufs, "w2")
    x_c = _gemm_operand(x, cdt)
    if hidden is None:
        hidden = x.new_empty((S, H))
    hidden[last:].zero_()
    acc = accumulate_dtype(x.dtype)
    out_acc = (out.zero_() if out is not None and acc == x.dtype else
               torch.zeros((x.size(0), D), dtype=acc, device=x.device))
    for blk in blocks:
        bs, be, n = blk.start, blk.end, blk.num_rows
        r = rows[bs:be]
        pad_b = pad[bs:be] if pad is not None else None
        pad_r = blk.pad_rows(pad_b)
        X = _gather_rows(x_c, blk.to_rows(r), pad_r, bufs.get("x", n, D, cdt))
        o = _block_outputs(blk, X, pad_r, hidden[bs:be], W1, W3, W2, b1_c, b3_c, b2_c,
                           activation, alpha, limit, bufs, cdt)
        # the routing weight scales the down bias too (gpt-oss); it is applied in the
        # accumulation dtype, so that a low-precision row is rounded once, by the combine
        o = o if o.dtype == out_acc.dtype else o.to(out_acc.dtype)
        o.mul_(weight[bs:be].unsqueeze(1))
        _zero_rows_(o, pad_b)
        _index_add_rows_(out_acc, r, o)
    if out is None:
        out = out_acc if out_acc.dtype == x.dtype else out_acc.to(x.dtype)
    elif out_acc is not out:
        out.copy_(out_acc)
    return out, hidden


def grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, activation,
                         alpha, limit, output_mask, b1=None, b2=None, b3=None):
    op = "torch_moe.grouped_ffn_backward"
    _, F = _checks.check_grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3,
                                              hidden, activation, output_mask, b1=b1, b2=b2, b3=b3)
    want_x, want_topk, want_w1, want_w2, want_w3, want_b1, want_b2, want_b3 = output_mask
    want_w3 = want_w3 and w3 is not None
    want_b1, want_b2, want_b3 = (want and b is not None
                                 for want, b in ((want_b1, b1), (want_b2, b2), (want_b3, b3)))
    # dA = G @ w2^T feeds grad_topk and dH; dH feeds grad_x, grad_w1, grad_w3, grad_b1 and
    # grad_b3; the activation act(h) feeds grad_topk and grad_w2; grad_b2 needs G only. Nothing
    # an unrequested gradient alone needs is computed.
    want_dH = want_x or want_w1 or want_w3 or want_b1 or want_b3
    want_dA = want_topk or want_dH
    want_act = want_topk or want_w2
    blocks, _, rows, pad, weight, cdt = _ffn_setup(op, x, sorted_ids, offs, topk_weights)
    bounds = [grp for blk in blocks for grp in blk.groups]
    T, D = x.shape
    H = hidden.size(1)
    acc = accumulate_dtype(x.dtype)
    bufs = _Buffers(x.device)
    W2t = _ExpertWeight(w2, cdt, bufs, "w2", transpose=True)
    x_c = _gemm_operand(x, cdt) if (want_w1 or want_w3) else None
    grad_c = _gemm_operand(grad, cdt)
    grad_x = torch.zeros((T, D), dtype=acc, device=x.device) if want_x else None
    grad_w1 = _empty_grad_like(w1, bounds) if want_w1 else None
    grad_w2 = _empty_grad_like(w2, bounds) if want_w2 else None
    grad_w3 = _empty_grad_like(w3, bounds) if want_w3 else None
    grad_weight_sorted = (
        torch.zeros(sorted_ids.size(0), dtype=acc, device=x.device) if want_topk else None
    )
    # bias gradients: per-expert row sums accumulated in fp32 (fp64), rounded once at the end;
    # zeros for the experts without rows
    grad_b1, grad_b2, grad_b3 = (
        torch.zeros(b.shape, dtype=acc, device=x.device) if want else None
        for want, b in ((want_b1, b1), (want_b2, b2), (want_b3, b3))
    )
    b2_acc = _gemm_operand(b2, acc) if (want_topk and b2 is not None) else None
    up = _UpBackward(w1, w3, F, cdt, bufs, x_c, grad_w1, grad_w3, grad_x)
    for blk in blocks if (want_dA or want_w2 or want_b2) else ():
        bs, be, n = blk.start, blk.end, blk.num_rows
        r = rows[bs:be]
        # Padded slots (and padding rows) read no row: their rows of G, X and hidden are zeros,
        # and so are those of dA and dX, which a NaN or Inf in their group's weights would
        # otherwise fill.
        pad_b = pad[bs:be] if pad is not None else None
        pad_r = blk.pad_rows(pad_b)
        w = blk.to_rows(weight[bs:be]).unsqueeze(1)
        G = _gather_rows(grad_c, blk.to_rows(r), pad_r, bufs.get("g", n, D, cdt))
        # hidden is read as it is; what is computed from its padded rows (act, dH) is zeroed
        if blk.batched:
            h = blk.to_rows_into(hidden[bs:be], bufs.get("h", n, H, cdt))
        else:
            h = _gemm_operand(hidden[bs:be], cdt)
        act = _zero_rows_(activation_forward(activation, h, bufs.get("a", n, F, cdt), alpha,
                                             limit), pad_r) if want_act else None
        if want_dA:
            # dA = G @ w2^T (unweighted): <dA_i, act_i> is d out / d topk_weight of slot i
            dA = _zero_rows_(blk.mm(G, W2t, bufs.get("da", n, F, cdt)), pad_r)
            if want_topk:
                grad_weight_sorted[bs:be] = blk.to_slots(_rowwise_dot(dA, act, acc))
        if want_w2:
            # d w2 = (w * act)^T @ G: scale the narrower operand
            act.mul_(w)
            blk.weight_grad(act, G, grad_w2, cdt, lambda shape: bufs.get(
                "dw2", 1, math.prod(shape), cdt).view(shape))
        if want_b2 or (want_topk and b2 is not None):
            # G in the accumulation dtype for the GEMVs of the down bias (converted where the
            # GEMMs run in bf16 / fp16), on the block's slots in order
            G_s = blk.to_slots(G)
            G_acc = G_s if G_s.dtype == acc else bufs.get("g_acc", be - bs, D, acc).copy_(G_s)
            w_acc = _gemm_operand(weight[bs:be], acc)
            for g, s, e in blk.groups:
                rows_g = slice(s - bs, e - bs)
                if want_topk:
                    # the routing weight scales the down bias too: d out / d w_i gains
                    # <G_i, b2[e]>
                    grad_weight_sorted[s:e].addmv_(G_acc[rows_g], b2_acc[g])
                if want_b2:
                    # d b2[e] = sum over the rows of e of w_i * G_i = G^T @ w
                    torch.mv(G_acc[rows_g].t(), w_acc[rows_g], out=grad_b2[g])
        if want_dH:
            dH = _zero_rows_(activation_backward(activation, dA.mul_(w), h,
                                                 bufs.get("dh", n, H, cdt), alpha, limit), pad_r)
            # d b1 (d b3) = the row sums of the gate (up) half of dH per expert; a fused w13's
            # b1 takes all of dH
            split = w3 is not None
            if want_b1:
                blk.row_sums(dH[:, :F] if split else dH, grad_b1, acc)
            if want_b3:
                blk.row_sums(dH[:, F:], grad_b3, acc)
            up(blk, r, pad_r, dH)
    if want_topk:
        if pad is not None:
            grad_weight_sorted.masked_fill_(pad, 0)
        grad_topk = torch.zeros(topk_weights.numel(), dtype=acc, device=x.device)
        valid = sorted_ids >= 0
        grad_topk[sorted_ids[valid]] = grad_weight_sorted[valid]
        grad_topk = grad_topk.view(topk_weights.shape).to(topk_weights.dtype)
    return (
        grad_x.to(x.dtype) if want_x else _empty_output(x),
        grad_topk if want_topk else _empty_output(topk_weights),
        grad_w1 if want_w1 else _empty_output(w1),
        grad_w2 if want_w2 else _empty_output(w2),
        grad_w3 if want_w3 else _empty_output(w3 if w3 is not None else w1),
        *(gb.to(b.dtype) if want else _empty_output(w1)
          for gb, want, b in ((grad_b1, want_b1, b1), (grad_b2, want_b2, b2),
                              (grad_b3, want_b3, b3))),
    )


class _UpBackward:
    """The gradients through the up projections, block by block, each only if requested (not
    None): grad_w1 (and grad_w3) = X^T @ dH per expert, and grad_x[t] += dH @ w1^T (+ dH_up @
    w3^T).

    x_c: the tokens in the GEMM dtype (None when no weight gradient is wanted). With a separate
    w3, dH = [d gate, d up] splits between w1 and w3; otherwise w1 is [E, D, H], the gate (and,
    fused, the up) projection.
    """

    def __init__(self, w1, w3, F, cdt, bufs, x_c, grad_w1, grad_w3, grad_x):
        self.W1t = _ExpertWeight(w1, cdt, bufs, "w1", transpose=True)
        self.W3t = _ExpertWeight(w3, cdt, bufs, "w3", transpose=True) if w3 is not None else None
        self.F, self.cdt, self.bufs, self.x_c = F, cdt, bufs, x_c
        self.grad_w1, self.grad_w3, self.grad_x = grad_w1, grad_w3, grad_x

    def _scratch(self, name):
        return lambda shape: self.bufs.get(name, 1, math.prod(shape), self.cdt).view(shape)

    def __call__(self, blk, r, pad_r, dH):
        """dH ``[num_rows, H]``: the pre-activation gradient of the block's rows; r: the token
        rows of its slots, pad_r: the padding rows of the block (``Block.pad_rows``)."""
        n, F, cdt, bufs = blk.num_rows, self.F, self.cdt, self.bufs
        split = self.W3t is not None
        dH1 = dH[:, :F] if split else dH
        dH3 = dH[:, F:] if split else None
        if blk.batched and split:
            # the batched GEMMs read contiguous operands (a strided half would be copied per
            # expert inside bmm)
            dH1 = bufs.get("dh_gate", n, F, cdt).copy_(dH1)
            dH3 = bufs.get("dh_up", n, F, cdt).copy_(dH3)
        if self.grad_w1 is not None or self.grad_w3 is not None:
            X = _gather_rows(self.x_c, blk.to_rows(r), pad_r,
                             bufs.get("x", n, self.x_c.size(1), cdt))
            if self.grad_w1 is not None:
                blk.weight_grad(X, dH1, self.grad_w1, cdt, self._scratch("dw1"))
            if self.grad_w3 is not None:
                blk.weight_grad(X, dH3, self.grad_w3, cdt, self._scratch("dw3"))
        if self.grad_x is not None:
            dX = bufs.get("dx", n, self.grad_x.size(1), cdt)
            if not split:
                blk.mm(dH1, self.W1t, dX)
            elif not blk.batched:
                blk.mm(dH1, self.W1t, dX)
                for g, s, e in blk.groups:
                    rows = slice(s - blk.start, e - blk.start)
                    dX[rows].addmm_(dH3[rows], self.W3t.one(g))
            else:
                blk.mm(dH1, self.W1t, dX)
                dX.view(blk.num_batched, blk.L, -1).baddbmm_(
                    dH3.view(blk.num_batched, blk.L, F), self.W3t.run(blk.g0, blk.num_batched))
            dX = blk.to_slots(_zero_rows_(dX, pad_r))
            _index_add_rows_(self.grad_x, r, dX)
