"""``torch_moe.scaled_grouped_mm``: grouped GEMM on FP8 / MXFP8 operands.

The CPU kernel is an emulation that is exact in what it promises: both operands are
dequantized to fp32 (exact: an FP8 value times a power of two), multiplied group by group with
fp32 accumulation, and rounded once to ``out_dtype``. The CUDA kernel (``_cuda.py``) differs by
its accumulation order and, because ``torch._scaled_grouped_mm`` and ``torch._grouped_mm`` write
bf16 only on CUDA in torch 2.13, by a rounding through bf16 when ``out_dtype`` is fp32 or fp16.

Layouts (``offs [G]`` int32 group ends along M):

    2D x 3D   a [M, K] @ b [G, K, N] -> [M, N]       MXFP8: scale_a [M, K/32], scale_b [G, K/32, N]
                                                     FP8:   scale_a [M, 1],    scale_b [G, 1, N]
    2D x 2D   a [K, M] @ b [M, N]    -> [G, K, N]    MXFP8: scale_a [K, M/32], scale_b [M/32, N]
                                                     FP8:   scale_a [K, G],    scale_b [G, N]
"""

import torch

from torch_moe.quantization import _checks as C
from torch_moe.quantization import _quantize as Q

_OP = "torch_moe.scaled_grouped_mm"


def recipe_of(scale_a: torch.Tensor, scale_b: torch.Tensor) -> str:
    mx = (torch.uint8, torch.float8_e8m0fnu)
    if scale_a.dtype in mx and scale_b.dtype in mx:
        return "mxfp8"
    torch._check(
        scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32,
        lambda: f"{_OP}: expected both scales to be E8M0 bytes (uint8 or float8_e8m0fnu, MXFP8) "
        f"or both float32 (FP8 rowwise), but got {scale_a.dtype} and {scale_b.dtype}",
    )
    return "fp8_rowwise"


def check_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype) -> str:
    """Metadata checks; returns the recipe the scale dtypes select."""
    C.check_elem_dtype(_OP, "mat_a", mat_a.dtype)
    C.check_elem_dtype(_OP, "mat_b", mat_b.dtype)
    C.check_out_dtype(_OP, out_dtype)
    C.check_group_offsets_meta(_OP, offs)
    recipe = recipe_of(scale_a, scale_b)
    torch._check(
        mat_a.dim() == 2 and mat_b.dim() in (2, 3),
        lambda: f"{_OP}: expected a 2D x 3D (a [M, K], b [G, K, N]) or 2D x 2D (a [K, M], "
        f"b [M, N]) layout, but got mat_a {tuple(mat_a.shape)} and mat_b {tuple(mat_b.shape)}",
    )
    G = offs.size(0)
    if mat_b.dim() == 3:
        M, K = mat_a.shape
        torch._check(
            mat_b.size(0) == G and mat_b.size(1) == K,
            lambda: f"{_OP}: expected mat_b of shape [{G}, {K}, N] (G = offs.size(0), K = "
            f"mat_a.size(1)), but got {tuple(mat_b.shape)}",
        )
        a_dim, b_dim, groups = 1, 1, 1
    else:
        K, M = mat_a.shape
        torch._check(
            mat_b.size(0) == M,
            lambda: f"{_OP}: expected mat_b of shape [{M}, N] (M = mat_a.size(1), the grouped "
            f"contraction), but got {tuple(mat_b.shape)}",
        )
        a_dim, b_dim, groups = 1, 0, G
    check = C.check_mx_scale if recipe == "mxfp8" else C.check_rowwise_scale
    for name, mat, scale, dim in (("scale_a", mat_a, scale_a, a_dim), ("scale_b", mat_b, scale_b, b_dim)):
        if recipe == "mxfp8":
            C.check_block_dim(_OP, "mat_a" if name == "scale_a" else "mat_b", mat, dim)
            expected = C.mx_scale_shape(mat.shape, dim)
        else:
            expected = C.rowwise_scale_shape(mat.shape, dim, groups)
        check(_OP, name, scale, expected)
    torch._check(
        mat_a.device == mat_b.device == scale_a.device == scale_b.device == offs.device,
        lambda: f"{_OP}: expected all tensors on one device, but got mat_a on {mat_a.device}, "
        f"mat_b on {mat_b.device}, scales on {scale_a.device} / {scale_b.device}, offs on "
        f"{offs.device}",
    )
    return recipe


def output_shape(mat_a, mat_b, offs) -> tuple:
    if mat_b.dim() == 3:
        return (mat_a.size(0), mat_b.size(2))
    return (offs.size(0), mat_a.size(0), mat_b.size(1))


def _dequantize(recipe, data, scale, dim, offs=None):
    if recipe == "mxfp8":
        return Q.dequantize_mxfp8(data, scale, dim)
    return Q.dequantize_fp8_rowwise(data, scale, dim, offs)


def scaled_grouped_mm_emulated(mat_a, mat_b, scale_a, scale_b, offs, out_dtype=torch.bfloat16):
    """Device-generic emulation (the CPU kernel)."""
    recipe = check_scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs, out_dtype)
    grouped_dim_size = mat_a.size(0) if mat_b.dim() == 3 else mat_a.size(1)
    C.check_group_offsets(_OP, offs, grouped_dim_size, C.GROUP_ALIGNMENT[recipe])
    if recipe == "fp8_rowwise":
        C.check_rowwise_scale_values(_OP, "scale_a", scale_a)
        C.check_rowwise_scale_values(_OP, "scale_b", scale_b)
    if mat_b.dim() == 3:
        a = _dequantize(recipe, mat_a, scale_a, 1)
        b = _dequantize(recipe, mat_b, scale_b, 1)
    else:
        a = _dequantize(recipe, mat_a, scale_a, 1, offs)
        b = _dequantize(recipe, mat_b, scale_b, 0, offs)
    return torch.ops.torch_moe.grouped_mm(a, b, offs).to(out_dtype)
