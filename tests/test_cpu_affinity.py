"""Binding CPU ranks to cores of their own (parallel_layers.cpu_affinity), in real gloo processes."""
import os
import threading

import pytest

from parallel_layers.cpu_affinity import bind_process_to_cores, cores_for_rank
from parallel_layers.testing import WorkerPool

CAN_BIND = hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task")


def test_cores_for_rank_splits_evenly_and_refuses_oversubscription():
    assert cores_for_rank(0, 2, [0, 1]) == [0]
    assert cores_for_rank(1, 2, [0, 1]) == [1]
    assert cores_for_rank(1, 2, [4, 5, 6, 7, 8]) == [6, 7]       # the fifth core stays unused
    assert cores_for_rank(2, 3, [0, 1, 2, 3, 4, 5]) == [4, 5]
    assert cores_for_rank(0, 3, [0, 1]) is None                   # more ranks than cores: nothing bound
    with pytest.raises(ValueError, match="local rank 2 is not in"):
        cores_for_rank(2, 2, [0, 1])


def _thread_masks():
    """Every thread of this process (gloo's included) and a thread started now: their affinity masks."""
    started = []
    t = threading.Thread(target=lambda: started.append(sorted(os.sched_getaffinity(threading.get_native_id()))))
    t.start()
    t.join()
    masks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            masks[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except ProcessLookupError:
            pass
    return masks, started[0]


def body_masks(rank, world):
    return _thread_masks()


@pytest.mark.skipif(not CAN_BIND or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 cores")
def test_bound_ranks_own_disjoint_cores_with_every_thread():
    cores = sorted(os.sched_getaffinity(0))
    with WorkerPool(2, bind_cores=True) as pool:
        results = pool.run(body_masks)
    owned = []
    for rank, (masks, later) in enumerate(results):
        mine = cores_for_rank(rank, 2, cores)
        assert len(masks) > 1, "expected gloo's threads beside the main thread"
        assert all(m == mine for m in masks.values()), f"rank {rank}: {masks} not all bound to {mine}"
        assert later == mine, f"rank {rank}: a thread started after binding runs on {later}, not {mine}"
        owned.append(set(mine))
    assert not owned[0] & owned[1]


@pytest.mark.skipif(not CAN_BIND, reason="needs Linux")
def test_more_ranks_than_cores_are_left_free():
    cores = sorted(os.sched_getaffinity(0))
    with WorkerPool(len(cores) + 1, bind_cores=True) as pool:
        results = pool.run(body_masks)
    for masks, later in results:
        assert all(m == cores for m in masks.values()) and later == cores


@pytest.mark.skipif(not CAN_BIND, reason="needs Linux")
def test_bind_process_to_cores_in_this_process_and_back():
    cores = sorted(os.sched_getaffinity(0))
    try:
        assert bind_process_to_cores(cores[:1])
        masks, later = _thread_masks()
        assert all(m == cores[:1] for m in masks.values()) and later == cores[:1]
    finally:
        bind_process_to_cores(cores)
    assert sorted(os.sched_getaffinity(0)) == cores
