"""Per-rank checkpoints of a ``Parallel3D``: every rank's own :meth:`Parallel3D.state_dict` in a file of
its own, as Megatron-LM and DeepSpeed save them; it loads back only on the same mesh (to change the
layout, use the universal format), and it is the cheaper save: nothing is gathered over dp or tp.

The same crash safety as the universal format (:mod:`parallel_layers.composition.universal_checkpoint`): each rank
serialises its state, takes the crc32 of the bytes and writes them under a fresh name (temporary name,
fsync, rename); global rank 0 writes ``meta.json`` (the files, their crc32, the data position and its
own checksum) last, in one rename, once every rank's file is on disk. Loading checks the meta, every
rank its file's crc32, and the ranks agree that all is sound before any state is touched. A file is read
with ``torch.load(weights_only=True)`` (:func:`load_data`): tensors and plain containers, which is all the
package writes; a pickle that would build any other object or call anything (code, in a checkpoint from
someone else) is refused, not run.

Like the universal format, a save is a snapshot (:func:`snapshot_per_rank`: the state copied to host
memory, no collective) and a write (:func:`write_per_rank`: the save id agreed, then the files; collectives
over a group of the caller's choice only).
"""
from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import secrets
import zlib
from typing import BinaryIO, Optional, Union

import torch
import torch.distributed as dist

from ..composition.universal_checkpoint import (
    LATEST,
    META,
    CheckpointError,
    attempt,
    fsync_dir,
    gathered,
    meta_checksum,
    raise_failures,
    write_atomically,
    write_text,
)

FORMAT = "parallel_layers.per_rank/1"
_RANK_FILE = re.compile(r"rank\d+-of-\d+\.[0-9a-f]+\.pt(\.tmp)?")


@dataclasses.dataclass
class PerRankSnapshot:
    """This rank's state (CPU copies) and what ``meta.json`` records of it (``save_id``: agreed by
    :func:`write_per_rank`)."""
    state: dict
    rank: int
    world: int
    save_id: str
    iteration: int
    step: int
    data: Optional[dict]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.state)


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _to_host(obj):
    """A deep copy of ``obj`` with every tensor copied to the CPU (the model may change once it returns)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_host(v) for v in obj)
    return obj


def load_data(source: Union[str, BinaryIO], what: str, trusted_hint: str = ""):
    """``torch.load(source, weights_only=True)``: tensors, numbers, strings, dtypes and plain containers
    only (all a checkpoint of the package holds). A pickle that references anything else (a function to
    call, a class to build: code, if the checkpoint comes from someone else) is refused before it runs: a
    :class:`CheckpointError` naming ``what`` and the global it asked for; ``trusted_hint`` tells a user
    who trusts the file how to read it anyway."""
    try:
        return torch.load(source, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        asked = found.group(1) if found else str(exc).strip().splitlines()[-1][:300]
        raise CheckpointError(f"{what} was refused: its pickle references {asked}, which a checkpoint may not "
                              f"hold (loaded with weights_only=True: tensors and plain containers only; "
                              f"unpickling it could run code). parallel_layers never writes such objects: the "
                              f"checkpoint was altered or written by something else{trusted_hint}") from exc
    except Exception as exc:  # noqa: BLE001 - torch raises several types for a damaged file
        raise CheckpointError(f"{what} cannot be read ({type(exc).__name__}: {exc}): truncated or "
                              f"corrupted") from exc


def rank_file(rank: int, world: int, save_id: str) -> str:
    return f"rank{rank}-of-{world}.{save_id}.pt"


def snapshot_per_rank(model, iteration: int, data: Optional[dict] = None) -> PerRankSnapshot:
    """This rank's ``model.state_dict()`` copied to host memory (no collective of its own: the save id is
    agreed when it is written)."""
    step = int(getattr(model.optimizer, "steps_taken", 0) or 0)
    return PerRankSnapshot(_to_host(model.state_dict()), dist.get_rank(), dist.get_world_size(), "",
                           iteration, step, data)


def _write_rank(directory: str, snap: PerRankSnapshot) -> dict:
    buf = io.BytesIO()
    torch.save({"format": FORMAT, "save": snap.save_id, "rank": snap.rank, "state": snap.state}, buf)
    data = buf.getbuffer()
    name = rank_file(snap.rank, snap.world, snap.save_id)
    os.makedirs(directory, exist_ok=True)

    def write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(data)
    write_atomically(os.path.join(directory, name), write)
    return {"file": name, "crc32": zlib.crc32(data), "bytes": len(data)}


def write_per_rank(snap: PerRankSnapshot, directory: str, group=None, latest_root: Optional[str] = None) -> None:
    """The ranks agree a save id (global rank 0's), every rank writes its file, then global rank 0
    ``meta.json`` (a collective over ``group``, default the world) and, with ``latest_root``, points its
    ``latest_checkpointed_iteration.txt`` at it. Every rank raises :class:`CheckpointError` if any rank
    failed; nothing is published then."""
    snap = dataclasses.replace(snap, save_id=gathered(secrets.token_hex(6), group)[0])
    written = gathered(attempt(lambda: _write_rank(directory, snap)), group)
    raise_failures(written, "writing the rank files", directory)
    committed = None
    if dist.get_rank() == 0:
        files = [w["ok"] for w in written]
        meta = {"format": FORMAT, "save": snap.save_id, "iteration": snap.iteration, "step": snap.step,
                "world": snap.world, "files": files, "resume": {"data": snap.data}}
        meta["checksum"] = meta_checksum(meta)
        committed = attempt(lambda: _publish(directory, meta, latest_root))
    raise_failures(gathered(committed, group), "writing meta.json", directory)


def _publish(directory: str, meta: dict, latest_root: Optional[str]) -> None:
    write_atomically(os.path.join(directory, META), write_text(json.dumps(meta, indent=1)))
    keep = {f["file"] for f in meta["files"]}
    for name in os.listdir(directory):             # the files of an earlier or killed save into this directory
        if (_RANK_FILE.fullmatch(name) and name not in keep) or name == META + ".tmp":
            os.remove(os.path.join(directory, name))
    fsync_dir(directory)
    if latest_root is not None:
        write_atomically(os.path.join(latest_root, LATEST), write_text(f"{meta['iteration']}\n"))


def read_per_rank_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("checksum") != meta_checksum(meta):
        raise CheckpointError(f"per-rank checkpoint: {path} is not an intact {FORMAT!r} meta.json")
    return meta


def _read_own(directory: str, meta: dict) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    if meta["world"] != world:
        raise CheckpointError(f"per-rank checkpoint {directory!r} was saved by {meta['world']} ranks, this run has "
                              f"{world}: a per-rank checkpoint loads only on the same mesh; save the universal "
                              f"format (AsyncCheckpointer(format='universal')) to change the layout")
    entry = meta["files"][rank]
    path = os.path.join(directory, entry["file"])
    if not os.path.exists(path):
        raise CheckpointError(f"per-rank checkpoint: {path} is missing ({META} lists it)")
    with open(path, "rb") as f:
        data = f.read()
    if zlib.crc32(data) != entry["crc32"]:
        raise CheckpointError(f"per-rank checkpoint: {path} does not match its crc32 in {META}: corrupted or "
                              f"truncated; load an earlier checkpoint")
    saved = load_data(io.BytesIO(data), f"per-rank checkpoint: {path}",
                      f"; if you trust it, torch.load({path!r}, weights_only=False)['state'] is this rank's "
                      f"state for model.load_state_dict")
    if not isinstance(saved, dict) or saved.get("save") != meta["save"] or saved.get("rank") != rank:
        raise CheckpointError(f"per-rank checkpoint: {path} belongs to another save or rank than its {META}")
    return saved["state"]


def load_per_rank(model, directory: str) -> dict:
    """Load this rank's file into ``model`` (a collective over the world: every rank checks its file and
    they agree before any is loaded); returns ``meta.json``."""
    meta = read_per_rank_meta(directory)
    read = attempt(lambda: _read_own(directory, meta))
    raise_failures(gathered(None if "ok" in read else read), "loading", directory)
    model.load_state_dict(read["ok"])
    return meta


__all__ = ["FORMAT", "PerRankSnapshot", "snapshot_per_rank", "write_per_rank", "load_per_rank",
           "read_per_rank_meta", "rank_file", "load_data"]
