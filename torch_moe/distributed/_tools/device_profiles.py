"""What one accelerator (or the local CPU) can do: the numbers the MoE cost model runs on.

A :class:`DeviceProfile` holds published peaks (FLOP/s per precision, memory bandwidth and
capacity, link bandwidths) and the *achieved* fractions the peaks never reach: a GEMM
efficiency curve over the rows of a group, per-call overheads, and the page-fault cost of
fresh host allocations. The published numbers are cited next to each profile; efficiency
curves of the GPU profiles are assumptions (stated as such) until a calibration replaces them,
and the local CPU profile is measured by :mod:`torch_moe.distributed._tools.calibrate`.

Units: seconds (``_s``), bytes (``_bytes``), bytes per second (``_Bps``), FLOP/s (``flops``).
Peaks are dense (no 2:4 sparsity). Link bandwidths are per GPU and per direction.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from dataclasses import dataclass, field

__all__ = [
    "PRECISIONS",
    "DeviceProfile",
    "H100",
    "H200",
    "B200",
    "MI300X",
    "REFERENCE_CPU",
    "get_profile",
    "known_profiles",
]

# GEMM precisions of the expert FFN (MoEConfig.precision) plus fp32 for the CPU reference path.
PRECISIONS = ("bf16", "fp8_rowwise", "mxfp8", "fp32")

_GB = 1e9
_TB = 1e12
_TFLOPS = 1e12


def _check_curve(name: str, curve) -> tuple[tuple[float, float], ...]:
    points = tuple((float(x), float(y)) for x, y in curve)
    if not points:
        raise ValueError(f"DeviceProfile: expected {name} to have at least one (rows, fraction) "
                         f"point, but got none")
    xs = [x for x, _ in points]
    if any(not (0 < x < math.inf) for x in xs) or xs != sorted(xs) or len(set(xs)) != len(xs):
        raise ValueError(f"DeviceProfile: expected the rows of {name} to be finite, positive and "
                         f"strictly increasing, but got {xs}")
    if any(not 0 < y <= 1 for _, y in points):
        raise ValueError(f"DeviceProfile: expected the fractions of {name} to lie in (0, 1], but "
                         f"got {[y for _, y in points]}")
    _check_time_monotone(name, points)
    return points


def _check_time_monotone(name: str, points) -> None:
    # The model charges rows / efficiency(rows) per group; if efficiency grew faster than the
    # rows between two points, more tokens would take less time. Linear interpolation between
    # points that satisfy this keeps it true everywhere in between.
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 / x1 > y0 / x0 * (1 + 1e-12):
            raise ValueError(f"DeviceProfile: expected {name} to grow no faster than the rows "
                             f"(efficiency / rows non-increasing), but ({x0}, {y0}) -> "
                             f"({x1}, {y1}) would make {x1:g} rows faster than {x0:g}")


def _check_seconds_curve(name: str, curve) -> tuple[tuple[float, float], ...]:
    points = tuple((float(x), float(y)) for x, y in curve)
    xs = [x for x, _ in points]
    if not points or any(not (0 < x < math.inf) for x in xs) or xs != sorted(xs) \
            or len(set(xs)) != len(xs):
        raise ValueError(f"DeviceProfile: expected {name} to be (rows, seconds) points with "
                         f"finite, positive, strictly increasing rows, but got rows {xs}")
    if any(not 0 <= y < math.inf for _, y in points):
        raise ValueError(f"DeviceProfile: expected the seconds of {name} to be finite and >= 0, "
                         f"but got {[y for _, y in points]}")
    return points


def _interp(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear in the rows, clamped to the end points (a GEMM never gets faster than
    the largest measured size, nor slower per row than the smallest)."""
    xs = [p[0] for p in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (x - x0) / (x1 - x0) * (y1 - y0)


@dataclass(frozen=True)
class DeviceProfile:
    """Peak and achieved performance of one device.

    Attributes:
        name: e.g. ``"H100-SXM"``.
        peak_flops: dense peak FLOP/s per GEMM precision in :data:`PRECISIONS`; a precision
            missing here is not supported by the device (asking for it raises).
        memory_bytes: device memory capacity.
        memory_bandwidth_Bps: achievable streaming bandwidth, read + write counted once each
            (the rate of an elementwise kernel such as a quantize pass).
        intra_node_bandwidth_Bps, intra_node_latency_s: one GPU's NVLink / Infinity Fabric
            bandwidth per direction, and the fixed cost of one collective call inside a node.
        inter_node_bandwidth_Bps, inter_node_latency_s: the same for the network (one NIC per
            GPU), for collectives that cross nodes.
        gemm_tile_rows: rows a grouped GEMM pads each non-empty group to (the M tile of the
            kernel: 128 for Hopper / Blackwell / CDNA3 grouped GEMMs, 1 for the CPU loop of
            ``torch.mm``); a group of 1 row costs a whole tile.
        gemm_efficiency: ``((rows, fraction of peak), ...)``: achieved fraction of
            ``peak_flops`` for a GEMM whose token dimension (M of ``[M, K] @ [K, N]``) has
            ``rows`` rows, N and K being layer sized. Interpolated linearly in the rows (at the
            tile-padded row count), and required to grow no faster than the rows.
        wgrad_efficiency: the same for the weight-gradient form, where the token dimension is
            the contraction (K), measured apart because the two forms differ for few rows
            (0.26 against 0.37 of peak for 32-row groups on :data:`REFERENCE_CPU`).
        precision_efficiency: multiplier of the curves per precision (quantized GEMMs reach a
            lower fraction of their higher peak); 1.0 when absent.
        precision_curves: ``{precision: (gemm_efficiency, wgrad_efficiency)}``, curves measured
            for one precision that replace the two above for it (a CPU's fp32 and bf16 GEMMs
            have curves of different shapes, not one curve at two peaks); the multiplier of
            ``precision_efficiency`` does not apply to them.
        gemm_call_s: fixed cost of one GEMM call (one ``torch.mm`` in the CPU loop; one grouped
            GEMM launch on a GPU).
        per_group_s: fixed cost per non-empty group inside one grouped call (CPU: Python loop
            overhead around each ``torch.mm``; GPU: ~0, the scheduler walks the groups).
        elementwise_bandwidth_Bps: achieved rate of the expert FFN's elementwise kernels (row
            gather, activation forward / backward, routing-weight scaling, scatter-add), in the
            bytes :func:`gemm_cost.ffn_elementwise_bytes` counts for them; ``None`` means
            ``memory_bandwidth_Bps`` (streaming kernels). On a CPU the activation's ``exp`` and
            the scatter-add make these well slower than ``copy_``. With
            ``elementwise_hidden_Bps`` set, this is the rate of the kernels on rows of the
            model width ``D`` only (:func:`gemm_cost.ffn_elementwise_split_bytes`).
        elementwise_hidden_Bps: achieved rate of the elementwise kernels on rows of the hidden
            width (the activation forward and backward, the routing weights' gradient and
            scaling); ``None`` means the rate above, for all.
        layer_overhead_s: fixed host cost of one MoE layer forward + backward outside its GEMMs
            and elementwise kernels (router, token sort, op dispatch, autograd); 0 on GPUs,
            where it overlaps with device work.
        dispatch_row_s: host seconds per row an expert-parallel layer dispatches, beyond its
            FFN and the wire time: packing, the sender's gathers and combine, and the CPU work
            of a host transport such as gloo. Not measured (``calibrate_local`` leaves it 0: the
            elementwise and all-to-all terms price the sender's gathers and the transport);
            0 for the GPU profiles, where copy engines and kernels do this work.
        fresh_alloc_threshold_bytes: allocations at or above this size are fresh mappings that
            page-fault on first touch (glibc's 32 MiB mmap ceiling on the CPU); ``inf`` where a
            caching allocator reuses blocks (CUDA / ROCm).
        page_fault_s_per_byte: extra cost per byte of such a fresh allocation.
        gemm_create_s: ``{precision: ((rows, seconds), ...)}``: host seconds to set up one GEMM
            call of a shape the library has not prepared before, by rows of the token
            dimension, interpolated linearly and clamped to the end points (CPU bf16: oneDNN
            builds, JIT-compiles and caches a primitive per shape and operand layout, in an
            LRU cache of 1024 by default; MKL's fp32 GEMM builds nothing). The cost model
            charges it once per distinct GEMM shape of a layer call
            (:func:`~torch_moe.distributed._tools.gemm_cost.expert_ffn_time`); absent or empty:
            nothing to set up (GPU kernels are compiled ahead of time).
        overlap_efficiency: fraction of the shorter of a chunk's communication and compute that
            runs hidden while both are in flight (1: a perfect pipeline; 0: no overlap at all),
            as :func:`~torch_moe.distributed._tools.calibrate.measure_overlap_efficiency`
            measures it; ``None`` where it was not measured (the GPU profiles): the cost model
            then assumes a perfect pipeline, and the planner does not choose chunking from it.
        sources: where the published numbers come from.
    """

    name: str
    peak_flops: dict
    memory_bytes: float
    memory_bandwidth_Bps: float
    intra_node_bandwidth_Bps: float
    intra_node_latency_s: float
    inter_node_bandwidth_Bps: float
    inter_node_latency_s: float
    gemm_tile_rows: int = 128
    gemm_efficiency: tuple = ((1, 0.75),)
    wgrad_efficiency: tuple = ((1, 0.75),)
    precision_efficiency: dict = field(default_factory=dict)
    gemm_call_s: float = 5e-6
    per_group_s: float = 0.0
    elementwise_bandwidth_Bps: float | None = None
    elementwise_hidden_Bps: float | None = None
    layer_overhead_s: float = 0.0
    dispatch_row_s: float = 0.0
    fresh_alloc_threshold_bytes: float = math.inf
    page_fault_s_per_byte: float = 0.0
    precision_curves: dict = field(default_factory=dict)
    gemm_create_s: dict = field(default_factory=dict)
    overlap_efficiency: float | None = None
    sources: tuple = ()

    def __post_init__(self):
        fn = "DeviceProfile"
        if not self.peak_flops:
            raise ValueError(f"{fn}: expected peak_flops for at least one precision, got none")
        for prec, flops in self.peak_flops.items():
            if prec not in PRECISIONS:
                raise ValueError(f"{fn}: expected precisions in {PRECISIONS}, but got {prec!r}")
            if not 0 < flops < math.inf:
                raise ValueError(f"{fn}: expected peak_flops[{prec!r}] to be finite and > 0, but "
                                 f"got {flops}")
        for prec, mult in self.precision_efficiency.items():
            if prec not in PRECISIONS or not 0 < mult <= 1:
                raise ValueError(f"{fn}: expected precision_efficiency entries (precision in "
                                 f"{PRECISIONS}, multiplier in (0, 1]), but got {prec!r}: {mult}")
        # an infinite memory or bandwidth would price everything at zero
        for attr in ("memory_bytes", "memory_bandwidth_Bps", "intra_node_bandwidth_Bps",
                     "inter_node_bandwidth_Bps"):
            if not 0 < getattr(self, attr) < math.inf:
                raise ValueError(f"{fn}: expected {attr} to be finite and > 0, but got "
                                 f"{getattr(self, attr)}")
        if not self.fresh_alloc_threshold_bytes > 0:  # inf: no allocation is fresh
            raise ValueError(f"{fn}: expected fresh_alloc_threshold_bytes > 0, but got "
                             f"{self.fresh_alloc_threshold_bytes}")
        for attr in ("elementwise_bandwidth_Bps", "elementwise_hidden_Bps"):
            value = getattr(self, attr)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{fn}: expected {attr} to be finite and > 0, or None, but "
                                 f"got {value}")
        for attr in ("intra_node_latency_s", "inter_node_latency_s", "gemm_call_s",
                     "per_group_s", "layer_overhead_s", "dispatch_row_s",
                     "page_fault_s_per_byte"):
            if not 0 <= getattr(self, attr) < math.inf:
                raise ValueError(f"{fn}: expected {attr} to be finite and >= 0, but got "
                                 f"{getattr(self, attr)}")
        if isinstance(self.gemm_tile_rows, bool) or not isinstance(self.gemm_tile_rows, int) \
                or self.gemm_tile_rows < 1:
            raise ValueError(f"{fn}: expected gemm_tile_rows to be a positive int, but got "
                             f"{self.gemm_tile_rows!r}")
        if self.overlap_efficiency is not None and not 0 <= self.overlap_efficiency <= 1:
            raise ValueError(f"{fn}: expected overlap_efficiency in [0, 1] or None, but got "
                             f"{self.overlap_efficiency}")
        # frozen dataclass: normalise the curves (JSON gives lists) through object.__setattr__
        curves = {}
        for prec, pair in self.precision_curves.items():
            if prec not in self.peak_flops:
                raise ValueError(f"{fn}: expected precision_curves for precisions of "
                                 f"peak_flops {tuple(self.peak_flops)}, but got {prec!r}")
            if len(pair) != 2:
                raise ValueError(f"{fn}: expected precision_curves[{prec!r}] to be a pair "
                                 f"(gemm_efficiency, wgrad_efficiency), but got {pair!r}")
            curves[prec] = (_check_curve(f"precision_curves[{prec!r}][0]", pair[0]),
                            _check_curve(f"precision_curves[{prec!r}][1]", pair[1]))
        object.__setattr__(self, "precision_curves", curves)
        create = {}
        for prec, curve in self.gemm_create_s.items():
            if prec not in self.peak_flops:
                raise ValueError(f"{fn}: expected gemm_create_s for precisions of peak_flops "
                                 f"{tuple(self.peak_flops)}, but got {prec!r}")
            create[prec] = _check_seconds_curve(f"gemm_create_s[{prec!r}]", curve)
        object.__setattr__(self, "gemm_create_s", create)
        object.__setattr__(self, "gemm_efficiency",
                           _check_curve("gemm_efficiency", self.gemm_efficiency))
        object.__setattr__(self, "wgrad_efficiency",
                           _check_curve("wgrad_efficiency", self.wgrad_efficiency))
        object.__setattr__(self, "sources", tuple(self.sources))

    def check_precision(self, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: expected one of {PRECISIONS}")
        if precision not in self.peak_flops:
            raise ValueError(f"{self.name} has no {precision} GEMMs: expected one of "
                             f"{tuple(self.peak_flops)}")

    @property
    def elementwise_Bps(self) -> float:
        """Rate of the expert FFN's elementwise kernels (see ``elementwise_bandwidth_Bps``)."""
        return self.elementwise_bandwidth_Bps or self.memory_bandwidth_Bps

    @property
    def elementwise_hidden_rate_Bps(self) -> float:
        """Rate of the elementwise kernels on hidden-width rows (see
        ``elementwise_hidden_Bps``)."""
        return self.elementwise_hidden_Bps or self.elementwise_Bps

    def gemm_flops(self, precision: str, rows: float, wgrad: bool = False) -> float:
        """Achieved FLOP/s of one GEMM whose token dimension has ``rows`` rows."""
        self.check_precision(precision)
        if isinstance(rows, bool) or not isinstance(rows, (int, float)) or not (
                0 <= rows < math.inf):
            raise ValueError(f"DeviceProfile.gemm_flops: expected rows to be a finite number "
                             f">= 0, but got {rows!r}")
        if precision in self.precision_curves:
            curve = self.precision_curves[precision][1 if wgrad else 0]
            return self.peak_flops[precision] * _interp(curve, max(rows, 1.0))
        curve = self.wgrad_efficiency if wgrad else self.gemm_efficiency
        mult = self.precision_efficiency.get(precision, 1.0)
        return self.peak_flops[precision] * mult * _interp(curve, max(rows, 1.0))

    def gemm_create_time_s(self, precision: str, rows: float) -> float:
        """Seconds to set up one GEMM call of a new shape with ``rows`` token rows (0 where the
        profile has no ``gemm_create_s`` for ``precision``)."""
        self.check_precision(precision)
        curve = self.gemm_create_s.get(precision)
        return _interp(curve, max(rows, 1.0)) if curve else 0.0

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["fresh_alloc_threshold_bytes"] = (None if math.isinf(self.fresh_alloc_threshold_bytes)
                                            else self.fresh_alloc_threshold_bytes)
        return json.dumps(d, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DeviceProfile":
        fn = "DeviceProfile.from_json"
        try:
            d = json.loads(text)
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{fn}: expected the JSON of a DeviceProfile, but got text that "
                             f"does not parse ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{fn}: expected a JSON object of DeviceProfile fields, but got "
                             f"{type(d).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"{fn}: unknown fields {sorted(unknown)}")
        required = [f.name for f in fields if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING]
        missing = [n for n in required if n not in d]
        if missing:
            raise ValueError(f"{fn}: expected the required fields {required}, but {missing} "
                             "are missing")
        if d.get("fresh_alloc_threshold_bytes", 0) is None:
            d["fresh_alloc_threshold_bytes"] = math.inf
        return cls(**d)


# Achieved fraction of peak for grouped GEMMs on data-center GPUs, by rows per group. These are
# assumptions, not published numbers: large bf16 GEMMs reach about 70-80 % of peak with cuBLAS
# on H100, and a group of a few dozen rows wastes most of a 128-row tile (which the tile
# quantisation in gemm_cost already charges) plus some pipeline fill. Replace by a calibration
# on the target machine when one is available.
_GPU_GEMM_EFFICIENCY = ((128, 0.45), (256, 0.58), (512, 0.66), (1024, 0.72), (4096, 0.76))
_GPU_WGRAD_EFFICIENCY = ((128, 0.30), (256, 0.45), (512, 0.58), (1024, 0.68), (4096, 0.74))
# FP8 GEMMs reach a lower fraction of their doubled peak: torchao reports +10 % (rowwise) to
# +25 % (tensorwise) end-to-end on Llama3-8B / 8xH100 rather than 2x (pytorch/ao
# docs/source/workflows/training.md); 0.7 of the bf16 efficiency makes the expert GEMMs 1.4x
# as fast as bf16 (an assumption, between those end-to-end gains and the 2x of the peaks).
_GPU_FP8_EFFICIENCY = {"fp8_rowwise": 0.7, "mxfp8": 0.7}

# 400 Gb/s NDR InfiniBand, one ConnectX-7 per GPU (DGX H100 / H200 / B200 reference designs,
# https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html); ~5 us per
# collective call across nodes and ~3 us inside a node are the usual NCCL small-message
# latencies (assumption).
_NDR_Bps = 50 * _GB

H100 = DeviceProfile(
    name="H100-SXM",
    # Dense tensor-core peaks: bf16 989.4, fp8 1978.9 TFLOP/s (the datasheet's 1979 / 3958 are
    # with 2:4 sparsity). https://www.nvidia.com/en-us/data-center/h100/ and
    # https://glennklockwood.com/garden/processors/h100 (table of VFMA / matrix / sparse rates).
    # MXFP8 needs Blackwell: Hopper has no block-scaled tensor-core instructions.
    peak_flops={"bf16": 989.4 * _TFLOPS, "fp8_rowwise": 1978.9 * _TFLOPS,
                "fp32": 66.9 * _TFLOPS},
    memory_bytes=80 * _GB,  # 80 GB HBM3
    memory_bandwidth_Bps=3.35 * _TB,
    intra_node_bandwidth_Bps=450 * _GB,  # NVLink 4: 900 GB/s total, 450 GB/s each direction
    intra_node_latency_s=3e-6,
    inter_node_bandwidth_Bps=_NDR_Bps,
    inter_node_latency_s=5e-6,
    gemm_efficiency=_GPU_GEMM_EFFICIENCY,
    wgrad_efficiency=_GPU_WGRAD_EFFICIENCY,
    precision_efficiency=_GPU_FP8_EFFICIENCY,
    sources=("https://www.nvidia.com/en-us/data-center/h100/",
             "https://glennklockwood.com/garden/processors/h100"),
)

H200 = dataclasses.replace(
    H100,
    name="H200-SXM",
    # Same GH100 compute as H100 SXM; 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s.
    # https://www.nvidia.com/en-us/data-center/h200/
    memory_bytes=141 * _GB,
    memory_bandwidth_Bps=4.8 * _TB,
    sources=("https://www.nvidia.com/en-us/data-center/h200/",),
)

B200 = DeviceProfile(
    name="B200",
    # HGX B200 (1000 W) dense tensor-core peaks: bf16 2250, fp8 4500 TFLOP/s; MXFP8 runs at the
    # fp8 rate. 180 GB usable of 192 GB HBM3e at 8 TB/s; NVLink 5: 1.8 TB/s total per GPU.
    # https://www.nvidia.com/en-us/data-center/hgx/ and
    # https://glennklockwood.com/garden/processors/B200 (HGX B200 table).
    peak_flops={"bf16": 2250 * _TFLOPS, "fp8_rowwise": 4500 * _TFLOPS,
                "mxfp8": 4500 * _TFLOPS, "fp32": 80 * _TFLOPS},
    memory_bytes=180 * _GB,
    memory_bandwidth_Bps=8 * _TB,
    intra_node_bandwidth_Bps=900 * _GB,
    intra_node_latency_s=3e-6,
    inter_node_bandwidth_Bps=_NDR_Bps,
    inter_node_latency_s=5e-6,
    gemm_efficiency=_GPU_GEMM_EFFICIENCY,
    wgrad_efficiency=_GPU_WGRAD_EFFICIENCY,
    precision_efficiency=_GPU_FP8_EFFICIENCY,
    sources=("https://www.nvidia.com/en-us/data-center/hgx/",
             "https://glennklockwood.com/garden/processors/B200"),
)

MI300X = DeviceProfile(
    name="MI300X",
    # Dense peaks: bf16 1307.4, fp8 2614.9 TFLOP/s; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric
    # links, 896 GB/s aggregate peer bandwidth (448 GB/s each direction).
    # https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html
    # No MX formats on CDNA3 (they arrive with MI350 / CDNA4).
    peak_flops={"bf16": 1307.4 * _TFLOPS, "fp8_rowwise": 2614.9 * _TFLOPS,
                "fp32": 163.4 * _TFLOPS},
    memory_bytes=192 * _GB,
    memory_bandwidth_Bps=5.3 * _TB,
    intra_node_bandwidth_Bps=448 * _GB,
    intra_node_latency_s=5e-6,
    inter_node_bandwidth_Bps=_NDR_Bps,
    inter_node_latency_s=5e-6,
    gemm_efficiency=_GPU_GEMM_EFFICIENCY,
    wgrad_efficiency=_GPU_WGRAD_EFFICIENCY,
    precision_efficiency=_GPU_FP8_EFFICIENCY,
    sources=("https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",),
)

_MiB = 2**20

# A 2-core AMD EPYC (Zen 4, AVX-512 BF16; 24 GiB; torch 2.13.0+cpu, 2 threads) as
# ``python benchmarks/cpu_profile.py`` measured it on 2026-12-01: three calibrate_local runs
# averaged, all_to_all_single fitted over 2 gloo processes (the table is in benchmarks/README.md).
# A starting point for a CPU; calibrate_local measures the machine at hand.
REFERENCE_CPU = DeviceProfile(
    name="reference-cpu",
    peak_flops={"bf16": 869e9, "fp32": 196e9},
    memory_bytes=24 * _GB,
    memory_bandwidth_Bps=54 * _GB,
    intra_node_bandwidth_Bps=5.32 * _GB,
    intra_node_latency_s=1.9e-4,
    inter_node_bandwidth_Bps=5.32 * _GB,
    inter_node_latency_s=1.9e-4,
    gemm_tile_rows=1,
    gemm_call_s=0.0,
    gemm_efficiency=((1, 0.0118), (4, 0.0472), (16, 0.1507), (32, 0.2556), (64, 0.3948),
                     (128, 0.5056), (256, 0.5496), (512, 0.6472), (1024, 0.7911),
                     (2048, 0.7912), (4096, 0.7219)),
    wgrad_efficiency=((1, 0.015), (4, 0.0598), (16, 0.2063), (32, 0.3651), (64, 0.5218),
                      (128, 0.5838), (256, 0.5481), (512, 0.5943), (1024, 0.6308),
                      (2048, 0.6338), (4096, 0.5758)),
    per_group_s=7.9e-6,
    elementwise_bandwidth_Bps=28 * _GB,
    layer_overhead_s=8.4e-4,
    fresh_alloc_threshold_bytes=32 * _MiB,
    page_fault_s_per_byte=0.24e-3 / _MiB,
    sources=("benchmarks/README.md, 'The built-in cpu profile' (python benchmarks/cpu_profile.py)",),
)

_PROFILES = {p.name: p for p in (H100, H200, B200, MI300X, REFERENCE_CPU)}
_ALIASES = {"h100": "H100-SXM", "h200": "H200-SXM", "b200": "B200", "mi300x": "MI300X",
            "cpu": "reference-cpu"}


def known_profiles() -> tuple[str, ...]:
    return tuple(_PROFILES)


def get_profile(name: str) -> DeviceProfile:
    """The built-in profile called ``name`` (case-insensitive; ``"h100"`` works)."""
    key = _ALIASES.get(name.lower(), name) if isinstance(name, str) else name
    if key not in _PROFILES:
        raise ValueError(f"unknown device profile {name!r}: expected one of "
                         f"{tuple(_PROFILES) + tuple(_ALIASES)}")
    return _PROFILES[key]
