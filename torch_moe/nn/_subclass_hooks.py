"""Functions that run ``moe_ffn`` and ``MoE`` on a tensor subclass, looked up by the input's type.

``nn`` computes on plain tensors. A subclass whose tensors mean more than their values (a
``DTensor`` is one global tensor whose shards live on many ranks) is run by the package that
owns it, which registers its handlers here: :mod:`torch_moe.distributed` registers those of
``DTensor`` as soon as ``torch.distributed.tensor`` is imported. ``nn`` imports nothing of
the owners.

Plain tensors, parameters and the subclasses that tracing wraps plain tensors in (fake and
functional tensors) take the plain path. Any other subclass without a handler raises rather
than running kernels that do not know what its values mean.
"""

from typing import Callable, NamedTuple, Optional

from torch import nn, Tensor

from torch_moe._compat import is_plain_or_tracing_tensor_type

__all__ = ["SubclassHandlers", "register_subclass_handlers", "subclass_handlers"]


class SubclassHandlers(NamedTuple):
    """How one tensor subclass runs the MoE layer.

    Attributes:
        moe_ffn: ``(x, topk_ids, topk_weights, w1, w2, w3, local_moe_ffn) -> y`` for
            :func:`torch_moe.nn.functional.moe_ffn`; ``local_moe_ffn`` takes the same six
            tensors as plain tensors (the arguments of ``moe_ffn`` already bound) and computes
            the routed experts on them.
        moe_layer: ``(moe, x, return_aux_loss) -> y`` for :meth:`torch_moe.nn.MoE.forward`.
    """

    moe_ffn: Callable[..., Tensor]
    moe_layer: Callable[..., Tensor]


_HANDLERS: dict[type, SubclassHandlers] = {}


def register_subclass_handlers(cls: type, *, moe_ffn: Callable[..., Tensor],
                               moe_layer: Callable[..., Tensor]) -> None:
    """Runs ``moe_ffn`` / ``MoE`` on inputs of type ``cls`` (and its subclasses) through these
    functions. Registering a type again replaces its handlers."""
    if not (isinstance(cls, type) and issubclass(cls, Tensor)) or cls is Tensor:
        raise TypeError(f"register_subclass_handlers: expected a subclass of torch.Tensor, but got "
                        f"{cls!r}")
    _HANDLERS[cls] = SubclassHandlers(moe_ffn, moe_layer)


def subclass_handlers(op: str, x: Tensor) -> Optional[SubclassHandlers]:
    """The handlers of ``type(x)`` or of its nearest registered base; None where ``x`` takes the
    plain path. ``op`` names the caller in the error raised for an unsupported subclass."""
    cls = type(x)
    if cls is Tensor or cls is nn.Parameter:  # the common cases first, constants under Dynamo
        return None
    # (issubclass over the registered types rather than a walk of cls.__mro__, which Dynamo
    # cannot trace)
    matches = [t for t in _HANDLERS if issubclass(cls, t)]
    if matches:
        nearest = min(matches, key=lambda t: cls.__mro__.index(t)) if len(matches) > 1 else matches[0]
        return _HANDLERS[nearest]
    if issubclass(cls, nn.Parameter) or is_plain_or_tracing_tensor_type(cls):
        return None
    supported = ", ".join(sorted(t.__name__ for t in _HANDLERS)) or "none registered"
    raise TypeError(
        f"{op}: expected x to be a plain tensor or a tensor subclass with MoE handlers "
        f"({supported}), but got a {cls.__module__}.{cls.__qualname__}; the package that "
        "owns the subclass registers them with torch_moe.nn._subclass_hooks."
        "register_subclass_handlers"
    )
