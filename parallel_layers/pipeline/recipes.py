"""Recipes: how one model family is cut into pipeline stages and split over tensor-parallel ranks.

Moved to :mod:`parallel_layers.families` (one file per family: its recipe and its tensor-parallel plan;
:class:`~parallel_layers.families.recipe.Recipe` and its contract in :mod:`parallel_layers.families.recipe`).
The names stay importable from here.
"""
from ..families.bert import BERT, bert_plan
from ..families.gpt import gpt_recipe
from ..families.gpt2 import GPT2, gpt2_recipe_plan
from ..families.llama import LLAMA, llama_plan
from ..families.recipe import Recipe, get_module
from ..families.registry import RECIPES, recipe_for

__all__ = ["Recipe", "LLAMA", "GPT2", "BERT", "RECIPES", "recipe_for", "llama_plan", "bert_plan", "gpt_recipe",
           "get_module", "gpt2_recipe_plan"]
