"""transformers' MoE blocks against the same blocks swapped onto torch_moe, side by side.

For each architecture at a realistic small size (hidden 1024, 16 to 64 experts), one block of
transformers 5 with random weights is timed forward + backward in three forms, interleaved in one
process (``_harness.interleaved``), on the same tokens and weights:

* ``eager``: transformers' own per-expert loop (``experts_implementation="eager"``, the default
  of a model built from a config on CPU);
* ``grouped_mm``: transformers' ``torch._grouped_mm`` experts (``experts_implementation=
  "grouped_mm"``), the composition torchtitan also uses;
* ``torch_moe``: the block after ``torch_moe.nn.replace_moe_blocks`` (same parameters, fused
  ``grouped_ffn`` experts).

It also counts the bytes autograd saves for backward beyond the inputs and weights
(``_harness.SavedBytes``) and checks that the three outputs agree. A table goes to stdout, CSV to
``benchmarks/results/hf_models.csv``; progress goes to stderr.

    python benchmarks/hf_models.py                 # all six architectures (about 6 minutes)
    python benchmarks/hf_models.py --quick         # tiny sizes, one round: a smoke test
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Entry, SavedBytes, environment_header, format_table, interleaved, write_csv  # noqa: E402

import torch_moe  # noqa: E402

try:
    import transformers
except ImportError:  # pragma: no cover - the `hf` extra
    sys.exit("benchmarks/hf_models.py needs transformers: pip install -e '.[hf]'")

RESULTS = Path(__file__).resolve().parent / "results" / "hf_models.csv"

# architecture -> (config class, block class path, config fields at the benchmark's size)
_ARCHS = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                dict(intermediate_size=1792, num_local_experts=16, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                  dict(moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
                       shared_expert_intermediate_size=2048, norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                  dict(moe_intermediate_size=384, num_experts=64, num_experts_per_tok=8,
                       norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
              dict(intermediate_size=512, num_experts=64, num_experts_per_tok=8)),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
                    dict(moe_intermediate_size=384, n_routed_experts=64, num_experts_per_tok=8,
                         n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5)),
    "gpt_oss": ("GptOssConfig", "gpt_oss.modeling_gpt_oss.GptOssMLP",
                dict(intermediate_size=1024, num_local_experts=32, num_experts_per_tok=4)),
}
_QUICK = dict(hidden_size=64, dims=("intermediate_size", "moe_intermediate_size",
                                    "shared_expert_intermediate_size"), width=32, tokens=64)
IMPLS = ("eager", "grouped_mm", "torch_moe")


def _block_class(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(__import__(f"transformers.models.{module}", fromlist=[name]), name)


def _config(arch: str, quick: bool, experts_implementation: str):
    cls_name, _, fields = _ARCHS[arch]
    fields = dict(fields, hidden_size=1024, num_attention_heads=8, num_key_value_heads=8)
    if quick:
        fields["hidden_size"] = _QUICK["hidden_size"]
        for name in _QUICK["dims"]:
            if name in fields:
                fields[name] = _QUICK["width"]
    config = getattr(transformers, cls_name)(**fields)
    config._experts_implementation = experts_implementation
    return config


def _output(y):
    return y[0] if isinstance(y, tuple) else y  # gpt-oss's block also returns its router scores


def _build(arch: str, quick: bool, dtype: torch.dtype) -> dict[str, nn.Module]:
    """The three forms of one block, with the same weights (random: transformers initialises some
    of them to zero)."""
    block_cls = _block_class(_ARCHS[arch][1])
    torch.manual_seed(0)
    eager = block_cls(_config(arch, quick, "eager"))
    with torch.no_grad():
        for name, t in list(eager.named_parameters()) + list(eager.named_buffers()):
            t.copy_(torch.randn_like(t) * (0.02 if t.dim() > 1 else 0.1))
    eager.to(dtype)
    grouped = block_cls(_config(arch, quick, "grouped_mm")).to(dtype)
    grouped.load_state_dict(eager.state_dict())
    holder = nn.ModuleDict({"mlp": copy.deepcopy(eager)})
    swapped = torch_moe.nn.replace_moe_blocks(holder)
    if swapped != ["mlp"]:
        raise RuntimeError(f"replace_moe_blocks swapped {swapped}, expected ['mlp']")
    return {"eager": eager, "grouped_mm": grouped, "torch_moe": holder["mlp"]}


def _step(block: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    def run():
        _output(block(x)).backward(grad)
    return run


def _reset(block: nn.Module, x: torch.Tensor):
    def reset():
        block.zero_grad(set_to_none=True)
        x.grad = None
    return reset


def _saved_mib(block: nn.Module, x: torch.Tensor) -> float:
    inputs = [x, *block.parameters(), *block.buffers()]
    with SavedBytes(inputs) as saved:
        y = _output(block(x))
    y.sum().backward()
    block.zero_grad(set_to_none=True)
    x.grad = None
    return saved.totals()[1] / 2**20


def run_arch(arch: str, args, dtype: torch.dtype, progress) -> dict:
    blocks = _build(arch, args.quick, dtype)
    D = blocks["eager"].experts.hidden_dim if hasattr(blocks["eager"].experts, "hidden_dim") else None
    D = D or blocks["eager"].experts.hidden_size
    tokens = _QUICK["tokens"] if args.quick else args.tokens
    torch.manual_seed(1)
    x = torch.randn(1, tokens, D, dtype=dtype, requires_grad=True)
    grad = torch.randn(1, tokens, D, dtype=dtype)
    with torch.no_grad():
        outs = {name: _output(b(x)).float() for name, b in blocks.items()}
    ref = outs["eager"]
    row = {"arch": arch, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "dim": D,
           "experts": blocks["torch_moe"].moe_config.num_experts,
           "top_k": blocks["torch_moe"].moe_config.top_k}
    for name in ("grouped_mm", "torch_moe"):
        row[f"{name}_max_rel_diff"] = f"{((outs[name] - ref).abs().max() / ref.abs().max()).item():.1e}"
    progress(f"{arch}: saved bytes")
    for name, b in blocks.items():
        row[f"{name}_saved_MiB"] = round(_saved_mib(b, x), 1)
    entries = [Entry(name, _step(b, x, grad), _reset(b, x)) for name, b in blocks.items()]
    progress(f"{arch}: timing {args.rounds} interleaved rounds of {', '.join(IMPLS)}")
    interleaved(entries, reps=args.rounds, warmup=1)
    for e in entries:
        row[f"{e.name}_ms"] = round(e.median * 1e3, 1)
    row["torch_moe_vs_eager"] = f"{row['eager_ms'] / row['torch_moe_ms']:.2f}x"
    row["torch_moe_vs_grouped_mm"] = f"{row['grouped_mm_ms'] / row['torch_moe_ms']:.2f}x"
    return row


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(_ARCHS), help=f"comma-separated subset of {','.join(_ARCHS)}")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per forward (batch 1)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per implementation")
    ap.add_argument("--csv", default=str(RESULTS))
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    args = ap.parse_args(argv)
    args.archs = args.archs.split(",")
    unknown = sorted(set(args.archs) - set(_ARCHS))
    if unknown:
        ap.error(f"unknown architectures {unknown}; expected a subset of {list(_ARCHS)}")
    if args.quick:
        args.rounds = 1
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    for line in environment_header():
        print(line)
    print(f"transformers {transformers.__version__}, torch_moe {getattr(torch_moe, '__version__', '')}".rstrip(", "))
    start = time.perf_counter()
    rows = []
    for i, arch in enumerate(args.archs):
        def progress(msg, i=i):
            print(f"[{i + 1}/{len(args.archs)} {time.perf_counter() - start:6.0f} s] {msg}",
                  file=sys.stderr, flush=True)
        rows.append(run_arch(arch, args, dtype, progress))
    columns = ["arch", "experts", "top_k", "eager_ms", "grouped_mm_ms", "torch_moe_ms",
               "torch_moe_vs_eager", "torch_moe_vs_grouped_mm", "eager_saved_MiB",
               "grouped_mm_saved_MiB", "torch_moe_saved_MiB", "grouped_mm_max_rel_diff",
               "torch_moe_max_rel_diff"]
    print(f"\nforward + backward of one block, {rows[0]['tokens']} tokens, {args.dtype}, median of "
          f"{args.rounds} interleaved rounds; saved = bytes autograd keeps for backward beyond "
          "inputs and weights; max_rel_diff = max |y - y_eager| / max |y_eager|")
    print(format_table(rows, columns))
    write_csv(args.csv, rows)
    print(f"\nCSV: {args.csv}")


if __name__ == "__main__":
    main()
