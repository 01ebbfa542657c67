"""Ring attention over the context-parallel group: keys and values travel, queries stay.

Each of the ``cp`` ranks holds its zigzag shard of the sequence (:mod:`.layout`). Forward, in ``cp``
steps: a rank computes its queries against the key/value block it holds (its own first), merges the
block's ``(out, lse)`` into its running result (:func:`.blocks.merge`'s rule), and meanwhile passes the block to
the next rank and receives the previous rank's (one ``batch_isend_irecv`` of a send and a receive per
step: the pair progresses together under NCCL's rules, and the transfer overlaps the block's compute).
The per-block work is the fused op ``parallel_layers.ops.block_attention`` (Triton on CUDA: flash-attention
tiles, the merge fused in, the mask evaluated per tile from positions and segments, no score matrix or mask
in memory; on CPU ATen's flash kernels, ``ops/block_attention_cpu.py``; :mod:`.blocks` is the oracle all are
tested against). Key tiles none of whose keys a query may see (all padding, another segment, causal: in the
query's future) are skipped.

Backward runs the same ring again: each step's block meets the rank's queries once more, the rank adds
the block's ``dQ`` to its own and the block's ``dK``/``dV`` to accumulators that travel with the block;
after the last step the accumulators go one hop further, back to the block's owner. No score matrix is
kept between forward and backward: only ``out`` and ``lse`` (flash attention's rule).

Communication per attention call, ``cp`` ranks, a shard of ``n = S / cp`` tokens, sent by each rank:
forward ``cp - 1`` messages of K and V (``2 b hkv n d`` elements in the model's dtype); backward ``cp - 1``
of K and V again plus ``cp`` of their fp32 gradient accumulators (``2 b hkv n d`` fp32 each). No
collective: every message goes to the next rank of the ring (counted in
``tests/test_context_parallel_attention.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..ops.block_attention import block_attention_backward, block_attention_forward
from .layout import zigzag_index


def _exchange(sends, group, rank: int, cp: int):
    """Post every tensor of ``sends`` to the next rank and a receive of each from the previous one, as one
    batch; returns ``(buffers, works)``."""
    recvs = [torch.empty_like(t) for t in sends]
    nxt, prev = dist.get_global_rank(group, (rank + 1) % cp), dist.get_global_rank(group, (rank - 1) % cp)
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, prev, group) for t in recvs]
    return recvs, dist.batch_isend_irecv(ops)


def _wait(works, what: str, group) -> None:
    try:
        for w in works:
            w.wait()
    except RuntimeError as exc:
        raise RuntimeError(f"ring attention: {what} over the cp group ({C.describe_group(group)}) failed: {exc}") \
            from exc


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seg, group, causal, scale):
        cp, rank = C.world_size(group), C.rank(group)
        seq_len = seg.shape[1]
        q_pos = zigzag_index(seq_len, cp, rank, q.device)
        q_seg = seg[:, q_pos]
        b, hq, n, d = q.shape
        out = torch.zeros(b, hq, n, d, dtype=torch.float32, device=q.device)
        lse = torch.full((b, hq, n), float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(cp):
            owner = (rank - step) % cp
            pending = _exchange([kv], group, rank, cp) if step < cp - 1 else None
            k_pos = zigzag_index(seq_len, cp, owner, q.device)
            # The block's attention, merged into (out, lse) in place; the mask is evaluated from positions
            # and segments inside the op (key tiles no query sees are skipped there).
            block_attention_forward(q, kv[0], kv[1], q_pos, k_pos, q_seg, seg[:, k_pos], causal, scale, out, lse)
            if pending is not None:
                (kv,), works = pending
                _wait(works, f"forward step {step}", group)
        ctx.save_for_backward(q, k, v, seg, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, seg, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank = C.world_size(group), C.rank(group)
        seq_len = seg.shape[1]
        q_pos = zigzag_index(seq_len, cp, rank, q.device)
        q_seg = seg[:, q_pos]
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(cp):
            owner = (rank - step) % cp
            k_pos = zigzag_index(seq_len, cp, owner, q.device)
            # Adds the block's dQ to dq and its dK/dV to the accumulators travelling with it.
            block_attention_backward(q, kv[0], kv[1], q_pos, k_pos, q_seg, seg[:, k_pos], causal, scale, lse, dout,
                                     delta, dq, dkv[0], dkv[1], out=out)
            if step < cp - 1:          # the block moves on with its gradient accumulators
                (kv, dkv), works = _exchange([kv, dkv], group, rank, cp)
                _wait(works, f"backward step {step}", group)
        if cp > 1:                     # the accumulators go home: this rank holds rank + 1's block
            (dkv,), works = _exchange([dkv], group, rank, cp)
            _wait(works, "backward, gradients home", group)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, segments: torch.Tensor,
                   causal: bool = True, scale: Optional[float] = None) -> torch.Tensor:
    """Attention of this rank's zigzag shard of queries ``q [b, hq, S/cp, d]`` over the whole sequence,
    whose keys/values ``k, v [b, hkv, S/cp, d]`` are sharded the same way over ``group``. ``segments
    [b, S]``: the whole sequence's segment ids (:func:`.layout.segments`; every rank passes the same).
    Returns ``[b, hq, S/cp, d]`` in ``q``'s dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, segments.to(torch.int64), group, bool(causal), scale)


__all__ = ["ring_attention"]
