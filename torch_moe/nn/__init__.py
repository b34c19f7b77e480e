"""Neural-network building blocks for Mixture-of-Experts (counterpart of ``torch.nn``)."""

from torch_moe.nn import functional  # noqa: F401

__all__ = ["functional"]
