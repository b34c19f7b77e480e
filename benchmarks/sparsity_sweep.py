"""The MoE cost model against torch_moe itself, across sparsity regimes: measured and predicted
time, saved-activation memory and dispatch bytes, as a table, a CSV, an error summary and plots.

Part 1, the layer: :class:`torch_moe.nn.MoE` forward + backward in one process (fp32, SwiGLU,
D = 512, F = 256), over E from 8 to 256, k from 1 to 8, T from 256 to 16384 tokens and router
skew from uniform to Zipf 1.2. Skew comes from the router's bias, ``-s * log(1 + rank)`` of a
random expert order, plus logits of standard deviation ~1.28 from the weights (close to Gumbel
noise, for which top-1 picks expert ``e`` with probability proportional to ``rank^-s``). The
prediction is ``moe_layer_cost`` on the profile :func:`calibrate_local` measures first (from
microbenchmarks at shapes disjoint from these, asserted below), given the per-expert counts the
layer actually routed. The held-out check of the cost model over many shapes and both dtypes
is ``benchmarks/cost_model_validation.py``; this sweep plots one shape across sparsity.
Memory is the storages autograd saves (``saved_tensors_hooks``, each once) plus the input,
against ``activation_bytes``.

Part 2, dispatch: :func:`expert_parallel_moe_ffn` forward + backward on 2 and 4 gloo processes
(one compute thread each, so 4 processes share 2 cores), plain and dedup, ids drawn per token
from a Zipf(s) expert distribution. Each process group calibrates its own profile before and
after its configurations, all ranks at once (so core sharing, gloo's alpha-beta and the
dispatcher's host work per row are in it), and times them in interleaved rounds. Measured: the
slowest rank's median, each call after a barrier; predicted: ``moe_layer_cost(ep=R)``. Bytes:
the dispatcher's ``bytes_sent`` counter against ``dispatch_bytes``.

Error = predicted / measured - 1; the summary gives the median and 90th percentile of its
absolute value over all configurations. Plots (``--plots``, needs matplotlib: ``pip install
-e .[plots]``): time per token against E and k, the roofline of each grouped GEMM (the up
projection measured through ``torch_moe.grouped_mm``, and the model's point for each of the
layer's grouped GEMMs), and the communication share of an MoE layer against the EP degree.

    python benchmarks/sparsity_sweep.py              # ~10 minutes on 2 cores; CSV + PNGs
    python benchmarks/sparsity_sweep.py --quick      # a handful of small configs, ~1 minute

The machine should be otherwise idle: the profile and the measurements are taken minutes apart.
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

from torch_moe.distributed._tools import calibrate, comm_cost, gemm_cost  # noqa: E402
from torch_moe.distributed._tools.cost_model import (  # noqa: E402
    MoELayerSpec,
    MoEStrategy,
    moe_layer_cost,
)

D, F = 512, 256
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class LayerCase:
    E: int
    k: int
    T: int
    skew: float


@dataclass(frozen=True)
class DispatchCase:
    R: int
    E: int
    k: int
    T: int
    skew: float
    dedup: bool


# A grid over E and k at fixed T (the time-per-token plot), then T and skew varied.
LAYER_CASES = [LayerCase(E, k, 2048, 0.0) for E in (8, 32, 128, 256) for k in (1, 2, 8)] + [
    LayerCase(8, 1, 256, 0.0), LayerCase(8, 2, 16384, 0.0), LayerCase(8, 2, 4096, 1.2),
    LayerCase(16, 2, 1024, 1.2), LayerCase(16, 4, 4096, 0.0), LayerCase(16, 1, 16384, 0.6),
    LayerCase(32, 4, 256, 0.0), LayerCase(32, 4, 4096, 0.6), LayerCase(32, 2, 16384, 1.2),
    LayerCase(64, 8, 256, 0.0), LayerCase(64, 6, 1024, 0.6), LayerCase(64, 2, 4096, 1.2),
    LayerCase(128, 4, 1024, 0.6), LayerCase(256, 8, 256, 0.6), LayerCase(256, 4, 4096, 1.2),
    LayerCase(256, 8, 16384, 1.2),
]
DISPATCH_CASES = [
    DispatchCase(2, 8, 2, 2048, 0.0, False), DispatchCase(2, 8, 2, 2048, 0.0, True),
    DispatchCase(2, 32, 4, 4096, 1.2, True), DispatchCase(2, 64, 8, 1024, 0.0, False),
    DispatchCase(2, 16, 1, 8192, 0.6, False),
    DispatchCase(4, 8, 2, 1024, 0.0, False), DispatchCase(4, 16, 4, 2048, 0.0, True),
    DispatchCase(4, 64, 8, 2048, 1.2, False), DispatchCase(4, 32, 2, 4096, 0.6, True),
    DispatchCase(4, 256, 8, 1024, 0.0, True),
]
QUICK_LAYER = [LayerCase(8, 2, 512, 0.0), LayerCase(64, 8, 256, 1.2), LayerCase(32, 1, 1024, 0.6)]
QUICK_DISPATCH = [DispatchCase(2, 8, 2, 512, 0.0, False), DispatchCase(2, 16, 4, 512, 1.2, True)]
calibrate.check_disjoint(sorted({(D, F, c.E) for c in LAYER_CASES + DISPATCH_CASES}))


# ---------------------------------------------------------------------------------------------
# Part 1: the layer
# ---------------------------------------------------------------------------------------------


def _skewed_layer(case: LayerCase, seed: int = 0):
    from torch_moe.nn.modules.moe import MoE, MoEConfig

    g = torch.Generator().manual_seed(seed)
    layer = MoE(MoEConfig(dim=D, hidden_dim=F, num_experts=case.E, top_k=case.k,
                          router_bias=True))
    with torch.no_grad():
        layer.router.weight.normal_(0, 1.28 / math.sqrt(D), generator=g)
        order = torch.randperm(case.E, generator=g).float()
        layer.router.bias.copy_(-case.skew * torch.log1p(order))
    x = torch.randn(case.T, D, generator=g).requires_grad_()
    return layer, x


ROUNDS = 5


class _LayerRun:
    """One configuration's layer, input and timings."""

    def __init__(self, case: LayerCase):
        self.case = case
        self.layer, self.x = _skewed_layer(case)
        self.times: list[float] = []

    def step(self) -> float:
        self.layer.zero_grad(set_to_none=True)
        self.x.grad = None
        t0 = time.perf_counter()
        self.layer(self.x).sum().backward()
        elapsed = time.perf_counter() - t0
        self.layer.zero_grad(set_to_none=True)  # the other layers' rounds need the memory
        return elapsed

    def release(self) -> None:
        """Keeps what the prediction needs (counts, saved bytes), frees the weights."""
        layer, x = self.layer, self.x
        counts = layer.tokens_per_expert.to(torch.float64)
        self.counts = (counts / counts.sum() * self.case.T * self.case.k).tolist()
        saved = SavedBytes([x, *layer.parameters()])
        with saved:
            y = layer(x)
        _, activations = saved.totals()
        del y
        self.saved_bytes = activations + x.numel() * x.element_size()  # the input is saved too
        del self.layer, self.x


def measure_layers(cases: list[LayerCase], rounds: int = ROUNDS) -> list[_LayerRun]:
    """Forward + backward of every configuration, in ``rounds`` rounds that each time every
    configuration once (after a warm-up round): a slow phase of the machine then lands on all
    configurations alike instead of on the few measured during it."""
    runs = [_LayerRun(c) for c in cases]
    for r in range(rounds + 1):
        for run in runs:
            t = run.step()
            if r:
                run.times.append(t)
        print(f"  round {r}/{rounds} done", flush=True)
    for run in runs:
        run.release()
    return runs


def predict_layer(run: _LayerRun, profile) -> dict:
    case = run.case
    measured_s = statistics.median(run.times)
    spec = MoELayerSpec(D, F, case.E, case.k)
    pred = moe_layer_cost(spec, MoEStrategy(ep=1, dispatch="plain", precision="fp32"), profile,
                          tokens_per_rank=case.T, load=run.counts)
    mean = case.T * case.k / case.E
    return dict(part="layer", R=1, E=case.E, k=case.k, T=case.T, skew=case.skew, dispatch="-",
                max_over_mean=round(max(run.counts) / mean, 2),
                measured_ms=measured_s * 1e3, predicted_ms=pred.total_s * 1e3,
                time_err=pred.total_s / measured_s - 1,
                measured_MiB=run.saved_bytes / 2**20,
                predicted_MiB=pred.activation_bytes / 2**20,
                mem_err=pred.activation_bytes / run.saved_bytes - 1,
                gemm_ms=pred.expert_gemm_s * 1e3, elementwise_ms=pred.elementwise_s * 1e3,
                page_fault_ms=pred.page_fault_s * 1e3, host_ms=pred.host_s * 1e3,
                a2a_ms=pred.a2a_s * 1e3, counts=run.counts)


def measure_grouped_mm(case: LayerCase, counts: list[float], profile) -> dict:
    """Roofline point of the up projection ``[S, D] @ [E, D, F]`` as ``torch_moe.grouped_mm``
    runs it with the layer's per-expert counts, measured and predicted."""
    import torch_moe  # noqa: F401

    rows = [int(round(c)) for c in counts]
    S = sum(rows)
    a = torch.randn(S, D)
    w = torch.randn(case.E, D, F)
    offs = torch.tensor(rows, dtype=torch.int64).cumsum(0).to(torch.int32)
    # the same timing as the calibration's GEMM points: one warm-up, median of 9
    measured = calibrate._median_s(lambda: torch.ops.torch_moe.grouped_mm(a, w, offs), 9)
    predicted = gemm_cost.grouped_gemm_time_s(profile, "fp32", rows, F, D)
    flops = 2.0 * S * D * F
    used = sum(1 for r in rows if r)
    moved = 4.0 * (S * D + used * D * F + S * F)  # rows in, weights of used experts, out
    return dict(intensity=flops / moved, measured_flops=flops / measured,
                predicted_flops=flops / predicted, rows_per_expert=S / case.E)


# ---------------------------------------------------------------------------------------------
# Part 2: dispatch on gloo
# ---------------------------------------------------------------------------------------------


def _zipf_ids(T: int, E: int, k: int, skew: float, g: torch.Generator) -> torch.Tensor:
    # the same expert order on every rank (seed 0); each token draws k distinct experts
    order = torch.randperm(E, generator=torch.Generator().manual_seed(0)).double()
    p = (1.0 + order) ** -skew
    return torch.multinomial(p.expand(T, E), k, replacement=False, generator=g)


def _dispatch_rank(rank: int, world: int, port: int, cases: list, quick: bool,
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
    for case in cases:
        g = torch.Generator().manual_seed(100 + rank)
        G = case.E // world
        x = torch.randn(case.T, D, generator=g).requires_grad_()
        ids = _zipf_ids(case.T, case.E, case.k, case.skew, g)
        wts = torch.rand(case.T, case.k, generator=g).requires_grad_()
        w1, w3 = (torch.randn(G, D, F, generator=g).div_(D ** 0.5).requires_grad_()
                  for _ in range(2))
        w2 = torch.randn(G, F, D, generator=g).div_(F ** 0.5).requires_grad_()
        runs.append(dict(case=case, tensors=(x, ids, wts, w1, w2, w3), times=[]))

    def step(run) -> float:
        x, ids, wts, w1, w2, w3 = run["tensors"]
        for t in (x, wts, w1, w2, w3):
            t.grad = None
        reset_dispatch_counters()
        dist.barrier()
        t0 = time.perf_counter()
        y = expert_parallel_moe_ffn(x, ids, wts, w1, w2, w3, num_experts=run["case"].E,
                                    dedup=run["case"].dedup)
        y.sum().backward()
        elapsed = time.perf_counter() - t0
        run["sent"] = float(read_dispatch_counters()["bytes_sent"])
        return elapsed

    # interleaved rounds after a warm-up round, as for the layer
    for r in range(ROUNDS + 1):
        for run in runs:
            t = step(run)
            if r:
                run["times"].append(t)
    profile = calibrate.average_profiles(
        [before, calibrate.calibrate_local(quick=quick, group=dist.group.WORLD)],
        f"local-cpu-gloo{world}")

    rows = []
    for run in runs:
        case, ids = run["case"], run["tensors"][1]
        slowest = torch.tensor([statistics.median(run["times"])], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        counts = torch.bincount(ids.flatten(), minlength=case.E).double()
        dist.all_reduce(counts)
        sent = torch.tensor([run["sent"]], dtype=torch.float64)
        dist.all_reduce(sent)
        if rank == 0:
            pred = moe_layer_cost(
                MoELayerSpec(D, F, case.E, case.k),
                MoEStrategy(ep=world, dispatch="dedup" if case.dedup else "plain",
                            precision="fp32"),
                profile, tokens_per_rank=case.T, gpus_per_node=world, load=counts.tolist())
            measured_s = slowest.item()
            mean = case.T * case.k * world / case.E
            # bytes_sent: remote dispatch rows plus the combine rows sent back, forward. The
            # model counts a rank's own copy among its dispatch rows; over the group, 1 / R of
            # the copies stay home.
            predicted_bytes = (pred.dispatch_bytes + pred.dispatch_rows * D * 4) \
                * (world - 1) / world
            measured_bytes = sent.item() / world
            rows.append(dict(
                part="dispatch", R=world, E=case.E, k=case.k, T=case.T, skew=case.skew,
                dispatch="dedup" if case.dedup else "plain",
                max_over_mean=round(counts.max().item() / mean, 2),
                measured_ms=measured_s * 1e3, predicted_ms=pred.total_s * 1e3,
                time_err=pred.total_s / measured_s - 1,
                measured_bytes=measured_bytes, predicted_bytes=predicted_bytes,
                bytes_err=predicted_bytes / measured_bytes - 1,
                gemm_ms=pred.expert_gemm_s * 1e3, elementwise_ms=pred.elementwise_s * 1e3,
                page_fault_ms=pred.page_fault_s * 1e3, host_ms=pred.host_s * 1e3,
                a2a_ms=pred.a2a_s * 1e3, a2a_share=pred.a2a_s / max(pred.total_s, 1e-12),
                alpha_ms=profile.intra_node_latency_s * 1e3,
                bandwidth_GBps=profile.intra_node_bandwidth_Bps / 1e9,
                overlap=profile.overlap_efficiency))
    if rank == 0:
        Path(out_path).write_text(json.dumps(rows))
    destroy_process_group()


def run_dispatch(cases: list, quick: bool) -> list[dict]:
    import torch.multiprocessing as mp

    rows = []
    for world in sorted({c.R for c in cases}):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "rows.json")
            mp.spawn(_dispatch_rank, args=(world, port, [c for c in cases if c.R == world],
                                           quick, out), nprocs=world)
            rows += json.loads(Path(out).read_text())
    return rows


# ---------------------------------------------------------------------------------------------
# Summary and plots
# ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) by linear interpolation between order statistics."""
    v = sorted(values)
    if not v:
        raise ValueError("expected at least one value")
    pos = q * (len(v) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def summarize(rows: list[dict]) -> str:
    lines = []
    for name, key in (("time", "time_err"), ("memory", "mem_err"), ("bytes", "bytes_err")):
        errs = [abs(r[key]) for r in rows if key in r]
        if errs:
            lines.append(f"{name} |error| over {len(errs)} configurations: median "
                         f"{statistics.median(errs) * 100:.1f}%, p90 "
                         f"{percentile(errs, 0.9) * 100:.1f}%, max {max(errs) * 100:.1f}%")
    return "\n".join(lines)


def comm_share_curve(profile_name: str = "h100") -> list[dict]:
    """Predicted communication share of a DeepSeek-V3 MoE layer (D=7168, F=2048, E=256, k=8,
    one shared expert, 4096 tokens per GPU, node-limited to 4 nodes) against the EP degree."""
    from torch_moe.distributed._tools import get_profile

    prof = get_profile(profile_name)
    layer = MoELayerSpec(7168, 2048, 256, 8, num_shared_experts=1, max_nodes=4)
    out = []
    for ep in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for method in ("plain", "dedup", "node_limited"):
            if method == "node_limited" and comm_cost.ep_nodes(ep, 1, 8) == 1:
                continue
            c = moe_layer_cost(layer, MoEStrategy(ep=ep, dispatch=method, precision="bf16",
                                                  dispatcher="fused"), prof, 4096, 8)
            out.append(dict(ep=ep, dispatch=method, a2a_share=c.a2a_s / c.total_s,
                            exposed_share=c.exposed_a2a_s / c.total_s))
    return out


def plot(layer_rows, dispatch_rows, roofline, profile, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[plots]): no plots")
        return []
    paths = []

    # 1. time per token against E, one line per k (the T = 2048 uniform grid)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    grid = [r for r in layer_rows if r["T"] == 2048 and r["skew"] == 0.0] or layer_rows
    for k in sorted({r["k"] for r in grid}):
        pts = sorted((r["E"], r["measured_ms"] / r["T"], r["predicted_ms"] / r["T"])
                     for r in grid if r["k"] == k)
        line, = ax.plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], "-",
                        label=f"k={k} predicted")
        ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], "o",
                color=line.get_color(), label=f"k={k} measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("experts E")
    ax.set_ylabel("forward + backward, us per token")
    ax.set_title(f"MoE layer, T=2048, D={D}, F={F}, fp32, uniform routing")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    paths.append(out_dir / "sparsity_time_per_token.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # 2. roofline of the up projection's grouped GEMM
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    peak, bw = profile.peak_flops["fp32"], profile.memory_bandwidth_Bps
    xs = [0.1 * 1.25 ** i for i in range(42)]
    ax.plot(xs, [min(peak, bw * x) / 1e9 for x in xs], "k-", lw=1,
            label=f"roofline: {peak / 1e9:.0f} GFLOP/s, {bw / 1e9:.0f} GB/s")
    ax.scatter([p["intensity"] for p in roofline], [p["measured_flops"] / 1e9 for p in roofline],
               c="C0", label="measured (torch_moe.grouped_mm)")
    ax.scatter([p["intensity"] for p in roofline],
               [p["predicted_flops"] / 1e9 for p in roofline], marker="x", c="C1",
               label="predicted (cost model)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP / byte")
    ax.set_ylabel("GFLOP/s")
    ax.set_title("Up-projection grouped GEMM of each layer configuration")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    paths.append(out_dir / "sparsity_roofline.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # 3. communication share against the EP degree
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    curve = comm_share_curve()
    for method in ("plain", "dedup", "node_limited"):
        pts = [(r["ep"], r["a2a_share"]) for r in curve if r["dispatch"] == method]
        ax.plot([p[0] for p in pts], [p[1] * 100 for p in pts], "-o", ms=3,
                label=f"H100, DeepSeek-V3 layer, {method}")
    if dispatch_rows:
        for dedup in ("plain", "dedup"):
            pts = [(r["R"], r["a2a_share"]) for r in dispatch_rows if r["dispatch"] == dedup]
            if pts:
                ax.scatter([p[0] for p in pts], [p[1] * 100 for p in pts], marker="s",
                           label=f"this CPU, gloo, {dedup} (predicted)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("expert-parallel degree")
    ax.set_ylabel("all-to-all share of layer time, %")
    ax.set_title("Communication share of one MoE layer, forward + backward")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    paths.append(out_dir / "sparsity_comm_share.png")
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def _fmt(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        f = {}
        for key, v in r.items():
            if key == "counts":
                continue
            if key.endswith("_err") or key == "a2a_share":
                f[key] = f"{v * 100:+.1f}%" if key.endswith("_err") else f"{v * 100:.0f}%"
            elif isinstance(v, float):
                f[key] = f"{v:.3g}" if abs(v) < 1e4 else f"{v:.4g}"
            else:
                f[key] = v
        out.append(f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few small configurations")
    parser.add_argument("--no-dispatch", action="store_true", help="skip the gloo part")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--out", default=str(RESULTS), help="directory for the CSV and PNGs")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    layer_cases = QUICK_LAYER if args.quick else LAYER_CASES
    dispatch_cases = [] if args.no_dispatch else QUICK_DISPATCH if args.quick else DISPATCH_CASES

    print("\n".join(environment_header()))
    t0 = time.perf_counter()

    def calibrated(when):
        p = calibrate.calibrate_local(quick=args.quick)
        print(f"calibration {when}: GEMM peak {p.peak_flops['fp32'] / 1e9:.0f} GFLOP/s, copy "
              f"{p.memory_bandwidth_Bps / 1e9:.1f} GB/s, elementwise "
              f"{p.elementwise_Bps / 1e9:.1f} GB/s, per group {p.per_group_s * 1e6:.1f} us, "
              f"layer call {p.layer_overhead_s * 1e3:.2f} ms, page faults "
              f"{p.page_fault_s_per_byte * 2**20 * 1e3:.2f} ms/MiB", flush=True)
        return p

    before = calibrated("before")
    runs = measure_layers(layer_cases, 2 if args.quick else ROUNDS)
    profile = calibrate.average_profiles([before, calibrated("after")], "local-cpu")
    calibrate.save_profile(profile, out_dir / "local_cpu_profile.json")
    layer_rows = [predict_layer(run, profile) for run in runs]
    roofline = [measure_grouped_mm(r.case, r.counts, profile) for r in runs]
    dispatch_rows = run_dispatch(dispatch_cases, args.quick) if dispatch_cases else []
    rows = layer_rows + dispatch_rows

    columns = ["part", "R", "E", "k", "T", "skew", "dispatch", "max_over_mean", "measured_ms",
               "predicted_ms", "time_err", "measured_MiB", "predicted_MiB", "mem_err",
               "measured_bytes", "predicted_bytes", "bytes_err", "gemm_ms", "elementwise_ms",
               "page_fault_ms", "host_ms", "a2a_ms"]
    print(f"\nD={D}, F={F}, fp32, SwiGLU; forward + backward; predicted from per-expert counts")
    print(format_table(_fmt(rows), columns))
    print()
    print(summarize(rows))
    csv_rows = [{k: v for k, v in r.items() if k != "counts"} for r in rows]
    write_csv(out_dir / "sparsity_sweep.csv", csv_rows)
    write_csv(out_dir / "sparsity_roofline.csv",
              [dict(E=c.E, k=c.k, T=c.T, skew=c.skew, **p) for c, p in zip(layer_cases, roofline)])
    print(f"\nwrote {out_dir / 'sparsity_sweep.csv'}, {out_dir / 'sparsity_roofline.csv'}")
    if not args.no_plots:
        for p in plot(layer_rows, dispatch_rows, roofline, profile, out_dir):
            print(f"wrote {p}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
