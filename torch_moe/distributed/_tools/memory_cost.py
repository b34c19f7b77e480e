"""Bytes one rank holds while training an MoE model: weights, gradients, optimizer state and
saved activations, by sharding and recompute strategy.

Model states. Per parameter, an :class:`OptimizerSpec` gives the bytes of the compute copy
(bf16), the fp32 master copy, the gradient and the optimizer state (Adam's two moments). Under
``"zero1"`` (DeepSeek-V3's ZeRO-1 data parallelism) the compute copy and the gradients are
replicated in the sharding group and only master weights and optimizer state are sharded;
under ``"fsdp"`` (FSDP2 / ZeRO-3) everything is sharded and each layer's compute copy is
all-gathered when needed (two layers' worth live at a time: the current one and the prefetch).

Saved activations of one MoE layer and one micro-batch (``T`` tokens on the rank, ``S`` expert
rows received, ``H = 2F`` for gated activations), following what ``grouped_ffn`` saves
(``torch_moe/_native/cpu.py``: the dispatched rows and the pre-activation ``hidden``; the
activation itself is recomputed):

* ``"none"``: layer input ``T x D``, routing ``T x k`` (ids + weights), received rows
  ``S x D`` and ``hidden`` ``S x H``; quantized precisions save the FP8 rows and their scales;
* ``"moe"``: ``hidden`` is dropped and the up projection is recomputed in backward;
* ``"full"``: only the layer input ``T x D`` is kept; backward reruns the whole layer forward,
  all-to-all included.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_moe.distributed._tools.gemm_cost import element_bytes, scale_bytes

__all__ = [
    "RECOMPUTE_MODES",
    "SHARDING_MODES",
    "OptimizerSpec",
    "ADAMW_MIXED",
    "ADAMW_BF16_MOMENTS",
    "ADAMW_BF16",
    "model_state_bytes",
    "moe_activation_bytes",
    "dense_activation_bytes",
]

RECOMPUTE_MODES = ("none", "moe", "full")
SHARDING_MODES = ("zero1", "fsdp")


@dataclass(frozen=True)
class OptimizerSpec:
    """Bytes per parameter of each model state.

    Attributes:
        param_bytes: the compute copy the GEMMs read (bf16: 2).
        master_bytes: the fp32 master copy the optimizer updates (0 when the compute copy is
            the master).
        grad_bytes: the accumulated gradient (fp32: 4).
        state_bytes: optimizer state (AdamW with fp32 moments: 8).
    """

    param_bytes: float = 2
    master_bytes: float = 4
    grad_bytes: float = 4
    state_bytes: float = 8

    def __post_init__(self):
        for name in ("param_bytes", "master_bytes", "grad_bytes", "state_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"OptimizerSpec: expected {name} >= 0, but got {value!r}")
        if self.param_bytes == 0:
            raise ValueError("OptimizerSpec: expected param_bytes > 0, but got 0")


# AdamW in mixed precision: bf16 compute copy, fp32 master, fp32 gradients, fp32 moments.
ADAMW_MIXED = OptimizerSpec()
# DeepSeek-V3 (arXiv 2412.19437, section 3.3.3): fp32 master weights and gradients, AdamW
# moments in bf16.
ADAMW_BF16_MOMENTS = OptimizerSpec(state_bytes=4)
# Pure bf16 AdamW: bf16 weights (no fp32 master), gradients and moments; the update needs
# stochastic rounding to stay accurate (torchao.optim offers it as bf16_stochastic_round).
ADAMW_BF16 = OptimizerSpec(param_bytes=2, master_bytes=0, grad_bytes=2, state_bytes=4)


def _nonneg(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"expected {name} >= 0, but got {value!r}")


def model_state_bytes(num_params: float, shard_group: int, sharding: str,
                      optimizer: OptimizerSpec = ADAMW_MIXED) -> float:
    """Persistent bytes on one rank for ``num_params`` parameters *of this rank's model
    replica slice* (already divided by expert parallelism), sharded over ``shard_group``
    ranks. Excludes FSDP's transient unsharded copies (counted by
    :func:`torch_moe.distributed._tools.planner.estimate_step`)."""
    _nonneg("num_params", num_params)
    if isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1:
        raise ValueError(f"expected shard_group to be a positive int, but got {shard_group!r}")
    if sharding not in SHARDING_MODES:
        raise ValueError(f"unknown sharding {sharding!r}: expected one of {SHARDING_MODES}")
    o = optimizer
    if sharding == "zero1":
        return num_params * (o.param_bytes + o.grad_bytes
                             + (o.master_bytes + o.state_bytes) / shard_group)
    return num_params * (o.param_bytes + o.master_bytes + o.grad_bytes + o.state_bytes) \
        / shard_group


def moe_activation_bytes(tokens: float, rows: float, dim: int, hidden_dim: int, top_k: int,
                         precision: str, recompute: str, gated: bool = True,
                         shared_hidden_dim: int = 0, num_experts: int = 0,
                         dispatched: bool = True, act_bytes: int = 2) -> float:
    """Saved activation bytes of one MoE layer for one micro-batch on one rank.

    Args:
        tokens: ``T``, tokens of the rank. rows: ``S``, expert rows it receives.
        hidden_dim: ``F`` per expert on this rank (divided by expert tensor parallelism).
        shared_hidden_dim: total FFN width of the shared experts (0 without them); they
            save ``T x D`` input rows and ``T x H_shared`` like a routed expert with all tokens.
        num_experts: ``E``; the router saves its fp32 logits and scores and the int64 order of
            its stable top-k, ``T x E`` each, and, in a layer of another dtype than fp32, the
            fp32 copies of its input ``T x D`` and weight ``E x D`` it computes from (0 leaves
            the router out).
        dispatched: the expert rows arrived by all-to-all and are saved as their own
            ``S x D`` buffer; without expert parallelism the experts read the layer input.
        act_bytes: bytes per activation element (bf16: 2; an fp32 layer: 4).
    """
    _nonneg("tokens", tokens)
    _nonneg("rows", rows)
    _nonneg("shared_hidden_dim", shared_hidden_dim)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute {recompute!r}: expected one of {RECOMPUTE_MODES}")
    act = act_bytes
    layer_input = tokens * dim * act
    if recompute == "full":
        return layer_input
    h = 2 * hidden_dim if gated else hidden_dim
    # int64 ids + fp32 weights per assignment, the router's T x E, the int64 sorted slots
    routing = tokens * top_k * (8 + 4) + tokens * num_experts * (4 + 4 + 8) + rows * 8
    if num_experts and act_bytes != 4:
        # the router computes in fp32: it saves fp32 copies of its input and weight
        routing += (tokens + num_experts) * dim * 4
    e = act if precision in ("bf16", "fp32") else element_bytes(precision)
    received = rows * dim * e + scale_bytes(precision, rows, dim) if dispatched else 0.0
    total = layer_input + routing + received
    if shared_hidden_dim:
        hs = 2 * shared_hidden_dim if gated else shared_hidden_dim
        total += tokens * hs * act
    if recompute == "none":
        total += rows * h * act
    return total


def dense_activation_bytes(tokens: float, per_token_bytes: float, recompute: str,
                           dim: int) -> float:
    """Saved bytes of a dense block (attention or dense FFN) whose activations take
    ``per_token_bytes`` per token; with ``recompute="full"`` only the block input
    (``T x D`` bf16) stays."""
    _nonneg("tokens", tokens)
    _nonneg("per_token_bytes", per_token_bytes)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute {recompute!r}: expected one of {RECOMPUTE_MODES}")
    if recompute == "full":
        return tokens * dim * 2
    return tokens * per_token_bytes
