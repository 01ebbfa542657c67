"""Llama-style decoders (``LlamaForCausalLM``, and Qwen2, built the same way): recipe and TP plan."""
from __future__ import annotations

import torch.nn as nn

from .infer_recipe import infer_hf_decoder
from .recipe import Recipe, causal_mask, first_output, positions


def _llama_context(model, hidden, attention_mask=None, position_ids=None):
    position_ids = positions(hidden, position_ids)
    return {"attention_mask": causal_mask(model, hidden, attention_mask, position_ids),
            "position_ids": position_ids,
            "position_embeddings": model.model.rotary_emb(hidden, position_ids=position_ids)}


def llama_plan(model: nn.Module) -> dict:
    """q/k/v, gate and up column-wise, o and down row-wise, the embedding and head over the vocabulary
    (the head's logits gathered for the user's loss). Heads and kv heads must divide by tp."""
    return {"model.embed_tokens": "vocab",
            "model.layers.*.self_attn.[qkv]_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": {"style": "colwise", "gather_output": True}}


LLAMA = Recipe(
    blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"), shared=("model.rotary_emb",),
    embed=lambda model, ids, **side: model.model.embed_tokens(ids),
    head=lambda model, h: model.lm_head(model.model.norm(h)),
    context=_llama_context,
    block=lambda block, h, ctx: first_output(block(h, **ctx)),
    tp_plan=llama_plan)



def qwen2_recipe(model: nn.Module) -> Recipe:
    """Llama's recipe, unless some layers attend through a sliding window (``use_sliding_window``: its
    ``layer_types`` mix kinds): the inferred recipe builds one mask per kind and gives each block its own
    (Llama's one causal mask trained those layers on a different forward)."""
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        return infer_hf_decoder(model)
    return LLAMA


# the model classes this file serves (the registry reads it)
RECIPES = {"LlamaForCausalLM": LLAMA, "Qwen2ForCausalLM": qwen2_recipe}

__all__ = ["LLAMA", "llama_plan", "qwen2_recipe", "RECIPES"]
