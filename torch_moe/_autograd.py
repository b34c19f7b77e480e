"""Derivative formulas of the torch_moe ops (counterpart of ``tools/autograd/derivatives.yaml``).

Each backward is itself a torch_moe op (or the forward op with permuted arguments), so the
backward graph stays traceable by AOTAutograd and shardable by DTensor.
"""

import torch

ops = torch.ops.torch_moe


def _register(name, setup_context):
    def deco(backward):
        torch.library.register_autograd(f"torch_moe::{name}", backward, setup_context=setup_context)
        return backward

    return deco


# permute: out[i] = x[sorted_ids[i] // k]  =>  grad_x[t] = sum of grad over the slots of t
def _permute_setup(ctx, inputs, output):
    x, sorted_ids, top_k = inputs
    ctx.save_for_backward(sorted_ids)
    ctx.top_k = top_k
    ctx.num_tokens = x.size(0)


@_register("permute", _permute_setup)
def _permute_backward(ctx, grad):
    (sorted_ids,) = ctx.saved_tensors
    return ops.permute_backward(grad, sorted_ids, ctx.top_k, ctx.num_tokens), None, None


def _permute_backward_setup(ctx, inputs, output):
    _, sorted_ids, top_k, _ = inputs
    ctx.save_for_backward(sorted_ids)
    ctx.top_k = top_k


@_register("permute_backward", _permute_backward_setup)
def _permute_backward_backward(ctx, grad):
    (sorted_ids,) = ctx.saved_tensors
    return ops.permute(grad, sorted_ids, ctx.top_k), None, None, None


# unpermute: out[t] = sum_j w[t, j] * y[slot(t, j)]
def _unpermute_setup(ctx, inputs, output):
    y, sorted_ids, topk_weights = inputs
    ctx.save_for_backward(y, sorted_ids, topk_weights)


@_register("unpermute", _unpermute_setup)
def _unpermute_backward(ctx, grad):
    y, sorted_ids, topk_weights = ctx.saved_tensors
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2]]
    grad_y, grad_w = ops.unpermute_backward(grad, y, sorted_ids, topk_weights, mask)
    return grad_y if mask[0] else None, None, grad_w if mask[1] else None


# grouped_mm: every layout's gradients are grouped_mm calls in another layout.
def _grouped_mm_setup(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


@_register("grouped_mm", _grouped_mm_setup)
def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b, _ = ctx.needs_input_grad
    grad_a = grad_b = None
    if a.dim() == 2 and b.dim() == 3:
        # out[rows_g] = a[rows_g] @ b[g]
        if need_a:
            grad_a = ops.grouped_mm(grad, b.transpose(-2, -1), offs)  # 2D x 3D
        if need_b:
            grad_b = ops.grouped_mm(a.t(), grad, offs)  # 2D x 2D over the rows
    elif a.dim() == 3 and b.dim() == 2:
        # out[:, cols_g] = a[g] @ b[:, cols_g]
        if need_a:
            grad_a = ops.grouped_mm(grad, b.t(), offs)  # 2D x 2D over the columns
        if need_b:
            grad_b = ops.grouped_mm(a.transpose(-2, -1), grad, offs)  # 3D x 2D
    else:
        # out[g] = a[:, ks_g] @ b[ks_g, :]
        if need_a:
            grad_a = ops.grouped_mm(grad, b.t(), offs)  # 3D x 2D
        if need_b:
            grad_b = ops.grouped_mm(a.t(), grad, offs)  # 2D x 3D
    return grad_a, grad_b, None


# indexed_grouped_mm
def _indexed_setup(ctx, inputs, output):
    input, weight, offs, gather_index, scatter_index, scatter_weight, _ = inputs
    ctx.save_for_backward(input, weight, offs, gather_index, scatter_index, scatter_weight)


@_register("indexed_grouped_mm", _indexed_setup)
def _indexed_backward(ctx, grad):
    input, weight, offs, gather_index, scatter_index, scatter_weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[1], scatter_weight is not None and need[5]]
    grad_input, grad_weight, grad_sw = ops.indexed_grouped_mm_backward(
        grad, input, weight, offs, gather_index, scatter_index, scatter_weight, mask
    )
    return (
        grad_input if mask[0] else None,
        grad_weight if mask[1] else None,
        None,
        None,
        None,
        grad_sw if mask[2] else None,
        None,
    )


# grouped_ffn: saves x, the routing, the weights, the biases and `hidden` (which includes the
# biases); the activation is recomputed.
def _grouped_ffn_setup(ctx, inputs, output):
    x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, alpha, limit, b1, b2, b3 = inputs
    _, hidden = output
    ctx.mark_non_differentiable(hidden)
    # `hidden` never has a gradient: without this, autograd would hand backward a zero tensor of
    # its size ([S, 2F], the largest activation of the layer) to allocate, fill and ignore
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, b1, b2, b3)
    ctx.activation, ctx.alpha, ctx.limit = activation, alpha, limit


@_register("grouped_ffn", _grouped_ffn_setup)
def _grouped_ffn_backward(ctx, grad, _grad_hidden):
    if grad is None:
        # with grads not materialised, an output that reaches no loss has no gradient at all
        return (None,) * 13
    x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, b1, b2, b3 = ctx.saved_tensors
    need = ctx.needs_input_grad
    # frozen experts (weights without requires_grad) skip their weight-gradient GEMMs, frozen
    # biases their row sums
    mask = [need[0], need[3], need[4], need[5], w3 is not None and need[6],
            b1 is not None and need[10], b2 is not None and need[11],
            b3 is not None and need[12]]
    grads = ops.grouped_ffn_backward(
        grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden, ctx.activation, ctx.alpha,
        ctx.limit, mask, b1, b2, b3,
    )
    grad_x, grad_topk, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3 = (
        g if want else None for g, want in zip(grads, mask)
    )
    return (
        grad_x, None, None, grad_topk, grad_w1, grad_w2, grad_w3, None, None, None,
        grad_b1, grad_b2, grad_b3,
    )
