"""torch_moe: Mixture-of-Experts operators, modules and parallelism for PyTorch.

Importing the package registers the ``torch.ops.torch_moe`` operator library: schemas
(:mod:`torch_moe._ops`), fake kernels (:mod:`torch_moe._meta_registrations`), CPU kernels
(:mod:`torch_moe._native`) and derivative formulas (:mod:`torch_moe._autograd`); the FP8 / MXFP8
ops (:mod:`torch_moe.quantization`); and, lazily, the Inductor lowerings
(:mod:`torch_moe._inductor`) and DTensor sharding strategies (:mod:`torch_moe.distributed.tensor`).
"""

import sys

from torch_moe import _ops  # noqa: F401  (defines the schemas first)
from torch_moe import _meta_registrations  # noqa: F401
from torch_moe import _native  # noqa: F401
from torch_moe import _autograd  # noqa: F401
from torch_moe._functional_ops import (
    grouped_mm,
    indexed_grouped_mm,
    permute,
    token_sort,
    unpermute,
)
from torch_moe import quantization  # noqa: F401
from torch_moe import nn  # noqa: F401

# Inductor lowerings and decompositions: registered before the first compile, without
# importing Inductor here (torch_moe._inductor).
from torch_moe import _inductor as _inductor_support  # noqa: E402

_inductor_support.install()

# DTensor sharding strategies register with ``import torch_moe.distributed.tensor`` (done here
# when the program already uses DTensor, and by moe_ffn / MoE when they receive a DTensor):
# importing torch.distributed.tensor costs about two seconds that non-distributed users skip.
if "torch.distributed.tensor" in sys.modules:
    import torch_moe.distributed.tensor  # noqa: F401

__all__ = ["token_sort", "permute", "unpermute", "grouped_mm", "indexed_grouped_mm", "nn", "quantization"]
__version__ = "0.1.0"
