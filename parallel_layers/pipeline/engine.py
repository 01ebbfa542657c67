"""Executes a pipeline schedule: the instruction list of this rank, one instruction at a time.

``PipelineEngine(chunks, pp_group, schedule=..., num_microbatches=m)``; ``engine.step(inputs, targets)``
splits the batch into ``m`` microbatches along dim 0, runs this rank's instructions and leaves the
accumulated gradients in the chunks' parameters (call ``zero_grad`` before, the optimizer after). The
loss is token-weighted (:mod:`.token_loss`): the mean over the labels of the whole batch that are not
``ignore_index``, as torch computes it on one process, whatever the micro-batches' share of ignored
labels; each micro-batch's backward runs on ``its loss sum / the batch's count`` (for equal micro-batches
without ignored labels, exactly ``its mean / m``). Returns that mean as a 0-dim fp32 tensor (on every
pipeline rank when ``broadcast_loss``, else on the last stage only, None elsewhere).
``engine.step(..., loss_denominator=D)`` divides by ``D`` instead of the batch's own count (a data-parallel
replica of a global batch: the global count over the replicas whose gradients are averaged).
``engine.evaluate(inputs, targets)`` returns the same mean loss from a forward-only pass (validation: eval
mode, no gradients, nothing kept between microbatches).

A chunk is any module ``chunk(x, targets=None)``: stage 0 receives the microbatch of ``inputs``; the
last stage receives ``targets`` and returns the micro-batch's loss, a scalar mean over its counted
labels or ``(sum, count)`` (see :mod:`.token_loss`); every other stage maps a tensor to a tensor.
Side inputs, ``engine.step(inputs, targets, attention_mask=..., position_ids=...)``: tensors every
rank holds (batch along dim 0) that every stage needs, split into the same microbatches and passed to
every chunk call as keyword arguments, so only the hidden states travel between stages (each stage
rebuilds masks and rotary tables from them, as Megatron-LM's stages do).
Every step records this rank's timeline (compute and message waits, a few ``perf_counter`` calls per
instruction; :meth:`gather_timeline`, :meth:`bubble_fraction`, :meth:`draw_timeline`); no barrier is
taken for it.

Receives are posted one communication step ahead of need where their shape is known (see
:meth:`PipelineEngine._prefetch`), so a message's transfer overlaps the computation before it. The
first activation of a link in a step is posted ahead too, in the shape the link carried last step
(see :meth:`PipelineEngine._recv_buffer`): on gloo a message whose receive is not yet posted waits
for the receiver's "ready" and is then written by the sender's gloo thread, which on a busy machine
wakes up milliseconds late (measured: the first activation of every step arrived 4-5 ms after it
was sent, against about 0.2 ms for a message whose receive was waiting).

``autocast=torch.bfloat16``: every forward runs under ``torch.autocast`` (fp32 weights, bf16 matmuls;
activations travel between stages in the dtype the stage produced; backward follows autograd's casts).

Zero-bubble schedules (``zb-h1``, ``zbv``): their ``Backward`` is B, the input gradient alone
(:func:`.backward_split.backward_input`: the weight branches' gradients are kept at their boundary nodes,
with the graph), and their ``WeightGrad`` (W) runs the weight gradients later, accumulating into
``.grad`` as a plain backward does (gradient hooks fire in W). In those schedules a received tensor is
waited for where it is used, not at its communication step, so the W after a batch run while its
messages travel. ``zbv`` lays the chunks in a V (chunk 0 is stage ``rank``, chunk 1 stage ``2p - 1 -
rank``; :func:`.schedules.stage_of`): the model must be built in that layout (``layout="v"``), and the
turn of the V on the last rank is a local hand-off like every neighbour stage on the same rank.

Chunks with a ``finish_grads()`` method (``GPTStage``: tied embeddings, sequence-parallel grads) have it
called once after the schedule.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..distributed import collectives as C
from .backward_split import backward_input
from .p2p import HEADER_TAG, P2P, RESHAPE_TAG, decode_header, encode_header, header_buffer, peer_failure
from .schedules import Instr, build_schedule, check_schedule_args, layout_of, place_of, stage_of
from .timeline import Timeline, bubble_breakdown, bubble_fraction, draw, gather_timelines
from .token_loss import IGNORE_INDEX, TokenLoss, count_labels_each


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


class _StepState:
    """What one step (or evaluation) of the engine carries between its instructions. Keys ``(mb, chunk)``
    unless said otherwise."""

    def __init__(self, train: bool, mb_inputs, mb_targets, mb_side: List[Dict[str, torch.Tensor]]):
        self.train = train
        self.mb_inputs, self.mb_targets = mb_inputs, mb_targets
        self.mb_side = mb_side                                      # per microbatch: side inputs (kwargs)
        self.inputs_of: Dict[Tuple[int, int], torch.Tensor] = {}   # received input (requires grad)
        self.pending_w: Dict[Tuple[int, int], object] = {}          # B ran, W not yet: PendingWeightGrad
        self.outstanding: list = []                                  # posted batches not yet waited for (W schedules)
        self.outputs: Dict[Tuple[int, int], torch.Tensor] = {}     # output, or the scaled loss
        self.out_grads: Dict[Tuple[int, int], torch.Tensor] = {}   # d loss / d output
        self.in_grads: Dict[Tuple[int, int], torch.Tensor] = {}    # d loss / d input, to send
        self.act_meta: Dict[int, Tuple[tuple, torch.dtype]] = {}   # chunk -> incoming (shape, dtype), from its header
        self.sent_shape: Dict[int, tuple] = {}                      # chunk -> shape of its first output sent
        self.header_sent: set = set()                               # chunks whose header went out
        self.token_loss: Optional[TokenLoss] = None                   # last stage: the loss accounting
        self.prefetched: Dict[Instr, Tuple[object, torch.Tensor]] = {}   # gloo: receive -> (work, buffer)
        self.guessed: Dict[Instr, Tuple[tuple, torch.dtype]] = {}        # gloo: posted in last step's shape


class PipelineEngine:
    def __init__(self, chunks: Sequence[nn.Module], pp_group, *, schedule: str = "1f1b", num_microbatches: int,
                 tensor_shape: Optional[Sequence[int]] = None, broadcast_loss: bool = True,
                 device: Optional[torch.device] = None, ignore_index: Optional[int] = IGNORE_INDEX,
                 autocast: Optional[torch.dtype] = None):
        self.chunks = list(chunks)
        if not self.chunks:
            raise ValueError("PipelineEngine: no chunks given")
        self.group = pp_group
        self.p, self.rank = C.world_size(pp_group), C.rank(pp_group)
        self.v, self.m = len(self.chunks), num_microbatches
        self.S = self.p * self.v
        check_schedule_args(schedule, self.p, num_microbatches, self.v)
        self.schedule = schedule
        self.layout = layout_of(schedule)
        self.steps = build_schedule(schedule, self.p, num_microbatches, self.rank, self.v)
        # B/W split: the schedule has W instructions (then B is the input gradient alone)
        self.split_backward = any(isinstance(st, Instr) and st.op == "W" for st in self.steps)
        self.peak_pending_w = 0            # most microbatches waiting for their W at once, last step
        self.peak_pending_w_bytes = 0      # most bytes of kept boundary gradients at once, last step
        self.tensor_shape = None if tensor_shape is None else tuple(int(x) for x in tensor_shape)
        self.broadcast_loss = broadcast_loss
        self.ignore_index = ignore_index       # labels equal to it do not count in the loss (None: all count)
        self.autocast = autocast               # every forward under torch.autocast(dtype=autocast) when set
        # the device communication buffers live on: the chunks' (NCCL moves only device tensors)
        self.device = device if device is not None else next(
            (p.device for c in self.chunks for p in c.parameters()), torch.device("cpu"))
        self.p2p = P2P(pp_group, self.device) if self.p > 1 else None
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
        return stage_of(self.rank, chunk, self.p, self.v, self.layout)

    def _local(self, stage: int) -> Optional[int]:
        """The chunk of ``stage`` if it lives on this rank (a local hand-off), else None."""
        rank, chunk = place_of(stage, self.p, self.v, self.layout)
        return chunk if rank == self.rank else None

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
        if op == "F" and self.autocast is not None:
            with torch.autocast(self.device.type, dtype=self.autocast):
                out = fn()
        else:
            out = fn()
        self.timeline.record(op, mb, chunk, t0, time.perf_counter())
        return out

    # ------------------------------------------------------------------ one step
    def step(self, inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, *,
             loss_denominator: Optional[float] = None, **side):
        """One training step: forward and backward of every microbatch (see the module docstring;
        ``side``: side inputs, passed to every chunk; ``loss_denominator``: what the loss sums are
        divided by, default the number of counted labels in ``targets``)."""
        return self._run(self._train, inputs, targets, side, loss_denominator)

    def evaluate(self, inputs: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, *,
                 loss_denominator: Optional[float] = None, **side):
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
                return self._run(self._eval, inputs, targets, side, loss_denominator)
        finally:
            for m, mode in modes:
                m.training = mode
            self.timeline = kept

    def _run(self, prog: _Program, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
             side: Dict[str, torch.Tensor], loss_denominator: Optional[float] = None):
        holds_first, holds_last = 0 in map(self.stage, range(self.v)), self.S - 1 in map(self.stage, range(self.v))
        split_side = {k: self._split(t, k, True) for k, t in side.items() if t is not None}
        st = _StepState(not prog.forward_only, self._split(inputs, "inputs", holds_first),
                        self._split(targets, "targets", holds_last),
                        [{k: v[mb] for k, v in split_side.items()} for mb in range(self.m)])
        if holds_last:
            st.token_loss = TokenLoss(count_labels_each(st.mb_targets, self.ignore_index), loss_denominator,
                                      self.ignore_index, f"pipeline stage {self.S - 1}")
        self._header_links = prog.header_links
        self.prefetched_receives = 0                                 # how many, this step (tests, tuning)
        self.timeline.start()
        ahead = self.p2p is not None and not self.p2p.ordered      # gloo only: see _communicate
        if ahead and prog.header_links:
            # Every shape header this rank will receive, posted now (own tag, first-in-first-out per peer
            # in the order the schedule first needs each link, which is the order the peer sends them):
            # a header then lands as soon as it is sent, and the first activation of a link can be
            # prefetched like the others once its header is in.
            ops = [("recv", header_buffer(self.device), ins.peer, f"receive header {ins}")
                   for ins in prog.header_links.values()]
            works = self.p2p.post(ops, tag=HEADER_TAG)
            self._hdr_in = {c: (w, op[1], ins) for (c, ins), op, w in zip(prog.header_links.items(), ops, works)}
            self._prefetch(prog.steps[prog.first_comm], st)

        lazy = self.split_backward and st.train
        self.peak_pending_w = self.peak_pending_w_bytes = 0
        for i, step in enumerate(prog.steps):
            if isinstance(step, Instr):
                if lazy:
                    self._await_inputs(step, st)
                self._compute(step, st)
                continue
            posted = self._communicate(step, st, wait=not lazy)
            if lazy:
                st.outstanding.append(posted)
            nxt = prog.next_comm[i]
            if ahead and nxt is not None:
                self._prefetch(prog.steps[nxt], st)
        while st.outstanding:
            self._finish_communicate(st.outstanding.pop(0), st)
        if st.pending_w:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule {self.schedule!r} left the W of "
                               f"{sorted(st.pending_w)} unrun")

        if self.p2p is not None:
            self.p2p.drain()
        self.timeline.stop()
        seen = set()
        for chunk in self.chunks if st.train else ():
            if hasattr(chunk, "finish_grads") and id(chunk) not in seen:
                seen.add(id(chunk))
                chunk.finish_grads()
        loss = None
        # every rank's loss buffer in one dtype, whatever the loss function returned: fp32 (fp64 models: fp64)
        first = next((p for c in self.chunks for p in c.parameters()), None)
        loss_dtype = torch.promote_types(first.dtype if first is not None else torch.float32, torch.float32)
        if st.token_loss is not None:
            st.token_loss.check()
            loss = st.token_loss.total(self.device).to(loss_dtype)
        if self.broadcast_loss and self.p > 1:
            buf = loss.clone() if loss is not None else torch.zeros((), dtype=loss_dtype, device=self.device)
            try:
                last_rank = place_of(self.S - 1, self.p, self.v, self.layout)[0]   # p - 1; in a V, 0
                C.broadcast(buf, last_rank, self.group)
            except Exception as exc:  # noqa: BLE001 - forward-only, the first stage may wait only here
                raise peer_failure(self.rank, "the loss broadcast from the last stage", exc) from exc
            loss = buf
        return loss

    def _await_inputs(self, ins: Instr, st: "_StepState") -> None:
        """W schedules: wait for the posted batches, in order, until the tensor ``ins`` needs is in."""
        s = self.stage(ins.chunk)
        key = (ins.mb, ins.chunk)
        if ins.op == "F" and s > 0 and self._local(s - 1) is None:
            where = st.inputs_of
        elif ins.op == "B" and s < self.S - 1 and self._local(s + 1) is None:
            where = st.out_grads
        else:
            return
        while key not in where:
            if not st.outstanding:
                raise RuntimeError(f"pipeline rank {self.rank}: {ins} needs a message no communication step "
                                   f"received (schedule {self.schedule!r})")
            self._finish_communicate(st.outstanding.pop(0), st)

    def _compute(self, ins: Instr, st: "_StepState") -> None:
        """One forward, backward or W; activations and gradients move through ``st``."""
        mb, c = ins.mb, ins.chunk
        s = self.stage(c)
        if ins.op == "W":
            self._timed("BW", mb, c, st.pending_w.pop((mb, c)).run)
            return
        if ins.op == "F":
            prev = self._local(s - 1) if s > 0 else None
            if s == 0:
                x = st.mb_inputs[mb]
            elif prev is not None:         # previous stage on this rank: local hand-off
                if st.train:
                    x = st.inputs_of[(mb, c)] = st.outputs[(mb, prev)].detach().requires_grad_()
                else:                      # nothing is kept for a backward
                    x = st.outputs.pop((mb, prev)).detach()
            else:
                x = st.inputs_of[(mb, c)] if st.train else st.inputs_of.pop((mb, c))
            side = st.mb_side[mb]
            if s == self.S - 1:
                out = self._timed("F", mb, c, lambda: self.chunks[c](x, st.mb_targets[mb], **side))
                part = st.token_loss.weigh(out, mb)
                if st.train:
                    st.outputs[(mb, c)] = part
            else:
                st.outputs[(mb, c)] = self._timed("F", mb, c, lambda: self.chunks[c](x, **side))
            return
        out = st.outputs.pop((mb, c))
        grad = None if s == self.S - 1 else st.out_grads.pop((mb, c))
        x = st.inputs_of.pop((mb, c), None)
        if self.split_backward:
            inputs = [x] if x is not None else []
            in_grads, pending = self._timed("B", mb, c, lambda: backward_input([out], [grad], inputs))
            st.pending_w[(mb, c)] = pending
            self.peak_pending_w = max(self.peak_pending_w, len(st.pending_w))
            self.peak_pending_w_bytes = max(self.peak_pending_w_bytes,
                                            sum(w.held_bytes for w in st.pending_w.values()))
            x_grad = in_grads[0] if x is not None else None
        else:
            self._timed("B", mb, c, lambda: torch.autograd.backward(out, grad))
            x_grad = x.grad if x is not None else None
        if x is not None:
            prev = self._local(s - 1)
            if prev is not None:
                st.out_grads[(mb, prev)] = x_grad
            else:
                st.in_grads[(mb, c)] = x_grad

    def _recv_buffer(self, ins, st: "_StepState") -> Optional[torch.Tensor]:
        """The buffer a receive lands in, or None while its shape is unknown (activation: no header yet
        this step; gradient: the forward whose output it belongs to has not run yet).

        gloo only: the first activation of a link, before its header is in, gets a buffer in the shape
        the link carried last step (guessed; checked against the header when it is waited for). If the
        sender's shape changed, it sends an empty message of the old shape to fill the guessed receive in
        its first-in-first-out place and the real activation on ``RESHAPE_TAG`` (:meth:`_communicate`):
        a changed shape costs one extra message, never a wrong match."""
        if ins.op == "RECV_ACT":
            meta = st.act_meta.get(ins.chunk) if self.p2p.ordered else self._take_header(ins.chunk, st, block=False)
            if meta is None:
                meta = self._link_meta.get(ins.chunk)
                if self.p2p.ordered or meta is None or self._header_links.get(ins.chunk) is not ins:
                    return None
                st.guessed[ins] = meta
            shape, dtype = meta
            return torch.empty(shape, dtype=dtype, device=self.device)
        out = st.outputs.get((ins.mb, ins.chunk))
        return None if out is None else torch.empty(out.shape, dtype=out.dtype, device=out.device)

    def _take_header(self, chunk, st: "_StepState", block: bool):
        """gloo: the (shape, dtype) of ``chunk``'s incoming activations this step, from the header posted
        at the start of the step (waited for when ``block``, else None while it has not arrived)."""
        if chunk in st.act_meta:
            return st.act_meta[chunk]
        work, h, ins = self._hdr_in[chunk]
        if not block and not work[0].is_completed():
            return None
        self.p2p.wait([work])
        del self._hdr_in[chunk]
        return self._header_in(chunk, h, ins, st)

    def _header_in(self, chunk, h, ins, st: "_StepState"):
        """Record a received header as the link's shape this step; checked against ``tensor_shape``."""
        st.act_meta[chunk] = self._link_meta[chunk] = decode_header(h)
        if self.tensor_shape is not None:
            self._check_shape(st.act_meta[chunk][0], ins, sending=False)
        return st.act_meta[chunk]

    def _prefetch(self, batch, st: "_StepState") -> None:
        """gloo: post the receives of the next communication step now, so their transfers run while this
        rank computes (gloo moves a message only once both ends have posted it: a receive posted just
        before it is needed leaves the whole hand-shake and copy on the critical path). Only a prefix of
        the step's receives, in order, so that messages still match first-in-first-out per peer; at most
        one step ahead, so at most one extra buffer per link is alive. Never under NCCL, where a posted
        receive blocks every later operation of the rank on the group.

        Called after the current step's wait, not before it: posting them before the wait measured worse
        on gloo (interleaved 1F1B, p=2 m=8, 2 x 9 reps A/B: bubble median 0.16-0.17 against 0.10-0.12),
        probably because gloo's thread then copies each message in as it arrives, during this rank's
        compute, instead of in the wait."""
        ops, keys = [], []
        for ins in batch:
            if not ins.op.startswith("RECV"):
                continue
            buf = self._recv_buffer(ins, st)
            if buf is None:
                break
            ops.append(("recv", buf, ins.peer, f"receive {ins}"))
            keys.append((ins, buf))
        if ops:
            for (ins, buf), work in zip(keys, self.p2p.post(ops)):
                st.prefetched[ins] = (work, buf)
            self.prefetched_receives += len(ops)

    def _communicate(self, batch, st: "_StepState", wait: bool = True):
        """One communication step: shape headers, then the data, then the received tensors put in place.

        The NCCL ordering lives here. Under NCCL (``p2p.ordered``) the first activation of each link in
        the step is preceded by its header in a batch of its own, exchanged in the same step by both
        ends, and the data follow as one batch, waited for as a whole; nothing is posted ahead. On gloo
        the headers travel on their own tag to receives posted at the start of the step, and receives of
        the next step are posted ahead (:meth:`_prefetch`). Only receives are waited for here; sends are
        drained at the end of the step. ``st.train`` False (forward only): an output is dropped once
        sent, and a received activation does not require grad. ``wait`` False (schedules with W): the
        step is posted and returned; :meth:`_finish_communicate` waits for it when a tensor it receives
        is needed (shape headers are still exchanged here)."""
        t0 = time.perf_counter()
        reshaped = self._send_headers(batch, st)
        if self.p2p.ordered:
            self._exchange_headers(batch, st)
        else:
            for ins in batch:
                if ins.op == "RECV_ACT" and (ins not in st.prefetched or ins in st.guessed):
                    self._take_header(ins.chunk, st, block=True)
        received, waits, reshape_ops = self._post_data(batch, st, reshaped)
        posted = (t0, received, waits + self.p2p.post(reshape_ops, tag=RESHAPE_TAG))
        if not wait:
            return posted
        self._finish_communicate(posted, st)
        return None

    def _finish_communicate(self, posted, st: "_StepState") -> None:
        """Wait for a posted communication step's receives and put the tensors in place."""
        t0, received, waits = posted
        if not waits:
            return
        t0 = t0 if not self.split_backward else time.perf_counter()     # lazily waited: from now
        self.p2p.wait(waits)
        for ins, buf in received:
            key = (ins.mb, ins.chunk)
            if ins.op == "RECV_ACT":
                st.inputs_of[key] = buf.requires_grad_(st.train and buf.is_floating_point())
            else:
                st.out_grads[key] = buf
        if received:
            first = received[0][0]
            self.timeline.record("W", first.mb, first.chunk, t0, time.perf_counter())

    def _header_sends(self, batch, st: "_StepState"):
        """The header sends of this step's first activation per link, and (gloo) the links whose shape
        changed since last step (first send -> last step's meta)."""
        ops, reshaped = [], {}
        for ins in batch:
            if ins.op == "SEND_ACT" and ins.chunk not in st.header_sent:
                st.header_sent.add(ins.chunk)
                out = st.outputs[(ins.mb, ins.chunk)]
                ops.append(("send", encode_header(out, self.device), ins.peer, f"send header {ins}"))
                meta, last = (tuple(out.shape), out.dtype), self._sent_meta.get(ins.chunk)
                if last is not None and last != meta and not self.p2p.ordered:
                    reshaped[ins] = last
                self._sent_meta[ins.chunk] = meta
        return ops, reshaped

    def _send_headers(self, batch, st: "_StepState"):
        """gloo: post this step's header sends on their tag now. Both ends check a declared
        ``tensor_shape`` (under NCCL :meth:`_exchange_headers` posts the sends with the receives)."""
        ops, reshaped = self._header_sends(batch, st) if not self.p2p.ordered else ([], {})
        if ops:
            self.p2p.post(ops, tag=HEADER_TAG)
        if not self.p2p.ordered:
            self._check_sent_shapes(batch, st)
        return reshaped

    def _check_sent_shapes(self, batch, st: "_StepState") -> None:
        if self.tensor_shape is None:
            return
        for ins in batch:
            if ins.op == "SEND_ACT":
                try:
                    self._check_shape(tuple(st.outputs[(ins.mb, ins.chunk)].shape), ins, sending=True)
                except ValueError:
                    # deliver the header first (a send dies with its buffer), so the receiver raises
                    # the same clear error instead of timing out
                    try:
                        self.p2p.drain()
                    except RuntimeError:
                        pass
                    raise

    def _exchange_headers(self, batch, st: "_StepState") -> None:
        """NCCL: this step's headers, sends and receives, as one batch of their own, waited for."""
        sends, _ = self._header_sends(batch, st)
        recvs = list({ins.chunk: ins for ins in reversed(batch)
                      if ins.op == "RECV_ACT" and ins.chunk not in st.act_meta}.values())[::-1]
        bufs = [header_buffer(self.device) for _ in recvs]
        works = self.p2p.post(sends + [("recv", h, ins.peer, f"receive header {ins}") for ins, h in zip(recvs, bufs)])
        self._check_sent_shapes(batch, st)
        self.p2p.wait(works)
        for ins, h in zip(recvs, bufs):
            self._header_in(ins.chunk, h, ins, st)

    def _post_data(self, batch, st: "_StepState", reshaped):
        """Post the step's data messages (receives posted ahead are not posted again); returns the
        receives (instruction, buffer), the works to wait for and (gloo) the re-shaped messages."""
        ops, received, waits, reshape_ops = [], [], [], []
        for ins in batch:
            key = (ins.mb, ins.chunk)
            if ins in st.prefetched:
                work, buf = st.prefetched.pop(ins)
                waits.append(work)
                guess = st.guessed.pop(ins, None)
                if guess is not None and guess != st.act_meta[ins.chunk]:
                    # the shape changed: the guessed receive gets the sender's filler, the data comes apart
                    shape, dtype = st.act_meta[ins.chunk]
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    reshape_ops.append(("recv", buf, ins.peer, f"receive {ins} (new shape)"))
                received.append((ins, buf))
                continue
            if ins.op == "SEND_ACT":
                out = (st.outputs[key] if st.train else st.outputs.pop(key)).detach()
                first = st.sent_shape.setdefault(ins.chunk, tuple(out.shape))
                if tuple(out.shape) != first:
                    raise ValueError(f"pipeline stage {self.stage(ins.chunk)}: microbatch {ins.mb} output has shape "
                                     f"{tuple(out.shape)} but earlier microbatches had {first}; microbatches must "
                                     f"have equal shapes")
                if ins in reshaped:    # fill the receive the peer posted in last step's shape, then the data
                    shape, dtype = reshaped[ins]
                    ops.append(("send", torch.empty(shape, dtype=dtype, device=out.device), ins.peer,
                                f"send {ins} (filler in last step's shape)"))
                    reshape_ops.append(("send", out.contiguous(), ins.peer, f"send {ins} (new shape)"))
                    continue
                ops.append(("send", out.contiguous(), ins.peer, f"send {ins}"))
            elif ins.op == "SEND_GRAD":
                ops.append(("send", st.in_grads.pop(key).contiguous(), ins.peer, f"send {ins}"))
            else:  # RECV_ACT: shape from the header; RECV_GRAD: the shape of the activation this rank sent
                buf = self._recv_buffer(ins, st)
                ops.append(("recv", buf, ins.peer, f"receive {ins}"))
                received.append((ins, buf))
        return received, waits + self.p2p.post(ops), reshape_ops

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
