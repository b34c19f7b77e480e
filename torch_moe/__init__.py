"""torch_moe: Mixture-of-Experts operators, modules and parallelism for PyTorch.

Importing the package registers the ``torch.ops.torch_moe`` operator library: schemas
(:mod:`torch_moe._ops`), fake kernels (:mod:`torch_moe._meta_registrations`), CPU kernels
(:mod:`torch_moe._native`) and derivative formulas (:mod:`torch_moe._autograd`); the FP8 / MXFP8
ops (:mod:`torch_moe.quantization`); and, lazily, the Inductor lowerings
(:mod:`torch_moe._inductor`), the DTensor sharding strategies (:mod:`torch_moe.distributed.tensor`)
and the DTensor handlers of ``moe_ffn`` / ``MoE``
(:mod:`torch_moe.distributed.tensor._token_parallel`); and torchtitan's override of its MoE layer
(:mod:`torch_moe.nn._torchtitan`).
"""

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
from torch_moe import cpu  # noqa: F401

# Inductor lowerings and decompositions: registered before the first compile, without
# importing Inductor here (torch_moe._inductor).
from torch_moe import _inductor as _inductor_support  # noqa: E402

_inductor_support.install()

# DTensor support (sharding strategies, and the DTensor handlers of moe_ffn / MoE) registers
# with torch.distributed.tensor: here when the program already uses DTensor, else right after
# its first import. A DTensor cannot exist before, and importing torch.distributed.tensor costs
# about two seconds that non-distributed users skip.
from torch_moe._import_hook import call_after_import  # noqa: E402


def _register_dtensor_support() -> None:
    import torch_moe.distributed.tensor  # noqa: F401  (sharding strategies)
    import torch_moe.distributed.tensor._token_parallel  # noqa: F401  (moe_ffn / MoE handlers)


call_after_import("torch.distributed.tensor", _register_dtensor_support)

# torchtitan's config overrides: torch_moe's forward of torchtitan's MoE registers (as
# "torch_moe.nn._torchtitan.torch_moe") once torchtitan's MoE module is imported, never importing
# torchtitan itself.
from torch_moe.nn._torchtitan import install_torchtitan_converter  # noqa: E402

install_torchtitan_converter()

__all__ = ["token_sort", "permute", "unpermute", "grouped_mm", "indexed_grouped_mm", "nn", "quantization",
           "cpu"]
__version__ = "0.1.0"
