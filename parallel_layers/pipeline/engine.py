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

Messages travel through a transport chosen once from the pipeline group's backend
(:func:`.transport.transport_for`): under NCCL's rules one batch per communication step and nothing posted
ahead; on gloo receives posted one communication step ahead of need, so a message's transfer overlaps the
computation before it (:class:`.transport.LookAheadTransport`). The engine hands it each communication
step and takes back the received tensors; it never looks at the backend.

``autocast=torch.bfloat16``: every forward runs under ``torch.autocast`` (fp32 weights, bf16 matmuls;
activations travel between stages in the dtype the stage produced; backward follows autograd's casts).

Zero-bubble schedules (``zb-h1``, ``zbv``): their ``Backward`` is B, the input gradient alone
(:func:`.backward_split.backward_input`: the weight branches' gradients are kept at their boundary nodes,
with the graph), and their ``WeightGrad`` (W) runs the weight gradients later, accumulating into
``.grad`` as a plain backward does (gradient hooks fire in W). In those schedules a received tensor is
waited for where it is used, not at its communication step, so the W after a batch run while its
messages travel. ``zbv`` lays the chunks in a V (chunk 0 is stage ``rank``, chunk 1 stage ``2p - 1 -
rank`` for ``p`` pipeline ranks; :func:`.schedules.stage_of`): the model must be built in that layout
(``layout="v"``), and the turn of the V on the last rank is a local hand-off like every neighbour stage
on the same rank.

Chunks with a ``finish_grads()`` method (``ModelStage``: tied embeddings) have it
called once after the schedule.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..distributed import collectives as C
from .backward_split import backward_input
from .p2p import peer_failure
from .saved_tensors import SavedTensors
from .schedules import Instr, build_schedule, check_schedule_args, layout_of, place_of, stage_of
from .timeline import Timeline, bubble_breakdown, bubble_fraction, draw, gather_timelines
from .token_loss import IGNORE_INDEX, TokenLoss, count_labels_each
from .transport import PostedStep, transport_for


class _Program:
    """One instruction list of this rank and what the engine derives from it once: the first activation
    receive of each chunk (its link needs a shape header), in schedule order, the first communication
    step and the communication step after each communication step."""

    def __init__(self, steps: List):
        self.steps = steps
        self.forward_only = not any(isinstance(step, Instr) and step.op == "B" for step in steps)
        self.header_links: Dict[int, Instr] = {}
        for step in steps:
            if not isinstance(step, Instr):
                for ins in step:
                    if ins.op == "RECV_ACT" and ins.chunk not in self.header_links:
                        self.header_links[ins.chunk] = ins
        comm = [i for i, step in enumerate(steps) if not isinstance(step, Instr)]
        self.next_comm: Dict[int, Optional[tuple]] = {a: steps[b] if b is not None else None
                                                      for a, b in zip(comm, comm[1:] + [None])}
        self.first_comm: Optional[tuple] = steps[comm[0]] if comm else None


class _StepState:
    """What one step (or evaluation) of the engine carries between its instructions. Keys ``(mb, chunk)``
    unless said otherwise. Also what the transport reads of the step (:class:`.transport.StepTensors`)."""

    def __init__(self, train: bool, mb_inputs, mb_targets, mb_side: List[Dict[str, torch.Tensor]]):
        self.train = train
        self.mb_inputs, self.mb_targets = mb_inputs, mb_targets
        self.mb_side = mb_side                                      # per microbatch: side inputs (kwargs)
        self.inputs_of: Dict[Tuple[int, int], torch.Tensor] = {}   # received input (requires grad)
        self.pending_w: Dict[Tuple[int, int], object] = {}          # B ran, W not yet: PendingWeightGrad
        self.saved: Dict[Tuple[int, int], SavedTensors] = {}        # F ran, B not yet (zero-bubble schedules)
        self.outstanding: list = []            # posted communication steps not yet waited for (W schedules)
        self.outputs: Dict[Tuple[int, int], torch.Tensor] = {}     # output, or the scaled loss
        self.out_grads: Dict[Tuple[int, int], torch.Tensor] = {}   # d loss / d output
        self.in_grads: Dict[Tuple[int, int], torch.Tensor] = {}    # d loss / d input, to send
        self.token_loss: Optional[TokenLoss] = None                   # last stage: the loss accounting

    def output(self, ins: Instr) -> Optional[torch.Tensor]:
        return self.outputs.get((ins.mb, ins.chunk))

    def outgoing(self, ins: Instr) -> torch.Tensor:
        """A send's tensor: the input gradient (handed over), or the output, detached (forward only: an
        output is dropped once sent)."""
        key = (ins.mb, ins.chunk)
        if ins.op == "SEND_GRAD":
            return self.in_grads.pop(key)
        return (self.outputs[key] if self.train else self.outputs.pop(key)).detach()


class PipelineEngine:
    def __init__(self, chunks: Sequence[nn.Module], pp_group, *, schedule: str = "1f1b", num_microbatches: int,
                 tensor_shape: Optional[Sequence[int]] = None, broadcast_loss: bool = True,
                 device: Optional[torch.device] = None, ignore_index: Optional[int] = IGNORE_INDEX,
                 autocast: Optional[torch.dtype] = None):
        self.chunks = list(chunks)
        if not self.chunks:
            raise ValueError("PipelineEngine: no chunks given")
        self.group = pp_group
        self.pp_size, self.rank = C.world_size(pp_group), C.rank(pp_group)   # pipeline ranks, this one's
        self.num_chunks = len(self.chunks)                                    # model chunks on each rank
        self.num_microbatches = num_microbatches
        self.num_stages = self.pp_size * self.num_chunks                      # model stages in all
        check_schedule_args(schedule, self.pp_size, num_microbatches, self.num_chunks)
        self.schedule = schedule
        self.layout = layout_of(schedule)
        self.steps = build_schedule(schedule, self.pp_size, num_microbatches, self.rank, self.num_chunks)
        # B/W split: the schedule has W instructions (then B is the input gradient alone)
        self.split_backward = any(isinstance(step, Instr) and step.op == "W" for step in self.steps)
        self.peak_pending_w = 0            # most microbatches waiting for their W at once, last step
        self.peak_pending_w_bytes = 0      # most bytes held between B and W at once (kept gradients, saved tensors)
        self.tensor_shape = None if tensor_shape is None else tuple(int(x) for x in tensor_shape)
        self.broadcast_loss = broadcast_loss
        self.ignore_index = ignore_index       # labels equal to it do not count in the loss (None: all count)
        self.autocast = autocast               # every forward under torch.autocast(dtype=autocast) when set
        # the device communication buffers live on: the chunks' (NCCL moves only device tensors)
        self.device = device if device is not None else next(
            (param.device for chunk in self.chunks for param in chunk.parameters()), torch.device("cpu"))
        self.transport = transport_for(pp_group, self.device, self.tensor_shape, self.stage)
        self._train = _Program(self.steps)
        self._eval: Optional[_Program] = None          # built on the first evaluate()
        self.timeline = Timeline(self.rank)
        self.last_timelines: Optional[List[Timeline]] = None

    @property
    def prefetched_receives(self) -> int:
        """Receives the transport posted ahead of their communication step in the last step (tests, tuning)."""
        return self.transport.prefetched_receives

    # ------------------------------------------------------------------ helpers
    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.pp_size, self.num_chunks, self.layout)

    def _local(self, stage: int) -> Optional[int]:
        """The chunk of ``stage`` if it lives on this rank (a local hand-off), else None."""
        rank, chunk = place_of(stage, self.pp_size, self.num_chunks, self.layout)
        return chunk if rank == self.rank else None

    def _split(self, t: Optional[torch.Tensor], name: str, needed: bool) -> Optional[List[torch.Tensor]]:
        if not needed:
            return None
        if t is None:
            raise ValueError(f"PipelineEngine.step: pipeline rank {self.rank} holds stage "
                             f"{'0' if name == 'inputs' else self.num_stages - 1} and needs {name}")
        if t.shape[0] % self.num_microbatches:
            raise ValueError(f"PipelineEngine.step: batch of {t.shape[0]} does not split into "
                             f"{self.num_microbatches} equal microbatches; use a batch size that is a multiple "
                             f"of num_microbatches")
        return list(t.chunk(self.num_microbatches, dim=0))

    def _timed(self, op, mb, chunk, fn, state: Optional["_StepState"] = None):
        t0 = time.perf_counter()
        if op == "F":
            with contextlib.ExitStack() as scope:
                if self.autocast is not None:
                    scope.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
                if self.split_backward and state is not None and state.train:
                    # B releases what only the input path used (:mod:`.saved_tensors`)
                    scope.enter_context(state.saved.setdefault((mb, chunk), SavedTensors()).hooks())
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
            self._eval = _Program(build_schedule(self.schedule, self.pp_size, self.num_microbatches, self.rank,
                                                 self.num_chunks, forward_only=True))
        modes = [(module, module.training) for chunk in self.chunks for module in chunk.modules()]  # restored
        kept, self.timeline = self.timeline, Timeline(self.rank)
        try:
            for chunk in self.chunks:
                chunk.eval()
            with torch.no_grad():
                return self._run(self._eval, inputs, targets, side, loss_denominator)
        finally:
            for module, mode in modes:
                module.training = mode
            self.timeline = kept

    def _run(self, prog: _Program, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
             side: Dict[str, torch.Tensor], loss_denominator: Optional[float] = None):
        last_stage = self.num_stages - 1
        stages_here = [self.stage(chunk) for chunk in range(self.num_chunks)]
        holds_first, holds_last = 0 in stages_here, last_stage in stages_here
        split_side = {name: self._split(t, name, True) for name, t in side.items() if t is not None}
        state = _StepState(not prog.forward_only, self._split(inputs, "inputs", holds_first),
                           self._split(targets, "targets", holds_last),
                           [{name: parts[mb] for name, parts in split_side.items()}
                            for mb in range(self.num_microbatches)])
        if holds_last:
            state.token_loss = TokenLoss(count_labels_each(state.mb_targets, self.ignore_index), loss_denominator,
                                         self.ignore_index, f"pipeline stage {last_stage}")
        self.timeline.start()
        self.transport.begin(prog.header_links, prog.first_comm, state)

        lazy = self.split_backward and state.train
        self.peak_pending_w = self.peak_pending_w_bytes = 0
        for i, step in enumerate(prog.steps):
            if isinstance(step, Instr):
                if lazy:
                    self._await_inputs(step, state)
                self._compute(step, state)
                continue
            posted = self._communicate(step, state, wait=not lazy)
            if lazy:
                state.outstanding.append(posted)
            following = prog.next_comm[i]
            if following is not None:      # the transport may post the next step's receives now
                self.transport.look_ahead(following, state)
        while state.outstanding:
            self._finish_communicate(state.outstanding.pop(0), state)
        if state.pending_w:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule {self.schedule!r} left the W of "
                               f"{sorted(state.pending_w)} unrun")

        self.transport.drain()
        self.timeline.stop()
        seen = set()
        for chunk in self.chunks if state.train else ():
            if hasattr(chunk, "finish_grads") and id(chunk) not in seen:
                seen.add(id(chunk))
                chunk.finish_grads()
        loss = None
        # every rank's loss buffer in one dtype, whatever the loss function returned: fp32 (fp64 models: fp64)
        first = next((param for chunk in self.chunks for param in chunk.parameters()), None)
        loss_dtype = torch.promote_types(first.dtype if first is not None else torch.float32, torch.float32)
        if state.token_loss is not None:
            state.token_loss.check()
            loss = state.token_loss.total(self.device).to(loss_dtype)
        if self.broadcast_loss and self.pp_size > 1:
            buf = loss.clone() if loss is not None else torch.zeros((), dtype=loss_dtype, device=self.device)
            try:
                # the last rank (in a V, rank 0)
                last_rank = place_of(last_stage, self.pp_size, self.num_chunks, self.layout)[0]
                C.broadcast(buf, last_rank, self.group)
            except Exception as exc:  # noqa: BLE001 - forward-only, the first stage may wait only here
                raise peer_failure(self.rank, "the loss broadcast from the last stage", exc) from exc
            loss = buf
        return loss

    def _await_inputs(self, ins: Instr, state: _StepState) -> None:
        """W schedules: wait for the posted steps, in order, until the tensor ``ins`` needs is in."""
        stage = self.stage(ins.chunk)
        key = (ins.mb, ins.chunk)
        if ins.op == "F" and stage > 0 and self._local(stage - 1) is None:
            where = state.inputs_of
        elif ins.op == "B" and stage < self.num_stages - 1 and self._local(stage + 1) is None:
            where = state.out_grads
        else:
            return
        while key not in where:
            if not state.outstanding:
                raise RuntimeError(f"pipeline rank {self.rank}: {ins} needs a message no communication step "
                                   f"received (schedule {self.schedule!r})")
            self._finish_communicate(state.outstanding.pop(0), state)

    def _compute(self, ins: Instr, state: _StepState) -> None:
        """One forward, backward or W; activations and gradients move through ``state``."""
        mb, chunk = ins.mb, ins.chunk
        stage = self.stage(chunk)
        if ins.op == "W":
            self._timed("BW", mb, chunk, state.pending_w.pop((mb, chunk)).run)
            return
        if ins.op == "F":
            prev = self._local(stage - 1) if stage > 0 else None
            if stage == 0:
                x = state.mb_inputs[mb]
            elif prev is not None:         # previous stage on this rank: local hand-off
                if state.train:
                    x = state.inputs_of[(mb, chunk)] = state.outputs[(mb, prev)].detach().requires_grad_()
                else:                      # nothing is kept for a backward
                    x = state.outputs.pop((mb, prev)).detach()
            else:
                x = state.inputs_of[(mb, chunk)] if state.train else state.inputs_of.pop((mb, chunk))
            side = state.mb_side[mb]
            if stage == self.num_stages - 1:
                out = self._timed("F", mb, chunk, lambda: self.chunks[chunk](x, state.mb_targets[mb], **side), state)
                part = state.token_loss.weigh(out, mb)
                if state.train:
                    state.outputs[(mb, chunk)] = part
            else:
                state.outputs[(mb, chunk)] = self._timed("F", mb, chunk, lambda: self.chunks[chunk](x, **side), state)
            return
        out = state.outputs.pop((mb, chunk))
        grad = None if stage == self.num_stages - 1 else state.out_grads.pop((mb, chunk))
        x = state.inputs_of.pop((mb, chunk), None)
        if self.split_backward:
            inputs = [x] if x is not None else []
            saved = state.saved.pop((mb, chunk), None)
            in_grads, pending = self._timed("B", mb, chunk, lambda: backward_input([out], [grad], inputs, saved))
            state.pending_w[(mb, chunk)] = pending
            self.peak_pending_w = max(self.peak_pending_w, len(state.pending_w))
            self.peak_pending_w_bytes = max(self.peak_pending_w_bytes,
                                            sum(w.held_bytes for w in state.pending_w.values()))
            x_grad = in_grads[0] if x is not None else None
        else:
            self._timed("B", mb, chunk, lambda: torch.autograd.backward(out, grad))
            x_grad = x.grad if x is not None else None
        if x is not None:
            prev = self._local(stage - 1)
            if prev is not None:
                state.out_grads[(mb, prev)] = x_grad
            else:
                state.in_grads[(mb, chunk)] = x_grad

    # ------------------------------------------------------------------ communication steps
    def _communicate(self, batch, state: _StepState, wait: bool = True) -> Optional[Tuple[float, PostedStep]]:
        """One communication step, handed to the transport (shape headers, then the data; only receives
        are waited for here, sends are drained at the end of the step). ``wait`` False (schedules with
        W): the step is posted and returned; :meth:`_finish_communicate` waits for it when a tensor it
        receives is needed."""
        posted = (time.perf_counter(), self.transport.post(batch, state))
        if not wait:
            return posted
        self._finish_communicate(posted, state)
        return None

    def _finish_communicate(self, posted: Tuple[float, PostedStep], state: _StepState) -> None:
        """Wait for a posted communication step's receives and put the tensors in place (a received
        activation requires grad when training)."""
        t0, step = posted
        if not step.received:
            return
        t0 = t0 if not self.split_backward else time.perf_counter()     # lazily waited: from now
        received = self.transport.wait(step)
        for ins, buf in received:
            key = (ins.mb, ins.chunk)
            if ins.op == "RECV_ACT":
                state.inputs_of[key] = buf.requires_grad_(state.train and buf.is_floating_point())
            else:
                state.out_grads[key] = buf
        if received:
            first = received[0][0]
            self.timeline.record("W", first.mb, first.chunk, t0, time.perf_counter())

    # ------------------------------------------------------------------ timeline
    def gather_timeline(self) -> Optional[List[Timeline]]:
        """All ranks' timelines of the last step on pipeline rank 0 (None elsewhere); a collective."""
        self.last_timelines = gather_timelines(self.timeline, self.group if self.pp_size > 1 else None)
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
        return bubble_breakdown(self.last_timelines, self.schedule, self.num_microbatches, self.num_chunks)

    def draw_timeline(self, path: str, title: Optional[str] = None) -> Optional[str]:
        """Gathers (a collective) and, on pipeline rank 0, writes the PNG; returns its path there."""
        tls = self.gather_timeline()
        if tls is None:
            return None
        return draw(tls, path, title or f"{self.schedule}: p={self.pp_size}, m={self.num_microbatches}, "
                                        f"chunks={self.num_chunks}")


__all__ = ["PipelineEngine"]
