"""Bucket pack / unpack for gradient communication.

Kernel contract:

    pack_bucket(srcs, bucket, offsets, scale) -> None
    unpack_bucket(bucket, dsts, offsets, scale, accumulate) -> None

- ``bucket``: a flat contiguous tensor (float32, bfloat16 or float16); ``offsets[i]`` (int) is where
  tensor ``i`` starts in it. ``srcs`` / ``dsts``: contiguous tensors of one dtype each.
- pack:   ``bucket[o_i : o_i + n_i] = (float(srcs[i]) * scale).to(bucket.dtype)``. The scale is
  applied in float32 *before* the down-cast, so a 1/world_size scale keeps fp16 from overflowing.
- unpack: ``dsts[i] = (float(dsts[i]) if accumulate else 0) + float(bucket[o_i : o_i + n_i]) * scale``,
  written in ``dsts[i].dtype`` (typically float32 main gradients).
- ``scale``: a 1-element float32 tensor on the bucket's device.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from . import _backend, _checks


def reference_pack_bucket(srcs, bucket, offsets, scale):
    for s, o in zip(srcs, offsets):
        n = s.numel()
        if n:
            bucket[o:o + n].copy_(s.reshape(-1).float() * scale)


def reference_unpack_bucket(bucket, dsts, offsets, scale, accumulate):
    for d, o in zip(dsts, offsets):
        n = d.numel()
        if n == 0:
            continue
        y = bucket[o:o + n].float() * scale
        if accumulate:
            y = d.reshape(-1).float() + y
        d.view(-1).copy_(y)


def pack_bucket(srcs: Sequence[torch.Tensor], bucket: Optional[torch.Tensor] = None, *,
                dtype: Optional[torch.dtype] = None, scale: Union[float, torch.Tensor] = 1.0,
                offsets: Optional[Sequence[int]] = None, backend: Optional[str] = None) -> torch.Tensor:
    """Copy ``srcs`` into one flat ``bucket`` (allocated with ``dtype`` if not given), times ``scale``.

    ``offsets`` default to packing back to back. Returns the bucket.
    """
    op = "pack_bucket"
    first = srcs[0] if isinstance(srcs, (list, tuple)) and srcs else None
    native = _backend.checks_inputs(op, getattr(first, "device", None), backend)
    srcs = _checks.tensor_list(op, "srcs", srcs, dtypes=_checks.FLOAT_DTYPES, kernel_checks=native)
    sizes = [s.numel() for s in srcs]
    if bucket is None:
        if not srcs:
            raise ValueError(f"{op}: no srcs and no bucket: nothing to pack")
        offs, end = _checks.offsets_for(op, sizes, offsets, None)
        bucket = torch.empty(end, dtype=dtype or srcs[0].dtype, device=srcs[0].device)
    else:
        dev = srcs[0].device if srcs else bucket.device
        _checks.tensor(op, "bucket", bucket, dtypes=_checks.FLOAT_DTYPES, device=dev, flat=True)
        if dtype is not None and bucket.dtype != dtype:
            raise TypeError(f"{op}: dtype={dtype} but bucket has dtype {bucket.dtype}")
        offs, _ = _checks.offsets_for(op, sizes, offsets, bucket.numel())
    if not srcs:
        return bucket
    scale_t = _checks.scalar_tensor(op, "scale", scale, bucket.device)
    impl = _backend.kernel(op, bucket.device, backend, reference_pack_bucket)
    _checks.explain_kernel_error(lambda: impl(srcs, bucket, offs, scale_t),
                                 lambda: _checks.tensor_list(op, "srcs", srcs, dtypes=_checks.FLOAT_DTYPES))
    return bucket


def unpack_bucket(bucket: torch.Tensor, dsts: Sequence[torch.Tensor], *, scale: Union[float, torch.Tensor] = 1.0,
                  offsets: Optional[Sequence[int]] = None, accumulate: bool = True,
                  backend: Optional[str] = None) -> None:
    """Write (or with ``accumulate``, add) ``bucket`` slices times ``scale`` into ``dsts``."""
    op = "unpack_bucket"
    _checks.tensor(op, "bucket", bucket, dtypes=_checks.FLOAT_DTYPES, flat=True)
    native = _backend.checks_inputs(op, bucket.device, backend)
    dsts = _checks.tensor_list(op, "dsts", dsts, dtypes=_checks.FLOAT_DTYPES, device=bucket.device,
                               kernel_checks=native)
    if not dsts:
        return
    offs, _ = _checks.offsets_for(op, [d.numel() for d in dsts], offsets, bucket.numel())
    scale_t = _checks.scalar_tensor(op, "scale", scale, bucket.device)
    impl = _backend.kernel(op, bucket.device, backend, reference_unpack_bucket)
    _checks.explain_kernel_error(
        lambda: impl(bucket, dsts, offs, scale_t, bool(accumulate)),
        lambda: _checks.tensor_list(op, "dsts", dsts, dtypes=_checks.FLOAT_DTYPES, device=bucket.device))
