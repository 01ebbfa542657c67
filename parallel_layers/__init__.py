"""parallel_layers: Triton- and CUDA-accelerated parallel layers for PyTorch.

Importing never fails because a kernel could not be built: ops fall back to their torch reference
with one warning that says why.

The top level holds what a training script builds a run from: ``Parallel3D`` and its four config groups,
the mesh, the reference GPT and a model family's ``Recipe``, the tensor-parallel layers and
``parallelize``, the mixture-of-experts layers, data parallelism and ZeRO, the fused optimizers, mixed
precision, the pipeline engine and checkpoint/resume. Everything else lives in its own module
(``parallel_layers.cpu_allocator``, ``parallel_layers.amp.clip``, ``parallel_layers.tensor_parallel.random``, ...).
"""
from . import _checkout, ops  # noqa: F401  (_checkout: parallel_layers.triton_kernels in place)
from .amp import DynamicLossScaler, PrecisionPolicy
from .composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from .composition.parallel3d import Parallel3D
from .data_parallel import DataParallel, SingleProcessDataParallel, SyncBatchNorm, convert_sync_batchnorm
from .families import Recipe
from .mesh import ParallelMesh
from .models import GPT, GPTConfig
from .moe import ExpertParallelMoE, MoELayer
from .optim import FusedAdamW, FusedSGD
from .pipeline import PipelineEngine
from .resilience import AsyncCheckpointer, resume
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, parallelize
from .zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer

__version__ = "0.1.0"

__all__ = [
    # 3D parallelism and its settings
    "Parallel3D", "OptimizerConfig", "PipelineConfig", "DataParallelConfig", "PrecisionConfig", "ParallelMesh",
    # models
    "GPT", "GPTConfig", "Recipe",
    # tensor parallel
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallelize",
    # mixture of experts
    "MoELayer", "ExpertParallelMoE",
    # data parallel and ZeRO
    "DataParallel", "SingleProcessDataParallel", "SyncBatchNorm", "convert_sync_batchnorm",
    "ZeroOptimizer", "ZeroStage3", "ZeroStage3Optimizer",
    # optimizers and precision
    "FusedAdamW", "FusedSGD", "DynamicLossScaler", "PrecisionPolicy",
    # pipeline, checkpoints
    "PipelineEngine", "AsyncCheckpointer", "resume",
    "__version__",
]
