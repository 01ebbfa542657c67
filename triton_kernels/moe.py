"""Mixture-of-Experts routing kernels: router top-k, the permutation's index, the row gathers and sums.

The kernel contracts are written in ``parallel_layers/ops/moe_routing.py`` and ``moe_permute.py``; these
launchers trust the arguments the ops layer validated.

- router top-k: one program per block of tokens holds their ``[BLOCK_T, E]`` logits, computes the fp32
  scores, then takes the ``k`` largest by ``k`` rounds of (max, lowest index holding it). Each block writes
  its per-expert histogram; the blocks' histograms are summed by one torch op (no atomics, deterministic).
- permute index: a histogram per block of pairs (first kernel), a prefix sum over blocks and experts on the
  ``[blocks, E]`` table (torch, integers), then each pair's rank inside its block and expert from a cumulative
  sum of its one-hot row (second kernel): stable, no atomics.
- row kernels: one program per (block of rows, block of columns); the sums over slots run in the order the
  contract fixes, in fp32.

The weighted kernels launch with ``enable_fp_fusion=False``: torch rounds each product before the add, so an
FMA would change the last bit. Stores to bf16 round to nearest even also under the interpreter (``cast_to``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import cast_to, launch_guard

BLOCK_PAIRS = 128     # (token, slot) pairs per program of the permute index
BLOCK_ROWS = 16
BLOCK_COLS = 128


def _pow2(n: int) -> int:
    return max(2, triton.next_power_of_2(n))


@triton.jit
def _router_kernel(logits_ptr, bias_ptr, w_ptr, e_ptr, part_ptr, T, E, K: tl.constexpr, K_PAD: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NORM: tl.constexpr, scale, SCALE: tl.constexpr):
    b = tl.program_id(0)
    rows = b * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
        choice = score
        if HAS_BIAS:
            choice = score + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))    # rows past T hold zeros: no -inf - -inf
        m = tl.max(x, axis=1)
        ex = tl.where(col_ok[None, :], tl.exp(x - m[:, None]), 0.0)
        score = ex / tl.sum(ex, axis=1)[:, None]
        choice = score
    choice = tl.where(col_ok[None, :], choice, float("-inf"))
    kcols = tl.arange(0, K_PAD)
    weights = tl.zeros([BLOCK_T, K_PAD], tl.float32)
    experts = tl.zeros([BLOCK_T, K_PAD], tl.int64)
    hist = tl.zeros([E_PAD], tl.int32)
    total = tl.zeros([BLOCK_T], tl.float32)
    for j in tl.static_range(K):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], cols[None, :], E_PAD), axis=1)   # lowest index on ties
        hit = cols[None, :] == pick[:, None]
        w = tl.sum(tl.where(hit, score, 0.0), axis=1)
        total = total + w
        weights = tl.where(kcols[None, :] == j, w[:, None], weights)
        experts = tl.where(kcols[None, :] == j, pick[:, None].to(tl.int64), experts)
        hist += tl.sum((hit & row_ok[:, None]).to(tl.int32), axis=0)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        if SIGMOID:
            total = total + 1e-20
        weights = weights / total[:, None]
    if SCALE:
        weights = weights * scale
    out = rows[:, None] * K + kcols[None, :]
    out_mask = row_ok[:, None] & (kcols[None, :] < K)
    tl.store(w_ptr + out, weights, mask=out_mask)
    tl.store(e_ptr + out, experts, mask=out_mask)
    tl.store(part_ptr + b * E + cols, hist, mask=col_ok)


def router_topk(logits, bias, top_k, sigmoid, norm, scale, weights, experts, counts) -> None:
    T, E = logits.shape
    e_pad = _pow2(E)
    block_t = max(1, min(64, 4096 // e_pad))
    blocks = triton.cdiv(T, block_t)
    part = torch.empty(blocks, E, dtype=torch.int32, device=logits.device)
    with launch_guard(logits):
        _router_kernel[(blocks,)](logits, bias if bias is not None else weights, weights, experts, part, T, E,
                                  K=top_k, K_PAD=_pow2(top_k), E_PAD=e_pad, BLOCK_T=block_t, SIGMOID=sigmoid,
                                  HAS_BIAS=bias is not None, NORM=norm, scale=float(scale), SCALE=scale != 1.0)
    torch.sum(part, dim=0, dtype=torch.int64, out=counts)


@triton.jit
def _onehot(experts_ptr, n, b, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    offs = b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    e = tl.load(experts_ptr + offs, mask=offs < n, other=-1)
    cols = tl.arange(0, E_PAD)
    return offs, e, (e[:, None] == cols[None, :]).to(tl.int32)


@triton.jit
def _histogram_kernel(experts_ptr, part_ptr, n, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    _offs, _e, onehot = _onehot(experts_ptr, n, b, E_PAD, BLOCK)
    cols = tl.arange(0, E_PAD)
    tl.store(part_ptr + b * E + cols, tl.sum(onehot, axis=0), mask=cols < E)


@triton.jit
def _positions_kernel(experts_ptr, base_ptr, pos_ptr, order_ptr, n, E, E_PAD: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    offs, e, onehot = _onehot(experts_ptr, n, b, E_PAD, BLOCK)
    rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)   # earlier pairs of my expert in block
    kept = (e >= 0) & (offs < n)
    base = tl.load(base_ptr + b * E + tl.where(kept, e, 0), mask=kept, other=0)
    pos = tl.where(kept, base + rank, -1)
    tl.store(pos_ptr + offs, pos, mask=offs < n)
    tl.store(order_ptr + pos, offs, mask=kept)


def moe_permute_index(experts, num_experts, counts, positions, order) -> None:
    n = experts.numel()
    if n == 0:
        counts.zero_()
        return
    e_pad = _pow2(num_experts)
    block = max(16, min(BLOCK_PAIRS, 8192 // e_pad))
    blocks = triton.cdiv(n, block)
    part = torch.empty(blocks, num_experts, dtype=torch.int64, device=experts.device)
    with launch_guard(experts):
        _histogram_kernel[(blocks,)](experts, part, n, num_experts, E_PAD=e_pad, BLOCK=block)
        torch.sum(part, dim=0, out=counts)
        # block b's first slot for expert e: e's offset plus the earlier blocks' pairs of e
        starts = torch.cumsum(counts, 0) - counts
        base = (torch.cumsum(part, 0) - part + starts).contiguous()
        _positions_kernel[(blocks,)](experts, base, positions, order, n, num_experts, E_PAD=e_pad, BLOCK=block)


@triton.jit
def _gather_kernel(src_ptr, order_ptr, scale_ptr, out_ptr, N, H, top_k, HAS_SCALE: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    row_ok = rows < N
    mask = row_ok[:, None] & (cols[None, :] < H)
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    x = tl.load(src_ptr + (pair // top_k)[:, None] * H + cols[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        w = tl.load(scale_ptr + pair, mask=row_ok, other=0.0)
        x = cast_to(x.to(tl.float32) * w[:, None], out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], x, mask=mask)


def moe_gather_rows(src, order, top_k, scale, out) -> None:
    N, H = out.shape
    if N == 0 or H == 0:
        return
    grid = (triton.cdiv(N, BLOCK_ROWS), triton.cdiv(H, BLOCK_COLS))
    with launch_guard(src):
        _gather_kernel[grid](src, order, scale if scale is not None else src, out, N, H, top_k,
                             HAS_SCALE=scale is not None, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
                             enable_fp_fusion=False)


@triton.jit
def _unpermute_kernel(src_ptr, pos_ptr, w_ptr, out_ptr, T, H, K: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    row_ok = rows < T
    col_ok = cols[None, :] < H
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for j in tl.static_range(K):                       # slot order, as the contract fixes
        p = tl.load(pos_ptr + rows * K + j, mask=row_ok, other=-1)
        w = tl.load(w_ptr + rows * K + j, mask=row_ok, other=0.0)
        kept = p >= 0
        x = tl.load(src_ptr + tl.where(kept, p, 0)[:, None] * H + cols[None, :], mask=kept[:, None] & col_ok,
                    other=0.0).to(tl.float32)
        acc = acc + tl.where(kept[:, None], x * w[:, None], 0.0)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], cast_to(acc, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok)


def moe_unpermute(expert_out, positions, weights, top_k, out) -> None:
    T, H = out.shape
    if T == 0 or H == 0:
        return
    grid = (triton.cdiv(T, BLOCK_ROWS), triton.cdiv(H, BLOCK_COLS))
    with launch_guard(out):
        _unpermute_kernel[grid](expert_out, positions, weights, out, T, H, K=top_k, BLOCK_R=BLOCK_ROWS,
                                BLOCK_C=BLOCK_COLS, enable_fp_fusion=False)


@triton.jit
def _permute_backward_kernel(grad_ptr, pos_ptr, out_ptr, T, H, K: tl.constexpr, K_PAD: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C).to(tl.int64)
    row_ok = rows < T
    col_ok = cols[None, :] < H
    slots = tl.arange(0, K_PAD)
    pos = tl.load(pos_ptr + rows[:, None] * K + slots[None, :], mask=row_ok[:, None] & (slots[None, :] < K),
                  other=-1)
    big = 1 << 62
    prev = tl.full([BLOCK_R], -1, tl.int64)
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for _ in tl.static_range(K):                       # ascending positions: the next one above the last
        nxt = tl.min(tl.where(pos > prev[:, None], pos, big), axis=1)
        kept = nxt < big
        g = tl.load(grad_ptr + tl.where(kept, nxt, 0)[:, None] * H + cols[None, :], mask=kept[:, None] & col_ok,
                    other=0.0).to(tl.float32)
        acc = tl.where(kept[:, None], acc + g, acc)
        prev = tl.where(kept, nxt, prev)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], cast_to(acc, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok)


def moe_permute_backward(grad, positions, top_k, out) -> None:
    T, H = out.shape
    if T == 0 or H == 0:
        return
    grid = (triton.cdiv(T, BLOCK_ROWS), triton.cdiv(H, BLOCK_COLS))
    with launch_guard(out):
        _permute_backward_kernel[grid](grad, positions, out, T, H, K=top_k, K_PAD=_pow2(top_k),
                                       BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS)
