"""Activation checkpointing of transformer blocks, with the dropout masks replayed exactly.

A checkpointed block keeps only its input for backward; backward runs the block again (torch's
non-reentrant ``torch.utils.checkpoint``) and differentiates the recomputation. For the gradients to
be the plain run's, the recomputation must draw the same dropout masks: torch's ``preserve_rng_state``
restores the default generator (replicated activations), and :func:`_rng_context_fn` restores the
tensor-parallel tracker's streams (sharded activations: attention heads, sequence shards), then puts
both back, so whatever runs after backward draws what it would have drawn without checkpointing.

Collectives inside a block (TP all-reduces, SP gathers) run again in the recomputation, on every rank
of the group in the same order, as Megatron-LM's full recomputation does. Under ZeRO-3 the block's
parameters are gathered again for it (``ZeroStage3``'s pre-backward hook; in the pipeline they are kept
gathered for the whole step).

Used by :class:`~parallel_layers.models.gpt.GPT` (``checkpoint=``) and the pipeline's ``GPTStage``.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint


def _rng_context_fn(tracker):
    """``context_fn`` for ``torch.utils.checkpoint``: the TP dropout stream (tracker) is restored on
    recomputation like the default generator (which ``preserve_rng_state`` already handles)."""
    saved = {}

    @contextlib.contextmanager
    def forward_ctx():
        saved["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        current = tracker.get_states()
        tracker.set_states(saved["states"])
        try:
            yield
        finally:
            tracker.set_states(current)

    return forward_ctx(), recompute_ctx()


def checkpointed(block: nn.Module, x: torch.Tensor, tracker=None) -> torch.Tensor:
    """Run ``block(x)`` without keeping its activations; backward recomputes it with the same RNG
    state (dropout masks replay exactly). ``tracker``: the TP RNG tracker, if the block uses one."""
    kwargs = {}
    if tracker is not None:
        kwargs["context_fn"] = lambda: _rng_context_fn(tracker)
    return _torch_checkpoint(block, x, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpointed_block_count(checkpoint: Union[bool, int], num_blocks: int, where: str = "checkpoint") -> int:
    """How many of ``num_blocks`` blocks (the first ones) run under activation checkpointing:
    ``checkpoint=True`` every block, ``False`` none, an int ``n`` the first ``n`` (Megatron-LM's
    ``--recompute-method block --recompute-num-layers n``: recomputing only some blocks saves less
    memory for less recomputation; counted per model, or per stage in a pipeline, so each chunk of the
    interleaved schedule recomputes its own first ``n``)."""
    if isinstance(checkpoint, bool):
        return num_blocks if checkpoint else 0
    if not isinstance(checkpoint, int) or checkpoint < 0:
        raise ValueError(f"{where}: checkpoint={checkpoint!r} must be True (every block), False (none) or a "
                         f"number of blocks >= 0 to recompute")
    return min(checkpoint, num_blocks)


def run_blocks(blocks: Iterable[nn.Module], h: torch.Tensor, recompute: int, tracker=None) -> torch.Tensor:
    """``h`` through ``blocks`` in order, the first ``recompute`` of them checkpointed."""
    for i, block in enumerate(blocks):
        h = checkpointed(block, h, tracker) if i < recompute else block(h)
    return h


__all__ = ["checkpointed", "checkpointed_block_count", "run_blocks"]
