"""GPU benchmark of ``torch_moe.quantized_grouped_mm`` (FP8 rowwise, MXFP8) against bf16
``torch._grouped_mm``, on MoE expert shapes. Needs a CUDA device (H100/H200 for the native FP8
rowwise kernel, B200/GB200 for the native MXFP8 one); without one it says so and exits 0.

Shapes (``M`` routed rows, grouped GEMM ``[M, K] @ [E, K, N]``, groups multiples of 32):

* DeepSeek-V3 (dim 7168, expert hidden 2048, 256 experts, top-8), the slice one GPU holds under
  16-way expert parallelism: E = 16 local experts, M = 16384 routed rows (2048 tokens x 8);
  ``dsv3_w13`` is the gate / up projection (K = 7168, N = 2048), ``dsv3_w2`` the down
  projection (K = 2048, N = 7168).
* Llama-4 Scout (dim 5120, expert hidden 8192, 16 experts, top-1): E = 16, M = 16384 tokens;
  ``llama4_w13`` (K = 5120, N = 8192) and ``llama4_w2`` (K = 8192, N = 5120).

For each shape and pass (forward; forward + backward) the implementations run interleaved
round-robin in one process, timed with CUDA events; the table reports medians. TFLOP/s counts
the GEMM work only, 2 M K N per GEMM (one GEMM forward, three forward + backward), so the FP8
rows also pay for their quantization kernels: that is the speed a training step sees.

Before timing, ``--check`` (on by default) runs ``torch_moe.scaled_grouped_mm`` on the device for
small problems with empty groups and rows past ``offs[-1]`` in every recipe and layout, and
compares it with the op's CPU kernel on the same operands; it also reports whether the call
synchronised with the host. The scale layouts the native kernels read are verified only here.

    python benchmarks/scaled_grouped_mm_gpu.py                   # check, then all shapes
    python benchmarks/scaled_grouped_mm_gpu.py --check-only      # correctness only
    python benchmarks/scaled_grouped_mm_gpu.py --shapes dsv3_w13 --reps 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import format_table, write_csv  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "scaled_grouped_mm_gpu.csv"
RECIPES = ("fp8_rowwise", "mxfp8")
ALIGN = 32  # group sizes: a multiple of both recipes' alignment (16 and 32)


@dataclass(frozen=True)
class Shape:
    model: str
    M: int
    K: int
    N: int
    E: int


SHAPES = {
    "dsv3_w13": Shape("DeepSeek-V3 gate/up, 16 of 256 experts", 16384, 7168, 2048, 16),
    "dsv3_w2": Shape("DeepSeek-V3 down, 16 of 256 experts", 16384, 2048, 7168, 16),
    "llama4_w13": Shape("Llama-4 Scout gate/up, 16 experts", 16384, 5120, 8192, 16),
    "llama4_w2": Shape("Llama-4 Scout down, 16 experts", 16384, 8192, 5120, 16),
}


def group_offsets(M: int, E: int, seed: int, device) -> torch.Tensor:
    """Cumulative ends of E groups, multiples of ALIGN summing to M, with a mild load imbalance
    (expert loads drawn from [0.5, 1.5) and normalised)."""
    gen = torch.Generator().manual_seed(seed)
    load = torch.rand(E, generator=gen) + 0.5
    blocks = (load / load.sum() * (M // ALIGN)).floor().to(torch.int64)
    blocks[-1] += M // ALIGN - int(blocks.sum())
    return torch.cumsum(blocks * ALIGN, 0).to(torch.int32).to(device)


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def time_interleaved(fns: dict, reps: int, warmup: int) -> dict:
    """Median milliseconds of each callable, run round-robin and timed with CUDA events."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    events = {name: [] for name in fns}
    names = list(fns)
    for i in range(reps):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]  # rotate the order to spread drift evenly
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {
        name: statistics.median(start.elapsed_time(end) for start, end in pairs)
        for name, pairs in events.items()
    }


def kernel_paths(recipe: str, shape: Shape, capability) -> str:
    """Which of the three GEMMs run torch._scaled_grouped_mm ("native") or the bf16 emulation."""
    from torch_moe.quantization import _cuda

    if torch.version.hip is not None:
        return "fwd/dgrad/wgrad emulated (ROCm)"
    def fp8(*size):
        return torch.empty(size, device="meta", dtype=torch.float8_e4m3fn)

    M, K, N, E = shape.M, shape.K, shape.N, shape.E
    offs = torch.empty(E, dtype=torch.int32, device="meta")
    gemms = {  # (layout, mat_a, mat_b) of each GEMM of quantized_grouped_mm
        "fwd": ("2d_3d", fp8(M, K), fp8(E, K, N)),
        "dgrad": ("2d_3d", fp8(M, N), fp8(E, N, K)),
        "wgrad": ("2d_2d", fp8(K, M), fp8(M, N)),
    }
    parts = []
    for name, (layout, a, b) in gemms.items():
        native = _cuda.native_kernel_supported(
            recipe, layout, capability, _cuda._built_with_mslk()
        ) and _cuda.native_shapes_supported(a, b, offs)
        parts.append(f"{name} {'native' if native else 'emulated'}")
    return ", ".join(parts)


def bench_shape(key: str, shape: Shape, reps: int, warmup: int, capability) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    offs = group_offsets(shape.M, shape.E, 0, dev)
    x = torch.randn(shape.M, shape.K, device=dev, dtype=torch.bfloat16, generator=gen)
    w = (torch.randn(shape.E, shape.K, shape.N, device=dev, dtype=torch.bfloat16, generator=gen)
         / shape.K**0.5)
    dy = torch.randn(shape.M, shape.N, device=dev, dtype=torch.bfloat16, generator=gen)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def forward(impl, a, b):
        if impl == "bf16":
            return torch._grouped_mm(a, b, offs=offs)
        return torch.ops.torch_moe.quantized_grouped_mm(a, b, offs, impl)

    def fwd_fn(impl):
        def fn():
            with torch.no_grad():
                forward(impl, x, w)
        return fn

    def fwd_bwd_fn(impl):
        def fn():
            xg.grad = wg.grad = None
            forward(impl, xg, wg).backward(dy)
        return fn

    impls = ("bf16",) + RECIPES
    flop = 2 * shape.M * shape.K * shape.N
    rows = []
    for pass_name, make, gemms in (("fwd", fwd_fn, 1), ("fwd+bwd", fwd_bwd_fn, 3)):
        ms = time_interleaved({impl: make(impl) for impl in impls}, reps, warmup)
        for impl in impls:
            rows.append({
                "shape": key, "M": shape.M, "K": shape.K, "N": shape.N, "E": shape.E,
                "pass": pass_name, "impl": impl,
                "median_ms": f"{ms[impl]:.3f}",
                "TFLOP/s": f"{gemms * flop / ms[impl] / 1e9:.0f}",
                "vs_bf16": f"{ms['bf16'] / ms[impl]:.2f}x",
                "paths": (
                    "torch._grouped_mm" if impl == "bf16" else kernel_paths(impl, shape, capability)
                ),
            })
    return rows


# --------------------------------------------------------------------------
# Correctness on the device
# --------------------------------------------------------------------------


def _vary_blocks(t: torch.Tensor, dim: int, gen) -> torch.Tensor:
    """t times a random power of two in [2**-4, 2**4] per block of 32 along ``dim`` (and per
    index of the other dims), so that neighbouring scales differ and a misplaced scale shows."""
    shape = list(t.shape)
    shape[dim] = -(-shape[dim] // 32)
    exponent = torch.randint(-4, 5, shape, generator=gen).repeat_interleave(32, dim)
    return t * torch.exp2(exponent.narrow(dim, 0, t.size(dim)).float()).to(t.device, t.dtype)


def _operands(recipe, two_d_three_d, sizes, tail, K, N, dev):
    ops = torch.ops.torch_moe
    gen = torch.Generator().manual_seed(1)
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32).to(dev)
    M = sum(sizes) + tail

    def quantize(t, dim, o=None):
        if recipe == "mxfp8":
            return ops.quantize_mxfp8(t, dim)
        return ops.quantize_fp8_rowwise(t, dim, o)

    x = torch.randn(M, K, generator=gen).to(dev, torch.bfloat16)
    if two_d_three_d:
        w = torch.randn(len(sizes), K, N, generator=gen).to(dev, torch.bfloat16)
        x, w = _vary_blocks(x, 1, gen), _vary_blocks(w, 1, gen)
        (a, sa), (b, sb) = quantize(x, 1), quantize(w, 1)
        return a, b, sa, sb, offs
    dy = torch.randn(M, N, generator=gen).to(dev, torch.bfloat16)
    x, dy = _vary_blocks(x, 0, gen), _vary_blocks(dy, 0, gen)
    (xq, sx), (gq, sg) = quantize(x, 0, offs), quantize(dy, 0, offs)
    return xq.t(), gq, sx.t(), sg, offs


def _call_without_sync(fn):
    """(result, synchronised?): runs fn with synchronising CUDA calls turned into errors, and
    again normally if one was raised."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(), False
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return fn(), True


def check(device="cuda") -> bool:
    from torch_moe.quantization import _cuda

    dev = torch.device(device)
    sizes = [64, 0, 160, 32, 0, 256, 96]  # empty groups; 2D x 3D also gets rows past offs[-1]
    ok = True
    rows = []
    for recipe in RECIPES:
        for two_d_three_d in (True, False):
            layout = "2d_3d" if two_d_three_d else "2d_2d"
            tail = 48 if two_d_three_d else 0
            # tile-aligned, and K / 32 and N not multiples of the 4 x 128 tile
            for K, N in ((256, 128), (96, 80)):
                a, b, sa, sb, offs = _operands(recipe, two_d_three_d, sizes, tail, K, N, dev)
                native = _cuda._use_native(recipe, layout, a, b, offs)
                status = "ok"
                try:
                    got, synced = _call_without_sync(
                        lambda: torch.ops.torch_moe.scaled_grouped_mm(
                            a, b, sa, sb, offs, torch.bfloat16
                        )
                    )
                    torch.cuda.synchronize()
                    a_, b_, sa_, sb_, offs_ = (t.cpu() for t in (a, b, sa, sb, offs))
                    op = torch.ops.torch_moe.scaled_grouped_mm
                    ref = op(a_, b_, sa_, sb_, offs_, torch.float32)
                    # |a| @ |b|: what an fp32 sum in another order can be off by, times ~K ulps
                    mag = op(a_.abs(), b_.abs(), sa_, sb_, offs_, torch.float32)
                    got = got.float().cpu()
                    # Outside the groups the result must be exactly zero. Inside, the device
                    # rounds to bf16 (half an ulp, 2**-9 relative) after summing in another
                    # order than the CPU; a misplaced scale is off by a factor of 2**k.
                    if two_d_three_d:
                        outside = got[sum(sizes):]
                    else:
                        outside = got[[g for g, s in enumerate(sizes) if s == 0]]
                    bound = 2**-8 * ref.abs() + 2**-14 * mag
                    if outside.any():
                        status = "FAIL: nonzero outside the groups"
                    elif not ((got - ref).abs() <= bound).all():
                        worst = ((got - ref).abs() - bound).argmax()
                        status = (f"FAIL: |diff| {(got - ref).abs().flatten()[worst]:.3g} > "
                                  f"{bound.flatten()[worst]:.3g} at flat index {int(worst)}")
                except Exception as e:  # report every case, then fail
                    status, synced = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0]}", None
                ok &= status == "ok"
                rows.append({
                    "recipe": recipe, "layout": layout, "K": K, "N": N,
                    "path": "native" if native else "emulated",
                    "host sync": "?" if synced is None else ("yes" if synced else "no"),
                    "result": status,
                })
    print(format_table(rows, list(rows[0])))
    return ok


# --------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-check", dest="check", action="store_false")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--csv", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "scaled_grouped_mm_gpu: no CUDA device (torch.cuda.is_available() is False), so "
            "nothing to benchmark. Run this on an H100/H200 (FP8 rowwise) or B200/GB200 (MXFP8)."
        )
        return 0

    import torch_moe  # noqa: F401  (registers the ops and their CUDA kernels)

    capability = torch.cuda.get_device_capability()
    print(f"{torch.cuda.get_device_name()} (capability {capability[0]}.{capability[1]}), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")

    if args.check or args.check_only:
        print("\ncheck: torch_moe.scaled_grouped_mm on the device against its CPU kernel")
        passed = check()
        if not passed:
            print("check FAILED: timings of a wrong kernel are meaningless, stopping")
            return 1
        if args.check_only:
            return 0

    rows = []
    for key in args.shapes:
        shape = SHAPES[key]
        dims = f"M={shape.M} K={shape.K} N={shape.N} E={shape.E}"
        print(f"\n{key}: {shape.model}, {dims}", flush=True)
        shape_rows = bench_shape(key, shape, args.reps, args.warmup, capability)
        columns = ["pass", "impl", "median_ms", "TFLOP/s", "vs_bf16", "paths"]
        print(format_table(shape_rows, columns))
        rows += shape_rows
        torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    for r in rows:
        r.update(device=device, torch=torch.__version__)
    write_csv(args.csv, rows)
    print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
