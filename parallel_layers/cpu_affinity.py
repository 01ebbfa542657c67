"""Bind each rank of a CPU job to cores of its own (DeepSpeed's ``--bind_cores_to_rank``).

A CPU rank runs its compute on one thread per core it owns, plus gloo's threads that move its messages
(and the pipeline's receive poster). Left to the scheduler, those threads migrate between cores and
share them with the neighbouring ranks, so a message or an op on the critical path sometimes waits for
a core that another rank's thread holds. Binding every thread of rank ``r`` to its own slice of the
cores keeps its caches and its gloo threads next to its compute.

Measured on the 2-core benchmark machine with ``python -m benchmarks.pipeline --pp 2 --no-csv`` (bound,
the default) against the same with ``--no-bind-cores`` (free): the 1F1B step at m=8 took 531 ms bound
against 559 ms free for ``torch.distributed.pipelining``'s schedule, 530 against 535 ms for ours, and the
bubble rows' message term is lower bound (benchmarks/README.md, "Pipeline, bound ranks").

Only where every local rank gets at least one core: with more ranks than cores (the demo's 8
processes on this machine) a fixed binding would stop the kernel from balancing them, so nothing is
bound. It is a setting of the whole process, so it is never applied behind the caller's back: the
demo's CPU ranks call :func:`bind_rank_to_cores` at start-up (``--no-bind-cores`` turns it off), the
timing benchmarks that were measured with it start their ranks bound
(``harness.run_ranks(bind_cores=True)``), and a user's own CPU script calls it once per process after
``init_process_group`` (so gloo's threads are bound too). A no-op returning None where the platform has
no ``sched_setaffinity`` (macOS, Windows).
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence


def available_cores() -> Optional[List[int]]:
    """The cores this process may run on (its affinity mask: what ``taskset``, cgroups or a launcher
    left it), or None where the platform cannot tell."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))


def cores_for_rank(local_rank: int, local_world_size: int, cores: Sequence[int]) -> Optional[List[int]]:
    """Rank ``local_rank``'s share of ``cores``: an equal contiguous slice each (cores left over by the
    division stay unused, as in DeepSpeed), or None when there are fewer cores than local ranks."""
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"cpu_affinity: local rank {local_rank} is not in [0, {local_world_size})")
    cores = list(cores)
    per_rank = len(cores) // local_world_size
    if per_rank == 0:
        return None
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank]


def bind_process_to_cores(cores: Sequence[int]) -> bool:
    """Restrict every thread of this process (those already running, such as gloo's, and through the
    main thread's mask every thread started later) to ``cores``. False where unsupported."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    mask = set(cores)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:              # no procfs: the calling thread, and the threads it starts from now on
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, mask)
        except ProcessLookupError:   # the thread ended meanwhile
            pass
    return True


def bind_rank_to_cores(local_rank: int, local_world_size: int) -> Optional[List[int]]:
    """Bind this process to its share of the available cores; returns the cores, or None when nothing
    was bound (more local ranks than cores, or an unsupported platform)."""
    cores = available_cores()
    if cores is None:
        return None
    mine = cores_for_rank(local_rank, local_world_size, cores)
    if mine is None or not bind_process_to_cores(mine):
        return None
    return mine


__all__ = ["available_cores", "cores_for_rank", "bind_process_to_cores", "bind_rank_to_cores"]
