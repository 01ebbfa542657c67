"""Asynchronous checkpoints of a ``Parallel3D``: training waits only while the step's state is copied to
host memory; a background thread writes it while training continues.

``save(iteration, data)`` (every rank, at the same step):

1. waits for the previous save's write, if one is still in flight (at most one: the host copy of a
   large model is not small), and reports it if it failed;
2. snapshots this rank's own state (parameters, optimizer shards, loss scaler, random streams, step,
   skipped steps, the caller's data position) into host memory, with no collective: universal format,
   its ZeRO shards and TP partitions as they are, with where they belong
   (:func:`~parallel_layers.resilience.local_snapshot.snapshot_local_universal`); per-rank format, its
   ``state_dict`` (:func:`~parallel_layers.resilience.per_rank.snapshot_per_rank`); this is the only
   part that needs the model;
3. hands the snapshot to a thread that (universal format) assembles the dense tensors from every rank's
   pieces (:func:`~parallel_layers.resilience.local_snapshot.assemble_universal`: the same tensors, bit
   for bit, the synchronous :func:`~parallel_layers.composition.universal_checkpoint.snapshot_universal`
   gathers) and writes it (checksummed files, ``meta.json`` last in one rename,
   :func:`~parallel_layers.composition.universal_checkpoint.write_universal` /
   :func:`~parallel_layers.resilience.per_rank.write_per_rank`), points
   ``latest_checkpointed_iteration.txt`` at it and prunes the run directory to the last ``keep``.

The writer's collectives (agreeing the save id, gathering every rank's random streams, summing the ZeRO
shards over dp and gathering the TP partitions, agreeing that every file is on disk before ``meta.json``
publishes them) run on gloo groups of its own, created once here (:mod:`.writer_groups`: one over the
world, and a mirror of each model group the assembly needs), so they never interleave with training's
collectives on the model's groups (torch DCP's async save does the same). A write that fails on any rank fails on
every rank, publishes nothing (the previous checkpoint stays the newest) and is reported: a warning at
the next ``save``/``wait`` and an entry in ``failures`` (``raise_errors=True``: a
:class:`~parallel_layers.composition.universal_checkpoint.CheckpointError` instead). ``asynchronous=False`` runs
the same write in the caller's thread (the synchronous save, for comparison).
"""
from __future__ import annotations

import dataclasses
import datetime
import threading
import time
import warnings
from typing import List, Optional

import torch.distributed as dist

from ..composition.universal_checkpoint import CheckpointError, iteration_dir, snapshot_universal, write_universal
from .local_shards import groups_to_mirror
from .local_snapshot import LocalUniversalSnapshot, assemble_universal, snapshot_local_universal
from .per_rank import snapshot_per_rank, write_per_rank
from .resume_state import capture
from .run_dir import prune
from .writer_groups import WriterGroups

FORMATS = ("universal", "per_rank")


@dataclasses.dataclass
class SaveRecord:
    """One save: how long training waited (``stall_s``: for the previous write, then the snapshot, and in a
    synchronous save the write too), how long the write took (``write_s``; for the universal format it
    includes ``gather_s``, assembling the dense tensors from every rank's pieces), the bytes this rank
    snapshotted, and the error if it failed."""
    iteration: int
    path: str
    asynchronous: bool = True
    wait_s: float = 0.0
    snapshot_s: float = 0.0
    write_s: Optional[float] = None
    gather_s: Optional[float] = None
    nbytes: int = 0
    error: Optional[str] = None

    @property
    def stall_s(self) -> float:
        return self.wait_s + self.snapshot_s + (0.0 if self.asynchronous else (self.write_s or 0.0))


class AsyncCheckpointer:
    """Checkpoints of ``model`` (a ``Parallel3D``) under ``root/iter_NNNNNNN``. Construct it on every rank
    (a collective: it creates the writer's process groups). ``format``: ``"universal"`` (any mesh resumes
    it) or ``"per_rank"`` (the same mesh only; nothing gathered). ``keep``: the newest complete
    checkpoints kept (0: all). ``timeout_s``: the writer's collectives fail after it (a dead peer)."""

    def __init__(self, model, root: str, *, format: str = "universal", keep: int = 0, asynchronous: bool = True,
                 raise_errors: bool = False, timeout_s: float = 600.0):
        if format not in FORMATS:
            raise ValueError(f"AsyncCheckpointer: format={format!r}; choose one of {FORMATS}")
        if keep < 0:
            raise ValueError(f"AsyncCheckpointer: keep={keep} must be >= 0 (0 keeps every checkpoint)")
        self.model, self.root, self.format, self.keep = model, root, format, keep
        self.asynchronous, self.raise_errors = asynchronous, raise_errors
        needed = groups_to_mirror(model) if format == "universal" else []
        self.groups = WriterGroups(needed, datetime.timedelta(seconds=timeout_s))
        self.group = self.groups.world
        self.records: List[SaveRecord] = []
        self.failures: List[str] = []
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the caller's thread
    def save(self, iteration: int, data: Optional[dict] = None) -> SaveRecord:
        """Checkpoint the model's current state as ``iteration`` (every rank calls it at the same step);
        ``data``: the caller's position in its data (JSON-able; ``meta["resume"]["data"]`` on resume).
        Returns once the state is in host memory (asynchronous) or on disk."""
        rec = SaveRecord(iteration, iteration_dir(self.root, iteration), self.asynchronous)
        t0 = time.perf_counter()
        self.wait()
        t1 = time.perf_counter()
        if self.format == "universal" and _experts_split(self.model):
            # the experts are gathered over ep on the model's groups, in this thread (the assembly from local
            # pieces knows dp, cp and tp only); the writer thread then only writes
            snap = snapshot_universal(self.model, iteration, capture(self.model, data))
        elif self.format == "universal":
            snap = snapshot_local_universal(self.model, iteration, data)
        else:
            snap = snapshot_per_rank(self.model, iteration, data)
        rec.wait_s, rec.snapshot_s, rec.nbytes = t1 - t0, time.perf_counter() - t1, snap.nbytes
        self.records.append(rec)
        if self.asynchronous:
            self._thread = threading.Thread(target=self._write, args=(snap, rec), name="checkpoint-writer",
                                            daemon=True)
            self._thread.start()
        else:
            self._write(snap, rec)
            self._report(rec)
        return rec

    def wait(self) -> Optional[SaveRecord]:
        """Block until the write in flight (if any) is done; report it if it failed. Returns its record."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        rec = self.records[-1]
        self._report(rec)
        return rec

    close = wait

    def _report(self, rec: SaveRecord) -> None:
        if rec.error is None:
            return
        text = (f"AsyncCheckpointer: the checkpoint of iteration {rec.iteration} ({rec.path}) was not saved: "
                f"{rec.error}. Nothing of it was published; the newest complete checkpoint under {self.root!r} is "
                f"an earlier one. Training goes on")
        self.failures.append(text)
        if self.raise_errors:
            raise CheckpointError(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------------ the writer
    def _write(self, snap, rec: SaveRecord) -> None:
        t0 = time.perf_counter()
        try:
            if self.format == "universal":
                if isinstance(snap, LocalUniversalSnapshot):
                    t_gather = time.perf_counter()
                    snap = assemble_universal(snap, self.groups, rec.path)
                    rec.gather_s = time.perf_counter() - t_gather
                write_universal(snap, rec.path, self.group, latest_root=self.root)
            else:
                write_per_rank(snap, rec.path, self.group, latest_root=self.root)
            if dist.get_rank() == 0:
                prune(self.root, self.keep)
        except Exception as exc:  # noqa: BLE001 - reported in the caller's thread (wait / the next save)
            rec.error = f"{type(exc).__name__}: {exc}"
        finally:
            rec.write_s = time.perf_counter() - t0


def _experts_split(model) -> bool:
    """Whether ``model`` (a ``Parallel3D``) holds experts split over ep ranks."""
    return model.mesh.sizes.get("ep", 1) > 1


def bandwidth(rec: SaveRecord) -> Optional[float]:
    """Bytes per second this rank's snapshot was written at (None while in flight)."""
    return rec.nbytes / rec.write_s if rec.write_s else None


__all__ = ["AsyncCheckpointer", "SaveRecord", "FORMATS", "bandwidth"]

