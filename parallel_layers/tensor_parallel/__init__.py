"""Tensor parallelism: communication patterns, parallel layers, parallel cross entropy."""
from . import mappings

__all__ = ["mappings"]
