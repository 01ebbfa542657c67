"""GPT-2 (``GPT2LMHeadModel``): recipe and TP plan."""
from __future__ import annotations

from typing import Dict, Union

import torch.nn as nn

from .recipe import Recipe, causal_mask, first_output, positions


def gpt2_plan(n_embd: int) -> Dict[str, Union[str, dict]]:
    """The plan for Hugging Face ``GPT2LMHeadModel`` (``n_embd``: ``config.n_embd``): the fused ``c_attn``
    split per q/k/v section, the attention's split size and head count made local, the MLP and
    attention output row-wise, the tied embedding and head over the vocabulary."""
    d = n_embd
    return {"transformer.wte": "vocab", "lm_head": {"style": "colwise", "gather_output": True},
            "transformer.h.*.attn.c_attn": {"style": "colwise", "sections": [d, d, d]},
            "transformer.h.*.attn": {"style": "divide", "attrs": ["split_size", "num_heads", "embed_dim"]},
            "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def gpt2_recipe_plan(model: nn.Module) -> dict:
    return gpt2_plan(model.config.n_embd)


def _gpt2_embed(model, ids, attention_mask=None, position_ids=None):
    t = model.transformer
    h = t.wte(ids)
    return t.drop(h + t.wpe(positions(h, position_ids)))


def _gpt2_context(model, hidden, attention_mask=None, position_ids=None):
    position_ids = positions(hidden, position_ids)
    return {"attention_mask": causal_mask(model, hidden, attention_mask, position_ids), "position_ids": position_ids}


GPT2 = Recipe(
    blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    last=("transformer.ln_f", "lm_head"),
    embed=_gpt2_embed,
    head=lambda model, h: model.lm_head(model.transformer.ln_f(h)),
    context=_gpt2_context,
    block=lambda block, h, ctx: first_output(block(h, **ctx)),
    tp_plan=gpt2_recipe_plan)

RECIPES = {"GPT2LMHeadModel": GPT2}

__all__ = ["GPT2", "gpt2_plan", "gpt2_recipe_plan", "RECIPES"]
