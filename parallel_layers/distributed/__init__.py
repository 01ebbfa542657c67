"""Thin, version-proof wrappers over torch.distributed (c10d). We never write our own transport: on gloo,
reduce-scatter and all-gather are rings of c10d sends and receives (``ring``), since gloo only emulates them."""
from . import collectives, ring

__all__ = ["collectives", "ring"]
