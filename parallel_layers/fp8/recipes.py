"""FP8 scaling recipes: how a tensor's scale is chosen, and quantizing a tensor with it.

Recipes (``FP8Recipe.scaling``):

- ``"tensor"``: per-tensor current scaling: ``scale = fp8_max / amax(x)`` from the tensor being cast (two
  passes: amax, then the cast).
- ``"delayed"``: per-tensor delayed scaling (Transformer Engine's default): the scale comes from the max of the
  last ``history_len`` amaxes (a :class:`DelayedScaling` per tensor), and the cast records the current amax in
  the same pass. Until a first amax is recorded a cast scales from its own amax (current scaling), so the
  first step does not run at scale 1 (which flushes small gradients to zero).
- ``"row"``: one scale per row (per token for activations and gradients, per output feature for weights).
- ``"block"``: DeepSeek-V3's blocks: ``1 x block_size`` for activations and gradients, ``block_size x
  block_size`` for weights.

Scales, defined for every amax (no host sync, no garbage):

- ``amax > 0`` finite: ``scale = (fp8_max / 2**margin) / amax``; a tiny amax whose scale overflows float32
  gets float32's largest finite value.
- ``amax == 0`` (an all-zero tensor or block): ``scale = 1`` (delayed: the previous scale).
- ``amax`` inf or NaN: reported (the returned ``nonfinite`` flag) and not used: ``scale = 1`` (delayed: the
  previous scale, and the amax is not written into the history). A NaN amax is reported as ``inf`` so a max
  all-reduce cannot lose it. The cast itself saturates +-inf to +-fp8_max and keeps NaN as NaN.

Tensor parallelism: a tensor sharded over a group is scaled as the one-process model scales the whole tensor.
When a scaling block spans the sharded dimension (per tensor: always; per row: when columns are sharded), the
block amaxes are max-all-reduced over the group before any scale is computed, so every rank, and the single
process, take the same scaling decisions. Blocks of explicit size never straddle ranks (the local size must
divide by them), so they need no communication. ``row_group``: the rows (tokens) are also split over another
group (context parallelism's sequence shards): a block spanning the rows is reduced over it too.

Delayed scaling in a training loop (``DelayedScaling(update="step")``, what ``Parallel3D`` uses): a cast uses
the state's scale and only records its amax (the running max since the last step); :func:`commit_delayed`
max-reduces those amaxes over the ranks holding replicas of the layers (data- and context-parallel) once per
optimizer step, writes one entry per tensor into the histories and recomputes the scales. Every micro-batch of a
step then uses the same scales, and the history holds the amax of the whole global batch, so the scaling
decisions are those of one process running the step, however the batch is split. ``update="cast"`` (the
default for a layer used alone) records every cast in the history and rescales at once.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..ops.fp8_cast import FP8_MAX, fp8_amax, fp8_cast, fp8_dtype, resolve_block

SCALINGS = ("tensor", "delayed", "row", "block")
FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class FP8Recipe:
    """What an FP8 layer does: the scaling, the formats (E4M3 forward, E5M2 or E4M3 gradients), and its knobs."""
    scaling: str = "tensor"
    fwd_format: str = "e4m3"
    grad_format: str = "e5m2"
    history_len: int = 16
    margin: int = 0
    block_size: int = 128

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"FP8Recipe: scaling={self.scaling!r} is not one of {SCALINGS}")
        fp8_dtype(self.fwd_format, "FP8Recipe")
        fp8_dtype(self.grad_format, "FP8Recipe")
        for name in ("history_len", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"FP8Recipe: {name}={getattr(self, name)} must be >= 1")

    def block(self, role: str) -> Tuple[int, int]:
        """Scaling block of a ``role`` ("input", "weight", "grad") tensor seen as a matrix."""
        if self.scaling in ("tensor", "delayed"):
            return (-1, -1)
        if self.scaling == "row":
            return (1, -1)
        return (self.block_size, self.block_size) if role == "weight" else (1, self.block_size)


def scale_from_amax(amax: torch.Tensor, fmt, margin: int = 0,
                    previous: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(scale, nonfinite)`` for the amaxes ``amax`` (see the module docstring); ``nonfinite`` is a 0-dim bool.

    Eight small ops (each a kernel launch on a GPU, where a step quantizes three tensors per linear layer):
    an amax is never negative, so ``amax < inf`` is ``isfinite`` (NaN fails it too), and the division by a CPU
    scalar tensor is the elementwise ``fmax / amax`` without filling a tensor with ``fmax`` first."""
    fmax = torch.tensor(FP8_MAX[fp8_dtype(fmt, "scale_from_amax")] / 2.0 ** margin, dtype=torch.float32)
    finite = amax < float("inf")
    scale = torch.div(fmax, amax).clamp_(max=FP32_MAX)          # amax 0: inf -> the largest float32
    fallback = 1.0 if previous is None else previous.expand_as(scale)
    scale = torch.where(finite & (amax > 0), scale, fallback)
    return scale, ~finite.all()


class DelayedScaling:
    """One tensor's delayed-scaling state: the last ``history_len`` amaxes and the scale for the next cast."""

    UPDATES = ("cast", "step")

    def __init__(self, history_len: int = 16, fmt="e4m3", margin: int = 0, device=None, update: str = "cast"):
        if int(history_len) < 1:
            raise ValueError(f"DelayedScaling: history_len={history_len} must be >= 1")
        if update not in self.UPDATES:
            raise ValueError(f"DelayedScaling: update={update!r} is not one of {self.UPDATES}")
        self.fmt, self.margin, self.update_every = fp8_dtype(fmt, "DelayedScaling"), margin, update
        self.amax_history = torch.zeros(int(history_len), dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        # update="step": the max of the finite amaxes cast since the last commit
        self.pending_amax = torch.zeros((), dtype=torch.float32, device=device)
        # no amax recorded yet: the first casts scale from their own amax (current scaling), not from scale 1,
        # which would flush small gradients to zero and make the first step depend on the loss's normalization
        self.has_history = False

    def update(self, amax: torch.Tensor) -> torch.Tensor:
        """Record ``amax`` (0-dim; already reduced over the group sharing the tensor): into the history, with the
        scale recomputed (``update="cast"``), or into the pending max until :meth:`commit` (``"step"``).
        A non-finite amax leaves the state unchanged; returns the 0-dim bool ``nonfinite``."""
        amax = amax.reshape(()).to(self.amax_history.device)
        finite = amax < float("inf")                      # an amax is never negative: isfinite in one op
        if self.update_every == "step":
            self.pending_amax = torch.where(finite, torch.maximum(self.pending_amax, amax), self.pending_amax)
        else:
            self._record(amax, finite)
        return ~finite

    def _record(self, amax: torch.Tensor, finite: torch.Tensor) -> None:
        rolled = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        self.amax_history = torch.where(finite, rolled, self.amax_history)
        self.scale, _ = scale_from_amax(self.amax_history.amax(), self.fmt, self.margin, previous=self.scale)
        self.has_history = True

    def commit(self, amax: Optional[torch.Tensor] = None) -> None:
        """``update="step"``: write the pending amax (or ``amax``: it reduced over the replicas) into the history,
        recompute the scale and start a new pending max."""
        amax = self.pending_amax if amax is None else amax.reshape(()).to(self.amax_history.device)
        self._record(amax, torch.isfinite(amax))
        self.pending_amax = torch.zeros_like(self.pending_amax)

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone(),
                "pending_amax": self.pending_amax.clone(), "has_history": self.has_history}

    def load_state_dict(self, state: dict) -> None:
        self.amax_history = state["amax_history"].clone().to(self.amax_history.device)
        self.scale = state["scale"].clone().to(self.scale.device)
        if "pending_amax" in state:
            self.pending_amax = state["pending_amax"].clone().to(self.pending_amax.device)
        self.has_history = bool(state.get("has_history", True))


@contextlib.contextmanager
def pending_kept(states):
    """Casts inside leave the pending amaxes of ``states`` (:class:`DelayedScaling`) as they were: an evaluation's
    forward must not steer the next training step's scales."""
    saved = [s.pending_amax for s in states]
    try:
        yield
    finally:
        for state, amax in zip(states, saved):
            state.pending_amax = amax


def commit_delayed(states, group=None) -> None:
    """Commit every ``update="step"`` state of ``states`` (an iterable of :class:`DelayedScaling`) at the end of
    an optimizer step: their pending amaxes max-all-reduced over ``group`` (the ranks holding replicas of the
    layers) in one collective, then written into the histories."""
    states = [s for s in states if s.update_every == "step"]
    if not states:
        return
    amaxes = torch.stack([s.pending_amax for s in states])
    if group is not None and C.world_size(group) > 1:
        C.all_reduce(amaxes, group, op=dist.ReduceOp.MAX)
    for s, a in zip(states, amaxes):
        s.commit(a)


@dataclass
class Quantized:
    """An FP8 matrix: ``data`` [R, C], per-block ``scale_inv`` (``x ~ data * scale_inv``), optional ``data_t``
    (``data.T`` contiguous), and the amax the scale came from (reduced over the group, NaN reported as inf)."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    data_t: Optional[torch.Tensor]
    amax: torch.Tensor


def _needs_reduce(block, shard_dim: Optional[int], group) -> bool:
    if group is None or shard_dim is None or C.world_size(group) == 1:
        return False
    return block[shard_dim] in (-1, None)


def _reduce_amax(amax: torch.Tensor, groups) -> torch.Tensor:
    amax = torch.nan_to_num(amax, nan=float("inf"))
    for group in groups:
        C.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    return amax


def quantize(x: torch.Tensor, fmt, block, *, group=None, shard_dim: Optional[int] = None, row_group=None,
             state: Optional[DelayedScaling] = None, transpose: bool = False, margin: int = 0,
             backend: Optional[str] = None) -> Tuple[Quantized, torch.Tensor]:
    """Quantize the matrix ``x`` with one scale per ``block``; returns ``(Quantized, nonfinite)``.

    ``group``/``shard_dim``: ``x`` is this rank's shard, along matrix dim ``shard_dim``, of a tensor split over
    ``group`` (None: the tensor is whole here). ``row_group``: its rows are also split over this group (context
    parallelism). ``state``: delayed scaling (per-tensor blocks only).
    """
    x = x.reshape(-1, x.shape[-1])
    br, bc = resolve_block("fp8 quantize", tuple(x.shape), block)
    reduce = [g for g, dim in ((group, shard_dim), (row_group, 0)) if _needs_reduce(block, dim, g)]
    if state is not None and (br, bc) != tuple(x.shape):
        raise ValueError(f"fp8 quantize: delayed scaling is per tensor; got block {block} for {tuple(x.shape)}")
    if state is not None and state.has_history:
        scale = state.scale.reshape(1, 1)
        data, data_t, amax = fp8_cast(x, scale, fmt=fmt, block=(br, bc), transpose=transpose, with_amax=True,
                                      backend=backend)
        amax = _reduce_amax(amax, reduce)
        nonfinite = state.update(amax)
    else:
        amax = _reduce_amax(fp8_amax(x, block=(br, bc), backend=backend), reduce)
        scale, nonfinite = scale_from_amax(amax, fmt, margin)
        data, data_t, _ = fp8_cast(x, scale, fmt=fmt, block=(br, bc), transpose=transpose, backend=backend)
        if state is not None:      # a delayed state's first cast: current scaling, its amax recorded
            state.update(amax)
    return Quantized(data, torch.reciprocal(scale), data_t, amax), nonfinite


__all__ = ["FP8Recipe", "DelayedScaling", "Quantized", "quantize", "scale_from_amax", "commit_delayed", "pending_kept",
           "SCALINGS"]
