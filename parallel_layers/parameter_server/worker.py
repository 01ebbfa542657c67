"""The worker side of parameter-server data parallelism: :class:`ParameterServerWorker`.

A step is the module's forward and ``loss.backward()``, nothing else: there is no optimizer on a worker.

1. Wrap time: the trained parameters move into one flat fp32 buffer (:func:`.protocol.plan_buckets`),
   the plan goes to every server, worker 0 sends each server the initial values of its shard, and the first
   pull is posted: every worker starts from worker 0's parameters, as :class:`DataParallel` starts from
   rank 0's.
2. Forward: a forward pre-hook on every module that owns parameters waits for the pulled pieces of the
   buckets holding them, so the first layers compute while the later buckets still arrive.
3. Backward: a post-accumulate-grad hook copies each gradient into the flat gradient buffer; when the last
   gradient of a bucket has landed (and every bucket before it was pushed: the same order on every link),
   its pieces are sent to their servers at once, overlapping the rest of backward.
4. End of backward (an autograd callback): push what is left, post the pull of every bucket (in forward
   order) and wait for the pushes to be on their way (the gradient buffer is written again next step).

Between a backward and the next forward the parameters are being pulled: :meth:`ParameterServerWorker.synchronize`
waits for them (before reading, evaluating outside the wrapper, or saving). Not synchronised: parameters with
``requires_grad=False`` and buffers, which stay as each worker built them (build them from one seed).
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..weak_hooks import weak_hook
from . import protocol as wire
from .protocol import PSLayout, Traffic


class ParameterServerWorker(nn.Module):
    """Trains ``module`` on this worker rank of ``layout``; the parameters live on the servers.

    ``bucket_cap_mb`` / ``first_bucket_cap_mb``: bucket sizes, as for ``DataParallel`` (a bucket is one
    message per server each way). ``find_unused_parameters``: a parameter without a gradient in a backward
    counts as a zero gradient (the server's AdamW then still moves it by its momentum, unlike torch's
    optimizers, which skip it); without it such a backward raises an error naming the parameters.
    ``wait_per_module=False``: every pull is waited for before the forward, instead of each module's
    buckets just before that module (needed when a parameter is read outside the forward of every module
    that owns it, before they ran).

    ``traffic``: bytes sent and received so far (headers included); ``step_traffic``: those of the last
    step (its push and the pull it posted); ``clock``: pushes made;
    ``staleness_log``: for each pull, how many pushes this worker was ahead of the slowest worker when
    the servers released it (0 in synchronous runs); ``last_push_log``: (bucket, gradients landed by
    then) for each bucket the last backward pushed (fewer than ``len(params)``: it overlapped backward).
    """

    def __init__(self, module: nn.Module, layout: PSLayout, *, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0, find_unused_parameters: bool = False,
                 wait_per_module: bool = True):
        super().__init__()
        if not layout.is_worker:
            raise ValueError(f"ParameterServerWorker: rank {layout.rank} is a {layout.role} of the layout (workers "
                             f"{layout.workers}, servers {layout.servers}); a server rank calls serve(layout, ...)")
        self.module = module
        self.layout = layout
        self.find_unused_parameters = bool(find_unused_parameters)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]   # shared ones listed once
        if not named:
            raise ValueError("ParameterServerWorker: the module has no parameters with requires_grad=True")
        wrong = sorted({str(p.dtype) for _, p in named if p.dtype != torch.float32})
        if wrong:
            raise TypeError(f"ParameterServerWorker: parameters of dtype {wrong}; the servers keep and send fp32 "
                            f"parameters, so cast the module with .float() first")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"ParameterServerWorker: parameters on several devices {sorted(map(str, devices))}; "
                             f"move the module to one device first")
        self.device = devices.pop()
        self._names = {id(p): n for n, p in named}
        self.params = [p for _, p in named]
        self.plan = wire.plan_buckets([p.numel() for p in self.params], layout.num_servers,
                                      bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=first_bucket_cap_mb)
        self._lay_out()
        self.rank = layout.rank
        self.index = layout.workers.index(layout.rank)
        self._links = [(s, layout.link(self.rank, s)) for s in layout.servers]
        self.traffic = Traffic()
        self.clock = 0
        self.staleness_log: List[int] = []
        self.staleness: Optional[int] = None          # the servers' bound, told with the first pull
        self._closed = False
        self._failed: Optional[str] = None
        self._pull_headers: List[Tuple[int, torch.Tensor, object]] = []
        self._pull_works: Dict[int, List[Tuple[int, object]]] = {}
        self._push_works: List[object] = []
        self._reset_backward()
        self.last_push_log: List[Tuple[int, int]] = []
        self._pushed_since_forward = False
        self._handshake()
        self._post_pull()
        self.traffic.step()
        self.step_traffic = {"sent": 0, "received": 0}
        on_grad = weak_hook(self, type(self)._on_grad_ready)      # a strong one would leak the whole model
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
        self.wait_per_module = bool(wait_per_module)
        if self.wait_per_module:
            for m in module.modules():
                own = m.parameters(recurse=False)
                owned = sorted({self._bucket_of[id(p)] for p in own if id(p) in self._bucket_of})
                if owned:
                    self._hooks.append(m.register_forward_pre_hook(self._pre_forward_hook(owned)))

    # ------------------------------------------------------------------ set-up
    def _lay_out(self) -> None:
        plan = self.plan
        with torch.no_grad():
            self.param_buffer = torch.zeros(plan.total, dtype=torch.float32, device=self.device)
            self.grad_buffer = torch.zeros(plan.total, dtype=torch.float32, device=self.device)
            self._bucket_of: Dict[int, int] = {}
            for b, members in enumerate(plan.params):
                pos = plan.start[b]
                for i in members:
                    p = self.params[i]
                    n = p.numel()
                    self.param_buffer[pos:pos + n].copy_(p.detach().reshape(-1))
                    p.data = self.param_buffer[pos:pos + n].view(p.shape)
                    p.main_grad = self.grad_buffer[pos:pos + n].view(p.shape)
                    self._bucket_of[id(p)] = b
                    pos += n
        self._bucket_size = [len(m) for m in plan.params]

    def _handshake(self) -> None:
        """The plan to every server; worker 0 also sends each server the initial values of its shard."""
        plan, works = self.plan, []
        sizes = torch.tensor(plan.piece, dtype=torch.int64, device=self.device)
        init = int(self.index == 0)
        shards = [torch.cat([self._piece(self.param_buffer, b, si) for b in range(len(plan.numel))])
                  for si in range(len(self._links))] if init else []
        for si in range(len(self._links)):
            works.append(self._send(self._header(wire.PLAN, len(plan.numel), plan.shard_numel, self.index, init), si))
            works.append(self._send(sizes, si))
            if init:
                works.append(self._send(shards[si], si))
        self._wait_sends(works, "sending the bucket plan")

    # ------------------------------------------------------------------ the wire
    def _send(self, t: torch.Tensor, si: int):
        s, group = self._links[si]
        try:
            return wire.isend(t, s, group, self.traffic)
        except RuntimeError as exc:          # gloo refuses a send at once on a link whose peer is gone
            self._failed = f"sending to server rank {s}"
            raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): sending to server rank {s} failed: {exc}. "
                               f"The server probably stopped first; see its error.") from exc

    def _recv(self, t: torch.Tensor, si: int):
        s, group = self._links[si]
        return wire.irecv(t, s, group, self.traffic)

    def _header(self, kind: int, *values: int) -> torch.Tensor:
        return wire.header(kind, *values, device=self.device)

    def _piece(self, buffer: torch.Tensor, b: int, si: int) -> torch.Tensor:
        """Server ``si``'s piece of bucket ``b`` in a flat buffer."""
        return buffer[slice(*self.plan.piece_range(b, si))]

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        if self._closed:
            raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): forward after close(); the servers no "
                               f"longer serve this worker")
        if torch.is_grad_enabled():
            self._pushed_since_forward = False
        self._wait_pull_headers()
        if not self.wait_per_module:
            self.synchronize()
        out = self.module(*args, **kwargs)
        self.synchronize()       # buckets no module waited for (never before a backward with a pull in flight)
        return out

    def synchronize(self) -> None:
        """Wait until every pulled parameter has arrived: the parameters are then the servers' latest."""
        self._wait_pull_headers()
        for b in sorted(self._pull_works, reverse=True):
            self._wait_pull_bucket(b)

    def close(self) -> None:
        """Leave: wait for the last pull, then tell every server this worker is done (a server returns
        once every worker has left). The module keeps the last parameters and trains no further."""
        if self._closed:
            return
        self._closed = True
        for h in self._hooks:
            h.remove()
        if self._failed is not None:
            return
        self.synchronize()
        works = []
        for si in range(len(self._links)):
            works.append(self._send(self._header(wire.LEAVE, self.clock, self.plan.shard_numel, self.index), si))
            for b in range(len(self.plan.numel)):      # the pieces a push carries, so both ends stay in step
                works.append(self._send(self._piece(self.grad_buffer, b, si), si))
        self._wait_sends(works, "leaving")

    def __enter__(self) -> "ParameterServerWorker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:     # an error is on its way up: leave without waiting on the servers
            self._failed = self._failed or exc_type.__name__
        self.close()

    # ------------------------------------------------------------------ pulls
    def _pull_timeout(self) -> datetime.timedelta:
        """Twice the link's timeout: a pull waits for the slowest worker's push, and a server needs up to the
        timeout to find a silent worker (it then serves without it, or, when synchronous, tells this worker
        which one failed: a clearer error than this worker's own timeout)."""
        return 2 * self.layout.timeout

    def _post_pull(self) -> None:
        for si, (s, _) in enumerate(self._links):
            h = wire.header_buffer(self.device)
            self._pull_headers.append((s, h, self._recv(h, si)))
            for b in reversed(range(len(self.plan.numel))):    # forward order: the first layers' bucket first
                self._pull_works.setdefault(b, []).append((s, self._recv(self._piece(self.param_buffer, b, si), si)))

    def _wait(self, work, server: int, what: str) -> None:
        try:
            work.wait(self._pull_timeout())
        except RuntimeError as exc:
            self._failed = f"{what} from server rank {server}"
            raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): {what} from server rank {server} failed "
                               f"or timed out: {exc}. The server probably stopped first; see its error.") from exc

    def _wait_pull_headers(self) -> None:
        if not self._pull_headers:
            return
        headers, self._pull_headers = self._pull_headers, []
        ahead = 0
        for s, h, work in headers:
            self._wait(work, s, f"the pull header after push {self.clock}")
            _, status, clock, min_clock, _, staleness, failed = wire.check_header(
                h, (wire.PULL,), f"ParameterServerWorker (rank {self.rank})", s)[:7]
            if status == wire.ABORT:
                self._failed = f"server rank {s} stopped the run"
                raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): server rank {s} stopped the synchronous "
                                   f"run at push {clock}: worker rank {failed} failed or timed out (see the server's "
                                   f"error). A synchronous step needs every worker.")
            self.staleness = staleness
            ahead = max(ahead, clock - min_clock)
        self.staleness_log.append(ahead)

    def _wait_pull_bucket(self, b: int) -> None:
        for s, work in self._pull_works.pop(b, ()):
            self._wait(work, s, f"pulling bucket {b} after push {self.clock}")

    def _pre_forward_hook(self, buckets: List[int]):
        def hook(module, args):
            if self._pull_headers or self._pull_works:
                self._wait_pull_headers()
                for b in buckets:
                    self._wait_pull_bucket(b)
        return hook

    # ------------------------------------------------------------------ pushes
    def _reset_backward(self) -> None:
        self._ready: set = set()
        self._ready_count = [0] * len(self.plan.numel)
        self._next = 0                  # the lowest bucket not pushed yet
        self._callback_queued = False
        self._push_log: List[Tuple[int, int]] = []

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._pushed_since_forward:
            raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): a second backward through the same "
                               f"forward ({self._names[id(p)]} got a gradient after this step's push); run a "
                               f"forward for every backward")
        if id(p) in self._ready:
            raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): parameter {self._names[id(p)]} got its "
                               f"gradient twice in one backward; its bucket was already pushed")
        with torch.no_grad():
            p.main_grad.copy_(p.grad)
        p.grad = None                   # the gradient lives in the flat buffer; nothing reads .grad here
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_push)
        self._mark_ready(p)

    def _mark_ready(self, p) -> None:
        self._ready.add(id(p))
        self._ready_count[self._bucket_of[id(p)]] += 1
        # strictly in bucket order: every link carries the buckets in the order its server receives them
        while self._next < len(self._bucket_size) and self._ready_count[self._next] == self._bucket_size[self._next]:
            self._push_bucket(self._next)
            self._next += 1

    def _push_bucket(self, b: int) -> None:
        self._push_log.append((b, len(self._ready)))
        for si in range(len(self._links)):
            if b == 0:
                head = self._header(wire.PUSH, self.clock, self.plan.shard_numel, self.index)
                self._push_works.append(self._send(head, si))
            self._push_works.append(self._send(self._piece(self.grad_buffer, b, si), si))

    def _finish_push(self) -> None:
        missing = [p for p in self.params if id(p) not in self._ready]
        with torch.no_grad():
            for p in missing:           # zeros keep the protocol (every bucket goes out); raised about below
                p.main_grad.zero_()
                self._mark_ready(p)
        self.clock += 1
        self.last_push_log = self._push_log
        self._reset_backward()
        self._pushed_since_forward = True
        self._post_pull()
        self.step_traffic = self.traffic.step()
        works, self._push_works = self._push_works, []
        self._wait_sends(works, f"push {self.clock - 1}")
        if missing and not self.find_unused_parameters:
            names = [self._names[id(p)] for p in missing]
            raise RuntimeError(
                f"ParameterServerWorker (rank {self.rank}): {len(names)} parameter(s) got no gradient in this "
                f"backward: {', '.join(names)}. They were pushed as zeros (the servers' AdamW still moves them by "
                f"momentum). Make every parameter take part in the loss, set requires_grad=False on unused "
                f"ones, or pass find_unused_parameters=True")

    def _wait_sends(self, works, what: str) -> None:
        for work in works:
            try:
                work.wait()
            except RuntimeError as exc:
                self._failed = what
                raise RuntimeError(f"ParameterServerWorker (rank {self.rank}): {what} failed or timed out: {exc}. "
                                   f"A server probably stopped first; see its error.") from exc


__all__ = ["ParameterServerWorker"]
