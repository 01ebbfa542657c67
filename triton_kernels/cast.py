"""Multi-tensor scaled copy: ``dst = (float(src) * scale [+ float(dst)]).to(dst dtype)``.

One kernel serves three ops, because they differ only in where the pointers come from:

* ``multi_tensor_cast``: srcs -> dsts, with the non-finite check on the written values;
* ``pack_bucket``  (bucket.py): srcs -> slices of the bucket;
* ``unpack_bucket`` (bucket.py): bucket slices -> dsts, optionally accumulating.

Bit-exactness with the torch reference: the scale is applied with one float32 multiply, the result is
converted with round-to-nearest-even, and the accumulating variant is launched with
``enable_fp_fusion=False`` so ``d + x * s`` is not contracted into an FMA (torch rounds ``x * s`` first).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from . import multi_tensor as mt


@triton.jit
def _copy_block(src, dst, offs, n, scale, bad, ACCUMULATE: tl.constexpr, CHECK_INF: tl.constexpr,
                MASKED: tl.constexpr):
    y = mt.load_block(src, offs, n, MASKED).to(tl.float32) * scale
    if ACCUMULATE:
        y = mt.load_block(dst, offs, n, MASKED).to(tl.float32) + y
    out = mt.cast_to(y, dst.dtype.element_ty)
    mt.store_block(dst, offs, out, n, MASKED)
    if CHECK_INF:
        # Check what was written (an fp16 overflow shows up only after the cast).
        bad = bad | mt.not_finite(out.to(tl.float32))
    return bad


@triton.jit
def _scaled_copy_kernel(table_ptr, n_tensors, chunk_blocks, scale_ptr, found_inf_ptr,
                        SRC: tl.constexpr, DST: tl.constexpr, ACCUMULATE: tl.constexpr,
                        CHECK_INF: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    tid, start, n = mt.chunk_of_program(table_ptr, n_tensors, 2, chunk_blocks, BLOCK)
    src = mt.tensor_ptr(table_ptr, n_tensors, 0, tid, SRC, ALIGNED)
    dst = mt.tensor_ptr(table_ptr, n_tensors, 1, tid, DST, ALIGNED)
    scale = tl.load(scale_ptr)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    n_steps = tl.minimum(tl.cdiv(n - start, BLOCK), chunk_blocks)
    for i in tl.range(0, n_steps):
        off0 = start + i * BLOCK
        offs = off0 + tl.arange(0, BLOCK)
        if off0 + BLOCK <= n:
            bad = _copy_block(src, dst, offs, n, scale, bad, ACCUMULATE, CHECK_INF, False)
        else:
            bad = _copy_block(src, dst, offs, n, scale, bad, ACCUMULATE, CHECK_INF, True)
    if CHECK_INF:
        if tl.max(bad, axis=0) > 0:
            tl.store(found_inf_ptr, 1.0)   # every writer stores the same value: no atomic needed


def scaled_copy(src_ptrs: Sequence[int], dst_ptrs: Sequence[int],
                sizes: Sequence[int], src_dtype: torch.dtype, dst_dtype: torch.dtype,
                scale: torch.Tensor, found_inf, accumulate: bool) -> None:
    """Launch the scaled copy over tensors given by raw addresses (all on ``scale``'s device).

    ``found_inf`` None means "do not check".
    """
    device = scale.device
    ptr_lists = (list(src_ptrs), list(dst_ptrs))
    table, n_chunks, chunk_blocks, aligned = mt.build_table(ptr_lists, sizes, device)
    if n_chunks == 0:
        return
    check = found_inf is not None
    with mt.launch_guard(scale):
        _scaled_copy_kernel[(n_chunks,)](
            table, len(sizes), chunk_blocks, scale, found_inf if check else scale,
            SRC=mt.TL_DTYPE[src_dtype], DST=mt.TL_DTYPE[dst_dtype], ACCUMULATE=bool(accumulate),
            CHECK_INF=check, ALIGNED=aligned, BLOCK=mt.BLOCK, num_warps=mt.NUM_WARPS,
            enable_fp_fusion=False)


def multi_tensor_cast(srcs, dsts, scale, found_inf) -> None:
    """Kernel contract: ``dsts[i] = (float(srcs[i]) * scale).to(dsts[i].dtype)``; flag non-finite outputs."""
    if not srcs:
        return
    sizes = [s.numel() for s in srcs]
    scaled_copy(mt.ptrs_of(srcs), mt.ptrs_of(dsts), sizes, srcs[0].dtype, dsts[0].dtype,
                scale, found_inf, accumulate=False)
