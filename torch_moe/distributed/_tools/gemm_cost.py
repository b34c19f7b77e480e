"""Time of the expert GEMMs and of the kernels around them, from per-expert token counts.

A grouped GEMM's time is the sum over its non-empty groups, each group taking
``2 * M_pad * N * K / (peak * efficiency(rows))`` where ``M_pad`` is the group's rows rounded up
to the kernel's row tile (tile quantisation: a group of 3 rows on a 128-row tile costs a whole
tile) and ``efficiency`` is the device's curve over the group's rows. So a skewed token
distribution costs more than its mean would: many small groups sit low on the curve. A fixed
``gemm_call_s`` per grouped call and ``per_group_s`` per non-empty group model the launch and,
on the CPU, the Python loop over ``torch.mm`` (one call per group and grouped GEMM).

Quantize kernels (FP8 rowwise, MXFP8) are memory bound: their time is the bytes they move
(high-precision read, FP8 and scales written) over the memory bandwidth. Dequantization is
fused into the scaled GEMMs' epilogues and costs nothing separate.

Fresh host allocations at or above ``fresh_alloc_threshold_bytes`` page-fault on first touch
(:func:`fresh_alloc_time_s`); the CPU grouped FFN allocates its ``hidden`` and the weight
gradients fresh on every call (``torch_moe/_native/cpu.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from torch_moe.distributed._tools.device_profiles import PRECISIONS, DeviceProfile
from torch_moe.quantization._formats import BLOCK_SIZE as MX_BLOCK_SIZE

__all__ = [
    "expert_ffn_gemm_calls",
    "ExpertFFNTime",
    "as_counts",
    "gemm_time_s",
    "grouped_gemm_time_s",
    "expert_ffn_time",
    "element_bytes",
    "ffn_elementwise_bytes",
    "ffn_elementwise_split_bytes",
    "ffn_fresh_allocations",
    "scale_bytes",
    "quantize_time_s",
    "fresh_alloc_time_s",
]


def as_counts(counts, name: str = "counts") -> list[float]:
    """Per-expert token counts as a list of non-negative floats (expected counts may be
    fractional). Accepts a 1-D tensor or a sequence of numbers."""
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 1:
            raise ValueError(f"expected {name} to be 1-D [E], but got shape "
                             f"{tuple(counts.shape)}")
        if counts.dtype == torch.bool or counts.is_complex():
            raise ValueError(f"expected {name} to be an integer or floating tensor, but got "
                             f"{counts.dtype}")
        values = counts.detach().to("cpu", torch.float64).tolist()
    elif isinstance(counts, Sequence) and not isinstance(counts, (str, bytes)):
        values = []
        for c in counts:
            if isinstance(c, bool) or not isinstance(c, (int, float)):
                raise ValueError(f"expected {name} to hold numbers, but got {c!r}")
            values.append(float(c))
    else:
        raise ValueError(f"expected {name} to be a 1-D tensor or a list of numbers, but got "
                         f"{type(counts).__name__}")
    if not values:
        raise ValueError(f"expected {name} to be non-empty")
    bad = [c for c in values if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"expected {name} to be finite and non-negative, but got {bad[:4]}")
    return values


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"expected {name} to be a positive number, but got {value!r}")


def gemm_time_s(profile: DeviceProfile, precision: str, rows: float, n: int, k: int,
                wgrad: bool = False) -> float:
    """Seconds of one GEMM group, without call overheads.

    Forward / dgrad form: ``[rows, k] @ [k, n]``, the tokens are M. Weight-gradient form
    (``wgrad=True``): ``[n, rows] @ [rows, k]``, the tokens are the contraction. Either way the
    token dimension is padded to ``profile.gemm_tile_rows`` and sets the efficiency.
    """
    if not rows >= 0:
        raise ValueError(f"expected rows >= 0, but got {rows}")
    _positive("n", n)
    _positive("k", k)
    profile.check_precision(precision)
    if rows == 0:
        return 0.0
    tile = profile.gemm_tile_rows
    rows_pad = math.ceil(rows / tile) * tile
    # the kernel runs whole tiles, so the padded rows set both the work and the efficiency
    return 2.0 * rows_pad * n * k / profile.gemm_flops(precision, rows_pad, wgrad)


def grouped_gemm_time_s(profile: DeviceProfile, precision: str, counts, n: int, k: int,
                        wgrad: bool = False) -> float:
    """Seconds of one grouped GEMM over groups of ``counts[g]`` token rows each (see
    :func:`gemm_time_s` for the forms), with one call overhead and one per non-empty group."""
    counts = as_counts(counts)
    groups = [c for c in counts if c > 0]
    if not groups:
        return 0.0
    body = sum(gemm_time_s(profile, precision, c, n, k, wgrad) for c in groups)
    return profile.gemm_call_s + profile.per_group_s * len(groups) + body


def expert_ffn_gemm_calls(gated: bool = True) -> int:
    """Grouped GEMM calls of :func:`expert_ffn_time`, forward + backward: one ``torch.mm``
    per non-empty group each in the CPU kernel. Gated (separate ``w1``, ``w3``): gate, up and
    down forward; ``dA``, two ``dX`` halves, and the ``w2``, ``w1``, ``w3`` gradients
    backward (9). Plain: up, down; ``dA``, ``dX``, ``w2`` and ``w1`` gradients (6)."""
    return 9 if gated else 6


@dataclass(frozen=True)
class ExpertFFNTime:
    """Seconds of one rank's expert FFN (its local experts) for one micro-batch.

    ``forward_s``: up (``[n, D] @ [D, H]``, ``H = 2F`` gated) and down (``[n, F] @ [F, D]``).
    ``dgrad_s``: the two input-gradient GEMMs. ``wgrad_s``: the two weight-gradient GEMMs,
    contraction over the tokens. ``recompute_s``: forward GEMMs redone in backward.
    """

    forward_s: float
    dgrad_s: float
    wgrad_s: float
    recompute_s: float = 0.0

    @property
    def backward_s(self) -> float:
        return self.dgrad_s + self.wgrad_s + self.recompute_s

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def expert_ffn_time(profile: DeviceProfile, precision: str, counts, dim: int, hidden_dim: int,
                    gated: bool = True, recompute_up: bool = False) -> ExpertFFNTime:
    """GEMM time of the local experts' FFN from their token counts.

    Args:
        counts: ``[E_local]`` token rows per local expert (a tensor or list).
        dim: ``D``. hidden_dim: ``F`` of one expert on this rank (already divided by the
            expert-tensor-parallel degree).
        gated: SwiGLU-style (``H = 2F``) rather than a plain activation (``H = F``).
        recompute_up: the up projection is recomputed in backward (its output not saved).

    This mirrors the GEMMs ``grouped_ffn`` / ``grouped_ffn_backward`` of
    ``torch_moe/_native/cpu.py`` issue per group, in their shapes (``[M, K] @ [K, N]``, the
    token-major form unless the tokens are the contraction): forward, gate and up
    ``[n, D] @ [D, F]`` each (gated experts hold ``w1`` and ``w3`` apart) and down
    ``[n, F] @ [F, D]``; backward, ``dA = G w2^T`` ``[n, D] @ [D, F]``, ``dX`` ``[n, F] @
    [F, D]`` per up-projection matrix, and the weight gradients ``[F, n] @ [n, D]`` (w2) and
    ``[D, n] @ [n, F]`` per up-projection matrix. The activation is always recomputed from
    the saved ``hidden`` (elementwise, not counted here); backward is twice the forward FLOPs.

    Each pass also pays the profile's ``gemm_create_s`` once per distinct group size and GEMM
    form (2 forms forward; ``dA``, ``dX``, its ``addmm_`` half and the two weight-gradient
    forms backward, 5 gated): a library that prepares a kernel per shape (oneDNN's bf16
    primitives on a CPU) finds none of a call's shapes prepared when the group sizes changed
    since it last saw them, as they do every training step, or when other layers' shapes
    filled its cache since. A size shared by several groups is prepared once.
    """
    _positive("dim", dim)
    _positive("hidden_dim", hidden_dim)
    ups = 2 if gated else 1
    D, F = dim, hidden_dim
    up = ups * grouped_gemm_time_s(profile, precision, counts, F, D)
    down = grouped_gemm_time_s(profile, precision, counts, D, F)
    dgrad = (grouped_gemm_time_s(profile, precision, counts, F, D)  # dA = G w2^T
             + ups * grouped_gemm_time_s(profile, precision, counts, D, F))  # dX = dH w^T
    wgrad = (grouped_gemm_time_s(profile, precision, counts, F, D, wgrad=True)  # act^T G
             + ups * grouped_gemm_time_s(profile, precision, counts, D, F, wgrad=True))
    # Set-up of the GEMM shapes this call issues (profile.gemm_create_s): one per distinct group
    # size and GEMM form; gate and up (and the w1 and w3 gradients) share a form, the second
    # dX half is an addmm_ of its own. Recomputed up projections reuse the forward's.
    create = sum(profile.gemm_create_time_s(precision, m) for m in _distinct_sizes(counts))
    fwd_forms, dgrad_forms, wgrad_forms = 2, (3 if gated else 2), 2
    return ExpertFFNTime(up + down + fwd_forms * create, dgrad + dgrad_forms * create,
                         wgrad + wgrad_forms * create, up if recompute_up else 0.0)


def _distinct_sizes(counts) -> list[int]:
    """The distinct row counts of the non-empty groups (expected counts rounded, at least 1):
    each is a GEMM shape of its own, whichever expert has it."""
    return sorted({max(1, round(c)) for c in as_counts(counts) if c > 0})


def ffn_elementwise_bytes(rows: float, tokens: float, dim: int, hidden_dim: int,
                          gated: bool = True, act_bytes: int = 2) -> tuple[float, float]:
    """``(forward_bytes, backward_bytes)`` read + written by the elementwise kernels around the
    expert GEMMs of ``grouped_ffn`` (``torch_moe/_native/cpu.py``) for ``rows`` expert rows
    from ``tokens`` tokens, with activations of ``act_bytes`` per element (``H = 2F`` gated):
    the sums of :func:`ffn_elementwise_split_bytes`."""
    (fwd_d, fwd_h), (bwd_d, bwd_h) = ffn_elementwise_split_bytes(rows, tokens, dim, hidden_dim,
                                                                 gated, act_bytes)
    return fwd_d + fwd_h, bwd_d + bwd_h


def ffn_elementwise_split_bytes(rows: float, tokens: float, dim: int, hidden_dim: int,
                                gated: bool = True, act_bytes: int = 2):
    """``((forward_dim, forward_hidden), (backward_dim, backward_hidden))``: the bytes of
    :func:`ffn_elementwise_bytes` split between the kernels on rows of the model width ``D``
    and those on rows of the hidden width (``F``, ``H``), which run at different rates on a
    CPU (the activation's ``exp`` against gathers and adds; the profile's
    ``elementwise_bandwidth_Bps`` and ``elementwise_hidden_Bps``).

    Width ``D``, forward: gather the rows' inputs (read + write ``D``), scale the ``D`` outputs
    by the routing weight (read + write) and scatter-add them (read ``D``) into the fp32
    ``[T, D]`` accumulator (zero-filled, then read + write; converted to the activations'
    dtype at the end when that is not fp32); backward: gather the output gradient (``2D``),
    gather the inputs again (``2D``) and scatter-add the input gradient (``D`` plus the
    ``[T, D]`` fp32 accumulator, as in forward). Hidden width, forward: read ``H`` and write
    ``F`` for the activation; backward: recompute it (``H + F``), the routing-weight gradient
    (read ``2F``), two weight scalings (``2F`` each), the activation's backward (read
    ``F + H``, write ``H``)."""
    if not (rows >= 0 and tokens >= 0):
        raise ValueError(f"expected rows and tokens >= 0, but got {rows}, {tokens}")
    _positive("dim", dim)
    _positive("hidden_dim", hidden_dim)
    h = 2 * hidden_dim if gated else hidden_dim
    f = hidden_dim
    # the fp32 [T, D] accumulator: zero-filled (write), summed into (read + write) and, in a
    # layer of another dtype, converted to it (read 4 B, write act_bytes)
    acc = tokens * dim * (4 * 3 + ((4 + act_bytes) if act_bytes != 4 else 0))
    fwd_d = rows * act_bytes * (2 * dim + 2 * dim + dim) + acc
    bwd_d = rows * act_bytes * (2 * dim + 2 * dim + dim) + acc
    fwd_h = rows * act_bytes * (h + f)
    bwd_h = rows * act_bytes * (h + f + 2 * f + 4 * f + f + 2 * h)
    return (fwd_d, fwd_h), (bwd_d, bwd_h)


def ffn_fresh_allocations(rows: float, tokens: float, dim: int, hidden_dim: int,
                          num_local_experts: int, gated: bool = True,
                          act_bytes: int = 2) -> tuple[list[float], list[float]]:
    """``(forward_sizes, backward_sizes)`` in bytes of the buffers ``grouped_ffn`` allocates
    anew on every call: forward's ``hidden [S, H]`` and fp32 ``[T, D]`` accumulator; backward's
    fp32 ``grad_x [T, D]`` and one gradient per weight matrix. Priced by
    :func:`fresh_alloc_time_s`."""
    h = 2 * hidden_dim if gated else hidden_dim
    w_grad = num_local_experts * dim * hidden_dim * act_bytes
    return ([rows * h * act_bytes, tokens * dim * 4],
            [tokens * dim * 4] + [w_grad] * (3 if gated else 2))


def element_bytes(precision: str) -> int:
    """Bytes per element of a GEMM operand in ``precision``."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: expected one of {PRECISIONS}")
    return {"bf16": 2, "fp8_rowwise": 1, "mxfp8": 1, "fp32": 4}[precision]


def scale_bytes(precision: str, rows: float, cols: int) -> float:
    """Scale bytes of a ``[rows, cols]`` operand quantized along ``cols``.

    FP8 rowwise: one fp32 scale per row. MXFP8: one E8M0 byte per 32-element block, in the
    swizzled layout Blackwell GEMMs read, padded to 128-row x 4-column tiles
    (``round_up(rows, 128) * round_up(ceil(cols / 32), 4)``: the 128 x 4 padding of
    https://docs.nvidia.com/deeplearning/transformer-engine/user-guide/api/c/swizzle.html).
    bf16 / fp32: none.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: expected one of {PRECISIONS}")
    if not rows >= 0:
        raise ValueError(f"expected rows >= 0, but got {rows}")
    _positive("cols", cols)
    if rows == 0 or precision in ("bf16", "fp32"):
        return 0.0
    if precision == "fp8_rowwise":
        return 4.0 * rows
    blocks = math.ceil(cols / MX_BLOCK_SIZE)
    return float(math.ceil(rows / 128) * 128 * math.ceil(blocks / 4) * 4)


def quantize_time_s(profile: DeviceProfile, precision: str, rows: float, cols: int,
                    source_bytes: int = 2) -> float:
    """Seconds to quantize a ``[rows, cols]`` tensor (read at ``source_bytes`` per element,
    bf16 by default) to ``precision``: memory bound, read + FP8 write + scales, over the
    memory bandwidth. Zero for bf16 / fp32 (nothing to do)."""
    if precision in ("bf16", "fp32"):
        element_bytes(precision)
        return 0.0
    moved = rows * cols * (source_bytes + element_bytes(precision))
    moved += scale_bytes(precision, rows, cols)
    return moved / profile.memory_bandwidth_Bps


def fresh_alloc_time_s(profile: DeviceProfile, sizes_bytes) -> float:
    """Page-fault seconds of fresh allocations of ``sizes_bytes``: each allocation at or above
    the profile's threshold pays ``page_fault_s_per_byte`` on every byte (glibc maps it fresh);
    smaller ones come from the heap for free."""
    total = 0.0
    for size in sizes_bytes:
        if not size >= 0:
            raise ValueError(f"expected allocation sizes >= 0, but got {size}")
        if size >= profile.fresh_alloc_threshold_bytes:
            total += size * profile.page_fault_s_per_byte
    return total
