"""Ulysses (DeepSpeed's sequence parallelism through attention): an all-to-all turns the sequence-sharded
queries, keys and values into head-sharded ones over the whole sequence, each rank computes plain
attention for its heads, and a second all-to-all turns the output back into sequence shards.

Needs ``cp`` to divide the key/value heads (and so the query heads): each rank takes ``hkv / cp`` key heads
and their query groups. Per attention call and rank, with ``n = S / cp`` tokens a shard: forward four
all-to-alls (q, k, v, the output), of which ``(2 hq + 2 hkv) b n d (cp - 1) / cp`` elements leave the
rank; backward the same four in reverse, as many again (counted in
``tests/test_context_parallel_attention.py``).

When each wins: forward, the ring sends ``2 hkv b n d (cp - 1)`` elements per rank (K and V, to the
next rank, overlapped with the block's compute), Ulysses ``(2 hq + 2 hkv) b n d (cp - 1) / cp`` as
all-to-alls that nothing overlaps; the ring sends less when ``2 hkv cp < 2 hq + 2 hkv`` (grouped-query
attention with few KV heads, small cp) and its backward adds fp32 gradient accumulators. Ulysses needs
``hkv >= cp`` and runs one dense attention over the whole sequence for its heads (the fastest kernel), the
ring needs only ``S`` divisible by ``2 cp`` and never holds more than one remote block. Inside a node with
a fast all-to-all and enough heads, Ulysses; across nodes, with few KV heads or very long sequences, the
ring.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..distributed import collectives as C
from .blocks import dense_attention
from .layout import all_zigzag_index, visible


def _seq_to_heads(t: torch.Tensor, group) -> torch.Tensor:
    """``[b, h, n, d]`` sequence shard -> ``[b, h / cp, cp * n, d]`` (every rank's shard, rank order)."""
    cp = C.world_size(group)
    b, h, n, d = t.shape
    parts = t.reshape(b, cp, h // cp, n, d).transpose(0, 1).contiguous()     # [cp, b, h/cp, n, d]
    got = C.all_to_all_dim0(parts, group)                                    # [cp(source), b, h/cp, n, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _heads_to_seq(t: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    cp = C.world_size(group)
    b, hl, s, d = t.shape
    n = s // cp
    parts = t.reshape(b, hl, cp, n, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dest), b, h/cp, n, d]
    got = C.all_to_all_dim0(parts, group)                                    # [cp(source heads), b, h/cp, n, d]
    return got.transpose(0, 1).reshape(b, cp * hl, n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _seq_to_heads(t, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        return _heads_to_seq(t, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad.contiguous(), ctx.group), None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, segments: torch.Tensor,
                      causal: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """:func:`.ring.ring_attention`'s contract, computed by all-to-all over heads."""
    cp = C.world_size(group)
    hq, hkv = q.shape[1], k.shape[1]
    if hkv % cp:
        raise ValueError(f"ulysses_attention: cp={cp} must divide the key/value heads ({hkv}; query heads {hq}): "
                         f"each rank takes hkv / cp of them. Use the ring (method='ring'), which has no such "
                         f"rule, or a cp that divides {hkv}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    pos = all_zigzag_index(segments.shape[1], cp, q.device)
    seg = segments[:, pos]
    out = dense_attention(qh, kh, vh, visible(pos, pos, seg, seg, causal), scale)
    return _HeadsToSeq.apply(out, group)


__all__ = ["ulysses_attention"]
