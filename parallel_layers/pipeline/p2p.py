"""Point-to-point transfer of activations (forward) and gradients (backward) over the ``pp_group``.

One communication step of a schedule is a list of sends and receives posted together. Two ways, chosen
by the group's backend (``P2P.ordered``): this file posts and waits for the messages; which messages a
step posts, and when, is the step's transport (:mod:`.transport`: ``OrderedTransport``,
``LookAheadTransport``), all the engine talks to:

- NCCL (and any backend but gloo, the NCCL-rules test backend included): one ``dist.batch_isend_irecv``
  per step, tag 0. NCCL ignores tags, matches the messages of a pair in posting order, runs a rank's
  operations on the group in issue order on one stream and returns ONE Work for the whole batch: every
  receive of the step waits on that Work, and nothing is posted ahead of the step that needs it.
- gloo: plain ``isend``/``irecv`` (torch issues a batch's ops one by one on gloo anyway, and the batching
  machinery only adds host time to every message), tags for the shape headers, receives posted ahead.

The caller waits for the receives at once and for the sends lazily (:meth:`P2P.drain`).

On gloo, receives are posted by a background thread (one per ``P2P``, in order, so they still match
first-in-first-out): posting takes gloo's lock of the connection, which gloo's own thread holds while
it moves a message, and on a busy CPU that thread is sometimes descheduled holding it. Measured in
the engine (1F1B, p=2, m=8, 2 cores): a post took a median of 40-55 us and at worst 4-7 ms on the
compute thread. A/B in the same processes (15 reps, p=2, m=8), bubble with the thread against without:
1F1B 0.137 against 0.143 on the benchmark's representative model (d 256), 0.19 against 0.23 on its small
one (d 128), interleaved 0.22 against 0.30 on the small one. Sends stay on the caller's thread. When its
receive is already waiting, gloo writes the message into the socket right there: for the benchmark's
256 KB activation that took a median of 0.24-0.29 ms per send (1F1B, p=2, m=8, 10 steps). Handing
sends to the thread as well measured worse for 1F1B (0.140 against 0.134), each message then waiting
for the thread to wake; a separate sending thread was no clear gain in two A/B runs (0.1355 against
0.1269, 0.1311 against 0.1339).

Shapes travel once per step and link: before the first activation of a step on a link, the sender
posts a small int64 header ``[ndim, dtype, *shape]``; the receiver allocates from it (gradients have the
shape of the activation the rank itself sent, so they need no header). If the user declared
``tensor_shape`` both ends check the header against it and raise the same clear ``ValueError``.

Timeouts: a wait uses the process group's timeout (create the pipeline's group with
``dist.new_group(timeout=...)`` for a short one), and a failed wait is re-raised naming this rank, the
message and the peer, since the usual cause is a peer that raised first.
"""
from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed.worker import OrderedWorker

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
HEADER_LEN = 8  # ndim, dtype code, up to 6 dims
HEADER_TAG = 7
RESHAPE_TAG = 8  # an activation whose shape changed since the last step (transport.LookAheadTransport)


def encode_header(t: torch.Tensor, device: Optional[torch.device] = None) -> torch.Tensor:
    """``[ndim, dtype code, *shape, 0...]`` as int64 on ``device`` (NCCL moves only device tensors)."""
    if t.dim() > HEADER_LEN - 2:
        raise ValueError(f"pipeline p2p: activations of {t.dim()} dims are not supported (at most {HEADER_LEN - 2})")
    if t.dtype not in _DTYPES:
        raise ValueError(f"pipeline p2p: activation dtype {t.dtype} is not supported ({_DTYPES})")
    values = [t.dim(), _DTYPES.index(t.dtype), *t.shape] + [0] * (HEADER_LEN - 2 - t.dim())
    return torch.tensor(values, dtype=torch.int64, device=device if device is not None else t.device)


def header_buffer(device: Optional[torch.device]) -> torch.Tensor:
    return torch.empty(HEADER_LEN, dtype=torch.int64, device=device)


def decode_header(h: torch.Tensor) -> Tuple[Tuple[int, ...], torch.dtype]:
    values = h.tolist()
    ndim, code = values[0], values[1]
    return tuple(values[2:2 + ndim]), _DTYPES[code]


def peer_failure(pp_rank: int, what: str, exc: BaseException) -> RuntimeError:
    """The error a pipeline rank raises when a message or collective with its neighbours fails or times
    out: it names the rank and what it waited for, and points at the usual cause."""
    return RuntimeError(f"pipeline rank {pp_rank} (global rank {dist.get_rank()}): {what} failed or timed out: "
                        f"{exc}. A neighbouring stage probably raised first; see its error.")


class _Posted:
    """A send or receive handed to the posting thread: waits for its posting, then for the c10d work."""

    def __init__(self, posting, works: list, index: int):
        self.posting, self.works, self.index = posting, works, index

    def is_completed(self) -> bool:
        return self.posting.is_completed() and self.works[self.index].is_completed()

    def wait(self) -> bool:
        self.posting.wait()
        return self.works[self.index].wait()


class _Batch:
    """The Works of one ``batch_isend_irecv`` (one on NCCL), waited for together."""

    def __init__(self, works: list):
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class P2P:
    """Sends and receives between pipeline ranks of ``group`` (peers named by their rank in the group).
    ``ordered``: NCCL's rules apply (any backend but gloo; see the module docstring). ``background``:
    post gloo's receives on a thread of its own (default: on gloo)."""

    def __init__(self, group, device: Optional[torch.device] = None, background: Optional[bool] = None):
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.device = device or torch.device("cpu")
        self._pending_sends: List[Tuple[object, object, str]] = []
        self.ordered = dist.get_backend(group) != "gloo"
        self.background = (not self.ordered) if background is None else background
        self._poster, self._poster_pid = None, None

    def post(self, ops: Sequence[Tuple[str, torch.Tensor, int, str]], tag: int = 0) -> List[Tuple[object, str]]:
        """Post ``(kind, tensor, peer, what)`` ops (kind ``"send"``/``"recv"``); returns the receives'
        works (``(work, what)``) to wait on. Sends are kept (with their tensors alive) until drained.
        ``tag`` (gloo only): headers use their own tag, so they form a FIFO channel apart from the data.
        ``ordered``: the ops form one batch with one Work, and every receive waits on it."""
        if not ops:
            return []
        if self.ordered:
            if tag:
                raise ValueError(f"pipeline p2p: tag {tag} on a {dist.get_backend(self.group)} group, which "
                                 f"ignores tags (NCCL matches a pair's messages in posting order)")
            batch = _Batch(dist.batch_isend_irecv(
                [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, self.ranks[peer], self.group)
                 for kind, t, peer, _ in ops]))
            sent = [t for kind, t, _, _ in ops if kind == "send"]
            if sent:
                self._pending_sends.append((batch, sent, "; ".join(w for k, _, _, w in ops if k == "send")))
            self._reap()
            return [(batch, what) for kind, _, _, what in ops if kind == "recv"]
        if self.background:    # receives on the thread, sends at once (each kind stays in order)
            recv_ops = [op for op in ops if op[0] == "recv"]
            later = iter(self._post_in_background(recv_ops, tag) if recv_ops else [])
            now = iter(self._post_now([op for op in ops if op[0] == "send"], tag))
            works = [next(later) if op[0] == "recv" else next(now) for op in ops]
        else:
            works = self._post_now(ops, tag)
        recvs = []
        for (kind, t, _peer, what), work in zip(ops, works):
            if kind == "send":
                self._pending_sends.append((work, t, what))
            else:
                recvs.append((work, what))
        self._reap()
        return recvs

    def _post_in_background(self, ops, tag: int) -> list:
        if self._poster is None or self._poster_pid != os.getpid():   # (a forked child has no such thread)
            self._poster, self._poster_pid = OrderedWorker("parallel_layers-p2p"), os.getpid()
        works: list = []
        # the message itself is named by the caller's wait (_wait_one), so no per-post description is built
        posting = self._poster.submit(lambda: works.extend(self._post_now(ops, tag)), "posting receives")
        return [_Posted(posting, works, i) for i in range(len(ops))]

    def _post_now(self, ops, tag: int) -> list:
        """gloo: one ``isend``/``irecv`` per op, in order."""
        return [(dist.isend if kind == "send" else dist.irecv)(t, self.ranks[peer], group=self.group, tag=tag)
                for kind, t, peer, _ in ops]

    def wait(self, works: Sequence[Tuple[object, str]]) -> None:
        for work, what in works:
            self._wait_one(work, what)

    def _wait_one(self, work, what: str) -> None:
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with the pipeline context
            raise peer_failure(self.rank, what, exc) from exc

    def _reap(self) -> None:
        """Forget sends that have completed, freeing their buffers early. (A gloo work reports completion
        only once waited for, so on gloo the sent tensors, one output and one input gradient per
        microbatch, live until :meth:`drain` at the end of the step.)"""
        self._pending_sends = [(w, t, what) for w, t, what in self._pending_sends if not w.is_completed()]

    def drain(self) -> None:
        """Wait for every posted send (end of a step)."""
        pending, self._pending_sends = self._pending_sends, []
        for work, _, what in pending:
            self._wait_one(work, what)


__all__ = ["P2P", "encode_header", "decode_header", "header_buffer", "peer_failure", "HEADER_LEN", "HEADER_TAG",
           "RESHAPE_TAG"]
