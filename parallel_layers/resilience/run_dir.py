"""A run's checkpoint directory, ``ROOT/iter_NNNNNNN`` (Megatron-LM's layout): which of its checkpoints are
complete, which is the newest, and pruning to the last K.

A checkpoint is complete when its ``meta.json`` is there and intact (it is written last, in one rename,
once every file it lists is on disk); a directory without one is a save that was killed or failed, and is
never offered for loading. The files a ``meta.json`` lists are checked (crc32) when they are loaded: a
checkpoint that fails there is skipped by :func:`parallel_layers.resilience.resume` for the one before.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Tuple

from ..composition.universal_checkpoint import META, meta_checksum

_ITER_DIR = re.compile(r"iter_(\d{7,})")


def _intact(directory: str) -> bool:
    try:
        with open(os.path.join(directory, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(meta, dict) and meta.get("checksum") == meta_checksum(meta)


def iteration_dirs(root: str) -> List[Tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_NNNNNNN`` directory under ``root``, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name)) for name in os.listdir(root)
             if (m := _ITER_DIR.fullmatch(name)) and os.path.isdir(os.path.join(root, name))]
    return sorted(found, reverse=True)


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """``(iteration, path)`` of the complete checkpoints under ``root`` (an intact ``meta.json``), newest
    first."""
    return [(it, path) for it, path in iteration_dirs(root) if _intact(path)]


def prune(root: str, keep: int) -> List[str]:
    """Keep the ``keep`` newest complete checkpoints under ``root`` (0: all); remove the older ones and any
    incomplete directory older than the newest complete one (a killed or failed save's leftovers). A
    directory newer than every complete one is left alone: it may be a save in progress. Returns what
    was removed. Call it from one process only (global rank 0's writer)."""
    complete = complete_checkpoints(root)
    if not complete:
        return []
    newest = complete[0][0]
    kept = {path for _, path in (complete[:keep] if keep else complete)}
    gone = [path for it, path in iteration_dirs(root) if it <= newest and path not in kept]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


__all__ = ["iteration_dirs", "complete_checkpoints", "prune"]
