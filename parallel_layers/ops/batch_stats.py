"""Per-channel batch statistics for (synchronized) batch norm: count, mean and M2, Welford/Chan-stable.

Kernel contract:

    batch_stats(x, mean, m2) -> None

- ``x``: contiguous ``[B, C, L]`` float32, bfloat16 or float16 (``L``: the product of the spatial dims, 1 for
  an ``[B, C]`` input). Accumulation is float32 whatever the input dtype.
- ``mean[c]`` = the mean of ``float(x[:, c, :])``; ``m2[c]`` = ``sum((float(x[:, c, :]) - mean[c]) ** 2)``
  (so the biased variance is ``m2 / (B * L)``); both contiguous float32 ``[C]``, written in full.
- ``B * L == 0``: ``mean = 0`` and ``m2 = 0`` (a rank with no rows contributes count 0 to the global
  statistics). A non-finite input makes its channel's mean and m2 non-finite.
- Stable: M2 is accumulated as sums of squared deviations from running means (Welford per element in the
  reference through ``torch.var_mean`` of the values shifted by each channel's first; per block merged with
  Chan's formula in the Triton kernel), never as
  ``sum(x^2) - n * mean^2``, so a channel of mean 1e4 and std 1 keeps its variance to float32 rounding.

Backends: ``triton`` (CUDA; CPU only under ``TRITON_INTERPRET=1``) and the torch reference, which is also
the CPU implementation (ATen's ``var_mean`` is a vectorised Welford reduction).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _backend, _checks

BACKENDS = ("triton",)  # besides the torch reference


def reference_batch_stats(x: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
    n = x.shape[0] * x.shape[2]
    if n == 0:
        mean.zero_()
        m2.zero_()
        return
    # Shifted by each channel's first value: the variance does not change, and the reduction then works on
    # values near zero. ATen's CUDA var_mean accumulates in float32 (its CPU one in float64), and on a channel
    # of mean 1e4 and std 1 that lost M2 to 5e-5 relative on an H100 (this shift brings it to float32 rounding).
    xf = x.float()
    shift = xf[:1, :, :1]
    var, mu = torch.var_mean(xf - shift, dim=(0, 2), correction=0)
    mean.copy_(mu + shift.reshape(-1))
    m2.copy_(var * n)


def batch_stats(x: torch.Tensor, backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(mean, m2, count)`` per channel of ``x`` (``[B, C, *]``, channels in dim 1): float32 ``[C]`` each,
    and ``count = B * prod(spatial dims)`` as a Python int (the shape gives it: no host sync)."""
    op = "batch_stats"
    _checks.tensor(op, "x", x, dtypes=_checks.FLOAT_DTYPES, contiguous=False)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must have a batch and a channel dim ([B, C, *]), got shape {tuple(x.shape)}")
    b, c = x.shape[0], x.shape[1]
    length = 1
    for d in x.shape[2:]:
        length *= d
    x3 = x.contiguous().view(b, c, length)
    count = b * x3.shape[2]
    mean = torch.empty(c, dtype=torch.float32, device=x.device)
    m2 = torch.empty(c, dtype=torch.float32, device=x.device)
    if c:
        _impl(op, x.device, backend)(x3, mean, m2)
    return mean, m2, count


def _impl(op: str, device: torch.device, backend: Optional[str]):
    if _backend.resolve(op, device, backend, BACKENDS) == "torch":
        return reference_batch_stats
    # triton_kernels/__init__.py exports the multi-tensor ops only; this one lives in its own module.
    from ..triton_kernels import batch_stats as tk
    return tk.batch_stats


__all__ = ["batch_stats", "reference_batch_stats"]
