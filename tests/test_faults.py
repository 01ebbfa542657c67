"""Faults in real processes: a rank that stops answering (SIGSTOP: hung, not dead) makes every other rank of
a 3D run fail within the mesh's timeout, not gloo's 30-minute default, and a failed collective names its
operation and process group (gloo's own text names neither)."""
import datetime
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
    # Grid (pp, dp, tp) = (2, 2, 1): dp groups [0, 1] and [2, 3]. Rank 2 waits on rank 3 in its gradient
    # reduction; rank 0 on rank 1, itself stuck on a pipeline receive from rank 3 (that one is
    # point-to-point, not a collective). The collective's error names the operation and the group.
    for rank, dp_ranks in ((0, [0, 1]), (2, [2, 3])):
        want = (f"reduce_scatter_dim0 (SUM) over ParallelMesh dp group {dp_ranks} (ranks {dp_ranks}, "
                f"timeout {TIMEOUT_S:g} s) failed: ")
        assert want in out[rank]["error"], (rank, out[rank]["error"])


class _TimedOutWork:
    def wait(self, timeout=None):
        raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")

    def is_completed(self):
        return True


def test_collective_errors_describe_groups_without_a_description():
    """A group c10d never named nor registered (the NCCL-rules backend's, made by hand) is still described
    by its backend, size and timeout; the backend's error is kept as the cause."""
    from parallel_layers.distributed.collectives import NamedWork, describe_group
    from parallel_layers.testing.nccl_rules import NcclRulesGroup

    group = NcclRulesGroup(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))
    assert describe_group(group) == "an unnamed nccl_rules group (ranks unknown, size 1, timeout 5 s)"
    with pytest.raises(RuntimeError) as info:
        NamedWork(_TimedOutWork(), "all_reduce", group, dist.ReduceOp.MAX).wait()
    assert str(info.value) == ("all_reduce (MAX) over an unnamed nccl_rules group (ranks unknown, size 1, "
                               "timeout 5 s) failed: Timed out waiting 3000ms for recv operation to complete")
    assert "Timed out" in str(info.value.__cause__)


def body_describe(rank, world):
    from parallel_layers.distributed.collectives import describe_group
    unnamed = dist.new_group(timeout=datetime.timedelta(seconds=7))
    return describe_group(None), describe_group(dist.group.WORLD), describe_group(unnamed)


def test_collective_errors_describe_the_world_and_unnamed_groups(dist_pools):
    for world, world_again, unnamed in dist_pools(2, "gloo").run(body_describe):
        assert world == world_again == "the world group (ranks [0, 1], timeout 60 s)", world
        assert unnamed == "an unnamed gloo group (ranks [0, 1], timeout 7 s)", unnamed
