"""The bytes ``ExpertParallelMoE`` sends are those its module docstring states, exactly, at ep 2 on gloo ranks.

Each rank's ``torch.distributed.all_to_all_single`` calls are recorded (what each peer is sent), and the
router's decisions captured by a forward hook; from the decisions of every rank (assignments kept after
capacity, per expert, gathered outside the recorded window) the docstring's formula gives, for each peer, the
rows of the dispatch (this rank's assignments to the peer's experts) and of the combine (the peer's assignments
to this rank's experts), each ``H * element size`` bytes, and ``E/ep`` int64 for the counts exchange; the
backward sends the two again, swapped. The benchmark's counter and formula (``benchmarks/moe.py``, which print
these figures) must give the same numbers.
"""
import pytest
import torch

H, INTER, E, K = 16, 24, 4, 2

# case -> (dtype, tokens per rank, capacity factor): capacity drops assignments, which are then never sent
CASES = {
    "fp32-capacity": (torch.float32, (20, 13), 1.0),
    "bf16": (torch.bfloat16, (16, 16), None),
    "one-rank-empty": (torch.float32, (0, 12), None),
}


def _recording(calls):
    """A wrapper of ``all_to_all_single`` appending ``(dtype, rows sent to each rank, bytes of a row)``."""
    import math

    import torch.distributed as dist
    real = dist.all_to_all_single

    def record(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        n = dist.get_world_size(group)
        splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
        calls.append((input.dtype, splits, math.prod(input.shape[1:]) * input.element_size()))
        return real(output, input, output_split_sizes, input_split_sizes, group=group, **kw)
    return real, record


def body_bytes(rank, world, case):
    import torch.distributed as dist

    from benchmarks.moe import SentBytes, formula_bytes
    from parallel_layers.moe import ExpertParallelMoE, MoELayer
    from parallel_layers.testing import cached_mesh

    dtype, tokens, capacity = CASES[case]
    group = cached_mesh(dp=world).dp_group
    torch.manual_seed(0)
    dense = MoELayer(H, INTER, E, K, capacity_factor=capacity, aux_loss_coef=0.01, dtype=dtype)
    layer = ExpertParallelMoE.from_dense(dense, group)
    decisions = []
    layer.router.register_forward_hook(lambda module, args, routing: decisions.append(routing.experts.clone()))
    x = torch.randn(tokens[rank], H, generator=torch.Generator().manual_seed(rank)).to(dtype).requires_grad_()

    calls = []
    real, record = _recording(calls)
    dist.all_to_all_single = record
    try:
        with SentBytes() as fwd:
            out = layer(x)
        forward_calls = len(calls)
        with SentBytes() as bwd:
            out.float().square().sum().backward()
    finally:
        dist.all_to_all_single = real

    kept = decisions[0][decisions[0] >= 0]
    mine = torch.bincount(kept, minlength=E)                      # this rank's assignments per expert
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine, group=group)
    every = torch.stack(every)                                    # [rank, expert]
    local = E // world
    per_peer = every.view(world, world, local).sum(2)             # [source rank, destination rank]
    return {"calls": calls, "forward_calls": forward_calls, "per_peer": per_peer, "every": every,
            "row": H * x.element_size(), "dropped": int(layer.stats["dropped"]),
            "bench": fwd.forward_exchanges(), "bench_backward": sum(c[2] for c in bwd.calls if c[0] == "all_to_all"),
            "bench_formula": formula_bytes(every, rank, H, x.element_size())}


def _sent(call, me):
    """The bytes a recorded call sends to each other rank."""
    _, splits, row = call
    return [s * row for j, s in enumerate(splits) if j != me]


@pytest.mark.parametrize("case", list(CASES))
def test_each_all_to_all_sends_the_docstring_bytes(case, dist_pools):
    world = 2
    results = dist_pools(world).run(body_bytes, case)
    if CASES[case][2] is not None:
        assert sum(r["dropped"] for r in results) > 0, "the capacity case must drop assignments to mean anything"
    for me, r in enumerate(results):
        per_peer, row = r["per_peer"], r["row"]
        dispatch = [int(per_peer[me, j]) * row for j in range(world) if j != me]
        combine = [int(per_peer[j, me]) * row for j in range(world) if j != me]
        calls = r["calls"]
        assert r["forward_calls"] == 3 and len(calls) == 5, (me, calls)
        # the counts: E/ep int64 to each peer
        assert calls[0][0] == torch.int64 and _sent(calls[0], me) == [E // world * 8] * (world - 1), calls[0]
        # forward dispatch, combine; backward: the combine's gradient (dispatch sizes), the dispatch's (combine's)
        for call, want in zip(calls[1:], (dispatch, combine, dispatch, combine)):
            assert call[0] == CASES[case][0] and _sent(call, me) == want, (case, me, call, want)
        # the benchmark's counter and formula print the same figures
        formula = r["bench_formula"]
        assert formula["dispatch"] == sum(dispatch) and formula["combine"] == sum(combine), (me, formula)
        assert formula["counts"] == (world - 1) * E // world * 8
        for name in formula:
            assert r["bench"][name] == formula[name], (case, me, name, r["bench"], formula)
        assert r["bench_backward"] == sum(dispatch) + sum(combine)
        assert torch.equal(r["per_peer"], results[0]["per_peer"])      # every rank saw the same decisions
