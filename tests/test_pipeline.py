"""Pipeline parallelism on real gloo ranks, every rank checked: each schedule at pp = 2 and 4 against
the unpipelined GPT (same seed, same full batch; float64 and float32), activation checkpointing with
dropout on, and bad input that must end in a clear error on every rank, never a hang."""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers.families import recipe_for
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.pipeline import PipelineEngine, split_model, tied_embedding_group
from parallel_layers.testing import RankFailure, cached_mesh
from parallel_layers.testing.compare import worst


def _tied(mesh):
    return mesh.tied_stage_group()      # made once per mesh (a collective: every rank builds it in the same body)


def _stages(cfg, rank, world, *, seed=0, dtype=None, **split):
    """This rank's stages of the reference GPT drawn from ``seed`` (the one-process model's weights), cut by its
    recipe as every other model is; the last stage returns its loss as ``(sum, count)``."""
    model = cfg.build(seed=seed, dtype=dtype)
    return split_model(model, recipe_for(model), rank, world, **split)


def _config(n_layer, dropout=0.0, tie=True):
    return GPTConfig(vocab_size=48, n_layer=n_layer, n_head=2, d_model=16, max_seq_len=8, dropout=dropout,
                     tie_embeddings=tie)


def _batch(batch=8, seq=8, vocab=48):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def body_parity(rank, world, schedule, m, v, tie, timeline_png, dtype=torch.float64):
    mesh = cached_mesh(pp=world)
    cfg = _config(n_layer=8, tie=tie)
    idx, targets = _batch()
    torch.manual_seed(0)
    dense = GPT(cfg, dtype=dtype)
    _, ref_loss = dense(idx, targets)
    ref_loss.backward()
    ref = {n: p.grad for n, p in dense.named_parameters()}

    chunks = _stages(cfg, mesh.pp_rank, world, num_chunks=v, tied_group=_tied(mesh) if tie else None,
                     dtype=dtype)
    engine = PipelineEngine(chunks, mesh.pp_group, schedule=schedule, num_microbatches=m)
    loss = engine.step(idx, targets)
    errs, names = [], []
    for chunk in chunks:
        for n, p in chunk.named_parameters():
            r = ref[chunk.dense_name(n)]
            errs.append(((p.grad - r).norm() / r.norm().clamp_min(1e-30)).item())
            names.append(chunk.dense_name(n))
    out = {"loss_err": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()), "grad_err": worst(errs),
           "names": names, "prefetched": engine.prefetched_receives}
    if timeline_png:
        path = engine.draw_timeline(timeline_png)
        out["png"] = path
        out["bubble"] = engine.bubble_fraction()
        out["breakdown"] = engine.bubble_breakdown()
        out["events"] = len(engine.timeline.events)
    return out


# float64 shows the pipeline computes the same sums (up to reordering); float32 is held to the suite's usual 1e-5
TOLERANCES = {"float64": (1e-12, 1e-10), "float32": (1e-5, 1e-5)}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule,m,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved", 4, 2)])
def test_pipeline_matches_unpipelined_gpt(dist_pools, tmp_path, world, schedule, m, v, dtype):
    png = str(tmp_path / "timeline.png") if (world == 2 and schedule == "1f1b" and m == 4 and
                                             dtype == "float64") else None
    out = dist_pools(world).run(body_parity, schedule, m, v, True, png, getattr(torch, dtype))
    covered = set()
    loss_tol, grad_tol = TOLERANCES[dtype]
    for r, res in enumerate(out):
        assert res["loss_err"] < loss_tol, (r, res["loss_err"])
        assert res["grad_err"] < grad_tol, (r, res["grad_err"])
        covered |= set(res["names"])
    cfg = _config(8)
    torch.manual_seed(0)
    assert covered == {n for n, _ in GPT(cfg).named_parameters()}    # every parameter lives on a stage
    if dist_pools.backend == "nccl_rules":     # under NCCL a receive posted ahead blocks the rank's sends
        assert all(res["prefetched"] == 0 for res in out)
    else:
        # gloo: receives are posted one communication step ahead (the gradients stage 0 waits for, the
        # activations after the first on the last stage; the first activation of a link waits for its header)
        assert sum(res["prefetched"] for res in out) > 0
        if world == 2 and schedule == "1f1b":
            assert [res["prefetched"] for res in out] == [m, m - 1]
    if png:
        assert os.path.getsize(out[0]["png"]) > 1000
        assert 0.0 <= out[0]["bubble"] < 1.0 and out[1]["events"] >= 2 * m
        b = out[0]["breakdown"]          # a real run's parts add up to what it measured
        assert b["measured"] == pytest.approx(out[0]["bubble"]) and b["ideal"] == pytest.approx(1 / 5)
        assert b["ideal"] + b["imbalance_jitter"] + b["engine_overhead"] + b["messages"] == pytest.approx(b["measured"])
        assert all(res.get("png") is None for res in out[1:])


def _train_step_errs(dense, chunks, engine, idx, targets):
    """One engine step against the dense model on the same batch: (loss rel. error, worst grad rel. error)."""
    dense.zero_grad()
    _, ref_loss = dense(idx, targets)
    ref_loss.backward()
    ref = {n: p.grad for n, p in dense.named_parameters()}
    for chunk in chunks:
        chunk.zero_grad()
    loss = engine.step(idx, targets)
    grad_err = worst(((p.grad - ref[c.dense_name(n)]).norm() / ref[c.dense_name(n)].norm().clamp_min(1e-30)).item()
                     for c in chunks for n, p in c.named_parameters())
    return abs(loss.item() - ref_loss.item()) / ref_loss.item(), grad_err


def body_changing_shapes(rank, world, schedule, m, v):
    """Several steps on one engine whose batch shape changes between steps (sequence length, then batch
    size), each step against the unpipelined model: the first activation of a link is received in the
    last step's shape (posted ahead), and a changed shape must still land in the right buffer. Receives
    are posted by the background thread in most steps and inline in the others."""
    mesh = cached_mesh(pp=world)
    cfg = _config(n_layer=8)
    torch.manual_seed(0)
    dense = GPT(cfg, dtype=torch.float64)
    chunks = _stages(cfg, mesh.pp_rank, world, num_chunks=v, tied_group=_tied(mesh), dtype=torch.float64)
    engine = PipelineEngine(chunks, mesh.pp_group, schedule=schedule, num_microbatches=m)
    out = []
    for i, (batch, seq) in enumerate(((8, 8), (8, 8), (8, 6), (8, 6), (16, 6), (8, 8))):
        engine.transport.p2p.background = i % 3 != 2     # receives posted on gloo's behalf by a thread, or inline
        loss_err, grad_err = _train_step_errs(dense, chunks, engine, *_batch(batch, seq))
        out.append((loss_err, grad_err, engine.prefetched_receives))
    return out


@pytest.mark.parametrize("world,schedule,m,v", [(2, "1f1b", 4, 1), (2, "interleaved", 4, 2), (4, "gpipe", 4, 1),
                                                (4, "interleaved", 4, 2)])
def test_pipeline_batch_shape_changes_between_steps(dist_pools, world, schedule, m, v):
    out = dist_pools(world).run(body_changing_shapes, schedule, m, v)
    for r, steps in enumerate(out):
        for i, (loss_err, grad_err, _) in enumerate(steps):
            assert loss_err < 1e-12 and grad_err < 1e-10, (r, i, loss_err, grad_err)
    if schedule == "1f1b" and dist_pools.backend == "gloo":
        # the last stage waits for its first activation with the receive posted ahead, from step 2 on
        assert [s[2] for s in out[1]] == [m - 1] + [m] * 5, out[1]


def _within(module, parent):
    return any(module is x for x in parent.modules())


def body_evaluate(rank, world, schedule, m, v, dropout):
    """Forward-only evaluation against the dense model in eval mode, between training steps, on batches
    of other shapes than the training ones. With dropout on, only eval mode gives the dense loss."""
    mesh = cached_mesh(pp=world)
    cfg = _config(n_layer=8, dropout=dropout)
    torch.manual_seed(0)
    dense = GPT(cfg, dtype=torch.float64)
    chunks = _stages(cfg, mesh.pp_rank, world, num_chunks=v, tied_group=_tied(mesh), dtype=torch.float64)
    engine = PipelineEngine(chunks, mesh.pp_group, schedule=schedule, num_microbatches=m)
    frozen = chunks[0].blocks[0]              # a user's module left in eval mode keeps it after evaluate()
    frozen.eval()
    first = next(n for n, _ in chunks[0].named_parameters() if n.startswith("blocks.0."))
    dense.blocks[int(chunks[0].dense_name(first).split(".")[1])].eval()
    out = []
    for kind, (batch, seq) in (("train", (8, 8)), ("eval", (16, 6)), ("train", (8, 8)), ("eval", (8, 8))):
        idx, targets = _batch(batch, seq)
        if kind == "eval":
            dense.eval()
            with torch.no_grad():
                _, ref_loss = dense(idx, targets)
            before = [p.grad.clone() for c in chunks for p in c.parameters()]
            events = list(engine.timeline.events)
            loss = engine.evaluate(idx, targets)
            untouched = all(torch.equal(a, p.grad) for a, p in zip(before, (p for c in chunks for p in c.parameters())))
            out.append({"kind": kind, "loss_err": abs(loss.item() - ref_loss.item()) / ref_loss.item(),
                        "grads_untouched": untouched, "modes_kept": not frozen.training and all(
                            m.training for c in chunks for m in c.modules() if not _within(m, frozen)),
                        "timeline_kept": engine.timeline.events == events, "requires_grad": loss.requires_grad})
            continue
        if dropout:                            # training masks differ from the dense model's: run it only
            for c in chunks:
                c.zero_grad()
            engine.step(idx, targets)
            continue
        dense.train()
        loss_err, grad_err = _train_step_errs(dense, chunks, engine, idx, targets)
        out.append({"kind": kind, "loss_err": loss_err, "grad_err": grad_err})
    return out


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("world,schedule,m,v", [(2, "gpipe", 4, 1), (2, "1f1b", 4, 1), (2, "interleaved", 4, 2),
                                                (4, "1f1b", 4, 1), (4, "interleaved", 4, 2)])
def test_pipeline_evaluate_matches_dense_eval_loss(dist_pools, world, schedule, m, v, dropout):
    out = dist_pools(world).run(body_evaluate, schedule, m, v, dropout)
    for r, steps in enumerate(out):
        assert [s["kind"] for s in steps] == (["eval", "eval"] if dropout else ["train", "eval", "train", "eval"])
        for i, s in enumerate(steps):
            assert s["loss_err"] < 1e-12, (r, i, s)
            if s["kind"] == "train":
                assert s["grad_err"] < 1e-10, (r, i, s)
            else:
                assert s["grads_untouched"] and s["modes_kept"] and s["timeline_kept"], (r, i, s)
                assert not s["requires_grad"], (r, i, s)


def test_pipeline_untied_embeddings(dist_pools):
    for res in dist_pools(2).run(body_parity, "1f1b", 2, 1, False, None):
        assert res["loss_err"] < 1e-12 and res["grad_err"] < 1e-10


def body_checkpointing(rank, world):
    """Gradients of one 1F1B step with dropout on: plain, every block checkpointed, the first block of
    each stage checkpointed (Megatron's block method), and plain with other dropout masks. Also counts
    each block's forward calls: a checkpointed block runs twice per microbatch (forward, recompute)."""
    mesh = cached_mesh(pp=world)
    cfg = _config(n_layer=4, dropout=0.2)
    idx, targets = _batch()
    grads, calls = [], []
    for ckpt, step_seed in ((False, 5), (True, 5), (1, 5), (False, 6)):
        chunks = _stages(cfg, mesh.pp_rank, world, tied_group=_tied(mesh), checkpoint=ckpt)
        count = [0] * len(chunks[0].blocks)
        for i, block in enumerate(chunks[0].blocks):
            block.register_forward_pre_hook(lambda *_, i=i: count.__setitem__(i, count[i] + 1))
        engine = PipelineEngine(chunks, mesh.pp_group, schedule="1f1b", num_microbatches=2)
        torch.manual_seed(step_seed)              # the dropout masks of this step
        engine.step(idx, targets)
        grads.append(torch.cat([p.grad.flatten() for p in chunks[0].parameters()]))
        calls.append(count)
    return [torch.equal(grads[0], g) for g in grads[1:]], calls


def test_activation_checkpointing_replays_dropout(dist_pools):
    for r, (same, calls) in enumerate(dist_pools(2).run(body_checkpointing)):
        every, first, other_seed = same
        assert every and first, f"rank {r}: checkpointed gradients differ from the plain ones {same}"
        assert not other_seed, f"rank {r}: dropout had no effect (test would prove nothing)"
        # 2 blocks per stage, 2 microbatches: recomputed blocks run 4 times, the others twice
        assert calls == [[2, 2], [4, 4], [4, 2], [2, 2]], (r, calls)


def test_checkpoint_setting_is_checked():
    for bad in (-1, 1.5, "all"):
        with pytest.raises(ValueError, match="checkpoint="):
            _stages(_config(n_layer=2), 0, 1, checkpoint=bad)
    (stage,) = _stages(_config(n_layer=4, tie=False), 0, 2, checkpoint=9)
    assert stage.checkpoint_blocks == 2          # more than a stage holds: every block


def _short_group(seconds=3.0):
    return dist.new_group(list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=seconds))


def body_bad_config(rank, world):
    msgs = []
    group = cached_mesh(pp=world).pp_group
    try:
        PipelineEngine([nn.Identity()], group, schedule="1f1b", num_microbatches=world - 1)
    except ValueError as e:
        msgs.append(str(e))
    try:
        PipelineEngine([nn.Identity(), nn.Identity()], group, schedule="interleaved", num_microbatches=3)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_bad_configuration_is_a_clear_error_on_every_rank(dist_pools):
    for msgs in dist_pools(4).run(body_bad_config):
        assert len(msgs) == 2, msgs
        assert "1F1B needs at least as many microbatches as stages" in msgs[0] and "3 < 4" in msgs[0]
        assert "divisible by the pipeline size" in msgs[1]


def body_shape_mismatch(rank, world):
    group = _short_group()
    chunks = _stages(_config(n_layer=4, tie=False), rank, world)
    engine = PipelineEngine(chunks, group, schedule="gpipe", num_microbatches=2, tensor_shape=(4, 8, 17))
    idx, targets = _batch()
    try:
        engine.step(idx, targets)
    except (ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def test_shape_mismatch_between_stages_is_a_clear_error(dist_pools):
    out = dist_pools(4).run(body_shape_mismatch, timeout=60)
    # stages 0 and 1 see the bad shape at once; the stages behind them time out on the short group
    for r in (0, 1):
        kind, msg = out[r]
        assert kind == "ValueError" and "stage 0 sends activations of shape (4, 8, 16) to stage 1" in msg, out[r]
        assert "declared tensor_shape is (4, 8, 17)" in msg
    for r in (2, 3):
        kind, msg = out[r]
        assert kind == "RuntimeError" and f"pipeline rank {r}" in msg and "neighbouring stage" in msg, out[r]


def body_tied_copies(rank, world):
    from parallel_layers.mesh import group_timeout
    mesh = cached_mesh(pp=world)
    group = tied_embedding_group(mesh.pp_group)
    stage = _stages(_config(n_layer=2), rank, world, seed=rank, tied_group=group)[0]   # seeded differently on purpose
    (tied,) = stage.tied                            # the embedding, held by the first and the last stage
    copies = [torch.empty_like(tied) for _ in range(world)]
    dist.all_gather(copies, tied.detach(), group=mesh.pp_group)
    return torch.equal(copies[0], copies[1]), group_timeout(group) == group_timeout(mesh.pp_group)


def test_tied_embedding_copies_start_equal_and_share_the_timeout(dist_pools):
    for rank, (equal, same_timeout) in enumerate(dist_pools(2).run(body_tied_copies)):
        assert equal, f"rank {rank}: the first and last stage's tied embeddings differ"
        assert same_timeout, rank


class _Boom(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, targets=None):
        raise RuntimeError("deliberate failure in stage 1")


def body_rank_raises(rank, world, mode):
    group = _short_group(2.0)
    chunks = _stages(_config(n_layer=2, tie=False), rank, world)
    if rank == 1:
        chunks = [_Boom(chunks[0])]
    engine = PipelineEngine(chunks, group, schedule="1f1b", num_microbatches=2)
    idx, targets = _batch()
    getattr(engine, mode)(idx, targets)


@pytest.mark.parametrize("mode", ["step", "evaluate"])
def test_a_rank_that_raises_fails_every_rank_within_the_timeout(dist_pools, mode):
    # Last in the file: the pool is restarted after a failure. Under evaluate the first stage receives
    # nothing from the failed one: its pending sends (and the loss broadcast) are what time out.
    with pytest.raises(RankFailure) as info:
        dist_pools(2).run(body_rank_raises, mode, timeout=60)
    msg = str(info.value)
    assert "--- rank 1 raised" in msg and "deliberate failure in stage 1" in msg
    assert "--- rank 0 raised" in msg and "pipeline rank 0" in msg    # the other rank: by the timeout


def test_fewer_blocks_than_stages_is_refused_with_the_sizes():
    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, max_seq_len=8, dropout=0.0, tie_embeddings=False)
    for rank in range(4):      # every rank refuses alike, before anything communicates
        with pytest.raises(ValueError, match=r"split_model: 2 blocks cannot fill 4 pipeline stages"):
            _stages(cfg, rank, 4)
    with pytest.raises(ValueError, match="cannot fill 4 pipeline stages .pipeline size 2 x 2 chunk"):
        _stages(cfg, 0, 2, num_chunks=2)
    assert len(_stages(cfg, 0, 4, boundaries=[1, 2, 2])) == 1    # explicit: the user's choice
