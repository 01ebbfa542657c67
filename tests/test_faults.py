"""Faults in real processes: a rank that stops answering (SIGSTOP: hung, not dead) makes every other rank of
a 3D run fail within the mesh's timeout, not gloo's 30-minute default."""
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from parallel_layers.testing import WorkerPool

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP/SIGCONT are POSIX signals")

TIMEOUT_S = 3.0      # the mesh's groups; the world group keeps the pool's 60 s
STOP_S = 10.0        # the stopped rank wakes after this: every other rank must have failed well before
SLACK_S = 6.0        # scheduling on a busy 2-core machine (4 ranks), on top of the timeout


def body_stop_one_rank(rank, world, stopped):
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.parallel3d import Parallel3D
    mesh = ParallelMesh(dp=2, pp=2, timeout=TIMEOUT_S)
    config = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, max_seq_len=4, bias=False)
    model = Parallel3D(config, mesh, zero=1, num_microbatches=2)
    batch = torch.randint(0, 32, (4, 5), generator=torch.Generator().manual_seed(0))
    x, y = batch[:, :-1], batch[:, 1:]
    model.train_step(x, y)               # every link of every group connected
    dist.barrier()
    if rank == stopped:
        # a helper wakes this rank later (a stopped process runs nothing itself); then it just returns
        subprocess.Popen(["sh", "-c", f"sleep {STOP_S}; kill -CONT {os.getpid()}"])
        os.kill(os.getpid(), signal.SIGSTOP)
        return None
    start = time.monotonic()
    try:
        model.train_step(x, y)
    except RuntimeError as exc:
        return {"seconds": time.monotonic() - start, "error": str(exc)}
    return {"seconds": time.monotonic() - start, "error": None}


def test_a_stopped_rank_fails_the_others_within_the_mesh_timeout():
    pool = WorkerPool(4)
    try:
        out = pool.run(body_stop_one_rank, 3, timeout=120)
    finally:
        for proc in pool._procs:                 # the stopped rank included: nothing is left behind
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
        pool.close()
    assert out[3] is None
    for rank, res in enumerate(out[:3]):
        assert res["error"] is not None, f"rank {rank} finished a step without rank 3"
        assert "timed out" in res["error"].lower(), (rank, res["error"])
        assert res["seconds"] < min(TIMEOUT_S + SLACK_S, STOP_S), (rank, res)
