"""DTensor support for torch_moe: sharding strategies for every op (``_ops``) and token
(data) parallel routing at the ``moe_ffn`` level."""

from torch_moe.distributed.tensor import _ops  # noqa: F401
