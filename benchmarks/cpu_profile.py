"""Measures the built-in ``cpu`` device profile of the cost model on this machine.

    python benchmarks/cpu_profile.py [--runs 3] [--world-size 2]

``calibrate_local`` (``torch_moe.distributed._tools.calibrate``) runs ``--runs`` times in this
process with every core, and ``average_profiles`` averages the runs (a shared machine drifts by
10 % and more between runs minutes apart). Then ``--world-size`` gloo processes on this machine
fit ``all_to_all_single``'s latency and bandwidth, one thread each. The script prints each run's
headline figures, the averaged profile as the ``DeviceProfile(...)`` literal that
``device_profiles.py`` holds as ``REFERENCE_CPU``, and writes it to
``benchmarks/results/cpu_profile.csv``. benchmarks/README.md records the figures of the machine
the built-in profile comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _harness import destroy_process_group, environment_header, format_table, write_csv
from torch_moe.distributed._tools.calibrate import average_profiles, calibrate_local, measure_all_to_all
from torch_moe.distributed._tools.device_profiles import DeviceProfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "cpu_profile.csv")


def _all_to_all_rank(rank: int, world_size: int, init_file: str, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        alpha, bandwidth = measure_all_to_all(dist.group.WORLD, reps=5)
        if rank == 0:
            out["alpha"], out["bandwidth"] = alpha, bandwidth
    finally:
        destroy_process_group()


def measure_all_to_all_fit(world_size: int) -> tuple[float, float]:
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as tmp:
        out = manager.dict()
        mp.spawn(_all_to_all_rank, args=(world_size, os.path.join(tmp, "init"), out),
                 nprocs=world_size, join=True)
        return out["alpha"], out["bandwidth"]


def _curve(points) -> str:
    # Rounded to 4 decimals, then clamped so that efficiency / rows stays non-increasing (the
    # rule DeviceProfile checks): rounding alone can break it where the efficiency grows almost
    # in proportion to the rows (1 to 16 rows).
    out = []
    for rows, eff in points:
        eff = round(eff, 4)
        if out:
            prev_rows, prev_eff = out[-1]
            eff = min(eff, prev_eff * rows / prev_rows)
        out.append((rows, eff))
    return "(" + ", ".join(f"({int(r)}, {e:.6g})" for r, e in out) + ")"


def profile_literal(p, alpha: float, bandwidth: float) -> str:
    g = 1e9
    return "\n".join([
        "DeviceProfile(",
        '    name="reference-cpu",',
        f'    peak_flops={{"bf16": {p.peak_flops["bf16"] / g:.0f}e9, "fp32": {p.peak_flops["fp32"] / g:.0f}e9}},',
        f"    memory_bytes={p.memory_bytes / 2**30:.0f} * _GB,",
        f"    memory_bandwidth_Bps={p.memory_bandwidth_Bps / g:.0f} * _GB,",
        f"    intra_node_bandwidth_Bps={bandwidth / g:.2f} * _GB,",
        f"    intra_node_latency_s={alpha:.1e},",
        f"    inter_node_bandwidth_Bps={bandwidth / g:.2f} * _GB,",
        f"    inter_node_latency_s={alpha:.1e},",
        f"    gemm_tile_rows={p.gemm_tile_rows},",
        f"    gemm_call_s={p.gemm_call_s},",
        f"    gemm_efficiency={_curve(p.gemm_efficiency)},",
        f"    wgrad_efficiency={_curve(p.wgrad_efficiency)},",
        f"    per_group_s={p.per_group_s:.1e},",
        f"    elementwise_bandwidth_Bps={p.elementwise_bandwidth_Bps / g:.0f} * _GB,",
        f"    layer_overhead_s={p.layer_overhead_s:.1e},",
        f"    fresh_alloc_threshold_bytes={p.fresh_alloc_threshold_bytes // 2**20} * _MiB,",
        f"    page_fault_s_per_byte={p.page_fault_s_per_byte * 2**20 * 1e3:.2f}e-3 / _MiB,",
        ")",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)
    print("\n".join(environment_header()))
    runs, rows = [], []
    for i in range(args.runs):
        print(f"calibration {i + 1}/{args.runs} ...", file=sys.stderr, flush=True)
        p = calibrate_local()
        runs.append(p)
        rows.append({
            "run": i + 1, "bf16 GFLOP/s": f"{p.peak_flops['bf16'] / 1e9:.0f}",
            "fp32 GFLOP/s": f"{p.peak_flops['fp32'] / 1e9:.0f}",
            "copy GB/s": f"{p.memory_bandwidth_Bps / 1e9:.1f}",
            "elementwise GB/s": f"{p.elementwise_bandwidth_Bps / 1e9:.1f}",
            "per group us": f"{p.per_group_s * 1e6:.1f}",
            "page fault ms/MiB": f"{p.page_fault_s_per_byte * 2**20 * 1e3:.2f}",
        })
    print(format_table(rows, list(rows[0])))
    # Page faults from the first run only: later calibrations in the same process find glibc's
    # heap already grown past the test's allocations and measure (nearly) none.
    averaged = dataclasses.replace(average_profiles(runs, name="reference-cpu"),
                                   page_fault_s_per_byte=runs[0].page_fault_s_per_byte)
    print(f"all_to_all_single fit over {args.world_size} gloo processes ...", file=sys.stderr,
          flush=True)
    alpha, bandwidth = measure_all_to_all_fit(args.world_size)
    print(f"all_to_all_single: latency {alpha * 1e3:.2f} ms, bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"per rank ({args.world_size} gloo processes)")
    literal = profile_literal(averaged, alpha, bandwidth)
    # the literal must make a valid profile (DeviceProfile checks its curves)
    eval(literal, {"DeviceProfile": DeviceProfile, "_GB": 1e9, "_MiB": 2**20})
    print(literal)
    write_csv(RESULTS, rows)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
