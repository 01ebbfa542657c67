"""A replica's batch cut for its context-parallel rank: the tokens of its zigzag shard (:mod:`.layout`),
their positions, and the whole sequence's segment ids for the attention."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .layout import check_divisible, segments, shard

SEGMENTS = "cp_segments"     # the side input the recipe's context turns into the attention's CPContext


def shard_batch(inputs: torch.Tensor, targets: Optional[torch.Tensor], side: Dict[str, torch.Tensor], cp: int,
                cp_rank: int) -> Tuple[torch.Tensor, Optional[torch.Tensor], Dict[str, torch.Tensor]]:
    """``(inputs, targets, side)`` of this cp rank: every tensor whose dim 1 is the sequence sharded along it
    (``position_ids`` made explicit first: a shard's tokens keep their positions in the sequence), and
    ``side["cp_segments"]``: the segment ids ``[b, S]`` from ``attention_mask`` (padding) and
    ``position_ids`` (packed sequences restart at 0)."""
    b, seq_len = inputs.shape[0], inputs.shape[1]
    check_divisible(seq_len, cp, f"context parallelism (cp={cp})")
    side = dict(side)
    seg = segments(b, seq_len, attention_mask=side.get("attention_mask"), position_ids=side.get("position_ids"),
                   device=inputs.device)
    if side.get("position_ids") is None:
        side["position_ids"] = torch.arange(seq_len, device=inputs.device).expand(b, seq_len)
    side = {k: (shard(v.expand(b, *v.shape[1:]) if v.shape[0] == 1 else v, cp, cp_rank)
                if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq_len else v)
            for k, v in side.items()}
    side[SEGMENTS] = seg
    return shard(inputs, cp, cp_rank), shard(targets, cp, cp_rank) if targets is not None else None, side


__all__ = ["SEGMENTS", "shard_batch"]
