"""The GPU check of torch_moe: one script, one JSON, a fixed wall-clock budget.

Run it once on a GPU machine (``python benchmarks/gpu.py``, under 8 minutes with the default
``--budget-s 420``); the JSON is the record of the run. Sections, in this order:

* ``tests``  -- the device tests of ``test/cuda`` (the classes ``instantiate_device_type_tests``
  makes, whose names end in ``CUDA``) in a pytest subprocess with a time cap: counts and the
  tail of the output.
* ``gemm``   -- grouped GEMM TFLOP/s on the expert shapes of DeepSeek-V3, Qwen3-30B-A3B and
  Mixtral-8x7B, balanced and skewed routing: bf16 ``torch_moe.grouped_mm`` and the gathering
  ``torch_moe.indexed_grouped_mm`` against ``torch._grouped_mm`` (and ``index_select`` before
  it); FP8 rowwise ``torch_moe.scaled_grouped_mm`` against ``torch._scaled_grouped_mm`` on the
  same quantized operands, and ``torch_moe.quantized_grouped_mm`` (quantization included)
  against bf16.
* ``layer``  -- forward + backward of the routed experts (token sort, expert FFN, weighted
  combine; fixed routing) on the same shapes: ``moe_ffn`` in bf16 and FP8 rowwise against the
  torchtitan-style ``torch._grouped_mm`` composition and a per-expert loop (both from
  ``benchmarks/ops.py``): time, peak memory and the activation memory autograd keeps between
  forward and backward.
* ``sync``   -- the whole ``torch_moe.nn.MoE`` layer (dropless bf16 and FP8 rowwise, capacity
  mode) forward + backward under ``torch.cuda.set_sync_debug_mode("warn")``: host
  synchronisations counted, with the source lines that caused them; the forward captured in a
  CUDA graph and replayed on new tokens, forward + backward through
  ``torch.cuda.make_graphed_callables``, and ``torch.compile(fullgraph=True)``.

Every section, and every case in it, runs in ``try``/``except``: an error is recorded in the
JSON as text and the next case runs. Each section has a share of the budget; a case that would
start past its section's share (unused time rolls over to later sections) is recorded as
``"skipped: out of time"``. The JSON is rewritten after every section, so a run killed from
outside still leaves what it measured. At the end the targets of the CUDA work are printed next
to their measurements, each PASS / FAIL (or "not measured").

Timing: CUDA events around each call, the implementations of one case interleaved round-robin
after warm-up calls (the first call, which compiles and autotunes Triton kernels, is timed on
its own and reported as ``first_call_s``); medians. TFLOP/s counts 2 M K N per GEMM, so
quantization and gathers are paid for by the implementation that does them.

    python benchmarks/gpu.py                       # everything, 420 s budget
    python benchmarks/gpu.py --quick               # a quarter of the tokens, fewer samples
    python benchmarks/gpu.py --sections gemm,layer --out /tmp/gpu.json

On a machine without CUDA it prints "no CUDA device: nothing measured", writes a JSON saying so
and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
# torch_moe from this checkout where it is not installed (a GPU machine gets a bare copy)
sys.path.insert(1, str(ROOT))
from _harness import Entry, format_table  # noqa: E402

DEFAULT_OUT = BENCH / "results" / "gpu.json"
SECTIONS = ("tests", "gemm", "layer", "sync")
# Shares of the budget, in this order; what a section leaves unused goes to the next ones.
SHARES = {"env": 0.03, "tests": 0.30, "gemm": 0.22, "layer": 0.25, "sync": 0.20}
TEST_PATHS = ("test/cuda",)
CUDA_ERROR_MARKERS = ("CUDA error", "device-side assert", "illegal memory access",
                      "unspecified launch failure", "CUBLAS_STATUS_EXECUTION_FAILED")

# Dense bf16 tensor-core peak (no sparsity) from the vendors' datasheets, TFLOP/s, matched in
# this order against torch.cuda.get_device_name(); an unknown GPU is measured instead.
DENSE_BF16_PEAK_TFLOPS = (
    ("GH200", 989.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # "NVIDIA H100 80GB HBM3": SXM
    ("H800", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
)

# The targets the CUDA work is judged against (issue "The CUDA path").
TARGET_GEMM_VS_TORCH = 0.9  # bf16 grouped GEMM time ratio to torch._grouped_mm, DeepSeek-V3
TARGET_GEMM_PEAK_FRACTION = 0.70  # of the dense bf16 peak, DeepSeek-V3
TARGET_LAYER_SPEEDUP = 1.3  # MoE layer fwd+bwd against the torchtitan-style composition
TARGET_ACTIVATION_SAVING = 0.40  # less activation memory than the torchtitan-style composition
TARGET_FP8_SPEEDUP = 1.3  # FP8 rowwise layer fwd+bwd against bf16


# --------------------------------------------------------------------------
# Shapes, FLOPs, targets (pure functions: test/test_gpu_benchmark.py runs them on CPU)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The expert computation one GPU runs for a model: T tokens routed top-k over the E
    experts it holds, D model dim, F expert FFN dim (SwiGLU: w1, w3 [E, D, F], w2 [E, F, D])."""

    key: str
    name: str
    D: int
    F: int
    E: int
    k: int
    T: int
    note: str

    @property
    def S(self) -> int:
        """Routed rows (token, slot) pairs."""
        return self.T * self.k

    def scaled(self, token_divisor: int) -> ModelShape:
        return ModelShape(self.key, self.name, self.D, self.F, self.E, self.k,
                          max(self.T // token_divisor, 1), self.note)


MODELS = (
    # 256 experts under 8-way expert parallelism: a rank holds 32 and receives the 16384 slots
    # that 16K tokens send it, 512 rows per expert; modelled as 2048 tokens routed top-8 over 32.
    ModelShape("dsv3", "DeepSeek-V3", D=7168, F=2048, E=32, k=8, T=2048,
               note="32 of 256 experts (8-way EP), 16384 routed rows"),
    ModelShape("qwen3", "Qwen3-30B-A3B", D=2048, F=768, E=128, k=8, T=16384,
               note="all 128 experts, 16K tokens, 131072 routed rows"),
    ModelShape("mixtral", "Mixtral-8x7B", D=4096, F=14336, E=8, k=2, T=16384,
               note="all 8 experts, 16K tokens, 32768 routed rows"),
)
# Router logits get -SKEW * log(e + 1) for expert e (Zipf-like popularity): with top-8 of 32 the
# busiest expert takes about 4x the mean load and the quietest about 0.1x.
ROUTINGS = {"balanced": 0.0, "skewed": 1.0}


def grouped_gemm_flops(M: int, K: int, N: int) -> float:
    """FLOPs of a grouped GEMM over M rows in all: 2 M K N (a multiply and an add)."""
    return 2.0 * M * K * N


def moe_ffn_flops(S: int, D: int, F: int, backward: bool) -> float:
    """FLOPs of the expert GEMMs of a SwiGLU expert FFN over S routed rows: three GEMMs of
    2 S D F forward; backward computes two per forward GEMM (input and weight gradients)."""
    forward = 3 * grouped_gemm_flops(S, D, F)
    return 3 * forward if backward else forward


def dense_bf16_peak_tflops(device_name: str) -> Optional[float]:
    """The datasheet dense bf16 peak of a GPU by its name, or None for one not in the table."""
    for fragment, tflops in DENSE_BF16_PEAK_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops
    return None


def select_device_tests(node_ids: Sequence[str]) -> list[str]:
    """The node ids of device-type test classes (``TestFooCUDA::test_bar_cuda``) among those
    ``pytest --collect-only -q`` printed. A ``-k cuda`` expression would select every test under
    ``test/cuda`` instead, the interpreter tests included (pytest matches directory names too)."""
    selected = []
    for line in node_ids:
        parts = line.strip().split("::")
        if len(parts) >= 3 and parts[1].endswith("CUDA"):
            selected.append(line.strip())
    return selected


def parse_pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's last summary line ("2 failed, 10 passed in 3.1s")."""
    lines = [line for line in output.splitlines() if re.search(r"\bin [\d.]+s", line)]
    if not lines:
        return {}
    counts = {}
    for number, outcome in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", lines[-1]):
        counts["errors" if outcome.startswith("error") else outcome] = int(number)
    return counts


def _target(name: str, measured: Optional[float], threshold: float, detail: str) -> dict:
    return {
        "target": name,
        "measured": measured,
        "threshold": threshold,
        "pass": None if measured is None else bool(measured >= threshold),
        "detail": detail,
    }


def _best(rows: list[dict], **match) -> Optional[dict]:
    """The fastest ok row whose fields equal ``match`` (an impl name may be a tuple of names)."""
    found = []
    for r in rows:
        if r.get("median_ms") is None:
            continue
        ok = True
        for key, value in match.items():
            allowed = value if isinstance(value, tuple) else (value,)
            ok &= r.get(key) in allowed
        if ok:
            found.append(r)
    return min(found, key=lambda r: r["median_ms"]) if found else None


GEMM_TORCH_MOE = "torch_moe.grouped_mm"
GEMM_TORCH = ("torch._grouped_mm", "torch._grouped_mm (B column-major)")
LAYER_BF16 = "torch_moe moe_ffn bf16"
LAYER_FP8 = "torch_moe moe_ffn fp8_rowwise"
LAYER_TITAN = "torchtitan-style"
LAYER_LOOP = "per-expert loop"


def build_targets(gemm_rows: list[dict], layer_rows: list[dict], peak_tflops: Optional[float],
                  models: Sequence[str] = tuple(m.name for m in MODELS),
                  routings: Sequence[str] = tuple(ROUTINGS)) -> list[dict]:
    """Each target with its measured value and PASS / FAIL (``pass`` None: not measured, so a
    case that was skipped or failed still shows).

    * bf16 grouped GEMM on DeepSeek-V3 (``models[0]``), per GEMM and routing: the time of the
      faster ``torch._grouped_mm`` layout over ``torch_moe.grouped_mm``'s, and
      ``torch_moe.grouped_mm``'s TFLOP/s as a fraction of ``peak_tflops``;
    * per model: the layer's fwd+bwd speedup over the torchtitan-style composition, its
      activation memory saving against it (1 - ours / theirs), and FP8 rowwise over bf16.
    """
    targets = []
    dsv3 = models[0]
    for gemm in ("w1", "w2"):
        for routing in routings:
            case = dict(model=dsv3, gemm=gemm, routing=routing, dtype="bf16")
            ours = _best(gemm_rows, impl=GEMM_TORCH_MOE, **case)
            theirs = _best(gemm_rows, impl=GEMM_TORCH, **case)
            label = f"{dsv3} {gemm} {routing}"
            ratio = theirs["median_ms"] / ours["median_ms"] if ours and theirs else None
            targets.append(_target(
                f"bf16 grouped GEMM vs torch._grouped_mm, {label}", ratio, TARGET_GEMM_VS_TORCH,
                "time of the faster torch._grouped_mm layout / torch_moe.grouped_mm's"))
            fraction = ours["tflops"] / peak_tflops if ours and peak_tflops else None
            targets.append(_target(
                f"bf16 grouped GEMM fraction of dense bf16 peak, {label}", fraction,
                TARGET_GEMM_PEAK_FRACTION, f"torch_moe.grouped_mm TFLOP/s / {peak_tflops} TFLOP/s"))
    for model in models:
        bf16 = _best(layer_rows, model=model, impl=LAYER_BF16)
        fp8 = _best(layer_rows, model=model, impl=LAYER_FP8)
        titan = _best(layer_rows, model=model, impl=LAYER_TITAN)
        speedup = titan["median_ms"] / bf16["median_ms"] if bf16 and titan else None
        targets.append(_target(
            f"MoE layer fwd+bwd vs torchtitan-style, {model}", speedup, TARGET_LAYER_SPEEDUP,
            "torchtitan-style time / torch_moe bf16 time"))
        saving = None
        if bf16 and titan and bf16.get("activation_MiB") is not None and titan.get("activation_MiB"):
            saving = 1.0 - bf16["activation_MiB"] / titan["activation_MiB"]
        targets.append(_target(
            f"MoE layer activation memory saving vs torchtitan-style, {model}", saving,
            TARGET_ACTIVATION_SAVING,
            "1 - torch_moe bf16 / torchtitan-style bytes held between forward and backward"))
        fp8_speedup = bf16["median_ms"] / fp8["median_ms"] if bf16 and fp8 else None
        targets.append(_target(
            f"FP8 rowwise layer fwd+bwd vs bf16, {model}", fp8_speedup, TARGET_FP8_SPEEDUP,
            "torch_moe bf16 time / torch_moe fp8_rowwise time"))
    return targets


def format_targets(targets: list[dict]) -> str:
    lines = []
    for t in targets:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[t["pass"]]
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.3f}"
        lines.append(f"  {verdict}  {t['target']}: {measured} (target >= {t['threshold']:g}; "
                     f"{t['detail']})")
    return "\n".join(lines)


def jsonable(obj):
    """``obj`` with NaN / inf floats as None and tuples as lists, so ``json.dump`` writes
    strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:2000]}"


# --------------------------------------------------------------------------
# Budget and the record
# --------------------------------------------------------------------------


class Run:
    """The wall-clock budget, the progress log and the JSON record of one run."""

    def __init__(self, budget_s: float, out: Path, quick: bool):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.out = out
        self.quick = quick
        self.record: dict = {}
        self.section_end = self.start
        self.cuda_broken: Optional[str] = None  # the error after which the context is unusable

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        """Seconds left of the current section's share (and never past the whole budget)."""
        return min(self.section_end, self.start + self.budget_s) - time.perf_counter()

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)

    def open_section(self, name: str) -> None:
        self.section_end += SHARES[name] * self.budget_s

    def note_error(self, e: BaseException) -> str:
        text = _error_text(e)
        if self.cuda_broken is None and any(m in str(e) for m in CUDA_ERROR_MARKERS):
            self.cuda_broken = text
        return text

    def skip_reason(self, needs_s: float) -> Optional[str]:
        if self.cuda_broken is not None:
            return f"skipped: CUDA context lost after {self.cuda_broken[:300]}"
        if self.left() < needs_s:
            return f"skipped: out of time ({self.left():.0f} s left of the section, needs ~{needs_s:.0f} s)"
        return None

    def write(self) -> None:
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(self.out.suffix + ".tmp")
        # default=str: a value of an unforeseen type must not cost the record
        tmp.write_text(json.dumps(jsonable(self.record), indent=1, default=str))
        tmp.replace(self.out)


def run_section(run: Run, name: str, fn: Callable[[Run], dict], needs_s: float) -> None:
    run.open_section(name)
    reason = run.skip_reason(needs_s)
    if reason is not None:
        run.record["sections"][name] = {"status": reason}
        run.log(f"{name}: {reason}")
    else:
        run.log(f"== {name} ({run.left():.0f} s of the budget for it)")
        try:
            result = fn(run)
            run.record["sections"][name] = {"status": "ok", **result}
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            run.record["sections"][name] = {
                "status": "error", "error": run.note_error(e),
                "traceback": traceback.format_exc()[-4000:],
            }
            run.log(f"{name}: error {_error_text(e)[:300]}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run.write()


# --------------------------------------------------------------------------
# Timing and memory on the device
# --------------------------------------------------------------------------


def time_cuda(entries: list[Entry], reps: int, warmup: int) -> dict[str, float]:
    """Fill ``entry.times`` (seconds, CUDA events) round-robin, after one timed first call
    (returned per name: it compiles and autotunes) and ``warmup`` untimed ones. ``reset`` runs
    untimed after every call."""
    first = {}
    for e in entries:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        e.fn()
        torch.cuda.synchronize()
        first[e.name] = time.perf_counter() - t0
        if e.reset is not None:
            e.reset()
    for _ in range(warmup):
        for e in entries:
            e.fn()
            if e.reset is not None:
                e.reset()
    torch.cuda.synchronize()
    pending = {e.name: [] for e in entries}
    for i in range(reps):
        for j in range(len(entries)):
            e = entries[(i + j) % len(entries)]  # rotate the order to spread drift evenly
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            e.fn()
            end.record()
            pending[e.name].append((start, end))
            if e.reset is not None:
                e.reset()
    torch.cuda.synchronize()
    for e in entries:
        e.times = [s.elapsed_time(t) / 1e3 for s, t in pending[e.name]]
    return first


def rel_diff(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|, in fp32."""
    got, want = got.float(), want.float()
    scale = want.abs().max().clamp_min(1e-30)
    return float((got - want).abs().max() / scale)


def measure_dense_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """TFLOP/s of a dense bf16 [n, n] @ [n, n] torch.mm (median of ``reps`` after warm-up)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    entry = Entry("mm", lambda: torch.mm(a, b, out=out))
    time_cuda([entry], reps, warmup=3)
    return grouped_gemm_flops(n, n, n) / entry.median / 1e12


# --------------------------------------------------------------------------
# Section: environment
# --------------------------------------------------------------------------


def section_env(run: Run, device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device)
    capability = torch.cuda.get_device_capability(device)
    datasheet = dense_bf16_peak_tflops(name)
    measured = measure_dense_peak(device)
    peak = datasheet if datasheet is not None else measured
    run.log(f"{name}, capability {capability[0]}.{capability[1]}; dense bf16 torch.mm "
            f"{measured:.0f} TFLOP/s measured, datasheet peak "
            f"{datasheet if datasheet is not None else 'unknown'}; targets use {peak:.0f}")
    return {
        "dense_bf16_mm_tflops_measured": measured,
        "dense_bf16_peak_tflops_datasheet": datasheet,
        "dense_bf16_peak_tflops_used": peak,
        "peak_source": "datasheet" if datasheet is not None else "measured 8192^3 torch.mm",
    }


# --------------------------------------------------------------------------
# Section: CUDA tests
# --------------------------------------------------------------------------


def _pytest(args: list[str], timeout_s: float) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=max(timeout_s, 1))
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        output = text(e.stdout) + text(e.stderr)
        return -1, output + f"\n[killed after {timeout_s:.0f} s]", time.perf_counter() - t0


def section_tests(run: Run) -> dict:
    common = ["-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    result: dict = {"paths": list(TEST_PATHS)}
    missing = [m for m in ("expecttest", "hypothesis") if importlib.util.find_spec(m) is None]
    if missing:
        # torch.testing._internal.common_utils imports expecttest: without it nothing collects
        result["missing_modules"] = missing
    rc, out, secs = _pytest(["--collect-only", *common, *TEST_PATHS], min(120.0, run.left()))
    ids = select_device_tests(out.splitlines())
    result.update(collected_device_tests=len(ids), collect_s=round(secs, 1))
    if rc not in (0, 5):  # 5: nothing collected
        result["collect_output_tail"] = out[-3000:]
    if not ids:
        result["note"] = "no device-test class (name ending in CUDA) collected"
        return result
    run_args = [*common, "-rfE", "--tb=short"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        run_args.append("--timeout=120")
    cap = run.left() - 5
    if cap < 10:
        result["status"] = f"skipped: out of time after collecting ({run.left():.0f} s left)"
        return result
    run.log(f"tests: {len(ids)} device tests, at most {cap:.0f} s")
    rc, out, secs = _pytest([*run_args, *ids], cap)
    counts = parse_pytest_counts(out)
    run.log(f"tests: rc {rc}, {counts}, {secs:.0f} s")
    result.update(returncode=rc, counts=counts, run_s=round(secs, 1),
                  timed_out=rc == -1, output_tail=out[-6000:])
    return result


# --------------------------------------------------------------------------
# Section: grouped GEMM
# --------------------------------------------------------------------------


def make_routing(shape: ModelShape, skew: float, device, seed: int = 0) -> tuple[Tensor, Tensor]:
    """topk_ids [T, k] int64 and fp32 weights (softmax of the top-k logits); logits are
    normal with -skew * log(e + 1) added for expert e."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits_TE = torch.randn(shape.T, shape.E, generator=gen, device=device)
    if skew:
        logits_TE -= skew * torch.log(torch.arange(1, shape.E + 1, device=device, dtype=torch.float32))
    values_TK, ids_TK = logits_TE.topk(shape.k, dim=-1)
    return ids_TK, values_TK.softmax(dim=-1)


def group_layout(ids_TK: Tensor, E: int, align: int = 1) -> tuple[Tensor, Tensor, int]:
    """(token index of each routed row in expert order [S] int64, offs [E] int32 with every
    group rounded up to ``align``, total rows). Setup only: it reads the counts on the host."""
    k = ids_TK.size(1)
    order_S = torch.argsort(ids_TK.flatten(), stable=True)
    counts_E = torch.bincount(ids_TK.flatten(), minlength=E)
    padded_E = (counts_E + align - 1) // align * align
    offs_E = torch.cumsum(padded_E, 0).to(torch.int32)
    return order_S // k, offs_E, int(offs_E[-1])


def _case_rows(shape: ModelShape, gemm: str, routing: str, dtype: str, M: int, K: int, N: int,
               cases: list[tuple[Entry, Optional[str]]], reps: int, warmup: int) -> list[dict]:
    """Time the entries of one case together; each row compares its entry with the entry
    named as its baseline (time ratio, and the outputs' max relative difference)."""
    entries = [e for e, _ in cases]
    first = time_cuda(entries, reps, warmup)
    by_name = {e.name: e for e in entries}
    outputs = {e.name: e.fn() for e in entries}
    rows = []
    for e, baseline in cases:
        t, base = e.median, by_name.get(baseline)
        rows.append({
            "model": shape.name, "model_key": shape.key, "gemm": gemm, "routing": routing,
            "dtype": dtype, "impl": e.name, "M": M, "K": K, "N": N, "E": shape.E,
            "median_ms": t * 1e3, "tflops": grouped_gemm_flops(M, K, N) / t / 1e12,
            "baseline": baseline, "vs_baseline": base.median / t if base is not None else None,
            "rel_diff_vs_baseline": (rel_diff(outputs[e.name], outputs[baseline])
                                     if base is not None else None),
            "first_call_s": first[e.name],
        })
    return rows


def bench_gemm_case(shape: ModelShape, gemm: str, routing: str, reps: int, warmup: int,
                    dev: torch.device) -> list[dict]:
    """bf16 and FP8 rowwise grouped GEMMs of one model's ``gemm`` on its routing: "w1" is the
    up-projection [M, D] @ [E, D, F] (its fused form gathers the token rows), "w2" the
    down-projection [M, F] @ [E, F, D] (its fused form scales by the routing weight and adds
    into the token rows)."""
    from torch_moe import _compat
    from torch_moe.quantization import _cuda

    ops = torch.ops.torch_moe
    K, N = (shape.D, shape.F) if gemm == "w1" else (shape.F, shape.D)
    gen = torch.Generator(device=dev).manual_seed(1)
    ids_TK, weights_TK = make_routing(shape, ROUTINGS[routing], dev)
    token_S, offs, M = group_layout(ids_TK, shape.E)
    weight_S = weights_TK.flatten()[torch.argsort(ids_TK.flatten(), stable=True)]
    x_TK = torch.randn(shape.T, K, device=dev, dtype=torch.bfloat16, generator=gen)
    a_MK = x_TK.index_select(0, token_S) if gemm == "w1" else torch.randn(
        M, K, device=dev, dtype=torch.bfloat16, generator=gen)
    w_EKN = torch.randn(shape.E, K, N, device=dev, dtype=torch.bfloat16, generator=gen) / K**0.5
    w_cm_EKN = w_EKN.transpose(1, 2).contiguous().transpose(1, 2)  # torchtitan's layout
    plain = GEMM_TORCH[0]
    cases = [
        (Entry(plain, lambda: _compat.grouped_mm(a_MK, w_EKN, offs=offs)), None),
        (Entry(GEMM_TORCH[1], lambda: _compat.grouped_mm(a_MK, w_cm_EKN, offs=offs)), plain),
        (Entry(GEMM_TORCH_MOE, lambda: ops.grouped_mm(a_MK, w_EKN, offs)), plain),
    ]
    if gemm == "w1":
        unfused = "index_select + torch._grouped_mm"
        cases += [
            (Entry(unfused, lambda: _compat.grouped_mm(x_TK.index_select(0, token_S), w_EKN,
                                                       offs=offs)), None),
            (Entry("torch_moe.indexed_grouped_mm (gather)",
                   lambda: ops.indexed_grouped_mm(x_TK, w_EKN, offs, token_S)), unfused),
        ]
    else:
        unfused = "torch._grouped_mm + weights + index_add_"

        def combine():
            y_MN = _compat.grouped_mm(a_MK, w_EKN, offs=offs) * weight_S[:, None]
            out = torch.zeros(shape.T, N, device=dev, dtype=torch.bfloat16)
            return out.index_add_(0, token_S, y_MN.to(torch.bfloat16))

        cases += [
            (Entry(unfused, combine), None),
            (Entry("torch_moe.indexed_grouped_mm (scatter)", lambda: ops.indexed_grouped_mm(
                a_MK, w_EKN, offs, None, token_S, weight_S, shape.T)), unfused),
        ]
    with torch.no_grad():
        rows = _case_rows(shape, gemm, routing, "bf16", M, K, N, cases, reps, warmup)
        del cases

        # FP8 rowwise: groups padded to 16 rows, as token_sort(align=16) pads them.
        _, offs16, M16 = group_layout(ids_TK, shape.E, align=16)
        a16_MK = torch.randn(M16, K, device=dev, dtype=torch.bfloat16, generator=gen)
        qa, sa_M1 = ops.quantize_fp8_rowwise(a16_MK, 1)
        qw, sw_E1N = ops.quantize_fp8_rowwise(w_EKN, 1)
        qw_cm = qw.transpose(1, 2).contiguous().transpose(1, 2)  # column-major, as aten takes it
        capability = torch.cuda.get_device_capability(dev)
        native = _cuda.native_kernel_supported("fp8_rowwise", "2d_3d", capability,
                                               _cuda._built_with_mslk())
        bf16 = "torch._grouped_mm bf16 (same rows)"
        aten = "torch._scaled_grouped_mm"
        cases = [(Entry(bf16, lambda: _compat.grouped_mm(a16_MK, w_EKN, offs=offs16)), None)]
        if native:
            sa_M, sw_EN = sa_M1.reshape(M16).contiguous(), sw_E1N.reshape(shape.E, N).contiguous()
            cases.append((Entry(aten, lambda: _compat.scaled_grouped_mm(
                qa, qw_cm, sa_M, sw_EN, recipe="fp8_rowwise", offs=offs16,
                out_dtype=torch.bfloat16)), None))
        cases += [
            (Entry("torch_moe.scaled_grouped_mm",
                   lambda: ops.scaled_grouped_mm(qa, qw_cm, sa_M1, sw_E1N, offs16)),
             aten if native else None),
            (Entry("torch_moe.quantized_grouped_mm (quantize + GEMM)",
                   lambda: ops.quantized_grouped_mm(a16_MK, w_EKN, offs16, "fp8_rowwise")), bf16),
        ]
        fp8_rows = _case_rows(shape, gemm, routing, "fp8_rowwise", M16, K, N, cases, reps, warmup)
    bf16_ms = fp8_rows[0]["median_ms"]
    for r in fp8_rows:
        r["vs_bf16"] = bf16_ms / r["median_ms"]
    if not native:
        fp8_rows.append({"model": shape.name, "model_key": shape.key, "gemm": gemm,
                         "routing": routing, "dtype": "fp8_rowwise", "impl": aten,
                         "note": f"no native FP8 rowwise grouped kernel on capability {capability}"})
    return rows + fp8_rows


GEMM_COLUMNS = ["model", "gemm", "routing", "dtype", "impl", "M", "K", "N", "median_ms", "tflops",
                "vs_baseline", "vs_bf16", "rel_diff_vs_baseline", "first_call_s", "error", "note"]


def _fmt(rows: list[dict], columns: list[str]) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, float) else ("" if v is None else v)
    return format_table([{c: cell(r.get(c)) for c in columns} for r in rows], columns)


def section_gemm(run: Run, models: Sequence[ModelShape], reps: int, warmup: int,
                 dev: torch.device) -> dict:
    rows = []
    routings = ("balanced",) if run.quick else tuple(ROUTINGS)
    for shape in models:
        for gemm in ("w1", "w2"):
            for routing in routings:
                label = f"{shape.name} {gemm} {routing}"
                reason = run.skip_reason(8.0)
                if reason is not None:
                    rows.append({"model": shape.name, "model_key": shape.key, "gemm": gemm,
                                 "routing": routing, "note": reason})
                    continue
                try:
                    case = bench_gemm_case(shape, gemm, routing, reps, warmup, dev)
                    rows += case
                    best = {r["impl"]: r for r in case if r.get("dtype") == "bf16"}
                    moe = best.get(GEMM_TORCH_MOE, {})
                    run.log(f"gemm {label}: torch_moe {moe.get('tflops', float('nan')):.0f} TFLOP/s, "
                            f"{moe.get('vs_baseline', float('nan')):.2f}x torch._grouped_mm")
                except Exception as e:  # noqa: BLE001 - record it, go on with the next case
                    rows.append({"model": shape.name, "model_key": shape.key, "gemm": gemm,
                                 "routing": routing, "error": run.note_error(e)})
                    run.log(f"gemm {label}: error {_error_text(e)[:300]}")
                torch.cuda.empty_cache()
    print(_fmt(rows, GEMM_COLUMNS), flush=True)
    from torch_moe import _compat

    # what the rows named torch._grouped_mm / torch._scaled_grouped_mm called (the same aten
    # kernels either way)
    aten_api = {
        "grouped_mm": "torch.nn.functional.grouped_mm" if _compat._public_grouped_mm()
        else "torch._grouped_mm",
        "scaled_grouped_mm": "torch.nn.functional.scaled_grouped_mm"
        if _compat._public_scaled_grouped_mm() else "torch._scaled_grouped_mm",
    }
    return {"rows": rows, "aten_api": aten_api}


# --------------------------------------------------------------------------
# Section: MoE layer forward + backward
# --------------------------------------------------------------------------


def make_problem(shape: ModelShape, skew: float, device):
    """``benchmarks/ops.py``'s Problem (x and the three weights: bf16 leaves that require
    grad; bf16 routing weights; a dense grad_out), generated on the device."""
    import ops

    gen = torch.Generator(device=device).manual_seed(2)
    T, D, F_, E = shape.T, shape.D, shape.F, shape.E

    def leaf(*size: int, fan_in: int = 1) -> Tensor:
        t = torch.randn(*size, generator=gen, device=device) / math.sqrt(fan_in)
        return t.to(torch.bfloat16).requires_grad_()

    ids_TK, weights_TK = make_routing(shape, skew, device)
    return ops.Problem(
        shape=ops.MoEShape(shape.key, T=T, D=D, F=F_, E=E, k=shape.k), dtype=torch.bfloat16,
        x_TD=leaf(T, D), topk_ids_TK=ids_TK, topk_weights_TK=weights_TK.to(torch.bfloat16),
        w1_EDF=leaf(E, D, F_, fan_in=D), w2_EFD=leaf(E, F_, D, fan_in=F_),
        w3_EDF=leaf(E, D, F_, fan_in=D),
        grad_out_TD=torch.randn(T, D, generator=gen, device=device).to(torch.bfloat16),
    )


def layer_impls(p) -> list[tuple[str, Callable]]:
    """(name, prepare) of each implementation; prepare(p) -> ops.Prepared."""
    import ops
    from torch_moe.nn.functional import moe_ffn

    def torch_moe(precision: str):
        def prepare(p):
            w1, w2, w3 = p.weights
            return ops.Prepared(
                [w1, w2, w3],
                lambda x, ids, tw: moe_ffn(x, ids, tw, w1, w2, w3, precision=precision),
                lambda: (w1.grad, w2.grad, w3.grad))
        return prepare

    return [(LAYER_BF16, torch_moe("bf16")), (LAYER_FP8, torch_moe("fp8_rowwise")),
            (LAYER_TITAN, ops.prepare_titan_style), (LAYER_LOOP, ops.prepare_hf_loop)]


def _tensor_bytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def layer_memory(p, prep) -> tuple[float, float, Tensor]:
    """(activation MiB: bytes allocated by the forward that stay until backward, the output
    excluded; peak MiB of forward + backward above what was allocated before (gradients
    included); the output)."""
    leaves = [p.x_TD, *prep.params]
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y_TD = prep.forward(p.x_TD, p.topk_ids_TK, p.topk_weights_TK)
    torch.cuda.synchronize()
    activation = torch.cuda.memory_allocated() - base - _tensor_bytes(y_TD)
    y_TD.backward(p.grad_out_TD)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out = y_TD.detach()
    for t in leaves:
        t.grad = None
    return activation / 2**20, peak / 2**20, out


def bench_layer_model(shape: ModelShape, reps: int, warmup: int, dev: torch.device) -> list[dict]:
    import ops

    p = make_problem(shape, ROUTINGS["balanced"], dev)
    flops = moe_ffn_flops(shape.S, shape.D, shape.F, backward=True)
    rows, entries, outputs = [], [], {}
    for name, prepare in layer_impls(p):
        row = {"model": shape.name, "model_key": shape.key, "impl": name, "T": shape.T,
               "D": shape.D, "F": shape.F, "E": shape.E, "k": shape.k}
        rows.append(row)
        try:
            prep = prepare(p)
            step, reset = ops.train_step_fns(p, prep)
            # The first step compiles and autotunes (and autotuning allocates buffers of its
            # own), so memory is measured on the second.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            reset()
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            row["activation_MiB"], row["peak_MiB"], outputs[name] = layer_memory(p, prep)
            syncs = count_syncs(lambda: (step(), reset()), first_traceback=False)
            row["host_syncs"] = syncs["syncs"]
            if name in (LAYER_BF16, LAYER_FP8):
                row["host_sync_sites"] = syncs["sites"]
            entries.append(Entry(name, step, reset))
        except Exception as e:  # noqa: BLE001 - one broken implementation must not stop the rest
            row["error"] = _error_text(e)
            if any(m in str(e) for m in CUDA_ERROR_MARKERS):
                raise
    time_cuda(entries, reps, warmup)
    by_name = {r["impl"]: r for r in rows}
    titan = next((e for e in entries if e.name == LAYER_TITAN), None)
    titan_row = by_name.get(LAYER_TITAN, {})
    for e in entries:
        row = by_name[e.name]
        row.update(median_ms=e.median * 1e3, tflops=flops / e.median / 1e12)
        if titan is not None:
            row["speedup_vs_titan"] = titan.median / e.median
            if titan_row.get("activation_MiB"):
                row["activation_vs_titan"] = row["activation_MiB"] / titan_row["activation_MiB"]
        if LAYER_TITAN in outputs:
            row["rel_diff_vs_titan"] = rel_diff(outputs[e.name], outputs[LAYER_TITAN])
    return rows


LAYER_COLUMNS = ["model", "impl", "median_ms", "tflops", "speedup_vs_titan", "activation_MiB",
                 "activation_vs_titan", "peak_MiB", "host_syncs", "rel_diff_vs_titan", "first_call_s",
                 "error", "note"]


def section_layer(run: Run, models: Sequence[ModelShape], reps: int, warmup: int,
                  dev: torch.device) -> dict:
    rows = []
    for shape in models:
        reason = run.skip_reason(15.0)
        if reason is not None:
            rows.append({"model": shape.name, "model_key": shape.key, "note": reason})
            continue
        try:
            model_rows = bench_layer_model(shape, reps, warmup, dev)
            rows += model_rows
            summary = ", ".join(f"{r['impl']} {r.get('median_ms', float('nan')):.2f} ms"
                                for r in model_rows)
            run.log(f"layer {shape.name}: {summary}")
        except Exception as e:  # noqa: BLE001
            rows.append({"model": shape.name, "model_key": shape.key, "error": run.note_error(e)})
            run.log(f"layer {shape.name}: error {_error_text(e)[:300]}")
        torch.cuda.empty_cache()
    print(_fmt(rows, LAYER_COLUMNS), flush=True)
    return {"rows": rows, "mode": "forward + backward, balanced routing, bf16 activations"}


# --------------------------------------------------------------------------
# Section: host synchronisations, CUDA graphs, torch.compile
# --------------------------------------------------------------------------


SYNC_SHAPE = ModelShape("qwen3", "Qwen3-30B-A3B", D=2048, F=768, E=128, k=8, T=4096,
                        note="4096 tokens")


def make_layer(shape: ModelShape, device, **config):
    """A seeded ``torch_moe.nn.MoE`` built on the device with bf16 parameters (its buffers keep
    their own dtypes)."""
    from torch_moe.nn import MoE, MoEConfig

    torch.manual_seed(0)
    cfg = MoEConfig(dim=shape.D, hidden_dim=shape.F, num_experts=shape.E, top_k=shape.k,
                    normalize_topk=True, **config)
    return MoE(cfg, device=device, dtype=torch.bfloat16)


def count_syncs(step: Callable[[], None], first_traceback: bool = True) -> dict:
    """Host synchronisations of one call of ``step``: the warnings that
    ``set_sync_debug_mode("warn")`` raises, by source line; where there are any and
    ``first_traceback``, the traceback of the first one (from the "error" mode, one more call)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    sites: dict[str, int] = {}
    for w in syncs:
        site = f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(str(ROOT)) else w.filename}:{w.lineno}"
        sites[site] = sites.get(site, 0) + 1
    result = {"syncs": len(syncs), "sites": sites}
    if syncs and first_traceback:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError:
            result["first_sync_traceback"] = traceback.format_exc()[-3000:]
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return result


def _layer_step(layer, x_TD: Tensor, grad_TD: Tensor) -> Callable[[], None]:
    def step() -> None:
        layer(x_TD).backward(grad_TD)
        layer.zero_grad(set_to_none=True)
        x_TD.grad = None
    return step


def graph_forward(layer, x_TD: Tensor, x2_TD: Tensor) -> dict:
    """Forward captured in a CUDA graph, replayed on the captured tokens and on new ones (other
    routing, decided inside the graph), against eager forwards."""
    static_x = x_TD.detach().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):
            layer(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        result = {"ok": True}
        graph.replay()
        result["replay_rel_diff"] = rel_diff(static_y, layer(static_x))
        static_x.copy_(x2_TD)
        graph.replay()
        result["replay_new_tokens_rel_diff"] = rel_diff(static_y, layer(static_x))
        eager = Entry("eager", lambda: layer(static_x))
        replay = Entry("replay", graph.replay)
        time_cuda([eager, replay], reps=10, warmup=2)
    result.update(eager_forward_ms=eager.median * 1e3, replay_ms=replay.median * 1e3)
    return result


def graph_fwd_bwd(layer, x_TD: Tensor, grad_TD: Tensor) -> dict:
    """Forward and backward captured by ``torch.cuda.make_graphed_callables``, one step run."""
    x = x_TD.detach().clone().requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    graphed(x).backward(grad_TD)
    torch.cuda.synchronize()
    layer.zero_grad(set_to_none=True)
    return {"ok": True}


def compiled_fwd_bwd(layer, x_TD: Tensor, grad_TD: Tensor) -> dict:
    """``torch.compile(fullgraph=True)`` of the layer: compile time, a fwd+bwd step's time
    against eager, and the output against eager."""
    compiled = torch.compile(layer, fullgraph=True)
    x = x_TD.detach().clone().requires_grad_()
    t0 = time.perf_counter()
    y = compiled(x)
    y.backward(grad_TD)
    torch.cuda.synchronize()
    result = {"ok": True, "compile_s": time.perf_counter() - t0}
    with torch.no_grad():
        result["rel_diff_vs_eager"] = rel_diff(compiled(x), layer(x))
    layer.zero_grad(set_to_none=True)
    steps = [Entry("eager", _layer_step(layer, x, grad_TD)),
             Entry("compiled", _layer_step(compiled, x, grad_TD))]
    time_cuda(steps, reps=5, warmup=1)
    result.update(eager_step_ms=steps[0].median * 1e3, compiled_step_ms=steps[1].median * 1e3)
    return result


def section_sync(run: Run, shape: ModelShape, dev: torch.device) -> dict:
    gen = torch.Generator(device=dev).manual_seed(3)
    x_TD = torch.randn(shape.T, shape.D, device=dev, generator=gen).to(torch.bfloat16).requires_grad_()
    x2_TD = torch.randn(shape.T, shape.D, device=dev, generator=gen).to(torch.bfloat16)
    grad_TD = torch.randn(shape.T, shape.D, device=dev, generator=gen).to(torch.bfloat16)
    result: dict = {"shape": f"{shape.name}: T={shape.T} D={shape.D} F={shape.F} E={shape.E} k={shape.k}"}
    cases = {
        "dropless bf16": {},
        "dropless fp8_rowwise": {"precision": "fp8_rowwise"},
        "capacity 1.25 bf16": {"capacity_factor": 1.25},
    }
    counts = {}
    for name, config in cases.items():
        reason = run.skip_reason(5.0)
        if reason is not None:
            counts[name] = {"status": reason}
            continue
        try:
            layer = make_layer(shape, dev, **config)
            step = _layer_step(layer, x_TD, grad_TD)
            step()  # first call: compiles and autotunes (autotuning synchronises)
            counts[name] = count_syncs(step)
            run.log(f"sync {name}: {counts[name]['syncs']} host syncs in forward + backward")
        except Exception as e:  # noqa: BLE001
            counts[name] = {"error": run.note_error(e)}
            run.log(f"sync {name}: error {_error_text(e)[:300]}")
    result["host_syncs_fwd_bwd"] = counts

    checks = (("cuda_graph_forward", 10.0, lambda layer: graph_forward(layer, x_TD, x2_TD)),
              ("cuda_graph_fwd_bwd", 10.0, lambda layer: graph_fwd_bwd(layer, x_TD, grad_TD)),
              ("compile_fullgraph_fwd_bwd", 60.0, lambda layer: compiled_fwd_bwd(layer, x_TD, grad_TD)))
    for name, needs_s, check in checks:
        reason = run.skip_reason(needs_s)
        if reason is not None:
            result[name] = {"status": reason}
            continue
        # what is known so far reaches the JSON even if this check hangs until the run is killed
        run.record["sections"]["sync"] = {"status": f"running {name}", **result}
        run.write()
        try:
            result[name] = check(make_layer(shape, dev))
        except Exception as e:  # noqa: BLE001 - the error is the finding
            # A failed capture raises CUDA errors that do not make the context unusable, so
            # they are not taken as its loss (the next check would show it).
            result[name] = {"ok": False, "error": _error_text(e),
                            "traceback": traceback.format_exc()[-3000:]}
        run.log(f"sync {name}: {'ok' if 'error' not in result[name] else result[name]['error'][:200]}")
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def versions() -> dict:
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"torch": torch.__version__, "triton": triton, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSON (default {DEFAULT_OUT})")
    ap.add_argument("--quick", action="store_true",
                    help="a quarter of the tokens, balanced routing only, fewer samples")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="wall-clock budget in seconds; sections past their share are skipped")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = Run(args.budget_s, args.out, args.quick)
    run.record = {"script": "benchmarks/gpu.py", "argv": sys.argv[1:], "versions": versions(),
                  "cuda_available": torch.cuda.is_available(), "budget_s": args.budget_s,
                  "quick": args.quick}
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        run.record.update(device=None, message="no CUDA device: nothing measured")
        run.write()
        print(f"wrote {args.out}")
        return 0

    import torch_moe  # noqa: F401  (registers the ops and their CUDA kernels)

    capability = torch.cuda.get_device_capability()
    run.record.update(device=torch.cuda.get_device_name(), capability=f"{capability[0]}.{capability[1]}",
                      sections={})
    run.log(f"{run.record['device']}, torch {torch.__version__}, triton {run.record['versions']['triton']}, "
            f"budget {args.budget_s:.0f} s{' (quick)' if args.quick else ''}")
    divisor, reps, warmup = (4, 5, 2) if args.quick else (1, 20, 3)
    models = [m.scaled(divisor) for m in MODELS]

    dev = torch.device("cuda", torch.cuda.current_device())
    run_section(run, "env", lambda r: section_env(r, dev), needs_s=1.0)
    env = run.record["sections"]["env"]
    peak = env.get("dense_bf16_peak_tflops_used")
    sections = {
        "tests": (section_tests, 30.0),
        "gemm": (lambda r: section_gemm(r, models, reps, warmup, dev), 8.0),
        "layer": (lambda r: section_layer(r, models, max(reps // 2, 3), warmup, dev), 15.0),
        "sync": (lambda r: section_sync(r, SYNC_SHAPE.scaled(divisor), dev), 5.0),
    }
    for name in SECTIONS:
        if name in args.sections:
            fn, needs_s = sections[name]
            run_section(run, name, fn, needs_s)
        else:
            run.open_section(name)  # its share goes to the sections after it
            run.record["sections"][name] = {"status": "skipped: not asked for (--sections)"}

    gemm_rows = run.record["sections"].get("gemm", {}).get("rows", [])
    layer_rows = run.record["sections"].get("layer", {}).get("rows", [])
    routings = ("balanced",) if args.quick else tuple(ROUTINGS)
    try:
        targets = build_targets(gemm_rows, layer_rows, peak, routings=routings)
        run.record["targets"] = targets
        run.record["targets_passed"] = sum(t["pass"] is True for t in targets)
        run.record["targets_failed"] = sum(t["pass"] is False for t in targets)
        run.record["targets_not_measured"] = sum(t["pass"] is None for t in targets)
        print("\ntargets:\n" + format_targets(targets), flush=True)
    except Exception as e:  # noqa: BLE001 - the measurements are in the record already
        run.record["targets_error"] = _error_text(e)
        run.log(f"targets: error {_error_text(e)}")
    run.write()
    run.log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
