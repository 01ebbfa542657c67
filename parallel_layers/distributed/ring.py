"""Reduce-scatter and all-gather on gloo as a ring of c10d sends and receives.

Why: gloo has no native reduce-scatter or all-gather into one tensor; torch emulates both with
full-size collectives (docs/architecture.md, "Known traps"), so every rank moves and reduces the whole buffer. A ring
moves ``(n - 1) / n`` of it per rank and adds only what it receives. Measured on 2 CPU cores
(``python -m benchmarks.zero``, rows ``collective_*``, 2 ranks, 25 MB): reduce-scatter about 2.5-2.8x
faster than ``reduce_scatter_tensor``, all-gather about 1.3x faster than ``all_gather_into_tensor``.
NCCL has both natively and never comes here.

Still c10d only: ``isend``/``irecv`` on the caller's group, its timeout, its error on a dead peer.

Asynchrony: a ring is ``n - 1`` dependent steps, which one c10d work cannot express, so every ring of a
group runs on one worker thread of that group, in submission order (the order every rank submits in,
like any collective), and the caller gets a :class:`RingWork` to ``wait()`` on. The thread blocks in
c10d waits and torch ops, which release the GIL, so it overlaps the caller's compute like gloo's own
threads do. Sends and receives use their own tag, apart from the pipeline's point-to-point messages.
"""
from __future__ import annotations

import os
import threading
from typing import Callable, Dict

import torch
import torch.distributed as dist

from .worker import BackgroundWork, OrderedWorker

RING_TAG = 0x5249   # "RI": apart from the pipeline's tags (0, 7 and 8) on a group both might share


# What an async ring returns: ``wait()`` re-raises the ring's error naming the collective.
RingWork = BackgroundWork


_workers: Dict[int, OrderedWorker] = {}
_workers_lock = threading.Lock()
# A forked child (a DataLoader worker, say) inherits the table but not the threads: start afresh there.
os.register_at_fork(after_in_child=_workers.clear)


def _worker(group) -> OrderedWorker:
    """The group's ring thread; after a failure the group's later rings fail at once."""
    key = id(group if group is not None else dist.group.WORLD)
    with _workers_lock:
        if key not in _workers:
            _workers[key] = OrderedWorker("parallel_layers-ring")
        return _workers[key]


def applies(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> bool:
    """Whether a collective on ``tensor`` over ``group`` takes the ring: gloo, CPU tensors, a sum."""
    return (tensor.device.type == "cpu" and op == dist.ReduceOp.SUM
            and dist.get_backend(group) == "gloo" and dist.get_world_size(group) > 1)


def _exchange(send: torch.Tensor, recv: torch.Tensor, nxt: int, prv: int, group) -> None:
    """Send to the next rank and receive from the previous one (posted together: no rank waits on a
    send its neighbour has not yet matched)."""
    s = dist.isend(send, nxt, group=group, tag=RING_TAG)
    r = dist.irecv(recv, prv, group=group, tag=RING_TAG)
    r.wait()
    s.wait()


def _reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """``out`` = the sum over ranks of chunk ``rank`` of ``tensor`` (flat, ``n`` equal chunks).

    Step ``k``: send the partial sum of chunk ``(r - k - 1) % n`` on, receive the previous rank's partial
    sum of chunk ``(r - k - 2) % n`` and add this rank's own part; after ``n - 1`` steps the partial that
    arrives is chunk ``r`` summed over every other rank."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(r + 1) % n], ranks[(r - 1) % n]
    chunks = tensor.reshape(n, -1)
    flat_out = out.view(-1)
    partial = chunks[(r - 1) % n]           # step 0 sends this rank's own chunk as it is
    spare = [torch.empty_like(chunks[0]), torch.empty_like(chunks[0])] if n > 2 else []
    for k in range(n - 1):
        last = k == n - 2
        landing = flat_out if last else spare[k % 2]
        _exchange(partial, landing, nxt, prv, group)
        landing.add_(chunks[(r - k - 2) % n])
        partial = landing


def _all_gather(out: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """Chunk ``i`` of ``out`` = rank ``i``'s ``tensor``: each step passes on the chunk received last."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    nxt, prv = ranks[(r + 1) % n], ranks[(r - 1) % n]
    chunks = out.view(n, -1)
    if chunks[r].data_ptr() != tensor.data_ptr():
        chunks[r].copy_(tensor.reshape(-1))
    for k in range(n - 1):
        _exchange(chunks[(r - k) % n], chunks[(r - k - 1) % n], nxt, prv, group)


def _run(group, fn: Callable[[], None], what: str, async_op: bool):
    work = _worker(group).submit(fn, what)
    if async_op:
        return work
    work.wait()
    return None


def _check(what: str, out: torch.Tensor, tensor: torch.Tensor, out_numel: int) -> None:
    if out.dtype != tensor.dtype or out.numel() != out_numel or not (out.is_contiguous() and tensor.is_contiguous()):
        raise ValueError(f"ring {what}: output {tuple(out.shape)} {out.dtype} does not fit input "
                         f"{tuple(tensor.shape)} {tensor.dtype} (need {out_numel} elements of the input's dtype, "
                         f"both contiguous)")


def reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Ring reduce-scatter (sum) of contiguous ``tensor`` into contiguous ``out`` (``numel / n``).
    ``tensor`` must stay untouched until the work completes (as for any c10d collective)."""
    n = dist.get_world_size(group)
    if tensor.numel() % n:
        raise ValueError(f"ring reduce-scatter: {tensor.numel()} elements do not split over {n} ranks")
    _check("reduce-scatter", out, tensor, tensor.numel() // n)
    return _run(group, lambda: _reduce_scatter(out, tensor, group),
                f"ring reduce-scatter of {tensor.numel()} {tensor.dtype} elements", async_op)


def all_gather(out: torch.Tensor, tensor: torch.Tensor, group, async_op: bool = False):
    """Ring all-gather of contiguous ``tensor`` into contiguous ``out`` (``n * numel``, rank order)."""
    _check("all-gather", out, tensor, tensor.numel() * dist.get_world_size(group))
    return _run(group, lambda: _all_gather(out, tensor, group),
                f"ring all-gather of {tensor.numel()} {tensor.dtype} elements", async_op)


__all__ = ["RingWork", "RING_TAG", "applies", "reduce_scatter", "all_gather"]
