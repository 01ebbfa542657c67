"""The default loss of a model the package did not write, computed on the vocabulary shards of its logits.

A tensor-parallel plan for a Hugging Face model gathers the LM head's output (``"colwise_gather"``) so that a
loss written for whole logits can run on them; at a large vocabulary and many tokens a micro-batch those
gathered logits (and their gradient) are the largest tensors of the step: ``tokens x vocab`` on every tp
rank. When the loss is ``Parallel3D``'s own token cross entropy (no ``loss_fn`` given) nothing needs them
whole: the head keeps its shard (``gather_output`` off) and the loss is
:func:`~parallel_layers.tensor_parallel.cross_entropy.vocab_parallel_cross_entropy` (Megatron-LM's: two
all-reduces of a few numbers a token), so a rank holds ``tokens x vocab / tp`` of them, as Megatron-LM and
torchtitan's ``loss_parallel`` do. Logits returned to the caller (no targets) are gathered first.

* :func:`loss_parallel_plan`: the plan with the head's gather taken off, and the head's name (None where the
  plan has no column-parallel, gathering entry for any of the recipe's last modules: the loss stays whole);
* :func:`vocab_parallel_token_loss`: ``loss(logits_shard, targets) -> (sum, count)``, the shape of
  :func:`~parallel_layers.pipeline.token_loss.token_cross_entropy`, in fp32.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from ..pipeline.token_loss import NO_LABEL
from .cross_entropy import vocab_parallel_cross_entropy
from .parallelize import plan_entry


def _gathers(style) -> bool:
    name, options = plan_entry(style)
    return name == "colwise_gather" or (name == "colwise" and bool(options.get("gather_output")))


def loss_parallel_plan(plan: Dict[str, object], head_names: Sequence[str]) -> Tuple[Dict[str, object], Optional[str]]:
    """``(plan, head)``: ``plan`` with the entry of the first of ``head_names`` (the recipe's last modules)
    that gathers a column-parallel output made to keep its shard instead, and that module's name; ``(plan,
    None)`` unchanged where none does (a head left whole, or split some other way)."""
    for name in head_names:
        style = plan.get(name)
        if style is not None and _gathers(style):
            kept = {"style": "colwise"} if isinstance(style, str) else dict(style, style="colwise")
            kept.pop("gather_output", None)
            return dict(plan, **{name: kept}), name
    return plan, None


def vocab_parallel_token_loss(tp_group, ignore_index: Optional[int]):
    """The last stage's ``loss(logits_shard, targets)``: ``(sum of the token cross entropies, count)`` over
    the targets other than ``ignore_index`` (None: every target counts), from this rank's vocabulary shard of
    the logits, in fp32 (upcast as torch's loss of bf16 logits is not; Megatron-LM upcasts too)."""
    ignore = NO_LABEL if ignore_index is None else int(ignore_index)

    def loss(logits_shard: torch.Tensor, targets: torch.Tensor):
        shard = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))
        total = vocab_parallel_cross_entropy(shard, targets, tp_group=tp_group, ignore_index=ignore,
                                             reduction="sum", inplace_backward=False)
        return total, (targets != ignore).sum()
    return loss


__all__ = ["loss_parallel_plan", "vocab_parallel_token_loss"]
