"""parallel_layers: Triton- and CUDA-accelerated parallel layers for PyTorch.

Importing never fails because a kernel could not be built: ops fall back to their torch reference
with one warning that says why.
"""
from . import _checkout, ops, pipeline  # noqa: F401  (_checkout: parallel_layers.triton_kernels in place)
from .amp import DynamicLossScaler, PrecisionPolicy, clip_grad_norm_
from .composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from .composition.parallel3d import Parallel3D
from .cpu_affinity import bind_rank_to_cores
from .cpu_allocator import retain_freed_memory
from .data_parallel import DataParallel, SingleProcessDataParallel, SyncBatchNorm, convert_sync_batchnorm
from .mesh import ParallelMesh
from .optim import FusedAdamW, FusedSGD
from .tensor_parallel import (
                              ColumnParallelLinear,
                              RNGStatesTracker,
                              RowParallelLinear,
                              VocabParallelEmbedding,
                              allreduce_sequence_parallel_grads,
                              parallelize,
                              tensor_parallel_rng_tracker,
                              vocab_parallel_cross_entropy,
)
from .zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer

__version__ = "0.1.0"

__all__ = ["ops", "pipeline", "ParallelMesh", "FusedAdamW", "FusedSGD", "ColumnParallelLinear", "RowParallelLinear",
           "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "parallelize",
           "allreduce_sequence_parallel_grads", "RNGStatesTracker", "tensor_parallel_rng_tracker", "DataParallel",
           "ZeroOptimizer", "ZeroStage3", "ZeroStage3Optimizer", "PrecisionPolicy", "DynamicLossScaler",
           "clip_grad_norm_",
           "retain_freed_memory", "bind_rank_to_cores", "Parallel3D", "OptimizerConfig", "PipelineConfig",
           "DataParallelConfig", "PrecisionConfig", "SyncBatchNorm", "convert_sync_batchnorm",
           "SingleProcessDataParallel",
           "__version__"]
