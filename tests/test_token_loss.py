"""The loss of a step is torch's: the mean over the non-ignored labels (-100) of the whole global batch.

``Parallel3D`` against one process on the global batch (``F.cross_entropy(..., ignore_index=-100)`` and
torch AdamW), with ignored labels spread unevenly over micro-batches and data-parallel replicas, a
micro-batch whose labels are all ignored, and a replica whose labels are all ignored: losses, gradient
norms and weights after every step within 1e-5 on every rank, for the reference GPT's built-in loss and
for a user's ``loss_fn`` returning a mean, a ``(sum, count)`` pair, or the default one.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.testing import cached_mesh

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)
LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.95), 0.1, 0.5
BATCH, SEQ, STEPS, MICRO = 8, 8, 3, 2
VOCAB = CFG["vocab_size"]


def _labels(y: torch.Tensor, pattern: str, step: int) -> torch.Tensor:
    """Targets with -100 where ``pattern`` says (rows 0-3 are dp replica 0's, 4-7 replica 1's; micro-batches
    of 2 rows)."""
    y = y.clone()
    gen = torch.Generator().manual_seed(100 + step)
    # uneven everywhere: row i keeps a random number of its last labels (prompt masking in SFT)
    keep = torch.randint(1, SEQ + 1, (BATCH,), generator=gen)
    for row in range(BATCH):
        y[row, :SEQ - int(keep[row])] = -100
    if pattern == "microbatch_all_ignored":
        y[2:4] = -100                      # replica 0, micro-batch 1
    elif pattern == "replica_all_ignored":
        y[4:] = -100                       # every label of replica 1
    elif pattern != "uneven":
        raise ValueError(pattern)
    return y


def _batches(pattern: str):
    gen = torch.Generator().manual_seed(1)
    out = []
    for step in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        out.append((x[:, :-1].contiguous(), _labels(x[:, 1:], pattern, step)))
    return out


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _clip_step(params, opt):
    norm = torch.nn.utils.clip_grad_norm_(params, CLIP).item()
    opt.step()
    opt.zero_grad()
    return norm


# ---------------------------------------------------------------------- the reference GPT, built-in loss
def body_gpt(rank, world, dims, zero, pattern):
    from parallel_layers.composition.parallel3d import Parallel3D

    mesh = cached_mesh(*dims)
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    model = Parallel3D(GPTConfig(**CFG), mesh, seed=0,
                       optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                       pipeline=PipelineConfig(num_microbatches=MICRO), data_parallel=DataParallelConfig(zero=zero))
    steps = []
    for x, y in _batches(pattern):
        _, ref = dense(x, y)
        ref.backward()
        ref_norm = _clip_step(dense.parameters(), ref_opt)
        out = model.train_step(x, y)
        steps.append((out["loss"], out["grad_norm"], ref.item(), ref_norm))
    x, y = _batches(pattern)[0]
    dense.eval()
    with torch.no_grad():
        ref_eval = dense(x, y)[1].item()
    got_eval = model.evaluate(x, y)
    ref = dense.state_dict()
    params = {k: _rel(v, ref[k]) for k, v in model.dense_state_dict().items()}
    return {"steps": steps, "params": params, "eval": (got_eval, ref_eval)}


def _check(outs, tol=1e-5):
    for rank, out in enumerate(outs):
        for step, (loss, norm, ref_loss, ref_norm) in enumerate(out["steps"]):
            assert math.isfinite(loss), f"rank {rank} step {step}: loss {loss}"
            assert abs(loss - ref_loss) <= tol * abs(ref_loss), f"rank {rank} step {step}: loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= tol * abs(ref_norm), f"rank {rank} step {step}: norm {norm} vs {ref_norm}"
        name, err = max(out["params"].items(), key=lambda kv: kv[1])
        assert err <= tol, f"rank {rank}: {name} differs by {err:.2e}"
        got, want = out["eval"]
        assert abs(got - want) <= tol * abs(want), f"rank {rank}: evaluate {got} vs {want}"


PATTERNS = ["uneven", "microbatch_all_ignored", "replica_all_ignored"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_gpt_loss_is_the_global_token_mean(dist_pools, pattern):
    _check(dist_pools(4).run(body_gpt, (2, 1, 2), 1, pattern))


def test_gpt_loss_is_the_global_token_mean_at_dp2_tp2_pp2_zero3(dist_pools):
    _check(dist_pools(8).run(body_gpt, (2, 2, 2), 3, "microbatch_all_ignored"))


# ---------------------------------------------------------------------- a Hugging Face model, the user's loss
def _mean_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _sum_count_loss(logits, targets):
    flat = targets.reshape(-1)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), flat, ignore_index=-100, reduction="sum")
    return total, (flat != -100).sum()


LOSSES = {"mean": _mean_loss, "sum_count": _sum_count_loss, "default": None}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=False))


def body_llama(rank, world, dims, zero, loss_name, pattern):
    from parallel_layers.composition.parallel3d import Parallel3D

    mesh = cached_mesh(*dims)
    dense = _llama()
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)
    model = Parallel3D(copy.deepcopy(dense), mesh, loss_fn=LOSSES[loss_name],
                       optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                       pipeline=PipelineConfig(num_microbatches=MICRO), data_parallel=DataParallelConfig(zero=zero))
    steps = []
    for x, y in _batches(pattern):
        ref = _mean_loss(dense(input_ids=x).logits, y)
        ref.backward()
        ref_norm = _clip_step(dense.parameters(), ref_opt)
        out = model.train_step(x, y)
        steps.append((out["loss"], out["grad_norm"], ref.item(), ref_norm))
    x, y = _batches(pattern)[0]
    with torch.no_grad():
        ref_eval = _mean_loss(dense(input_ids=x).logits, y).item()
    got_eval = model.evaluate(x, y)
    want = dict(dense.named_parameters())
    params = {k: _rel(v, want[k].detach()) for k, v in model.dense_state_dict().items() if k in want}
    return {"steps": steps, "params": params, "eval": (got_eval, ref_eval)}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_user_loss_is_the_global_token_mean(dist_pools, loss_name):
    pytest.importorskip("transformers")
    _check(dist_pools(4).run(body_llama, (2, 1, 2), 1, loss_name, "microbatch_all_ignored"))


def test_user_loss_replica_all_ignored_zero3(dist_pools):
    pytest.importorskip("transformers")
    _check(dist_pools(4).run(body_llama, (2, 1, 2), 3, "mean", "replica_all_ignored"))


# ---------------------------------------------------------------------- the accounting alone
def test_a_micro_batch_with_no_counted_label_contributes_zero_and_finite_gradients():
    from parallel_layers.pipeline.token_loss import TokenLoss, count_labels_each
    logits = torch.randn(2, 5, 7, requires_grad=True)
    targets = torch.full((2, 5), -100)
    for out in (_mean_loss(logits, targets), _sum_count_loss(logits, targets)):
        acc = TokenLoss(count_labels_each([targets]), denominator=10.0, ignore_index=-100, where="test")
        part = acc.weigh(out, 0)
        part.backward()
        assert part.item() == 0.0
        assert torch.equal(logits.grad, torch.zeros_like(logits))
        logits.grad = None


def test_weighted_micro_batches_equal_the_whole_batch_mean():
    from parallel_layers.pipeline.token_loss import TokenLoss, count_labels_each, token_cross_entropy
    torch.manual_seed(0)
    logits = torch.randn(6, 4, 9, requires_grad=True)
    targets = torch.randint(0, 9, (6, 4))
    targets[0] = -100
    targets[3, :3] = -100
    want = _mean_loss(logits, targets)
    micro = list(zip(logits.chunk(3), targets.chunk(3)))
    for loss_fn in (_mean_loss, _sum_count_loss, token_cross_entropy):
        acc = TokenLoss(count_labels_each([t for _, t in micro]), None, -100, "test")
        total = sum(acc.weigh(loss_fn(lg, t), i) for i, (lg, t) in enumerate(micro))
        acc.check()
        assert abs(total.item() - want.item()) < 1e-6
        assert abs(acc.total().item() - want.item()) < 1e-6


def test_returned_counts_that_disagree_with_the_labels_are_an_error():
    from parallel_layers.pipeline.token_loss import TokenLoss, count_labels_each
    logits = torch.randn(4, 3)
    targets = torch.tensor([1, 2, -100, 0])
    acc = TokenLoss(count_labels_each([targets]), None, -100, "pipeline stage 1")
    acc.weigh((F.cross_entropy(logits, targets, reduction="sum"), torch.tensor(4)), 0)
    with pytest.raises(ValueError, match=r"counts summing to 4 .* labels hold 3 .*ignore_index=-100"):
        acc.check()
