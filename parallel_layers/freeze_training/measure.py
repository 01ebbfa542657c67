"""What the elastic decisions read off a running ``Parallel3D``: each block's gradient norm (AutoFreeze)
and each block's measured cost (AutoPipe), agreed over every rank.

* :func:`block_grad_norms`: the norm of each active block's gradient after the data-parallel reduction
  and before clipping, from whatever this rank holds of it (the full gradient under plain data
  parallelism, counted once per replica; its ZeRO shard otherwise), summed over the world in one
  all-reduce so every rank gets the same numbers.
* :class:`StageTimer`: forward hooks on this rank's blocks and stages that add up the forward time of
  every block and of what each stage runs besides its blocks (the first stage's embedding, the last
  stage's head and loss). :meth:`StageTimer.agreed` averages them over the data-parallel replicas and
  shares them with every rank (one all-reduce), per sample.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..composition.replicas import Replicated, ShardedGrads, ShardedParams
from ..distributed import collectives as C


def _grad_pieces(mode) -> List[Tuple[nn.Parameter, torch.Tensor]]:
    """``(parameter, gradient piece)`` for every piece of gradient this rank holds after the dp reduction."""
    if isinstance(mode, Replicated):
        return [(p, p.main_grad) for p in mode.dp.buffer.params]
    if isinstance(mode, ShardedGrads):
        out = []
        for b in mode.dp.buffer.buckets:
            shard = mode.dp.bucket_grad_shard(b)
            out += [(p, shard[start:start + n]) for p, _, start, n in b.param_shard_overlaps(mode.dp.dp_rank)]
        return out
    if isinstance(mode, ShardedParams):
        return [(p, mode.z.grad_buffer[start:start + n]) for p, _, start, n in mode.optimizer.shard_pieces()]
    raise TypeError(f"freeze training: no gradient pieces for replica mode {type(mode).__name__}")


def block_grad_norms(model, block_of: Dict[int, int], num_blocks: int, *, device: torch.device,
                     inv_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gradient norm of each of ``num_blocks`` blocks (``block_of``: id(parameter) -> block), the same
    float64 tensor on every rank (a collective over the world). ``model``: a ``Parallel3D`` between its
    dp reduction and its optimizer step; ``inv_scale``: an fp16 run's 1 / loss scale."""
    mode = model.mode
    sq = torch.zeros(num_blocks, dtype=torch.float64, device=device)
    held = [(block_of[id(p)], piece.detach()) for p, piece in _grad_pieces(mode) if id(p) in block_of]
    if held:                                     # one multi-tensor norm, summed into the blocks
        norms = torch.stack(torch._foreach_norm([piece for _, piece in held])).to(torch.float64)
        index = torch.tensor([i for i, _ in held], dtype=torch.long, device=device)
        sq.index_add_(0, index, norms.to(device) ** 2)
    if not mode.shards_grads:
        sq /= model.mesh.dp                      # every replica holds the whole reduced gradient
    C.all_reduce(sq, dist.group.WORLD)
    if inv_scale is not None:
        sq *= inv_scale.double().to(sq.device).reshape(()) ** 2
    return sq.sqrt()


class StageTimer:
    """Forward seconds of every block (``blocks``: module -> block index) and of the extras of the first
    and last stage on this rank, summed over training forwards (not ``evaluate``) since the last
    :meth:`agreed`. Activation checkpointing's recomputation counts as forward time too."""

    def __init__(self, chunks: Sequence[nn.Module], blocks: Dict[nn.Module, int], num_blocks: int):
        self.num_blocks = num_blocks
        self.block_s = [0.0] * num_blocks
        self.first_s = self.last_s = 0.0
        self.samples = 0
        self._starts: Dict[int, Tuple[float, float]] = {}     # id(module) -> (start, block seconds so far)
        self._handles = []
        for module, i in blocks.items():
            self._handles += [module.register_forward_pre_hook(self._enter),
                              module.register_forward_hook(lambda m, a, o, i=i: self._leave_block(m, i))]
        for chunk in chunks:
            self._handles += [chunk.register_forward_pre_hook(self._enter),
                              chunk.register_forward_hook(lambda m, a, o: self._leave_chunk(m))]

    def _enter(self, module, args) -> None:
        self._starts[id(module)] = (time.perf_counter(), sum(self.block_s))

    def _leave_block(self, module, i: int) -> None:
        start, _ = self._starts.pop(id(module))
        if torch.is_grad_enabled():
            self.block_s[i] += time.perf_counter() - start

    def _leave_chunk(self, chunk) -> None:
        start, blocks_before = self._starts.pop(id(chunk))
        if not torch.is_grad_enabled():
            return
        extra = max(0.0, time.perf_counter() - start - (sum(self.block_s) - blocks_before))
        if chunk.is_last:                                 # a rank holding both ends: the head dominates
            self.last_s += extra
        elif chunk.is_first:
            self.first_s += extra

    def count(self, samples: int) -> None:
        """``samples`` went through this replica's stages in the step just taken (every rank calls it)."""
        self.samples += samples

    def agreed(self, dp: int, device: torch.device) -> Tuple[List[float], float, float]:
        """``(per-block seconds, first-stage extra, last-stage extra)`` per sample, forward only, averaged
        over the dp replicas, the same on every rank (a collective over the world); resets the sums.
        Blocks not run since the last call read 0."""
        t = torch.tensor(self.block_s + [self.first_s, self.last_s, float(self.samples)], dtype=torch.float64,
                         device=device)
        C.all_reduce(t, dist.group.WORLD)
        samples = t[-1].item() / dist.get_world_size()   # every rank counted its replica's samples
        per = (t[:-1] / dp / max(samples, 1.0)).tolist()  # each block ran on dp replicas
        self.block_s = [0.0] * self.num_blocks
        self.first_s = self.last_s = 0.0
        self.samples = 0
        return per[:self.num_blocks], per[self.num_blocks], per[self.num_blocks + 1]

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["block_grad_norms", "StageTimer"]
