"""How a pipeline rank's communication steps travel: one interface, one transport per backend's rules.

The engine (:mod:`.engine`) interprets this rank's instruction list; each communication step (a tuple of
``SendAct``/``RecvAct``/``SendGrad``/``RecvGrad`` instructions) goes through the engine's
:class:`Transport`, which never sees a schedule and is all the engine knows of the backend:

- ``begin(header_links, first_step, tensors)``: a step (or evaluation) starts; ``header_links``: the first
  activation receive of each chunk (its link carries a shape header), ``first_step``: the first
  communication step;
- ``post(batch, tensors)``: post one communication step, shape headers then data; a :class:`PostedStep`;
- ``wait(posted)``: wait for that step's receives; returns ``(instruction, received tensor)`` in batch order;
- ``look_ahead(next_batch, tensors)``: after each communication step is posted (and waited for, unless the
  schedule waits lazily), the next one: a transport may post its receives now;
- ``drain()``: wait for every send (end of a step).

``tensors`` is the engine's side of the step (:class:`StepTensors`): the outputs it computed (they size
the headers and the gradient receives) and the tensor each send instruction hands over.

Chosen once per engine from the pipeline group's backend (:func:`transport_for`, as
:attr:`.p2p.P2P.ordered` decides): :class:`OrderedTransport` under NCCL's rules (any backend but gloo, the
NCCL-rules test backend included), :class:`LookAheadTransport` on gloo; a one-rank pipeline sends nothing
(the base :class:`Transport`). Shapes travel once per step and link (a header before the first activation
of the step; see :mod:`.p2p`), and both ends check a declared ``tensor_shape`` against it.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch

from ..distributed import collectives as C
from .p2p import HEADER_TAG, P2P, RESHAPE_TAG, decode_header, encode_header, header_buffer
from .schedules import Instr

Meta = Tuple[Tuple[int, ...], torch.dtype]      # (shape, dtype) of the activations a link carries


class StepTensors(Protocol):
    """What a transport reads of the engine's step."""

    def output(self, ins: Instr) -> Optional[torch.Tensor]:
        """The output this rank computed for ``ins``'s microbatch and chunk; None before its forward ran."""

    def outgoing(self, ins: Instr) -> torch.Tensor:
        """The tensor the send instruction ``ins`` sends, handed over by the step (forward only: an
        output is dropped once sent)."""


class PostedStep:
    """A posted communication step: its receives ``(instruction, buffer)`` and the works to wait for."""

    __slots__ = ("received", "waits")

    def __init__(self, received: List[Tuple[Instr, torch.Tensor]], waits: list):
        self.received, self.waits = received, waits


class Transport:
    """The interface (see the module docstring). As it is, the transport of a one-rank pipeline: every
    hand-off is local, nothing travels."""

    prefetched_receives = 0      # receives posted ahead of their communication step, this step (tests, tuning)

    def begin(self, header_links: Dict[int, Instr], first_step: Optional[Sequence[Instr]],
              tensors: StepTensors) -> None:
        pass

    def post(self, batch: Sequence[Instr], tensors: StepTensors) -> PostedStep:
        raise RuntimeError(f"pipeline: a one-rank pipeline has nothing to send or receive ({batch})")

    def wait(self, posted: PostedStep) -> List[Tuple[Instr, torch.Tensor]]:
        return []

    def look_ahead(self, batch: Sequence[Instr], tensors: StepTensors) -> None:
        pass

    def drain(self) -> None:
        pass


def transport_for(group, device: torch.device, tensor_shape: Optional[Tuple[int, ...]],
                  stage_of: Callable[[int], int]) -> Transport:
    """The transport of a pipeline over ``group`` (``stage_of(chunk)``: the stage a chunk of this rank
    holds, for error messages; ``tensor_shape``: the declared activation shape, or None)."""
    if C.world_size(group) == 1:
        return Transport()
    p2p = P2P(group, device)
    return (OrderedTransport if p2p.ordered else LookAheadTransport)(p2p, tensor_shape, stage_of)


class _Messages(Transport):
    """What both transports share: the step's shape headers, the checks on shapes, the data payloads."""

    def __init__(self, p2p: P2P, tensor_shape: Optional[Tuple[int, ...]], stage_of: Callable[[int], int]):
        self.p2p = p2p
        self.device = p2p.device
        self.tensor_shape = tensor_shape
        self.stage_of = stage_of
        self.prefetched_receives = 0
        self.act_meta: Dict[int, Meta] = {}     # chunk -> incoming (shape, dtype) this step, from its header
        self.sent_shape: Dict[int, tuple] = {}  # chunk -> shape of its first output sent this step
        self.header_sent: Set[int] = set()      # chunks whose header went out this step

    def begin(self, header_links, first_step, tensors) -> None:
        self.act_meta, self.sent_shape, self.header_sent = {}, {}, set()
        self.prefetched_receives = 0

    def wait(self, posted: PostedStep) -> List[Tuple[Instr, torch.Tensor]]:
        if posted.waits:
            self.p2p.wait(posted.waits)
        return posted.received

    def drain(self) -> None:
        self.p2p.drain()

    # ------------------------------------------------------------------ headers and shapes
    def _header_sends(self, batch, tensors: StepTensors) -> Tuple[list, List[Tuple[Instr, Meta]]]:
        """The header sends of this step's first activation per link, and those activations' (shape, dtype)."""
        ops, firsts = [], []
        for ins in batch:
            if ins.op == "SEND_ACT" and ins.chunk not in self.header_sent:
                self.header_sent.add(ins.chunk)
                out = tensors.output(ins)
                ops.append(("send", encode_header(out, self.device), ins.peer, f"send header {ins}"))
                firsts.append((ins, (tuple(out.shape), out.dtype)))
        return ops, firsts

    def _header_in(self, ins: Instr, h: torch.Tensor) -> Meta:
        """Record a received header as the link's shape this step; checked against ``tensor_shape``."""
        meta = self.act_meta[ins.chunk] = decode_header(h)
        self._remember(ins.chunk, meta)
        if self.tensor_shape is not None:
            self._check_shape(meta[0], ins, sending=False)
        return meta

    def _remember(self, chunk: int, meta: Meta) -> None:
        """A link's shape arrived (the look-ahead keeps it for the next step)."""

    def _check_sent_shapes(self, batch, tensors: StepTensors) -> None:
        if self.tensor_shape is None:
            return
        for ins in batch:
            if ins.op == "SEND_ACT":
                try:
                    self._check_shape(tuple(tensors.output(ins).shape), ins, sending=True)
                except ValueError:
                    # deliver the header first (a send dies with its buffer), so the receiver raises
                    # the same clear error instead of timing out
                    try:
                        self.p2p.drain()
                    except RuntimeError:
                        pass
                    raise

    def _check_shape(self, shape, ins: Instr, sending: bool) -> None:
        if shape != self.tensor_shape:
            stage = self.stage_of(ins.chunk)
            other = stage + 1 if sending else stage - 1
            raise ValueError(f"pipeline: stage {stage if sending else other} sends activations of shape {shape} to "
                             f"stage {other if sending else stage}, but the declared tensor_shape is "
                             f"{self.tensor_shape}; fix the stage split or tensor_shape (microbatch {ins.mb})")

    # ------------------------------------------------------------------ data
    def _payload(self, ins: Instr, tensors: StepTensors) -> torch.Tensor:
        """What a send instruction sends; an activation must have the shape of the step's first on its link
        (the receiver allocated from that one's header)."""
        out = tensors.outgoing(ins)
        if ins.op == "SEND_ACT":
            first = self.sent_shape.setdefault(ins.chunk, tuple(out.shape))
            if tuple(out.shape) != first:
                raise ValueError(f"pipeline stage {self.stage_of(ins.chunk)}: microbatch {ins.mb} output has shape "
                                 f"{tuple(out.shape)} but earlier microbatches had {first}; microbatches must "
                                 f"have equal shapes")
        return out

    def _grad_buffer(self, ins: Instr, tensors: StepTensors) -> Optional[torch.Tensor]:
        """A gradient lands in the shape of the activation this rank sent (None before its forward ran)."""
        out = tensors.output(ins)
        return None if out is None else torch.empty(out.shape, dtype=out.dtype, device=out.device)


class OrderedTransport(_Messages):
    """NCCL's rules: NCCL ignores tags, matches a pair's messages in posting order and runs a rank's
    operations on the group in issue order, so a posted receive blocks every later operation of the rank
    on the group. Per communication step, the first activation of each link is preceded by its header in
    a batch of its own, exchanged in the same step by both ends; the data follow as one batch, waited for
    as a whole. Nothing is posted ahead of the step that needs it."""

    def post(self, batch, tensors: StepTensors) -> PostedStep:
        self._exchange_headers(batch, tensors)
        ops, received = [], []
        for ins in batch:
            if ins.op.startswith("SEND"):
                ops.append(("send", self._payload(ins, tensors).contiguous(), ins.peer, f"send {ins}"))
            else:    # RECV_ACT: shape from the header; RECV_GRAD: the shape of the activation this rank sent
                buf = self._recv_buffer(ins, tensors)
                ops.append(("recv", buf, ins.peer, f"receive {ins}"))
                received.append((ins, buf))
        return PostedStep(received, self.p2p.post(ops))

    def _exchange_headers(self, batch, tensors: StepTensors) -> None:
        """This step's headers, sends and receives, as one batch of their own, waited for."""
        sends, _ = self._header_sends(batch, tensors)
        recvs = list({ins.chunk: ins for ins in reversed(batch)
                      if ins.op == "RECV_ACT" and ins.chunk not in self.act_meta}.values())[::-1]
        bufs = [header_buffer(self.device) for _ in recvs]
        works = self.p2p.post(sends + [("recv", h, ins.peer, f"receive header {ins}") for ins, h in zip(recvs, bufs)])
        self._check_sent_shapes(batch, tensors)
        self.p2p.wait(works)
        for ins, h in zip(recvs, bufs):
            self._header_in(ins, h)

    def _recv_buffer(self, ins: Instr, tensors: StepTensors) -> Optional[torch.Tensor]:
        if ins.op == "RECV_ACT":
            shape, dtype = self.act_meta[ins.chunk]
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._grad_buffer(ins, tensors)


class LookAheadTransport(_Messages):
    """gloo: receives posted one communication step ahead of need where their shape is known
    (:meth:`look_ahead`), so a message's transfer overlaps the computation before it. The shape headers
    travel on their own tag to receives posted at the start of the step. The first activation of a link
    in a step is posted ahead too, in the shape the link carried last step (:meth:`_recv_buffer`): on
    gloo a message whose receive is not yet posted waits for the receiver's "ready" and is then written
    by the sender's gloo thread, which on a busy machine wakes up milliseconds late (measured: the first
    activation of every step arrived 4-5 ms after it was sent, against about 0.2 ms for a message whose
    receive was waiting). Only receives are waited for in a step; sends are drained at its end."""

    def __init__(self, p2p: P2P, tensor_shape, stage_of):
        super().__init__(p2p, tensor_shape, stage_of)
        self.header_links: Dict[int, Instr] = {}     # of the program running now
        self.header_in: Dict[int, Tuple[object, torch.Tensor, Instr]] = {}   # chunk -> posted header receive
        # chunk -> (shape, dtype) of the activations its link carried in the last step, as received
        # (from the header) and as sent; both ends update them from the same headers, so they agree on
        # whether the link's first receive was posted ahead in that shape
        self.link_meta: Dict[int, Meta] = {}
        self.sent_meta: Dict[int, Meta] = {}
        self.prefetched: Dict[Instr, Tuple[object, torch.Tensor]] = {}   # receive -> (work, buffer)
        self.guessed: Dict[Instr, Meta] = {}                             # posted in last step's shape

    def begin(self, header_links, first_step, tensors) -> None:
        super().begin(header_links, first_step, tensors)
        self.prefetched, self.guessed = {}, {}
        self.header_links, self.header_in = header_links, {}
        if header_links:
            # Every shape header this rank will receive, posted now (own tag, first-in-first-out per peer
            # in the order the schedule first needs each link, which is the order the peer sends them):
            # a header then lands as soon as it is sent, and the first activation of a link can be
            # prefetched like the others once its header is in.
            ops = [("recv", header_buffer(self.device), ins.peer, f"receive header {ins}")
                   for ins in header_links.values()]
            works = self.p2p.post(ops, tag=HEADER_TAG)
            self.header_in = {c: (w, op[1], ins) for (c, ins), op, w in zip(header_links.items(), ops, works)}
            self.look_ahead(first_step, tensors)

    def look_ahead(self, batch, tensors: StepTensors) -> None:
        """Post the receives of the next communication step now, so their transfers run while this rank
        computes (gloo moves a message only once both ends have posted it: a receive posted just before
        it is needed leaves the whole hand-shake and copy on the critical path). Only a prefix of the
        step's receives, in order, so that messages still match first-in-first-out per peer; at most one
        step ahead, so at most one extra buffer per link is alive. Never under NCCL, where a posted
        receive blocks every later operation of the rank on the group.

        Called after the current step's wait, not before it: posting them before the wait measured worse
        on gloo (interleaved 1F1B, p=2 m=8, 2 x 9 reps A/B: bubble median 0.16-0.17 against 0.10-0.12),
        probably because gloo's thread then copies each message in as it arrives, during this rank's
        compute, instead of in the wait."""
        ops, keys = [], []
        for ins in batch:
            if not ins.op.startswith("RECV"):
                continue
            buf = self._recv_buffer(ins, tensors)
            if buf is None:
                break
            ops.append(("recv", buf, ins.peer, f"receive {ins}"))
            keys.append((ins, buf))
        if ops:
            for (ins, buf), work in zip(keys, self.p2p.post(ops)):
                self.prefetched[ins] = (work, buf)
            self.prefetched_receives += len(ops)

    def post(self, batch, tensors: StepTensors) -> PostedStep:
        """Headers on their tag, then the data (receives posted ahead are not posted again), then the
        activations whose shape changed since last step on ``RESHAPE_TAG``."""
        reshaped = self._send_headers(batch, tensors)
        for ins in batch:
            if ins.op == "RECV_ACT" and (ins not in self.prefetched or ins in self.guessed):
                self._take_header(ins.chunk, block=True)
        received, waits, reshape_ops = self._post_data(batch, tensors, reshaped)
        return PostedStep(received, waits + self.p2p.post(reshape_ops, tag=RESHAPE_TAG))

    def _recv_buffer(self, ins: Instr, tensors: StepTensors) -> Optional[torch.Tensor]:
        """The buffer a receive lands in, or None while its shape is unknown (activation: no header yet
        this step; gradient: the forward whose output it belongs to has not run yet).

        The first activation of a link, before its header is in, gets a buffer in the shape the link
        carried last step (guessed; checked against the header when it is waited for). If the sender's
        shape changed, it sends an empty message of the old shape to fill the guessed receive in its
        first-in-first-out place and the real activation on ``RESHAPE_TAG`` (:meth:`_post_data`): a
        changed shape costs one extra message, never a wrong match."""
        if ins.op == "RECV_ACT":
            meta = self._take_header(ins.chunk, block=False)
            if meta is None:
                meta = self.link_meta.get(ins.chunk)
                if meta is None or self.header_links.get(ins.chunk) is not ins:
                    return None
                self.guessed[ins] = meta
            shape, dtype = meta
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._grad_buffer(ins, tensors)

    def _take_header(self, chunk: int, block: bool) -> Optional[Meta]:
        """The (shape, dtype) of ``chunk``'s incoming activations this step, from the header posted at the
        start of the step (waited for when ``block``, else None while it has not arrived)."""
        if chunk in self.act_meta:
            return self.act_meta[chunk]
        work, h, ins = self.header_in[chunk]
        if not block and not work[0].is_completed():
            return None
        self.p2p.wait([work])
        del self.header_in[chunk]
        return self._header_in(ins, h)

    def _remember(self, chunk: int, meta: Meta) -> None:
        self.link_meta[chunk] = meta

    def _send_headers(self, batch, tensors: StepTensors) -> Dict[Instr, Meta]:
        """Post this step's header sends on their tag now and check a declared ``tensor_shape``; returns
        the links whose shape changed since last step (first send -> last step's (shape, dtype))."""
        ops, firsts = self._header_sends(batch, tensors)
        reshaped = {}
        for ins, meta in firsts:
            last = self.sent_meta.get(ins.chunk)
            if last is not None and last != meta:
                reshaped[ins] = last
            self.sent_meta[ins.chunk] = meta
        if ops:
            self.p2p.post(ops, tag=HEADER_TAG)
        self._check_sent_shapes(batch, tensors)
        return reshaped

    def _post_data(self, batch, tensors: StepTensors, reshaped: Dict[Instr, Meta]):
        """Post the step's data messages; returns the receives (instruction, buffer), the works to wait
        for and the re-shaped messages (filled guesses' real data, on ``RESHAPE_TAG``)."""
        ops, received, waits, reshape_ops = [], [], [], []
        for ins in batch:
            if ins in self.prefetched:
                work, buf = self.prefetched.pop(ins)
                waits.append(work)
                guess = self.guessed.pop(ins, None)
                if guess is not None and guess != self.act_meta[ins.chunk]:
                    # the shape changed: the guessed receive gets the sender's filler, the data comes apart
                    shape, dtype = self.act_meta[ins.chunk]
                    buf = torch.empty(shape, dtype=dtype, device=self.device)
                    reshape_ops.append(("recv", buf, ins.peer, f"receive {ins} (new shape)"))
                received.append((ins, buf))
                continue
            if ins.op == "SEND_ACT":
                out = self._payload(ins, tensors)
                if ins in reshaped:    # fill the receive the peer posted in last step's shape, then the data
                    shape, dtype = reshaped[ins]
                    ops.append(("send", torch.empty(shape, dtype=dtype, device=out.device), ins.peer,
                                f"send {ins} (filler in last step's shape)"))
                    reshape_ops.append(("send", out.contiguous(), ins.peer, f"send {ins} (new shape)"))
                    continue
                ops.append(("send", out.contiguous(), ins.peer, f"send {ins}"))
            elif ins.op == "SEND_GRAD":
                ops.append(("send", self._payload(ins, tensors).contiguous(), ins.peer, f"send {ins}"))
            else:  # RECV_ACT: shape from the header; RECV_GRAD: the shape of the activation this rank sent
                buf = self._recv_buffer(ins, tensors)
                ops.append(("recv", buf, ins.peer, f"receive {ins}"))
                received.append((ins, buf))
        return received, waits + self.p2p.post(ops), reshape_ops


__all__ = ["Transport", "OrderedTransport", "LookAheadTransport", "PostedStep", "StepTensors", "transport_for"]
