"""The demo's models: the reference GPT (``--model gpt``), the reference GPT with Mixture-of-Experts MLPs
(``--model moe``: ``--experts`` experts, ``--top-k`` per token, split over ``--ep`` ranks) or a small Llama built
from a ``transformers`` config (``--model llama``), all trained by the same
:class:`~parallel_layers.composition.parallel3d.Parallel3D` path on the same byte-level corpus, and the
single-process twin each is checked against."""
from __future__ import annotations

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


def reference_microbatches(args, batch_shards: int):
    """The rows of each micro-batch the parallel run computes its router losses over (micro-batch ``m``: the
    ``m``-th slice of every replica's rows), for a model whose loss depends on how the batch is cut (the MoE
    GPT's load-balancing loss is over each micro-batch's tokens); None for the others (one whole batch)."""
    if args.model != "moe":
        return None
    per = args.batch_size // batch_shards
    size = per // args.microbatches
    return [torch.cat([torch.arange(r * per + m * size, r * per + (m + 1) * size) for r in range(batch_shards)])
            for m in range(args.microbatches)]


__all__ = ["MODELS", "gpt_config", "lm_loss", "llama", "parallel_model", "model_description", "reference",
           "reference_microbatches"]
