"""ParallelMesh layout and timeouts, and the TP/SP communication patterns (forward and backward) on real
gloo ranks."""
import datetime

import pytest
import torch
import torch.distributed as dist

from parallel_layers.tensor_parallel import mappings as M
from parallel_layers.testing import RankFailure, cached_mesh


def body_mesh_layout(rank, world, dp, tp, pp):
    mesh = cached_mesh(dp=dp, tp=tp, pp=pp)
    tp_ranks = dist.get_process_group_ranks(mesh.tp_group)
    dp_ranks = dist.get_process_group_ranks(mesh.dp_group)
    pp_ranks = dist.get_process_group_ranks(mesh.pp_group)
    return (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), tp_ranks, dp_ranks, pp_ranks


@pytest.mark.parametrize("dp,tp,pp", [(1, 4, 1), (2, 2, 1), (1, 2, 2), (4, 1, 1)])
def test_mesh_layout_tp_fastest(dist_pools, dp, tp, pp):
    out = dist_pools(4).run(body_mesh_layout, dp, tp, pp)
    for rank, (coord, tp_ranks, dp_ranks, pp_ranks) in enumerate(out):
        p, d, t = coord
        assert rank == (p * dp + d) * tp + t
        assert tp_ranks == [(p * dp + d) * tp + i for i in range(tp)]
        assert dp_ranks == [(p * dp + i) * tp + t for i in range(dp)]
        assert pp_ranks == [(i * dp + d) * tp + t for i in range(pp)]


def body_bad_mesh(rank, world):
    from parallel_layers import ParallelMesh
    try:
        ParallelMesh(dp=3, tp=2)
    except ValueError as exc:
        return str(exc)
    return None


def test_mesh_wrong_world_size_is_a_clear_error(dist_pools):
    for msg in dist_pools(2).run(body_bad_mesh):
        assert msg and "dp=3 x tp=2 x pp=1 = 6 ranks, but the world size is 2" in msg


def _timeouts(mesh):
    from parallel_layers.mesh import group_timeout
    return {d: group_timeout(getattr(mesh, f"{d}_group")).total_seconds() for d in ("dp", "tp", "pp")}


def body_mesh_timeouts(rank, world):
    from parallel_layers import ParallelMesh
    from parallel_layers.mesh import group_timeout
    default = ParallelMesh(dp=2, pp=2)
    explicit = ParallelMesh(dp=2, tp=2, timeout=7)
    whole = ParallelMesh(dp=4, timeout=datetime.timedelta(seconds=9))     # a dimension that is the whole world
    return {"world": group_timeout(dist.group.WORLD).total_seconds(), "default": _timeouts(default),
            "explicit": _timeouts(explicit), "whole": _timeouts(whole), "attr": explicit.timeout,
            "desc": default.dp_group.group_desc, "sub_mesh": default["pp"].get_group() is default.pp_group}


def test_mesh_groups_honour_the_timeout(dist_pools):
    """Every group of the mesh waits as long as the caller asked (default: the world group's timeout),
    never the backend's 30-minute default that ``init_device_mesh`` gives the groups it creates."""
    for rank, out in enumerate(dist_pools(4).run(body_mesh_timeouts)):
        assert out["default"] == dict.fromkeys(("dp", "tp", "pp"), out["world"]), (rank, out)
        assert out["explicit"] == dict.fromkeys(("dp", "tp", "pp"), 7.0), (rank, out)
        assert out["whole"] == dict.fromkeys(("dp", "tp", "pp"), 9.0), (rank, out)
        assert out["attr"] == datetime.timedelta(seconds=7)
        assert out["desc"] == f"ParallelMesh dp group {[0, 1] if rank < 2 else [2, 3]}" and out["sub_mesh"], out


def body_bad_timeouts(rank, world):
    from parallel_layers import ParallelMesh
    errors = []
    for bad in (0, -1.5, "5", True, datetime.timedelta(0)):
        try:
            ParallelMesh(dp=world, timeout=bad)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_mesh_bad_timeout_is_a_clear_error(dist_pools):
    for errors in dist_pools(2).run(body_bad_timeouts):
        assert all(e and "must be a positive datetime.timedelta or number of seconds" in e for e in errors), errors


def body_mappings(rank, world):
    group = cached_mesh(tp=world).tp_group
    torch.manual_seed(0)  # same full tensors on every rank
    full = torch.randn(3, 4 * world, 5 * world, dtype=torch.float64)
    upstream = torch.randn_like(full)
    shard_last = full.chunk(world, dim=-1)[rank]
    shard_seq = full.chunk(world, dim=1)[rank]
    out = {}

    x = full.clone().requires_grad_()
    y = M.copy_to_tensor_parallel_region(x, group)
    (y * (rank + 1)).sum().backward()
    out["copy"] = (torch.equal(y, full), x.grad)  # grad = all-reduce of (rank+1)

    x = (full * (rank + 1)).requires_grad_()
    y = M.reduce_from_tensor_parallel_region(x, group)
    y.backward(upstream)
    out["reduce"] = (y, x.grad)

    x = full.clone().requires_grad_()
    y = M.scatter_to_tensor_parallel_region(x, group)
    y.backward(upstream.chunk(world, dim=-1)[rank])
    out["scatter"] = (torch.equal(y, shard_last), x.grad)

    x = shard_last.clone().requires_grad_()
    y = M.gather_from_tensor_parallel_region(x, group)
    y.backward(upstream)
    out["gather"] = (torch.equal(y, full), torch.equal(x.grad, upstream.chunk(world, dim=-1)[rank]))

    x = full.clone().requires_grad_()
    y = M.scatter_to_sequence_parallel_region(x, group, dim=1)
    y.backward(upstream.chunk(world, dim=1)[rank])
    out["sp_scatter"] = (torch.equal(y, shard_seq), torch.equal(x.grad, upstream))

    x = shard_seq.clone().requires_grad_()
    y = M.gather_from_sequence_parallel_region(x, group, dim=1)
    y.backward(upstream * (rank + 1))
    expected = (upstream * sum(range(1, world + 1))).chunk(world, dim=1)[rank]
    out["sp_gather"] = (torch.equal(y, full), torch.allclose(x.grad, expected))

    x = (full * (rank + 1)).requires_grad_()
    y = M.reduce_scatter_to_sequence_parallel_region(x, group, dim=1)
    y.backward(upstream.chunk(world, dim=1)[rank])
    out["sp_reduce_scatter"] = (torch.allclose(y, (full * sum(range(1, world + 1))).chunk(world, dim=1)[rank]),
                                torch.equal(x.grad, upstream))
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_mappings_forward_and_backward(dist_pools, world):
    torch.manual_seed(0)
    full = torch.randn(3, 4 * world, 5 * world, dtype=torch.float64)
    upstream = torch.randn_like(full)
    total = sum(range(1, world + 1))
    for rank, out in enumerate(dist_pools(world).run(body_mappings)):
        ok, grad = out["copy"]
        assert ok and torch.allclose(grad, torch.full_like(full, float(total))), rank
        y, grad = out["reduce"]
        assert torch.allclose(y, full * total) and torch.equal(grad, upstream), rank
        ok, grad = out["scatter"]
        assert ok and torch.equal(grad, upstream)  # every rank's slice of the gradient, gathered
        for key in ("gather", "sp_scatter", "sp_gather", "sp_reduce_scatter"):
            assert all(out[key]), (key, rank, out[key])


def body_indivisible(rank, world):
    group = cached_mesh(tp=world).tp_group
    M.scatter_to_sequence_parallel_region(torch.randn(2, 5, 4), group, dim=1)


def test_indivisible_split_names_the_sizes(dist_pools):
    with pytest.raises(RankFailure, match="dimension 1 has size 5, which does not divide by the group size 2"):
        dist_pools(2).run(body_indivisible)


def body_hang(rank, world):
    if rank == 0:
        raise RuntimeError("rank 0 fails before the collective")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 1 waits for rank 0 forever without timeouts
    return t.item()


def test_a_failing_rank_fails_the_call_instead_of_hanging(dist_pools):
    with pytest.raises(RankFailure, match="rank 0 fails before the collective"):
        dist_pools(2).run(body_hang, timeout=60)
    # The pool restarts and works again.
    assert dist_pools(2).run(body_mesh_layout, 1, 2, 1)[1][0] == (0, 0, 1)
