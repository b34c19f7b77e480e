"""Functions that run ``moe_ffn`` and ``MoE`` on a tensor subclass, looked up by the input's type.

``nn`` computes on plain tensors. A subclass whose tensors mean more than their values (a
``DTensor`` is one global tensor whose shards live on many ranks) is run by the package that
owns it, which registers its handlers here: :mod:`torch_moe.distributed` registers those of
``DTensor`` as soon as ``torch.distributed.tensor`` is imported. ``nn`` imports nothing of
the owners.

A subclass without handlers takes the plain path: every op of the layer then dispatches
through the subclass's own ``__torch_dispatch__`` (fake and functional tensors while tracing,
``LocalTensor`` simulating ranks, a ``TwoTensor``), which says what the op means for it. Only a
subclass whose meaning is not per op, as a DTensor's token routing is not, needs handlers.
"""

from typing import Callable, NamedTuple, Optional

from torch import nn, Tensor

__all__ = ["SubclassHandlers", "register_subclass_handlers", "subclass_handlers"]


class SubclassHandlers(NamedTuple):
    """How one tensor subclass runs the MoE layer.

    Attributes:
        moe_ffn: ``(x, topk_ids, topk_weights, w1, w2, w3, local_moe_ffn) -> y`` for
            :func:`torch_moe.nn.functional.moe_ffn`; ``local_moe_ffn`` takes the same six
            tensors as plain tensors (the arguments of ``moe_ffn`` already bound) and computes
            the routed experts on them. When expert biases are given they follow as keywords
            ``b1=, b2=, b3=``, which ``local_moe_ffn`` takes too; a handler without those
            parameters makes ``moe_ffn`` with biases raise.
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


def subclass_handlers(x: Tensor) -> Optional[SubclassHandlers]:
    """The handlers of ``type(x)`` or of its nearest registered base; None where ``x`` takes the
    plain path."""
    cls = type(x)
    if cls is Tensor or cls is nn.Parameter or not _HANDLERS:  # constants under Dynamo
        return None
    # (issubclass over the registered types rather than a walk of cls.__mro__, which Dynamo
    # cannot trace)
    matches = [t for t in _HANDLERS if issubclass(cls, t)]
    if not matches:
        return None
    nearest = min(matches, key=lambda t: cls.__mro__.index(t)) if len(matches) > 1 else matches[0]
    return _HANDLERS[nearest]
