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

Two layouts of the routed experts (``layout=``); router and shared experts are the same in both:

- ``"checkpoint"``: one ``nn.Linear`` per expert projection, as the table above and as the
  checkpoints on the Hub store Mixtral, Qwen2/3-MoE, OLMoE and DeepSeek-V3.
- ``"transformers"``: what a transformers-5 model holds in memory (``model.state_dict()``,
  ``save_pretrained`` of a converted model): ``experts.gate_up_proj [E, 2F, D]`` (gate rows
  first) and ``experts.down_proj [E, D, F]``.

``"gpt_oss"`` has one layout (``router.weight [E, D]``, ``router.bias [E]``,
``experts.gate_up_proj [E, D, 2F]`` with gate and up columns interleaved,
``experts.gate_up_proj_bias [E, 2F]``, ``experts.down_proj [E, F, D]``,
``experts.down_proj_bias [E]``); the MoE needs ``router_bias``, ``ffn_bias`` and
``activation="swiglu_oai"`` (``MoEConfig.from_hf``). Its MXFP4 ``*_blocks`` / ``*_scales``
checkpoints are not read: dequantize them first.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from torch_moe.nn.modules.moe import MoE

__all__ = ["load_hf_moe_state_dict", "hf_moe_state_dict", "HFLoadResult", "STYLES", "LAYOUTS"]


@dataclass(frozen=True)
class _Style:
    gate: str  # HF module names of an expert's gate, up and down projections
    up: str
    down: str
    shared: Optional[str] = None  # HF module holding the shared experts
    shared_gate: Optional[str] = None  # HF module of the sigmoid gate on the shared output
    expert_bias: Optional[str] = None  # HF name, under the router, of the selection bias
    router: str = "gate"  # HF module of the router
    interleaved: bool = False  # gpt-oss: fused, interleaved, biased experts in GEMM layout

    @property
    def block_modules(self) -> set[str]:
        """First key components that belong to this style's MoE block."""
        names = {self.router, "experts", self.shared, self.shared_gate}
        return {n for n in names if n is not None}


_QWEN = _Style("gate_proj", "up_proj", "down_proj", shared="shared_expert",
               shared_gate="shared_expert_gate")
_STYLES = {
    "mixtral": _Style("w1", "w3", "w2"),
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "olmoe": _Style("gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": _Style("gate_proj", "up_proj", "down_proj", shared="shared_experts",
                          expert_bias="e_score_correction_bias"),
    "gpt_oss": _Style("gate_up_proj", "gate_up_proj", "down_proj", router="router",
                      interleaved=True),
}
STYLES = tuple(_STYLES)
LAYOUTS = ("checkpoint", "transformers")
# transformers 5's name of the fused per-layer expert weights, by which "auto" tells the layouts apart
_FUSED_NAMES = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")

# At most this many keys are spelled out in an error message; a 256-expert layer has 768.
_MAX_KEYS_SHOWN = 6


class HFLoadResult(NamedTuple):
    """What a non-strict :func:`load_hf_moe_state_dict` left out (sorted HF keys): tensors of
    ``moe`` the state dict has no key for (they keep their values), and keys of the block that
    nothing of ``moe`` takes."""

    missing_keys: list[str]
    unexpected_keys: list[str]


@dataclass(frozen=True)
class _Entry:
    """One HF tensor of the block: its shape and layout, how to read it from the MoE (a view
    where the layouts allow one) and how to write an HF value into the MoE's parameters."""

    shape: tuple[int, ...]
    layout: str
    read: Callable[[], Tensor]
    write: Callable[[Tensor], None]
    dtype: torch.dtype


def _view_entry(view: Tensor, layout: str) -> _Entry:
    return _Entry(tuple(view.shape), layout, lambda: view, view.copy_, view.dtype)


def _get_style(fn: str, style: str) -> _Style:
    if style not in _STYLES:
        raise ValueError(f"{fn}: expected style in {STYLES}, but got {style!r}")
    return _STYLES[style]


def _check_prefix(fn: str, prefix: str) -> None:
    # without the dot, "model.layers.1" would also match the keys of "model.layers.10."
    if not isinstance(prefix, str):
        raise TypeError(f"{fn}: expected prefix to be a str, but got {type(prefix).__name__}")
    if prefix and not prefix.endswith("."):
        raise ValueError(f"{fn}: expected prefix to be empty or end with '.', but got {prefix!r}")


def _check_compatible(fn: str, moe: MoE, style_name: str, s: _Style) -> None:
    """Rejects MoE configurations that the style's checkpoints cannot hold."""
    c = moe.config
    if s.interleaved:
        wanted = dict(router_bias=True, ffn_bias=True, activation="swiglu_oai")
        for name, value in wanted.items():
            if getattr(c, name) != value:
                raise ValueError(f"{fn}: style {style_name!r} needs a MoE with {name}={value!r} "
                                 f"(MoEConfig.from_hf builds it), but got {getattr(c, name)!r}")
    elif c.activation != "swiglu":
        raise ValueError(f"{fn}: style {style_name!r} has SiLU-gated experts (gate and up "
                         f"projections), but the MoE has activation={c.activation!r}; use "
                         f"activation='swiglu'")
    elif c.router_bias or c.ffn_bias:
        name = "router_bias" if c.router_bias else "ffn_bias"
        raise ValueError(f"{fn}: style {style_name!r} has no biases, but the MoE has {name}=True")
    if c.num_shared_experts > 0 and s.shared is None:
        raise ValueError(f"{fn}: style {style_name!r} has no shared experts, but the MoE has "
                         f"num_shared_experts={c.num_shared_experts}")
    if c.num_shared_experts > 0 and c.shared_expert_gate and s.shared_gate is None:
        raise ValueError(f"{fn}: style {style_name!r} has no shared-expert gate, but the MoE has "
                         f"shared_expert_gate=True")


def _gate_up(moe: MoE) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Views ``(gate [E, D, F], up [E, D, F], gate bias [E, F], up bias [E, F])`` of the
    experts' weights, fused (``w1 = [gate | up]``) or not (biases None without ``ffn_bias``)."""
    ex, F = moe.experts, moe.config.hidden_dim
    if ex.w3 is None:
        b_gate = None if ex.b1 is None else ex.b1[:, :F]
        b_up = None if ex.b1 is None else ex.b1[:, F:]
        return ex.w1[..., :F], ex.w1[..., F:], b_gate, b_up
    return ex.w1, ex.w3, ex.b1, ex.b3


def _pair_entry(first: Tensor, second: Tensor, cat, split, layout: str) -> _Entry:
    """An HF tensor holding two MoE views at once: ``cat(first, second)`` to read it (a view
    when ``cat`` can make one) and ``split(value) -> (first, second)`` to write it."""
    def write(value: Tensor) -> None:
        a, b = split(value)
        first.copy_(a)
        second.copy_(b)
    shape = tuple(cat(first[:1], second[:1]).shape)
    return _Entry((first.size(0),) + shape[1:], layout, lambda: cat(first, second), write,
                  first.dtype)


def _fused_entries(moe: MoE, p: str, s: _Style) -> dict[str, _Entry]:
    """The transformers-5 expert tensors: ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``,
    or gpt-oss's interleaved GEMM-layout tensors with their biases."""
    ex = moe.experts
    gate, up, b_gate, b_up = _gate_up(moe)
    if s.interleaved:
        def interleave(a, b):  # columns g0 u0 g1 u1 ...: a copy, there is no such view
            return torch.stack([a, b], dim=-1).flatten(-2)
        def deinterleave(v):
            return v[..., ::2], v[..., 1::2]
        return {
            f"{p}gate_up_proj": _pair_entry(gate, up, interleave, deinterleave, "[E, D, 2F] interleaved"),
            f"{p}gate_up_proj_bias": _pair_entry(b_gate, b_up, interleave, deinterleave,
                                                 "[E, 2F] interleaved"),
            f"{p}down_proj": _view_entry(ex.w2, "[E, F, D]"),
            f"{p}down_proj_bias": _view_entry(ex.b2, "[E, D]"),
        }
    F = moe.config.hidden_dim
    if ex.w3 is None:  # fused: the transformers tensor is a view of w1
        gate_up = _view_entry(ex.w1.transpose(1, 2), "[E, 2F, D]")
    else:
        gate_up = _pair_entry(
            gate, up, lambda a, b: torch.cat([a, b], dim=-1).transpose(1, 2),
            lambda v: (v[:, :F].transpose(1, 2), v[:, F:].transpose(1, 2)), "[E, 2F, D]")
    return {f"{p}gate_up_proj": gate_up,
            f"{p}down_proj": _view_entry(ex.w2.transpose(1, 2), "[E, D, F]")}


def _hf_entries(moe: MoE, prefix: str, s: _Style, layout: str) -> dict[str, _Entry]:
    """Maps every HF key of the block, in ``layout``, to its :class:`_Entry`.

    Writing goes into views of the MoE's parameters, so loading keeps the parameter objects
    (and any optimizer or FSDP references to them).
    """
    r = f"{prefix}{s.router}."
    entries = {f"{r}weight": _view_entry(moe.router.weight, "[E, D]")}
    if s.interleaved:
        entries[f"{r}bias"] = _view_entry(moe.router.bias, "[E]")
    if s.expert_bias is not None and moe.router.expert_bias is not None:
        entries[f"{r}{s.expert_bias}"] = _view_entry(moe.router.expert_bias, "[E]")
    if layout == "transformers" or s.interleaved:
        entries.update(_fused_entries(moe, f"{prefix}experts.", s))
    else:
        gate, up, _, _ = _gate_up(moe)
        w2_EFD = moe.experts.w2
        for i in range(moe.config.num_experts):
            p = f"{prefix}experts.{i}."
            entries[f"{p}{s.gate}.weight"] = _view_entry(gate[i].t(), "[F, D]")
            entries[f"{p}{s.up}.weight"] = _view_entry(up[i].t(), "[F, D]")
            entries[f"{p}{s.down}.weight"] = _view_entry(w2_EFD[i].t(), "[D, F]")
    shared = moe.shared_experts
    if shared is not None:
        p = f"{prefix}{s.shared}."
        entries[f"{p}{s.gate}.weight"] = _view_entry(shared.w1.t(), "[Fs, D]")
        entries[f"{p}{s.up}.weight"] = _view_entry(shared.w3.t(), "[Fs, D]")
        entries[f"{p}{s.down}.weight"] = _view_entry(shared.w2.t(), "[D, Fs]")
        if shared.gate is not None:
            entries[f"{prefix}{s.shared_gate}.weight"] = _view_entry(shared.gate, "[1, D]")
    return entries


def _check_layout(fn: str, layout: str, allowed: tuple[str, ...]) -> None:
    if layout not in allowed:
        raise ValueError(f"{fn}: expected layout in {allowed}, but got {layout!r}")


def _layouts_present(block_keys: Iterable[str], prefix: str) -> set[str]:
    """Which expert layouts the keys of the block hold."""
    found = set()
    for key in block_keys:
        parts = key[len(prefix):].split(".")
        if parts[0] == "experts" and len(parts) > 1:
            if parts[1].isdigit():
                found.add("checkpoint")
            elif parts[1] in _FUSED_NAMES:
                found.add("transformers")
    return found


def _resolve_layout(fn: str, layout: str, block_keys: set[str], prefix: str, s: _Style) -> str:
    present = _layouts_present(block_keys, prefix)
    if len(present) > 1:
        raise ValueError(f"{fn}: the state dict holds the experts under prefix {prefix!r} in both "
                         f"layouts (experts.<i>.* and experts.gate_up_proj / down_proj); expected one")
    if s.interleaved:
        return "transformers"
    if layout == "auto":
        return present.pop() if present else "checkpoint"
    if present and layout not in present:
        other = present.pop()
        raise ValueError(
            f"{fn}: layout={layout!r} was asked, but the experts under prefix {prefix!r} are in "
            f"the {other!r} layout ({_LAYOUT_HINT[other]}); pass layout={other!r} or 'auto'")
    return layout


_LAYOUT_HINT = {
    "checkpoint": "one experts.<i>.<proj>.weight per expert, as the Hub checkpoints store them",
    "transformers": "experts.gate_up_proj [E, 2F, D] and experts.down_proj [E, D, F], as a "
                    "transformers-5 model holds them in memory",
}


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
    key = f"{prefix}{s.router}.{s.expert_bias}"
    if key in block_keys:
        raise ValueError(
            f"{fn}: the state dict has {key!r} (an expert-selection bias), but the MoE was built "
            f"with load_balance_bias=False; build it with MoEConfig(load_balance_bias=True)")


def _check_value(fn: str, key: str, value, entry: _Entry) -> None:
    # ``copy_`` would silently drop an imaginary part, or turn integers (quantized or mislabelled
    # data) into weights
    if not isinstance(value, Tensor):
        raise TypeError(f"{fn}: expected {key!r} to be a Tensor, but got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{fn}: expected {key!r} to be a floating-point tensor like the "
                        f"{entry.dtype} it is loaded into, but got {value.dtype}")
    if tuple(value.shape) != entry.shape:
        raise ValueError(f"{fn}: expected {key!r} of shape {list(entry.shape)} ({entry.layout}), "
                         f"but got {list(value.shape)}")


@torch.no_grad()
def load_hf_moe_state_dict(
    moe: MoE,
    state_dict: Mapping[str, Tensor],
    prefix: str = "",
    style: str = "mixtral",
    strict: bool = True,
    layout: str = "auto",
) -> HFLoadResult:
    """Copies the MoE block of a HuggingFace-style ``state_dict`` into ``moe``, in place.

    Every weight is transposed from the HF layout into ``moe``'s GEMM layout (see the module
    docstring) and cast to the dtype of the parameter it lands in; the parameter objects are
    kept. Keys outside ``prefix``, and keys under it whose first component is not a module of
    the style's MoE block (the router, ``experts``, the shared experts), are ignored, so
    ``state_dict`` may be a whole model's.

    Args:
        moe: the layer to fill; its config fixes E, D, F and which optional tensors exist
            (``MoEConfig.from_hf(model.config)`` builds the matching one).
        state_dict: HF tensors, e.g. from ``safetensors.torch.load_file`` (``"checkpoint"``
            layout) or a transformers-5 ``model.state_dict()`` (``"transformers"`` layout).
        prefix: the block's key prefix, empty or ending with ``'.'``, e.g.
            ``"model.layers.0.block_sparse_moe."`` (Hub Mixtral) or ``"model.layers.0.mlp."``.
        style: one of :data:`STYLES`.
        strict: raise on missing keys, on unexpected keys of the block and on fewer experts than
            E. Without it nothing is raised for those: the tensors without a key keep their
            values and the result names every key left out, which loads a block spread over
            the shards of a checkpoint one shard at a time.
        layout: ``"checkpoint"``, ``"transformers"`` or ``"auto"`` (the one the keys are in).

    Returns:
        :class:`HFLoadResult` ``(missing_keys, unexpected_keys)``, both empty after a strict load.

    Raises:
        KeyError: ``strict`` and keys of the block are missing.
        TypeError: whatever ``strict``, a value that is not a floating-point tensor (complex,
            integer or bool tensors would be silently converted).
        ValueError: unknown style or layout, a config the style cannot hold, ``strict`` and
            unexpected keys, and, whatever ``strict``: keys of the other layout than
            ``layout`` or of both, a shape mismatch, experts with an index >= E, and a
            selection bias for a layer built without ``load_balance_bias``. Everything is
            checked before anything is copied: on error ``moe`` is unchanged.
    """
    fn = "load_hf_moe_state_dict"
    s = _get_style(fn, style)
    _check_prefix(fn, prefix)
    _check_layout(fn, layout, LAYOUTS + ("auto",))
    _check_compatible(fn, moe, style, s)
    block_keys = {k for k in state_dict
                  if k.startswith(prefix) and k[len(prefix):].split(".")[0] in s.block_modules}
    layout = _resolve_layout(fn, layout, block_keys, prefix, s)
    if layout == "checkpoint":
        _check_expert_count(fn, _expert_ids(block_keys, prefix), moe.config.num_experts, prefix,
                            strict)
    _check_expert_bias(fn, moe, block_keys, prefix, s)
    entries = _hf_entries(moe, prefix, s, layout)
    unexpected = sorted(block_keys - entries.keys())
    missing = sorted(entries.keys() - block_keys)
    where = f"for style {style!r} ({layout} layout) under prefix {prefix!r}"
    if strict and unexpected:
        raise ValueError(f"{fn}: unexpected keys {where}: {_format_keys(unexpected)}")
    if strict and missing:
        raise KeyError(f"{fn}: missing keys {where}: {_format_keys(missing)}; pass strict=False "
                       f"to load the others and get the missing keys back")
    present = [key for key in entries if key in block_keys]
    for key in present:
        _check_value(fn, key, state_dict[key], entries[key])
    for key in present:
        entries[key].write(state_dict[key])
    return HFLoadResult(missing, unexpected)


@torch.no_grad()
def hf_moe_state_dict(moe: MoE, prefix: str = "", style: str = "mixtral",
                      layout: str = "checkpoint") -> dict[str, Tensor]:
    """The HuggingFace-style state dict of ``moe``'s block in ``layout`` (``"checkpoint"``:
    one tensor per expert projection, as on the Hub; ``"transformers"``: a transformers-5
    model's fused ``experts.gate_up_proj`` / ``experts.down_proj``): the inverse of
    :func:`load_hf_moe_state_dict`.

    Returns new contiguous tensors in the HF layouts (see the module docstring), in ``moe``'s
    dtypes and on its device, detached from it; loading them back reproduces ``moe`` bit for
    bit. Raises ``ValueError`` for an unknown style or layout, a config the style cannot hold,
    or a non-zero ``router.expert_bias`` the style has no key for.
    """
    fn = "hf_moe_state_dict"
    s = _get_style(fn, style)
    _check_prefix(fn, prefix)
    _check_layout(fn, layout, LAYOUTS)
    _check_compatible(fn, moe, style, s)
    bias = moe.router.expert_bias
    if s.expert_bias is None and bias is not None and bool(bias.any()):
        raise ValueError(f"{fn}: style {style!r} has no key for router.expert_bias, but it is "
                         f"non-zero; its effect on expert selection would be lost")
    return {key: entry.read().detach().clone(memory_format=torch.contiguous_format)
            for key, entry in _hf_entries(moe, prefix, s, layout).items()}
