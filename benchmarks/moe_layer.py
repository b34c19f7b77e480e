"""CPU benchmark of the whole ``torch_moe.nn.MoE`` layer: router + experts + combine.

Side by side, in one process, interleaved round-robin, on the same weights and routing
configuration:

* ``torch_moe MoE``       -- :class:`torch_moe.nn.MoE`;
* ``HF-style loop``       -- a sparse MoE block written the way HuggingFace's Mixtral (and,
  for shape (d), DeepSeek-V3) modelling code writes it: router linear, fp32 scores, top-k,
  a Python loop over the experts hit with ``torch.where`` and ``index_add_``;
* ``torchtitan 0.3.0 MoE`` -- ``torchtitan.models.common.moe.MoE`` when ``import torchtitan``
  works (the optional ``bench`` extra), else a line says it is not installed;
* ``ceiling (dense GEMM)`` -- the layer's FLOPs (expert GEMMs, router, shared expert) at the
  best dense ``torch.mm`` rate of the run: native in the dtype or fp32, whichever is faster.

Reported per (shape, dtype, mode): median time, tokens/s, fraction of the ceiling, and the
time ratio to torch_moe; then the bytes each implementation saves for backward, the share of
torch_moe's step spent outside its fused expert kernel (from ``torch.profiler``), and a
correctness check of every implementation against torch_moe in fp32.

Shapes (T tokens, D model dim, F expert dim, E experts, k experts per token):

    (a) T=4096 D=1024 F=1024 E=8  k=2   Mixtral-like routing (softmax, top-k, renormalise)
    (b) T=4096 D=1024 F=256  E=64 k=8   fine-grained, Mixtral-like routing
    (c) T=256  D=1024 F=256  E=64 k=8   decode-like, Mixtral-like routing
    (d) T=1024 D=1024 F=256  E=64 k=6   DeepSeek-V3-like: sigmoid scores, 8 groups of which
                                        4 are kept, renormalised, scaled by 2.5, one shared
                                        expert, expert bias for aux-loss-free balancing

    python benchmarks/moe_layer.py              # all shapes, bf16 and fp32: 7 to 10 minutes
    python benchmarks/moe_layer.py --quick      # shape (d), 2 reps: under a minute
    python benchmarks/moe_layer.py --shapes a --dtypes fp32 --reps 5
    python benchmarks/moe_layer.py --dtypes fp32 --forms auto,batched --sweep
                                                # + torch_moe per expert GEMM form, + T sweep

How to read it:

* Each implementation's time per call is estimated first, per mode, from calls on token
  slices. On a CPU without bf16 GEMM instructions, native bf16 ``torch.mm`` runs at about
  1 GFLOP/s (B row-major) to 17 GFLOP/s (B transposed), against about 110 in fp32, and the
  backward's layouts are the slow ones. A baseline whose GEMMs run natively in bf16 and whose
  estimate exceeds ``--max-iter-seconds`` is listed as skipped, with the estimate; torch_moe
  and every fp32 computation always run.
* torchtitan's GroupedExperts casts to bf16 whatever the input dtype, so its fp32 rows time
  bf16 GEMMs. The correctness check runs it twice: with those casts turned into no-ops (its
  own routing, dispatch and combine code, fp32 GEMMs: comparable to 1e-5) and as shipped.
* Parameters are cast to the dtype, buffers (load counts, expert bias) stay fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import resource
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn, Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    Entry,
    SavedBytes,
    environment_header,
    format_table,
    interleaved,
    line_plot,
    time_once,
    write_csv,
)
from ops import MoEShape, describe_rates, gemm_entry, native_gemm_rates  # noqa: E402

import torch_moe.cpu  # noqa: E402
from torch_moe.nn import MoE, MoEConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIGURES = Path(__file__).resolve().parent / "figures"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MODES = ("fwd", "fwd+bwd")
TORCH_MOE = "torch_moe MoE"
HF_STYLE = "HF-style loop"
TORCHTITAN = "torchtitan 0.3.0 MoE"


# --------------------------------------------------------------------------
# Shapes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerShape:
    name: str
    T: int
    config: MoEConfig

    @property
    def routed_gemm_flops(self) -> float:
        """FLOPs of one of the three expert GEMMs over all T * k routed rows."""
        c = self.config
        return 2.0 * self.T * c.top_k * c.dim * c.hidden_dim

    def forward_flops(self) -> float:
        """Expert GEMMs + router GEMM + shared-expert GEMMs of one forward."""
        c = self.config
        shared_F = c.num_shared_experts * (c.shared_hidden_dim or c.hidden_dim)
        return (3 * self.routed_gemm_flops + 2.0 * self.T * c.dim * c.num_experts
                + 3 * 2.0 * self.T * c.dim * shared_F)

    def flops(self, mode: str) -> float:
        # Backward computes two GEMMs (input and weight gradients) per forward GEMM.
        return self.forward_flops() * (1 if mode == "fwd" else 3)

    def __str__(self) -> str:
        c = self.config
        extra = []
        if c.score_func != "softmax":
            extra.append(c.score_func)
        if c.num_expert_groups:
            extra.append(f"groups {c.topk_groups}/{c.num_expert_groups}")
        if c.route_scale != 1.0:
            extra.append(f"scale {c.route_scale:g}")
        if c.num_shared_experts:
            extra.append(f"{c.num_shared_experts} shared")
        if c.load_balance_bias:
            extra.append("expert bias")
        return (f"({self.name}) T={self.T} D={c.dim} F={c.hidden_dim} E={c.num_experts} "
                f"k={c.top_k}" + (f" [{', '.join(extra)}]" if extra else ""))


def _mixtral_like(D: int, F_: int, E: int, k: int) -> MoEConfig:
    # Mixtral: softmax over all experts, top-k, renormalise the k weights.
    return MoEConfig(dim=D, hidden_dim=F_, num_experts=E, top_k=k, score_func="softmax",
                     normalize_topk=True)


SHAPES = {
    "a": LayerShape("a", 4096, _mixtral_like(1024, 1024, 8, 2)),
    "b": LayerShape("b", 4096, _mixtral_like(1024, 256, 64, 8)),
    "c": LayerShape("c", 256, _mixtral_like(1024, 256, 64, 8)),
    "d": LayerShape("d", 1024, MoEConfig(
        dim=1024, hidden_dim=256, num_experts=64, top_k=6, score_func="sigmoid",
        num_expert_groups=8, topk_groups=4, normalize_topk=True, route_scale=2.5,
        num_shared_experts=1, load_balance_bias=True)),
}


def check_shape(shape: LayerShape) -> LayerShape:
    """The same routing configuration at a size where every implementation runs in fp32
    in a fraction of a second."""
    return LayerShape(f"{shape.name}, small", 128, replace(shape.config, dim=128, hidden_dim=64))


# --------------------------------------------------------------------------
# HuggingFace-style MoE block
# --------------------------------------------------------------------------


class _HFExpertMLP(nn.Module):
    """One SwiGLU expert as HuggingFace stores it: three nn.Linear, (out, in) weights."""

    def __init__(self, D: int, F_: int):
        super().__init__()
        self.gate_proj = nn.Linear(D, F_, bias=False)
        self.up_proj = nn.Linear(D, F_, bias=False)
        self.down_proj = nn.Linear(F_, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFStyleMoE(nn.Module):
    """A sparse MoE block in the style of HuggingFace's Mixtral and DeepSeek-V3 blocks.

    Routing is computed here from the config, independently of torch_moe, so the correctness
    check compares two implementations rather than one with itself. Experts are a ModuleList
    of per-expert MLPs, visited in a Python loop: ``torch.where`` on the one-hot routing mask
    finds each expert's (slot, token) pairs, and ``index_add_`` accumulates the weighted
    outputs.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        c = config
        if c.activation != "swiglu" or c.topk_before_score or c.capacity_factor is not None:
            raise ValueError("HFStyleMoE: only dropless swiglu with score-then-top-k routing")
        self.config = c
        self.gate = nn.Linear(c.dim, c.num_experts, bias=False)
        self.experts = nn.ModuleList(
            _HFExpertMLP(c.dim, c.hidden_dim) for _ in range(c.num_experts))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(c.num_experts) if c.load_balance_bias else None)
        shared_F = c.num_shared_experts * (c.shared_hidden_dim or c.hidden_dim)
        self.shared_experts = _HFExpertMLP(c.dim, shared_F) if shared_F else None

    @classmethod
    @torch.no_grad()
    def from_torch_moe(cls, moe: MoE) -> HFStyleMoE:
        """Copies of ``moe``'s weights in HF's layout (GEMM-form [D, F] becomes (out, in))."""
        hf = cls(moe.config)
        hf.gate.weight.copy_(moe.router.weight)
        if hf.e_score_correction_bias is not None:
            hf.e_score_correction_bias.copy_(moe.router.expert_bias)
        w1_EDF, w2_EFD, w3_EDF = moe.experts.w1, moe.experts.w2, moe.experts.w3
        for e, mlp in enumerate(hf.experts):
            mlp.gate_proj.weight.copy_(w1_EDF[e].t())
            mlp.up_proj.weight.copy_(w3_EDF[e].t())
            mlp.down_proj.weight.copy_(w2_EFD[e].t())
        if hf.shared_experts is not None:
            s = moe.shared_experts
            hf.shared_experts.gate_proj.weight.copy_(s.w1.t())
            hf.shared_experts.up_proj.weight.copy_(s.w3.t())
            hf.shared_experts.down_proj.weight.copy_(s.w2.t())
        return hf

    def route(self, x_TD: Tensor) -> tuple[Tensor, Tensor]:
        """(topk_ids [T, k], topk_weights [T, k] in x's dtype); scores in fp32."""
        c = self.config
        logits_TE = self.gate(x_TD).float()
        if c.score_func == "softmax":
            scores_TE = logits_TE.softmax(dim=-1)
        else:
            scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE
        if self.e_score_correction_bias is not None:
            choice_TE = scores_TE + self.e_score_correction_bias.float()
        if c.num_expert_groups:
            choice_TE = self._keep_top_groups(choice_TE)
        topk_ids_TK = choice_TE.topk(c.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if c.normalize_topk:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids_TK, (weights_TK * c.route_scale).to(x_TD.dtype)

    def _keep_top_groups(self, choice_TE: Tensor) -> Tensor:
        # DeepSeek-V3: a group scores the sum of its two best experts; keep the best groups.
        c = self.config
        T = choice_TE.size(0)
        grouped_TGe = choice_TE.view(T, c.num_expert_groups, -1)
        group_scores_TG = grouped_TGe.topk(2, dim=-1).values.sum(dim=-1)
        top_groups = group_scores_TG.topk(c.topk_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, top_groups, True)
        return grouped_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, -1)

    def forward(self, x: Tensor) -> Tensor:
        x_TD = x.reshape(-1, x.size(-1))
        topk_ids_TK, weights_TK = self.route(x_TD)
        out_TD = torch.zeros_like(x_TD)
        mask_EKT = F.one_hot(topk_ids_TK, self.config.num_experts).permute(2, 1, 0)
        for e in mask_EKT.sum(dim=(1, 2)).nonzero().flatten().tolist():
            slot, token = torch.where(mask_EKT[e])
            y_ND = self.experts[e](x_TD[token]) * weights_TK[token, slot, None]
            out_TD.index_add_(0, token, y_ND.to(x_TD.dtype))
        if self.shared_experts is not None:
            out_TD = out_TD + self.shared_experts(x_TD)
        return out_TD.view(x.shape)


# --------------------------------------------------------------------------
# torchtitan
# --------------------------------------------------------------------------


def torchtitan_status() -> tuple[bool, str]:
    try:
        import torchtitan
        import torchtitan.models.common.moe  # noqa: F401 - what the comparison needs
    except Exception as e:  # noqa: BLE001 - report whatever stops the import
        return False, (f"torchtitan: not importable ({type(e).__name__}: {e}); "
                       "`pip install -e '.[bench]'` adds it")
    return True, (f"torchtitan: {getattr(torchtitan, '__version__', '?')} importable; "
                  "its MoE computes the expert GEMMs in bf16 whatever the input dtype")


@torch.no_grad()
def torchtitan_from_torch_moe(moe: MoE) -> nn.Module:
    """``torchtitan.models.common.moe.MoE`` holding copies of ``moe``'s weights.

    torchtitan keeps expert weights in nn.Linear's (out, in) layout, w1/w3 [E, F, D] and
    w2 [E, D, F], and runs ``torch._grouped_mm(x, w.transpose(-2, -1))``; torch_moe keeps the
    GEMM layout [E, D, F], so each weight is transposed once here.
    """
    from torchtitan.models.common.feed_forward import FeedForward
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (
        GroupedExperts, MoE as TitanMoE, RoutedExperts, TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    c = moe.config
    if c.activation != "swiglu" or c.topk_before_score or c.shared_expert_gate:
        raise ValueError("torchtitan's MoE has swiglu experts and score-then-top-k routing only")
    D, F_, E = c.dim, c.hidden_dim, c.num_experts
    shared = None
    if c.num_shared_experts:
        Fs = c.num_shared_experts * (c.shared_hidden_dim or F_)
        shared = FeedForward.Config(
            w1=Linear.Config(in_features=D, out_features=Fs),
            w2=Linear.Config(in_features=Fs, out_features=D),
            w3=Linear.Config(in_features=D, out_features=Fs))
    config = TitanMoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F_, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=c.top_k)),
        router=TokenChoiceTopKRouter.Config(
            num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
            num_expert_groups=c.num_expert_groups, num_limited_groups=c.topk_groups,
            top_k=c.top_k, score_func=c.score_func, route_norm=c.normalize_topk,
            route_scale=c.route_scale),
        # A coefficient is what makes torchtitan keep (and route with) an expert bias; its
        # aux-loss-free update runs outside forward, as torch_moe's does.
        load_balance_coeff=1e-3 if c.load_balance_bias else None,
        shared_experts=shared,
    )
    titan = config.build()
    titan.router.gate.weight.copy_(moe.router.weight)
    if c.load_balance_bias:
        titan.expert_bias_E.copy_(moe.router.expert_bias)
    experts = titan.routed_experts.inner_experts
    experts.w1_EFD.copy_(moe.experts.w1.transpose(-2, -1))
    experts.w2_EDF.copy_(moe.experts.w2.transpose(-2, -1))
    experts.w3_EFD.copy_(moe.experts.w3.transpose(-2, -1))
    if shared is not None:
        s = moe.shared_experts
        titan.shared_experts.w1.weight.copy_(s.w1.t())
        titan.shared_experts.w2.weight.copy_(s.w2.t())
        titan.shared_experts.w3.weight.copy_(s.w3.t())
    return titan


@contextlib.contextmanager
def _bf16_casts_disabled():
    """Makes ``Tensor.bfloat16()`` return fp32 tensors unchanged.

    torchtitan's GroupedExperts casts its operands with ``.bfloat16()`` unconditionally. Only
    the correctness check uses this, to run torchtitan's own routing, dispatch and combine
    code with fp32 GEMMs, so that an fp32 comparison with torch_moe is meaningful.
    """
    original = torch.Tensor.bfloat16

    def bfloat16(self, *args, **kwargs):
        return self if self.dtype == torch.float32 else original(self, *args, **kwargs)

    torch.Tensor.bfloat16 = bfloat16
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original


# --------------------------------------------------------------------------
# Implementations of one cell
# --------------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    module: nn.Module
    # The dtype its expert GEMMs run in when that is not the data dtype (torchtitan: bf16).
    gemm_dtype: Optional[torch.dtype] = None
    est_s: dict = field(default_factory=dict)  # mode -> estimated seconds per call
    error: str = ""
    # torch_moe's expert GEMM form for this implementation's calls (torch_moe.cpu.expert_form);
    # None: the process-wide default
    form: Optional[str] = None

    def may_skip(self, dtype: torch.dtype) -> bool:
        """torch_moe and everything computing in fp32 always run; an implementation whose
        GEMMs run natively in bf16 (minutes per step on a CPU without bf16 GEMM
        instructions) may be skipped when its estimate is over budget."""
        return (not self.name.startswith(TORCH_MOE)
                and (self.gemm_dtype or dtype) != torch.float32)


def _in_form(form: Optional[str]):
    return torch_moe.cpu.expert_form(form) if form else contextlib.nullcontext()


def _cast_parameters(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Casts parameters only. ``module.to(dtype)`` would also cast the fp32 buffers
    (load counts, expert bias), and bf16 counts stop being exact above 256."""
    for p in module.parameters():
        p.data = p.data.to(dtype)
    return module


def reference_moe(shape: LayerShape, seed: int = 0) -> MoE:
    """The seeded fp32 layer every implementation copies its weights from."""
    torch.manual_seed(seed)
    moe = MoE(shape.config)
    if moe.router.expert_bias is not None:
        # A non-zero bias, so the check sees it change the routing.
        moe.router.expert_bias.copy_(torch.randn(shape.config.num_experts) * 0.05)
    return moe


def build_impls(ref: MoE, dtype: torch.dtype, has_titan: bool, forms=()) -> list[Impl]:
    """torch_moe (in the default expert form, then in each of ``forms``), the HF-style loop,
    torchtitan."""
    impls = [Impl(TORCH_MOE, _cast_parameters(copy.deepcopy(ref), dtype))]
    impls += [Impl(f"{TORCH_MOE} [{form}]", _cast_parameters(copy.deepcopy(ref), dtype), form=form)
              for form in forms]
    impls.append(Impl(HF_STYLE, _cast_parameters(HFStyleMoE.from_torch_moe(ref), dtype)))
    if has_titan:
        try:
            titan = _cast_parameters(torchtitan_from_torch_moe(ref), dtype)
            impls.append(Impl(TORCHTITAN, titan, gemm_dtype=torch.bfloat16))
        except Exception as e:  # noqa: BLE001 - one broken baseline must not stop the rest
            impls.append(Impl(TORCHTITAN, nn.Identity(), torch.bfloat16,
                              error=f"error: {type(e).__name__}: {e}"))
    return impls


def make_inputs(shape: LayerShape, dtype: torch.dtype, seed: int = 1) -> tuple[Tensor, Tensor]:
    """x [1, T, D] (a leaf that requires grad) and a dense grad_out, generated in fp32."""
    g = torch.Generator().manual_seed(seed)
    D = shape.config.dim
    x_BLD = torch.randn(1, shape.T, D, generator=g).to(dtype).requires_grad_()
    return x_BLD, torch.randn(1, shape.T, D, generator=g).to(dtype)


def forward_fn(module: nn.Module, x_BLD: Tensor, form: Optional[str] = None
               ) -> Callable[[], Tensor]:
    def run() -> Tensor:
        with torch.no_grad(), _in_form(form):
            return module(x_BLD)

    return run


def train_step_fns(module: nn.Module, x_BLD: Tensor, grad_BLD: Tensor,
                   form: Optional[str] = None):
    """(step, reset): forward + backward with a dense grad_out; the untimed reset drops the
    gradients, as ``zero_grad(set_to_none=True)`` does."""

    def step() -> None:
        with _in_form(form):  # the backward too: it chooses its GEMM form when it runs
            module(x_BLD).backward(grad_BLD)

    def reset() -> None:
        module.zero_grad(set_to_none=True)
        x_BLD.grad = None

    return step, reset


def _slice_fn(module: nn.Module, x_BLD: Tensor, grad_BLD: Tensor, mode: str, n: int):
    """One call of ``mode`` on the first n tokens."""
    x_slice = x_BLD.detach()[:, :n].requires_grad_(mode != "fwd")
    if mode == "fwd":
        return forward_fn(module, x_slice)
    step, reset = train_step_fns(module, x_slice, grad_BLD[:, :n])
    return lambda: (step(), reset())


def estimate_seconds(module: nn.Module, x_BLD: Tensor, grad_BLD: Tensor, mode: str,
                     target_s: float = 0.25) -> float:
    """Seconds per call of ``mode`` over all T tokens, extrapolated from calls on growing
    token slices.

    Each mode is probed on its own: on a CPU without bf16 GEMM instructions the backward's
    GEMM layouts can be far slower than the forward's, so no fixed ratio holds. The probe
    starts at T/64 tokens (at least 32), so a native-bf16 path costs about a second, and
    doubles the slice until a call takes ``target_s`` (after at least two slices) or covers
    every token. A layer has a large fixed cost per call (every expert's weights are read,
    whatever the token count), so the estimate fits time = fixed + per-token cost through the
    last two slices, bounded below by the last measurement and above by proportional
    scaling. A first slice that is already very slow stops the probe: the proportional bound
    is then the estimate, and it errs towards skipping.
    """
    T = x_BLD.size(1)
    n, points = min(T, max(32, T // 64)), []
    while True:
        run = _slice_fn(module, x_BLD, grad_BLD, mode, n)
        elapsed = time_once(run)
        if elapsed < target_s:  # cheap: take the better of two, past first-call costs
            elapsed = min(elapsed, time_once(run))
        points.append((n, elapsed))
        if n >= T or elapsed >= 8 * target_s or (elapsed >= target_s and len(points) >= 2):
            break
        n = min(T, 2 * n)
    n1, t1 = points[-1]
    proportional = t1 * T / n1
    if len(points) < 2:
        return proportional
    n0, t0 = points[-2]
    linear = t1 + (t1 - t0) / (n1 - n0) * (T - n1)
    return min(max(linear, t1), proportional)


def _samples(est_s: float, reps: int, warmup: int, budget_s: float) -> tuple[int, int]:
    """(reps, warmup) so that a slow implementation fits ``budget_s``."""
    n = max(1, min(reps, int(budget_s // max(est_s, 1e-9))))
    return n, (warmup if est_s * (n + warmup) <= budget_s else 0)


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def bench_cell(shape: LayerShape, dtype: torch.dtype, impls: list[Impl], native_rates: dict,
               args, modes=MODES, section: str = "layer") -> list[dict]:
    """Times every implementation of one (shape, dtype) in each mode, with the ceiling GEMM
    in the same rounds."""
    dname = DTYPE_NAMES[dtype]
    x_BLD, grad_BLD = make_inputs(shape, dtype)
    rows = []
    for mode in modes:
        entries, skipped = [], {}
        for impl in impls:
            impl.module.train(mode != "fwd")
            est = impl.est_s.get(mode, float("nan"))
            if impl.error:
                skipped[impl.name] = impl.error
            elif est > args.max_iter_seconds and impl.may_skip(dtype):
                gemm = DTYPE_NAMES[impl.gemm_dtype or dtype]
                skipped[impl.name] = (f"skipped: est. {est:.0f} s/iter (native {gemm} GEMMs: "
                                      f"{describe_rates(native_rates[impl.gemm_dtype or dtype])})")
            else:
                n, w = _samples(est, args.reps, args.warmup, args.cell_seconds)
                if mode == "fwd":
                    run = forward_fn(impl.module, x_BLD, impl.form)
                    entries.append(Entry(impl.name, run, reps=n, warmup=w))
                else:
                    step, reset = train_step_fns(impl.module, x_BLD, grad_BLD, impl.form)
                    entries.append(Entry(impl.name, step, reset, reps=n, warmup=w))

        # The ceiling rate: fp32 mm of one expert GEMM's shape timed in the same rounds, and
        # native mm in the dtype where affordable (else the start-up probe's rate).
        c = shape.config
        gemm_shape = MoEShape(shape.name, shape.T, c.dim, c.hidden_dim, c.num_experts, c.top_k)
        gemm = {"fp32": gemm_entry("dense mm fp32", gemm_shape, torch.float32, "b")}
        rates = {}
        if dtype != torch.float32:
            layout = max(native_rates[dtype], key=native_rates[dtype].get)
            rates[dname] = native_rates[dtype][layout]
            if shape.routed_gemm_flops / (rates[dname] * 1e9) <= args.max_iter_seconds / 4:
                gemm[dname] = gemm_entry(f"dense mm {dname}", gemm_shape, dtype, layout)
        interleaved(entries + list(gemm.values()), args.reps, args.warmup)
        rates.update({k: shape.routed_gemm_flops / e.median / 1e9 for k, e in gemm.items()})
        best = max(rates, key=rates.get)
        ceiling_s = shape.flops(mode) / (rates[best] * 1e9)

        timed = {e.name: e for e in entries}
        ref_t = timed[TORCH_MOE].median
        for impl in impls:
            row = dict(section=section, shape=shape.name, T=shape.T, dtype=dname, mode=mode,
                       impl=impl.name)
            if impl.name in timed:
                t = timed[impl.name].median
                row.update(n=len(timed[impl.name].times), median_ms=f"{t * 1e3:.1f}",
                           tokens_per_s=f"{shape.T / t:,.0f}", frac_ceiling=f"{ceiling_s / t:.2f}",
                           vs_torch_moe=f"{t / ref_t:.2f}x")
            else:
                row.update(n=0, note=skipped[impl.name])
            rows.append(row)
        rows.append(dict(
            section=section, shape=shape.name, T=shape.T, dtype=dname, mode=mode,
            impl="ceiling (dense GEMM)",
            n=len(gemm["fp32"].times), median_ms=f"{ceiling_s * 1e3:.1f}",
            tokens_per_s=f"{shape.T / ceiling_s:,.0f}", frac_ceiling="1.00",
            vs_torch_moe=f"{ceiling_s / ref_t:.2f}x",
            note=f"{shape.flops(mode) / 1e9:.1f} GFLOP at {best} mm {rates[best]:.1f} GFLOP/s"
                 + "".join(f"; {k} {v:.1f}" for k, v in rates.items() if k != best)))
    for impl in impls:
        impl.module.train()
    return rows


# --------------------------------------------------------------------------
# Bytes saved for backward
# --------------------------------------------------------------------------


def bench_saved(shape: LayerShape, dtype: torch.dtype, impls: list[Impl], args) -> list[dict]:
    """Distinct storages each implementation's forward saves for backward (training mode)."""
    dname = DTYPE_NAMES[dtype]
    x_BLD, _ = make_inputs(shape, dtype)
    rows, results = [], {}
    for impl in impls:
        row = dict(section="saved", shape=shape.name, dtype=dname, impl=impl.name)
        rows.append(row)
        if impl.error:
            row["how"] = impl.error
            continue
        if impl.est_s["fwd"] > args.max_iter_seconds and impl.may_skip(dtype):
            row["how"] = f"skipped: forward est. {impl.est_s['fwd']:.0f} s"
            continue
        with SavedBytes([x_BLD, *impl.module.parameters()]) as counter:
            y = impl.module(x_BLD)
            total, activations = counter.totals()
        del y
        results[impl.name] = activations
        row.update(total_MiB=f"{total / 2**20:.1f}", activations_MiB=f"{activations / 2**20:.1f}",
                   how=f"measured in {dname}")
    ref = results.get(TORCH_MOE)
    for row in rows:
        if ref and row["impl"] in results:
            row["vs_torch_moe"] = f"{results[row['impl']] / ref:.2f}x"
    return rows


# --------------------------------------------------------------------------
# Where torch_moe's time goes
# --------------------------------------------------------------------------

EXPERT_KERNELS = ("torch_moe::grouped_ffn", "torch_moe::grouped_ffn_backward")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm",
            "aten::_grouped_mm", "aten::matmul")


# The kernel configurations profiled side by side: (expert GEMM form, weight-gradient storage
# reused). "fresh grad storage": a fresh gradient storage every step, as any allocation gets.
PROFILE_CONFIGS = {"default": (None, True), "fresh grad storage": (None, False)}


def _page_faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def bench_overhead(shape: LayerShape, dtype: torch.dtype, impl: Impl, config: str,
                   steps: int = 3) -> dict:
    """torch_moe's forward + backward in one kernel configuration (:data:`PROFILE_CONFIGS`):
    the median of ``steps`` unprofiled steps and their page faults per step, then one profiled
    step: the share of its wall time outside the fused expert kernel (router GEMM and scoring,
    top-k, token sort, load counts, dtype casts, shared expert) and the share inside GEMMs of
    any kind. Gradients are dropped between steps (``zero_grad(set_to_none=True)``), as a
    training loop does."""
    from torch.profiler import ProfilerActivity, profile, schedule

    form, reuse = PROFILE_CONFIGS[config]
    reuse_before = torch_moe.cpu.grad_storage_reuse_enabled()
    torch_moe.cpu.set_grad_storage_reuse(reuse)
    try:
        x_BLD, grad_BLD = make_inputs(shape, dtype)
        step, reset = train_step_fns(impl.module, x_BLD, grad_BLD, form)
        step()
        reset()
        times, faults = [], []
        for _ in range(steps):
            before = _page_faults()
            times.append(time_once(step))
            faults.append(_page_faults() - before)
            reset()
        # The first profiled step warms the profiler up and is discarded.
        with profile(activities=[ProfilerActivity.CPU],
                     schedule=schedule(wait=0, warmup=1, active=1), acc_events=True) as prof:
            for _ in range(2):
                step_s = time_once(step)
                reset()
                prof.step()
    finally:
        torch_moe.cpu.set_grad_storage_reuse(reuse_before)
    events = prof.key_averages()
    # Total (inclusive) time of the fused op; self time of GEMMs, so nested calls count once.
    expert_s = sum(e.cpu_time_total for e in events if e.key in EXPERT_KERNELS) / 1e6
    gemm_s = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e6
    return dict(section="overhead", shape=shape.name, dtype=DTYPE_NAMES[dtype], impl=TORCH_MOE,
                config=config, step_ms=f"{statistics.median(times) * 1e3:.1f}",
                page_faults_per_step=round(statistics.median(faults)),
                profiled_step_ms=f"{step_s * 1e3:.1f}",
                expert_kernel_ms=f"{expert_s * 1e3:.1f}",
                outside_expert_kernel=f"{max(0.0, 1 - expert_s / step_s):.1%}",
                gemm_share=f"{min(1.0, gemm_s / step_s):.1%}")


# --------------------------------------------------------------------------
# What the expert GEMMs alone cost: a bound on any kernel made of aten GEMMs
# --------------------------------------------------------------------------

BOUND_COLUMNS = ["shape", "dtype", "impl", "n", "median_ms", "gflops", "frac_ceiling",
                 "layer_frac_ceiling", "note"]


def routed_counts(moe: MoE, x_BLD: Tensor) -> list[int]:
    """Rows per expert of the layer's own routing of ``x``."""
    with torch.no_grad():
        topk_ids = moe.router(x_BLD.reshape(-1, moe.config.dim))[0]
    return torch.bincount(topk_ids.flatten(), minlength=moe.config.num_experts).tolist()


def _dense_step_gemms(T: int, D: int, F_: int, gated: bool):
    """fwd + bwd GEMMs of a dense FFN (the router with F_ = E, ungated; a shared expert) on T
    rows, as closures over preallocated buffers."""
    x, g = torch.randn(T, D), torch.randn(T, D)
    ws = [torch.randn(D, F_) for _ in range(2 if gated else 1)]
    w2 = torch.randn(F_, D) if gated else None
    h, dx, dw, dw2 = torch.empty(T, F_), torch.empty(T, D), torch.empty(D, F_), torch.empty(F_, D)

    def run():
        for w in ws:  # up (and gate): forward, grad-input, grad-weight
            torch.mm(x, w, out=h)
            torch.mm(h, w.t(), out=dx)
            torch.mm(x.t(), h, out=dw)
        if w2 is not None:  # down
            torch.mm(h, w2, out=dx)
            torch.mm(g, w2.t(), out=h)
            torch.mm(h.t(), g, out=dw2)

    return run


def gemm_bound_entries(shape: LayerShape, counts: list[int]) -> list[Entry]:
    """The GEMMs of one fp32 forward + backward of the layer and nothing else, on buffers that
    already exist (no gather, activation, combine, allocation or Python beyond the calls):

    * per-group: the routed experts' GEMMs exactly as the fused CPU kernel issues them in its
      per-group form (gate, up, down; d act, d w2, d w1, d w3, d x from w1 and w3), one ``mm``
      per expert on its ``counts[e]`` rows;
    * batched, no padding: the same as ``bmm`` over all experts with every expert at the mean
      count. Routing never gives every expert the mean, so no batched form reaches it: it is
      the most the batched form could gain.

    Both add the router's and the shared experts' GEMMs, dense on T rows."""
    c = shape.config
    E, D, F_ = c.num_experts, c.dim, c.hidden_dim
    assert c.gated and not c.fused_gate_up, "the bound models separate w1 / w3 experts"
    S = sum(counts)
    W1, W3, W2 = torch.randn(E, D, F_), torch.randn(E, D, F_), torch.randn(E, F_, D)
    X, G = torch.randn(S, D), torch.randn(S, D)
    h1, h3, a, dA = (torch.empty(S, F_) for _ in range(4))
    o, dX = torch.empty(S, D), torch.empty(S, D)
    gW1, gW3, gW2 = torch.empty(E, D, F_), torch.empty(E, D, F_), torch.empty(E, F_, D)
    dense = [_dense_step_gemms(shape.T, D, E, gated=False)]
    if c.num_shared_experts:
        dense.append(_dense_step_gemms(shape.T, D, c.num_shared_experts
                                       * (c.shared_hidden_dim or F_), gated=True))
    bounds, start = [], 0
    for e, n in enumerate(counts):
        if n:
            bounds.append((e, slice(start, start + n)))
        start += n

    def per_group():
        for e, r in bounds:
            torch.mm(X[r], W1[e], out=h1[r])
            torch.mm(X[r], W3[e], out=h3[r])
            torch.mm(a[r], W2[e], out=o[r])
        for e, r in bounds:
            torch.mm(G[r], W2[e].t(), out=dA[r])
            torch.mm(a[r].t(), G[r], out=gW2[e])
            torch.mm(X[r].t(), h1[r], out=gW1[e])
            torch.mm(X[r].t(), h3[r], out=gW3[e])
            torch.mm(h1[r], W1[e].t(), out=dX[r])
            dX[r].addmm_(h3[r], W3[e].t())
        for run in dense:
            run()

    L = -(-S // E)
    X3, G3 = torch.randn(E, L, D), torch.randn(E, L, D)
    h13, h33, a3, dA3 = (torch.empty(E, L, F_) for _ in range(4))
    o3, dX3 = torch.empty(E, L, D), torch.empty(E, L, D)

    def batched():
        torch.bmm(X3, W1, out=h13)
        torch.bmm(X3, W3, out=h33)
        torch.bmm(a3, W2, out=o3)
        torch.bmm(G3, W2.transpose(1, 2), out=dA3)
        torch.bmm(a3.transpose(1, 2), G3, out=gW2)
        torch.bmm(X3.transpose(1, 2), h13, out=gW1)
        torch.bmm(X3.transpose(1, 2), h33, out=gW3)
        torch.bmm(h13, W1.transpose(1, 2), out=dX3)
        dX3.baddbmm_(h33, W3.transpose(1, 2))
        for run in dense:
            run()

    return [Entry("expert GEMMs alone, per-group mm", per_group),
            Entry(f"expert GEMMs alone, bmm at the mean {L} rows (no padding)", batched)]


def bench_gemm_bound(shape: LayerShape, ref: MoE, layer_rows: list[dict], args) -> list[dict]:
    """Times :func:`gemm_bound_entries` against the dense ceiling in the same rounds."""
    x_BLD, _ = make_inputs(shape, torch.float32)
    counts = routed_counts(ref, x_BLD)
    c = shape.config
    gemm_shape = MoEShape(shape.name, shape.T, c.dim, c.hidden_dim, c.num_experts, c.top_k)
    ceiling = gemm_entry("dense mm fp32", gemm_shape, torch.float32, "b")
    entries = gemm_bound_entries(shape, counts)
    interleaved(entries + [ceiling], args.reps, args.warmup)
    flops = shape.flops("fwd+bwd")
    ceiling_s = flops / (shape.routed_gemm_flops / ceiling.median)
    layer = next((r for r in layer_rows if r["shape"] == shape.name and r["dtype"] == "fp32"
                  and r["mode"] == "fwd+bwd" and r["impl"] == TORCH_MOE), {})
    nonzero = [n for n in counts if n]
    note = (f"rows per expert {min(nonzero)}..{max(nonzero)}, mean {sum(counts) / len(counts):.0f}"
            if nonzero else "no rows")
    return [dict(section="bound", shape=shape.name, dtype="fp32", impl=e.name, n=len(e.times),
                 median_ms=f"{e.median * 1e3:.1f}", gflops=f"{flops / e.median / 1e9:.0f}",
                 frac_ceiling=f"{ceiling_s / e.median:.2f}",
                 layer_frac_ceiling=layer.get("frac_ceiling", ""), note=note)
            for e in entries]


# --------------------------------------------------------------------------
# Correctness
# --------------------------------------------------------------------------


def _max_rel_diff(got: Tensor, want: Tensor) -> float:
    """max |got - want| / max |want|."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _output_and_grads(module: nn.Module, router_weight: Tensor, x_BLD: Tensor,
                      grad_BLD: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(y, dL/dx, dL/d router weight): the router's gradient flows only through the routing
    weights, so it checks the combine's weighting as well."""
    x = x_BLD.detach().clone().requires_grad_()
    y = module(x)
    y.backward(grad_BLD)
    return y.detach(), x.grad, router_weight.grad


def run_check(shapes: list[LayerShape], has_titan: bool,
              tol: float = 1e-5) -> tuple[bool, list[dict]]:
    """fp32 outputs and gradients of every implementation against torch_moe's, on the same
    weights, for each shape's routing configuration at a small size."""
    ok, rows = True, []
    print(f"== check: max relative difference to torch_moe (max|diff| / max|torch_moe|) of the "
          f"output y and the gradients of x and the router weight, fp32, target {tol:g}")
    configs = {}  # shapes that differ only in T share one check
    for shape in map(check_shape, shapes):
        configs.setdefault(repr(shape.config), shape)
    for shape in configs.values():
        print(f"  {shape}")
        ref = reference_moe(shape)
        x_BLD, grad_BLD = make_inputs(shape, torch.float32)
        want = _output_and_grads(ref, ref.router.weight, x_BLD, grad_BLD)
        hf = HFStyleMoE.from_torch_moe(ref)
        candidates = [(HF_STYLE, hf, hf.gate.weight, contextlib.nullcontext)]
        if has_titan:
            titan = torchtitan_from_torch_moe(ref)
            gate = titan.router.gate.weight
            candidates += [
                (f"{TORCHTITAN} (its bf16 casts disabled)", titan, gate, _bf16_casts_disabled),
                (f"{TORCHTITAN} (as shipped: bf16 expert GEMMs)", titan, gate,
                 contextlib.nullcontext)]
        for name, module, router_weight, context in candidates:
            module.zero_grad(set_to_none=True)
            with context():
                got = _output_and_grads(module, router_weight, x_BLD, grad_BLD)
            errs = [_max_rel_diff(g, w) for g, w in zip(got, want)]
            if max(errs) <= tol:
                verdict = "ok"
            else:
                verdict = "bf16 rounding, expected" if "as shipped" in name else "MISMATCH"
            ok &= verdict != "MISMATCH"
            rows.append(dict(section="check", shape=shape.name, impl=name, y_rel=f"{errs[0]:.1e}",
                             dx_rel=f"{errs[1]:.1e}", drouter_rel=f"{errs[2]:.1e}",
                             verdict=verdict))
            print(f"    {name:46s} y {errs[0]:.1e}  dx {errs[1]:.1e}  "
                  f"drouter {errs[2]:.1e}  {verdict}")
    return ok, rows


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

LAYER_COLUMNS = ["shape", "dtype", "mode", "impl", "n", "median_ms", "tokens_per_s",
                 "frac_ceiling", "vs_torch_moe", "note"]
SAVED_COLUMNS = ["shape", "dtype", "impl", "total_MiB", "activations_MiB", "vs_torch_moe", "how"]
OVERHEAD_COLUMNS = ["shape", "dtype", "config", "step_ms", "page_faults_per_step",
                    "profiled_step_ms", "expert_kernel_ms", "outside_expert_kernel", "gemm_share"]
SWEEP_TS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="a,b,c,d",
                    help="comma-separated subset of a,b,c,d ('' for none, e.g. with --sweep)")
    ap.add_argument("--dtypes", default="bf16,fp32", help="comma-separated subset of bf16,fp32")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per implementation")
    ap.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    ap.add_argument("--max-iter-seconds", type=float, default=10.0,
                    help="skip a native-bf16 baseline whose estimated seconds per iteration "
                         "exceed this")
    ap.add_argument("--cell-seconds", type=float, default=20.0,
                    help="fewer samples for an implementation whose reps would take longer "
                         "than this")
    ap.add_argument("--csv", default=None,
                    help="output CSV (default results/moe_layer.csv; results/moe_layer_quick.csv "
                         "with --quick)")
    ap.add_argument("--quick", action="store_true", help="shape (d), 2 reps, tight skip budget")
    ap.add_argument("--no-check", action="store_true", help="skip the fp32 correctness check")
    ap.add_argument("--forms", default="",
                    help="also time torch_moe with its expert GEMMs in each of these forms "
                         "(comma-separated subset of auto,batched; the default row is per_group)")
    ap.add_argument("--sweep", action="store_true",
                    help="also sweep T at D=1024, F=256, E=64, k=8, fp32 forward + backward, and "
                         "plot the fraction of the ceiling against T")
    ap.add_argument("--sweep-ts", default=",".join(map(str, SWEEP_TS)),
                    help="token counts of the sweep")
    args = ap.parse_args(argv)
    if args.quick:
        args.shapes, args.reps, args.warmup = "d", 2, 1
        args.max_iter_seconds, args.cell_seconds = min(args.max_iter_seconds, 1.0), 5.0
    if args.csv is None:
        args.csv = str(RESULTS / ("moe_layer_quick.csv" if args.quick else "moe_layer.csv"))
    return args


def sweep_shape(T: int) -> LayerShape:
    return LayerShape(f"T={T}", T, _mixtral_like(1024, 256, 64, 8))


def run_sweep(ts: list[int], has_titan: bool, forms: list[str], native_rates: dict, args,
              start: float) -> list[dict]:
    """fp32 forward + backward at D=1024, F=256, E=64, k=8 for each T, on the same weights;
    a table, and a plot of the fraction of the ceiling against T."""
    print(f"\n== T sweep: D=1024 F=256 E=64 k=8 (Mixtral-like routing), fp32, fwd+bwd; "
          f"T = {', '.join(map(str, ts))}", flush=True)
    ref = reference_moe(sweep_shape(ts[0]))  # the weights do not depend on T
    sweep_rows = []
    for T in ts:
        shape = sweep_shape(T)
        impls = build_impls(ref, torch.float32, has_titan, forms)
        x_BLD, grad_BLD = make_inputs(shape, torch.float32)
        for impl in impls:
            if not impl.error:
                impl.est_s = {"fwd+bwd": estimate_seconds(impl.module, x_BLD, grad_BLD, "fwd+bwd")}
        cell = bench_cell(shape, torch.float32, impls, native_rates, args, modes=("fwd+bwd",),
                          section="sweep")
        sweep_rows += cell
        print(f"   T={T}: " + ", ".join(f"{r['impl']} {r.get('frac_ceiling', 'skipped')}"
                                        for r in cell) +
              f"  [{time.perf_counter() - start:.0f} s elapsed]", flush=True)
        del impls, x_BLD, grad_BLD
    print(format_table(sweep_rows, LAYER_COLUMNS))
    series = {}
    for r in sweep_rows:
        if "frac_ceiling" in r and r["impl"] != "ceiling (dense GEMM)":
            series.setdefault(r["impl"], []).append((r["T"], float(r["frac_ceiling"])))
    line_plot(FIGURES / ("moe_layer_sweep_quick.png" if args.quick else "moe_layer_sweep.png"),
              list(series.items()), "tokens per step T (D=1024, F=256, E=64, k=8, fp32 fwd+bwd)",
              "fraction of the dense-GEMM ceiling", hline=1.0)
    return sweep_rows


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes = [SHAPES[s] for s in args.shapes.split(",") if s]
    dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    forms = [f for f in args.forms.split(",") if f]
    for form in forms:
        if form not in torch_moe.cpu.EXPERT_FORMS:
            raise SystemExit(f"--forms: expected forms among {torch_moe.cpu.EXPERT_FORMS}, got {form!r}")
    has_titan, titan_line = torchtitan_status()
    # torchtitan's router asks CPU autocast for fp32, which CPU autocast does not support: it
    # warns and runs the gate in the input dtype, on every call.
    warnings.filterwarnings("ignore",
                            message="In CPU autocast, but the target dtype is not supported")
    for line in environment_header() + [titan_line]:
        print(line)
    rows: list[dict] = []
    start = time.perf_counter()
    ok = True
    if not args.no_check:
        ok, check_rows = run_check(shapes, has_titan)
        rows += check_rows
        print()

    native_rates = {dt: native_gemm_rates(dt) for dt in {*dtypes, torch.bfloat16}}
    for dt, r in native_rates.items():
        print(f"dense torch.mm probe, {DTYPE_NAMES[dt]} [512, 1024] @ [1024, 256]: "
              f"{describe_rates(r)}")
    print(f"reps {args.reps}, warmup {args.warmup}, skip budget {args.max_iter_seconds:g} s/iter, "
          f"{args.cell_seconds:g} s per implementation and mode; fwd runs under no_grad in eval "
          "mode, fwd+bwd in train mode with a dense grad_out")
    print("frac_ceiling = ceiling time / time; vs_torch_moe = time / torch_moe's time "
          "(> 1: torch_moe is faster)\n")

    layer_rows, saved_rows, overhead_rows, bound_rows = [], [], [], []
    for shape in shapes:
        ref = reference_moe(shape)
        for dtype in sorted(dtypes, key=lambda d: d != torch.float32):  # fp32 first
            impls = build_impls(ref, dtype, has_titan, forms)
            x_BLD, grad_BLD = make_inputs(shape, dtype)
            for impl in impls:
                if not impl.error:
                    impl.est_s = {mode: estimate_seconds(impl.module, x_BLD, grad_BLD, mode)
                                  for mode in MODES}
            print(f"-- {shape} {DTYPE_NAMES[dtype]}: est. s/iter (fwd, fwd+bwd): " + ", ".join(
                f"{i.name} " + ", ".join(f"{i.est_s.get(m, math.nan):.2f}" for m in MODES)
                for i in impls), flush=True)
            cell = bench_cell(shape, dtype, impls, native_rates, args)
            print(format_table(cell, LAYER_COLUMNS), flush=True)
            layer_rows += cell
            saved_rows += bench_saved(shape, dtype, impls, args)
            overhead_rows += [bench_overhead(shape, dtype, impls[0], config)
                              for config in PROFILE_CONFIGS]
            if dtype == torch.float32 and ref.config.gated and not ref.config.fused_gate_up:
                bound_rows += bench_gemm_bound(shape, ref, cell, args)
            print(f"   [{time.perf_counter() - start:.0f} s elapsed]", flush=True)
            del impls, x_BLD, grad_BLD

    if shapes:
        print("\n== bytes saved for backward (distinct storages; activations exclude x and the "
              "parameters; vs_torch_moe compares activations)")
        print(format_table(saved_rows, SAVED_COLUMNS))
        print("\n== torch_moe fwd+bwd per kernel configuration (default: weight-gradient storage "
              "reused across steps; fresh grad storage: a fresh gradient storage each step, "
              "torch_moe.cpu.set_grad_storage_reuse(False)): unprofiled median step and page "
              "faults per "
              "step, then one profiled step's share of wall time outside the fused expert kernel "
              "(torch_moe::grouped_ffn + grouped_ffn_backward: gather, expert GEMMs, activation, "
              "weighted scatter) and in GEMM ops of any kind")
        print(format_table(overhead_rows, OVERHEAD_COLUMNS))
    if bound_rows:
        print("\n== fp32 fwd+bwd: the GEMMs of a step alone (routed experts on the layer's own "
              "routing, router, shared experts), on existing buffers, against the dense ceiling "
              "in the same rounds: no kernel built of these aten GEMMs, whatever it fuses around "
              "them, gets above this frac_ceiling; layer_frac_ceiling is torch_moe's whole layer")
        print(format_table(bound_rows, BOUND_COLUMNS))
    rows += layer_rows + saved_rows + overhead_rows + bound_rows
    if args.sweep:
        rows += run_sweep([int(t) for t in args.sweep_ts.split(",")], has_titan, forms,
                          native_rates, args, start)
    write_csv(args.csv, rows)
    print(f"\nwrote {args.csv} ({len(rows)} rows) in {time.perf_counter() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
