"""What a resumed run needs besides the model and optimizer: every rank's random streams, the layout they
belong to, the skipped-step count and the caller's position in its data.

A universal checkpoint holds the dense model, which any layout loads; the random streams are per rank
and per layout (another mesh draws other dropout masks anyway). So they are kept with the layout they
were drawn on, and restored only on the same one: the case a torchrun restart is (same ranks, same mesh),
where a resumed run must continue bit for bit. The data position is the caller's (a JSON-able dict, e.g.
``{"iteration": 40}`` or a sampler's state); it is global (never per dp rank), so any dp size continues
the same sample order. Everything here lands in ``meta.json`` (checksummed with it) as
``meta["resume"]``. The streams are read back with ``torch.load(weights_only=True)``: a ``meta.json`` whose
streams would build other objects or call anything (code, in a checkpoint from someone else) is refused
on every rank, not run.
"""
from __future__ import annotations

import base64
import io
from typing import Optional

import torch
import torch.distributed as dist

from ..composition.universal_checkpoint import CheckpointError
from .per_rank import load_data


def layout_of(model) -> dict:
    """The layout a rank's random streams belong to: mesh sizes, schedule chunks and the world size."""
    m = model.mesh
    return {**m.sizes, "chunks per rank": model.engine.num_chunks, "world": dist.get_world_size()}


def _encode(obj) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(text, rank: int):
    what = f"meta.json's resume state of rank {rank} (its random streams)"
    if not isinstance(text, str):
        raise CheckpointError(f"{what} is a {type(text).__name__}, not the base64 text the package writes")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise CheckpointError(f"{what} is not valid base64 ({exc})") from exc
    return load_data(io.BytesIO(data), what)


def rank_state(model) -> str:
    """This rank's random streams and skipped-step count, serialised (a copy; no collective)."""
    return _encode({"random": model.random_state(), "skipped_steps": model.skipped_steps})


def combine(layout: dict, mine: str, data: Optional[dict], group=None) -> Optional[dict]:
    """``meta["resume"]`` from every rank's :func:`rank_state` (``mine``: this rank's): a collective over
    ``group`` (default the world; it must hold every rank, in global rank order); the dict on global
    rank 0, None elsewhere."""
    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    if dist.get_rank() != 0:
        return None
    return {"layout": layout, "ranks": every, "data": data}


def capture(model, data: Optional[dict]) -> Optional[dict]:
    """``meta["resume"]`` for the current state of ``model`` (a ``Parallel3D``): a collective over the
    world (every rank's streams are gathered); the dict on global rank 0, None elsewhere."""
    return combine(layout_of(model), rank_state(model), data)


def restore(model, resume: Optional[dict]) -> bool:
    """Restore this rank's random streams and skipped-step count from ``meta["resume"]`` when it was saved
    on the same layout; returns whether it did (no collective: every rank decides alike from the same
    meta). Every rank reads every rank's entry (a few kB each), so an entry that is refused
    (:func:`~parallel_layers.resilience.per_rank.load_data`) raises :class:`CheckpointError` on all of
    them together, before any stream is set."""
    if not resume or resume.get("layout") != layout_of(model):
        return False
    ranks, world = resume.get("ranks"), dist.get_world_size()
    if not isinstance(ranks, list) or len(ranks) != world:
        raise CheckpointError(f"meta.json's resume state holds {len(ranks) if isinstance(ranks, list) else 'no'} "
                              f"rank entries for a layout of {world} ranks")
    state = None
    for r, text in enumerate(ranks):
        entry = _decode(text, r)
        if not isinstance(entry, dict) or not {"random", "skipped_steps"} <= entry.keys():
            raise CheckpointError(f"meta.json's resume state of rank {r} is not the random streams and skipped-step "
                                  f"count the package writes")
        if r == dist.get_rank():
            state = entry
    model.load_random_state(state["random"])
    model.skipped_steps = state["skipped_steps"]
    return True


__all__ = ["capture", "rank_state", "combine", "restore", "layout_of"]
