"""``torch.compile`` of the MoE layer on CPU: eager against compiled (Inductor, default and
``max-autotune``), forward and forward + backward, side by side in one process.

For each shape of ``benchmarks/moe_layer.py`` ((a) Mixtral-like, (b) fine-grained, (c)
decode-like, (d) DeepSeek-V3-like) and dtype: the median time of each variant (interleaved
round-robin), the speedup of each compiled variant over eager, and the compile time (the first
call). The compiled layer is ``fullgraph=True`` with the token dim marked dynamic; the run ends
with the number of graphs Dynamo compiled and of graph breaks.

What compile changes here (``torch_moe._inductor``): routing (router linear, softmax, top-k,
``token_sort``'s histogram and cumulative sums, the renormalisation) becomes a few fused C++
kernels instead of about twenty eager ops, and the auxiliary-loss and combine code is fused
too; the expert FFN stays the fused ``grouped_ffn`` kernel.

    python benchmarks/compile.py                      # shapes a-d, fp32: about 10 minutes
    python benchmarks/compile.py --shapes c --reps 20
    python benchmarks/compile.py --no-max-autotune    # skip the max-autotune variant
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Entry, environment_header, format_table, interleaved, write_csv  # noqa: E402
from moe_layer import SHAPES, _cast_parameters, make_inputs, reference_moe  # noqa: E402

import torch_moe  # noqa: E402,F401

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _fns(module, x, grad, mode):
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return module(x)
        return run, None

    def step():
        module(x).backward(grad)

    def reset():
        module.zero_grad(set_to_none=True)
        x.grad = None

    return step, reset


def bench_shape(shape, dtype, args) -> list[dict]:
    ref = reference_moe(shape)
    x, grad = make_inputs(shape, dtype)
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        variants = [("eager", None)] + [("compiled", "default")] + (
            [] if args.no_max_autotune else [("compiled max-autotune", "max-autotune")])
        entries, compile_s, graphs = [], {}, {}
        for name, compile_mode in variants:
            module = _cast_parameters(copy.deepcopy(ref), dtype)
            if compile_mode is not None:
                torch._dynamo.reset()
                before = _graph_count()
                torch._dynamo.mark_dynamic(x, 1)
                compiled = torch.compile(module, fullgraph=True, mode=compile_mode)
                fn, reset = _fns(compiled, x, grad, mode)
                start = time.perf_counter()
                fn()
                compile_s[name] = time.perf_counter() - start
                if reset:
                    reset()
                graphs[name] = before
            else:
                fn, reset = _fns(module, x, grad, mode)
            entries.append(Entry(name, fn, reset))
        interleaved(entries, reps=args.reps, warmup=2)
        eager = entries[0].median
        for e in entries:
            rows.append({
                "shape": shape.name, "dtype": str(dtype).removeprefix("torch."), "mode": mode,
                "variant": e.name, "median_ms": f"{e.median * 1e3:.2f}",
                "speedup_vs_eager": f"{eager / e.median:.2f}x",
                "compile_s": f"{compile_s[e.name]:.1f}" if e.name in compile_s else "",
            })
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="a,b,c,d")
    ap.add_argument("--dtypes", default="fp32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-max-autotune", action="store_true")
    ap.add_argument("--csv", default=str(RESULTS / "compile.csv"))
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    print("\n".join(environment_header()))
    start = time.perf_counter()
    rows = []
    for s in args.shapes.split(","):
        for d in args.dtypes.split(","):
            print(f"\n== {SHAPES[s]} {d}", flush=True)
            shape_rows = bench_shape(SHAPES[s], DTYPES[d], args)
            print(format_table(shape_rows, list(shape_rows[0])), flush=True)
            rows += shape_rows
    from torch._dynamo.utils import counters

    print(f"\ngraphs compiled: {counters['stats']['unique_graphs']} over "
          f"{sum(r['variant'] != 'eager' for r in rows)} compiled variants; graph breaks: {sum(counters['graph_break'].values())}")
    write_csv(args.csv, rows)
    print(f"done in {time.perf_counter() - start:.0f} s; CSV in {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
