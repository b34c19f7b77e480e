"""Where the slots of groups padded to a multiple of ``align`` lie (``token_sort(align=)``).

FP8 and MXFP8 grouped GEMMs need every group to start on a multiple of 16 or 32 rows, so
``token_sort`` (its CPU kernel and its Inductor decomposition) and
``token_sort_with_capacity`` pad each expert's group of sorted slots up to a multiple of
``align``. A group of ``c`` assignments takes ``ceil(c / align) * align`` slots, so the slot
count is bounded statically by ``S = T * k + E * (align - 1)``
(:func:`torch_moe._checks.token_sort_num_slots`) and the slots past the last group, like the
padding slots inside the groups, hold -1.
"""

import torch

__all__ = ["padded_group_layout"]


def padded_group_layout(counts_E: torch.Tensor, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts [E]`` (int64 assignments per group) -> ``(ends [E], shift [E])``, int64.

    ``ends`` are the cumulative ends of the padded groups (``offs``); ``shift[e]`` moves the
    ``r``-th assignment of group ``e`` from its unpadded slot ``start[e] + r`` to its padded slot
    ``padded_start[e] + r``. Out of place, so that decompositions may trace it.
    """
    padded = torch.div(counts_E + (align - 1), align, rounding_mode="floor") * align
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts_E.cumsum(0) - counts_E)
    return ends, shift
