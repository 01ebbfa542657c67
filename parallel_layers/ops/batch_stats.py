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
    mu, dev2 = _reference_stats(x)
    mean.copy_(mu)
    m2.copy_(dev2)


def _reference_stats(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(mean, m2)`` of ``[B, C, L]`` ``x`` as new float32 tensors (the contract's values)."""
    n = x.shape[0] * x.shape[2]
    if n == 0:
        zeros = torch.zeros(2, x.shape[1], dtype=torch.float32, device=x.device)
        return zeros[0], zeros[1]
    # Shifted by each channel's first value: the variance does not change, and the reduction then works on
    # values near zero. ATen's CUDA var_mean accumulates in float32 (its CPU one in float64), and on a channel
    # of mean 1e4 and std 1 that lost M2 to 5e-5 relative on an H100 (this shift brings it to float32 rounding).
    xf = x.float()
    shift = xf[:1, :, :1]
    var, mu = torch.var_mean(xf - shift, dim=(0, 2), correction=0)
    return mu + shift.view(-1), var * n


def batch_stats(x: torch.Tensor, backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """``(mean, m2, count)`` per channel of ``x`` (``[B, C, *]``, channels in dim 1): float32 ``[C]`` each,
    and ``count = B * prod(spatial dims)`` as a Python int (the shape gives it: no host sync)."""
    op = "batch_stats"
    if not (isinstance(x, torch.Tensor) and x.dtype in _checks.FLOAT_DTYPES and x.dim() >= 2):
        _checks.tensor(op, "x", x, dtypes=_checks.FLOAT_DTYPES, contiguous=False)
        raise ValueError(f"{op}: x must have a batch and a channel dim ([B, C, *]), got shape {tuple(x.shape)}")
    shape = x.shape
    b, c = shape[0], shape[1]
    numel = shape.numel()
    length = numel // (b * c) if b * c else shape[2:].numel()
    count = b * length
    x3 = x.view(b, c, length) if x.is_contiguous() else x.contiguous().view(b, c, length)
    if _backend.resolve(op, x.device, backend, BACKENDS) == "torch":
        # the reference's values as new tensors: no outputs to allocate and copy into
        return (*_reference_stats(x3), count)
    mean = torch.empty(c, dtype=torch.float32, device=x.device)
    m2 = torch.empty(c, dtype=torch.float32, device=x.device)
    if c:
        _triton_kernel()(x3, mean, m2)
    return mean, m2, count


def _triton_kernel():
    # triton_kernels/__init__.py exports the multi-tensor ops only; this one lives in its own module.
    from ..triton_kernels import batch_stats as tk
    return tk.batch_stats


__all__ = ["batch_stats", "reference_batch_stats"]
