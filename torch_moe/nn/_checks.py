"""Argument checks of the ``torch_moe.nn`` entry points.

Plain raises (``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong value or
shape) rather than ``torch._check``: Dynamo traces the functional layer, and a message closure
that captures tensors would break its graph. Each message names the entry point, the argument,
what was expected and what was given. Only :func:`check_expert_ids` reads tensor values.
"""

import math
from typing import Optional

import torch
from torch import Tensor

# MAX_EXPERTS and MAX_SLOTS are re-exported for the nn entry points
from torch_moe._compat import assert_async
from torch_moe._checks import FLOAT_DTYPES, INDEX_DTYPES, MAX_EXPERTS, MAX_SLOTS  # noqa: F401
# the most elements a tensor may hold so that its size in bytes (8 per element at most) fits
# in int64, as every storage size does
MAX_NUMEL = (2**63 - 1) // 8


def _dtype_names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1]


def check_int(fn: str, name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> None:
    """``value`` is an integer (not a bool, a float or a tensor) in ``[low, high]``."""
    if isinstance(value, (bool, Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{fn}: expected {name} to be an int, but got {type(value).__name__} {value!r}")
    if high is not None and low is not None and not low <= value <= high:
        raise ValueError(f"{fn}: expected {name} in [{low}, {high}], but got {value}")
    if high is None and low is not None and value < low:
        raise ValueError(f"{fn}: expected {name} >= {low}, but got {value}")


def check_real(fn: str, name: str, value, *, low: Optional[float] = None, strict: bool = False,
               extra: str = "") -> None:
    """``value`` is a finite real number, ``> low`` (``strict``) or ``>= low``."""
    if isinstance(value, (bool, Tensor)) or not isinstance(value, (int, float, torch.SymInt, torch.SymFloat)):
        raise TypeError(f"{fn}: expected {name} to be a float, but got {type(value).__name__} {value!r}")
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return
    if low is None:
        ok, want = math.isfinite(value), "to be finite"
    else:
        ok = math.isfinite(value) and (value > low if strict else value >= low)
        want = f"{'>' if strict else '>='} {low:g} and finite"
    if not ok:
        raise ValueError(f"{fn}: expected {name} {want}{extra}, but got {value}")


def check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: expected {name} to be a Tensor, but got {type(t).__name__}")


def check_float_tensor(fn: str, name: str, t) -> None:
    check_tensor(fn, name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: expected {name} to be {_dtype_names(FLOAT_DTYPES)}, but got {t.dtype}")


def check_index_tensor(fn: str, name: str, t) -> None:
    check_tensor(fn, name, t)
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{fn}: expected {name} to be {_dtype_names(INDEX_DTYPES)}, but got {t.dtype}")


def check_tokens(fn: str, name: str, x, dim: Optional[int] = None) -> None:
    """``x [T, D]`` holds floating-point features (token ids or complex values are caller bugs
    that a cast to the weights' dtype would hide)."""
    check_tensor(fn, name, x)
    if not x.is_floating_point():
        raise TypeError(f"{fn}: expected {name} to be a floating-point tensor "
                        f"({_dtype_names(FLOAT_DTYPES)}), but got {x.dtype}")
    if x.dim() != 2 or (dim is not None and x.size(1) != dim):
        raise ValueError(f"{fn}: expected {name} [T, {'D' if dim is None else dim}], but got shape "
                         f"{tuple(x.shape)}")


def check_shape(fn: str, name: str, t: Tensor, expected: tuple, doc: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{fn}: expected {name} of shape {tuple(expected)} ({doc}), but got "
                         f"{tuple(t.shape)}")


def check_same_device(fn: str, name: str, t: Tensor, ref_name: str, ref: Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{fn}: expected {name} on the device of {ref_name} ({ref.device}), but "
                         f"got {t.device}")


def check_expert_ids(fn: str, topk_ids: Tensor, num_experts: int) -> None:
    """Values of ``topk_ids`` in ``[0, num_experts)``.

    In eager mode on CPU this raises with the range found; elsewhere (other devices, or while
    ``torch.compile`` traces) it is an on-device assert, so it costs no host synchronisation.
    """
    if topk_ids.numel() == 0:
        return
    if topk_ids.device.type == "cpu" and not torch.compiler.is_compiling():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{fn}: expected topk_ids values in [0, {num_experts}), but got values "
                             f"in [{lo}, {hi}]")
        return
    assert_async(((topk_ids >= 0) & (topk_ids < num_experts)).all(),
                        f"{fn}: expected topk_ids values in [0, {num_experts})")
