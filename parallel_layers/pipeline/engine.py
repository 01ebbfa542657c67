"""Executes a pipeline schedule: the instruction list of this rank, one instruction at a time.

``PipelineEngine(chunks, pp_group, schedule=..., num_microbatches=m)``; ``engine.step(inputs, targets)``
splits the batch into ``m`` microbatches along dim 0, runs this rank's instructions and leaves the
accumulated gradients in the chunks' parameters (call ``zero_grad`` before, the optimizer after). The
last stage's loss of every microbatch is scaled by ``1 / m`` before its backward, so for a mean loss
over equal microbatches the accumulated gradients equal the full batch's. Returns the mean loss over
microbatches (on every pipeline rank when ``broadcast_loss``, else on the last stage only, None
elsewhere). ``engine.evaluate(inputs, targets)`` returns the same mean loss from a forward-only pass
(validation: eval mode, no gradients, nothing kept between microbatches).

A chunk is any module ``chunk(x, targets=None)``: stage 0 receives the microbatch of ``inputs``; the
last stage receives ``targets`` and returns a scalar loss; every other stage maps a tensor to a tensor.
Every step records this rank's timeline (compute and message waits, a few ``perf_counter`` calls per
instruction; :meth:`gather_timeline`, :meth:`bubble_fraction`, :meth:`draw_timeline`); no barrier is
taken for it, so ``record_timeline`` changes nothing and is kept for compatibility.

Receives are posted one communication step ahead of need where their shape is known (see
:meth:`PipelineEngine._prefetch`), so a message's transfer overlaps the computation before it. The
first activation of a link in a step is posted ahead too, in the shape the link carried last step
(see :meth:`PipelineEngine._recv_buffer`): on gloo a message whose receive is not yet posted waits
for the receiver's "ready" and is then written by the sender's gloo thread, which on a busy machine
wakes up milliseconds late (measured: the first activation of every step arrived 4-5 ms after it
was sent, against about 0.2 ms for a message whose receive was waiting).

Chunks with a ``finish_grads()`` method (``GPTStage``: tied embeddings, sequence-parallel grads) have it
called once after the schedule.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..distributed import collectives as C
from .p2p import HEADER_LEN, HEADER_TAG, P2P, RESHAPE_TAG, decode_header, encode_header, peer_failure
from .schedules import Instr, build_schedule, check_schedule_args, format_schedule
from .timeline import Timeline, bubble_breakdown, bubble_fraction, draw, gather_timelines


class _Program:
    """One instruction list of this rank and what the engine derives from it once: the first activation
    receive of each chunk (its link needs a shape header), in schedule order, and the index of the
    communication step after each communication step."""

    def __init__(self, steps: List):
        self.steps = steps
        self.forward_only = not any(isinstance(st, Instr) and st.op == "B" for st in steps)
        self.header_links: Dict[int, Instr] = {}
        for st in steps:
            if not isinstance(st, Instr):
                for ins in st:
                    if ins.op == "RECV_ACT" and ins.chunk not in self.header_links:
                        self.header_links[ins.chunk] = ins
        comm = [i for i, st in enumerate(steps) if not isinstance(st, Instr)]
        self.next_comm: Dict[int, Optional[int]] = {a: b for a, b in zip(comm, comm[1:] + [None])}
        self.first_comm: Optional[int] = comm[0] if comm else None


class PipelineEngine:
    def __init__(self, chunks: Sequence[nn.Module], pp_group, *, schedule: str = "1f1b", num_microbatches: int,
                 tensor_shape: Optional[Sequence[int]] = None, broadcast_loss: bool = True,
                 record_timeline: bool = False, device: Optional[torch.device] = None):
        self.chunks = list(chunks)
        if not self.chunks:
            raise ValueError("PipelineEngine: no chunks given")
        self.group = pp_group
        self.p, self.rank = C.world_size(pp_group), C.rank(pp_group)
        self.v, self.m = len(self.chunks), num_microbatches
        self.S = self.p * self.v
        check_schedule_args(schedule, self.p, num_microbatches, self.v)
        self.schedule = schedule
        self.steps = build_schedule(schedule, self.p, num_microbatches, self.rank, self.v)
        self.tensor_shape = None if tensor_shape is None else tuple(int(x) for x in tensor_shape)
        self.broadcast_loss = broadcast_loss
        self.record_timeline = record_timeline
        self.device = device
        self.p2p = P2P(pp_group, device) if self.p > 1 else None
        self._train = _Program(self.steps)
        self._eval: Optional[_Program] = None          # built on the first evaluate()
        self._header_links = self._train.header_links  # of the program running now
        self._hdr_in: Dict[int, Tuple[object, torch.Tensor, Instr]] = {}
        # chunk -> (shape, dtype) of the activations its link carried in the last step, as received
        # (from the header) and as sent; both ends update them from the same headers, so they agree on
        # whether the link's first receive was posted ahead in that shape
        self._link_meta: Dict[int, Tuple[tuple, torch.dtype]] = {}
        self._sent_meta: Dict[int, Tuple[tuple, torch.dtype]] = {}
        self.timeline = Timeline(self.rank)
        self.last_timelines: Optional[List[Timeline]] = None
        self.prefetched_receives = 0

    # ------------------------------------------------------------------ helpers
    def stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def describe(self) -> str:
        return f"{self.schedule}, rank {self.rank} of {self.p}, {self.v} chunk(s), {self.m} microbatches:\n" + \
            format_schedule(self.steps)

    def _split(self, t: Optional[torch.Tensor], name: str, needed: bool) -> Optional[List[torch.Tensor]]:
        if not needed:
            return None
        if t is None:
            raise ValueError(f"PipelineEngine.step: pipeline rank {self.rank} holds stage "
                             f"{'0' if name == 'inputs' else self.S - 1} and needs {name}")
        if t.shape[0] % self.m:
            raise ValueError(f"PipelineEngine.step: batch of {t.shape[0]} does not split into {self.m} equal "
                             f"microbatches; use a batch size that is a multiple of num_microbatches")
        return list(t.chunk(self.m, dim=0))

    def _timed(self, op, mb, chunk, fn):
        t0 = time.perf_counter()
        out = fn()
        self.timeline.record(op, mb, chunk, t0, time.perf_counter())
        return out

    # ------------------------------------------------------------------ one step
    def step(self, inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None):
        """One training step: forward and backward of every microbatch (see the module docstring)."""
        return self._run(self._train, inputs, targets)

    def evaluate(self, inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None):
        """The mean loss over the microbatches of ``inputs``/``targets``, forward only (Megatron-LM's
        ``forward_only``, DeepSpeed's ``eval_batch``): the schedule's forward-only instruction list
        (:func:`~parallel_layers.pipeline.schedules.build_schedule`), under ``torch.no_grad`` with the
        chunks in eval mode (no dropout; every module's own mode is restored after). No gradient is
        touched and nothing is kept between microbatches. The batch may differ in shape from the
        training batches (a multiple of ``num_microbatches``; a declared ``tensor_shape`` still holds).
        The timeline of the last training step is kept. A collective over the pipeline group, like
        :meth:`step`; returns the loss where :meth:`step` does."""
        if self._eval is None:
            self._eval = _Program(build_schedule(self.schedule, self.p, self.m, self.rank, self.v, forward_only=True))
        modes = [(m, m.training) for c in self.chunks for m in c.modules()]   # each module's own, restored
        kept, self.timeline = self.timeline, Timeline(self.rank)
        try:
            for c in self.chunks:
                c.eval()
            with torch.no_grad():
                return self._run(self._eval, inputs, targets)
        finally:
            for m, mode in modes:
                m.training = mode
            self.timeline = kept

    def _run(self, prog: _Program, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]):
        holds_first, holds_last = 0 in map(self.stage, range(self.v)), self.S - 1 in map(self.stage, range(self.v))
        mb_inputs = self._split(inputs, "inputs", holds_first)
        mb_targets = self._split(targets, "targets", holds_last)
        train = not prog.forward_only
        inputs_of: Dict[Tuple[int, int], torch.Tensor] = {}   # (mb, chunk) -> input (requires grad)
        outputs: Dict[Tuple[int, int], torch.Tensor] = {}     # (mb, chunk) -> output, or scaled loss
        out_grads: Dict[Tuple[int, int], torch.Tensor] = {}   # (mb, chunk) -> d loss / d output
        in_grads: Dict[Tuple[int, int], torch.Tensor] = {}    # (mb, chunk) -> d loss / d input, to send
        recv_shape: Dict[int, Tuple[tuple, torch.dtype]] = {}  # chunk -> activation shape this step
        header_sent: set = set()
        losses: List[torch.Tensor] = []
        prefetched: Dict[Instr, Tuple[object, torch.Tensor]] = {}  # receive -> (work, buffer), posted early
        self._guessed: Dict[Instr, Tuple[tuple, torch.dtype]] = {}  # first receives posted in last step's shape
        self._header_links = prog.header_links
        self.prefetched_receives = 0                                 # how many, this step (tests, tuning)
        self.timeline.start()
        if prog.header_links:
            # Every shape header this rank will receive, posted now (own tag, first-in-first-out per peer
            # in the order the schedule first needs each link, which is the order the peer sends them):
            # a header then lands as soon as it is sent, and the first activation of a link can be
            # prefetched like the others once its header is in.
            ops = [("recv", torch.empty(HEADER_LEN, dtype=torch.int64), ins.peer, f"receive header {ins}")
                   for ins in prog.header_links.values()]
            works = self.p2p.post(ops, tag=HEADER_TAG)
            self._hdr_in = {c: (w, op[1], ins) for (c, ins), op, w in zip(prog.header_links.items(), ops, works)}
            self._prefetch(prog.steps[prog.first_comm], outputs, recv_shape, prefetched)

        for i, step in enumerate(prog.steps):
            if isinstance(step, Instr):
                mb, c = step.mb, step.chunk
                s = self.stage(c)
                if step.op == "F":
                    if s == 0:
                        x = mb_inputs[mb]
                    elif self.p == 1:              # previous stage on this rank: local hand-off
                        if train:
                            x = inputs_of[(mb, c)] = outputs[(mb, c - 1)].detach().requires_grad_()
                        else:                      # nothing is kept for a backward
                            x = outputs.pop((mb, c - 1)).detach()
                    else:
                        x = inputs_of[(mb, c)] if train else inputs_of.pop((mb, c))
                    if s == self.S - 1:
                        loss = self._timed("F", mb, c, lambda: self.chunks[c](x, mb_targets[mb]))
                        losses.append(loss.detach())
                        if train:
                            outputs[(mb, c)] = loss / self.m
                    else:
                        outputs[(mb, c)] = self._timed("F", mb, c, lambda: self.chunks[c](x))
                else:
                    out = outputs.pop((mb, c))
                    grad = None if s == self.S - 1 else out_grads.pop((mb, c))
                    self._timed("B", mb, c, lambda: torch.autograd.backward(out, grad))
                    x = inputs_of.pop((mb, c), None)
                    if x is not None:
                        if self.p == 1:
                            out_grads[(mb, c - 1)] = x.grad
                        else:
                            in_grads[(mb, c)] = x.grad
                continue
            self._communicate(step, outputs, inputs_of, out_grads, in_grads, recv_shape, header_sent, prefetched,
                              train)
            nxt = prog.next_comm[i]
            if nxt is not None:
                self._prefetch(prog.steps[nxt], outputs, recv_shape, prefetched)

        if self.p2p is not None:
            self.p2p.drain()
        self.timeline.stop()
        seen = set()
        for chunk in self.chunks if train else ():
            if hasattr(chunk, "finish_grads") and id(chunk) not in seen:
                seen.add(id(chunk))
                chunk.finish_grads()
        loss = torch.stack(losses).mean() if losses else None
        if self.broadcast_loss and self.p > 1:
            buf = loss.clone() if loss is not None else torch.zeros((), dtype=self._loss_dtype())
            try:
                C.broadcast(buf, self.p - 1, self.group)   # stage S - 1 lives on pipeline rank p - 1
            except Exception as exc:  # noqa: BLE001 - forward-only, the first stage may wait only here
                raise peer_failure(self.rank, "the loss broadcast from the last stage", exc) from exc
            loss = buf
        return loss

    def _loss_dtype(self):
        return next(self.chunks[0].parameters()).dtype

    def _recv_buffer(self, ins, outputs, recv_shape) -> Optional[torch.Tensor]:
        """The buffer a receive lands in, or None while its shape is unknown (activation: no header yet
        this step; gradient: the forward whose output it belongs to has not run yet).

        The first activation of a link, before its header is in, gets a buffer in the shape the link
        carried last step (guessed; checked against the header when it is waited for). If the sender's
        shape changed, it sends an empty message of the old shape to fill the guessed receive in its
        first-in-first-out place and the real activation on ``RESHAPE_TAG`` (:meth:`_communicate`):
        a changed shape costs one extra message, never a wrong match."""
        if ins.op == "RECV_ACT":
            meta = self._take_header(ins.chunk, recv_shape, block=False)
            if meta is None:
                meta = self._link_meta.get(ins.chunk)
                if meta is None or self._header_links.get(ins.chunk) is not ins:
                    return None
                self._guessed[ins] = meta
            shape, dtype = meta
            return torch.empty(shape, dtype=dtype, device=self.device)
        out = outputs.get((ins.mb, ins.chunk))
        return None if out is None else torch.empty(out.shape, dtype=out.dtype, device=out.device)

    def _take_header(self, chunk, recv_shape, block: bool):
        """The (shape, dtype) of ``chunk``'s incoming activations this step, from its header (waited for
        when ``block``, else None while it has not arrived); checked against ``tensor_shape``."""
        if chunk in recv_shape:
            return recv_shape[chunk]
        work, h, ins = self._hdr_in[chunk]
        if not block and not work[0].is_completed():
            return None
        self.p2p.wait([work])
        del self._hdr_in[chunk]
        recv_shape[chunk] = self._link_meta[chunk] = decode_header(h)
        if self.tensor_shape is not None:
            self._check_shape(recv_shape[chunk][0], ins, sending=False)
        return recv_shape[chunk]

    def _prefetch(self, batch, outputs, recv_shape, prefetched) -> None:
        """Post the receives of the next communication step now, so their transfers run while this
        rank computes (gloo moves a message only once both ends have posted it: a receive posted just
        before it is needed leaves the whole hand-shake and copy on the critical path). Only a prefix of
        the step's receives, in order, so that messages still match first-in-first-out per peer; at most
        one step ahead, so at most one extra buffer per link is alive.

        Called after the current step's wait, not before it: posting them before the wait measured worse
        on gloo (interleaved 1F1B, p=2 m=8, 2 x 9 reps A/B: bubble median 0.16-0.17 against 0.10-0.12),
        probably because gloo's thread then copies each message in as it arrives, during this rank's
        compute, instead of in the wait."""
        ops, keys = [], []
        for ins in batch:
            if not ins.op.startswith("RECV"):
                continue
            buf = self._recv_buffer(ins, outputs, recv_shape)
            if buf is None:
                break
            ops.append(("recv", buf, ins.peer, f"receive {ins}"))
            keys.append((ins, buf))
        if ops:
            for (ins, buf), work in zip(keys, self.p2p.post(ops)):
                prefetched[ins] = (work, buf)
            self.prefetched_receives += len(ops)

    def _communicate(self, batch, outputs, inputs_of, out_grads, in_grads, recv_shape, header_sent, prefetched,
                     train: bool = True):
        """One batch of messages. Activation shapes travel in a header (first message of a link in
        this step, on its own tag; the receives for them are posted at the start of the step), then the
        data; only receives are waited for. Receives posted ahead by :meth:`_prefetch` are not posted
        again. ``train=False`` (forward only): an output is dropped once sent, and a received activation
        does not require grad."""
        t0 = time.perf_counter()
        hdr_ops, reshaped = [], {}   # reshaped: first send of a link whose shape changed -> last step's meta
        for ins in batch:
            if ins.op == "SEND_ACT" and ins.chunk not in header_sent:
                header_sent.add(ins.chunk)
                out = outputs[(ins.mb, ins.chunk)]
                hdr_ops.append(("send", encode_header(out), ins.peer, f"send header {ins}"))
                meta, last = (tuple(out.shape), out.dtype), self._sent_meta.get(ins.chunk)
                if last is not None and last != meta:
                    reshaped[ins] = last
                self._sent_meta[ins.chunk] = meta
        if hdr_ops:
            self.p2p.post(hdr_ops, tag=HEADER_TAG)
            for ins in batch:                       # both ends check what the user declared
                if ins.op == "SEND_ACT" and self.tensor_shape is not None:
                    try:
                        self._check_shape(tuple(outputs[(ins.mb, ins.chunk)].shape), ins, sending=True)
                    except ValueError:
                        # deliver the header first (a send dies with its buffer), so the receiver
                        # raises the same clear error instead of timing out
                        try:
                            self.p2p.drain()
                        except RuntimeError:
                            pass
                        raise
        for ins in batch:
            if ins.op == "RECV_ACT" and (ins not in prefetched or ins in self._guessed):
                self._take_header(ins.chunk, recv_shape, block=True)
        ops, received, waits, reshape_ops = [], [], [], []
        for ins in batch:
            key = (ins.mb, ins.chunk)
            if ins in prefetched:
                work, buf = prefetched.pop(ins)
                waits.append(work)
                guess = self._guessed.pop(ins, None)
                if guess is not None and guess != recv_shape[ins.chunk]:
                    # the shape changed: the guessed receive gets the sender's filler, the data comes apart
                    shape, dtype = recv_shape[ins.chunk]
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    reshape_ops.append(("recv", buf, ins.peer, f"receive {ins} (new shape)"))
                received.append((ins, buf))
                continue
            if ins.op == "SEND_ACT":
                out = (outputs[key] if train else outputs.pop(key)).detach()
                if tuple(out.shape) != recv_shape.get(("sent", ins.chunk), tuple(out.shape)):
                    raise ValueError(f"pipeline stage {self.stage(ins.chunk)}: microbatch {ins.mb} output has shape "
                                     f"{tuple(out.shape)} but earlier microbatches had "
                                     f"{recv_shape[('sent', ins.chunk)]}; microbatches must have equal shapes")
                recv_shape[("sent", ins.chunk)] = tuple(out.shape)
                if ins in reshaped:    # fill the receive the peer posted in last step's shape, then the data
                    shape, dtype = reshaped[ins]
                    ops.append(("send", torch.empty(shape, dtype=dtype, device=out.device), ins.peer,
                                f"send {ins} (filler in last step's shape)"))
                    reshape_ops.append(("send", out.contiguous(), ins.peer, f"send {ins} (new shape)"))
                    continue
                ops.append(("send", out.contiguous(), ins.peer, f"send {ins}"))
            elif ins.op == "SEND_GRAD":
                g = in_grads.pop(key)
                ops.append(("send", g.contiguous(), ins.peer, f"send {ins}"))
            else:  # RECV_ACT: shape from the header; RECV_GRAD: the shape of the activation this rank sent
                buf = self._recv_buffer(ins, outputs, recv_shape)
                ops.append(("recv", buf, ins.peer, f"receive {ins}"))
                received.append((ins, buf))
        waits += self.p2p.post(ops)
        self.p2p.wait(waits + self.p2p.post(reshape_ops, tag=RESHAPE_TAG))
        for ins, buf in received:
            key = (ins.mb, ins.chunk)
            if ins.op == "RECV_ACT":
                inputs_of[key] = buf.requires_grad_(train and buf.is_floating_point())
            else:
                out_grads[key] = buf
        if received:
            first = received[0][0]
            self.timeline.record("W", first.mb, first.chunk, t0, time.perf_counter())

    def _check_shape(self, shape, ins, sending: bool):
        if shape != self.tensor_shape:
            s = self.stage(ins.chunk)
            other = s + 1 if sending else s - 1
            raise ValueError(f"pipeline: stage {other if not sending else s} sends activations of shape {shape} to "
                             f"stage {s if not sending else other}, but the declared tensor_shape is "
                             f"{self.tensor_shape}; fix the stage split or tensor_shape (microbatch {ins.mb})")

    # ------------------------------------------------------------------ timeline
    def gather_timeline(self) -> Optional[List[Timeline]]:
        """All ranks' timelines of the last step on pipeline rank 0 (None elsewhere); a collective."""
        self.last_timelines = gather_timelines(self.timeline, self.group if self.p > 1 else None)
        return self.last_timelines

    def bubble_fraction(self) -> Optional[float]:
        """Measured bubble of the last step (call :meth:`gather_timeline` first; rank 0 only)."""
        return None if self.last_timelines is None else bubble_fraction(self.last_timelines)

    def bubble_breakdown(self) -> Optional[Dict[str, float]]:
        """Where the last step's bubble came from (schedule, stage imbalance and jitter, engine time,
        message latency): :func:`timeline.bubble_breakdown` on the gathered timelines (call
        :meth:`gather_timeline` first; rank 0 only)."""
        if self.last_timelines is None:
            return None
        return bubble_breakdown(self.last_timelines, self.schedule, self.m, self.v)

    def draw_timeline(self, path: str, title: Optional[str] = None) -> Optional[str]:
        """Gathers (a collective) and, on pipeline rank 0, writes the PNG; returns its path there."""
        tls = self.gather_timeline()
        if tls is None:
            return None
        return draw(tls, path, title or f"{self.schedule}: p={self.p}, m={self.m}, chunks={self.v}")


__all__ = ["PipelineEngine"]
