"""The demo's models: the reference GPT (``--model gpt``), the reference GPT with Mixture-of-Experts MLPs
(``--model moe``: ``--experts`` experts, ``--top-k`` per token, split over ``--ep`` ranks) or a small Llama built
from a ``transformers`` config (``--model llama``), all trained by the same
:class:`~parallel_layers.composition.parallel3d.Parallel3D` path on the same byte-level corpus, and the
single-process twin each is checked against."""
from __future__ import annotations

import math
import os
from typing import Callable, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("gpt", "moe", "llama")
REFERENCE_GPT = ("gpt", "moe")
VOCAB = 256


def gpt_config(args):
    from ..models.gpt import GPTConfig
    moe = dict(num_experts=args.experts, moe_top_k=args.top_k) if args.model == "moe" else {}
    return GPTConfig(vocab_size=VOCAB, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                     max_seq_len=args.seq_len, dropout=0.0, bias=False, tie_embeddings=True, **moe)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross entropy, the mean over every position (the GPT's own loss)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def llama(args) -> nn.Module:
    """A Llama of the demo's sizes (SwiGLU width 4 x d_model, every head its own kv head, tied embeddings),
    drawn from ``torch.manual_seed(args.seed)``: the same weights in every process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                      num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                      num_key_value_heads=args.n_head, max_position_embeddings=args.seq_len,
                      tie_word_embeddings=True, attention_dropout=0.0)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(cfg)


def parallel_model(args) -> Tuple[Union[object, nn.Module], dict]:
    """What ``Parallel3D`` is built from and the keyword arguments that go with it."""
    if args.model in REFERENCE_GPT:
        return gpt_config(args), {"seed": args.seed}
    return llama(args), {"loss_fn": lm_loss, "seed": args.seed}


def model_description(args):
    """What a universal checkpoint of this model records (``Parallel3D.description``)."""
    if args.model in REFERENCE_GPT:
        return gpt_config(args)
    model = llama(args)
    return {"class": type(model).__name__, "parameters": {n: list(p.shape) for n, p in model.named_parameters()}}


def reference(args) -> Tuple[nn.Module, Callable]:
    """The single-process model and ``loss(model, x, y)``."""
    if args.model in REFERENCE_GPT:
        from ..models.gpt import GPT
        torch.manual_seed(args.seed)
        return GPT(gpt_config(args)), lambda model, x, y: model(x, y)[1]
    return llama(args), lambda model, x, y: lm_loss(model(input_ids=x).logits, y)


def fp8_recipe(args):
    """``--precision fp8``'s recipe (None otherwise): ``--fp8-recipe``'s scaling; blocks of 128, or of the largest
    power of two that divides the model's local widths (d_model / tp, 3 d_model / tp) where that is less."""
    if args.precision != "fp8":
        return None
    from ..fp8 import FP8Recipe
    block = math.gcd(128, args.d_model // args.tp, 3 * args.d_model // args.tp)
    return FP8Recipe(scaling=args.fp8_recipe, block_size=block)


def reference_microbatches(args, batch_shards: int):
    """The rows of each micro-batch of the one-process run, for a model whose loss depends on how the batch is
    cut; None for the others (one whole batch):

    - the MoE GPT: its load-balancing loss is over each micro-batch's tokens, and the parallel run's micro-batch
      ``m`` is the ``m``-th slice of every replica's rows;
    - FP8 (``--precision fp8``): a per-tensor scale is that of the tensor a rank casts, so each replica's
      micro-batch is a micro-batch of its own."""
    per = args.batch_size // batch_shards
    size = per // args.microbatches
    if args.precision == "fp8":
        return [torch.arange(r * per + m * size, r * per + (m + 1) * size)
                for r in range(batch_shards) for m in range(args.microbatches)]
    if args.model != "moe":
        return None
    return [torch.cat([torch.arange(r * per + m * size, r * per + (m + 1) * size) for r in range(batch_shards)])
            for m in range(args.microbatches)]


__all__ = ["MODELS", "gpt_config", "lm_loss", "llama", "parallel_model", "model_description", "reference",
           "reference_microbatches", "fp8_recipe"]
