"""Expert-parallel dispatch volume: copies per token for plain, dedup and rank-limited dispatch.

No collective runs here; the numbers are counts from ``torch_moe.distributed._dispatch_plan``
on one simulated source rank, compared with the closed forms of
``expected_copies_per_token``. Counting includes the source rank's own copy (see the module
docstring there).

Sweep: E in (8, 32, 64, 256), k in (1, 2, 4, 8) with k <= E, EP degree R in (2, 8, 64) with
R dividing E. Routing is uniform: the top-k of i.i.d. uniform scores, i.e. a uniformly random
k-subset per token. Rank-limited routing uses the same scores with m = min(4, R) ranks per
token (DeepSeek-V3 style, rank score = sum of the top-2 expert scores on the rank); it is
skipped ("n/a") when m ranks hold fewer than k experts.

Columns: ``plain``/``dedup``/``limited`` measured copies per token; ``*_an`` analytical
(for ``limited`` the bound min(k, m), not an expectation); ``dedup/plain`` measured ratio;
``dedup_err`` relative error of measured dedup vs analytical; ``lim/bound`` measured
rank-limited copies over the bound. A final row gives bytes per token for E=256, k=8, EP=64,
D=7168 in bf16.

    python benchmarks/dispatch.py              # T = 4096 tokens, seed 0, a few seconds
    python benchmarks/dispatch.py --gloo-overlap   # wall time on 2 gloo processes, ~1 minute

``--gloo-overlap`` times ``expert_parallel_moe_ffn`` forward + backward on 2 real gloo processes
(one compute thread each) with 1, 2 and 4 chunks, plain and deduplicated, interleaved
round-robin with a barrier before every call; the table gives each rank-0 median and its ratio
to one chunk. On 2 CPU cores gloo's transfer threads share the cores with the expert GEMMs, so
this measures the scheduling cost of chunking more than the overlap a GPU (separate copy
engines) would get.

    python benchmarks/dispatch.py --nccl       # one process per GPU (at least 2), NCCL

``--nccl`` times the same call with CUDA tensors on NCCL, bf16, a DeepSeek-V3-like slice (8
experts per rank, k = 8, D = 2048, F = 1408, 4096 tokens per rank): exact mode plain and dedup
with 1, 2 and 4 chunks (the overlap of one chunk's exchanges with another's experts on the
communication stream), sync-free capacity mode, and ``backend="symm_mem"`` where torch has
NVSHMEM. CUDA events time every call after a barrier; the table gives the slowest rank's
median and its ratio to exact plain with one chunk, and the CSV goes to
``results/dispatch_nccl.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import destroy_process_group, environment_header, format_table, write_csv  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torch_moe.distributed._dispatch_plan import (  # noqa: E402
    bytes_per_token,
    expected_copies_per_token,
    rank_limited_topk,
    send_counts,
)

EXPERTS = (8, 32, 64, 256)
TOPK = (1, 2, 4, 8)
EP_DEGREES = (2, 8, 64)


def measure(num_tokens: int, num_experts: int, k: int, num_ranks: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    ids = scores.topk(k, dim=1).indices
    plain = send_counts(ids, num_experts, num_ranks, dedup=False).sum().item() / num_tokens
    dedup = send_counts(ids, num_experts, num_ranks, dedup=True).sum().item() / num_tokens
    plain_an = expected_copies_per_token(num_experts, k, num_ranks, dedup=False)
    dedup_an = expected_copies_per_token(num_experts, k, num_ranks, dedup=True)
    m = min(4, num_ranks)
    row = {
        "E": num_experts,
        "k": k,
        "EP": num_ranks,
        "m": m,
        "plain": f"{plain:.4f}",
        "plain_an": f"{plain_an:.4f}",
        "dedup": f"{dedup:.4f}",
        "dedup_an": f"{dedup_an:.4f}",
        "dedup/plain": f"{dedup / plain:.4f}",
        "dedup_err": f"{(dedup - dedup_an) / dedup_an:+.2%}",
    }
    if k <= m * (num_experts // num_ranks):
        lim_ids, _ = rank_limited_topk(scores, k, num_ranks, m)
        limited = send_counts(lim_ids, num_experts, num_ranks, dedup=True).sum().item() / num_tokens
        bound = expected_copies_per_token(num_experts, k, num_ranks, dedup=True, max_ranks=m)
        row.update(
            limited=f"{limited:.4f}",
            limited_an=f"{bound:.4f}",
            **{"lim/plain": f"{limited / plain:.4f}", "lim/bound": f"{limited / bound:.4f}"},
        )
    else:
        row.update(limited="n/a", limited_an="n/a", **{"lim/plain": "n/a", "lim/bound": "n/a"})
    return row


OVERLAP_VARIANTS = [(c, d) for d in (False, True) for c in (1, 2, 4)]


def _spawn(rank_fn, world_size: int, args: tuple) -> list[dict]:
    """Runs ``rank_fn(rank, world_size, port, out_path, *args)`` in ``world_size`` processes on
    a free local port; returns the rows rank 0 wrote to ``out_path`` (JSON)."""
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(rank_fn, args=(world_size, port, out, *args), nprocs=world_size)
        return json.loads(Path(out).read_text())


def _overlap_rank(rank: int, world_size: int, port: int, out_path: str, reps: int) -> None:
    import os
    import statistics
    import time

    import torch.distributed as dist

    from torch_moe.distributed.dispatch import expert_parallel_moe_ffn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    E, k, T, D, F = 8, 2, 2048, 512, 512
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, D, generator=g).requires_grad_()
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    w = torch.rand(T, k, generator=g).requires_grad_()
    w1, w3 = (torch.randn(E // 2, D, F, generator=g).div_(D**0.5).requires_grad_()
              for _ in range(2))
    w2 = torch.randn(E // 2, F, D, generator=g).div_(F**0.5).requires_grad_()
    times = {v: [] for v in OVERLAP_VARIANTS}
    for rep in range(reps + 2):
        for chunks, dedup in OVERLAP_VARIANTS:
            dist.barrier()
            start = time.perf_counter()
            y = expert_parallel_moe_ffn(x, ids, w, w1, w2, w3, num_experts=E, dedup=dedup,
                                        num_chunks=chunks)
            y.sum().backward()
            elapsed = time.perf_counter() - start
            if rep >= 2:  # warm-up
                times[(chunks, dedup)].append(elapsed)
            for t in (x, w, w1, w2, w3):
                t.grad = None
    if rank == 0:
        base = {d: statistics.median(times[(1, d)]) for d in (False, True)}
        rows = [{"kind": "gloo_overlap", "T": T, "D": D, "F": F, "E": E, "k": k, "EP": 2,
                 "chunks": c, "dedup": d, "median_ms": f"{statistics.median(times[(c, d)]) * 1e3:.1f}",
                 "vs_1_chunk": f"{base[d] / statistics.median(times[(c, d)]):.2f}x"}
                for c, d in OVERLAP_VARIANTS]
        import json

        Path(out_path).write_text(json.dumps(rows))
    destroy_process_group()


def overlap_main(reps: int, csv_path: str) -> None:
    print("\n".join(environment_header()))
    rows = _spawn(_overlap_rank, 2, (reps,))
    print("expert_parallel_moe_ffn forward + backward, 2 gloo processes, fp32, rank 0 medians:")
    print(format_table(rows, list(rows[0])))
    write_csv(csv_path, rows)
    print(f"\nwrote {csv_path}")


def _nccl_variants(symm_mem: bool) -> list[dict]:
    variants = [dict(dedup=d, num_chunks=c) for d in (False, True) for c in (1, 2, 4)]
    variants.append(dict(dedup=True, capacity_factor=1.25, sync_free=True))
    if symm_mem:
        variants += [dict(backend="symm_mem"), dict(backend="symm_mem", dedup=True)]
    return variants


def _nccl_rank(rank: int, world_size: int, port: int, out_path: str, reps: int) -> None:
    import json
    import os
    import statistics

    import torch.distributed as dist

    from torch_moe.distributed._compat import prepare_symm_mem
    from torch_moe.distributed.dispatch import expert_parallel_moe_ffn

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    symm_mem_reason = prepare_symm_mem(device, world_size)
    if rank == 0 and symm_mem_reason is not None:
        print(f"backend='symm_mem' not timed: {symm_mem_reason}", flush=True)
    symm_mem = symm_mem_reason is None
    dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
    G, k, T, D, F = 8, 8, 4096, 2048, 1408
    E = G * world_size
    g = torch.Generator().manual_seed(rank)
    bf16 = dict(dtype=torch.bfloat16, device=device)
    x = torch.randn(T, D, generator=g).to(**bf16).requires_grad_()
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices.to(device)
    w = torch.rand(T, k, generator=g).to(device).requires_grad_()
    w1, w3 = (torch.randn(G, D, F, generator=g).div_(D**0.5).to(**bf16).requires_grad_()
              for _ in range(2))
    w2 = torch.randn(G, F, D, generator=g).div_(F**0.5).to(**bf16).requires_grad_()
    variants = _nccl_variants(symm_mem)
    times = [[] for _ in variants]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rep in range(reps + 2):
        for i, options in enumerate(variants):
            dist.barrier()
            start.record()
            y = expert_parallel_moe_ffn(x, ids, w, w1, w2, w3, num_experts=E, **options)
            y.float().sum().backward()
            end.record()
            end.synchronize()
            if rep >= 2:  # warm-up: Triton compiles and autotunes, buffers are allocated
                times[i].append(start.elapsed_time(end))
            for t in (x, w, w1, w2, w3):
                t.grad = None
    medians = torch.tensor([statistics.median(t) for t in times], device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    if rank == 0:
        rows = [{"kind": "nccl", "ranks": world_size, "T": T, "D": D, "F": F, "E": E, "k": k,
                 "options": " ".join(f"{n}={v}" for n, v in o.items()),
                 "median_ms": f"{m:.3f}", "vs_exact_plain": f"{medians[0].item() / m:.2f}x"}
                for o, m in zip(variants, medians.tolist())]
        Path(out_path).write_text(json.dumps(rows))
    destroy_process_group()


def nccl_main(reps: int, csv_path: str) -> None:
    import torch.distributed as dist

    world_size = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world_size < 2 or not dist.is_nccl_available():
        raise SystemExit(f"dispatch.py --nccl: needs at least 2 CUDA devices and NCCL, but this "
                         f"machine has {world_size} device(s) and NCCL "
                         f"{'available' if dist.is_nccl_available() else 'not available'}")
    print("\n".join(environment_header()))
    rows = _spawn(_nccl_rank, world_size, (reps,))
    print(f"expert_parallel_moe_ffn forward + backward, {world_size} NCCL ranks, bf16, slowest "
          "rank's median:")
    print(format_table(rows, list(rows[0])))
    write_csv(csv_path, rows)
    print(f"\nwrote {csv_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gloo-overlap", action="store_true")
    parser.add_argument("--nccl", action="store_true",
                        help="time the dispatcher on NCCL, one process per GPU")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--csv", default=str(Path(__file__).resolve().parent / "results" / "dispatch.csv")
    )
    args = parser.parse_args()
    if args.nccl:
        nccl_main(args.reps, str(Path(args.csv).with_name("dispatch_nccl.csv")))
        return
    if args.gloo_overlap:
        overlap_main(args.reps, str(Path(args.csv).with_name("dispatch_overlap.csv")))
        return
    # Counting only; one thread keeps it off the cores of anything timed alongside.
    torch.set_num_threads(1)

    print("\n".join(environment_header()))
    print(f"T = {args.tokens} tokens per source rank, seed {args.seed}, uniform random routing\n")

    rows = []
    for num_experts in EXPERTS:
        for k in TOPK:
            if k > num_experts:
                continue
            for num_ranks in EP_DEGREES:
                if num_experts % num_ranks != 0:
                    continue
                rows.append(measure(args.tokens, num_experts, k, num_ranks, args.seed))
    columns = list(rows[0])
    print(format_table(rows, columns))

    # DeepSeek-V3-like: 256 routed experts, top-8, EP 64, D = 7168 in bf16, at most 4 ranks.
    e, k, r, d, nbytes, m = 256, 8, 64, 7168, 2, 4
    ds = measure(args.tokens, e, k, r, args.seed)
    plain_b = float(ds["plain"]) * d * nbytes
    dedup_b = float(ds["dedup"]) * d * nbytes
    limited_b = float(ds["limited"]) * d * nbytes
    ds_row = {
        "E": e,
        "k": k,
        "EP": r,
        "m": m,
        "D": d,
        "dtype": "bf16",
        "plain_B": f"{plain_b:.0f}",
        "plain_B_an": f"{bytes_per_token(e, k, r, d, nbytes, dedup=False):.0f}",
        "dedup_B": f"{dedup_b:.0f}",
        "dedup_B_an": f"{bytes_per_token(e, k, r, d, nbytes, dedup=True):.0f}",
        "limited_B": f"{limited_b:.0f}",
        "limited_B_bound": f"{bytes_per_token(e, k, r, d, nbytes, dedup=True, max_ranks=m):.0f}",
        "dedup/plain": ds["dedup/plain"],
        "dedup/plain_an": f"{expected_copies_per_token(e, k, r, dedup=True) / k:.4f}",
        "lim/plain": ds["lim/plain"],
    }
    print("\nBytes per token, DeepSeek-V3-like shape (activation rows only, no metadata):")
    print(format_table([ds_row], list(ds_row)))

    write_csv(
        args.csv,
        [dict(row, kind="copies_per_token") for row in rows]
        + [dict(ds_row, kind="bytes_per_token")],
    )
    print(f"\nwrote {args.csv}")


if __name__ == "__main__":
    main()
