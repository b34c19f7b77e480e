"""FP8 rowwise and MXFP8 training: what quantization costs and what it changes.

Three sections, each printed as a table and written as CSV under ``benchmarks/results/``:

* ``bandwidth``: each quantize kernel against ``clone()`` of the same input, on CPU. GB/s counts
  the bytes read and written (input, FP8 data, scales); ``vs clone`` is the quantizer's time
  over clone's (1.00x would be a kernel that is as cheap as moving the bytes once).
* ``sqnr``: signal-to-quantization-noise ratio (dB) of each recipe against the unquantized
  computation (bf16 operands, fp32 accumulation): the three GEMMs of a grouped GEMM (forward,
  grad-input, grad-weight) on random data, and a whole MoE layer (output, input gradient and the
  worst expert-weight gradient) in the layer setup of torchao's MoE training tests (one shared
  expert, top-1, weights ~ N(0, 0.02), MSE loss against ones) and in the demo's setup (top-2,
  no shared expert).
* ``training``: the demo model (``benchmarks/demo.py``) trained from the same initialisation on
  the same batches with its expert GEMMs unquantized and in each recipe; the loss curves side by
  side and the gap of the final loss (mean of the last 10 steps) to the unquantized run.

On a CPU the quantized GEMMs are an emulation (dequantize, fp32 GEMM), so the training section
measures numerics, not speed; ``benchmarks/scaled_grouped_mm_gpu.py`` measures speed on a GPU.

    python benchmarks/quantization.py                       # all sections, 300 training steps
    python benchmarks/quantization.py --sections sqnr       # one section
    python benchmarks/quantization.py --steps 100           # a shorter training run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import Entry, environment_header, format_table, interleaved, write_csv  # noqa: E402

import torch_moe  # noqa: E402,F401
from torch_moe.nn import MoE, MoEConfig  # noqa: E402

ops = torch.ops.torch_moe
RESULTS = Path(__file__).resolve().parent / "results"
RECIPES = (("fp8_rowwise", "rceil"), ("mxfp8", "rceil"), ("mxfp8", "floor"))


def sqnr(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --------------------------------------------------------------------------
# Quantize bandwidth
# --------------------------------------------------------------------------


def bandwidth(args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    M, K = (2048, 1024) if args.quick else (8192, 2048)
    E, D, Fd = (4, 512, 256) if args.quick else (8, 2048, 1024)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(E, D, Fd, generator=g).bfloat16()
    offs = torch.linspace(0, M, E + 1)[1:].round().int().div(16, rounding_mode="floor").mul(16).int()
    offs[-1] = M
    cases = [
        ("mxfp8 rows  x[M,K] dim=-1", x, lambda: ops.quantize_mxfp8(x, -1)),
        ("mxfp8 cols  x[M,K] dim=0", x, lambda: ops.quantize_mxfp8(x, 0)),
        ("mxfp8 floor x[M,K] dim=-1", x, lambda: ops.quantize_mxfp8(x, -1, torch.float8_e4m3fn, "floor")),
        ("mxfp8 w[E,D,F] dim=1", w, lambda: ops.quantize_mxfp8(w, 1)),
        ("fp8 rowwise x[M,K] dim=-1", x, lambda: ops.quantize_fp8_rowwise(x, -1)),
        ("fp8 per-group x[M,K] dim=0", x, lambda: ops.quantize_fp8_rowwise(x, 0, offs)),
        ("fp8 rowwise w[E,D,F] dim=1", w, lambda: ops.quantize_fp8_rowwise(w, 1)),
    ]
    rows = []
    for name, src, fn in cases:
        clone = Entry("clone", lambda src=src: src.clone())
        quant = Entry(name, fn)
        interleaved([clone, quant], reps=args.reps, warmup=2)
        data, scale = fn()
        moved = _nbytes(src, data, scale)
        rows.append({
            "kernel": name,
            "shape": "x".join(map(str, src.shape)),
            "quantize_ms": f"{quant.median * 1e3:.2f}",
            "quantize_GB/s": f"{moved / quant.median / 1e9:.2f}",
            "clone_ms": f"{clone.median * 1e3:.2f}",
            "clone_GB/s": f"{2 * _nbytes(src) / clone.median / 1e9:.2f}",
            "vs_clone": f"{quant.median / clone.median:.2f}x",
        })
    print(format_table(rows, list(rows[0])))
    return rows


# --------------------------------------------------------------------------
# SQNR
# --------------------------------------------------------------------------


def gemm_sqnr(args) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    M, K, N, E = (512, 256, 256, 4) if args.quick else (2048, 1024, 512, 8)
    sizes = torch.full((E,), M // E)
    offs = sizes.cumsum(0).int()
    # Power-of-two scales leave mantissas alone, so two recipes differ only on elements that
    # one of them pushes out of E4M3's normal range (below 2**-6 times its scale). On Gaussian
    # data that never happens, and FP8 rowwise and MXFP8 RCEIL dequantize to the same values:
    # their rows coincide. (Tensors whose 32-blocks span more than E4M3's range do differ,
    # but the difference sits in the small blocks, which barely move a norm-based SQNR.)
    rows = []
    for data, x_scale in (("gaussian", torch.ones(K)),):
        x = (torch.randn(M, K, generator=g) * x_scale).bfloat16()
        w = (torch.randn(E, K, N, generator=g) / K**0.5).bfloat16()
        dy = torch.randn(M, N, generator=g).bfloat16()
        xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
        ref = torch_moe.grouped_mm(xr, wr, offs)
        ref.backward(dy.float())
        for recipe, mode in RECIPES:
            xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = ops.quantized_grouped_mm(xq, wq, offs, recipe, mode, False)
            out.backward(dy)
            rows.append({
                "gemm": f"grouped [{M},{K}]x[{E},{K},{N}], {data}", "recipe": recipe,
                "scale_mode": mode, "forward_dB": f"{sqnr(ref, out):.2f}",
                "grad_input_dB": f"{sqnr(xr.grad, xq.grad):.2f}",
                "grad_weight_dB": f"{sqnr(wr.grad, wq.grad):.2f}",
            })
    return rows


def _layer(cfg: MoEConfig, torchao_style: bool, precision: str, mode: str, seed: int):
    torch.manual_seed(seed)
    ref = MoE(cfg).bfloat16()
    if torchao_style:
        for p in ref.parameters():
            torch.nn.init.trunc_normal_(p, std=0.02)
    model = MoE(MoEConfig(**{**cfg.__dict__, "precision": precision, "quant_scale_mode": mode}))
    model = model.bfloat16()
    model.load_state_dict(ref.state_dict())
    x = torch.randn(4, 256, cfg.dim, dtype=torch.bfloat16)
    results = []
    for m in (ref, model):
        xi = x.clone().requires_grad_()
        y = m(xi)
        if torchao_style:
            F.mse_loss(y, torch.ones_like(y)).backward()
        else:
            y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16())
        results.append((y, xi.grad, {n: p.grad for n, p in m.named_parameters() if "experts." in n}))
    (y0, dx0, dw0), (y1, dx1, dw1) = results
    worst = min(sqnr(dw0[n], dw1[n]) for n in dw0 if n.startswith("experts."))
    return sqnr(y0, y1), sqnr(dx0, dx1), worst


def layer_sqnr(args) -> list[dict]:
    setups = [
        ("torchao test (D=256, F=1024, E=8, k=1, shared)", True,
         MoEConfig(dim=256, hidden_dim=1024, num_experts=8, top_k=1, num_shared_experts=1)),
        ("demo-like (D=128, F=256, E=8, k=2)", False,
         MoEConfig(dim=128, hidden_dim=256, num_experts=8, top_k=2)),
    ]
    rows = []
    for name, torchao_style, cfg in setups:
        for recipe, mode in RECIPES:
            out, dx, dw = _layer(cfg, torchao_style, recipe, mode, seed=42)
            rows.append({"gemm": f"MoE layer: {name}", "recipe": recipe, "scale_mode": mode,
                         "forward_dB": f"{out:.2f}", "grad_input_dB": f"{dx:.2f}",
                         "grad_weight_dB": f"{dw:.2f} (worst expert weight)"})
    return rows


def sqnr_section(args) -> list[dict]:
    rows = gemm_sqnr(args) + layer_sqnr(args)
    print(format_table(rows, list(rows[0])))
    return rows


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def training(args) -> list[dict]:
    import demo

    demo_args = demo.parse_args(["--steps", str(args.steps), "--log-every", str(args.log_every)])
    P_VV = demo.make_markov_chain(demo_args.vocab, demo_args.successors, demo_args.seed)
    train_NL = demo.sample_sequences(P_VV, demo_args.steps * demo_args.batch, demo_args.seq_len,
                                     demo_args.seed + 1)
    floor = demo.entropy_rate(P_VV)
    histories = {}
    for precision in ("bf16", "fp8_rowwise", "mxfp8"):
        demo_args.precision = precision
        label = "unquantized" if precision == "bf16" else precision
        print(f"-- {label}", flush=True)
        histories[precision] = demo.train(demo_args, True, train_NL, label=label)

    def window_mean(losses, end):
        start = max(0, end - args.log_every)
        return sum(losses[start:end]) / (end - start)

    rows = []
    for end in list(range(args.log_every, args.steps + 1, args.log_every)):
        row = {"step": end}
        for p, h in histories.items():
            row[f"loss_{p}"] = f"{window_mean(h['losses'], end):.4f}"
        rows.append(row)
    final = {p: sum(h["losses"][-10:]) / len(h["losses"][-10:]) for p, h in histories.items()}
    summary = {"step": "final (mean of last 10)"}
    for p, v in final.items():
        summary[f"loss_{p}"] = f"{v:.4f}"
    rows.append(summary)
    gap = {"step": "gap to unquantized"}
    for p, v in final.items():
        gap[f"loss_{p}"] = f"{100 * (v - final['bf16']) / final['bf16']:+.2f}%"
    rows.append(gap)
    print(f"\nloss per {args.log_every}-step window (mean), demo model, {args.steps} steps; "
          f"entropy-rate floor {floor:.3f}; 'bf16' = unquantized expert GEMMs (fp32 parameters "
          "on this CPU)")
    print(format_table(rows, list(rows[0])))
    for p in ("fp8_rowwise", "mxfp8"):
        rel = abs(final[p] - final["bf16"]) / final["bf16"]
        print(f"{p}: final loss {final[p]:.4f} vs {final['bf16']:.4f} unquantized: gap "
              f"{100 * rel:.2f}% ({'within' if rel <= 0.02 else 'OUTSIDE'} 2%)")
    return rows


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["bandwidth", "sqnr", "training"],
                    choices=["bandwidth", "sqnr", "training"])
    ap.add_argument("--steps", type=int, default=300, help="training steps per precision")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per kernel")
    ap.add_argument("--quick", action="store_true", help="smaller shapes")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    print("\n".join(environment_header()))
    sections = {"bandwidth": bandwidth, "sqnr": sqnr_section, "training": training}
    for name in args.sections:
        print(f"\n== {name}\n", flush=True)
        rows = sections[name](args)
        write_csv(RESULTS / f"quantization_{name}.csv", rows)
    print(f"\ndone in {time.perf_counter() - start:.0f} s; CSV in {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
