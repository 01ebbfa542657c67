"""Splitting a model into pipeline stages: layer ranges, which stages a rank holds, and the weights tied
between the first and the last stage.

Layout of virtual stages (Megatron-LM's): with ``p`` pipeline ranks and ``v`` chunks per rank there are
``S = p * v`` stages; chunk ``c`` of rank ``r`` is stage ``c * p + r``. With ``v = 1`` a rank holds
one contiguous slice of the layers. Every model is split by :mod:`.any_model` (``Parallel3D``'s reference GPT
included).

Tied embeddings: the first stage owns the embedding; the last stage (when tied) holds its own copy, made
equal to the first stage's (:func:`start_tied_equal`), for the LM head. Their gradients are summed over a group
of the first and last pipeline rank (:func:`tied_embedding_group`) in ``ModelStage.finish_grads``, so both
copies see the dense model's gradient and stay equal under any optimizer that is deterministic in it.
When one rank holds both ends (``p = 1``), the chunks share one module.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives as C


def partition_layers(num_layers: int, num_stages: int, boundaries: Optional[Sequence[int]] = None,
                     require_divisible: bool = False) -> List[Tuple[int, int]]:
    """``[start, end)`` layer ranges of ``num_stages`` stages.

    ``boundaries``: explicit split points, ``num_stages - 1`` increasing integers in ``(0, num_layers)``
    (a stage may also be empty at the ends). Otherwise balanced by count: the first ``num_layers %
    num_stages`` stages get one layer more; with ``require_divisible=True`` an uneven count is an error
    (the interleaved schedule's chunks should cost alike)."""
    if num_stages < 1:
        raise ValueError(f"partition_layers: num_stages={num_stages} must be >= 1")
    if boundaries is not None:
        b = list(boundaries)
        if len(b) != num_stages - 1 or any(not 0 <= x <= num_layers for x in b) or b != sorted(b):
            raise ValueError(f"partition_layers: boundaries={b} must be {num_stages - 1} non-decreasing layer "
                             f"indices in [0, {num_layers}] for {num_stages} stages")
        edges = [0] + b + [num_layers]
        return [(edges[i], edges[i + 1]) for i in range(num_stages)]
    if require_divisible and num_layers % num_stages:
        raise ValueError(f"partition_layers: {num_layers} layers do not divide into {num_stages} stages; choose "
                         f"n_layer a multiple of {num_stages} (pipeline size x chunks) or pass explicit boundaries")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for i in range(num_stages):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def stage_ids(pp_rank: int, pp_size: int, num_chunks: int = 1, layout: str = "loop") -> List[int]:
    """Global stage index of each chunk of ``pp_rank``: ``c * pp_size + pp_rank`` (``layout="loop"``), or
    in a V (``"v"``, ZBV's two chunks) stages ``pp_rank`` and ``2 pp_size - 1 - pp_rank``."""
    from .schedules import LAYOUTS, stage_of
    if layout not in LAYOUTS:
        raise ValueError(f"stage_ids: layout={layout!r}; choose one of {LAYOUTS}")
    if layout == "v" and num_chunks != 2:
        raise ValueError(f"stage_ids: the V layout has two chunks per rank, got num_chunks={num_chunks}")
    return [stage_of(pp_rank, c, pp_size, num_chunks, layout) for c in range(num_chunks)]


def start_tied_equal(params, tied_group) -> None:
    """Weights tied between the first and last stage start as the first stage's (group rank 0), even on
    ranks seeded differently; :func:`sum_tied_grads` keeps them equal from then on."""
    with torch.no_grad():
        for p in params:
            C.broadcast(p, 0, tied_group)


def sum_tied_grads(params, tied_group) -> None:
    """Sum the tied weights' gradients over the first and last stage (a missing one counts as zero: one
    end may not have used the weight this step)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        C.all_reduce(p.grad, tied_group)


def tied_embedding_group(pp_group, timeout=None):
    """A group of the first and last rank of every pipeline group (a collective over the whole world:
    every rank must call it, in the same order). Returns this rank's group, or None if it is neither
    first nor last, or if the pipeline has one rank. ``timeout``: default the pipeline group's."""
    from ..mesh import group_timeout
    timeout = timeout if timeout is not None else group_timeout(pp_group)
    mine = dist.get_process_group_ranks(pp_group)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    result = None
    for ranks in sorted({tuple(r) for r in every}):
        if len(ranks) < 2:
            continue
        g = dist.new_group([ranks[0], ranks[-1]], use_local_synchronization=False, timeout=timeout,
                           group_desc=f"tied embedding group [{ranks[0]}, {ranks[-1]}]")
        if list(ranks) == mine and dist.get_rank() in (ranks[0], ranks[-1]):
            result = g
    return result


__all__ = ["partition_layers", "stage_ids", "tied_embedding_group", "start_tied_equal", "sum_tied_grads"]
