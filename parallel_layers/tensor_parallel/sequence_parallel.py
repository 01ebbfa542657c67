"""Sequence parallelism for a model cut by a recipe (Hugging Face decoders): Megatron-LM's scheme, applied to
layers the package did not write.

Between two tensor-parallel regions (after a row-parallel projection, before the next column-parallel one) a
block's activations are the same on every tp rank: its residual adds, its norms, dropout. Under sequence
parallelism each tp rank holds ``1 / tp`` of those tokens instead (``[b, s/tp, d]``): the column-parallel
projections all-gather their input along the sequence, the row-parallel ones reduce-scatter their output
along it instead of all-reducing it, so a block moves the same bytes and keeps ``1 / tp`` of what the replicated
region kept (the activations saved for backward, a checkpointed block's input) and does ``1 / tp`` of its
elementwise work.

What it takes for a recipe's model (:class:`~parallel_layers.families.Recipe`):

* :func:`sequence_parallel_plan`: inside the blocks, the row-wise projections reduce-scatter their output
  along the sequence (``sequence_parallel=True``) and the column-wise ones take an input gathered for them
  (``input_gathered=True``: their partial input gradients pass on unreduced); the embedding and the head keep
  their styles;
* :func:`gather_region_inputs`: the module that holds a block's column-wise projections (its attention, its
  MLP) gets its hidden states all-gathered along the sequence on the way in (one gather for q, k and v; its
  backward reduce-scatters the summed partial gradients). Gathering there, not inside each projection, is
  what lets a Hugging Face attention run unchanged: it reads the sequence length off its input to shape its
  heads and its rotary tables;
* :func:`mark_sequence_parallel_params`: a block's parameters outside every module the plan matched (its
  norms: they see this rank's tokens only) carry ``p.sequence_parallel = True``, their gradients partial sums
  that ``Parallel3D`` sums over tp before the step (as it does for the reference GPT's norms);
* the stage (``ModelStage(sequence_parallel_group=...)``): the first splits the hidden states along the
  sequence after the recipe's context is built from the whole sequence (masks, positions, rotary tables); the
  pipeline's messages are each tp rank's shard (1/tp of the bytes, as Megatron-LM sends them; a later stage
  builds its context from a stand-in of the whole's shape); the last gathers them before the head.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Dict, List

import torch
import torch.nn as nn

from .layers import check_sequence_input
from .mappings import gather_from_sequence_parallel_region
from .parallelize import plan_entry

_SPLIT_STYLES = ("colwise", "rowwise")


def sequence_parallel_plan(plan: Dict[str, object], blocks: str) -> Dict[str, object]:
    """``plan`` with its column- and row-wise styles inside the blocks (``blocks``: the recipe's container of
    blocks, e.g. ``model.layers``) made sequence-parallel (see the module docstring)."""
    out: Dict[str, object] = {}
    for pattern, style in plan.items():
        name = plan_entry(style)[0]
        if name in _SPLIT_STYLES and pattern.startswith(blocks + "."):
            options = dict(style) if isinstance(style, dict) else {"style": style}
            if options.get("gather_output"):
                raise ValueError(f"sequence parallelism: the plan's {pattern!r} gathers its output inside a block "
                                 f"({style!r}); a block's column-wise projections must keep their shards")
            options["input_gathered" if name == "colwise" else "sequence_parallel"] = True
            out[pattern] = options
        else:
            out[pattern] = style
    return out


def _column_regions(model: nn.Module, plan: Dict[str, object], blocks: str) -> List[str]:
    """The modules that hold a block's column-wise projections (each projection's parent), in model order."""
    columns = [pattern for pattern, style in plan.items() if pattern.startswith(blocks + ".")
               and plan_entry(style)[0] == "colwise"]
    parents = []
    for name, _ in model.named_modules():
        if any(fnmatchcase(name, pattern) for pattern in columns):
            parent = name.rpartition(".")[0]
            if parent.count(".") <= blocks.count(".") + 1:
                raise ValueError(f"sequence parallelism: {name!r} is a column-wise projection directly in its block; "
                                 f"the block's input is a sequence shard, so the projections must sit in a "
                                 f"sub-module (attention, MLP) whose input is gathered. Turn sequence_parallel off "
                                 f"for this model")
            if parent not in parents:
                parents.append(parent)
    return parents


def _gather_input(group):
    def hook(module, args, kwargs):
        if args:
            return (_gathered(args[0], group, module),) + tuple(args[1:]), kwargs
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=_gathered(kwargs["hidden_states"], group, module))
        raise ValueError(f"sequence parallelism: {type(module).__name__} was called without a positional input "
                         f"or hidden_states=; its input cannot be gathered. Turn sequence_parallel off")
    return hook


def _gathered(x: torch.Tensor, group, module: nn.Module) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"sequence parallelism: {type(module).__name__}'s input is a {type(x).__name__}, not a "
                         f"[batch, sequence, hidden] tensor; turn sequence_parallel off")
    check_sequence_input(f"sequence parallelism ({type(module).__name__}'s input)", x, 1, "")
    return gather_from_sequence_parallel_region(x, group, dim=1, tensor_parallel_output_grad=True)


def gather_region_inputs(model: nn.Module, plan: Dict[str, object], blocks: str, group) -> List[str]:
    """Gather the input of every module holding a block's column-wise projections along the sequence (a
    forward pre-hook; backward: the reduce-scatter of its gradient). Returns those modules' names."""
    regions = _column_regions(model, plan, blocks)
    for name in regions:
        model.get_submodule(name).register_forward_pre_hook(_gather_input(group), with_kwargs=True)
    return regions


def mark_sequence_parallel_params(model: nn.Module, plan: Dict[str, object], blocks: str) -> List[str]:
    """Mark (``p.sequence_parallel = True``) the parameters of the blocks that no module matched by ``plan``
    holds: they act on this rank's tokens only. Returns their names."""
    matched = [name for name, _ in model.named_modules()
               if name and any(fnmatchcase(name, pattern) for pattern in plan)]
    marked = []
    for name, p in model.named_parameters():
        if not name.startswith(blocks + "."):
            continue
        if any(name.startswith(m + ".") for m in matched):
            continue
        p.sequence_parallel = True
        marked.append(name)
    return marked


__all__ = ["sequence_parallel_plan", "gather_region_inputs", "mark_sequence_parallel_params"]
