"""Measure the local machine into a :class:`DeviceProfile` with microbenchmarks only.

Calibration never runs what the cost model is validated on: not ``grouped_ffn``,
``grouped_mm``, ``moe_ffn``, the ``MoE`` module nor ``expert_parallel_moe_ffn``
(``test/distributed/test_cost_model.py`` makes them raise during a calibration), and no
factor is fitted to a layer's measured time. What is measured, and the profile field each sets:

* GEMM throughput of plain ``torch.mm`` / ``addmm_`` against the rows of the token
  dimension, in the forms, operand layouts (transposed weight views, column halves) and
  proportions a gated expert FFN issues per group: token-major (``[rows, K] @ [K, N]``) and
  weight-gradient (``[K, rows] @ [rows, N]``, the tokens the contraction), each group on
  different matrices (as each group meets its own expert), in fp32 and, where the CPU has bf16 GEMM
  instructions, bf16: ``peak_flops`` (the best rate seen), ``precision_curves`` (rate / peak
  per precision) and ``gemm_efficiency`` / ``wgrad_efficiency`` (those of bf16);
* the set-up cost of a ``torch.mm`` call of a shape not seen before (a oneDNN primitive built
  and JIT-compiled for bf16; nothing for MKL's fp32) against rows, in the token-major and the
  weight-gradient form at the calibration widths, each call made new by an output row stride
  not used before and timed against its repeat: ``gemm_create_s`` per precision;
* the host cost of one ``torch.mm`` call on one-row views of tiny matrices, with the slicing
  and expert selection that produce its operands: ``per_group_s`` (the cost model charges it
  per non-empty group and grouped GEMM);
* a stand-in for the fixed host work of one layer call, forward + backward on a few tokens:
  a router (linear, softmax, top-k, renormalisation), a token sort (bincount, stable sort,
  cumsum) and three calls of a trivial ``torch.library`` custom op with an autograd formula
  (the expert op's forward and backward, the sort op): ``layer_overhead_s``;
* the elementwise ATen kernels of an expert FFN (row gather, SwiGLU forward and backward,
  routing-weight scaling, scatter-add) block by block on fixed buffers, with ``torch.mm``
  calls between them where an FFN has its GEMMs (timed apart), at the calibration widths and
  at the same widths swapped, solved for the rate of the kernels on model-width rows and that
  of those on hidden-width rows: ``elementwise_bandwidth_Bps``, ``elementwise_hidden_Bps``;
* ``copy_`` into an existing buffer: ``memory_bandwidth_Bps`` (read + write);
* a fresh ``empty`` + ``fill_`` above glibc's 32 MiB mmap threshold (after ``malloc_trim``)
  against the same on a reused buffer: ``page_fault_s_per_byte``;
* with a process group: ``all_to_all_single`` at two sizes, the latency and bandwidth of both
  link fields (one machine has one link); and an ``all_to_all_single`` in flight while the
  rank runs GEMMs against each alone: ``overlap_efficiency``, the share of the shorter that
  runs hidden (the pipeline term of chunked dispatch). ``dispatch_row_s`` stays 0: no
  stand-in measures host work per dispatched row apart from what the elementwise and
  all-to-all terms already price.

Shapes are disjoint from the validated layers': every benchmark that has a layer shape runs at
widths taken from :data:`CALIBRATION_DIMS` (GEMMs ``(K, N)`` in
:data:`CALIBRATION_GEMM_SHAPES`), and :func:`check_disjoint` raises when a validated layer's
GEMMs would share a ``(K, N)`` pair or its ``D`` / ``F`` a width with them, so that no
calibrated GEMM or elementwise benchmark has the shape of a validated one at any row count.

A full run takes about a minute on two cores; ``quick=True`` runs tiny sizes once, to check
the plumbing (its numbers mean nothing). Timings take the median of ``reps`` runs after one
warm-up (the GEMM curve: of ``reps`` passes over all row counts), in wall time unless
:func:`timing` sets another clock or statistic. The machine is shared: calibrate when it is quiet,
and bracket long measurements (:func:`average_profiles`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import statistics
import time

import torch

from torch_moe.distributed._tools.device_profiles import REFERENCE_CPU, DeviceProfile

__all__ = [
    "CALIBRATION_DIMS",
    "CALIBRATION_GEMM_SHAPES",
    "CALIBRATION_ROWS",
    "check_disjoint",
    "timing",
    "measure_gemm_curve",
    "measure_mm_call_s",
    "measure_gemm_create_s",
    "measure_layer_overhead_s",
    "measure_ffn_elementwise_Bps",
    "measure_ffn_elementwise_rates",
    "measure_copy_bandwidth_Bps",
    "measure_page_fault_s_per_byte",
    "measure_all_to_all",
    "measure_overlap_efficiency",
    "fit_efficiency_curve",
    "calibrate_local",
    "average_profiles",
    "save_profile",
    "load_profile",
]

_MiB = 2**20

# Layer-shaped widths of the benchmarks: (D, F) of a full calibration, then of a quick one.
_FULL_DIMS, _QUICK_DIMS = (640, 320), (160, 80)
CALIBRATION_DIMS = frozenset(_FULL_DIMS + _QUICK_DIMS)
# (K, N) of every GEMM calibration times: the curves in both orientations of each (D, F), the
# per-call stand-in's 8 x 8, the layer stand-in's router (D = 8, E = 2) and expert (8 x 8)
_TINY, _TINY_EXPERTS = 8, 2
CALIBRATION_GEMM_SHAPES = frozenset(
    [(a, b) for d, f in (_FULL_DIMS, _QUICK_DIMS) for a, b in ((d, f), (f, d))]
    + [(_TINY, _TINY), (_TINY, _TINY_EXPERTS)])
# Rows of the GEMM curves: 3 * 2^i, off the powers of two the uniform layer loads tend to hit
# (that is not needed for disjointness, which the widths give, but no curve point then sits
# exactly on a validated group size).
CALIBRATION_ROWS = (1, 3, 6, 12, 24, 48, 96, 192, 384, 768, 1536, 3072, 6144)
_QUICK_ROWS = (3, 24, 192)


def check_disjoint(layers) -> None:
    """Raise ``ValueError`` unless the validated ``layers`` (``(D, F, E)`` triples; shared
    experts as more ``(D, F_shared, 1)`` triples) are disjoint from calibration. Disjoint
    means: (1) no GEMM of such a layer has the ``(K, N)`` of a calibrated GEMM
    (:data:`CALIBRATION_GEMM_SHAPES`): the expert GEMMs are ``(D, F)`` and ``(F, D)``, the
    router's ``(D, E)``; and (2) neither ``D`` nor ``F`` is a width of
    :data:`CALIBRATION_DIMS`, so the elementwise benchmarks never run at a layer's widths
    either. Then no calibration measurement has the shape of a validated one, whatever the
    rows."""
    clashes = []
    for layer in layers:
        D, F, E = (int(v) for v in layer)
        gemms = {(D, F), (F, D), (D, E)}
        shared = sorted(gemms & CALIBRATION_GEMM_SHAPES)
        widths = sorted({D, F} & CALIBRATION_DIMS)
        if shared or widths:
            clashes.append(f"(D={D}, F={F}, E={E}): GEMMs {shared}, widths {widths}")
    if clashes:
        raise ValueError("expected validated layers disjoint from the calibration shapes "
                         f"(GEMMs {sorted(CALIBRATION_GEMM_SHAPES)}, widths "
                         f"{sorted(CALIBRATION_DIMS)}), but " + "; ".join(clashes))


# What single-process timings read and how their repetitions are summarised: wall time and
# the median, or what timing() sets. The collective benchmarks always take the median of wall
# times (their ranks wait on each other).
_clock = time.perf_counter
_statistic = statistics.median


@contextlib.contextmanager
def timing(clock=time.perf_counter, statistic=statistics.median):
    """Times the single-process benchmarks with ``clock`` and summarises their repetitions
    with ``statistic`` inside the block. On one compute thread of a shared machine, the
    thread's CPU time (``time.thread_time``) leaves out the time other processes hold the
    core, and the minimum the repetitions that other processes' cache and memory traffic
    slowed; on an idle machine all agree."""
    global _clock, _statistic
    previous = _clock, _statistic
    _clock, _statistic = clock, statistic
    try:
        yield
    finally:
        _clock, _statistic = previous


def _median_s(fn, reps: int) -> float:
    fn()  # warm-up: first-touch, oneDNN primitive creation
    times = []
    for _ in range(reps):
        t0 = _clock()
        fn()
        times.append(_clock() - t0)
    return _statistic(times)


def _check_reps(reps) -> None:
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"expected reps to be a positive int, but got {reps!r}")


def measure_gemm_curve(rows, dim: int, hidden_dim: int, dtype: torch.dtype = torch.float32,
                       wgrad: bool = False, reps: int = 5,
                       experts_bytes: int = 64 * _MiB,
                       flops_per_timing: float = 2e9) -> list[tuple[int, float]]:
    """``[(rows, FLOP/s)]`` of plain ``torch.mm`` / ``addmm_`` calls in the forms, operand
    layouts and proportions of a gated expert FFN's per-group GEMMs (``D = dim``, ``F =
    hidden_dim``, a ``rows``-row group), each point all the forms' FLOPs over their summed
    time. ``wgrad=False``, the token-major forms (the tokens are M): gate and up ``[rows, D]
    @ [D, F]`` into the two column halves of a ``[rows, 2F]`` buffer (row-strided outputs),
    down ``[rows, F] @ [F, D]``; in backward ``G @ w2^T`` (a transposed weight view), ``dH_gate
    @ w1^T`` from a column half of ``dH`` and ``addmm_`` of ``dH_up @ w3^T`` into the same
    output. ``wgrad=True``, the weight-gradient forms (the tokens are the contraction):
    ``X^T @ dH_gate``, ``X^T @ dH_up`` and ``act^T @ G``, transposed views of token-major
    buffers into one expert's gradient.

    Consecutive groups read a different expert's weights (token-major forms) or write a
    different expert's gradients (weight-gradient forms), cycling over ``experts_bytes`` of
    them: in an expert FFN every group touches its own expert, so a small group pays for
    bringing whole ``D x F`` matrices from memory, which a benchmark reusing one cached matrix
    would hide. Each timing runs about ``flops_per_timing`` FLOPs (at most 2000 groups)."""
    _check_reps(reps)
    if dim < 1 or hidden_dim < 1 or not rows or any(r < 1 for r in rows):
        raise ValueError(f"expected positive rows, dim and hidden_dim, but got rows={rows}, "
                         f"dim={dim}, hidden_dim={hidden_dim}")
    D, F = dim, hidden_dim
    experts = max(1, experts_bytes // (3 * D * F * torch.finfo(dtype).bits // 8))
    g = torch.Generator().manual_seed(0)
    # the experts' weights (token-major forms) or gradients (weight-gradient forms), shared
    # by every row count: [experts, D, F] twice (gate, up) and [experts, F, D] (down)
    w1, w3 = (torch.randn(experts, D, F, generator=g).to(dtype) for _ in range(2))
    w2 = torch.randn(experts, F, D, generator=g).to(dtype)
    runners = []
    for r in rows:
        x, grad = (torch.randn(r, D, generator=g).to(dtype) for _ in range(2))
        act = torch.randn(r, F, generator=g).to(dtype)
        dH = torch.randn(r, 2 * F, generator=g).to(dtype)
        h, o, dA, dX = (torch.empty(r, n, dtype=dtype) for n in (2 * F, D, F, D))
        if wgrad:
            def group(e, x=x, grad=grad, act=act, dH=dH):
                torch.mm(x.t(), dH[:, :F], out=w1[e])
                torch.mm(x.t(), dH[:, F:], out=w3[e])
                torch.mm(act.t(), grad, out=w2[e])
        else:
            def group(e, x=x, grad=grad, act=act, dH=dH, h=h, o=o, dA=dA, dX=dX):
                torch.mm(x, w1[e], out=h[:, :F])
                torch.mm(x, w3[e], out=h[:, F:])
                torch.mm(act, w2[e], out=o)
                torch.mm(grad, w2[e].t(), out=dA)
                torch.mm(dH[:, :F], w1[e].t(), out=dX)
                dX.addmm_(dH[:, F:], w3[e].t())
        calls = max(1, min(2000, int(flops_per_timing / (6.0 * r * D * F))))
        runners.append((r, calls, group))

    # Passes over all row counts rather than all repetitions of one count: a slow phase of a
    # shared machine then spreads over the curve instead of bending one point.
    forms = 3 if wgrad else 6
    times = {r: [] for r in rows}
    for p in range(reps + 1):
        for r, calls, group in runners:
            t0 = _clock()
            # every group meets an expert that has not been touched for a whole cycle
            for i in range(p * calls, (p + 1) * calls):
                group(i % experts)
            if p:  # the first pass is the warm-up
                times[r].append((_clock() - t0) / calls)
    return [(int(r), forms * 2.0 * r * D * F / _statistic(times[r])) for r in rows]


# Output row strides of measure_gemm_create_s are never used twice in a process for one shape,
# so every first call is a shape the GEMM library has not prepared, whatever ran before.
_fresh_strides = collections.defaultdict(itertools.count)
_CREATE_ROWS = (3, 48, 384, 1536)


def _primitive_cache_capacity() -> int:
    """Entries of oneDNN's primitive cache: its environment setting, else its default 1024."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1024


def measure_gemm_create_s(rows, dim: int, hidden_dim: int, dtype: torch.dtype = torch.float32,
                          reps: int = 5, batch: int = 8,
                          fill_cache: bool = True) -> list[tuple[int, float]]:
    """``[(rows, seconds)]``: the extra seconds of the first ``torch.mm`` call of a shape over
    the same call repeated, the mean of the token-major form (``[rows, D] @ [D, F]``) and the
    weight-gradient form (``[D, rows] @ [rows, F]``, a transposed view). Each timing runs
    ``batch`` new shapes, then the same ``batch`` calls again; the statistic is over ``reps``
    such timings, so it summarises the mean cost of a set-up, as a layer call pays many. A
    shape is new through its output: a column slice of a buffer whose row stride no earlier
    call used, which changes no arithmetic but is part of the key under which oneDNN caches
    its primitives. Outputs are zero-filled first, so the first call page-faults no more than
    its repeat. With ``fill_cache`` the cache is filled before (:func:`_primitive_cache_capacity`
    new 3-row shapes), so every new shape evicts one, as in a job whose group sizes change
    every step."""
    _check_reps(reps)
    if dim < 1 or hidden_dim < 1 or not rows or any(r < 1 for r in rows):
        raise ValueError(f"expected positive rows, dim and hidden_dim, but got rows={rows}, "
                         f"dim={dim}, hidden_dim={hidden_dim}")
    D, F = dim, hidden_dim
    g = torch.Generator().manual_seed(0)
    top = max(rows)
    x = torch.randn(top, D, generator=g).to(dtype)
    w = torch.randn(D, F, generator=g).to(dtype)
    grad = torch.randn(top, F, generator=g).to(dtype)
    # a long job keeps its primitive cache full (group sizes change every step), so each new
    # primitive also evicts and destroys one: fill the cache with 3-row shapes first
    for _ in range(_primitive_cache_capacity() + 64 if fill_cache else 0):
        pad = 16 * (1 + next(_fresh_strides[(dtype, D, F, "fill")]))
        torch.mm(x[:3], w, out=torch.empty(3, F + pad, dtype=dtype)[:, :F])

    def first_over_repeat(call, out_rows, key):
        outs = [torch.zeros(out_rows, F + 16 * (1 + next(_fresh_strides[key])),
                            dtype=dtype)[:, :F] for _ in range(batch)]
        t0 = _clock()
        for out in outs:
            call(out)
        t1 = _clock()
        for out in outs:
            call(out)
        t2 = _clock()
        return ((t1 - t0) - (t2 - t1)) / batch

    points = []
    for r in rows:
        forms = (
            (lambda out, r=r: torch.mm(x[:r], w, out=out), r),
            (lambda out, r=r: torch.mm(x[:r].t(), grad[:r], out=out), D),
        )
        extra = [_statistic([first_over_repeat(call, n, (dtype, D, F, r, i))
                             for _ in range(reps)])
                 for i, (call, n) in enumerate(forms)]
        points.append((int(r), max(0.0, sum(extra) / len(extra))))
    return points


def measure_mm_call_s(reps: int = 5, groups: int = 256) -> float:
    """Host seconds of one ``torch.mm`` call of a per-group loop: ``groups`` one-row groups
    of an 8-wide matrix, each call on the group's row view, its own matrix (a ``select`` of
    a stacked ``[G, 8, 8]``) and a column-sliced output view, as the CPU kernel slices its
    operands; the arithmetic is negligible. Measured against a single group, so what is left
    is the per-call cost."""
    _check_reps(reps)

    def timed(num_groups):
        x = torch.randn(num_groups, _TINY)
        w = torch.randn(num_groups, _TINY, _TINY)
        out = torch.empty(num_groups, 2 * _TINY)

        def run():
            for g in range(num_groups):
                torch.mm(x[g:g + 1], w[g], out=out[g:g + 1, :_TINY])

        return _median_s(run, reps)

    return max(0.0, timed(groups) - timed(1)) / (groups - 1)


@functools.lru_cache(maxsize=None)
def _stand_in_op():
    """A trivial custom op with an autograd formula: the dispatch cost of a ``torch.library``
    op call (schema parsing, dispatcher, autograd node), none of torch_moe's kernels."""
    lib = torch.library.Library("torch_moe_calibration", "FRAGMENT")
    lib.define("stand_in(Tensor x, Tensor rows) -> Tensor")
    lib.define("stand_in_backward(Tensor grad, Tensor rows) -> Tensor")

    def forward(x, rows):
        return x.index_select(0, rows)

    def backward_kernel(grad, rows):
        return torch.zeros(grad.shape, dtype=grad.dtype).index_add_(0, rows, grad)

    lib.impl("stand_in", forward, "CPU")
    lib.impl("stand_in_backward", backward_kernel, "CPU")
    op = torch.ops.torch_moe_calibration

    def backward(ctx, grad):
        return op.stand_in_backward(grad, ctx.rows), None

    def setup_context(ctx, inputs, output):
        ctx.rows = inputs[1]

    torch.library.register_autograd("torch_moe_calibration::stand_in", backward,
                                    setup_context=setup_context, lib=lib)
    return lib, op


def measure_layer_overhead_s(reps: int = 5) -> float:
    """Seconds of one forward + backward of a stand-in for the fixed host work of an MoE layer
    call, on 4 tokens of width 8 and 2 experts, top-1, where the arithmetic is negligible: a
    router (``linear``, fp32 ``softmax``, ``topk``, renormalisation), a token sort
    (``bincount``, stable ``sort``, ``cumsum``) whose order goes through one custom-op call,
    and the experts as a custom op with an autograd formula (forward and backward: two more
    calls) feeding an 8 x 8 GEMM, weighted by the routing weights. Module hooks, input checks
    and the per-group work are not in it (the latter is priced per group)."""
    import torch.nn.functional as F_

    _check_reps(reps)
    _, op = _stand_in_op()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, _TINY, generator=g, requires_grad=True)
    gate = torch.randn(_TINY_EXPERTS, _TINY, generator=g, requires_grad=True)
    w = torch.randn(_TINY, _TINY, generator=g, requires_grad=True)
    last = torch.tensor([_TINY_EXPERTS - 1])

    def run():
        for t in (x, gate, w):
            t.grad = None
        scores = F_.linear(x, gate).float().softmax(-1)
        weights, ids = scores.topk(1, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = ids.flatten()
        counts = torch.bincount(flat, minlength=_TINY_EXPERTS)
        order = torch.sort(flat, stable=True).indices
        offs = op.stand_in(counts.cumsum(0).to(torch.int32), last)  # the sort op
        rows = op.stand_in(x, order)  # the expert op: forward here, backward below
        y = torch.mm(rows, w).mul(weights.view(-1, 1).to(x.dtype))
        y.sum().backward()
        return offs

    return min(_median_s(run, reps) for _ in range(3))


def measure_ffn_elementwise_Bps(dim: int, hidden_dim: int, rows: int = 4096,
                                dtype: torch.dtype = torch.float32, reps: int = 5) -> float:
    """Rate of an expert FFN's elementwise kernels on ``rows`` rows of width ``dim`` /
    ``hidden_dim`` (SwiGLU), forward and backward, in the bytes
    :func:`~torch_moe.distributed._tools.gemm_cost.ffn_elementwise_bytes` counts for them:
    plain ATen calls (``index_select``, ``sigmoid``, ``mul_``, ``index_add_``, a row-wise
    dot) on reused buffers, block by block as the CPU kernel's per-group form walks its rows
    (``torch_moe/_native/_expert_blocks.py``: ``BLOCK_ROWS``), so every call's fixed cost is paid
    as often. Between them run the block's GEMMs where an FFN has them (gate and up, down;
    ``G w2^T``, the weight gradients, ``dX``), on a few experts' weights in turn, so the
    elementwise kernels find the cache as the GEMMs leave it; only the elementwise calls are
    timed. No torch_moe kernel runs."""
    from torch_moe._native._expert_blocks import BLOCK_ROWS as block
    from torch_moe.distributed._tools.gemm_cost import ffn_elementwise_bytes

    _check_reps(reps)
    D, F, n = dim, hidden_dim, rows
    g = torch.Generator().manual_seed(0)
    x, grad = (torch.randn(n, D, generator=g).to(dtype) for _ in range(2))
    idx = torch.randperm(n, generator=g)
    w = torch.rand(n, 1, generator=g).to(dtype)
    h = torch.empty(n, 2 * F, dtype=dtype)
    X, G, o, dX = (torch.empty(n, D, dtype=dtype) for _ in range(4))
    act, s = torch.empty(n, F, dtype=dtype), torch.empty(n, F, dtype=dtype)
    dA = torch.empty(n, F, dtype=dtype)
    dH = torch.empty(n, 2 * F, dtype=dtype)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = torch.zeros(n, D, dtype=acc_dtype)
    experts = 8
    w1, w3 = (torch.randn(experts, D, F, generator=g).div_(D ** 0.5).to(dtype)
              for _ in range(2))
    w2 = torch.randn(experts, F, D, generator=g).div_(F ** 0.5).to(dtype)
    gw1, gw3, gw2 = torch.empty_like(w1[0]), torch.empty_like(w3[0]), torch.empty_like(w2[0])

    def add_rows(i, src):
        # sums across experts accumulate in fp32 at least: the block is converted first
        acc.index_add_(0, i, src if src.dtype == acc.dtype else src.to(acc.dtype))

    def swiglu(hb, out):
        gate, up = hb[:, :F], hb[:, F:]
        return torch.sigmoid(gate, out=out).mul_(gate).mul_(up)

    def run():
        spent = 0.0
        for b, st in enumerate(range(0, n, block)):
            e = min(st + block, n)
            ex = b % experts
            i, hb, wb = idx[st:e], h[st:e], w[st:e]
            Xb, Gb, ob, dXb = X[st:e], G[st:e], o[st:e], dX[st:e]
            ab, sb, dAb, dHb = act[st:e], s[st:e], dA[st:e], dH[st:e]
            # forward
            t0 = _clock()
            torch.index_select(x, 0, i, out=Xb)
            spent += _clock() - t0
            torch.mm(Xb, w1[ex], out=hb[:, :F])
            torch.mm(Xb, w3[ex], out=hb[:, F:])
            t0 = _clock()
            swiglu(hb, ab)
            spent += _clock() - t0
            torch.mm(ab, w2[ex], out=ob)
            t0 = _clock()
            ob.mul_(wb)
            add_rows(i, ob)
            # backward
            torch.index_select(grad, 0, i, out=Gb)
            swiglu(hb, ab)
            spent += _clock() - t0
            torch.mm(Gb, w2[ex].t(), out=dAb)
            t0 = _clock()
            torch.sum(dAb * ab, dim=1)
            ab.mul_(wb)
            spent += _clock() - t0
            torch.mm(ab.t(), Gb, out=gw2)
            t0 = _clock()
            da = dAb.mul_(wb)
            gate, up = hb[:, :F], hb[:, F:]
            dg, du = dHb[:, :F], dHb[:, F:]
            torch.sigmoid(gate, out=sb)
            torch.mul(gate, sb, out=du).mul_(da)
            torch.neg(sb, out=dg).add_(1).mul_(gate).add_(1).mul_(sb).mul_(up).mul_(da)
            torch.index_select(x, 0, i, out=Xb)
            spent += _clock() - t0
            torch.mm(Xb.t(), dg, out=gw1)
            torch.mm(Xb.t(), du, out=gw3)
            torch.mm(dg, w1[ex].t(), out=dXb)
            dXb.addmm_(du, w3[ex].t())
            t0 = _clock()
            add_rows(i, dXb)
            spent += _clock() - t0
        return spent

    run()  # warm-up
    elapsed = _statistic([run() for _ in range(reps)])
    fwd, bwd = ffn_elementwise_bytes(n, n, D, F, True, torch.finfo(dtype).bits // 8)
    return (fwd + bwd) / elapsed


def measure_ffn_elementwise_rates(dims=_FULL_DIMS, rows: int = 4096,
                                  dtype: torch.dtype = torch.float32,
                                  reps: int = 5) -> tuple[float, float]:
    """``(dim_Bps, hidden_Bps)``: the rates of the elementwise kernels on rows of the model
    width and on rows of the hidden width
    (:func:`~torch_moe.distributed._tools.gemm_cost.ffn_elementwise_split_bytes`), from
    :func:`measure_ffn_elementwise_Bps` at ``(D, F) = dims`` and at the swapped widths
    ``(F, D)``: two timings whose bytes split differently between the two, solved for the
    two rates. Where noise leaves no positive solution, both are the rate of the two runs
    together."""
    from torch_moe.distributed._tools.gemm_cost import ffn_elementwise_split_bytes

    act_bytes = torch.finfo(dtype).bits // 8
    systems = []
    for d, f in (dims, dims[::-1]):
        rate = measure_ffn_elementwise_Bps(d, f, rows, dtype, reps)
        (fwd_d, fwd_h), (bwd_d, bwd_h) = ffn_elementwise_split_bytes(rows, rows, d, f, True,
                                                                     act_bytes)
        dim_bytes, hidden_bytes = fwd_d + bwd_d, fwd_h + bwd_h
        systems.append((dim_bytes, hidden_bytes, (dim_bytes + hidden_bytes) / rate))
    (a1, b1, t1), (a2, b2, t2) = systems
    # t = a / dim_Bps + b / hidden_Bps at both widths: Cramer's rule for the inverse rates
    det = a1 * b2 - a2 * b1
    inv_dim, inv_hidden = (t1 * b2 - t2 * b1) / det, (a1 * t2 - a2 * t1) / det
    if inv_dim > 0 and inv_hidden > 0:
        return 1.0 / inv_dim, 1.0 / inv_hidden
    both = (a1 + b1 + a2 + b2) / (t1 + t2)
    return both, both


def measure_copy_bandwidth_Bps(nbytes: int = 64 * _MiB, reps: int = 5) -> float:
    """Bytes moved per second (read + write) by ``copy_`` between existing buffers."""
    _check_reps(reps)
    n = max(1, nbytes // 4)
    src, dst = torch.ones(n), torch.empty(n)
    return 2 * n * 4 / _median_s(lambda: dst.copy_(src), reps)


def measure_page_fault_s_per_byte(nbytes: int = 64 * _MiB, reps: int = 5) -> float:
    """Extra seconds per byte of a fresh ``empty`` + ``fill_`` above glibc's 32 MiB mmap
    threshold over a reused buffer's ``fill_``. Before each fresh allocation the allocator
    returns its free memory to the system (glibc's ``malloc_trim``): a free heap region left
    by earlier work could otherwise serve the allocation with pages already mapped."""
    _check_reps(reps)
    n = max(1, nbytes // 4)
    reused = torch.empty(n)
    t_reused = _median_s(lambda: reused.fill_(0), reps)
    trim = _malloc_trim()
    times = []
    for _ in range(reps + 1):  # the first is the warm-up
        trim()
        t0 = _clock()
        torch.empty(n).fill_(0)
        times.append(_clock() - t0)
    return max(0.0, _statistic(times[1:]) - t_reused) / (n * 4)


def _malloc_trim():
    """glibc's ``malloc_trim(0)`` (free heap memory back to the system), or a no-op where the
    C library has none."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    return lambda: trim(0)


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


def measure_overlap_efficiency(group, nbytes: int = 4 * _MiB, reps: int = 5,
                               dims: tuple = _FULL_DIMS) -> float:
    """Share of the shorter of a communication and a computation that runs hidden when both
    are in flight, as a chunked dispatch has them: an ``all_to_all_single`` of ``nbytes``
    per rank issued asynchronously while the rank runs ``torch.mm`` calls at the
    calibration widths ``dims`` sized to take about as long, against each alone:
    ``(t_comm + t_comp - t_both) / min(t_comm, t_comp)`` clipped to [0, 1]. On gloo the
    transfer runs on gloo's own threads and competes with the GEMMs for the cores. Rank 0's
    figure is broadcast. Collective: every rank of ``group`` must call it."""
    import torch.distributed as dist

    _check_reps(reps)
    world = dist.get_world_size(group)
    n = max(world, nbytes // 4 // world * world)
    send, recv = torch.ones(n), torch.empty(n)
    d, f = dims
    a, b = torch.randn(256, d), torch.randn(d, f)
    out = torch.empty(256, f)

    def comm():
        dist.all_to_all_single(recv, send, group=group)

    def mms(calls):
        for _ in range(calls):
            torch.mm(a, b, out=out)

    def timed(fn):
        def run():
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        run()
        return statistics.median(run() for _ in range(reps))

    t_comm = timed(comm)
    t_mm = timed(lambda: mms(8)) / 8
    # every rank runs the same number of GEMMs (rank 0's choice)
    calls = torch.tensor([max(1, round(t_comm / max(t_mm, 1e-9)))], dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(calls, src=src, group=group)
    calls = int(calls.item())
    t_comp = timed(lambda: mms(calls))

    def both():
        work = dist.all_to_all_single(recv, send, group=group, async_op=True)
        mms(calls)
        work.wait()

    t_both = timed(both)
    eta = (t_comm + t_comp - t_both) / max(min(t_comm, t_comp), 1e-12)
    t = torch.tensor([min(1.0, max(0.0, eta))], dtype=torch.float64)
    dist.broadcast(t, src=src, group=group)
    return float(t.item())


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


def _curves(dtype, rows, dims, reps, work):
    """``(peak, forward curve, weight-gradient curve)`` of ``dtype`` at widths ``dims``."""
    d, f = dims
    fwd = measure_gemm_curve(rows, d, f, dtype, False, reps, flops_per_timing=work)
    wgr = measure_gemm_curve(rows, d, f, dtype, True, reps, flops_per_timing=work)
    peak = max(r for _, r in fwd + wgr)
    return peak, fit_efficiency_curve(fwd, peak), fit_efficiency_curve(wgr, peak)


def calibrate_local(quick: bool = False, group=None, name: str = "local-cpu") -> DeviceProfile:
    """Measure this machine at the calibration shapes (:data:`CALIBRATION_DIMS`,
    :data:`CALIBRATION_ROWS`); ``group`` adds the all-to-all fit and the overlap measurement
    (collective: all ranks call together, so core sharing between ranks is in every figure).

    The GEMM curves are measured in fp32 and in bf16 where the CPU computes bf16 GEMMs natively
    (``torch_moe/_native/_cpu_features.py``); elsewhere bf16 operands are converted to fp32,
    and bf16 gets the fp32 curves and peak. The elementwise rate is measured in bf16's compute
    dtype."""
    from torch_moe._native._cpu_features import gemm_compute_dtype

    if quick:
        dims, rows, reps, work = _QUICK_DIMS, _QUICK_ROWS, 1, 1e8
        copy_bytes, fault_bytes, groups, ew_rows, a2a_bytes = 4 * _MiB, 40 * _MiB, 16, 64, _MiB
    else:
        dims, rows, reps, work = _FULL_DIMS, CALIBRATION_ROWS, 5, 2e9
        copy_bytes, fault_bytes, groups, ew_rows, a2a_bytes = (64 * _MiB, 64 * _MiB, 256,
                                                                6144, 4 * _MiB)
    bf16_dtype = gemm_compute_dtype(torch.bfloat16)
    create_rows, create_batch = ((3,), 2) if quick else (_CREATE_ROWS, 8)
    peak32, fwd32, wgr32 = _curves(torch.float32, rows, dims, reps, work)
    create32 = measure_gemm_create_s(create_rows, *dims, torch.float32, reps, create_batch,
                                     fill_cache=not quick)
    if bf16_dtype == torch.float32:
        peak16, fwd16, wgr16, create16 = peak32, fwd32, wgr32, create32
    else:
        peak16, fwd16, wgr16 = _curves(bf16_dtype, rows, dims, reps, work)
        create16 = measure_gemm_create_s(create_rows, *dims, bf16_dtype, reps, create_batch,
                                         fill_cache=not quick)
    if group is not None:
        alpha, bw = measure_all_to_all(group, large_bytes=a2a_bytes, reps=reps)
        overlap = measure_overlap_efficiency(group, a2a_bytes, reps, dims)
    else:
        alpha, bw = REFERENCE_CPU.intra_node_latency_s, REFERENCE_CPU.intra_node_bandwidth_Bps
        overlap = None
    ew_dim, ew_hidden = measure_ffn_elementwise_rates(dims, ew_rows, bf16_dtype, reps)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = REFERENCE_CPU.memory_bytes
    return DeviceProfile(
        name=name,
        peak_flops={"bf16": peak16, "fp32": peak32},
        memory_bytes=float(ram),
        memory_bandwidth_Bps=measure_copy_bandwidth_Bps(copy_bytes, reps),
        intra_node_bandwidth_Bps=bw,
        intra_node_latency_s=alpha,
        inter_node_bandwidth_Bps=bw,
        inter_node_latency_s=alpha,
        gemm_tile_rows=1,
        gemm_efficiency=fwd16,
        wgrad_efficiency=wgr16,
        precision_curves={"bf16": (fwd16, wgr16), "fp32": (fwd32, wgr32)},
        gemm_create_s={"bf16": tuple(create16), "fp32": tuple(create32)},
        gemm_call_s=0.0,
        per_group_s=measure_mm_call_s(reps, groups),
        elementwise_bandwidth_Bps=ew_dim,
        elementwise_hidden_Bps=ew_hidden,
        layer_overhead_s=measure_layer_overhead_s(reps),
        fresh_alloc_threshold_bytes=32 * _MiB,
        page_fault_s_per_byte=measure_page_fault_s_per_byte(fault_bytes, reps),
        overlap_efficiency=overlap,
        sources=(f"calibrate_local(quick={quick}) at D, F = {dims} on "
                 f"{torch.get_num_threads()} threads, torch {torch.__version__}, bf16 GEMMs in "
                 f"{str(bf16_dtype).replace('torch.', '')}",),
    )


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
        if set(p.precision_curves) != set(first.precision_curves) or any(
                [r for r, _ in c] != [r for r, _ in c0]
                for prec in first.precision_curves
                for c, c0 in zip(p.precision_curves[prec], first.precision_curves[prec])):
            raise ValueError(f"expected profiles with precision_curves at the same rows, but "
                             f"{p.name!r} and {first.name!r} differ")

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
        elif f.name == "precision_curves":
            fields[f.name] = {
                prec: tuple(tuple(
                    (r, mean([p.precision_curves[prec][j][i][1] * p.peak_flops[prec]
                              for p in profiles]) / mean([p.peak_flops[prec] for p in profiles]))
                    for i, (r, _) in enumerate(curve))
                    for j, curve in enumerate(pair))
                for prec, pair in first.precision_curves.items()}
        elif f.name == "gemm_create_s":
            if any(set(v) != set(values[0]) or any(
                    [r for r, _ in v[prec]] != [r for r, _ in values[0][prec]] for prec in v)
                    for v in values):
                raise ValueError("expected profiles with gemm_create_s at the same rows")
            fields[f.name] = {prec: tuple((r, mean([v[prec][i][1] for v in values]))
                                          for i, (r, _) in enumerate(curve))
                              for prec, curve in values[0].items()}
        elif f.name == "overlap_efficiency":
            fields[f.name] = None if None in values else mean(values)
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

