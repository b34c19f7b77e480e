"""DTensor sharding strategies of the torch_moe ops (counterpart of
``torch/distributed/tensor/_ops/``). Importing this package registers them."""

from torch_moe.distributed.tensor._ops import _moe_ops, _quantization_ops  # noqa: F401
