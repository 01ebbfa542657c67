"""AutoFreeze: when the bottom blocks of a model stop changing, and how many of them to freeze.

A policy answers one question before every training step: how many blocks, counted from the bottom,
are frozen for this step (``frozen_blocks(step, current)``; 0-based step index = the number of steps
already taken). Frozen only grows: a block once frozen stays frozen, and the embedding is frozen with
the first block (the prefix the frozen blocks need as input).

* :class:`NoFreeze`: nothing is ever frozen (the static run).
* :class:`FreezeSchedule`: fixed points, ``{step: blocks}``: from ``step`` on, the first ``blocks`` blocks
  are frozen (``"3:2,10:4"`` on the command line).
* :class:`AutoFreeze`: the adaptive criterion. After every step it is handed each active block's
  gradient norm (of the data-parallel-reduced gradient, before clipping, summed over every rank by
  one all-reduce: every rank holds the same numbers, so every rank takes the same decision). Over a
  window of ``interval`` steps it averages them; a block is *stable* when its windowed mean changed by
  less than ``threshold`` (relative) since the previous window. The stable blocks directly above the
  frozen prefix are frozen, at most ``rate`` x the active blocks per decision (at least one) and never
  more than ``cap`` of all blocks. This is PipeTransformer's rule in spirit (freeze bottom-up, gradient
  norms that stopped changing, an upper bound growing with what is still active); its exact thresholds
  differ.

Every policy refuses to freeze more than ``cap`` of the blocks (a fraction, default 0.5) and always
leaves one block to train.
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence

import torch


def max_frozen(num_blocks: int, cap: float) -> int:
    """The most blocks a policy may freeze: ``floor(cap * num_blocks)``, leaving at least one active."""
    if not 0.0 <= cap < 1.0:
        raise ValueError(f"AutoFreeze: cap={cap!r} must be a fraction in [0, 1) of the blocks (1 would leave "
                         f"nothing to train)")
    return min(int(math.floor(cap * num_blocks + 1e-9)), num_blocks - 1)


class FreezePolicy:
    """The interface: :meth:`frozen_blocks` before each step, :meth:`observe` after it (only called with
    gradient norms when :attr:`needs_grad_norms`)."""
    needs_grad_norms = False

    def frozen_blocks(self, step: int, current: int) -> int:
        raise NotImplementedError

    def observe(self, step: int, first_active: int, norms: Optional[torch.Tensor]) -> None:
        """After step ``step``: ``norms[i]`` is block ``first_active + i``'s gradient norm (the same on
        every rank)."""

    def describe(self) -> str:
        raise NotImplementedError


class NoFreeze(FreezePolicy):
    def frozen_blocks(self, step: int, current: int) -> int:
        return current

    def describe(self) -> str:
        return "off"


class FreezeSchedule(FreezePolicy):
    """``points``: ``{step: blocks}``, from ``step`` (0-based: after that many steps) the first ``blocks``
    blocks are frozen; steps and block counts must both increase."""

    def __init__(self, points: Mapping[int, int], num_blocks: int, cap: float = 0.5):
        self.points = dict(sorted((int(s), int(b)) for s, b in points.items()))
        limit = max_frozen(num_blocks, cap)
        counts = list(self.points.values())
        if any(s < 0 for s in self.points) or any(b < 1 for b in counts):
            raise ValueError(f"FreezeSchedule: {self.describe()}: steps must be >= 0 and block counts >= 1")
        if counts != sorted(set(counts)):
            raise ValueError(f"FreezeSchedule: {self.describe()}: frozen block counts must increase with the step "
                             f"(a frozen block stays frozen)")
        if counts and counts[-1] > limit:
            raise ValueError(f"FreezeSchedule: {self.describe()} freezes {counts[-1]} of {num_blocks} blocks, over "
                             f"the cap of {limit} (cap {cap:g}); raise the cap (below 1) or freeze fewer blocks")

    def frozen_blocks(self, step: int, current: int) -> int:
        due = [b for s, b in self.points.items() if s <= step]
        return max([current] + due)

    def describe(self) -> str:
        return ",".join(f"{s}:{b}" for s, b in self.points.items())


class AutoFreeze(FreezePolicy):
    """The adaptive criterion of the module docstring. ``interval``: steps per window; ``threshold``:
    the relative change of a block's mean gradient norm below which it counts as stable; ``rate``: at
    most this fraction of the active blocks per decision; ``cap``: at most this fraction of all blocks
    frozen; ``warmup_windows``: windows observed before the first decision is allowed."""
    needs_grad_norms = True

    def __init__(self, num_blocks: int, *, cap: float = 0.5, interval: int = 10, threshold: float = 0.1,
                 rate: float = 0.5, warmup_windows: int = 2):
        if interval < 1 or threshold <= 0 or not 0 < rate <= 1 or warmup_windows < 1:
            raise ValueError(f"AutoFreeze: interval={interval} (>= 1), threshold={threshold} (> 0), rate={rate} "
                             f"(in (0, 1]) and warmup_windows={warmup_windows} (>= 1) out of range")
        self.num_blocks, self.cap, self.limit = num_blocks, cap, max_frozen(num_blocks, cap)
        self.interval, self.threshold, self.rate, self.warmup = interval, threshold, rate, warmup_windows
        self._sum = torch.zeros(num_blocks, dtype=torch.float64)
        self._count = torch.zeros(num_blocks, dtype=torch.float64)
        self._previous: Optional[torch.Tensor] = None      # last window's mean norm per block (NaN: not seen)
        self.windows = 0
        self.target = 0
        self.decisions: List[Dict[str, object]] = []        # every window's change rates and outcome

    def frozen_blocks(self, step: int, current: int) -> int:
        return max(current, self.target)

    def observe(self, step: int, first_active: int, norms: Optional[torch.Tensor]) -> None:
        if norms is None:
            return
        norms = norms.detach().to("cpu", torch.float64)
        self._sum[first_active:first_active + norms.numel()] += norms
        self._count[first_active:first_active + norms.numel()] += 1
        if (step + 1) % self.interval:
            return
        mean = torch.where(self._count > 0, self._sum / self._count.clamp_min(1), torch.nan)
        self._sum.zero_()
        self._count.zero_()
        self.windows += 1
        previous, self._previous = self._previous, mean
        if previous is None or self.windows <= self.warmup:
            return
        change = ((mean - previous).abs() / previous.abs()).tolist()
        self.target = max(self.target, self._decide(max(first_active, self.target), change))
        self.decisions.append({"step": step + 1, "change": [round(c, 4) if c == c else None for c in change],
                               "frozen": self.target})

    def _decide(self, first_active: int, change: Sequence[float]) -> int:
        """The new frozen count: the stable run of blocks from ``first_active`` up, bounded per decision and
        by the cap (a NaN change, a block not seen in both windows, is not stable)."""
        active = self.num_blocks - first_active
        step_limit = max(1, int(self.rate * active))
        frozen = first_active
        while (frozen < min(self.limit, first_active + step_limit)
               and change[frozen] == change[frozen] and change[frozen] < self.threshold):
            frozen += 1
        return frozen

    def describe(self) -> str:
        return (f"auto (window {self.interval} steps, threshold {self.threshold:g}, rate {self.rate:g}, "
                f"cap {self.cap:g})")


def parse_freeze(spec: str, num_blocks: int, cap: float = 0.5, **auto_options) -> FreezePolicy:
    """``"off"``, ``"auto"`` or ``"STEP:BLOCKS,..."`` (e.g. ``"3:2,10:4"``: blocks 0-1 frozen from step 3,
    blocks 0-3 from step 10) -> a policy over ``num_blocks`` blocks with at most ``cap`` of them frozen."""
    text = spec.strip().lower()
    if text == "off":
        return NoFreeze()
    if text == "auto":
        return AutoFreeze(num_blocks, cap=cap, **auto_options)
    points: Dict[int, int] = {}
    for item in text.split(","):
        step, sep, blocks = item.partition(":")
        if not sep or not step.strip().isdigit() or not blocks.strip().isdigit():
            raise ValueError(f"freeze schedule {spec!r}: {item!r} is not STEP:BLOCKS (e.g. '3:2,10:4': the first 2 "
                             f"blocks frozen from step 3, the first 4 from step 10); or use 'auto' or 'off'")
        points[int(step)] = int(blocks)
    return FreezeSchedule(points, num_blocks, cap)


__all__ = ["FreezePolicy", "NoFreeze", "FreezeSchedule", "AutoFreeze", "parse_freeze", "max_frozen"]
