"""Which tokens a context-parallel rank holds, and which keys each query may see.

**The load-balanced split** (Megatron-core's zigzag): the sequence of length ``S`` is cut into ``2 cp``
equal chunks and rank ``i`` holds chunks ``i`` and ``2 cp - 1 - i``, in that order. Under a causal mask
the work of a query grows with its position, so the plain split (rank ``i`` holds the ``i``-th ``S / cp``
tokens) gives the last rank ``2 cp - 1`` times the first one's; the zigzag pairs an early chunk with a
late one and every rank does the same work: ``(2 cp - 1) * 2 + 1`` chunk pairs' worth, rank by rank.

**Segments** say which keys a query may see besides causality: a token's segment id is that of the
sequence it belongs to (one per row; packed variable-length sequences: a new id wherever the position ids
restart at 0, or from ``cu_seqlens``), and ``-1`` for padding (``attention_mask == 0``). A query sees a
key when both are in the same segment, the key is not padding, and (causal) the key's position in the row
is not after the query's. A padding query sees nothing: its output is 0.
"""
from __future__ import annotations

from typing import List, Optional

import torch


def check_divisible(seq_len: int, cp: int, where: str = "context parallelism") -> None:
    if seq_len % (2 * cp):
        raise ValueError(f"{where}: the sequence length {seq_len} must be a multiple of 2 x cp = {2 * cp} (the "
                         f"load-balanced split cuts it into 2 x cp equal chunks); pad the sequences to a "
                         f"multiple of {2 * cp}")


def zigzag_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (int64, ``[seq_len / cp]``) of the tokens cp rank ``rank`` holds: chunks ``rank`` and
    ``2 cp - 1 - rank`` of ``2 cp``."""
    check_divisible(seq_len, cp)
    c = seq_len // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def all_zigzag_index(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """Every rank's positions, rank by rank (``[seq_len]``): the order Ulysses' all-to-all gathers in."""
    return torch.cat([zigzag_index(seq_len, cp, r, device) for r in range(cp)])


def shard(t: Optional[torch.Tensor], cp: int, rank: int, dim: int = 1) -> Optional[torch.Tensor]:
    """This rank's tokens of ``t`` along ``dim`` (the sequence dimension), in the zigzag order."""
    if t is None or cp == 1:
        return t
    return t.index_select(dim, zigzag_index(t.shape[dim], cp, rank, t.device))


def unshard(parts: List[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence back from every rank's :func:`shard` (``parts`` in rank order)."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    seq_len = sum(p.shape[dim] for p in parts)
    whole = torch.cat(parts, dim)
    order = torch.argsort(all_zigzag_index(seq_len, cp, whole.device))
    return whole.index_select(dim, order)


def segments(batch: int, seq_len: int, *, attention_mask: Optional[torch.Tensor] = None,
             position_ids: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
             device=None) -> torch.Tensor:
    """Segment ids ``[batch, seq_len]`` (int64): 0 for one sequence per row; packed sequences numbered from
    where ``position_ids`` restart at 0 (or the boundaries ``cu_seqlens``, shared by every row); -1 where
    ``attention_mask`` is 0."""
    if cu_seqlens is not None:
        starts = torch.zeros(seq_len, dtype=torch.int64, device=device)
        bounds = [int(x) for x in cu_seqlens.tolist()]
        if bounds[0] != 0 or bounds[-1] != seq_len or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"context parallelism: cu_seqlens {bounds} must rise strictly from 0 to the sequence "
                             f"length {seq_len}")
        starts[bounds[1:-1]] = 1
        seg = starts.cumsum(0).expand(batch, seq_len).clone()
    elif position_ids is not None:
        pos = position_ids.expand(batch, seq_len).to(device)
        seg = (pos == 0).to(torch.int64).cumsum(1)
    else:
        seg = torch.zeros(batch, seq_len, dtype=torch.int64, device=device)
    if attention_mask is not None:
        seg = seg.masked_fill(attention_mask.to(seg.device) == 0, -1)
    return seg


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_seg: torch.Tensor, k_seg: torch.Tensor,
            causal: bool) -> torch.Tensor:
    """``[batch, sq, sk]``: may the query at position ``q_pos`` (its segment ``q_seg [batch, sq]``) see the
    key at ``k_pos`` (``k_seg``)?"""
    ok = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        ok = ok & (k_pos[None, None, :] <= q_pos[None, :, None])
    return ok


__all__ = ["zigzag_index", "all_zigzag_index", "shard", "unshard", "segments", "visible", "check_divisible"]
