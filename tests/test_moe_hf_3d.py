"""Hugging Face MoE models (transformers 5.x Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in ``Parallel3D`` with no
recipe: their sparse MoE blocks become our ``MoELayer`` (:mod:`parallel_layers.moe.hf_swap`), so expert
parallelism shards their experts, against one process training the unmodified HF model with torch AdamW on
the same batches.

Compared on every rank after 5 steps, within 1e-5: the losses and every parameter (the dense state dict mapped
back to the HF names, the experts gathered over ep). With ``output_router_logits=True`` the HF model's loss adds
``router_aux_loss_coef * load_balancing_loss_func(all layers' router logits)``; it is reproduced (value and
gradients) over two or four micro-batches (the reference accumulates the same micro-batches), with and
without activation checkpointing, at pp 1 and at pp 2 (the sums carried stage to stage), with padding (left
out of the sums as transformers leaves it out), and refused with the fix with padding at cp > 1.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

VOCAB, ROWS, SEQ, STEPS, LR = 64, 8, 8, 5, 1e-2
# Adam's eps: at 1e-8 an element whose first gradient is ~1e-9 (Qwen2-MoE's shared down_proj has one of 3e-9
# beside a median of 1e-4) moves by lr * g / (|g| + eps), so float32 rounding in g (~1e-11) becomes 1e-5 steps
EPS = 1e-6
KINDS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def hf_moe_model(kind: str, router_logits: bool = False):
    """A tiny 2-layer decoder of ``kind`` (hidden 16, 4 experts, top-2), the same weights on every call."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as t
    torch.manual_seed(0)
    common = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=None, eos_token_id=None,
                  num_experts_per_tok=2, output_router_logits=router_logits, router_aux_loss_coef=0.05)
    if kind == "mixtral":
        model = t.MixtralForCausalLM(t.MixtralConfig(**common, intermediate_size=32, num_local_experts=4))
    elif kind == "qwen2_moe":
        # no q/k/v biases: the key bias's exact gradient is zero, which Adam turns into lr-sized noise steps
        model = t.Qwen2MoeForCausalLM(t.Qwen2MoeConfig(**common, intermediate_size=32, moe_intermediate_size=16,
                                                       shared_expert_intermediate_size=24, num_experts=4,
                                                       qkv_bias=False))
    elif kind == "qwen3_moe":
        model = t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(**common, head_dim=8, intermediate_size=32,
                                                       moe_intermediate_size=16, num_experts=4,
                                                       norm_topk_prob=True))
    elif kind == "olmoe":
        model = t.OlmoeForCausalLM(t.OlmoeConfig(**common, intermediate_size=16, num_experts=4))
    else:
        raise ValueError(kind)
    with torch.no_grad():          # Qwen2-MoE's router starts at zero (every expert tied): give it a choice
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    return model


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))
            for _ in range(STEPS)]


def _padding_mask() -> torch.Tensor:
    """Left padding: every other row's first two tokens are padding (0)."""
    mask = torch.ones(ROWS, SEQ, dtype=torch.int64)
    mask[::2, :2] = 0
    return mask


def one_process(kind: str, router_logits: bool, shards: int, microbatches: int, mask=None):
    """The HF model trained on the global batches: gradient accumulation over the micro-batches the mesh runs
    (micro-batch m: the m-th slice of every replica's rows), each adding its ``coef * aux_loss / m`` when the
    model's router loss is on; AdamW and clipping as Parallel3D's. Returns the cross-entropy losses, the state
    dict and the last micro-batch's ``aux_loss``."""
    model = hf_moe_model(kind, router_logits)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.0, foreach=False)
    per, losses, aux = ROWS // shards, [], None
    mb = per // microbatches
    for ids, tgt in _batches():
        total = 0.0
        for m in range(microbatches):
            rows = torch.cat([torch.arange(r * per + m * mb, r * per + (m + 1) * mb) for r in range(shards)])
            out = model(input_ids=ids[rows], **({} if mask is None else dict(attention_mask=mask[rows])))
            ce = F.cross_entropy(out.logits.flatten(0, 1), tgt[rows].flatten(), reduction="sum") / tgt.numel()
            loss = ce
            if router_logits:
                aux = out.aux_loss.item()
                loss = ce + model.config.router_aux_loss_coef * out.aux_loss / microbatches
            loss.backward()
            total += ce.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, aux


def body_hf_moe(rank, world, cases):
    from parallel_layers import DataParallelConfig, OptimizerConfig, Parallel3D, PipelineConfig
    from parallel_layers.moe import ExpertParallelMoE
    from parallel_layers.moe.hf_swap import to_hf_state_dict
    from parallel_layers.testing import cached_mesh
    out = {}
    for name, (kind, sizes, zero, microbatches, router_logits, *options) in cases.items():
        options = dict(options[0]) if options else {}
        side = dict(attention_mask=_padding_mask()) if options.pop("padding", False) else {}
        p3d = Parallel3D(hf_moe_model(kind, router_logits), cached_mesh(**sizes), loss_fn=loss_fn,
                         optimizer=OptimizerConfig(lr=LR, eps=EPS),
                         pipeline=PipelineConfig(num_microbatches=microbatches, **options),
                         data_parallel=DataParallelConfig(zero=zero))
        losses = [p3d.train_step(ids, tgt, **side)["loss"] for ids, tgt in _batches()]
        out[name] = dict(losses=losses, state=to_hf_state_dict(p3d.dense_state_dict()),
                         local_experts=sorted({m.num_local_experts for c in p3d.chunks for m in c.modules()
                                               if isinstance(m, ExpertParallelMoE)}),
                         aux=None if p3d.router_loss is None else p3d.router_loss.value,
                         shared=sorted({type(p).__name__ for c in p3d.chunks for n, p in c.named_modules()
                                        if ".shared_expert." in n + "." and n.endswith("proj")}))
    return out


def _check(name, case, outs):
    kind, sizes, _, microbatches, router_logits, *options = case
    shards = sizes.get("dp", 1) * sizes.get("ep", 1)
    padded = bool(options and options[0].get("padding"))
    ref_losses, ref_state, ref_aux = one_process(kind, router_logits, shards, microbatches,
                                                 _padding_mask() if padded else None)
    covered = set()
    for rank, got in enumerate(o[name] for o in outs):
        ep = sizes.get("ep", 1)
        assert got["local_experts"] == ([4 // ep] if ep > 1 else []), (name, rank, got["local_experts"])
        assert max(abs(a - b) for a, b in zip(got["losses"], ref_losses)) < 1e-5, (name, rank, got["losses"],
                                                                                 ref_losses)
        params = {k for k, _ in hf_moe_model(kind).named_parameters()}
        held = params & set(got["state"])         # with pp, this rank's stage's
        covered |= held
        worst = max(((got["state"][k] - ref_state[k]).abs().max().item(), k) for k in held)
        assert worst[0] < 1e-5, (name, rank, worst)
        if kind == "qwen2_moe":    # the shared expert: split column/row-wise at tp 2, plain linears otherwise
            split = ["ColumnParallelLinear", "RowParallelLinear"] if sizes.get("tp", 1) > 1 else ["Linear"]
            assert got["shared"] == split, (name, got["shared"])
        if router_logits:
            assert abs(got["aux"] - ref_aux) < 1e-5, (name, rank, got["aux"], ref_aux)
    assert covered == {k for k, _ in hf_moe_model(kind).named_parameters()}, (name, covered)


# name -> (kind, mesh sizes, ZeRO stage, micro-batches, output_router_logits[, PipelineConfig options])
CHECKPOINT = dict(checkpoint=True)
WORLD2 = {f"{kind}-ep2": (kind, dict(ep=2), 0, 1, False) for kind in KINDS}
WORLD2["qwen3_moe-ep2-router-logits-checkpointed"] = ("qwen3_moe", dict(ep=2), 0, 2, True, CHECKPOINT)
WORLD2["mixtral-ep2-router-logits-padded"] = ("mixtral", dict(ep=2), 0, 2, True, dict(padding=True))
WORLD4 = {"qwen2_moe-tp2ep2": ("qwen2_moe", dict(tp=2, ep=2), 0, 1, False),
          "mixtral-dp2ep2-zero1": ("mixtral", dict(dp=2, ep=2), 1, 1, False),
          "qwen2_moe-dp2ep2-zero1-router-logits": ("qwen2_moe", dict(dp=2, ep=2), 1, 2, True),
          "olmoe-dp2ep2-zero3-router-logits-checkpointed": ("olmoe", dict(dp=2, ep=2), 3, 2, True, CHECKPOINT)}
# the router loss's sums carried along the pipeline (also under the NCCL rules: two groups of their own)
PIPELINE = {"mixtral-dp2pp2-router-logits-padded": ("mixtral", dict(dp=2, pp=2), 0, 4, True, dict(padding=True)),
            "qwen3_moe-ep2pp2-zb-h1-router-logits-checkpointed": ("qwen3_moe", dict(ep=2, pp=2), 1, 2, True,
                                                                  dict(schedule="zb-h1", checkpoint=True))}


@pytest.mark.parametrize("world,cases", [(2, WORLD2), (4, WORLD4), (4, PIPELINE)],
                         ids=["world2", "world4", "pipeline"])
def test_hf_moe_models_train_with_expert_parallelism_like_one_process(world, cases, dist_pools):
    outs = dist_pools(world).run(body_hf_moe, cases)
    for name, case in cases.items():
        _check(name, case, outs)


def body_refusals(rank, world):
    import torch.nn as nn

    from parallel_layers import Parallel3D
    from parallel_layers.testing import cached_mesh

    class OddMoeBlock(nn.Module):             # an MoE block of a class the swap does not know
        def __init__(self, mlp):
            super().__init__()
            self.gate, self.experts = mlp.gate, mlp.experts

        def forward(self, x):
            return x

    errors = {}
    model = hf_moe_model("mixtral")
    model.model.layers[1].mlp = OddMoeBlock(model.model.layers[1].mlp)
    try:
        Parallel3D(model, cached_mesh(ep=2), loss_fn=loss_fn)
    except ValueError as e:
        errors["unknown"] = str(e)
    p3d = Parallel3D(hf_moe_model("mixtral", router_logits=True), cached_mesh(cp=2), loss_fn=loss_fn)
    ids, tgt = _batches()[0]
    try:
        p3d.train_step(ids, tgt, attention_mask=_padding_mask())
    except ValueError as e:
        errors["mask"] = str(e)
    return errors


def test_what_is_not_reproduced_is_refused_with_the_fix(dist_pools):
    for errors in dist_pools(2).run(body_refusals):
        assert "OddMoeBlock" in errors["unknown"] and "model.layers.1.mlp" in errors["unknown"] and \
            "MixtralSparseMoeBlock" in errors["unknown"] and "recipe" in errors["unknown"], errors
        assert "output_router_logits" in errors["mask"], errors
        assert "padding" in errors["mask"] and "cp=2" in errors["mask"], errors


def test_to_hf_state_dict_names_every_parameter_as_the_model_does():
    from parallel_layers.moe.hf_swap import swap_hf_moe_blocks, to_hf_state_dict
    for kind in KINDS:
        model, ref = hf_moe_model(kind), hf_moe_model(kind)
        assert swap_hf_moe_blocks(model, ep=1) == 2
        x = torch.randint(0, VOCAB, (2, SEQ))
        # the same numbers up to the order the experts' outputs are summed in (grouped product vs HF's loop)
        torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, rtol=0, atol=1e-6)
        mapped, want = to_hf_state_dict(model.state_dict()), ref.state_dict()
        assert set(mapped) == set(want) and all(torch.equal(mapped[k], want[k]) for k in want), kind
