"""The gloo ring reduce-scatter / all-gather (parallel_layers.distributed.ring) against torch's own
collectives, on every rank, at 2, 3 and 4 ranks; async rings in flight together; a missing peer."""
import datetime

import pytest
import torch
import torch.distributed as dist

from parallel_layers.distributed import collectives as C
from parallel_layers.distributed import ring


def _input(rank, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(n, generator=g) * 3).to(dtype)


def body_matches_torch(rank, world):
    group = dist.group.WORLD
    assert ring.applies(torch.zeros(1), group) and not ring.applies(torch.zeros(1), group, dist.ReduceOp.MAX)
    errs = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for per_rank in (1, 7, 1000):
            n = per_rank * world
            x = _input(rank, n, dtype)
            ref = x.clone()
            dist.all_reduce(ref)                         # torch's sum, the oracle
            out = C.reduce_scatter_dim0(x.clone(), group)
            mine = ref[rank * per_rank:(rank + 1) * per_rank]
            # bf16: a different summation order than gloo's; every partial sum rounds to 8 significant bits,
            # so allow (world - 1) roundings of the largest partial (bounded by the sum of magnitudes)
            mags = x.abs()
            dist.all_reduce(mags)
            scale = mags[rank * per_rank:(rank + 1) * per_rank].max().item()
            tol = 0 if dtype != torch.bfloat16 else (world - 1) * scale * 2 ** -8
            errs.append(("rs", str(dtype), per_rank, (out.double() - mine.double()).abs().max().item(), tol))
            shard = _input(rank, per_rank, dtype, seed=1)
            full = C.all_gather_dim0(shard, group)
            want = torch.cat([_input(r, per_rank, dtype, seed=1) for r in range(world)])
            errs.append(("ag", str(dtype), per_rank, (full.double() - want.double()).abs().max().item(), 0))
    # 2-D tensors keep their trailing dims; several async rings in flight complete in order
    x = _input(rank, world * 6 * 5, torch.float32).view(world * 6, 5)
    ref = x.clone()
    dist.all_reduce(ref)
    pending = [C.reduce_scatter_dim0(x, group, async_op=True) for _ in range(3)]
    pending.append(C.all_gather_dim0(ref[rank * 6:(rank + 1) * 6], group, async_op=True))
    for _out, work in pending:
        work.wait()
    rs_err = max((out - ref[rank * 6:(rank + 1) * 6]).abs().max().item() for out, _ in pending[:3])
    ag_err = (pending[3][0] - ref).abs().max().item()
    return errs, rs_err, ag_err, tuple(pending[0][0].shape)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_torch_collectives(dist_pools, world):
    for rank, (errs, rs_err, ag_err, shape) in enumerate(dist_pools(world).run(body_matches_torch)):
        for kind, dtype, per_rank, err, tol in errs:
            # fp32/fp64: the ring adds in a different order than gloo's all-reduce: a few ulps of the sum
            bound = tol or (1e-12 if dtype == "torch.float64" else 1e-5)
            assert err <= (bound if kind == "rs" else 0), (rank, kind, dtype, per_rank, err)
        assert rs_err < 1e-5 and ag_err == 0 and shape == (6, 5), (rank, rs_err, ag_err, shape)


def body_missing_peer(rank, world):
    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    if rank == 1:
        return None                                  # never joins the ring
    _, work = C.reduce_scatter_dim0(torch.ones(4 * world), group, async_op=True)
    try:
        work.wait()
    except RuntimeError as exc:
        first = str(exc)
    else:
        return "no error"
    try:                                             # the group is now unusable: later rings fail at once
        C.all_gather_dim0(torch.ones(2), group)
    except RuntimeError as exc:
        return first, str(exc)
    return first, "no error"


def test_ring_with_a_missing_peer_errors_instead_of_hanging(dist_pools):
    out = dist_pools(2).run(body_missing_peer, timeout=60)
    first, later = out[0]
    assert "ring reduce-scatter of 8 torch.float32 elements failed" in first, first
    assert "ring all-gather" in later and "failed" in later, later


def body_bad_output(rank, world):
    errors = []
    for fn, out in ((ring.reduce_scatter, torch.empty(3)), (ring.reduce_scatter, torch.empty(4, dtype=torch.float64)),
                    (ring.all_gather, torch.empty(4 * world + 1))):
        try:
            fn(out, torch.ones(4 * world if fn is ring.reduce_scatter else 4), dist.group.WORLD)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_ring_rejects_an_output_that_does_not_fit(dist_pools):
    for errors in dist_pools(2).run(body_bad_output):
        assert len(errors) == 3 and all("does not fit input" in e for e in errors), errors


def test_a_forked_child_starts_without_the_parents_ring_threads():
    import os

    ring._workers[-1] = object()          # stands for a worker whose thread a child would not have
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if not ring._workers else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        ring._workers.pop(-1, None)
