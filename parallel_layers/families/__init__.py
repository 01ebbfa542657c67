"""Model families: one file per family holding its pipeline recipe and tensor-parallel plan
(:mod:`.llama`, :mod:`.gpt2`, :mod:`.bert`, :mod:`.mistral`, :mod:`.gpt`), the inferred recipe and plan
for any other model (:mod:`.infer_recipe`, :mod:`.infer_plan`) and the registry that picks one
(:mod:`.registry`)."""
from .bert import BERT, bert_plan
from .gpt import gpt_recipe
from .gpt2 import GPT2, gpt2_plan
from .infer_recipe import InferenceError, infer_recipe
from .llama import LLAMA, llama_plan
from .recipe import Recipe, get_module
from .registry import FAMILIES, RECIPES, recipe_for

__all__ = ["Recipe", "get_module", "RECIPES", "FAMILIES", "recipe_for", "LLAMA", "llama_plan", "GPT2", "gpt2_plan",
           "BERT", "bert_plan", "gpt_recipe", "infer_recipe", "InferenceError"]
