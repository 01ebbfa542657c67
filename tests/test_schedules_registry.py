"""A pipeline schedule is declared once (``SCHEDULE_SPECS``): every consumer reads its declaration, a new
schedule is one declaration plus its compute order, and freeze training runs ZBV with the two chunks a rank
``PipelineConfig`` gives it."""
import argparse

import pytest
import torch
import torch.nn.functional as F

import parallel_layers.__main__ as entry
from parallel_layers import OptimizerConfig, PipelineConfig
from parallel_layers.cli import demo
from parallel_layers.freeze_training import FreezeTrainer
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.pipeline import schedules
from parallel_layers.pipeline.schedules import (
    SCHEDULE_SPECS,
    Backward,
    Forward,
    Instr,
    ScheduleSpec,
    build_all,
    check_schedule_args,
    layout_of,
    schedule_names,
    schedule_spec,
    simulate,
)
from parallel_layers.planner import search
from parallel_layers.planner.spec import Request
from parallel_layers.testing import cached_mesh


def _demo_args(*argv) -> argparse.Namespace:
    return demo.build_parser().parse_args(list(argv))


def _layer_error(schedule: str, pp: int, n_layer: int) -> str:
    """The demo's complaint about --n-layer for ``schedule`` ("" when it has none)."""
    args = _demo_args("--schedule", schedule, "--pp", str(pp), "--n-layer", str(n_layer), "--dp", "1", "--tp", "1")
    try:
        demo.check_args(args)
    except SystemExit as exc:
        return next((part for part in str(exc).split("; ") if "--n-layer" in part), "")
    return ""


# ---------------------------------------------------------------------- every consumer reads the declaration
def test_every_consumer_reads_the_declarations():
    names = schedule_names()
    assert names == tuple(SCHEDULE_SPECS) == schedules.SCHEDULES == ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
    schedule_action = next(a for a in demo.build_parser()._actions if a.dest == "schedule")
    assert tuple(schedule_action.choices) == names
    assert "--schedule " + "|".join(names) + " " in entry.USAGE
    req = Request(GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8), world=2,
                  global_batch=8, seq_len=8, memory_bytes=2**30)
    planned = {lay.schedule for lay, _ in search.candidate_layouts(req) if lay.pp > 1}
    assert planned == {s.name for s in SCHEDULE_SPECS.values() if not s.splits_backward}
    for spec in SCHEDULE_SPECS.values():
        assert PipelineConfig(schedule=spec.name).chunks() == spec.chunks
        assert layout_of(spec.name) == spec.layout
        chunks = {lay.num_chunks for lay, _ in search.candidate_layouts(req, schedules=(spec.name,)) if lay.pp > 1}
        assert chunks == {spec.chunks}, spec.name
        # the demo asks for pp x chunks layers, evenly split where a rank holds several chunks
        assert (_layer_error(spec.name, 2, 6) != "") == spec.virtual_stages, spec.name
        assert (f"pp x chunks = {2 * spec.chunks}" in _layer_error(spec.name, 2, 3)) == spec.virtual_stages
        # the builder agrees with the flags: W instructions iff the backward is split; the micro-batch rules
        p, v = 2, spec.chunks
        streams = build_all(spec.name, p, 2 * p, v)
        simulate(streams, num_chunks=v, layout=spec.layout)
        has_w = any(isinstance(s, Instr) and s.op == "W" for stream in streams for s in stream)
        assert has_w == spec.splits_backward, spec.name
        for m, needs in ((1, spec.microbatches_at_least_pp or spec.microbatches_multiple_of_pp),
                         (3, spec.microbatches_multiple_of_pp)):
            if needs:
                with pytest.raises(ValueError, match=spec.title):
                    check_schedule_args(spec.name, p, m, v)
            else:
                check_schedule_args(spec.name, p, m, v)


def test_an_unknown_schedule_names_the_known_ones():
    for bad in ("zigzag", None, ["1f1b"]):
        with pytest.raises(ValueError, match=r"unknown schedule .*'gpipe', '1f1b', 'interleaved', 'zb-h1', 'zbv'"):
            schedule_spec(bad)
    with pytest.raises(SystemExit):
        _demo_args("--schedule", "zigzag")
    with pytest.raises(TypeError):
        SCHEDULE_SPECS["toy"] = SCHEDULE_SPECS["gpipe"]           # the registry is read-only


# ---------------------------------------------------------------------- a new schedule is one declaration
def lifo_order(p: int, m: int, rank: int):
    """All forwards, then the backwards newest first (GPipe with a last-in-first-out backward)."""
    return [Forward(i) for i in range(m)] + [Backward(i) for i in reversed(range(m))]


TOY = ScheduleSpec("gpipe-lifo", "GPipe LIFO", lambda p, m, rank, v: lifo_order(p, m, rank))


def test_a_toy_schedule_is_one_declaration(monkeypatch):
    monkeypatch.setattr(schedules, "SCHEDULE_SPECS", {**SCHEDULE_SPECS, TOY.name: TOY})
    assert schedule_names()[-1] == "gpipe-lifo" and layout_of("gpipe-lifo") == "loop"
    streams = build_all("gpipe-lifo", 3, 4)
    stats = simulate(streams)                                  # deadlock-free, everything run once
    assert stats["backwards"] == [4, 4, 4] and stats["max_in_flight"] == [4, 4, 4]
    with pytest.raises(ValueError, match="one chunk per rank"):
        check_schedule_args("gpipe-lifo", 2, 2, 2)
    assert PipelineConfig(schedule="gpipe-lifo").chunks() == 1
    assert _demo_args("--schedule", "gpipe-lifo").schedule == "gpipe-lifo"
    assert _layer_error("gpipe-lifo", 2, 6) == ""


# ---------------------------------------------------------------------- freeze training and ZBV's two chunks
CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def body_freeze_zbv(rank, world):
    trainer = FreezeTrainer(_gpt, dp=1, pp=2, loss_fn=_loss, freeze="1:1",
                            mesh_factory=lambda d, p: cached_mesh(dp=d, pp=p), optimizer=OptimizerConfig(lr=1e-3),
                            pipeline=PipelineConfig(schedule="zbv", num_microbatches=4))
    start = (trainer.chunks, trainer.start.chunks, len(trainer.model.chunks))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):                                          # the freeze at step 1 re-lays the run out
        tokens = torch.randint(0, CFG["vocab_size"], (8, 9), generator=gen)
        losses.append(trainer.train_step(tokens[:, :-1], tokens[:, 1:])["loss"])
    after = (trainer.layout.dp, trainer.layout.pp, trainer.layout.chunks, len(trainer.model.chunks))
    return start, after, losses


def test_freeze_training_runs_zbv_with_two_chunks_a_rank(dist_pools):
    for start, after, losses in dist_pools(2).run(body_freeze_zbv):
        assert start == (2, 2, 2), start
        # 3 active blocks cannot fill pp 2 x 2 chunks: one stage of two chunks, two replicas
        assert after == (2, 1, 2, 2), after
        assert all(torch.isfinite(torch.tensor(loss)) for loss in losses), losses
