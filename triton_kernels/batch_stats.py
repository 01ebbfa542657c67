"""Per-channel count / mean / M2 of a ``[B, C, L]`` tensor (synchronized batch norm's local statistics).

The kernel contract is written in ``parallel_layers/ops/batch_stats.py``; this launcher trusts the
arguments the ops layer validated.

A 2-D grid: (channel, split). Split ``s`` of channel ``c`` walks its share of the channel's ``B * L``
elements in blocks; each block's own mean and M2 (deviations from the block mean, in float32) are merged
into the program's running ``(n, mean, M2)`` with Chan's formula, so nothing is ever computed as
``sum(x^2) - n * mean^2`` (stable for a mean far from 0). The splits' partials ``[C, S, 3]`` are merged the
same way by a few torch ops on ``[C, S]``. Element offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import launch_guard

BLOCK = 1024
MAX_PROGRAMS = 2048       # channels x splits on a GPU
INTERPRETED_SPLITS = 2    # under the interpreter: few programs (each is slow), still more than one


@triton.jit
def _batch_stats_kernel(x_ptr, part_ptr, C, L, per_split, total, n_splits, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    start = s * per_split
    stop = tl.minimum(start + per_split, total)
    n = tl.zeros([], tl.float32)
    mean = tl.zeros([], tl.float32)
    m2 = tl.zeros([], tl.float32)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    for off in tl.range(start, stop, BLOCK):
        e = off + lanes
        mask = e < stop
        b = e // L
        i = e - b * L
        x = tl.load(x_ptr + (b * C + c) * L + i, mask=mask, other=0.0).to(tl.float32)
        cnt = tl.sum(mask.to(tl.float32), axis=0)
        bmean = tl.sum(x, axis=0) / cnt
        d = tl.where(mask, x - bmean, 0.0)
        bm2 = tl.sum(d * d, axis=0)
        n_new = n + cnt
        delta = bmean - mean
        mean = mean + delta * (cnt / n_new)
        m2 = m2 + bm2 + delta * delta * (n * cnt / n_new)
        n = n_new
    out = part_ptr + (c * n_splits + s) * 3
    tl.store(out, n)
    tl.store(out + 1, mean)
    tl.store(out + 2, m2)


def _splits(channels: int, total: int, device: torch.device) -> int:
    blocks = triton.cdiv(total, BLOCK)
    if device.type != "cuda":
        return max(1, min(INTERPRETED_SPLITS, blocks))
    return max(1, min(blocks, MAX_PROGRAMS // max(channels, 1)))


def batch_stats(x: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """Kernel contract: per-channel mean and M2 (float32) of the contiguous ``[B, C, L]`` tensor ``x``."""
    b, c, length = x.shape
    total = b * length
    if total == 0:
        mean.zero_()
        m2.zero_()
        return
    splits = _splits(c, total, x.device)
    per_split = triton.cdiv(triton.cdiv(total, splits), BLOCK) * BLOCK
    splits = triton.cdiv(total, per_split)
    part = torch.empty(c, splits, 3, dtype=torch.float32, device=x.device)
    with launch_guard(x):
        _batch_stats_kernel[(c, splits)](x, part, c, length, per_split, total, splits, BLOCK=BLOCK)
    if splits == 1:
        mean.copy_(part[:, 0, 1])
        m2.copy_(part[:, 0, 2])
        return
    # Chan's merge of the splits (every split holds at least one element): M2 = sum M2_s + sum n_s (mu_s - mu)^2.
    n_s, mu_s, m2_s = part.unbind(2)
    mu = (n_s * mu_s).sum(1) / float(total)
    mean.copy_(mu)
    m2.copy_(m2_s.sum(1) + (n_s * (mu_s - mu[:, None]).square()).sum(1))
