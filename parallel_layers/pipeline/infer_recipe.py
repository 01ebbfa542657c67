"""Recipes inferred from the model itself: moved to :mod:`parallel_layers.families.infer_recipe`; the names
stay importable from here."""
from ..families.infer_recipe import InferenceError, find_blocks, infer_hf_decoder, infer_recipe, infer_sequential

__all__ = ["infer_recipe", "infer_hf_decoder", "infer_sequential", "find_blocks", "InferenceError"]
