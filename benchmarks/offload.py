"""CPU benchmark of experts larger than memory: ``torch_moe.nn.expert_store`` against the
all-resident model.

A stack of L MoE layers (``h = h + MoE(RMSNorm(h))``, E experts, top-k) whose routed experts are
written to a safetensors file and run through a cache of C experts per layer
(``offload_experts``), C at 1/8, 1/4 and 1/2 of E, LRU and LFU eviction, prefetch (the next
layer's router on this layer's input) on and off. The file tier is measured cold: before every
configuration the file's pages are unmapped and dropped from the page cache
(``POSIX_FADV_DONTNEED``, verified at start by a cold against a warm read); inside a
configuration the page cache fills as experts are read (as llama.cpp's mmap does), except in the
``disk`` rows (``drop_page_cache=True``: every miss reads the disk, a file larger than RAM).

Workloads:
* decode: steps of 1, 2, ..., 8 tokens (twice), top-k of E per layer, inference;
* batch: T=256 tokens touching every expert, forward (and one forward + backward row, the
  fine-tuning case: the backward reads the experts again): bytes moved per token, and the
  most times one expert was read within one step (1: never more than once).

Routing: ``uniform`` (random router, random tokens: no locality, the worst case for a cache)
and ``zipf`` (a fixed router bias ``-0.5 * log(rank + 1)`` over a random ranking per layer: the
skewed expert popularity of trained models).

Reported: tokens/s and its ratio to the resident model (its experts read back from the file
and timed right after each configuration, on the same inputs: the speed of a shared machine
drifts over minutes, the ratio of neighbouring runs much less), hit rate, stall seconds
(compute thread waiting for loads), prefetch hits and issued, MiB moved per token, MiB read
from the disk (the file's block device, from /sys/dev/block), max reads of an expert per step,
RSS (VmRSS, and the Rss of the file's mapping from /proc/self/smaps)
against the cache budget (slot bytes), and whether the outputs equal the resident model's
(torch.equal; the resident model computes in the per-group expert GEMM form, the default and
the one the store's passes use). The decode rows at a quarter of the experts (the targets of
RFC part 8.1) run ``--repeats`` times (each column the median of the runs, with the range of the
speed ratios and of the stall); a last table sets them against the targets (0.5x the resident
speed with prefetch; prefetch removing half the stall it has without).

    python benchmarks/offload.py            # L=16, E=64, D=512, F=256 (1.5 GiB of experts): ~9 min
    python benchmarks/offload.py --quick    # L=4, a smaller file: about a minute
    python benchmarks/offload.py --plot-only benchmarks/results/offload.csv
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment_header, format_table, line_plot, write_csv  # noqa: E402

import torch_moe.cpu  # noqa: E402
from torch_moe.nn import GroupedExperts, MoE, MoEConfig  # noqa: E402
from torch_moe.nn.expert_store import load_experts, offload_experts, save_experts  # noqa: E402

ROOT = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Model(nn.Module):
    def __init__(self, layers, cfg):
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(cfg.dim) for _ in range(layers))
        self.layers = nn.ModuleList(MoE(cfg) for _ in range(layers))

    def forward(self, h):
        for norm, moe in zip(self.norms, self.layers):
            h = h + moe(norm(h))
        return h


def set_routing(model: Model, mode: str, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for moe in model.layers:
            E = moe.config.num_experts
            if mode == "uniform":
                moe.router.bias.zero_()
            else:
                rank = torch.randperm(E, generator=g).float()
                moe.router.bias.copy_(-0.5 * torch.log(rank + 1))


def proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    return out


def mapping_rss(address) -> int:
    """Rss of the mapping that starts at ``address`` (bytes), from /proc/self/smaps."""
    if address is None:
        return 0
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start = int(head.split("-")[0], 16)
                found = start == address
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    return 0


def verify_fadvise(path: str, nbytes: int) -> dict:
    """Times a read of the first ``nbytes`` of the file after POSIX_FADV_DONTNEED (cold) and
    again right after (warm): a working drop makes the first one disk-bound."""
    fd = os.open(path, os.O_RDONLY)
    try:
        def read():
            start, off = time.perf_counter(), 0
            while off < nbytes:
                chunk = os.pread(fd, 8 << 20, off)
                if not chunk:
                    break
                off += len(chunk)
            return off / (time.perf_counter() - start) / 1e9
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold = read()
        warm = read()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        cold2 = read()
    finally:
        os.close(fd)
    return {"cold_GBps": cold, "warm_GBps": warm, "cold_again_GBps": cold2}


def disk_read_bytes(path: str):
    """Bytes read so far from the block device that holds ``path`` (``/sys/dev/block/M:m/stat``,
    sectors read), or None where there is no such device (not Linux, an overlay or network
    file system): what a run read from the disk, rather than from the page cache."""
    dev = os.stat(path).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat") as f:
            return int(f.read().split()[2]) * 512
    except (OSError, IndexError, ValueError):
        return None


def decode_steps(D: int, reps: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, D, generator=g) for _ in range(reps) for T in range(1, 9)]


def run_steps(model, inputs, backward: bool = False, outs=None):
    outs = [] if outs is None else outs
    start = time.perf_counter()
    for x in inputs:
        if backward:
            x = x.clone().requires_grad_(True)
            y = model(x)
            y.square().mean().backward()
            outs.append(y.detach())
        else:
            with torch.no_grad():
                outs.append(model(x))
    return time.perf_counter() - start, outs


def paired_resident(model, path, inputs, work: str):
    """Times the resident model (experts read back from ``path``, frozen) on ``inputs``: the
    whole run and, for decode, its last 8 steps (the warm rows' reference)."""
    load_experts(model, path)
    for moe in model.layers:
        for p in moe.experts.parameters():
            p.requires_grad_(False)  # frozen, as in the store
    backward = work == "batch_bwd"
    run_steps(model, inputs[:2], backward=backward)  # warm-up
    t, _ = run_steps(model, inputs, backward=backward)
    t_last = run_steps(model, inputs[-8:])[0] if work == "decode" else None
    return t, t_last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--decode-reps", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, default=256)
    ap.add_argument("--batch-steps", type=int, default=2)
    ap.add_argument("--file", default=None, help="where to write the experts (default: a temp dir)")
    ap.add_argument("--csv", default=None,
                    help="output CSV (default results/offload.csv; results/offload_quick.csv with "
                         "--quick, so that a quick run leaves the kept results and plot alone)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="cold runs of each decode configuration at a quarter of the experts (the "
                         "median is reported)")
    ap.add_argument("--threads", type=int, default=1,
                    help="compute threads (torch.set_num_threads); the loader thread takes a core "
                         "of its own, so on 2 cores the default leaves it one")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plot-only", metavar="CSV", help="only draw the plot of an earlier run's CSV")
    args = ap.parse_args()
    if args.plot_only:
        import csv
        with open(args.plot_only) as f:
            plot(list(csv.DictReader(f)), ROOT / "figures" / "offload_throughput.png")
        return
    if args.quick:
        args.layers, args.decode_reps, args.batch_steps, args.repeats = 4, 2, 1, 1
    suffix = "_quick" if args.quick else ""
    if args.csv is None:
        args.csv = str(ROOT / "results" / f"offload{suffix}.csv")
    torch.manual_seed(0)
    threads_default = torch.get_num_threads()
    L, E, k, D, F = args.layers, args.experts, args.top_k, args.dim, args.hidden
    for line in environment_header():
        print(line)
    cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=k, router_bias=True)
    model = Model(L, cfg)
    # random routers see unit-scale tokens; expert outputs are kept small next to the residual
    expert_bytes = 3 * D * F * 4
    print(f"model: {L} layers x {E} experts, top-{k}, D={D}, F={F}: {expert_bytes / 2**20:.2f} MiB "
          f"per expert, {L * E * expert_bytes / 2**30:.2f} GiB of experts")
    tmp = tempfile.TemporaryDirectory(dir=os.path.dirname(args.file) if args.file else None)
    path = args.file or os.path.join(tmp.name, "experts.safetensors")
    start = time.perf_counter()
    save_experts(model, path)
    log(f"wrote {os.path.getsize(path) / 2**30:.2f} GiB to {path} in {time.perf_counter() - start:.1f} s")
    fadv = verify_fadvise(path, min(os.path.getsize(path), 512 << 20))
    print(f"posix_fadvise(DONTNEED) check, {min(os.path.getsize(path), 512 << 20) >> 20} MiB read: "
          f"cold {fadv['cold_GBps']:.2f} GB/s, warm {fadv['warm_GBps']:.2f} GB/s, cold again "
          f"{fadv['cold_again_GBps']:.2f} GB/s")

    decode_in = decode_steps(D, args.decode_reps, seed=1)
    decode_tokens = sum(x.size(0) for x in decode_in)
    gb = torch.Generator().manual_seed(2)
    batch_in = [torch.randn(args.batch_tokens, D, generator=gb) for _ in range(args.batch_steps)]

    # -- resident ------------------------------------------------------------------------------
    # in the per-group expert form (the default, and the form the store's passes compute in:
    # bit-identity is to that form)
    torch_moe.cpu.set_expert_form("per_group")
    rows, reference, reference_last = [], {}, {}
    for p in model.parameters():
        if p.dim() == 3:
            p.requires_grad_(False)  # the experts are frozen in both models
    # the resident model with every core computing, for reference (no loader to share them)
    set_routing(model, "uniform")
    run_steps(model, decode_in[:2])
    t_all, _ = run_steps(model, decode_in)
    rows.append({"workload": "decode", "routing": "uniform", "cache": f"resident, {threads_default} thr",
                 "cache_frac": 1.0, "tokens_per_s": round(decode_tokens / t_all, 1)})
    torch.set_num_threads(args.threads)
    print(f"compute threads: {args.threads} (resident decode with {threads_default}: "
          f"{decode_tokens / t_all:.1f} tokens/s)")
    for routing in ("uniform", "zipf"):
        set_routing(model, routing)
        run_steps(model, decode_in[:2])  # warm-up
        t, outs = run_steps(model, decode_in)
        t_last, _ = run_steps(model, decode_in[-8:])
        reference[("decode", routing)] = (t, outs)
        reference_last[routing] = t_last
        log(f"resident decode {routing}: {decode_tokens / t:.1f} tokens/s")
    set_routing(model, "uniform")
    for bwd in (False, True):
        run_steps(model, batch_in[:1], backward=bwd)
        t, outs = run_steps(model, batch_in, backward=bwd)
        reference[("batch_bwd" if bwd else "batch", "uniform")] = (t, outs)
        log(f"resident batch{' fwd+bwd' if bwd else ''}: {len(batch_in) * args.batch_tokens / t:.1f} tokens/s")
    rss_resident = proc_status()
    for (work, routing), (t, _) in reference.items():
        ntok = decode_tokens if work == "decode" else len(batch_in) * args.batch_tokens
        rows.append({"workload": work, "routing": routing, "cache": "resident", "cache_frac": 1.0,
                     "policy": "-", "prefetch": "-", "tier": "ram", "tokens_per_s": round(ntok / t, 1),
                     "vs_resident": 1.0, "RSS_MiB": round(rss_resident["VmRSS"] / 2**20),
                     **({"tok_s_warm": round(36 / reference_last[routing], 1), "x_warm": 1.0}
                        if work == "decode" else {})})

    # experts out of the process: every layer gets a meta GroupedExperts for offload_experts
    def strip():
        for moe in model.layers:
            moe.experts = GroupedExperts(moe.config, device="meta")
        gc.collect()

    strip()
    base = proc_status()
    print(f"RSS: {rss_resident['VmRSS'] / 2**20:.0f} MiB with resident experts, "
          f"{base['VmRSS'] / 2**20:.0f} MiB without them")

    configs = []
    for frac in (8, 4, 2):
        C = E // frac
        for policy in ("lru", "lfu"):
            for prefetch in (None, "router"):
                for routing in ("uniform", "zipf"):
                    configs.append(("decode", routing, C, policy, prefetch, False))
        for prefetch in (None, "router"):
            configs.append(("batch", "uniform", C, "lru", prefetch, False))
    for prefetch in (None, "router"):
        for routing in ("uniform", "zipf"):
            configs.append(("decode", routing, E // 4, "lru", prefetch, True))
        configs.append(("batch_bwd", "uniform", E // 4, "lru", prefetch, False))

    def measure(work, routing, C, policy, prefetch, disk) -> dict:
        """One cold run of a configuration, and the resident run paired with it."""
        strip()
        set_routing(model, routing)
        store = offload_experts(model, path, cache_experts=C, policy=policy, prefetch=prefetch,
                                drop_page_cache=disk)
        store.drop_page_cache()  # cold: nothing of the file in memory
        inputs = decode_in if work == "decode" else batch_in
        ntok = sum(x.size(0) for x in inputs)
        disk0 = disk_read_bytes(path)
        if work == "decode":
            # the last repetition apart: its numbers are those of a page cache warmed by the run
            t1, outs = run_steps(model, inputs[:-8])
            s1 = store.stats()
            t2, outs = run_steps(model, inputs[-8:], outs=outs)
            t = t1 + t2
        else:
            t, outs = run_steps(model, inputs, backward=work == "batch_bwd")
        s = store.stats()
        disk1 = disk_read_bytes(path)
        exact = all(torch.equal(a, b) for a, b in zip(outs, reference[(work, routing)][1]))
        status = proc_status()
        map_rss = mapping_rss(store.tier.file.mapping_address())
        budget = store.slot_bytes()
        store.close()
        del store, outs
        # the resident model again, right after: this kind of machine's speed drifts by a fifth
        # over minutes, so each ratio is to a resident run of the same moment
        ref_t, ref_last = paired_resident(model, path, inputs, work)
        warm = {}
        if work == "decode":
            warm = {"tok_s_warm": round(36 / t2, 1), "x_warm": round(ref_last / t2, 3),
                    "stall_warm_s": round(s.stall_s - s1.stall_s, 3),
                    "hit_warm": round((s.hits - s1.hits) / (s.requests - s1.requests), 3)}
        row = {
            "workload": work, "routing": routing, "cache": C, "cache_frac": round(C / E, 3),
            "policy": policy, "prefetch": prefetch or "off", "tier": "disk" if disk else "file",
            "tokens_per_s": round(ntok / t, 1), "resident_tok_s": round(ntok / ref_t, 1),
            "vs_resident": round(ref_t / t, 3),
            "hit_rate": round(s.hit_rate, 3), "stall_s": round(s.stall_s, 3),
            "stall_frac": round(s.stall_s / t, 3),
            "prefetch_hits": s.prefetch_hits, "prefetches": s.prefetches,
            "MiB_per_token": round(s.bytes_moved / ntok / 2**20, 2),
            "disk_MiB": round((disk1 - disk0) / 2**20) if disk0 is not None else "",
            "max_reads_per_step": s.max_reads_per_step, "exact": exact,
            "budget_MiB": round(budget / 2**20), "RSS_MiB": round(status["VmRSS"] / 2**20),
            "RSS_over_base_MiB": round((status["VmRSS"] - base["VmRSS"]) / 2**20),
            "map_RSS_MiB": round(map_rss / 2**20, 1), "time_s": round(t, 2), **warm,
        }
        return row

    for i, config in enumerate(configs):
        work, routing, C, policy, prefetch, disk = config
        # the decode target's rows (a quarter of the experts cached) several times: now and then
        # a cold run takes up to twice as long as its neighbours on this kind of machine; each
        # column is the median of the runs, with the range of the speeds and of the stall
        n = args.repeats if work == "decode" and C == E // 4 and not disk else 1
        row = median_row([measure(*config) for _ in range(n)])
        rows.append(row)
        log(f"[{i + 1}/{len(configs)}] {work} {routing} C={C} {policy} prefetch={prefetch} "
            f"{'disk' if disk else 'file'}: {row['tokens_per_s']} tok/s ({row['vs_resident']}x"
            + (f", {row['vs_resident_range']} over {n} runs" if n > 1 else "")
            + f"), hit {row['hit_rate']}, stall {row['stall_s']} s, exact {row['exact']}"
            + (f"; last rep {row['tok_s_warm']} tok/s ({row['x_warm']}x), stall "
               f"{row['stall_warm_s']} s" if work == "decode" else ""))
    strip()

    cols = ["workload", "routing", "cache", "cache_frac", "policy", "prefetch", "tier",
            "tokens_per_s", "resident_tok_s", "vs_resident", "runs", "vs_resident_range",
            "hit_rate", "stall_s", "stall_s_range", "stall_frac", "tok_s_warm", "x_warm",
            "x_warm_range", "hit_warm", "stall_warm_s", "prefetch_hits", "prefetches",
            "MiB_per_token", "disk_MiB", "max_reads_per_step", "exact", "budget_MiB",
            "RSS_over_base_MiB", "map_RSS_MiB"]
    print(format_table(rows, cols))
    print(format_table(target_rows(rows, E), TARGET_COLS))
    write_csv(args.csv, rows)
    print(f"wrote {args.csv}")
    plot(rows, ROOT / "figures" / f"offload_throughput{suffix}.png")
    tmp.cleanup()


# columns measured anew by every run of a configuration (the rest describe it, or, as RSS and
# the counters of loads, are the same in every run up to a page or two)
MEASURED = ("tokens_per_s", "resident_tok_s", "vs_resident", "stall_s", "stall_frac",
            "tok_s_warm", "x_warm", "stall_warm_s", "time_s", "disk_MiB")
RANGED = ("vs_resident", "x_warm", "stall_s")


def median_row(runs: list) -> dict:
    """One row for repeated runs of a configuration: each measured column the median of its
    runs (the lower of the middle two for an even count), with the range of the runs for
    ``RANGED``; the other columns those of the run of median speed. ``exact`` only if every
    run was."""
    n = len(runs)
    mid = (n - 1) // 2
    row = dict(sorted(runs, key=lambda r: r["vs_resident"])[mid])
    row["runs"] = n
    row["exact"] = all(r["exact"] for r in runs)
    if n == 1:
        return row
    for col in MEASURED:
        vals = sorted(r[col] for r in runs if r.get(col) not in (None, ""))
        if vals:
            row[col] = vals[mid] if len(vals) == n else row[col]
            if col in RANGED:
                row[f"{col}_range"] = f"{vals[0]}-{vals[-1]}"
    return row


TARGET_COLS = ["routing", "policy", "x_resident_cold", "cold_range", "x_resident_warm",
               "stall_off_s", "stall_router_s", "stall_removed", "stall_removed_warm",
               "disk_MiB"]


def target_rows(rows, E: int) -> list:
    """The decode rows at a quarter of the experts (file tier) against the targets of RFC part
    8.1: the speed with router prefetch relative to the resident model (target 0.5x), and the
    share of the stall without prefetch that prefetch removes (target: half), cold and warm."""

    def removed(on_s, off_s):
        return round(1 - on_s / off_s, 3) if off_s else ""  # no stall to remove

    out = []
    for routing in ("uniform", "zipf"):
        for policy in ("lru", "lfu"):
            pick = {r.get("prefetch"): r for r in rows
                    if r["workload"] == "decode" and r["routing"] == routing
                    and r.get("policy") == policy and r.get("tier") == "file"
                    and r["cache"] == E // 4}
            off, on = pick.get("off"), pick.get("router")
            if off is None or on is None:
                continue
            out.append({
                "routing": routing, "policy": policy,
                "x_resident_cold": on["vs_resident"], "cold_range": on.get("vs_resident_range", ""),
                "x_resident_warm": on["x_warm"],
                "stall_off_s": off["stall_s"], "stall_router_s": on["stall_s"],
                "stall_removed": removed(on["stall_s"], off["stall_s"]),
                "stall_removed_warm": removed(on["stall_warm_s"], off["stall_warm_s"]),
                "disk_MiB": on.get("disk_MiB", ""),
            })
    return out


def _series(rows, column="vs_resident", workloads=(("decode", "uniform"), ("decode", "zipf"),
                                                   ("batch", "uniform"))):
    """(label, [(cache fraction, ``column``, (low, high) of its repeated runs or None)]) per
    line of the plot."""
    def spread(r):
        lo_hi = r.get(f"{column}_range")
        return tuple(float(v) for v in lo_hi.split("-")) if lo_hi else None

    out = []
    for work, routing in workloads:
        for policy, prefetch in (("lru", "off"), ("lru", "router"), ("lfu", "router")):
            pts = sorted(((float(r["cache_frac"]), float(r[column]), spread(r)) for r in rows
                          if r["workload"] == work and r["routing"] == routing
                          and r.get("policy") == policy and r.get("prefetch") == prefetch
                          and r.get("tier") == "file" and r.get(column)),
                         key=lambda p: p[0])  # (a range may be None: not compared)
            if pts:
                out.append((f"{work} {routing} {policy} prefetch {prefetch}", pts))
    return out


def plot(rows, out: Path) -> None:
    """Throughput against cache size: the cold runs, and decode once the page cache holds what
    the run read (its last 8 steps), side by side; a vertical bar is the range of repeated
    runs."""
    cold = _series(rows)
    warm = _series(rows, "x_warm", (("decode", "uniform"), ("decode", "zipf")))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the harness writes an SVG of the cold panel by hand
        line_plot(out, [(label, [p[:2] for p in pts]) for label, pts in cold],
                  "cache size / experts per layer", "throughput / all-resident (cold file)",
                  hline=1.0)
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    styles = {}
    for ax, series, title in ((axes[0], cold, "file cold (page cache dropped)"),
                              (axes[1], warm, "decode, page cache warm (last 8 steps)")):
        for j, (label, pts) in enumerate(series):
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=label,
                            **styles.get(label, {}))
            styles.setdefault(label, {"color": line.get_color()})
            for x, _, lo_hi in pts:  # the range of repeated runs (the point is their median),
                if lo_hi:            # nudged sideways so that the lines' bars do not overlap
                    xj = x * 2 ** (0.04 * (j - len(series) / 2))
                    ax.plot([xj, xj], lo_hi, "-", lw=1.2, alpha=0.7, color=line.get_color())
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(0.5, color="k", lw=0.6, ls="--")  # the decode target at a quarter
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.05)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("cache size / experts per layer")
    axes[0].set_ylabel("throughput / all-resident")
    axes[0].legend(fontsize=6, loc="upper left")
    fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
