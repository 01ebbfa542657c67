"""Parameter-server data parallelism: which ranks serve, which work, and what travels between them.

The alternative to :class:`~parallel_layers.data_parallel.DataParallel`'s all-reduce: *server* ranks hold
the parameters, sharded, with their AdamW state and step them; *worker* ranks run forward and backward,
push gradients and pull fresh parameters, and never talk to each other. This module holds what both sides
share: the layout of ranks (:class:`PSLayout`, :func:`ps_layout`), how the flat buffer is cut into buckets
and each bucket into one piece per server (:func:`plan_buckets`), the small headers of the wire protocol,
and the traffic model (:func:`predicted_bytes_per_step`). The worker is :mod:`.worker`
(:class:`ParameterServerWorker`), the server :mod:`.server` (:class:`ParameterServerShard`, :func:`serve`).

Sharding: the worker lays its trained parameters out in one flat fp32 buffer, in buckets (the rules of
:mod:`parallel_layers.data_parallel.buffers`: last layers first, a small first bucket, whole parameters),
each padded to a multiple of ``64 x servers`` elements and cut into one contiguous piece per server.
Server ``s`` owns piece ``s`` of every bucket, so every bucket's push keeps every server busy (BytePS
partitions the same way) and the shards are balanced to within the padding.

One link per (worker, server) pair: a process group of those two ranks, created by :func:`ps_layout`. On
every link the messages follow one fixed order, the same on both ends, with no tags::

    worker -> server   plan header, piece sizes, [worker 0: the initial values of the server's shard]
    server -> worker   pull: header, then the pieces of the buckets in forward order (last bucket first)
    worker -> server   push: header, then the gradient pieces of the buckets in backward order (bucket 0 first)
    ... pull, push, pull ... ; the last push is a LEAVE header (its pieces carry nothing)

Why this maps to NCCL (the ``nccl_rules`` test backend checks it): NCCL ignores tags and matches a pair's
messages in posting order, which the fixed order above gives; and it runs a rank's operations on one
communicator in issue order on one stream, so a posted receive blocks everything the rank posts after it
on that communicator. An asynchronous server must take the push of *whichever* worker comes first; with
one communicator over every rank, a receive posted for worker 0 would block the one for worker 1 (and NCCL
has no wildcard receive). With a communicator per link, the server posts each worker's next push on that
worker's link and waits on each link separately (:mod:`.server` waits on a thread per link, since
gloo's receives only complete inside ``wait()``; under NCCL the same works complete on their own streams).
A worker belongs to ``servers`` links and a server to ``workers`` links: that many communicators per rank.
A failed link is also only that link: a dead worker breaks the two-rank groups it is in, nothing else.

Why c10d point-to-point rather than ``torch.distributed.rpc``: rpc runs over its own TensorPipe agent, not
the process groups the rest of the package (and its NCCL-rules test backend) uses, so none of its
messages could be checked against NCCL's rules or time out like the other groups; it pickles every call
and runs it on a thread pool of the callee, while the server here is a loop that decides when to answer
(bounded staleness holds a pull back); and it has not been actively developed for years (none of
PyTorch's recent distributed components uses it, and its TensorPipe transport is unmaintained). What it
would give (calling a function on the server) is one ``if`` on a header here.

Synchronous (``staleness=0``): each server waits for every worker's piece of a bucket, sums them and steps
that bucket's part of its shard (the average gradient, the package's fused ``adamw_step``) while the rest
of the push still arrives, then sends the shard back in forward order. Workers compute the same thing as
one process on the concatenated batch. Asynchronous with staleness ``k >= 1``: a server applies each
worker's push as an AdamW step of its own as soon as it has arrived, and answers a worker's pull only once
that worker is at most ``k`` pushes ahead of the slowest worker still training; a faster one blocks on its
pull. Details, and what happens when a worker dies, in :mod:`.server`.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..mesh import Timeout, group_timeout

ALIGN = 64                       # elements: each server's piece of a bucket is a multiple of it

# Headers: 8 int64 each. The first element says what the message is, so a link whose ends disagree about
# the protocol fails on the first message instead of reading one kind of message as another.
HEADER_LEN = 8
PLAN, PULL, PUSH, LEAVE = 0x5053_0001, 0x5053_0002, 0x5053_0003, 0x5053_0004
OK, ABORT = 0, 1                 # a pull's status


@dataclass
class PSLayout:
    """Which ranks work and which serve, and the two-rank group of every (worker, server) link.

    ``workers`` and ``servers`` are global ranks; ``links[(worker, server)]`` is the group of that pair
    on the ranks that belong to it. Build it with :func:`ps_layout` (a collective over the world)."""

    workers: List[int]
    servers: List[int]
    rank: int
    timeout: datetime.timedelta
    links: Dict[Tuple[int, int], object] = field(default_factory=dict, repr=False)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_servers(self) -> int:
        return len(self.servers)

    @property
    def is_server(self) -> bool:
        return self.rank in self.servers

    @property
    def is_worker(self) -> bool:
        return self.rank in self.workers

    @property
    def role(self) -> str:
        return "server" if self.is_server else "worker" if self.is_worker else "bystander"

    def link(self, worker: int, server: int):
        """The group of the link between global ranks ``worker`` and ``server`` (on those two ranks only)."""
        try:
            return self.links[(worker, server)]
        except KeyError:
            raise ValueError(f"PSLayout: rank {self.rank} has no link ({worker}, {server}); links exist between "
                             f"workers {self.workers} and servers {self.servers}, on their two ranks only") from None


def ps_layout(num_servers: int = 1, *, ranks: Optional[Sequence[int]] = None,
              timeout: Optional[Timeout] = None) -> PSLayout:
    """The last ``num_servers`` of ``ranks`` (default: every rank of the world) serve; the others work.

    A collective over the world (``dist.new_group`` for every link, in the same order on every rank).
    ``timeout`` (a ``timedelta`` or seconds; default the world group's): how long an operation on a link
    waits for its peer. A synchronous run fails within it when a worker stops answering; an asynchronous
    server declares a worker that has been silent for that long dead and serves the others without it."""
    if not dist.is_initialized():
        raise RuntimeError("ps_layout: call torch.distributed.init_process_group first")
    ranks = list(range(dist.get_world_size())) if ranks is None else [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks) or not all(0 <= r < dist.get_world_size() for r in ranks):
        raise ValueError(f"ps_layout: ranks={ranks} must be distinct ranks of the world (size "
                         f"{dist.get_world_size()})")
    if isinstance(num_servers, bool) or not isinstance(num_servers, int) or not 1 <= num_servers < len(ranks):
        raise ValueError(f"ps_layout: num_servers={num_servers!r} must be an integer in [1, {len(ranks) - 1}] "
                         f"for {len(ranks)} ranks (at least one server and one worker)")
    if timeout is None:
        timeout = group_timeout(dist.group.WORLD)
        if timeout is None:
            raise ValueError(f"ps_layout: the world group's backend ({dist.get_backend()}) does not tell its "
                             f"timeout; pass ps_layout(..., timeout=seconds)")
    elif not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"ps_layout: timeout={timeout!r} must be positive")
    workers, servers = ranks[:-num_servers], ranks[-num_servers:]
    me = dist.get_rank()
    links = {}
    for w in workers:
        for s in servers:
            group = dist.new_group(sorted((w, s)), timeout=timeout,
                                   group_desc=f"parameter-server link worker {w} - server {s}")
            if me in (w, s):
                links[(w, s)] = group
    return PSLayout(workers=workers, servers=servers, rank=me, timeout=timeout, links=links)


# ----------------------------------------------------------------------------------------- buckets
@dataclass
class BucketPlan:
    """The flat layout a worker builds and every server checks: ``params[b]`` (indices into the
    parameter list) fill bucket ``b``, which has ``numel[b]`` elements (padded) starting at ``start[b]``;
    server ``s`` owns ``[start[b] + s * piece[b], start[b] + (s + 1) * piece[b])`` of every bucket."""

    params: List[List[int]]
    numel: List[int]
    start: List[int]
    num_servers: int

    @property
    def piece(self) -> List[int]:
        return [n // self.num_servers for n in self.numel]

    @property
    def total(self) -> int:
        return sum(self.numel)

    @property
    def shard_numel(self) -> int:
        """Elements each server owns: its piece of every bucket."""
        return self.total // self.num_servers

    def piece_range(self, b: int, server_index: int) -> Tuple[int, int]:
        """[start, end) of server ``server_index``'s piece of bucket ``b`` in the flat buffer."""
        q = self.numel[b] // self.num_servers
        return self.start[b] + server_index * q, self.start[b] + (server_index + 1) * q

    def shard_offsets(self) -> List[int]:
        """Where each bucket's piece starts within a server's shard (bucket order)."""
        out, pos = [], 0
        for q in self.piece:
            out.append(pos)
            pos += q
        return out


def plan_buckets(numels: Sequence[int], num_servers: int, *, element_size: int = 4, bucket_cap_mb: float = 25.0,
                 first_bucket_cap_mb: float = 1.0) -> BucketPlan:
    """Buckets over parameters of ``numels`` given in forward order: laid out in reverse (the last layers'
    gradients arrive first in backward), filled greedily up to the caps (the first one smaller, so the
    first push starts early), a parameter never split, each bucket padded to ``ALIGN * num_servers``."""
    align = ALIGN * num_servers
    order = list(reversed(range(len(numels))))
    groups: List[List[int]] = []
    cur: List[int] = []
    cur_bytes = 0
    for i in order:
        cap = (first_bucket_cap_mb if not groups else bucket_cap_mb) * 1024 * 1024
        cur.append(i)
        cur_bytes += numels[i] * element_size
        if cur_bytes >= cap:
            groups.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        groups.append(cur)
    sizes = [max(align, math.ceil(sum(numels[i] for i in g) / align) * align) for g in groups]
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    return BucketPlan(params=groups, numel=sizes, start=starts, num_servers=num_servers)


# ----------------------------------------------------------------------------------------- the wire
def header(kind: int, *values: int, device) -> torch.Tensor:
    """``[kind, *values, 0...]`` as 8 int64 on ``device`` (NCCL moves only device tensors)."""
    if len(values) > HEADER_LEN - 1:
        raise ValueError(f"parameter server: a header holds {HEADER_LEN - 1} values, got {len(values)}")
    return torch.tensor([kind, *values] + [0] * (HEADER_LEN - 1 - len(values)), dtype=torch.int64, device=device)


def header_buffer(device) -> torch.Tensor:
    return torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)


def check_header(h: torch.Tensor, kinds: Sequence[int], who: str, peer: int) -> List[int]:
    """The header's values; a kind other than ``kinds`` means the two ends of a link disagree."""
    values = h.tolist()
    if values[0] not in kinds:
        names = {PLAN: "PLAN", PULL: "PULL", PUSH: "PUSH", LEAVE: "LEAVE"}
        raise RuntimeError(f"{who}: the message from rank {peer} is {names.get(values[0], hex(values[0]))}, expected "
                           f"{' or '.join(names[k] for k in kinds)}: the two ends of the link run different "
                           f"protocols (a worker and a server from different versions, or a rank that is not a "
                           f"parameter-server rank sending on the link)")
    return values


class Traffic:
    """Bytes this rank put on its links and took off them (headers included), counted when posted;
    :meth:`step` marks the end of a step and returns what moved since the previous mark."""

    def __init__(self):
        self.sent = 0
        self.received = 0
        self._mark = (0, 0)

    def as_dict(self) -> Dict[str, int]:
        return {"sent": self.sent, "received": self.received}

    def step(self) -> Dict[str, int]:
        since = {"sent": self.sent - self._mark[0], "received": self.received - self._mark[1]}
        self._mark = (self.sent, self.received)
        return since

    def __repr__(self) -> str:
        return f"Traffic(sent={self.sent}, received={self.received})"


def isend(t: torch.Tensor, peer: int, group, traffic: Traffic):
    traffic.sent += t.numel() * t.element_size()
    return dist.isend(t, dst=peer, group=group)


def irecv(t: torch.Tensor, peer: int, group, traffic: Traffic):
    traffic.received += t.numel() * t.element_size()
    return dist.irecv(t, src=peer, group=group)


def predicted_bytes_per_step(model_bytes: float, workers: int, servers: int) -> Dict[str, float]:
    """Bytes per step and per direction (sent, or received: equal) at each kind of rank: a parameter-server
    worker moves the model once each way whatever the counts; a server moves ``workers / servers`` models
    each way; ``DataParallel``'s ring all-reduce over ``workers`` ranks moves ``2 (n - 1) / n`` models each
    way on every rank. On full-duplex links of equal bandwidth the busiest rank sets the step's
    communication time: ``max(worker, server)`` for the parameter server, ``ring`` for the all-reduce."""
    n = workers
    return {"ps_worker": float(model_bytes), "ps_server": float(model_bytes) * workers / servers,
            "ps_busiest": float(model_bytes) * max(1.0, workers / servers),
            "ring": 2.0 * (n - 1) / n * model_bytes if n > 1 else 0.0}


__all__ = ["PSLayout", "ps_layout", "BucketPlan", "plan_buckets", "Traffic", "predicted_bytes_per_step"]
