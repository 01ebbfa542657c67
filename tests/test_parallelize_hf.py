"""``parallelize`` on a model we did not write: Hugging Face Llama, random weights, no download.

Every rank builds the same ``LlamaForCausalLM`` from one seed, keeps a deep copy as the dense
reference, parallelizes the other at tp=2 with a plan (q/k/v/gate/up column-wise, o/down row-wise,
the token embedding vocabulary-parallel, the LM head column-wise with the logits gathered) and checks
logits, loss and the gathered gradients against the reference, in float64 (rounding only: 1e-10).

No config change is needed for HF's attention: ``LlamaAttention`` reshapes with
``view(*input_shape, -1, head_dim)``, so it infers the local head count (``num_heads / tp``) from the
sharded q/k/v projections, and its ``num_key_value_groups`` (q heads per kv head) is the same ratio
on every shard. Grouped-query attention (2 kv heads for 4 q heads) therefore also splits, as long as
the kv heads divide by tp.
"""
import copy
import os

import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

pytest.importorskip("transformers")

PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": {"style": "colwise", "gather_output": True},
}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def body_llama(rank, world, kv_heads, attn_impl):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_layers.tensor_parallel.embedding import VocabParallelEmbedding
    from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from parallel_layers.tensor_parallel.parallelize import gather_dense_state_dict, parallelize

    mesh = cached_mesh(tp=world)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads, vocab_size=100, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation=attn_impl)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).to(torch.float64)
    model = parallelize(copy.deepcopy(dense), mesh, PLAN)
    types = {n: type(m).__name__ for n, m in model.named_modules()
             if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding))}

    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=gen)
    out_ref = dense(input_ids=idx, labels=idx)
    out = model(input_ids=idx, labels=idx)
    out_ref.loss.backward()
    out.loss.backward()
    grads = gather_dense_state_dict(model, grads=True)
    ref_grads = {n: p.grad for n, p in dense.named_parameters()}
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    grad_err = worst((_rel(grads[n], ref_grads[n]), n) for n in grads)
    params = gather_dense_state_dict(model)
    param_equal = all(torch.equal(params[n], t) for n, t in dense.state_dict().items())
    local_q = model.model.layers[0].self_attn.q_proj.weight.shape
    return dict(types=types, logits_err=_rel(out.logits, out_ref.logits), logits_shape=tuple(out.logits.shape),
                loss=(out.loss.item(), out_ref.loss.item()), grad_err=grad_err, param_equal=param_equal,
                local_q=tuple(local_q))


@pytest.mark.parametrize("kv_heads,attn_impl", [(2, "sdpa"), (4, "eager")])
def test_llama_parallelized_matches_dense(dist_pools, kv_heads, attn_impl):
    for rank, out in enumerate(dist_pools(2).run(body_llama, kv_heads, attn_impl)):
        types = out["types"]
        assert len(types) == 1 + 2 * 7 + 1, types  # embedding, 7 linears per layer, lm_head
        assert types["model.embed_tokens"] == "VocabParallelEmbedding"
        assert types["model.layers.1.self_attn.o_proj"] == "RowParallelLinear"
        assert types["lm_head"] == "ColumnParallelLinear"
        assert out["local_q"] == (32, 64), out["local_q"]  # half the heads on each rank
        assert out["param_equal"], f"rank {rank}: gathered shards differ from the dense weights"
        assert out["logits_shape"] == (2, 12, 100)
        assert out["logits_err"] < 1e-10, (rank, out["logits_err"])
        got, ref = out["loss"]
        assert abs(got - ref) <= 1e-10 * abs(ref), (rank, got, ref)
        err, name = out["grad_err"]
        assert err < 1e-10, f"rank {rank}: gradient of {name} differs by {err:.2e}"


def body_plan_errors(rank, world):
    from parallel_layers.tensor_parallel.parallelize import parallelize

    mesh = cached_mesh(tp=world)

    def net():
        return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3), nn.Embedding(11, 8))

    msgs = {}
    for key, (plan, target) in {
        "nomatch": ({"blocks.*.fc": "colwise"}, mesh),
        "wrong_type": ({"1": "colwise"}, mesh),
        "indivisible": ({"2": "colwise"}, mesh),
        "bad_style": ({"0": "diagonal"}, mesh),
        "bad_mesh": ({"0": "colwise"}, "tp"),
    }.items():
        try:
            parallelize(net(), target, plan)
            msgs[key] = None
        except (TypeError, ValueError) as exc:
            msgs[key] = f"{type(exc).__name__}: {exc}"
    # A process group works as the mesh; 11 embeddings are padded to 12; "colwise_gather" gathers.
    model = parallelize(net(), mesh.tp_group, {"0": "colwise_gather", "3": "vocab", "2": "rowwise"})
    x = torch.randn(5, 8)
    return msgs, tuple(model[0](x).shape), model[3].num_embeddings_padded, tuple(model[2].weight.shape)


def test_plan_errors_name_the_problem(dist_pools):
    for msgs, out_shape, padded, row_shape in dist_pools(2).run(body_plan_errors):
        assert msgs["nomatch"].startswith("ValueError") and "'blocks.*.fc' matched no module" in msgs["nomatch"]
        assert "candidates:" in msgs["nomatch"] and "0" in msgs["nomatch"]
        assert msgs["wrong_type"].startswith("TypeError") and "'1', a LayerNorm" in msgs["wrong_type"]
        assert "'2'" in msgs["indivisible"] and "out_features=3 does not divide by the tensor-parallel size 2" \
            in msgs["indivisible"]
        assert "'diagonal'" in msgs["bad_style"] and "colwise" in msgs["bad_style"]
        assert msgs["bad_mesh"].startswith("TypeError") and "ParallelMesh" in msgs["bad_mesh"]
        assert out_shape == (5, 6) and padded == 12 and row_shape == (3, 3)


def _train_both(dense, model, idx, steps=3):
    """``steps`` AdamW steps on the dense model and its parallel copy (each rank steps its shards, which is
    the dense step sliced: AdamW is elementwise); returns the losses of both."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (dense, model)]
    losses = []
    for _ in range(steps):
        pair = []
        for m, opt in zip((dense, model), opts):
            opt.zero_grad()
            loss = m(input_ids=idx, labels=idx).loss
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append(tuple(pair))
    return losses


def _compare_after_steps(dense, model, idx):
    from parallel_layers.tensor_parallel.parallelize import gather_dense_state_dict

    out = model(input_ids=idx, labels=idx)
    out_ref = dense(input_ids=idx, labels=idx)
    out.loss.backward()
    out_ref.loss.backward()
    grads = gather_dense_state_dict(model, grads=True)
    grad_err = worst((_rel(grads[n], p.grad), n) for n, p in dense.named_parameters())
    losses = _train_both(dense, model, idx)
    params = gather_dense_state_dict(model)
    param_err = worst((_rel(params[n], t), n) for n, t in dense.state_dict().items() if t.is_floating_point())
    return dict(logits_err=_rel(out.logits, out_ref.logits), grad_err=grad_err, losses=losses, param_err=param_err)


def body_gpt2(rank, world, attn_impl):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    from parallel_layers.families import gpt2_plan
    from parallel_layers.tensor_parallel.parallelize import parallelize

    mesh = cached_mesh(tp=world)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn_impl)
    torch.manual_seed(0)
    dense = GPT2LMHeadModel(cfg).to(torch.float64)
    assert dense.lm_head.weight is dense.transformer.wte.weight
    model = parallelize(copy.deepcopy(dense), mesh, gpt2_plan(cfg.n_embd))
    tied = model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    res = _compare_after_steps(dense, model, idx)
    res.update(tied=tied, still_tied=model.lm_head.weight is model.transformer.wte.weight,
               local_c_attn=tuple(model.transformer.h[0].attn.c_attn.weight.shape))
    return res


def body_llama_tied(rank, world):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_layers.tensor_parallel.parallelize import parallelize

    mesh = cached_mesh(tp=world)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    dense = LlamaForCausalLM(cfg).to(torch.float64)
    assert dense.lm_head.weight is dense.model.embed_tokens.weight
    model = parallelize(copy.deepcopy(dense), mesh, PLAN)
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    res = _compare_after_steps(dense, model, idx)
    res.update(tied=model.lm_head.weight is model.model.embed_tokens.weight)
    # refused: a plan that splits one side of the tie, or splits the two sides differently
    msgs = {}
    for key, plan in {"one_side": {"lm_head": "colwise_gather"},
                      "rowwise": {"model.embed_tokens": "vocab", "lm_head": "rowwise"}}.items():
        try:
            parallelize(copy.deepcopy(dense), mesh, plan)
            msgs[key] = None
        except ValueError as exc:
            msgs[key] = str(exc)
    res["msgs"] = msgs
    return res


def _check_trained(rank, out):
    assert out["logits_err"] < 1e-10, (rank, out["logits_err"])
    err, name = out["grad_err"]
    assert err < 1e-10, f"rank {rank}: gradient of {name} differs by {err:.2e}"
    for step, (got, ref) in enumerate(out["losses"]):
        assert abs(got - ref) <= 1e-9 * abs(ref), (rank, step, got, ref)
    err, name = out["param_err"]
    assert err < 1e-9, f"rank {rank}: after 3 AdamW steps {name} differs by {err:.2e}"


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_gpt2_conv1d_fused_qkv_and_tied_head(dist_pools, attn_impl):
    """GPT-2 split in attention too: Conv1D layers, the fused c_attn split per q/k/v section, the
    attention's split_size made local, the tied wte/lm_head kept one Parameter; equal to the dense model
    in forward, gradients and after 3 AdamW steps."""
    for rank, out in enumerate(dist_pools(2).run(body_gpt2, attn_impl)):
        assert out["tied"] and out["still_tied"], rank
        assert out["local_c_attn"] == (48, 32), out["local_c_attn"]   # [q_r | k_r | v_r] of 3 x 16, Linear layout
        _check_trained(rank, out)


def test_llama_tied_embeddings_stay_tied(dist_pools):
    for rank, out in enumerate(dist_pools(2).run(body_llama_tied)):
        assert out["tied"], rank
        _check_trained(rank, out)
        one_side = out["msgs"]["one_side"]
        assert one_side and "lm_head.weight is tied to model.embed_tokens.weight" in one_side, one_side
        assert "'model.embed_tokens'" in one_side and "untie" in one_side, one_side
        rowwise = out["msgs"]["rowwise"]
        assert rowwise and "split them differently" in rowwise and "'vocab'" in rowwise, rowwise
