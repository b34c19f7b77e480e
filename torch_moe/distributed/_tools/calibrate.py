"""Measure the local machine into a :class:`DeviceProfile` with a short microbenchmark.

What is measured, and the profile field each sets:

* GEMM throughput against rows per group (``[rows, D] @ [D, 2F]``, the up projection of an
  expert) and for the weight-gradient form (``[D, rows] @ [rows, 2F]``): ``peak_flops`` (the
  best rate seen), ``gemm_efficiency`` and ``wgrad_efficiency`` (rate / peak);
* the fixed cost of one tiny ``torch.mm`` call: ``per_group_s`` (the CPU grouped FFN is a
  Python loop of ``torch.mm``);
* ``copy_`` into an existing buffer: ``memory_bandwidth_Bps`` (read + write);
* a fresh ``empty`` + ``fill_`` above glibc's 32 MiB mmap threshold against the same on a
  reused buffer: ``page_fault_s_per_byte``;
* optionally, with a process group, ``all_to_all_single`` at two sizes: the latency and
  bandwidth of both link fields (one machine has one link).

A full run stays well under a minute on two cores; ``quick=True`` runs tiny sizes once, to
check the plumbing (its numbers mean nothing). Timings take the median of ``reps`` runs after
one warm-up. The machine is shared: calibrate when it is quiet.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from torch_moe.distributed._tools.device_profiles import LOCAL_CPU_NOTES, DeviceProfile

__all__ = [
    "measure_gemm_curve",
    "measure_call_overhead_s",
    "measure_copy_bandwidth_Bps",
    "measure_page_fault_s_per_byte",
    "measure_all_to_all",
    "fit_efficiency_curve",
    "calibrate_local",
    "save_profile",
    "load_profile",
]

_MiB = 2**20


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up: first-touch, oneDNN primitive creation
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _check_reps(reps) -> None:
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"expected reps to be a positive int, but got {reps!r}")


def measure_gemm_curve(rows, dim: int, hidden_dim: int, dtype: torch.dtype = torch.bfloat16,
                       wgrad: bool = False, reps: int = 5) -> list[tuple[int, float]]:
    """``[(rows, FLOP/s)]`` of the expert up projection (``wgrad=False``: ``[rows, D] @
    [D, 2F]``) or of its weight gradient (``wgrad=True``: ``[D, rows] @ [rows, 2F]``)."""
    _check_reps(reps)
    if dim < 1 or hidden_dim < 1 or not rows or any(r < 1 for r in rows):
        raise ValueError(f"expected positive rows, dim and hidden_dim, but got rows={rows}, "
                         f"dim={dim}, hidden_dim={hidden_dim}")
    n = 2 * hidden_dim
    out = []
    for r in rows:
        if wgrad:
            a = torch.randn(r, dim, dtype=dtype).t()
            b = torch.randn(r, n, dtype=dtype)
            c = torch.empty(dim, n, dtype=dtype)
        else:
            a = torch.randn(r, dim, dtype=dtype)
            b = torch.randn(dim, n, dtype=dtype)
            c = torch.empty(r, n, dtype=dtype)
        # ~1 ms of work per timing at ~100 GFLOP/s, so the timer resolution does not matter
        calls = min(1000, max(1, int(1e8 / (2 * r * dim * n))))

        def run():
            for _ in range(calls):
                torch.mm(a, b, out=c)

        t = _median_s(run, reps) / calls
        out.append((int(r), 2.0 * r * dim * n / t))
    return out


def measure_call_overhead_s(reps: int = 5, calls: int = 2000) -> float:
    """Seconds of one ``torch.mm`` on 1 x 8 x 8 operands: the per-group cost of the loop."""
    _check_reps(reps)
    a, b = torch.randn(1, 8), torch.randn(8, 8)
    c = torch.empty(1, 8)

    def run():
        for _ in range(calls):
            torch.mm(a, b, out=c)

    return _median_s(run, reps) / calls


def measure_copy_bandwidth_Bps(nbytes: int = 64 * _MiB, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by ``copy_`` between existing buffers."""
    _check_reps(reps)
    n = max(1, nbytes // 4)
    src, dst = torch.ones(n), torch.empty(n)
    return 2 * n * 4 / _median_s(lambda: dst.copy_(src), reps)


def measure_page_fault_s_per_byte(nbytes: int = 64 * _MiB, reps: int = 5) -> float:
    """Extra seconds per byte of a fresh ``empty`` + ``fill_`` over a reused buffer's ``fill_``
    (zero when the size is below the allocator's fresh-mapping threshold)."""
    _check_reps(reps)
    n = max(1, nbytes // 4)
    reused = torch.empty(n)
    t_reused = _median_s(lambda: reused.fill_(0), reps)
    t_fresh = _median_s(lambda: torch.empty(n).fill_(0), reps)
    return max(0.0, t_fresh - t_reused) / (n * 4)


def measure_all_to_all(group, small_bytes: int = 1024, large_bytes: int = 4 * _MiB,
                       reps: int = 5) -> tuple[float, float]:
    """``(latency_s, bandwidth_Bps)`` of ``all_to_all_single`` on ``group``, each rank sending
    ``small_bytes`` then ``large_bytes`` in total: a line through the two points. Collective:
    every rank of ``group`` must call it."""
    import torch.distributed as dist

    _check_reps(reps)
    world = dist.get_world_size(group)

    def timed(nbytes):
        n = max(world, nbytes // 4 // world * world)
        x, y = torch.ones(n), torch.empty(n)

        def run():
            dist.all_to_all_single(y, x, group=group)

        return _median_s(run, reps), n * 4

    t_small, b_small = timed(small_bytes)
    t_large, b_large = timed(large_bytes)
    # rank 0's view is broadcast so every rank builds the same profile
    t = torch.tensor([t_small, t_large], dtype=torch.float64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    t_small, t_large = t.tolist()
    slope = max(t_large - t_small, 1e-12) / (b_large - b_small)
    return max(0.0, t_small - slope * b_small), 1.0 / slope


def fit_efficiency_curve(points, peak: float) -> tuple[tuple[float, float], ...]:
    """Turns ``[(rows, FLOP/s)]`` into ``((rows, fraction of peak), ...)`` that the cost model
    accepts: fractions clipped to (0, 1], and measurement noise that would make more rows
    faster in total (fraction growing faster than the rows) flattened."""
    if not points or not peak > 0:
        raise ValueError(f"expected measured points and a positive peak, got {points}, {peak}")
    pts = sorted((float(r), min(1.0, max(f / peak, 1e-6))) for r, f in points)
    out = [pts[0]]
    for r, e in pts[1:]:
        r0, e0 = out[-1]
        if r == r0:
            continue
        out.append((r, min(e, e0 * r / r0)))
    return tuple(out)


def calibrate_local(dim: int = 1024, hidden_dim: int = 256, quick: bool = False, group=None,
                    name: str = "local-cpu") -> DeviceProfile:
    """Measure this machine. ``dim`` and ``hidden_dim`` set the GEMM shapes (use the layer's
    own); ``group`` adds the all-to-all fit (collective: all ranks call together)."""
    if quick:
        rows, reps = (4, 32, 256), 1
        dim, hidden_dim = min(dim, 128), min(hidden_dim, 64)
        copy_bytes, fault_bytes = 4 * _MiB, 40 * _MiB
    else:
        rows, reps = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), 5
        copy_bytes, fault_bytes = 64 * _MiB, 64 * _MiB
    fwd = measure_gemm_curve(rows, dim, hidden_dim, torch.bfloat16, False, reps)
    wgr = measure_gemm_curve(rows, dim, hidden_dim, torch.bfloat16, True, reps)
    peak_bf16 = max(f for _, f in fwd + wgr)
    big = rows[-1]
    (_, peak_fp32), = measure_gemm_curve((big,), dim, hidden_dim, torch.float32, False, reps)
    if group is not None:
        alpha, bw = measure_all_to_all(group, reps=reps)
    else:
        alpha, bw = LOCAL_CPU_NOTES.intra_node_latency_s, LOCAL_CPU_NOTES.intra_node_bandwidth_Bps
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = LOCAL_CPU_NOTES.memory_bytes
    return DeviceProfile(
        name=name,
        peak_flops={"bf16": peak_bf16, "fp32": peak_fp32},
        memory_bytes=float(ram),
        memory_bandwidth_Bps=measure_copy_bandwidth_Bps(copy_bytes, reps),
        intra_node_bandwidth_Bps=bw,
        intra_node_latency_s=alpha,
        inter_node_bandwidth_Bps=bw,
        inter_node_latency_s=alpha,
        gemm_tile_rows=1,
        gemm_efficiency=fit_efficiency_curve(fwd, peak_bf16),
        wgrad_efficiency=fit_efficiency_curve(wgr, peak_bf16),
        gemm_call_s=0.0,
        per_group_s=measure_call_overhead_s(reps, 200 if quick else 2000),
        fresh_alloc_threshold_bytes=32 * _MiB,
        page_fault_s_per_byte=measure_page_fault_s_per_byte(fault_bytes, reps),
        sources=(f"calibrate_local(dim={dim}, hidden_dim={hidden_dim}, quick={quick}) on "
                 f"{torch.get_num_threads()} threads, torch {torch.__version__}",),
    )


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        f.write(profile.to_json())


def load_profile(path: str) -> DeviceProfile:
    with open(path) as f:
        return DeviceProfile.from_json(f.read())

