"""``torch_moe.quantized_grouped_mm``: a trainable grouped GEMM in FP8 rowwise or MXFP8.

``out [M, N] = input [M, K] @ weight [G, K, N]`` with the rows of ``input`` split by ``offs``.
Each of the three GEMMs quantizes its two operands along *its own* contraction dim, from the
high-precision tensors (quantization and transposition do not commute, so nothing quantized is
reused across GEMMs):

    GEMM                            contracts   input / grad_out          weight
    forward   out  = x @ W[g]       K           x along K (rows)          W along K
    dgrad     dx   = dy @ W[g]^T    N           dy along N (rows)         W along N
    wgrad     dW[g] = x_g^T @ dy_g  M_g         x, dy along M, per group  (-)

For the wgrad GEMM MXFP8 blocks (32 rows) and FP8 per-group scales must not straddle groups:
every group size is a multiple of 32 (MXFP8) or 16 (FP8), which ``token_sort(..., align=)``
provides. ``wgrad_high_precision`` computes dW in the input dtype instead (torchao's
``wgrad_with_hp``, TransformerEngine's ``rowwise_with_gw_hp``).

Operand layouts: every operand is quantized into the layout the GEMM reads (aten's scaled
grouped GEMM: ``mat_a`` row-major, ``mat_b`` column-major), quantizing a transposed view where
that layout is the transpose (the forward's ``W``, both weight-gradient operands); the CUDA
quantizers write the transposed copy in the same pass, and the GEMM copies nothing.

Saved for backward: ``input`` and ``weight`` in high precision (the quantized copies are
rebuilt along the backward axes, which is cheaper in memory than keeping three of them); the
backward formulas are in :mod:`torch_moe.quantization._autograd`.
"""

import torch

from torch_moe import _checks as core_checks
from torch_moe.quantization import _checks as C

ops = torch.ops.torch_moe
_OP = "torch_moe.quantized_grouped_mm"


def check_quantized_grouped_mm(input, weight, offs, recipe, scale_mode) -> None:
    C.check_recipe(_OP, recipe)
    C.check_scale_mode(_OP, scale_mode)
    C.check_quantizable(_OP, "input", input)
    core_checks.check_dim(_OP, "input", input, 2)
    core_checks.check_dim(_OP, "weight", weight, 3)
    core_checks.check_same_dtype(_OP, {"input": input, "weight": weight})
    C.check_group_offsets_meta(_OP, offs)
    G, K, N = weight.shape
    torch._check(
        input.size(1) == K,
        lambda: f"{_OP}: expected input.size(1) == weight.size(1) (K = {K}), but got {input.size(1)}",
    )
    torch._check(
        offs.size(0) == G,
        lambda: f"{_OP}: expected offs.size(0) == weight.size(0) (G = {G}), but got {offs.size(0)}",
    )
    if recipe == "mxfp8":
        # forward blocks along K, dgrad along N
        C.check_block_dim(_OP, "weight", weight, 1)
        C.check_block_dim(_OP, "weight", weight, 2)


def quantize(t, dim, recipe, scale_mode, offs=None):
    """Quantizes ``t`` along ``dim`` with the recipe's elements (E4M3) and scales."""
    if recipe == "mxfp8":
        return ops.quantize_mxfp8(t, dim, torch.float8_e4m3fn, scale_mode)
    return ops.quantize_fp8_rowwise(t, dim, offs)


def quantized_grouped_mm_forward(input, weight, offs, recipe, scale_mode="rceil"):
    """The forward body: metadata checks, the two quantizers and the scaled grouped GEMM, which
    checks the values of offs. Traceable: the Inductor decomposition is this function."""
    check_quantized_grouped_mm(input, weight, offs, recipe, scale_mode)
    a, scale_a = quantize(input, 1, recipe, scale_mode)
    # W quantized along K from its transposed view: data [G, N, K] contiguous, which is the
    # column-major [G, K, N] operand aten's scaled grouped GEMM takes, in one pass on CUDA
    bt, scale_bt = quantize(weight.transpose(1, 2), 2, recipe, scale_mode)
    return ops.scaled_grouped_mm(
        a, bt.transpose(1, 2), scale_a, scale_bt.transpose(1, 2), offs, input.dtype
    )


def quantized_grouped_mm(input, weight, offs, recipe, scale_mode="rceil", wgrad_high_precision=False):
    check_quantized_grouped_mm(input, weight, offs, recipe, scale_mode)
    # the GEMM checks offs too, but an eager error should name this op, the one the caller
    # called (a host read of offs, which a traced graph cannot make)
    C.check_group_offsets(_OP, offs, input.size(0), C.GROUP_ALIGNMENT[recipe])
    return quantized_grouped_mm_forward(input, weight, offs, recipe, scale_mode)
