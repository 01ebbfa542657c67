"""The local passes of vocab-parallel cross entropy (one rank's slice of the vocabulary).

``parallel_layers.tensor_parallel.cross_entropy`` runs them around two small all-reduces. Neither pass
communicates, so each is a plain kernel with a torch reference, tested on its own.

Kernel contract (``logits``: 2-D ``[rows, cols]`` float64/32/16/bf16 with unit column stride;
``target``: ``[rows]`` int64 *global* class ids; this shard holds global columns
``[vocab_start, vocab_start + cols)``, of which the first ``n_valid`` are real classes and the rest are
vocabulary padding; accumulation dtype ``acc`` = float64 for float64 logits, else float32):

    ce_forward_stats(logits, target, vocab_start, n_valid, row_max, stats) -> None
        row_max[r]  = max of the row's valid logits (-inf if n_valid == 0)
        stats[r, 0] = sum_j exp(x[r, j] - row_max[r]) over valid j (0 for a row of -inf only)
        stats[r, 1] = x[r, target[r] - vocab_start] if this shard owns target[r] (a valid column), else 0
        stats[r, 2] = sum of the row's valid logits
      row_max: [rows], stats: [rows, 3], both contiguous, dtype acc.

    ce_backward(logits, target, lse, g, vocab_start, n_valid, smooth, on, out) -> None
        out[r, j] = g[r] * (exp(x[r, j] - lse[r]) - smooth - on * [vocab_start + j == target[r]])
                    for valid j, and 0 for padded j; written in out.dtype.
      lse, g: [rows] dtype acc. ``out``: same shape and dtype as ``logits`` (unit column stride); it
      may be ``logits`` itself (the in-place backward).

Backends: ``triton`` (CUDA; CPU only under TRITON_INTERPRET=1) and the torch reference, which is
also the CPU implementation: it walks the rows in chunks of about ``CHUNK_BYTES`` of float32 so its
temporaries stay bounded whatever the vocabulary (no full-size softmax is ever materialised).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import _backend

BACKENDS = ("triton",)  # besides the torch reference
CHUNK_BYTES = 1 << 20   # rows per chunk of the torch reference: ~1 MB of float32 temporaries (stays in L2)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def row_chunks(n_rows: int, n_cols: int, chunk_bytes: int):
    """The ``(first, end)`` row spans the torch reference walks: ``chunk_bytes`` of float32 each."""
    step = max(1, chunk_bytes // (4 * max(n_cols, 1)))
    for r0 in range(0, n_rows, step):
        yield r0, min(n_rows, r0 + step)


_chunk_walk = [row_chunks]      # what the loops call; replaced only inside sampled_row_walk


@contextlib.contextmanager
def sampled_row_walk(walk):
    """Within this block the reference's row loops take their spans from ``walk(n_rows, n_cols, chunk_bytes)``
    (a generator over :func:`row_chunks`'s spans) instead: the layout planner, on the meta device, runs a few of
    them and charges the rest (``planner.accounting.sampled_loss_rows``). Not for real tensors."""
    _chunk_walk.append(walk)
    try:
        yield
    finally:
        _chunk_walk.remove(walk)


def _chunks(n_rows: int, n_cols: int, chunk_bytes: int):
    return _chunk_walk[-1](n_rows, n_cols, chunk_bytes)


def safe_max(m: torch.Tensor) -> torch.Tensor:
    """The row max to subtract: 0 for a row of -inf only, so exp(-inf - 0) = 0 rather than nan."""
    return torch.where(m == float("-inf"), torch.zeros_like(m), m)


def reference_ce_forward_stats(logits, target, vocab_start, n_valid, row_max, stats,
                               chunk_bytes: int = CHUNK_BYTES):
    rows = logits.shape[0]
    if n_valid == 0:
        row_max.fill_(float("-inf"))
        stats.zero_()
        return
    acc = row_max.dtype
    for r0, r1 in _chunks(rows, n_valid, chunk_bytes):
        x = logits[r0:r1, :n_valid].to(acc)   # a view (no copy) when logits are already acc
        m = x.amax(dim=1)
        row_max[r0:r1] = m
        stats[r0:r1, 0] = (x - safe_max(m)[:, None]).exp_().sum(dim=1)
        t = target[r0:r1] - vocab_start
        owned = (t >= 0) & (t < n_valid)
        picked = x.gather(1, t.clamp(0, n_valid - 1)[:, None]).squeeze(1)
        stats[r0:r1, 1] = torch.where(owned, picked, torch.zeros_like(picked))
        stats[r0:r1, 2] = x.sum(dim=1)


def reference_ce_backward(logits, target, lse, g, vocab_start, n_valid, smooth, on, out,
                          chunk_bytes: int = CHUNK_BYTES):
    rows, cols = logits.shape
    acc = lse.dtype
    if n_valid < cols:
        out[:, n_valid:] = 0
    if n_valid == 0:
        return
    in_place = (out.data_ptr() == logits.data_ptr() and out.stride() == logits.stride()
                and out.dtype == logits.dtype)
    for r0, r1 in _chunks(rows, n_valid, chunk_bytes):
        dst = out[r0:r1, :n_valid]
        # Work in dst itself when it has the accumulation dtype (then the in-place backward allocates
        # nothing); otherwise in one float32 chunk that is cast into dst at the end.
        work = dst if dst.dtype == acc else torch.empty(dst.shape, dtype=acc, device=dst.device)
        if not (work is dst and in_place):
            work.copy_(logits[r0:r1, :n_valid])
        work.sub_(lse[r0:r1, None]).exp_()
        if smooth:
            work.sub_(smooth)
        t = target[r0:r1] - vocab_start
        owned = ((t >= 0) & (t < n_valid)).nonzero().squeeze(1)
        if owned.numel():
            work[owned, t[owned]] -= on
        work.mul_(g[r0:r1, None])
        if work is not dst:
            dst.copy_(work)


def ce_forward_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_valid: int,
                     backend: Optional[str] = None):
    """Per-row statistics of one vocabulary shard (see the kernel contract). Returns (row_max, stats)."""
    acc = acc_dtype(logits.dtype)
    row_max = torch.empty(logits.shape[0], dtype=acc, device=logits.device)
    stats = torch.empty(logits.shape[0], 3, dtype=acc, device=logits.device)
    impl = _impl("ce_forward_stats", logits.device, backend, reference_ce_forward_stats)
    impl(logits, target, int(vocab_start), int(n_valid), row_max, stats)
    return row_max, stats


def ce_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor,
                vocab_start: int, n_valid: int, smooth: float, on: float, out: torch.Tensor,
                backend: Optional[str] = None) -> torch.Tensor:
    """Write the cross-entropy gradient of one vocabulary shard into ``out`` (may be ``logits``)."""
    impl = _impl("ce_backward", logits.device, backend, reference_ce_backward)
    impl(logits, target, lse, g, int(vocab_start), int(n_valid), float(smooth), float(on), out)
    return out


def _impl(op: str, device: torch.device, backend: Optional[str], reference):
    if _backend.resolve(op, device, backend, BACKENDS) == "torch":
        return reference
    # triton_kernels/__init__.py exports the multi-tensor ops only; these live in their own module.
    from ..triton_kernels import cross_entropy as tk
    return getattr(tk, op)


__all__ = ["ce_forward_stats", "ce_backward", "safe_max", "reference_ce_forward_stats", "reference_ce_backward"]
