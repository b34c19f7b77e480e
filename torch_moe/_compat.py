"""The adapter of torch_moe's ops to the private parts of PyTorch's core.

Every private core API that the ops, their kernels and the ``nn`` layer need (``torch._*``,
``torch.ops.aten._*``, ``torch._subclasses``, ``torch.export._*``, the oneDNN probes) is reached
through this module, so that a new torch release that renames one breaks one place. Each entry
detects the feature it needs rather than comparing version strings, and uses the public API
where torch has one (``torch.nn.functional.grouped_mm`` and ``scaled_grouped_mm``).

The other rooms have their own adapters: :mod:`torch_moe._inductor._compat` (Inductor, Dynamo),
:mod:`torch_moe.distributed._compat` (c10d, functional collectives) and
:mod:`torch_moe.distributed.tensor._compat` (DTensor's sharding-strategy internals).

``torch._check`` and its siblings (``_check_index``, ``_check_value``, ...) are not wrapped:
they are the way PyTorch's own meta registrations and the ``torch.export`` documentation state
conditions that tracing keeps, and the fake kernels here mirror ``torch/_meta_registrations.py``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "assert_async",
    "grouped_mm",
    "scaled_grouped_mm",
    "is_plain_or_tracing_tensor_type",
    "functional_tensor_mode",
    "triton_op_decomposition_disabled",
    "mkldnn_native_gemm_dtypes",
    "storage_use_count",
]


def assert_async(condition: Tensor, message: str) -> None:
    """Asserts a one-element bool tensor without synchronising the host.

    On CPU a false condition raises ``RuntimeError(message)`` at once; on CUDA it is a
    device-side assertion; under tracing it stays in the graph (``aten._assert_async.msg``).
    PyTorch has no public spelling of this.
    """
    torch._assert_async(condition, message)


@functools.cache
def _public_grouped_mm():
    # torch.nn.functional.grouped_mm wraps the private aten op; prefer it where it exists
    return getattr(F, "grouped_mm", None)


def grouped_mm(mat_a: Tensor, mat_b: Tensor, *, offs: Optional[Tensor] = None,
               out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """aten's grouped GEMM (``torch.nn.functional.grouped_mm`` where torch has it, else
    ``torch._grouped_mm``): ``mat_a [M, K]`` x ``mat_b [G, K, N]`` with ``offs [G]`` int32 group
    ends, and the other layouts aten accepts. Its 2.13 behaviour (rows past ``offs[-1]`` left
    unwritten) is the caller's to handle."""
    public = _public_grouped_mm()
    if public is not None:
        return public(mat_a, mat_b, offs=offs, out_dtype=out_dtype)
    return torch._grouped_mm(mat_a, mat_b, offs=offs, out_dtype=out_dtype)


@functools.cache
def _public_scaled_grouped_mm():
    """``(torch.nn.functional.scaled_grouped_mm, {recipe: (ScalingType, SwizzleType or None)})``
    where torch has the public API with the recipes used here, else None."""
    fn = getattr(F, "scaled_grouped_mm", None)
    scaling, swizzle = getattr(F, "ScalingType", None), getattr(F, "SwizzleType", None)
    if fn is None or scaling is None or swizzle is None:
        return None
    try:
        recipes = {
            "fp8_rowwise": (scaling.RowWise, None),
            "mxfp8": (scaling.BlockWise1x32, swizzle.SWIZZLE_32_4_4),
        }
    except AttributeError:
        return None
    return fn, recipes


def scaled_grouped_mm(mat_a: Tensor, mat_b: Tensor, scale_a: Tensor, scale_b: Tensor, *,
                      recipe: str, offs: Optional[Tensor], out_dtype: torch.dtype = torch.bfloat16,
                      use_fast_accum: bool = False) -> Tensor:
    """aten's scaled grouped GEMM on operands already in its layouts: e4m3 ``mat_a``
    (row-major) and ``mat_b`` (column-major), and for ``recipe``

    * ``"fp8_rowwise"``: fp32 dequantization scales, one per row of ``mat_a`` and per column of
      ``mat_b`` (per group and row / column in the 2D x 2D layout);
    * ``"mxfp8"``: e8m0 scales of blocks of 32 along the contraction, in the 32x4x4 swizzled
      layout.

    ``torch.nn.functional.scaled_grouped_mm`` with the recipe spelled out (``ScalingType.RowWise``
    on both sides; ``ScalingType.BlockWise1x32`` with ``SwizzleType.SWIZZLE_32_4_4``) where torch
    has it, else ``torch._scaled_grouped_mm``, which infers the same recipes from the scale
    dtypes (fp32 rowwise; e8m0 MX with the swizzled layout implied).
    """
    torch._check(recipe in ("fp8_rowwise", "mxfp8"),
                 lambda: f"scaled_grouped_mm: unknown recipe {recipe!r}")
    public = _public_scaled_grouped_mm()
    if public is not None:
        fn, recipes = public
        scaling, swizzle = recipes[recipe]
        return fn(mat_a, mat_b, scale_a, scaling, scale_b, scaling, swizzle_a=swizzle,
                  swizzle_b=swizzle, offs=offs, output_dtype=out_dtype,
                  use_fast_accum=use_fast_accum)
    return torch._scaled_grouped_mm(mat_a, mat_b, scale_a, scale_b, offs=offs,
                                    out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def is_plain_or_tracing_tensor_type(t: type) -> bool:
    """Whether ``t`` is ``torch.Tensor`` itself or one of the subclasses that tracing wraps
    plain tensors in (fake and functional tensors): what ``triton_op`` can decompose."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return t in (Tensor, FunctionalTensor) or issubclass(t, FakeTensor)


def functional_tensor_mode() -> type:
    """The mode class of functionalization, for ``torch.library.register_torch_dispatch``
    rules that must run while AOTAutograd traces."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    return FunctionalTensorMode


def triton_op_decomposition_disabled() -> bool:
    """Whether ``torch.export`` asked to keep ``triton_op`` s whole (no decomposition into the
    Triton kernel wrapper). False on a torch without the switch."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:
        return False
    return custom_triton_ops_decomposition_disabled()


@functools.cache
def mkldnn_native_gemm_dtypes() -> frozenset:
    """The reduced-precision dtypes (bf16, fp16) for which this CPU has native GEMM
    instructions (AVX512-BF16 / AMX / AVX512-FP16), as oneDNN reports them."""
    native = set()
    if not torch.backends.mkldnn.is_available():
        return frozenset()
    for dtype, probe in ((torch.bfloat16, "_is_mkldnn_bf16_supported"),
                         (torch.float16, "_is_mkldnn_fp16_supported")):
        fn = getattr(torch.ops.mkldnn, probe, None)
        if fn is not None and fn():
            native.add(dtype)
    return frozenset(native)


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many owners (tensors, storage objects) the storage has, ``storage`` itself included:
    1 means that nothing but ``storage`` refers to its memory. Weak references do not count."""
    return torch._C._storage_Use_Count(storage._cdata)
