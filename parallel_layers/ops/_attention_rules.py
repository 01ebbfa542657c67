"""What the implementations of ``ops.block_attention`` share: which keys a query sees, and the merge of a
block's ``(out_b, lse_b)`` into the running result. (``context_parallel/blocks.py``, the oracle, keeps
its own copy on purpose: the tests compare against it.)"""
from __future__ import annotations

import torch


def visible(q_pos, k_pos, q_seg, k_seg, causal) -> torch.Tensor:
    """``[b, sq, sk]``: the query sees the key when both are in the same segment, the key is not padding
    (-1) and, if ``causal``, its position is not after the query's."""
    ok = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        ok = ok & (k_pos[None, None, :] <= q_pos[None, :, None])
    return ok


def merge_into(out: torch.Tensor, lse: torch.Tensor, rows: slice, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    """Merge ``(out_b, lse_b)`` into query rows ``rows`` of the running ``(out, lse)`` in place:
    ``lse' = logaddexp(lse, lse_b)``, ``out' = out exp(lse - lse') + out_b exp(lse_b - lse')``; rows that
    have seen no key keep ``lse = -inf`` and ``out = 0``."""
    lse_a = lse[:, :, rows]
    new = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    wa = torch.where(finite, torch.exp(lse_a - safe), torch.zeros_like(new))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(new))
    out[:, :, rows] = out[:, :, rows] * wa[..., None] + out_b.float() * wb[..., None]
    lse[:, :, rows] = new
