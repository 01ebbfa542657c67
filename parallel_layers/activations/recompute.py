"""Activation checkpointing of transformer blocks, with the dropout masks replayed exactly.

A checkpointed block keeps only its input for backward; backward runs the block again (torch's
non-reentrant ``torch.utils.checkpoint``) and differentiates the recomputation. For the gradients to
be the plain run's, the recomputation must draw the same dropout masks: torch's ``preserve_rng_state``
restores the default generator (replicated activations), and :func:`_context_fn` restores the
tensor-parallel tracker's streams (sharded activations: attention heads, sequence shards), then puts
both back, so whatever runs after backward draws what it would have drawn without checkpointing.

Collectives inside a block (TP all-reduces, SP gathers) run again in the recomputation, on every rank
of the group in the same order, as Megatron-LM's full recomputation does. Under ZeRO-3 the block's
parameters are gathered again for it (``ZeroStage3``'s pre-backward hook; in the pipeline they are kept
gathered for the whole step).

Where to checkpoint (every block, the first n, Chen et al.'s sqrt(n) segments, the least recomputation
within a memory budget) is :mod:`~parallel_layers.activations.checkpoint_policy`'s; :class:`Placement` applies a
policy to one model or stage, and :func:`run_blocks` runs the blocks by its plan: a segment of several
blocks is one checkpoint (its input kept, the whole run recomputed in backward, its dropout masks
replayed like a single block's).

How a checkpointed block keeps its input (whole, by default) is a ``saved_inputs=``
(:class:`~parallel_layers.activations.partitioned_checkpoint.SavedInputs`): a ``1/tp`` slice per TP rank gathered
again for the recomputation (ZeRO-R's partitioned activations) and / or a copy in host memory; the
recomputation reads the same values, so the gradients are plain checkpointing's bit for bit.

Used by :class:`~parallel_layers.models.gpt.GPT` (``checkpoint=``, ``checkpoint_inputs=``), and
``split_model``'s ``ModelStage``.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .checkpoint_policy import BlockProfile, CheckpointPlan, Policy, measure_blocks, resolve_policy

# set inside a checkpoint's recomputation, in the thread that runs it (torch's autograd thread on a GPU)
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("parallel_layers_recomputing", default=False)


def recomputing() -> bool:
    """True while a checkpointed block's forward runs again in backward (:func:`checkpointed`). A forward hook
    that records something once per forward (a router's statistics for a model-level loss) must run the
    same tensor operations there (torch checks the recomputation saves what the forward saved) but leave
    its records alone: backward runs the forward's own autograd nodes, with the recomputed tensors."""
    return _RECOMPUTING.get()


def _context_fn(tracker):
    """``context_fn`` for ``torch.utils.checkpoint``: marks the recomputation (:func:`recomputing`) and, with
    a tracker, restores the TP dropout stream on it like the default generator (which ``preserve_rng_state``
    already handles)."""
    saved = {}

    @contextlib.contextmanager
    def forward_ctx():
        if tracker is not None:
            saved["states"] = tracker.get_states()
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        current = tracker.get_states() if tracker is not None else None
        if tracker is not None:
            tracker.set_states(saved["states"])
        token = _RECOMPUTING.set(True)
        try:
            yield
        finally:
            _RECOMPUTING.reset(token)
            if tracker is not None:
                tracker.set_states(current)

    return forward_ctx(), _Reenterable(recompute_ctx)


class _Reenterable:
    """A context manager entered once per recomputation: torch's checkpoint recomputes once per backward
    call, and a zero-bubble schedule's W (pipeline/backward_split.py) is a second call on the same graph."""

    def __init__(self, make):
        self.make, self.entered = make, []

    def __enter__(self):
        cm = self.make()
        self.entered.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


def checkpointed(block: nn.Module, x: torch.Tensor, tracker=None, saved_inputs=None) -> torch.Tensor:
    """Run ``block(x)`` without keeping its activations; backward recomputes it with the same RNG
    state (dropout masks replay exactly). ``tracker``: the TP RNG tracker, if the block uses one.
    ``saved_inputs``: a ``SavedInputs`` (how ``x`` is kept until then: sliced over TP, on the host), or
    None (kept whole)."""
    # torch saves the checkpoint's inputs through autograd's saved-tensor hooks: these see x alone
    with saved_inputs.hooks() if saved_inputs is not None else contextlib.nullcontext():
        return _torch_checkpoint(block, x, use_reentrant=False, preserve_rng_state=True,
                                 context_fn=lambda: _context_fn(tracker))


def checkpointed_block_count(checkpoint: Union[bool, int, str, Policy], num_blocks: int,
                             where: str = "checkpoint") -> Optional[int]:
    """How many of ``num_blocks`` blocks (the first ones) run under activation checkpointing:
    ``checkpoint=True`` every block, ``False`` none, an int ``n`` the first ``n`` (Megatron-LM's
    ``--recompute-method block --recompute-num-layers n``: recomputing only some blocks saves less
    memory for less recomputation; counted per model, or per stage in a pipeline, so each chunk of the
    interleaved schedule recomputes its own first ``n``). A placement policy (``"sqrt"``, ``SqrtPolicy()``,
    ``MemoryBudget(...)``): the blocks it recomputes, None where that is only known once measured."""
    return Placement(checkpoint, num_blocks, where).static_count


class Placement:
    """``checkpoint=`` applied to ``num_blocks`` blocks: the policy (:func:`resolve_policy`, which checks
    the value) and its plan, computed once, or once per input shape, dtype and device for a policy that
    measures the blocks (``MemoryBudget`` without given sizes: :func:`measure_blocks` on the first training
    forward of that shape; ``plans`` holds what it chose, ``profiles`` what it measured)."""

    def __init__(self, checkpoint, num_blocks: int, where: str = "checkpoint"):
        self.policy = resolve_policy(checkpoint, where)
        self.num_blocks = num_blocks
        self.plans: Dict[tuple, CheckpointPlan] = {}
        self.profiles: Dict[tuple, BlockProfile] = {}
        self._static = None if self.policy.needs_profile else self.policy.plan(num_blocks)

    @property
    def static_count(self) -> Optional[int]:
        return None if self._static is None else self._static.recomputed

    def plan_for(self, fns: Sequence[Callable], h: torch.Tensor, tracker=None) -> CheckpointPlan:
        if self._static is not None:
            return self._static
        key = (tuple(h.shape), h.dtype, h.device)
        if key not in self.plans:
            self.profiles[key] = measure_blocks(fns, h, tracker)
            self.plans[key] = self.policy.plan(self.num_blocks, self.profiles[key])
        return self.plans[key]

    def __repr__(self):
        return f"Placement({self.policy!r}, {self.num_blocks} blocks)"


def checkpoint_placement(checkpoint, num_blocks: int, where: str = "checkpoint") -> Placement:
    """The :class:`Placement` of ``checkpoint=`` over ``num_blocks`` blocks (a bad value raises ``ValueError``)."""
    return Placement(checkpoint, num_blocks, where)


class _Segment:
    """Blocks ``fns`` run in order, as one function: one checkpoint over the whole run."""

    def __init__(self, fns: List[Callable]):
        self.fns = fns

    def __call__(self, h):
        for fn in self.fns:
            h = fn(h)
        return h


def run_blocks(blocks: Iterable[Callable], h: torch.Tensor, recompute: Union[int, Placement, CheckpointPlan],
               tracker=None, saved_inputs=None) -> torch.Tensor:
    """``h`` through ``blocks`` (modules or one-argument callables) in order; ``recompute``: an int (the
    first ``recompute`` blocks checkpointed, each alone), a :class:`Placement` or a ``CheckpointPlan``
    (its segments checkpointed, each as one); ``saved_inputs``: how each checkpoint keeps its input
    (:func:`checkpointed`)."""
    fns = list(blocks)
    if isinstance(recompute, Placement):
        plan = recompute.plan_for(fns, h, tracker)
    elif isinstance(recompute, CheckpointPlan):
        plan = recompute
    else:
        plan = CheckpointPlan.first(len(fns), recompute)
    if plan.num_blocks != len(fns):
        raise ValueError(f"run_blocks: a plan for {plan.num_blocks} blocks given {len(fns)} blocks")
    starts = {s: e for s, e in plan.segments}
    i = 0
    while i < len(fns):
        e = starts.get(i)
        if e is None:
            h = fns[i](h)
            i += 1
        else:
            h = checkpointed(fns[i] if e == i + 1 else _Segment(fns[i:e]), h, tracker, saved_inputs)
            i = e
    return h


__all__ = ["checkpointed", "checkpointed_block_count", "checkpoint_placement", "Placement", "recomputing",
           "run_blocks"]
