"""The MoE cost model against torch_moe itself, across sparsity regimes: measured and predicted
time, saved-activation memory and dispatch bytes, as a table, a CSV, an error summary and plots.

The measurements and predictions are ``benchmarks/cost_model_validation.py``'s (its layer and
gloo dispatch runs, their predictions and its error summary), on a grid of its own: this sweep
plots one shape across sparsity, the validation checks the model over many shapes and both
dtypes.

Part 1, the layer: :class:`torch_moe.nn.MoE` forward + backward in one process (fp32, SwiGLU,
D = 512, F = 256), over E from 8 to 256, k from 1 to 8, T from 256 to 16384 tokens and router
skew from uniform to Zipf 1.2 (from the router's bias, as in the validation). On one compute
thread, timed in that thread's CPU time and summarised by the minimum over interleaved rounds,
the layers and the two calibrations around them alike (on a shared machine CPU time leaves out
the time other processes hold the core, and the minimum the rounds their cache traffic slowed;
on an idle one they are the wall time and the median). The prediction is ``moe_layer_cost`` on
the averaged profile of those calibrations (microbenchmarks at shapes disjoint from these,
asserted below), given the per-expert counts the layer actually routed. Memory is the storages
autograd saves plus the input, against ``activation_bytes``.

Part 2, dispatch: :func:`expert_parallel_moe_ffn` forward + backward on 2 and 4 gloo processes
(one compute thread each, so 4 processes share 2 cores), plain and dedup, ids drawn per token
from a Zipf(s) expert distribution; each process group calibrates its own profile before and
after its configurations. Measured: the slowest rank's median wall time, each call after a
barrier; predicted: ``moe_layer_cost(ep=R)``. Bytes: the dispatcher's ``bytes_sent`` counter
against the model's dispatch and combine bytes.

Error = predicted / measured - 1; the summary gives the median, 90th percentile and maximum of
its absolute value. Plots (``--no-plots`` to skip; they need matplotlib: ``pip install -e
.[plots]``): time per token against E and k, the roofline of each grouped GEMM (the up
projection measured through ``torch_moe.grouped_mm``, and the model's point for each of the
layer's grouped GEMMs), and the communication share of an MoE layer against the EP degree.

    python benchmarks/sparsity_sweep.py              # 10 minutes or more; CSV + PNGs
    python benchmarks/sparsity_sweep.py --quick      # a handful of small configs, ~15 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment_header, format_table, write_csv  # noqa: E402
from cost_model_validation import (  # noqa: E402
    _fmt,
    DispatchConfig,
    LayerConfig,
    measure_layers,
    predict_layer,
    run_dispatch,
    summarize,
)

from torch_moe.distributed._tools import calibrate, comm_cost, gemm_cost  # noqa: E402
from torch_moe.distributed._tools.cost_model import (  # noqa: E402
    MoELayerSpec,
    MoEStrategy,
    moe_layer_cost,
)

D, F = 512, 256
RESULTS = Path(__file__).resolve().parent / "results"
ROUNDS = 5


def _layer(E: int, k: int, T: int, skew: float) -> LayerConfig:
    return LayerConfig(D, F, E, k, T, skew, "fp32")


def _dispatch(R: int, E: int, k: int, T: int, skew: float, dedup: bool) -> DispatchConfig:
    return DispatchConfig(R, D, F, E, k, T, skew, dedup)


# A grid over E and k at fixed T (the time-per-token plot), then T and skew varied.
LAYER_CASES = [_layer(E, k, 2048, 0.0) for E in (8, 32, 128, 256) for k in (1, 2, 8)] + [
    _layer(8, 1, 256, 0.0), _layer(8, 2, 16384, 0.0), _layer(8, 2, 4096, 1.2),
    _layer(16, 2, 1024, 1.2), _layer(16, 4, 4096, 0.0), _layer(16, 1, 16384, 0.6),
    _layer(32, 4, 256, 0.0), _layer(32, 4, 4096, 0.6), _layer(32, 2, 16384, 1.2),
    _layer(64, 8, 256, 0.0), _layer(64, 6, 1024, 0.6), _layer(64, 2, 4096, 1.2),
    _layer(128, 4, 1024, 0.6), _layer(256, 8, 256, 0.6), _layer(256, 4, 4096, 1.2),
    _layer(256, 8, 16384, 1.2),
]
DISPATCH_CASES = [
    _dispatch(2, 8, 2, 2048, 0.0, False), _dispatch(2, 8, 2, 2048, 0.0, True),
    _dispatch(2, 32, 4, 4096, 1.2, True), _dispatch(2, 64, 8, 1024, 0.0, False),
    _dispatch(2, 16, 1, 8192, 0.6, False),
    _dispatch(4, 8, 2, 1024, 0.0, False), _dispatch(4, 16, 4, 2048, 0.0, True),
    _dispatch(4, 64, 8, 2048, 1.2, False), _dispatch(4, 32, 2, 4096, 0.6, True),
    _dispatch(4, 256, 8, 1024, 0.0, True),
]
QUICK_LAYER = [_layer(8, 2, 512, 0.0), _layer(64, 8, 256, 1.2), _layer(32, 1, 1024, 0.6)]
QUICK_DISPATCH = [_dispatch(2, 8, 2, 512, 0.0, False), _dispatch(2, 16, 4, 512, 1.2, True)]
calibrate.check_disjoint(sorted({(c.D, c.F, c.E) for c in LAYER_CASES + DISPATCH_CASES}))


def measure_grouped_mm(c: LayerConfig, counts: list[float], profile) -> dict:
    """Roofline point of the up projection ``[S, D] @ [E, D, F]`` as ``torch_moe.grouped_mm``
    runs it with the layer's per-expert counts, measured and predicted (the op is registered by
    the ``torch_moe`` imports above)."""
    rows = [int(round(n)) for n in counts]
    S = sum(rows)
    a = torch.randn(S, c.D)
    w = torch.randn(c.E, c.D, c.F)
    offs = torch.tensor(rows, dtype=torch.int64).cumsum(0).to(torch.int32)
    # the same timing as the calibration's GEMM points: one warm-up, then 9 repetitions
    measured = calibrate._median_s(lambda: torch.ops.torch_moe.grouped_mm(a, w, offs), 9)
    predicted = gemm_cost.grouped_gemm_time_s(profile, "fp32", rows, c.F, c.D)
    flops = 2.0 * S * c.D * c.F
    used = sum(1 for r in rows if r)
    moved = 4.0 * (S * c.D + used * c.D * c.F + S * c.F)  # rows in, used experts' weights, out
    return dict(intensity=flops / moved, measured_flops=flops / measured,
                predicted_flops=flops / predicted, rows_per_expert=S / c.E)


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


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

    # one compute thread timed in its CPU time, the minimum of the rounds (see the docstring)
    torch.set_num_threads(1)
    clock, statistic = time.thread_time, min
    print("\n".join(environment_header()))
    t0 = time.perf_counter()

    def calibrated(when):
        with calibrate.timing(clock, statistic):
            p = calibrate.calibrate_local(quick=args.quick)
        print(f"calibration {when}: GEMM peak {p.peak_flops['fp32'] / 1e9:.0f} GFLOP/s, copy "
              f"{p.memory_bandwidth_Bps / 1e9:.1f} GB/s, elementwise "
              f"{p.elementwise_Bps / 1e9:.1f} GB/s, per group {p.per_group_s * 1e6:.1f} us, "
              f"layer call {p.layer_overhead_s * 1e3:.2f} ms, page faults "
              f"{p.page_fault_s_per_byte * 2**20 * 1e3:.2f} ms/MiB", flush=True)
        return p

    rounds = 2 if args.quick else ROUNDS
    before = calibrated("before")
    runs = measure_layers(layer_cases, rounds, clock)
    profile = calibrate.average_profiles([before, calibrated("after")], "local-cpu")
    calibrate.save_profile(profile, out_dir / "local_cpu_profile.json")
    layer_rows = [predict_layer(run, profile, statistic) for run in runs]
    with calibrate.timing(clock, statistic):
        roofline = [measure_grouped_mm(r.config, r.counts, profile) for r in runs]
    dispatch_rows = run_dispatch(dispatch_cases, args.quick, rounds) if dispatch_cases else []
    for r in dispatch_rows:
        r["a2a_share"] = r["a2a_ms"] / max(r["predicted_ms"], 1e-9)
    rows = layer_rows + dispatch_rows

    columns = ["part", "R", "E", "k", "T", "skew", "dispatch", "max_over_mean", "measured_ms",
               "predicted_ms", "time_err", "measured_saved_MiB", "predicted_saved_MiB",
               "saved_err", "measured_wire_bytes", "predicted_wire_bytes", "wire_err", "gemm_ms",
               "elementwise_ms", "page_fault_ms", "host_ms", "a2a_ms"]
    print(f"\nD={D}, F={F}, fp32, SwiGLU; forward + backward; predicted from per-expert counts")
    print(format_table(_fmt(rows), columns))
    print()
    print(summarize(rows))
    write_csv(out_dir / "sparsity_sweep.csv", rows)
    write_csv(out_dir / "sparsity_roofline.csv",
              [dict(E=c.E, k=c.k, T=c.T, skew=c.skew, **p) for c, p in zip(layer_cases, roofline)])
    print(f"\nwrote {out_dir / 'sparsity_sweep.csv'}, {out_dir / 'sparsity_roofline.csv'}")
    if not args.no_plots:
        for p in plot(layer_rows, dispatch_rows, roofline, profile, out_dir):
            print(f"wrote {p}")
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
