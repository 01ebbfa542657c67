"""Grouped matrix product over experts in one launch, and the weight gradient per expert.

Kernel contracts (``parallel_layers/ops/grouped_mm.py`` validates the arguments; these launchers trust them):

    grouped_mm(x [N, K], weight [E, M, K] (any strides), counts [E] int64, out [N, M]) -> None
        rows offs[e]:offs[e+1] of out = x[offs[e]:offs[e+1]] @ weight[e].T   (offs = exclusive cumsum of counts)
    grouped_mm_weight_grad(dy [N, M], x [N, K], counts [E] int64, out [E, M, K] float32) -> None
        out[e] = dy[offs[e]:offs[e+1]].T @ x[offs[e]:offs[e+1]]  (zeros for an expert with no rows)

Forward tiling: the row tiles of all experts are numbered one after the other (expert ``e`` owns
``cdiv(counts[e], BLOCK_M)`` of them, their starts a cumulative sum computed on the device), and the grid is
``(cdiv(N, BLOCK_M) + E, cdiv(M, BLOCK_N))``, an upper bound on the tile count known without a host sync;
programs past the last tile write nothing. A program finds its expert by counting the tile starts at or
below its index. The weight gradient runs one program per (expert, tile of M, tile of K), walking that
expert's rows in BLOCK_K steps. Products accumulate in float32; float32 inputs use IEEE products unless
``torch.backends.cuda.matmul.allow_tf32`` (as ``triton_kernels/matmul.py``). Under ``TRITON_INTERPRET=1``
16-bit tiles are widened to float32 before ``tl.dot`` (the interpreter multiplies bf16 as raw integers).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .multi_tensor import cast_to, launch_guard


def _config(device: torch.device):
    if device.type == "cuda":
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)
    return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)   # interpreter: every program costs, keep tiles small


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32 else "tf32"


def _upcast(t: torch.Tensor) -> bool:
    return t.device.type != "cuda" and t.dtype != torch.float32


@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, offs_ptr, tiles_ptr, out_ptr, M, K, E, sw0, sw1, sw2,
                       E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    starts = tl.load(tiles_ptr + experts, mask=experts < E, other=1 << 30)
    e = tl.sum((starts <= tile).to(tl.int32), axis=0) - 1
    e = tl.maximum(e, 0)
    first_tile = tl.load(tiles_ptr + e)
    row_end = tl.load(offs_ptr + e + 1)
    row0 = tl.load(offs_ptr + e) + (tile - first_tile) * BLOCK_M
    total_tiles = tl.load(tiles_ptr + E)
    row_end = tl.where(tile < total_tiles, row_end, row0)          # past the last tile: no rows
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K).to(tl.int64)
    row_ok = rows < row_end
    col_ok = cols < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * sw0
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
        b = tl.load(w_base + cols[None, :] * sw1 + kk[:, None] * sw2, mask=col_ok[None, :] & (kk[:, None] < K),
                    other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * M + cols[None, :], cast_to(acc, out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _offsets(counts: torch.Tensor, block_m: int):
    """Row offsets ``[E + 1]`` and tile starts ``[E + 1]`` (int64, on the device)."""
    zero = counts.new_zeros(1)
    offs = torch.cat([zero, torch.cumsum(counts, 0)])
    tiles = torch.cat([zero, torch.cumsum((counts + block_m - 1) // block_m, 0)])
    return offs, tiles


def grouped_mm(x, weight, counts, out) -> None:
    N, K = x.shape
    E, M = weight.shape[0], weight.shape[1]
    if N == 0 or M == 0:
        return
    cfg = _config(x.device)
    offs, tiles = _offsets(counts, cfg["BLOCK_M"])
    grid = (triton.cdiv(N, cfg["BLOCK_M"]) + E, triton.cdiv(M, cfg["BLOCK_N"]))
    with launch_guard(x):
        _grouped_mm_kernel[grid](x, weight, offs, tiles, out, M, K, E, *weight.stride(),
                                 E_PAD=max(2, triton.next_power_of_2(E)), PRECISION=_precision(x.dtype),
                                 UPCAST=_upcast(x), **cfg)


@triton.jit
def _weight_grad_kernel(dy_ptr, x_ptr, offs_ptr, out_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    ks = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    rs = tl.arange(0, BLOCK_K).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for r0 in tl.range(start, end, BLOCK_K):
        r = r0 + rs
        r_ok = r < end
        a = tl.load(dy_ptr + r[None, :] * M + ms[:, None], mask=r_ok[None, :] & (ms[:, None] < M), other=0.0)
        b = tl.load(x_ptr + r[:, None] * K + ks[None, :], mask=r_ok[:, None] & (ks[None, :] < K), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(out_ptr + e * M * K + ms[:, None] * K + ks[None, :], acc,
             mask=(ms[:, None] < M) & (ks[None, :] < K))


def grouped_mm_weight_grad(dy, x, counts, out) -> None:
    E, M, K = out.shape
    if E == 0 or M == 0 or K == 0:
        return
    cfg = _config(x.device)
    offs, _ = _offsets(counts, 1)
    grid = (E, triton.cdiv(M, cfg["BLOCK_M"]), triton.cdiv(K, cfg["BLOCK_N"]))
    with launch_guard(x):
        _weight_grad_kernel[grid](dy, x, offs, out, M, K, PRECISION=_precision(x.dtype), UPCAST=_upcast(x), **cfg)
