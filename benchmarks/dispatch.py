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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import environment_header, format_table, write_csv  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--csv", default=str(Path(__file__).resolve().parent / "results" / "dispatch.csv")
    )
    args = parser.parse_args()
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
