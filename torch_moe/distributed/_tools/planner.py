"""Rank the ways to train an MoE model on a cluster by predicted step time under the memory limit.

Given a :class:`ModelSpec` (an MoE layer shape, layer counts, attention, vocabulary, tokens per
batch) and a :class:`ClusterSpec` (a device profile, GPUs per node, nodes), :func:`plan`
enumerates :class:`Strategy` choices (EP and ETP degrees, dispatch method, expert GEMM
precision per MoE layer, chunk count, recompute, ZeRO-1 or FSDP sharding, micro-batch size),
prices each with :func:`estimate_step` and ranks the feasible ones. :func:`format_plan` prints
the table and why the winner beats the runner-up.

Scope. Outside the experts every rank is data parallel (ZeRO-1 or FSDP over all ranks);
there is no tensor, context or pipeline parallelism for the dense part. Pipeline parallelism
(DeepSeek-V3's DualPipe) is left out: it changes the memory per rank (1/PP of the layers) and
adds bubbles whose size depends on the schedule, which this model does not simulate. The
attention is a FLOP and byte count per token (:class:`AttentionSpec`), not a kernel model.
Multi-token-prediction modules are not counted.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from torch_moe.distributed._tools import comm_cost, gemm_cost, memory_cost
from torch_moe.distributed._tools.cost_model import MoELayerCost, MoELayerSpec, MoEStrategy, \
    moe_layer_cost
from torch_moe.distributed._tools.device_profiles import DeviceProfile, get_profile

__all__ = [
    "AttentionSpec",
    "ModelSpec",
    "ClusterSpec",
    "Strategy",
    "StepCost",
    "Plan",
    "estimate_step",
    "candidate_strategies",
    "plan",
    "format_plan",
    "deepseek_v3",
    "mixtral_8x7b",
]

_GiB = 2**30


def _pos_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: expected {name} to be a positive int, but got {value!r}")


# per-layer tuples (one precision per MoE layer) are built: bound the layer count so that an
# absurd one is an error, not a memory blow-up
MAX_LAYERS = 1 << 16


def _check_type(owner: str, name: str, value, cls) -> None:
    if not isinstance(value, cls):
        raise ValueError(f"{owner}: expected {name} to be a {cls.__name__} instance, but got "
                         f"{type(value).__name__}")


@dataclass(frozen=True)
class AttentionSpec:
    """One attention block as counts per token.

    Attributes:
        params: weights of the block (projections; norms are negligible).
        num_heads, qk_head_dim, v_head_dim: set the causal score / value FLOPs,
            ``num_heads * (qk_head_dim + v_head_dim) * seq_len`` per token forward (half of the
            dense ``2 * h * (d_qk + d_v) * s`` under the causal mask).
        activation_bytes_per_token: bytes saved for backward per token without recompute.
    """

    params: int
    num_heads: int
    qk_head_dim: int
    v_head_dim: int
    activation_bytes_per_token: int

    def __post_init__(self):
        for name in ("params", "num_heads", "qk_head_dim", "v_head_dim",
                     "activation_bytes_per_token"):
            _pos_int("AttentionSpec", name, getattr(self, name))

    def forward_flops_per_token(self, seq_len: int) -> float:
        _pos_int("AttentionSpec", "seq_len", seq_len)
        return 2.0 * self.params + self.num_heads * (self.qk_head_dim + self.v_head_dim) \
            * seq_len

    @classmethod
    def gqa(cls, dim: int, num_heads: int, num_kv_heads: int, head_dim: int) -> "AttentionSpec":
        """Grouped-query attention (Mixtral, Llama): q, k, v, o projections."""
        for name, v in (("dim", dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
            _pos_int("AttentionSpec.gqa", name, v)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"AttentionSpec.gqa: num_heads={num_heads} is not divisible by "
                             f"num_kv_heads={num_kv_heads}")
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        params = dim * q + 2 * dim * kv + q * dim
        # bf16: norm input and output, q, k, v, attention output; fp32 softmax stats per head
        act = 2 * (2 * dim + 2 * q + 2 * kv) + 4 * num_heads
        return cls(params, num_heads, head_dim, head_dim, act)

    @classmethod
    def mla(cls, dim: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
            qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> "AttentionSpec":
        """Multi-head latent attention (DeepSeek-V2/V3): low-rank q and kv projections."""
        for name, v in (("dim", dim), ("num_heads", num_heads), ("q_lora_rank", q_lora_rank),
                        ("kv_lora_rank", kv_lora_rank), ("qk_nope_head_dim", qk_nope_head_dim),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            _pos_int("AttentionSpec.mla", name, v)
        qk = qk_nope_head_dim + qk_rope_head_dim
        params = (dim * q_lora_rank + q_lora_rank * num_heads * qk
                  + dim * (kv_lora_rank + qk_rope_head_dim)
                  + kv_lora_rank * num_heads * (qk_nope_head_dim + v_head_dim)
                  + num_heads * v_head_dim * dim)
        act = 2 * (2 * dim + q_lora_rank + kv_lora_rank + qk_rope_head_dim
                   + 2 * num_heads * qk + 2 * num_heads * v_head_dim) + 4 * num_heads
        return cls(params, num_heads, qk, v_head_dim, act)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer.

    Attributes:
        moe: the MoE layer (all MoE layers share it).
        num_layers: transformer blocks; the first ``num_dense_layers`` have a dense FFN of width
            ``dense_hidden_dim`` instead of the MoE.
        attention: the attention block of every layer.
        vocab_size: embedding and (untied) output head rows.
        seq_len: tokens per sequence. tokens_per_batch: tokens per optimizer step, all ranks.
    """

    name: str
    moe: MoELayerSpec
    num_layers: int
    attention: AttentionSpec
    vocab_size: int
    seq_len: int
    tokens_per_batch: int
    num_dense_layers: int = 0
    dense_hidden_dim: int | None = None

    def __post_init__(self):
        owner = "ModelSpec"
        _check_type(owner, "moe", self.moe, MoELayerSpec)
        _check_type(owner, "attention", self.attention, AttentionSpec)
        for name in ("num_layers", "vocab_size", "seq_len", "tokens_per_batch"):
            _pos_int(owner, name, getattr(self, name))
        if self.num_layers > MAX_LAYERS:
            raise ValueError(f"{owner}: expected num_layers <= {MAX_LAYERS}, but got "
                             f"{self.num_layers}")
        if isinstance(self.num_dense_layers, bool) or not isinstance(
                self.num_dense_layers, int) or not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(f"{owner}: expected num_dense_layers to be an int in [0, "
                             f"num_layers={self.num_layers}], but got {self.num_dense_layers!r}")
        if self.num_dense_layers and self.dense_hidden_dim is None:
            raise ValueError(f"{owner}: expected dense_hidden_dim for num_dense_layers="
                             f"{self.num_dense_layers}, but got None")
        if self.dense_hidden_dim is not None:
            _pos_int(owner, "dense_hidden_dim", self.dense_hidden_dim)
        if self.tokens_per_batch % self.seq_len != 0:
            raise ValueError(f"ModelSpec: tokens_per_batch={self.tokens_per_batch} is not a "
                             f"multiple of seq_len={self.seq_len}")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def dense_params(self) -> int:
        """Parameters outside the routed experts (attention, dense FFNs, shared experts,
        routers, embedding and head)."""
        d = self.moe.dim
        ffn = self.moe.matrices * d * (self.dense_hidden_dim or 0)
        return (self.num_layers * self.attention.params + self.num_dense_layers * ffn
                + self.num_moe_layers * self.moe.dense_params + 2 * self.vocab_size * d)

    @property
    def expert_params(self) -> int:
        return self.num_moe_layers * self.moe.expert_params

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` nodes of ``gpus_per_node`` devices described by ``profile``; a rank may
    use ``memory_fraction`` of the device memory (the rest: allocator fragmentation, runtime
    context, communication buffers)."""

    profile: DeviceProfile
    gpus_per_node: int
    num_nodes: int
    memory_fraction: float = 0.9

    def __post_init__(self):
        _pos_int("ClusterSpec", "gpus_per_node", self.gpus_per_node)
        _pos_int("ClusterSpec", "num_nodes", self.num_nodes)
        if not isinstance(self.profile, DeviceProfile):
            raise ValueError(f"ClusterSpec: expected a DeviceProfile, but got "
                             f"{type(self.profile).__name__}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"ClusterSpec: expected memory_fraction in (0, 1], but got "
                             f"{self.memory_fraction}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def memory_limit_bytes(self) -> float:
        return self.profile.memory_bytes * self.memory_fraction


@dataclass(frozen=True)
class Strategy:
    """One way to run the model. ``precision`` is one name for every MoE layer or a tuple with
    one per MoE layer. ``micro_batch_seqs`` sequences per rank per micro-batch; gradient
    accumulation covers the rest of the batch."""

    ep: int = 1
    etp: int = 1
    dispatch: str = "dedup"
    precision: str | tuple = "bf16"
    num_chunks: int = 1
    recompute: str = "none"
    sharding: str = "fsdp"
    micro_batch_seqs: int = 1

    def __post_init__(self):
        _pos_int("Strategy", "micro_batch_seqs", self.micro_batch_seqs)
        if not isinstance(self.precision, (str, tuple)) or self.precision == ():
            raise ValueError(f"Strategy: expected precision to be a precision name or a "
                             f"non-empty tuple of them, but got {self.precision!r}")
        if self.sharding not in memory_cost.SHARDING_MODES:
            raise ValueError(f"Strategy: unknown sharding {self.sharding!r}: expected one of "
                             f"{memory_cost.SHARDING_MODES}")
        for p in self.precisions_set:
            MoEStrategy(precision=p)  # validates the name
        self.moe_strategy(self.precisions_set[0])  # validates the rest

    @property
    def precisions_set(self) -> tuple:
        return (self.precision,) if isinstance(self.precision, str) else tuple(
            dict.fromkeys(self.precision))

    def layer_precisions(self, num_moe_layers: int) -> tuple:
        if isinstance(self.precision, str):
            return (self.precision,) * num_moe_layers
        if len(self.precision) != num_moe_layers:
            raise ValueError(f"Strategy: expected one precision per MoE layer "
                             f"({num_moe_layers}), but got {len(self.precision)}")
        return tuple(self.precision)

    def moe_strategy(self, precision: str) -> MoEStrategy:
        return MoEStrategy(self.ep, self.etp, self.dispatch, precision, self.num_chunks,
                           self.recompute)

    def label(self) -> str:
        if isinstance(self.precision, str):
            prec = self.precision
        else:
            counts = {p: self.precision.count(p) for p in self.precisions_set}
            prec = "+".join(f"{p}x{n}" for p, n in counts.items())
        return (f"EP{self.ep} ETP{self.etp} {self.dispatch} {prec} c{self.num_chunks} "
                f"rc={self.recompute} {self.sharding} mb{self.micro_batch_seqs}")


@dataclass(frozen=True)
class StepCost:
    """Predicted optimizer step on the slowest rank. Seconds per step unless ``_bytes``."""

    strategy: Strategy
    step_s: float
    memory_bytes: float
    memory_limit_bytes: float
    compute_s: float
    a2a_s: float
    exposed_a2a_s: float
    fsdp_s: float
    exposed_fsdp_s: float
    quant_s: float
    optimizer_s: float
    micro_batches: int
    memory_breakdown: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes


def _dense_time(profile: DeviceProfile, flops: float, rows: float) -> float:
    return flops / profile.gemm_flops("bf16", rows) if flops else 0.0


def estimate_step(model: ModelSpec, cluster: ClusterSpec, strategy: Strategy,
                  optimizer: memory_cost.OptimizerSpec = memory_cost.ADAMW_MIXED,
                  load="uniform", _cache: dict | None = None) -> StepCost:
    """Step time and peak memory per rank of ``model`` on ``cluster`` under ``strategy``.

    Raises ``ValueError`` for a strategy the cluster cannot lay out (EP * ETP not dividing the
    ranks, ``E`` not divisible by EP, a batch that does not split into micro-batches, a
    precision the device lacks).
    """
    owner = "estimate_step"
    _check_type(owner, "model", model, ModelSpec)
    _check_type(owner, "cluster", cluster, ClusterSpec)
    _check_type(owner, "strategy", strategy, Strategy)
    _check_type(owner, "optimizer", optimizer, memory_cost.OptimizerSpec)
    prof, W, gpn = cluster.profile, cluster.world_size, cluster.gpus_per_node
    ep, etp = strategy.ep, strategy.etp
    if W % (ep * etp) != 0:
        raise ValueError(f"ep * etp = {ep * etp} does not divide the {W} ranks")
    if "bf16" not in prof.peak_flops:
        raise ValueError(f"{prof.name} has no bf16 GEMMs, which the dense layers need")
    comm_cost.ep_nodes(ep, etp, gpn)
    seqs_per_rank = model.tokens_per_batch / model.seq_len / W
    if seqs_per_rank != int(seqs_per_rank) or int(seqs_per_rank) % strategy.micro_batch_seqs:
        raise ValueError(f"tokens_per_batch={model.tokens_per_batch} gives "
                         f"{seqs_per_rank:g} sequences per rank, not a multiple of "
                         f"micro_batch_seqs={strategy.micro_batch_seqs}")
    micro_batches = int(seqs_per_rank) // strategy.micro_batch_seqs
    T = strategy.micro_batch_seqs * model.seq_len
    D, layer = model.moe.dim, model.moe
    rc = strategy.recompute
    n_fwd = 2 if rc == "full" else 1

    # MoE layers, one cost per distinct precision
    precisions = strategy.layer_precisions(model.num_moe_layers)
    moe_costs: dict[str, MoELayerCost] = {}
    for p in dict.fromkeys(precisions):
        ms = strategy.moe_strategy(p)
        key = (layer, ms, T, gpn, id(prof), load if isinstance(load, (str, float, int)) else None)
        cost = _cache.get(key) if _cache is not None and key[-1] is not None else None
        if cost is None:
            cost = moe_layer_cost(layer, ms, prof, T, gpn, load)
            if _cache is not None and key[-1] is not None:
                _cache[key] = cost
        moe_costs[p] = cost
    moe = [moe_costs[p] for p in precisions]

    # Dense parts per micro-batch: attention of every layer, dense FFNs, embedding + head.
    attn_f = _dense_time(prof, T * model.attention.forward_flops_per_token(model.seq_len), T)
    ffn_f = 0.0
    if model.num_dense_layers:
        ffn = gemm_cost.expert_ffn_time(prof, "bf16", [T], D, model.dense_hidden_dim,
                                        layer.gated)
        ffn_f, ffn_b = ffn.forward_s, ffn.backward_s
    # memory-bound kernels around attention (norms, rope, residual adds, softmax statistics):
    # about three passes over the saved bytes forward, twice that backward
    attn_f += 3 * T * model.attention.activation_bytes_per_token / prof.memory_bandwidth_Bps
    head_f = _dense_time(prof, 2.0 * T * D * model.vocab_size, T)
    dense_s = (model.num_layers * attn_f * (n_fwd + 2) + head_f * 3
               + (model.num_dense_layers * (ffn_f * n_fwd + ffn_b) if ffn_f else 0.0))

    mb_compute = dense_s + sum(c.compute_s for c in moe)
    mb_a2a = sum(c.a2a_s for c in moe)
    mb_time = dense_s + sum(c.total_s for c in moe)
    mb_exposed_a2a = mb_time - mb_compute

    # Sharded model states: dense parameters over all ranks, experts over the ranks that hold
    # the same expert shard (expert data parallel).
    edp = W // (ep * etp)
    expert_local = model.expert_params / (ep * etp)
    sh = strategy.sharding
    states = (memory_cost.model_state_bytes(model.dense_params, W, sh, optimizer)
              + memory_cost.model_state_bytes(expert_local, edp, sh, optimizer))
    spans = cluster.num_nodes > 1
    layer_dense = model.attention.params + layer.dense_params
    layer_expert = layer.expert_params / (ep * etp)
    o = optimizer
    if sh == "fsdp":
        # per micro-batch: all-gather each layer forward and backward, reduce-scatter grads
        per_layer = (2 * comm_cost.ring_collective_time_s(prof, layer_dense * o.param_bytes, W,
                                                          spans)
                     + comm_cost.ring_collective_time_s(prof, layer_dense * o.grad_bytes, W,
                                                        spans)
                     + 2 * comm_cost.ring_collective_time_s(prof, layer_expert * o.param_bytes,
                                                            edp, spans)
                     + comm_cost.ring_collective_time_s(prof, layer_expert * o.grad_bytes, edp,
                                                        spans))
        fsdp_s = micro_batches * model.num_layers * per_layer
        # the current and the prefetched layer unsharded, and one layer of unsharded grads
        buffers = (layer_dense + layer_expert) * (2 * o.param_bytes + o.grad_bytes)
    else:
        # once per step: reduce-scatter the accumulated grads, all-gather the updated params
        fsdp_s = (comm_cost.ring_collective_time_s(prof, model.dense_params * (
            o.grad_bytes + o.param_bytes), W, spans) + comm_cost.ring_collective_time_s(
            prof, expert_local * (o.grad_bytes + o.param_bytes), edp, spans))
        buffers = 0.0
    # The network is free for FSDP traffic while the token all-to-all is not using it.
    link_idle = micro_batches * max(0.0, mb_time - mb_a2a)
    exposed_fsdp = max(0.0, fsdp_s - link_idle)

    # both modes shard the master weights and optimizer state the same way
    shard_params = model.dense_params / W + expert_local / edp
    optimizer_s = shard_params * (2 * (o.master_bytes + o.state_bytes) + o.grad_bytes
                                  + o.param_bytes) / prof.memory_bandwidth_Bps

    # Peak memory: states + buffers + every layer's saved activations of one micro-batch +
    # the working set of the layer in backward and the fp32 logits.
    attn_act = memory_cost.dense_activation_bytes(T, model.attention.activation_bytes_per_token,
                                                  rc, D)
    ffn_act = 0.0
    if model.num_dense_layers:
        h = (2 if layer.gated else 1) * model.dense_hidden_dim
        ffn_act = memory_cost.dense_activation_bytes(T, 2 * (D + h), rc, D)
    activations = (model.num_layers * attn_act + model.num_dense_layers * ffn_act
                   + sum(c.activation_bytes for c in moe))
    h_local = (2 if layer.gated else 1) * layer.hidden_dim // etp
    working = max(c.rows for c in moe) * (D + 2 * h_local) * 2 + T * model.vocab_size * 4
    memory = states + buffers + activations + working

    step = micro_batches * mb_time + exposed_fsdp + optimizer_s
    return StepCost(
        strategy=strategy, step_s=step, memory_bytes=memory,
        memory_limit_bytes=cluster.memory_limit_bytes,
        compute_s=micro_batches * mb_compute, a2a_s=micro_batches * mb_a2a,
        exposed_a2a_s=micro_batches * mb_exposed_a2a, fsdp_s=fsdp_s,
        exposed_fsdp_s=exposed_fsdp, quant_s=micro_batches * sum(c.quant_s for c in moe),
        optimizer_s=optimizer_s, micro_batches=micro_batches,
        memory_breakdown={"model_states": states, "fsdp_buffers": buffers,
                          "activations": activations, "working": working})


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_strategies(model: ModelSpec, cluster: ClusterSpec,
                         chunks=None, micro_batch_seqs=(1, 2, 4)) -> list[Strategy]:
    """Every strategy the cluster can lay out: EP dividing ``E``; ETP a power of two inside a
    node dividing ``F``; ``ep * etp`` dividing the ranks and fitting the node layout; every
    dispatch method the model allows; each precision the device has, uniformly and with the
    first and last MoE layers kept in bf16 (a common FP8 recipe); the given chunk counts and
    micro-batch sizes that split the batch; all recompute and sharding modes.

    ``chunks=None`` tries 1, 2 and 4 chunks where the device profile's overlap was measured
    (``overlap_efficiency`` set, as :func:`~torch_moe.distributed._tools.calibrate.
    calibrate_local` does with a process group), and only 1 where it was not: the pipeline
    term would otherwise pick chunking from an assumed perfect overlap."""
    owner = "candidate_strategies"
    _check_type(owner, "model", model, ModelSpec)
    _check_type(owner, "cluster", cluster, ClusterSpec)
    if chunks is None:
        chunks = (1,) if cluster.profile.overlap_efficiency is None else (1, 2, 4)
    for name, values in (("chunks", chunks), ("micro_batch_seqs", micro_batch_seqs)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ValueError(f"{owner}: expected {name} to be a sequence of positive ints, but "
                             f"got {values!r}")
        for v in values:
            _pos_int(owner, name, v)
    W, gpn = cluster.world_size, cluster.gpus_per_node
    layer = model.moe
    prof = cluster.profile
    dispatches = ["plain", "dedup"] + (["node_limited"] if layer.max_nodes else [])
    precisions: list = [p for p in ("bf16", "fp8_rowwise", "mxfp8") if p in prof.peak_flops]
    n = model.num_moe_layers
    for p in list(precisions):
        if p != "bf16" and "bf16" in prof.peak_flops and n > 2:
            precisions.append(("bf16",) + (p,) * (n - 2) + ("bf16",))
    seqs_per_rank = model.tokens_per_batch // model.seq_len / W
    out = []
    for ep in _divisors(layer.num_experts):
        for etp in (1, 2, 4, 8):
            if ep * etp > W or W % (ep * etp) or gpn % etp or layer.hidden_dim % etp:
                continue
            try:
                comm_cost.ep_nodes(ep, etp, gpn)
            except ValueError:
                continue
            for d, p, c, rc, sh, mb in itertools.product(
                    dispatches, precisions, chunks, memory_cost.RECOMPUTE_MODES,
                    memory_cost.SHARDING_MODES, micro_batch_seqs):
                if seqs_per_rank != int(seqs_per_rank) or int(seqs_per_rank) % mb:
                    continue
                if ep * etp == 1 and (d != "plain" or c != 1):
                    continue  # no all-to-all: dispatch method and chunking are moot
                out.append(Strategy(ep, etp, d, p, c, rc, sh, mb))
    return out


@dataclass(frozen=True)
class Plan:
    """Feasible strategies fastest first, and the infeasible ones by memory."""

    model: ModelSpec
    cluster: ClusterSpec
    ranked: tuple
    infeasible: tuple

    @property
    def best(self) -> StepCost | None:
        return self.ranked[0] if self.ranked else None


def plan(model: ModelSpec, cluster: ClusterSpec,
         optimizer: memory_cost.OptimizerSpec = memory_cost.ADAMW_MIXED, load="uniform",
         strategies=None) -> Plan:
    """Price every candidate (or the given ``strategies``) and rank the ones that fit."""
    _check_type("plan", "model", model, ModelSpec)
    _check_type("plan", "cluster", cluster, ClusterSpec)
    if strategies is None:
        strategies = candidate_strategies(model, cluster)
    cache: dict = {}
    costs = [estimate_step(model, cluster, s, optimizer, load, cache) for s in strategies]
    if not costs:
        raise ValueError(f"no strategy can be laid out for {model.name} on "
                         f"{cluster.world_size} ranks")
    # times within a part in a million are ties (the same bytes over the same link): the
    # smaller memory footprint wins them
    fits = sorted((c for c in costs if c.fits),
                  key=lambda c: (float(f"{c.step_s:.6g}"), c.memory_bytes))
    over = sorted((c for c in costs if not c.fits), key=lambda c: c.memory_bytes)
    return Plan(model, cluster, tuple(fits), tuple(over))


_COLUMNS = (("compute", "compute_s"), ("a2a", "a2a_s"), ("exp a2a", "exposed_a2a_s"),
            ("fsdp", "fsdp_s"), ("exp fsdp", "exposed_fsdp_s"), ("quant", "quant_s"),
            ("optim", "optimizer_s"))


def _why(win: StepCost, other: StepCost) -> str:
    parts = {
        "exposed all-to-all": other.exposed_a2a_s - win.exposed_a2a_s,
        "compute": (other.compute_s - other.quant_s) - (win.compute_s - win.quant_s),
        "quantize kernels": other.quant_s - win.quant_s,
        "exposed FSDP/ZeRO traffic": other.exposed_fsdp_s - win.exposed_fsdp_s,
        "optimizer step": other.optimizer_s - win.optimizer_s,
    }
    order = sorted(parts.items(), key=lambda kv: -abs(kv[1]))
    said = [f"{name} {'-' if v > 0 else '+'}{abs(v):.3f} s" for name, v in order[:3]
            if abs(v) > 1e-4]
    gain = other.step_s - win.step_s
    if gain <= 1e-3 * other.step_s:
        return (f"ties with {other.strategy.label()} (within 0.1 %), picked for its memory: "
                f"{win.memory_bytes / _GiB:.1f} vs {other.memory_bytes / _GiB:.1f} GiB")
    return (f"beats {other.strategy.label()} by {gain:.3f} s/step "
            f"({100 * gain / other.step_s:.1f} %); winner minus other: " + ", ".join(said)
            + f"; memory {win.memory_bytes / _GiB:.1f} vs {other.memory_bytes / _GiB:.1f} GiB")


def _bottleneck(c: StepCost) -> str:
    if c.exposed_fsdp_s > 0:
        # the network never idles: the step is the sum of what crosses it
        return (f"network-bound: the NIC carries {c.a2a_s:.1f} s of all-to-all and "
                f"{c.fsdp_s:.1f} s of FSDP/ZeRO traffic per step, so every strategy that moves "
                f"the same bytes ties; compute is {c.compute_s:.1f} s")
    if c.exposed_a2a_s > 0.1 * c.step_s:
        return (f"all-to-all-bound: {c.exposed_a2a_s:.1f} s of {c.a2a_s:.1f} s all-to-all is "
                f"not hidden behind {c.compute_s:.1f} s of compute")
    return (f"compute-bound: {c.compute_s:.1f} s of {c.step_s:.1f} s is compute, "
            f"{c.exposed_a2a_s:.1f} s exposed all-to-all")


def format_plan(result: Plan, top: int = 10) -> str:
    """The ranking as a table (seconds per step, GiB per rank) and why the winner wins: its
    bottleneck, the runner-up, and the best strategy that differs in each of dispatch,
    precision, recompute, sharding and parallel layout."""
    _check_type("format_plan", "result", result, Plan)
    _pos_int("format_plan", "top", top)
    m, cl = result.model, result.cluster
    head = (f"{m.name}: {m.params / 1e9:.0f}B params ({m.expert_params / 1e9:.0f}B in experts), "
            f"{m.tokens_per_batch:,} tokens/step on {cl.world_size} x {cl.profile.name} "
            f"({cl.num_nodes} nodes of {cl.gpus_per_node}), limit "
            f"{cl.memory_limit_bytes / _GiB:.1f} GiB/rank")
    widths = [58, 8, 6] + [8] * len(_COLUMNS)
    names = ["strategy", "step s", "GiB"] + [n for n, _ in _COLUMNS]
    lines = [head, " ".join(n.ljust(w) if i == 0 else n.rjust(w)
                            for i, (n, w) in enumerate(zip(names, widths)))]
    rows = list(result.ranked[:top])
    if not rows:
        lines.append("no strategy fits in memory; the smallest:")
        rows = list(result.infeasible[:min(top, 3)])
    for c in rows:
        vals = [c.strategy.label(), f"{c.step_s:.3f}", f"{c.memory_bytes / _GiB:.1f}"]
        vals += [f"{getattr(c, a):.3f}" for _, a in _COLUMNS]
        lines.append(" ".join(v.ljust(w) if i == 0 else v.rjust(w)
                              for i, (v, w) in enumerate(zip(vals, widths))))
    if not result.ranked:
        return "\n".join(lines)
    win = result.ranked[0]
    lines.append(f"winner: {win.strategy.label()}: {_bottleneck(win)}")
    if len(result.ranked) == 1:
        lines.append("why: the only strategy that fits in memory")
        return "\n".join(lines)
    lines.append("vs runner-up: " + _why(win, result.ranked[1]))
    w = win.strategy
    for what, key in (("dispatch", lambda s: s.dispatch), ("precision", lambda s: s.precision),
                      ("recompute", lambda s: s.recompute), ("sharding", lambda s: s.sharding),
                      ("layout", lambda s: (s.ep, s.etp))):
        alt = next((c for c in result.ranked[1:] if key(c.strategy) != key(w)), None)
        if alt is not None:
            lines.append(f"vs best other {what}: " + _why(win, alt))
        elif result.infeasible and any(key(c.strategy) != key(w) for c in result.infeasible):
            lines.append(f"vs other {what}: none fits in memory")
    return "\n".join(lines)


def deepseek_v3(tokens_per_batch: int = 15360 * 4096) -> ModelSpec:
    """DeepSeek-V3 (671B): 61 layers, the first 3 dense (FFN 18432), then 58 MoE layers of 256
    routed experts (F = 2048) + 1 shared, top-8, node-limited to 4 nodes; MLA attention (128
    heads, q / kv LoRA ranks 1536 / 512, qk 128 + 64 rope, v 128); vocabulary 129280. The
    batch ramps to 15360 sequences of 4096 tokens. Source: arXiv 2412.19437, sections 4.2
    (hyper-parameters) and 3.2 (node-limited routing), and config.json of
    https://huggingface.co/deepseek-ai/DeepSeek-V3.

    Published training setup, to compare plans with: 2048 H800 GPUs, 16-way pipeline
    parallelism (DualPipe), 64-way expert parallelism over 8 nodes, ZeRO-1 data parallelism,
    no tensor parallelism, FP8 GEMMs (arXiv 2412.19437, sections 3.2 and 3.3). NVIDIA's
    Megatron-Bridge recipe for the minimum of 32 nodes uses TP2 PP8 EP32 with full recompute
    (https://docs.nvidia.com/nemo/megatron-bridge/0.4.0/apidocs/bridge/bridge.recipes.deepseek.
    deepseek_v3.html)."""
    moe = MoELayerSpec(7168, 2048, 256, 8, num_shared_experts=1, max_nodes=4)
    attn = AttentionSpec.mla(7168, 128, 1536, 512, 128, 64, 128)
    return ModelSpec("DeepSeek-V3", moe, 61, attn, 129280, 4096, tokens_per_batch,
                     num_dense_layers=3, dense_hidden_dim=18432)


def mixtral_8x7b(tokens_per_batch: int = 256 * 4096) -> ModelSpec:
    """Mixtral 8x7B: 32 layers, D = 4096, 8 experts of F = 14336, top-2, GQA with 32 query and
    8 KV heads of 128, vocabulary 32000 (arXiv 2401.04088, table 1). Its training batch is not
    published; the default, 256 sequences of 4096 tokens (1M tokens), is an assumption.

    Mistral AI did not publish the training setup (hardware, parallelism, batch). NVIDIA's
    NeMo predefined Mixtral 8x7B configuration trains on 16 nodes of 8 GPUs
    (https://docs.nvidia.com/nemo-framework/user-guide/latest/LLMs/Mixtral/
    TrainingPredefined.html)."""
    moe = MoELayerSpec(4096, 14336, 8, 2)
    attn = AttentionSpec.gqa(4096, 32, 8, 128)
    return ModelSpec("Mixtral-8x7B", moe, 32, attn, 32000, 4096, tokens_per_batch)


def main() -> None:
    """Print the plans of the report: DeepSeek-V3 on 256 H100s, Mixtral 8x7B on 8 H100s."""
    for model, cluster, opt in (
            (deepseek_v3(), ClusterSpec(get_profile("h100"), 8, 32),
             memory_cost.ADAMW_BF16_MOMENTS),
            (mixtral_8x7b(), ClusterSpec(get_profile("h100"), 8, 1), memory_cost.ADAMW_MIXED),
            (mixtral_8x7b(), ClusterSpec(get_profile("h100"), 8, 1),
             memory_cost.ADAMW_BF16_MOMENTS),
            (mixtral_8x7b(), ClusterSpec(get_profile("h100"), 8, 1), memory_cost.ADAMW_BF16)):
        print(f"optimizer: {opt}")
        print(format_plan(plan(model, cluster, opt)))
        print()


if __name__ == "__main__":
    main()
