"""The published H100 runs the planner is checked against (:mod:`parallel_layers.planner.published_h100`):
each run's layout is one the planner can express (its GPUs = dp x tp x pp x cp, batches and layers split as
published), and each variant the comparison weighs keeps the published layout."""
from __future__ import annotations

from parallel_layers.planner import published_h100 as P


def test_published_h100_runs_are_layouts_the_planner_can_weigh():
    assert set(P.TABLES) == {"torchtitan", "nemo"}
    for table in P.TABLES:
        assert sum(r.table == table for r in P.RUNS) >= 5, table
    for r in P.RUNS:
        layers, _, heads, *_ = P.MODELS[r.model]
        assert r.dp * r.tp * r.pp * r.cp == r.gpus, r.label
        assert r.global_batch % r.dp == 0, r.label
        assert r.micro_batch is None or (r.global_batch // r.dp) % r.micro_batch == 0, r.label
        assert layers % (r.pp * r.vp) == 0 and heads % r.tp == 0, r.label
        assert r.zero == (3 if r.table == "torchtitan" else 1), r.label     # FSDP2 / NeMo's distributed optimizer
        variants = P.variants(r)
        assert variants and all(lay.world == r.gpus and (lay.dp, lay.tp, lay.pp, lay.cp) == (r.dp, r.tp, r.pp, r.cp)
                                for lay in variants), r.label
