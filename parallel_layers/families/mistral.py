"""Mistral (``MistralForCausalLM``): the inferred recipe (:mod:`.infer_recipe`), whose context builds the
sliding-window mask Mistral's attention uses (Llama's full causal mask differs once a sequence is longer
than ``config.sliding_window``); its plan is the inferred one too."""
from __future__ import annotations

from .infer_recipe import infer_hf_decoder

RECIPES = {"MistralForCausalLM": infer_hf_decoder}

__all__ = ["RECIPES"]
