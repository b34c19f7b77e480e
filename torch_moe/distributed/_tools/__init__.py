"""Cost model and planner for Mixture-of-Experts training (counterpart of
``torch.distributed._tools``: ``runtime_estimator``, ``mem_tracker``, ``ilp_utils``).

* ``device_profiles``: peak and achieved performance of H100, H200, B200, MI300X and of the
  local CPU, with sources.
* ``gemm_cost``: grouped expert GEMMs from per-expert token counts (tile quantisation,
  efficiency curves, the set-up of each distinct GEMM shape), elementwise bytes at model and
  hidden width, quantize kernels, page faults of fresh host allocations.
* ``comm_cost``: all-to-all traffic of plain / dedup / node-limited dispatch and alpha-beta
  times over intra- and inter-node links; ring collectives of FSDP / ZeRO.
* ``memory_cost``: model states by sharding, saved activations by recompute and precision.
* ``cost_model``: one MoE layer forward + backward on the slowest rank, with chunked overlap.
* ``planner``: whole models (DeepSeek-V3, Mixtral 8x7B presets), strategies ranked by predicted
  step time under the memory limit, with a breakdown table.
* ``calibrate``: measure the local machine into a profile from microbenchmarks only (``torch.mm``
  curves and the set-up of a new GEMM shape, per-call and per-layer stand-ins, elementwise ATen
  kernels, copy bandwidth, page faults, gloo all-to-all and its overlap with GEMMs), at shapes
  disjoint from the validated ones.

``benchmarks/cost_model_validation.py`` checks the model out of sample against torch_moe on the
local machine (a fixed held-out set); ``benchmarks/sparsity_sweep.py`` sweeps one layer shape.

Print the DeepSeek-V3 and Mixtral plans with
``python -c "from torch_moe.distributed._tools import planner; planner.main()"``.
"""

from torch_moe.distributed._tools.calibrate import calibrate_local
from torch_moe.distributed._tools.cost_model import (
    MoELayerCost,
    MoELayerSpec,
    MoEStrategy,
    expert_counts,
    moe_layer_cost,
    rank_imbalance,
)
from torch_moe.distributed._tools.device_profiles import (
    B200,
    H100,
    H200,
    REFERENCE_CPU,
    MI300X,
    DeviceProfile,
    get_profile,
)
from torch_moe.distributed._tools.memory_cost import (
    ADAMW_BF16,
    ADAMW_BF16_MOMENTS,
    ADAMW_MIXED,
    OptimizerSpec,
)
from torch_moe.distributed._tools.planner import (
    AttentionSpec,
    ClusterSpec,
    ModelSpec,
    Plan,
    StepCost,
    Strategy,
    deepseek_v3,
    estimate_step,
    format_plan,
    mixtral_8x7b,
    plan,
)

__all__ = [
    "ADAMW_BF16",
    "ADAMW_BF16_MOMENTS",
    "ADAMW_MIXED",
    "AttentionSpec",
    "B200",
    "ClusterSpec",
    "DeviceProfile",
    "H100",
    "H200",
    "REFERENCE_CPU",
    "MI300X",
    "ModelSpec",
    "MoELayerCost",
    "MoELayerSpec",
    "MoEStrategy",
    "OptimizerSpec",
    "Plan",
    "StepCost",
    "Strategy",
    "calibrate_local",
    "deepseek_v3",
    "estimate_step",
    "expert_counts",
    "format_plan",
    "get_profile",
    "mixtral_8x7b",
    "moe_layer_cost",
    "plan",
    "rank_imbalance",
]
