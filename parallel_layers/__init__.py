"""parallel_layers: Triton- and CUDA-accelerated parallel layers for PyTorch.

Importing never fails because a kernel could not be built: ops fall back to their torch reference
with one warning that says why.
"""
from . import ops
from .mesh import ParallelMesh
from .optim import FusedAdamW, FusedSGD
from .tensor_parallel import (ColumnParallelLinear, RNGStatesTracker, RowParallelLinear, VocabParallelEmbedding,
                              allreduce_sequence_parallel_grads, parallelize, tensor_parallel_rng_tracker,
                              vocab_parallel_cross_entropy)

__version__ = "0.1.0"

__all__ = ["ops", "ParallelMesh", "FusedAdamW", "FusedSGD", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "parallelize",
           "allreduce_sequence_parallel_grads", "RNGStatesTracker", "tensor_parallel_rng_tracker", "__version__"]
