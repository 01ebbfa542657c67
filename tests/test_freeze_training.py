"""Freeze training with elastic pipelining (parallel_layers.freeze_training, after PipeTransformer) on 4 gloo ranks:
with freezing off the trainer is Parallel3D bit for bit; with a fixed schedule it equals one process whose
torch AdamW trains the same model with the same blocks frozen (requires_grad=False) at the same step, across
a re-layout pp 4 -> 2, dp 1 -> 2 that moves parameters, AdamW moments and step count exactly and keeps every
global batch's samples in order; the prefix cache serves a later epoch without running the prefix; the
policies, the layout choice and the demo's --freeze."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
from parallel_layers.composition.parallel3d import Parallel3D
from parallel_layers.families import recipe_for
from parallel_layers.freeze_training import (
    AutoFreeze,
    FreezeSchedule,
    FreezeTrainer,
    NoFreeze,
    PrefixCache,
    choose_layout,
    freeze_prefix_,
    parse_freeze,
    split_at,
)
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)
OPT = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
CLIP, BATCH, SEQ, SAMPLES, STEPS, FREEZE_AT = 0.5, 8, 8, 16, 6, 2
TOL = 1e-5


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _data():
    """16 fixed samples; each epoch (2 steps of 8) visits all of them in its own order."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG["vocab_size"], (SAMPLES, SEQ + 1), generator=gen)
    steps = []
    for epoch in range(STEPS * BATCH // SAMPLES):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch))
        for ids in order.split(BATCH):
            steps.append((tokens[ids, :-1], tokens[ids, 1:], ids))
    return steps


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _reference(freeze_at=FREEZE_AT, frozen=2):
    """One process: torch AdamW, global clipping, the first ``frozen`` blocks (and the tied embedding)
    frozen from step ``freeze_at``: (losses, final parameters)."""
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), **OPT, foreach=False)
    losses = []
    for step, (x, y, _) in enumerate(_data()):
        if step == freeze_at:
            freeze_prefix_(model, frozen)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _trainer(freeze, zero, dp=1, pp=4, **kw):
    return FreezeTrainer(_gpt, dp=dp, pp=pp, loss_fn=_loss, freeze=freeze,
                         mesh_factory=lambda d, p: cached_mesh(dp=d, pp=p),
                         optimizer=OptimizerConfig(max_grad_norm=CLIP, **OPT),
                         pipeline=PipelineConfig(num_microbatches=4), data_parallel=DataParallelConfig(zero=zero), **kw)


# ---------------------------------------------------------------------- freezing off = Parallel3D
def body_freeze_off_is_parallel3d(rank, world, zero):
    static = Parallel3D(_gpt(), cached_mesh(dp=2, pp=2), loss_fn=_loss,
                        optimizer=OptimizerConfig(max_grad_norm=CLIP, **OPT),
                        pipeline=PipelineConfig(num_microbatches=4), data_parallel=DataParallelConfig(zero=zero))
    static_losses = [static.train_step(x, y)["loss"] for x, y, _ in _data()[:3]]
    trainer = _trainer("off", zero, dp=2, pp=2)
    losses = [trainer.train_step(x, y, sample_ids=ids)["loss"] for x, y, ids in _data()[:3]]
    mine, theirs = trainer.dense_state_dict(), static.dense_state_dict()
    assert sorted(mine) == sorted(theirs)
    return losses == static_losses, all(torch.equal(mine[n], theirs[n]) for n in mine), trainer.history


@pytest.mark.parametrize("zero", [0, 1])
def test_freeze_off_equals_static_parallel3d_bit_for_bit(dist_pools, zero):
    for same_losses, same_weights, history in dist_pools(4).run(body_freeze_off_is_parallel3d, zero):
        assert same_losses and same_weights and history == []


# ---------------------------------------------------------------------- a fixed schedule across a re-layout
def body_freeze_relayout(rank, world, zero):
    trainer = _trainer(f"{FREEZE_AT}:2", zero, layouts={2: (2, 2)})
    data = _data()
    losses, replica_samples, prefix_samples = [], [], []
    for step, (x, y, ids) in enumerate(data):
        if step == FREEZE_AT:
            before, step_before = trainer.training_state()
            event = trainer.relayout(2, batch=BATCH, cached=True)
            after, step_after = trainer.training_state()
        out = trainer.train_step(x, y, sample_ids=ids)
        losses.append(out["loss"])
        rows = trainer.last_replica_rows if trainer.mesh.pp_rank == 0 and trainer.layout.frozen else None
        replica_samples.append(None if rows is None else ids[rows[0]:rows[1]].tolist())
        prefix_samples.append(trainer.prefix.samples if trainer.prefix is not None else None)
    # the move: every parameter bit-identical; the trained ones' moments and the step count carried
    moved = [torch.equal(before[n]["param"], after[n]["param"]) for n in before]
    trained = [n for n in after if "exp_avg" in after[n]]
    moments = [torch.equal(before[n][k], after[n][k]) for n in trained for k in ("exp_avg", "exp_avg_sq")]
    # the cache: its entries are what the prefix computes now
    cache_err = None
    if trainer.prefix is not None:
        tokens = {}
        for x, _, ids in data:
            tokens.update({i: row for i, row in zip(ids.tolist(), x)})
        order = sorted(tokens)
        fresh = trainer.prefix(torch.stack([tokens[i] for i in order]))      # all 16 in one batch, recomputed
        cache_err = max(_rel(trainer.cache.get(i), fresh[j]) for j, i in enumerate(order))
    return dict(losses=losses, params=trainer.dense_state_dict(), moved=all(moved) and len(moved) > 0,
                moments=all(moments) and len(moments) > 0, steps=(step_before, step_after), event=event,
                layout=(trainer.layout.dp, trainer.layout.pp), coords=(trainer.mesh.dp_rank, trainer.mesh.pp_rank),
                replica_samples=replica_samples, prefix_samples=prefix_samples, cache_err=cache_err,
                cache=trainer.cache.stats(), events=trainer.freeze_events)


@pytest.mark.parametrize("zero", [0, 1])
def test_fixed_schedule_relayout_pp4_to_dp2_pp2_matches_single_process(dist_pools, zero):
    results = dist_pools(4).run(body_freeze_relayout, zero)
    ref_losses, ref_params = _reference()
    data = _data()
    for rank, res in enumerate(results):
        assert res["moved"] and res["moments"], f"rank {rank}: the re-layout changed the state"
        assert res["steps"] == (FREEZE_AT, FREEZE_AT), res["steps"]
        assert res["layout"] == (2, 2) and res["event"]["dp"] == 2 and res["event"]["pp"] == 2, res["event"]
        assert res["events"] == [(FREEZE_AT, 2)]
        errs = [abs(a - b) / b for a, b in zip(res["losses"], ref_losses)]
        assert worst(errs) <= TOL, f"rank {rank}: loss errors {errs}"
        perrs = [(_rel(t, ref_params[n]), n) for n, t in res["params"].items()]
        assert worst(perrs)[0] <= TOL, f"rank {rank}: {worst(perrs)}"
        frozen = [n for n in res["params"] if n.startswith(("wte.", "wpe.", "blocks.0.", "blocks.1."))]
        for n in frozen:       # the frozen prefix never changed after the freeze: equal to the reference's
            assert _rel(res["params"][n], ref_params[n]) <= TOL, n
    # data order: after the re-layout the two replicas' first stages take the two halves, in order
    firsts = sorted((r for r in results if r["coords"][1] == 0), key=lambda r: r["coords"][0])
    assert len(firsts) == 2
    for step in range(FREEZE_AT, STEPS):
        assert firsts[0]["replica_samples"][step] + firsts[1]["replica_samples"][step] == data[step][2].tolist()
    # AutoCache: the epoch after the freeze (steps 2-3) fills it, the next one (steps 4-5) runs no prefix
    for r in firsts:
        counts = r["prefix_samples"]
        assert counts[3] > 0 and counts[5] == counts[3], counts
        assert r["cache"]["entries"] == SAMPLES and r["cache_err"] <= 1e-6, (r["cache"], r["cache_err"])


# ---------------------------------------------------------------------- the adaptive criterion, agreed by every rank
def _reference_block_norms():
    """Each block's gradient norm at the first step of the single-process run (before clipping)."""
    model = _gpt()
    x, y, _ = _data()[0]
    model(x, y)[1].backward()
    return [sum(p.grad.double().pow(2).sum() for p in block.parameters()).sqrt().item() for block in model.blocks]


def body_auto_freeze(rank, world, zero):
    policy = AutoFreeze(CFG["n_layer"], cap=0.5, interval=1, threshold=10.0, warmup_windows=1)
    trainer = _trainer(policy, zero)
    losses, norms = [], None
    for x, y, ids in _data():
        losses.append(trainer.train_step(x, y, sample_ids=ids)["loss"])
        if norms is None:
            norms = trainer.block_norms.clone()
    return dict(losses=losses, norms=norms, events=trainer.freeze_events, decisions=policy.decisions,
                layout=(trainer.layout.dp, trainer.layout.pp), history=trainer.history)


def test_auto_freeze_decides_the_same_on_every_rank_from_agreed_norms(dist_pools):
    results = dist_pools(4).run(body_auto_freeze, 1)
    ref_losses, _ = _reference()
    ref_norms = _reference_block_norms()
    for rank, res in enumerate(results):
        assert torch.equal(res["norms"], results[0]["norms"]), "ranks disagree on the gradient norms"
        errs = [abs(a - b) / b for a, b in zip(res["norms"].tolist(), ref_norms)]
        assert worst(errs) <= TOL, f"rank {rank}: block norms {res['norms'].tolist()} vs {ref_norms}"
        # window 1 is warm-up; window 2 (after step 2) finds every block stable: 2 blocks (rate 0.5 x 4, cap 0.5)
        assert res["events"] == [(FREEZE_AT, 2)] and res["decisions"] == results[0]["decisions"], res["events"]
        assert res["layout"][1] <= 2 and res["layout"][0] * res["layout"][1] == 4, res["layout"]
        errs = [abs(a - b) / b for a, b in zip(res["losses"], ref_losses)]
        assert worst(errs) <= TOL, f"rank {rank}: loss errors {errs}"


# ---------------------------------------------------------------------- policies, layout choice, cache, split
def test_freeze_policies_and_their_errors():
    assert isinstance(parse_freeze("off", 4), NoFreeze) and isinstance(parse_freeze("auto", 4), AutoFreeze)
    sched = parse_freeze("3:1,10:2", 4)
    assert [sched.frozen_blocks(s, 0) for s in (0, 2, 3, 9, 10, 50)] == [0, 0, 1, 1, 2, 2]
    assert sched.frozen_blocks(4, 2) == 2                         # frozen never shrinks
    with pytest.raises(ValueError, match="over the cap of 2"):
        parse_freeze("3:3", 4, cap=0.5)
    with pytest.raises(ValueError, match="must increase"):
        FreezeSchedule({2: 2, 5: 1}, 8)
    with pytest.raises(ValueError, match="is not STEP:BLOCKS"):
        parse_freeze("3-2", 4)
    with pytest.raises(ValueError, match="cap"):
        parse_freeze("auto", 4, cap=1.0)
    # adaptive, 8 blocks, windows of 2 steps: the stable run just above the frozen prefix freezes, bounded by
    # rate x the active blocks per decision (at least 1) and by the cap
    auto = AutoFreeze(8, cap=0.5, interval=2, threshold=0.05, rate=0.25, warmup_windows=1)
    start = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
    later = torch.tensor([1.01, 2.02, 3.0, 4.0, 9.0, 6.0, 7.0, 8.0])        # blocks 0-3 stable, 4 is not
    for step, norms in enumerate([start, start, later, later]):              # window 1: warm-up
        auto.observe(step, 0, norms)
    assert auto.frozen_blocks(4, 0) == 2                                     # 0.25 x 8 active
    for step in (4, 5, 6, 7, 8, 9):
        frozen = auto.frozen_blocks(step, 0)
        auto.observe(step, frozen, later[frozen:])
    assert [d["frozen"] for d in auto.decisions] == [2, 3, 4, 4]             # 0.25 x 6 -> 1, then the cap (4)


def test_choose_layout_fewer_stages_when_they_fit():
    # 8 equal blocks started on pp 4 (2 blocks a stage): 4 active ones fit 2 stages, 6 need 4 (3 would not divide 4)
    pp, bounds, costs = choose_layout([1.0] * 4, world=4, current_pp=4, budget=2.0, batch=8, microbatches=2)
    assert (pp, bounds, costs) == (2, [2], [2.0, 2.0])
    pp, bounds, costs = choose_layout([1.0] * 6, world=4, current_pp=4, budget=2.0, batch=8, microbatches=2)
    assert pp == 4 and len(bounds) == 3 and max(costs) == 2.0
    # the prefix's forward on the first stage moves blocks off it
    pp, bounds, costs = choose_layout([1.0] * 4, world=4, current_pp=4, budget=3.0, batch=8, microbatches=2,
                                      first_extra=1.0)
    assert (pp, bounds, costs) == (2, [1], [2.0, 3.0])
    # nothing fits: the cheapest most expensive stage; a batch that does not split rules a layout out
    pp, _, _ = choose_layout([1.0] * 4, world=4, current_pp=4, budget=0.5, batch=8, microbatches=2)
    assert pp == 4
    pp, _, _ = choose_layout([1.0] * 4, world=4, current_pp=4, budget=2.0, batch=6, microbatches=2)
    assert pp == 4                                                  # 6 does not split into dp 2 x 2 microbatches
    with pytest.raises(ValueError, match="no layout"):
        choose_layout([1.0] * 4, world=4, current_pp=4, budget=2.0, batch=8, microbatches=2, fixed_pp=3)


def test_prefix_cache_bound_and_reset():
    cache = PrefixCache(max_bytes=3 * 4 * 4)                       # three [4] fp32 outputs
    for i in range(4):
        cache.put(i, torch.full((4,), float(i)))
    assert len(cache) == 3 and not cache.accepting and 3 not in cache
    assert torch.equal(cache.get(1), torch.full((4,), 1.0)) and cache.get(3) is None
    cache.reset(2)
    assert len(cache) == 0 and cache.accepting and cache.depth == 2


def test_split_at_runs_the_whole_model_and_freezes_what_the_reference_freezes():
    whole, model = _gpt(), _gpt()
    recipe = recipe_for(model)
    prefix, active, active_recipe = split_at(model, recipe, 2, keep_prefix=True)
    x, y, _ = _data()[0]
    h = active_recipe.embed(active, prefix(x))
    for block in active.blocks:
        h = active_recipe.block(block, h, {})
    assert torch.equal(_loss(active_recipe.head(active, h), y), whole(x, y)[1])
    frozen = freeze_prefix_(whole, 2)
    assert frozen == [n for n, _ in whole.named_parameters() if n.startswith(("wte", "wpe", "blocks.0.", "blocks.1."))]
    assert {n for n, p in active.named_parameters() if not p.requires_grad} == {"wte.weight"}   # the tied head
    assert len(active.blocks) == 2 and active.wpe is None and prefix.calls == 1


# ---------------------------------------------------------------------- the demo
def test_demo_freeze_shows_the_layout_changing(tmp_path):
    out = tmp_path / "demo_freeze"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--dp", "1", "--tp", "1", "--pp", "4", "--freeze", "2:2",
           "--steps", "4", "--n-layer", "4", "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--batch-size",
           "8", "--microbatches", "4", "--corpus-bytes", "200000", "--eval-interval", "2", "--out", str(out),
           "--no-progress"]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("layout after step 2: froze blocks 0-1; dp 1 x pp 4, nothing frozen, stages [0 | 1 | 2 | 3] -> "
            "dp 2 x pp 2, blocks 0-1 frozen, stages [2 | 3]") in proc.stdout, proc.stdout
    assert "losses and validation losses agree" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [(e["step"], e["frozen"], e["dp"], e["pp"]) for e in summary["freeze"]] == [(2, 2, 2, 2)]
    assert os.path.getsize(out / "timeline.png") > 1000
    from parallel_layers.cli import demo
    with pytest.raises(SystemExit, match="--freeze trades pipeline stages"):
        demo.check_args(demo.build_parser().parse_args(["--freeze", "auto", "--tp", "2"]))


# ---------------------------------------------------------------------- any model Parallel3D takes: HF Llama
def _llama():
    from hf_models import hf_model
    return hf_model("llama", tie=True)


def _llama_batches():
    from hf_models import token_batches
    return token_batches(4, BATCH, SEQ, mask=True)


def body_llama_freeze(rank, world):
    from hf_models import loss_fn
    trainer = FreezeTrainer(_llama, dp=1, pp=4, loss_fn=loss_fn, freeze="2:2", layouts={2: (2, 2)},
                            mesh_factory=lambda d, p: cached_mesh(dp=d, pp=p),
                            optimizer=OptimizerConfig(max_grad_norm=CLIP, **OPT),
                            pipeline=PipelineConfig(num_microbatches=4), data_parallel=DataParallelConfig(zero=1))
    losses = [trainer.train_step(x, y, attention_mask=m)["loss"] for x, y, m in _llama_batches()]
    return losses, trainer.dense_state_dict(), (trainer.layout.dp, trainer.layout.pp)


def test_hf_llama_freezes_through_its_recipe(dist_pools):
    from hf_models import loss_fn, rel_err
    results = dist_pools(4).run(body_llama_freeze)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), **OPT, foreach=False)
    ref = []
    for step, (x, y, m) in enumerate(_llama_batches()):
        if step == 2:
            freeze_prefix_(model, 2)
        loss = loss_fn(model(input_ids=x, attention_mask=m).logits, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        ref.append(loss.item())
    dense = dict(model.named_parameters())
    for rank, (losses, params, layout) in enumerate(results):
        assert layout == (2, 2)
        assert worst([abs(a - b) / b for a, b in zip(losses, ref)]) <= TOL, (rank, losses, ref)
        errs = [(rel_err(n, t, dense[n].detach()), n) for n, t in params.items()]
        assert worst(errs)[0] <= TOL, (rank, worst(errs))


# ---------------------------------------------------------------------- the benchmark
def test_benchmark_smoke_reports_time_to_the_same_loss():
    """``benchmarks.freeze_training``'s smoke profile end to end (no CSV); nothing about speed."""
    from benchmarks import freeze_training
    rows, res, runs = freeze_training._collect("smoke")
    assert set(res) == {"static pp4", "freeze elastic", "freeze keep-pp"}
    assert all(r["time_ms"] is not None and r["time_ms"] > 0 for r in res.values()), res
    assert len(rows) == 2 and all(r["speedup"] > 0 for r in rows), rows
    for name in ("freeze elastic", "freeze keep-pp"):        # 2 of 4 blocks frozen at step 4; the rest on dp2 x pp2
        assert [(e["step"], e["frozen"], e["dp"], e["pp"]) for e in res[name]["history"]] == [(4, 2, 2, 2)]
        assert runs[name]["losses"][:4] == runs["static pp4"]["losses"][:4]     # nothing frozen yet: the same run
