"""The server side of parameter-server data parallelism: :class:`ParameterServerShard` and :func:`serve`.

A server owns one piece of every bucket (:mod:`.protocol`): the fp32 parameters of that shard and
their AdamW moments, stepped with the package's fused ``adamw_step``. It needs no model: the workers send
the bucket plan, worker 0 the initial values, and every worker must send the same plan.

``staleness=0``, synchronous. The receives of a whole push are posted on every link ahead of time. Bucket
by bucket, in the order backward produces them, the server waits for every worker's piece, sums them and
steps that part of its shard (elementwise, so the same result as one step of the whole shard) while the
later buckets are still on their way; then it sends the shard to every worker in forward order. A worker
that fails or is silent for the layout's timeout fails the step: the server tells every other worker
(an ABORT header in place of its pull, so they raise at once instead of timing out) and raises itself.

``staleness=k >= 1``, asynchronous with bounded staleness. Each worker's next push is posted on its link and
waited for by a thread of that link (gloo completes a receive only inside ``wait()``); the main loop takes
pushes in the order they complete and applies each as an AdamW step of its own, with that worker's
gradient. The server counts each worker's pushes (its clock) and answers a worker's pull only when its
clock is at most ``k`` ahead of the slowest worker still training, so a worker computes on parameters that
miss at most ``k`` steps of any other worker, and a fast worker blocks on its pull. A worker whose link
fails or stays silent for the layout's timeout is declared dead: a ``RuntimeWarning`` names it, it joins
:attr:`ParameterServerShard.dead_workers`, it no longer holds the others back, and the server serves the
rest. (A worker that pauses longer than the timeout between steps is therefore declared dead too.)

Either way a worker that is done sends LEAVE (:meth:`ParameterServerWorker.close`); :func:`serve` returns
the shard once every worker has left or died.

Memory per server, in shards of fp32 (model / servers elements each): the parameters and the two moments,
plus one receive buffer per worker (the receives of a push are posted ahead), plus, when asynchronous, one
copy of the parameters per worker for its pull in flight: ``3 + workers`` (``3 + 2 x workers``) shards.
"""
from __future__ import annotations

import queue
import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..ops.optimizer_step import adamw_step
from . import protocol as wire
from .protocol import PSLayout, Traffic

LR = Union[float, Callable[[int], float]]


class _WorkerFailed(Exception):
    def __init__(self, worker: int, what: str, exc: BaseException):
        super().__init__(f"worker rank {worker}: {what}: {exc}")
        self.worker, self.what, self.exc = worker, what, exc


class _LinkWaiter:
    """A thread that waits, in order, for the receives of one worker's pushes, and reports each push (or
    the link's failure) on the server's queue of arrivals."""

    def __init__(self, worker: int, arrivals: "queue.Queue"):
        self.worker, self.arrivals = worker, arrivals
        self.jobs: "queue.Queue" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"ps-link-{worker}", daemon=True)
        self.thread.start()

    def submit(self, works: Sequence[object]) -> None:
        self.jobs.put(list(works))

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while True:
            works = self.jobs.get()
            if works is None:
                return
            try:
                for work in works:
                    work.wait()
            except RuntimeError as exc:
                self.arrivals.put((self.worker, exc))
                return
            self.arrivals.put((self.worker, None))


class ParameterServerShard:
    """This server rank's shard of the parameters and its AdamW state (see the module docstring).

    ``lr`` (a number, or a function of the 1-based step number), ``betas``, ``eps``, ``weight_decay``:
    AdamW's, as ``torch.optim.AdamW`` takes them, for every parameter. ``staleness``: 0 synchronous,
    ``k >= 1`` asynchronous with at most ``k`` pushes between the fastest and the slowest worker.
    ``device``: where the shard lives (default: the current CUDA device on NCCL links, else the CPU).

    After :meth:`run`: ``steps_taken`` (AdamW steps: rounds when synchronous, pushes applied when not),
    ``clocks`` (pushes applied per worker rank), ``left_workers``, ``dead_workers`` (rank -> reason),
    ``release_log`` ((worker, its clock, the slowest live worker's clock) for every pull answered),
    ``traffic`` (bytes so far), ``step_traffic`` (those of the last step: every worker's push and pull when
    synchronous, one push and the pulls it released when not) and :meth:`status`.
    """

    def __init__(self, layout: PSLayout, *, lr: LR = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, staleness: int = 0,
                 device: Optional[torch.device] = None, backend: Optional[str] = None):
        if not layout.is_server:
            raise ValueError(f"ParameterServerShard: rank {layout.rank} is a {layout.role} of the layout (workers "
                             f"{layout.workers}, servers {layout.servers}); a worker rank wraps its model in "
                             f"ParameterServerWorker(model, layout)")
        if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"ParameterServerShard: staleness={staleness!r} must be an integer >= 0 (0: synchronous)")
        self.layout, self.rank = layout, layout.rank
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), float(eps), float(weight_decay)
        self.staleness, self.backend = staleness, backend
        self.workers = list(layout.workers)
        self._links = {w: layout.link(w, self.rank) for w in self.workers}
        if device is None:
            nccl = dist.get_backend(self._links[self.workers[0]]) == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self.device = torch.device(device)
        self.name = f"ParameterServerShard (server rank {self.rank})"
        self.traffic = Traffic()
        self.clocks: Dict[int, int] = {w: 0 for w in self.workers}
        self.left_workers: List[int] = []
        self.dead_workers: Dict[int, str] = {}
        self.release_log: List[Tuple[int, int, int]] = []
        self.steps_taken = 0
        self.step_traffic = {"sent": 0, "received": 0}
        self._sends: Dict[int, list] = {}
        self._pushes: Dict[int, tuple] = {}

    # ------------------------------------------------------------------ public API
    def run(self) -> "ParameterServerShard":
        """Serve until every worker has left (or died, when asynchronous); returns ``self``."""
        try:
            self._handshake()
        except _WorkerFailed as failed:
            raise RuntimeError(f"{self.name}: worker rank {failed.worker} failed or timed out while {failed.what}: "
                               f"{failed.exc}") from failed.exc
        if self.staleness == 0:
            self._run_sync()
        else:
            self._run_async()
        return self

    @property
    def live_workers(self) -> List[int]:
        gone = set(self.left_workers) | set(self.dead_workers)
        return [w for w in self.workers if w not in gone]

    def status(self) -> dict:
        return {"rank": self.rank, "staleness": self.staleness, "steps_taken": self.steps_taken,
                "live_workers": self.live_workers, "left_workers": list(self.left_workers),
                "dead_workers": dict(self.dead_workers), "clocks": dict(self.clocks),
                "traffic": self.traffic.as_dict(), "step_traffic": dict(self.step_traffic)}

    # ------------------------------------------------------------------ set-up
    def _handshake(self) -> None:
        """Every worker's plan (all equal), the initial shard from worker 0, then the first pull to all."""
        heads = {w: wire.header_buffer(self.device) for w in self.workers}
        works = {w: self._irecv(heads[w], w) for w in self.workers}
        plans = {}
        for w in self.workers:
            self._wait(works[w], w, "receiving the bucket plan")
            _, n_buckets, shard_numel, index, init = wire.check_header(heads[w], (wire.PLAN,), self.name, w)[:5]
            plans[w] = (n_buckets, shard_numel, init)
        sizes = {w: torch.zeros(plans[w][0], dtype=torch.int64, device=self.device) for w in self.workers}
        works = {w: self._irecv(sizes[w], w) for w in self.workers}
        first = self.workers[0]
        for w in self.workers:
            self._wait(works[w], w, "receiving the bucket plan")
            if plans[w][:2] != plans[first][:2] or not torch.equal(sizes[w], sizes[first]):
                raise RuntimeError(f"{self.name}: worker rank {w} lays its parameters out as {plans[w][0]} buckets "
                                   f"of {sizes[w].tolist()} elements on this server, worker rank {first} as "
                                   f"{plans[first][0]} of {sizes[first].tolist()}: the workers must wrap the same "
                                   f"model with the same bucket sizes")
        self.piece = sizes[first].tolist()
        self.offsets = [sum(self.piece[:b]) for b in range(len(self.piece))]
        numel = plans[first][1]
        self.master = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self._wait(self._irecv(self.master, first), first, "receiving the initial values")
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self._step = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._grads = {w: torch.zeros_like(self.master) for w in self.workers}
        if self.staleness:             # a copy per worker: the shard keeps changing while a pull is on its way
            self._snapshots = {w: torch.zeros_like(self.master) for w in self.workers}
        for w in self.workers:
            self._send_pull(w, self.master, slowest=0)
        self.traffic.step()

    # ------------------------------------------------------------------ the wire
    def _isend(self, t: torch.Tensor, w: int):
        return wire.isend(t, w, self._links[w], self.traffic)

    def _irecv(self, t: torch.Tensor, w: int):
        return wire.irecv(t, w, self._links[w], self.traffic)

    def _slice(self, t: torch.Tensor, b: int) -> torch.Tensor:
        return t[self.offsets[b]:self.offsets[b] + self.piece[b]]

    def _send_pull(self, w: int, source: torch.Tensor, slowest: int, status: int = wire.OK, failed: int = -1) -> None:
        for work in self._sends.pop(w, ()):          # the previous pull to w: w pushed since, so it arrived
            work.wait()
        head = wire.header(wire.PULL, status, self.clocks[w], slowest, self.steps_taken, self.staleness, failed,
                           device=self.device)
        works = [self._isend(head, w)]
        if status == wire.OK:
            for b in reversed(range(len(self.piece))):
                works.append(self._isend(self._slice(source, b), w))
            self.release_log.append((w, self.clocks[w], slowest))
        self._sends[w] = works

    def _post_push(self, w: int) -> list:
        h = wire.header_buffer(self.device)
        works = [self._irecv(h, w)] + [self._irecv(self._slice(self._grads[w], b), w) for b in range(len(self.piece))]
        self._pushes[w] = (h, works)
        return works

    def _wait(self, work, w: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise _WorkerFailed(w, what, exc) from exc

    def _push_kind(self, w: int, expect_clock: Optional[int]) -> int:
        h, _ = self._pushes[w]
        kind, clock = wire.check_header(h, (wire.PUSH, wire.LEAVE), self.name, w)[:2]
        if kind == wire.PUSH and expect_clock is not None and clock != expect_clock:
            raise RuntimeError(f"{self.name}: worker rank {w} pushed its step {clock} in synchronous round "
                               f"{expect_clock}; synchronous workers push once per step, every one of them")
        return kind

    def _adamw(self, lo: int, hi: int, grad: torch.Tensor, scale: torch.Tensor) -> None:
        lr = self.lr(self.steps_taken) if callable(self.lr) else self.lr
        adamw_step(self.master[lo:hi], grad, self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], lr=float(lr),
                   step=self._step, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                   weight_decay=self.weight_decay, grad_scale=scale, backend=self.backend)

    # ------------------------------------------------------------------ synchronous
    def _run_sync(self) -> None:
        live = list(self.workers)
        for w in live:
            self._post_push(w)
        round_ = 0
        while live:
            try:
                for w in live:
                    self._wait(self._pushes[w][1][0], w, f"receiving the header of push {round_}")
                pushers = [w for w in live if self._push_kind(w, round_) == wire.PUSH]
                if pushers:
                    self.steps_taken += 1
                    self._step += 1
                    scale = torch.full((1,), 1.0 / len(pushers), dtype=torch.float32, device=self.device)
                for b in range(len(self.piece)):
                    for w in live:
                        self._wait(self._pushes[w][1][1 + b], w, f"receiving bucket {b} of push {round_}")
                    if pushers:
                        total = self._slice(self._grads[pushers[0]], b)
                        for w in pushers[1:]:
                            total.add_(self._slice(self._grads[w], b))
                        self._adamw(self.offsets[b], self.offsets[b] + self.piece[b], total, scale)
            except _WorkerFailed as failed:
                self._abort(failed, [w for w in live if w != failed.worker], round_)
            for w in live:
                if w not in pushers:
                    self.left_workers.append(w)
            live = pushers
            for w in live:
                self.clocks[w] += 1
                self._send_pull(w, self.master, slowest=self.clocks[w])
                self._post_push(w)
            if live:
                self.step_traffic = self.traffic.step()
            round_ += 1

    def _abort(self, failed: _WorkerFailed, others: List[int], round_: int):
        """A synchronous step cannot go on without a worker: tell the others (an ABORT pull), then raise."""
        self.dead_workers[failed.worker] = str(failed.exc)
        told = []
        for w in others:
            try:
                self._send_pull(w, self.master, slowest=round_, status=wire.ABORT, failed=failed.worker)
                for work in self._sends.pop(w):
                    work.wait(self.layout.timeout)
                told.append(w)
            except RuntimeError:
                pass                   # that worker's link failed too: it errors out on its own
        raise RuntimeError(f"{self.name}: worker rank {failed.worker} failed or timed out in synchronous round "
                           f"{round_} ({failed.what}): {failed.exc}. A synchronous step needs every worker; told "
                           f"worker ranks {told} to stop") from failed.exc

    # ------------------------------------------------------------------ asynchronous
    def _run_async(self) -> None:
        arrivals: "queue.Queue" = queue.Queue()
        waiters = {w: _LinkWaiter(w, arrivals) for w in self.workers}
        waiting: List[int] = []                      # pushed, pull not answered yet
        one = torch.ones(1, dtype=torch.float32, device=self.device)
        for w in self.workers:
            waiters[w].submit(self._post_push(w))
        try:
            while self.live_workers:
                try:
                    w, error = arrivals.get(timeout=3 * self.layout.timeout.total_seconds())
                except queue.Empty:
                    raise RuntimeError(f"{self.name}: no push, leave or link failure from any of workers "
                                       f"{self.live_workers} in {3 * self.layout.timeout}; their waiters are "
                                       f"stuck") from None
                applied = False
                if error is not None:
                    self._declare_dead(w, f"its push {self.clocks[w]} failed or timed out: {error}")
                elif self._push_kind(w, None) == wire.LEAVE:
                    self.left_workers.append(w)
                else:
                    self.steps_taken += 1
                    self._step += 1
                    self._adamw(0, self.master.numel(), self._grads[w], one)
                    self.clocks[w] += 1
                    waiting.append(w)
                    applied = True
                self._release(waiting, waiters)
                if applied:          # since the previous push applied: this push and the pulls it released
                    self.step_traffic = self.traffic.step()
        finally:
            for waiter in waiters.values():
                waiter.stop()

    def _release(self, waiting: List[int], waiters: Dict[int, _LinkWaiter]) -> None:
        """Answer the pulls of the waiting workers at most ``staleness`` pushes ahead of the slowest."""
        waiting[:] = [w for w in waiting if w in self.live_workers]
        progress = True
        while progress and waiting:
            progress = False
            slowest = min(self.clocks[v] for v in self.live_workers)
            for w in list(waiting):
                if self.clocks[w] - slowest > self.staleness:
                    continue
                waiting.remove(w)
                try:
                    self._snapshots[w].copy_(self.master)
                    self._send_pull(w, self._snapshots[w], slowest)
                    waiters[w].submit(self._post_push(w))
                except RuntimeError as exc:          # the link is gone: a worker that died between its push and now
                    self._declare_dead(w, f"sending its pull failed: {exc}")
                    progress = True                  # the slowest may have changed
                    break

    def _declare_dead(self, w: int, reason: str) -> None:
        self.dead_workers[w] = reason
        warnings.warn(f"{self.name}: worker rank {w} is dead ({reason}); serving the remaining worker ranks "
                      f"{self.live_workers} without it", RuntimeWarning, stacklevel=2)


def serve(layout: PSLayout, **options) -> ParameterServerShard:
    """On a server rank of ``layout``: serve the workers until every one has left; returns the shard (its
    state, clocks, dead workers). ``options``: :class:`ParameterServerShard`'s (lr, betas, eps,
    weight_decay, staleness, device, backend)."""
    return ParameterServerShard(layout, **options).run()


__all__ = ["ParameterServerShard", "serve"]
