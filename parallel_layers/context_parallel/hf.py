"""Context parallelism for models we did not write: their attention call swapped, the model unedited.

Hugging Face attention modules call whatever function ``config._attn_implementation`` names in
transformers' ``AttentionInterface`` with ``(module, query [b, hq, n, d], key, value [b, hkv, n, d],
attention_mask, dropout=, scaling=, **kwargs)`` (after rotary embeddings and before the output
projection). :func:`enable_context_parallel` registers :func:`hf_attention` under :data:`ATTENTION` and
points the model's config at it; the recipe's context (:func:`with_context_parallel`) adds a
``cp_context`` (the cp group, the whole sequence's segment ids, ring or Ulysses) to the keyword arguments
every block receives, which transformers hands down to the attention function. Masks are not built (the
function applies causality and segments by position; see :mod:`.layout`), so no stage materialises a
``[S, S]`` mask.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from . import context_parallel_attention

ATTENTION = "parallel_layers_context_parallel"


@dataclass
class CPContext:
    """What the attention of a block needs besides q, k, v: the cp group, the segment ids of the whole
    sequence ``[b, S]`` (this micro-batch's rows) and ``"ring"`` or ``"ulysses"``."""
    group: object
    segments: torch.Tensor
    method: str = "ring"


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                 cp_context: Optional[CPContext] = None, **kwargs):
    """transformers' attention-function contract, computed over the cp group; returns ``([b, n, hq, d], None)``."""
    name = type(module).__name__
    if cp_context is None:
        raise RuntimeError(f"{name}: the model's attention is set to context parallelism ({ATTENTION}) but the block "
                           f"was called without a cp_context; run it through Parallel3D with a mesh of cp > 1 (its "
                           f"recipe passes the context) or set config._attn_implementation back to 'sdpa'")
    if dropout:
        raise ValueError(f"{name}: attention dropout {dropout} is not supported under context parallelism; set the "
                         f"config's attention dropout to 0")
    for option in ("softcap", "s_aux"):
        if kwargs.get(option) is not None:
            raise ValueError(f"{name}: attention with {option} (Gemma 2's soft-capped scores, gpt-oss's sinks) is "
                             f"not computed by context-parallel attention, which would silently drop it; use cp=1 "
                             f"for this model")
    window = kwargs.get("sliding_window")
    if window is not None and cp_context.segments.shape[1] > window:
        raise ValueError(f"{name}: sliding-window attention (window {window}) over sequences of "
                         f"{cp_context.segments.shape[1]} tokens is not supported under context parallelism; use "
                         f"sequences of at most {window} tokens or cp=1")
    out = context_parallel_attention(query, key, value, group=cp_context.group, segments=cp_context.segments,
                                     causal=bool(getattr(module, "is_causal", True)), scale=scaling,
                                     method=cp_context.method)
    return out.transpose(1, 2).contiguous(), None


def enable_context_parallel(model: nn.Module) -> None:
    """Register :func:`hf_attention` with transformers and make ``model``'s attention call it.

    The model gets its own copy of its config (and of every sub-config its modules hold) first: transformers
    keeps the config object a model was built from, so switching that one would switch every other model built
    from it too (the planner builds one per layout from the user's config; a one-process reference model
    shares it), and those would then call the cp attention without a cp group."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, hf_attention)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise ValueError(f"context parallelism: {type(model).__name__} has no Hugging Face config whose attention "
                         f"implementation can be set; its attention must call "
                         f"parallel_layers.context_parallel.context_parallel_attention itself")
    copies: dict = {}                      # id(config) -> this model's own copy (deepcopy's memo: shared stays shared)
    own = copy.deepcopy(config, copies)
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is None or not hasattr(cfg, "_attn_implementation"):
            continue
        if cfg is not config and id(cfg) not in copies:     # a sub-config the top one does not hold
            copies[id(cfg)] = copy.deepcopy(cfg, copies)
        mine = own if cfg is config else copies[id(cfg)]
        mine._attn_implementation = ATTENTION
        sub.config = mine
    own._attn_implementation = ATTENTION


def with_context_parallel(recipe, group, method: str):
    """``recipe`` whose context adds the :class:`CPContext` to what every block receives (the side input
    ``cp_segments``, the micro-batch's segment ids, becomes its ``segments``)."""
    inner, inner_embed = recipe.context, recipe.embed

    def context(model, hidden, cp_segments=None, **side):
        ctx = dict(inner(model, hidden, **side))
        ctx["attention_mask"] = None          # causality and segments are applied by the attention itself
        ctx["cp_context"] = CPContext(group, cp_segments, method)
        return ctx

    def embed(model, ids, cp_segments=None, **side):
        return inner_embed(model, ids, **side)
    return dataclasses.replace(recipe, context=context, embed=embed)


__all__ = ["ATTENTION", "CPContext", "hf_attention", "enable_context_parallel", "with_context_parallel"]
