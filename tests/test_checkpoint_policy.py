"""Checkpoint placement policies (``activations/checkpoint_policy.py``): Chen et al.'s sqrt(n) segments and the
least recomputation within a memory budget. What each chooses for 1..16 blocks, the budget's search
against brute force, the memory each keeps (measured), and gradients bit-identical to no checkpointing
on the reference GPT and on HF Llama through ``split_model``, and in a 2-stage pipeline."""
import itertools
import math
import random

import pytest
import torch

from parallel_layers.activations.checkpoint_policy import (
    CheckpointPlan,
    EveryBlock,
    FirstBlocks,
    LiveBytes,
    MemoryBudget,
    SqrtPolicy,
    budget_plan,
    min_peak,
    plan_memory,
    resolve_policy,
    saved_bytes,
)
from parallel_layers.activations.recompute import checkpoint_placement
from parallel_layers.models.gpt import GPT, GPTConfig


@pytest.mark.parametrize("n", range(1, 17))
def test_sqrt_segments(n):
    plan = SqrtPolicy().plan(n)
    k = math.ceil(math.sqrt(n))
    lengths = [e - s for s, e in plan.segments]
    assert plan.segments[0][0] == 0 and plan.segments[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(plan.segments, plan.segments[1:]))        # contiguous: all recomputed
    assert len(lengths) == math.ceil(n / k) and max(lengths) <= k and max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)
    assert plan.recomputed == n


def test_sqrt_segments_named_cases():
    assert SqrtPolicy().plan(16).segments == ((0, 4), (4, 8), (8, 12), (12, 16))
    assert SqrtPolicy().plan(10).segments == ((0, 4), (4, 7), (7, 10))
    assert SqrtPolicy().plan(2).segments == ((0, 2),)
    assert SqrtPolicy().plan(1).segments == ((0, 1),)
    assert SqrtPolicy(segment=3).plan(7).segments == ((0, 3), (3, 5), (5, 7))
    assert resolve_policy("sqrt") == SqrtPolicy()


@pytest.mark.parametrize("n", range(1, 17))
def test_every_and_first_blocks(n):
    assert EveryBlock().plan(n).segments == tuple((i, i + 1) for i in range(n))
    assert FirstBlocks(3).plan(n).segments == tuple((i, i + 1) for i in range(min(3, n)))
    assert checkpoint_placement(True, n).static_count == n
    assert checkpoint_placement(5, n).static_count == min(5, n)
    assert checkpoint_placement(False, n).static_count == 0
    assert checkpoint_placement(MemoryBudget(fraction=0.5), n).static_count is None      # measured first


def _all_plans(n):
    """Every placement of n blocks: each block plain, starting a segment, or continuing the one before."""
    for labels in itertools.product("psc", repeat=n):
        if any(lab == "c" and (i == 0 or labels[i - 1] == "p") for i, lab in enumerate(labels)):
            continue
        segs = []
        for i, lab in enumerate(labels):
            if lab == "s":
                segs.append([i, i + 1])
            elif lab == "c":
                segs[-1][1] = i + 1
        yield CheckpointPlan(n, tuple(map(tuple, segs)))


@pytest.mark.parametrize("n", range(1, 9))
def test_budget_is_the_least_recomputation_brute_force(n):
    rng = random.Random(n)
    plans = list(_all_plans(n))
    for trial in range(6):
        a = [rng.randint(5, 40) for _ in range(n)]
        x = [rng.randint(1, 6) for _ in range(n)]
        costs = None if trial % 2 else [rng.randint(1, 5) for _ in range(n)]
        c = costs or [1] * n
        table = [(sum(sum(c[s:e]) for s, e in p.segments), plan_memory(p, a, x), p) for p in plans]
        for budget in sorted({pk for _, (_, pk), _ in table})[::max(1, len(table) // 12)] + [sum(a) * 2]:
            fits = [(cost, kept) for cost, (kept, pk), _ in table if pk <= budget]
            got = budget_plan(a, x, budget, costs)
            kept, peak = plan_memory(got, a, x)
            assert peak <= budget
            assert (sum(sum(c[s:e]) for s, e in got.segments), kept) == min(fits), (a, x, costs, budget, got)
        least = min(pk for _, (_, pk), _ in table)
        assert abs(min_peak(a, x) - least) <= 0.5
        with pytest.raises(ValueError, match="no checkpoint placement"):
            budget_plan(a, x, least - 1)


@pytest.mark.parametrize("n", range(1, 17))
def test_budget_on_uniform_blocks(n):
    """Blocks alike (a = 10 x their input): a budget of the whole model's bytes recomputes nothing, the
    peak of every-block checkpointing is met with no more recomputation than it has, and the plan keeps
    no more than the budget."""
    a, x = [10.0] * n, [1.0] * n
    assert budget_plan(a, x, sum(a)).segments == ()
    every = plan_memory(EveryBlock().plan(n), a, x)[1]
    plan = budget_plan(a, x, every)
    assert plan_memory(plan, a, x)[1] <= every and plan.recomputed <= n
    for frac in (0.3, 0.5, 0.8):
        budget = max(frac * sum(a), min_peak(a, x))
        plan = budget_plan(a, x, budget)
        kept, peak = plan_memory(plan, a, x)
        assert kept <= peak <= budget


def test_budget_too_small_names_the_numbers():
    with pytest.raises(ValueError, match=r"fits 20 bytes.*every block checkpointed peaks at 50 \(keeps 40\).*"
                                         r"smallest any placement reaches is"):
        budget_plan([10.0] * 4, [10.0] * 4, 20)
    with pytest.raises(ValueError, match="checkpoint="):
        resolve_policy("every")
    with pytest.raises(ValueError, match="budget_bytes or fraction"):
        MemoryBudget()


def _gpt(checkpoint, n_layer=6, dropout=0.1):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, n_layer=n_layer, n_head=2, d_model=32, max_seq_len=16, dropout=dropout)
    return GPT(cfg, checkpoint=checkpoint).train()


def _gpt_grads(model, seed=1):
    g = torch.Generator().manual_seed(3)
    idx, tgt = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    torch.manual_seed(seed)                       # this step's dropout masks
    model(idx, tgt)[1].backward()
    return [p.grad.clone() for p in model.parameters()]


POLICIES = [True, 2, "sqrt", SqrtPolicy(segment=4), MemoryBudget(fraction=0.5), MemoryBudget(fraction=0.25)]


def test_gpt_gradients_bit_identical_under_every_policy():
    plain = _gpt_grads(_gpt(False))
    other = _gpt_grads(_gpt(False), seed=2)
    assert not all(torch.equal(a, b) for a, b in zip(plain, other)), "dropout had no effect: the test proves nothing"
    for ckpt in POLICIES:
        model = _gpt(ckpt)
        got = _gpt_grads(model)
        assert all(torch.equal(a, b) for a, b in zip(plain, got)), ckpt
    (plan,) = model.checkpointing.plans.values()          # the budget measured once, chose segments
    assert 0 < plan.recomputed <= 6


def test_memory_measured_none_sqrt_every_block():
    """Measured on a 16-block GPT: the bytes kept at the end of forward (saved-tensor hooks) fall from none
    to every block to sqrt segments (4 inputs against 16), and the peak through backward (every storage
    created, gradients left out) falls from none to sqrt to every block (a 4-block segment recomputed at
    once against one block)."""
    kept, peak = {}, {}
    for name, ckpt in (("none", False), ("sqrt", "sqrt"), ("every", True), ("budget", MemoryBudget(fraction=0.5))):
        model = _gpt(ckpt, n_layer=16, dropout=0.0)
        g = torch.Generator().manual_seed(3)
        idx, tgt = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
        if name == "budget":
            _gpt_grads(model)                                    # the measuring forward happens once, here
            model.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            (_, loss), kept[name] = saved_bytes(lambda: model(idx, tgt))
            loss.backward()
        peak[name] = live.peak([p.grad for p in model.parameters()])
    assert kept["none"] > kept["every"] > kept["sqrt"], kept
    assert peak["none"] > peak["sqrt"] > peak["every"], peak
    assert peak["budget"] <= 0.6 * peak["none"], peak          # the budget: half the blocks' bytes, plus the head


def _llama_stage(checkpoint):
    from parallel_layers.families import recipe_for
    from parallel_layers.pipeline.any_model import split_model
    from tests.hf_models import hf_model, loss_fn
    model = hf_model("llama", tie=False, dropout=0.1, layers=6).train()
    (stage,) = split_model(model, recipe_for(model), 0, 1, loss_fn=loss_fn, checkpoint=checkpoint)
    return stage.train()


def test_llama_gradients_bit_identical_through_split_model():
    from tests.hf_models import token_batches
    ((idx, tgt, _),) = token_batches(1, 4, 16, mask=False)

    def grads(stage, seed=1):
        torch.manual_seed(seed)
        stage(idx, tgt).backward()
        return [p.grad.clone() for p in stage.parameters()]

    plain = grads(_llama_stage(False))
    assert not all(torch.equal(a, b) for a, b in zip(plain, grads(_llama_stage(False), seed=2))), "no dropout"
    for ckpt in (True, "sqrt", MemoryBudget(fraction=0.5)):
        stage = _llama_stage(ckpt)
        assert all(torch.equal(a, b) for a, b in zip(plain, grads(stage))), ckpt
        if isinstance(ckpt, MemoryBudget):
            (plan,) = stage.checkpointing.plans.values()
            assert plan.recomputed > 0


def body_pipeline_policies(rank, world):
    """One 1F1B step with dropout, 4 blocks per stage: plain, sqrt segments and a budget, gradients equal."""
    from parallel_layers.families import recipe_for
    from parallel_layers.pipeline import PipelineEngine, split_model
    from parallel_layers.testing import cached_mesh
    mesh = cached_mesh(pp=world)
    cfg = GPTConfig(vocab_size=48, n_layer=8, n_head=2, d_model=16, max_seq_len=8, dropout=0.2)
    g = torch.Generator().manual_seed(1)
    idx, tgt = torch.randint(0, 48, (8, 8), generator=g), torch.randint(0, 48, (8, 8), generator=g)
    out = []
    for ckpt in (False, "sqrt", MemoryBudget(fraction=0.5)):
        gpt = cfg.build(seed=0)
        chunks = split_model(gpt, recipe_for(gpt), mesh.pp_rank, world, tied_group=mesh.tied_stage_group(),
                             checkpoint=ckpt)
        engine = PipelineEngine(chunks, mesh.pp_group, schedule="1f1b", num_microbatches=2)
        torch.manual_seed(5)
        engine.step(idx, tgt)
        out.append((torch.cat([p.grad.flatten() for p in chunks[0].parameters()]),
                    [p.describe() for p in chunks[0].checkpointing.plans.values()]))
    return [torch.equal(out[0][0], o[0]) for o in out[1:]], out[-1][1]


def test_pipeline_pp2_policies_bit_identical(dist_pools):
    for r, (same, budget_plans) in enumerate(dist_pools(2).run(body_pipeline_policies)):
        assert all(same), (r, same)
        assert len(budget_plans) == 1, (r, budget_plans)        # measured once, on the first micro-batch


def test_benchmark_smoke():
    """``benchmarks.checkpoint_policy``'s smoke profile: a row per model and policy; nothing about speed."""
    from benchmarks import checkpoint_policy
    rows = checkpoint_policy.collect("smoke", torch.device("cpu"))
    cases = {r["case"] for r in rows}
    for model in ("gpt", "llama"):
        for policy in ("none", "every", "first_half", "sqrt", "budget50"):
            assert f"{model}_{policy}" in cases, cases
    for r in rows:
        assert r["ours_median_ms"] > 0 and r["mem_mb"] > 0, r
