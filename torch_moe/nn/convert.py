"""Conversion between :class:`~torch_moe.nn.MoE` and the MoE blocks of HuggingFace checkpoints.

HuggingFace models keep one ``nn.Linear`` per expert projection, stored ``[out, in]``; an
:class:`MoE` keeps the experts stacked in GEMM layout (``x @ w``). Shape legend: E experts, D
model dim, F expert FFN dim, Fs shared FFN width (``num_shared_experts * shared_hidden_dim``).

================================  ============  =================================
HF key (under ``prefix``)          HF layout     MoE tensor
================================  ============  =================================
``gate.weight``                    [E, D]        ``router.weight`` [E, D]
``gate.e_score_correction_bias``   [E]           ``router.expert_bias`` [E]
``experts.{i}.<gate>.weight``      [F, D]        ``experts.w1[i]`` of [E, D, F]
``experts.{i}.<up>.weight``        [F, D]        ``experts.w3[i]`` of [E, D, F]
``experts.{i}.<down>.weight``      [D, F]        ``experts.w2[i]`` of [E, F, D]
``<shared>.<gate>.weight``         [Fs, D]       ``shared_experts.w1`` [D, Fs]
``<shared>.<up>.weight``           [Fs, D]       ``shared_experts.w3`` [D, Fs]
``<shared>.<down>.weight``         [D, Fs]       ``shared_experts.w2`` [Fs, D]
``shared_expert_gate.weight``      [1, D]        ``shared_experts.gate`` [1, D]
================================  ============  =================================

Styles (``<gate>/<up>/<down>`` and ``<shared>``), with the :class:`MoEConfig` that reproduces
the HF forward (all three use SiLU-gated experts: ``activation="swiglu"``):

- ``"mixtral"``: ``w1/w3/w2``, no shared experts, no expert bias. Mixtral takes the softmax
  over all logits, keeps the top-k and renormalises, which equals the softmax over the top-k
  logits: ``score_func="softmax", topk_before_score=True``. Prefix e.g.
  ``"model.layers.0.block_sparse_moe."``.
- ``"qwen3_moe"``: ``gate_proj/up_proj/down_proj``; ``score_func="softmax"``,
  ``normalize_topk=norm_topk_prob``. The Qwen2-MoE shared expert (``shared_expert`` and
  ``shared_expert_gate``) is read when the MoE has shared experts
  (``shared_expert_gate=True`` for Qwen2-MoE). Prefix e.g. ``"model.layers.0.mlp."``.
- ``"deepseek_v3"``: ``gate_proj/up_proj/down_proj``, shared experts under
  ``shared_experts``, and ``gate.e_score_correction_bias`` when the MoE was built with
  ``load_balance_bias=True``; ``score_func="sigmoid", normalize_topk=norm_topk_prob,
  route_scale=routed_scaling_factor, num_expert_groups=n_group, topk_groups=topk_group``.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from torch_moe.nn.modules.moe import MoE

__all__ = ["load_hf_moe_state_dict", "hf_moe_state_dict"]


@dataclass(frozen=True)
class _Style:
    gate: str  # HF module names of an expert's gate, up and down projections
    up: str
    down: str
    shared: Optional[str] = None  # HF module holding the shared experts
    shared_gate: Optional[str] = None  # HF module of the sigmoid gate on the shared output
    expert_bias: Optional[str] = None  # HF name, under ``gate.``, of the selection bias

    @property
    def block_modules(self) -> set[str]:
        """First key components that belong to this style's MoE block."""
        names = {"gate", "experts", self.shared, self.shared_gate}
        return {n for n in names if n is not None}


_STYLES = {
    "mixtral": _Style("w1", "w3", "w2"),
    "qwen3_moe": _Style("gate_proj", "up_proj", "down_proj", shared="shared_expert",
                        shared_gate="shared_expert_gate"),
    "deepseek_v3": _Style("gate_proj", "up_proj", "down_proj", shared="shared_experts",
                          expert_bias="e_score_correction_bias"),
}

# At most this many keys are spelled out in an error message; a 256-expert layer has 768.
_MAX_KEYS_SHOWN = 6


def _get_style(fn: str, style: str) -> _Style:
    if style not in _STYLES:
        raise ValueError(f"{fn}: expected style in {tuple(_STYLES)}, but got {style!r}")
    return _STYLES[style]


def _check_prefix(fn: str, prefix: str) -> None:
    # without the dot, "model.layers.1" would also match the keys of "model.layers.10."
    if prefix and not prefix.endswith("."):
        raise ValueError(f"{fn}: expected prefix to be empty or end with '.', but got {prefix!r}")


def _check_compatible(fn: str, moe: MoE, style_name: str, s: _Style) -> None:
    """Rejects MoE configurations that the style's checkpoints cannot hold."""
    c = moe.config
    if not c.gated:
        raise ValueError(f"{fn}: style {style_name!r} has gated experts (gate and up projections), "
                         f"but the MoE has activation={c.activation!r}; use activation='swiglu'")
    if c.router_bias:
        raise ValueError(f"{fn}: style {style_name!r} has no router bias, but the MoE has "
                         f"router_bias=True")
    if c.num_shared_experts > 0 and s.shared is None:
        raise ValueError(f"{fn}: style {style_name!r} has no shared experts, but the MoE has "
                         f"num_shared_experts={c.num_shared_experts}")
    if c.num_shared_experts > 0 and c.shared_expert_gate and s.shared_gate is None:
        raise ValueError(f"{fn}: style {style_name!r} has no shared-expert gate, but the MoE has "
                         f"shared_expert_gate=True")


def _hf_views(moe: MoE, prefix: str, s: _Style) -> dict[str, tuple[Tensor, str]]:
    """Maps every HF key of the block to ``(view, layout)``: a view of the MoE tensor holding
    that weight, transposed to the HF ``[out, in]`` layout, and the layout's name.

    Writing into a view writes into the MoE's parameter, so loading keeps the parameter
    objects (and any optimizer or FSDP references to them).
    """
    views: dict[str, tuple[Tensor, str]] = {f"{prefix}gate.weight": (moe.router.weight, "[E, D]")}
    if s.expert_bias is not None and moe.router.expert_bias is not None:
        views[f"{prefix}gate.{s.expert_bias}"] = (moe.router.expert_bias, "[E]")
    w1_EDF, w3_EDF, w2_EFD = moe.experts.w1, moe.experts.w3, moe.experts.w2
    for i in range(moe.config.num_experts):
        p = f"{prefix}experts.{i}."
        views[f"{p}{s.gate}.weight"] = (w1_EDF[i].t(), "[F, D]")
        views[f"{p}{s.up}.weight"] = (w3_EDF[i].t(), "[F, D]")
        views[f"{p}{s.down}.weight"] = (w2_EFD[i].t(), "[D, F]")
    shared = moe.shared_experts
    if shared is not None:
        p = f"{prefix}{s.shared}."
        views[f"{p}{s.gate}.weight"] = (shared.w1.t(), "[Fs, D]")
        views[f"{p}{s.up}.weight"] = (shared.w3.t(), "[Fs, D]")
        views[f"{p}{s.down}.weight"] = (shared.w2.t(), "[D, Fs]")
        if shared.gate is not None:
            views[f"{prefix}{s.shared_gate}.weight"] = (shared.gate, "[1, D]")
    return views


def _format_keys(keys: Iterable[str]) -> str:
    keys = sorted(keys)
    shown = ", ".join(repr(k) for k in keys[:_MAX_KEYS_SHOWN])
    more = len(keys) - _MAX_KEYS_SHOWN
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def _format_experts(ids: list[int]) -> str:
    if ids == list(range(ids[0], ids[-1] + 1)):
        return f"{len(ids)} (experts.{ids[0]} to experts.{ids[-1]})"
    return f"{len(ids)} (experts {ids})"


def _expert_ids(block_keys: Iterable[str], prefix: str) -> list[int]:
    """Sorted expert indices ``i`` of the keys ``{prefix}experts.{i}.*``."""
    ids = set()
    for key in block_keys:
        parts = key[len(prefix):].split(".")
        if parts[0] == "experts" and len(parts) > 1 and parts[1].isdigit():
            ids.add(int(parts[1]))
    return sorted(ids)


def _check_expert_count(fn: str, expert_ids: list[int], num_experts: int, prefix: str,
                        strict: bool) -> None:
    # Experts past E have nowhere to go whatever ``strict`` says; fewer experts are allowed
    # without ``strict`` because sharded checkpoints split a layer's experts across files.
    too_many = bool(expert_ids) and expert_ids[-1] >= num_experts
    too_few = strict and expert_ids != list(range(num_experts))
    if too_many or too_few:
        found = _format_experts(expert_ids) if expert_ids else "none"
        raise ValueError(
            f"{fn}: expected {num_experts} experts (experts.0 to experts.{num_experts - 1}) under "
            f"prefix {prefix!r}, but the state dict has {found}")


def _check_expert_bias(fn: str, moe: MoE, block_keys: Iterable[str], prefix: str,
                       s: _Style) -> None:
    # Dropping the bias would silently change which experts tokens pick, so this raises even
    # without ``strict``.
    if s.expert_bias is None or moe.router.expert_bias is not None:
        return
    key = f"{prefix}gate.{s.expert_bias}"
    if key in block_keys:
        raise ValueError(
            f"{fn}: the state dict has {key!r} (an expert-selection bias), but the MoE was built "
            f"with load_balance_bias=False; build it with MoEConfig(load_balance_bias=True)")


def _check_value(fn: str, key: str, value, view: Tensor, layout: str) -> None:
    # ``copy_`` would silently drop an imaginary part, or turn integers (quantized or mislabelled
    # data) into weights
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: expected {key!r} to be a Tensor, but got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{fn}: expected {key!r} to be a floating-point tensor like the "
                        f"{view.dtype} it is loaded into, but got {value.dtype}")
    if value.shape != view.shape:
        raise ValueError(f"{fn}: expected {key!r} of shape {list(view.shape)} ({layout}), but got "
                         f"{list(value.shape)}")


@torch.no_grad()
def load_hf_moe_state_dict(
    moe: MoE,
    state_dict: Mapping[str, Tensor],
    prefix: str = "",
    style: str = "mixtral",
    strict: bool = True,
) -> None:
    """Copies the MoE block of a HuggingFace-style ``state_dict`` into ``moe``, in place.

    Every weight is transposed from the HF ``[out, in]`` layout into ``moe``'s GEMM layout (see
    the module docstring) and cast to the dtype of the parameter it lands in; the parameter
    objects are kept. Keys outside ``prefix``, and keys under it whose first component is not
    a module of the style's MoE block (``gate``, ``experts``, the shared experts), are ignored,
    so ``state_dict`` may be a whole model's.

    Args:
        moe: the layer to fill; its config fixes E, D, F and which optional tensors exist.
        state_dict: HF tensors, e.g. from ``safetensors.torch.load_file``.
        prefix: the block's key prefix, empty or ending with ``'.'``, e.g.
            ``"model.layers.0.block_sparse_moe."``.
        style: ``"mixtral"``, ``"qwen3_moe"`` or ``"deepseek_v3"``.
        strict: raise on missing keys, on unexpected keys of the block and on fewer experts than
            E. Without it those are skipped (their parameters keep their values), which loads
            a block spread over the shards of a checkpoint one shard at a time.

    Raises:
        KeyError: ``strict`` and keys of the block are missing.
        TypeError: whatever ``strict``, a value that is not a floating-point tensor (complex,
            integer or bool tensors would be silently converted).
        ValueError: unknown style, a config the style cannot hold, ``strict`` and unexpected
            keys, and, whatever ``strict``: a shape mismatch, experts with an index >= E, and an
            ``e_score_correction_bias`` for a layer built without ``load_balance_bias``.
            Everything is checked before anything is copied: on error ``moe`` is unchanged.
    """
    fn = "load_hf_moe_state_dict"
    s = _get_style(fn, style)
    _check_prefix(fn, prefix)
    _check_compatible(fn, moe, style, s)
    block_keys = {k for k in state_dict
                  if k.startswith(prefix) and k[len(prefix):].split(".")[0] in s.block_modules}
    _check_expert_count(fn, _expert_ids(block_keys, prefix), moe.config.num_experts, prefix, strict)
    _check_expert_bias(fn, moe, block_keys, prefix, s)
    views = _hf_views(moe, prefix, s)
    if strict:
        unexpected = block_keys - views.keys()
        if unexpected:
            raise ValueError(f"{fn}: unexpected keys for style {style!r} under prefix {prefix!r}: "
                             f"{_format_keys(unexpected)}")
        missing = views.keys() - block_keys
        if missing:
            raise KeyError(f"{fn}: missing keys for style {style!r} under prefix {prefix!r}: "
                           f"{_format_keys(missing)}")
    present = [key for key in views if key in block_keys]
    for key in present:
        _check_value(fn, key, state_dict[key], *views[key])
    for key in present:
        views[key][0].copy_(state_dict[key])


@torch.no_grad()
def hf_moe_state_dict(moe: MoE, prefix: str = "", style: str = "mixtral") -> dict[str, Tensor]:
    """The HuggingFace-style state dict of ``moe``'s block: the inverse of
    :func:`load_hf_moe_state_dict`.

    Returns new contiguous tensors in the HF ``[out, in]`` layout (see the module docstring),
    in ``moe``'s dtypes and on its device, detached from it; loading them back reproduces
    ``moe`` bit for bit. Raises ``ValueError`` for an unknown style, a config the style cannot
    hold, or a non-zero ``router.expert_bias`` the style has no key for.
    """
    fn = "hf_moe_state_dict"
    s = _get_style(fn, style)
    _check_prefix(fn, prefix)
    _check_compatible(fn, moe, style, s)
    bias = moe.router.expert_bias
    if s.expert_bias is None and bias is not None and bool(bias.any()):
        raise ValueError(f"{fn}: style {style!r} has no key for router.expert_bias, but it is "
                         f"non-zero; its effect on expert selection would be lost")
    return {key: view.detach().clone(memory_format=torch.contiguous_format)
            for key, (view, _) in _hf_views(moe, prefix, s).items()}
