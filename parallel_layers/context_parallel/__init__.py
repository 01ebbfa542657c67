"""Context parallelism: the sequence sharded over ``cp`` ranks through attention too.

``context_parallel_attention(q, k, v, group=mesh.cp_group, segments=..., method="ring"|"ulysses")`` is
softmax attention of this rank's shard of the queries over the whole sequence. Shards follow the
load-balanced zigzag split (:mod:`.layout`); the ring (:mod:`.ring`) passes key/value blocks around and
merges partial results by their log-sum-exp (:mod:`.blocks`); Ulysses (:mod:`.ulysses`) re-shards by heads
with all-to-alls. Segments (padding, packed sequences) and causality are applied by position, so a shard
whose keys are all masked gives zeros, never NaN.
"""
from __future__ import annotations

from typing import Optional

import torch

from .blocks import block_attention, dense_attention, merge
from .layout import segments, shard, unshard, visible, zigzag_index
from .ring import ring_attention
from .ulysses import ulysses_attention

METHODS = ("ring", "ulysses")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, segments: torch.Tensor,
                               causal: bool = True, scale: Optional[float] = None, method: str = "ring"):
    """See the module docstring; ``q [b, hq, S/cp, d]``, ``k, v [b, hkv, S/cp, d]``, ``segments [b, S]``."""
    if method == "ring":
        return ring_attention(q, k, v, group=group, segments=segments, causal=causal, scale=scale)
    if method == "ulysses":
        return ulysses_attention(q, k, v, group=group, segments=segments, causal=causal, scale=scale)
    raise ValueError(f"context_parallel_attention: method={method!r} must be one of {METHODS}")


__all__ = ["context_parallel_attention", "ring_attention", "ulysses_attention", "block_attention", "merge",
           "dense_attention", "segments", "shard", "unshard", "visible", "zigzag_index", "METHODS"]
