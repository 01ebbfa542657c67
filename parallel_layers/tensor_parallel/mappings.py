"""Communication patterns of tensor parallelism, each an autograd Function (Megatron-LM's idea).

Forward and backward of one pattern sit side by side, so a reader can check that each backward is
the adjoint of its forward:

=============================================  ==========================  ==========================
pattern                                        forward                     backward
=============================================  ==========================  ==========================
copy_to_tensor_parallel_region                 identity                    all-reduce
reduce_from_tensor_parallel_region             all-reduce                  identity
scatter_to_tensor_parallel_region              keep my slice of last dim   all-gather last dim
gather_from_tensor_parallel_region             all-gather last dim         keep my slice of last dim
scatter_to_sequence_parallel_region            keep my slice of seq dim    all-gather seq dim
gather_from_sequence_parallel_region           all-gather seq dim          reduce-scatter seq dim (*)
reduce_scatter_to_sequence_parallel_region     reduce-scatter seq dim      all-gather seq dim
=============================================  ==========================  ==========================

(*) when the gathered activations feed a tensor-parallel region, every rank's gradient is a partial
sum, so the backward reduce-scatters; otherwise (``tensor_parallel_output_grad=False``) it only slices.

Every function takes the group explicitly. Sizes along the split dimension must divide by the group
size; the error names the dimension and the sizes.
"""
from __future__ import annotations

import torch

from ..distributed import collectives as C


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = C.world_size(group)
    if n == 1:
        return x
    size = x.shape[dim]
    if size % n:
        raise ValueError(f"tensor parallel split: dimension {dim} has size {size}, which does not divide by "
                         f"the group size {n}")
    return x.narrow(dim, C.rank(group) * (size // n), size // n).contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = C.world_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    front = x.movedim(dim, 0).contiguous()
    out = C.all_gather_dim0(front, group)
    return out.movedim(0, dim) if dim else out


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = C.world_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % n:
        raise ValueError(f"sequence parallel reduce-scatter: dimension {dim} has size {x.shape[dim]}, which "
                         f"does not divide by the group size {n}")
    front = x.movedim(dim, 0).contiguous()
    out = C.reduce_scatter_dim0(front, group)
    return out.movedim(0, dim) if dim else out


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if C.world_size(group) == 1:
        return x
    x = x.contiguous().clone()  # never all-reduce a tensor autograd may still need
    C.all_reduce(x, group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, tensor_parallel_output_grad):
        ctx.group, ctx.dim, ctx.tp_grad = group, dim, tensor_parallel_output_grad
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _ScatterToSP.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    return _GatherFromSP.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    return _ReduceScatterToSP.apply(x, group, dim)


__all__ = ["copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]
