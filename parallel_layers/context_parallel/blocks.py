"""Attention over one block of keys, with its log-sum-exp, and the merge of partial results: the torch
reference of context parallelism's per-block work (and the oracle of its kernels).

Ring attention never holds the whole score matrix: a rank's queries meet one block of keys at a time, and
each block's result ``(out_b, lse_b)`` (the softmax-weighted values over that block alone, and the
log-sum-exp of its scores) is merged into the running one. With ``lse = logaddexp(lse_a, lse_b)``:

    out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

which is exactly softmax attention over the union of the blocks. A query that sees no key of a block has
``lse_b = -inf`` and contributes nothing; a query that sees no key at all (a padding token, a shard whose
keys are all masked) ends with ``lse = -inf`` and an output of 0, never NaN.

Backward, per block, from the final ``out``/``lse`` (flash attention's rule, no softmax kept):
``P = exp(S - lse)``, ``dV = P^T dO``, ``dS = P * (dO V^T - rowsum(dO * out))``, ``dQ = dS K scale``,
``dK = dS^T Q scale``. Shapes: ``q [b, hq, sq, d]``, ``k, v [b, hkv, sk, d]`` with ``hq`` a multiple of
``hkv`` (grouped-query attention: query head ``h`` reads key head ``h // (hq / hkv)``), ``visible
[b, sq, sk]`` (True where the query may attend to the key), ``lse [b, hq, sq]`` in fp32.
"""
from __future__ import annotations

from typing import Tuple

import torch


def _expand_kv(t: torch.Tensor, hq: int) -> torch.Tensor:
    """``[b, hkv, s, d]`` -> ``[b, hq, s, d]`` (each key head repeated for its group of query heads)."""
    group = hq // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold_kv(t: torch.Tensor, hkv: int) -> torch.Tensor:
    """The gradient of :func:`_expand_kv`: ``[b, hq, s, d]`` summed over each group -> ``[b, hkv, s, d]``."""
    b, hq, s, d = t.shape
    return t if hq == hkv else t.view(b, hkv, hq // hkv, s, d).sum(2)


def _scores(q, k, visible, scale):
    s = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    return s.masked_fill(~visible[:, None], float("-inf"))


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out [b, hq, sq, d] in fp32, lse [b, hq, sq] fp32)`` of ``q`` over this block of keys."""
    s = _scores(q, k, visible, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))   # masked: exp(-inf) = 0
    return torch.matmul(p, _expand_kv(v, q.shape[1]).float()), lse


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge a block's ``(out_b, lse_b)`` into the running ``(out, lse)``; fully masked rows stay 0."""
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    wa = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(new))
    return out * wa[..., None] + out_b * wb[..., None], new


def block_attention_backward(q, k, v, visible, scale, out, lse, dout, delta):
    """``(dq, dk, dv)`` of this block's share, given the FINAL ``out``/``lse`` of the queries and
    ``delta = rowsum(dout * out)``; all in fp32, ``dk``/``dv`` folded to ``hkv`` heads."""
    hq, hkv = q.shape[1], k.shape[1]
    s = _scores(q, k, visible, scale)
    p = torch.exp(s - lse[..., None].masked_fill(torch.isinf(lse[..., None]), 0.0))
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, _expand_kv(v, hq).float().transpose(-1, -2))
    ds = p * (dp - delta[..., None])
    dq = torch.matmul(ds, _expand_kv(k, hq).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _fold_kv(dk, hkv), _fold_kv(dv, hkv)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Differentiable softmax attention in plain torch ops (autograd does the backward), fully masked rows
    0: the single-process reference, and Ulysses' local attention. Output in ``q``'s dtype."""
    s = torch.matmul(q.float(), _expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    s = s.masked_fill(~visible[:, None], float("-inf"))
    any_key = visible.any(-1)[:, None, :, None]
    p = torch.softmax(torch.where(any_key, s, torch.zeros_like(s)), dim=-1) * any_key
    return torch.matmul(p, _expand_kv(v, q.shape[1]).float()).to(q.dtype)


__all__ = ["block_attention", "block_attention_backward", "merge", "dense_attention"]
