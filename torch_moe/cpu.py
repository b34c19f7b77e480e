"""Controls of torch_moe's CPU kernels (counterpart of ``torch.cuda.memory``'s cache controls and
of ``torch.backends``' kernel flags).

Weight-gradient storage. The CPU kernels keep the storage of large expert-weight gradients for the
next backward instead of returning it to the system and faulting fresh pages in
(:mod:`torch_moe._native.grad_storage` says when a storage is reused: only once nothing else
refers to it)::

    torch_moe.cpu.cached_bytes()       # (bytes held, bytes of those free for reuse)
    torch_moe.cpu.empty_cache()        # release what nothing uses, as torch.cuda.empty_cache
    torch_moe.cpu.set_grad_storage_reuse(False)   # allocate every gradient afresh

Expert GEMM form. The fused expert kernels run an expert's GEMMs either one ``mm`` per expert
(``"per_group"``, the default) or, for runs of experts with few and similar row counts, one
``bmm`` over several experts padded to a common row count (``"batched"``); ``"auto"`` chooses
per run of experts by the rule of :mod:`torch_moe._native._expert_blocks`. Which is fastest
depends on the CPU's GEMM kernels at a few tens of rows: measure with
``benchmarks/moe_layer.py --forms auto,batched``::

    torch_moe.cpu.set_expert_form("auto")          # process-wide
    with torch_moe.cpu.expert_form("per_group"):   # this thread, within the block
        ...

The per-group form computes every expert's rows independently of the other experts' rows, bit
for bit; the batched form sums each dot product in ``bmm``'s order, which may differ from
``mm``'s in the last bits (fp32 rounding), and depends on which experts share the ``bmm``.
"""

from torch_moe._native._expert_blocks import FORMS as EXPERT_FORMS
from torch_moe._native._expert_blocks import get_form as get_expert_form
from torch_moe._native._expert_blocks import set_form as set_expert_form
from torch_moe._native._expert_blocks import use_form as expert_form
from torch_moe._native.grad_storage import cached_bytes, empty_cache
from torch_moe._native.grad_storage import is_enabled as grad_storage_reuse_enabled
from torch_moe._native.grad_storage import set_enabled as set_grad_storage_reuse

__all__ = ["cached_bytes", "empty_cache", "set_grad_storage_reuse", "grad_storage_reuse_enabled",
           "EXPERT_FORMS", "set_expert_form", "get_expert_form", "expert_form"]
