"""Measure what a layout really holds and how long its step takes, on gloo ranks (the planner's check).

Memory, per rank, by the tensors' and the allocator's own accounting (not RSS):

* at the start of a step (after a warm-up step, so every lazily made buffer exists): the bytes of the
  distinct storages of every tensor alive in the process (``gc.get_objects()``: model, gradients,
  optimizer state, buffers, the batch);
* during the step: torch's profiler with ``profile_memory=True`` reports every allocation and free of
  torch's CPU allocator; the running sum's maximum is the step's growth above its start. The profiler
  reports no free of a block allocated before it started, so it runs from the warm-up step on (a step that
  frees what the previous one allocated, ZeRO-3's gradient shard or ZeRO-2's buckets, is then seen to).

peak = the first + the second. Time: the slowest rank's wall time of a step, median of ``steps``.

Kineto (the profiler's backend) writes a ``USDT: ... profiler_start`` / ``profiler_stop`` line to stderr
on every start and stop, at a severity above its errors (``KINETO_LOG_LEVEL`` would have to hide those
too), and the CPU allocator a warning about blocks freed that were allocated before the profiler started:
:func:`quiet_profile` drops those lines and passes everything else through.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

from .accounting import held_bytes


def live_tensors() -> List[torch.Tensor]:
    """Every tensor the garbage collector tracks. Tested by ``type(obj)``, not ``isinstance``: that reads
    ``obj.__class__``, which torch's deprecated module attributes (``torch.distributed.reduce_op``) answer with
    a FutureWarning, and a dead ``weakref.proxy`` with a ReferenceError."""
    gc.collect()
    return [obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor)]


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor alive in this process (views counted once)."""
    return held_bytes([t for t in live_tensors() if t.device.type == "cpu"])


# What the profiler prints that is no message to anyone: kineto's start/stop markers, and the CPU allocator's
# note (once a process) that a block allocated before the profiler started was freed under it, which
# ``step_growth`` does on purpose
def _profiler_noise(line: bytes) -> bool:
    return line.startswith(b"USDT:") or b"allocated before the profiling started" in line


@contextlib.contextmanager
def _without_kineto_markers():
    """Runs the body with file descriptor 2 sent to a file, then writes back every line but the profiler's
    noise (:func:`_profiler_noise`: C++ writes it to the descriptor, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True) if not _profiler_noise(line)]
            if kept:
                os.write(2, b"".join(kept))


@contextlib.contextmanager
def quiet_profile(**options):
    """``torch.profiler.profile(**options)`` as a context manager, without the profiler's noise on stderr
    (the body's own lines come out when it ends)."""
    from torch.profiler import profile
    prof = profile(**options)
    with _without_kineto_markers():
        prof.__enter__()
        try:
            yield prof
        except BaseException:
            prof.__exit__(*sys.exc_info())
            raise
        prof.__exit__(None, None, None)


def step_growth(fn, before=None) -> int:
    """The most bytes torch's CPU allocator held above its level at the start while ``fn()`` ran.
    ``before``: run first under the same profiler (a warm-up step), so that what ``fn`` frees of the blocks
    ``before`` allocated counts too (the profiler reports no free of a block allocated before it started)."""
    from torch.profiler import ProfilerActivity, record_function
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if before is not None:
            before()
        with record_function("step_growth: measured"):
            fn()
    events = list(prof.profiler.kineto_results.events())
    marks = [e.start_ns() for e in events if e.name() == "step_growth: measured"]
    start_ns = min(marks) if marks and before is not None else None
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = base = top = 0
    for t, nbytes in memory:
        if start_ns is not None and t < start_ns:
            level += nbytes
            base = top = level
            continue
        level += nbytes
        top = max(top, level)
    return top - base


def measure_layout(p3d, batch, steps: int = 3, baseline: int = 0) -> Dict[str, object]:
    """On every rank of ``p3d``'s mesh (a collective): one warm-up step and one step under the memory
    profiler (the second measured), then ``steps`` timed steps. Returns this rank's figures; ``baseline``:
    the live tensor bytes before the model was built (what the process held already), taken off the start."""
    import torch.distributed as dist
    x, y = batch
    start = []

    def warm_up():
        p3d.train_step(x, y)                               # lazy optimizer state, bucket rebuilds
        start.append(live_tensor_bytes() - baseline)

    growth = step_growth(lambda: p3d.train_step(x, y), before=warm_up)
    start = start[0]
    times: List[float] = []
    for _ in range(steps):
        dist.barrier()
        t0 = time.perf_counter()
        p3d.train_step(x, y)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    m = p3d.mesh
    return {"pp_rank": m.pp_rank, "rank": dist.get_rank(), "start_bytes": start, "growth_bytes": growth,
            "peak_bytes": start + growth, "step_s": statistics.median(times)}


__all__ = ["live_tensors", "live_tensor_bytes", "quiet_profile", "step_growth", "measure_layout"]
