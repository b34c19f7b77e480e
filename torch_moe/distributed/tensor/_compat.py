"""The adapter of torch_moe's sharding strategies to DTensor's private strategy API.

DTensor's propagation rules are registered through modules that are still private in PyTorch
(``torch.distributed.tensor._op_schema``, ``._ops.utils``, ``._ops.single_dim_strategy``) and
the strided placement of fused weights is ``_StridedShard``. This module is the only one of
torch_moe that imports them: ``_ops/_moe_ops.py`` and ``_ops/_quantization_ops.py`` use the
names below, so a torch release that renames one breaks this file alone.

What differs between the supported torch releases is detected, never read from a version
string: the keyword that takes the strategy filter of ``expand_to_full_mesh_op_strategy``
(``is_valid_strategy_cb``, renamed ``full_mesh_strategy_filter``) is looked up in its signature.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Optional

from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, RuntimeSchemaInfo
from torch.distributed.tensor._ops import utils as _op_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _ShardingPlaceholder as ShardingPlaceholder,
    register_single_dim_strategy,
)
from torch.distributed.tensor._ops.utils import register_op_strategy
# ``Shard`` of a dim that holds ``split_factor`` tensors concatenated along it, each sharded on
# its own (the fused gate/up weight of a gated FFN)
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard

__all__ = [
    "OpSchema",
    "OpStrategy",
    "RuntimeSchemaInfo",
    "ShardingPlaceholder",
    "StridedShard",
    "register_op_strategy",
    "register_single_dim_strategy",
    "expand_to_full_mesh_op_strategy",
]

# (input_specs, output_specs) -> whether a full-mesh strategy candidate is valid
StrategyFilter = Callable[[list, object], bool]

# the keyword of ``expand_to_full_mesh_op_strategy`` that takes a StrategyFilter, newest first
# (``is_valid_strategy_cb`` was renamed ``full_mesh_strategy_filter``; same callback)
_FILTER_KEYWORDS = ("full_mesh_strategy_filter", "is_valid_strategy_cb")


@functools.cache
def _strategy_filter_keyword() -> str:
    params = inspect.signature(_op_utils.expand_to_full_mesh_op_strategy).parameters
    for name in _FILTER_KEYWORDS:
        if name in params:
            return name
    raise RuntimeError(
        "torch.distributed.tensor._ops.utils.expand_to_full_mesh_op_strategy takes none of "
        f"{_FILTER_KEYWORDS}; torch_moe's mesh-dependent sharding rules need one of them"
    )


def expand_to_full_mesh_op_strategy(
    mesh,
    op_schema: OpSchema,
    single_mesh_dim_strategies: Sequence[list],
    *,
    input_index: int = 1,
    strategy_filter: Optional[StrategyFilter] = None,
) -> OpStrategy:
    """DTensor's expansion of one-mesh-dim rules (``[outputs..., inputs...]`` placement lists,
    ``input_index`` outputs first) to every combination over ``mesh``'s dims.

    ``strategy_filter(input_specs, output_specs)`` drops the full-mesh candidates it returns
    False for (e.g. shards that would split an MX block); it is passed under whichever name the
    installed torch gives that keyword."""
    kwargs = {}
    if strategy_filter is not None:
        kwargs[_strategy_filter_keyword()] = strategy_filter
    return _op_utils.expand_to_full_mesh_op_strategy(
        mesh, op_schema, list(single_mesh_dim_strategies), input_index=input_index, **kwargs
    )
