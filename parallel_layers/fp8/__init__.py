"""FP8 training: linear layers whose GEMMs run in FP8 (E4M3 forward, E5M2 gradients), their tensor-parallel
versions, the scaling recipes (per-tensor current and delayed, per-row, DeepSeek-V3 blocks), and the conversion
of a model's linear layers (:func:`convert_to_fp8`, what ``PrecisionConfig(fp8=...)`` runs in ``Parallel3D``).

The cast kernels are ``parallel_layers.ops.fp8_cast``; the scaling rules are in :mod:`.recipes`.
"""
from .convert import convert_to_fp8, default_fp8_modules, delayed_scaling_states, fp8_layers
from .linear import FP8Linear
from .parallel import FP8ColumnParallelLinear, FP8RowParallelLinear
from .recipes import SCALINGS, DelayedScaling, FP8Recipe, Quantized, commit_delayed, quantize, scale_from_amax

__all__ = ["FP8Linear", "FP8ColumnParallelLinear", "FP8RowParallelLinear", "FP8Recipe", "DelayedScaling",
           "Quantized", "quantize", "scale_from_amax", "commit_delayed", "SCALINGS", "convert_to_fp8",
           "default_fp8_modules", "delayed_scaling_states", "fp8_layers"]
