"""Inductor support for the torch_moe ops (counterpart of ``torch/_inductor``).

This package will hold the lowerings registered at import time (``lowering.py``) and the grouped
GEMM templates (``kernel/``) that make ``torch.compile`` of an MoE layer whole-graph and fused.
"""
