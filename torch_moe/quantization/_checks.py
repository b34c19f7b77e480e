"""Input checks of the quantization ops.

The metadata checks (shape, dtype, device) are shared by the fake and device kernels; the value
checks (:func:`check_group_offsets`, :func:`check_rowwise_scale_values`) are called by the
device kernels only: they raise on eager CPU tensors and are on-device asserts elsewhere (other
devices, and while ``torch.compile`` traces), with no host sync.
"""

import torch

from torch_moe import _checks
from torch_moe._compat import assert_async
from torch_moe.quantization._formats import BLOCK_SIZE, ELEM_DTYPES, SCALE_MODES

# bf16 and fp16 are exact in fp32, so quantizing them never rounds twice; fp64 would.
QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
RECIPES = ("fp8_rowwise", "mxfp8")
# the precisions of the expert GEMMs; "bf16": no quantization, GEMMs in the parameters' dtype
PRECISIONS = ("bf16",) + RECIPES
# Group sizes of a grouped GEMM must be multiples of these (blocks never straddle groups).
GROUP_ALIGNMENT = {"fp8_rowwise": 16, "mxfp8": BLOCK_SIZE}


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_quantizable(op: str, name: str, x: torch.Tensor) -> None:
    torch._check(
        x.dtype in QUANTIZABLE_DTYPES,
        lambda: f"{op}: expected {name} to be {_names(QUANTIZABLE_DTYPES)}, but got {x.dtype}",
    )


def check_elem_dtype(op: str, name: str, dtype: torch.dtype) -> None:
    torch._check(
        dtype in ELEM_DTYPES,
        lambda: f"{op}: expected {name} to be {_names(ELEM_DTYPES)}, but got {dtype}",
    )


def check_out_dtype(op: str, dtype: torch.dtype) -> None:
    torch._check(
        dtype in QUANTIZABLE_DTYPES,
        lambda: f"{op}: expected out_dtype to be {_names(QUANTIZABLE_DTYPES)}, but got {dtype}",
    )


def check_scale_mode(op: str, scale_mode: str) -> None:
    torch._check(
        scale_mode in SCALE_MODES,
        lambda: f"{op}: expected scale_mode to be one of {SCALE_MODES}, but got {scale_mode!r}",
    )


def check_recipe(op: str, recipe: str) -> None:
    torch._check(
        recipe in RECIPES, lambda: f"{op}: expected recipe to be one of {RECIPES}, but got {recipe!r}"
    )


def wrap_dim(op: str, dim: int, ndim: int) -> int:
    torch._check(
        -ndim <= dim < ndim and ndim > 0,
        lambda: f"{op}: expected dim in [{-ndim}, {ndim}), but got {dim}",
    )
    return dim % ndim


def check_block_dim(op: str, name: str, x: torch.Tensor, dim: int) -> None:
    n = x.size(dim)
    torch._check(
        n % BLOCK_SIZE == 0,
        lambda: f"{op}: expected {name}.size({dim}) to be a multiple of the MX block size "
        f"{BLOCK_SIZE}, but got {n}",
    )


def mx_scale_shape(shape, dim: int) -> tuple:
    return tuple(n // BLOCK_SIZE if d == dim else n for d, n in enumerate(shape))


def rowwise_scale_shape(shape, dim: int, num_groups: int) -> tuple:
    return tuple(num_groups if d == dim else n for d, n in enumerate(shape))


def check_mx_scale(op: str, name: str, scale: torch.Tensor, expected_shape) -> None:
    torch._check(
        scale.dtype in (torch.uint8, torch.float8_e8m0fnu),
        lambda: f"{op}: expected {name} to hold E8M0 bytes (uint8 or float8_e8m0fnu), but got "
        f"{scale.dtype}",
    )
    torch._check(
        tuple(scale.shape) == tuple(expected_shape),
        lambda: f"{op}: expected {name} of shape {tuple(expected_shape)} (one byte per block of "
        f"{BLOCK_SIZE} along the blocked dim), but got {tuple(scale.shape)}",
    )


def check_rowwise_scale(op: str, name: str, scale: torch.Tensor, expected_shape) -> None:
    torch._check(
        scale.dtype == torch.float32,
        lambda: f"{op}: expected {name} to be float32, but got {scale.dtype}",
    )
    torch._check(
        tuple(scale.shape) == tuple(expected_shape),
        lambda: f"{op}: expected {name} of shape {tuple(expected_shape)}, but got "
        f"{tuple(scale.shape)}",
    )


def _raises_eagerly(t: torch.Tensor) -> bool:
    """Whether a value check of ``t`` may read it on the host: eager CPU tensors only. On other
    devices, and while ``torch.compile`` traces, it is an on-device assert (no synchronisation,
    no data-dependent graph break)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def check_group_offsets(op: str, offs: torch.Tensor, limit: int, multiple: int = 1) -> None:
    """Value checks of ``offs`` (cumulative group ends): non-decreasing, ``offs[-1] <= limit``
    and every group size a multiple of ``multiple``. On CPU the check raises with the values
    found; elsewhere it is an on-device assert with the same message minus the values."""
    _checks.check_offs(op, offs)
    if offs.numel() == 0:
        return
    sizes = torch.diff(offs, prepend=offs.new_zeros(1))
    decreasing = f"{op}: expected offs to be non-decreasing and non-negative"
    past_end = f"{op}: expected offs[-1] <= {limit}"
    misaligned = (
        f"{op}: expected every group size to be a multiple of {multiple} (blocks must not "
        f"straddle groups; pad groups with token_sort(..., align={multiple}))"
    )
    if not _raises_eagerly(offs):
        assert_async((sizes >= 0).all(), decreasing)
        assert_async(offs.select(0, -1) <= limit, past_end)
        if multiple > 1:
            assert_async((sizes % multiple == 0).all(), misaligned)
        return
    bad = torch.nonzero(sizes < 0)
    if bad.numel():
        g = int(bad[0])
        prev = f"offs[{g - 1}] = {int(offs[g - 1])}" if g else "0"
        raise RuntimeError(f"{decreasing}, but offs[{g}] = {int(offs[g])} < {prev}")
    last = int(offs[-1])
    if last > limit:
        raise RuntimeError(f"{past_end}, but got {last}")
    bad = torch.nonzero(sizes % multiple)
    if bad.numel():
        g = int(bad[0])
        raise RuntimeError(
            f"{misaligned}, but group {g} has {int(sizes[g])} rows (offs[{g}] = {int(offs[g])})"
        )


def check_group_offsets_meta(op: str, offs: torch.Tensor) -> None:
    _checks.check_offs(op, offs)


def check_rowwise_scale_values(op: str, name: str, scale: torch.Tensor) -> None:
    """FP8 rowwise scales are positive finite powers of two, or NaN (a row that held NaN or
    Inf, which the GEMM must turn into NaN). An Inf or non-positive scale is a caller bug.
    Raises on CPU, an on-device assert elsewhere (see :func:`check_group_offsets`)."""
    message = f"{op}: expected {name} to hold positive finite scales (or NaN for a non-finite row)"
    bad = torch.isinf(scale) | (scale <= 0)
    if not _raises_eagerly(scale):
        assert_async(bad.any().logical_not(), message)
        return
    idx = torch.nonzero(bad)
    if idx.numel():
        where = tuple(idx[0].tolist())
        raise RuntimeError(f"{message}, but got {scale[where].item()} at index {where}")


def check_same_device(op: str, a: torch.Tensor, b: torch.Tensor, a_name: str, b_name: str) -> None:
    torch._check(
        a.device == b.device,
        lambda: f"{op}: expected {a_name} and {b_name} on one device, but {a_name} is on "
        f"{a.device} and {b_name} on {b.device}",
    )
