"""A second CPU kernel of ``torch_moe::grouped_mm`` for ``a [M, K] x b [G, K, N]``, the one the
lowering offers next to the per-group kernel when Inductor autotunes (``mode="max-autotune"``).

The per-group kernel (:func:`torch_moe._native.cpu.grouped_mm`) runs one GEMM per non-empty
group: with many small groups (a fine-grained MoE layer on few tokens) the per-call overhead of
``mm`` dominates. This kernel copies the rows of group ``g`` into ``A[g, :rows_g]`` of a
zero-filled ``A [G, L, K]`` (``L`` the longest group), runs one ``bmm(A, b) -> C [G, L, N]`` and
copies the rows of each group back. It pays for the copies and for the padding rows' flops, so
it is faster for small groups only; where the padding would exceed
:data:`MAX_PADDED_ROWS_PER_ROW` padded rows per real row (a skewed routing) it runs the
per-group kernel instead, as the choice autotuning made on balanced groups may meet other loads.

Numerics follow the per-group kernel's (not bitwise: ``bmm`` may sum the contraction in another
order): GEMMs in ``gemm_compute_dtype`` (fp32 for bf16 / fp16
where the CPU has no native instructions), one rounding to the output dtype, rows past
``offs[-1]`` zero. Padding rows of ``A`` are zeros, never copies of real rows, so a NaN or Inf
in a real row does not reach another group or a row past ``offs[-1]``. Errors are the per-group
kernel's: the same checks, with the same messages, run first.
"""

import torch

from torch_moe import _checks
from torch_moe._native import cpu as native_cpu
from torch_moe._native._cpu_features import gemm_compute_dtype

__all__ = ["MAX_PADDED_ROWS_PER_ROW", "grouped_mm_padded_bmm"]

# G * L (the rows the batched GEMM computes) at most this many times offs[-1] (the rows it needs)
MAX_PADDED_ROWS_PER_ROW = 2


def grouped_mm_padded_bmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch_moe::grouped_mm`` of ``a [M, K]`` and ``b [G, K, N]`` with ``offs [G]`` as one
    padded ``bmm``: ``out [M, N]``, ``out[rows_g] = a[rows_g] @ b[g]``, zero past ``offs[-1]``."""
    op = "torch_moe.grouped_mm"
    _checks.check_grouped_mm(a, b, offs)
    torch._check(
        a.dim() == 2 and b.dim() == 3,
        lambda: f"{op} (padded bmm): expected self [M, K] and mat2 [G, K, N], but got "
        f"{a.dim()}D and {b.dim()}D",
    )
    bounds, last = native_cpu._group_bounds(op, offs, a.size(0), "self.size(0)")
    G, N = b.size(0), b.size(2)
    longest = max((e - s for _, s, e in bounds), default=0)
    if G * longest > MAX_PADDED_ROWS_PER_ROW * last:
        return native_cpu.grouped_mm(a, b, offs)
    out = a.new_empty((a.size(0), N))
    out[last:].zero_()
    if last == 0 or N == 0:
        return out
    cdt = gemm_compute_dtype(a.dtype)
    ends = offs.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    # valid[g, j]: row j of group g is a real row. Row-major order of the True entries is the
    # order of the rows [0, offs[-1]) of a, as the groups are consecutive and non-decreasing.
    valid = torch.arange(longest, device=a.device).unsqueeze(0) < counts.unsqueeze(1)
    A = torch.zeros((G, longest, a.size(1)), dtype=cdt, device=a.device)
    A[valid] = a[:last].to(cdt)
    C = torch.bmm(A, b if b.dtype == cdt else b.to(cdt))
    out[:last] = C[valid]
    return out
