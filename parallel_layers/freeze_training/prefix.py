"""A model cut at block ``k``: the frozen prefix (embedding + blocks ``0..k-1``) and the active rest.

Both halves come from the model's :class:`~parallel_layers.families.Recipe` (the reference GPT's, a
Hugging Face family's, or ``Recipe.sequential``), so whatever ``Parallel3D`` takes can be frozen:

* :func:`freeze_prefix_` sets ``requires_grad=False`` on the embedding (the recipe's ``first`` modules)
  and the first ``k`` blocks, in place: what a single-process run does to freeze the same blocks, and
  the oracle the tests compare with. A weight tied between the embedding and the head (a GPT's ``wte``,
  a tied Llama's ``lm_head``) is one parameter, so the head is frozen with it, in both runs alike.
* :class:`FrozenPrefix` runs the frozen part under ``torch.no_grad`` in eval mode (no dropout: its output
  is a function of the sample alone, which is what lets it be cached) and maps token ids (and side
  inputs) to the hidden states after block ``k - 1``.
* :func:`split_at` turns a whole model into ``(prefix, active model, active recipe)``: the active model is
  the same model object with its block list cut to blocks ``k..`` and the embedding dropped, and its
  recipe takes hidden states in where the original took token ids, so ``Parallel3D`` pipelines it as any
  other model. The active model's block ``i`` is the whole model's block ``k + i`` (:func:`full_name`).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.nn as nn

from ..families import Recipe, get_module


def _set(model: nn.Module, dotted: str, value) -> None:
    parent, _, attr = dotted.rpartition(".")
    setattr(get_module(model, parent) if parent else model, attr, value)


def blocks_of(model: nn.Module, recipe: Recipe) -> nn.ModuleList:
    blocks = get_module(model, recipe.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"freeze training: {type(model).__name__} has no nn.ModuleList of blocks at {recipe.blocks!r} "
                         f"(the recipe's 'blocks'); fix the recipe")
    return blocks


def prefix_modules(model: nn.Module, recipe: Recipe, num_frozen: int) -> List[nn.Module]:
    """The modules a freeze of ``num_frozen`` blocks covers: the recipe's ``first`` modules and the first
    ``num_frozen`` blocks (none for 0)."""
    if num_frozen == 0:
        return []
    firsts = [get_module(model, n) for n in recipe.first]
    return [m for m in firsts if m is not None] + list(blocks_of(model, recipe)[:num_frozen])


def freeze_prefix_(model: nn.Module, num_frozen: int, recipe: Optional[Recipe] = None) -> List[str]:
    """Freeze the embedding and the first ``num_frozen`` blocks of ``model`` in place
    (``requires_grad=False``); returns the names of the parameters frozen. ``recipe``: default the shipped
    one for the model's class (:func:`~parallel_layers.families.recipe_for`)."""
    if recipe is None:
        from ..families import recipe_for
        recipe = recipe_for(model)
    ids = {id(p) for m in prefix_modules(model, recipe, num_frozen) for p in m.parameters()}
    names = []
    for name, p in model.named_parameters():
        if id(p) in ids:
            p.requires_grad_(False)
            names.append(name)
    return names


def full_name(name: str, num_frozen: int, recipe: Recipe) -> str:
    """A parameter name of the active model (blocks counted from the first active one) -> the whole
    model's."""
    head = recipe.blocks + "."
    if num_frozen and name.startswith(head):
        index, _, rest = name[len(head):].partition(".")
        return f"{head}{int(index) + num_frozen}.{rest}"
    return name


def block_index(name: str, recipe: Recipe) -> Optional[int]:
    """The block a parameter of that (dense) name belongs to, or None (embedding, head)."""
    head = recipe.blocks + "."
    return int(name[len(head):].partition(".")[0]) if name.startswith(head) else None


class FrozenPrefix:
    """The frozen embedding and first ``num_frozen`` blocks of a model: ``prefix(ids, **side)`` -> hidden
    states, without gradients, in eval mode. Not an ``nn.Module`` of the active model: its parameters are
    in no optimizer and no gradient buffer. ``calls`` / ``samples`` count what it computed."""

    def __init__(self, model: nn.Module, recipe: Recipe, num_frozen: int):
        self.model, self.recipe, self.num_frozen = model.eval(), recipe, num_frozen
        self.blocks = list(blocks_of(model, recipe))[:num_frozen]
        self.calls = self.samples = 0

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, **side) -> torch.Tensor:
        self.calls += 1
        self.samples += ids.shape[0]
        h = self.recipe.embed(self.model, ids, **side)
        ctx = self.recipe.context(self.model, h, **side)
        for block in self.blocks:
            h = self.recipe.block(block, h, ctx)
        return h

    def parameters(self):
        return self.model.parameters()


def _hidden_states_in(model: nn.Module, hidden: torch.Tensor, **side) -> torch.Tensor:
    """The active model's first stage: the frozen prefix's output comes in where token ids did."""
    return hidden


def active_recipe(recipe: Recipe, num_frozen: int) -> Recipe:
    """``recipe`` for the active part: no ``first`` modules, hidden states in."""
    if num_frozen == 0:
        return recipe
    return dataclasses.replace(recipe, first=(), embed=_hidden_states_in)


def split_at(model: nn.Module, recipe: Recipe, num_frozen: int, *,
             keep_prefix: bool) -> Tuple[Optional[FrozenPrefix], nn.Module, Recipe]:
    """``(prefix, active model, active recipe)`` of ``model`` cut at block ``num_frozen`` (see the module
    docstring). ``model`` is changed in place and becomes the active model; the prefix is a copy of only
    the frozen part, made where ``keep_prefix`` (the ranks that feed the pipeline), else None. With
    ``num_frozen == 0`` the model and recipe come back unchanged."""
    if num_frozen == 0:
        return None, model, recipe
    blocks = blocks_of(model, recipe)
    if not 0 < num_frozen < len(blocks):
        raise ValueError(f"freeze training: cannot freeze {num_frozen} of {len(blocks)} blocks; "
                         f"leave at least one to train")
    freeze_prefix_(model, num_frozen, recipe)
    prefix = None
    if keep_prefix:
        # copy only what the prefix runs: the block list cut to the frozen blocks and the head's own
        # modules (not shared with the embedding) taken out while copying
        heads_only = [n for n in recipe.last if n not in recipe.first and get_module(model, n) is not None]
        held = {n: get_module(model, n) for n in heads_only}
        _set(model, recipe.blocks, nn.ModuleList(list(blocks)[:num_frozen]))
        for n in heads_only:
            _set(model, n, None)
        try:
            prefix = FrozenPrefix(copy.deepcopy(model), recipe, num_frozen)
        finally:
            _set(model, recipe.blocks, blocks)
            for n, m in held.items():
                _set(model, n, m)
    _set(model, recipe.blocks, nn.ModuleList(list(blocks)[num_frozen:]))
    for name in recipe.first:
        if name not in recipe.last:
            _set(model, name, None)       # the embedding runs in the prefix only
    return prefix, model, active_recipe(recipe, num_frozen)


__all__ = ["freeze_prefix_", "FrozenPrefix", "split_at", "active_recipe", "full_name", "block_index", "blocks_of",
           "prefix_modules"]
