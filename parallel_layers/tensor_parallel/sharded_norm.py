"""An RMSNorm over features that tensor parallelism has split: OLMo2's q/k norms.

OLMo2 normalizes the whole query (``heads x head_dim`` features) before splitting it into heads. Under
tp, the column-parallel ``q_proj`` leaves each rank ``1/tp`` of those features, so a plain norm would
take the statistics of this rank's features only. :class:`ShardedRMSNorm` keeps this rank's slice of the
weight (the same rows as the projection's) and all-reduces the sum of squares over tp:

    ``y_local = w_local * x_local / sqrt(sum_over_ranks(sum(x_local ** 2)) / n + eps)``

Backward: the sum of squares is one number per token shared by every rank, and each rank's loss
reaches it only through its own features, so its gradient is summed over tp (forward and backward
all-reduces: ``copy_to(reduce_from(ss))``). The weight's gradient is this rank's slice, whole.

:meth:`ShardedRMSNorm.from_dense` takes a Hugging Face RMSNorm only after checking, on random inputs in
the module's own dtype, that its forward is bit for bit one of the two formulas it implements
(``(w * x_normed).to(dtype)``, OLMo2's and T5's order, or ``w * x_normed.to(dtype)``, Llama's); any
other norm (an offset weight ``1 + w``, a mean subtracted) is refused naming it: the layer never runs a
forward other than the model's own. :func:`rms_norm_reference` is the torch formula, the oracle.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..distributed import collectives as C
from .layers import set_parameter
from .mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region

ORDERS = ("weight_after_cast_back", "cast_back_then_weight")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, order: str,
                       sum_of_squares: Optional[torch.Tensor] = None, features: Optional[int] = None):
    """The RMSNorm of ``x`` over its last dimension in fp32, cast back to ``x``'s dtype in ``order``;
    ``sum_of_squares`` / ``features``: the statistics of the whole (split) dimension, when given."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    if sum_of_squares is None:
        variance = x32.pow(2).mean(-1, keepdim=True)
    else:
        variance = sum_of_squares / features
    normed = x32 * torch.rsqrt(variance + eps)
    if order == "weight_after_cast_back":
        return (weight * normed).to(dtype)
    return weight * normed.to(dtype)


def _eps_of(norm: nn.Module) -> Optional[float]:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, attr, None)
        if isinstance(value, float):
            return value
    return None


def dense_order(norm: nn.Module) -> Optional[str]:
    """Which formula ``norm``'s own forward computes, bit for bit (None: neither)."""
    weight, eps = getattr(norm, "weight", None), _eps_of(norm)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None \
            or len(list(norm.parameters())) != 1:
        return None
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, weight.numel(), generator=gen) * 3).to(weight.dtype).to(weight.device)
    with torch.no_grad():
        want = norm(x)
        for order in ORDERS:
            if torch.equal(rms_norm_reference(x, weight, eps, order), want):
                return order
    return None


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a last dimension split over ``tp_group`` (see the module docstring)."""

    def __init__(self, features: int, eps: float, order: str, tp_group, weight: torch.Tensor):
        super().__init__()
        self.features, self.eps, self.order, self.tp_group = features, eps, order, tp_group
        set_parameter(self, "weight", weight, tensor_parallel=True, partition_dim=0)

    @classmethod
    def from_dense(cls, norm: nn.Module, tp_group, name: str = "norm") -> "ShardedRMSNorm":
        order = dense_order(norm)
        if order is None:
            raise ValueError(f"parallelize: module {name!r} ({type(norm).__name__}) normalizes features that "
                             f"tensor parallelism splits, and its forward is not an RMSNorm this layer "
                             f"reproduces bit for bit (one weight, an eps attribute, x * rsqrt(mean(x^2) + eps) "
                             f"in fp32); train this model with tp=1, or leave the module's attention unsplit")
        tp, rank = C.world_size(tp_group), C.rank(tp_group)
        n = norm.weight.numel()
        if n % tp:
            raise ValueError(f"parallelize: module {name!r} has {n} features, which do not divide by the "
                             f"tensor-parallel size {tp}")
        rows = n // tp
        weight = norm.weight.detach()[rank * rows:(rank + 1) * rows].clone()
        layer = cls(n, _eps_of(norm), order, tp_group, weight)
        layer.weight.requires_grad_(norm.weight.requires_grad)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sum_of_squares = x.to(torch.float32).pow(2).sum(-1, keepdim=True)
        if C.world_size(self.tp_group) > 1:
            sum_of_squares = copy_to_tensor_parallel_region(
                reduce_from_tensor_parallel_region(sum_of_squares, self.tp_group), self.tp_group)
        return rms_norm_reference(x, self.weight, self.eps, self.order, sum_of_squares, self.features)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()} of {self.features} features, eps={self.eps}, tp={C.world_size(self.tp_group)}"


__all__ = ["ShardedRMSNorm", "rms_norm_reference", "dense_order"]
