"""The planner's fast path (:mod:`parallel_layers.planner.representative`: stage shapes probed at 1-3 blocks
and scaled, the loss's row loop sampled) against the full probe, on a model where both run."""
from __future__ import annotations

import contextlib

import pytest

from parallel_layers.composition.layout import Layout
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import Request, load_profile, plan
from parallel_layers.planner import probe as probe_mod
from parallel_layers.planner import representative as rep

# 8 blocks: 8, 4 and 2 a chunk at pp 1, 2 and 2 x 2 chunks, so the scaled path extrapolates past its probes
GPT8 = GPTConfig(vocab_size=256, n_layer=8, n_head=4, d_model=64, max_seq_len=64)
LAYOUTS = [Layout(dp=4, zero=z, checkpoint=ck) for z in (0, 1, 2, 3) for ck in (False, True)] + [
    Layout(dp=2, pp=2, zero=z, schedule=s, num_microbatches=m, checkpoint=ck)
    for z, s, m, ck in ((1, "1f1b", 2, False), (1, "gpipe", 4, True), (3, "1f1b", 4, True), (3, "gpipe", 2, False))
] + [Layout(dp=1, pp=2, zero=1, schedule="interleaved", num_chunks=2, num_microbatches=4),
     # 8 blocks over 3 stages (3, 3, 2) and over 2 x 3 chunks (2, 2, 1, 1, 1, 1): each stage scaled to its own
     Layout(pp=3, zero=1, num_microbatches=3), Layout(pp=3, zero=3, num_microbatches=3, checkpoint=True),
     Layout(pp=2, zero=1, schedule="interleaved", num_chunks=3, num_microbatches=4),
     Layout(tp=2, dp=2, zero=1), Layout(tp=2, pp=2, schedule="1f1b", num_microbatches=2, checkpoint=True)]
MEMORY_TOLERANCE = 0.02        # measured: 0 (see the module docstring of representative)


@pytest.fixture(scope="module")
def both(request):
    req = Request(GPT8, world=4, global_batch=16, seq_len=64, memory_bytes=1e12)
    prof = load_profile("h100")
    fast = plan(req, prof, [(lay, None) for lay in LAYOUTS])
    mp = pytest.MonkeyPatch()
    mp.setattr(rep, "why_exact", lambda req, layout: "the full probe, for the comparison")
    mp.setattr(probe_mod, "_on_meta", lambda dev, tallies: contextlib.nullcontext())
    try:
        full = plan(req, prof, [(lay, None) for lay in LAYOUTS])
    finally:
        mp.undo()
    return fast, full


def test_the_fast_path_ranks_as_the_full_probe(both):
    """The same order, the same step times (to 1e-5: ZeRO padding extrapolated, 7e-7 measured) and every
    rank's memory terms within ``MEMORY_TOLERANCE`` of the full probe's (8 blocks probed at 1-3 and scaled)."""
    fast, full = both
    by_layout = {p.layout: p for p in full}
    for p in fast:
        q = by_layout[p.layout]
        assert p.step_s == pytest.approx(q.step_s, rel=1e-5), p.layout.name()      # measured: 7e-7 (padding)
        for mine, theirs in zip(p.memory, q.memory):
            for term, value in theirs.items():
                assert mine[term] == pytest.approx(value, rel=MEMORY_TOLERANCE, abs=64), (p.layout.name(), term)
    order = [p.layout for p in fast]
    ties = {p.layout: round(p.tokens_per_s, 6) for p in full}
    assert [ties[lay] for lay in order] == [ties[p.layout] for p in full]


def test_streaming_zero2_scaled_from_two_and_three_blocks_is_the_full_probe(monkeypatch):
    """A streaming ZeRO-2 rank (pp 1, untied) whose blocks span several 25 MB buckets: its static terms probed at
    2 and 3 blocks and scaled to 8 (the streamed buckets' bytes constant) equal the full probe's, and the
    scaled path is the one taken."""
    cfg = GPTConfig(vocab_size=256, n_layer=8, n_head=8, d_model=1024, max_seq_len=64, tie_embeddings=False)
    req = Request(cfg, world=4, global_batch=8, seq_len=64, memory_bytes=1e12)
    prof = load_profile("h100")
    layouts = [(Layout(dp=4, zero=2, checkpoint=ck), None) for ck in (False, True)]
    scaled = []
    real = rep.scale_streaming
    monkeypatch.setattr(rep, "scale_streaming", lambda *a: scaled.append(a[2]) or real(*a))
    fast = plan(req, prof, layouts)
    assert len(scaled) == 2 and all(flight > 0 for flight in scaled), scaled
    monkeypatch.setattr(rep, "why_exact", lambda req, layout: "the full probe, for the comparison")
    full = plan(req, prof, layouts)
    assert len(scaled) == 2
    by_layout = {p.layout: p for p in full}
    for p in fast:
        q = by_layout[p.layout]
        assert p.step_s == pytest.approx(q.step_s, rel=1e-5), p.layout.name()
        for mine, theirs in zip(p.memory, q.memory):
            for term in ("parameters", "gradients", "optimizer"):       # what the static probe holds: exact
                assert mine[term] == theirs[term], (p.layout.name(), term)
            for term, value in theirs.items():
                assert mine[term] == pytest.approx(value, rel=MEMORY_TOLERANCE, abs=64), (p.layout.name(), term)


def test_the_sampled_loss_counts_what_the_whole_loop_does():
    """The cross entropy's row loop on meta run for three chunks and charged for the rest counts the same ops,
    traffic, FLOPs and peak as running every chunk (a 32k vocabulary: 256 chunks here)."""
    cfg = GPTConfig(vocab_size=32000, n_layer=1, n_head=4, d_model=64, max_seq_len=512, bias=False,
                    tie_embeddings=False)
    req = Request(cfg, world=1, global_batch=2, seq_len=512, memory_bytes=1e12)
    lay = Layout()

    def probe():
        with probe_mod.fake_world(0, 1):
            return probe_mod.microbatch_probe(probe_mod.build_rank(req, lay, 0), 2, 512, None)[0][0]
    sampled = probe()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_mod, "_on_meta", lambda dev, tallies: contextlib.nullcontext())
        whole = probe()
    assert sampled == whole


def test_a_fake_world_rank_makes_only_its_own_groups(monkeypatch):
    """Under the planner's fake world (one process playing one rank) a mesh makes only this rank's groups, with
    the ranks and coordinates the full collective construction gives (a real world makes every group: the
    distributed suite)."""
    import torch.distributed as dist

    from parallel_layers.dimensions import grid_ranks
    from parallel_layers.mesh import ParallelMesh, plays_one_rank
    made = []
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda ranks=None, **kw: made.append(ranks) or new_group(ranks, **kw))
    sizes = dict(dp=4, tp=4, pp=4, cp=2)
    with probe_mod.fake_world(5, 128):
        mesh = ParallelMesh(**sizes, timeout=60)
        assert plays_one_rank()
        for dim in sizes:
            mine = next(r for r in grid_ranks(mesh.sizes, [dim]) if 5 in r)
            assert dist.get_process_group_ranks(mesh.group(dim)) == mine, dim
        assert dist.get_process_group_ranks(mesh.replica_group) == next(
            r for r in grid_ranks(mesh.sizes, ["dp", "cp"]) if 5 in r)
        pipeline = next(r for r in grid_ranks(mesh.sizes, ["pp"]) if 5 in r)
        assert dist.get_process_group_ranks(mesh.tied_stage_group()) == [pipeline[0], pipeline[-1]]
    # one a dimension, the replicas' and the tied pair's (the collective construction: every group of the world)
    assert len(made) == len(sizes) + 2 and all(5 in ranks for ranks in made), made
