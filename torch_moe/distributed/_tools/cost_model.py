"""Cost of one MoE layer, forward and backward, on the slowest rank of an expert-parallel group.

Inputs are a :class:`MoELayerSpec` (the layer's shapes), a :class:`MoEStrategy` (how it runs:
EP / ETP degrees, dispatch method, GEMM precision, chunk count, recompute), a
:class:`~torch_moe.distributed._tools.device_profiles.DeviceProfile`, and the expert load:
either per-expert token counts (a tensor or list) or a skew descriptor (``"uniform"`` or a
Zipf exponent) from which expected counts are derived.

Layout. Every rank holds ``T`` tokens of its own (data parallel outside the experts). An
expert-parallel group of ``ep * etp`` ranks holds the ``E`` experts: ``E / ep`` per rank, each
expert's FFN width split ``etp`` ways. The group's ``ep * etp * T * k`` assignments of one
micro-batch are the per-expert counts; a rank computes all rows of its ``E / ep`` experts at
width ``F / etp``.

The time of one pass (forward, then backward) with ``c`` chunks is a three-stage pipeline,
dispatch -> compute -> combine, whose two communication stages share the links::

    pass_s = d + q + p + (c - 1) * (max(d + q, p) + (1 - eta) * min(d + q, p))

with ``d``, ``p``, ``q`` the per-chunk dispatch, compute and combine times and ``eta`` the
profile's ``overlap_efficiency`` (the share of the shorter stage that runs hidden behind the
longer one: measured on the CPU over gloo, 1 where unmeasured). ``c = 1`` exposes
all communication; more chunks hide it behind compute but shrink every per-expert GEMM (lower
efficiency, more tile padding) and repeat per-call latencies and, on the CPU, the fresh weight
gradient allocations of each chunk's backward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch_moe.distributed._tools import comm_cost, gemm_cost, memory_cost
from torch_moe.distributed._tools.device_profiles import PRECISIONS, DeviceProfile
from torch_moe.distributed.placement import zipf_load

__all__ = [
    "DISPATCHERS",
    "MoELayerSpec",
    "MoEStrategy",
    "MoELayerCost",
    "expert_counts",
    "rank_imbalance",
    "moe_layer_cost",
]


def _pos_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: expected {name} to be a positive int, but got {value!r}")


# The model walks per-expert Python lists (counts, rank slices), and the planner prices
# hundreds of strategies: a bound on E keeps an absurd size an error instead of a hang. 4096 is
# far above today's layers (DeepSeek-V3: 256) and plans in seconds.
MAX_EXPERTS = 1 << 12


def _check_num_experts(owner: str, num_experts) -> None:
    _pos_int(owner, "num_experts", num_experts)
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"{owner}: expected num_experts <= {MAX_EXPERTS}, but got "
                         f"{num_experts}")


@dataclass(frozen=True)
class MoELayerSpec:
    """Shapes of one MoE layer.

    Attributes:
        dim: ``D``. hidden_dim: ``F`` of one routed expert. num_experts: ``E``. top_k: ``k``.
        num_shared_experts, shared_hidden_dim: always-on experts (width defaults to ``F``).
        gated: SwiGLU-style experts (three weight matrices) rather than two.
        max_nodes: node-limited routing (DeepSeek-V3: 4): each token's experts lie on at most
            this many nodes; ``None`` for unrestricted routing.
    """

    dim: int
    hidden_dim: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    shared_hidden_dim: int | None = None
    gated: bool = True
    max_nodes: int | None = None

    def __post_init__(self):
        owner = "MoELayerSpec"
        for name in ("dim", "hidden_dim", "top_k"):
            _pos_int(owner, name, getattr(self, name))
        _check_num_experts(owner, self.num_experts)
        if self.top_k > self.num_experts:
            raise ValueError(f"{owner}: expected top_k <= num_experts, but got top_k="
                             f"{self.top_k} > num_experts={self.num_experts}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(
                self.num_shared_experts, int) or self.num_shared_experts < 0:
            raise ValueError(f"{owner}: expected num_shared_experts >= 0, but got "
                             f"{self.num_shared_experts!r}")
        if self.shared_hidden_dim is not None:
            _pos_int(owner, "shared_hidden_dim", self.shared_hidden_dim)
        if self.max_nodes is not None:
            _pos_int(owner, "max_nodes", self.max_nodes)

    @classmethod
    def from_config(cls, config, max_nodes: int | None = None) -> "MoELayerSpec":
        """From a :class:`torch_moe.nn.modules.moe.MoEConfig`. Group-limited routing in the
        config is by expert group; pass ``max_nodes`` when the groups are nodes."""
        return cls(config.dim, config.hidden_dim, config.num_experts, config.top_k,
                   config.num_shared_experts, config.shared_hidden_dim,
                   config.activation in ("swiglu", "geglu", "swiglu_oai"), max_nodes)

    @property
    def matrices(self) -> int:
        return 3 if self.gated else 2

    @property
    def shared_width(self) -> int:
        """Total FFN width of the shared experts (they run as one FFN)."""
        return self.num_shared_experts * (self.shared_hidden_dim or self.hidden_dim)

    @property
    def expert_params(self) -> int:
        return self.num_experts * self.matrices * self.dim * self.hidden_dim

    @property
    def dense_params(self) -> int:
        """Router plus shared experts: the parameters every rank uses."""
        return self.num_experts * self.dim + self.matrices * self.dim * self.shared_width

    @property
    def params(self) -> int:
        return self.expert_params + self.dense_params


@dataclass(frozen=True)
class MoEStrategy:
    """How one MoE layer runs.

    Attributes:
        ep: expert-parallel degree (divides ``E``). etp: expert tensor parallel degree (splits
            each expert's ``F``; its groups stay inside a node).
        dispatch: ``"plain"``, ``"dedup"`` or ``"node_limited"`` (needs ``max_nodes``).
        precision: expert GEMM precision, ``"bf16"``, ``"fp8_rowwise"`` or ``"mxfp8"``.
        num_chunks: token chunks pipelined to overlap all-to-all with compute.
        recompute: ``"none"``, ``"moe"`` (recompute the up projection) or ``"full"``.
        fp8_dispatch: with an FP8 precision, send the dispatch payload quantized (DeepSeek-V3
            does; the combine and all gradients stay bf16).
        dispatcher: ``"torch_moe"`` (``expert_parallel_moe_ffn``: separate exchanges of counts,
            rows, ids and weights) or ``"fused"`` (one call per stage, DeepEP-style); sets the
            number of all-to-all latencies paid.
    """

    ep: int = 1
    etp: int = 1
    dispatch: str = "dedup"
    precision: str = "bf16"
    num_chunks: int = 1
    recompute: str = "none"
    fp8_dispatch: bool = True
    dispatcher: str = "torch_moe"

    def __post_init__(self):
        owner = "MoEStrategy"
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"{owner}: unknown dispatcher {self.dispatcher!r}: expected one of "
                             f"{DISPATCHERS}")
        for name in ("ep", "etp", "num_chunks"):
            _pos_int(owner, name, getattr(self, name))
        if self.dispatch not in comm_cost.DISPATCH_METHODS:
            raise ValueError(f"{owner}: unknown dispatch {self.dispatch!r}: expected one of "
                             f"{comm_cost.DISPATCH_METHODS}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"{owner}: unknown precision {self.precision!r}: expected one of "
                             f"{PRECISIONS}")
        if self.recompute not in memory_cost.RECOMPUTE_MODES:
            raise ValueError(f"{owner}: unknown recompute {self.recompute!r}: expected one of "
                             f"{memory_cost.RECOMPUTE_MODES}")


@dataclass(frozen=True)
class MoELayerCost:
    """One micro-batch of one MoE layer on the slowest rank, forward + backward. Seconds
    unless named ``_bytes``.

    ``compute_s`` is everything on the compute stream (expert GEMMs, shared experts, router,
    quantize kernels, memory-bound elementwise kernels, page faults, fixed host work);
    ``a2a_s`` all token communication; ``total_s`` the pipelined time, so ``exposed_a2a_s =
    total_s - compute_s`` is the communication compute did not hide. ``dispatch_rows`` /
    ``dispatch_bytes``: rows one rank dispatches per micro-batch (its own copies included, as
    ``_dispatch_plan`` counts them) and their bytes; a dedup row carries ``min(k, E / ep)``
    (id, weight) pairs, so with a very narrow ``D`` dedup can move more bytes than plain in
    fewer rows.
    """

    expert_gemm_s: float
    shared_gemm_s: float
    router_s: float
    quant_s: float
    elementwise_s: float
    page_fault_s: float
    host_s: float
    a2a_s: float
    total_s: float
    dispatch_rows: float
    dispatch_bytes: float
    rows: float
    imbalance: float
    activation_bytes: float

    @property
    def compute_s(self) -> float:
        return (self.expert_gemm_s + self.shared_gemm_s + self.router_s + self.quant_s
                + self.elementwise_s + self.page_fault_s + self.host_s)

    @property
    def exposed_a2a_s(self) -> float:
        return max(0.0, self.total_s - self.compute_s)


# All-to-all calls per stage of one chunk. ``"torch_moe"``: :func:`torch_moe.distributed.
# dispatch.expert_parallel_moe_ffn` exchanges the counts (one synchronising call), then rows,
# expert ids and routing weights separately; backward returns the gradients of the rows and of
# the weights. ``"fused"``: one call per stage with ids and weights inside the row (DeepEP).
DISPATCHERS = ("torch_moe", "fused")
_DISPATCHER_CALLS = {
    "torch_moe": dict(dispatch=4, combine=1, combine_backward=1, dispatch_backward=2),
    "fused": dict(dispatch=1, combine=1, combine_backward=1, dispatch_backward=1),
}


def expert_counts(num_experts: int, assignments: float, load="uniform") -> list[float]:
    """Expected per-expert token counts summing to ``assignments``.

    ``load``: ``"uniform"``; a Zipf exponent ``s >= 0`` (the shape of
    :func:`torch_moe.distributed.placement.zipf_load` with 1024 draws per expert and seed 0,
    normalised, so hot experts land on random ids and the same exponent always gives the same
    shape); or per-expert counts / weights (a tensor or list of ``E`` numbers), rescaled.
    """
    _check_num_experts("expert_counts", num_experts)
    if not (isinstance(assignments, (int, float)) and not isinstance(assignments, bool)
            and math.isfinite(assignments) and assignments >= 0):
        raise ValueError(f"expected assignments to be a finite number >= 0, but got "
                         f"{assignments!r}")
    if isinstance(load, str):
        if load != "uniform":
            raise ValueError(f"unknown load {load!r}: expected 'uniform', a Zipf exponent or "
                             "per-expert counts")
        return [assignments / num_experts] * num_experts
    if isinstance(load, (int, float)) and not isinstance(load, bool):
        if not (math.isfinite(load) and load >= 0):
            raise ValueError(f"expected a Zipf exponent >= 0, but got {load}")
        shape = _zipf_shape(num_experts, float(load))
    else:
        shape = gemm_cost.as_counts(load, "load")
        if len(shape) != num_experts:
            raise ValueError(f"expected load of {num_experts} experts, but got {len(shape)}")
    total = sum(shape)
    if total == 0:
        raise ValueError("expected load with at least one non-zero count, but all are zero")
    return [assignments * c / total for c in shape]


@functools.lru_cache(maxsize=256)
def _zipf_shape(num_experts: int, exponent: float) -> tuple:
    return tuple(zipf_load(num_experts, exponent, 1024 * num_experts, seed=0).tolist())


def _rank_slices(counts: list[float], ep: int) -> list[tuple]:
    g = len(counts) // ep
    return [tuple(counts[r * g:(r + 1) * g]) for r in range(ep)]


def rank_imbalance(counts, ep: int) -> float:
    """Rows of the most loaded of ``ep`` ranks (contiguous blocks of ``E / ep`` experts) over
    the mean; 1.0 for an all-zero load."""
    counts = gemm_cost.as_counts(counts)
    _pos_int("rank_imbalance", "ep", ep)
    if len(counts) % ep != 0:
        raise ValueError(f"num_experts={len(counts)} is not divisible by ep={ep}")
    loads = [sum(s) for s in _rank_slices(counts, ep)]
    mean = sum(loads) / ep
    return max(loads) / mean if mean > 0 else 1.0


def _chunk_times(profile, precision, rank_counts, layer, strategy, f_local, chunk):
    """(forward_s, backward_s, recompute_s) of the expert GEMMs of one rank for one chunk."""
    counts = [c / chunk for c in rank_counts]
    t = gemm_cost.expert_ffn_time(profile, precision, counts, layer.dim, f_local, layer.gated,
                                  recompute_up=strategy.recompute == "moe")
    return t.forward_s, t.dgrad_s + t.wgrad_s, t.recompute_s


def moe_layer_cost(layer: MoELayerSpec, strategy: MoEStrategy, profile: DeviceProfile,
                   tokens_per_rank: float | None = None, gpus_per_node: int = 8,
                   load="uniform") -> MoELayerCost:
    """Forward + backward cost of one micro-batch of ``layer`` on the slowest rank.

    Args:
        tokens_per_rank: ``T``. May be omitted when ``load`` is explicit counts, which then
            are the group's assignments (``T = sum / (ep * etp * k)``); when both are given the
            counts are taken as a shape and rescaled to ``ep * etp * T * k``.
        gpus_per_node: ranks per node (sets which traffic crosses the network).
        load: see :func:`expert_counts`.
    """
    if not isinstance(layer, MoELayerSpec) or not isinstance(strategy, MoEStrategy):
        raise ValueError("expected an MoELayerSpec and an MoEStrategy, but got "
                         f"{type(layer).__name__} and {type(strategy).__name__}")
    if not isinstance(profile, DeviceProfile):
        raise ValueError(f"moe_layer_cost: expected profile to be a DeviceProfile, but got "
                         f"{type(profile).__name__}")
    ep, etp, k, E = strategy.ep, strategy.etp, layer.top_k, layer.num_experts
    if E % ep != 0:
        raise ValueError(f"num_experts={E} is not divisible by ep={ep}: expert parallelism "
                         "places the same number of experts on every rank")
    if layer.hidden_dim % etp != 0:
        raise ValueError(f"hidden_dim={layer.hidden_dim} is not divisible by etp={etp}")
    profile.check_precision(strategy.precision)
    if strategy.dispatch == "node_limited" and layer.max_nodes is None:
        raise ValueError("dispatch 'node_limited' needs a layer with max_nodes (node-limited "
                         "routing), but the layer has max_nodes=None")
    group = ep * etp
    if tokens_per_rank is None:
        if isinstance(load, str) or isinstance(load, (int, float)):
            raise ValueError("tokens_per_rank is required unless load is per-expert counts")
        raw = gemm_cost.as_counts(load, "load")
        tokens_per_rank = sum(raw) / (group * k)
    if isinstance(tokens_per_rank, bool) or not isinstance(tokens_per_rank, (int, float)) \
            or not (math.isfinite(tokens_per_rank) and tokens_per_rank >= 0):
        raise ValueError(f"expected tokens_per_rank to be a finite number >= 0, but got "
                         f"{tokens_per_rank!r}")
    T = float(tokens_per_rank)
    counts = expert_counts(E, group * T * k, load) if T > 0 else [0.0] * E
    # a skewed load hits fewer ranks per token: dedup sends fewer copies
    shares = [sum(s) for s in _rank_slices(counts, ep)] if sum(counts) > 0 else None
    traffic = comm_cost.dispatch_traffic(E, k, ep, etp, gpus_per_node, strategy.dispatch,
                                         layer.max_nodes, shares)
    c = strategy.num_chunks
    prec = strategy.precision
    f_local = layer.hidden_dim // etp
    D = layer.dim
    quantized = prec in ("fp8_rowwise", "mxfp8")
    # bytes per element of activations and weight gradients: the layer's own dtype (fp32 for
    # an fp32 layer, else bf16; FP8 layers keep bf16 activations around their GEMMs)
    act_b = 4 if prec == "fp32" else 2

    # Dense work on the rank's own tokens: shared experts and router (one group each).
    Tc = T / c
    shared_f = shared_b = 0.0
    if layer.shared_width:
        st = gemm_cost.expert_ffn_time(profile, prec, [Tc], D, layer.shared_width, layer.gated,
                                       recompute_up=strategy.recompute == "moe")
        shared_f, shared_b = st.forward_s, st.backward_s
    # the router computes in fp32 whatever the layer's dtype (torch_moe.nn.MoE: x.float() @
    # weight.float().t()); a device without fp32 GEMMs in its profile runs it in prec
    router_f = gemm_cost.grouped_gemm_time_s(profile, "fp32" if "fp32" in profile.peak_flops
                                             else prec, [Tc], E, D)
    router_b = 2 * router_f
    h_local = (2 if layer.gated else 1) * f_local
    w_elems = (E // ep) * layer.matrices * D * f_local
    n_fwd = 2 if strategy.recompute == "full" else 1

    def rank_work(rank_counts) -> dict:
        """Per-chunk seconds of everything that depends on the rank's expert rows."""
        fwd, bwd, rec = _chunk_times(profile, prec, rank_counts, layer, strategy, f_local, c)
        rows_c = sum(rank_counts) / c
        # Quantize kernels (see the module note of gemm_cost): forward quantizes the dispatched
        # rows (on the sender when the payload is FP8), the activation and the weights;
        # backward the output gradient and dH both row- and column-wise, the column-wise
        # copies of the saved operands, and the weights again.
        quant_f = quant_b = 0.0
        if quantized:
            q = functools.partial(gemm_cost.quantize_time_s, profile, prec)
            quant_f = (q(Tc, D) if strategy.fp8_dispatch else q(rows_c, D)) \
                + q(rows_c, f_local) + q(w_elems / D, D)
            quant_b = 3 * q(rows_c, D) + 2 * q(rows_c, h_local) + q(rows_c, f_local) \
                + q(w_elems / D, D)
        # Elementwise kernels around the expert GEMMs (row gather, activation, weighting,
        # scatter-add; gemm_cost.ffn_elementwise_bytes) at their own rate, and the router's
        # softmax / top-k (read and write T x E fp32, twice as much in backward) streaming.
        # (the hidden-width kernels at their own rate, everything else at elementwise_Bps)
        (ffn_f, hid_f), (ffn_b, hid_b) = gemm_cost.ffn_elementwise_split_bytes(
            rows_c, Tc, D, f_local, layer.gated, act_b)
        router_bytes = Tc * E * 8 / profile.memory_bandwidth_Bps
        if act_b != 4:
            # the fp32 router converts its input (read act_b, write 4 B per element) and
            # backward the input's gradient back (read 4 B, write act_b)
            ffn_f += Tc * D * (act_b + 4)
            ffn_b += Tc * D * (act_b + 4)
        if group > 1:
            # the sender gathers its rows into the send buffer (read + write), then reads the
            # returned rows into an fp32 [T, D] sum; backward gathers the output gradient for
            # the return trip and scatter-adds the rows' gradients into grad_x
            sent = Tc * traffic.copies * D * act_b
            ffn_f += 3 * sent + Tc * D * 4 * 2
            ffn_b += 3 * sent + Tc * D * 4 * 2
        hidden_rate = profile.elementwise_hidden_rate_Bps
        ew_f = ffn_f / profile.elementwise_Bps + hid_f / hidden_rate + router_bytes
        ew_b = ffn_b / profile.elementwise_Bps + hid_b / hidden_rate + 2 * router_bytes
        # Fresh allocations (page faults on the CPU): forward's hidden and fp32 output
        # accumulator; backward's fp32 grad_x and the weight gradients, new on every call.
        alloc_f, alloc_b = gemm_cost.ffn_fresh_allocations(rows_c, Tc, D, f_local, E // ep,
                                                           layer.gated, act_b)
        pf_f = gemm_cost.fresh_alloc_time_s(profile, alloc_f)
        pf_b = gemm_cost.fresh_alloc_time_s(profile, alloc_b)
        work = dict(fwd=fwd, bwd=bwd, rec=rec, quant_f=quant_f, quant_b=quant_b, ew_f=ew_f,
                    ew_b=ew_b, pf_f=pf_f, pf_b=pf_b, rows=sum(rank_counts))
        work["key"] = (fwd + quant_f + ew_f + pf_f) * n_fwd + bwd + rec + quant_b \
            + ew_b + pf_b
        return work

    # The slowest rank sets the time; ranks with the same counts cost the same, so each
    # distinct slice is priced once.
    per_rank = [rank_work(s) for s in set(_rank_slices(counts, ep))]
    w = max(per_rank, key=lambda v: (v["key"], v["rows"]))
    fwd_e, bwd_e, rec_e, rows = w["fwd"], w["bwd"], w["rec"], w["rows"]
    quant_f, quant_b, ew_f, ew_b, pf_f, pf_b = (w[n] for n in (
        "quant_f", "quant_b", "ew_f", "ew_b", "pf_f", "pf_b"))
    mean_rows = group * T * k / ep
    imbalance = max(v["rows"] for v in per_rank) / mean_rows if mean_rows > 0 else 1.0

    # Token traffic per chunk on the slowest rank's receive side.
    # A dispatched row carries the token (FP8 with its scales when the payload is quantized)
    # and its W (expert id int32, routing weight fp32) pairs: W = 1 for plain dispatch, up to
    # min(k, E / ep) for dedup, whose one row serves all the token's experts on a rank.
    pairs = 1 if strategy.dispatch == "plain" else min(k, E // ep)
    disp_row = D * (gemm_cost.element_bytes(prec) if quantized and strategy.fp8_dispatch
                    else act_b) + pairs * 8
    if quantized and strategy.fp8_dispatch:
        disp_row += gemm_cost.scale_bytes(prec, 1, D) if prec == "fp8_rowwise" else D / 32
    comb_row = D * act_b
    calls = _DISPATCHER_CALLS[strategy.dispatcher]

    def a2a(row_bytes: float, stage: str) -> float:
        if group == 1:
            return 0.0  # no expert parallelism: the layer sends nothing
        scale = Tc * imbalance * row_bytes
        intra = scale * (traffic.intra_copies + traffic.copies * (etp - 1))
        inter = scale * traffic.inter_copies
        return comm_cost.all_to_all_time_s(profile, intra, inter, calls[stage])

    d_f, q_f = a2a(disp_row, "dispatch"), a2a(comb_row, "combine")
    # backward: the combine's gradient goes out, the rows' (and routing weights') come back
    d_b = a2a(comb_row, "combine_backward")
    q_b = a2a(comb_row + pairs * 4, "dispatch_backward")
    # fixed host cost of a layer call, split like the FLOPs: a third in forward; with expert
    # parallelism, the dispatcher's host work per dispatched row, half in each pass
    host_f, host_b = profile.layer_overhead_s / 3, 2 * profile.layer_overhead_s / 3
    if group > 1:
        rows_out = Tc * traffic.copies * profile.dispatch_row_s / 2
        host_f, host_b = host_f + rows_out, host_b + rows_out
    p_f = fwd_e + shared_f + router_f + quant_f + ew_f + pf_f + host_f
    p_b = bwd_e + rec_e + shared_b + router_b + quant_b + ew_b + pf_b + host_b
    if strategy.recompute == "full":
        # backward reruns the forward, its all-to-alls included
        p_b, d_b, q_b = p_b + p_f, d_b + d_f, q_b + q_f

    # the fraction of the shorter stage a chunk hides behind the longer one: measured on the
    # CPU (calibrate.measure_overlap_efficiency: an all-to-all in flight during GEMMs on gloo);
    # unmeasured (None, the GPU profiles) is taken as a perfect pipeline
    eta = 1.0 if profile.overlap_efficiency is None else profile.overlap_efficiency

    def pipelined(d: float, p: float, q_: float) -> float:
        comm = d + q_
        return comm + p + (c - 1) * (max(comm, p) + (1.0 - eta) * min(comm, p))

    total = pipelined(d_f, p_f, q_f) + pipelined(d_b, p_b, q_b)
    expert_gemm = c * (fwd_e + bwd_e + rec_e + (fwd_e if strategy.recompute == "full" else 0))
    shared = c * (shared_f + shared_b + (shared_f if strategy.recompute == "full" else 0))
    router = c * (router_f * n_fwd + router_b)
    quant = c * (quant_f * n_fwd + quant_b)
    elementwise = c * (ew_f * n_fwd + ew_b)
    host = c * (host_f * n_fwd + host_b)
    page_fault = c * (pf_f * n_fwd + pf_b)
    a2a_total = c * (d_f + q_f + d_b + q_b)
    act = memory_cost.moe_activation_bytes(T, rows, D, f_local, k, prec, strategy.recompute,
                                           layer.gated, layer.shared_width, E,
                                           dispatched=group > 1, act_bytes=act_b)
    return MoELayerCost(
        expert_gemm_s=expert_gemm, shared_gemm_s=shared, router_s=router, quant_s=quant,
        elementwise_s=elementwise, page_fault_s=page_fault, host_s=host, a2a_s=a2a_total,
        total_s=total,
        dispatch_rows=T * traffic.copies, dispatch_bytes=T * traffic.copies * disp_row,
        rows=rows, imbalance=imbalance,
        activation_bytes=act)

