"""BERT (``BertForMaskedLM``): recipe and TP plan."""
from __future__ import annotations

import torch.nn as nn

from .recipe import Recipe, first_output


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
    block=lambda block, h, ctx: first_output(block(h, **ctx)),
    tp_plan=bert_plan)

RECIPES = {"BertForMaskedLM": BERT}

__all__ = ["BERT", "bert_plan", "RECIPES"]
