"""Tensor-parallel FP8 linear layers: :class:`ColumnParallelLinear` / :class:`RowParallelLinear` with FP8 GEMMs.

Same shards, arguments and ``from_dense`` as the layers they extend; the GEMMs are :class:`.FP8Linear`'s. The
rule that makes them equal to the one-process FP8 model: a tensor sharded over the TP group is scaled as one
tensor, so its block amaxes are max-all-reduced over the group wherever a scaling block spans the sharded
dimension (:func:`.recipes.quantize`). Per layer:

=========================  =============================  ==================================================
tensor                     column-parallel                row-parallel
=========================  =============================  ==================================================
input                      whole (replicated); under       columns sharded ``[.., in/tp]``: reduced
                           sequence parallelism rows
                           sharded: reduced, then the
                           FP8 bytes are all-gathered
weight                     rows sharded ``[out/tp, in]``   columns sharded ``[out, in/tp]``
output gradient            columns sharded ``[.., out/tp]`` whole (after the output's all-reduce / gather)
=========================  =============================  ==================================================

A tensor that is whole on every rank needs no reduction: every rank computes the one-process amax itself.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, check_sequence_input
from ..tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .linear import FP8LinearFunction, FP8Mixin, FP8Plan
from .recipes import FP8Recipe


def _share_parameters(layer, module):
    """``layer`` (built on meta with ``module``'s sizes) takes ``module``'s parameter objects (their flags too)."""
    layer.weight = module.weight
    layer.bias = module.bias
    return layer


class FP8ColumnParallelLinear(FP8Mixin, ColumnParallelLinear):
    """:class:`ColumnParallelLinear` with FP8 GEMMs (``recipe``, ``out_dtype``, ``backend`` as FP8Linear).
    ``activation`` is applied to the GEMM's output (not fused into it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group,
                 recipe: Optional[FP8Recipe] = None, out_dtype=None, backend=None, **kwargs):
        super().__init__(in_features, out_features, bias, tp_group=tp_group, **kwargs)
        self.init_fp8(recipe, out_dtype, backend, kwargs.get("device"))

    @classmethod
    def from_parallel(cls, module: ColumnParallelLinear, **kwargs) -> "FP8ColumnParallelLinear":
        """An FP8 twin of the column-parallel ``module``, sharing its parameters."""
        layer = cls(module.in_features, module.out_features, module.bias is not None, tp_group=module.tp_group,
                    gather_output=module.gather_output, sequence_parallel=module.sequence_parallel,
                    activation=module.activation, dtype=module.weight.dtype, device="meta",
                    input_gathered=module.input_gathered, **kwargs)
        _share_parameters(layer, module)
        layer.init_fp8(layer.recipe, layer.out_dtype, layer.backend, module.weight.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        self._check_input(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{name}: input has last dimension {x.shape[-1]}, expected "
                             f"in_features={self.in_features} (input shape {tuple(x.shape)})")
        plan = FP8Plan(self.recipe, self.fp8_states, self.out_dtype, self.backend,
                       weight_group=self.tp_group, weight_shard_dim=0,
                       grad_group=self.tp_group, grad_shard_dim=1, row_group=self.row_group,
                       weight_q=self.fp8_gathered_weight)
        if self.sequence_parallel:
            check_sequence_input(name, x, self.tp_size, "")
            plan.input_group, plan.input_shard_dim, plan.seq_group = self.tp_group, 0, self.tp_group
        elif not self.input_gathered:
            plan.dgrad_allreduce_group = self.tp_group  # the input is whole: its gradient sums over the group
        y = FP8LinearFunction.apply(x, self.weight, self.bias, plan, self.fp8_nonfinite)
        if self.activation is not None:
            y = F.gelu(y) if self.activation == "gelu" else F.silu(y)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y

    @classmethod
    def from_dense(cls, module, *, tp_group, **kwargs) -> "FP8ColumnParallelLinear":
        layer = super().from_dense(module, tp_group=tp_group, **kwargs)
        layer.init_fp8(layer.recipe, layer.out_dtype, layer.backend, module.weight.device)
        return layer


class FP8RowParallelLinear(FP8Mixin, RowParallelLinear):
    """:class:`RowParallelLinear` with FP8 GEMMs (``recipe``, ``out_dtype``, ``backend`` as FP8Linear)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group,
                 recipe: Optional[FP8Recipe] = None, out_dtype=None, backend=None, **kwargs):
        super().__init__(in_features, out_features, bias, tp_group=tp_group, **kwargs)
        self.init_fp8(recipe, out_dtype, backend, kwargs.get("device"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        self._check_input(x)
        expected = self.in_features_per_partition if self.input_is_parallel else self.in_features
        if x.shape[-1] != expected:
            raise ValueError(f"{name}: input has last dimension {x.shape[-1]}, expected {expected} "
                             f"(input_is_parallel={self.input_is_parallel}, input shape {tuple(x.shape)})")
        if self.sequence_parallel:
            check_sequence_input(name, x, self.tp_size, "dim 1 of the input, reduce-scattered over the TP group")
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        # The output gradient reaches the GEMM whole (the reduction's backward is an identity or an all-gather).
        plan = FP8Plan(self.recipe, self.fp8_states, self.out_dtype, self.backend,
                       input_group=self.tp_group, input_shard_dim=1,
                       weight_group=self.tp_group, weight_shard_dim=1, row_group=self.row_group,
                       weight_q=self.fp8_gathered_weight)
        y = FP8LinearFunction.apply(x, self.weight, None, plan, self.fp8_nonfinite)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, dim=1)
        elif self.tp_size > 1:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    @classmethod
    def from_parallel(cls, module: RowParallelLinear, **kwargs) -> "FP8RowParallelLinear":
        """An FP8 twin of the row-parallel ``module``, sharing its parameters."""
        layer = cls(module.in_features, module.out_features, module.bias is not None, tp_group=module.tp_group,
                    input_is_parallel=module.input_is_parallel, sequence_parallel=module.sequence_parallel,
                    dtype=module.weight.dtype, device="meta", **kwargs)
        _share_parameters(layer, module)
        layer.init_fp8(layer.recipe, layer.out_dtype, layer.backend, module.weight.device)
        return layer

    @classmethod
    def from_dense(cls, module, *, tp_group, **kwargs) -> "FP8RowParallelLinear":
        layer = super().from_dense(module, tp_group=tp_group, **kwargs)
        layer.init_fp8(layer.recipe, layer.out_dtype, layer.backend, module.weight.device)
        return layer


__all__ = ["FP8ColumnParallelLinear", "FP8RowParallelLinear"]
