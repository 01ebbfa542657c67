"""Synchronized batch norm: the statistics of the global batch (every rank of a data-parallel or ZeRO group),
with one all-reduce per layer in forward and one in backward.

Forward (training): each rank computes its per-channel ``(count, mean, M2)`` with the fused op
``parallel_layers.ops.batch_stats`` (Welford/Chan-stable, float32), then ONE all-reduce of the packed float64
vector ``[count, sum x (C), sum x^2 (C)]``, where ``sum x = n * mean`` and ``sum x^2 = M2 + n * mean^2`` are
rebuilt from the stable local statistics. Why sums in float64 rather than Chan's pairwise merge: Chan's merge
needs every rank's (n, mean, M2) (an all-gather, as ``torch.nn.SyncBatchNorm`` does) or a second round trip for
the global mean; sums reduce with one plain all-reduce, whatever the local batch sizes. The price is the
cancellation in ``var = sum x^2 / N - mean^2``: in float64 its relative error is about
``1e-16 * (mean / std)^2`` (1e-8 at mean 1e4, std 1), far below float32 rounding; the local sums themselves
are exact up to float32 rounding of mean and M2 because they come from Welford, not from ``sum(x^2)`` in
float32.

Uneven local batches, a rank with 0 rows included, give exactly the global statistics: each rank adds its
own count. A rank with 0 rows still joins both all-reduces (its output and input gradient are empty), so it
must run the layer, and backward through it, like the others. A global batch of one value per channel gives
an infinite unbiased variance in the running statistics (``torch.nn.BatchNorm`` refuses it; here the global
count is only known after the all-reduce, and checking it would sync with the host).

Backward: the local ``(sum dy, sum dy * xhat)`` per channel (ATen's batch-norm backward with only the
weight and bias gradients asked for: one fused pass), ONE all-reduce of the packed float32 ``[2C]``, then
``dx = w * invstd * (dy - sum dy / N - xhat * sum(dy * xhat) / N)`` elementwise. The weight and bias
gradients returned are the local ones (like torch's): the data-parallel gradient reduction sums them.

Running statistics are updated like torch's: ``momentum`` (or the cumulative average when it is None) with
the unbiased global variance ``var * N / (N - 1)``. Eval mode normalises with the running statistics and
communicates nothing; with ``track_running_stats=False`` eval uses the local batch's statistics, as torch's
``SyncBatchNorm`` does. Inputs ``[B, C]`` and ``[B, C, *]`` (any number of spatial dims), float32, bfloat16
or float16 (statistics and gradient reductions in float32; the output in the input's dtype).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..distributed import collectives as C
from ..ops.batch_stats import batch_stats

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm", "sync_batch_norm"]


def _all_reduce(t: torch.Tensor, group) -> None:
    if group is None and not dist.is_initialized():
        return                      # one process, no process group: the local batch is the global one
    C.all_reduce(t, group)


def _bshape(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` ([C]) shaped to broadcast over a ``dim``-D ``[B, C, ...]`` tensor."""
    return t.view((1, -1) + (1,) * (dim - 2))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group, backend):
        x = x.contiguous()
        channels = x.shape[1]
        mean_l, m2_l, n_l = batch_stats(x, backend=backend)
        packed = torch.empty(2 * channels + 1, dtype=torch.float64, device=x.device)
        mean_d = mean_l.double()
        packed[0] = n_l
        torch.mul(mean_d, n_l, out=packed[1:channels + 1])
        torch.addcmul(m2_l.double(), mean_d, mean_d, value=n_l, out=packed[channels + 1:])
        _all_reduce(packed, group)                                  # the one forward collective
        total = packed[0]
        mean_g = packed[1:channels + 1] / total
        var_g = (packed[channels + 1:] / total - mean_g.square()).clamp_min_(0)
        mean = mean_g.float()
        var = var_g.float()
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and factor > 0:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = (var_g * total / (total - 1)).to(running_var.dtype)
                running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        if x.numel() == 0:
            y = torch.empty_like(x)
        else:
            w = weight if weight is None or x.dtype == torch.float32 else weight.float()
            b = bias if bias is None or x.dtype == torch.float32 else bias.float()
            xf = x if x.dtype == torch.float32 else x.float()
            y = F.batch_norm(xf, mean, var, w, b, False, 0.0, eps).to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, total.float())
        ctx.group = group
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, total = ctx.saved_tensors
        channels = x.shape[1]
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if x.numel() == 0:
            sum_dy = torch.zeros(channels, dtype=torch.float32, device=x.device)
            sum_dy_xhat = torch.zeros_like(sum_dy)
        else:
            xf = x if x.dtype == torch.float32 else x.float()
            dyf = dy.contiguous() if dy.dtype == torch.float32 else dy.float().contiguous()
            # ATen's fused reduction: grad_weight = sum(dy * xhat), grad_bias = sum(dy), per channel.
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dyf, xf, None, None, None, mean, invstd, True, 0.0, [False, True, True])
        dx = dw = db = None
        if need_w and weight is not None:
            dw = sum_dy_xhat.to(weight.dtype)
        if need_b and weight is not None:
            db = sum_dy.to(weight.dtype)
        if need_x:
            packed = torch.cat([sum_dy, sum_dy_xhat])
            _all_reduce(packed, ctx.group)                          # the one backward collective
            if x.numel() == 0:
                dx = torch.zeros_like(x)
            else:
                mean_dy = packed[:channels] / total
                mean_dy_xhat = packed[channels:] / total
                k = invstd if weight is None else invstd * weight.float()
                a = -k * invstd * mean_dy_xhat                     # dx = k dy + a x + c
                c = k * (mean * invstd * mean_dy_xhat - mean_dy)
                d = x.dim()
                dx = torch.addcmul(_bshape(c, d), xf, _bshape(a, d))    # two passes: c + a x, then + k dy
                dx = dx.addcmul_(dyf, _bshape(k, d)).to(x.dtype)
        return dx, dw, db, None, None, None, None, None, None


def sync_batch_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                    running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], *,
                    momentum: float, eps: float, group, backend: Optional[str] = None) -> torch.Tensor:
    """Batch norm with the statistics of ``x`` over every rank of ``group`` (training mode); updates the
    running statistics in place with factor ``momentum`` when they are given."""
    if x.dim() < 2:
        raise ValueError(f"sync_batch_norm: expected an input [B, C, *] of at least 2 dims, got {tuple(x.shape)}")
    return _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, float(eps),
                                        float(momentum), group, backend)


class SyncBatchNorm(_BatchNorm):
    """``nn.BatchNorm{1,2,3}d`` over the global batch of ``process_group`` (see the module docstring).

    The same arguments, buffers, state dict and eval behaviour as torch's batch norms; ``process_group``
    is explicit (None: the default group, or no communication at all without ``torch.distributed``).
    ``backend`` forces the backend of the statistics kernel (``parallel_layers.ops``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 device=None, dtype=None, backend: Optional[str] = None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group
        self.backend = backend

    def _check_input_dim(self, x):
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected at least 2D input [B, C, *], got {x.dim()}D")
        if x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm: input has {x.shape[1]} channels, the layer {self.num_features}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:     # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or self.running_mean is None
        if not use_batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        if not self.training:             # eval without running statistics: the local batch, no communication
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        track = self.track_running_stats
        return sync_batch_norm(x, self.weight, self.bias, self.running_mean if track else None,
                               self.running_var if track else None, momentum=factor, eps=self.eps,
                               group=self.process_group, backend=self.backend)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", process_group={C.describe_group(self.process_group)}"


def convert_sync_batchnorm(module: nn.Module, process_group=None, backend: Optional[str] = None) -> nn.Module:
    """Replace every ``nn.BatchNorm{1,2,3}d`` (any ``_BatchNorm``, torch's ``SyncBatchNorm`` included) in
    ``module``, recursively, by a :class:`SyncBatchNorm` over ``process_group``, sharing its weight and bias
    parameters and its running-statistics buffers, with its training flag. Returns the module (a new one if
    ``module`` itself is a batch norm), like ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``."""
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, backend=backend)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, process_group, backend))
    return out
