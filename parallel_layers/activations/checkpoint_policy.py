"""Where to checkpoint: placement policies for activation checkpointing, and the memory they keep.

A placement is a :class:`CheckpointPlan`: disjoint runs of consecutive blocks (``segments``), each run
checkpointed as one (only the run's input is kept; backward recomputes the whole run), the other blocks
plain. The policies that ``checkpoint=`` accepts (:func:`resolve_policy`):

* ``True`` / :class:`EveryBlock`: every block its own segment (n inputs kept, one block recomputed at a
  time); ``False``: none; an int ``n`` / :class:`FirstBlocks`: the first ``n`` blocks, each its own
  segment (Megatron-LM's ``--recompute-method block``).
* ``"sqrt"`` / :class:`SqrtPolicy`: Chen et al. 2016 ("Training deep nets with sublinear memory cost"):
  about sqrt(n) segments of about sqrt(n) blocks, only each segment's input kept; backward recomputes one
  segment at a time, so the activations held are O(sqrt(n)) inputs + one segment's internals, against
  n inputs + one block's for every-block checkpointing (fewer bytes kept at the end of forward, more
  held while a segment is recomputed).
* :class:`MemoryBudget` (``Budget``): the placement that recomputes the least (the fewest blocks, or the
  least of given per-block costs) whose modelled activation peak (:func:`plan_memory`) fits a budget in
  bytes. The per-block bytes are given, or measured once per input shape on one micro-batch
  (:func:`measure_blocks`, saved-tensor hooks, RNG state restored so the step's dropout masks are
  untouched).

The memory model (per micro-batch, per model or pipeline stage), ``a[i]`` the bytes block ``i`` saves for
backward when run plainly, ``x[i]`` the bytes of its input: a plain block keeps ``a[i]``, a segment
``[s, e)`` keeps ``x[s]``. Backward frees a block's saved tensors after its backward, so the live bytes
peak either at the end of forward (everything kept, ``kept``) or while a segment is recomputed: everything
kept by the blocks before it and its input, plus the segment's recomputed ``sum(a[s:e])``. ``peak`` is the
larger of the two. Gradients, parameters and the head's activations are outside the model (equal for
every placement).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

Segments = Tuple[Tuple[int, int], ...]


@dataclass(frozen=True)
class CheckpointPlan:
    """``segments``: sorted, disjoint ``(start, end)`` runs of blocks, each checkpointed as one; the blocks
    outside every run are plain."""
    num_blocks: int
    segments: Segments = ()

    def __post_init__(self):
        last = 0
        for s, e in self.segments:
            if not (last <= s < e <= self.num_blocks):
                raise ValueError(f"CheckpointPlan: segments {self.segments} must be sorted, disjoint, non-empty "
                                 f"runs inside 0..{self.num_blocks}")
            last = e

    @classmethod
    def first(cls, num_blocks: int, n: int) -> "CheckpointPlan":
        """The first ``n`` blocks checkpointed, each on its own."""
        return cls(num_blocks, tuple((i, i + 1) for i in range(min(n, num_blocks))))

    @property
    def recomputed(self) -> int:
        """Blocks that run twice (forward and the recomputation in backward)."""
        return sum(e - s for s, e in self.segments)

    def describe(self) -> str:
        if not self.segments:
            return "none"
        return " ".join(f"[{s}]" if e == s + 1 else f"[{s}-{e - 1}]" for s, e in self.segments)


def plan_memory(plan: CheckpointPlan, block_bytes: Sequence[float],
                input_bytes: Sequence[float]) -> Tuple[float, float]:
    """``(kept, peak)``: the bytes kept for backward at the end of forward, and the modelled peak of
    activation bytes through backward (see the module docstring)."""
    starts = {s: e for s, e in plan.segments}
    kept = peak = 0.0
    i = 0
    while i < plan.num_blocks:
        if i in starts:
            e = starts[i]
            kept += input_bytes[i]
            peak = max(peak, kept + sum(block_bytes[i:e]))
            i = e
        else:
            kept += block_bytes[i]
            i += 1
    return kept, max(peak, kept)


def _solve(block_bytes: Sequence[float], input_bytes: Sequence[float], budget: float,
           costs: Optional[Sequence[float]] = None) -> Optional[CheckpointPlan]:
    """:func:`budget_plan`'s search; None when no placement fits.

    Exact, by dynamic programming over block positions. A partial placement of blocks ``0..i-1`` is
    summarised by ``(K, C)``: the bytes it keeps and its cost. Every constraint a continuation must meet
    reads the prefix only through ``K`` (a plain block ``i`` needs ``K + a[i] <= budget``, a segment
    ``[i, e)`` needs ``K + x[i] + sum(a[i:e]) <= budget``), monotonically, and cost adds. So a prefix with
    ``K' <= K`` and ``C' <= C`` can replace the other in any completion: keeping, at each position, only
    the prefixes not dominated that way (the Pareto front of ``(K, C)``) loses no optimum. From each kept
    prefix the step tries block ``i`` plain and every segment ``[i, e)``; at position n the front's
    cheapest (then smallest ``K``) is optimal.
    """
    n = len(block_bytes)
    if len(input_bytes) != n:
        raise ValueError(f"budget_plan: {n} block sizes but {len(input_bytes)} input sizes")
    costs = [1.0] * n if costs is None else [float(c) for c in costs]
    if len(costs) != n:
        raise ValueError(f"budget_plan: {n} block sizes but {len(costs)} costs")
    fronts: List[Dict[float, Tuple[float, Segments]]] = [dict() for _ in range(n + 1)]
    fronts[0][0.0] = (0.0, ())

    def offer(i, kept, cost, segs):
        old = fronts[i].get(kept)
        if old is None or cost < old[0]:
            fronts[i][kept] = (cost, segs)

    for i in range(n):
        front = sorted(fronts[i].items())
        pruned, best = [], math.inf
        for kept, (cost, segs) in front:          # the Pareto front: K ascending, cost strictly falling
            if cost < best:
                pruned.append((kept, cost, segs))
                best = cost
        for kept, cost, segs in pruned:
            if kept + block_bytes[i] <= budget:
                offer(i + 1, kept + block_bytes[i], cost, segs)
            inner, c = 0.0, cost
            for e in range(i + 1, n + 1):
                inner += block_bytes[e - 1]
                c += costs[e - 1]
                if kept + input_bytes[i] + inner > budget:
                    break
                offer(e, kept + input_bytes[i], c, segs + ((i, e),))
    if not fronts[n]:
        return None
    kept, (cost, segs) = min(fronts[n].items(), key=lambda kv: (kv[1][0], kv[0]))
    return CheckpointPlan(n, segs)


def budget_plan(block_bytes: Sequence[float], input_bytes: Sequence[float], budget: float,
                costs: Optional[Sequence[float]] = None) -> CheckpointPlan:
    """The placement of least recomputation (``sum(costs)`` over the recomputed blocks; default 1 per
    block) whose :func:`plan_memory` peak is at most ``budget``; among those, the one keeping the fewest
    bytes (:func:`_solve`, exact). Raises ``ValueError`` naming the numbers when no placement fits."""
    plan = _solve(block_bytes, input_bytes, budget, costs)
    if plan is None:
        n = len(block_bytes)
        every = plan_memory(CheckpointPlan.first(n, n), block_bytes, input_bytes)
        sqrt = plan_memory(SqrtPolicy().plan(n), block_bytes, input_bytes)
        least = min_peak(block_bytes, input_bytes)
        raise ValueError(f"MemoryBudget: no checkpoint placement of {n} blocks fits {budget:,.0f} bytes of "
                         f"activations: every block checkpointed peaks at {every[1]:,.0f} (keeps {every[0]:,.0f}), "
                         f"sqrt segments at {sqrt[1]:,.0f}, the smallest any placement reaches is {least:,.0f}; "
                         f"raise the budget or use smaller micro-batches")
    return plan


def min_peak(block_bytes: Sequence[float], input_bytes: Sequence[float]) -> float:
    """The smallest modelled peak any placement reaches, to half a byte (bisection on feasibility)."""
    n = len(block_bytes)
    lo, hi = 0.0, plan_memory(CheckpointPlan.first(n, n), block_bytes, input_bytes)[1]
    for _ in range(60):
        if hi - lo <= 0.5:
            break
        mid = (lo + hi) / 2
        if _solve(block_bytes, input_bytes, mid) is not None:
            hi = mid
        else:
            lo = mid
    return hi


# ------------------------------------------------------------------------------------------- policies
class Policy:
    """A placement rule: ``plan(num_blocks, profile)``; ``needs_profile``: it needs measured block sizes."""
    needs_profile = False

    def plan(self, num_blocks: int, profile: Optional["BlockProfile"] = None) -> CheckpointPlan:
        raise NotImplementedError

    def static_count(self, num_blocks: int) -> Optional[int]:
        """How many blocks it recomputes, where that is known without measuring."""
        return None if self.needs_profile else self.plan(num_blocks).recomputed


@dataclass(frozen=True)
class FirstBlocks(Policy):
    """The first ``n`` blocks, each checkpointed alone (``checkpoint=n``; ``n >= num_blocks``: every block)."""
    n: int

    def plan(self, num_blocks, profile=None):
        return CheckpointPlan.first(num_blocks, self.n)


class EveryBlock(FirstBlocks):
    """Every block checkpointed alone (``checkpoint=True``)."""

    def __init__(self):
        super().__init__(1 << 62)

    def __repr__(self):
        return "EveryBlock()"


@dataclass(frozen=True)
class SqrtPolicy(Policy):
    """Chen et al.'s sqrt(n) rule: segments of ``segment`` blocks (default ``ceil(sqrt(n))``), their number
    ``ceil(n / segment)``, the blocks shared out as evenly as possible (earlier segments one longer)."""
    segment: Optional[int] = None

    def plan(self, num_blocks, profile=None):
        if num_blocks == 0:
            return CheckpointPlan(0)
        k = self.segment or math.ceil(math.sqrt(num_blocks))
        if k < 1:
            raise ValueError(f"SqrtPolicy: segment={k} must be >= 1")
        m = math.ceil(num_blocks / k)
        base, extra = divmod(num_blocks, m)
        segs, s = [], 0
        for j in range(m):
            e = s + base + (1 if j < extra else 0)
            segs.append((s, e))
            s = e
        return CheckpointPlan(num_blocks, tuple(segs))


@dataclass(frozen=True)
class BlockProfile:
    """Per block: ``block_bytes`` saved for backward when run plainly, ``input_bytes`` of its input."""
    block_bytes: Tuple[float, ...]
    input_bytes: Tuple[float, ...]

    @property
    def none_peak(self) -> float:
        return sum(self.block_bytes)


@dataclass(frozen=True)
class MemoryBudget(Policy):
    """The least recomputation whose activation peak fits ``budget_bytes`` (per micro-batch, per model or
    stage; see :func:`budget_plan`). ``block_bytes``/``input_bytes``: per-block sizes, else measured on the
    first training forward of each input shape; ``fraction``: instead of bytes, a fraction of the measured
    peak without checkpointing (``MemoryBudget(fraction=0.5)``); ``costs``: per-block recomputation costs
    (default 1 each: the fewest blocks)."""
    budget_bytes: Optional[float] = None
    block_bytes: Optional[Tuple[float, ...]] = None
    input_bytes: Optional[Tuple[float, ...]] = None
    costs: Optional[Tuple[float, ...]] = None
    fraction: Optional[float] = None

    def __post_init__(self):
        if (self.budget_bytes is None) == (self.fraction is None):
            raise ValueError("MemoryBudget: give either budget_bytes or fraction (of the peak without checkpointing)")
        if (self.block_bytes is None) != (self.input_bytes is None):
            raise ValueError("MemoryBudget: give block_bytes and input_bytes together (or neither: measured)")

    @property
    def needs_profile(self):
        return self.block_bytes is None

    def plan(self, num_blocks, profile=None):
        if self.block_bytes is not None:
            profile = BlockProfile(tuple(self.block_bytes), tuple(self.input_bytes))
        if profile is None:
            raise ValueError("MemoryBudget: per-block sizes are needed; they are measured on a training forward")
        if len(profile.block_bytes) != num_blocks:
            raise ValueError(f"MemoryBudget: sizes of {len(profile.block_bytes)} blocks for {num_blocks} blocks")
        budget = self.budget_bytes if self.fraction is None else self.fraction * profile.none_peak
        return budget_plan(profile.block_bytes, profile.input_bytes, budget, self.costs)


Budget = MemoryBudget


def resolve_policy(checkpoint, where: str = "checkpoint") -> Policy:
    """``checkpoint=`` -> a :class:`Policy`: True (every block), False (none), an int ``n`` (the first
    ``n``), ``"sqrt"``, or a Policy instance."""
    if isinstance(checkpoint, Policy):
        return checkpoint
    if isinstance(checkpoint, bool):
        return EveryBlock() if checkpoint else FirstBlocks(0)
    if isinstance(checkpoint, int) and checkpoint >= 0:
        return FirstBlocks(checkpoint)
    if checkpoint == "sqrt":
        return SqrtPolicy()
    raise ValueError(f"{where}: checkpoint={checkpoint!r} must be True (every block), False (none), a number of "
                     f"blocks >= 0 to recompute, 'sqrt' (Chen et al.'s segments), or a policy "
                     f"(SqrtPolicy(), MemoryBudget(bytes))")


# ------------------------------------------------------------------------------------------- measuring
def _storage_key(t: torch.Tensor):
    return t.untyped_storage().data_ptr(), t.device


def _storage_id(storage) -> int:
    """The same number for every Python object of one storage (torch's ``_cdata``; it has no public one)."""
    return storage._cdata


def _is_weight(t: torch.Tensor) -> bool:
    """A parameter (a leaf that requires grad) or a view of one: saved by reference, not an activation."""
    base = t if t._base is None else t._base
    return base.is_leaf and base.requires_grad


def saved_bytes(fn: Callable[[], object]) -> Tuple[object, float]:
    """``(fn(), bytes)``: the bytes of the distinct storages autograd saves for backward while ``fn`` runs
    (saved-tensor hooks; a tensor saved twice counts once; parameters, leaves that require grad, and their
    views are not activations and are left out: a frozen parameter counts). A checkpointed region's inputs
    are seen (torch saves them for backward), what it recomputes is not."""
    seen: Dict[tuple, int] = {}

    def pack(t):
        if not _is_weight(t):
            seen.setdefault(_storage_key(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, float(sum(seen.values()))


def measure_blocks(fns: Sequence[Callable[[torch.Tensor], torch.Tensor]], h: torch.Tensor,
                   tracker=None) -> BlockProfile:
    """Each block run once, plainly, on a detached copy of its input (one block's activations alive at a
    time), its saved bytes counted. The default generator (CPU and the input's CUDA device) and the TP
    tracker's streams are put back afterwards, so the real forward draws the masks it would have drawn."""
    devices = [h.device] if h.device.type == "cuda" else []
    states = tracker.get_states() if tracker is not None else None
    block_bytes, input_bytes = [], []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        x = h.detach()
        for fn in fns:
            x = x.detach().requires_grad_(x.is_floating_point())
            x = x.clone() if x.requires_grad else x     # not a leaf: counted, like the model's hidden states
            input_bytes.append(float(x.numel() * x.element_size()))
            x, b = saved_bytes(lambda fn=fn, x=x: fn(x))
            block_bytes.append(b)
    if tracker is not None:
        tracker.set_states(states)
    return BlockProfile(tuple(block_bytes), tuple(input_bytes))


class LiveBytes:
    """Peak bytes of the tensors created while it is active (``with LiveBytes() as live: ...``; then
    ``live.peak(exclude)``), counted at every op: each new storage an op returns (not a view of one of its
    inputs) adds its bytes until it is freed. ``exclude``: tensors whose storage is left out (the parameters'
    gradients, equal under every placement), as long as they are still alive at the end. Measures on CPU,
    where no allocator statistics exist; slow (a Python call per op), for measuring, not for training."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        count = self._after

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                count(args, kwargs, out)
                return out

        self._mode = _Mode()
        self._live: Dict[int, tuple] = {}
        self._events: List[Tuple[int, int]] = []
        self._next = 0

    def _after(self, args, kwargs, out):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        for key, (ref, nbytes, ident) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self._events.append((ident, -nbytes))
        inputs = {_storage_id(a.untyped_storage()) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                key = _storage_id(st)
                if key not in inputs and key not in self._live:
                    self._live[key] = (StorageWeakRef(st), st.nbytes(), self._next)
                    self._events.append((self._next, st.nbytes()))
                    self._next += 1

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def peak(self, exclude: Sequence[torch.Tensor] = ()) -> float:
        gone = {self._live[_storage_id(t.untyped_storage())][2] for t in exclude
                if t is not None and _storage_id(t.untyped_storage()) in self._live}
        now = top = 0
        for ident, nbytes in self._events:
            if ident not in gone:
                now += nbytes
                top = max(top, now)
        return float(top)


__all__ = ["LiveBytes", "CheckpointPlan", "Policy", "FirstBlocks", "EveryBlock", "SqrtPolicy", "MemoryBudget", "Budget",
           "BlockProfile", "plan_memory", "budget_plan", "min_peak", "resolve_policy", "saved_bytes",
           "measure_blocks"]
