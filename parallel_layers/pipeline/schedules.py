"""Pipeline schedules as explicit instruction lists (DeepSpeed's idea): built first, then executed.

A schedule is, for every pipeline rank, a list of *steps*. A step is either one compute instruction
(``Forward(mb, chunk)`` / ``Backward(mb, chunk)``) or a tuple of communication instructions
(``SendAct``, ``RecvAct``, ``SendGrad``, ``RecvGrad``) that the engine posts together
(``batch_isend_irecv``) and waits for together. Because the lists are plain data they can be printed
(:func:`format_schedule`), unit-tested, and checked for deadlock by :func:`simulate` without a model.

Layout (Megatron-LM's): ``p`` ranks, ``v`` chunks per rank (virtual stages). Chunk ``c`` on rank ``r``
is the global stage ``c * p + r``; stage ``s`` sends activations to stage ``s + 1`` (rank ``(r+1) % p``)
and gradients back to stage ``s - 1``. GPipe and 1F1B use ``v = 1``.

Only the *compute order* differs between schedules (:func:`gpipe_order`, :func:`one_f_one_b_order`,
:func:`interleaved_order`); :func:`add_communication` then derives the messages from it the same way
for all: between two compute steps, the sends of the previous one and the receives the next one needs
form one batch (Megatron's ``send_forward_recv_backward``); in interleaved 1F1B's steady state a forward
and its backward share their batches (Megatron's ``send_forward_backward_recv_forward_backward``). Every
schedule is deadlock-free under NCCL's rules, where a batch completes only when all of its messages,
sends included, have been taken and nothing later on the rank starts before (:func:`simulate`).

Zero-bubble schedules (Qi et al. 2024) split a backward into ``Backward`` (B: the input gradient, which
the previous stage waits for) and ``WeightGrad`` (W: the weight gradients, needed only before the
optimizer step; :mod:`.backward_split`), and put the W where a rank would otherwise idle: ``zb-h1``
(:func:`zb_h1_order`: 1F1B with each rank's W delayed; the peak of held activations is 1F1B's, the
bubble about a third) and ``zbv`` (:func:`zbv_order`: two chunks per rank laid out in a V, chunk 0 going
down the ranks and chunk 1 coming back up, so the first stage's input and the last stage's loss are on
rank 0 and the turn at rank ``p - 1`` is a local hand-off). In a schedule with W a ``Backward`` is B
alone; elsewhere it is the whole backward. :func:`stage_of` maps (rank, chunk) to the stage for both
layouts (``"loop"``, Megatron's, and ``"v"``).

Each schedule is declared once, in :data:`SCHEDULE_SPECS`: a :class:`ScheduleSpec` with its compute order,
chunks per rank, layout, whether it splits the backward and what it needs of the micro-batch count. The
checks here, ``PipelineConfig``, ``Parallel3D``, the demo, the planner and freeze training read it
(:func:`schedule_spec`) and never test a schedule's name.

Evaluation runs the *forward-only* list of a schedule (``build_schedule(..., forward_only=True)``,
Megatron-LM's ``forward_only``, DeepSpeed's ``eval_batch``): every forward in the training order's
sequence, no backward and no gradient message. Without backward nothing is held between microbatches,
so the order only has to respect the layout: microbatch by microbatch for one chunk per rank, and for
virtual stages the interleaved schedule's forward order (groups of ``p`` microbatches through chunk 0,
then chunk 1, ...), so a rank never waits on a chunk its neighbour reaches later.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

LAYOUTS = ("loop", "v")


def layout_of(schedule: str) -> str:
    """How a schedule lays its chunks on the ranks (:attr:`ScheduleSpec.layout`): ``"v"`` for ZBV,
    ``"loop"`` (chunk c of rank r is stage ``c * p + r``) for the others."""
    return schedule_spec(schedule).layout


def stage_of(rank: int, chunk: int, p: int, v: int, layout: str = "loop") -> int:
    """The global stage of ``chunk`` on pipeline ``rank``: ``chunk * p + rank`` (loop); in a V (two chunks)
    chunk 0 is stage ``rank`` and chunk 1 is stage ``2p - 1 - rank``."""
    if layout == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def place_of(stage: int, p: int, v: int, layout: str = "loop") -> Tuple[int, int]:
    """(rank, chunk) that holds global ``stage`` (the inverse of :func:`stage_of`)."""
    if layout == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


@dataclass(frozen=True)
class Instr:
    op: str            # "F", "B", "W", "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"
    mb: int
    chunk: int
    peer: int = -1     # pipeline rank of the other end (communication only)

    def __str__(self) -> str:
        name = {"F": "Forward", "B": "Backward", "W": "WeightGrad", "SEND_ACT": "SendAct", "RECV_ACT": "RecvAct",
                "SEND_GRAD": "SendGrad", "RECV_GRAD": "RecvGrad"}[self.op]
        peer = f"->{self.peer}" if self.op.startswith("SEND") else f"<-{self.peer}" if self.peer >= 0 else ""
        return f"{name}(mb={self.mb}, chunk={self.chunk}{', ' + peer if peer else ''})"


def Forward(mb: int, chunk: int = 0) -> Instr:  # noqa: N802 - instruction constructors read like schedule notation
    return Instr("F", mb, chunk)


def Backward(mb: int, chunk: int = 0) -> Instr:  # noqa: N802
    return Instr("B", mb, chunk)


def WeightGrad(mb: int, chunk: int = 0) -> Instr:  # noqa: N802
    """W: the weight gradients of a microbatch whose B (input gradient) ran earlier."""
    return Instr("W", mb, chunk)


Step = Union[Instr, Tuple[Instr, ...]]


# ---------------------------------------------------------------------------------------- validation
def check_schedule_args(schedule: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> None:
    """Clear errors for combinations a schedule cannot run (same message on every rank)."""
    spec = schedule_spec(schedule)
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_chunks", num_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline: {name}={value!r} must be a positive integer")
    if not spec.runs(num_chunks):
        if spec.chunks > 1:
            raise ValueError(f"pipeline: schedule {schedule!r} runs {_chunk_words(spec.chunks)} per rank"
                             f"{' (a V)' if spec.layout == 'v' else ''}, got num_chunks={num_chunks}; build the "
                             f"model with num_chunks={spec.chunks}")
        virtual = " or ".join(f"schedule={s.name!r} ("
                              + ("any number of chunks" if s.any_chunks else _chunk_words(s.chunks)) + ")"
                              for s in SCHEDULE_SPECS.values() if s.virtual_stages)
        raise ValueError(f"pipeline: schedule {schedule!r} runs one chunk per rank, got num_chunks={num_chunks}; "
                         f"use {virtual} for virtual stages")
    if spec.microbatches_at_least_pp and num_microbatches < num_stages:
        free = [s.name for s in SCHEDULE_SPECS.values() if s.runs(num_chunks) and not s.microbatches_at_least_pp
                and not s.microbatches_multiple_of_pp]
        raise ValueError(f"pipeline: {spec.title} needs at least as many microbatches as stages, got "
                         f"num_microbatches={num_microbatches} < {num_stages} stages; use >= {num_stages} "
                         f"microbatches" + (f" (or schedule={free[0]!r})" if free else ""))
    if spec.microbatches_multiple_of_pp and num_microbatches % num_stages:
        raise ValueError(f"pipeline: {spec.title} needs num_microbatches divisible by the pipeline size, got "
                         f"num_microbatches={num_microbatches} and {num_stages} stages; use a multiple of "
                         f"{num_stages}")


def _chunk_words(n: int) -> str:
    return {1: "one chunk", 2: "two chunks"}.get(n, f"{n} chunks")


# ---------------------------------------------------------------------------------------- compute orders
def gpipe_order(p: int, m: int, rank: int) -> List[Instr]:
    """All forwards, then all backwards."""
    return [Forward(i) for i in range(m)] + [Backward(i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, rank: int) -> List[Instr]:
    """Warm-up of ``p - rank - 1`` forwards, steady one-forward-one-backward, cool-down of backwards.
    At most ``p - rank`` microbatches are in flight (forward done, backward not) on ``rank``."""
    warmup = min(p - rank - 1, m)
    order = [Forward(i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Forward(warmup + i), Backward(i)]
    order += [Backward(i) for i in range(m - warmup, m)]
    return order


def _interleaved_unit(k: int, p: int, v: int, forward: bool) -> Tuple[int, int]:
    """(microbatch, chunk) of the ``k``-th forward (or backward) of the interleaved order."""
    group, pos = divmod(k, p * v)          # each group of p*v units covers p microbatches x v chunks
    chunk = pos // p
    mb = group * p + pos % p
    return mb, (chunk if forward else v - 1 - chunk)


def interleaved_order(p: int, m: int, rank: int, v: int) -> List[Instr]:
    """Megatron-LM's interleaved 1F1B: microbatches go through the ``v`` chunks in groups of ``p``;
    warm-up ``2 (p - rank - 1) + (v - 1) p`` forwards, then 1F1B over (microbatch, chunk) pairs."""
    total = m * v

    def unit(k: int, forward: bool) -> Tuple[int, int]:
        return _interleaved_unit(k, p, v, forward)

    if m == p:
        warmup = total                          # Megatron: with m == p everything warms up first
    else:
        warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [Forward(*unit(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [Forward(*unit(warmup + k, True)), Backward(*unit(k, False))]
    order += [Backward(*unit(k, False)) for k in range(total - warmup, total)]
    return order


def _with_delayed_weights(order: Sequence[Instr], delay: int) -> List[Instr]:
    """``order`` (forwards and backwards) with each backward's W after the backward ``delay`` places later,
    the W still owed at the end appended in backward order."""
    out: List[Instr] = []
    owed: deque = deque()
    for ins in order:
        out.append(ins)
        if ins.op == "B":
            owed.append(ins)
            if len(owed) > delay:
                b = owed.popleft()
                out.append(WeightGrad(b.mb, b.chunk))
    out += [WeightGrad(b.mb, b.chunk) for b in owed]
    return out


def zb_h1_order(p: int, m: int, rank: int) -> List[Instr]:
    """ZB-H1 (Qi et al. 2024, torch's ``ScheduleInterleavedZeroBubble`` with one stage per rank): 1F1B's
    order of forwards and input backwards, each W run ``rank`` backwards late, so that the last ranks,
    whose B gradients the earlier ranks wait for, send them sooner and fill their cool-down with W.
    Held activations (forward run, W not yet) peak at ``p`` on every rank: 1F1B's peak (rank 0's)."""
    return _with_delayed_weights(one_f_one_b_order(p, m, rank), rank)


def zbv_order(p: int, m: int, rank: int) -> List[Instr]:
    """ZBV (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble``): two chunks per rank in a V
    (chunk 0: stage ``rank``; chunk 1: stage ``2p - 1 - rank``). Warm-up: ``2(p - rank) - 1`` forwards of
    chunk 0, then ``rank`` pairs of chunk 1 and chunk 0 forwards, then ``p - rank`` times chunk 1's F, B,
    W; steady state: chunk 0's F, B, W then chunk 1's F, B, W; cool-down: the remaining B of both
    chunks, chunk 0's with their W, then every W still owed. Built for ``max(m, 2p - 1)`` microbatches
    (the V needs ``2p - 1`` to fill) and the instructions of the ones past ``m`` dropped."""
    n = max(m, 2 * p - 1)
    order: List[Instr] = []
    f = [0, 0]
    b = [0, 0]

    def fwd(c):
        order.append(Forward(f[c], c))
        f[c] += 1

    def bwd(c, with_w: bool):
        order.append(Backward(b[c], c))
        if with_w:
            order.append(WeightGrad(b[c], c))
        b[c] += 1

    for _ in range(2 * (p - rank) - 1):
        fwd(0)
    for _ in range(rank):
        fwd(1)
        fwd(0)
    for _ in range(p - rank):
        fwd(1)
        bwd(1, True)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            fwd(0)
        bwd(0, True)
        fwd(1)
        bwd(1, True)
    w = list(b)
    for _ in range(rank):
        bwd(0, False)
        bwd(1, False)
    for _ in range(p - rank):
        bwd(0, False)
        order.append(WeightGrad(w[0], 0))
        w[0] += 1
    order += [WeightGrad(i, 1) for i in range(w[1], b[1])]
    order += [WeightGrad(i, 0) for i in range(w[0], b[0])]
    return [ins for ins in order if ins.mb < m]


def forward_only_order(p: int, m: int, rank: int, v: int = 1, layout: str = "loop") -> List[Instr]:
    """Every forward of this rank and no backward (evaluation): microbatch order for one chunk per
    rank, the interleaved forward order for ``v`` chunks (``m`` a multiple of ``p``); in a V every
    microbatch through chunk 0, then every microbatch through chunk 1."""
    if layout == "v":
        return [Forward(i, c) for c in range(v) for i in range(m)]
    if v == 1:
        return [Forward(i) for i in range(m)]
    return [Forward(*_interleaved_unit(k, p, v, True)) for k in range(m * v)]


# ---------------------------------------------------------------------------------------- the schedules
Order = Callable[[int, int, int, int], List[Instr]]     # (p, m, rank, v) -> the compute order of ``rank``


@dataclass(frozen=True)
class ScheduleSpec:
    """One pipeline schedule and everything the rest of the package needs to know about it. Config checks,
    ``Parallel3D``, the demo, the planner and freeze training read these fields, never the name, so a new
    schedule is its compute order and one entry in :data:`SCHEDULE_SPECS`."""
    name: str                                  # what PipelineConfig(schedule=...) and --schedule take
    title: str                                 # how error messages name it
    order: Order
    chunks: int = 1                            # chunks per rank when num_chunks is not given
    any_chunks: bool = False                   # runs any number of chunks per rank (else exactly ``chunks``)
    layout: str = "loop"                       # where the chunks sit (:func:`stage_of`): "loop" or "v"
    splits_backward: bool = False              # B (input gradient) and W (weight gradients) apart
    microbatches_at_least_pp: bool = False     # needs num_microbatches >= the pipeline size
    microbatches_multiple_of_pp: bool = False  # needs num_microbatches divisible by the pipeline size
    # a steady-state forward and the backward after it share their message batches: without that the
    # order deadlocks under NCCL's rules (:func:`add_communication`)
    pairs_steady_state: bool = False

    def runs(self, num_chunks: int) -> bool:
        """Whether the schedule runs ``num_chunks`` chunks per rank."""
        return self.any_chunks or num_chunks == self.chunks

    @property
    def virtual_stages(self) -> bool:
        """More than one chunk per rank by default. Its chunks should cost alike, so a model's layers must
        split evenly into ``pp x chunks`` stages."""
        return self.chunks > 1


def _one_chunk(order: Callable[[int, int, int], List[Instr]]) -> Order:
    return lambda p, m, rank, v: order(p, m, rank)


SCHEDULE_SPECS: Mapping[str, ScheduleSpec] = MappingProxyType({spec.name: spec for spec in (
    ScheduleSpec("gpipe", "GPipe", _one_chunk(gpipe_order)),
    ScheduleSpec("1f1b", "1F1B", _one_chunk(one_f_one_b_order), microbatches_at_least_pp=True),
    ScheduleSpec("interleaved", "interleaved 1F1B", interleaved_order, chunks=2, any_chunks=True,
                 microbatches_multiple_of_pp=True, pairs_steady_state=True),
    ScheduleSpec("zb-h1", "ZB-H1", _one_chunk(zb_h1_order), splits_backward=True, microbatches_at_least_pp=True),
    ScheduleSpec("zbv", "ZBV", _one_chunk(zbv_order), chunks=2, layout="v", splits_backward=True),
)})


def schedule_spec(name: str) -> ScheduleSpec:
    """The declaration of schedule ``name``; a ValueError naming the known schedules for any other."""
    spec = SCHEDULE_SPECS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"pipeline: unknown schedule {name!r}; choose one of {schedule_names()}")
    return spec


def schedule_names() -> Tuple[str, ...]:
    """Every declared schedule's name, in declaration order."""
    return tuple(SCHEDULE_SPECS)


SCHEDULES = schedule_names()


def _units(order: Sequence[Instr], paired: bool) -> List[List[Instr]]:
    """Compute instructions grouped into units that share their messages: each alone, or (``paired``)
    each steady-state forward with the backward right after it."""
    units: List[List[Instr]] = []
    i = 0
    while i < len(order):
        if paired and order[i].op == "F" and i + 1 < len(order) and order[i + 1].op == "B":
            units.append([order[i], order[i + 1]])
            i += 2
        else:
            units.append([order[i]])
            i += 1
    return units


def add_communication(order: Sequence[Instr], p: int, rank: int, v: int = 1, paired: bool = False,
                      layout: str = "loop") -> List[Step]:
    """Insert the messages a compute order needs. Stage ``s = stage_of(rank, chunk)``; a neighbour stage
    on this same rank (``p == 1``, the turn of a V) is a local hand-off, no message. A W sends nothing.

    Between two units, the sends of the first and the receives of the second form one batch. A unit is
    one instruction, or with ``paired`` a steady-state forward and its backward (Megatron-LM's
    interleaved schedule: one ``send_forward_backward_recv_forward_backward`` per pair). Under NCCL a
    batch completes only when all of its messages, sends included, have been taken (one Work, one
    stream), and interleaved 1F1B with a batch between every two instructions deadlocks there;
    :func:`simulate` checks exactly that rule."""
    S = p * v

    def stage(chunk):
        return stage_of(rank, chunk, p, v, layout)

    def peer(s):                               # the rank of stage s, or None when it is this one
        r = place_of(s, p, v, layout)[0]
        return None if r == rank else r

    def sends(ins: Instr) -> List[Instr]:
        s = stage(ins.chunk)
        if ins.op == "F" and s < S - 1 and peer(s + 1) is not None:
            return [Instr("SEND_ACT", ins.mb, ins.chunk, peer(s + 1))]
        if ins.op == "B" and s > 0 and peer(s - 1) is not None:
            return [Instr("SEND_GRAD", ins.mb, ins.chunk, peer(s - 1))]
        return []

    def recvs(ins: Instr) -> List[Instr]:
        s = stage(ins.chunk)
        if ins.op == "F" and s > 0 and peer(s - 1) is not None:
            return [Instr("RECV_ACT", ins.mb, ins.chunk, peer(s - 1))]
        if ins.op == "B" and s < S - 1 and peer(s + 1) is not None:
            return [Instr("RECV_GRAD", ins.mb, ins.chunk, peer(s + 1))]
        return []

    # W sends and receives nothing and is transparent here: the W between two units go after the batch
    # between them, so they run while its messages travel (the engine waits for a received tensor at the
    # instruction that uses it, not before the W in between)
    units: List[Tuple[List[Instr], List[Instr]]] = []      # (the W before it, the unit)
    weights: List[Instr] = []
    for unit in _units([ins for ins in order if ins.op != "W"], paired):
        units.append(([], unit))
    k = 0
    for ins in order:                                      # hang each W on the unit after it
        if ins.op == "W":
            if k < len(units):
                units[k][0].append(ins)
            else:
                weights.append(ins)
        elif ins is units[k][1][-1] if k < len(units) else False:
            k += 1
    steps: List[Step] = []
    pending: List[Instr] = []
    for before, unit in units:
        batch = tuple(pending + [r for ins in unit for r in recvs(ins)])
        if batch:
            steps.append(batch)
        steps.extend(before)
        steps.extend(unit)
        pending = [snd for ins in unit for snd in sends(ins)]
    if pending:
        steps.append(tuple(pending))
    steps.extend(weights)
    return steps


def build_schedule(schedule: str, num_stages: int, num_microbatches: int, rank: int,
                   num_chunks: int = 1, forward_only: bool = False) -> List[Step]:
    """The instruction list of pipeline rank ``rank``; ``forward_only``: the evaluation list (see the
    module docstring), for the same arguments."""
    check_schedule_args(schedule, num_stages, num_microbatches, num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if not 0 <= rank < p:
        raise ValueError(f"pipeline: rank {rank} outside 0..{p - 1}")
    spec = schedule_spec(schedule)
    layout = spec.layout

    def order(r: int) -> List[Instr]:
        return forward_only_order(p, m, r, v, layout) if forward_only else spec.order(p, m, r, v)

    # in a V both directions of a link carry activations and gradients, in an order add_communication's
    # batches cannot keep deadlock-free (see lockstep_communication); evaluation too: rank 0 sends chunk 0's
    # output down while waiting for chunk 1's
    if layout == "v":
        return lockstep_communication([order(r) for r in range(p)], p, v, layout)[rank]
    # no pairing when every forward warms up (interleaved 1F1B with m == p)
    paired = spec.pairs_steady_state and not forward_only and m != p
    return add_communication(order(rank), p, rank, v, paired, layout)


def lockstep_communication(orders: Sequence[Sequence[Instr]], p: int, v: int, layout: str = "loop") -> List[List[Step]]:
    """Every rank's steps from every rank's compute order, with the messages batched by *tick*: the
    orders are run together with one instruction per rank per tick (F = B = W = 1, a message usable the
    tick after it is sent), and after each tick every rank posts one batch with what it sent in that
    tick and what was sent to it in that tick. Both ends of every message then post it in the same
    tick's batch, so no batch waits on a later one of its peer: deadlock-free under NCCL's rules
    whatever the order. :func:`add_communication` cannot promise that for ZBV: in a V both directions of
    a link carry activations and gradients, the sender's order of the two kinds is not the order the
    receiver needs them in, and two neighbours that send to each other in batches of their own
    deadlock. A receive may come earlier than needed; the engine waits for a received tensor where it
    is used."""
    S = p * v
    done: Dict[Tuple[str, int, int], int] = {}            # (op, mb, stage) -> tick it ran
    pos = [0] * p
    ticked: List[List[Tuple[int, Instr]]] = [[] for _ in range(p)]
    tick, idle = 0, 0
    while any(pos[r] < len(orders[r]) for r in range(p)):
        ran = []
        for r in range(p):
            if pos[r] == len(orders[r]):
                continue
            ins = orders[r][pos[r]]
            s = stage_of(r, ins.chunk, p, v, layout)
            need = [("F", ins.mb, s - 1)] if ins.op == "F" and s > 0 else \
                [("B", ins.mb, s + 1)] if ins.op == "B" and s < S - 1 else []
            if all(done.get(k, tick) < tick for k in need):
                ran.append((r, ins, s))
        for r, ins, s in ran:
            done[(ins.op, ins.mb, s)] = tick
            ticked[r].append((tick, ins))
            pos[r] += 1
        idle = 0 if ran else idle + 1
        if idle > 2:
            raise ScheduleError(f"lockstep_communication: the compute orders deadlock at tick {tick}")
        tick += 1
    batches: List[Dict[int, List[Instr]]] = [defaultdict(list) for _ in range(p)]   # rank -> tick -> messages
    for r in range(p):
        for t, ins in ticked[r]:
            s = stage_of(r, ins.chunk, p, v, layout)
            nxt = s + 1 if ins.op == "F" else s - 1
            if ins.op == "W" or not 0 <= nxt < S:
                continue
            q, c = place_of(nxt, p, v, layout)
            if q == r:
                continue                                   # the turn of the V: a local hand-off
            send, recv = ("SEND_ACT", "RECV_ACT") if ins.op == "F" else ("SEND_GRAD", "RECV_GRAD")
            batches[r][t].append(Instr(send, ins.mb, ins.chunk, q))
            batches[q][t].append(Instr(recv, ins.mb, c, r))
    out: List[List[Step]] = []
    for r in range(p):
        steps: List[Step] = []
        by_tick = dict(ticked[r])
        for t in range(tick):
            if t in by_tick:
                steps.append(by_tick[t])
            if batches[r].get(t):
                # sends first, then receives, each by peer: the same order at both ends of a pair
                steps.append(tuple(sorted(batches[r][t], key=lambda i: (not i.op.startswith("SEND"), i.peer))))
        out.append(steps)
    return out


def build_all(schedule: str, num_stages: int, num_microbatches: int, num_chunks: int = 1,
              forward_only: bool = False) -> List[List[Step]]:
    return [build_schedule(schedule, num_stages, num_microbatches, r, num_chunks, forward_only)
            for r in range(num_stages)]


def format_schedule(steps: Sequence[Step]) -> str:
    lines = []
    for step in steps:
        lines.append(str(step) if isinstance(step, Instr) else "  [" + ", ".join(map(str, step)) + "]")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- simulation
class ScheduleError(AssertionError):
    """A schedule that cannot run: deadlock, mismatched messages or a missing dependency."""


def simulate(streams: Sequence[Sequence[Step]], num_chunks: int = 1, forward_only: bool = False,
             layout: str = "loop") -> Dict[str, object]:
    """Run every rank's instruction stream against the others under NCCL's rules (the stricter ones;
    gloo's follow): a message moves only when both ends have posted it (rendezvous), messages match
    first-in-first-out per (sender, receiver) pair, and a communication step is one batch that ends
    only when every message in it, sends included, has been taken (one Work per batch, one stream per
    rank: nothing later starts before). Raises :class:`ScheduleError` on
    deadlock, on a message whose two ends disagree about (kind, microbatch, stage), on a forward whose
    input is not there, or a backward before its forward. Returns statistics (max in-flight per rank,
    number of rounds). ``forward_only``: evaluation streams (:func:`forward_only_order`): a backward or a
    gradient message is an error, and microbatches are not expected to run backward.

    W instructions: a W before its B, or a B without its W in a stream that has W, is an error.
    ``max_held``: per rank, the most (microbatch, chunk) whose forward ran and whose activations are
    still kept (until B without W, until W with it): the activation memory, in microbatches of a chunk.
    ``layout``: ``"v"`` for ZBV's streams (see :func:`stage_of`)."""
    p, v = len(streams), num_chunks
    S = p * v
    pos = [0] * p
    have_act = [set() for _ in range(p)]     # (mb, stage) inputs present on the rank
    have_grad = [set() for _ in range(p)]    # (mb, stage) output gradients present
    done_f = [set() for _ in range(p)]
    done_b = [set() for _ in range(p)]
    done_w = [set() for _ in range(p)]
    has_w = [any(isinstance(st, Instr) and st.op == "W" for st in stream) for stream in streams]
    in_flight = [0] * p
    max_in_flight = [0] * p
    held = [0] * p
    max_held = [0] * p
    posted: Dict[Tuple[int, int], deque] = defaultdict(deque)   # (src, dst) -> posted sends
    waiting: Dict[Tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> posted recvs
    done_ops: set = set()
    posted_batches = [None] * p
    rounds = 0

    def stage(r, chunk):
        return stage_of(r, chunk, p, v, layout)

    def here(r, s):          # stage s lives on rank r too: a local hand-off
        return place_of(s, p, v, layout)[0] == r

    while any(pos[r] < len(streams[r]) for r in range(p)):
        rounds += 1
        progressed = False
        for r in range(p):
            while pos[r] < len(streams[r]):
                step = streams[r][pos[r]]
                if isinstance(step, Instr):
                    s = stage(r, step.chunk)
                    key = (step.mb, s)
                    if forward_only and step.op != "F":
                        raise ScheduleError(f"rank {r}: {step} in a forward-only schedule")
                    if step.op == "W":
                        if key not in done_b[r] or key in done_w[r]:
                            raise ScheduleError(f"rank {r}: {step} before its backward (or twice)")
                        done_w[r].add(key)
                        held[r] -= 1
                        pos[r] += 1
                        progressed = True
                        continue
                    if step.op == "F":
                        local_prev = s > 0 and here(r, s - 1) and (step.mb, s - 1) in done_f[r]
                        if s > 0 and key not in have_act[r] and not local_prev:
                            raise ScheduleError(f"rank {r}: {step} has no input activation")
                        done_f[r].add(key)
                        in_flight[r] += 1
                        max_in_flight[r] = max(max_in_flight[r], in_flight[r])
                        held[r] += 1
                        max_held[r] = max(max_held[r], held[r])
                    else:
                        if key not in done_f[r]:
                            raise ScheduleError(f"rank {r}: {step} before its forward")
                        local_next = s < S - 1 and here(r, s + 1) and (step.mb, s + 1) in done_b[r]
                        if s < S - 1 and key not in have_grad[r] and not local_next:
                            raise ScheduleError(f"rank {r}: {step} has no output gradient")
                        done_b[r].add(key)
                        in_flight[r] -= 1
                        held[r] -= 0 if has_w[r] else 1
                    pos[r] += 1
                    progressed = True
                    continue
                if posted_batches[r] is None:          # post every op of the batch at once
                    posted_batches[r] = step
                    for ins in step:
                        if forward_only and ins.op.endswith("GRAD"):
                            raise ScheduleError(f"rank {r}: {ins} in a forward-only schedule")
                        if ins.op.startswith("SEND"):
                            if ins.op == "SEND_ACT" and (ins.mb, stage(r, ins.chunk)) not in done_f[r]:
                                raise ScheduleError(f"rank {r}: {ins} before its forward")
                            if ins.op == "SEND_GRAD" and (ins.mb, stage(r, ins.chunk)) not in done_b[r]:
                                raise ScheduleError(f"rank {r}: {ins} before its backward")
                            posted[(r, ins.peer)].append((r, ins))
                        else:
                            waiting[(ins.peer, r)].append((r, ins))
                    progressed = True
                # match what can be matched, FIFO per pair
                for pair in list(posted):
                    while posted[pair] and waiting[pair]:
                        (src, snd), (dst, rcv) = posted[pair].popleft(), waiting[pair].popleft()
                        s_src, s_dst = stage(src, snd.chunk), stage(dst, rcv.chunk)
                        ok = (snd.mb == rcv.mb and
                              ((snd.op == "SEND_ACT" and rcv.op == "RECV_ACT" and s_dst == s_src + 1) or
                               (snd.op == "SEND_GRAD" and rcv.op == "RECV_GRAD" and s_dst == s_src - 1)))
                        if not ok:
                            raise ScheduleError(f"message mismatch: rank {src} {snd} meets rank {dst} {rcv}")
                        done_ops.add((src, snd))
                        done_ops.add((dst, rcv))
                        (have_act if rcv.op == "RECV_ACT" else have_grad)[dst].add((rcv.mb, s_dst))
                        progressed = True
                # NCCL: the batch is done once all of its messages, sends too, have been matched
                if all((r, ins) in done_ops for ins in step):
                    posted_batches[r] = None
                    pos[r] += 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {r: str(streams[r][pos[r]]) for r in range(p) if pos[r] < len(streams[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}")
    unmatched = [str(ins) for q in posted.values() for _, ins in q]
    if unmatched:
        raise ScheduleError(f"sends never received: {unmatched}")
    for r in range(p):
        if in_flight[r] != 0 and not forward_only:
            raise ScheduleError(f"rank {r}: {in_flight[r]} microbatches never ran backward")
        if has_w[r] and done_w[r] != done_b[r]:
            raise ScheduleError(f"rank {r}: backwards without their W: {sorted(done_b[r] - done_w[r])}")
    return {"max_in_flight": max_in_flight, "max_held": max_held, "rounds": rounds,
            "forwards": [len(d) for d in done_f], "backwards": [len(d) for d in done_b],
            "weights": [len(d) for d in done_w]}


def simulate_timing(streams: Sequence[Sequence[Step]], num_chunks: int = 1, *, forward: float = 1.0,
                    backward: float = 2.0, weight: Optional[float] = None, latency: float = 0.0,
                    last_stage_extra: float = 0.0, layout: str = "loop",
                    durations: Optional[Dict[Tuple[int, str, int, int], float]] = None,
                    message_cost: float = 0.0) -> Dict[str, object]:
    """The time the instruction streams take when every stage's forward costs ``forward`` and backward
    ``backward`` (a chunk of ``v`` chunks per rank: ``1 / v`` of that; the last stage ``1 +
    last_stage_extra`` times it: LM head and loss), a message arrives ``latency`` after its send is
    posted, sends never block and a communication step waits for its receives (the engine's rules; in a
    schedule with W instructions a received tensor is waited for by the instruction that uses it).
    Returns ``{"step": ..., "bubble": ..., "busy": [...]}`` with the bubble defined as the engine's
    timeline measures it (mean over ranks of 1 - busy / step): the reference a measured bubble is
    compared with. With equal stages and no latency GPipe and 1F1B give ``(p-1)/(m+p-1)``.
    ``durations``: ``{(rank, op, mb, chunk): cost}`` replaces the model cost of those instructions (a
    measured timeline replayed: :func:`parallel_layers.pipeline.timeline.bubble_breakdown`).
    ``backward`` is the whole backward; in a stream with W instructions, W costs ``weight`` (default
    half the backward) and B the rest (F = B = W = 1: ``forward=1, backward=2``). ``message_cost``: the
    time a rank itself spends on each send it posts and each receive it completes (a host that copies
    messages through its own cores: gloo), added to its timeline, never to its busy time."""
    p, v = len(streams), num_chunks
    weight = backward / 2 if weight is None else weight
    has_w = [any(isinstance(st, Instr) and st.op == "W" for st in stream) for stream in streams]
    # with W the engine waits for a received tensor at the instruction that uses it (the W after a
    # batch run while its messages travel); without, a communication step waits for its receives
    lazy = any(has_w)

    def _remote_input(ins: Instr, r: int):
        s = stage_of(r, ins.chunk, p, v, layout)
        if ins.op == "F" and s > 0 and place_of(s - 1, p, v, layout)[0] != r:
            return ("A", ins.mb, s)
        if ins.op == "B" and s < S - 1 and place_of(s + 1, p, v, layout)[0] != r:
            return ("G", ins.mb, s)
        return None
    S = p * v
    now, pos, busy = [0.0] * p, [0] * p, [0.0] * p
    arrival: Dict[Tuple[str, int, int], float] = {}     # (kind, mb, receiving stage) -> time
    sent: set = set()                                   # (rank, position) of the communication steps posted
    while any(pos[r] < len(streams[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(streams[r]):
                step = streams[r][pos[r]]
                if isinstance(step, Instr):
                    key = (r, step.op, step.mb, step.chunk)
                    need = lazy and _remote_input(step, r)
                    if need:
                        if need not in arrival:
                            break              # not sent yet: let the others run
                        now[r] = max(now[r], arrival[need])
                    if durations is not None and key in durations:
                        cost = durations[key]
                    else:
                        full = backward - weight if has_w[r] else backward
                        cost = {"F": forward, "B": full, "W": weight}[step.op] / v
                        if stage_of(r, step.chunk, p, v, layout) == S - 1:
                            cost *= 1.0 + last_stage_extra
                    now[r] += cost
                    busy[r] += cost
                else:
                    needs = []
                    if (r, pos[r]) not in sent:        # (a step revisited after waiting posts its sends once)
                        sent.add((r, pos[r]))
                        now[r] += message_cost * sum(1 for ins in step if ins.op.startswith("SEND"))
                    for ins in step:
                        s = stage_of(r, ins.chunk, p, v, layout)
                        if ins.op == "SEND_ACT":
                            arrival[("A", ins.mb, s + 1)] = now[r] + latency
                        elif ins.op == "SEND_GRAD":
                            arrival[("G", ins.mb, s - 1)] = now[r] + latency
                        else:
                            needs.append(("A" if ins.op == "RECV_ACT" else "G", ins.mb, s))
                    if not lazy:
                        if not all(k in arrival for k in needs):
                            break              # its messages are not sent yet: let the others run
                        now[r] = max([now[r]] + [arrival[k] for k in needs])
                    now[r] += message_cost * len(needs)        # each received message taken in once it is here
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ScheduleError("simulate_timing: deadlock (run simulate() for the details)")
    step_time = max(now)
    return {"step": step_time, "busy": busy,
            "bubble": sum(1.0 - b / step_time for b in busy) / p if step_time > 0 else 0.0}


__all__ = ["Instr", "Forward", "Backward", "WeightGrad", "SCHEDULES", "ScheduleSpec", "SCHEDULE_SPECS",
           "schedule_spec", "schedule_names", "LAYOUTS", "layout_of", "stage_of", "place_of",
           "build_schedule", "build_all", "format_schedule", "simulate", "simulate_timing", "ScheduleError",
           "check_schedule_args", "add_communication", "lockstep_communication", "forward_only_order",
           "zb_h1_order", "zbv_order"]
