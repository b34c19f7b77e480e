"""Tile configurations of the grouped GEMM kernels (:mod:`torch_moe._triton.grouped_mm`).

A config is picked from a small table keyed by the GPU, the operand dtype's size and size buckets
of the problem; :func:`autotune_candidates` gives a few configs around that pick for
``triton.autotune`` to measure. The two kernels have different shapes of work:

* the rows kernel (forward, input gradient): tiles of ``BLOCK_M`` rows of one group times
  ``BLOCK_N`` output columns, over the contraction ``K``. The rows per group (the mean,
  ``rows / groups``; the real sizes are on the device) decide how much of a tall tile is padding:
  many small experts (DeepSeek-V3's 256, decoding) want ``BLOCK_M`` 32 or 64, few large ones
  (Mixtral's 8) 128.
* the contraction-split kernel (weight gradients): ``[BLOCK_M, BLOCK_N]`` tiles of one expert's
  weight, over that expert's slots; the slots per group decide ``BLOCK_K``.

Facts behind the table (Hopper, sm_90 and Blackwell, sm_100, 227 KiB of shared memory per block):
16-bit GEMM tiles of 128 x 128 x 64 with 8 warps (two warp groups of the wgmma instruction) and
3-4 pipeline stages are the usual best tiles of large GEMMs (Triton's matmul tutorial, Inductor's
mm and grouped-mm candidate lists, which span BLOCK_M 16-128, BLOCK_N 64-256, BLOCK_K 64-256,
3-4 stages, 4-8 warps); groups of few rows waste most of a 128-row tile, so they take 64 (or 32)
rows with 4 warps. A stage of a 16-bit 128 x 128 x 64 tile holds (128 * 64 + 64 * 128) * 2 B =
32 KiB. Ampere (sm_80, 163 KiB) and Ada / consumer GPUs (sm_86, sm_89, sm_120, 99 KiB) take
tiles of at most 64 x 128 x 64 in 3 stages (72 KiB), which fit every GPU since Ampere. Configs
whose stages do not fit the device's shared memory are never proposed, the table's pick included:
:func:`pick_config` steps it down (BLOCK_K to 32, then the stages to 2, then BLOCK_N, BLOCK_M
and BLOCK_K to 16) until it fits, counting every weight tile of a stage (two in the FFN up
kernel), so that launches that keep the pick without autotuning run on any GPU, including those
whose capability the table does not know (99 KiB assumed).

fp32 operands (ieee or tf32) and fp64 halve the tiles: their elements are 2 and 4 times wider and
the MMA is narrower.
"""

import functools
from typing import NamedTuple, Optional

import torch

__all__ = [
    "GemmConfig",
    "autotune_candidates",
    "fit_shared_memory",
    "pick_config",
    "shared_memory_bytes",
]


class GemmConfig(NamedTuple):
    """Tile sizes (powers of two, at least 16 for ``tl.dot``) and launch parameters."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Shared memory one program may use, by compute capability (bytes); others take the smallest.
_SHARED_MEMORY = {
    (8, 0): 163 * 1024,
    (8, 7): 163 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
}
_SMALL_SHARED_MEMORY = 99 * 1024  # sm_86, sm_89, sm_120


def shared_memory_bytes(arch: Optional[tuple[int, int]]) -> int:
    return _SHARED_MEMORY.get(arch, _SMALL_SHARED_MEMORY) if arch else _SMALL_SHARED_MEMORY


@functools.cache
def _cuda_arch(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_arch(device: torch.device) -> Optional[tuple[int, int]]:
    """The compute capability of a CUDA device, None elsewhere (the interpreter's CPU tensors, and
    fake CUDA tensors on a machine without a GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())


def _block(n, low: int, high: int) -> int:
    """The smallest power of two in [low, high] that is >= n (``high`` if none is).

    Written with comparisons only, so that a symbolic ``n`` gives guards, not errors.
    """
    b = low
    while b < high and b < n:
        b *= 2
    return b


def _fit(cfg: GemmConfig, m, n, k) -> GemmConfig:
    """``cfg`` with each block narrowed to the dimension it tiles (no wider than needed)."""
    return cfg._replace(
        block_m=_block(m, 16, cfg.block_m),
        block_n=_block(n, 16, cfg.block_n),
        block_k=_block(k, 16, cfg.block_k),
    )


def _stage_bytes(cfg: GemmConfig, itemsize: int, weight_tiles: int = 1) -> int:
    """One pipeline stage: a ``[BLOCK_M, BLOCK_K]`` input tile and ``weight_tiles``
    ``[BLOCK_K, BLOCK_N]`` weight tiles."""
    return (cfg.block_m * cfg.block_k + weight_tiles * cfg.block_k * cfg.block_n) * itemsize


def _fits(cfg: GemmConfig, itemsize: int, arch, weight_tiles: int = 1) -> bool:
    return cfg.num_stages * _stage_bytes(cfg, itemsize, weight_tiles) <= shared_memory_bytes(arch)


def fit_shared_memory(
    cfg: GemmConfig, dtype: torch.dtype, arch: Optional[tuple[int, int]], weight_tiles: int = 1
) -> GemmConfig:
    """``cfg``, stepped down until its stages fit the shared memory of ``arch``: BLOCK_K to 32,
    then the stages to 2, then BLOCK_N, BLOCK_M and BLOCK_K to 16 (the MMA tile is kept longest;
    a shorter contraction step with the same stages hides the same latency)."""
    itemsize = dtype.itemsize
    while not _fits(cfg, itemsize, arch, weight_tiles):
        if cfg.block_k > 32:
            cfg = cfg._replace(block_k=cfg.block_k // 2)
        elif cfg.num_stages > 2:
            cfg = cfg._replace(num_stages=cfg.num_stages - 1)
        elif cfg.block_n > 16:
            cfg = cfg._replace(block_n=cfg.block_n // 2)
        elif cfg.block_m > 16:
            cfg = cfg._replace(block_m=cfg.block_m // 2, num_warps=4)
        elif cfg.block_k > 16:
            cfg = cfg._replace(block_k=cfg.block_k // 2)
        else:
            break  # 16 x 16 x 16 in 2 stages: 2 KiB per weight tile, fits any GPU
    return cfg


def _generic(itemsize: int) -> GemmConfig:
    # fits every GPU since Ampere for 16-bit operands (72 KiB); 4- and 8-byte operands halve
    # BLOCK_N and BLOCK_K
    if itemsize <= 2:
        return GemmConfig(64, 128, 64, num_warps=4, num_stages=3)
    if itemsize == 4:
        return GemmConfig(64, 64, 32, num_warps=4, num_stages=3)
    return GemmConfig(64, 64, 32, num_warps=4, num_stages=2)


def _hopper(kind: str, itemsize: int, m_per_group, contraction) -> GemmConfig:
    """The sm_90 / sm_100 table. ``m_per_group``: mean rows per group (rows kernel) or mean
    slots per group (contraction-split kernel, where it is the contraction)."""
    if itemsize > 2:
        if itemsize == 4:
            return GemmConfig(128, 64, 32, num_warps=8, num_stages=3)
        return GemmConfig(64, 64, 32, num_warps=4, num_stages=3)
    if kind == "rows":
        if m_per_group <= 32:
            return GemmConfig(32, 128, 128, num_warps=4, num_stages=4)
        if m_per_group <= 96:
            return GemmConfig(64, 128, 64, num_warps=4, num_stages=4)
        return GemmConfig(128, 128, 64, num_warps=8, num_stages=4 if contraction >= 1024 else 3)
    # weight gradients: the weight's tile is fixed (128 x 128); few slots per expert take a
    # shorter contraction step
    if m_per_group <= 64:
        return GemmConfig(128, 128, 32, num_warps=8, num_stages=3)
    return GemmConfig(128, 128, 64, num_warps=8, num_stages=4)


def pick_config(
    kind: str, dtype: torch.dtype, arch: Optional[tuple[int, int]], m, n, k, groups,
    weight_tiles: int = 1,
) -> GemmConfig:
    """The table's config for one launch, within the shared memory of ``arch``
    (:func:`fit_shared_memory`, ``weight_tiles`` weight tiles per stage).

    Args:
        kind: ``"rows"`` (rows kernel: m rows in total over ``groups`` groups, n output columns,
            contraction k) or ``"k"`` (contraction-split kernel: ``[groups, m, n]`` output,
            contraction of k slots in total).
        arch: the compute capability (:func:`device_arch`), None for the generic table.
    """
    itemsize = dtype.itemsize
    per_group = (m if kind == "rows" else k) // max(groups, 1)
    if arch is not None and arch[0] in (9, 10):
        cfg = _hopper(kind, itemsize, per_group, k)
    else:
        cfg = _generic(itemsize)
    if kind == "rows":
        # M is the token dimension and not narrowed: it varies from call to call, and a fixed
        # block keeps one compiled kernel
        cfg = cfg._replace(block_n=_block(n, 16, cfg.block_n), block_k=_block(k, 16, cfg.block_k))
    else:
        cfg = _fit(cfg, m, n, per_group if per_group > 0 else 16)
    return fit_shared_memory(cfg, dtype, arch, weight_tiles)


def autotune_candidates(
    cfg: GemmConfig, dtype: torch.dtype, arch: Optional[tuple[int, int]], m, n
) -> list[GemmConfig]:
    """A few configs around the table's pick ``cfg`` for ``triton.autotune``: half and twice
    BLOCK_M and BLOCK_N (within the dimensions, ``m``: None for the rows kernel's token
    dimension), 4 or 8 warps, one stage more or less, all within the device's shared memory and
    with the pick's BLOCK_K (the kernels specialise on K being a multiple of it). Just the pick
    without a GPU (the interpreter runs one config)."""
    if arch is None:
        return [cfg]
    itemsize = dtype.itemsize
    out = [cfg]

    def add(c: GemmConfig) -> None:
        if c not in out and c.block_m >= 16 and c.block_n >= 16 and _fits(c, itemsize, arch):
            out.append(c)

    for bm in (cfg.block_m // 2, cfg.block_m * 2):
        if bm <= 128 and (m is None or bm <= _block(m, 16, 128)):
            add(cfg._replace(block_m=bm, num_warps=8 if bm >= 128 else 4))
    for bn in (cfg.block_n // 2, cfg.block_n * 2):
        if bn <= 256 and bn <= _block(n, 16, 256):
            add(cfg._replace(block_n=bn))
    add(cfg._replace(num_warps=4 if cfg.num_warps == 8 else 8))
    for stages in (cfg.num_stages - 1, cfg.num_stages + 1):
        if 2 <= stages <= 5:
            add(cfg._replace(num_stages=stages))
    return out
