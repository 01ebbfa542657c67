"""Low-precision models through every layout: bf16 and fp16 Hugging Face models (and bf16 autocast over fp32
weights) under ``Parallel3D`` against one process doing the same arithmetic.

The one-process oracle keeps what ZeRO keeps: fp32 master weights, AdamW on them, the model's weights the
master's rounding to bf16/fp16 after every step; forward and backward run in the model's dtype, the loss
in fp32 from the logits. The parallel run differs only in the order of sums (the micro-batches, the
data-parallel reduction, the tensor-parallel partial sums), each rounded to the model's dtype, so the
agreement is that of a few roundings of 2^-8 (bf16) or 2^-11 (fp16) relative, not fp32's 1e-5:

- losses within 5e-4 relative, gradient norms within 1e-2 (measured: bf16 5e-5 and 1.1e-3, fp16 5e-6 and
  1.2e-4, bf16 autocast 3e-5 and 4e-4);
- the fp32 master weights (dense, gathered) within 5e-3 (bf16) / 1.5e-3 (fp16) relative per tensor after 3
  steps at lr 1e-4 (measured: bf16 1.9e-3, fp16 4.6e-4, autocast 4.4e-4): Adam moves every element by about
  lr whatever its gradient's size, so an element whose gradient is at rounding level moves by a
  rounding-dependent step; the loss and the norm, not the weights, are what catch a wrong scale.

ZeRO-3 over a bf16/fp16 model (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``): the
parameters gathered in bf16/fp16, the gradients accumulated over the micro-batches and reduce-scattered in fp32,
fp32 master weights in ``ZeroStage3Optimizer``; at dp2 x pp2 (1f1b, gpipe, interleaved, zb-h1, zbv), dp 4,
dp2 x cp2, dp2 x tp2 x pp2, Qwen3's tp-partial q/k norm gradients at dp2 x tp2, the optimizer state on disk,
fp16 through the loss scaler (and its overflow skip), per-rank and universal checkpoints; within the same
tolerances (measured: bf16 loss 4.8e-5, norm 1.7e-3, weights 2.1e-3; fp16 4.9e-6, 1.2e-4, 4.6e-4). The
reference GPT in bf16 at dp2 x tp2 trains bit for bit under ZeRO-3 as under ZeRO-1 (both sum the gradients
in fp32 in the same order); with sequence parallelism it trains within bf16 roundings of that.

Unsupported combinations are refused at construction (bf16/fp16 with ``zero=0``: no fp32 master weights
there; ``zero=3`` with other dtypes than fp32, bf16, fp16); ``autocast=torch.bfloat16`` over fp32 weights
runs at every stage.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from parallel_layers.testing import cached_mesh

pytest.importorskip("transformers")

VOCAB, BATCH, SEQ, STEPS, MICRO = 64, 8, 8, 3, 2
LR, BETAS, WD, CLIP = 1e-4, (0.9, 0.95), 0.1, 1.0
TOL = {"loss": 5e-4, "norm": 1e-2, "weights": {"bfloat16": 5e-3, "float16": 1.5e-3}}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=True))


def _loss(logits, targets):
    """fp32 loss from low-precision logits (what users write, and what made pp > 1 abort: the last
    stage's loss was fp32 while the other stages' loss buffers were bf16)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        y = x[:, 1:].clone()
        y[::3, :2] = -100
        out.append((x[:, :-1].contiguous(), y))
    return out


class _MasterWeightsReference:
    """One process: the model in ``dtype``, fp32 master weights stepped by torch AdamW."""

    def __init__(self, dense, dtype, autocast):
        self.autocast = autocast
        self.master = dense
        self.model = copy.deepcopy(dense).to(dtype)
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=LR, betas=BETAS, weight_decay=WD, foreach=False)

    def step(self, x, y):
        if self.autocast is not None:
            with torch.autocast("cpu", dtype=self.autocast):
                loss = _loss(self.master(input_ids=x).logits, y)
            loss.backward()
        else:
            loss = _loss(self.model(input_ids=x).logits, y)
            loss.backward()
            for m, p in zip(self.master.parameters(), self.model.parameters()):
                m.grad = p.grad.float()
                p.grad = None
        grads = [p.grad for p in self.master.parameters() if p.grad is not None]
        norm = torch.stack([g.double().norm() for g in grads]).norm()
        coef = (CLIP / (norm + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        self.opt.step()
        self.opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(self.master.parameters(), self.model.parameters()):
                p.copy_(m)
        return loss.item(), norm.item()


def body_low_precision(rank, world, dims, zero, dtype_name, autocast_name, micro=MICRO, schedule="1f1b",
                       offload_dir=None, family=None, sequence_parallel=False, default_loss=False):
    from parallel_layers.composition.parallel3d import Parallel3D

    dtype, autocast = getattr(torch, dtype_name), (getattr(torch, autocast_name) if autocast_name else None)
    mesh = cached_mesh(*dims)
    if family is None:
        dense = _llama()
    else:
        from hf_families import family_model
        dense = family_model(family)
    ref = _MasterWeightsReference(copy.deepcopy(dense), dtype, autocast)
    model = copy.deepcopy(dense) if autocast else copy.deepcopy(dense).to(dtype)
    offload = {} if offload_dir is None else {"offload": "disk", "offload_dir": offload_dir}
    p3d = Parallel3D(model, mesh, loss_fn=None if default_loss else _loss,
                     optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP, **offload),
                     pipeline=PipelineConfig(num_microbatches=micro, schedule=schedule),
                     data_parallel=DataParallelConfig(zero=zero), precision=PrecisionConfig(autocast=autocast),
                     sequence_parallel=sequence_parallel)
    steps = []
    for x, y in _batches():
        out = p3d.train_step(x, y)
        steps.append((out["loss"], out["grad_norm"]) + ref.step(x, y))
    from parallel_layers.composition.universal_checkpoint import dense_states
    got = {n: st["param"] for n, st in dense_states(p3d)[0].items()}   # the fp32 master weights, dense
    want = dict(ref.master.named_parameters())
    errs = {n: ((t.double() - want[n].double()).norm() / want[n].double().norm()).item()
            for n, t in got.items() if n in want}
    # ZeRO-3: the dtype the gradients were accumulated and reduce-scattered in (fp32 for a bf16/fp16 model)
    reduced = {str(u.grad_full.dtype) for u in p3d.z.units} if p3d.z is not None else None
    return {"steps": steps, "weights": errs, "reduced_in": reduced}


def _check(outs, dtype):
    for out in outs:
        assert out["reduced_in"] in (None, {"torch.float32"}), out["reduced_in"]
    worst = {k: max(abs(s[i] - s[i + 2]) / abs(s[i + 2]) for o in outs for s in o["steps"])
             for i, k in enumerate(("loss", "norm"))}
    print(f"{dtype}: worst loss {worst['loss']:.2e}, norm {worst['norm']:.2e}, weights "
          f"{max(max(o['weights'].values()) for o in outs):.2e}")
    for rank, out in enumerate(outs):
        for step, (loss, norm, ref_loss, ref_norm) in enumerate(out["steps"]):
            assert math.isfinite(loss) and abs(loss - ref_loss) <= TOL["loss"] * abs(ref_loss), \
                f"rank {rank} step {step}: loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= TOL["norm"] * abs(ref_norm), \
                f"rank {rank} step {step}: grad norm {norm} vs {ref_norm}"
        name, err = max(out["weights"].items(), key=lambda kv: kv[1])
        assert out["weights"] and err <= TOL["weights"][dtype], f"rank {rank}: {name} differs by {err:.2e}"


@pytest.mark.parametrize("dims,zero,dtype,micro", [
    ((2, 1, 2), 1, "bfloat16", 2), ((2, 1, 2), 2, "float16", 2), ((1, 1, 4), 1, "bfloat16", 4)],
    ids=["dp2-pp2-zero1-bf16", "dp2-pp2-zero2-fp16", "pp4-zero1-bf16"])
def test_low_precision_model_through_the_pipeline(dist_pools, dims, zero, dtype, micro):
    _check(dist_pools(4).run(body_low_precision, dims, zero, dtype, None, micro), dtype)


def test_bf16_llama_with_sequence_parallelism(dist_pools):
    """A bf16 Hugging Face Llama at dp2 x tp2 with ``sequence_parallel=True`` (its norms' gradients bf16 sums over
    each rank's tokens, summed over tp): within the bf16 tolerances of the one-process reference."""
    _check(dist_pools(4).run(body_low_precision, (2, 2, 1), 1, "bfloat16", None, sequence_parallel=True), "bfloat16")


@pytest.mark.parametrize("dims,dtype", [((2, 2, 1), "bfloat16"), ((1, 2, 2), "float16")],
                         ids=["dp2-tp2-bf16", "tp2-pp2-fp16"])
def test_default_loss_on_vocabulary_shards_in_low_precision(dist_pools, dims, dtype):
    """No ``loss_fn`` at tp 2: the loss on the LM head's vocabulary shards (upcast to fp32; under fp16 through
    the loss scaler, which takes the shards) within the low-precision tolerances of one process's fp32 loss
    on whole logits."""
    _check(dist_pools(4).run(body_low_precision, dims, 1, dtype, None, default_loss=True), dtype)


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_autocast_over_fp32_weights(dist_pools, zero):
    _check(dist_pools(4).run(body_low_precision, (2, 1, 2), zero, "float32", "bfloat16"), "bfloat16")


def test_bf16_at_dp2_tp2_pp2(dist_pools):
    _check(dist_pools(8).run(body_low_precision, (2, 2, 2), 1, "bfloat16", None), "bfloat16")


@pytest.mark.parametrize("dims,dtype,schedule", [
    ((2, 1, 2), "bfloat16", "1f1b"), ((4, 1, 1), "bfloat16", "1f1b"), ((2, 1, 2), "float16", "1f1b"),
    ((2, 1, 2), "bfloat16", "gpipe"), ((2, 1, 2), "bfloat16", "interleaved"), ((2, 1, 2), "bfloat16", "zb-h1"),
    ((2, 1, 2), "bfloat16", "zbv"), ((2, 1, 1, 2), "bfloat16", "1f1b")],
    ids=["dp2-pp2-bf16", "dp4-bf16", "dp2-pp2-fp16", "dp2-pp2-bf16-gpipe", "dp2-pp2-bf16-interleaved",
         "dp2-pp2-bf16-zb-h1", "dp2-pp2-bf16-zbv", "dp2-cp2-bf16"])
def test_zero3_low_precision_like_one_process(dist_pools, dims, dtype, schedule):
    """ZeRO-3 over a bf16/fp16 model: bf16 parameters gathered, gradients accumulated over the micro-batches
    and reduce-scattered in fp32 (FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), fp32
    master weights stepped by the sharded AdamW; fp16 through the loss scaler."""
    _check(dist_pools(4).run(body_low_precision, dims, 3, dtype, None, MICRO, schedule), dtype)


def test_zero3_bf16_at_dp2_tp2_pp2(dist_pools):
    _check(dist_pools(8).run(body_low_precision, (2, 2, 2), 3, "bfloat16", None), "bfloat16")


def test_zero3_bf16_qwen3_at_dp2_tp2(dist_pools):
    """Qwen3's per-head q/k norms get tp-partial gradients: summed over tp on the fp32 accumulation."""
    _check(dist_pools(4).run(body_low_precision, (2, 2, 1), 3, "bfloat16", None, MICRO, "1f1b", None, "qwen3"),
           "bfloat16")


def test_zero3_bf16_with_the_optimizer_state_on_disk(dist_pools, tmp_path):
    _check(dist_pools(4).run(body_low_precision, (2, 1, 2), 3, "bfloat16", None, MICRO, "1f1b", str(tmp_path)),
           "bfloat16")


def body_gpt(rank, world, zero, sequence_parallel):
    """The reference GPT in bf16 at dp2 x tp2, with or without sequence parallelism."""
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.composition.universal_checkpoint import dense_states
    from parallel_layers.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, d_model=32, max_seq_len=SEQ,
                    sequence_parallel=sequence_parallel)
    p3d = Parallel3D(cfg, cached_mesh(2, 2, 1),
                     optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                     pipeline=PipelineConfig(num_microbatches=MICRO), data_parallel=DataParallelConfig(zero=zero),
                     precision=PrecisionConfig(dtype=torch.bfloat16))
    losses = [p3d.train_step(x, y)["loss"] for x, y in _batches()]
    return losses, {n: st["param"] for n, st in dense_states(p3d)[0].items()}


def test_zero3_bf16_gpt_equals_zero1_and_takes_sequence_parallelism(dist_pools):
    """ZeRO-3 accumulates and reduces a bf16 model's gradients in fp32 as ZeRO-1's fp32 main grads do: the same
    bits. With sequence parallelism the norms' gradients are bf16 sums over each rank's tokens, then summed over
    tp on the fp32 gradients by the replica mode, at every ZeRO stage (ZeRO-1/2 crashed before: the stage
    summed them in p.grad, a guard for a bf16 model), and ZeRO-1, 2 and 3 agree; against the run
    without it, another rounding of the zero-initialized biases, which move by about lr a step (measured:
    loss 4e-6, weights 7.7e-3 relative)."""
    cases = ((3, False), (1, False), (3, True), (1, True), (2, True))
    runs = {case: dist_pools(4).run(body_gpt, *case)[0] for case in cases}
    (loss3, w3), (loss1, w1), (loss_sp, w_sp) = (runs[c] for c in cases[:3])
    assert loss3 == loss1 and w3.keys() == w1.keys() and all(torch.equal(w3[n], w1[n]) for n in w1)
    (loss_1, w_1), (loss_2, w_2) = runs[(1, True)], runs[(2, True)]
    assert loss_2 == loss_1 and all(torch.equal(w_2[n], w_1[n]) for n in w_1)
    # ZeRO-3's clip coefficient sums the norm over other shards: an fp32 ulp apart (measured 3.7e-9 on weights ~1)
    assert loss_1 == loss_sp and all((w_1[n] - w_sp[n]).abs().max() <= 1e-6 * w_sp[n].abs().max() for n in w_sp)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(loss_sp, loss3))
    w_err = {n: ((w_sp[n].double() - w3[n].double()).norm() / w3[n].double().norm()).item() for n in w3}
    print(f"GPT bf16 ZeRO-3, with sequence parallelism vs without: loss {loss_err:.2e}, weights "
          f"{max(w_err.values()):.2e}")
    assert set(w_sp) == set(w3) and loss_err <= TOL["loss"], (loss_sp, loss3)
    assert max(w_err.values()) <= 2e-2, max(w_err.items(), key=lambda kv: kv[1])


def body_zero3_fp16_overflow(rank, world):
    """fp16 ZeRO-3 with a loss scale of 2^24: the fp16 gradients of every micro-batch overflow (inf, summed
    into the fp32 accumulation); every rank skips, bit for bit, and the scale backs off until steps are taken."""
    from parallel_layers.amp import DynamicLossScaler
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.composition.universal_checkpoint import dense_states

    p3d = Parallel3D(_llama().to(torch.float16), cached_mesh(2, 1, 2), loss_fn=_loss,
                     optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                     pipeline=PipelineConfig(num_microbatches=MICRO), data_parallel=DataParallelConfig(zero=3),
                     precision=PrecisionConfig(loss_scaler=DynamicLossScaler(init_scale=2.0 ** 24, hysteresis=1,
                                                                             growth_interval=1000)))
    batches = _batches()
    before, step0 = dense_states(p3d)
    shard = p3d.z.shard_buffer.clone()
    outs = [p3d.train_step(*batches[0])]
    after, step1 = dense_states(p3d)
    unchanged = (step0 == step1 and torch.equal(shard, p3d.z.shard_buffer)
                 and all(torch.equal(before[n][k], after[n][k]) for n in before for k in before[n]))
    while outs[-1]["skipped"] and len(outs) < 12:
        outs.append(p3d.train_step(*batches[len(outs) % len(batches)]))
    moved, step2 = dense_states(p3d)
    return {"skipped": [o["skipped"] for o in outs], "scales": [o["loss_scale"] for o in outs], "unchanged": unchanged,
            "last_loss": outs[-1]["loss"], "moved": any(not torch.equal(moved[n]["param"], before[n]["param"])
                                                         for n in before), "steps": step2}


def test_zero3_fp16_overflow_skips_on_every_rank(dist_pools):
    outs = dist_pools(4).run(body_zero3_fp16_overflow)
    print(f"fp16 ZeRO-3 from a loss scale of 2^24: skipped {outs[0]['skipped']}, scales {outs[0]['scales']}")
    for out in outs:
        skips = out["skipped"]
        assert skips[0] and out["unchanged"], out
        assert not skips[-1] and sum(skips) == len(skips) - 1, out        # then a step is taken
        assert out["scales"] == [2.0 ** (23 - i) for i in range(len(skips) - 1)] + [out["scales"][-2]], out
        assert math.isfinite(out["last_loss"]) and out["moved"] and out["steps"] == 1, out
        assert out["skipped"] == outs[0]["skipped"] and out["scales"] == outs[0]["scales"]


def _zero3_bf16(dims, zero=3, seed=0):
    from parallel_layers.composition.parallel3d import Parallel3D

    model = _llama()
    if seed:                                      # other weights: what a checkpoint must overwrite
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.1)
    return Parallel3D(model.to(torch.bfloat16), cached_mesh(*dims), loss_fn=_loss,
                      optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(num_microbatches=MICRO), data_parallel=DataParallelConfig(zero=zero))


def body_zero3_checkpoints(rank, world, path):
    """bf16 ZeRO-3 at dp2 x pp2: 2 steps, then the per-rank state and a universal checkpoint; a third step.
    The per-rank state resumes that step bit for bit; the universal one loads the fp32 masters bit for bit
    into ZeRO-3 at dp 4 and ZeRO-1 at dp2 x pp2 (the bf16 parameters their rounding)."""
    from parallel_layers.composition.universal_checkpoint import dense_states, load_universal, save_universal

    batches = _batches()
    p3d = _zero3_bf16((2, 1, 2))
    for x, y in batches[:2]:
        p3d.train_step(x, y)
    state = p3d.state_dict()
    save_universal(p3d, path)
    saved, _ = dense_states(p3d)
    third = p3d.train_step(*batches[2])["loss"]
    after, _ = dense_states(p3d)
    out = {"masters_fp32": all(st["param"].dtype == torch.float32 for st in saved.values()),
           "bf16_shard": p3d.z.shard_buffer.dtype == torch.bfloat16}

    again = _zero3_bf16((2, 1, 2), seed=5)
    again.load_state_dict(state)
    out["resumed_loss_equal"] = again.train_step(*batches[2])["loss"] == third
    resumed, _ = dense_states(again)
    out["resumed_equal"] = all(torch.equal(resumed[n][k], after[n][k]) for n in after for k in after[n])
    for name, dims, zero in (("dp4_zero3", (4, 1, 1), 3), ("dp2pp2_zero1", (2, 1, 2), 1)):
        other = _zero3_bf16(dims, zero, seed=7)
        load_universal(other, path)
        loaded, _ = dense_states(other)
        bf16 = other.dense_state_dict()
        both = [n for n in loaded if n in saved]      # dp 4 holds every stage, dp2 x pp2 this rank's
        out[name] = {"masters_equal": bool(both) and all(torch.equal(loaded[n]["param"], saved[n]["param"])
                                                         for n in both),
                     "bf16_rounded": all(torch.equal(bf16[n], loaded[n]["param"].to(torch.bfloat16))
                                         for n in loaded if n in bf16),
                     "loss": other.train_step(*batches[2])["loss"], "third": third}
    return out


def test_zero3_bf16_checkpoints_resume(dist_pools, tmp_path):
    outs = dist_pools(4).run(body_zero3_checkpoints, str(tmp_path / "ckpt"))
    print("loss of the step after loading on another layout, relative to the straight run: " + ", ".join(
        f"{name} {max(abs(o[name]['loss'] - o[name]['third']) / o[name]['third'] for o in outs):.2e}"
        for name in ("dp4_zero3", "dp2pp2_zero1")))
    for out in outs:
        assert out["masters_fp32"] and out["bf16_shard"], out
        assert out["resumed_loss_equal"] and out["resumed_equal"], out
        for name in ("dp4_zero3", "dp2pp2_zero1"):
            got = out[name]
            assert got["masters_equal"] and got["bf16_rounded"], (name, got)
            # another layout sums in another order: the same step up to bf16 roundings
            assert abs(got["loss"] - got["third"]) <= TOL["loss"] * abs(got["third"]), (name, got)


def test_unsupported_precision_combinations_are_refused_at_construction():
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8)
    with pytest.raises(ValueError, match="autocast=torch.float16 is not supported.*dtype=torch.float16 with zero=1"):
        Parallel3D(cfg, None, precision=PrecisionConfig(autocast=torch.float16))
    with pytest.raises(ValueError, match="autocast is for fp32 weights"):
        Parallel3D(cfg, None, data_parallel=DataParallelConfig(zero=1),
                   precision=PrecisionConfig(dtype=torch.bfloat16, autocast=torch.bfloat16))
    with pytest.raises(ValueError, match="needs fp32 master weights; use zero=1, 2 or 3"):
        Parallel3D(cfg, None, data_parallel=DataParallelConfig(zero=0), precision=PrecisionConfig(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="zero=3 supports fp32, bf16 and fp16 models"):
        Parallel3D(cfg, None, data_parallel=DataParallelConfig(zero=3), precision=PrecisionConfig(dtype=torch.float64))


