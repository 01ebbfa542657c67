"""Automatic resume: find the newest complete checkpoint in a run's directory and load it.

Global rank 0 lists the directory and every rank follows its choice (the ranks must load the same
checkpoint). A checkpoint whose files fail their checks when loaded (a flipped bit, a truncated file) is
reported and skipped for the one before it; the load is a collective that fails on every rank
together, before the model is touched, so the next candidate starts from a clean model.

Universal checkpoints load on any mesh; on the layout they were saved from, every rank's random streams
and skipped-step count come back too (:mod:`.resume_state`), so the resumed run continues bit for bit.
Per-rank checkpoints load on the same mesh only.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch.distributed as dist

from ..composition.universal_checkpoint import META, CheckpointError, load_universal
from . import resume_state
from .per_rank import FORMAT as PER_RANK_FORMAT
from .per_rank import load_per_rank
from .run_dir import complete_checkpoints


def _format_of(path: str) -> str:
    with open(os.path.join(path, META)) as f:
        return json.load(f).get("format", "")


def load_checkpoint(model, path: str) -> dict:
    """Load the checkpoint at ``path`` (either format) into ``model`` (a collective); returns
    ``{"iteration", "data", "path", "restored_random_state"}``."""
    if _format_of(path) == PER_RANK_FORMAT:
        meta = load_per_rank(model, path)
        restored = True                       # the per-rank state holds the random streams
    else:
        meta = load_universal(model, path)
        restored = resume_state.restore(model, meta.get("resume"))
    data = (meta.get("resume") or {}).get("data")
    return {"iteration": meta["iteration"], "data": data, "path": path, "restored_random_state": restored}


def resume(model, root: str) -> Optional[dict]:
    """Load the newest complete checkpoint under ``root`` (``root/iter_NNNNNNN``) into ``model`` (a
    ``Parallel3D``; a collective over the world). Returns what :func:`load_checkpoint` returns, or None
    when ``root`` holds no complete checkpoint (a fresh run)."""
    candidates = [None] * 1
    if dist.get_rank() == 0:
        candidates[0] = [path for _, path in complete_checkpoints(root)]
    dist.broadcast_object_list(candidates, src=0)
    for path in candidates[0]:
        try:
            return load_checkpoint(model, path)
        except CheckpointError as exc:        # raised on every rank together
            if dist.get_rank() == 0:
                warnings.warn(f"resume: skipping {path}: {exc}", RuntimeWarning, stacklevel=2)
    return None


__all__ = ["resume", "load_checkpoint"]
