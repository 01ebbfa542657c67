"""The reference GPT (:class:`parallel_layers.models.gpt.GPT`) as any other model: its recipe.

(The hand-written pipeline stages of this GPT, ``GPTStage`` / ``build_gpt_stages``, are in
:mod:`parallel_layers.models.gpt_stages`; this recipe cuts the same model through the generic path.)
"""
from __future__ import annotations

import torch.nn as nn

from .recipe import Recipe


def gpt_recipe(model: nn.Module) -> Recipe:
    """Its own ``embed`` and ``head``; with tied embeddings the last stage holds ``wte`` for the head. Its
    layers are built tensor-parallel already (``GPT(config, tp_group=...)``), so its plan is empty."""
    tied = model.config.tie_embeddings
    return Recipe(blocks="blocks", first=("wte", "wpe"), last=("ln_f", "wte") if tied else ("ln_f", "lm_head"),
                  embed=lambda m, ids, **side: m.embed(ids), head=lambda m, h: m.head(h),
                  context=lambda m, h, **side: {}, block=lambda block, h, ctx: block(h),
                  tp_plan=lambda m: {})


RECIPES = {"GPT": gpt_recipe}

__all__ = ["gpt_recipe", "RECIPES"]
