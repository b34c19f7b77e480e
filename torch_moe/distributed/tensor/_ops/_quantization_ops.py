"""Sharding strategies of the FP8 / MXFP8 quantization ops.

A quantizer is elementwise except along its reduced dim: MXFP8 reduces blocks of 32 along
``dim``, FP8 rowwise the whole of ``dim`` (or each group of it). So any other dim shards freely,
with the scale sharded like its data. ``dim`` itself shards only for MXFP8, and only where every
shard boundary falls on a block boundary, which depends on the mesh: these strategies are
``register_op_strategy`` rules with a strategy filter that checks it.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from torch_moe.distributed.tensor._compat import (
    expand_to_full_mesh_op_strategy,
    OpSchema,
    OpStrategy,
    register_op_strategy,
    RuntimeSchemaInfo,
)
from torch_moe.quantization._formats import BLOCK_SIZE

ops = torch.ops.torch_moe
R = Replicate()
P = Partial()


def _schema(first_non_tensor: int, *kwargs: str) -> RuntimeSchemaInfo:
    # the non-tensor arguments (dims, dtypes, recipes) change shapes or rules, so they join
    # DTensor's sharding cache key
    return RuntimeSchemaInfo(static_argnum=first_non_tensor, static_kwargkey=list(kwargs))


def _wrap(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def _blocks_whole(block_dims: dict[int, int | tuple[int, ...]]):
    """A strategy filter: every input in ``block_dims`` (input index -> tensor dim or
    dims) that is sharded along such a dim must have shards of whole MX blocks."""

    def valid(input_specs, output_specs) -> bool:
        for i, spec in enumerate(input_specs):
            dims = block_dims.get(i)
            if dims is None or spec is None:
                continue
            for d in (dims,) if isinstance(dims, int) else dims:
                parts = math.prod(
                    spec.mesh.size(m) for m, p in enumerate(spec.placements) if p.is_shard(d)
                )
                size = spec.tensor_meta.shape[d]
                if parts > 1 and size % (parts * BLOCK_SIZE) != 0:
                    return False
        return True

    return valid


def _expand(op_schema: OpSchema, rules, n_outputs: int, strategy_filter=None) -> OpStrategy:
    mesh = op_schema.get_mesh_from_args()
    all_r = [R] * (n_outputs + sum(isinstance(a, OpStrategy) for a in op_schema.args_schema))
    rules = [all_r] + rules
    # args that are not tensors (dim, dtypes, strings) take no placement
    rules = [r + [None] * (n_outputs + len(op_schema.args_schema) - len(r)) for r in rules]
    return expand_to_full_mesh_op_strategy(
        mesh, op_schema, rules, input_index=n_outputs, strategy_filter=strategy_filter
    )


def _ndim(strategy) -> int:
    return strategy.ndim


@register_op_strategy(ops.quantize_mxfp8.default, schema_info=_schema(1, "dim", "elem_dtype", "scale_mode"))
def quantize_mxfp8_strategy(op_schema: OpSchema) -> OpStrategy:
    # (data, scale) <- x: any dim; the block dim only in whole blocks
    x = op_schema.args_schema[0]
    nd = _ndim(x)
    dim = _wrap(op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else -1, nd)
    rules = [[Shard(d), Shard(d), Shard(d)] for d in range(nd)]
    return _expand(op_schema, rules, 2, _blocks_whole({0: dim}))


@register_op_strategy(ops.dequantize_mxfp8.default, schema_info=_schema(2, "dim", "out_dtype"))
def dequantize_mxfp8_strategy(op_schema: OpSchema) -> OpStrategy:
    # out <- data, scale: sharded together along any dim (whole blocks along the block dim)
    data = op_schema.args_schema[0]
    nd = _ndim(data)
    dim = _wrap(op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else -1, nd)
    rules = [[Shard(d), Shard(d), Shard(d)] for d in range(nd)]
    return _expand(op_schema, rules, 1, _blocks_whole({0: dim}))


@register_op_strategy(ops.quantize_fp8_rowwise.default, schema_info=_schema(1, "dim"))
def quantize_fp8_rowwise_strategy(op_schema: OpSchema) -> OpStrategy:
    # (data, scale) <- x, offs?: every dim but the reduced one
    x = op_schema.args_schema[0]
    nd = _ndim(x)
    dim = _wrap(op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else -1, nd)
    has_offs = len(op_schema.args_schema) > 2 and op_schema.args_schema[2] is not None
    offs = [R] if has_offs else []
    rules = [[Shard(d), Shard(d), Shard(d), *offs] for d in range(nd) if d != dim]
    return _expand(op_schema, rules, 2)


@register_op_strategy(ops.dequantize_fp8_rowwise.default, schema_info=_schema(2, "dim", "out_dtype"))
def dequantize_fp8_rowwise_strategy(op_schema: OpSchema) -> OpStrategy:
    # out <- data, scale, offs?: data and scale together; the reduced dim with the scale
    # replicated (one scale for the whole dim), unless groups split it
    data = op_schema.args_schema[0]
    nd = _ndim(data)
    dim = _wrap(op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else -1, nd)
    has_offs = len(op_schema.args_schema) > 3 and op_schema.args_schema[3] is not None
    offs = [R] if has_offs else []
    rules = [[Shard(d), Shard(d), Shard(d), *offs] for d in range(nd) if d != dim]
    if not has_offs:
        rules.append([Shard(dim), Shard(dim), R])
    rules.append([P, R, P, *offs])  # linear in the scale
    return _expand(op_schema, rules, 1)


def _whole_row_tiles(input_specs, output_specs) -> bool:
    # the swizzled layout is row-tile major: a shard of whole 128-row tiles is a contiguous
    # slice of the flat output
    spec = input_specs[0]
    d = len(spec.tensor_meta.shape) - 2
    parts = math.prod(spec.mesh.size(m) for m, p in enumerate(spec.placements) if p.is_shard(d))
    return parts == 1 or spec.tensor_meta.shape[d] % (parts * 128) == 0


@register_op_strategy(ops.swizzle_mx_scale.default)
def swizzle_mx_scale_strategy(op_schema: OpSchema) -> OpStrategy:
    # [..., R, C] -> [..., n]: leading (batch) dims, and rows in whole 128-row tiles
    nd = _ndim(op_schema.args_schema[0])
    rules = [[Shard(d), Shard(d)] for d in range(nd - 2)] + [[Shard(nd - 2), Shard(nd - 2)]]
    return _expand(op_schema, rules, 1, _whole_row_tiles)


@register_op_strategy(ops.unswizzle_mx_scale.default, schema_info=_schema(1, "rows", "cols"))
def unswizzle_mx_scale_strategy(op_schema: OpSchema) -> OpStrategy:
    nd = _ndim(op_schema.args_schema[0])
    return _expand(op_schema, [[Shard(d), Shard(d)] for d in range(nd - 1)], 1)


def _is_mx(scale_strategy) -> bool:
    spec = scale_strategy.strategies[0].output_spec
    return spec.tensor_meta.dtype in (torch.uint8, torch.float8_e8m0fnu)


@register_op_strategy(ops.scaled_grouped_mm.default, schema_info=_schema(5, "out_dtype"))
def scaled_grouped_mm_strategy(op_schema: OpSchema) -> OpStrategy:
    # out <- mat_a, mat_b, scale_a, scale_b, offs
    a, b, scale_a = op_schema.args_schema[:3]
    mx = _is_mx(scale_a)
    if _ndim(b) == 3:
        # [M, N] <- a [M, K], b [G, K, N]: N free with b's scale; K contracted, MX scales
        # sharded with it in whole blocks, rowwise scales (whole-K) replicated
        k_scales = [Shard(1), Shard(1)] if mx else [R, R]
        rules = [[Shard(1), R, Shard(2), R, Shard(2), R], [P, Shard(1), Shard(1), *k_scales, R]]
        strategy_filter = _blocks_whole({0: 1, 1: 1}) if mx else None
    else:
        # [G, K, N] <- a [K, M], b [M, N]: K and N free, their scales with them
        rules = [[Shard(1), Shard(0), R, Shard(0), R, R], [Shard(2), R, Shard(1), R, Shard(1), R]]
        strategy_filter = None
    return _expand(op_schema, rules, 1, strategy_filter)


@register_op_strategy(ops.quantized_grouped_mm.default, schema_info=_schema(3, "recipe", "scale_mode", "wgrad_high_precision"))
def quantized_grouped_mm_strategy(op_schema: OpSchema) -> OpStrategy:
    # out [M, N] <- input [M, K], weight [G, K, N], offs: quantization runs along K per row of
    # input and per (g, n) of weight, so N shards in both recipes; K shards only for MXFP8 in
    # whole blocks (a rowwise scale spans all of K)
    recipe = op_schema.args_schema[3]
    rules = [[Shard(1), R, Shard(2), R]]
    strategy_filter = None
    if recipe == "mxfp8":
        rules.append([P, Shard(1), Shard(1), R])
        # K in whole blocks (forward), and N too: the backward quantizes along N
        strategy_filter = _blocks_whole({0: 1, 1: (1, 2)})
    return _expand(op_schema, rules, 1, strategy_filter)
