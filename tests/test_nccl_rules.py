"""The NCCL-rules backend (``parallel_layers.testing.nccl_rules``): each rule catches a deliberately
wrong program, fast and by name, and the right version of the same program passes. Every body runs on a
fresh group of its own (a violation leaves that group unusable, as a real NCCL error would), so the
pool's world group stays healthy for the next test."""
import time

import pytest
import torch
import torch.distributed as dist

from parallel_layers.testing import nccl_rules


def _fresh_group():
    return dist.new_group(list(range(dist.get_world_size())))


def _caught(fn):
    """Run ``fn``; return the RuleViolation's message (None if it passed) and the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
    except nccl_rules.RuleViolation as exc:
        return str(exc), time.monotonic() - t0
    return None, time.monotonic() - t0


def body_tags(rank, world):
    g = _fresh_group()
    peer = 1 - rank
    x, y = torch.full((3,), float(rank)), torch.empty(3)
    ok = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, g), dist.P2POp(dist.irecv, y, peer, g)])
    for w in ok:
        w.wait()
    assert y.tolist() == [float(peer)] * 3
    if rank == 0:
        return _caught(lambda: dist.isend(x, 1, group=g, tag=7))
    return None, 0.0


def body_posting_order(rank, world):
    g = _fresh_group()
    if rank == 0:      # two messages; a tag would have kept them apart on gloo
        dist.isend(torch.zeros(3), 1, group=g)
        dist.isend(torch.zeros(5), 1, group=g)
        return None, 0.0
    return _caught(lambda: dist.irecv(torch.empty(5), 0, group=g).wait())


def body_receive_first_deadlock(rank, world, batched):
    g = _fresh_group()
    peer = 1 - rank
    x, y = torch.full((4,), float(rank)), torch.empty(4)
    if batched:        # right: the receive and the send progress together in one batch
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, y, peer, g), dist.P2POp(dist.isend, x, peer, g)])

        def wait():
            for w in works:
                w.wait()
        msg, took = _caught(wait)
        assert y.tolist() == [float(peer)] * 4
        return msg, took
    r = dist.irecv(y, peer, group=g)   # wrong: each rank's receive blocks its own later send
    dist.isend(x, peer, group=g)
    return _caught(r.wait)


def _post_and_wait_receives(ops, wait_all):
    works = dist.batch_isend_irecv([op for _, op in ops])
    if wait_all:
        for w in works:
            w.wait()
    else:              # one Work per operation assumed: zip pairs the batch's Work with the send only
        for (kind, _), w in zip(ops, works):
            if kind == "recv":
                w.wait()
    return len(works)


def body_one_work_per_batch(rank, world, wait_all):
    g = _fresh_group()
    peer = 1 - rank
    x, y = torch.full((2,), float(rank)), torch.empty(2)
    ops = [("send", dist.P2POp(dist.isend, x, peer, g)), ("recv", dist.P2POp(dist.irecv, y, peer, g))]
    n = _post_and_wait_receives(ops, wait_all)
    msg, took = _caught(lambda: dist.all_reduce(torch.ones(1), group=g))
    return msg, took, n


def body_collective_order(rank, world):
    g = _fresh_group()
    t = torch.ones(4)
    dist.all_reduce(t, group=g)                    # same collective everywhere: fine
    assert t.tolist() == [float(world)] * 4
    if rank == 0:
        return _caught(lambda: dist.all_reduce(t, group=g))
    return _caught(lambda: dist.broadcast(t, 0, group=g))


def body_uneven_all_to_all(rank, world):
    g = _fresh_group()
    sends = [[1, 3], [0, 2]][rank]                 # rank i sends sends[j] rows to rank j: tensors of 4 and 2 rows
    recv = [[1, 0], [3, 2]][rank]                  # ... and receives what the peers send it: fine
    x = torch.full((sum(sends), 5), float(rank))
    out = torch.empty(sum(recv), 5)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=sends, group=g)
    assert out[:, 0].tolist() == [0.0] * recv[0] + [1.0] * recv[1]
    wrong = [[1, 0], [2, 2]][rank]                 # rank 1 expects 2 rows from rank 0, which sends it 3
    return _caught(lambda: dist.all_to_all_single(torch.empty(sum(wrong), 5), x, output_split_sizes=wrong,
                                                  input_split_sizes=sends, group=g))


def body_device(rank, world):
    nccl_rules.track_host_tensors([__file__])      # this file plays the package's part
    g = _fresh_group()
    device = torch.device("cpu")                   # "the device the model trains on"
    dist.all_reduce(torch.zeros(4, device=device), group=g)
    dist.all_reduce(torch.zeros(4).to(device), group=g)
    weight = torch.nn.Parameter(torch.ones(4, device=device))
    dist.all_reduce((weight * 2).detach(), group=g)    # computed from a device tensor
    host = _caught(lambda: dist.all_reduce(torch.zeros(4), group=g))
    derived = _caught(lambda: dist.broadcast(torch.zeros(2).add(1)[:1], 0, group=g))
    return host, derived


@pytest.fixture
def pool(_pools):
    return _pools(2, "nccl_rules")


def test_tags_refused(pool):
    out = pool.run(body_tags)
    msg, took = out[0]
    assert msg is not None and "tags are ignored" in msg and "tag=7" in msg and "test_nccl_rules.py" in msg, msg


def test_messages_match_in_posting_order(pool):
    msg, took = pool.run(body_posting_order)[1]
    assert msg is not None and "match in posting order" in msg and "(5,)" in msg and "(3,)" in msg, msg
    assert "test_nccl_rules.py" in msg, msg     # both ends' sites


def test_receive_before_send_deadlocks_fast(pool):
    for msg, _took in pool.run(body_receive_first_deadlock, True):
        assert msg is None
    out = pool.run(body_receive_first_deadlock, False)
    for rank, (msg, took) in enumerate(out):
        assert msg is not None and "deadlock" in msg and "one stream" in msg, msg
        assert "receive from rank" in msg and "send to rank" in msg, msg   # the head and what is queued behind
        assert took < 10, f"rank {rank} took {took:.1f}s to detect the deadlock"


def test_one_work_per_batch(pool):
    for msg, _took, n in pool.run(body_one_work_per_batch, True):
        assert msg is None and n == 1
    for msg, _took, _n in pool.run(body_one_work_per_batch, False):
        assert msg is not None and "one Work per batch" in msg and "dropped without wait()" in msg, msg


def test_collectives_in_the_same_order(pool):
    for msg, _took in pool.run(body_collective_order):
        assert msg is not None and "same collectives in the same order" in msg, msg
        assert "all_reduce" in msg and "broadcast" in msg, msg


def test_uneven_all_to_all_agrees_per_pair(pool):
    """Ranks of an uneven all-to-all send tensors of different sizes (no fingerprint mismatch for that), but
    each pair must agree on its rows."""
    for msg, _took in pool.run(body_uneven_all_to_all):
        assert msg is not None and "agree on the rows of each pair" in msg, msg
        assert "rank 0 sends 3 rows to rank 1, which expects 2" in msg, msg


def test_host_tensors_refused(pool):
    for (host, _), (derived, _) in pool.run(body_device):
        for msg in (host, derived):
            assert msg is not None and "communication tensors live on the GPU" in msg, msg
            assert "test_nccl_rules.py" in msg, msg
