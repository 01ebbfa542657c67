"""parallel_layers: Triton- and CUDA-accelerated parallel layers for PyTorch.

Importing never fails because a kernel could not be built: ops fall back to their torch reference
with one warning that says why.
"""
from . import ops
from .mesh import ParallelMesh
from .optim import FusedAdamW, FusedSGD

__version__ = "0.1.0"

__all__ = ["ops", "ParallelMesh", "FusedAdamW", "FusedSGD", "__version__"]
