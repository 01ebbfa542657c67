"""Unscale + non-finite check + global L2 norm over many tensors, with no host sync.

Launch 1 (one program per chunk, see multi_tensor.py): ``y = float(x) * inv_scale``, optionally written
back (round to nearest even: bit-identical to ``x.copy_(x.float() * inv_scale)``), the chunk's sum of
``y*y`` stored in ``partials[chunk]``, and ``found_inf`` set to 1.0 if any ``y`` is inf/nan.
Launch 2 (one program): sums ``partials`` in a fixed order and writes ``sqrt`` to ``norm_out``.
Two launches instead of float atomics keep the norm deterministic run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import multi_tensor as mt

_REDUCE_BLOCK = 1024


@triton.jit
def _unscale_block(x_ptr, offs, n, inv_scale, acc, bad, UNSCALE: tl.constexpr, MASKED: tl.constexpr):
    y = mt.load_block(x_ptr, offs, n, MASKED).to(tl.float32) * inv_scale
    if UNSCALE:
        mt.store_block(x_ptr, offs, y, n, MASKED)
    return acc + y * y, bad | mt.not_finite(y)   # masked lanes are 0: add nothing, never flag


@triton.jit
def _unscale_norm_kernel(table_ptr, n_tensors, chunk_blocks, inv_scale_ptr, found_inf_ptr, partial_ptr,
                         DTYPE: tl.constexpr, UNSCALE: tl.constexpr, ALIGNED: tl.constexpr,
                         BLOCK: tl.constexpr):
    tid, start, n = mt.chunk_of_program(table_ptr, n_tensors, 1, chunk_blocks, BLOCK)
    x_ptr = mt.tensor_ptr(table_ptr, n_tensors, 0, tid, DTYPE, ALIGNED)
    inv_scale = tl.load(inv_scale_ptr)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    n_steps = tl.minimum(tl.cdiv(n - start, BLOCK), chunk_blocks)
    for i in tl.range(0, n_steps):
        off0 = start + i * BLOCK
        offs = off0 + tl.arange(0, BLOCK)
        if off0 + BLOCK <= n:
            acc, bad = _unscale_block(x_ptr, offs, n, inv_scale, acc, bad, UNSCALE, False)
        else:
            acc, bad = _unscale_block(x_ptr, offs, n, inv_scale, acc, bad, UNSCALE, True)
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))
    if tl.max(bad, axis=0) > 0:
        tl.store(found_inf_ptr, 1.0)   # never cleared; concurrent writers all store 1.0


@triton.jit
def _norm_finalize_kernel(partial_ptr, n_partials, norm_ptr, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in tl.range(0, n_partials, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + offs, mask=offs < n_partials, other=0.0)
    tl.store(norm_ptr, tl.sqrt_rn(tl.sum(acc, axis=0)))


def unscale_and_norm(tensors, inv_scale, found_inf, norm_out, unscale) -> None:
    """Kernel contract (see parallel_layers/ops/unscale_norm.py)."""
    device = norm_out.device
    sizes = [t.numel() for t in tensors]
    ptrs = [mt.ptrs_of(tensors)]
    table, n_chunks, chunk_blocks, aligned = mt.build_table(ptrs, sizes, device)
    with mt.launch_guard(norm_out):
        if n_chunks == 0:
            norm_out.zero_()
            return
        partials = torch.empty(n_chunks, dtype=torch.float32, device=device)
        _unscale_norm_kernel[(n_chunks,)](
            table, len(sizes), chunk_blocks, inv_scale, found_inf, partials,
            DTYPE=mt.TL_DTYPE[tensors[0].dtype], UNSCALE=bool(unscale),
            ALIGNED=aligned, BLOCK=mt.BLOCK, num_warps=mt.NUM_WARPS)
        _norm_finalize_kernel[(1,)](partials, n_chunks, norm_out, BLOCK=_REDUCE_BLOCK, num_warps=4)
