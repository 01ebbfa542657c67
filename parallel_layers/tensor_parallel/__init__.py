"""Tensor parallelism: communication patterns, parallel layers, parallel cross entropy, parallelize()."""
from . import mappings
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .layers import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads
from .parallelize import gather_dense_state_dict, parallelize
from .partial_grads import partial_grad_params, sum_partial_grads
from .random import RNGStatesTracker, tensor_parallel_rng_tracker

__all__ = ["mappings", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "allreduce_sequence_parallel_grads", "parallelize",
           "gather_dense_state_dict", "partial_grad_params", "sum_partial_grads",
           "RNGStatesTracker", "tensor_parallel_rng_tracker"]
