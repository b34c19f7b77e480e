"""Distributed Mixture-of-Experts on ``torch.distributed`` (counterpart of ``torch.distributed``).

* ``tensor``: DTensor sharding strategies for every torch_moe op (``tensor/_ops/``, registered by
  ``import torch_moe.distributed.tensor``) and token-parallel execution of ``moe_ffn`` / ``MoE``
  on DTensors (``tensor/_token_parallel.py``).

Expert parallelism (ParallelStyles, the all-to-all token dispatcher, expert placement,
checkpoint resharding) and the cost model come next.
"""
