"""Distributed Mixture-of-Experts on ``torch.distributed`` (counterpart of ``torch.distributed``).

* ``tensor``: DTensor sharding strategies for every torch_moe op (``tensor/_ops/``, registered by
  ``import torch_moe.distributed.tensor``) and token-parallel execution of ``moe_ffn`` / ``MoE``
  on DTensors (``tensor/_token_parallel.py``, which registers them as the DTensor handlers of
  :mod:`torch_moe.nn._subclass_hooks`). ``torch_moe`` imports both as soon as
  ``torch.distributed.tensor`` is imported, so they are in place before any DTensor exists.
* ``placement``: expert placement over expert-parallel ranks, with replicas of hot experts, even
  routing to replicas and rebalancing of expert rows.
* ``_dispatch_plan``: where routed tokens go under expert parallelism and how many copies each
  sends (plain, deduplicated, rank-limited routing), with the analytical traffic model.
* ``dispatch``: the all-to-all expert-parallel FFN (plain, deduplicated, chunked with overlap,
  capacity mode, and two modes without a host read: sync-free capacity mode and the
  ``symm_mem`` backend) with per-rank traffic and load counters, on any device and backend.
* ``parallel``: ``ExpertParallel``, ``ExpertTensorParallel`` and ``TensorParallelExperts``
  ParallelStyles for ``parallelize_module``; ``ExpertParallel`` also with replicas of hot
  experts (``slots_per_rank`` / ``placement``).
* ``replicas``: what a training loop calls on replicated layers: the sum of replica gradients,
  rebalancing from observed loads (weights and optimizer state moved in place), the logical
  weights, and the placement tables for checkpoints.
* ``checkpoint``: ``torch.distributed.checkpoint`` save / load of expert weights across EP
  degrees and placements with replicas (stored as logical experts).
* ``_tools``: the cost model, device profiles and planner.
"""
