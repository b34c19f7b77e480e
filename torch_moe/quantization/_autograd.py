"""Derivative formulas of the quantization ops (counterpart of ``tools/autograd/derivatives.yaml``).

Only ``quantized_grouped_mm`` is differentiable (the quantizers and ``scaled_grouped_mm`` are
not: their outputs are FP8 data and scales). Its backward quantizes along the contraction dim
of each backward GEMM, from the high-precision tensors saved in forward
(:mod:`torch_moe.quantization._grouped_mm` tells why).
"""

import torch

from torch_moe.quantization._checks import GROUP_ALIGNMENT
from torch_moe.quantization._grouped_mm import quantize

ops = torch.ops.torch_moe


def _quantized_grouped_mm_setup(ctx, inputs, output):
    input, weight, offs, recipe, scale_mode, wgrad_high_precision = inputs
    ctx.save_for_backward(input, weight, offs)
    ctx.recipe, ctx.scale_mode, ctx.wgrad_high_precision = recipe, scale_mode, wgrad_high_precision


def _quantized_grouped_mm_backward(ctx, grad):
    input, weight, offs = ctx.saved_tensors
    recipe, mode = ctx.recipe, ctx.scale_mode
    grad = grad.to(input.dtype)
    grad_input = grad_weight = None
    if ctx.needs_input_grad[0]:
        # dx [M, K] = dy [M, N] @ W[g]^T [N, K]: both quantized along N
        g, scale_g = quantize(grad, 1, recipe, mode)
        w, scale_w = quantize(weight, 2, recipe, mode)
        grad_input = ops.scaled_grouped_mm(
            g, w.transpose(1, 2), scale_g, scale_w.transpose(1, 2), offs, input.dtype
        )
    if ctx.needs_input_grad[1]:
        if ctx.wgrad_high_precision:
            grad_weight = ops.grouped_mm(input.t(), grad, offs)
        else:
            # dW[g] [K, N] = x_g^T [K, M_g] @ dy_g [M_g, N]: both quantized along M. Rows past
            # offs[-1] belong to no group; with aligned groups offs[-1] <= M rounded down to the
            # alignment, so those rows can be cut to make M a whole number of blocks.
            M = input.size(0)
            rows = M - M % GROUP_ALIGNMENT[recipe]
            # Quantized from transposed views: x^T [K, M] row-major and dy^T [N, M], i.e. dy
            # column-major, the layouts of the GEMM's operands (one pass each on CUDA).
            xt, scale_xt = quantize(input.narrow(0, 0, rows).t(), 1, recipe, mode, offs)
            gt, scale_gt = quantize(grad.narrow(0, 0, rows).t(), 1, recipe, mode, offs)
            grad_weight = ops.scaled_grouped_mm(
                xt, gt.t(), scale_xt, scale_gt.t(), offs, weight.dtype
            )
    return grad_input, grad_weight, None, None, None, None


torch.library.register_autograd(
    "torch_moe::quantized_grouped_mm", _quantized_grouped_mm_backward,
    setup_context=_quantized_grouped_mm_setup,
)
