"""NCCL's rules, enforced over gloo on CPU: the test backend ``"nccl_rules"``.

The package promises that the code path tested on CPU is the one that runs on GPUs with NCCL. Gloo is
more forgiving than NCCL in ways that become hangs on a GPU cluster, so this backend runs every
operation over an inner gloo group with NCCL's semantics, and fails fast, naming the rule and the call
site, where a program leans on gloo's leniency:

1. **tags**: NCCL ignores ``tag``; messages between a pair match in posting order. A non-zero tag is
   refused: a program that passes one relies on a channel NCCL does not give.
2. **matching**: every message carries its shape, dtype and call site; a receive that meets a message
   of another shape or dtype (the two ends post in different orders) fails naming both ends.
3. **one stream per rank and group**: every operation (send, receive, batch, collective) runs in issue
   order on one worker thread, and a send completes only once the peer's receive takes it, as NCCL's
   kernels do on one CUDA stream. A posted receive therefore blocks every later operation of that rank
   on that group. Ranks whose stalled heads wait on each other are deadlocked: each rank publishes its
   stalled head in the group's store, and every rank of a wait cycle raises within about two seconds.
4. **one Work per batch**: ``dist.batch_isend_irecv`` returns a single Work for the whole batch (NCCL's
   coalescing), and the batch completes when all of its operations have.
5. **collective order**: all ranks issue the same collectives in the same order; a fingerprint (op,
   element count, dtype, root) is compared across the group before each one. An uneven all-to-all
   (``all_to_all_single`` with split sizes) compares the elements of a row instead, and checks that each
   pair of ranks agrees on the rows it exchanges.
6. **device**: communication tensors must live on the device the model trains on. On CPU both are
   "cpu", so :class:`HostTensors` (a ``TorchFunctionMode``) remembers which tensors the watched code
   created without ``device=`` (on a GPU machine: a CPU tensor) and what was computed from those
   alone; the backend refuses them, naming where the tensor was made.

``register()`` makes the backend known (``init_process_group("nccl_rules")``, and every group made
from it after); ``track_host_tensors()`` starts rule 6 for the package's own code.
"""
from __future__ import annotations

import datetime
import json
import os
import queue
import sys
import threading
import time
import zlib
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from . import gloo_device

BACKEND = "nccl_rules"
STALL_S = 1.0            # a head blocked this long is published as stalled
_SITE_LEN = 160
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.int16]
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS = os.path.abspath(__file__)


class RuleViolation(RuntimeError):
    """A program did something NCCL would hang or fail on; the message names the rule and the site."""


def _site() -> str:
    """``file:line (function)`` of the innermost caller outside torch and this module."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and os.path.abspath(name) != _THIS:
            return f"{os.path.relpath(name) if not name.startswith('<') else name}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "<unknown>"


# ----------------------------------------------------------------------------------------- rule 6
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.as_tensor, torch.arange,
              torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.empty_strided,
              torch.from_numpy, torch.frombuffer}
_TO = {torch.Tensor.to, torch.Tensor.cuda}
_HOST = "_nccl_rules_host_site"     # set on a host tensor: where it was made


class HostTensors(TorchFunctionMode):
    """Tracks host tensors: made by a factory call without ``device=`` (or ``.cpu()``) in a file under
    one of ``watch``, or computed only from such tensors. ``.to(device)`` / ``.cuda()`` of one gives a
    device tensor (a copy, as on a GPU). Everything else is a device tensor."""

    def __init__(self, watch: Sequence[str]):
        super().__init__()
        self.watch = tuple(os.path.abspath(w) for w in watch)

    @staticmethod
    def site_of(t: torch.Tensor) -> Optional[str]:
        """Where a host tensor was made, or None for a device tensor."""
        return t.__dict__.get(_HOST)

    def _watched_site(self) -> Optional[str]:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if not name.startswith(_TORCH_DIR) and os.path.abspath(name) != _THIS:
                if os.path.abspath(name).startswith(self.watch):
                    return f"{os.path.relpath(name)}:{f.f_lineno} ({f.f_code.co_name})"
                return None
            f = f.f_back
        return None

    def _host_inputs(self, args, kwargs) -> Optional[str]:
        """The site of a host input when every tensor input is a host tensor, else None."""
        site = None
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    s = t.__dict__.get(_HOST)
                    if s is None:
                        return None
                    site = site or s
        return site

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if func in _FACTORIES or func is torch.Tensor.cpu:
            if func is torch.Tensor.cpu or kwargs.get("device") is None:
                site = self._watched_site()
                if site is not None:
                    out.__dict__[_HOST] = site
            return out
        if func in _TO and (func is torch.Tensor.cuda or _to_device(args, kwargs)):
            if out is args[0] and _HOST in out.__dict__:
                out = out.clone()          # on a GPU this is a new tensor on the device
            out.__dict__.pop(_HOST, None)
            return out
        if args and out is args[0]:
            return out                      # in-place ops keep their tensor's kind
        site = self._host_inputs(args, kwargs)
        if site is not None:
            out.__dict__[_HOST] = site
        return out


def _to_device(args, kwargs) -> bool:
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    return any(isinstance(a, (torch.device, str, torch.Tensor)) for a in args[1:])


_tracker: Optional[HostTensors] = None


def track_host_tensors(watch: Sequence[str] = ()) -> HostTensors:
    """Start rule 6 in this process (this thread's torch calls) for the package's code and ``watch``."""
    global _tracker
    if _tracker is None:
        package = os.path.dirname(os.path.dirname(_THIS))
        _tracker = HostTensors([package, *watch])
        _tracker.__enter__()
    else:
        _tracker.watch += tuple(os.path.abspath(w) for w in watch)
    return _tracker


def _check_device(t: torch.Tensor, what: str, site: str) -> None:
    host = HostTensors.site_of(t)
    if host is not None:
        raise RuleViolation(
            f"NCCL rule 'communication tensors live on the GPU': {what} at {site} passes a tensor made on the "
            f"host at {host} (a factory call without device=, or computed from such tensors only). Under NCCL "
            f"this is a CPU tensor and the call raises; create it with device= the model's device.")


# ----------------------------------------------------------------------------------------- the stream
class RulesWork(dist.Work):
    """One stream item: completes when the stream has run it; ``wait`` re-raises its error."""

    def __init__(self, group: "NcclRulesGroup", what: str, site: str, receives: bool = False):
        super().__init__()
        self.group, self.what, self.site = group, what, site
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._unobserved = receives     # a receive's buffer is only valid after wait() (or is_completed())

    def __del__(self):
        if getattr(self, "_unobserved", False):
            self.group._dropped.append(f"{self.what} (posted at {self.site})")

    def _finish(self, error: Optional[BaseException] = None) -> None:
        if not self._done.is_set():
            self._error = error
            self._done.set()

    def is_completed(self) -> bool:
        if self._done.is_set():
            self._unobserved = False
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self):
        return self._error

    def wait(self, timeout=None) -> bool:
        self._unobserved = False
        limit = self.group.timeout_s
        if timeout is not None and timeout.total_seconds() > 0:
            limit = min(limit, timeout.total_seconds())
        if not self._done.wait(limit):
            raise RuleViolation(f"NCCL rules: {self.what} (posted at {self.site}) did not complete within "
                                f"{limit:.0f}s; {self.group.describe_stream()}")
        if self._error is not None:
            raise self._error
        return True


class _Head:
    """What the stream is blocked on now: for the stall detector."""

    def __init__(self, seq: int, what: str, site: str):
        self.seq, self.what, self.site, self.since = seq, what, site, time.monotonic()
        self.peers: List[int] = []       # group ranks a point-to-point wait depends on
        self.collective: Optional[int] = None


class NcclRulesGroup(dist.ProcessGroup):
    """A process group with NCCL's rules over an inner gloo group (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._store = store
        # the inner gloo group on the process's one shared transport device (testing.gloo_device: why)
        self._inner = gloo_device.process_group(dist.PrefixStore("inner", store), rank, size, timeout)
        self.timeout_s = timeout.total_seconds()
        self._queue: "queue.Queue" = queue.Queue()
        self._queued: List[RulesWork] = []
        self._lock = threading.Lock()
        self._seq = 0
        self._collectives = 0
        self._head: Optional[_Head] = None
        self._violation: Optional[RuleViolation] = None
        self._dropped: List[str] = []     # receives whose Work was never waited (rule 4)
        threading.Thread(target=self._run, name="nccl_rules-stream", daemon=True).start()
        threading.Thread(target=self._watch, name="nccl_rules-stall", daemon=True).start()

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # c10d keeps a group's name on its C++ backends, which a Python group has none of
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # ------------------------------------------------------------------ the stream thread
    def _submit(self, what: str, site: str, fn: Callable[[_Head], None], receives: bool = False) -> RulesWork:
        self._check_dropped(what, site)
        work = RulesWork(self, what, site, receives)
        with self._lock:
            if self._violation is not None:
                work._finish(self._violation)
                return work
            self._seq += 1
            self._queued.append(work)
            self._queue.put((self._seq, fn, work))
        return work

    def _check_dropped(self, what: str, site: str) -> None:
        if self._dropped:
            dropped, self._dropped[:] = list(self._dropped), []
            raise RuleViolation(
                f"NCCL rule 'one Work per batch': before {what} at {site}, the Work of {'; '.join(dropped)} was "
                f"dropped without wait(). NCCL's batch_isend_irecv returns one Work for the whole batch, so "
                f"code that pairs operations with Works loses its receives: wait on every Work returned.")

    def _run(self) -> None:
        while True:
            seq, fn, work = self._queue.get()
            head = _Head(seq, work.what, work.site)
            with self._lock:
                self._head = head
                failed = self._violation
            try:
                if failed is None:
                    self._check_dropped(work.what, work.site)
                    fn(head)
                work._finish(failed)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                with self._lock:
                    if self._violation is None:
                        self._violation = exc if isinstance(exc, RuleViolation) else RuleViolation(
                            f"NCCL rules: {work.what} (posted at {work.site}) failed: {exc}")
                work._finish(self._violation)
            with self._lock:
                self._head = None
                self._queued.remove(work)
            del work, fn, head           # the caller's reference decides when a dropped Work is noticed

    def describe_stream(self) -> str:
        with self._lock:
            head, queued = self._head, list(self._queued)
        if head is None:
            return "nothing is running on this rank's stream for the group"
        behind = [f"{w.what} (posted at {w.site})" for w in queued if w.what != head.what or w.site != head.site]
        text = f"rank {self.rank()}'s stream is blocked on {head.what} (posted at {head.site})"
        if behind:
            text += ("; queued behind it, unable to start: " + "; ".join(behind[:6]) +
                     (f" and {len(behind) - 6} more" if len(behind) > 6 else ""))
        return text

    # ------------------------------------------------------------------ the stall detector
    def _state_key(self, rank: int) -> str:
        return f"stall/{rank}"

    def _watch(self) -> None:
        published, seen = None, None
        while self._violation is None:
            time.sleep(0.25)
            with self._lock:
                head = self._head
            stalled = head is not None and time.monotonic() - head.since > STALL_S
            state = (json.dumps({"seq": head.seq, "peers": head.peers, "coll": head.collective,
                                 "what": f"{head.what} (posted at {head.site})", "desc": self.describe_stream()})
                     if stalled else "")
            if state != published:
                self._store.set(self._state_key(self.rank()), state)
                published = state
            if not stalled:
                seen = None
                continue
            cycle = self._find_cycle()
            if cycle is None:
                seen = None
            elif cycle == seen:        # the same stalled heads twice in a row: nobody can move
                self._fail(RuleViolation(
                    "NCCL rule 'a rank's operations on a group run in issue order (one stream)': deadlock. "
                    "Every rank below waits on the next, and what it waits for is queued behind the head of "
                    "that rank's stream (under NCCL a posted receive, or a send not yet received, blocks every "
                    "later operation of the rank on the group; put operations that must progress together in "
                    "one batch_isend_irecv):\n  " + "\n  ".join(f"rank {r}: {d}" for r, d in cycle[1])))
            else:
                seen = cycle

    def _find_cycle(self):
        states: Dict[int, dict] = {}
        for r in range(self.size()):
            key = self._state_key(r)
            if self._store.check([key]):
                raw = self._store.get(key).decode()
                if raw:
                    states[r] = json.loads(raw)
        me = self.rank()
        if me not in states:
            return None

        def waits_on(r: int) -> List[int]:
            s = states[r]
            if s["coll"] is not None:     # a collective waits for every rank not at the same one
                return [q for q in range(self.size()) if q != r and (q not in states or states[q]["coll"] != s["coll"])]
            return s["peers"]

        path, r = [me], me
        while True:                      # follow the first stalled peer; a cycle back to me is a deadlock
            nxt = next((q for q in waits_on(r) if q in states), None)
            if nxt is None:
                return None
            if nxt == me:
                key = tuple((q, states[q]["seq"]) for q in path)
                return key, [(q, states[q]["desc"]) for q in path]
            if nxt in path:
                return None
            path.append(nxt)
            r = nxt

    def _fail(self, error: RuleViolation) -> None:
        with self._lock:
            self._violation = error
            queued = list(self._queued)
        for w in queued:
            w._finish(error)

    # ------------------------------------------------------------------ point to point
    def _header(self, t: torch.Tensor, site: str) -> torch.Tensor:
        h = torch.zeros(8 + _SITE_LEN, dtype=torch.int64)
        h[0] = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else 99
        h[1] = t.dim()
        h[2:2 + min(t.dim(), 6)] = torch.tensor(list(t.shape)[:6], dtype=torch.int64)
        _put_text(h, site)
        return h

    @staticmethod
    def _decode(h: torch.Tensor):
        code, ndim = int(h[0]), int(h[1])
        dtype = _DTYPES[code] if code < len(_DTYPES) else "other"
        site = _get_text(h)
        return tuple(int(x) for x in h[2:2 + ndim]), dtype, site

    def _check_p2p(self, kind: str, t: torch.Tensor, peer: int, tag: int, site: str) -> None:
        what = f"{kind} {'to' if kind == 'send' else 'from'} rank {peer}"
        if tag != 0:
            raise RuleViolation(f"NCCL rule 'tags are ignored': {what} at {site} passes tag={tag}. NCCL matches "
                                f"the messages between two ranks in posting order whatever their tags, so a "
                                f"tag gives no separate channel; post messages in the same order on both ends.")
        if not 0 <= peer < self.size() or peer == self.rank():
            raise RuleViolation(f"NCCL rules: {what} at {site}: no such peer in a group of {self.size()}")
        _check_device(t, what, site)

    def _post_send(self, t: torch.Tensor, peer: int, site: str) -> List[dist.Work]:
        return [self._inner.send([self._header(t, site)], peer, 0), self._inner.send([t], peer, 0)]

    def _recv_into(self, t: torch.Tensor, peer: int, site: str, head: _Head) -> dist.Work:
        h = torch.empty(8 + _SITE_LEN, dtype=torch.int64)
        head.peers = [peer]
        self._inner.recv([h], peer, 0).wait()
        shape, dtype, sender = self._decode(h)
        if shape != tuple(t.shape) or dtype != t.dtype:
            raise RuleViolation(
                f"NCCL rule 'messages between a pair match in posting order': rank {self.rank()} receives into "
                f"{tuple(t.shape)} {t.dtype} at {site}, but the message rank {peer} posted next to it is "
                f"{shape} {dtype}, sent at {sender}. The two ends post their messages in different orders "
                f"(tags do not reorder them under NCCL).")
        return self._inner.recv([t], peer, 0)

    def _p2p(self, ops: Sequence[tuple], what: str, site: str) -> RulesWork:
        """``ops``: ``(kind, tensor, group peer, site)``; run as one stream item (NCCL's group)."""
        def run(head: _Head) -> None:
            pending = []                            # sends first: all of a batch's ops progress together
            for kind, t, peer, s in ops:
                if kind == "send":
                    pending += [(w, peer) for w in self._post_send(t, peer, s)]
            for kind, t, peer, s in ops:
                if kind == "recv":
                    pending.append((self._recv_into(t, peer, s, head), peer))
            for w, peer in pending:
                head.peers = [peer]
                w.wait()
        return self._submit(what, site, run, receives=any(kind == "recv" for kind, *_ in ops))

    def send(self, tensors, dst, tag=0):
        site = _site()
        self._check_p2p("send", tensors[0], dst, tag, site)
        return self._p2p([("send", tensors[0], dst, site)], f"send to rank {dst}", site)

    def recv(self, tensors, src, tag=0):
        site = _site()
        self._check_p2p("recv", tensors[0], src, tag, site)
        return self._p2p([("recv", tensors[0], src, site)], f"receive from rank {src}", site)

    def recv_anysource(self, tensors, tag=0):
        raise RuleViolation(f"NCCL rules: a receive from any source at {_site()}: NCCL has none; name the peer")

    def batch(self, p2p_ops: Sequence[dist.P2POp]) -> RulesWork:
        """NCCL's ``batch_isend_irecv``: one stream item, one Work."""
        site = _site()
        ops = []
        for op in p2p_ops:
            kind = "send" if op.op in (dist.isend, dist.send) else "recv"
            peer = op.group_peer
            self._check_p2p(kind, op.tensor, peer, op.tag or 0, site)
            ops.append((kind, op.tensor, peer, site))
        desc = ", ".join(f"{k} {'to' if k == 'send' else 'from'} {p}" for k, _, p, _ in ops)
        return self._p2p(ops, f"batch [{desc}]", site)

    # ------------------------------------------------------------------ collectives
    def _collective(self, name: str, tensors: Sequence[torch.Tensor], extra: int,
                    call: Callable[[], dist.Work], numel: Optional[int] = None,
                    agree: Optional[Callable[[str], None]] = None) -> RulesWork:
        """``numel``: the element count the ranks must agree on (default: the first tensor's); ``agree(site)``:
        a further check run on the stream after the fingerprints matched, before the collective."""
        site = _site()
        for t in tensors:
            _check_device(t, name, site)
        t0 = tensors[0] if tensors else torch.empty(0)
        numel = t0.numel() if numel is None else numel
        fingerprint = [zlib.crc32(name.encode()), numel, _DTYPES.index(t0.dtype) if t0.dtype in _DTYPES else 99,
                       extra]

        def run(head: _Head) -> None:
            self._collectives += 1
            head.collective = self._collectives
            mine = torch.zeros(8 + _SITE_LEN, dtype=torch.int64)
            mine[:4] = torch.tensor(fingerprint, dtype=torch.int64)
            _put_text(mine, f"{name} of {numel} {t0.dtype} at {site}")
            every = torch.empty(self.size() * mine.numel(), dtype=torch.int64)
            self._inner._allgather_base(every, mine).wait()
            every = every.view(self.size(), -1)
            if not bool((every[:, :4] == mine[:4]).all()):
                lines = [f"rank {r}: " + _get_text(every[r])
                         for r in range(self.size())]
                raise RuleViolation("NCCL rule 'every rank issues the same collectives in the same order': "
                                    "the ranks of this group reached different collectives:\n  " + "\n  ".join(lines))
            if agree is not None:
                agree(site)
            call().wait()
        return self._submit(f"{name} of {numel} {t0.dtype}", site, run)

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._collective("all_reduce", tensors, _op_code(opts.reduceOp),
                                lambda: self._inner.allreduce(tensors, opts))

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._collective("broadcast", tensors, opts.rootRank, lambda: self._inner.broadcast(tensors, opts))

    def barrier(self, opts=None):
        return self._collective("barrier", [], 0, lambda: self._inner.barrier(opts or dist.BarrierOptions()))

    def allgather(self, output_tensors, input_tensors, opts=None):
        return self._collective("all_gather", input_tensors, 0,
                                lambda: self._inner.allgather(output_tensors, input_tensors,
                                                              opts or dist.AllgatherOptions()))

    def _allgather_base(self, output, input, opts=None):
        return self._collective("all_gather_into_tensor", [input, output], 0,
                                lambda: self._inner._allgather_base(output, input, opts or dist.AllgatherOptions()))

    all_gather_single = _allgather_base

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._collective("reduce_scatter_tensor", [input, output], _op_code(opts.reduceOp),
                                lambda: self._inner._reduce_scatter_base(output, input, opts))

    reduce_scatter_single = _reduce_scatter_base

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        def call():
            return self._inner.alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                             opts or dist.AllToAllOptions())
        if not output_split_sizes and not input_split_sizes:
            return self._collective("all_to_all_single", [input, output], 0, call)
        # uneven: the ranks' tensors differ in rows, so they agree on a row's size, and each pair on its rows
        row = 1
        for size in input.shape[1:]:
            row *= int(size)
        sizes = [self._splits(input_split_sizes, input), self._splits(output_split_sizes, output)]
        return self._collective("all_to_all_single (uneven; elements per row)", [input, output], 0, call, row,
                                lambda site: self._check_splits(sizes, site))

    def _splits(self, sizes, t: torch.Tensor) -> List[int]:
        return [int(s) for s in sizes] if sizes else [t.shape[0] // self.size()] * self.size()

    def _check_splits(self, sizes: List[List[int]], site: str) -> None:
        """Rank ``i`` sends rank ``j`` as many rows as ``j`` expects from ``i``, for every pair: NCCL's
        all-to-all is a send and a receive per pair, and a pair that disagrees hangs or corrupts memory."""
        n = self.size()
        every = torch.empty(n * 2 * n, dtype=torch.int64)
        self._inner._allgather_base(every, torch.tensor(sizes[0] + sizes[1], dtype=torch.int64)).wait()
        every = every.view(n, 2, n)
        sent, expected = every[:, 0, :], every[:, 1, :].t()        # [i, j]: i -> j, and what j expects from i
        bad = (sent != expected).nonzero().tolist()
        if bad:
            pairs = "; ".join(f"rank {i} sends {int(sent[i, j])} rows to rank {j}, which expects "
                              f"{int(expected[i, j])}" for i, j in bad[:4])
            raise RuleViolation(f"NCCL rule 'an uneven all-to-all's ranks agree on the rows of each pair': at {site}: "
                                f"{pairs}. Each rank's input_split_sizes[j] must be rank j's "
                                f"output_split_sizes[i]: exchange the counts first (an all-to-all of them).")

    def gather(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.GatherOptions()
        return self._collective("gather", input_tensors, opts.rootRank,
                                lambda: self._inner.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors, input_tensors, opts=None):
        opts = opts or dist.ScatterOptions()
        return self._collective("scatter", output_tensors, opts.rootRank,
                                lambda: self._inner.scatter(output_tensors, input_tensors, opts))


def _put_text(row: torch.Tensor, text: str) -> None:
    """A call site or description into ``row[8:]`` of a header (one byte per int64)."""
    code = text.encode()[:_SITE_LEN]
    row[8:8 + len(code)] = torch.tensor(list(code), dtype=torch.int64)


def _get_text(row: torch.Tensor) -> str:
    return bytes(int(x) for x in row[8:] if int(x)).decode(errors="replace")


def _op_code(op) -> int:
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name, None):
            return zlib.crc32(name.encode())
    return 0


# ----------------------------------------------------------------------------------------- registration
def _create(store, rank, size, timeout):
    return NcclRulesGroup(store, rank, size, timeout)


_torch_batch_isend_irecv = dist.batch_isend_irecv


def _world_group():
    """The world group's ProcessGroup object (c10d has no public getter for it)."""
    return dist.distributed_c10d._get_default_group()


def _batch_isend_irecv(p2p_op_list):
    group = p2p_op_list[0].group if p2p_op_list else None
    group = group if group is not None else _world_group()
    if isinstance(group, NcclRulesGroup):
        return [group.batch(p2p_op_list)]
    return _torch_batch_isend_irecv(p2p_op_list)


def register() -> None:
    """Make ``"nccl_rules"`` a c10d backend in this process (idempotent)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    dist.batch_isend_irecv = _batch_isend_irecv
    dist.distributed_c10d.batch_isend_irecv = _batch_isend_irecv


def is_rules_group(group) -> bool:
    group = group if group is not None else _world_group()
    return isinstance(group, NcclRulesGroup)


__all__ = ["BACKEND", "HostTensors", "NcclRulesGroup", "RuleViolation", "register", "track_host_tensors",
           "is_rules_group"]
