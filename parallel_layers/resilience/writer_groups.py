"""The background checkpoint writer's own process groups.

A writer thread that ran collectives on the model's groups would interleave them with training's on the
same communicators (a hang, or one rank's gradients summed with another's checkpoint shards). So the
writer gets gloo groups of its own, created once: one over the whole world (agreeing the save id, every
rank's random streams, that every file is on disk), and a mirror, with the same ranks, of every model
group that assembling the dense tensors needs (the ZeRO group, to sum the shards; the TP groups, to
gather the partitions). Gloo: the writer works on host copies, whatever the model's device.
"""
from __future__ import annotations

import datetime
from typing import Dict, Iterable, Optional, Tuple

import torch.distributed as dist

Ranks = Tuple[int, ...]


def ranks_of(group) -> Ranks:
    """The global ranks of ``group`` (a model's process group; None: the world), in group rank order."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


class WriterGroups:
    """``world``: a gloo group of every rank; :meth:`mirror`: a gloo group with the ranks of a model's group.
    A collective over the world (every rank constructs it, with its own ``needed``: the rank tuples of the
    model groups it belongs to; ranks of one group may pass them or not, every group is created on
    every rank in one sorted order, ``dist.new_group``'s rule). Single-rank groups get no mirror: nothing
    to communicate."""

    def __init__(self, needed: Iterable[Ranks], timeout: datetime.timedelta):
        self.world = dist.new_group(backend="gloo", timeout=timeout, group_desc="checkpoint writer world")
        mine = sorted({tuple(r) for r in needed if len(r) > 1})
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine, group=self.world)
        me = dist.get_rank()
        self._mirrors: Dict[Ranks, object] = {}
        for ranks in sorted({tuple(r) for rank_list in every for r in rank_list}):
            group = dist.new_group(list(ranks), backend="gloo", timeout=timeout,
                                   group_desc=f"checkpoint writer mirror {list(ranks)}")
            if me in ranks:
                self._mirrors[ranks] = group

    def mirror(self, ranks: Ranks) -> Optional[object]:
        """The writer's group with ``ranks`` (None for a single rank); a ``KeyError`` for a group this rank
        did not declare when the groups were created."""
        if len(ranks) == 1:
            return None
        try:
            return self._mirrors[tuple(ranks)]
        except KeyError:
            raise KeyError(f"WriterGroups: no mirror of the process group {list(ranks)} on rank "
                           f"{dist.get_rank()}; its ranks were not among the groups declared at construction "
                           f"(the model's groups changed after the checkpointer was built?)") from None


__all__ = ["WriterGroups", "ranks_of"]
