"""Bucket pack / unpack: the multi-tensor scaled copy (cast.py) with one side pointing into the bucket.

pack:   bucket[o_i : o_i + n_i] = (float(srcs[i]) * scale).to(bucket.dtype)
unpack: dsts[i] = ((float(dsts[i]) if accumulate else 0) + float(bucket[o_i : o_i + n_i]) * scale)
        written in dsts[i].dtype. Without ``accumulate`` nothing is added (0 + -0.0 would be +0.0 and
        break bit-identity with the reference), which is why accumulation is a constexpr branch.
"""
from __future__ import annotations

from . import multi_tensor as mt
from .cast import scaled_copy


def _slice_ptrs(bucket, offsets):
    base, esize = bucket.data_ptr(), bucket.element_size()
    return [base + int(o) * esize for o in offsets]


def pack_bucket(srcs, bucket, offsets, scale) -> None:
    if not srcs:
        return
    sizes = [s.numel() for s in srcs]
    scaled_copy(mt.ptrs_of(srcs), _slice_ptrs(bucket, offsets), sizes, srcs[0].dtype, bucket.dtype,
                scale, None, accumulate=False)


def unpack_bucket(bucket, dsts, offsets, scale, accumulate) -> None:
    if not dsts:
        return
    sizes = [d.numel() for d in dsts]
    scaled_copy(_slice_ptrs(bucket, offsets), mt.ptrs_of(dsts), sizes, bucket.dtype, dsts[0].dtype,
                scale, None, accumulate=bool(accumulate))
