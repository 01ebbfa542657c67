"""FP8 training: linear layers whose GEMMs run in FP8 (E4M3 forward, E5M2 gradients), their tensor-parallel
versions, and the scaling recipes (per-tensor current and delayed, per-row, DeepSeek-V3 blocks).

The cast kernels are ``parallel_layers.ops.fp8_cast``; the scaling rules are in :mod:`.recipes`.
"""
from .linear import FP8Linear
from .parallel import FP8ColumnParallelLinear, FP8RowParallelLinear
from .recipes import SCALINGS, DelayedScaling, FP8Recipe, Quantized, quantize, scale_from_amax

__all__ = ["FP8Linear", "FP8ColumnParallelLinear", "FP8RowParallelLinear", "FP8Recipe", "DelayedScaling",
           "Quantized", "quantize", "scale_from_amax", "SCALINGS"]
