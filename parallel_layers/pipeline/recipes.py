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
  (optional: without it, tensor parallelism needs a plan from the caller).

Shipped: Llama-style decoders (``LlamaForCausalLM`` and the families built like it: Qwen2; Mistral's is
the inferred one, for its sliding-window mask),
GPT-2 (``GPT2LMHeadModel``) and BERT (``BertForMaskedLM``). Any other class gets a recipe inferred from
its structure (:mod:`~.infer_recipe`: Hugging Face decoders such as Phi-3, GPT-NeoX or Gemma, and models
of your own whose children run in order), or an error naming the part it could not place. A model of your
own whose blocks map a tensor to a tensor can also name its parts with :meth:`Recipe.sequential`::

    recipe = Recipe.sequential(blocks="layers", first=["embed"], last=["norm", "head"])

A complete hand-written recipe, with the contract of ``context``, is in docs/custom_recipe.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

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

    @classmethod
    def sequential(cls, blocks: str, first: Sequence[str], last: Sequence[str],
                   tp_plan: Optional[Callable[[nn.Module], dict]] = None) -> "Recipe":
        """A model that runs ``first`` modules in order, then every block as ``block(h)``, then ``last``
        modules in order (no masks or positions between blocks)."""
        first, last = tuple(first), tuple(last)
        return cls(blocks=blocks, first=first, last=last, embed=_run_in_order(first),
                   head=lambda model, h: _run_in_order(last)(model, h),
                   context=lambda model, h: {}, block=lambda block, h, ctx: block(h), tp_plan=tp_plan)


def _positions(hidden: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


def _causal_mask(model, hidden, attention_mask, position_ids):
    from transformers.masking_utils import create_causal_mask
    return create_causal_mask(config=model.config, inputs_embeds=hidden, attention_mask=attention_mask,
                              past_key_values=None, position_ids=position_ids)


def _first_output(out):
    return out[0] if isinstance(out, tuple) else out


def _llama_context(model, hidden, attention_mask=None, position_ids=None):
    position_ids = _positions(hidden, position_ids)
    return {"attention_mask": _causal_mask(model, hidden, attention_mask, position_ids),
            "position_ids": position_ids,
            "position_embeddings": model.model.rotary_emb(hidden, position_ids=position_ids)}


def llama_plan(model: nn.Module) -> dict:
    """q/k/v, gate and up column-wise, o and down row-wise, the embedding and head over the vocabulary
    (the head's logits gathered for the user's loss). Heads and kv heads must divide by tp."""
    return {"model.embed_tokens": "vocab",
            "model.layers.*.self_attn.[qkv]_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise",
            "lm_head": {"style": "colwise", "gather_output": True}}


LLAMA = Recipe(
    blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"), shared=("model.rotary_emb",),
    embed=lambda model, ids, **side: model.model.embed_tokens(ids),
    head=lambda model, h: model.lm_head(model.model.norm(h)),
    context=_llama_context,
    block=lambda block, h, ctx: _first_output(block(h, **ctx)),
    tp_plan=llama_plan)


def _gpt2_embed(model, ids, attention_mask=None, position_ids=None):
    t = model.transformer
    h = t.wte(ids)
    return t.drop(h + t.wpe(_positions(h, position_ids)))


def _gpt2_context(model, hidden, attention_mask=None, position_ids=None):
    position_ids = _positions(hidden, position_ids)
    return {"attention_mask": _causal_mask(model, hidden, attention_mask, position_ids), "position_ids": position_ids}


def gpt2_recipe_plan(model: nn.Module) -> dict:
    from ..tensor_parallel.parallelize import gpt2_plan
    return gpt2_plan(model.config.n_embd)


GPT2 = Recipe(
    blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    last=("transformer.ln_f", "lm_head"),
    embed=_gpt2_embed,
    head=lambda model, h: model.lm_head(model.transformer.ln_f(h)),
    context=_gpt2_context,
    block=lambda block, h, ctx: _first_output(block(h, **ctx)),
    tp_plan=gpt2_recipe_plan)


def _bert_embed(model, ids, attention_mask=None, token_type_ids=None, position_ids=None):
    return model.bert.embeddings(input_ids=ids, token_type_ids=token_type_ids, position_ids=position_ids)


def _bert_context(model, hidden, attention_mask=None, token_type_ids=None, position_ids=None):
    from transformers.masking_utils import create_bidirectional_mask
    return {"attention_mask": create_bidirectional_mask(config=model.config, inputs_embeds=hidden,
                                                        attention_mask=attention_mask)}


def bert_plan(model: nn.Module) -> dict:
    """Self-attention q/k/v and the intermediate projection column-wise, the attention output and the
    block output row-wise, the word embedding and the (tied) MLM decoder over the vocabulary."""
    layer = "bert.encoder.layer.*."
    return {"bert.embeddings.word_embeddings": "vocab",
            layer + "attention.self.query": "colwise", layer + "attention.self.key": "colwise",
            layer + "attention.self.value": "colwise", layer + "attention.output.dense": "rowwise",
            layer + "intermediate.dense": "colwise", layer + "output.dense": "rowwise",
            "cls.predictions.decoder": {"style": "colwise", "gather_output": True},
            "cls.predictions": "share"}        # holds the decoder's bias (tied), unused in its forward


BERT = Recipe(
    blocks="bert.encoder.layer", first=("bert.embeddings",), last=("cls",),
    embed=_bert_embed,
    head=lambda model, h: model.cls(h),
    context=_bert_context,
    block=lambda block, h, ctx: _first_output(block(h, **ctx)),
    tp_plan=bert_plan)

def gpt_recipe(model: nn.Module) -> Recipe:
    """The reference GPT (``parallel_layers.models.gpt.GPT``) as any other model: its own ``embed`` and
    ``head``; with tied embeddings the last stage holds ``wte`` for the head. Its layers are built
    tensor-parallel already (``GPT(config, tp_group=...)``), so its plan is empty."""
    tied = model.config.tie_embeddings
    return Recipe(blocks="blocks", first=("wte", "wpe"), last=("ln_f", "wte") if tied else ("ln_f", "lm_head"),
                  embed=lambda m, ids, **side: m.embed(ids), head=lambda m, h: m.head(h),
                  context=lambda m, h, **side: {}, block=lambda block, h, ctx: block(h),
                  tp_plan=lambda m: {})


def _inferred(model: nn.Module) -> Recipe:
    """Mistral: the inferred recipe, whose context builds the sliding-window mask Mistral's attention
    uses (``LLAMA``'s full causal mask differs once a sequence is longer than ``config.sliding_window``)."""
    from .infer_recipe import infer_hf_decoder
    return infer_hf_decoder(model)


# a Recipe, or a function of the model returning one
RECIPES: Dict[str, object] = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": _inferred, "Qwen2ForCausalLM": LLAMA,
                              "GPT2LMHeadModel": GPT2, "BertForMaskedLM": BERT, "GPT": gpt_recipe}


def recipe_for(model: nn.Module) -> Recipe:
    """The shipped recipe for ``model``'s class, else one inferred from its structure
    (:func:`~.infer_recipe.infer_recipe`), else an error naming the part that could not be placed and the
    ``Recipe`` to write (docs/custom_recipe.md)."""
    name = type(model).__name__
    if name not in RECIPES:
        from .infer_recipe import infer_recipe
        return infer_recipe(model)
    recipe = RECIPES[name]
    return recipe if isinstance(recipe, Recipe) else recipe(model)


__all__ = ["Recipe", "LLAMA", "GPT2", "BERT", "RECIPES", "recipe_for", "llama_plan", "bert_plan", "gpt_recipe",
           "get_module"]
