# Owner(s): ["module: moe"]
"""Malformed calls of the distributed helpers: the ParallelStyles' parallelize path
(``torch_moe.distributed.parallel``), expert placement (``torch_moe.distributed.placement``),
the cost model and planner (``torch_moe.distributed._tools``) and the checkpoint helpers
(``torch_moe.distributed.checkpoint``).

The ParallelStyle cases and the group checks of ``rebalance_distributed_`` need a process group
but no exchange (they fail before any collective, or only lay weights out): they run in a
four-rank "fake" world, a process group of this one process whose collectives do nothing,
created for the call and destroyed after it.

Run: ``python -m pytest test/malformed/test_malformed_distributed.py -q -p no:cacheprovider``.
"""

import atexit
import contextlib
import dataclasses
import os
import shutil
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.common_utils import run_tests

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _malformed import Case, malformed_tests  # noqa: E402

from torch_moe.distributed import checkpoint as ckpt  # noqa: E402
from torch_moe.distributed._tools import (  # noqa: E402
    H100,
    REFERENCE_CPU,
    DeviceProfile,
    MoELayerSpec,
    MoEStrategy,
    expert_counts,
    get_profile,
    moe_layer_cost,
    rank_imbalance,
)
from torch_moe.distributed._tools import planner  # noqa: E402
from torch_moe.distributed.placement import (  # noqa: E402
    Placement,
    plan_placement,
    rebalance_,
    rebalance_distributed_,
    route_to_replicas,
    zipf_load,
)

PLACE = "torch_moe.distributed.placement"
TOOLS = "torch_moe.distributed._tools"
CKPT = "torch_moe.distributed.checkpoint"
STYLE = "torch_moe.distributed.parallel"

E = 8


def naive(num_ranks: int = 2) -> Placement:
    return Placement.from_phys_to_logical(torch.arange(E), num_ranks, E)


def replicated() -> Placement:
    # 4 experts on 2 ranks of 3 slots: the hot expert 0 gets the two extra slots' replicas
    return plan_placement(torch.tensor([10.0, 1.0, 1.0, 1.0]), 2, 3)


def ids(*rows, dtype=torch.int64):
    return torch.tensor(rows, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# a process group for the calls that need one
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_world(world_size: int = 4):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def in_world(fn, world_size: int = 4):
    def call():
        with fake_world(world_size):
            return fn()
    return call


def make_moe(**overrides):
    from torch_moe.nn import MoE, MoEConfig

    cfg = dict(dim=8, hidden_dim=12, num_experts=8, top_k=2)
    cfg.update(overrides)
    torch.manual_seed(0)
    return MoE(MoEConfig(**cfg))


def parallelize(style_name, mesh_shape, module=None, style_kwargs=None, world_size=4, **moe):
    def call():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from torch_moe.distributed import parallel

        mesh = init_device_mesh("cpu", mesh_shape)
        target = make_moe(**moe) if module is None else module()
        style = getattr(parallel, style_name)(**(style_kwargs or {}))
        return parallelize_module(target, mesh, style)
    return in_world(call, world_size)


def parallelize_twice():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from torch_moe.distributed.parallel import ExpertParallel, TensorParallelExperts

    mesh = init_device_mesh("cpu", (4,))
    moe = make_moe()
    parallelize_module(moe, mesh, ExpertParallel())
    return parallelize_module(moe.experts, mesh, TensorParallelExperts())


def check_local_shapes(shapes):
    def check(moe):
        for name, shape in shapes.items():
            w = getattr(moe.experts, name)
            assert tuple(w.to_local().shape) == shape, (name, w.to_local().shape)
    return check


def expected(value):
    def check(result):
        assert torch.equal(result, value) if isinstance(value, torch.Tensor) \
            else result == value, (result, value)
    return check


def check_shape(shape, dtype=None):
    def check(result):
        assert tuple(result.shape) == tuple(shape), result.shape
        if dtype is not None:
            assert result.dtype == dtype, result.dtype
    return check


STYLE_CASES = [
    Case(f"{STYLE}.ExpertParallel", "module_not_moe",
         parallelize("ExpertParallel", (4,), module=lambda: nn.Linear(8, 8)), ValueError,
         needles=("ExpertParallel", "MoE or GroupedExperts module", "but got Linear")),
    Case(f"{STYLE}.ExpertParallel", "mesh_2d",
         parallelize("ExpertParallel", (2, 2)), ValueError,
         needles=("expected a 1-D device mesh", "2-D mesh of shape (2, 2)")),
    Case(f"{STYLE}.ExpertTensorParallel", "mesh_1d",
         parallelize("ExpertTensorParallel", (4,)), ValueError,
         needles=("expected a 2-D device mesh", "1-D mesh of shape (4,)")),
    Case(f"{STYLE}.TensorParallelExperts", "mesh_2d",
         parallelize("TensorParallelExperts", (2, 2)), ValueError,
         needles=("expected a 1-D device mesh", "2-D mesh of shape (2, 2)")),
    Case(f"{STYLE}.ExpertParallel", "experts_not_divisible",
         parallelize("ExpertParallel", (4,), num_experts=6), ValueError,
         needles=("num_experts (6)", "expert-parallel degree (4)")),
    Case(f"{STYLE}.ExpertParallel", "more_ranks_than_experts",
         parallelize("ExpertParallel", (4,), num_experts=2, top_k=1), ValueError,
         needles=("num_experts (2)", "expert-parallel degree (4)")),
    Case(f"{STYLE}.ExpertTensorParallel", "experts_not_divisible_by_ep",
         parallelize("ExpertTensorParallel", (2, 2), num_experts=3, top_k=1), ValueError,
         needles=("num_experts (3)", "(mesh dim 0) degree (2)")),
    Case(f"{STYLE}.ExpertTensorParallel", "hidden_not_divisible_by_tp",
         parallelize("ExpertTensorParallel", (2, 2), hidden_dim=5), ValueError,
         needles=("hidden_dim (5)", "(mesh dim 1) degree (2)")),
    Case(f"{STYLE}.TensorParallelExperts", "hidden_not_divisible",
         parallelize("TensorParallelExperts", (4,), hidden_dim=6), ValueError,
         needles=("hidden_dim (6)", "tensor-parallel degree (4)")),
    Case(f"{STYLE}.ExpertParallel", "fp8_precision",
         parallelize("ExpertParallel", (4,), precision="fp8_rowwise"), NotImplementedError,
         needles=("expected precision='bf16'", "precision='fp8_rowwise'")),
    Case(f"{STYLE}.ExpertParallel", "capacity_factor",
         parallelize("ExpertParallel", (4,), capacity_factor=1.25), NotImplementedError,
         needles=("expected capacity_factor=None", "but got 1.25")),
    Case(f"{STYLE}.ExpertParallel", "already_parallelized", in_world(parallelize_twice),
         ValueError, needles=("TensorParallelExperts", "already parallelized")),
    Case(f"{STYLE}.ExpertParallel", "unknown_dispatch_option",
         lambda: __import__("torch_moe.distributed.parallel", fromlist=["x"]).ExpertParallel(
             dispatch_options={"bogus": 1}), ValueError,
         needles=("unknown dispatch_options ['bogus']", "accepts")),
    Case(f"{STYLE}.ExpertParallel", "reserved_dispatch_option",
         lambda: __import__("torch_moe.distributed.parallel", fromlist=["x"]).ExpertParallel(
             dispatch_options={"num_experts": 8}), ValueError,
         needles=("unknown dispatch_options ['num_experts']",)),
    Case(f"{STYLE}.ExpertParallel", "dispatch_options_not_a_dict",
         lambda: __import__("torch_moe.distributed.parallel", fromlist=["x"]).ExpertParallel(
             dispatch_options="dedup"), ValueError,
         needles=("dispatch_options", "a dict", "but got str")),
    Case(f"{STYLE}.ExpertTensorParallel", "dispatch_options_not_a_dict",
         lambda: __import__("torch_moe.distributed.parallel", fromlist=["x"]).ExpertTensorParallel(
             dispatch_options=[("dedup", True)]), ValueError,
         needles=("dispatch_options", "a dict", "but got list")),
    Case(f"{STYLE}.ExpertParallel", "one_rank_mesh",
         parallelize("ExpertParallel", (1,), world_size=1),
         check=check_local_shapes({"w1": (8, 8, 12), "w2": (8, 12, 8), "w3": (8, 8, 12)})),
    Case(f"{STYLE}.ExpertTensorParallel", "one_by_one_mesh",
         parallelize("ExpertTensorParallel", (1, 1), world_size=1),
         check=check_local_shapes({"w1": (8, 8, 12), "w2": (8, 12, 8)})),
]


# ---------------------------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------------------------


PLACEMENT_CASES = [
    # route_to_replicas
    Case(f"{PLACE}.route_to_replicas", "negative_expert_id",
         lambda: route_to_replicas(ids([0, -1], [3, 4]), naive()), ValueError,
         needles=("topk_ids", "[0, 8)", "[-1, 4]")),
    Case(f"{PLACE}.route_to_replicas", "negative_expert_id_int32",
         lambda: route_to_replicas(ids([-8, 1], dtype=torch.int32), naive()), ValueError,
         needles=("topk_ids", "[0, 8)", "[-8, 1]")),
    Case(f"{PLACE}.route_to_replicas", "expert_id_equal_to_E",
         lambda: route_to_replicas(ids([0, 8]), naive()), ValueError,
         needles=("topk_ids", "[0, 8)", "[0, 8]")),
    Case(f"{PLACE}.route_to_replicas", "expert_id_out_of_range_with_replicas",
         lambda: route_to_replicas(ids([0, 4]), replicated()), ValueError,
         needles=("topk_ids", "[0, 4)", "[0, 4]")),
    Case(f"{PLACE}.route_to_replicas", "float_ids",
         lambda: route_to_replicas(torch.zeros(2, 2), naive()), ValueError,
         needles=("topk_ids", "int32 or int64", "torch.float32")),
    Case(f"{PLACE}.route_to_replicas", "bool_ids",
         lambda: route_to_replicas(torch.zeros(2, 2, dtype=torch.bool), naive()), ValueError,
         needles=("topk_ids", "int32 or int64", "torch.bool")),
    Case(f"{PLACE}.route_to_replicas", "complex_ids",
         lambda: route_to_replicas(torch.zeros(2, 2, dtype=torch.complex64), naive()),
         ValueError, needles=("topk_ids", "int32 or int64", "torch.complex64")),
    Case(f"{PLACE}.route_to_replicas", "int16_ids",
         lambda: route_to_replicas(torch.zeros(2, 2, dtype=torch.int16), naive()), ValueError,
         needles=("topk_ids", "int32 or int64", "torch.int16")),
    Case(f"{PLACE}.route_to_replicas", "1d_ids",
         lambda: route_to_replicas(torch.zeros(4, dtype=torch.int64), naive()), ValueError,
         needles=("topk_ids", "2-D tensor [T, k]", "shape (4,)")),
    Case(f"{PLACE}.route_to_replicas", "3d_ids",
         lambda: route_to_replicas(torch.zeros(2, 2, 2, dtype=torch.int64), naive()),
         ValueError, needles=("topk_ids", "2-D tensor [T, k]", "shape (2, 2, 2)")),
    Case(f"{PLACE}.route_to_replicas", "list_ids",
         lambda: route_to_replicas([[0, 1]], naive()), ValueError,
         needles=("topk_ids", "2-D tensor [T, k]", "but got list")),
    Case(f"{PLACE}.route_to_replicas", "placement_not_a_placement",
         lambda: route_to_replicas(ids([0, 1]), "naive"), ValueError,
         needles=("placement", "a Placement", "but got str")),
    Case(f"{PLACE}.route_to_replicas", "no_tokens",
         lambda: route_to_replicas(torch.zeros(0, 2, dtype=torch.int64), naive()),
         check=check_shape((0, 2), torch.int64)),
    Case(f"{PLACE}.route_to_replicas", "meta_ids",
         lambda: route_to_replicas(torch.zeros(3, 2, dtype=torch.int32, device="meta"), naive()),
         check=check_shape((3, 2), torch.int32)),
    Case(f"{PLACE}.route_to_replicas", "duplicate_ids_in_a_row",
         lambda: route_to_replicas(ids([0, 0], [0, 0]), replicated()),
         check=lambda phys: _check_spread(phys, replicated())),
    # plan_placement
    Case(f"{PLACE}.plan_placement", "absurd_num_ranks",
         lambda: plan_placement(torch.ones(E), 10**9, 1), ValueError,
         needles=("num_ranks * slots_per_rank <= 65536", "1000000000 x 1")),
    Case(f"{PLACE}.plan_placement", "absurd_slots_per_rank",
         lambda: plan_placement(torch.ones(E), 2, 10**12), ValueError,
         needles=("num_ranks * slots_per_rank <= 65536", "2 x 1000000000000")),
    Case(f"{PLACE}.plan_placement", "at_the_slot_bound",
         lambda: plan_placement(zipf_load(256, 1.2, 100_000, seed=0), 1024, 64),
         check=lambda p: _check_slots(p, 1024 * 64), timeout_s=20.0),
    Case(f"{PLACE}.plan_placement", "fewer_slots_than_experts",
         lambda: plan_placement(torch.ones(E), 2, 3), ValueError,
         needles=(">= 8 experts", "2 ranks x 3 slots = 6")),
    Case(f"{PLACE}.plan_placement", "zero_ranks",
         lambda: plan_placement(torch.ones(E), 0, 8), ValueError,
         needles=("num_ranks", "positive integer", "but got 0")),
    Case(f"{PLACE}.plan_placement", "negative_slots",
         lambda: plan_placement(torch.ones(E), 2, -4), ValueError,
         needles=("slots_per_rank", "positive integer", "but got -4")),
    Case(f"{PLACE}.plan_placement", "bool_ranks",
         lambda: plan_placement(torch.ones(E), True, 8), ValueError,
         needles=("num_ranks", "positive integer", "but got True")),
    Case(f"{PLACE}.plan_placement", "float_slots",
         lambda: plan_placement(torch.ones(E), 2, 4.0), ValueError,
         needles=("slots_per_rank", "positive integer", "but got 4.0")),
    Case(f"{PLACE}.plan_placement", "nan_load",
         lambda: plan_placement(torch.tensor([1.0, float("nan")]), 1, 2), ValueError,
         needles=("load", "finite", "experts [1]", "inf or nan")),
    Case(f"{PLACE}.plan_placement", "inf_load",
         lambda: plan_placement(torch.tensor([float("inf"), 1.0]), 1, 2), ValueError,
         needles=("load", "finite", "experts [0]", "inf or nan")),
    Case(f"{PLACE}.plan_placement", "negative_load",
         lambda: plan_placement(torch.tensor([3, -1, 2, -5]), 2, 2), ValueError,
         needles=("load", "non-negative", "experts [1, 3]")),
    Case(f"{PLACE}.plan_placement", "bool_load",
         lambda: plan_placement(torch.tensor([True, False]), 1, 2), ValueError,
         needles=("load", "integer or floating", "torch.bool")),
    Case(f"{PLACE}.plan_placement", "complex_load",
         lambda: plan_placement(torch.ones(2, dtype=torch.complex64), 1, 2), ValueError,
         needles=("load", "integer or floating", "torch.complex64")),
    Case(f"{PLACE}.plan_placement", "2d_load",
         lambda: plan_placement(torch.ones(2, 4), 2, 4), ValueError,
         needles=("load", "non-empty 1-D tensor [E]", "shape (2, 4)")),
    Case(f"{PLACE}.plan_placement", "empty_load",
         lambda: plan_placement(torch.zeros(0), 1, 1), ValueError,
         needles=("load", "non-empty 1-D tensor [E]", "shape (0,)")),
    Case(f"{PLACE}.plan_placement", "list_load",
         lambda: plan_placement([1, 2], 1, 2), ValueError,
         needles=("load", "a tensor", "but got list")),
    Case(f"{PLACE}.plan_placement", "meta_load",
         lambda: plan_placement(torch.ones(4, device="meta"), 2, 2), ValueError,
         needles=("load", "a device with data", "meta")),
    Case(f"{PLACE}.plan_placement", "all_zero_load",
         lambda: plan_placement(torch.zeros(4), 2, 3),
         check=lambda p: _check_slots(p, 6)),
    Case(f"{PLACE}.plan_placement", "more_replicas_than_ranks",
         lambda: plan_placement(torch.tensor([100, 1, 1]), 2, 4),
         check=lambda p: expected([4, 2, 2])(p.num_replicas.tolist())),
    # Placement.from_phys_to_logical
    Case(f"{PLACE}.Placement.from_phys_to_logical", "negative_expert_id",
         lambda: Placement.from_phys_to_logical(torch.tensor([0, -1, 2, 1]), 2, 3), ValueError,
         needles=("expert ids in [0, 3)", "[-1, 2]")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "expert_id_out_of_range",
         lambda: Placement.from_phys_to_logical(torch.tensor([0, 3, 2, 1]), 2, 3), ValueError,
         needles=("expert ids in [0, 3)", "[0, 3]")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "expert_without_slot",
         lambda: Placement.from_phys_to_logical(torch.tensor([0, 0, 2, 2]), 2, 3), ValueError,
         needles=("every expert in [0, 3)", "experts [1]")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "absurd_num_logical",
         lambda: Placement.from_phys_to_logical(torch.arange(4), 2, 10**12), ValueError,
         needles=("num_logical <= 4", "but got 1000000000000")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "absurd_num_ranks",
         lambda: Placement.from_phys_to_logical(torch.arange(4), 10**12, 4), ValueError,
         needles=("num_ranks = 1000000000000", "4 % 1000000000000 = 4")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "uneven_slots",
         lambda: Placement.from_phys_to_logical(torch.arange(3), 2, 3), ValueError,
         needles=("num_ranks = 2", "3 % 2 = 1")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "no_slots",
         lambda: Placement.from_phys_to_logical(torch.zeros(0, dtype=torch.int64), 2, 3),
         ValueError, needles=("num_logical <= 0", "but got 3")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "float_ids",
         lambda: Placement.from_phys_to_logical(torch.tensor([0.0, 1.0]), 2, 2), ValueError,
         needles=("phys_to_logical", "int32 or int64", "torch.float32")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "2d_ids",
         lambda: Placement.from_phys_to_logical(torch.zeros(2, 2, dtype=torch.int64), 2, 2),
         ValueError, needles=("phys_to_logical", "1-D tensor [P]", "shape (2, 2)")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "meta_ids",
         lambda: Placement.from_phys_to_logical(torch.arange(4, device="meta"), 2, 4),
         ValueError, needles=("phys_to_logical", "a device with data", "meta")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "zero_num_logical",
         lambda: Placement.from_phys_to_logical(torch.arange(4), 2, 0), ValueError,
         needles=("num_logical", "positive integer", "but got 0")),
    Case(f"{PLACE}.Placement.from_phys_to_logical", "int32_ids",
         lambda: Placement.from_phys_to_logical(torch.arange(4, dtype=torch.int32), 2, 4),
         check=lambda p: expected(torch.arange(4))(p.phys_to_logical)),
    # rank_loads / imbalance
    Case(f"{PLACE}.Placement.rank_loads", "wrong_num_experts",
         lambda: naive().rank_loads(torch.ones(E - 1)), ValueError,
         needles=("load of 8 experts", "but got 7")),
    Case(f"{PLACE}.Placement.rank_loads", "nan_load",
         lambda: naive().rank_loads(torch.full((E,), float("nan"))), ValueError,
         needles=("load", "finite", "inf or nan")),
    Case(f"{PLACE}.Placement.imbalance", "negative_load",
         lambda: naive().imbalance(-torch.ones(E)), ValueError,
         needles=("load", "non-negative", "negative load")),
    Case(f"{PLACE}.Placement.imbalance", "all_zero_load",
         lambda: naive().imbalance(torch.zeros(E)), check=expected(1.0)),
    # rebalance_
    Case(f"{PLACE}.rebalance_", "placements_of_different_experts",
         lambda: rebalance_({}, naive(), replicated()), ValueError,
         needles=("same number of logical experts", "8 (old) and 4 (new)")),
    Case(f"{PLACE}.rebalance_", "rows_not_of_old_placement",
         lambda: rebalance_({"w1": torch.zeros(E + 1, 2)}, naive(), naive()), ValueError,
         needles=("'w1'", "the 8 physical experts", "shape (9, 2)")),
    Case(f"{PLACE}.rebalance_", "state_not_a_dict",
         lambda: rebalance_([torch.zeros(E)], naive(), naive()), ValueError,
         needles=("state", "a dict of tensors", "but got list")),
    Case(f"{PLACE}.rebalance_", "old_not_a_placement",
         lambda: rebalance_({}, "naive", naive()), ValueError,
         needles=("old", "a Placement", "but got str")),
    Case(f"{PLACE}.rebalance_", "empty_state",
         lambda: rebalance_({}, naive(), naive()), check=expected({})),
    Case(f"{PLACE}.rebalance_", "scalars_kept",
         lambda: rebalance_({"step": torch.tensor(3.0), "lr": 0.1}, naive(), naive()),
         check=lambda s: expected({"step": 3.0, "lr": 0.1})(
             {"step": s["step"].item(), "lr": s["lr"]})),
    # rebalance_distributed_
    Case(f"{PLACE}.rebalance_distributed_", "placements_over_other_ranks",
         in_world(lambda: rebalance_distributed_({}, naive(4), naive(2))), ValueError,
         needles=("placements over the 4 ranks", "4 (old) and 2 (new)")),
    Case(f"{PLACE}.rebalance_distributed_", "rows_not_of_this_rank",
         in_world(lambda: rebalance_distributed_({"w": torch.zeros(3, 1)}, naive(4), naive(4))),
         ValueError, needles=("'w'", "the 2 slots", "shape (3, 1)")),
    Case(f"{PLACE}.rebalance_distributed_", "placements_of_different_experts",
         in_world(lambda: rebalance_distributed_({}, naive(4), plan_placement(
             torch.ones(4), 4, 1))), ValueError,
         needles=("same number of logical experts", "8 (old) and 4 (new)")),
    Case(f"{PLACE}.rebalance_distributed_", "new_not_a_placement",
         in_world(lambda: rebalance_distributed_({}, naive(4), None)), ValueError,
         needles=("new", "a Placement", "but got NoneType")),
    # zipf_load
    Case(f"{PLACE}.zipf_load", "zero_experts", lambda: zipf_load(0, 1.0, 10, 0), ValueError,
         needles=("num_experts", "positive integer", "but got 0")),
    Case(f"{PLACE}.zipf_load", "absurd_experts", lambda: zipf_load(10**12, 1.0, 10, 0),
         ValueError, needles=("num_experts <= 65536", "but got 1000000000000")),
    Case(f"{PLACE}.zipf_load", "absurd_total", lambda: zipf_load(8, 1.0, 10**12, 0),
         ValueError, needles=("total <= 67108864", "but got 1000000000000")),
    Case(f"{PLACE}.zipf_load", "negative_total", lambda: zipf_load(8, 1.0, -1, 0), ValueError,
         needles=("total", "int >= 0", "but got -1")),
    Case(f"{PLACE}.zipf_load", "nan_exponent", lambda: zipf_load(8, float("nan"), 10, 0),
         ValueError, needles=("exponent", "finite number >= 0", "but got nan")),
    Case(f"{PLACE}.zipf_load", "negative_exponent", lambda: zipf_load(8, -1.0, 10, 0),
         ValueError, needles=("exponent", "finite number >= 0", "but got -1.0")),
    Case(f"{PLACE}.zipf_load", "float_experts", lambda: zipf_load(8.0, 1.0, 10, 0),
         ValueError, needles=("num_experts", "positive integer", "but got 8.0")),
    Case(f"{PLACE}.zipf_load", "str_seed", lambda: zipf_load(8, 1.0, 10, "a"), ValueError,
         needles=("seed", "an int", "but got 'a'")),
    Case(f"{PLACE}.zipf_load", "no_draws", lambda: zipf_load(8, 1.0, 0, 0),
         check=expected(torch.zeros(8, dtype=torch.int64))),
]


def _check_spread(phys, placement):
    # four assignments to expert 0: spread evenly over its replicas, all slots of expert 0
    assert bool((placement.phys_to_logical[phys] == 0).all()), phys
    counts = torch.bincount(phys.flatten(), minlength=placement.num_physical)
    slots = placement.logical_to_phys[0, :int(placement.num_replicas[0])]
    assert int(counts[slots].max() - counts[slots].min()) <= 1, counts


def _check_slots(p, num_slots):
    assert p.num_physical == num_slots, p.num_physical
    assert int(p.num_replicas.sum()) == num_slots
    assert bool((p.num_replicas >= 1).all())


# ---------------------------------------------------------------------------------------------
# cost model, device profiles, planner
# ---------------------------------------------------------------------------------------------

LAYER = MoELayerSpec(dim=64, hidden_dim=128, num_experts=8, top_k=2)
ATTN = planner.AttentionSpec.gqa(64, 4, 2, 16)


def model(**overrides):
    kw = dict(name="m", moe=LAYER, num_layers=4, attention=ATTN, vocab_size=1000, seq_len=128,
              tokens_per_batch=128 * 64)
    kw.update(overrides)
    return planner.ModelSpec(**kw)


CLUSTER = planner.ClusterSpec(H100, 8, 1)


def profile(**changes):
    return dataclasses.replace(H100, **changes)


TOOLS_CASES = [
    # MoELayerSpec / MoEStrategy
    Case(f"{TOOLS}.MoELayerSpec", "absurd_num_experts",
         lambda: MoELayerSpec(64, 128, 10**12, 2), ValueError,
         needles=("num_experts <= 4096", "but got 1000000000000")),
    Case(f"{TOOLS}.MoELayerSpec", "k_greater_than_E", lambda: MoELayerSpec(64, 128, 8, 9),
         ValueError, needles=("top_k <= num_experts", "top_k=9", "num_experts=8")),
    Case(f"{TOOLS}.MoELayerSpec", "zero_dim", lambda: MoELayerSpec(0, 128, 8, 2), ValueError,
         needles=("dim", "positive int", "but got 0")),
    Case(f"{TOOLS}.MoELayerSpec", "float_hidden_dim", lambda: MoELayerSpec(64, 128.0, 8, 2),
         ValueError, needles=("hidden_dim", "positive int", "but got 128.0")),
    Case(f"{TOOLS}.MoELayerSpec", "bool_top_k", lambda: MoELayerSpec(64, 128, 8, True),
         ValueError, needles=("top_k", "positive int", "but got True")),
    Case(f"{TOOLS}.MoELayerSpec", "negative_shared_experts",
         lambda: MoELayerSpec(64, 128, 8, 2, num_shared_experts=-1), ValueError,
         needles=("num_shared_experts >= 0", "but got -1")),
    Case(f"{TOOLS}.MoELayerSpec", "zero_max_nodes",
         lambda: MoELayerSpec(64, 128, 8, 2, max_nodes=0), ValueError,
         needles=("max_nodes", "positive int", "but got 0")),
    Case(f"{TOOLS}.MoEStrategy", "zero_ep", lambda: MoEStrategy(ep=0), ValueError,
         needles=("ep", "positive int", "but got 0")),
    Case(f"{TOOLS}.MoEStrategy", "unknown_dispatch", lambda: MoEStrategy(dispatch="x"),
         ValueError, needles=("dispatch 'x'", "expected one of")),
    Case(f"{TOOLS}.MoEStrategy", "unknown_precision", lambda: MoEStrategy(precision="fp4"),
         ValueError, needles=("precision 'fp4'", "expected one of")),
    Case(f"{TOOLS}.MoEStrategy", "zero_chunks", lambda: MoEStrategy(num_chunks=0), ValueError,
         needles=("num_chunks", "positive int", "but got 0")),
    # moe_layer_cost / expert_counts / rank_imbalance
    Case(f"{TOOLS}.moe_layer_cost", "profile_not_a_profile",
         lambda: moe_layer_cost(LAYER, MoEStrategy(ep=2), "H100", 10), ValueError,
         needles=("profile", "a DeviceProfile", "but got str")),
    Case(f"{TOOLS}.moe_layer_cost", "layer_not_a_spec",
         lambda: moe_layer_cost(3, MoEStrategy(), H100, 10), ValueError,
         needles=("an MoELayerSpec and an MoEStrategy", "but got int and MoEStrategy")),
    Case(f"{TOOLS}.moe_layer_cost", "ep_not_dividing_experts",
         lambda: moe_layer_cost(LAYER, MoEStrategy(ep=3), H100, 10), ValueError,
         needles=("num_experts=8", "divisible by ep=3")),
    Case(f"{TOOLS}.moe_layer_cost", "more_ranks_than_experts",
         lambda: moe_layer_cost(LAYER, MoEStrategy(ep=16), H100, 10), ValueError,
         needles=("num_experts=8", "divisible by ep=16")),
    Case(f"{TOOLS}.moe_layer_cost", "nan_tokens",
         lambda: moe_layer_cost(LAYER, MoEStrategy(), H100, float("nan")), ValueError,
         needles=("tokens_per_rank", "finite number >= 0", "but got nan")),
    Case(f"{TOOLS}.moe_layer_cost", "negative_tokens",
         lambda: moe_layer_cost(LAYER, MoEStrategy(), H100, -1), ValueError,
         needles=("tokens_per_rank", "finite number >= 0", "but got -1")),
    Case(f"{TOOLS}.moe_layer_cost", "nan_load",
         lambda: moe_layer_cost(LAYER, MoEStrategy(), H100, 10, load=[float("nan")] * 8),
         ValueError, needles=("load", "finite and non-negative", "nan")),
    Case(f"{TOOLS}.moe_layer_cost", "load_of_other_experts",
         lambda: moe_layer_cost(LAYER, MoEStrategy(), H100, 10, load=[1.0] * 7), ValueError,
         needles=("load of 8 experts", "but got 7")),
    Case(f"{TOOLS}.moe_layer_cost", "bool_load",
         lambda: moe_layer_cost(LAYER, MoEStrategy(), H100, 10,
                                load=torch.ones(8, dtype=torch.bool)), ValueError,
         needles=("load", "integer or floating", "torch.bool")),
    Case(f"{TOOLS}.moe_layer_cost", "precision_the_device_lacks",
         lambda: moe_layer_cost(LAYER, MoEStrategy(precision="mxfp8"), REFERENCE_CPU, 10),
         ValueError, needles=("no mxfp8 GEMMs", "expected one of")),
    Case(f"{TOOLS}.moe_layer_cost", "no_tokens",
         lambda: moe_layer_cost(LAYER, MoEStrategy(ep=2), H100, 0),
         check=lambda c: _check_finite_cost(c)),
    Case(f"{TOOLS}.moe_layer_cost", "absurd_tokens",
         lambda: moe_layer_cost(LAYER, MoEStrategy(ep=2), H100, 1e30),
         check=lambda c: _check_finite_cost(c)),
    Case(f"{TOOLS}.expert_counts", "absurd_num_experts",
         lambda: expert_counts(10**9, 100.0, 1.2), ValueError,
         needles=("num_experts <= 4096", "but got 1000000000")),
    Case(f"{TOOLS}.expert_counts", "negative_assignments",
         lambda: expert_counts(8, -1.0), ValueError,
         needles=("assignments", "finite number >= 0", "but got -1.0")),
    Case(f"{TOOLS}.expert_counts", "all_zero_load",
         lambda: expert_counts(4, 8.0, [0, 0, 0, 0]), ValueError,
         needles=("at least one non-zero count", "all are zero")),
    Case(f"{TOOLS}.rank_imbalance", "ep_not_dividing", lambda: rank_imbalance([1, 2, 3], 2),
         ValueError, needles=("num_experts=3", "divisible by ep=2")),
    Case(f"{TOOLS}.rank_imbalance", "nan_counts",
         lambda: rank_imbalance([1.0, float("nan")], 1), ValueError,
         needles=("counts", "finite and non-negative", "nan")),
    Case(f"{TOOLS}.rank_imbalance", "all_zero", lambda: rank_imbalance([0, 0, 0, 0], 2),
         check=expected(1.0)),
    # DeviceProfile
    Case(f"{TOOLS}.get_profile", "unknown_name", lambda: get_profile("X100"), ValueError,
         needles=("device profile 'X100'", "expected one of")),
    Case(f"{TOOLS}.DeviceProfile", "negative_memory", lambda: profile(memory_bytes=-1),
         ValueError, needles=("memory_bytes", "finite and > 0", "but got -1")),
    Case(f"{TOOLS}.DeviceProfile", "infinite_bandwidth",
         lambda: profile(memory_bandwidth_Bps=float("inf")), ValueError,
         needles=("memory_bandwidth_Bps", "finite and > 0", "but got inf")),
    Case(f"{TOOLS}.DeviceProfile", "infinite_link_bandwidth",
         lambda: profile(inter_node_bandwidth_Bps=float("inf")), ValueError,
         needles=("inter_node_bandwidth_Bps", "finite and > 0", "but got inf")),
    Case(f"{TOOLS}.DeviceProfile", "infinite_flops",
         lambda: profile(peak_flops={"bf16": float("inf")}), ValueError,
         needles=("peak_flops['bf16']", "finite and > 0", "but got inf")),
    Case(f"{TOOLS}.DeviceProfile", "nan_latency",
         lambda: profile(intra_node_latency_s=float("nan")), ValueError,
         needles=("intra_node_latency_s", "finite and >= 0", "but got nan")),
    Case(f"{TOOLS}.DeviceProfile", "nan_curve_rows",
         lambda: profile(gemm_efficiency=((float("nan"), 0.5),)), ValueError,
         needles=("rows of gemm_efficiency", "finite, positive", "[nan]")),
    Case(f"{TOOLS}.DeviceProfile", "curve_fraction_above_one",
         lambda: profile(gemm_efficiency=((1, 2.0),)), ValueError,
         needles=("fractions of gemm_efficiency", "(0, 1]", "[2.0]")),
    Case(f"{TOOLS}.DeviceProfile", "empty_curve", lambda: profile(wgrad_efficiency=()),
         ValueError, needles=("wgrad_efficiency", "at least one", "got none")),
    Case(f"{TOOLS}.DeviceProfile", "zero_tile_rows", lambda: profile(gemm_tile_rows=0),
         ValueError, needles=("gemm_tile_rows", "positive int", "but got 0")),
    Case(f"{TOOLS}.DeviceProfile.gemm_flops", "nan_rows",
         lambda: H100.gemm_flops("bf16", float("nan")), ValueError,
         needles=("rows", "finite number >= 0", "but got nan")),
    Case(f"{TOOLS}.DeviceProfile.gemm_flops", "negative_rows",
         lambda: H100.gemm_flops("bf16", -1), ValueError,
         needles=("rows", "finite number >= 0", "but got -1")),
    Case(f"{TOOLS}.DeviceProfile.gemm_flops", "zero_rows",
         lambda: H100.gemm_flops("bf16", 0), check=lambda f: _check_positive(f)),
    Case(f"{TOOLS}.DeviceProfile.from_json", "not_json",
         lambda: DeviceProfile.from_json("not json"), ValueError,
         needles=("from_json", "the JSON of a DeviceProfile", "does not parse")),
    Case(f"{TOOLS}.DeviceProfile.from_json", "missing_fields",
         lambda: DeviceProfile.from_json('{"name": "x"}'), ValueError,
         needles=("required fields", "'peak_flops'", "are missing")),
    Case(f"{TOOLS}.DeviceProfile.from_json", "not_an_object",
         lambda: DeviceProfile.from_json("[1, 2]"), ValueError,
         needles=("a JSON object", "but got list")),
    Case(f"{TOOLS}.DeviceProfile.from_json", "unknown_field",
         lambda: DeviceProfile.from_json('{"x": 1}'), ValueError,
         needles=("unknown fields ['x']",)),
    Case(f"{TOOLS}.DeviceProfile.from_json", "round_trip",
         lambda: DeviceProfile.from_json(H100.to_json()), check=expected(H100)),
    # planner specs
    Case(f"{TOOLS}.ModelSpec", "absurd_num_layers", lambda: model(num_layers=10**15),
         ValueError, needles=("num_layers <= 65536", "but got 1000000000000000")),
    Case(f"{TOOLS}.ModelSpec", "more_dense_layers_than_layers",
         lambda: model(num_dense_layers=5, dense_hidden_dim=8), ValueError,
         needles=("num_dense_layers", "[0, num_layers=4]", "but got 5")),
    Case(f"{TOOLS}.ModelSpec", "float_dense_layers",
         lambda: model(num_dense_layers=1.5, dense_hidden_dim=8), ValueError,
         needles=("num_dense_layers", "an int in [0, num_layers=4]", "but got 1.5")),
    Case(f"{TOOLS}.ModelSpec", "zero_dense_hidden_dim",
         lambda: model(num_dense_layers=1, dense_hidden_dim=0), ValueError,
         needles=("dense_hidden_dim", "positive int", "but got 0")),
    Case(f"{TOOLS}.ModelSpec", "dense_layers_without_width",
         lambda: model(num_dense_layers=1), ValueError,
         needles=("dense_hidden_dim for num_dense_layers=1", "but got None")),
    Case(f"{TOOLS}.ModelSpec", "moe_not_a_spec", lambda: model(moe=3), ValueError,
         needles=("moe", "MoELayerSpec", "but got int")),
    Case(f"{TOOLS}.ModelSpec", "attention_not_a_spec", lambda: model(attention="gqa"),
         ValueError, needles=("attention", "AttentionSpec", "but got str")),
    Case(f"{TOOLS}.ModelSpec", "tokens_not_whole_sequences",
         lambda: model(tokens_per_batch=100), ValueError,
         needles=("tokens_per_batch=100", "multiple of seq_len=128")),
    Case(f"{TOOLS}.ClusterSpec", "nan_memory_fraction",
         lambda: planner.ClusterSpec(H100, 8, 1, float("nan")), ValueError,
         needles=("memory_fraction in (0, 1]", "but got nan")),
    Case(f"{TOOLS}.ClusterSpec", "profile_not_a_profile",
         lambda: planner.ClusterSpec("H100", 8, 1), ValueError,
         needles=("a DeviceProfile", "but got str")),
    Case(f"{TOOLS}.ClusterSpec", "zero_nodes", lambda: planner.ClusterSpec(H100, 8, 0),
         ValueError, needles=("num_nodes", "positive int", "but got 0")),
    Case(f"{TOOLS}.Strategy", "empty_precision_tuple", lambda: planner.Strategy(precision=()),
         ValueError, needles=("precision", "non-empty tuple", "but got ()")),
    Case(f"{TOOLS}.Strategy", "unknown_sharding", lambda: planner.Strategy(sharding="x"),
         ValueError, needles=("sharding 'x'", "expected one of")),
    Case(f"{TOOLS}.AttentionSpec.mla", "negative_rank",
         lambda: planner.AttentionSpec.mla(64, 4, -1, 8, 8, 8, 8), ValueError,
         needles=("q_lora_rank", "positive int", "but got -1")),
    Case(f"{TOOLS}.AttentionSpec.gqa", "heads_not_divisible",
         lambda: planner.AttentionSpec.gqa(64, 5, 2, 16), ValueError,
         needles=("num_heads=5", "num_kv_heads=2")),
    # estimate_step / candidate_strategies / plan / format_plan
    Case(f"{TOOLS}.estimate_step", "optimizer_not_a_spec",
         lambda: planner.estimate_step(model(), CLUSTER, planner.Strategy(), optimizer=3),
         ValueError, needles=("optimizer", "OptimizerSpec", "but got int")),
    Case(f"{TOOLS}.estimate_step", "model_not_a_spec",
         lambda: planner.estimate_step(3, CLUSTER, planner.Strategy()), ValueError,
         needles=("model", "ModelSpec", "but got int")),
    Case(f"{TOOLS}.estimate_step", "ep_not_dividing_ranks",
         lambda: planner.estimate_step(model(), CLUSTER, planner.Strategy(ep=3)), ValueError,
         needles=("ep * etp = 3", "the 8 ranks")),
    Case(f"{TOOLS}.estimate_step", "precisions_of_other_layers",
         lambda: planner.estimate_step(model(), CLUSTER,
                                       planner.Strategy(precision=("bf16", "bf16"))),
         ValueError, needles=("one precision per MoE layer (4)", "but got 2")),
    Case(f"{TOOLS}.estimate_step", "nan_zipf_load",
         lambda: planner.estimate_step(model(), CLUSTER, planner.Strategy(),
                                       load=float("nan")), ValueError,
         needles=("Zipf exponent >= 0", "but got nan")),
    Case(f"{TOOLS}.candidate_strategies", "zero_micro_batch",
         lambda: planner.candidate_strategies(model(), CLUSTER, micro_batch_seqs=(0,)),
         ValueError, needles=("micro_batch_seqs", "positive int", "but got 0")),
    Case(f"{TOOLS}.candidate_strategies", "zero_chunks",
         lambda: planner.candidate_strategies(model(), CLUSTER, chunks=(1, 0)), ValueError,
         needles=("chunks", "positive int", "but got 0")),
    Case(f"{TOOLS}.candidate_strategies", "chunks_not_a_sequence",
         lambda: planner.candidate_strategies(model(), CLUSTER, chunks=2), ValueError,
         needles=("chunks", "a sequence of positive ints", "but got 2")),
    Case(f"{TOOLS}.plan", "absurd_cluster",
         lambda: planner.plan(model(), planner.ClusterSpec(H100, 8, 10**9)), ValueError,
         needles=("no strategy can be laid out", "8000000000 ranks")),
    Case(f"{TOOLS}.plan", "no_strategies",
         lambda: planner.plan(model(), CLUSTER, strategies=[]), ValueError,
         needles=("no strategy can be laid out", "8 ranks")),
    Case(f"{TOOLS}.plan", "cluster_not_a_spec", lambda: planner.plan(model(), "8xH100"),
         ValueError, needles=("cluster", "ClusterSpec", "but got str")),
    Case(f"{TOOLS}.plan", "absurd_tokens",
         lambda: planner.plan(model(tokens_per_batch=128 * 2**40), CLUSTER,
                              strategies=[planner.Strategy()]),
         check=lambda p: _check_positive(p.ranked[0].step_s if p.ranked
                                         else p.infeasible[0].step_s)),
    Case(f"{TOOLS}.format_plan", "result_not_a_plan", lambda: planner.format_plan(3),
         ValueError, needles=("result", "Plan", "but got int")),
    Case(f"{TOOLS}.format_plan", "zero_rows",
         lambda: planner.format_plan(planner.plan(model(), CLUSTER,
                                                  strategies=[planner.Strategy()]), top=0),
         ValueError, needles=("top", "positive int", "but got 0")),
]


def _check_finite_cost(cost):
    import math
    assert math.isfinite(cost.total_s) and cost.total_s >= 0, cost.total_s


def _check_positive(x):
    import math
    assert math.isfinite(x) and x > 0, x


# ---------------------------------------------------------------------------------------------
# checkpoint helpers
# ---------------------------------------------------------------------------------------------


def local(shape=(4, 2)):
    return {"w1": torch.zeros(shape)}


_SAVED = {}


def saved_checkpoint() -> str:
    """A single-process checkpoint of logical experts ``w1 [8, 2]`` (row e holds 2e, 2e + 1)."""
    if "dir" not in _SAVED:
        import tempfile
        import warnings

        import torch.distributed.checkpoint as dcp

        path = tempfile.mkdtemp(prefix="moe_malformed_ckpt_")
        atexit.register(shutil.rmtree, path, True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # no process group: DCP saves from this process
            dcp.save({"w1": torch.arange(16.0).view(E, 2)}, checkpoint_id=path)
        _SAVED["dir"] = path
    return _SAVED["dir"]


def load_into(state, placement, keys=("w1",), rank=0):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_logical_expert_state_dict(state, placement, rank, list(keys),
                                            checkpoint_id=saved_checkpoint())
    return state


CKPT_CASES = [
    Case(f"{CKPT}.expert_runs", "rank_out_of_range",
         lambda: ckpt.expert_runs(naive(), 2, primary_only=True), ValueError,
         needles=("rank in [0, 2)", "but got 2")),
    Case(f"{CKPT}.expert_runs", "negative_rank",
         lambda: ckpt.expert_runs(naive(), -1, primary_only=True), ValueError,
         needles=("rank in [0, 2)", "but got -1")),
    Case(f"{CKPT}.expert_runs", "bool_rank",
         lambda: ckpt.expert_runs(naive(), True, primary_only=True), ValueError,
         needles=("rank", "an int", "but got True")),
    Case(f"{CKPT}.expert_runs", "placement_not_a_placement",
         lambda: ckpt.expert_runs("naive", 0, primary_only=True), ValueError,
         needles=("placement", "a Placement", "but got str")),
    Case(f"{CKPT}.expert_runs", "replicas_read_once",
         lambda: ckpt.expert_runs(Placement.from_phys_to_logical(
             torch.tensor([0, 0, 1, 1]), 1, 2), 0, primary_only=False),
         check=expected([(0, 0, 1), (2, 1, 1)])),
    Case(f"{CKPT}.logical_expert_state_dict", "state_dict_not_a_dict",
         lambda: ckpt.logical_expert_state_dict([], naive(), 0, ["w1"]), ValueError,
         needles=("state_dict", "a dict", "but got list")),
    Case(f"{CKPT}.logical_expert_state_dict", "missing_expert_key",
         lambda: ckpt.logical_expert_state_dict({}, naive(), 0, ["w1"]), ValueError,
         needles=("every expert key", "['w1'] are missing")),
    Case(f"{CKPT}.logical_expert_state_dict", "expert_keys_a_string",
         lambda: ckpt.logical_expert_state_dict(local(), naive(), 0, "w1"), ValueError,
         needles=("expert_keys", "a collection of keys or a callable", "but got 'w1'")),
    Case(f"{CKPT}.logical_expert_state_dict", "slots_of_another_placement",
         lambda: ckpt.logical_expert_state_dict(local((3, 2)), naive(), 0, ["w1"]), ValueError,
         needles=("'w1'", "slots_per_rank = 4", "shape (3, 2)")),
    Case(f"{CKPT}.logical_expert_state_dict", "scalar_entry",
         lambda: ckpt.logical_expert_state_dict({"w1": torch.zeros(())}, naive(), 0, ["w1"]),
         ValueError, needles=("'w1'", "slots_per_rank = 4", "shape ()")),
    Case(f"{CKPT}.logical_expert_state_dict", "entry_not_a_tensor",
         lambda: ckpt.logical_expert_state_dict({"w1": 3}, naive(), 0, ["w1"]), ValueError,
         needles=("'w1'", "plain strided local tensor", "but got int")),
    Case(f"{CKPT}.logical_expert_state_dict", "sparse_entry",
         lambda: ckpt.logical_expert_state_dict({"w1": torch.zeros(4, 2).to_sparse()}, naive(),
                                                0, ["w1"]), ValueError,
         needles=("'w1'", "plain strided local tensor", "sparse_coo")),
    Case(f"{CKPT}.logical_expert_state_dict", "rank_out_of_range",
         lambda: ckpt.logical_expert_state_dict(local(), naive(), 5, ["w1"]), ValueError,
         needles=("rank in [0, 2)", "but got 5")),
    Case(f"{CKPT}.logical_expert_state_dict", "no_expert_keys",
         lambda: ckpt.logical_expert_state_dict({"step": 3}, naive(), 0, []),
         check=expected({"step": 3})),
    Case(f"{CKPT}.logical_expert_state_dict", "logical_shape",
         lambda: ckpt.logical_expert_state_dict(local(), naive(), 1, ["w1"])["w1"],
         check=check_shape((E, 2))),
    Case(f"{CKPT}.load_logical_expert_state_dict", "no_checkpoint",
         lambda: ckpt.load_logical_expert_state_dict(local(), naive(), 0, ["w1"]), ValueError,
         needles=("checkpoint_id or storage_reader", "but got neither")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "checkpoint_not_a_directory",
         lambda: ckpt.load_logical_expert_state_dict(local(), naive(), 0, ["w1"],
                                                     checkpoint_id="/nonexistent/ckpt"),
         ValueError, needles=("checkpoint_id", "a checkpoint directory", "'/nonexistent/ckpt'")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "slots_of_another_placement",
         lambda: ckpt.load_logical_expert_state_dict(local((5, 2)), naive(), 0, ["w1"],
                                                     checkpoint_id="/nonexistent/ckpt"),
         ValueError, needles=("'w1'", "slots_per_rank = 4", "shape (5, 2)")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "checkpoint_of_other_experts",
         lambda: load_into({"w1": torch.zeros(2, 2)},
                           Placement.from_phys_to_logical(torch.arange(4), 2, 4)), ValueError,
         needles=("'w1'", "the placement's 4 logical experts", "it has 8")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "checkpoint_of_other_dtype",
         lambda: load_into({"w1": torch.zeros(4, 2, dtype=torch.float64)}, naive()), ValueError,
         needles=("'w1'", "local dtype torch.float64", "but got torch.float32")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "checkpoint_of_other_expert_shape",
         lambda: load_into({"w1": torch.zeros(4, 3)}, naive()), ValueError,
         needles=("'w1'", "per-expert shape (3,)", "but got (2,)")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "key_not_in_checkpoint",
         lambda: load_into({"w3": torch.zeros(4, 2)}, naive(), keys=("w3",)), ValueError,
         needles=("a tensor [8, ...] for 'w3'", "but got nothing")),
    Case(f"{CKPT}.load_logical_expert_state_dict", "replicas_on_one_rank",
         # rank 0's five slots hold experts 5, 5, 7, 0, 1: the second copy of 5 is filled too
         lambda: load_into({"w1": torch.zeros(5, 2)}, Placement.from_phys_to_logical(
             torch.tensor([5, 5, 7, 0, 1, 2, 3, 4, 6, 6]), 2, E))["w1"],
         check=expected(torch.tensor([[10.0, 11.0], [10.0, 11.0], [14.0, 15.0], [0.0, 1.0],
                                      [2.0, 3.0]]))),
    Case(f"{CKPT}.save_expert_parallel_checkpoint", "model_not_a_module",
         lambda: ckpt.save_expert_parallel_checkpoint(3, checkpoint_id="/tmp/unused"),
         ValueError, needles=("model", "an nn.Module", "but got int")),
    Case(f"{CKPT}.save_expert_parallel_checkpoint", "optimizer_not_an_optimizer",
         lambda: ckpt.save_expert_parallel_checkpoint(nn.Linear(2, 2), [3],
                                                      checkpoint_id="/tmp/unused"),
         ValueError, needles=("optimizers", "torch.optim.Optimizer", "but got int")),
    Case(f"{CKPT}.load_expert_parallel_checkpoint", "checkpoint_not_a_directory",
         lambda: ckpt.load_expert_parallel_checkpoint(nn.Linear(2, 2),
                                                      checkpoint_id="/nonexistent/ckpt"),
         ValueError, needles=("checkpoint_id", "a checkpoint directory", "'/nonexistent/ckpt'")),
    Case(f"{CKPT}.load_expert_parallel_checkpoint", "model_not_a_module",
         lambda: ckpt.load_expert_parallel_checkpoint(None, checkpoint_id="/nonexistent"),
         ValueError, needles=("model", "an nn.Module", "but got NoneType")),
]


CASES = STYLE_CASES + PLACEMENT_CASES + TOOLS_CASES + CKPT_CASES

TestMalformedDistributed = malformed_tests(CASES, "TestMalformedDistributed")


if __name__ == "__main__":
    run_tests()
