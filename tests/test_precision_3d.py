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

Unsupported combinations are refused at construction (bf16/fp16 with ``zero=0`` or ``zero=3``: no fp32
master weights there; see ``test_3d.py``); ``autocast=torch.bfloat16`` over fp32 weights runs at every
stage.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

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


def body_low_precision(rank, world, dims, zero, dtype_name, autocast_name, micro=MICRO):
    from parallel_layers.composition.parallel3d import Parallel3D

    dtype, autocast = getattr(torch, dtype_name), (getattr(torch, autocast_name) if autocast_name else None)
    mesh = cached_mesh(*dims)
    dense = _llama()
    ref = _MasterWeightsReference(copy.deepcopy(dense), dtype, autocast)
    model = copy.deepcopy(dense) if autocast else copy.deepcopy(dense).to(dtype)
    kw = {"autocast": autocast} if autocast else {}
    p3d = Parallel3D(model, mesh, loss_fn=_loss, zero=zero, num_microbatches=micro, lr=LR, betas=BETAS,
                     weight_decay=WD, max_grad_norm=CLIP, **kw)
    steps = []
    for x, y in _batches():
        out = p3d.train_step(x, y)
        steps.append((out["loss"], out["grad_norm"]) + ref.step(x, y))
    from parallel_layers.composition.universal_checkpoint import dense_states
    got = {n: st["param"] for n, st in dense_states(p3d)[0].items()}   # the fp32 master weights, dense
    want = dict(ref.master.named_parameters())
    errs = {n: ((t.double() - want[n].double()).norm() / want[n].double().norm()).item()
            for n, t in got.items() if n in want}
    return {"steps": steps, "weights": errs}


def _check(outs, dtype):
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


@pytest.mark.parametrize("zero", [0, 3])
def test_bf16_autocast_over_fp32_weights(dist_pools, zero):
    _check(dist_pools(4).run(body_low_precision, (2, 1, 2), zero, "float32", "bfloat16"), "bfloat16")


def test_bf16_at_dp2_tp2_pp2(dist_pools):
    _check(dist_pools(8).run(body_low_precision, (2, 2, 2), 1, "bfloat16", None), "bfloat16")


def test_unsupported_precision_combinations_are_refused_at_construction():
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8)
    with pytest.raises(ValueError, match="autocast=torch.float16 is not supported.*dtype=torch.float16 with zero=1"):
        Parallel3D(cfg, None, autocast=torch.float16)
    with pytest.raises(ValueError, match="autocast is for fp32 weights"):
        Parallel3D(cfg, None, zero=1, dtype=torch.bfloat16, autocast=torch.bfloat16)
    with pytest.raises(ValueError, match="needs fp32 master weights; use zero=1 or 2"):
        Parallel3D(cfg, None, zero=0, dtype=torch.bfloat16)
