"""Recipes: how one model family is cut into pipeline stages and split over tensor-parallel ranks.

A transformer is an embedding, a stack of blocks and a head; only the hidden states flow from block to
block. A :class:`Recipe` names those parts of one model family and says how each is called:

- ``blocks``: the dotted name of the ``nn.ModuleList`` of blocks (``"model.layers"``);
- ``first`` / ``last``: the modules only the first / last stage keeps (embeddings; final norm and head);
  ``shared``: parameter-free modules every stage keeps (rotary tables);
- ``embed(model, input_ids, **side)``, ``head(model, hidden)``: the first stage's and last stage's work;
- ``context(model, hidden, **side)``: what every block needs besides the hidden states (attention
  mask, position ids, rotary cos/sin), rebuilt on every stage from the *side inputs* each rank holds
  (``engine.step(ids, targets, attention_mask=..., position_ids=...)``), so only one tensor travels
  between stages, as in Megatron-LM;
- ``block(block, hidden, context)``: one block's call;
- ``tp_plan(model)``: the :func:`~parallel_layers.tensor_parallel.parallelize` plan of the family
  (optional: without it, tensor parallelism needs a plan from the caller);
- ``loss(model, ignore_index)``: the family's ``loss_fn(logits, targets)`` (optional: without it the
  default is token cross entropy on whole logits).

Each shipped family has its recipe and plan in one file of this package (:mod:`.llama`, :mod:`.gpt2`,
:mod:`.bert`, :mod:`.mistral`, :mod:`.gpt`); :mod:`.registry` maps a model's class to its recipe. A model
of your own whose blocks map a tensor to a tensor can name its parts with :meth:`Recipe.sequential`::

    recipe = Recipe.sequential(blocks="layers", first=["embed"], last=["norm", "head"])

A complete hand-written recipe, with the contract of ``context``, is in docs/custom_recipe.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn


def get_module(model: nn.Module, dotted: str) -> Optional[nn.Module]:
    """``model``'s submodule at ``dotted`` (``"model.layers"``), or None where any part is missing."""
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _run_in_order(names: Sequence[str]) -> Callable:
    def run(model, h, **side):
        for name in names:
            h = get_module(model, name)(h)
        return h
    return run


@dataclass
class Recipe:
    """How one model family is cut into stages (see the module docstring)."""
    blocks: str
    first: Sequence[str]
    last: Sequence[str]
    embed: Callable
    head: Callable
    context: Callable
    block: Callable
    shared: Sequence[str] = ()
    tp_plan: Optional[Callable[[nn.Module], dict]] = None
    # loss(model, ignore_index) -> loss_fn(logits, targets): the family's own loss, used when the caller gives
    # none (the reference GPT's logits are vocabulary shards under tensor parallelism)
    loss: Optional[Callable] = None

    @classmethod
    def sequential(cls, blocks: str, first: Sequence[str], last: Sequence[str],
                   tp_plan: Optional[Callable[[nn.Module], dict]] = None) -> "Recipe":
        """A model that runs ``first`` modules in order, then every block as ``block(h)``, then ``last``
        modules in order (no masks or positions between blocks)."""
        first, last = tuple(first), tuple(last)
        return cls(blocks=blocks, first=first, last=last, embed=_run_in_order(first),
                   head=lambda model, h: _run_in_order(last)(model, h),
                   context=lambda model, h: {}, block=lambda block, h, ctx: block(h), tp_plan=tp_plan)


# ---------------------------------------------------------------------- what Hugging Face families share
def positions(hidden: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """``position_ids`` as given, else ``0 .. n-1`` for the sequence of ``hidden`` ``[b, n, h]``."""
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def causal_mask(model, hidden, attention_mask, position_ids):
    """transformers' causal mask for ``model``'s config (what its own forward would build)."""
    from transformers.masking_utils import create_causal_mask
    return create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              past_key_values=None, position_ids=position_ids)


def first_output(out):
    """A Hugging Face block returns its hidden states, or a tuple that starts with them."""
    return out[0] if isinstance(out, tuple) else out


__all__ = ["Recipe", "get_module", "positions", "causal_mask", "first_output"]
