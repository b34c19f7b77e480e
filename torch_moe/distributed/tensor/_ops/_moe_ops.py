"""Sharding strategies of the torch_moe routing, permutation and grouped-GEMM ops.

Counterpart of ``torch/distributed/tensor/_ops/_matrix_ops.py``. Every rule here is written for
one mesh dimension with ``register_single_dim_strategy`` (the all-Replicate rule is implicit) and
is checked against ground truth by ``test/distributed/tensor/test_moe_sharding.py``.

Notation in the comments: ``R`` Replicate, ``S(d)`` Shard(d), ``P`` Partial(sum); a rule reads
``outputs <- inputs`` in the order of the op's tensor arguments (absent optional tensors are
skipped).

What has no rule, and why:

* Sharding tokens (dim 0 of ``x`` / ``topk_ids``). The routing tensors are global index maps:
  ``token_sort`` of a token shard is not a shard of ``token_sort`` of all tokens, and
  ``permute`` / ``unpermute`` / ``grouped_ffn`` index rows across the whole token dim. Token
  (data) parallelism is exact one level up, where a row's output depends on that row only:
  ``moe_ffn`` and ``MoE`` route every shard on its own (``_token_parallel.py``). Slots (dim 0
  of ``sorted_ids``) can be sharded, with replicated tokens: a rank gathers, or sums back, its
  slice of the slots.
* Sharding experts (dim 0 of 3-D weights). A shard's rows are a data-dependent subset of the
  token rows, which no placement describes; the expert-parallel dispatcher moves those rows with
  an all-to-all and runs the ops on local tensors with local offsets.
* ``offs`` is read on the host by CPU kernels and defines the groups: always Replicate.

The expert biases of ``grouped_ffn`` (b1, b3 of the up projections, b2 of the down projection)
follow their weights. With F sharded, b1 / b3 shard their F columns like w1 / w3 (``Shard(1)``;
the ``[E, 2F]`` b1 of a fused w13 ``_StridedShard(1, split_factor=2)``, the layout of w13's
columns). b2 is added after the down projection, which is a partial sum over the F shards: a
rank that added all of b2 to its partial output would count it once per shard. So the rule
takes b2 ``Partial``: each rank adds its part and the sum over the ranks holds b2 exactly once,
whatever the split. A replicated b2 is redistributed to ``Partial`` by DTensor, which divides it
by the mesh dim's size (exact for a power of two); a caller that wants no division passes b2
as ``Partial`` already (b2 on one rank, zeros on the others). The backward takes b2 the same
way, since the routing weights' gradient ``<grad, a @ w2 + b2>`` is then a sum of per-rank
terms too, and gives ``grad_b2`` ``Replicate`` (every rank sees the whole output gradient). The
output is linear in (w2, b2) together, not in either alone: the rule with w2 ``Partial`` takes
b2 ``Partial``. The expert dim has no rule (see above), for the biases neither.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_moe._checks import GATED_ACTIVATIONS
from torch_moe.distributed.tensor._compat import (
    register_single_dim_strategy,
    RuntimeSchemaInfo,
    ShardingPlaceholder,
    StridedShard,
)

ops = torch.ops.torch_moe

R = Replicate()
P = Partial()


def _schema(first_non_tensor: int, *kwargs: str) -> RuntimeSchemaInfo:
    # DTensor caches a sharding decision per input specs; the non-tensor arguments from
    # ``first_non_tensor`` on (and these keywords) change shapes or rules, so they join the key.
    return RuntimeSchemaInfo(static_argnum=first_non_tensor, static_kwargkey=list(kwargs))


def S(dim: int) -> ShardingPlaceholder:
    return ShardingPlaceholder(dim)


def _present(*tensors) -> list:
    return [t for t in tensors if t is not None]


def _output_mask(args, kwargs, index: int) -> list:
    return list(args[index]) if len(args) > index else list(kwargs["output_mask"])


def _masked(rules: list, output_mask: list) -> list:
    """Rules of a backward op whose outputs not requested by ``output_mask`` are empty [0]
    tensors: those are Replicate whatever the inputs."""
    n = len(output_mask)
    return [[p if want else R for p, want in zip(rule[:n], output_mask)] + rule[n:]
            for rule in rules]


# ---------------------------------------------------------------------------------------------
# Routing and permutation
# ---------------------------------------------------------------------------------------------


@register_single_dim_strategy(ops.token_sort.default, _schema(1, "num_experts", "align"))
def token_sort_strategy(op, args, kwargs):
    # sorted_ids / offs are global index maps of all tokens: nothing but Replicate is exact.
    return []


@register_single_dim_strategy(ops.permute.default, _schema(2, "top_k"))
def permute_strategy(op, args, kwargs):
    # out [S, D] <- x [T, D], sorted_ids [S]: a copy of rows, so columns shard, sums pass and
    # a slice of the slots gathers a slice of the output.
    return [[S(1), S(1), R], [P, P, R], [S(0), R, S(0)]]


@register_single_dim_strategy(ops.permute_backward.default, _schema(2, "top_k", "num_tokens"))
def permute_backward_strategy(op, args, kwargs):
    # grad_x [T, D] <- grad [S, D], sorted_ids [S]: a sum of rows (over a slice of slots:
    # a partial sum).
    return [[S(1), S(1), R], [P, P, R], [P, S(0), S(0)]]


@register_single_dim_strategy(ops.unpermute.default)
def unpermute_strategy(op, args, kwargs):
    # out [T, D] <- y [S, D], sorted_ids, topk_weights [T, k]: bilinear in (y, topk_weights).
    return [[S(1), S(1), R, R], [P, P, R, R], [P, R, R, P], [P, S(0), S(0), R]]


@register_single_dim_strategy(ops.unpermute_backward.default, _schema(4, "output_mask"))
def unpermute_backward_strategy(op, args, kwargs):
    # (grad_y [S, D], grad_w [T, k]) <- grad [T, D], y [S, D], sorted_ids, topk_weights:
    # grad_y = w * grad (no y), grad_w = <grad, y> over D.
    return _masked([
        [S(1), P, S(1), S(1), R, R],
        [P, P, P, R, R, R],
        [R, P, R, P, R, R],
        [P, R, R, R, R, P],
        [P, P, R, P, R, P],           # bilinear: grad_y in the weights, grad_w in y
        [S(0), P, R, S(0), S(0), R],  # a slice of the slots
    ], _output_mask(args, kwargs, 4))


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs
# ---------------------------------------------------------------------------------------------


def grouped_mm_rules(a_dim: int, b_dim: int) -> list:
    """[out, a, b, offs] rules of ``grouped_mm`` for the layout of ``a`` / ``b`` ranks."""
    if a_dim == 2 and b_dim == 3:
        # [M, N] <- [M, K] @ [G, K, N]: K contracted, N free
        rules = [[P, S(1), S(1), R], [S(1), R, S(2), R]]
    elif a_dim == 3 and b_dim == 2:
        # [M, N] <- [G, M, K] @ [K, N] (columns of b grouped): K contracted, M free
        rules = [[P, S(2), S(0), R], [S(0), S(1), R, R]]
    else:
        # [G, K, N] <- [K, M] @ [M, N] (M grouped): K and N free
        rules = [[S(1), S(0), R, R], [S(2), R, S(1), R]]
    return rules + [[P, P, R, R], [P, R, P, R]]


@register_single_dim_strategy(ops.grouped_mm.default)
def grouped_mm_strategy(op, args, kwargs):
    a, b = args[0], args[1]
    return grouped_mm_rules(len(a.shape), len(b.shape))


@register_single_dim_strategy(ops.indexed_grouped_mm.default, _schema(3, "num_out_rows"))
def indexed_grouped_mm_strategy(op, args, kwargs):
    # out <- input [rows, K], weight [G, K, N], offs, gather?, scatter?, scatter_weight?
    _, _, _, gather, scatter, scatter_weight = (list(args) + [None] * 6)[:6]
    idx = [R] * len(_present(gather, scatter))
    has_sw = scatter_weight is not None
    sw = [R] if has_sw else []
    rules = [
        [P, S(1), S(1), R, *idx, *sw],   # K contracted
        [S(1), R, S(2), R, *idx, *sw],   # N free
        [P, P, R, R, *idx, *sw],
        [P, R, P, R, *idx, *sw],
    ]
    if has_sw:
        rules.append([P, R, R, R, *idx, P])  # linear in the row weights
    return rules


@register_single_dim_strategy(ops.indexed_grouped_mm_backward.default, _schema(4, "output_mask"))
def indexed_grouped_mm_backward_strategy(op, args, kwargs):
    # (grad_input [rows, K], grad_weight [G, K, N], grad_scatter_weight [S])
    #   <- grad [out_rows, N], input, weight, offs, gather?, scatter?, scatter_weight?
    _, _, _, _, gather, scatter, scatter_weight = (list(args) + [None] * 7)[:7]
    idx = [R] * len(_present(gather, scatter))
    has_sw = scatter_weight is not None
    sw = [R] if has_sw else []
    rules = [
        [S(1), S(1), P, R, S(1), S(1), R, *idx, *sw],   # K sharded
        [P, S(2), P, S(1), R, S(2), R, *idx, *sw],      # N sharded
        [P, P, P, P, R, R, R, *idx, *sw],               # grad partial
        [R, P, P, R, P, R, R, *idx, *sw],               # input partial
        [P, R, P, R, R, P, R, *idx, *sw],               # weight partial
    ]
    if has_sw:
        rules.append([P, P, R, R, R, R, R, *idx, P])
    return _masked(rules, _output_mask(args, kwargs, 7))


# ---------------------------------------------------------------------------------------------
# The fused expert FFN
# ---------------------------------------------------------------------------------------------


# The expert-TP rules use concrete Shard placements, not placeholders: a placeholder takes the
# type of the runtime inputs, so a StridedShard w13 would turn w2's placeholder into a
# StridedShard too, and the F slices of w2 would no longer match those of w13 and hidden.


def _hidden_f_shard(gated: bool):
    # hidden [S, 2F] is cat(gate, up) along dim 1: with F sharded, a rank holds
    # cat(gate_r, up_r), the right-to-left layout of StridedShard(1, split_factor=2).
    return StridedShard(1, split_factor=2) if gated else Shard(1)


def _ffn_weight_f_shards(activation: str, has_w3: bool):
    """Placements of (w1, w2[, w3]) that shard the expert FFN dim F."""
    gated = activation in GATED_ACTIVATIONS
    if gated and not has_w3:
        # fused w13 [E, D, 2F] = cat(gate, up): a rank needs cat(gate_r, up_r)
        w1 = StridedShard(2, split_factor=2)
    else:
        w1 = Shard(2)
    return [w1, Shard(1)] + ([Shard(2)] if has_w3 else [])


def _ffn_biases(args, kwargs, first: int) -> list[str]:
    """The names of the biases grouped_ffn(_backward) is given, in the order DTensor counts its
    tensor inputs: the positional ones (from argument ``first`` on: b1, b2, b3), then the
    keyword ones in the order they were passed."""
    names = [n for n, b in zip(("b1", "b2", "b3"), args[first:first + 3]) if b is not None]
    return names + [n for n, b in kwargs.items() if n in ("b1", "b2", "b3") and b is not None]


def _bias_f_shards(gated: bool, has_w3: bool, biases: list[str]) -> list:
    """Placements of the biases (in the order of ``biases``) on a mesh dim that shards F: b1 /
    b3 like their weights' columns, b2 Partial (added once over the F shards; see the module
    docstring)."""
    # the [E, 2F] b1 of a fused w13 is cat(gate, up), sharded as w13's columns are
    b1 = StridedShard(1, split_factor=2) if gated and not has_w3 else Shard(1)
    return [{"b1": b1, "b2": P, "b3": Shard(1)}[n] for n in biases]


@register_single_dim_strategy(ops.grouped_ffn.default, _schema(6, "activation", "alpha", "limit"))
def grouped_ffn_strategy(op, args, kwargs):
    # (out [T, D], hidden [S, *]) <- x, sorted_ids, offs, topk_weights, w1, w2, w3?, b1?, b2?,
    # b3? (the biases in the order they were passed)
    x, sorted_ids, offs, topk_weights, w1, w2, w3, activation = (list(args) + [None] * 8)[:8]
    activation = activation or kwargs.get("activation", "swiglu")
    biases = _ffn_biases(args, kwargs, 10)
    has_w3 = w3 is not None
    gated = activation in GATED_ACTIVATIONS
    n_w = 3 if has_w3 else 2
    no_bias = [R] * len(biases)
    return [
        # expert tensor parallel: F sharded, the down projection contracts it (b2 Partial)
        [P, _hidden_f_shard(gated), R, R, R, R, *_ffn_weight_f_shards(activation, has_w3),
         *_bias_f_shards(gated, has_w3, biases)],
        # linear in the routing weights, which scale b2 too
        [P, R, R, R, R, P, *([R] * n_w), *no_bias],
        # linear in the down projection (w2, b2) together
        [P, R, R, R, R, R, R, P, *([R] * (n_w - 2)), *[P if n == "b2" else R for n in biases]],
    ]


@register_single_dim_strategy(
    ops.grouped_ffn_backward.default, _schema(7, "activation", "alpha", "limit", "output_mask")
)
def grouped_ffn_backward_strategy(op, args, kwargs):
    # (grad_x, grad_topk_weights, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3)
    #   <- grad, x, sorted_ids, offs, topk_weights, w1, w2, w3?, hidden, b1?, b2?, b3?
    # (an absent w3 or bias has an empty gradient: Replicate)
    (grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, activation) = (
        list(args) + [None] * 10
    )[:10]
    activation = activation or kwargs.get("activation")
    biases = _ffn_biases(args, kwargs, 13)
    has_w3 = w3 is not None
    gated = activation in GATED_ACTIVATIONS
    weights = _ffn_weight_f_shards(activation, has_w3)
    grad_w3 = weights[2] if has_w3 else R  # an empty tensor when there is no w3
    n_w = 3 if has_w3 else 2
    in_f = _bias_f_shards(gated, has_w3, biases)
    # the gradients of b1 / b3 are sharded like the biases; that of b2 is whole on every rank
    f_grads = {n: R if n == "b2" else p for n, p in zip(biases, in_f)}

    def bias_grads(placement_of):
        return [placement_of(n) if n in biases else R for n in ("b1", "b2", "b3")]

    no_bias = [R] * len(biases)
    return _masked([
        # F sharded; b2 Partial: the routing weights' gradient <grad, b2> is a per-rank term
        [P, P, weights[0], weights[1], grad_w3, *bias_grads(f_grads.get), R, R, R, R, R,
         *weights, _hidden_f_shard(gated), *in_f],
        # linear in grad
        [P, P, P, P, P if has_w3 else R, *bias_grads(lambda n: P), P, R, R, R, R, *([R] * n_w),
         R, *no_bias],
        # linear in the routing weights, except their own gradient (which they do not enter)
        [P, R, P, P, P if has_w3 else R, *bias_grads(lambda n: P), R, R, R, R, P, *([R] * n_w),
         R, *no_bias],
    ], _output_mask(args, kwargs, 12))
