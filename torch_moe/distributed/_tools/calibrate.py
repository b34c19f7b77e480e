"""Measure the local machine into a :class:`DeviceProfile` with a short microbenchmark.

What is measured, and the profile field each sets. Each benchmark mirrors what the CPU kernel
of ``grouped_ffn`` (``torch_moe/_native/cpu.py``) does, in the dtype it computes in:

* GEMM throughput against rows per group, token-major (``[rows, D] @ [D, F]`` and ``[rows, F]
  @ [F, D]``) and weight-gradient forms (``[D, rows] @ [rows, F]``, ``[F, rows] @ [rows, D]``),
  each call on a different expert's matrix: ``peak_flops`` (the best rate seen),
  ``gemm_efficiency`` and ``wgrad_efficiency`` (rate / peak);
* the kernel's host work per non-empty group and grouped GEMM, on one-row groups:
  ``per_group_s``;
* its elementwise kernels (gather, SwiGLU forward / backward, weighting, scatter-add) block by
  block: ``elementwise_bandwidth_Bps``;
* forward + backward of a minimal ``MoE`` layer: ``layer_overhead_s``;
* ``copy_`` into an existing buffer: ``memory_bandwidth_Bps`` (read + write);
* a fresh ``empty`` + ``fill_`` above glibc's 32 MiB mmap threshold against the same on a
  reused buffer: ``page_fault_s_per_byte``;
* optionally, with a process group, ``all_to_all_single`` at two sizes: the latency and
  bandwidth of both link fields (one machine has one link); then ``expert_parallel_moe_ffn``
  on a uniform load: ``dispatch_row_s``, the host work per dispatched row the rest leaves out.

Last, the GEMM curves are reconciled with ``grouped_ffn`` itself run on uniform loads
(:func:`fit_to_grouped_ffn`).

A full run stays well under a minute on two cores; ``quick=True`` runs tiny sizes once, to
check the plumbing (its numbers mean nothing). Timings take the median of ``reps`` runs after
one warm-up (the GEMM curve: of ``reps`` passes over all row counts). The machine is shared:
calibrate when it is quiet, and bracket long measurements (:func:`average_profiles`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from torch_moe.distributed._tools.device_profiles import REFERENCE_CPU, DeviceProfile

__all__ = [
    "measure_gemm_curve",
    "measure_group_overhead_s",
    "measure_grouped_ffn_s",
    "fit_to_grouped_ffn",
    "measure_dispatch_row_s",
    "measure_ffn_elementwise_Bps",
    "measure_layer_overhead_s",
    "measure_copy_bandwidth_Bps",
    "measure_page_fault_s_per_byte",
    "measure_all_to_all",
    "fit_efficiency_curve",
    "calibrate_local",
    "average_profiles",
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


def measure_gemm_curve(rows, dim: int, hidden_dim: int, dtype: torch.dtype = torch.float32,
                       wgrad: bool = False, reps: int = 5,
                       experts_bytes: int = 64 * _MiB) -> list[tuple[int, float]]:
    """``[(rows, FLOP/s)]`` of the per-expert GEMMs of ``grouped_ffn`` on this CPU, with a
    ``rows``-row group: ``wgrad=False`` times the token-major forms ``[rows, D] @ [D, F]`` and
    ``[rows, F] @ [F, D]`` (gate / up and down projections, and their input gradients);
    ``wgrad=True`` the weight-gradient forms ``[D, rows] @ [rows, F]`` and ``[F, rows] @
    [rows, D]``, where the tokens are the contraction. Each point is the two shapes' FLOPs over
    their summed time, as the kernel runs both in equal numbers.

    Consecutive GEMMs read a different expert's weight (forward forms) or write a different
    expert's gradient (weight-gradient forms), cycling over ``experts_bytes`` of them: in the
    kernel every group touches its own expert, so a small group pays for bringing a whole
    ``D x F`` matrix from memory, which a benchmark reusing one cached matrix would hide."""
    _check_reps(reps)
    if dim < 1 or hidden_dim < 1 or not rows or any(r < 1 for r in rows):
        raise ValueError(f"expected positive rows, dim and hidden_dim, but got rows={rows}, "
                         f"dim={dim}, hidden_dim={hidden_dim}")
    experts = max(1, experts_bytes // (dim * hidden_dim * torch.finfo(dtype).bits // 8))
    shapes = ((dim, hidden_dim), (hidden_dim, dim))
    # the experts' weights (forward forms) or gradients (weight-gradient forms), shared by
    # every row count
    mats = [torch.randn(experts, k_, n_, dtype=dtype) for k_, n_ in shapes]
    runners = []
    for r in rows:
        operands = []
        for (k_, n_), m in zip(shapes, mats):
            if wgrad:
                # [K, rows] @ [rows, N]: the transposed view of a token-major [rows, K], as
                # grouped_ffn_backward passes it, into one expert's gradient
                a, b = torch.randn(r, k_, dtype=dtype).t(), torch.randn(r, n_, dtype=dtype)
                operands.append([(a, b, c) for c in m])
            else:
                # the gate / up projections write the halves of a [rows, 2F] buffer, so their
                # outputs are row-strided views, as in grouped_ffn
                a = torch.randn(r, k_, dtype=dtype)
                c = torch.empty(r, 2 * n_, dtype=dtype)[:, :n_] if n_ == hidden_dim else \
                    torch.empty(r, n_, dtype=dtype)
                operands.append([(a, b, c) for b in m])
        # ~20 ms of work per timing at ~100 GFLOP/s
        calls = max(1, min(10000, int(2e9 / (4.0 * r * dim * hidden_dim))))
        runners.append((r, calls, operands))

    def run(calls, operands, start):
        # every call meets an expert that has not been touched for a whole cycle
        for i in range(start, start + calls):
            for ops_ in operands:
                a, b, c = ops_[i % experts]
                torch.mm(a, b, out=c)

    # Passes over all row counts rather than all repetitions of one count: a slow phase of a
    # shared machine then spreads over the curve instead of bending one point.
    times = {r: [] for r in rows}
    for p in range(reps + 1):
        for r, calls, operands in runners:
            t0 = time.perf_counter()
            run(calls, operands, p * calls)
            if p:  # the first pass is the warm-up
                times[r].append((time.perf_counter() - t0) / calls)
    return [(int(r), 4.0 * r * dim * hidden_dim / statistics.median(times[r])) for r in rows]


def measure_group_overhead_s(reps: int = 5, groups: int = 256) -> float:
    """Seconds of host work per non-empty group and grouped GEMM call inside ``grouped_ffn``
    forward + backward (slicing, weight views, the ``torch.mm`` call itself), measured on
    ``groups`` one-row groups of an 8-wide expert, where the arithmetic is negligible, against
    a single group. The cost model charges it on each of the grouped GEMMs of
    ``gemm_cost.expert_ffn_time``."""
    _check_reps(reps)

    def timed(num_groups):
        d = 8
        x = torch.randn(num_groups, d)
        w1, w2, w3 = (torch.randn(num_groups, d, d) for _ in range(3))
        sorted_ids = torch.arange(num_groups)
        offs = torch.arange(1, num_groups + 1, dtype=torch.int32)
        weights = torch.ones(num_groups, 1)
        ops = torch.ops.torch_moe

        def run():
            y, hidden = ops.grouped_ffn(x, sorted_ids, offs, weights, w1, w2, w3, "swiglu",
                                        1.702, 7.0)
            ops.grouped_ffn_backward(y, x, sorted_ids, offs, weights, w1, w2, w3, hidden,
                                     "swiglu", 1.702, 7.0, [True] * 5)

        return _median_s(run, reps)

    from torch_moe.distributed._tools.gemm_cost import EXPERT_FFN_GROUPED_CALLS

    return max(0.0, timed(groups) - timed(1)) / (groups - 1) / EXPERT_FFN_GROUPED_CALLS


def measure_grouped_ffn_s(rows, dim: int, hidden_dim: int, dtype: torch.dtype = torch.float32,
                          reps: int = 5, total_rows: int = 8192,
                          max_groups: int = 64) -> list[tuple[int, int, float]]:
    """``[(rows, groups, seconds)]`` of ``grouped_ffn`` forward + backward (SwiGLU) on a uniform
    synthetic load: ``groups`` experts of ``rows`` rows each, one row per token. The kernel
    as a whole, with its GEMMs, elementwise kernels, host work and allocations interleaved as
    they are in a layer; :func:`fit_to_grouped_ffn` reconciles the part-wise curves with it.
    Row counts are timed in interleaved passes, like :func:`measure_gemm_curve`."""
    _check_reps(reps)
    ops = torch.ops.torch_moe
    cases = []
    g = torch.Generator().manual_seed(0)
    for r in rows:
        G = max(1, min(max_groups, total_rows // r))
        S = G * r
        x = torch.randn(S, dim, generator=g, dtype=dtype)
        # weights at nn.Linear's scale, so activations have the magnitudes of a real layer
        w1, w3 = (torch.randn(G, dim, hidden_dim, generator=g, dtype=dtype) / dim ** 0.5
                  for _ in range(2))
        w2 = torch.randn(G, hidden_dim, dim, generator=g, dtype=dtype) / hidden_dim ** 0.5
        sorted_ids = torch.arange(S)
        offs = torch.arange(1, G + 1, dtype=torch.int32) * r
        weights = torch.rand(S, 1, generator=g)
        grad = torch.randn(S, dim, generator=g, dtype=dtype)
        cases.append((r, G, (x, sorted_ids, offs, weights, w1, w2, w3), grad))

    def run(args, grad):
        y, hidden = ops.grouped_ffn(*args, "swiglu", 1.702, 7.0)
        ops.grouped_ffn_backward(grad, args[0], args[1], args[2], args[3], args[4], args[5],
                                 args[6], hidden, "swiglu", 1.702, 7.0, [True] * 5)

    times = {r: [] for r, *_ in cases}
    for p in range(reps + 1):
        for r, G, args, grad in cases:
            t0 = time.perf_counter()
            run(args, grad)
            if p:
                times[r].append(time.perf_counter() - t0)
    return [(r, G, statistics.median(times[r])) for r, G, *_ in cases]


def fit_to_grouped_ffn(profile: DeviceProfile, measured, dim: int, hidden_dim: int,
                       precision: str = "fp32") -> DeviceProfile:
    """Scale ``profile``'s GEMM curves so that the cost model's ``grouped_ffn`` time matches
    ``measured`` (from :func:`measure_grouped_ffn_s`) at each row count.

    The part-wise benchmarks time each GEMM shape in a tight loop of its own; inside the kernel
    the GEMMs alternate with gathers, activations and scatter-adds that evict their operands,
    and run at another rate (0.7 to 1.05 of the isolated one across runs on the development
    machine; more than 1 on one thread). With the model's own elementwise, host and page-fault terms taken
    out of the measured time, what is left is the kernel's GEMM time; the ratio to the modelled
    GEMM time scales both curves at that row count (interpolated in between, clamped at the
    ends), keeping the forward / weight-gradient ratio the part-wise benchmarks saw. The peak
    stays; a fraction that would pass 1 is capped, and the curves keep growing no faster than
    the rows (:func:`fit_efficiency_curve`)."""
    from torch_moe.distributed._tools import gemm_cost

    act_b = 4 if precision == "fp32" else 2
    scale = []
    for r, G, seconds in measured:
        counts = [float(r)] * G
        t = gemm_cost.expert_ffn_time(profile, precision, counts, dim, hidden_dim)
        # the GEMMs' arithmetic alone: the per-call and per-group host costs are measured
        calls = gemm_cost.EXPERT_FFN_GROUPED_CALLS * (profile.gemm_call_s
                                                      + profile.per_group_s * G)
        gemm = t.total_s - calls
        S = float(r * G)
        ew = sum(gemm_cost.ffn_elementwise_bytes(S, S, dim, hidden_dim, True, act_b))
        alloc_f, alloc_b = gemm_cost.ffn_fresh_allocations(S, S, dim, hidden_dim, G, True,
                                                           act_b)
        other = calls + ew / profile.elementwise_Bps + gemm_cost.fresh_alloc_time_s(
            profile, alloc_f + alloc_b)
        # a measurement below the modelled non-GEMM part is noise; never scale by more than 4x
        scale.append((float(r), min(4.0, max(0.25, gemm / max(seconds - other, gemm / 4)))))
    curve_scale = tuple(scale)
    peak = profile.peak_flops.get(precision, max(profile.peak_flops.values()))

    def rescaled(curve):
        from torch_moe.distributed._tools.device_profiles import _interp

        return fit_efficiency_curve(
            [(x, peak * min(1.0, e * _interp(curve_scale, x))) for x, e in curve], peak)

    return dataclasses.replace(
        profile, gemm_efficiency=rescaled(profile.gemm_efficiency),
        wgrad_efficiency=rescaled(profile.wgrad_efficiency),
        sources=profile.sources + (
            "GEMM curves scaled to grouped_ffn at rows " + ", ".join(
                f"{int(x)}: {f:.2f}" for x, f in curve_scale),))


def measure_ffn_elementwise_Bps(dim: int, hidden_dim: int, rows: int = 4096,
                                dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """Rate of the elementwise kernels ``grouped_ffn`` runs around its GEMMs on one block of
    ``rows`` rows (SwiGLU), forward and backward, in the bytes
    :func:`~torch_moe.distributed._tools.gemm_cost.ffn_elementwise_bytes` counts for them:
    the same ATen calls on buffers of the same shapes, without the GEMMs."""
    from torch_moe._native._cpu_features import accumulate_dtype
    from torch_moe._native.activation import activation_backward, activation_forward
    from torch_moe._native.cpu import _BLOCK_ROWS as block
    from torch_moe.distributed._tools.gemm_cost import ffn_elementwise_bytes

    _check_reps(reps)
    D, F, n = dim, hidden_dim, rows
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(n, D, generator=g, dtype=dtype), torch.randn(n, D, generator=g,
                                                                       dtype=dtype)
    idx = torch.randperm(n, generator=g)
    w = torch.rand(n, 1, generator=g, dtype=dtype)
    h = torch.randn(n, 2 * F, generator=g, dtype=dtype)
    X, G, o, dX = (torch.empty(n, D, dtype=dtype) for _ in range(4))
    act, dA = torch.empty(n, F, dtype=dtype), torch.randn(n, F, generator=g, dtype=dtype)
    dH = torch.empty(n, 2 * F, dtype=dtype)
    acc = torch.zeros(n, D, dtype=accumulate_dtype(dtype))

    def add_rows(i, src):
        # the kernel converts each block to the accumulation dtype before index_add_
        acc.index_add_(0, i, src if src.dtype == acc.dtype else src.to(acc.dtype))

    def run():
        # block by block, as the kernel walks its rows (torch_moe/_native/cpu.py: _BLOCK_ROWS),
        # so the per-call cost of every kernel is paid as often
        for s in range(0, n, block):
            e = min(s + block, n)
            i, hb, wb = idx[s:e], h[s:e], w[s:e]
            # forward
            torch.index_select(x, 0, i, out=X[s:e])
            activation_forward("swiglu", hb, act[s:e], 1.702, 7.0)
            o[s:e].copy_(X[s:e]).mul_(wb)  # stands in for the down projection's output
            add_rows(i, o[s:e])
            # backward
            torch.index_select(grad, 0, i, out=G[s:e])
            activation_forward("swiglu", hb, act[s:e], 1.702, 7.0)
            torch.sum(dA[s:e] * act[s:e], dim=1)
            act[s:e].mul_(wb)
            activation_backward("swiglu", dA[s:e].mul_(wb), hb, dH[s:e], 1.702, 7.0)
            torch.index_select(x, 0, i, out=dX[s:e])
            add_rows(i, dX[s:e])

    # the stand-in copy_ of the forward is D extra bytes read per row; count it
    fwd, bwd = ffn_elementwise_bytes(n, n, D, F, True, torch.finfo(dtype).bits // 8)
    return (fwd + bwd + n * D * (torch.finfo(dtype).bits // 8)) / _median_s(run, reps)


def measure_layer_overhead_s(reps: int = 5) -> float:
    """Seconds of one forward + backward of a minimal :class:`torch_moe.nn.MoE` (2 tokens,
    ``D = F = 8``, 2 experts, top-1): the fixed host cost of a layer call (router, token sort,
    op dispatch, autograd), where the arithmetic is negligible. Includes one non-empty group's
    share of the per-group cost, which is small."""
    from torch_moe.nn.modules.moe import MoE, MoEConfig

    _check_reps(reps)
    layer = MoE(MoEConfig(dim=8, hidden_dim=8, num_experts=2, top_k=1))
    x = torch.randn(2, 8, requires_grad=True)

    def run():
        layer.zero_grad(set_to_none=True)
        layer(x).sum().backward()

    return min(_median_s(run, reps) for _ in range(3))


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


def measure_dispatch_row_s(group, profile: DeviceProfile, dim: int, hidden_dim: int,
                           tokens: int = 2048, reps: int = 5) -> float:
    """Host seconds per dispatched row of :func:`torch_moe.distributed.dispatch.
    expert_parallel_moe_ffn` beyond what ``profile`` already prices: forward + backward on a
    uniform synthetic load (``2 * R`` experts, top-1, ``tokens`` per rank, plain dispatch),
    the slowest rank's median, minus the cost model's time for it without a router; what is
    left, over the rows each rank dispatches. Collective: every rank calls it."""
    import torch.distributed as dist

    from torch_moe.distributed._tools.cost_model import MoELayerSpec, MoEStrategy, moe_layer_cost
    from torch_moe.distributed.dispatch import expert_parallel_moe_ffn

    _check_reps(reps)
    R = dist.get_world_size(group)
    E, k = 2 * R, 1
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, dim, generator=g).requires_grad_()
    # every expert gets tokens // 2 of each rank's tokens: a uniform, known load
    ids = (torch.arange(tokens) % E).view(tokens, 1)
    weights = torch.rand(tokens, k, generator=g).requires_grad_()
    w1, w3 = (torch.randn(2, dim, hidden_dim, generator=g).div_(dim ** 0.5).requires_grad_()
              for _ in range(2))
    w2 = torch.randn(2, hidden_dim, dim, generator=g).div_(hidden_dim ** 0.5).requires_grad_()

    def step():
        for t in (x, weights, w1, w2, w3):
            t.grad = None
        dist.barrier(group=group)
        t0 = time.perf_counter()
        y = expert_parallel_moe_ffn(x, ids, weights, w1, w2, w3, num_experts=E, group=group)
        y.sum().backward()
        return time.perf_counter() - t0

    step()
    slowest = torch.tensor([statistics.median(step() for _ in range(reps))],
                           dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    spec = MoELayerSpec(dim, hidden_dim, E, k)
    prec = "fp32" if "fp32" in profile.peak_flops else "bf16"
    pred = moe_layer_cost(spec, MoEStrategy(ep=R, dispatch="plain", precision=prec),
                          dataclasses.replace(profile, dispatch_row_s=0.0), tokens,
                          gpus_per_node=R)
    residual = slowest.item() - (pred.total_s - pred.router_s)
    return max(0.0, residual) / (tokens * k)


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
    own); ``group`` adds the all-to-all fit (collective: all ranks call together).

    The GEMM curves are measured in the dtype torch_moe's CPU kernels compute in: bf16 where the
    CPU has bf16 GEMM instructions, else fp32 (bf16 operands are converted,
    ``torch_moe/_native/_cpu_features.py``), in which case the bf16 and fp32 peaks are the same
    measured fp32 rate."""
    from torch_moe._native._cpu_features import gemm_compute_dtype

    if quick:
        rows, reps = (4, 32, 256), 1
        dim, hidden_dim = min(dim, 128), min(hidden_dim, 64)
        copy_bytes, fault_bytes, groups, ew_rows = 4 * _MiB, 40 * _MiB, 16, 64
    else:
        rows, reps = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096), 5
        copy_bytes, fault_bytes, groups, ew_rows = 64 * _MiB, 64 * _MiB, 256, 4096
    bf16_dtype = gemm_compute_dtype(torch.bfloat16)
    fwd = measure_gemm_curve(rows, dim, hidden_dim, bf16_dtype, False, reps)
    wgr = measure_gemm_curve(rows, dim, hidden_dim, bf16_dtype, True, reps)
    peak_bf16 = max(f for _, f in fwd + wgr)
    if bf16_dtype == torch.float32:
        peak_fp32 = peak_bf16
    else:
        (_, peak_fp32), = measure_gemm_curve((rows[-1],), dim, hidden_dim, torch.float32, False,
                                             reps)
    if group is not None:
        alpha, bw = measure_all_to_all(group, reps=reps)
    else:
        alpha, bw = REFERENCE_CPU.intra_node_latency_s, REFERENCE_CPU.intra_node_bandwidth_Bps
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = REFERENCE_CPU.memory_bytes
    parts = DeviceProfile(
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
        per_group_s=measure_group_overhead_s(reps, groups),
        elementwise_bandwidth_Bps=measure_ffn_elementwise_Bps(dim, hidden_dim, ew_rows,
                                                              bf16_dtype, reps),
        layer_overhead_s=measure_layer_overhead_s(reps),
        fresh_alloc_threshold_bytes=32 * _MiB,
        page_fault_s_per_byte=measure_page_fault_s_per_byte(fault_bytes, reps),
        sources=(f"calibrate_local(dim={dim}, hidden_dim={hidden_dim}, quick={quick}) on "
                 f"{torch.get_num_threads()} threads, torch {torch.__version__}, GEMMs in "
                 f"{str(bf16_dtype).replace('torch.', '')}",),
    )
    ffn_rows = (4, 32) if quick else (4, 16, 64, 256, 1024, 4096)
    ffn_total = 256 if quick else 8192
    kernel = measure_grouped_ffn_s(ffn_rows, dim, hidden_dim, bf16_dtype, reps, ffn_total)
    profile = fit_to_grouped_ffn(parts, kernel, dim, hidden_dim,
                                 "fp32" if bf16_dtype == torch.float32 else "bf16")
    if group is not None:
        profile = dataclasses.replace(profile, dispatch_row_s=measure_dispatch_row_s(
            group, profile, dim, hidden_dim, 256 if quick else 2048, reps))
    return profile


def average_profiles(profiles, name: str | None = None) -> DeviceProfile:
    """The mean of several calibrations of one machine (same row points): a shared machine
    drifts between fast and slow phases over minutes, so profiles taken before and after a
    long measurement bracket it better than either alone. Numbers and achieved GEMM rates are
    averaged; a mean of curves that each grow no faster than the rows does not either."""
    profiles = list(profiles)
    if not profiles:
        raise ValueError("expected at least one profile")
    first = profiles[0]
    for p in profiles[1:]:
        for curve in ("gemm_efficiency", "wgrad_efficiency"):
            if [r for r, _ in getattr(p, curve)] != [r for r, _ in getattr(first, curve)]:
                raise ValueError(f"expected profiles measured at the same rows, but the "
                                 f"{curve} of {p.name!r} and {first.name!r} differ")
        if set(p.peak_flops) != set(first.peak_flops):
            raise ValueError("expected profiles with the same precisions")

    def mean(values):
        return sum(values) / len(values)

    fields = {}
    for f in dataclasses.fields(DeviceProfile):
        values = [getattr(p, f.name) for p in profiles]
        if f.name in ("gemm_efficiency", "wgrad_efficiency"):
            # average the achieved rates, not the fractions of different peaks
            key = "bf16" if "bf16" in first.peak_flops else next(iter(first.peak_flops))
            peaks = [p.peak_flops[key] for p in profiles]
            fields[f.name] = tuple(
                (r, mean([c[i][1] * pk for c, pk in zip(values, peaks)]) / mean(peaks))
                for i, (r, _) in enumerate(values[0]))
        elif f.name == "peak_flops":
            fields[f.name] = {k: mean([v[k] for v in values]) for k in values[0]}
        elif f.name == "sources":
            fields[f.name] = (f"mean of {len(profiles)} calibrations",) + values[0]
        elif f.name == "name":
            fields[f.name] = name or values[0]
        elif isinstance(values[0], float) and values[0] is not None:
            fields[f.name] = mean(values)
        else:
            fields[f.name] = values[0]
    return DeviceProfile(**fields)


def save_profile(profile: DeviceProfile, path: str) -> None:
    with open(path, "w") as f:
        f.write(profile.to_json())


def load_profile(path: str) -> DeviceProfile:
    with open(path) as f:
        return DeviceProfile.from_json(f.read())

