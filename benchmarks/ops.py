"""CPU benchmarks of torch_moe's routing ops and of ``moe_ffn`` against common baselines.

Sections (``--sections``, all by default):

* ``sort``  -- ``torch_moe.token_sort`` against ``argsort`` + ``bincount``, and
  ``torch_moe.permute`` against ``index_select``, with ``copy_`` of the same bytes as the
  bandwidth ceiling.
* ``ffn``   -- ``moe_ffn`` forward (under ``no_grad``) and forward + backward against a
  HuggingFace-Mixtral-style loop over experts, ``torch._grouped_mm`` used the way
  torchtitan 0.3.0 uses it, torchtitan's own modules when ``import torchtitan`` works, and
  the obvious composition (argsort, ``index_select``, two ``torch._grouped_mm``, ``scatter_add``:
  what a user writes first). The ceiling is a dense GEMM of
  the same FLOPs at the best dense GEMM rate available for the dtype, measured in the run.
* ``saved`` -- bytes each implementation saves for backward, from
  ``torch.autograd.graph.saved_tensors_hooks``.
* ``frozen`` -- a ``moe_ffn`` training step (forward + backward) with trainable experts against
  frozen ones (expert weights without ``requires_grad``, as when fine-tuning other layers):
  time, and peak bytes allocated during the step from the profiler's memory events. The
  backward skips the weight-gradient GEMMs and their gradient buffers of frozen experts.

Every comparison runs its implementations in one process, interleaved round-robin, and
reports medians and ratios. An implementation whose GEMMs run in bf16 and whose estimated
time per iteration exceeds ``--max-iter-seconds`` (native bf16 GEMMs on a CPU without bf16
GEMM instructions take minutes) is reported as skipped with the estimate, never dropped
silently; fp32 implementations always run.

Shape legend: T tokens, k experts per token, S = T * k routed slots, E experts,
D model dim, F expert hidden dim.

    python benchmarks/ops.py                 # full run, about 10 minutes on 2 idle cores
    python benchmarks/ops.py --quick         # shape (c), fp32, one rep, under a minute
    python benchmarks/ops.py --check         # correctness of all implementations, then exit
    python benchmarks/ops.py --quick --sections frozen   # frozen vs trainable experts
    python benchmarks/ops.py --sections ffn --dtypes fp32 --forms auto,batched
                                             # torch_moe in each expert GEMM form side by side
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    Entry,
    SavedBytes,
    environment_header,
    format_table,
    interleaved,
    time_once,
    write_csv,
)

# --------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEShape:
    name: str
    T: int
    D: int
    F: int
    E: int
    k: int

    @property
    def S(self) -> int:
        return self.T * self.k

    @property
    def gemm_flops(self) -> float:
        """FLOPs of one of the three expert GEMMs over all routed slots: [S, D] @ [D, F]."""
        return 2.0 * self.S * self.D * self.F

    def __str__(self) -> str:
        return f"({self.name}) T={self.T} D={self.D} F={self.F} E={self.E} k={self.k}"


SHAPES = {
    "a": MoEShape("a", T=4096, D=1024, F=1024, E=8, k=2),  # few large experts
    "b": MoEShape("b", T=4096, D=1024, F=256, E=64, k=8),  # fine-grained experts
    "c": MoEShape("c", T=256, D=1024, F=256, E=64, k=8),  # decode-like: ~32 rows per expert
}
CHECK_SHAPE = MoEShape("check", T=64, D=64, F=32, E=8, k=2)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# The three GEMMs of forward; backward adds two per GEMM (input and weight gradients).
GEMMS_PER_MODE = {"fwd": 3, "fwd+bwd": 9}


@dataclass
class Problem:
    shape: MoEShape
    dtype: torch.dtype
    x_TD: Tensor
    topk_ids_TK: Tensor
    topk_weights_TK: Tensor
    w1_EDF: Tensor  # gate
    w2_EFD: Tensor  # down
    w3_EDF: Tensor  # up
    grad_out_TD: Tensor

    @property
    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.w1_EDF, self.w2_EFD, self.w3_EDF


def make_routing(T: int, E: int, k: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Seeded top-k routing: ids [T, k] int64, fp32 weights = softmax over the top-k logits."""
    g = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=g)
    values_TK, ids_TK = logits_TE.topk(k, dim=-1)
    return ids_TK, values_TK.softmax(dim=-1)


def make_problem(shape: MoEShape, dtype: torch.dtype, seed: int = 0) -> Problem:
    """Inputs generated in fp32 and rounded, so every dtype sees the same problem.

    x, w1, w2 and w3 are leaves that require grad; forward-only timing runs under no_grad.
    """
    g = torch.Generator().manual_seed(seed + 1)
    T, D, F_, E = shape.T, shape.D, shape.F, shape.E

    def leaf(*size: int, fan_in: int = 1) -> Tensor:
        t = torch.randn(*size, generator=g) / math.sqrt(fan_in)
        return t.to(dtype).requires_grad_()

    ids_TK, weights_TK = make_routing(T, E, shape.k, seed)
    return Problem(
        shape=shape,
        dtype=dtype,
        x_TD=leaf(T, D),
        topk_ids_TK=ids_TK,
        topk_weights_TK=weights_TK.to(dtype),
        w1_EDF=leaf(E, D, F_, fan_in=D),
        w2_EFD=leaf(E, F_, D, fan_in=F_),
        w3_EDF=leaf(E, D, F_, fan_in=D),
        grad_out_TD=torch.randn(T, D, generator=g).to(dtype),
    )


# --------------------------------------------------------------------------
# torch_moe
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class MoEApi:
    """The parts of torch_moe under test."""

    name: str
    token_sort: Callable  # (topk_ids_TK, E) -> (sorted_ids_S, offs_E, tokens_per_expert_E)
    permute: Callable  # (x_TD, sorted_ids_S, k) -> x_SD
    moe_ffn: Callable  # torch_moe.nn.functional.moe_ffn


def load_torch_moe() -> tuple[MoEApi | None, str]:
    try:
        import torch_moe
        import torch_moe.nn.functional as moe_F

        api = MoEApi(
            "torch_moe",
            torch.ops.torch_moe.token_sort,
            torch.ops.torch_moe.permute,
            moe_F.moe_ffn,
        )
        where = Path(torch_moe.__file__).parent
        return api, f"torch_moe: {getattr(torch_moe, '__version__', '?')} from {where}"
    except Exception as e:  # noqa: BLE001 - report whatever stops the import
        return None, f"torch_moe: NOT importable ({type(e).__name__}: {e})"


# --------------------------------------------------------------------------
# Baselines. All take weights in GEMM form unless noted: w1/w3 [E, D, F], w2 [E, F, D].
# --------------------------------------------------------------------------


def hf_loop_forward(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
    w1_DF: Sequence[Tensor], w2_FD: Sequence[Tensor], w3_DF: Sequence[Tensor],
) -> Tensor:
    """Loop over experts, as HuggingFace's Mixtral sparse MoE block does.

    Takes one weight tensor per expert, as Mixtral's ModuleList of expert MLPs holds them.
    Indexing a stacked [E, D, F] leaf instead (``w1[e]``) would make every select's
    backward allocate and zero-fill a full [E, D, F] gradient: 3 * E of them per step.
    """
    y_TD = torch.zeros_like(x_TD)
    for e in range(len(w1_DF)):
        token_idx, slot = torch.where(topk_ids_TK == e)
        if token_idx.numel() == 0:
            continue
        current_ND = x_TD[token_idx]
        h_NF = F.silu(current_ND @ w1_DF[e]) * (current_ND @ w3_DF[e])
        out_ND = (h_NF @ w2_FD[e]) * topk_weights_TK[token_idx, slot, None]
        y_TD.index_add_(0, token_idx, out_ND.to(x_TD.dtype))
    return y_TD


@contextlib.contextmanager
def _deterministic():
    """torchtitan's deterministic_scatter_add runs scatter_add under this mode."""
    prev, prev_warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def titan_style_forward(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
    w1_EFD: Tensor, w2_EDF: Tensor, w3_EFD: Tensor,
) -> Tensor:
    """``torch._grouped_mm`` used as torchtitan 0.3.0 uses it (MoE.forward's token counts,
    LocalTokenDispatcher.dispatch/combine, GroupedExperts.forward), in plain functions.

    Weights are in torchtitan's nn.Linear (out, in) layout: w1/w3 [E, F, D], w2 [E, D, F].
    One deliberate difference: GroupedExperts casts to bf16 unconditionally; this runs the
    GEMMs in the data dtype, so the fp32 rows measure fp32 GEMMs.
    """
    T, K = topk_ids_TK.shape
    E, D = w1_EFD.size(0), x_TD.size(1)
    # MoE.forward: tokens per expert from a one-hot routing map.
    routing_map_TE = torch.zeros(T, E, dtype=torch.bool, device=topk_ids_TK.device).scatter_(
        -1, topk_ids_TK, True)
    tokens_per_expert_E = routing_map_TE.sum(dim=0)
    # LocalTokenDispatcher._local_reorder
    sorted_N = torch.argsort(topk_ids_TK.view(-1), stable=True)
    scores_N = topk_weights_TK.view(-1)[sorted_N]
    token_indices_N = sorted_N // K
    routed_ND = x_TD[token_indices_N]
    # GroupedExperts.forward
    offsets_E = torch.cumsum(tokens_per_expert_E, dim=0, dtype=torch.int32)
    h_NF = F.silu(torch._grouped_mm(routed_ND, w1_EFD.transpose(-2, -1), offs=offsets_E))
    h_NF = h_NF * torch._grouped_mm(routed_ND, w3_EFD.transpose(-2, -1), offs=offsets_E)
    out_ND = torch._grouped_mm(h_NF, w2_EDF.transpose(-2, -1), offs=offsets_E)
    # LocalTokenDispatcher.combine
    out_ND = (out_ND.to(torch.float32) * scores_N.reshape(-1, 1)).to(out_ND.dtype)
    index_ND = token_indices_N.reshape(-1, 1).expand(-1, D)
    with _deterministic():
        return torch.zeros_like(x_TD).scatter_add(0, index_ND, out_ND)


def obvious_forward(
    x_TD: Tensor, topk_ids_TK: Tensor, topk_weights_TK: Tensor,
    w1_EDF: Tensor, w2_EFD: Tensor, w3_EDF: Tensor,
) -> Tensor:
    """The composition a user writes first (stable argsort + bincount, ``index_select`` of the
    tokens, two grouped GEMMs, ``scatter_add`` of the weighted rows): the bar torch_moe must beat."""
    k, E = topk_ids_TK.size(1), w1_EDF.size(0)
    ids_S = topk_ids_TK.flatten()
    order_S = torch.argsort(ids_S, stable=True)
    offs_E = torch.bincount(ids_S, minlength=E).cumsum(0, dtype=torch.int32)
    token_S = order_S // k
    x_SD = x_TD.index_select(0, token_S)
    h_SF = F.silu(torch._grouped_mm(x_SD, w1_EDF, offs=offs_E)) * torch._grouped_mm(
        x_SD, w3_EDF, offs=offs_E
    )
    out_SD = torch._grouped_mm(h_SF, w2_EFD, offs=offs_E)
    out_SD = out_SD * topk_weights_TK.flatten().index_select(0, order_S).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add_(0, token_S, out_SD)


# --------------------------------------------------------------------------
# Implementations behind one interface
# --------------------------------------------------------------------------


@dataclass
class Prepared:
    """An implementation bound to one problem's weights."""

    params: list[Tensor]  # leaves, in the implementation's own layout
    forward: Callable[[Tensor, Tensor, Tensor], Tensor]  # (x_TD, ids_TK, weights_TK) -> y_TD
    canonical_grads: Callable[[], tuple[Tensor, Tensor, Tensor]]  # (dw1_EDF, dw2_EFD, dw3_EDF)
    # torch_moe's expert GEMM form for its calls, forward and backward (None: the default)
    form: str | None = None

    def context(self):
        if self.form is None:
            return contextlib.nullcontext()
        import torch_moe.cpu

        return torch_moe.cpu.expert_form(self.form)


@dataclass(frozen=True)
class MoEImpl:
    name: str
    prepare: Callable[[Problem], Prepared]
    # dtype its GEMMs run in when that is not the data dtype (torchtitan casts to bf16)
    gemm_dtype: torch.dtype | None = None


def _plain(forward: Callable) -> Callable[[Problem], Prepared]:
    """An implementation that takes the problem's weights as they are."""

    def prepare(p: Problem) -> Prepared:
        w1, w2, w3 = p.weights
        return Prepared(
            [w1, w2, w3],
            lambda x, ids, tw: forward(x, ids, tw, w1, w2, w3),
            lambda: (w1.grad, w2.grad, w3.grad),
        )

    return prepare


def prepare_hf_loop(p: Problem) -> Prepared:
    per_expert = [
        [w.detach().clone().requires_grad_() for w in stacked.unbind(0)] for stacked in p.weights
    ]
    w1_DF, w2_FD, w3_DF = per_expert

    def canonical_grads() -> tuple[Tensor, ...]:
        # Experts that received no token have no gradient.
        return tuple(
            torch.stack([w.grad if w.grad is not None else torch.zeros_like(w) for w in ws])
            for ws in per_expert
        )

    return Prepared(
        w1_DF + w2_FD + w3_DF,
        lambda x, ids, tw: hf_loop_forward(x, ids, tw, w1_DF, w2_FD, w3_DF),
        canonical_grads,
    )


def _titan_layout(p: Problem) -> tuple[Tensor, Tensor, Tensor]:
    """Copies of the weights in torchtitan's (out, in) layout: w1/w3 [E, F, D], w2 [E, D, F]."""
    return tuple(
        w.detach().transpose(-2, -1).contiguous().requires_grad_() for w in p.weights
    )


def prepare_titan_style(p: Problem) -> Prepared:
    w1_EFD, w2_EDF, w3_EFD = _titan_layout(p)
    return Prepared(
        [w1_EFD, w2_EDF, w3_EFD],
        lambda x, ids, tw: titan_style_forward(x, ids, tw, w1_EFD, w2_EDF, w3_EFD),
        lambda: tuple(w.grad.transpose(-2, -1) for w in (w1_EFD, w2_EDF, w3_EFD)),
    )


def prepare_torchtitan(p: Problem) -> Prepared:
    """torchtitan's own LocalTokenDispatcher + GroupedExperts (what RoutedExperts runs)."""
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    s = p.shape
    experts = GroupedExperts.Config(dim=s.D, hidden_dim=s.F, num_experts=s.E).build()
    dispatcher = LocalTokenDispatcher.Config(num_experts=s.E, top_k=s.k).build()
    w1_EFD, w2_EDF, w3_EFD = _titan_layout(p)
    experts.w1_EFD = torch.nn.Parameter(w1_EFD)
    experts.w2_EDF = torch.nn.Parameter(w2_EDF)
    experts.w3_EFD = torch.nn.Parameter(w3_EFD)

    def forward(x_TD: Tensor, ids_TK: Tensor, weights_TK: Tensor) -> Tensor:
        # MoE.forward's token counts, then RoutedExperts.forward.
        routing_map_TE = torch.zeros(x_TD.size(0), s.E, dtype=torch.bool).scatter_(-1, ids_TK, True)
        routed_RD, tokens_per_expert_E, metadata = dispatcher.dispatch(
            x_TD, weights_TK, ids_TK, routing_map_TE.sum(dim=0)
        )
        return dispatcher.combine(experts(routed_RD, tokens_per_expert_E), metadata, x_TD)

    params = [experts.w1_EFD, experts.w2_EDF, experts.w3_EFD]
    return Prepared(params, forward, lambda: tuple(w.grad.transpose(-2, -1) for w in params))


def _torch_moe_impls(api: MoEApi, forms=()) -> list[MoEImpl]:
    def separate(p: Problem, form: str | None = None) -> Prepared:
        w1, w2, w3 = p.weights
        return Prepared(
            [w1, w2, w3],
            lambda x, ids, tw: api.moe_ffn(x, ids, tw, w1, w2, w3, activation="swiglu"),
            lambda: (w1.grad, w2.grad, w3.grad),
            form,
        )

    def fused(p: Problem) -> Prepared:
        w1, w2, w3 = p.weights
        F_ = w1.size(-1)
        w13_ED2F = torch.cat([w1.detach(), w3.detach()], dim=-1).requires_grad_()
        return Prepared(
            [w13_ED2F, w2],
            lambda x, ids, tw: api.moe_ffn(x, ids, tw, w13_ED2F, w2, None, activation="swiglu"),
            lambda: (w13_ED2F.grad[..., :F_], w2.grad, w13_ED2F.grad[..., F_:]),
        )

    # torch_moe runs bf16 GEMMs in fp32 on a CPU without native bf16 GEMM: never skip it there
    gemm_dtype = None
    if api.name == "torch_moe":
        from torch_moe._native._cpu_features import gemm_compute_dtype

        if gemm_compute_dtype(torch.bfloat16) == torch.float32:
            gemm_dtype = torch.float32
    return ([MoEImpl(f"{api.name}", separate, gemm_dtype),
             MoEImpl(f"{api.name} (w13)", fused, gemm_dtype)]
            + [MoEImpl(f"{api.name} [{form}]", functools.partial(separate, form=form), gemm_dtype)
               for form in forms])


def torchtitan_status() -> tuple[bool, str]:
    try:
        import torchtitan  # noqa: F401
        from torchtitan.models.common.moe import GroupedExperts  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return False, f"torchtitan: not installed ({type(e).__name__}: {e}); its own modules not timed"
    version = getattr(sys.modules["torchtitan"], "__version__", "?")
    return True, f"torchtitan: {version} importable; its GroupedExperts + LocalTokenDispatcher timed"


HF_LOOP = "HF per-expert loop"
OBVIOUS = "obvious composition"
TITAN_STYLE = "torchtitan-style"


def all_impls(api: MoEApi | None, with_torchtitan: bool, forms=()) -> list[MoEImpl]:
    impls = _torch_moe_impls(api, forms) if api is not None else []
    impls += [
        MoEImpl(HF_LOOP, prepare_hf_loop),
        MoEImpl(TITAN_STYLE, prepare_titan_style),
    ]
    if with_torchtitan:
        impls.append(MoEImpl("torchtitan 0.3.0 modules", prepare_torchtitan, torch.bfloat16))
    impls.append(MoEImpl(OBVIOUS, _plain(obvious_forward)))
    return impls


# --------------------------------------------------------------------------
# Running one implementation
# --------------------------------------------------------------------------


def forward_fn(p: Problem, prep: Prepared) -> Callable[[], Tensor]:
    def run() -> Tensor:
        with torch.no_grad(), prep.context():
            return prep.forward(p.x_TD, p.topk_ids_TK, p.topk_weights_TK)

    return run


def train_step_fns(p: Problem, prep: Prepared) -> tuple[Callable[[], None], Callable[[], None]]:
    """(step, reset): forward + backward with a dense random grad_out, and an untimed
    reset that sets gradients to None, as ``zero_grad(set_to_none=True)`` would."""
    leaves = [p.x_TD, *prep.params]

    def step() -> None:
        with prep.context():  # the backward too: it chooses its GEMM form when it runs
            y_TD = prep.forward(p.x_TD, p.topk_ids_TK, p.topk_weights_TK)
            # A dense grad, not y.sum(): sum's stride-0 grad is unrepresentative, and
            # _grouped_mm's backward rejects it.
            y_TD.backward(p.grad_out_TD)

    def reset() -> None:
        for t in leaves:
            t.grad = None

    return step, reset


def _run_slice(p: Problem, prep: Prepared, mode: str, n: int) -> None:
    """One forward (no_grad) or training step on the first ``n`` tokens."""
    x_nD, ids_nK, tw_nK = p.x_TD[:n], p.topk_ids_TK[:n], p.topk_weights_TK[:n]
    if mode == "fwd":
        with torch.no_grad():
            prep.forward(x_nD, ids_nK, tw_nK)
        return
    x_nD = x_nD.detach().requires_grad_()
    prep.forward(x_nD, ids_nK, tw_nK).backward(p.grad_out_TD[:n])
    for t in prep.params:
        t.grad = None


def estimate_seconds(p: Problem, prep: Prepared, mode: str, target_s: float = 0.25) -> float:
    """Seconds per full iteration of ``mode``, extrapolated from runs on growing token slices.

    Starts at T/128 tokens (at least 32), so a native-bf16-GEMM path costs about a second
    to probe, and doubles the slice until one call takes ``target_s`` or the slice is the
    whole problem. An untimed call on a few tokens first absorbs one-time costs, and cheap
    calls are timed twice (min). The extrapolation fits time = fixed + per-token cost
    through the last two slices, bounded below by the last measurement and above by
    proportional scaling.
    """
    T = p.shape.T
    _run_slice(p, prep, mode, min(T, 8))
    n, points = min(T, max(32, T // 128)), []
    while True:
        call = functools.partial(_run_slice, p, prep, mode, n)
        elapsed = time_once(call)
        if elapsed < target_s:
            elapsed = min(elapsed, time_once(call))
        points.append((n, elapsed))
        if elapsed >= target_s or n >= T:
            break
        n = min(T, 2 * n)
    n1, t1 = points[-1]
    proportional = t1 * T / n1
    if len(points) < 2:
        return proportional
    n0, t0 = points[-2]
    linear = t1 + (t1 - t0) / (n1 - n0) * (T - n1)
    return min(max(linear, t1), proportional)


# --------------------------------------------------------------------------
# Dense GEMM ceiling
# --------------------------------------------------------------------------


# Layouts of the GEMM's B operand: "b" is [K, N] row-major (GEMM form, w[e] here), "b_t"
# is stored [N, K] and passed transposed (nn.Linear form, torchtitan's weights). On a CPU
# without native bf16 GEMM they take very different kernels, so both are probed.
GEMM_LAYOUTS = {"b": "B row-major", "b_t": "B transposed"}


def _gemm_operands(M: int, K: int, N: int, dtype: torch.dtype, layout: str):
    g = torch.Generator().manual_seed(7)
    a_MK = torch.randn(M, K, generator=g).to(dtype)
    if layout == "b":
        b_KN = (torch.randn(K, N, generator=g) / math.sqrt(K)).to(dtype)
    else:
        b_KN = (torch.randn(N, K, generator=g) / math.sqrt(K)).to(dtype).t()
    return a_MK, b_KN, torch.empty(M, N, dtype=dtype)


def native_gemm_rates(dtype: torch.dtype, M: int = 512, K: int = 1024, N: int = 256) -> dict[str, float]:
    """GFLOP/s of torch.mm in ``dtype`` per B layout (a small probe, best of two)."""
    rates = {}
    for layout in GEMM_LAYOUTS:
        mm = functools.partial(torch.mm, *_gemm_operands(M, K, N, dtype, layout)[:2])
        mm()
        rates[layout] = 2.0 * M * K * N / min(time_once(mm), time_once(mm)) / 1e9
    return rates


def describe_rates(rates: dict[str, float]) -> str:
    return ", ".join(f"{v:.1f} GFLOP/s {GEMM_LAYOUTS[k]}" for k, v in rates.items())


def gemm_entry(name: str, shape: MoEShape, dtype: torch.dtype, layout: str) -> Entry:
    """One dense GEMM [S, D] @ [D, F] into a buffer that already exists."""
    a, b, out = _gemm_operands(shape.S, shape.D, shape.F, dtype, layout)
    return Entry(name, lambda: torch.mm(a, b, out=out))


# --------------------------------------------------------------------------
# Section: token sort and permute
# --------------------------------------------------------------------------


def _op_rows(op: str, shape: MoEShape, dtype_name: str, entries: list[Entry], nbytes: int,
             baseline: Entry, ceiling: Entry | None = None) -> list[dict]:
    return [
        dict(section="sort", shape=shape.name, dtype=dtype_name, op=op, impl=e.name,
             n=len(e.times), median_us=f"{e.median * 1e6:.1f}",
             GBps=f"{nbytes / e.median / 1e9:.2f}",
             frac_copy=f"{ceiling.median / e.median:.2f}" if ceiling is not None else "",
             speedup=f"{baseline.median / e.median:.2f}x")
        for e in entries
    ]


def bench_token_sort(shape: MoEShape, api: MoEApi | None, args) -> list[dict]:
    """torch_moe.token_sort against a stable argsort + bincount of the flat expert ids."""
    ids_TK, _ = make_routing(shape.T, shape.E, shape.k)
    ids_S, E = ids_TK.flatten(), shape.E
    baseline = Entry("argsort+bincount", lambda: (
        torch.argsort(ids_S, stable=True), torch.bincount(ids_S, minlength=E)))
    entries = [baseline]
    if api is not None:
        entries.insert(0, Entry(f"{api.name}.token_sort", lambda: api.token_sort(ids_TK, E)))
    interleaved(entries, args.op_reps, max(1, args.warmup))
    # Bytes: int64 ids in + sorted ids out, a lower bound on the traffic.
    nbytes = 2 * ids_S.numel() * 8
    rows = _op_rows("token_sort", shape, "int64", entries, nbytes, baseline)
    if api is None:
        rows.append(dict(section="sort", shape=shape.name, op="token_sort", impl="torch_moe",
                         note="not importable"))
    return rows


def bench_permute(shape: MoEShape, dtype: torch.dtype, api: MoEApi | None, args) -> list[dict]:
    """torch_moe.permute against index_select, with copy_ of the same rows as the ceiling."""
    ids_TK, _ = make_routing(shape.T, shape.E, shape.k)
    k, S, D = shape.k, shape.S, shape.D
    sorted_S = torch.argsort(ids_TK.flatten(), stable=True)  # == token_sort's, align=1
    x_TD = torch.randn(shape.T, D).to(dtype)
    src_SD, dst_SD = torch.randn(S, D).to(dtype), torch.empty(S, D, dtype=dtype)
    baseline = Entry("x.index_select(0, sorted_ids // k)", lambda: x_TD.index_select(0, sorted_S // k))
    ceiling = Entry("copy_ (ceiling)", lambda: dst_SD.copy_(src_SD))
    entries = [baseline, ceiling]
    if api is not None:
        entries.insert(0, Entry(f"{api.name}.permute", lambda: api.permute(x_TD, sorted_S, k)))
        if hasattr(torch.ops.torch_moe, "permute"):
            # the out= form writes into an existing buffer, like the copy_ ceiling: above glibc's
            # 32 MiB mmap threshold a fresh output page-faults on first touch
            out_SD = torch.empty(S, D, dtype=dtype)
            entries.insert(1, Entry(f"{api.name}.permute(out=)",
                                    lambda: torch.ops.torch_moe.permute.out(x_TD, sorted_S, k, out=out_SD)))
    interleaved(entries, args.op_reps, max(1, args.warmup))
    # Bytes moved by a row gather: read + write of the [S, D] rows (indices ignored).
    nbytes = 2 * S * D * x_TD.element_size()
    return _op_rows("permute", shape, DTYPE_NAMES[dtype], entries, nbytes, baseline, ceiling)


# --------------------------------------------------------------------------
# Section: moe_ffn timing
# --------------------------------------------------------------------------


@dataclass
class Plan:
    """What to do with one implementation in one (shape, dtype) cell."""

    impl: MoEImpl
    prep: Prepared | None
    est_s: dict[str, float]  # estimated seconds per iteration, per mode
    error: str = ""


def plan_cell(p: Problem, impls: list[MoEImpl], args) -> list[Plan]:
    """Prepare every implementation and estimate its cost per iteration.

    The training step is probed on its own only where it may lead to a skip: a forward
    that takes native bf16 GEMMs with B transposed (fast) can have a backward that takes
    them row-major (10x slower). Elsewhere backward is taken as twice the forward.
    """
    plans = []
    for impl in impls:
        try:
            prep = impl.prepare(p)
            fwd = estimate_seconds(p, prep, "fwd")
            if may_skip(impl, p.dtype) and 3 * fwd <= args.max_iter_seconds:
                train = estimate_seconds(p, prep, "fwd+bwd")
            else:
                train = 3 * fwd
            plans.append(Plan(impl, prep, {"fwd": fwd, "fwd+bwd": train}))
        except Exception as e:  # noqa: BLE001 - one broken implementation must not stop the rest
            nan = float("nan")
            plans.append(Plan(impl, None, {"fwd": nan, "fwd+bwd": nan}, f"error: {type(e).__name__}: {e}"))
    return plans


def may_skip(impl: MoEImpl, dtype: torch.dtype) -> bool:
    """Only implementations whose GEMMs run in a low-precision dtype may be skipped: on a
    CPU without native bf16 GEMM those take minutes. Everything computing in fp32 runs,
    whatever the estimate says (a busy machine inflates estimates too)."""
    return (impl.gemm_dtype or dtype) != torch.float32


def _samples(est_s: float, reps: int, warmup: int, cell_budget_s: float) -> tuple[int, int]:
    """(reps, warmup) for one implementation: slow ones take fewer samples, so the whole
    run fits its budget; warm-up is dropped where one call costs seconds anyway."""
    n = max(1, min(reps, int(cell_budget_s // max(est_s, 1e-9))))
    w = warmup if est_s * (n + warmup) <= cell_budget_s else 0
    return n, w


def bench_ffn_cell(p: Problem, plans: list[Plan], native_rates: dict, args) -> list[dict]:
    """Time every implementation of one (shape, dtype), forward and forward + backward."""
    shape, dtype = p.shape, p.dtype
    dname = DTYPE_NAMES[dtype]
    flops = shape.gemm_flops
    rows = []
    for mode, gemms in GEMMS_PER_MODE.items():
        entries, skipped = [], {}
        for plan in plans:
            if plan.prep is None:
                skipped[plan.impl.name] = plan.error
                continue
            est = plan.est_s[mode]
            if est > args.max_iter_seconds and may_skip(plan.impl, dtype):
                gdt = plan.impl.gemm_dtype or dtype
                skipped[plan.impl.name] = (
                    f"skipped: est. {est:.0f} s/iter (native {DTYPE_NAMES[gdt]} mm on this CPU: "
                    f"{describe_rates(native_rates[gdt])})"
                )
                continue
            n, w = _samples(est, args.reps, args.warmup, args.cell_seconds)
            if mode == "fwd":
                entries.append(Entry(plan.impl.name, forward_fn(p, plan.prep), reps=n, warmup=w))
            else:
                step, reset = train_step_fns(p, plan.prep)
                entries.append(Entry(plan.impl.name, step, reset, reps=n, warmup=w))

        # The ceiling GEMMs are timed in the same rounds: fp32, and native mm in the dtype
        # (its faster B layout) where affordable; otherwise the start-up probe's rate.
        gemm_entries = {"fp32": gemm_entry("dense mm fp32", shape, torch.float32, "b")}
        rates = {}
        if dtype != torch.float32:
            layout = max(native_rates[dtype], key=native_rates[dtype].get)
            rates[dname] = native_rates[dtype][layout]
            if flops / (rates[dname] * 1e9) <= args.max_iter_seconds / 4:
                gemm_entries[dname] = gemm_entry(f"dense mm {dname}", shape, dtype, layout)
        interleaved(entries + list(gemm_entries.values()), args.reps, args.warmup)
        rates.update({k: flops / e.median / 1e9 for k, e in gemm_entries.items()})

        best = max(rates, key=rates.get)
        ceiling_s = gemms * flops / (rates[best] * 1e9)
        ceiling_note = ", ".join(
            f"{k} mm {v:.1f} GFLOP/s" + ("" if k in gemm_entries else " (probe)") for k, v in rates.items()
        ) + f"; ceiling uses {best}"

        timed = {e.name: e for e in entries}
        obvious_t = timed[OBVIOUS].median if OBVIOUS in timed else float("nan")
        for plan in plans:
            name = plan.impl.name
            row = dict(section="ffn", shape=shape.name, dtype=dname, mode=mode, impl=name)
            if name in timed:
                t = timed[name].median
                row.update(
                    n=len(timed[name].times),
                    median_ms=f"{t * 1e3:.1f}",
                    frac_ceiling=f"{ceiling_s / t:.2f}",
                    vs_obvious=f"{obvious_t / t:.2f}x" if obvious_t == obvious_t else "n/a",
                )
            else:
                row.update(n=0, note=skipped[name])
            rows.append(row)
        rows.append(dict(section="ffn", shape=shape.name, dtype=dname, mode=mode,
                         impl="ceiling (dense GEMM)", n=len(gemm_entries["fp32"].times),
                         median_ms=f"{ceiling_s * 1e3:.1f}", frac_ceiling="1.00",
                         vs_obvious=f"{obvious_t / ceiling_s:.2f}x" if obvious_t == obvious_t else "n/a",
                         note=f"{gemms} x {flops / 1e9:.1f} GFLOP; {ceiling_note}"))
    return rows


# --------------------------------------------------------------------------
# Section: bytes saved for backward
# --------------------------------------------------------------------------


def saved_bytes(p: Problem, prep: Prepared, float_scale: float = 1.0) -> tuple[float, float]:
    """(total, activations only) bytes that one forward saves for backward."""
    inputs = [p.x_TD, p.topk_ids_TK, p.topk_weights_TK, *prep.params]
    with SavedBytes(inputs) as counter:
        y_TD = prep.forward(p.x_TD, p.topk_ids_TK, p.topk_weights_TK)
        result = counter.totals(float_scale)
    del y_TD
    return result


class Fp32SavedBytes:
    """Saved bytes of one shape measured in fp32, standing in for a dtype whose forward is
    too slow to run here (native bf16 GEMMs). Computed on first use, then cached."""

    def __init__(self, shape: MoEShape):
        self.shape = shape
        self.problem: Problem | None = None
        self.cache: dict[str, tuple[float, float]] = {}

    def get(self, impl: MoEImpl) -> tuple[float, float]:
        """(total, activations) in fp32 bytes."""
        if impl.name not in self.cache:
            if self.problem is None:
                self.problem = make_problem(self.shape, torch.float32)
            self.cache[impl.name] = saved_bytes(self.problem, impl.prepare(self.problem))
        return self.cache[impl.name]


def bench_saved_cell(p: Problem, plans: list[Plan], fp32: Fp32SavedBytes, args) -> list[dict]:
    """Saved bytes in the real dtype where a forward is affordable (estimated at most a
    quarter of --max-iter-seconds), else measured in fp32 and converted to the dtype's
    element size (labelled as such)."""
    dname = DTYPE_NAMES[p.dtype]
    results: dict[str, tuple[float, float]] = {}
    rows = []
    for plan in plans:
        row = dict(section="saved", shape=p.shape.name, dtype=dname, impl=plan.impl.name)
        rows.append(row)
        try:
            if plan.prep is not None and (
                plan.est_s["fwd"] <= args.max_iter_seconds / 4 or not may_skip(plan.impl, p.dtype)
            ):
                total, acts = saved_bytes(p, plan.prep)
                row["how"] = f"measured in {dname}"
                if p.dtype == torch.float32:
                    fp32.problem, fp32.cache[plan.impl.name] = p, (total, acts)
            elif p.dtype == torch.float32 or plan.impl.gemm_dtype is not None:
                # An fp32 run stands in only for implementations that compute in the data
                # dtype; torchtitan's modules cast to bf16 themselves.
                row["how"] = f"skipped: forward est. {plan.est_s['fwd']:.0f} s in {dname}"
                continue
            else:
                measured = fp32.get(plan.impl)
                ratio = p.x_TD.element_size() / 4
                total, acts = (b * ratio for b in measured)
                row["how"] = (f"ESTIMATE: measured in fp32, float storages x{ratio:g} "
                              f"(forward too slow in {dname})")
        except Exception as e:  # noqa: BLE001
            row["how"] = f"error: {type(e).__name__}: {e}"
            continue
        results[plan.impl.name] = (total, acts)
        row.update(total_MiB=f"{total / 2**20:.1f}", activations_MiB=f"{acts / 2**20:.1f}")
    if TITAN_STYLE in results:
        ref_total, ref_acts = results[TITAN_STYLE]
        for row in rows:
            if row["impl"] in results:
                total, acts = results[row["impl"]]
                row["vs_titan_style"] = f"{total / ref_total:.2f} / {acts / ref_acts:.2f}"
    return rows


# --------------------------------------------------------------------------
# Section: frozen experts
# --------------------------------------------------------------------------


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated before: the running
    sum of the CPU profiler's allocation and free events, in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _frozen_step(p: Problem, api: MoEApi, trainable: bool) -> tuple[Callable, Callable]:
    """(step, reset) of a moe_ffn training step whose expert weights are trainable or frozen;
    x requires grad in both, so the backward always runs."""
    w1, w2, w3 = (w.detach().requires_grad_(trainable) for w in p.weights)
    x = p.x_TD.detach().requires_grad_()

    def step() -> None:
        y_TD = api.moe_ffn(x, p.topk_ids_TK, p.topk_weights_TK, w1, w2, w3, activation="swiglu")
        y_TD.backward(p.grad_out_TD)

    def reset() -> None:
        for t in (x, w1, w2, w3):
            t.grad = None

    return step, reset


def bench_frozen_cell(p: Problem, api: MoEApi | None, args) -> list[dict]:
    """Trainable against frozen experts, side by side: median time of interleaved steps and
    peak bytes of one step (gradients of the previous step released)."""
    dname = DTYPE_NAMES[p.dtype]
    base = dict(section="frozen", shape=p.shape.name, dtype=dname)
    if api is None:
        return [dict(base, impl="torch_moe", note="not importable")]
    steps = {name: _frozen_step(p, api, name == "trainable experts")
             for name in ("trainable experts", "frozen experts")}
    entries = [Entry(name, step, reset) for name, (step, reset) in steps.items()]
    interleaved(entries, args.reps, args.warmup)
    peaks = {}
    for name, (step, reset) in steps.items():
        reset()
        peaks[name] = peak_bytes(step)
        reset()
    ref = entries[0]
    return [
        dict(base, impl=e.name, n=len(e.times), median_ms=f"{e.median * 1e3:.1f}",
             vs_trainable=f"{e.median / ref.median:.2f}",
             peak_MiB=f"{peaks[e.name] / 2**20:.1f}",
             peak_vs_trainable=f"{peaks[e.name] / peaks[ref.name]:.2f}")
        for e in entries
    ]


# --------------------------------------------------------------------------
# Correctness check
# --------------------------------------------------------------------------


def run_check(api: MoEApi | None, with_torchtitan: bool) -> bool:
    """Compare every implementation's output and gradients with the per-expert loop."""
    shape = CHECK_SHAPE
    ok = True
    print(f"check on {shape}, expert {shape.E - 1} never routed (tests empty groups)")
    for dname, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        p = make_problem(shape, dtype)
        # Leave the last expert empty: the loop skips it and grouped GEMMs see an empty group.
        g = torch.Generator().manual_seed(3)
        logits = torch.randn(shape.T, shape.E, generator=g)
        logits[:, -1] = -float("inf")
        vals, p.topk_ids_TK = logits.topk(shape.k, dim=-1)
        p.topk_weights_TK = vals.softmax(-1).to(dtype)

        results = {}
        for impl in all_impls(api, with_torchtitan):
            prep = impl.prepare(p)
            step, reset = train_step_fns(p, prep)
            y = prep.forward(p.x_TD, p.topk_ids_TK, p.topk_weights_TK)
            y.backward(p.grad_out_TD)
            results[impl.name] = [y.detach().float(), p.x_TD.grad.float()] + [
                g.float() for g in prep.canonical_grads()
            ]
            reset()
        ref = results[HF_LOOP]
        for impl in all_impls(api, with_torchtitan):
            errs = [(r - q).abs().max().item() for r, q in zip(ref, results[impl.name])]
            # Tolerance relative to each reference tensor's largest magnitude.
            bf16_math = dtype == torch.bfloat16 or impl.gemm_dtype == torch.bfloat16
            rtol = 3e-2 if bf16_math else 1e-5
            verdict = "ok" if all(e <= rtol * r.abs().max().item() for e, r in zip(errs, ref)) else "MISMATCH"
            ok &= verdict == "ok"
            print(f"  {dname} {impl.name:26s} max|err| " + " ".join(
                f"{n} {e:.1e}" for n, e in zip(("y", "dx", "dw1", "dw2", "dw3"), errs))
                + f"  (tol {rtol:g} x max|ref|) {verdict}")

    if api is not None:
        ids_TK, _ = make_routing(shape.T, shape.E, shape.k)
        sorted_S, offs_E, counts_E = api.token_sort(ids_TK, shape.E)
        ids_S = ids_TK.flatten()
        same_sort = torch.equal(sorted_S, torch.argsort(ids_S, stable=True))
        same_counts = torch.equal(counts_E, torch.bincount(ids_S, minlength=shape.E)) and torch.equal(
            offs_E, counts_E.cumsum(0).to(torch.int32))
        x_TD = torch.randn(shape.T, shape.D)
        same_perm = torch.equal(
            api.permute(x_TD, sorted_S, shape.k), x_TD.index_select(0, sorted_S // shape.k))
        print(f"  token_sort == stable argsort: {same_sort}; offs/counts == bincount: {same_counts}; "
              f"permute == index_select: {same_perm}")
        ok &= same_sort and same_counts and same_perm
    print("check:", "PASSED" if ok else "FAILED")
    return ok


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


SORT_COLUMNS = ["shape", "dtype", "op", "impl", "n", "median_us", "GBps", "frac_copy", "speedup", "note"]
FFN_COLUMNS = ["shape", "dtype", "mode", "impl", "n", "median_ms", "frac_ceiling", "vs_obvious", "note"]
SAVED_COLUMNS = ["shape", "dtype", "impl", "total_MiB", "activations_MiB", "vs_titan_style", "how"]
FROZEN_COLUMNS = ["shape", "dtype", "impl", "n", "median_ms", "vs_trainable", "peak_MiB",
                  "peak_vs_trainable", "note"]


# --quick's settings; flags given explicitly on the command line take precedence.
QUICK = dict(shapes="c", dtypes="fp32", reps=1, warmup=1, op_reps=3, max_iter_seconds=2.0)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="a,b,c", help="comma-separated subset of a,b,c")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated subset of bf16,fp32")
    ap.add_argument("--sections", default="sort,ffn,saved,frozen",
                    help="comma-separated subset of sort,ffn,saved,frozen")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per implementation (moe_ffn)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    ap.add_argument("--op-reps", type=int, default=20, help="timed repetitions for token_sort/permute")
    ap.add_argument("--max-iter-seconds", type=float, default=20.0,
                    help="skip a bf16-GEMM implementation whose estimated seconds per iteration exceed this")
    ap.add_argument("--cell-seconds", type=float, default=20.0,
                    help="fewer samples for an implementation whose reps would take longer than this")
    ap.add_argument("--csv", default=str(Path(__file__).resolve().parent / "results" / "ops.csv"))
    ap.add_argument("--quick", action="store_true",
                    help="shape (c), fp32, one rep: under a minute (other flags still apply)")
    ap.add_argument("--forms", default="",
                    help="also time torch_moe with its expert GEMMs in each of these forms "
                         "(comma-separated subset of auto,batched; the default row is per_group)")
    ap.add_argument("--check", action="store_true",
                    help="compare all implementations with the per-expert loop on a small shape, then exit")
    args = ap.parse_args(argv)
    if args.quick:
        given = ap.parse_args(argv, namespace=argparse.Namespace(**{k: None for k in QUICK}))
        for key, value in QUICK.items():
            if getattr(given, key) is None:
                setattr(args, key, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    sections = set(args.sections.split(","))

    api, api_line = load_torch_moe()
    has_titan, titan_line = torchtitan_status()
    for line in environment_header() + [api_line, titan_line]:
        print(line)
    if args.check:
        return 0 if run_check(api, has_titan) else 1

    native_rates = {dt: native_gemm_rates(dt) for dt in {*dtypes, torch.bfloat16}}
    for dt, r in native_rates.items():
        print(f"dense torch.mm probe, {DTYPE_NAMES[dt]} [512, 1024] @ [1024, 256]: {describe_rates(r)}")
    print(f"reps {args.reps}, warmup {args.warmup}, max {args.max_iter_seconds:g} s/iter, "
          f"{args.cell_seconds:g} s per implementation and mode\n")

    rows: list[dict] = []
    start = time.perf_counter()
    if "sort" in sections:
        sort_rows = []
        for shape in shapes:
            sort_rows += bench_token_sort(shape, api, args)
            for dtype in dtypes:
                sort_rows += bench_permute(shape, dtype, api, args)
        print("== token_sort and permute (GB/s: read + write of the rows; frac_copy: of copy_ GB/s)")
        print(format_table(sort_rows, SORT_COLUMNS) + "\n")
        rows += sort_rows

    forms = [f for f in args.forms.split(",") if f]
    impls = all_impls(api, has_titan, forms)
    ffn_rows, saved_rows = [], []
    if "ffn" in sections:
        print("== moe_ffn: median time; frac_ceiling = ceiling time / time; vs_obvious = obvious "
              "composition's time / time; fwd runs under no_grad")
    for shape in shapes if sections & {"ffn", "saved"} else []:
        fp32 = Fp32SavedBytes(shape)
        for dtype in sorted(dtypes, key=lambda d: d != torch.float32):  # fp32 first, for fp32
            p = make_problem(shape, dtype)
            plans = plan_cell(p, impls, args)
            print(f"-- {shape} {DTYPE_NAMES[dtype]}: est. s/iter fwd | fwd+bwd: " + ", ".join(
                f"{pl.impl.name} {pl.est_s['fwd']:.2f} | {pl.est_s['fwd+bwd']:.2f}" for pl in plans),
                flush=True)
            if "ffn" in sections:
                cell = bench_ffn_cell(p, plans, native_rates, args)
                print(format_table(cell, FFN_COLUMNS), flush=True)
                ffn_rows += cell
            if "saved" in sections:
                saved_rows += bench_saved_cell(p, plans, fp32, args)
            print(f"   [{time.perf_counter() - start:.0f} s elapsed]", flush=True)
            del p, plans
        del fp32
    if saved_rows:
        print("\n== bytes saved for backward: distinct storages; activations = excluding the inputs' "
              "storages (x, topk_ids, topk_weights, weights); vs_titan_style = total / activations ratio")
        print(format_table(saved_rows, SAVED_COLUMNS))
    rows += ffn_rows + saved_rows

    if "frozen" in sections:
        frozen_rows = []
        for shape in shapes:
            for dtype in dtypes:
                frozen_rows += bench_frozen_cell(make_problem(shape, dtype), api, args)
        print("\n== moe_ffn training step, trainable vs frozen experts: median time; peak bytes "
              "allocated during one step; ratios to the trainable step")
        print(format_table(frozen_rows, FROZEN_COLUMNS))
        rows += frozen_rows

    write_csv(args.csv, rows)
    print(f"\nwrote {args.csv} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
