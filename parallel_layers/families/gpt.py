"""The reference GPT (:class:`parallel_layers.models.gpt.GPT`) as any other model: its recipe and its loss (a
``GPTConfig`` handed to ``Parallel3D`` becomes the model by :meth:`GPTConfig.build`), cut into pipeline stages by
``split_model`` as a Hugging Face model is: there is no second, GPT-specific way.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..pipeline.token_loss import NO_LABEL
from .recipe import Recipe


def gpt_loss(model: nn.Module, ignore_index: Optional[int]):
    """The last stage's ``loss_fn(logits_shard, targets)``: ``(sum of the token cross entropies, count)`` over
    the targets that are not ``ignore_index``, in fp32 (a sum of thousands of bf16 terms would keep 3
    significant digits), from the logits' vocabulary shard (the GPT's own :meth:`GPT.loss`)."""
    ignore = NO_LABEL if ignore_index is None else ignore_index

    def loss(logits_shard: torch.Tensor, targets: torch.Tensor):
        logits_shard = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))
        return (type(model).loss(model, logits_shard, targets, ignore_index=ignore, reduction="sum"),
                (targets != ignore).sum())
    return loss


def gpt_recipe(model: nn.Module) -> Recipe:
    """Its own ``embed`` and ``head``; with tied embeddings the last stage holds ``wte`` for the head. Its
    layers are built tensor-parallel already (``GPT(config, tp_group=...)``), so its plan is empty; its logits
    are vocabulary shards under tensor parallelism, so its loss is its own (:func:`gpt_loss`)."""
    tied = model.config.tie_embeddings
    return Recipe(blocks="blocks", first=("wte", "wpe"), last=("ln_f", "wte") if tied else ("ln_f", "lm_head"),
                  embed=lambda m, ids, **side: m.embed(ids), head=lambda m, h: m.head(h),
                  context=lambda m, h, **side: {}, block=lambda block, h, ctx: block(h),
                  tp_plan=lambda m: {}, loss=gpt_loss)


RECIPES = {"GPT": gpt_recipe}

__all__ = ["gpt_recipe", "gpt_loss", "RECIPES"]
