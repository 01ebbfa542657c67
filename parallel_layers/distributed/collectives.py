"""Every collective the library issues goes through here, so one place absorbs torch API drift.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; the GPU machines run torch 2.11, which only has the
old names. Gloo (CPU) and NCCL (GPU) both run these paths.

All functions gather/scatter along dim 0 of contiguous tensors; callers move other dims first.
On gloo (CPU) reduce-scatter and all-gather run as a ring of sends and receives (:mod:`.ring`): gloo only
emulates them, with full-size collectives. They return the same ``(out, work)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import ring

_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place sum (or ``op``) over ``group``; a no-op for a group of one."""
    if world_size(group) == 1:
        return None
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_dim0(tensor: torch.Tensor, group, out: Optional[torch.Tensor] = None,
                    async_op: bool = False):
    """Concatenate every rank's ``tensor`` along dim 0 (rank order). Returns ``out`` (or (out, work))."""
    n = world_size(group)
    tensor = tensor.contiguous()
    if out is None:
        out = torch.empty((n * tensor.shape[0],) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
    if n == 1:
        out.copy_(tensor)
        return (out, None) if async_op else out
    if ring.applies(tensor, group):
        work = ring.all_gather(out, tensor, group, async_op=async_op)
    else:
        work = _all_gather_flat(out, tensor, group=group, async_op=async_op)
    return (out, work) if async_op else out


def reduce_scatter_dim0(tensor: torch.Tensor, group, out: Optional[torch.Tensor] = None,
                        op=dist.ReduceOp.SUM, async_op: bool = False):
    """Sum ``tensor`` over ranks and keep this rank's 1/n slice of dim 0."""
    n = world_size(group)
    tensor = tensor.contiguous()
    if tensor.shape[0] % n:
        raise ValueError(f"reduce_scatter_dim0: dim 0 of size {tensor.shape[0]} does not divide by the "
                         f"group size {n}")
    if out is None:
        out = torch.empty((tensor.shape[0] // n,) + tuple(tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
    if n == 1:
        out.copy_(tensor)
        return (out, None) if async_op else out
    if ring.applies(tensor, group, op):
        work = ring.reduce_scatter(out, tensor, group, async_op=async_op)
    else:
        work = _reduce_scatter_flat(out, tensor, op=op, group=group, async_op=async_op)
    return (out, work) if async_op else out


def broadcast(tensor: torch.Tensor, src_group_rank: int, group):
    if world_size(group) == 1:
        return tensor
    dist.broadcast(tensor, group_src=src_group_rank, group=group)
    return tensor
