"""FP8 scaling recipes: how a tensor's scale is chosen, and quantizing a tensor with it.

Recipes (``FP8Recipe.scaling``):

- ``"tensor"``: per-tensor current scaling: ``scale = fp8_max / amax(x)`` from the tensor being cast (two
  passes: amax, then the cast).
- ``"delayed"``: per-tensor delayed scaling (Transformer Engine's default): the scale comes from the max of the
  last ``history_len`` amaxes (a :class:`DelayedScaling` per tensor), and the cast records the current amax in
  the same pass.
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
divide by them), so they need no communication.
"""
from __future__ import annotations

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
    """``(scale, nonfinite)`` for the amaxes ``amax`` (see the module docstring); ``nonfinite`` is a 0-dim bool."""
    fmax = FP8_MAX[fp8_dtype(fmt, "scale_from_amax")] / 2.0 ** margin
    scale = torch.div(torch.full_like(amax, fmax), amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    finite = torch.isfinite(amax)
    fallback = torch.ones_like(scale) if previous is None else previous.expand_as(scale)
    scale = torch.where(finite & (amax > 0), scale, fallback)
    return scale, ~finite.all()


class DelayedScaling:
    """One tensor's delayed-scaling state: the last ``history_len`` amaxes and the scale for the next cast."""

    def __init__(self, history_len: int = 16, fmt="e4m3", margin: int = 0, device=None):
        if int(history_len) < 1:
            raise ValueError(f"DelayedScaling: history_len={history_len} must be >= 1")
        self.fmt, self.margin = fp8_dtype(fmt, "DelayedScaling"), margin
        self.amax_history = torch.zeros(int(history_len), dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    def update(self, amax: torch.Tensor) -> torch.Tensor:
        """Record ``amax`` (0-dim; already reduced over the group sharing the tensor) and recompute the scale.
        A non-finite amax leaves the state unchanged; returns the 0-dim bool ``nonfinite``."""
        amax = amax.reshape(()).to(self.amax_history.device)
        finite = torch.isfinite(amax)
        rolled = torch.cat([amax.reshape(1), self.amax_history[:-1]])
        self.amax_history = torch.where(finite, rolled, self.amax_history)
        self.scale, _ = scale_from_amax(self.amax_history.amax(), self.fmt, self.margin, previous=self.scale)
        return ~finite

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.amax_history = state["amax_history"].clone()
        self.scale = state["scale"].clone()


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


def _reduce_amax(amax: torch.Tensor, reduce: bool, group) -> torch.Tensor:
    amax = torch.nan_to_num(amax, nan=float("inf"))
    if reduce:
        C.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    return amax


def quantize(x: torch.Tensor, fmt, block, *, group=None, shard_dim: Optional[int] = None,
             state: Optional[DelayedScaling] = None, transpose: bool = False, margin: int = 0,
             backend: Optional[str] = None) -> Tuple[Quantized, torch.Tensor]:
    """Quantize the matrix ``x`` with one scale per ``block``; returns ``(Quantized, nonfinite)``.

    ``group``/``shard_dim``: ``x`` is this rank's shard, along matrix dim ``shard_dim``, of a tensor split over
    ``group`` (None: the tensor is whole here). ``state``: delayed scaling (per-tensor blocks only).
    """
    x = x.reshape(-1, x.shape[-1])
    br, bc = resolve_block("fp8 quantize", tuple(x.shape), block)
    reduce = _needs_reduce(block, shard_dim, group)
    if state is not None:
        if (br, bc) != tuple(x.shape):
            raise ValueError(f"fp8 quantize: delayed scaling is per tensor; got block {block} for {tuple(x.shape)}")
        scale = state.scale.reshape(1, 1)
        data, data_t, amax = fp8_cast(x, scale, fmt=fmt, block=(br, bc), transpose=transpose, with_amax=True,
                                      backend=backend)
        amax = _reduce_amax(amax, reduce, group)
        nonfinite = state.update(amax)
    else:
        amax = _reduce_amax(fp8_amax(x, block=(br, bc), backend=backend), reduce, group)
        scale, nonfinite = scale_from_amax(amax, fmt, margin)
        data, data_t, _ = fp8_cast(x, scale, fmt=fmt, block=(br, bc), transpose=transpose, backend=backend)
    return Quantized(data, torch.reciprocal(scale), data_t, amax), nonfinite


__all__ = ["FP8Recipe", "DelayedScaling", "Quantized", "quantize", "scale_from_amax", "SCALINGS"]
