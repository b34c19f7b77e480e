"""Distributed Mixture-of-Experts on ``torch.distributed`` (counterpart of ``torch.distributed``).

This package will hold the expert-parallel API: DTensor sharding strategies for the torch_moe
ops (``tensor/_ops/``), ParallelStyles for experts (``tensor/parallel/``), the all-to-all token
dispatcher, expert placement, checkpoint resharding and the cost model (``_tools/``).
"""
