"""Vocab-parallel cross entropy: the two local passes over one rank's logits shard.

The kernel contracts are written in ``parallel_layers/ops/cross_entropy.py``; these launchers trust
the arguments the ops layer validated.

``ce_forward_stats``: one program per row walks the row's valid columns in blocks with an online
softmax (running max ``m`` and ``s = sum exp(x - m)``, rescaled when the max grows: one exp per
element), and in the same pass the sum of the logits (for label smoothing) and, when this rank owns
the row's target, the target logit. It reads the shard once and writes 4 numbers per row.

``ce_backward``: a 2-D grid (row, block of columns), each program writes
``g * (exp(x - lse) - smooth - on * [j == target])`` for its block, and 0 on padded columns. The
output may be the logits buffer itself (in-place backward): each element is read, then written, by
the same program.

Accumulation is float32 (float64 for float64 logits). Row offsets are int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import launch_guard

_TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64,
             torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _ce_stats_kernel(x_ptr, stride_row, target_ptr, max_ptr, stats_ptr, vocab_start, n_valid,
                     ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = x_ptr + row * stride_row
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    total = tl.zeros([], ACC)
    cols = tl.arange(0, BLOCK)
    for start in tl.range(0, n_valid, BLOCK):
        offs = start + cols
        mask = offs < n_valid
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A row (so far) of -inf only: subtract 0 instead of -inf so exp gives 0, not nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new).to(ACC)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        total += tl.sum(tl.where(mask, x, 0.0).to(ACC), axis=0)
        m = m_new
    t = tl.load(target_ptr + row) - vocab_start
    owned = (t >= 0) & (t < n_valid)
    t_safe = tl.where(owned, t, 0)
    x_t = tl.load(row_ptr + t_safe, mask=owned, other=0.0).to(ACC)
    x_t = tl.where(owned, x_t, 0.0).to(ACC)
    tl.store(max_ptr + row, m)
    tl.store(stats_ptr + row * 3, s)
    tl.store(stats_ptr + row * 3 + 1, x_t)
    tl.store(stats_ptr + row * 3 + 2, total)


@triton.jit
def _ce_backward_kernel(x_ptr, stride_x, out_ptr, stride_out, target_ptr, lse_ptr, g_ptr, vocab_start,
                        n_valid, n_cols, smooth_hi, smooth_lo, on_hi, on_lo, ACC: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < n_cols
    valid = offs < n_valid
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=0.0).to(ACC)
    lse = tl.load(lse_ptr + row).to(ACC)
    g = tl.load(g_ptr + row).to(ACC)
    t = tl.load(target_ptr + row) - vocab_start
    zero = tl.zeros([], ACC)
    smooth = (zero + smooth_hi) + smooth_lo
    on = (zero + on_hi) + on_lo
    grad = tl.exp(x - lse) - smooth - tl.where(offs == t, on, 0.0)
    grad = tl.where(valid, grad * g, 0.0)
    tl.store(out_ptr + row * stride_out + offs, grad.to(out_ptr.dtype.element_ty), mask=in_row)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _split(x: float):
    """Triton passes Python floats as float32; ``hi + lo`` carries a float64 to ~1e-14 relative."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def _stats_block(n_valid: int) -> int:
    return max(16, min(4096, triton.next_power_of_2(max(n_valid, 1))))


def ce_forward_stats(logits, target, vocab_start, n_valid, row_max, stats) -> None:
    """Kernel contract (see parallel_layers/ops/cross_entropy.py)."""
    n_rows = logits.shape[0]
    if n_rows == 0:
        return
    block = _stats_block(n_valid)
    with launch_guard(logits):
        _ce_stats_kernel[(n_rows,)](logits, logits.stride(0), target, row_max, stats, int(vocab_start),
                                    int(n_valid), ACC=_acc(logits.dtype), BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)


def ce_backward(logits, target, lse, g, vocab_start, n_valid, smooth, on, out) -> None:
    """Kernel contract (see parallel_layers/ops/cross_entropy.py)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        return
    block = max(16, min(2048, triton.next_power_of_2(n_cols)))
    grid = (n_rows, triton.cdiv(n_cols, block))
    with launch_guard(logits):
        _ce_backward_kernel[grid](logits, logits.stride(0), out, out.stride(0), target, lse, g,
                                  int(vocab_start), int(n_valid), int(n_cols), *_split(smooth), *_split(on),
                                  ACC=_acc(logits.dtype), BLOCK=block, num_warps=4)


__all__ = ["ce_forward_stats", "ce_backward"]
