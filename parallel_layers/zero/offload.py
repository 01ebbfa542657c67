"""ZeRO-Infinity on the CPU: each rank's optimizer shard (fp32 master weights + AdamW moments) lives in a
file and is streamed through a few fixed host buffers while the fused AdamW kernel steps it.

Options of ``ZeroOptimizer`` (stages 1 and 2) and ``ZeroStage3Optimizer`` (and so of ``Parallel3D``'s
``optimizer_options`` and ``demo --offload disk --offload-dir DIR``):

* ``offload="disk", offload_dir=DIR``: the shard lives in ``DIR/zero-<stage>-rank<g>-dp<r>of<n>.optstate``
  (one file per rank, created by the optimizer, removed when it is garbage collected; two live optimizers
  never share one: the file is locked). What goes to the file: the fp32 master and both moments, except
  where the master *is* the model's parameter shard (ZeRO-3 with fp32 parameters): then the moments only.
* ``offload_buffer_mb`` (default 64): host memory the streamed state may occupy at once, all buffers
  together. It sets the sub-group size ``B``: three buffers of ``B`` elements of each state in the file,
  plus one of ``B`` for per-element weight decay.
* ``offload_io``: ``"direct"`` (``O_DIRECT``: no page cache), ``"buffered"`` (the page cache), or
  ``"auto"`` (the default: direct where the filesystem allows it, buffered elsewhere, e.g. tmpfs).
  Measured on this machine's (virtual, shared) disk with ``python -m benchmarks.zero_offload --quick``
  (benchmarks/results/zero_offload.csv; 2 ranks, 59 MiB of state each): an optimizer step took 130 ms
  with ``O_DIRECT`` and 137 ms buffered once the state's writes reach the disk in the step and the next
  step reads cold (both about the disk's sequential bandwidth; earlier runs 133/144 ms), against 24 ms
  in memory. Buffered I/O was faster (40 ms) only while the whole file sat in the page cache, i.e. while
  the state fits in RAM after all; it also fills the page cache with state read once per step, which a
  memory budget (a cgroup) is charged for. Hence direct by default, ``"buffered"`` for a state that fits
  the page cache. Reads use ``os.preadv`` straight into page-aligned buffers (``O_DIRECT`` needs that;
  ``os.pread`` returns a new bytes object per request, which cold reads showed no consistent gain for).
* ``offload="cpu"`` (ZeRO-Offload: a CUDA model's state in pinned host memory, stepped by the CPU kernel
  while the gradients and parameters cross on side streams; ``offload_delayed_update=True`` overlaps that
  step with the next forward and backward and changes results) is :mod:`.host_offload`. On a CPU model it
  raises: the state already is in host memory, there is nothing to move. ``offload="disk"`` needs a CPU
  model (the step runs the CPU kernel on the buffers).

The largest model (``python -m benchmarks.zero_offload --largest``): ZeRO-3 keeps the bf16 parameter
shard and, with ``ZeroStage3(grad_dtype=torch.bfloat16)``, a bf16 gradient shard, so a rank holds about
4 bytes per parameter (measured peak RSS: 5.85 B/param at 0.49B parameters, 4.95 at 1.02B; the rest is
torch and one block's gathered parameters and gradients) and the disk 12: a 24 GiB machine fits about
4-5B parameters where in-memory ZeRO (16 B/param) fits about 1.2B. The kernel reads the bf16 gradients
as they are (no fp32 copy of the shard or of a sub-group).

The step walks the sub-groups that hold a parameter with a gradient (frozen stretches are neither read
nor written). Three buffers rotate: while the kernel steps sub-group ``i`` in one, a reader thread fills
the next with sub-group ``i + 1`` and a writer thread writes sub-group ``i - 1`` back from the third
(the kernel's binding and ``os.preadv``/``os.pwrite`` release the GIL, so the I/O threads' Python runs
while a sub-group is stepped). Results are bit-identical to the in-memory optimizer: AdamW is
elementwise, the kernel is built with ``-ffp-contract=off`` (a sub-range computes each element exactly as
the whole range does), and every call gets the same arguments. A ``found_inf`` step is checked on the
host first (free on a CPU) and reads and writes nothing.

Failures. The file is checked before every step (:meth:`StateFile.verify`). A read or write that fails
mid-step raises :class:`OffloadIOError` naming the file, the sub-group and the OS error; the file is
then flagged half-written and this optimizer refuses to step or save: rebuild it and load the last
checkpoint, which the failure did not touch (``state_dict()`` copies the state to a file of its own).
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .host_offload import HostOffload
from .state_file import ALIGN_NUMEL, IO_MODES, OffloadStateError, StateFile, aligned_buffer, layout_digest

SLOTS = 3                       # read i+1 | step i | write i-1
DEFAULT_BUFFER_MB = 64.0


class OffloadIOError(RuntimeError):
    """A read or write of the offloaded optimizer state failed during a step or a load."""


@dataclass(frozen=True)
class DiskOffload:
    """Where and how one optimizer's shard is offloaded (see the module docstring)."""
    directory: str
    buffer_bytes: int
    io: str


def resolve_offload(owner: str, offload: Optional[str], offload_dir: Optional[str], device: torch.device,
                    buffer_mb: float = DEFAULT_BUFFER_MB, io: str = "auto", delayed_update: bool = False
                    ) -> Union[None, DiskOffload, HostOffload]:
    """The optimizer's ``offload=`` options checked: None (state in memory), a :class:`DiskOffload`, or a
    :class:`~.host_offload.HostOffload` (``offload="cpu"`` on a CUDA model)."""
    if delayed_update and offload != "cpu":
        raise ValueError(f"{owner}: offload_delayed_update=True overlaps the host's optimizer step with the "
                         f"device's next step; it needs offload='cpu' (a CUDA model), got offload={offload!r}")
    if offload is None:
        if offload_dir is not None:
            raise ValueError(f"{owner}: offload_dir={offload_dir!r} was given without offload='disk'; pass "
                             f"offload='disk' to keep the optimizer state there, or drop offload_dir")
        return None
    if offload == "cpu":
        if device.type == "cpu":
            raise ValueError(f"{owner}: offload='cpu' moves the optimizer state from an accelerator to host "
                             f"memory, but this model is on the CPU: its state already is in host memory and "
                             f"there is nothing to move. Drop offload= (same result), or pass offload='disk', "
                             f"offload_dir=DIR to keep the state in files")
        if device.type != "cuda":
            raise ValueError(f"{owner}: offload='cpu' for a model on {device} is not implemented; it needs a CUDA "
                             f"model (copy streams, pinned memory)")
        if offload_dir is not None:
            raise ValueError(f"{owner}: offload_dir={offload_dir!r} is for offload='disk'; offload='cpu' keeps the "
                             f"state in host memory: drop offload_dir")
        return HostOffload(delayed_update=bool(delayed_update))
    if offload != "disk":
        raise ValueError(f"{owner}: offload={offload!r}; choose None (in memory), 'disk' (files under "
                         f"offload_dir) or 'cpu'")
    if device.type != "cpu":
        raise ValueError(f"{owner}: offload='disk' steps the state with the CPU AdamW kernel; this model is on "
                         f"{device}, which is not supported: keep the model on the CPU or drop offload=")
    if not offload_dir:
        raise ValueError(f"{owner}: offload='disk' needs offload_dir=DIR, a directory on the disk that will hold "
                         f"one file per rank (12 bytes per shard element)")
    if io not in IO_MODES + ("auto",):
        raise ValueError(f"{owner}: offload_io={io!r}; choose 'auto', 'direct' (O_DIRECT) or 'buffered'")
    try:
        buffer_bytes = int(float(buffer_mb) * 2**20)
    except (TypeError, ValueError):
        buffer_bytes = -1
    if buffer_bytes <= 0:
        raise ValueError(f"{owner}: offload_buffer_mb={buffer_mb!r} must be a positive number of MiB")
    os.makedirs(offload_dir, exist_ok=True)
    if not os.access(offload_dir, os.W_OK):
        raise ValueError(f"{owner}: offload_dir={offload_dir!r} is not writable by this process")
    return DiskOffload(os.path.abspath(offload_dir), buffer_bytes, io)


def subgroup_numel(owner: str, buffer_bytes: int, n_states: int, numel: int) -> int:
    """Elements per sub-group: ``SLOTS`` buffers of each streamed state plus one weight-decay buffer fit in
    ``buffer_bytes``; a multiple of 1024 (``O_DIRECT`` alignment), no more than the shard needs."""
    per_element = 4 * (SLOTS * n_states + 1)
    b = buffer_bytes // per_element // ALIGN_NUMEL * ALIGN_NUMEL
    if b < ALIGN_NUMEL:
        raise ValueError(f"{owner}: offload_buffer_mb={buffer_bytes / 2**20:g} is too small: one sub-group of "
                         f"{ALIGN_NUMEL} elements needs {per_element * ALIGN_NUMEL / 2**20:.3f} MiB "
                         f"({SLOTS} buffers x {n_states} states + 1 fp32); give at least that")
    return min(b, -(-max(numel, 1) // ALIGN_NUMEL) * ALIGN_NUMEL)


class StreamedShard:
    """A :class:`StateFile` and the host buffers its sub-groups are streamed through; see the module
    docstring. ``stream(groups, fn)`` runs one step; the rest serve checkpoints and re-layouts."""

    def __init__(self, file: StateFile, subgroup: int):
        self.file = file
        self.subgroup = subgroup
        self.states = file.states
        self.numel = file.numel
        k = len(self.states)
        self._slots = [aligned_buffer(k * subgroup * 4) for _ in range(SLOTS)]
        self._flat = [torch.frombuffer(s, dtype=torch.float32, count=k * subgroup) for s in self._slots]
        self._mv = [memoryview(s) for s in self._slots]
        self._scratch: Optional[torch.Tensor] = None
        self._views: Optional[Dict[str, torch.Tensor]] = None
        self.failed: Optional[str] = None
        self.stats = {"read_bytes": 0, "write_bytes": 0, "read_s": 0.0, "write_s": 0.0, "steps": 0}
        self._lock = threading.Lock()
        self._pools: List[ThreadPoolExecutor] = []
        self._finalizer = weakref.finalize(self, _shut, self._pools, file)

    # ------------------------------------------------------------------ sizes
    @property
    def buffer_bytes(self) -> int:
        """Host memory of the buffers (allocated now, or on first use for the weight-decay one)."""
        return sum(len(s) for s in self._slots) + self.subgroup * 4

    def groups(self, spans: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
        """The sub-groups ``[lo, hi)`` that intersect any of ``spans`` (``(start, end)`` in shard order)."""
        b, out, last = self.subgroup, [], -1
        for s, e in spans:
            for g in range(max(s // b, last + 1), (e - 1) // b + 1):
                out.append((g * b, min((g + 1) * b, self.numel)))
                last = g
        return out

    def scratch(self) -> torch.Tensor:
        """A sub-group sized fp32 buffer for the caller (per-element weight decay)."""
        if self._scratch is None:
            self._scratch = torch.empty(self.subgroup, dtype=torch.float32)
        return self._scratch

    # ------------------------------------------------------------------ the step
    def _chunk(self, slot: int, n: int) -> Dict[str, torch.Tensor]:
        b, flat = self.subgroup, self._flat[slot]
        return {name: flat[k * b:k * b + n] for k, name in enumerate(self.states)}

    def _io(self, kind: str, slot: int, lo: int, hi: int) -> None:
        b, mv, t0 = self.subgroup * 4, self._mv[slot], time.perf_counter()
        for k, name in enumerate(self.states):
            region = mv[k * b:(k + 1) * b]
            if kind == "read":
                self.file.read(name, lo, hi, region)
            else:
                self.file.write(name, lo, hi, region)
        with self._lock:
            self.stats[f"{kind}_bytes"] += (hi - lo) * 4 * len(self.states)
            self.stats[f"{kind}_s"] += time.perf_counter() - t0

    def _pool(self, i: int) -> ThreadPoolExecutor:
        while len(self._pools) < 2:
            self._pools.append(ThreadPoolExecutor(1, thread_name_prefix=f"zero-offload-{'rw'[len(self._pools)]}"))
        return self._pools[i]

    def stream(self, groups: Sequence[Tuple[int, int]], fn: Callable[[int, int, Dict[str, torch.Tensor]], None],
               owner: str) -> None:
        """For every sub-group ``(lo, hi)`` of ``groups``: read it, ``fn(lo, hi, chunks)`` (``chunks``: state
        name -> its ``hi - lo`` elements, in a host buffer, updated in place), write it back."""
        if not groups:
            return
        self.drop_views()
        reader, writer = self._pool(0), self._pool(1)
        reads: Dict[int, object] = {}
        writes: List[Optional[object]] = [None] * SLOTS
        started_writing, where = False, "reading"
        try:
            reads[0] = reader.submit(self._io, "read", 0, *groups[0])
            for i, (lo, hi) in enumerate(groups):
                slot = i % SLOTS
                where = f"reading sub-group {i}"
                reads.pop(i).result()
                if i + 1 < len(groups):
                    nxt = (i + 1) % SLOTS
                    if writes[nxt] is not None:       # the buffer's previous sub-group must be on disk first
                        where = f"writing sub-group {i + 1 - SLOTS}"
                        writes[nxt].result()
                        writes[nxt] = None
                    reads[i + 1] = reader.submit(self._io, "read", nxt, *groups[i + 1])
                where = f"stepping sub-group {i}"
                fn(lo, hi, self._chunk(slot, hi - lo))
                if not started_writing:
                    where = "flagging the file as being written"
                    self.file.begin_write()
                    started_writing = True
                writes[slot] = writer.submit(self._io, "write", slot, lo, hi)
            for _j, w in enumerate(writes):
                if w is not None:
                    where = "writing the last sub-groups"
                    w.result()
            where = "clearing the file's writing flag"
            self.file.end_write(step_done=True)
            self.stats["steps"] += 1
        except BaseException as exc:
            for f in list(reads.values()) + [w for w in writes if w is not None]:
                f.cancel()
                try:
                    f.result()
                except BaseException:       # the first failure is the one reported
                    pass
            self._fail(owner, where, len(groups), started_writing, exc)

    def _fail(self, owner: str, where: str, n_groups: int, started_writing: bool, exc: BaseException):
        state = ("the file now mixes this step's sub-groups with the previous step's and is flagged so"
                 if started_writing else "nothing was written yet, but this step's gradients are consumed")
        self.failed = (f"{owner}: the offloaded optimizer state ({self.file.path}) failed while {where} of "
                       f"{n_groups} ({type(exc).__name__}: {exc}); {state}. This optimizer refuses to step or "
                       f"save from now on: rebuild it and load the last checkpoint (a state_dict() taken before "
                       f"is a separate copy the failure did not touch)")
        raise OffloadIOError(self.failed) from exc

    # ------------------------------------------------------------------ checks, loads, views
    def verify(self, owner: str) -> None:
        """Raise if a step failed mid-way or the file is no longer this optimizer's, whole and current."""
        if self.failed is not None:
            raise OffloadStateError(self.failed)
        self.file.verify(owner)

    def load(self, sources: Dict[str, torch.Tensor], owner: str) -> None:
        """Write whole states (``name -> numel`` fp32 values, in memory or mapped) into the file, a sub-group
        at a time through one buffer."""
        self.verify(owner)
        self.drop_views()
        chunk, mv, b = self._flat[0], self._mv[0], self.subgroup
        self.file.begin_write()
        try:
            for name, src in sources.items():
                src = src.reshape(-1)
                for lo in range(0, self.numel, b):
                    hi = min(lo + b, self.numel)
                    chunk[:hi - lo].copy_(src[lo:hi])
                    self.file.write(name, lo, hi, mv)
        except BaseException as exc:
            self._fail(owner, "loading a state", -(-self.numel // b), True, exc)
        self.file.end_write(step_done=False)

    def views(self) -> Dict[str, torch.Tensor]:
        """The states mapped from the file (``StateFile.views``), cached until the next step or load."""
        if self._views is None:
            self._views = self.file.views()
        return self._views

    def drop_views(self) -> None:
        self._views = None

    def snapshot(self, owner: str) -> Dict[str, torch.Tensor]:
        """The states now, as tensors mapped from a private copy of the file (see ``StateFile.snapshot``)."""
        self.verify(owner)
        return self.file.snapshot(self.file.path + ".snapshot")

    def replace(self, old: "StreamedShard") -> None:
        """This shard's file takes ``old``'s path (after a re-layout moved the state over); ``old`` closes."""
        self.file.replace(old.file)
        old.close()

    def close(self) -> None:
        """Stop the I/O threads and remove the file (a live optimizer's scratch space, not a checkpoint)."""
        self._finalizer()


def _shut(pools: List[ThreadPoolExecutor], file: StateFile) -> None:
    for p in pools:
        p.shutdown(wait=True)
    file.close(unlink=True)


def open_streamed_shard(config: DiskOffload, *, owner: str, tag: str, group, layout: object, numel: int,
                        states: Sequence[str], init: Dict[str, Callable], suffix: str = "") -> StreamedShard:
    """Create this rank's state file under ``config.directory`` and its stream. ``tag`` names the stage in
    the file name; ``layout`` (any repr-able structure) is fingerprinted into the header; ``init[name](lo,
    hi, out)`` gives a state's initial values (the others start at zero)."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    dp_rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
    dp_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    path = os.path.join(config.directory, f"zero-{tag}-rank{rank}-dp{dp_rank}of{dp_size}.optstate{suffix}")
    b = subgroup_numel(owner, config.buffer_bytes, len(states), numel)
    identity = dict(owner=owner, rank=rank, dp_rank=dp_rank, dp_size=dp_size, layout=layout_digest(layout),
                    numel=int(numel), states=list(states))
    try:
        file = StateFile.create(path, identity=identity, io=config.io, chunk_numel=b, init=init)
    except OSError as exc:
        raise OffloadIOError(f"{owner}: could not create the offloaded optimizer state file {path} "
                             f"({exc.strerror or exc}); nothing was stepped. Free space on that disk or choose "
                             f"another offload_dir") from exc
    return StreamedShard(file, b)


__all__ = ["DiskOffload", "StreamedShard", "OffloadIOError", "OffloadStateError", "resolve_offload",
           "open_streamed_shard", "subgroup_numel", "DEFAULT_BUFFER_MB"]
