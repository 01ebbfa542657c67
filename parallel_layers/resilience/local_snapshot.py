"""An asynchronous universal save's two halves: :func:`snapshot_local_universal` (the training thread:
host copies of this rank's own pieces and the small things ``meta.json`` records, no collective) and
:func:`assemble_universal` (the writer thread: the save id and every rank's random streams agreed, the
dense tensors assembled, all on the writer's own groups), which returns the same
:class:`~parallel_layers.composition.universal_checkpoint.UniversalSnapshot` the synchronous
:func:`~parallel_layers.composition.universal_checkpoint.snapshot_universal` does, so
:func:`~parallel_layers.composition.universal_checkpoint.write_universal` writes the same files.
"""
from __future__ import annotations

import dataclasses
import secrets
from typing import Callable, Optional

from ..composition.universal_checkpoint import (
    UniversalSnapshot,
    attempt,
    check_iteration,
    gathered,
    is_stage_writer,
    raise_failures,
    run_description,
)
from . import resume_state
from .local_shards import LocalShards, assemble, snapshot_local
from .writer_groups import WriterGroups


@dataclasses.dataclass
class LocalUniversalSnapshot:
    """This rank's part of a universal checkpoint in host memory, before anything is gathered:
    ``shards`` (:class:`~.local_shards.LocalShards`), the iteration, this rank's pipeline stage and whether
    it writes the stage's file, ``meta.json``'s description of the run, and the resume state's parts
    (the layout, this rank's serialised random streams, the caller's data position)."""
    shards: LocalShards
    iteration: int
    stage: int
    pp: int
    writer: bool
    described: dict
    layout: dict
    rank_state: str
    data: Optional[dict]

    @property
    def nbytes(self) -> int:
        return self.shards.nbytes


def snapshot_local_universal(model, iteration: int, data: Optional[dict] = None) -> LocalUniversalSnapshot:
    """This rank's part of a universal checkpoint of ``model`` (a ``Parallel3D``) at ``iteration``, copied
    to host memory with no collective; training may change the model once it returns."""
    check_iteration(iteration, "AsyncCheckpointer.save")
    m = model.mesh
    return LocalUniversalSnapshot(snapshot_local(model), iteration, m.pp_rank, m.pp, is_stage_writer(m),
                                  run_description(model), resume_state.layout_of(model),
                                  resume_state.rank_state(model), data)


def _agreed(fn: Callable[[], object], what: str, directory: str, group) -> object:
    """``fn()`` here; every rank of ``group`` raises if it failed on any (before the next collective)."""
    res = attempt(fn)
    raise_failures(gathered(None if "ok" in res else res, group), what, directory)
    return res["ok"]


def assemble_universal(snap: LocalUniversalSnapshot, groups: WriterGroups, directory: str) -> UniversalSnapshot:
    """The :class:`UniversalSnapshot` of ``snap``: one save id (global rank 0's), every rank's random streams
    (``meta["resume"]``, on rank 0), the dense tensors on the stage writers. A collective over ``groups``
    only (every rank calls it); a part that fails on any rank raises
    :class:`~parallel_layers.composition.universal_checkpoint.CheckpointError` on every rank (``directory``
    names the save in it)."""
    world = groups.world
    save_id = gathered(secrets.token_hex(6), world)[0]
    resume = resume_state.combine(snap.layout, snap.rank_state, snap.data, world)
    states = assemble(snap.shards, groups, lambda fn, what: _agreed(fn, what, directory, world))
    return UniversalSnapshot(states if snap.writer else {}, snap.shards.step, snap.iteration, save_id, snap.stage,
                             snap.pp, snap.writer, snap.described, resume)


__all__ = ["LocalUniversalSnapshot", "snapshot_local_universal", "assemble_universal"]
