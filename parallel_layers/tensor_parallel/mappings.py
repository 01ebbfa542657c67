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
size; the error names the dimension and the sizes. The forward collectives check that every rank's input
has the same shape (:mod:`.agreed_shapes`: gloo would kill the process otherwise) with no extra
collective while the shape stays the same; the backward ones take gradients of shapes already agreed.

Under ``torch.compile`` each function runs :class:`_Traced` instead: the same forward and backward, the
collectives from ``torch.distributed._functional_collectives`` (which dynamo traces and inductor
schedules), the ranks' shapes not checked (the check reads a flag on the host, a graph break; a compiled
region is guarded on its input shapes, but nothing compares them across ranks). Eager calls take the
Functions above, unchanged.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
import torch.distributed._functional_collectives as funcol

from ..distributed import collectives as C
from .agreed_shapes import checked


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


# ---------------------------------------------------------------------- forward collectives, shapes checked
# Each sends the agreed shape's elements plus one flag element (see .agreed_shapes); the copy into the
# flagged buffer replaces the copy the unchecked version makes anyway (clone / contiguous), except for
# the all-gather, whose result is copied once more to drop the flags.

def _leading(buf: torch.Tensor, shape: Tuple[int, ...], offset: int = 0) -> torch.Tensor:
    """``buf``'s elements ``[offset, offset + prod(shape))`` as a tensor of ``shape`` that shares its storage
    but is not a view: the output of an autograd Function that is a view of a buffer made inside it cannot
    be changed in place, and models do (Falcon adds its attention output into the MLP's in place)."""
    return buf.new_empty(0).set_(buf.untyped_storage(), buf.storage_offset() + offset, shape)


def _flagged_all_reduce(x: torch.Tensor, agreed: Tuple[int, ...], matches: bool, group):
    n = math.prod(agreed)
    if matches:
        buf = torch.cat((x.reshape(-1), x.new_zeros(1)))
    else:
        buf = x.new_zeros(n + 1)
        buf[n] = 1
    C.all_reduce(buf, group)
    return _leading(buf, agreed), buf[n].item()


def _flagged_gather(x: torch.Tensor, dim: int, agreed: Tuple[int, ...], matches: bool, group):
    n, dim = C.world_size(group), dim % len(agreed)
    front_shape = (agreed[dim],) + agreed[:dim] + agreed[dim + 1:]
    size = math.prod(agreed)
    buf = torch.empty(size + 1, dtype=x.dtype, device=x.device)
    if matches:
        buf[:size].view(front_shape).copy_(x.movedim(dim, 0))
        buf[size] = 0
    else:
        buf.zero_()
        buf[size] = 1
    out = C.all_gather_dim0(buf, group).view(n, size + 1)
    data = out[:, :size].reshape((n * agreed[dim],) + front_shape[1:])
    return (data.movedim(0, dim) if dim else data), out[:, size].sum().item()


def _flagged_reduce_scatter(x: torch.Tensor, dim: int, agreed: Tuple[int, ...], matches: bool, group):
    n, dim = C.world_size(group), dim % len(agreed)
    front_shape = (agreed[dim],) + agreed[:dim] + agreed[dim + 1:]
    chunk = math.prod(agreed) // n
    buf = torch.empty(n, chunk + 1, dtype=x.dtype, device=x.device)    # every rank's chunk with a flag
    if matches:
        buf[:, :chunk].view((n, agreed[dim] // n) + front_shape[1:]).copy_(
            x.movedim(dim, 0).unflatten(0, (n, agreed[dim] // n)))
        buf[:, chunk] = 0
    else:
        buf.zero_()
        buf[:, chunk] = 1
    out = C.reduce_scatter_dim0(buf.view(-1), group)
    data = out[:chunk].view((agreed[dim] // n,) + front_shape[1:])
    return (data.movedim(0, dim) if dim else data), out[chunk].item()


def _checked_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if C.world_size(group) == 1:
        return x
    return checked(("all_reduce",), x, group, "all-reduce",
                   lambda t, agreed, ok: _flagged_all_reduce(t, agreed, ok, group),
                   lambda t: _all_reduce(t, group))


def _checked_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if C.world_size(group) == 1:
        return x
    dim = dim % x.dim()
    return checked(("all_gather", dim), x, group, f"all-gather of dimension {dim}",
                   lambda t, agreed, ok: _flagged_gather(t, dim, agreed, ok, group),
                   lambda t: _gather(t, dim, group))


def _checked_reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    if C.world_size(group) == 1:
        return x
    dim = dim % x.dim()
    # (a size that does not divide by the group differs from the agreed one: the shapes are exchanged
    # first, so every rank raises, the mismatch or the divisibility error, rather than one alone)
    return checked(("reduce_scatter", dim), x, group, f"reduce-scatter of dimension {dim}",
                   lambda t, agreed, ok: _flagged_reduce_scatter(t, dim, agreed, ok, group),
                   lambda t: _reduce_scatter(t, dim, group))


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
        return _checked_all_reduce(x, group)

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
        return _checked_gather(x, -1, group)

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
        return _checked_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _checked_reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


# ---------------------------------------------------------------------- under torch.compile
# torch 2.13 names the flat functional collectives *_single; torch 2.11 has only *_tensor
_fc_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_fc_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _traced_collective(kind: str, x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """One side of a pattern, traceable by dynamo: ``kind`` is "identity", "all_reduce", "split",
    "gather" or "reduce_scatter" (along ``dim``)."""
    if kind == "identity" or C.world_size(group) == 1:
        return x
    if kind == "split":
        return _split(x, dim, group)
    dim = dim % x.dim()
    if kind == "all_reduce":
        return funcol.all_reduce(x, "sum", group)
    if kind == "gather":
        return _fc_all_gather(x.contiguous(), dim, group)
    n = C.world_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"sequence parallel reduce-scatter: dimension {dim} has size {x.shape[dim]}, which "
                         f"does not divide by the group size {n}")
    return _fc_reduce_scatter(x.contiguous(), "sum", dim, group)


class _Traced(torch.autograd.Function):
    """Every pattern of the table for ``torch.compile``: ``forward`` then ``backward`` of ``_traced_collective``."""

    @staticmethod
    def forward(ctx, x, group, dim, forward, backward):
        ctx.group, ctx.dim, ctx.backward = group, dim, backward
        return _traced_collective(forward, x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _traced_collective(ctx.backward, grad, ctx.dim, ctx.group), None, None, None, None


_compiling = torch.compiler.is_compiling


def copy_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, -1, "identity", "all_reduce")
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, -1, "all_reduce", "identity")
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, -1, "split", "gather")
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, -1, "gather", "split")
    return _GatherFromTP.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, dim, "split", "gather")
    return _ScatterToSP.apply(x, group, dim)


def gather_from_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1,
                                         tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, dim, "gather", "reduce_scatter" if tensor_parallel_output_grad else "split")
    return _GatherFromSP.apply(x, group, dim, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    if _compiling():
        return _Traced.apply(x, group, dim, "reduce_scatter", "gather")
    return _ReduceScatterToSP.apply(x, group, dim)


__all__ = ["copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
           "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
           "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region"]
