"""Which recipe serves which model class: each family file's ``RECIPES``, merged.

Adding a family is adding one file beside :mod:`.llama` (its recipe, its TP plan, and a ``RECIPES`` dict
from class name to a :class:`~.recipe.Recipe` or a function of the model returning one) and naming it in
:data:`FAMILIES`. A class no family serves gets a recipe inferred from its structure (:mod:`.infer_recipe`).
"""
from __future__ import annotations

from typing import Dict

import torch.nn as nn

from . import bert, gpt, gpt2, llama, mistral
from .infer_recipe import infer_recipe
from .recipe import Recipe

FAMILIES = (llama, mistral, gpt2, bert, gpt)

# class name -> a Recipe, or a function of the model returning one (one dict: callers may edit it)
RECIPES: Dict[str, object] = {name: recipe for family in FAMILIES for name, recipe in family.RECIPES.items()}


def recipe_for(model: nn.Module) -> Recipe:
    """The shipped recipe for ``model``'s class, else one inferred from its structure
    (:func:`~.infer_recipe.infer_recipe`), else an error naming the part that could not be placed and the
    ``Recipe`` to write (docs/custom_recipe.md)."""
    name = type(model).__name__
    if name not in RECIPES:
        return infer_recipe(model)
    recipe = RECIPES[name]
    return recipe if isinstance(recipe, Recipe) else recipe(model)


__all__ = ["FAMILIES", "RECIPES", "recipe_for"]
