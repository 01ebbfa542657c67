"""Replicated parameters whose gradient is a partial sum over the tensor-parallel ranks.

A parameter that tp does not split is a copy on every tp rank, and the copies stay equal only if each
rank's gradient is the whole one. That holds for a module that sees the full activation (a block's
input norm, after a row-parallel all-reduce). It does not for a module that sees only this rank's shard:
a per-head q/k norm after a column-parallel projection (Qwen3, Gemma 3) normalizes this rank's heads
only, so its weight's gradient on each rank is the sum over that rank's heads, and the whole gradient is
the sum over tp (as Megatron-LM all-reduces the gradients of norms inside a sequence-parallel region).

``parallelize``'s style ``"partial"`` marks a module's parameters (``p.tp_partial_grad = True``);
:func:`partial_grad_params` finds them and :func:`sum_partial_grads` sums their gradients over tp, once
per step, after every micro-batch's backward and before the gradient norm, the data-parallel reduction
and the optimizer. ``Parallel3D`` does it; a training loop of your own over a ``parallelize``d model
calls ``sum_partial_grads([p.grad for p in partial_grad_params(model)], tp_group)`` after backward.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.nn as nn

from ..distributed import collectives as C


def mark_partial(module: nn.Module) -> None:
    """Mark ``module``'s own parameters (recursively) as replicated with tp-partial gradients."""
    for p in module.parameters():
        mark_partial_param(p)


def mark_partial_param(p: nn.Parameter) -> None:
    """Mark one parameter as replicated with a tp-partial gradient (a sequence-parallel norm's weight)."""
    p.tp_partial_grad = True


def partial_grad_params(model: nn.Module) -> List[nn.Parameter]:
    """The parameters of ``model`` marked by :func:`mark_partial`, in registration order (the same order on
    every tp rank), each once."""
    return [p for p in model.parameters() if getattr(p, "tp_partial_grad", False)]


@torch.no_grad()
def sum_partial_grads(grads: Sequence[Optional[torch.Tensor]], tp_group) -> None:
    """Sum ``grads`` over ``tp_group`` in place, in one all-reduce (a collective: every tp rank calls it
    with the same parameters' gradients). A parameter this step did not reach (None) is left out: the tp
    ranks run the same blocks, so it is missing on all of them."""
    present = [g for g in grads if g is not None]
    if C.world_size(tp_group) == 1 or not present:
        return
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in present])
    C.all_reduce(flat, tp_group)
    pos = 0
    for g in present:
        n = g.numel()
        g.copy_(flat[pos:pos + n].view_as(g))
        pos += n


__all__ = ["mark_partial", "mark_partial_param", "partial_grad_params", "sum_partial_grads"]
