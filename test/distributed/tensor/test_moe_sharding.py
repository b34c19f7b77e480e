# Owner(s): ["module: moe"]
"""Ground-truth validation of the DTensor sharding strategies of the torch_moe ops.

``torch_moe/distributed/tensor/_ops/`` claims, for every op, a set of single-mesh-dim rules
(input placements -> output placements). This file checks the claims against what the ops
actually compute, on 1-D meshes of 2 and 4 simulated ranks (the ``"fake"`` process group and
``LocalTensorMode``: one process runs every rank).

How a sample is checked (``_validate_sample``), for each world size ``ws``:

1. Input placement combinations are enumerated per tensor argument: floating tensors take
   Replicate, Shard(d) for every d, Partial(sum) and Partial(avg); integer (index) tensors
   Replicate and Shard(0); FP8 / E8M0 (uint8) quantized data and scales Replicate and
   Shard(d), never Partial. Shards must be even (a Shard(d) with ``size(d) % ws != 0`` is
   skipped: the strategies do not allow uneven sharding, and neither does torch's
   validator). The grouped_ffn(_backward) samples add ``_StridedShard(2, 2)`` (w1 / w13 / w3)
   and ``_StridedShard(1, 2)`` (w2, hidden) inputs. All-Replicate is skipped.
2. The inputs are split into LocalTensors like torch's ``strategy_validation`` does
   (``_create_partial_input``: asymmetric 60/40 splits with sign-alternating offsets;
   ``tensor.chunk`` for Shard; ``distribute_tensor`` for _StridedShard). The op runs ONCE per
   Partial split variant (``mask_shift`` 0 and 1; one run if no input is Partial) on the
   sharded LocalTensors, under ``LocalTensorMode``.
3. For EACH OUTPUT INDEPENDENTLY, every candidate output placement (Replicate, Shard(d),
   Partial(sum), Partial(avg), ``_StridedShard(1, 2)`` for the gated ``hidden`` and the
   ``_StridedShard`` grads of strided weights; no Partial for FP8 / uint8 outputs, and
   Partial(sum) only for integer outputs) is accepted if the per-rank local outputs are exactly
   what that placement of the unsharded result is (Shard / _StridedShard shards from
   ``distribute_tensor`` of the unsharded result; Partial by summing / averaging the ranks;
   rtol 1e-4, atol 1e-4 * max|result|; FP8 / integer outputs bit-exact), in both split
   variants. (torch's validator gives all outputs of a multi-output op the same placement, so
   it cannot find a rule like ``(P, _S(1, 2))``, and it has no ``_StridedShard``.) An input
   combination is ground truth if every output has at least one accepted placement.
4. The claimed rule for the same input combination is what DTensor's sharding propagation
   does with it: single-dim strategies are asked through ``_PreparedSingleDimStrategy
   .try_propagate`` (the zero-redistribution fast path of DTensor's own search), op strategies
   (the quantization ops) and any combination with a ``_StridedShard`` input through the full
   ``ShardingPropagator.propagate_op_sharding_non_cached`` (with the output metadata computed
   once per sample: it does not depend on placements). A combination is claimed when DTensor
   runs the op without redistributing any input; its output placements are the claim. This
   includes what DTensor derives from a strategy (``_ShardingPlaceholder`` expanded into
   ``_StridedShard`` when an input is one). Every claimed or ground-truth combination of a
   single-dim strategy is re-asked through the full propagator and the two answers must agree.
   Every claimed rule is also checked end to end: the local outputs are wrapped with
   ``DTensor.from_local`` in the claimed placements, redistributed to Replicate and compared
   with the unsharded result.

Results: a WRONG rule (claimed, but some output's claimed placement is not accepted, the op
raised on the local shards, or the end-to-end check failed) fails the test with a list.
MISSING rules (ground truth, not claimed) are pinned per op with ``assertExpectedInline``, one
sorted line per rule, ``label: inputs -> outputs``, inputs in the order of the op's tensor
arguments (absent optional tensors skipped), ``[ws=N]`` when the rule was found on that world
size only (on the other it does not hold, or its shards are uneven). Collapsed there:

* a rule with Partial(avg) inputs whose Partial(sum) mirror (every P(avg) -> P, inputs and
  outputs) is also ground truth, claimed or not: DTensor never takes P(avg) inputs without
  reducing them first, so these only repeat linearity;
* Partial(avg) on an output that is also accepted as Replicate (identical ranks average to
  themselves) is not shown; ``*`` marks an empty output (any placement holds);
* the claimed rules themselves are not pinned (the strategy files are their record).

Ground truth comes from samples, so a rule that holds by coincidence on a sample would show as
missing. The samples avoid the coincidences met so far: uneven non-empty groups where a
zero-size group would line up with a shard boundary, and FP8 rowwise inputs whose magnitude
falls 100x per quarter of K (with the weight rising to match), because a power-of-two scale
taken over a shard of K quantizes exactly like the one over all of K until values reach the
FP8 subnormals. The MXFP8 samples use block dims that shard in whole 32-blocks on 2 and 4
ranks (K = 128, 256) and one that does only on 2 (K = 64, and N = 64 for
``quantized_grouped_mm``, whose backward blocks along N).

``TORCH_MOE_PRINT_SHARDING_TABLE=1`` prints the table
``op | samples | combos | claimed | wrong | missing | P(avg) mirrors`` and the wrong and missing
rules after the rule tests (``=2`` also the claimed rules and the collapsed mirrors); under
pytest add ``-s``. ``claimed`` counts the distinct claimed rules the enumeration met.

Bounds on the enumeration, to keep the file near 90 s on 2 CPU cores:

* routing index tensors are tied to ``offs`` (``sorted_ids`` / gather / scatter index take
  the placement of ``offs``): an index sharded without its groups, or groups without their
  index, fails the kernels' checks or mixes experts, so only combinations are lost;
* ``w3`` is tied to ``w1`` (the gate and up projections shard alike);
* ``scaled_grouped_mm``: each scale is Replicate or takes its data's placement;
* ``grouped_ffn``, ``grouped_ffn_backward`` and ``indexed_grouped_mm_backward`` enumerate only
  combinations with at most 3 non-Replicate untied inputs (every claimed rule has at most 3);
  ``grouped_ffn_backward`` also drops Partial(avg) inputs; ``grouped_ffn_backward`` and the
  non-gated ``grouped_ffn`` sample run on ws=2 only;
* everything runs with one intra-op thread (two OpenMP threads made some of these tiny GEMMs
  take 15 ms each on a 2-core machine).

Notes on torch 2.13 met here: ``distribute_tensor`` of a *plain* tensor with a
``_StridedShard`` placement under ``LocalTensorMode`` gives every rank rank 0's shard (this
file distributes a replicated LocalTensor instead); and ``(_StridedShard(1, 2),
_StridedShard(1, 2))`` on a 2x2 mesh does not round-trip (``full_tensor()`` of
``distribute_tensor``'s own result is wrong; also with gloo), which the 2-D choice test pins.
The file uses torch internals (``strategy_validation``, ``_PreparedSingleDimStrategy``,
``ShardingPropagator._wrap_with_op_strategy`` / ``_propagate_tensor_meta_non_cached``) and
is written against torch 2.13.

A second test class pins the strategy DTensor actually chooses (output placements, the inputs
it redistributes, from -> to, and the collectives it issues, counted by ``CommDebugMode``) for
the common MoE layouts on a 1-D mesh of 2 and on a 2x2 mesh, and checks each result against
the unsharded op (``full_tensor()``; where that fails, whether the local shards are
``distribute_tensor`` of the unsharded result, or WRONG, which fails the test).

Run: ``python -m pytest test/distributed/tensor/test_moe_sharding.py -q`` from the repo root,
or ``python test/distributed/tensor/test_moe_sharding.py``.
"""

import contextlib
import dataclasses
import functools
import itertools
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor._ops import strategy_validation as sv
from torch.distributed.tensor._ops.single_dim_strategy import _PreparedSingleDimStrategy
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
import torch_moe.distributed.tensor  # noqa: F401  (registers the sharding strategies)

ops = torch.ops.torch_moe
R = Replicate()
P = Partial()
P_AVG = Partial("avg")
SS1 = _StridedShard(1, split_factor=2)
SS2 = _StridedShard(2, split_factor=2)

PRINT_TABLE = os.environ.get("TORCH_MOE_PRINT_SHARDING_TABLE", "0") not in ("", "0")

_EXACT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.uint8)
_INDEX_DTYPES = (torch.int32, torch.int64)
_RTOL = 1e-4


def _pstr(p) -> str:
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "-" if p is None else str(p)


def _key(p) -> str:
    # Shard and _StridedShard compare equal on some torch versions: compare by text
    return str(p)


# ---------------------------------------------------------------------------------------------
# Simulated ranks
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _fake_world(world_size: int):
    """A "fake" default process group of ``world_size`` ranks (LocalTensorMode supplies the
    data of every rank)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _one_thread():
    """Tiny GEMMs: intra-op threads only cost here (some shapes took 15 ms per mm with two
    OpenMP threads on a 2-core machine, 0.03 ms with one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _local(t) -> dict:
    """{rank: tensor} of a LocalTensor (a plain tensor is the same on every rank)."""
    return t._local_tensors if isinstance(t, LocalTensor) else None


# ---------------------------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    label: str
    op: torch._ops.OpOverload
    args: tuple
    world_sizes: tuple = (2, 4)
    # tensor index -> tensor index whose placement it copies
    ties: dict = dataclasses.field(default_factory=dict)
    # tensor index -> tensor index: Replicate or the other tensor's placement (a scale and its
    # quantized data)
    follows: dict = dataclasses.field(default_factory=dict)
    # tensor index -> extra input placements; output index -> extra output placements
    extra_in: dict = dataclasses.field(default_factory=dict)
    extra_out: dict = dataclasses.field(default_factory=dict)
    # at most this many non-Replicate untied inputs
    max_sharded: int | None = None
    partial_avg: bool = True


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed))


def _routing(T=8, k=2, E=4, align=1, seed=0):
    """topk_ids [T, k] (distinct experts per token, uneven groups), token_sort of them."""
    scores = torch.rand(T, E, generator=_gen(seed))
    scores[:, 0] += 0.5  # expert 0 popular, the others uneven
    ids = scores.topk(k, dim=1).indices
    sorted_ids, offs, counts = ops.token_sort(ids, E, align)
    return ids, sorted_ids, offs


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


# T tokens, k experts per token, E experts, D model dim, F FFN dim (all multiples of 4, and
# 2F of 8, so that every dim shards evenly on 4 ranks and _StridedShard(., 2) on 4 ranks)
T, K_TOP, E, D, F = 8, 2, 4, 8, 8


@functools.cache
def _samples() -> dict:
    ids, sorted_ids, offs = _routing()
    ids_pad, sorted_pad, offs_pad = _routing(align=2, seed=1)  # S = 20, with -1 padding
    S = sorted_ids.numel()
    tokens = torch.where(sorted_ids >= 0, sorted_ids // K_TOP, -1)
    x = _randn(T, D, seed=1)
    tw = torch.rand(T, K_TOP, generator=_gen(2)) + 0.5
    w1 = _randn(E, D, F, seed=3)
    w2 = _randn(E, F, D, seed=4)
    w3 = _randn(E, D, F, seed=5)
    w13 = _randn(E, D, 2 * F, seed=6)
    y = _randn(S, D, seed=7)
    g_td = _randn(T, D, seed=8)
    h = _randn(S, F, seed=9)
    sw = torch.rand(S, generator=_gen(10)) + 0.5
    all_ = {}

    def add(op_name, *samples):
        all_[op_name] = list(samples)

    add(
        "token_sort",
        Sample("token_sort", ops.token_sort.default, (ids, E, 1)),
        Sample("token_sort[align=2]", ops.token_sort.default, (ids_pad, E, 2)),
    )
    add(
        "permute",
        Sample("permute", ops.permute.default, (x, sorted_ids, K_TOP)),
        Sample("permute[pad]", ops.permute.default, (x, sorted_pad, K_TOP)),
    )
    add(
        "permute_backward",
        Sample("permute_backward", ops.permute_backward.default, (y, sorted_ids, K_TOP, T)),
    )
    add(
        "unpermute",
        Sample("unpermute", ops.unpermute.default, (y, sorted_ids, tw)),
        Sample("unpermute[pad]", ops.unpermute.default,
               (_randn(sorted_pad.numel(), D, seed=11), sorted_pad, tw)),
    )
    add(
        "unpermute_backward",
        Sample("unpermute_backward", ops.unpermute_backward.default,
               (g_td, y, sorted_ids, tw, [True, True])),
    )
    gm_offs = _offs([3, 5, 0, 8])  # uneven, one empty group
    add(
        "grouped_mm",
        Sample("grouped_mm[2Dx3D]", ops.grouped_mm.default,
               (_randn(16, 8, seed=12), _randn(4, 8, 8, seed=13), gm_offs)),
        Sample("grouped_mm[3Dx2D]", ops.grouped_mm.default,
               (_randn(4, 8, 8, seed=14), _randn(8, 16, seed=15), gm_offs)),
        Sample("grouped_mm[2Dx2D]", ops.grouped_mm.default,
               (_randn(8, 16, seed=16), _randn(16, 8, seed=17), gm_offs)),
    )
    # tensor order: input, weight, offs, index..., scatter_weight
    add(
        "indexed_grouped_mm",
        Sample("indexed_grouped_mm[gather]", ops.indexed_grouped_mm.default,
               (x, w1, offs, tokens), ties={3: 2}),
        Sample("indexed_grouped_mm[scatter]", ops.indexed_grouped_mm.default,
               (h, w2, offs, None, tokens, sw, T), ties={3: 2}),
        Sample("indexed_grouped_mm[sorted]", ops.indexed_grouped_mm.default, (h, w2, offs)),
    )
    mask = [True, True, True]
    add(
        "indexed_grouped_mm_backward",
        Sample("indexed_grouped_mm_backward[gather]", ops.indexed_grouped_mm_backward.default,
               (_randn(S, F, seed=18), x, w1, offs, tokens, None, None, mask),
               ties={4: 3}, max_sharded=3),
        Sample("indexed_grouped_mm_backward[scatter]", ops.indexed_grouped_mm_backward.default,
               (g_td, h, w2, offs, None, tokens, sw, mask), ties={4: 3}, max_sharded=3),
        Sample("indexed_grouped_mm_backward[sorted]", ops.indexed_grouped_mm_backward.default,
               (_randn(S, D, seed=19), h, w2, offs, None, None, None, mask), max_sharded=3),
    )
    # tensor order: x, sorted_ids, offs, topk_weights, w1, w2[, w3]
    ffn_ties = {1: 2}
    add(
        "grouped_ffn",
        Sample("grouped_ffn[swiglu,w1+w3]", ops.grouped_ffn.default,
               (x, sorted_ids, offs, tw, w1, w2, w3, "swiglu"),
               ties={**ffn_ties, 6: 4}, extra_in={4: [SS2], 5: [SS1], 6: [SS2]},
               extra_out={1: [SS1]}, max_sharded=3),
        Sample("grouped_ffn[swiglu,w13]", ops.grouped_ffn.default,
               (x, sorted_ids, offs, tw, w13, w2, None, "swiglu"),
               ties=ffn_ties, extra_in={4: [SS2], 5: [SS1]}, extra_out={1: [SS1]},
               max_sharded=3),
        Sample("grouped_ffn[relu]", ops.grouped_ffn.default,
               (x, sorted_ids, offs, tw, w1, w2, None, "relu"),
               ties=ffn_ties, max_sharded=3, world_sizes=(2,)),
    )
    with torch.no_grad():
        _, hid = ops.grouped_ffn(x, sorted_ids, offs, tw, w1, w2, w3, "swiglu")
        _, hid13 = ops.grouped_ffn(x, sorted_ids, offs, tw, w13, w2, None, "swiglu")
        _, hid_relu = ops.grouped_ffn(x, sorted_ids, offs, tw, w1, w2, None, "relu")
    # tensor order: grad, x, sorted_ids, offs, topk_weights, w1, w2[, w3], hidden
    add(
        "grouped_ffn_backward",
        Sample("grouped_ffn_backward[swiglu,w1+w3]", ops.grouped_ffn_backward.default,
               (g_td, x, sorted_ids, offs, tw, w1, w2, w3, hid, "swiglu", 1.702, 7.0,
                [True] * 8),
               ties={2: 3, 7: 5}, extra_in={5: [SS2], 6: [SS1], 7: [SS2], 8: [SS1]},
               extra_out={2: [SS2], 3: [SS1], 4: [SS2]}, max_sharded=3,
               partial_avg=False, world_sizes=(2,)),
        Sample("grouped_ffn_backward[swiglu,w13]", ops.grouped_ffn_backward.default,
               (g_td, x, sorted_ids, offs, tw, w13, w2, None, hid13, "swiglu", 1.702, 7.0,
                [True] * 8),
               ties={2: 3}, extra_in={5: [SS2], 6: [SS1], 7: [SS1]}, extra_out={2: [SS2]},
               max_sharded=3, partial_avg=False, world_sizes=(2,)),
        Sample("grouped_ffn_backward[relu]", ops.grouped_ffn_backward.default,
               (g_td, x, sorted_ids, offs, tw, w1, w2, None, hid_relu, "relu", 1.702, 7.0,
                [True] * 8),
               ties={2: 3}, max_sharded=3, partial_avg=False, world_sizes=(2,)),
    )

    # ---- quantization --------------------------------------------------------------------
    # MX blocks are 32 wide: a block dim of 256 shards in whole blocks on 2 and 4 ranks, 64
    # only on 2 (16 per rank on 4), and 64 rows (dim 0) likewise.
    xq = _randn(8, 256, seed=20)
    xq64 = _randn(8, 64, seed=21)
    xq_rows = _randn(64, 8, seed=22)
    add(
        "quantize_mxfp8",
        Sample("quantize_mxfp8[K=256]", ops.quantize_mxfp8.default, (xq, -1)),
        Sample("quantize_mxfp8[K=64]", ops.quantize_mxfp8.default, (xq64, -1)),
        Sample("quantize_mxfp8[dim=0,K=64]", ops.quantize_mxfp8.default, (xq_rows, 0)),
    )
    d256, s256 = ops.quantize_mxfp8(xq, -1)
    d_rows, s_rows = ops.quantize_mxfp8(xq_rows, 0)
    add(
        "dequantize_mxfp8",
        Sample("dequantize_mxfp8[K=256]", ops.dequantize_mxfp8.default, (d256, s256, -1)),
        Sample("dequantize_mxfp8[dim=0,K=64]", ops.dequantize_mxfp8.default,
               (d_rows, s_rows, 0)),
    )
    xr = _randn(8, 32, seed=23)
    xr_g = _randn(32, 8, seed=24)
    q_offs = _offs([4, 12, 8, 8])
    add(
        "quantize_fp8_rowwise",
        Sample("quantize_fp8_rowwise", ops.quantize_fp8_rowwise.default, (xr, -1)),
        Sample("quantize_fp8_rowwise[dim=0,offs]", ops.quantize_fp8_rowwise.default,
               (xr_g, 0, q_offs)),
    )
    dr, sr = ops.quantize_fp8_rowwise(xr, -1)
    dr_g, sr_g = ops.quantize_fp8_rowwise(xr_g, 0, q_offs)
    add(
        "dequantize_fp8_rowwise",
        Sample("dequantize_fp8_rowwise", ops.dequantize_fp8_rowwise.default, (dr, sr, -1)),
        Sample("dequantize_fp8_rowwise[dim=0,offs]", ops.dequantize_fp8_rowwise.default,
               (dr_g, sr_g, 0, q_offs)),
    )
    sc3 = torch.randint(100, 140, (4, 256, 8), dtype=torch.uint8, generator=_gen(25))
    sc2 = torch.randint(100, 140, (256, 8), dtype=torch.uint8, generator=_gen(26))
    add(
        "swizzle_mx_scale",
        Sample("swizzle_mx_scale[3D]", ops.swizzle_mx_scale.default, (sc3,)),
        Sample("swizzle_mx_scale[2D]", ops.swizzle_mx_scale.default, (sc2,)),
    )
    add(
        "unswizzle_mx_scale",
        Sample("unswizzle_mx_scale[3D]", ops.unswizzle_mx_scale.default,
               (ops.swizzle_mx_scale(sc3), 256, 8)),
        Sample("unswizzle_mx_scale[2D]", ops.unswizzle_mx_scale.default,
               (ops.swizzle_mx_scale(sc2), 256, 8)),
    )
    # scaled_grouped_mm: groups of 32 rows (one empty), out_dtype float32. Magnitudes fall by
    # 100x per quarter of K, so that a quantization scale taken over a shard of K differs from
    # the one over all of K (FP8 rounding is invariant to power-of-two scales until values
    # reach the subnormals).
    g_offs = _offs([32, 0, 64, 32])
    kq = torch.tensor([1.0, 1e-2, 1e-4, 1e-6]).repeat_interleave(32)
    a2 = _randn(128, 128, seed=27) * kq     # [M, K]
    b3 = _randn(4, 128, 16, seed=28) / kq[:, None]  # [G, K, N], products a * b of one size
    a_km = _randn(16, 128, seed=29)         # [K, M] (2D x 2D: M grouped)
    b_mn = _randn(128, 16, seed=30)         # [M, N]
    # scale_a follows mat_a, scale_b follows mat_b
    sgm_follows = {2: 0, 3: 1}
    f32 = torch.float32
    qa, sa = ops.quantize_mxfp8(a2, 1)
    qb, sb = ops.quantize_mxfp8(b3, 1)
    ra, rsa = ops.quantize_fp8_rowwise(a2, 1)
    rb, rsb = ops.quantize_fp8_rowwise(b3, 1)
    qa2, sa2 = ops.quantize_mxfp8(a_km, 1)
    qb2, sb2 = ops.quantize_mxfp8(b_mn, 0)
    ra2, rsa2 = ops.quantize_fp8_rowwise(a_km, 1, g_offs)
    rb2, rsb2 = ops.quantize_fp8_rowwise(b_mn, 0, g_offs)
    add(
        "scaled_grouped_mm",
        Sample("scaled_grouped_mm[mxfp8,2Dx3D]", ops.scaled_grouped_mm.default,
               (qa, qb, sa, sb, g_offs, f32), follows=sgm_follows),
        Sample("scaled_grouped_mm[fp8_rowwise,2Dx3D]", ops.scaled_grouped_mm.default,
               (ra, rb, rsa, rsb, g_offs, f32), follows=sgm_follows),
        Sample("scaled_grouped_mm[mxfp8,2Dx2D]", ops.scaled_grouped_mm.default,
               (qa2, qb2, sa2, sb2, g_offs, f32), follows=sgm_follows),
        Sample("scaled_grouped_mm[fp8_rowwise,2Dx2D]", ops.scaled_grouped_mm.default,
               (ra2, rb2, rsa2, rsb2, g_offs, f32), follows=sgm_follows),
    )
    # quantized_grouped_mm: MXFP8 blocks K (forward) and N (dgrad) in 32s; input magnitudes
    # fall along K as above
    m_offs = _offs([32, 0, 32, 0])
    x_mk = a2[:64]
    w_k128 = _randn(4, 128, 64, seed=31) / kq[:, None]
    kq64 = torch.tensor([1.0, 1e-5]).repeat_interleave(32)
    add(
        "quantized_grouped_mm",
        Sample("quantized_grouped_mm[mxfp8,K=128,N=64]", ops.quantized_grouped_mm.default,
               (x_mk, w_k128, m_offs, "mxfp8")),
        Sample("quantized_grouped_mm[mxfp8,K=64,N=64]", ops.quantized_grouped_mm.default,
               (_randn(64, 64, seed=32) * kq64, _randn(4, 64, 64, seed=33) / kq64[:, None],
                m_offs, "mxfp8")),
        Sample("quantized_grouped_mm[fp8_rowwise]", ops.quantized_grouped_mm.default,
               (x_mk, w_k128, m_offs, "fp8_rowwise")),
    )
    return all_


# ---------------------------------------------------------------------------------------------
# The validator
# ---------------------------------------------------------------------------------------------


def _exact(t: torch.Tensor) -> bool:
    return t.dtype in _EXACT_DTYPES or t.dtype in _INDEX_DTYPES or t.dtype == torch.bool


def _input_candidates(t: torch.Tensor, ws: int, partial_avg: bool, extra) -> list:
    if t.dtype in _INDEX_DTYPES:
        cands = [R, Shard(0)]
    elif t.is_floating_point() and t.dtype not in _EXACT_DTYPES:
        cands = [R, *(Shard(d) for d in range(t.ndim)), P] + ([P_AVG] if partial_avg else [])
    else:
        cands = [R, *(Shard(d) for d in range(t.ndim))]
    cands += extra
    ok = []
    for p in cands:
        if isinstance(p, _StridedShard):
            if t.shape[p.dim] % (ws * p.split_factor):
                continue
        elif isinstance(p, Shard) and t.shape[p.dim] % ws:
            continue
        ok.append(p)
    return ok


def _output_candidates(t: torch.Tensor, extra) -> list:
    cands = [R, *(Shard(d) for d in range(t.ndim))]
    if t.dtype in _INDEX_DTYPES:
        cands.append(P)
    elif t.is_floating_point() and t.dtype not in _EXACT_DTYPES:
        cands += [P, P_AVG]
    return cands + list(extra)


def _same(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if _exact(b):
        if b.element_size() == 1:
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=_RTOL, atol=_RTOL * scale, equal_nan=True)


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


class _Validator:
    """Runs the samples of one op on one world size."""

    def __init__(self, sample: Sample, ws: int, mesh):
        self.s = sample
        self.ws = ws
        self.mesh = mesh
        self.prop = DTensor._op_dispatcher.sharding_propagator
        self.pos = [i for i, a in enumerate(sample.args) if isinstance(a, torch.Tensor)]
        self.tensors = [sample.args[i] for i in self.pos]
        self.pristine = [t.clone() for t in self.tensors]
        with torch.no_grad():
            self.gt = [o.clone() for o in _as_list(sample.op(*sample.args))]
        self.scale = [
            1.0 if _exact(g) or g.numel() == 0 else 1.0 + float(g.float().abs().nan_to_num().max())
            for g in self.gt
        ]
        self._shards = {}
        self._expected = {}
        self._out_meta = None
        self.single_dim = sample.op in self.prop.op_single_dim_strategy_funcs

    # -- inputs ----------------------------------------------------------------------------

    def combos(self):
        s = self.s
        allowed = [
            _input_candidates(t, self.ws, s.partial_avg, s.extra_in.get(i, []))
            for i, t in enumerate(self.tensors)
        ]
        allowed_keys = [{_key(p) for p in a} for a in allowed]
        free = [i for i in range(len(self.tensors)) if i not in s.ties]
        cands = [allowed[i] for i in free]
        for choice in itertools.product(*cands):
            if all(isinstance(p, Replicate) for p in choice):
                continue
            if s.max_sharded is not None and sum(
                not isinstance(p, Replicate) for p in choice
            ) > s.max_sharded:
                continue
            combo = [None] * len(self.tensors)
            for i, p in zip(free, choice):
                combo[i] = p
            for i, j in s.ties.items():
                combo[i] = combo[j]
            if any(
                not isinstance(combo[i], Replicate) and _key(combo[i]) != _key(combo[j])
                for i, j in s.follows.items()
            ):
                continue
            if any(_key(p) not in allowed_keys[i] for i, p in enumerate(combo)):
                continue  # a tied tensor cannot take its partner's placement
            yield tuple(combo)

    def shards(self, i: int, p, mask: int) -> dict:
        key = (i, _key(p), mask if isinstance(p, Partial) else 0)
        if key not in self._shards:
            t = self.tensors[i]
            if isinstance(p, Replicate):
                d = {r: t for r in range(self.ws)}
            elif isinstance(p, Partial):
                d = dict(sv._create_partial_input(t, p, self.ws, i, mask)._local_tensors)
            elif type(p) is Shard:
                d = {r: c.contiguous() for r, c in enumerate(t.chunk(self.ws, p.dim))}
            else:
                d = self.distributed(t, p)
            self._shards[key] = d
        return self._shards[key]

    def distributed(self, t: torch.Tensor, p) -> dict:
        # the source must be a (replicated) LocalTensor: distribute_tensor of a plain tensor
        # with a _StridedShard gives every rank rank 0's shard under LocalTensorMode
        src = LocalTensor({r: t.clone() for r in range(self.ws)})
        with LocalTensorMode(frozenset(range(self.ws))):
            lt = distribute_tensor(src, self.mesh, (p,)).to_local()
        return {r: v.contiguous() for r, v in _local(lt).items()}

    def local_args(self, combo, mask):
        args = list(self.s.args)
        for i, (pos, p) in enumerate(zip(self.pos, combo)):
            args[pos] = LocalTensor(self.shards(i, p, mask))
        return args

    # -- ground truth ----------------------------------------------------------------------

    def run(self, combo, mask):
        """Per-rank outputs ([{rank: tensor}] per output), or the error the op raised."""
        args = self.local_args(combo, mask)
        try:
            # mismatched shards make some kernels resize their scratch buffers, with a warning
            with LocalTensorMode(frozenset(range(self.ws))), torch.no_grad(), \
                    warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = self.s.op(*args)
        except Exception as e:  # noqa: BLE001  (any failure on the shards means no rule)
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        outs = []
        for o in _as_list(out):
            d = _local(o)
            outs.append(d if d is not None else {r: o for r in range(self.ws)})
        return outs

    def expected_shards(self, out_idx: int, p) -> dict:
        key = (out_idx, _key(p))
        if key not in self._expected:
            g = self.gt[out_idx]
            if type(p) is Shard:
                chunks = list(g.chunk(self.ws, p.dim))
                empty_shape = list(g.shape)
                empty_shape[p.dim] = 0
                chunks += [g.new_empty(empty_shape)] * (self.ws - len(chunks))
                self._expected[key] = dict(enumerate(chunks))
            else:
                self._expected[key] = self.distributed(g, p)
        return self._expected[key]

    def accepted(self, out_idx: int, local: dict, claimed=None) -> set:
        """The candidate placements of output ``out_idx`` (and the claimed one, if it is not
        a candidate) that the per-rank outputs ``local`` are."""
        g = self.gt[out_idx]
        if g.numel() == 0:
            return {"*"}
        scale = self.scale[out_idx]
        ranks = [local[r] for r in range(self.ws)]
        cands = _output_candidates(g, self.s.extra_out.get(out_idx, []))
        if claimed is not None and _key(claimed) not in {_key(p) for p in cands}:
            cands.append(claimed)
        ok = set()
        for p in cands:
            if isinstance(p, Replicate):
                good = all(_same(v, g, scale) for v in ranks)
            elif isinstance(p, Partial):
                if any(v.shape != g.shape or v.dtype != g.dtype for v in ranks):
                    continue
                acc = torch.stack([v.double() for v in ranks]).sum(0)
                if p.reduce_op == "avg":
                    acc = acc / self.ws
                good = _same(acc.to(g.dtype), g, scale)
            else:
                if isinstance(p, _StridedShard) and g.shape[p.dim] % (self.ws * p.split_factor):
                    continue
                exp = self.expected_shards(out_idx, p)
                good = all(_same(ranks[r], exp[r], scale) for r in range(self.ws))
            if good:
                ok.add(_key(p))
        return ok

    # -- claims ----------------------------------------------------------------------------

    def schema(self, combo) -> OpSchema:
        args = list(self.s.args)
        for pos, p, t in zip(self.pos, combo, self.tensors):
            args[pos] = DTensorSpec(self.mesh, (p,), TensorMeta(t.shape, t.stride(), t.dtype))
        op = self.s.op
        info = self.prop.op_to_schema_info.get(op) or \
            self.prop.op_to_schema_info_for_single_dim_strategy.get(op)
        return OpSchema(op, tuple(args), {}, schema_info=info)

    def out_meta(self, schema):
        if self._out_meta is None:
            self._out_meta = self.prop._propagate_tensor_meta_non_cached(schema)
        return self._out_meta

    def claim_full(self, combo):
        """DTensor's full sharding propagation: the output placements if it runs the op on
        these placements as they are, None if it redistributes an input (the output meta does
        not depend on placements, so it is computed once per sample)."""
        schema = self.schema(combo)
        meta = self.out_meta(schema)
        self.prop._propagate_tensor_meta_non_cached = lambda _: meta
        try:
            out = self.prop.propagate_op_sharding_non_cached(schema)
        finally:
            del self.prop._propagate_tensor_meta_non_cached
        if out.needs_redistribute:
            return None
        return tuple(None if o is None else o.placements[0] for o in _as_list(out.output_spec))

    def claim(self, combo):
        if not self.single_dim or any(isinstance(p, _StridedShard) for p in combo):
            return self.claim_full(combo)
        schema = self.schema(combo)
        strategy_schema = self.prop._wrap_with_op_strategy(schema)
        prepared = _PreparedSingleDimStrategy(
            self.prop.op_single_dim_strategy_funcs[self.s.op], strategy_schema,
            self.out_meta(schema),
        )
        specs = [a for a in schema.args_schema if isinstance(a, DTensorSpec)]
        res = prepared.try_propagate(self.mesh, tuple(s.placements for s in specs), specs)
        if res is None:
            return None
        return tuple(
            None if o is None else o.placements[0]
            for o in _as_list(res.strategies[0].output_specs)
        )

    def end_to_end(self, outs, claimed) -> str | None:
        """Wraps the local outputs in the claimed placements and redistributes to Replicate."""
        with LocalTensorMode(frozenset(range(self.ws))):
            for i, (local, p, g) in enumerate(zip(outs, claimed, self.gt)):
                if p is None or g.numel() == 0:
                    continue
                dt = DTensor.from_local(LocalTensor(local), self.mesh, (p,), run_check=False,
                                        shape=g.shape, stride=g.stride())
                full = _local(dt.redistribute(self.mesh, (R,)).to_local())
                for r in range(self.ws):
                    if not _same(full[r], g, self.scale[i]):
                        return f"output {i} in {_pstr(p)} does not redistribute to the result"
        return None


@dataclasses.dataclass
class _Result:
    combos: int = 0
    claimed: dict = dataclasses.field(default_factory=dict)   # (label, ins, outs) -> {ws}
    wrong: list = dataclasses.field(default_factory=list)
    inconsistent: list = dataclasses.field(default_factory=list)
    missing: dict = dataclasses.field(default_factory=dict)   # (label, ins, outs) -> {ws}
    mirrors: int = 0
    mirror_lines: list = dataclasses.field(default_factory=list)
    samples: int = 0
    missing_lines: list = dataclasses.field(default_factory=list)
    claimed_lines: list = dataclasses.field(default_factory=list)


def _fmt(label, ins, outs, ws_set=None, all_ws=None) -> str:
    line = f"{label}: {', '.join(ins)} -> {', '.join(outs)}"
    if ws_set is not None and set(ws_set) != set(all_ws):
        line += f"  [ws={','.join(map(str, sorted(ws_set)))}]"
    return line


def _validate_sample(sample: Sample, ws: int, result: _Result) -> None:
    mesh = init_device_mesh("cpu", (ws,))
    v = _Validator(sample, ws, mesh)
    gt_rules = {}  # combo strings -> output strings
    missing = {}
    for combo in v.combos():
        result.combos += 1
        try:
            claimed = v.claim(combo)
        except Exception as e:  # noqa: BLE001  (a strategy must not raise on valid inputs)
            result.wrong.append(
                f"{sample.label} (ws={ws}): {', '.join(_pstr(p) for p in combo)}: sharding "
                f"propagation raised {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            )
            continue
        masks = (0, 1) if any(isinstance(p, Partial) for p in combo) else (0,)
        runs = [v.run(combo, m) for m in masks]
        error = next((r for r in runs if isinstance(r, str)), None)
        accepted = None
        if error is None:
            accepted = [
                set.intersection(*(
                    v.accepted(i, run[i], claimed[i] if claimed else None) for run in runs
                ))
                for i in range(len(v.gt))
            ]
        ins = tuple(_pstr(p) for p in combo)
        is_gt = accepted is not None and all(accepted)
        if (is_gt or claimed is not None) and v.single_dim:
            # the fast path must agree with DTensor's full propagation
            full = v.claim_full(combo)
            if [_key(p) for p in full or ()] != [_key(p) for p in claimed or ()] or (
                (full is None) != (claimed is None)
            ):
                result.inconsistent.append(
                    f"{sample.label} ws={ws}: {', '.join(ins)}: try_propagate "
                    f"{claimed} != propagate_op_sharding {full}"
                )
        if is_gt:
            outs = []
            for a in accepted:
                if a == {"*"}:
                    outs.append("*")
                    continue
                if "R" in a:
                    a = a - {_key(P_AVG)}
                outs.append("|".join(_pstr(_parse(k)) for k in sorted(a, key=_order)))
            gt_rules[ins] = tuple(outs)
        if claimed is not None:
            outs_c = tuple(_pstr(p) for p in claimed)
            result.claimed.setdefault((sample.label, ins, outs_c), set()).add(ws)
            reasons = []
            if error is not None:
                reasons.append(f"the op raised on the local shards ({error})")
            else:
                for i, p in enumerate(claimed):
                    if p is None or "*" in accepted[i]:
                        continue
                    if _key(p) not in accepted[i]:
                        got = "|".join(
                            _pstr(_parse(k)) for k in sorted(accepted[i], key=_order)
                        ) or "none"
                        reasons.append(f"output {i}: claimed {_pstr(p)}, ground truth {got}")
                if not reasons:
                    for run in runs:
                        bad = v.end_to_end(run, claimed)
                        if bad:
                            reasons.append(bad)
                            break
            if reasons:
                result.wrong.append(
                    f"{_fmt(sample.label, ins, outs_c)}  (ws={ws}): " + "; ".join(reasons)
                )
        elif is_gt:
            missing[ins] = gt_rules[ins]
    for i, (t, orig) in enumerate(zip(v.tensors, v.pristine)):
        # Replicate shards are the sample's own tensors: an op writing to an input would
        # corrupt every later combination
        if not torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                           orig.view(torch.uint8) if orig.element_size() == 1 else orig):
            result.wrong.append(f"{sample.label} (ws={ws}): the op wrote to tensor input {i}")
    for ins, outs in missing.items():
        if _pstr(P_AVG) in ins:
            avg, total = _pstr(P_AVG), _pstr(P)
            mirror = tuple(total if p == avg else p for p in ins)
            if gt_rules.get(mirror) == tuple(o.replace(avg, total) for o in outs):
                result.mirrors += 1
                result.mirror_lines.append(
                    f"{_fmt(sample.label, ins, outs)}  (ws={ws}) mirrors "
                    f"{', '.join(mirror)} -> {', '.join(gt_rules[mirror])}"
                )
                continue
        result.missing.setdefault((sample.label, ins, outs), set()).add(ws)


def _order(k: str):
    # R, S(d), _S(d, sf), P, P(avg)
    return ({"R": 0, "S": 1, "_": 2, "P": 3}[k[0]], k)


def _parse(k: str):
    if k == "*":
        return "*"
    if k.startswith("_S("):
        d, sf = k[3:-1].split(",")
        return _StridedShard(int(d), split_factor=int(sf))
    return sv.parse_placement(k)


_RESULTS: dict = {}


def _validate_op(op_name: str) -> _Result:
    if op_name in _RESULTS:
        return _RESULTS[op_name]
    result = _Result()
    samples = _samples()[op_name]
    result.samples = len(samples)
    with _one_thread():
        for ws in (2, 4):
            todo = [s for s in samples if ws in s.world_sizes]
            if not todo:
                continue
            with _fake_world(ws):
                for s in todo:
                    _validate_sample(s, ws, result)
    all_ws = {s.label: s.world_sizes for s in samples}
    result.missing_lines = sorted(
        _fmt(label, ins, outs, wss, all_ws[label])
        for (label, ins, outs), wss in result.missing.items()
    )
    result.claimed_lines = sorted(
        _fmt(label, ins, outs, wss, all_ws[label])
        for (label, ins, outs), wss in result.claimed.items()
    )
    _RESULTS[op_name] = result
    return result


def _table() -> str:
    rows = [("op", "samples", "combos", "claimed", "wrong", "missing", "P(avg) mirrors")]
    for name in (n for n in _samples() if n in _RESULTS):
        r = _RESULTS[name]
        rows.append((name, r.samples, r.combos, len(r.claimed_lines), len(r.wrong),
                     len(r.missing_lines), r.mirrors))
    widths = [max(len(str(row[c])) for row in rows) for c in range(len(rows[0]))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# What DTensor chooses
# ---------------------------------------------------------------------------------------------


def _pl(placements) -> str:
    return "(" + ", ".join(_pstr(p) for p in placements) + ")"


def _dtensor_choice(mesh, name, op, args, placements) -> str:
    """Runs ``op`` on DTensors of ``args`` in ``placements`` (one tuple per tensor argument) and
    reports the output placements, the inputs DTensor redistributed (``argN``: the N-th tensor
    argument, from -> to), the collectives it issued and whether the result matches the
    unsharded op."""
    ws = mesh.size()
    ranks = frozenset(range(ws))
    with LocalTensorMode(ranks):
        dargs, it = [], iter(placements)
        for a in args:
            if isinstance(a, torch.Tensor):
                src = LocalTensor({r: a.clone() for r in range(ws)})
                dargs.append(distribute_tensor(src, mesh, next(it)))
            else:
                dargs.append(a)
        prop = DTensor._op_dispatcher.sharding_propagator
        schema = DTensor._op_dispatcher.unwrap_to_op_info(op, tuple(dargs), {}).schema
        plan = prop.propagate_op_sharding(schema)
        moved = []
        if plan.needs_redistribute:
            want = [s for s in plan.redistribute_schema.args_schema if isinstance(s, DTensorSpec)]
            have = [s for s in schema.args_schema if isinstance(s, DTensorSpec)]
            for i, (h, w) in enumerate(zip(have, want)):
                if h.placements != w.placements:
                    moved.append(f"arg{i} {_pl(h.placements)} -> {_pl(w.placements)}")
        with CommDebugMode() as comm, torch.no_grad():
            outs = _as_list(op(*dargs))
        comms = ", ".join(
            f"{str(k).split('.')[-1]} x{n}"
            for k, n in sorted(comm.get_comm_counts().items(), key=lambda kv: str(kv[0]))
        )
        with torch.no_grad():
            refs = _as_list(op(*args))
        checks = []
        for i, (o, ref) in enumerate(zip(outs, refs)):
            scale = 1.0 if _exact(ref) else 1.0 + float(ref.abs().max())
            if _same(_local(o.full_tensor())[0], ref, scale):
                continue
            # does the output hold the right data, in the layout distribute_tensor gives its
            # placements, even though DTensor cannot gather it back?
            want = _local(distribute_tensor(
                LocalTensor({r: ref.clone() for r in range(ws)}), mesh, o.placements
            ).to_local())
            have = _local(o.to_local())
            if all(_same(have[r], want[r], scale) for r in range(ws)):
                checks.append(f"output {i}: full_tensor() != the unsharded op, but the local "
                              "shards are distribute_tensor(unsharded, same placements)")
            else:
                checks.append(f"output {i}: WRONG")
    ins = " ".join(_pl(p) for p in placements)
    out = " ".join(_pl(o.placements) for o in outs)
    return (f"{name}: {ins} -> {out}\n    redistributed: {'; '.join(moved) or 'nothing'}"
            f"; collectives: {comms or 'none'}; "
            + ("; ".join(checks) if checks else "full_tensor() matches the unsharded op"))


def _choice_cases(mesh_shape) -> list:
    ids, sorted_ids, offs = _routing()
    x = _randn(T, D, seed=1)
    tw = torch.rand(T, K_TOP, generator=_gen(2)) + 0.5
    w1, w2, w3 = _randn(E, D, F, seed=3), _randn(E, F, D, seed=4), _randn(E, D, F, seed=5)
    w13 = _randn(E, D, 2 * F, seed=6)
    a, b, gm_offs = _randn(16, 8, seed=12), _randn(4, 8, 8, seed=13), _offs([3, 5, 0, 8])
    xq = _randn(8, 64, seed=21)
    ffn = ops.grouped_ffn.default
    gmm = ops.grouped_mm.default
    ffn_args = (x, sorted_ids, offs, tw, w1, w2, w3, "swiglu")
    ffn13_args = (x, sorted_ids, offs, tw, w13, w2, None, "swiglu")
    if len(mesh_shape) == 1:
        r, s0, s1, s2 = (R,), (Shard(0),), (Shard(1),), (Shard(2),)
        return [
            ("grouped_ffn ETP", ffn, ffn_args, [r, r, r, r, s2, s1, s2]),
            ("grouped_ffn ETP, fused w13", ffn, ffn13_args, [r, r, r, r, (SS2,), s1]),
            ("grouped_ffn ETP, tokens sharded", ffn, ffn_args, [s0, s0, r, s0, s2, s1, s2]),
            ("grouped_mm 2Dx3D, K sharded", gmm, (a, b, gm_offs), [s1, s1, r]),
            ("grouped_mm 2Dx3D, N sharded", gmm, (a, b, gm_offs), [r, s2, r]),
            ("grouped_mm 2Dx3D, rows sharded", gmm, (a, b, gm_offs), [s0, s2, r]),
            ("grouped_mm 2Dx3D, offs sharded", gmm, (a, b, gm_offs), [r, s2, s0]),
            ("quantize_mxfp8 K=64 sharded", ops.quantize_mxfp8.default, (xq, -1), [s1]),
        ]
    rr, rs1, rs2 = (R, R), (R, Shard(1)), (R, Shard(2))
    return [
        ("grouped_ffn ETP on mesh dim 1", ffn, ffn_args, [rr, rr, rr, rr, rs2, rs1, rs2]),
        ("grouped_ffn F sharded on both mesh dims", ffn, ffn_args,
         [rr, rr, rr, rr, (Shard(2), Shard(2)), (Shard(1), Shard(1)), (Shard(2), Shard(2))]),
        ("grouped_ffn tokens on dim 0, ETP on dim 1", ffn, ffn_args,
         [(Shard(0), R), (Shard(0), R), rr, (Shard(0), R), rs2, rs1, rs2]),
        ("grouped_mm 2Dx3D, K sharded on dim 1", gmm, (a, b, gm_offs), [rs1, rs1, rr]),
        ("grouped_mm 2Dx3D, N on dim 0, K on dim 1", gmm, (a, b, gm_offs),
         [rs1, (Shard(2), Shard(1)), rr]),
        ("grouped_mm 2Dx3D, rows on dim 0, N on dim 1", gmm, (a, b, gm_offs),
         [(Shard(0), R), rs2, rr]),
        ("grouped_mm 2Dx3D, offs sharded", gmm, (a, b, gm_offs), [rr, rs2, (Shard(0), R)]),
        ("quantize_mxfp8 K=64 on both mesh dims", ops.quantize_mxfp8.default, (xq, -1),
         [(Shard(1), Shard(1))]),
    ]


def _choices(mesh_shape) -> str:
    ws = 1
    for n in mesh_shape:
        ws *= n
    with _fake_world(ws), _one_thread():
        with LocalTensorMode(frozenset(range(ws))):
            mesh = init_device_mesh("cpu", mesh_shape)
        return "\n".join(
            _dtensor_choice(mesh, name, op, args, pls)
            for name, op, args, pls in _choice_cases(mesh_shape)
        )


class TestMoEShardingRules(TestCase):
    """Claimed rules against ground truth, one test per op (see the module docstring)."""

    @classmethod
    def tearDownClass(cls):
        if PRINT_TABLE and _RESULTS:
            print("\n" + _table(), file=sys.stderr)
            for name, r in _RESULTS.items():
                for line in r.wrong:
                    print(f"WRONG {line}", file=sys.stderr)
            print("\nmissing rules:", file=sys.stderr)
            for name, r in _RESULTS.items():
                for line in r.missing_lines:
                    print(f"  {line}", file=sys.stderr)
            if os.environ.get("TORCH_MOE_PRINT_SHARDING_TABLE") == "2":
                print("\nclaimed rules:", file=sys.stderr)
                for name, r in _RESULTS.items():
                    for line in r.claimed_lines:
                        print(f"  {line}", file=sys.stderr)
                print("\nP(avg) mirrors (collapsed):", file=sys.stderr)
                for name, r in _RESULTS.items():
                    for line in r.mirror_lines:
                        print(f"  {line}", file=sys.stderr)
        super().tearDownClass()

    def _check(self, op_name: str) -> str:
        r = _validate_op(op_name)
        self._wrong = r.wrong + [f"inconsistent claim: {x}" for x in r.inconsistent]
        return "\n".join(r.missing_lines)

    def _assert_no_wrong(self):
        if self._wrong:
            self.fail("claimed rules that are wrong:\n" + "\n".join(self._wrong))

    def test_token_sort(self):
        self.assertExpectedInline(self._check("token_sort"), """""")
        self._assert_no_wrong()

    def test_permute(self):
        self.assertExpectedInline(self._check("permute"), """""")
        self._assert_no_wrong()

    def test_permute_backward(self):
        self.assertExpectedInline(self._check("permute_backward"), """""")
        self._assert_no_wrong()

    def test_unpermute(self):
        self.assertExpectedInline(self._check("unpermute"), """""")
        self._assert_no_wrong()

    def test_unpermute_backward(self):
        self.assertExpectedInline(self._check("unpermute_backward"), """""")
        self._assert_no_wrong()

    def test_grouped_mm(self):
        self.assertExpectedInline(self._check("grouped_mm"), """""")
        self._assert_no_wrong()

    def test_indexed_grouped_mm(self):
        self.assertExpectedInline(self._check("indexed_grouped_mm"), """""")
        self._assert_no_wrong()

    def test_indexed_grouped_mm_backward(self):
        self.assertExpectedInline(self._check("indexed_grouped_mm_backward"), """\
indexed_grouped_mm_backward[gather]: R, P, P, R, R -> P, P, *
indexed_grouped_mm_backward[sorted]: R, P, P, R -> P, P, *""")
        self._assert_no_wrong()

    def test_grouped_ffn(self):
        self.assertExpectedInline(self._check("grouped_ffn"), """""")
        self._assert_no_wrong()

    def test_grouped_ffn_backward(self):
        self.assertExpectedInline(self._check("grouped_ffn_backward"), """\
grouped_ffn_backward[relu]: R, P, R, R, R, P, R, R -> P, R, P, R, *, *, *, *
grouped_ffn_backward[relu]: R, P, R, R, R, R, R, R -> R, R, P, R, *, *, *, *
grouped_ffn_backward[relu]: R, R, R, R, R, P, R, R -> P, R, R, R, *, *, *, *
grouped_ffn_backward[relu]: R, R, R, R, R, R, P, R -> P, P, P, R, *, *, *, *
grouped_ffn_backward[swiglu,w1+w3]: R, P, R, R, R, P, R, P, R -> P, R, P, R, P, *, *, *
grouped_ffn_backward[swiglu,w1+w3]: R, P, R, R, R, R, R, R, R -> R, R, P, R, P, *, *, *
grouped_ffn_backward[swiglu,w1+w3]: R, R, R, R, R, P, R, P, R -> P, R, R, R, R, *, *, *
grouped_ffn_backward[swiglu,w1+w3]: R, R, R, R, R, R, P, R, R -> P, P, P, R, P, *, *, *
grouped_ffn_backward[swiglu,w13]: R, P, R, R, R, P, R, R -> P, R, P, R, *, *, *, *
grouped_ffn_backward[swiglu,w13]: R, P, R, R, R, R, R, R -> R, R, P, R, *, *, *, *
grouped_ffn_backward[swiglu,w13]: R, R, R, R, R, P, R, R -> P, R, R, R, *, *, *, *
grouped_ffn_backward[swiglu,w13]: R, R, R, R, R, R, P, R -> P, P, P, R, *, *, *, *""")
        self._assert_no_wrong()

    def test_quantize_mxfp8(self):
        self.assertExpectedInline(self._check("quantize_mxfp8"), """""")
        self._assert_no_wrong()

    def test_dequantize_mxfp8(self):
        self.assertExpectedInline(self._check("dequantize_mxfp8"), """""")
        self._assert_no_wrong()

    def test_quantize_fp8_rowwise(self):
        self.assertExpectedInline(self._check("quantize_fp8_rowwise"), """""")
        self._assert_no_wrong()

    def test_dequantize_fp8_rowwise(self):
        self.assertExpectedInline(self._check("dequantize_fp8_rowwise"), """""")
        self._assert_no_wrong()

    def test_swizzle_mx_scale(self):
        self.assertExpectedInline(self._check("swizzle_mx_scale"), """""")
        self._assert_no_wrong()

    def test_unswizzle_mx_scale(self):
        self.assertExpectedInline(self._check("unswizzle_mx_scale"), """""")
        self._assert_no_wrong()

    def test_scaled_grouped_mm(self):
        self.assertExpectedInline(self._check("scaled_grouped_mm"), """""")
        self._assert_no_wrong()

    def test_quantized_grouped_mm(self):
        self.assertExpectedInline(self._check("quantized_grouped_mm"), """""")
        self._assert_no_wrong()


class TestMoEShardingChoices(TestCase):
    """The strategy DTensor picks for the common MoE layouts (see the module docstring)."""

    def _assert_right_data(self, report: str):
        self.assertNotIn("WRONG", report, report)

    def test_choices_1d_mesh(self):
        report = _choices((2,))
        self.assertExpectedInline(report, """\
grouped_ffn ETP: (R) (R) (R) (R) (S(2)) (S(1)) (S(2)) -> (P) (_S(1, 2))
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_ffn ETP, fused w13: (R) (R) (R) (R) (_S(2, 2)) (S(1)) -> (P) (_S(1, 2))
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_ffn ETP, tokens sharded: (S(0)) (S(0)) (R) (S(0)) (S(2)) (S(1)) (S(2)) -> (P) (_S(1, 2))
    redistributed: arg0 (S(0)) -> (R); arg1 (S(0)) -> (R); arg3 (S(0)) -> (R); collectives: all_gather_into_tensor x3; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, K sharded: (S(1)) (S(1)) (R) -> (P)
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, N sharded: (R) (S(2)) (R) -> (S(1))
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, rows sharded: (S(0)) (S(2)) (R) -> (S(1))
    redistributed: arg0 (S(0)) -> (R); collectives: all_gather_into_tensor x1; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, offs sharded: (R) (S(2)) (S(0)) -> (S(1))
    redistributed: arg2 (S(0)) -> (R); collectives: all_gather_into_tensor x1; full_tensor() matches the unsharded op
quantize_mxfp8 K=64 sharded: (S(1)) -> (S(1)) (S(1))
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op""")
        self._assert_right_data(report)

    def test_choices_2d_mesh(self):
        report = _choices((2, 2))
        self.assertExpectedInline(report, """\
grouped_ffn ETP on mesh dim 1: (R, R) (R, R) (R, R) (R, R) (R, S(2)) (R, S(1)) (R, S(2)) -> (R, P) (R, _S(1, 2))
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_ffn F sharded on both mesh dims: (R, R) (R, R) (R, R) (R, R) (S(2), S(2)) (S(1), S(1)) (S(2), S(2)) -> (P, P) (_S(1, 2), _S(1, 2))
    redistributed: nothing; collectives: none; output 1: full_tensor() != the unsharded op, but the local shards are distribute_tensor(unsharded, same placements)
grouped_ffn tokens on dim 0, ETP on dim 1: (S(0), R) (S(0), R) (R, R) (S(0), R) (R, S(2)) (R, S(1)) (R, S(2)) -> (R, P) (R, _S(1, 2))
    redistributed: arg0 (S(0), R) -> (R, R); arg1 (S(0), R) -> (R, R); arg3 (S(0), R) -> (R, R); collectives: all_gather_into_tensor x3; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, K sharded on dim 1: (R, S(1)) (R, S(1)) (R, R) -> (R, P)
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, N on dim 0, K on dim 1: (R, S(1)) (S(2), S(1)) (R, R) -> (S(1), P)
    redistributed: nothing; collectives: none; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, rows on dim 0, N on dim 1: (S(0), R) (R, S(2)) (R, R) -> (R, S(1))
    redistributed: arg0 (S(0), R) -> (R, R); collectives: all_gather_into_tensor x1; full_tensor() matches the unsharded op
grouped_mm 2Dx3D, offs sharded: (R, R) (R, S(2)) (S(0), R) -> (R, S(1))
    redistributed: arg2 (S(0), R) -> (R, R); collectives: all_gather_into_tensor x1; full_tensor() matches the unsharded op
quantize_mxfp8 K=64 on both mesh dims: (S(1), S(1)) -> (S(1), R) (S(1), R)
    redistributed: arg0 (S(1), S(1)) -> (S(1), R); collectives: all_gather_into_tensor x1; full_tensor() matches the unsharded op""")
        self._assert_right_data(report)


if __name__ == "__main__":
    run_tests()
