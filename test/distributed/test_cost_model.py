# Owner(s): ["module: moe"]
"""The MoE cost model, device profiles, calibration and planner
(``torch_moe/distributed/_tools/``).

Checked: the formulas on hand-computed cases (one GEMM, a grouped GEMM with tile padding and
overheads, the all-to-all alpha-beta model, model states and saved activations, page faults);
properties under hypothesis (more tokens never cost less, dedup never sends more than plain,
node-limited never more than dedup, the planner's pick fits the memory limit and no feasible
strategy is faster); clear errors for bad configurations; a quick calibration run and the JSON
round trip of profiles. No timing benchmark runs here.

Run: ``python test/distributed/test_cost_model.py``.
"""

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from torch.testing._internal.common_utils import IS_CI, TestCase, run_tests

from torch_moe.distributed._tools import calibrate, comm_cost, gemm_cost, memory_cost
from torch_moe.distributed._tools.cost_model import (
    MoELayerSpec,
    MoEStrategy,
    expert_counts,
    moe_layer_cost,
    rank_imbalance,
)
from torch_moe.distributed._tools.device_profiles import (
    H100,
    REFERENCE_CPU,
    DeviceProfile,
    get_profile,
)
from torch_moe.distributed._tools.planner import (
    AttentionSpec,
    ClusterSpec,
    ModelSpec,
    Strategy,
    candidate_strategies,
    deepseek_v3,
    estimate_step,
    format_plan,
    mixtral_8x7b,
    plan,
)

_MiB = 2**20


def cost_settings(max_examples):
    # the suite's hypothesis profile (test/test_properties.py): bounded, derandomised under CI
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=IS_CI,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _toy_profile(**overrides):
    """Round numbers for hand-computed cases: 1 TFLOP/s bf16, 2 fp8, 128-row tiles."""
    fields = dict(
        name="toy",
        peak_flops={"bf16": 1e12, "fp8_rowwise": 2e12, "mxfp8": 2e12},
        memory_bytes=1e10,
        memory_bandwidth_Bps=1e11,
        intra_node_bandwidth_Bps=1e11,
        intra_node_latency_s=1e-5,
        inter_node_bandwidth_Bps=5e10,
        inter_node_latency_s=2e-5,
        gemm_tile_rows=128,
        gemm_efficiency=((128, 0.5), (1024, 1.0)),
        wgrad_efficiency=((128, 0.25), (1024, 1.0)),
        gemm_call_s=1e-5,
        per_group_s=1e-6,
    )
    fields.update(overrides)
    return DeviceProfile(**fields)


@contextlib.contextmanager
def _validated_functions_raise():
    """Makes every function the cost model is validated on raise while the block runs:
    torch_moe's ops (grouped_ffn, grouped_mm, token_sort...) through a dispatch mode that sees
    every op call, and ``moe_ffn``, the ``MoE`` module and ``expert_parallel_moe_ffn`` through
    patches. Yields the set of op namespaces called."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import torch_moe.distributed.dispatch as dispatch
    import torch_moe.nn.functional as functional
    from torch_moe.nn.modules.moe import MoE

    seen = set()

    class Guard(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.namespace)
            if func.namespace == "torch_moe":
                raise AssertionError(f"calibration called {func}")
            return func(*args, **(kwargs or {}))

    def raiser(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"calibration called {name}")
        return fail

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(functional, "moe_ffn", raiser("moe_ffn")))
        stack.enter_context(mock.patch.object(MoE, "forward", raiser("MoE.forward")))
        stack.enter_context(mock.patch.object(
            dispatch, "expert_parallel_moe_ffn", raiser("expert_parallel_moe_ffn")))
        stack.enter_context(Guard())
        yield seen


def _validation_module():
    """benchmarks/cost_model_validation.py, which holds the held-out set."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "cost_model_validation.py"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location("cost_model_validation", path)
        module = importlib.util.module_from_spec(spec)
        # dataclasses resolve the module's annotations through sys.modules
        sys.modules.setdefault(spec.name, module)
        spec.loader.exec_module(sys.modules[spec.name])
    finally:
        sys.path.remove(str(path.parent))
    return sys.modules[spec.name]



class TestFormulas(TestCase):
    def test_gemm_time_tile_padding(self):
        prof = _toy_profile()
        # 100 rows run as one 128-row tile at efficiency 0.5: 2 * 128 * 256 * 512 / 0.5e12
        self.assertAlmostEqual(gemm_cost.gemm_time_s(prof, "bf16", 100, 256, 512),
                               2 * 128 * 256 * 512 / 0.5e12, delta=1e-15)
        # 1024 rows at full efficiency; fp8 doubles the peak
        self.assertAlmostEqual(gemm_cost.gemm_time_s(prof, "fp8_rowwise", 1024, 256, 512),
                               2 * 1024 * 256 * 512 / 2e12, delta=1e-15)
        # the weight-gradient form has its own curve
        self.assertAlmostEqual(gemm_cost.gemm_time_s(prof, "bf16", 128, 256, 512, wgrad=True),
                               2 * 128 * 256 * 512 / 0.25e12, delta=1e-15)

    def test_efficiency_interpolation(self):
        prof = _toy_profile(gemm_tile_rows=1)
        # linear between (128, 0.5) and (1024, 1.0): 576 rows -> 0.75
        self.assertAlmostEqual(prof.gemm_flops("bf16", 576), 0.75e12)
        self.assertAlmostEqual(prof.gemm_flops("bf16", 4), 0.5e12)  # clamped below
        self.assertAlmostEqual(prof.gemm_flops("bf16", 10**6), 1e12)  # and above

    def test_grouped_gemm_time(self):
        prof = _toy_profile()
        counts = [100, 0, 1024]
        expected = (1e-5 + 2 * 1e-6  # one call, two non-empty groups; the empty one is free
                    + 2 * 128 * 256 * 512 / 0.5e12 + 2 * 1024 * 256 * 512 / 1e12)
        for c in (counts, torch.tensor(counts)):
            self.assertAlmostEqual(gemm_cost.grouped_gemm_time_s(prof, "bf16", c, 256, 512),
                                   expected, delta=1e-15)
        self.assertEqual(gemm_cost.grouped_gemm_time_s(prof, "bf16", [0, 0], 256, 512), 0.0)

    def test_skew_costs_more_than_the_mean(self):
        # same total rows: one hot expert and seven tiny ones pay tile padding and low
        # efficiency that eight equal groups do not
        prof = _toy_profile()
        even = gemm_cost.expert_ffn_time(prof, "bf16", [256] * 8, 512, 256).total_s
        skew = gemm_cost.expert_ffn_time(prof, "bf16", [1827] + [5] * 7, 512, 256).total_s
        self.assertGreater(skew, even)

    def test_expert_ffn_backward_is_twice_forward_flops(self):
        prof = _toy_profile(gemm_tile_rows=1, gemm_efficiency=((1, 1.0),),
                            wgrad_efficiency=((1, 1.0),), gemm_call_s=0.0, per_group_s=0.0)
        t = gemm_cost.expert_ffn_time(prof, "bf16", [64, 32], 128, 96)
        fwd = 2 * 96 * (128 * 192 + 96 * 128) / 1e12
        self.assertAlmostEqual(t.forward_s, fwd, delta=1e-15)
        self.assertAlmostEqual(t.dgrad_s + t.wgrad_s, 2 * fwd, delta=1e-15)
        self.assertEqual(t.recompute_s, 0.0)

    def test_quantize_and_scales(self):
        prof = _toy_profile()
        self.assertEqual(gemm_cost.scale_bytes("fp8_rowwise", 10, 1024), 40.0)
        # MXFP8: 32 blocks per row, padded to 128 rows x 4 columns of scales
        self.assertEqual(gemm_cost.scale_bytes("mxfp8", 1, 1024), 128 * 32)
        self.assertEqual(gemm_cost.scale_bytes("bf16", 10, 1024), 0.0)
        # read bf16 (2 B) + write fp8 (1 B) + fp32 row scales, over 1e11 B/s
        self.assertAlmostEqual(gemm_cost.quantize_time_s(prof, "fp8_rowwise", 10, 1024),
                               (10 * 1024 * 3 + 40) / 1e11)
        self.assertEqual(gemm_cost.quantize_time_s(prof, "bf16", 10, 1024), 0.0)

    def test_page_faults(self):
        sizes = [64 * _MiB, 16 * _MiB]  # only the first is above the 32 MiB threshold
        self.assertAlmostEqual(gemm_cost.fresh_alloc_time_s(REFERENCE_CPU, sizes),
                               64 * _MiB * REFERENCE_CPU.page_fault_s_per_byte)
        self.assertEqual(gemm_cost.fresh_alloc_time_s(H100, sizes), 0.0)

    def test_ffn_elementwise_bytes(self):
        # 10 rows from 4 tokens, D=8, F=2 gated (H=4), fp32:
        # forward per row 2*8 + 4 + 2 + 2*8 + 8 = 46 elements, backward
        # 2*8 + 4 + 2 + 2*2 + 4*2 + 2 + 2*4 + 2*8 + 8 = 68; plus the fp32 [4, 8] accumulator
        # zero-filled and summed into, 3 passes of 128 B
        fwd, bwd = gemm_cost.ffn_elementwise_bytes(10, 4, 8, 2, True, 4)
        self.assertEqual((fwd, bwd), (10 * 4 * 46 + 384, 10 * 4 * 68 + 384))
        # bf16: 2 B elements, and the accumulator converted to bf16 (read 4, write 2 B)
        fwd, bwd = gemm_cost.ffn_elementwise_bytes(10, 4, 8, 2, True, 2)
        self.assertEqual((fwd, bwd), (10 * 2 * 46 + 384 + 32 * 6, 10 * 2 * 68 + 384 + 32 * 6))
        # the layer charges them at the profile's elementwise rate
        prof = _toy_profile(elementwise_bandwidth_Bps=1e9, layer_overhead_s=3e-3)
        layer = MoELayerSpec(dim=8, hidden_dim=2, num_experts=2, top_k=1)
        cost = moe_layer_cost(layer, MoEStrategy(ep=1, precision="fp32"),
                              dataclasses.replace(prof, peak_flops={"fp32": 1e12}), 10)
        router = 10 * 2 * 8 * 3 / 1e11  # softmax / top-k bytes, forward and twice in backward
        expected = sum(gemm_cost.ffn_elementwise_bytes(10, 10, 8, 2, True, 4)) / 1e9 + router
        self.assertAlmostEqual(cost.elementwise_s, expected)
        # the fixed host cost of a layer call, once per chunk
        self.assertAlmostEqual(cost.host_s, 3e-3)
        two = moe_layer_cost(layer, MoEStrategy(ep=1, precision="fp32", num_chunks=2),
                             dataclasses.replace(prof, peak_flops={"fp32": 1e12}), 10)
        self.assertAlmostEqual(two.host_s, 6e-3)

    def test_hidden_width_elementwise_rate(self):
        # the split: width D (gathers, scale, scatter-add, the [T, D] accumulator) and hidden
        # width (activation, routing-weight gradient and scalings) sum to the totals
        (fd, fh), (bd, bh) = gemm_cost.ffn_elementwise_split_bytes(10, 4, 8, 2, True, 4)
        self.assertEqual((fh, bh), (10 * 4 * (4 + 2), 10 * 4 * (4 + 2 + 2 * 2 + 4 * 2 + 2 + 2 * 4)))
        self.assertEqual((fd + fh, bd + bh), gemm_cost.ffn_elementwise_bytes(10, 4, 8, 2, True, 4))
        # a layer charges the hidden-width bytes at elementwise_hidden_Bps, the rest at
        # elementwise_bandwidth_Bps
        layer = MoELayerSpec(dim=8, hidden_dim=2, num_experts=2, top_k=1)
        prof = _toy_profile(elementwise_bandwidth_Bps=1e9, elementwise_hidden_Bps=2.5e8,
                            peak_flops={"fp32": 1e12})
        cost = moe_layer_cost(layer, MoEStrategy(ep=1, precision="fp32"), prof, 10)
        (fd, fh), (bd, bh) = gemm_cost.ffn_elementwise_split_bytes(10, 10, 8, 2, True, 4)
        router = 10 * 2 * 8 * 3 / 1e11
        self.assertAlmostEqual(cost.elementwise_s, (fd + bd) / 1e9 + (fh + bh) / 2.5e8 + router)
        with self.assertRaisesRegex(ValueError, "elementwise_hidden_Bps to be finite and > 0"):
            _toy_profile(elementwise_hidden_Bps=0.0)

    def test_gemm_set_up_per_distinct_shape(self):
        # 1 ms to set up a bf16 GEMM shape at any rows (clamped curve), none for fp32
        create = {"bf16": ((1, 1e-3), (100, 1e-3))}
        peaks = {"bf16": 1e12, "fp32": 5e11}
        prof = _toy_profile(gemm_tile_rows=1, gemm_create_s=create, peak_flops=peaks)
        plain = _toy_profile(gemm_tile_rows=1, peak_flops=peaks)
        # four groups, three distinct sizes (5 twice; 5.2 rounds to 5), and an empty group
        counts = [5, 5.2, 7, 0, 9]
        t = gemm_cost.expert_ffn_time(prof, "bf16", counts, 64, 32)
        t0 = gemm_cost.expert_ffn_time(plain, "bf16", counts, 64, 32)
        # gated: 2 forms forward (gate and up share one), dA, dX and its addmm_ half, and the
        # two weight-gradient forms backward: 7 per distinct size
        self.assertAlmostEqual(t.forward_s - t0.forward_s, 3 * 2 * 1e-3)
        self.assertAlmostEqual(t.dgrad_s - t0.dgrad_s, 3 * 3 * 1e-3)
        self.assertAlmostEqual(t.wgrad_s - t0.wgrad_s, 3 * 2 * 1e-3)
        t_plain = gemm_cost.expert_ffn_time(prof, "bf16", counts, 64, 32, gated=False)
        t0_plain = gemm_cost.expert_ffn_time(plain, "bf16", counts, 64, 32, gated=False)
        self.assertAlmostEqual(t_plain.total_s - t0_plain.total_s, 3 * 6 * 1e-3)
        # fp32 has no curve: nothing to set up
        self.assertEqual(gemm_cost.expert_ffn_time(prof, "fp32", counts, 64, 32),
                         gemm_cost.expert_ffn_time(plain, "fp32", counts, 64, 32))
        self.assertEqual(prof.gemm_create_time_s("fp32", 5), 0.0)
        self.assertEqual(DeviceProfile.from_json(prof.to_json()), prof)
        with self.assertRaisesRegex(ValueError, "gemm_create_s for precisions of peak_flops"):
            _toy_profile(gemm_create_s={"fp32": ((1, 1e-3),)})
        with self.assertRaisesRegex(ValueError, "seconds of gemm_create_s.*finite and >= 0"):
            _toy_profile(gemm_create_s={"bf16": ((1, -1e-3),)})
        with self.assertRaisesRegex(ValueError, "strictly increasing rows"):
            _toy_profile(gemm_create_s={"bf16": ((4, 1e-3), (2, 1e-3))})

    def test_all_to_all_alpha_beta(self):
        prof = _toy_profile()
        # both links at once; the slower (network: 2e-5 + 1e9 / 5e10) sets the time
        self.assertAlmostEqual(comm_cost.all_to_all_time_s(prof, 1e8, 1e9), 2e-5 + 0.02)
        self.assertAlmostEqual(comm_cost.all_to_all_time_s(prof, 1e8, 0.0), 1e-5 + 1e-3)
        self.assertAlmostEqual(comm_cost.all_to_all_time_s(prof, 1e8, 0.0, calls=3),
                               3e-5 + 1e-3)

    def test_ring_collective(self):
        prof = _toy_profile()
        self.assertAlmostEqual(comm_cost.ring_collective_time_s(prof, 8e9, 8, False),
                               7 * (1e-5 + 1e9 / 1e11))
        self.assertEqual(comm_cost.ring_collective_time_s(prof, 8e9, 1, True), 0.0)

    def test_dispatch_traffic(self):
        # 16 ranks on 2 nodes of 8: half the copies of plain dispatch leave the node
        t = comm_cost.dispatch_traffic(16, 4, 16, 1, 8, "plain")
        self.assertEqual((t.copies, t.intra_copies, t.inter_copies), (4.0, 2.0, 2.0))
        d = comm_cost.dispatch_traffic(16, 4, 16, 1, 8, "dedup")
        self.assertEqual(d.copies, 4.0)  # one expert per rank: dedup changes nothing
        # E=256, k=8, 64 ranks on 8 nodes, node-limited to 4: at most 4 network copies,
        # 7/8 of them remote
        n = comm_cost.dispatch_traffic(256, 8, 64, 1, 8, "node_limited", max_nodes=4)
        self.assertAlmostEqual(n.inter_copies, 4 * 7 / 8)
        self.assertEqual(comm_cost.ep_nodes(64, 1, 8), 8)
        self.assertEqual(comm_cost.ep_nodes(2, 2, 8), 1)
        # a skewed load: dedup follows the rank shares (equal shares: the uniform count; all
        # on one rank: one copy per token); plain sends k copies whatever the load
        uniform = comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "dedup").copies
        self.assertAlmostEqual(comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "dedup",
                                                          rank_shares=[5, 5]).copies, uniform)
        self.assertEqual(comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "dedup",
                                                    rank_shares=[1, 0]).copies, 1.0)
        # 3:1 shares: hit probabilities 1 - 0.25^4 and 1 - 0.75^4, mapped linearly from
        # (1 rank: 1 copy) to (equal shares, 2 - 2 * 0.5^4: the uniform count)
        skew = comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "dedup", rank_shares=[3, 1]).copies
        h, h_uniform = 2 - 0.25 ** 4 - 0.75 ** 4, 2 - 2 * 0.5 ** 4
        self.assertAlmostEqual(skew, 1 + (uniform - 1) * (h - 1) / (h_uniform - 1))
        self.assertEqual(comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "plain",
                                                    rank_shares=[3, 1]).copies, 4.0)
        with self.assertRaisesRegex(ValueError, "rank_shares to be 2 non-negative"):
            comm_cost.dispatch_traffic(16, 4, 2, 1, 2, "dedup", rank_shares=[1, 1, 1])

    def test_layer_a2a_hand_computed(self):
        prof = _toy_profile()
        layer = MoELayerSpec(dim=1024, hidden_dim=512, num_experts=16, top_k=2)
        cost = moe_layer_cost(layer, MoEStrategy(ep=16, dispatch="plain", dispatcher="fused"),
                              prof, tokens_per_rank=1000, gpus_per_node=8)
        # 1000 tokens x 2 copies, half of them over the (slower) network: 1000 rows per call.
        # Rows: dispatch 2048 B of bf16 + 8 B (id, weight); combine and combine-backward 2048 B;
        # dispatch-backward 2048 B + 4 B of weight gradient.
        def call(row_bytes):
            return 2e-5 + 1000 * row_bytes / 5e10

        expected = call(2056) + call(2048) + call(2048) + call(2052)
        self.assertAlmostEqual(cost.a2a_s, expected)  # dispatch + combine, fwd and bwd
        self.assertAlmostEqual(cost.exposed_a2a_s, cost.a2a_s)  # one chunk hides nothing
        self.assertEqual(cost.imbalance, 1.0)
        self.assertEqual(cost.rows, 2000.0)
        self.assertAlmostEqual(cost.dispatch_bytes, 1000 * 2 * 2056)
        # torch_moe's dispatcher pays 8 latencies instead of 4: counts, rows, ids and weights
        # out; rows back; two gradients back in backward
        ours = moe_layer_cost(layer, MoEStrategy(ep=16, dispatch="plain"), prof,
                              tokens_per_rank=1000, gpus_per_node=8)
        self.assertAlmostEqual(ours.a2a_s - cost.a2a_s, 4 * 2e-5)
        # no expert parallelism, no communication
        alone = moe_layer_cost(layer, MoEStrategy(ep=1), prof, tokens_per_rank=1000)
        self.assertEqual(alone.a2a_s, 0.0)
        # host work per dispatched row: 1000 tokens x 2 copies x 1 us, none without EP
        busy = dataclasses.replace(prof, dispatch_row_s=1e-6)
        self.assertAlmostEqual(
            moe_layer_cost(layer, MoEStrategy(ep=16, dispatch="plain"), busy, 1000).host_s
            - ours.host_s, 2e-3)
        self.assertEqual(moe_layer_cost(layer, MoEStrategy(ep=1), busy, 1000).host_s,
                         alone.host_s)

    def test_chunks_hide_communication(self):
        # flat efficiency and no latency: chunking keeps compute and hides communication
        prof = _toy_profile(gemm_tile_rows=1, gemm_efficiency=((1, 1.0),),
                            wgrad_efficiency=((1, 1.0),), gemm_call_s=0.0, per_group_s=0.0,
                            intra_node_latency_s=0.0, inter_node_latency_s=0.0)
        layer = MoELayerSpec(dim=1024, hidden_dim=512, num_experts=16, top_k=2)
        one, four = (moe_layer_cost(layer, MoEStrategy(ep=16, num_chunks=c), prof, 4096, 8)
                     for c in (1, 4))
        self.assertAlmostEqual(one.compute_s, four.compute_s)
        self.assertAlmostEqual(one.a2a_s, four.a2a_s)
        self.assertLess(four.exposed_a2a_s, one.exposed_a2a_s)
        c = 4
        d, p = four.a2a_s / c / 4, four.compute_s / c
        # forward: comm d + d vs compute p / 3; backward: 2d vs 2p / 3 (two thirds of FLOPs)
        pf, pb = p / 3, 2 * p / 3
        expected = sum(2 * d + q + (c - 1) * max(2 * d, q) for q in (pf, pb))
        self.assertAlmostEqual(four.total_s, expected, delta=1e-12 * expected + 1e-4 * pf)
        # a measured overlap: the share eta of the shorter stage runs hidden, the rest adds;
        # eta = 0 is no pipeline at all
        for eta in (0.0, 0.25):
            part = moe_layer_cost(layer, MoEStrategy(ep=16, num_chunks=c),
                                  dataclasses.replace(prof, overlap_efficiency=eta), 4096, 8)
            expected = sum(2 * d + q + (c - 1) * (max(2 * d, q) + (1 - eta) * min(2 * d, q))
                           for q in (pf, pb))
            self.assertAlmostEqual(part.total_s, expected, delta=1e-12 * expected + 1e-4 * pf)
        serial = moe_layer_cost(layer, MoEStrategy(ep=16, num_chunks=c),
                                dataclasses.replace(prof, overlap_efficiency=0.0), 4096, 8)
        self.assertAlmostEqual(serial.total_s, serial.compute_s + serial.a2a_s,
                               delta=1e-4 * pf)

    def test_planner_chunks_only_from_a_measured_overlap(self):
        model = _tiny_model(128 * 4 * 4)
        unmeasured = ClusterSpec(_toy_profile(), 4, 1)
        self.assertEqual({s.num_chunks for s in candidate_strategies(model, unmeasured)}, {1})
        measured = ClusterSpec(_toy_profile(overlap_efficiency=0.5), 4, 1)
        self.assertEqual({s.num_chunks for s in candidate_strategies(model, measured)},
                         {1, 2, 4})
        # asked for explicitly, chunks are priced either way
        self.assertEqual({s.num_chunks for s in candidate_strategies(model, unmeasured,
                                                                     chunks=(1, 2))}, {1, 2})

    def test_model_states(self):
        mixed = memory_cost.ADAMW_MIXED  # 2 + 4 + 4 + 8 bytes per parameter
        self.assertEqual(memory_cost.model_state_bytes(1e9, 8, "fsdp", mixed), 18e9 / 8)
        # ZeRO-1: compute copy and grads replicated, master + Adam moments sharded
        self.assertEqual(memory_cost.model_state_bytes(1e9, 8, "zero1", mixed), 7.5e9)
        self.assertEqual(memory_cost.model_state_bytes(
            1e9, 1, "fsdp", memory_cost.ADAMW_BF16_MOMENTS), 14e9)

    def test_activations(self):
        act = memory_cost.moe_activation_bytes
        # T=10, S=20, D=8, F=4, k=2: input 160, routing 240 + sorted slots 160, rows 320,
        # hidden 320
        self.assertEqual(act(10, 20, 8, 4, 2, "bf16", "none"), 1200)
        self.assertEqual(act(10, 20, 8, 4, 2, "bf16", "moe"), 880)
        self.assertEqual(act(10, 20, 8, 4, 2, "bf16", "full"), 160)
        # FP8 rows (1 B) and their fp32 row scales (20 x 4 B)
        self.assertEqual(act(10, 20, 8, 4, 2, "fp8_rowwise", "none"),
                         160 + 400 + 240 + 320)
        # the router's logits, scores and top-k order (E=3: 10 x 3 x 16 B) and, the layer
        # being bf16, the fp32 copies of its input and weight it computes from ((10 + 3) x 8
        # x 4 B); without expert parallelism no received copy; an fp32 layer doubles the
        # activations and needs no copy for its router
        self.assertEqual(act(10, 20, 8, 4, 2, "bf16", "none", num_experts=3), 1200 + 480 + 416)
        self.assertEqual(act(10, 20, 8, 4, 2, "fp32", "none", num_experts=3, act_bytes=4)
                         - act(10, 20, 8, 4, 2, "fp32", "none", act_bytes=4), 480)
        self.assertEqual(act(10, 20, 8, 4, 2, "bf16", "none", dispatched=False), 1200 - 320)
        self.assertEqual(act(10, 20, 8, 4, 2, "fp32", "none", dispatched=False, act_bytes=4),
                         320 + 400 + 640)

    def test_counts_and_skew(self):
        self.assertEqual(expert_counts(4, 8.0), [2.0] * 4)
        self.assertEqual(expert_counts(4, 8.0, [1, 1, 2, 0]), [2.0, 2.0, 4.0, 0.0])
        zipf = expert_counts(16, 1600.0, 1.2)
        self.assertAlmostEqual(sum(zipf), 1600.0)
        self.assertEqual(zipf, expert_counts(16, 1600.0, 1.2))  # deterministic
        self.assertGreater(max(zipf), 4 * min(zipf))
        self.assertEqual(rank_imbalance([1, 1, 2, 0], 2), 1.0)
        self.assertEqual(rank_imbalance([4, 0, 0, 0], 2), 2.0)
        layer = MoELayerSpec(64, 32, 4, 2)
        # explicit counts imply the tokens: 16 assignments over 2 ranks x k=2 = 4 tokens each
        c = moe_layer_cost(layer, MoEStrategy(ep=2), _toy_profile(), load=[8, 0, 4, 4])
        self.assertEqual(c.rows, 8.0)
        self.assertEqual(c.imbalance, 1.0)

    def test_profiles(self):
        self.assertEqual(get_profile("h100").peak_flops["bf16"], 989.4e12)
        self.assertEqual(get_profile("H200").memory_bytes, 141e9)
        self.assertEqual(get_profile("b200").peak_flops["mxfp8"], 4500e12)
        self.assertEqual(get_profile("MI300X").memory_bandwidth_Bps, 5.3e12)
        for name in ("h100", "h200", "b200", "mi300x", "cpu"):
            p = get_profile(name)
            self.assertTrue(p.sources)
            self.assertEqual(DeviceProfile.from_json(p.to_json()), p)

    def test_moe_config(self):
        from torch_moe.nn.modules.moe import MoEConfig

        spec = MoELayerSpec.from_config(MoEConfig(dim=64, hidden_dim=32, num_experts=8, top_k=2,
                                                  num_shared_experts=1))
        self.assertEqual(spec.params, 8 * 3 * 64 * 32 + 8 * 64 + 3 * 64 * 32)


class TestErrors(TestCase):
    def test_bad_layers(self):
        with self.assertRaisesRegex(ValueError, "top_k <= num_experts.*top_k=9 > num_experts=8"):
            MoELayerSpec(64, 32, 8, 9)
        with self.assertRaisesRegex(ValueError, "dim to be a positive int"):
            MoELayerSpec(0, 32, 8, 2)
        layer = MoELayerSpec(64, 32, 8, 2)
        with self.assertRaisesRegex(ValueError, "num_experts=8 is not divisible by ep=3"):
            moe_layer_cost(layer, MoEStrategy(ep=3), H100, 16, 8)
        with self.assertRaisesRegex(ValueError, "tokens_per_rank to be a finite number >= 0"):
            moe_layer_cost(layer, MoEStrategy(ep=2), H100, -1, 8)
        with self.assertRaisesRegex(ValueError, "needs a layer with max_nodes"):
            moe_layer_cost(layer, MoEStrategy(ep=8, dispatch="node_limited"), H100, 16, 8)
        with self.assertRaisesRegex(ValueError, "load of 8 experts, but got 3"):
            moe_layer_cost(layer, MoEStrategy(ep=2), H100, 16, 8, load=[1, 2, 3])
        with self.assertRaisesRegex(ValueError, "finite and non-negative"):
            moe_layer_cost(layer, MoEStrategy(ep=2), H100, 16, 8, load=[-1] * 8)
        with self.assertRaisesRegex(ValueError, "unknown load 'zipf'"):
            expert_counts(8, 16, "zipf")

    def test_bad_strategies(self):
        with self.assertRaisesRegex(ValueError, "unknown precision 'fp4'"):
            MoEStrategy(precision="fp4")
        with self.assertRaisesRegex(ValueError, "unknown dispatch 'broadcast'"):
            MoEStrategy(dispatch="broadcast")
        with self.assertRaisesRegex(ValueError, "unknown recompute"):
            MoEStrategy(recompute="some")
        with self.assertRaisesRegex(ValueError, "H100-SXM has no mxfp8 GEMMs"):
            moe_layer_cost(MoELayerSpec(64, 32, 8, 2), MoEStrategy(precision="mxfp8"), H100,
                           16, 8)
        with self.assertRaisesRegex(ValueError, "ep \\* etp = 3 must divide gpus_per_node=8"):
            comm_cost.ep_nodes(3, 1, 8)
        with self.assertRaisesRegex(ValueError, "unknown sharding"):
            Strategy(sharding="zero2")

    def test_bad_profiles(self):
        with self.assertRaisesRegex(ValueError, "unknown device profile 'h300'"):
            get_profile("h300")
        with self.assertRaisesRegex(ValueError, "grow no faster than the rows"):
            _toy_profile(gemm_efficiency=((16, 0.1), (32, 0.5)))
        with self.assertRaisesRegex(ValueError, "fractions of gemm_efficiency to lie in"):
            _toy_profile(gemm_efficiency=((16, 1.5),))
        with self.assertRaisesRegex(ValueError, "precisions in"):
            _toy_profile(peak_flops={"int4": 1e12})
        with self.assertRaisesRegex(ValueError, "unknown fields"):
            DeviceProfile.from_json('{"name": "x", "warp_size": 32}')
        with self.assertRaisesRegex(ValueError, "overlap_efficiency in \\[0, 1\\]"):
            _toy_profile(overlap_efficiency=1.5)
        with self.assertRaisesRegex(ValueError, "precision_curves for precisions"):
            _toy_profile(precision_curves={"fp32": (((1, 0.5),), ((1, 0.5),))})
        with self.assertRaisesRegex(ValueError, "grow no faster"):
            _toy_profile(precision_curves={"bf16": (((16, 0.1), (32, 0.5)), ((1, 0.5),))})
        # a precision's own curves replace the shared ones (without precision_efficiency)
        own = _toy_profile(precision_curves={"fp8_rowwise": (((1, 0.25),), ((1, 0.125),))},
                           precision_efficiency={"fp8_rowwise": 0.5})
        self.assertAlmostEqual(own.gemm_flops("fp8_rowwise", 512), 0.5e12)
        self.assertAlmostEqual(own.gemm_flops("fp8_rowwise", 512, wgrad=True), 0.25e12)
        self.assertEqual(DeviceProfile.from_json(own.to_json()), own)

    def test_bad_planner_inputs(self):
        model = _tiny_model()
        cluster = ClusterSpec(_toy_profile(), 4, 2)
        with self.assertRaisesRegex(ValueError, "ep \\* etp = 3 does not divide the 8 ranks"):
            estimate_step(model, cluster, Strategy(ep=3))
        with self.assertRaisesRegex(ValueError, "not a multiple of micro_batch_seqs=3"):
            estimate_step(model, cluster, Strategy(ep=2, micro_batch_seqs=3))
        with self.assertRaisesRegex(ValueError, "memory_fraction in \\(0, 1\\]"):
            ClusterSpec(_toy_profile(), 4, 2, memory_fraction=1.5)
        with self.assertRaisesRegex(ValueError, "not a multiple of seq_len=128"):
            dataclasses.replace(model, tokens_per_batch=1000)
        with self.assertRaisesRegex(ValueError, "one precision per MoE layer"):
            estimate_step(model, cluster, Strategy(ep=2, precision=("bf16", "fp8_rowwise")))


def _tiny_model(tokens_per_batch=128 * 8 * 4):
    moe = MoELayerSpec(64, 128, 8, 2, num_shared_experts=1)
    return ModelSpec("tiny", moe, 4, AttentionSpec.gqa(64, 4, 2, 16), 512, 128,
                     tokens_per_batch, num_dense_layers=1, dense_hidden_dim=256)


_EXPERTS = st.sampled_from([4, 8, 16, 32, 64])


class TestProperties(TestCase):
    @cost_settings(40)
    @given(E=_EXPERTS, data=st.data())
    def test_more_tokens_never_cost_less(self, E, data):
        k = data.draw(st.integers(1, min(E, 8)))
        ep = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64) if E % d == 0]))
        gpn = data.draw(st.sampled_from([4, 8]))
        assume(ep <= gpn or ep % gpn == 0)
        strategy = MoEStrategy(
            ep=ep, dispatch=data.draw(st.sampled_from(["plain", "dedup"])),
            precision=data.draw(st.sampled_from(["bf16", "fp8_rowwise"])),
            num_chunks=data.draw(st.sampled_from([1, 2, 4])),
            recompute=data.draw(st.sampled_from(["none", "moe", "full"])))
        layer = MoELayerSpec(data.draw(st.sampled_from([64, 512])),
                             data.draw(st.sampled_from([32, 256])), E, k,
                             num_shared_experts=data.draw(st.integers(0, 1)))
        load = data.draw(st.sampled_from(["uniform", 0.8, 1.5]))
        profile = data.draw(st.sampled_from([H100, REFERENCE_CPU, _toy_profile()]))
        if strategy.precision not in profile.peak_flops:
            strategy = dataclasses.replace(strategy, precision="bf16")
        t1 = data.draw(st.integers(0, 5000))
        t2 = t1 + data.draw(st.integers(0, 5000))
        a, b = (moe_layer_cost(layer, strategy, profile, t, gpn, load) for t in (t1, t2))
        tol = 1e-12
        self.assertGreaterEqual(b.total_s, a.total_s * (1 - tol))
        self.assertGreaterEqual(b.compute_s, a.compute_s * (1 - tol))
        self.assertGreaterEqual(b.a2a_s, a.a2a_s * (1 - tol))
        self.assertGreaterEqual(b.activation_bytes, a.activation_bytes)

    @cost_settings(60)
    @given(E=_EXPERTS, data=st.data())
    def test_dedup_and_node_limits_never_send_more(self, E, data):
        k = data.draw(st.integers(1, E))
        gpn = data.draw(st.sampled_from([2, 4, 8]))
        ep = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64) if E % d == 0]))
        assume(ep <= gpn and gpn % ep == 0 or ep % gpn == 0)
        nodes = comm_cost.ep_nodes(ep, 1, gpn)
        m = data.draw(st.integers(1, 8))
        assume(k <= min(m, nodes) * E // nodes)  # m nodes must hold k experts
        plain, dedup, limited = (comm_cost.dispatch_traffic(E, k, ep, 1, gpn, meth, m)
                                 for meth in ("plain", "dedup", "node_limited"))
        eps = 1e-12
        self.assertLessEqual(dedup.copies, plain.copies + eps)
        self.assertLessEqual(dedup.inter_copies, plain.inter_copies + eps)
        self.assertLessEqual(limited.copies, dedup.copies + eps)
        self.assertLessEqual(limited.inter_copies, dedup.inter_copies + eps)
        layer = MoELayerSpec(64, 32, E, k, max_nodes=m)
        T = data.draw(st.integers(0, 4096))
        cost = {d: moe_layer_cost(layer, MoEStrategy(ep=ep, dispatch=d), H100, T, gpn)
                for d in ("plain", "dedup", "node_limited")}
        self.assertLessEqual(cost["dedup"].dispatch_rows, cost["plain"].dispatch_rows + eps)
        self.assertLessEqual(cost["node_limited"].dispatch_bytes,
                             cost["dedup"].dispatch_bytes + eps)
        # bytes: a dedup row carries W = min(k, E / ep) (id, weight) pairs of 8 B, a plain row
        # one, so dedup sends no more bytes than plain rows of that width would
        W = min(k, E // ep)
        self.assertLessEqual(cost["dedup"].dispatch_bytes,
                             cost["plain"].dispatch_bytes * (64 * 2 + 8 * W) / (64 * 2 + 8) + eps)

    @cost_settings(4)
    @given(fraction=st.floats(0.002, 0.05), nodes=st.sampled_from([1, 2]))
    def test_planner_pick_fits_and_is_fastest(self, fraction, nodes):
        model = _tiny_model(128 * 4 * nodes * 4)
        cluster = ClusterSpec(dataclasses.replace(_toy_profile(), memory_bytes=1e9), 4, nodes,
                              memory_fraction=fraction)
        strategies = candidate_strategies(model, cluster, chunks=(1, 2), micro_batch_seqs=(2,))
        result = plan(model, cluster, strategies=strategies)
        all_costs = [estimate_step(model, cluster, s) for s in strategies]
        feasible = [c for c in all_costs if c.memory_bytes <= cluster.memory_limit_bytes]
        self.assertEqual(len(result.ranked), len(feasible))
        if not feasible:
            self.assertIsNone(result.best)
            self.assertIn("no strategy fits", format_plan(result))
            return
        best = result.best
        self.assertLessEqual(best.memory_bytes, cluster.memory_limit_bytes)
        fastest = min(c.step_s for c in feasible)
        self.assertLessEqual(best.step_s, fastest * (1 + 1e-6))
        text = format_plan(result, top=3)
        self.assertIn(best.strategy.label(), text)
        self.assertIn("winner:", text)


class TestPlannerAndCalibration(TestCase):
    def test_presets(self):
        ds = deepseek_v3()
        self.assertAlmostEqual(ds.params / 1e9, 671, delta=3)  # 671B total (arXiv 2412.19437)
        self.assertEqual(ds.num_moe_layers, 58)
        mx = mixtral_8x7b()
        self.assertAlmostEqual(mx.params / 1e9, 46.7, delta=0.3)  # 46.7B (arXiv 2401.04088)

    def test_deepseek_strategy_estimate(self):
        # the published layout's MoE part: EP64, node-limited, FP8 (one estimate, no search)
        cluster = ClusterSpec(get_profile("h100"), 8, 32)
        cost = estimate_step(deepseek_v3(), cluster,
                             Strategy(ep=64, dispatch="node_limited", precision="fp8_rowwise",
                                      num_chunks=2, recompute="full", micro_batch_seqs=2),
                             memory_cost.ADAMW_BF16_MOMENTS)
        self.assertGreater(cost.step_s, cost.compute_s)
        self.assertEqual(cost.micro_batches, 15360 // 256 // 2)

    def test_calibrate_quick_and_json(self):
        # calibration runs microbenchmarks only: every function the cost model is validated on
        # raises while it runs (torch_moe's ops through a dispatch mode that sees every op
        # call, the Python entry points through patches)
        with _validated_functions_raise() as seen:
            prof = calibrate.calibrate_local(quick=True)
        self.assertIn("torch_moe_calibration", seen)  # the mode does see custom ops
        self.assertNotIn("torch_moe", seen)
        self.assertEqual(prof.gemm_tile_rows, 1)
        self.assertGreater(prof.peak_flops["bf16"], 0)
        self.assertEqual(set(prof.precision_curves), {"bf16", "fp32"})
        self.assertGreater(prof.memory_bandwidth_Bps, 0)
        self.assertGreater(prof.per_group_s, 0)
        self.assertGreater(prof.layer_overhead_s, 0)
        self.assertGreaterEqual(prof.page_fault_s_per_byte, 0)
        self.assertEqual(set(prof.gemm_create_s), {"bf16", "fp32"})
        self.assertGreater(prof.elementwise_bandwidth_Bps, 0)
        self.assertGreater(prof.elementwise_hidden_Bps, 0)
        self.assertIsNone(prof.overlap_efficiency)  # no process group: not measured
        self.assertEqual(prof.dispatch_row_s, 0.0)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "cpu.json")
            calibrate.save_profile(prof, path)
            self.assertEqual(calibrate.load_profile(path), prof)
        # the calibrated profile prices a layer
        cost = moe_layer_cost(MoELayerSpec(128, 64, 8, 2), MoEStrategy(), prof, 256)
        self.assertTrue(math.isfinite(cost.total_s) and cost.total_s > 0)

    def test_calibrate_collectives_single_rank(self):
        # the process-group benchmarks on a one-rank gloo group, under the same guard
        import torch.distributed as dist

        with tempfile.TemporaryDirectory() as d:
            store = dist.FileStore(os.path.join(d, "store"), 1)
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
            try:
                with _validated_functions_raise() as seen:
                    alpha, bw = calibrate.measure_all_to_all(dist.group.WORLD, 1024, 1 << 16,
                                                             reps=1)
                    eta = calibrate.measure_overlap_efficiency(dist.group.WORLD, 1 << 16,
                                                               reps=1, dims=(160, 80))
            finally:
                dist.destroy_process_group()
        self.assertNotIn("torch_moe", seen)
        self.assertGreaterEqual(alpha, 0.0)
        self.assertGreater(bw, 0.0)
        self.assertTrue(0.0 <= eta <= 1.0)

    def test_calibration_shapes_are_disjoint_from_the_held_out_set(self):
        # "disjoint" (calibrate.check_disjoint): no held-out layer GEMM has the (K, N) of a
        # calibrated GEMM, and no held-out D or F is a calibration width
        validation = _validation_module()
        shapes = validation.held_out_shapes()
        self.assertGreaterEqual(len(validation.HELD_OUT_LAYERS), 30)
        self.assertEqual({c.R for c in validation.HELD_OUT_DISPATCH}, {2, 4})
        self.assertTrue(any(c.num_chunks > 1 for c in validation.HELD_OUT_DISPATCH))
        calibrate.check_disjoint(shapes)
        widths = {w for D, F, _ in shapes for w in (D, F)}
        self.assertFalse(widths & calibrate.CALIBRATION_DIMS)
        for D, F, E in shapes:
            gemms = {(D, F), (F, D), (D, E)}
            self.assertFalse(gemms & calibrate.CALIBRATION_GEMM_SHAPES, (D, F, E))
        # the calibration itself only uses its own widths
        self.assertEqual(set(calibrate._FULL_DIMS + calibrate._QUICK_DIMS),
                         set(calibrate.CALIBRATION_DIMS))
        # a held-out layer at a calibration width, or with the router shape of the layer
        # stand-in, is refused
        with self.assertRaisesRegex(ValueError, "disjoint"):
            calibrate.check_disjoint([(640, 256, 8)])
        with self.assertRaisesRegex(ValueError, "disjoint"):
            calibrate.check_disjoint([(512, 320, 8)])
        with self.assertRaisesRegex(ValueError, r"\(8, 2\)"):
            calibrate.check_disjoint([(8, 16, 2)])

    def test_average_profiles(self):
        a = _toy_profile(per_group_s=1e-6)
        b = _toy_profile(peak_flops={"bf16": 3e12, "fp8_rowwise": 2e12, "mxfp8": 2e12},
                         per_group_s=3e-6, gemm_efficiency=((128, 0.25), (1024, 1.0)))
        m = calibrate.average_profiles([a, b], "mean")
        self.assertEqual(m.name, "mean")
        self.assertAlmostEqual(m.per_group_s, 2e-6)
        self.assertAlmostEqual(m.peak_flops["bf16"], 2e12)
        # achieved rates are averaged: 128 rows ran at 0.5 TFLOP/s and 0.75 TFLOP/s
        self.assertAlmostEqual(m.gemm_flops("bf16", 128), 0.625e12)
        self.assertAlmostEqual(m.gemm_flops("bf16", 1024), 2e12)
        with self.assertRaisesRegex(ValueError, "same rows"):
            calibrate.average_profiles([a, _toy_profile(gemm_efficiency=((64, 0.5),))])
        # GEMM set-up seconds are averaged point by point
        c1 = _toy_profile(gemm_create_s={"bf16": ((3, 1e-3), (48, 2e-3))})
        c2 = _toy_profile(gemm_create_s={"bf16": ((3, 3e-3), (48, 4e-3))})
        self.assertEqual(calibrate.average_profiles([c1, c2]).gemm_create_s,
                         {"bf16": ((3.0, 2e-3), (48.0, 3e-3))})
        with self.assertRaisesRegex(ValueError, "gemm_create_s at the same rows"):
            calibrate.average_profiles([c1, _toy_profile(gemm_create_s={"bf16": ((4, 1e-3),)})])
        with self.assertRaisesRegex(ValueError, "at least one"):
            calibrate.average_profiles([])

    def test_fresh_allocations(self):
        # 10 rows of 4 tokens, D=8, F=2 gated, 3 local experts, fp32: hidden 10 x 4 x 4 B,
        # accumulators 4 x 8 x 4 B, three weight gradients 3 x 8 x 2 x 4 B
        fwd, bwd = gemm_cost.ffn_fresh_allocations(10, 4, 8, 2, 3, True, 4)
        self.assertEqual(fwd, [160, 128])
        self.assertEqual(bwd, [128, 192, 192, 192])

    def test_fit_efficiency_curve_is_valid(self):
        # noisy points where more rows would be faster in total are flattened
        curve = calibrate.fit_efficiency_curve([(16, 10.0), (32, 40.0), (64, 50.0)], 50.0)
        self.assertEqual(curve, ((16.0, 0.2), (32.0, 0.4), (64.0, 0.8)))
        _toy_profile(gemm_efficiency=curve)


if __name__ == "__main__":
    run_tests()
