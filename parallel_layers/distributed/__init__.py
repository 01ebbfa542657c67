"""Thin, version-proof wrappers over torch.distributed (c10d). We never write our own transport."""
from . import collectives

__all__ = ["collectives"]
