"""A recorded timeline per pipeline rank, its measured bubble fraction, and a PNG drawing.

Every rank records ``(op, microbatch, chunk, start, end)`` for each compute instruction it runs (op
``"F"`` forward, ``"B"`` backward or, in zero-bubble schedules, its input-gradient half, ``"BW"`` the
weight-gradient half: the schedule's ``WeightGrad``) and for each wait on communication (op ``"W"``).
Times are ``time.perf_counter()`` seconds relative to the rank's own entry into the step.
``perf_counter`` is CLOCK_MONOTONIC on Linux: one clock for every process of a host, so when all
ranks of the pipeline run on one host the gathered timelines are put on a common origin (the earliest
rank's entry) and a rank that entered later shows that delay as idle; across hosts (clocks not
comparable) each rank's zero is its own entry. No barrier is needed inside the step: a caller that
wants aligned starts (a benchmark) meets at one before calling ``step``.

Bubble fraction of a rank = 1 - (compute time) / (step time), step time = from the first rank's entry
to the last rank's end; the pipeline's figure is the mean over ranks: the share of stage-time the
pipeline left idle (waiting on neighbours or messages, posting them, or engine overhead between
instructions), which is what ``(p - 1) / (m + p - 1)`` predicts for 1F1B with equal stages. The same
definition holds for interleaved schedules (compute of every chunk of the rank counts as busy).
"""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

COMPUTE = ("F", "B", "BW")       # the events that count as busy; "W" is a wait


def schedule_op(event_op: str) -> str:
    """The schedule's instruction op of a recorded compute event (``"BW"`` is the schedule's ``"W"``)."""
    return "W" if event_op == "BW" else event_op


@dataclass
class Event:
    op: str          # "F", "B", "BW" (compute: forward, backward / input grad, weight grad) or "W" (waiting)
    mb: int
    chunk: int
    start: float
    end: float


@dataclass
class Timeline:
    rank: int
    events: List[Event] = field(default_factory=list)
    t0: float = 0.0            # absolute perf_counter() of the rank's entry into the step
    t_end: float = 0.0         # end, relative to t0
    entry: float = 0.0         # this rank's entry into the step, relative to t0 (0 but on a common origin)

    def start(self) -> None:
        self.events.clear()
        self.t0 = time.perf_counter()

    def record(self, op: str, mb: int, chunk: int, start: float, end: float) -> None:
        self.events.append(Event(op, mb, chunk, start - self.t0, end - self.t0))

    def stop(self) -> None:
        self.t_end = time.perf_counter() - self.t0

    @property
    def busy(self) -> float:
        return sum(e.end - e.start for e in self.events if e.op in COMPUTE)

    def to_rows(self) -> List[tuple]:
        return [(e.op, e.mb, e.chunk, e.start, e.end) for e in self.events]


def bubble_fraction(timelines: Sequence[Timeline]) -> float:
    """Mean over ranks of idle / step time, step time = the last rank's end."""
    total = max(t.t_end for t in timelines)
    if total <= 0:
        return 0.0
    return sum(1.0 - t.busy / total for t in timelines) / len(timelines)


def replay_durations(timelines: Sequence[Timeline], with_overhead: bool) -> Dict[Tuple[int, str, int, int], float]:
    """``{(rank, op, mb, chunk): seconds}`` of every recorded forward/backward. ``with_overhead``: each
    instruction also absorbs the rank's own time since its previous compute ended that was not spent
    waiting for a message (posting sends and receives, bookkeeping: the engine's cost)."""
    out: Dict[Tuple[int, str, int, int], float] = {}
    for t in timelines:
        prev_end, waited = t.entry, 0.0
        for e in t.events:
            if e.op == "W":
                waited += e.end - e.start
                continue
            start = min(prev_end + waited, e.start) if with_overhead else e.start
            out[(t.rank, schedule_op(e.op), e.mb, e.chunk)] = e.end - start
            prev_end, waited = e.end, 0.0
    return out


def bubble_breakdown(timelines: Sequence[Timeline], schedule: str, num_microbatches: int,
                     num_chunks: int = 1) -> Dict[str, float]:
    """Where a measured bubble comes from, by replaying the recorded instruction times through the
    schedule's timing model (``schedules.simulate_timing``: messages arrive when sent, sends never block):

    - ``ideal``: equal stages, free messages: the schedule's own bubble (``(p-1)/(m+p-1)`` for 1F1B);
    - ``compute``: the measured forward/backward times, free messages and no engine time: adds unequal
      stages and run-to-run jitter of the compute (a slow op delays its neighbours);
    - ``engine``: also each rank's own time between instructions (posting messages, bookkeeping);
    - ``measured``: the recorded bubble; ``measured - engine`` is what message latency cost.

    The keys ``imbalance_jitter``, ``engine_overhead`` and ``messages`` give those increments; they sum
    with ``ideal`` to ``measured``."""
    from .schedules import build_all, layout_of, simulate_timing

    p = len(timelines)
    streams = build_all(schedule, p, num_microbatches, num_chunks)
    layout = layout_of(schedule)
    busy = {t.rank: t.busy for t in timelines}

    def replayed(with_overhead: bool) -> float:   # idle share of the replay; busy = compute only
        step = simulate_timing(streams, num_chunks, layout=layout,
                               durations=replay_durations(timelines, with_overhead))["step"]
        return sum(1.0 - b / step for b in busy.values()) / p if step > 0 else 0.0

    ideal = simulate_timing(streams, num_chunks, layout=layout)["bubble"]
    compute, engine = replayed(False), replayed(True)
    measured = bubble_fraction(timelines)
    return {"ideal": ideal, "compute": compute, "engine": engine, "measured": measured,
            "imbalance_jitter": compute - ideal, "engine_overhead": engine - compute, "messages": measured - engine}


def gather_timelines(local: Timeline, group) -> Optional[List[Timeline]]:
    """Every pipeline rank's timeline on the group's rank 0 (None elsewhere), on a common time origin
    when the ranks share a host. A collective."""
    if group is None or dist.get_world_size(group) == 1:
        return [local]
    out = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object((local.rank, local.to_rows(), local.t_end, local.t0, socket.gethostname()), out,
                       group_dst=0, group=group)
    if out is None:
        return None
    one_host = len({host for *_, host in out}) == 1
    origin = min(t0 for _, _, _, t0, _ in out) if one_host else 0.0
    result = []
    for rank, rows, t_end, t0, _ in out:
        shift = t0 - origin if one_host else 0.0     # onto the common origin (same clock on one host)
        tl = Timeline(rank)
        tl.events = [Event(op, mb, c, a + shift, b + shift) for op, mb, c, a, b in rows]
        tl.t0, tl.t_end, tl.entry = origin if one_host else t0, t_end + shift, shift
        result.append(tl)
    return result


def draw(timelines: Sequence[Timeline], path: str, title: str = "") -> Optional[str]:
    """Draw the ranks' timelines (one row per rank; forward blue, backward green (in zero-bubble schedules
    its input-gradient half), weight gradients orange, waits grey; the microbatch written in each box,
    ``mb.chunk`` with virtual stages) to a PNG; None without matplotlib."""
    from ..optional import pyplot
    plt = pyplot()
    if plt is None:
        return None

    n = len(timelines)
    chunks = max((e.chunk for t in timelines for e in t.events), default=0) + 1
    fig, ax = plt.subplots(figsize=(12, 0.7 * n + 1.4))
    colors = {"F": ["#4c72b0", "#8fb0e0", "#2a4a80"], "B": ["#55a868", "#96d3a6", "#2f6e3f"],
              "BW": ["#dd8452", "#f0b48c", "#a0522d"]}
    total = max(t.t_end for t in timelines) * 1e3
    for t in timelines:
        y = n - 1 - t.rank
        for e in t.events:
            s, w = e.start * 1e3, (e.end - e.start) * 1e3
            if e.op == "W":
                ax.broken_barh([(s, w)], (y - 0.15, 0.3), facecolors="#cccccc")
                continue
            ax.broken_barh([(s, w)], (y - 0.4, 0.8), facecolors=colors[e.op][e.chunk % 3], edgecolor="white",
                           linewidth=0.5)
            if w > total / 80:
                label = f"{e.mb}" if chunks == 1 else f"{e.mb}.{e.chunk}"
                ax.text(s + w / 2, y, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {n - 1 - i}" for i in range(n)])
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, total * 1.01)
    bubble = bubble_fraction(timelines)
    what = "blue forward, green backward, grey waiting"
    if any(e.op == "BW" for t in timelines for e in t.events):
        what = "blue F, green B (input grad), orange W (weight grads), grey waiting"
    ax.set_title(f"{title}  bubble {bubble:.1%}  ({what})".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["COMPUTE", "schedule_op", "Event", "Timeline", "bubble_fraction", "bubble_breakdown", "replay_durations",
           "gather_timelines", "draw"]
