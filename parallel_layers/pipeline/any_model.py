"""Pipeline stages cut from a model you did not write (Hugging Face included), without rewriting it.

A transformer is an embedding, a stack of blocks and a head; only the hidden states flow from block to
block. A *recipe* names those parts of one model family and says how each is called:

- ``blocks``: the dotted name of the ``nn.ModuleList`` of blocks (``"model.layers"``);
- ``first`` / ``last``: the modules only the first / last stage keeps (embeddings; final norm and head);
  ``shared``: parameter-free modules every stage keeps (rotary tables);
- ``embed(model, input_ids, **side)``, ``head(model, hidden)``: the first stage's and last stage's work;
- ``context(model, hidden, **side)``: what every block needs besides the hidden states (attention
  mask, position ids, rotary cos/sin), rebuilt on every stage from the *side inputs* each rank holds
  (``engine.step(ids, targets, attention_mask=..., position_ids=...)``, see ``PipelineEngine``), so
  only one tensor travels between stages, as in Megatron-LM;
- ``block(block, hidden, context)``: one block's call.

:func:`split_model` keeps this rank's stages of the model and drops the rest (their parameters are
freed): ``stages = split_model(model, recipe_for(model), pp_rank, pp_size, loss_fn=...)``, then
``PipelineEngine(stages, pp_group, ...)``. The user's ``loss_fn(logits, targets)`` runs on the last
stage. Weights tied between the first and last stage (``lm_head.weight is embed_tokens.weight``)
stay tied: both ranks hold the parameter, it starts as the first stage's (broadcast) and its gradients
are summed over the two (``finish_grads``), as Megatron-LM does for its word embeddings.
Recipes ship for Llama-style decoders (``LlamaForCausalLM`` and the families built like it: Mistral,
Qwen2) and GPT-2 (``GPT2LMHeadModel``); a model of your own gets a :class:`Recipe` of a few lines.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from .stage import partition_layers, stage_ids, start_tied_equal, sum_tied_grads


def _get(model: nn.Module, dotted: str) -> Optional[nn.Module]:
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _set(model: nn.Module, dotted: str, value) -> None:
    parent, _, attr = dotted.rpartition(".")
    setattr(_get(model, parent) if parent else model, attr, value)


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


LLAMA = Recipe(
    blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"), shared=("model.rotary_emb",),
    embed=lambda model, ids, **side: model.model.embed_tokens(ids),
    head=lambda model, h: model.lm_head(model.model.norm(h)),
    context=_llama_context,
    block=lambda block, h, ctx: _first_output(block(h, **ctx)))


def _gpt2_embed(model, ids, attention_mask=None, position_ids=None):
    t = model.transformer
    h = t.wte(ids)
    return t.drop(h + t.wpe(_positions(h, position_ids)))


def _gpt2_context(model, hidden, attention_mask=None, position_ids=None):
    position_ids = _positions(hidden, position_ids)
    return {"attention_mask": _causal_mask(model, hidden, attention_mask, position_ids), "position_ids": position_ids}


GPT2 = Recipe(
    blocks="transformer.h", first=("transformer.wte", "transformer.wpe", "transformer.drop"),
    last=("transformer.ln_f", "lm_head"),
    embed=_gpt2_embed,
    head=lambda model, h: model.lm_head(model.transformer.ln_f(h)),
    context=_gpt2_context,
    block=lambda block, h, ctx: _first_output(block(h, **ctx)))

RECIPES: Dict[str, Recipe] = {"LlamaForCausalLM": LLAMA, "MistralForCausalLM": LLAMA, "Qwen2ForCausalLM": LLAMA,
                              "GPT2LMHeadModel": GPT2}


def recipe_for(model: nn.Module) -> Recipe:
    """The shipped recipe for ``model``'s class, or a clear error saying how to write one."""
    name = type(model).__name__
    if name not in RECIPES:
        raise ValueError(f"split_model: no recipe for {name} (recipes: {', '.join(sorted(RECIPES))}); write a "
                         f"parallel_layers.pipeline.any_model.Recipe naming its blocks, embedding and head")
    return RECIPES[name]


class ModelStage(nn.Module):
    """One pipeline stage of a model cut by :func:`split_model`: ``stage(x, targets=None, **side)``."""

    def __init__(self, model: nn.Module, recipe: Recipe, blocks: List[nn.Module], is_first: bool, is_last: bool,
                 loss_fn: Optional[Callable], tied_group=None):
        super().__init__()
        self._model = [model]              # in a list: not a submodule, its dropped parts stay out of parameters()
        self.recipe, self.is_first, self.is_last, self.loss_fn = recipe, is_first, is_last, loss_fn
        kept = list(recipe.shared) + (list(recipe.first) if is_first else []) + (list(recipe.last) if is_last else [])
        self.parts = nn.ModuleDict({name.replace(".", "__"): _get(model, name) for name in kept
                                    if _get(model, name) is not None})
        self.blocks = nn.ModuleList(blocks)
        self.tied_group = tied_group
        self.tied: List[nn.Parameter] = []

    def forward(self, x, targets=None, **side):
        model = self._model[0]
        h = self.recipe.embed(model, x, **side) if self.is_first else x
        ctx = self.recipe.context(model, h, **side)
        for block in self.blocks:
            h = self.recipe.block(block, h, ctx)
        if not self.is_last:
            return h
        logits = self.recipe.head(model, h)
        return logits if targets is None or self.loss_fn is None else self.loss_fn(logits, targets)

    def finish_grads(self) -> None:
        """After backward: the tied weights' gradients summed over the first and last stage."""
        sum_tied_grads(self.tied, self.tied_group)


def _tied_between(model: nn.Module, recipe: Recipe) -> List[nn.Parameter]:
    """Parameters held both by a first-stage part and a last-stage part (tied embeddings)."""
    def params(names):
        return {id(p): p for n in names if _get(model, n) is not None for p in _get(model, n).parameters()}
    first, last = params(recipe.first), params(recipe.last)
    return [first[i] for i in first if i in last]


def split_model(model: nn.Module, recipe: Recipe, pp_rank: int, pp_size: int, *, num_chunks: int = 1,
                boundaries: Optional[Sequence[int]] = None, loss_fn: Optional[Callable] = None,
                tied_group=None) -> List[ModelStage]:
    """This rank's stages (one per chunk) of ``model``; the parts no stage of this rank needs are dropped
    from ``model``. Every rank passes the same model (built from the same seed or loaded from the same
    weights). ``boundaries``: block split points (default balanced by count); ``tied_group``: the group
    of the first and last pipeline rank (:func:`~parallel_layers.pipeline.tied_embedding_group`), needed
    when weights are tied between them."""
    blocks = _get(model, recipe.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"split_model: {type(model).__name__} has no nn.ModuleList at {recipe.blocks!r}")
    S = pp_size * num_chunks
    if boundaries is None and len(blocks) < S:
        raise ValueError(f"split_model: {len(blocks)} blocks cannot fill {S} pipeline stages (pipeline size "
                         f"{pp_size} x {num_chunks} chunk(s)); use fewer stages or pass explicit boundaries")
    ranges = partition_layers(len(blocks), S, boundaries)
    mine = stage_ids(pp_rank, pp_size, num_chunks)
    has_first, has_last = 0 in mine, S - 1 in mine
    tied = _tied_between(model, recipe) if pp_size > 1 else []
    if tied and (has_first or has_last) and tied_group is None:
        raise ValueError(f"split_model: {len(tied)} weight(s) are tied between the first and last stage; pass "
                         f"tied_group=tied_embedding_group(pp_group) (every rank calls it)")
    stages = [ModelStage(model, recipe, [blocks[i] for i in range(*ranges[s])], s == 0, s == S - 1, loss_fn,
                         tied_group if (has_first or has_last) and tied else None) for s in mine]
    owned = {i for s in mine for i in range(*ranges[s])}
    for i in range(len(blocks)):           # free what this rank does not run
        if i not in owned:
            blocks[i] = nn.Identity()
    for name in (() if has_first else recipe.first):
        _set(model, name, None)
    for name in (() if has_last else recipe.last):
        _set(model, name, None)
    if tied and (has_first or has_last):
        start_tied_equal(tied, tied_group)
        holder = next(st for st in stages if st.is_first or st.is_last)
        holder.tied = tied
    return stages


__all__ = ["Recipe", "LLAMA", "GPT2", "RECIPES", "recipe_for", "ModelStage", "split_model"]
