"""The MoE cost model checked out of sample: a fixed held-out set of layers and gloo dispatches,
measured, against ``moe_layer_cost`` on a profile that ``calibrate_local`` measured from
microbenchmarks alone.

The held-out set is :data:`HELD_OUT_LAYERS` (MoE layers in one process: D, F, E, k, T, router
skew, dtype) and :data:`HELD_OUT_DISPATCH` (``expert_parallel_moe_ffn`` on 2 and 4 gloo
processes, plain and dedup, one and two chunks). Calibration never runs these functions and
its shapes are disjoint from theirs (``calibrate.check_disjoint``, asserted below at import):
no calibrated GEMM shares a ``(K, N)`` with a held-out layer's GEMMs, and no width of a
calibration benchmark is a held-out ``D`` or ``F``. Nothing is fitted to these measurements.

Part 1, the layer: :class:`torch_moe.nn.MoE` forward + backward (SwiGLU), on one compute
thread by default (``--threads``: on a shared machine, a multi-threaded GEMM waits at every
call for a thread another process holds, which turns small GEMMs erratic) and timed in that
thread's CPU time (``--clock thread``, the default; ``--clock wall`` for wall time), the
layers and their calibrations alike, each summarised by its minimum over repetitions
(``--statistic``; the calibrations' too): on a shared machine CPU time leaves out the time
other processes hold the core and the minimum the repetitions their cache and memory traffic
slowed; on an idle one they are the wall time and the median. Router skew comes from the
router's bias, ``-s * log(1 + rank)`` of a random expert order, plus logits of standard
deviation ~1.28 from its weights (close to Gumbel noise, for which top-1 picks expert ``e``
with probability ``~ rank^-s``). Timed in interleaved rounds between two calibrations that are
averaged; predicted from the per-expert counts the layer routed. The bf16 GEMMs run on oneDNN,
which builds a primitive per GEMM shape into an LRU cache of 1024: the bf16 layers of one round
build about 2300, so every layer call finds none of its own left from the round before
and builds one per distinct group size and GEMM form, as the model charges (a training step,
whose routing changes every step, does the same; one layer repeated alone on the same routing
would find them all cached). Saved bytes: the storages
autograd saves (``saved_tensors_hooks``, each once) plus the input, against
``activation_bytes``.

Part 2, dispatch: each process group calibrates inside itself before and after its
configurations, all ranks at once (so core sharing between ranks, gloo's alpha-beta and the
measured overlap of an all-to-all with GEMMs are in the profile); the slowest rank's median,
each call after a barrier. Wire bytes: the dispatcher's ``bytes_sent`` counter against the
model's dispatch and combine bytes. Configurations run with one and with two chunks: the
ratio of the two, measured and predicted, checks the pipeline term (the profile's
``overlap_efficiency``).

Error = predicted / measured - 1; the summary gives the median, 90th percentile and maximum of
its absolute value.

    python benchmarks/cost_model_validation.py            # ~6 minutes on 2 idle cores
    python benchmarks/cost_model_validation.py --quick    # a few configurations, ~1.5 minutes

Writes ``results/cost_model_validation.csv`` (one row per configuration: measured, predicted,
errors, the model's breakdown) and ``results/cost_model_profile.json`` (the layer part's
averaged profile; the gloo profiles are summarised in the CSV's ``alpha_ms``,
``bandwidth_GBps`` and ``overlap`` columns). The machine should be otherwise idle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import SavedBytes, destroy_process_group, environment_header, format_table, write_csv  # noqa: E402

from torch_moe.distributed._tools import calibrate  # noqa: E402
from torch_moe.distributed._tools.cost_model import (  # noqa: E402
    MoELayerSpec,
    MoEStrategy,
    moe_layer_cost,
)

RESULTS = Path(__file__).resolve().parent / "results"
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LayerConfig:
    D: int
    F: int
    E: int
    k: int
    T: int
    skew: float
    dtype: str = "fp32"


@dataclass(frozen=True)
class DispatchConfig:
    R: int
    D: int
    F: int
    E: int
    k: int
    T: int
    skew: float
    dedup: bool
    num_chunks: int = 1


L, P = LayerConfig, DispatchConfig
# The held-out set. Widths 256..1024 (none a calibration width), E 8..256, k 1..8, skew uniform
# to Zipf 1.2; bf16 (native bf16 GEMMs on this CPU: AVX512-BF16) with larger loads, as its
# GEMMs run about four times as fast as fp32's.
HELD_OUT_LAYERS: tuple = (
    L(512, 256, 8, 2, 2048, 0.0), L(512, 256, 32, 4, 2048, 0.0), L(512, 256, 64, 8, 1024, 0.6),
    L(512, 256, 16, 1, 4096, 1.2), L(512, 256, 128, 4, 1024, 0.0), L(384, 192, 8, 1, 4096, 0.0),
    L(384, 192, 32, 2, 2048, 1.2), L(384, 192, 64, 6, 1024, 0.6), L(384, 768, 16, 2, 1024, 0.0),
    L(384, 768, 8, 4, 512, 1.2), L(768, 384, 8, 2, 1024, 0.0), L(768, 384, 32, 4, 512, 0.6),
    L(768, 384, 64, 8, 256, 0.0), L(768, 384, 16, 2, 1024, 1.2), L(1024, 512, 8, 1, 1024, 0.0),
    L(1024, 512, 16, 2, 512, 0.6), L(1024, 512, 32, 4, 256, 1.2), L(1024, 256, 64, 4, 512, 0.0),
    L(256, 512, 32, 8, 1024, 0.6), L(512, 256, 256, 8, 512, 0.0),
    L(512, 256, 8, 2, 4096, 0.0, "bf16"), L(512, 256, 64, 8, 2048, 0.6, "bf16"),
    L(768, 384, 16, 2, 2048, 0.0, "bf16"), L(768, 384, 32, 4, 2048, 1.2, "bf16"),
    L(1024, 512, 8, 2, 2048, 0.0, "bf16"), L(1024, 512, 64, 4, 1024, 0.6, "bf16"),
    L(384, 192, 32, 4, 4096, 0.0, "bf16"), L(384, 768, 16, 2, 2048, 1.2, "bf16"),
    L(1024, 256, 128, 8, 1024, 0.0, "bf16"), L(256, 512, 8, 1, 8192, 0.6, "bf16"),
    L(512, 384, 32, 2, 4096, 0.0, "bf16"), L(768, 256, 256, 8, 1024, 1.2, "bf16"),
)
HELD_OUT_DISPATCH: tuple = (
    P(2, 512, 256, 8, 2, 2048, 0.0, False, 1), P(2, 512, 256, 8, 2, 2048, 0.0, False, 2),
    P(2, 768, 384, 16, 4, 1024, 1.2, True, 1), P(2, 768, 384, 16, 4, 1024, 1.2, True, 2),
    P(2, 384, 192, 32, 2, 2048, 0.6, False, 1), P(2, 1024, 512, 8, 1, 1024, 0.0, True, 1),
    P(4, 512, 256, 16, 2, 1024, 0.0, False, 1), P(4, 512, 256, 16, 2, 1024, 0.0, False, 2),
    P(4, 768, 384, 32, 4, 512, 0.6, True, 1), P(4, 768, 384, 32, 4, 512, 0.6, True, 2),
    P(4, 384, 192, 64, 8, 512, 1.2, False, 1), P(4, 1024, 512, 16, 2, 512, 0.0, True, 1),
)
del L, P
QUICK_LAYERS = HELD_OUT_LAYERS[:2] + HELD_OUT_LAYERS[20:22]
QUICK_DISPATCH = HELD_OUT_DISPATCH[:2]


def held_out_shapes() -> list[tuple[int, int, int]]:
    """``(D, F, E)`` of every held-out configuration, for ``calibrate.check_disjoint``."""
    return sorted({(c.D, c.F, c.E) for c in HELD_OUT_LAYERS + HELD_OUT_DISPATCH})


calibrate.check_disjoint(held_out_shapes())


# ---------------------------------------------------------------------------------------------
# Part 1: the layer
# ---------------------------------------------------------------------------------------------


def _skewed_layer(c: LayerConfig, seed: int = 0):
    from torch_moe.nn.modules.moe import MoE, MoEConfig

    g = torch.Generator().manual_seed(seed)
    layer = MoE(MoEConfig(dim=c.D, hidden_dim=c.F, num_experts=c.E, top_k=c.k,
                          router_bias=True))
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.28 / math.sqrt(c.D), generator=g)
        order = torch.randperm(c.E, generator=g).float()
        layer.router.bias.copy_(-c.skew * torch.log1p(order))
    layer.to(_DTYPES[c.dtype])
    x = torch.randn(c.T, c.D, generator=g).to(_DTYPES[c.dtype]).requires_grad_()
    return layer, x


class _LayerRun:
    """One configuration's layer, input and timings."""

    def __init__(self, c: LayerConfig):
        self.config = c
        self.layer, self.x = _skewed_layer(c)
        self.times: list[float] = []

    def step(self, clock=time.perf_counter) -> float:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        t0 = clock()
        self.layer(self.x).sum().backward()
        elapsed = clock() - t0
        self.layer.zero_grad(set_to_none=True)  # the other layers' rounds need the memory
        return elapsed

    def release(self) -> None:
        """Keeps what the prediction needs (counts, saved bytes), frees the weights."""
        layer, x, c = self.layer, self.x, self.config
        counts = layer.tokens_per_expert.to(torch.float64)
        self.counts = (counts / counts.sum() * c.T * c.k).tolist()
        saved = SavedBytes([x, *layer.parameters()])
        with saved:
            y = layer(x)
        _, activations = saved.totals()
        del y
        self.saved_bytes = activations + x.numel() * x.element_size()  # the input is saved too
        del self.layer, self.x


def measure_layers(configs, rounds: int, clock=time.perf_counter) -> list[_LayerRun]:
    """Forward + backward of every configuration in ``rounds`` rounds after a warm-up round,
    each round timing every configuration once: a slow phase of the machine then lands on all
    configurations alike."""
    runs = [_LayerRun(c) for c in configs]
    for r in range(rounds + 1):
        for run in runs:
            t = run.step(clock)
            if r:
                run.times.append(t)
        print(f"  round {r}/{rounds} done", flush=True)
    for run in runs:
        run.release()
    return runs


def _breakdown(pred) -> dict:
    return dict(gemm_ms=pred.expert_gemm_s * 1e3, elementwise_ms=pred.elementwise_s * 1e3,
                page_fault_ms=pred.page_fault_s * 1e3, host_ms=pred.host_s * 1e3,
                a2a_ms=pred.a2a_s * 1e3)


def predict_layer(run: _LayerRun, profile, statistic=statistics.median) -> dict:
    c = run.config
    measured_s = statistic(run.times)
    pred = moe_layer_cost(MoELayerSpec(c.D, c.F, c.E, c.k),
                          MoEStrategy(ep=1, dispatch="plain", precision=c.dtype), profile,
                          tokens_per_rank=c.T, load=run.counts)
    mean = c.T * c.k / c.E
    return dict(part="layer", R=1, D=c.D, F=c.F, E=c.E, k=c.k, T=c.T, skew=c.skew,
                dtype=c.dtype, dispatch="-", chunks=1,
                max_over_mean=round(max(run.counts) / mean, 2),
                measured_ms=measured_s * 1e3, predicted_ms=pred.total_s * 1e3,
                time_err=pred.total_s / measured_s - 1,
                measured_saved_MiB=run.saved_bytes / 2**20,
                predicted_saved_MiB=pred.activation_bytes / 2**20,
                saved_err=pred.activation_bytes / run.saved_bytes - 1, **_breakdown(pred))


# ---------------------------------------------------------------------------------------------
# Part 2: dispatch on gloo
# ---------------------------------------------------------------------------------------------


def _zipf_ids(T: int, E: int, k: int, skew: float, g: torch.Generator) -> torch.Tensor:
    # the same expert order on every rank (seed 0); each token draws k distinct experts
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0)).double()
    p = (1.0 + order) ** -skew
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=g)


def _dispatch_rank(rank: int, world: int, port: int, configs, quick: bool, rounds: int,
                   out_path: str) -> None:
    import torch.distributed as dist

    from torch_moe.distributed.dispatch import (
        expert_parallel_moe_ffn,
        read_dispatch_counters,
        reset_dispatch_counters,
    )

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    before = calibrate.calibrate_local(quick=quick, group=dist.group.WORLD)

    runs = []
    for c in configs:
        g = torch.Generator().manual_seed(100 + rank)
        G = c.E // world
        x = torch.randn(c.T, c.D, generator=g).requires_grad_()
        ids = _zipf_ids(c.T, c.E, c.k, c.skew, g)
        wts = torch.rand(c.T, c.k, generator=g).requires_grad_()
        w1, w3 = (torch.randn(G, c.D, c.F, generator=g).div_(c.D ** 0.5).requires_grad_()
                  for _ in range(2))
        w2 = torch.randn(G, c.F, c.D, generator=g).div_(c.F ** 0.5).requires_grad_()
        runs.append(dict(config=c, tensors=(x, ids, wts, w1, w2, w3), times=[]))

    def step(run) -> float:
        x, ids, wts, w1, w2, w3 = run["tensors"]
        c = run["config"]
        for t in (x, wts, w1, w2, w3):
            t.grad = None
        reset_dispatch_counters()
        dist.barrier()
        t0 = time.perf_counter()
        y = expert_parallel_moe_ffn(x, ids, wts, w1, w2, w3, num_experts=c.E, dedup=c.dedup,
                                    num_chunks=c.num_chunks)
        y.sum().backward()
        elapsed = time.perf_counter() - t0
        run["sent"] = float(read_dispatch_counters()["bytes_sent"])
        return elapsed

    for r in range(rounds + 1):
        for run in runs:
            t = step(run)
            if r:
                run["times"].append(t)
    profile = calibrate.average_profiles(
        [before, calibrate.calibrate_local(quick=quick, group=dist.group.WORLD)],
        f"local-cpu-gloo{world}")

    rows = []
    for run in runs:
        c, ids = run["config"], run["tensors"][1]
        slowest = torch.tensor([statistics.median(run["times"])], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        counts = torch.bincount(ids.flatten(), minlength=c.E).double()
        dist.all_reduce(counts)
        sent = torch.tensor([run["sent"]], dtype=torch.float64)
        dist.all_reduce(sent)
        if rank == 0:
            pred = moe_layer_cost(
                MoELayerSpec(c.D, c.F, c.E, c.k),
                MoEStrategy(ep=world, dispatch="dedup" if c.dedup else "plain",
                            precision="fp32", num_chunks=c.num_chunks),
                profile, tokens_per_rank=c.T, gpus_per_node=world, load=counts.tolist())
            measured_s = slowest.item()
            mean = c.T * c.k * world / c.E
            # bytes_sent: remote dispatch rows plus the combine rows sent back, forward. The
            # model counts a rank's own copy among its dispatch rows; over the group, 1 / R of
            # the copies stay home.
            predicted_bytes = (pred.dispatch_bytes + pred.dispatch_rows * c.D * 4) \
                * (world - 1) / world
            measured_bytes = sent.item() / world
            rows.append(dict(
                part="dispatch", R=world, D=c.D, F=c.F, E=c.E, k=c.k, T=c.T, skew=c.skew,
                dtype="fp32", dispatch="dedup" if c.dedup else "plain", chunks=c.num_chunks,
                max_over_mean=round(counts.max().item() / mean, 2),
                measured_ms=measured_s * 1e3, predicted_ms=pred.total_s * 1e3,
                time_err=pred.total_s / measured_s - 1,
                measured_wire_bytes=measured_bytes, predicted_wire_bytes=predicted_bytes,
                wire_err=predicted_bytes / measured_bytes - 1, **_breakdown(pred),
                alpha_ms=profile.intra_node_latency_s * 1e3,
                bandwidth_GBps=profile.intra_node_bandwidth_Bps / 1e9,
                overlap=profile.overlap_efficiency))
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    destroy_process_group()


def run_dispatch(configs, quick: bool, rounds: int) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for world in sorted({c.R for c in configs}):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rows.json")
            mp.spawn(_dispatch_rank, args=(world, port, [c for c in configs if c.R == world],
                                           quick, rounds, out), nprocs=world)
            rows += json.loads(Path(out).read_text())
        print(f"  {world} gloo ranks done", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def percentile(values, q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics."""
    v = sorted(values)
    if not v:
        raise ValueError("expected at least one value")
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def error_stats(rows, key: str) -> dict | None:
    errs = [abs(r[key]) for r in rows if r.get(key) is not None]
    if not errs:
        return None
    return dict(n=len(errs), median=statistics.median(errs), p90=percentile(errs, 0.9),
                max=max(errs))


def chunk_pairs(rows) -> list[dict]:
    """Two-chunk over one-chunk time of the dispatch configurations run both ways, measured
    and predicted: the check of the pipeline (overlap) term."""
    key = ("R", "D", "F", "E", "k", "T", "skew", "dispatch")
    one = {tuple(r[n] for n in key): r for r in rows if r["part"] == "dispatch"
           and r["chunks"] == 1}
    out = []
    for r in rows:
        base = one.get(tuple(r[n] for n in key))
        if r["part"] == "dispatch" and r["chunks"] > 1 and base is not None:
            m = r["measured_ms"] / base["measured_ms"]
            p = r["predicted_ms"] / base["predicted_ms"]
            out.append(dict(R=r["R"], E=r["E"], k=r["k"], chunks=r["chunks"],
                            measured_ratio=m, predicted_ratio=p, ratio_err=p / m - 1,
                            overlap=r["overlap"]))
    return out


def summarize(rows) -> str:
    lines = []
    for name, key in (("time", "time_err"), ("saved bytes", "saved_err"),
                      ("wire bytes", "wire_err")):
        s = error_stats(rows, key)
        if s:
            lines.append(f"{name} |predicted / measured - 1| over {s['n']} configurations: "
                         f"median {s['median'] * 100:.1f}%, p90 {s['p90'] * 100:.1f}%, max "
                         f"{s['max'] * 100:.1f}%")
    for part in ("layer", "dispatch"):
        s = error_stats([r for r in rows if r["part"] == part], "time_err")
        if s:
            lines.append(f"  time, {part} only ({s['n']}): median {s['median'] * 100:.1f}%, "
                         f"p90 {s['p90'] * 100:.1f}%, max {s['max'] * 100:.1f}%")
    for p in chunk_pairs(rows):
        lines.append(f"chunks {p['chunks']} / 1 at R={p['R']} E={p['E']} k={p['k']}: measured "
                     f"{p['measured_ratio']:.3f}, predicted {p['predicted_ratio']:.3f} "
                     f"(overlap_efficiency {p['overlap']:.2f})")
    return "\n".join(lines)


def _fmt(rows) -> list[dict]:
    out = []
    for r in rows:
        f = {}
        for key, v in r.items():
            if key.endswith("_err"):
                f[key] = f"{v * 100:+.1f}%"
            elif isinstance(v, float):
                f[key] = f"{v:.3g}" if abs(v) < 1e4 else f"{v:.4g}"
            else:
                f[key] = v
        out.append(f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a few configurations and quick calibrations (plumbing only)")
    parser.add_argument("--no-dispatch", action="store_true", help="skip the gloo part")
    parser.add_argument("--no-layers", action="store_true", help="skip the layer part")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed rounds per configuration (default 7, quick 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads of the layer part (calibration and layers)")
    parser.add_argument("--clock", choices=("thread", "wall"), default="thread",
                        help="what the layer part and its calibrations time: the thread's CPU "
                             "time (needs --threads 1) or wall time")
    parser.add_argument("--statistic", choices=("min", "median"), default="min",
                        help="how the layer part and its calibrations summarise repetitions")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the CSV and JSON")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error(f"--clock thread times one thread: expected --threads 1, but got "
                     f"--threads {args.threads}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    statistic = min if args.statistic == "min" else statistics.median
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rounds = args.rounds or (2 if args.quick else 7)
    layer_configs = () if args.no_layers else QUICK_LAYERS if args.quick else HELD_OUT_LAYERS
    dispatch_configs = () if args.no_dispatch else (
        QUICK_DISPATCH if args.quick else HELD_OUT_DISPATCH)

    print("\n".join(environment_header()))
    t0 = time.perf_counter()

    def calibrated(when):
        with calibrate.timing(clock, statistic):
            p = calibrate.calibrate_local(quick=args.quick)
        create = ", ".join(f"{r:.0f}: {t * 1e3:.2f}" for r, t in p.gemm_create_s["bf16"])
        print(f"calibration {when}: GEMM peak fp32 {p.peak_flops['fp32'] / 1e9:.0f}, bf16 "
              f"{p.peak_flops['bf16'] / 1e9:.0f} GFLOP/s, bf16 GEMM set-up by rows ({create}) "
              f"ms, copy {p.memory_bandwidth_Bps / 1e9:.1f} GB/s, elementwise "
              f"{p.elementwise_Bps / 1e9:.1f} (hidden width "
              f"{p.elementwise_hidden_rate_Bps / 1e9:.1f}) GB/s, per mm call "
              f"{p.per_group_s * 1e6:.1f} us, "
              f"layer stand-in {p.layer_overhead_s * 1e3:.2f} ms, page faults "
              f"{p.page_fault_s_per_byte * 2**20 * 1e3:.2f} ms/MiB", flush=True)
        return p

    rows = []
    if layer_configs:
        before = calibrated("before")
        runs = measure_layers(layer_configs, rounds, clock)
        profile = calibrate.average_profiles([before, calibrated("after")], "local-cpu")
        calibrate.save_profile(profile, out_dir / "cost_model_profile.json")
        rows += [predict_layer(run, profile, statistic) for run in runs]
    if dispatch_configs:
        rows += run_dispatch(dispatch_configs, args.quick, rounds)

    columns = ["part", "R", "D", "F", "E", "k", "T", "skew", "dtype", "dispatch", "chunks",
               "max_over_mean", "measured_ms", "predicted_ms", "time_err", "saved_err",
               "wire_err", "gemm_ms", "elementwise_ms", "page_fault_ms", "host_ms", "a2a_ms"]
    print("\nSwiGLU; forward + backward; predicted from per-expert counts")
    print(format_table(_fmt(rows), columns))
    print()
    print(summarize(rows))
    write_csv(out_dir / "cost_model_validation.csv", rows)
    print(f"\nwrote {out_dir / 'cost_model_validation.csv'}, "
          f"{out_dir / 'cost_model_profile.json'}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
