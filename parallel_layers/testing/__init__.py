"""Test utilities: a pool of real worker processes joined by a gloo process group."""
from .workers import RankFailure, WorkerPool, cached_mesh

__all__ = ["WorkerPool", "RankFailure", "cached_mesh"]
