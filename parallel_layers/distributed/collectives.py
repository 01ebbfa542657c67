"""Every collective the library issues goes through here, so one place absorbs torch API drift.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; the GPU machines run torch 2.11, which only has the
old names. Gloo (CPU) and NCCL (GPU) both run these paths.

All functions gather/scatter along dim 0 of contiguous tensors; callers move other dims first.
On gloo (CPU) reduce-scatter and all-gather run as a ring of sends and receives (:mod:`.ring`): gloo only
emulates them, with full-size collectives. They return the same ``(out, work)``.

Failures: a collective that fails (a peer timed out, hung or died) raises ``RuntimeError("<op> over <group>
(ranks ..., timeout ...) failed: <the backend's error>")``, from the backend's error; an async one raises
so from ``work.wait()``. The backends' own text (gloo: "Timed out waiting 3000ms for recv") names neither
the group nor the operation, and a rank is in several groups at once. The description is built only when
something failed: the success path adds a ``try`` and, for ``async_op=True``, one small wrapper object.
"""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..mesh import group_timeout
from . import ring

# torch's own flat collectives, under the name this torch has (public: the benchmarks time ours against them)
torch_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_size(group) -> int:
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def rank(group) -> int:
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)


# ----------------------------------------------------------------------------------------- failures
_RANKS_SHOWN = 16     # a group's ranks listed in full up to this many; beyond, the first ones and the count


def _ranks_text(group) -> str:
    try:
        ranks = dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a group c10d does not know (made by hand): its size still tells
        return f"ranks unknown, size {group.size()}"
    if len(ranks) <= _RANKS_SHOWN:
        return f"ranks {ranks}"
    return f"ranks [{', '.join(map(str, ranks[:_RANKS_SHOWN]))}, ...] ({len(ranks)} ranks)"


def _timeout_text(group) -> str:
    timeout: Optional[datetime.timedelta] = group_timeout(group)
    return "timeout unknown" if timeout is None else f"timeout {timeout.total_seconds():g} s"


def _world_group():
    """The world group's ProcessGroup object (c10d has no public getter for it)."""
    return dist.distributed_c10d._get_default_group()


def _group_name(group) -> str:
    """The group's ``group_desc`` (``ParallelMesh`` sets one per group), else what kind of group it is."""
    if dist.is_initialized() and group is _world_group():
        return "the world group"
    desc = getattr(group, "group_desc", None)        # a Python group may never have been given one
    if desc and desc not in ("undefined", "default_pg"):
        return desc
    try:
        backend = dist.get_backend(group)
    except Exception:  # noqa: BLE001 - a group c10d does not know
        backend = group.name() if hasattr(group, "name") else type(group).__name__
    return f"an unnamed {backend} group"


def describe_group(group) -> str:
    """``group`` for an error message: e.g. "ParallelMesh dp group [0, 1] (ranks [0, 1], timeout 3 s)".
    None is the world group. Never raises: it runs while another error is on its way up."""
    if group is None:
        if not dist.is_initialized():
            return "the world group (torch.distributed not initialised)"
        group = _world_group()
    try:
        return f"{_group_name(group)} ({_ranks_text(group)}, {_timeout_text(group)})"
    except Exception as exc:  # noqa: BLE001 - the original error matters more than this description
        return f"{type(group).__name__} group (not describable: {exc})"


def _failure(what: str, group, exc: BaseException, op=None) -> RuntimeError:
    """The error to raise ``from exc``: the operation and the group it ran over, then the backend's text."""
    if op is not None:
        what = f"{what} ({getattr(op, 'name', op)})"
    return RuntimeError(f"{what} over {describe_group(group)} failed: {exc}")


class NamedWork:
    """What an ``async_op=True`` collective returns: the backend's work, whose ``wait()`` failure is
    re-raised naming the operation and the group (see the module docstring)."""

    __slots__ = ("work", "what", "group", "op")

    def __init__(self, work, what: str, group, op=None):
        self.work, self.what, self.group, self.op = work, what, group, op

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        try:
            return self.work.wait() if timeout is None else self.work.wait(timeout)
        except RuntimeError as exc:
            raise _failure(self.what, self.group, exc, self.op) from exc

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def __getattr__(self, name):       # anything else a backend's work offers (get_future, ...)
        if name in NamedWork.__slots__:  # not set yet (a copy being built): no recursion into self.work
            raise AttributeError(name)
        return getattr(self.work, name)


def _named(work, what: str, group, op=None):
    return None if work is None else NamedWork(work, what, group, op)


# ----------------------------------------------------------------------------------------- collectives
# Only RuntimeError is re-raised with the group: it is what c10d raises when a peer fails or times out
# (DistBackendError and friends derive from it); ValueError / TypeError are about the arguments and
# already say what is wrong with them.

def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place sum (or ``op``) over ``group``; a no-op for a group of one."""
    if world_size(group) == 1:
        return None
    try:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _failure("all_reduce", group, exc, op) from exc
    return _named(work, "all_reduce", group, op) if async_op else work


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
    try:
        if ring.applies(tensor, group):
            work = ring.all_gather(out, tensor, group, async_op=async_op)
        else:
            work = torch_all_gather_flat(out, tensor, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _failure("all_gather_dim0", group, exc) from exc
    return (out, _named(work, "all_gather_dim0", group)) if async_op else out


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
    try:
        if ring.applies(tensor, group, op):
            work = ring.reduce_scatter(out, tensor, group, async_op=async_op)
        else:
            work = torch_reduce_scatter_flat(out, tensor, op=op, group=group, async_op=async_op)
    except RuntimeError as exc:
        raise _failure("reduce_scatter_dim0", group, exc, op) from exc
    return (out, _named(work, "reduce_scatter_dim0", group, op)) if async_op else out


def broadcast(tensor: torch.Tensor, src_group_rank: int, group):
    if world_size(group) == 1:
        return tensor
    try:
        dist.broadcast(tensor, group_src=src_group_rank, group=group)
    except RuntimeError as exc:
        raise _failure(f"broadcast from group rank {src_group_rank}", group, exc) from exc
    return tensor


def all_to_all_dim0(tensor: torch.Tensor, group) -> torch.Tensor:
    """Split ``tensor`` (contiguous) into ``world_size(group)`` equal parts along dim 0, send part ``j`` to
    group rank ``j``, and return the parts received, in rank order, concatenated along dim 0."""
    if world_size(group) == 1:
        return tensor
    out = torch.empty_like(tensor)
    try:
        dist.all_to_all_single(out, tensor.contiguous(), group=group)
    except RuntimeError as exc:
        raise _failure("all_to_all", group, exc) from exc
    return out


def all_to_all_uneven(tensor: torch.Tensor, input_split_sizes: Sequence[int], output_split_sizes: Sequence[int],
                      group) -> torch.Tensor:
    """Send ``input_split_sizes[j]`` consecutive rows (dim 0) of ``tensor`` to group rank ``j``, and return
    the rows received, ``output_split_sizes[i]`` from group rank ``i``, in rank order, concatenated along
    dim 0. The pairs must agree (rank ``i``'s ``input_split_sizes[j]`` is rank ``j``'s
    ``output_split_sizes[i]``); any size may be 0."""
    n = world_size(group)
    ins, outs = [int(s) for s in input_split_sizes], [int(s) for s in output_split_sizes]
    if len(ins) != n or len(outs) != n or min(ins + outs, default=0) < 0 or sum(ins) != tensor.shape[0]:
        raise ValueError(f"all_to_all_uneven: input_split_sizes {ins} and output_split_sizes {outs} must be "
                         f"{n} sizes >= 0 each (one per rank of the group), the input ones summing to dim 0 of the "
                         f"tensor ({tensor.shape[0]})")
    if n == 1:
        if outs != ins:
            raise ValueError(f"all_to_all_uneven: in a group of one rank the rows sent are the rows received; got "
                             f"input_split_sizes {ins} and output_split_sizes {outs}")
        return tensor
    out = tensor.new_empty((sum(outs),) + tuple(tensor.shape[1:]))
    try:
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=outs, input_split_sizes=ins,
                               group=group)
    except RuntimeError as exc:
        raise _failure("all_to_all_uneven", group, exc) from exc
    return out
