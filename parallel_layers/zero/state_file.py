"""One rank's offloaded ZeRO optimizer state in one file: layout, identity checks, aligned reads and writes.

Layout (every offset and length a multiple of 4096 bytes, so ``O_DIRECT`` can read and write it)::

    [0, 4096)                              header: UTF-8 JSON, zero padded
    [4096 + k * stride, + numel * 4)       state k (fp32), k-th of ``states``; ``stride`` is ``numel``
                                           rounded up to 1024 elements, times 4 bytes

State-major: each state is one contiguous fp32 array, so a sub-group ``[lo, hi)`` of the shard is one read
(or write) per state, and the whole state maps as tensors (:meth:`StateFile.views`) for the paths that
are not the step (checkpoints, re-layout) without reading it into anonymous memory.

Identity. The header names what wrote the file (owner, global rank, dp rank and size), a random id of
this file's creation, a digest of the shard layout, the element count and state names, a generation
(steps written) and a ``writing`` flag, set before a step's first write and cleared after its last.
:meth:`StateFile.verify` compares all of it with what this process expects before a step reads anything:
a missing, truncated, foreign (another rank, another run, another layout), stale or half-written file is
refused with an error that says which, and which file.

Space. :meth:`StateFile.create` writes every byte of the file (the initial master weights, zero moments)
after checking the free space, so on a non-copy-on-write filesystem (ext4, xfs) every block is allocated
before the first step and a step's overwrites cannot run out of space; on btrfs or zfs they still can,
and a step that fails mid-write leaves the ``writing`` flag set, so the file is refused from then on.
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import uuid
from typing import Callable, Dict, Optional

import torch

FORMAT = "parallel_layers.zero.offload/1"
ALIGN = 4096                     # O_DIRECT: buffer address, file offset and length multiples of this
ALIGN_NUMEL = ALIGN // 4         # fp32 elements per aligned block
HEADER_BYTES = ALIGN
IO_MODES = ("direct", "buffered")
IDENTITY_KEYS = ("owner", "rank", "dp_rank", "dp_size", "layout", "numel", "states")


class OffloadStateError(RuntimeError):
    """An offloaded optimizer state file cannot be used: missing, truncated, foreign, stale or half written."""


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Page-aligned private anonymous memory (what ``O_DIRECT`` needs); wrap it with ``torch.frombuffer``."""
    return mmap.mmap(-1, max(round_up(nbytes, ALIGN), ALIGN), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _full_pread(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            return done
        done += n
    return done


def _full_pwrite(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


class StateFile:
    """The state file of one rank's optimizer shard; see the module docstring.

    Built by :meth:`create`. ``read``/``write`` move one sub-group of one state between the file and a
    page-aligned buffer; every method raises ``OSError`` as the OS reports it (the caller says what failed).
    """

    def __init__(self, path: str, fd: int, header: dict, io: str):
        self.path, self.fd, self.io = path, fd, io
        self.header = header
        self.numel = header["numel"]
        self.states = tuple(header["states"])
        self.stride = header["stride"]
        self.nbytes = HEADER_BYTES + len(self.states) * self.stride
        st = os.fstat(fd)
        self._inode = (st.st_dev, st.st_ino)
        self._header_buf = aligned_buffer(HEADER_BYTES)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, path: str, *, identity: Dict[str, object], io: str, chunk_numel: int,
               init: Dict[str, Callable[[int, int, torch.Tensor], None]]) -> "StateFile":
        """A new file at ``path`` holding ``identity["numel"]`` elements of each of ``identity["states"]``:
        ``init[name](lo, hi, out)`` fills elements ``[lo, hi)`` of a state (the others start at zero).
        ``io``: ``"direct"`` (``O_DIRECT``), ``"buffered"`` (the page cache), or ``"auto"`` (direct where the
        filesystem allows it). Refuses a file another live optimizer holds (an exclusive ``flock``)."""
        numel, states = int(identity["numel"]), tuple(identity["states"])
        stride = round_up(max(numel, 1), ALIGN_NUMEL) * 4
        nbytes = HEADER_BYTES + len(states) * stride
        directory = os.path.dirname(os.path.abspath(path))
        vfs = os.statvfs(directory)
        existing = os.path.getsize(path) if os.path.exists(path) else 0
        free = vfs.f_bavail * vfs.f_frsize + existing
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"the offloaded optimizer state needs {nbytes / 2**30:.2f} GiB "
                                        f"({len(states)} fp32 states x {numel} elements) but {directory} has "
                                        f"{free / 2**30:.2f} GiB free; free space or choose another offload_dir")
        fd, io = cls._open(path, io)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)                # the file is the other optimizer's: leave it be
            raise OffloadStateError(f"{identity['owner']}: {path} is in use by another live optimizer (it holds "
                                    f"the file's lock); give each run its own offload_dir") from None
        try:
            os.ftruncate(fd, 0)
            header = {**identity, "format": FORMAT, "id": uuid.uuid4().hex, "states": list(states),
                      "stride": stride, "generation": 0, "writing": True}
            self = cls(path, fd, header, io)
            self._write_header()
            self._fill(chunk_numel, init)
            self.header["writing"] = False
            self._write_header()
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        return self

    @staticmethod
    def _open(path: str, io: str):
        flags = os.O_RDWR | os.O_CREAT
        if io in ("direct", "auto"):
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600), "direct"
            except OSError as exc:          # tmpfs and some network filesystems refuse O_DIRECT
                if io == "direct" or exc.errno != errno.EINVAL:
                    raise
        return os.open(path, flags, 0o600), "buffered"

    def _fill(self, chunk_numel: int, init) -> None:
        buf = aligned_buffer(chunk_numel * 4)
        chunk = torch.frombuffer(buf, dtype=torch.float32, count=chunk_numel)
        view = memoryview(buf)
        os.ftruncate(self.fd, self.nbytes)
        for name in self.states:
            fill = init.get(name)
            if fill is None:
                chunk.zero_()
            for lo in range(0, self.numel, chunk_numel):
                hi = min(lo + chunk_numel, self.numel)
                if fill is not None:
                    fill(lo, hi, chunk[:hi - lo])
                self.write(name, lo, hi, view)

    # ------------------------------------------------------------------ sub-group I/O
    def _span(self, name: str, lo: int, hi: int):
        k = self.states.index(name)
        nbytes = round_up((hi - lo) * 4, ALIGN)       # inside the state's padded stride
        return HEADER_BYTES + k * self.stride + lo * 4, nbytes

    def read(self, name: str, lo: int, hi: int, into: memoryview) -> None:
        """Elements ``[lo, hi)`` of state ``name`` into ``into`` (page aligned, at least the rounded length);
        ``lo`` a multiple of 1024."""
        offset, nbytes = self._span(name, lo, hi)
        got = _full_pread(self.fd, into[:nbytes], offset)
        if got < nbytes:
            raise OSError(errno.EIO, f"{self.path} ended after {offset + got} bytes while reading state {name!r} "
                                     f"elements [{lo}, {hi}) (the file was truncated)")

    def write(self, name: str, lo: int, hi: int, src: memoryview) -> None:
        offset, nbytes = self._span(name, lo, hi)
        _full_pwrite(self.fd, src[:nbytes], offset)

    # ------------------------------------------------------------------ header
    def _write_header(self) -> None:
        text = json.dumps(self.header, sort_keys=True).encode()
        if len(text) > HEADER_BYTES:
            raise ValueError(f"StateFile: the header of {self.path} needs {len(text)} bytes, more than {HEADER_BYTES}")
        buf = self._header_buf
        buf.seek(0)
        buf.write(text + b"\0" * (HEADER_BYTES - len(text)))
        _full_pwrite(self.fd, memoryview(buf), 0)

    def begin_write(self) -> None:
        """Flag the file as being written (cleared by :meth:`end_write`): a write that fails in between
        leaves it set, and :meth:`verify` refuses the file from then on."""
        self.header["writing"] = True
        self._write_header()

    def end_write(self, step_done: bool) -> None:
        self.header["writing"] = False
        if step_done:
            self.header["generation"] += 1
        self._write_header()

    @staticmethod
    def read_header(path: str) -> Optional[dict]:
        """The header of the file at ``path``, or None when it has none we can parse."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read(HEADER_BYTES)
            return json.loads(raw.rstrip(b"\0").decode())
        except (OSError, ValueError, UnicodeDecodeError):
            return None

    # ------------------------------------------------------------------ checks
    def verify(self, owner: str) -> None:
        """Raise :class:`OffloadStateError` unless ``path`` still is this file, whole, with this header."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise OffloadStateError(f"{owner}: the offloaded optimizer state file {self.path} is missing (deleted "
                                    f"since this optimizer created it); rebuild the optimizer and load the last "
                                    f"checkpoint") from None
        if (st.st_dev, st.st_ino) != self._inode:
            found = self.read_header(self.path)
            raise OffloadStateError(f"{owner}: {self.path} was replaced by another file since this optimizer created "
                                    f"it: {self.describe_foreign(found)}; each rank and run needs its own file: "
                                    f"rebuild the optimizer and load the last checkpoint")
        got = _full_pread(self.fd, memoryview(self._header_buf), 0) if st.st_size >= HEADER_BYTES else 0
        if got < HEADER_BYTES:
            self._refuse_size(owner, st.st_size)
        try:
            found = json.loads(self._header_buf[:got].rstrip(b"\0").decode())
        except (ValueError, UnicodeDecodeError):
            found = None
        mine = self.header
        if found != mine:
            if isinstance(found, dict) and all(found.get(k) == mine.get(k) for k in IDENTITY_KEYS + ("id",)):
                if found.get("writing"):
                    why = (f"a step failed while writing it (its sub-groups now mix two steps; generation "
                           f"{found.get('generation')})")
                else:
                    why = (f"it holds generation {found.get('generation')} (steps written), this optimizer "
                           f"expects {mine['generation']}: it was overwritten with an older copy")
            else:
                why = f"it was overwritten by another file: {self.describe_foreign(found)}"
            raise OffloadStateError(f"{owner}: the offloaded optimizer state file {self.path} cannot be used: {why}; "
                                    f"rebuild the optimizer and load the last checkpoint")
        if mine.get("writing"):
            raise OffloadStateError(f"{owner}: a step failed while writing {self.path}, so its sub-groups mix two "
                                    f"steps; rebuild the optimizer and load the last checkpoint")
        if st.st_size != self.nbytes:      # after the header: a foreign file says whose it is
            self._refuse_size(owner, st.st_size)

    def _refuse_size(self, owner: str, size: int) -> None:
        raise OffloadStateError(f"{owner}: the offloaded optimizer state file {self.path} has {size} bytes, "
                                f"expected {self.nbytes} ({len(self.states)} fp32 states x {self.numel} elements "
                                f"and a {HEADER_BYTES}-byte header): it was "
                                f"{'truncated' if size < self.nbytes else 'extended'}; rebuild the optimizer and "
                                f"load the last checkpoint")

    def describe_foreign(self, found: Optional[dict]) -> str:
        """Why a header ``found`` at our path is not ours, in words."""
        mine = self.header
        if not isinstance(found, dict) or found.get("format") != FORMAT:
            return "it is not a ZeRO offload state file (no header of format " + FORMAT + ")"
        if (found.get("rank"), found.get("dp_rank"), found.get("dp_size")) != \
                (mine["rank"], mine["dp_rank"], mine["dp_size"]):
            return (f"it was written by global rank {found.get('rank')} (dp rank {found.get('dp_rank')} of "
                    f"{found.get('dp_size')}); this is global rank {mine['rank']} (dp rank {mine['dp_rank']} of "
                    f"{mine['dp_size']})")
        if any(found.get(k) != mine[k] for k in ("owner", "layout", "numel", "states")):
            return (f"it holds another layout ({found.get('owner')}, {found.get('numel')} elements of "
                    f"{found.get('states')}, layout {str(found.get('layout'))[:12]}); this optimizer has "
                    f"{mine['owner']}, {mine['numel']} elements of {mine['states']}, layout {mine['layout'][:12]}")
        if found.get("id") != mine["id"]:
            return f"it belongs to another run (file id {found.get('id')}, this optimizer's is {mine['id']})"
        return "its header differs from this optimizer's"

    # ------------------------------------------------------------------ whole-state access
    def views(self) -> Dict[str, torch.Tensor]:
        """Every state as a flat fp32 tensor mapped from the file (``MAP_SHARED``: writing one writes the file;
        the kernel keeps it coherent with ``read``/``write``). Costs address space, not memory. Verified
        first: ``torch.from_file`` would create a missing file."""
        self.verify(self.header["owner"])
        return self._map(self.path, shared=True)

    def _map(self, path: str, shared: bool) -> Dict[str, torch.Tensor]:
        whole = torch.from_file(path, shared=shared, size=self.nbytes // 4, dtype=torch.float32)
        base = HEADER_BYTES // 4
        return {name: whole[base + k * self.stride // 4: base + k * self.stride // 4 + self.numel]
                for k, name in enumerate(self.states)}

    def snapshot(self, path: str) -> Dict[str, torch.Tensor]:
        """A copy of the states as they are now, as tensors mapped privately from a copy of the file at
        ``path`` (copied in the kernel, ``copy_file_range``), which is unlinked at once: the copy's blocks
        live while the tensors do, and no anonymous memory holds them."""
        tmp = path + ".tmp"
        try:
            src = os.open(self.path, os.O_RDONLY)
            try:
                dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                try:
                    done = 0
                    while done < self.nbytes:
                        n = os.copy_file_range(src, dst, self.nbytes - done, done, done)
                        if n == 0:
                            raise OSError(errno.EIO, f"{self.path} ended after {done} bytes while copying it")
                        done += n
                finally:
                    os.close(dst)
            finally:
                os.close(src)
            return self._map(tmp, shared=False)
        finally:
            _unlink_quietly(tmp)

    # ------------------------------------------------------------------ lifetime
    def replace(self, old: "StateFile") -> None:
        """Take ``old``'s path (``os.replace``: atomic) and close ``old``."""
        os.replace(self.path, old.path)
        self.path = old.path
        old.close(unlink=False)

    def close(self, unlink: bool = True) -> None:
        """Close the file and (``unlink``) remove it, unless the path now names another file."""
        if self.fd < 0:
            return
        try:
            if unlink:
                try:
                    st = os.stat(self.path)
                except FileNotFoundError:
                    st = None
                if st is not None and (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
        finally:
            os.close(self.fd)
            self.fd = -1


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def layout_digest(layout: object) -> str:
    """A short fingerprint of a shard layout (a structure of lists, tuples, strings and numbers)."""
    import hashlib

    return hashlib.sha256(repr(layout).encode()).hexdigest()[:32]


__all__ = ["StateFile", "OffloadStateError", "aligned_buffer", "layout_digest", "IO_MODES", "ALIGN_NUMEL"]
