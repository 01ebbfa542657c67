"""Recipes inferred for models without a shipped one (``pipeline/infer_recipe.py``, ``pipeline/infer_plan.py``)
and the tensor-parallel errors of issue 30.

Single process, float64: the inferred stages of every family (Llama, Mistral with a sliding window
shorter than the sequence, Qwen2, Phi-3, GPT-NeoX, Gemma, GPT-2 and a model of our own with an
``nn.Sequential`` of blocks; and the ``NEW_FAMILIES``: Qwen3, Qwen2 with its sliding window, Gemma 2 and 3,
OLMo2, Granite, Cohere, Falcon with ALiBi and with rotary, Starcoder2, GPT-J, SmolLM3, tied Llama),
chained as two chunks, give the unmodified model's logits exactly, left padding included; forwards the
inference does not reproduce are refused, naming what (``families/infer_forward.py``). Two ranks: the
inferred plan splits each family at tp=2 and forward and gradients equal the dense model's (1e-10), Falcon's
ALiBi cut to each rank's heads; the plans that were wrong before are refused up front with the numbers and
the fix. The 3D matrix against one process is in test_3d_inferred.py.
"""
import copy

import pytest
import torch
import torch.nn as nn
from hf_families import FAMILIES, NEW_FAMILIES, VOCAB, OwnModel, family_model, logits_of

from parallel_layers.testing import cached_mesh

pytest.importorskip("transformers")


def _batch(kind):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, (None if kind == "own" else mask)


def _chained(model, ids, mask):
    from parallel_layers.families import recipe_for
    from parallel_layers.pipeline import split_model

    stages = split_model(model, recipe_for(model), 0, 1, num_chunks=2)
    side = {} if mask is None else {"attention_mask": mask}
    return stages[1](stages[0](ids, **side), **side)


@pytest.mark.parametrize("kind", FAMILIES)
def test_inferred_stages_give_the_models_own_logits(kind):
    from parallel_layers.families import RECIPES
    from parallel_layers.families.infer_recipe import infer_recipe

    model = family_model(kind, dtype=torch.float64)
    ids, mask = _batch(kind)
    want = logits_of(model, ids, mask)
    if type(model).__name__ in RECIPES:          # shipped recipes keep priority: test the inference itself
        RECIPES_BACKUP = dict(RECIPES)
        RECIPES.pop(type(model).__name__)
        try:
            got = _chained(copy.deepcopy(model), ids, mask)
        finally:
            RECIPES.update(RECIPES_BACKUP)
    else:
        got = _chained(copy.deepcopy(model), ids, mask)
    assert infer_recipe(model).blocks in ("model.layers", "gpt_neox.layers", "transformer.h", "blocks")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _inferred_chained(model, ids, mask):
    """The stages of ``infer_recipe(model)`` (not a shipped recipe), chained as two chunks."""
    from parallel_layers.families.infer_recipe import infer_recipe
    from parallel_layers.pipeline import split_model

    stages = split_model(model, infer_recipe(model), 0, 1, num_chunks=2)
    side = {} if mask is None else {"attention_mask": mask}
    return stages[1](stages[0](ids, **side), **side)


@pytest.mark.parametrize("kind", NEW_FAMILIES)
def test_new_families_give_the_models_own_logits_and_gradients(kind):
    """Before, Gemma 2 (final soft-capping), Granite (logits_scaling), Cohere (logit_scale) were refused by
    config option, Qwen2 with its sliding window and Gemma 3 (mixed kinds: "the blocks have no attention_type
    attribute") and Falcon (its blocks "need ['alibi']") by structure. Gemma 2's own forward (eager, float64)
    gives NaN on the left-padded row (a fully masked query row): the stages give the same NaNs, and the
    unpadded batch is compared with gradients too."""
    model = family_model(kind, dtype=torch.float64)
    ids, mask = _batch(kind)
    torch.testing.assert_close(_inferred_chained(copy.deepcopy(model), ids, mask), logits_of(model, ids, mask),
                               rtol=0, atol=1e-12, equal_nan=True)
    stages_model = copy.deepcopy(model)
    got, want = _inferred_chained(stages_model, ids, None), logits_of(model, ids)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    got.square().mean().backward()
    want.square().mean().backward()
    grads = dict(stages_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-9, atol=1e-12,     # summation order
                                   msg=lambda m: f"{kind} {name}: {m}")


def test_gemma3_with_every_layer_sliding_gets_its_local_rotary_table():
    """Gemma 3's default pattern (one full layer in 6) makes all 4 layers sliding. Before: "the recipe of
    Gemma3ForCausalLM does not take the side inputs []" (its rotary embedding's forward needs the layer
    type, the TypeError read as a side-input error); now the context builds the table of each kind its
    layers use (local here) and the blocks get their kind's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                               vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4,
                                               bos_token_id=None, eos_token_id=None)).double()
    assert set(model.config.layer_types) == {"sliding_attention"}
    ids, mask = _batch("gemma3")
    torch.testing.assert_close(_inferred_chained(copy.deepcopy(model), ids, mask), logits_of(model, ids, mask),
                               rtol=0, atol=1e-12)


def test_qwen2_with_its_sliding_window_through_recipe_for():
    """Qwen2 with use_sliding_window=True trained silently wrong (0.22 off in the logits at a window of 4
    over 12 tokens): recipe_for gave it Llama's recipe, whose one causal mask ignores the window."""
    model = family_model("qwen2_sliding", dtype=torch.float64)
    ids, mask = _batch("qwen2_sliding")
    torch.testing.assert_close(_chained(copy.deepcopy(model), ids, mask), logits_of(model, ids, mask), rtol=0,
                               atol=1e-12)


def test_starcoder2_embedding_dropout_is_the_models_own():
    """Starcoder2 applies a functional dropout (config.embedding_dropout) to its embeddings in training:
    before, the inferred embedding left it out (a different forward once it was on); now the same draws
    give the same logits."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    torch.manual_seed(0)
    model = Starcoder2ForCausalLM(Starcoder2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                                   embedding_dropout=0.5, residual_dropout=0.0,
                                                   attention_dropout=0.0, bos_token_id=None,
                                                   eos_token_id=None)).double().train()
    ids, _ = _batch("starcoder2")
    stages_model = copy.deepcopy(model)
    torch.manual_seed(3)
    want = logits_of(model, ids)
    torch.manual_seed(3)
    got = _inferred_chained(stages_model, ids, None)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.manual_seed(4)
    assert (_inferred_chained(stages_model, ids, None) - want).abs().max() > 1e-3     # the dropout is on


def test_mistral_gets_its_sliding_window_mask():
    """Before, Mistral was split with Llama's recipe, whose full causal mask gave logits 0.14 off once the
    sequence (12) outgrew config.sliding_window (8)."""
    model = family_model("mistral", dtype=torch.float64)
    ids, mask = _batch("mistral")
    assert model.config.sliding_window < ids.shape[1]
    torch.testing.assert_close(_chained(copy.deepcopy(model), ids, mask), logits_of(model, ids, mask), rtol=0,
                               atol=1e-12)


def test_models_the_inference_cannot_place_get_the_recipe_to_write():
    from parallel_layers.families import InferenceError, recipe_for

    class NoBlocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(8, 4), nn.Linear(4, 8)

    with pytest.raises(InferenceError, match="no recipe for NoBlocks .*no nn.ModuleList or nn.Sequential of blocks"
                                             "(.|\n)*docs/custom_recipe.md(.|\n)*Recipe\\(blocks="):
        recipe_for(NoBlocks())
    flat = nn.Sequential(nn.Embedding(8, 4), *[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
    with pytest.raises(InferenceError, match="nest them, nn.Sequential\\(embed, nn.Sequential\\(\\*blocks\\)"):
        recipe_for(flat)
    with pytest.raises(ValueError, match="no recipe for Linear"):
        recipe_for(nn.Linear(2, 2))
    odd = family_model("phi3", layers=2)
    odd.model.extra = nn.Linear(32, 32)               # a part the decoder layout does not have
    with pytest.raises(InferenceError, match="cannot place 'model.extra' \\(Linear\\) of the base model"):
        recipe_for(odd)
    from transformers import BloomConfig, BloomForCausalLM

    bloom = BloomForCausalLM(                                         # an embedding norm, ALiBi
        BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB))
    with pytest.raises(InferenceError, match="cannot place 'transformer.word_embeddings_layernorm' \\(LayerNorm\\)"):
        recipe_for(bloom)
    capped = family_model("phi3", layers=2)
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(InferenceError, match="config.final_logit_softcapping=30.0"):
        recipe_for(capped)


def test_forwards_the_inference_does_not_reproduce_are_refused_by_name():
    """The model's forwards are read (infer_forward.py): a head that scales its logits by an attribute the
    recipe does not know trained silently wrong before (its recipe left the scale out); now it is refused,
    and so are a known option applied another way, Gemma 3's bidirectional masks and config.scale_emb."""
    from transformers import CohereForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from parallel_layers.families import InferenceError, recipe_for

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None)

    class TemperedLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            return self.lm_head(hidden) / self.temperature

    tempered = TemperedLlama(LlamaConfig(**small))
    tempered.temperature = 0.7
    with pytest.raises(InferenceError, match="TemperedLlama.forward reads self.temperature, which the inferred "
                                             "recipe does not reproduce"):
        recipe_for(tempered)

    class DividedCohere(CohereForCausalLM):                          # logit_scale, applied another way
        def forward(self, input_ids=None, attention_mask=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.lm_head(hidden)
            return logits / self.logit_scale

    cohere = family_model("cohere", layers=2)
    cohere.__class__ = DividedCohere
    with pytest.raises(InferenceError, match="DividedCohere.forward reads self.logit_scale in a way the inferred "
                                             "recipe does not reproduce"):
        recipe_for(cohere)
    bidirectional = Gemma3ForCausalLM(Gemma3TextConfig(**small, head_dim=8, use_bidirectional_attention=True))
    with pytest.raises(InferenceError, match="config.use_bidirectional_attention=True .* is not reproduced"):
        recipe_for(bidirectional)
    minicpm_like = family_model("phi3", layers=2)
    minicpm_like.config.scale_emb = 12
    with pytest.raises(InferenceError, match="config.scale_emb=12 changes the forward"):
        recipe_for(minicpm_like)


def test_decoders_whose_forward_differed_silently_are_refused():
    """Before, these got a recipe that ran a different forward (logits off, by the amount in brackets, at
    2 layers): NanoChat calls its final norm before its blocks too (0.16), CTRL scales its embeddings and
    adds a sinusoidal table it holds as a buffer (0.62). A mixture of experts whose config asks for the
    routers' load-balancing loss in the model's loss is refused too; without it, its logits are exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from parallel_layers.families import InferenceError, recipe_for

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)

    def build(model_type, **extra):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **small, **extra))

    with pytest.raises(InferenceError, match="NanoChatModel.forward calls self.norm more than once"):
        recipe_for(build("nanochat", final_logit_softcapping=None))
    with pytest.raises(InferenceError, match="CTRLModel.forward reads self.d_model_size, self.pos_encoding"):
        recipe_for(build("ctrl", n_embd=32, n_layer=2, n_head=4, dff=64))
    with pytest.raises(InferenceError, match="config.output_router_logits=True adds the routers' load-balancing"):
        recipe_for(build("mixtral", num_local_experts=4, output_router_logits=True))
    moe = build("mixtral", num_local_experts=4)
    ids, mask = _batch("mixtral")
    torch.testing.assert_close(_chained(copy.deepcopy(moe), ids, mask), logits_of(moe, ids, mask), rtol=0, atol=1e-6)


def test_a_model_with_an_nn_sequential_of_blocks_splits_by_parameters():
    """Before, split_model refused an nn.Sequential of blocks ("has no nn.ModuleList"); now its children run
    in order and the blocks split like a ModuleList's."""
    from parallel_layers.families import recipe_for
    from parallel_layers.pipeline import split_model

    model = OwnModel(4).double()
    ids, _ = _batch("own")
    stages = [split_model(copy.deepcopy(model), recipe_for(model), 0, 1, num_chunks=2, boundaries="parameters")]
    chunk0, chunk1 = stages[0]
    assert [len(chunk0.blocks), len(chunk1.blocks)] == [2, 2]     # the tied embedding weighs on both ends
    torch.testing.assert_close(chunk1(chunk0(ids)), model(ids), rtol=0, atol=0)
    # a model that is itself an nn.Sequential, its blocks nested in one
    seq = nn.Sequential(model.embed, model.blocks, model.norm, model.head)
    chunk0, chunk1 = split_model(copy.deepcopy(seq), recipe_for(seq), 0, 1, num_chunks=2)
    assert (chunk0.recipe.first, chunk0.recipe.blocks, chunk0.recipe.last) == (("0",), "1", ("2", "3"))
    torch.testing.assert_close(chunk1(chunk0(ids)), seq(ids), rtol=0, atol=0)


# ---------------------------------------------------------------------- tp=2: the inferred plans
def body_tp_families(rank, world, kinds):
    from parallel_layers.families.infer_recipe import infer_recipe
    from parallel_layers.tensor_parallel.parallelize import gather_dense_state_dict, parallelize, tp_partitions

    mesh = cached_mesh(tp=world)
    out = {}
    for kind in kinds:
        dense = family_model(kind, layers=2, dtype=torch.float64)
        model = parallelize(copy.deepcopy(dense), mesh, infer_recipe(dense).tp_plan(dense))
        ids, mask = _batch(kind)
        ref, got = logits_of(dense, ids, mask), logits_of(model, ids, mask)
        ref.square().mean().backward()
        got.square().mean().backward()
        grads = gather_dense_state_dict(model, grads=True)
        grad_err = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                       for n, p in dense.named_parameters())
        split = {n.split(".")[-2] for n in tp_partitions(model)}        # the layers' names, split over tp
        out[kind] = ((got - ref).abs().max().item() / ref.abs().max().item(), grad_err, split)
    return out


def test_inferred_tp_plans_match_the_dense_models(dist_pools):
    """Phi-3's fused qkv_proj/gate_up_proj split by sections with a local config (its attention reads the
    head counts from it), GPT-NeoX's per-head query_key_value split plainly, Gemma's scaled embedding kept
    over the vocabulary split, GPT-2's Conv1D c_attn split by sections with local split_size and heads."""
    kinds = [k for k in FAMILIES if k not in ("mistral", "qwen2")]     # built as Llama (tested in 3D)
    want = {"llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                      "lm_head"},
            "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"},
            "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "embed_in", "lm_head"},
            "gemma": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens"},
            "gpt2": {"c_attn", "c_proj", "c_fc", "wte"}, "own": {"fc1", "fc2", "embed"}}
    for rank, out in enumerate(dist_pools(2).run(body_tp_families, kinds)):
        for kind, (logits_err, grad_err, split) in out.items():
            assert logits_err < 1e-10 and grad_err < 1e-10, (rank, kind, logits_err, grad_err)
            assert want[kind] <= split, (kind, want[kind] - split)     # every block layer split, and the embeddings


FALCON_PLAN = {"transformer.word_embeddings": "vocab",
               # [q|k|v] per head (ALiBi's falcon) or [q.. | k | v] per key/value group (falcon_rope): a
               # contiguous split is whole heads or whole groups
               "transformer.h.*.self_attention.query_key_value": {"style": "colwise", "sections": None},
               "transformer.h.*.self_attention.dense": "rowwise",
               "transformer.h.*.self_attention": {"style": "divide", "attrs": ["num_heads", "num_kv_heads"]},
               "transformer.h.*.mlp.dense_h_to_4h": "colwise", "transformer.h.*.mlp.dense_4h_to_h": "rowwise",
               "lm_head": {"style": "colwise", "gather_output": True}}


def body_tp_falcon(rank, world, kinds):
    from parallel_layers.families.infer_recipe import infer_recipe
    from parallel_layers.pipeline import split_model
    from parallel_layers.tensor_parallel.parallelize import gather_dense_state_dict, parallelize

    mesh = cached_mesh(tp=world)
    out = {}
    for kind in kinds:
        dense = family_model(kind, layers=2, dtype=torch.float64)
        model = parallelize(copy.deepcopy(dense), mesh, FALCON_PLAN)
        ids, mask = _batch(kind)
        first, second = split_model(model, infer_recipe(dense), 0, 1, num_chunks=2)
        got = second(first(ids, attention_mask=mask), attention_mask=mask)
        ref = logits_of(dense, ids, mask)
        ref.square().mean().backward()
        got.square().mean().backward()
        grads = gather_dense_state_dict(model, grads=True)
        grad_err = max(((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-30)).item()
                       for n, p in dense.named_parameters())
        out[kind] = ((got - ref).abs().max().item() / ref.abs().max().item(), grad_err)
    return out


def test_falcon_alibi_is_cut_to_each_tensor_parallel_ranks_heads(dist_pools):
    """Falcon's ALiBi bias and the causal mask that holds it ([b, heads, n, n]) are built for every head in
    the context; each block takes its rank's heads (a column-parallel query_key_value gives rank r heads
    r*heads/tp ..). At tp=2 through the inferred stages with a hand plan (infer_plan does not know Falcon's
    query_key_value), logits and gradients equal the dense model's own; falcon_rope alike."""
    for rank, out in enumerate(dist_pools(2).run(body_tp_falcon, ["falcon"])):
        for kind, (logits_err, grad_err) in out.items():
            assert logits_err < 1e-10 and grad_err < 1e-10, (rank, kind, logits_err, grad_err)


def _version(text):
    return tuple(int(x) for x in text.split(".")[:2] if x.isdigit())


try:
    import transformers as _tf
    _TRANSFORMERS = _version(_tf.__version__)
except ImportError:
    _TRANSFORMERS = (0, 0)


def body_tp_errors(rank, world):
    from parallel_layers.families import llama_plan
    from parallel_layers.families.infer_recipe import infer_recipe
    from parallel_layers.tensor_parallel.parallelize import parallelize

    mesh = cached_mesh(tp=world)
    msgs = {}

    def attempt(key, fn):
        try:
            fn()
            msgs[key] = None
        except (ValueError, TypeError) as exc:
            msgs[key] = str(exc)
        except RuntimeError as exc:           # raised inside the model's own code (see the test)
            msgs[key] = "RuntimeError: " + str(exc)

    ids, mask = _batch("phi3")
    mqa = family_model("llama", layers=2, kv_heads=1)                 # one KV head cannot split over 2 ranks
    attempt("kv", lambda: parallelize(mqa, mesh, llama_plan(mqa)))
    phi3 = family_model("phi3", layers=2)
    plan = infer_recipe(phi3).tp_plan(phi3)
    forgot = {k: ("colwise" if isinstance(v, dict) and "sections" in v else v) for k, v in plan.items()}
    attempt("sections", lambda: parallelize(copy.deepcopy(phi3), mesh, forgot))
    no_local = {k: v for k, v in plan.items() if not (isinstance(v, dict) and v.get("style") == "divide")}
    attempt("local_config", lambda: logits_of(parallelize(copy.deepcopy(phi3), mesh, no_local), ids, mask))
    return msgs


def test_tp_errors_name_the_numbers_and_the_fix(dist_pools):
    """Before: 1 KV head at tp=2 died inside HF attention ("shape '[2, 12, -1, 8]' is invalid"); Phi-3's
    fused projections split without sections trained silently wrong; its attention without local head
    counts failed in RowParallelLinear with no pointer to the fix."""
    for msgs in dist_pools(2).run(body_tp_errors):
        kv = msgs["kv"]
        assert kv and "config.num_attention_heads=4 and config.num_key_value_heads=1" in kv, kv
        assert "tensor-parallel size 2" in kv and "use tp in [1]" in kv and "not replicated" in kv, kv
        sections = msgs["sections"]
        assert sections and "'model.layers.0.self_attn.qkv_proj' looks like a fused projection" in sections, sections
        assert "'sections': [32, 16, 16]" in sections and "train silently wrong" in sections, sections
        local = msgs["local_config"]
        if local and local.startswith("RuntimeError") and _TRANSFORMERS < (5, 20):
            # transformers 5.17's Phi-3 attention reads the config's head counts before its output projection,
            # so a plan without the local config fails inside SDPA, before RowParallelLinear can name the fix
            assert "size" in local, local
            continue
        assert local and "RowParallelLinear: input has last dimension" in local, local
        assert "'config_attrs': ['num_attention_heads', 'num_key_value_heads']" in local and "tp_plan=" in local, local


def test_the_custom_recipe_example_in_the_docs_runs():
    """docs/custom_recipe.md's complete Recipe (Phi-3 by hand, its context contract) computes the model's logits."""
    import os
    import re

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "custom_recipe.md")
    with open(path) as fh:
        text = fh.read()
    block = re.search(r"<!-- checked: tests/test_infer_recipe.py -->\n```python\n(.*?)^```", text, re.M | re.S)
    assert block, "docs/custom_recipe.md lost its checked example"
    exec(compile(block.group(1), path, "exec"), {"__name__": "custom_recipe_example"})
