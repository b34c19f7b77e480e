"""Fake (meta) kernels for the torch_moe ops.

Counterpart of ``torch/_meta_registrations.py``: each kernel checks metadata with the shared
checks of :mod:`torch_moe._checks` and returns an empty tensor with the exact shape, dtype and
strides of the device kernel's output. Every output size is static (a function of input sizes),
so none of these ops needs an unbacked symbol or a host synchronisation under tracing.
"""

import torch

from torch_moe import _checks
from torch_moe._native._layouts import empty_weight_grad


def _register(name):
    return torch.library.register_fake(f"torch_moe::{name}")


@_register("token_sort")
def token_sort_meta(topk_ids, num_experts, align=1):
    _checks.check_token_sort(topk_ids, num_experts, align)
    S = _checks.token_sort_num_slots(topk_ids.numel(), num_experts, align)
    dev = topk_ids.device
    return (
        topk_ids.new_empty((S,), dtype=torch.int64),
        torch.empty((num_experts,), dtype=torch.int32, device=dev),
        torch.empty((num_experts,), dtype=torch.int64, device=dev),
    )


@_register("permute")
def permute_meta(x, sorted_ids, top_k):
    _checks.check_permute(x, sorted_ids, top_k)
    return x.new_empty((sorted_ids.size(0), x.size(1)))


@_register("permute.out")
def permute_out_meta(x, sorted_ids, top_k, *, out):
    _checks.check_permute_out(x, sorted_ids, top_k, out)


@_register("permute_backward")
def permute_backward_meta(grad, sorted_ids, top_k, num_tokens):
    _checks.check_permute_backward(grad, sorted_ids, top_k, num_tokens)
    return grad.new_empty((num_tokens, grad.size(1)))


@_register("unpermute")
def unpermute_meta(y, sorted_ids, topk_weights):
    _checks.check_unpermute(y, sorted_ids, topk_weights)
    return y.new_empty((topk_weights.size(0), y.size(1)))


def _grad_like(t: torch.Tensor, wanted: bool) -> torch.Tensor:
    """The gradient of ``t`` if requested by the output mask, else an empty tensor."""
    return t.new_empty(t.shape) if wanted else t.new_empty((0,))


def _weight_grad_like(w: torch.Tensor, wanted: bool) -> torch.Tensor:
    """The gradient of the weight ``w`` if requested, in the strides the device kernels give it
    (those of ``w`` where it is dense), else an empty tensor."""
    return empty_weight_grad(w) if wanted else w.new_empty((0,))


@_register("unpermute_backward")
def unpermute_backward_meta(grad, y, sorted_ids, topk_weights, output_mask):
    _checks.check_unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask)
    return _grad_like(y, output_mask[0]), _grad_like(topk_weights, output_mask[1])


@_register("grouped_mm")
def grouped_mm_meta(a, b, offs):
    _checks.check_grouped_mm(a, b, offs)
    return a.new_empty(_checks.grouped_mm_out_shape(a, b, offs))


@_register("indexed_grouped_mm")
def indexed_grouped_mm_meta(
    input, weight, offs, gather_index=None, scatter_index=None, scatter_weight=None,
    num_out_rows=-1,
):
    S = _checks.check_indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows
    )
    rows = num_out_rows if scatter_index is not None else S
    return input.new_empty((rows, weight.size(2)))


@_register("indexed_grouped_mm_backward")
def indexed_grouped_mm_backward_meta(
    grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
):
    _checks.check_indexed_grouped_mm_backward(
        grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
    )
    want_input, want_weight, want_sw = output_mask
    grad_sw = (
        _grad_like(scatter_weight, want_sw) if scatter_weight is not None
        else input.new_empty((0,))
    )
    return _grad_like(input, want_input), _weight_grad_like(weight, want_weight), grad_sw


@_register("grouped_ffn")
def grouped_ffn_meta(x, sorted_ids, offs, topk_weights, w1, w2, w3=None, activation="swiglu",
                     alpha=1.702, limit=7.0, b1=None, b2=None, b3=None):
    _, F = _checks.check_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                                     b1=b1, b2=b2, b3=b3)
    width = 2 * F if activation in _checks.GATED_ACTIVATIONS else F
    return x.new_empty(x.shape), x.new_empty((sorted_ids.size(0), width))


def _optional_grad_like(t, wanted: bool, like: torch.Tensor) -> torch.Tensor:
    """The gradient of an optional input ``t``; an empty tensor (of ``like``) where it is None."""
    return _grad_like(t, wanted) if t is not None else like.new_empty((0,))


@_register("grouped_ffn_backward")
def grouped_ffn_backward_meta(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden,
                              activation, alpha, limit, output_mask, b1=None, b2=None, b3=None):
    _checks.check_grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden,
                                       activation, output_mask, b1=b1, b2=b2, b3=b3)
    want_x, want_topk, want_w1, want_w2, want_w3, want_b1, want_b2, want_b3 = output_mask
    return (
        _grad_like(x, want_x),
        _grad_like(topk_weights, want_topk),
        _weight_grad_like(w1, want_w1),
        _weight_grad_like(w2, want_w2),
        _weight_grad_like(w3, want_w3) if w3 is not None else w1.new_empty((0,)),
        _optional_grad_like(b1, want_b1, w1),
        _optional_grad_like(b2, want_b2, w1),
        _optional_grad_like(b3, want_b3, w1),
    )
