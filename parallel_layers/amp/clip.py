"""Global gradient-norm clipping across data, tensor and pipeline parallel ranks, on the device.

The norm that ``torch.nn.utils.clip_grad_norm_`` computes on the dense single-process model is the norm of
the vector of *all distinct* gradient elements. With parallelism each rank holds a piece of that vector:

- tensor parallel: a parameter marked ``tensor_parallel=True`` is a shard, so its squares are summed over the
  TP group; a replicated one (LayerNorm, the row layer's bias) is a full copy on every TP rank and must be
  counted once, not tp times: only TP rank 0 adds it (Megatron's rule), then one sum over the TP group;
- sharded data parallel (ZeRO-2/3 gradient shards) and pipeline stages: each rank holds disjoint elements,
  so the squares are summed over those groups (pass them in ``groups``). Plain data parallel after the
  all-reduce holds *identical* full gradients: do not pass the dp group then.

Per rank the work is one ``ops.unscale_and_norm`` call per dtype (one fused pass that also unscales on the
fly and flags inf/nan), then one 2-element all-reduce per group carrying (sum of squares, overflow count):
summing the 0/1 flags is as good as a MAX and saves a collective. Nothing is read to the host: the norm and
the clip coefficient come back as device tensors, and the coefficient can go straight into a fused
optimizer step as part of its gradient multiplier (:func:`grad_multiplier`, :func:`fused_optimizer_grad_scale`).
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..ops import unscale_and_norm

_EPS = 1e-6   # torch.nn.utils.clip_grad_norm_'s: coefficient = max_norm / (norm + 1e-6)


def grads_and_flags(items, where: str) -> Tuple[List[torch.Tensor], List[bool]]:
    """Gradients of ``items`` and whether each is a tensor-parallel shard.

    An item is a parameter (``nn.Parameter``, or a leaf that requires grad): its ``main_grad`` when set (the
    fp32 gradient buffer of Megatron-style data parallelism), else ``.grad``; parameters without a gradient
    are skipped. Any other tensor *is* a gradient (e.g. a ZeRO shard). ``tensor_parallel`` is read from the
    parameter, or from the gradient tensor itself. A parameter whose gradient lives in a ZeRO shard (its
    ``.grad`` is the ZeRO optimizer's guard) is a ``RuntimeError`` naming ``optimizer.clip_grad_norm_``.
    """
    if isinstance(items, torch.Tensor):
        items = [items]
    grads, flags = [], []
    for i, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"{where}: item {i} is a {type(item).__name__}; pass parameters or gradient tensors")
        if isinstance(item, nn.Parameter) or (item.requires_grad and item.is_leaf):
            sharded = getattr(item.grad, "sharded_grad_message", None)
            if sharded is not None:     # a ZeRO guard: neither .grad nor main_grad holds this gradient
                raise RuntimeError(sharded)
            g = getattr(item, "main_grad", None)
            if g is None:
                g = item.grad
            if g is None:
                continue
        else:
            g = item
        if g.layout != torch.strided:
            raise ValueError(f"{where}: item {i} has a {g.layout} gradient; only dense gradients are supported")
        grads.append(g)
        flags.append(bool(getattr(item, "tensor_parallel", False)))
    return grads, flags


def _local_stats(grads: List[torch.Tensor], inv_scale, found_inf: torch.Tensor, norm_type: float,
                 device) -> torch.Tensor:
    """This rank's (sum of squares | max abs) of ``grads * inv_scale``; ``found_inf`` accumulates inf/nan."""
    acc = torch.zeros(1, dtype=torch.float32, device=device)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g if g.is_contiguous() else g.contiguous())
    for ts in by_dtype.values():
        if norm_type == 2.0:
            norm, _ = unscale_and_norm(ts, inv_scale=inv_scale, found_inf=found_inf, unscale=False)
            acc += norm * norm
        else:   # inf-norm: no fused kernel; torch's foreach max-abs (still no host sync)
            m = torch.stack(torch._foreach_norm(ts, math.inf)).max().float().reshape(1)
            if inv_scale is not None:
                m = m * inv_scale
            found_inf.copy_(torch.where(torch.isfinite(m), found_inf, torch.ones_like(found_inf)))
            acc = torch.maximum(acc, m)
    return acc


def clip_grad_norm_(parameters, max_norm: float, *, groups: Sequence = (), tp_group=None,
                    norm_type: float = 2.0, foreach: Optional[bool] = None, apply: bool = True,
                    inv_scale: Union[torch.Tensor, float, None] = None,
                    found_inf: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Global gradient norm over all parallel ranks and the clip coefficient, both 0-dim device tensors.

    Args:
        parameters: parameters or gradient tensors (see :func:`grads_and_flags`); every rank passes its own.
        max_norm: the clipping threshold.
        groups: groups over which this rank's gradients are *disjoint pieces* of the model: the dp group
            when the gradients are ZeRO shards, the pp group (pipeline stages). Summed over.
        tp_group: the tensor-parallel group: ``tensor_parallel`` shards summed over it, replicated
            parameters counted once (on TP rank 0). Do not also list it in ``groups``.
        norm_type: 2.0 (fused kernel) or ``inf``.
        apply: multiply the gradients in place by the coefficient (times ``inv_scale`` if given, so loss-
            scaled gradients come out unscaled and clipped in the same write). ``apply=False`` only measures:
            hand the coefficient to the optimizer instead (see :func:`fused_optimizer_grad_scale`).
        inv_scale: ``1/loss_scale`` (e.g. ``scaler.inv_scale``) when the gradients are still loss-scaled:
            the norm is then that of the unscaled gradients.
        found_inf: a 1-element float32 tensor set to 1.0 when any rank's gradients hold inf/nan (agreed
            across ``tp_group`` and ``groups`` by the same all-reduce as the norm).

    Returns ``(total_norm, clip_coef)`` with ``clip_coef = min(1, max_norm / (total_norm + 1e-6))``.
    Like torch, a non-finite norm gives a 0 or nan coefficient; check ``found_inf`` to skip such steps.
    Parameters shared between pipeline stages (tied embeddings) must be passed on one stage only.
    """
    where = "clip_grad_norm_"
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if norm_type not in (2.0, math.inf):
        raise ValueError(f"{where}: norm_type={norm_type} is not supported; use 2.0 (fused) or math.inf")
    if tp_group is not None and any(g is tp_group for g in groups):
        raise ValueError(f"{where}: the tp group is also in groups; pass it only as tp_group (listing it in "
                         f"groups would sum the tensor-parallel squares twice)")
    grads, flags = grads_and_flags(parameters, where)
    if grads:
        device = grads[0].device
    elif isinstance(found_inf, torch.Tensor):
        device = found_inf.device
    else:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    if isinstance(inv_scale, (int, float)):
        inv_scale = torch.full((1,), float(inv_scale), dtype=torch.float32, device=device)
    elif inv_scale is not None:
        inv_scale = inv_scale.to(device=device, dtype=torch.float32).reshape(1)

    # Replicated parameters: counted on TP rank 0 only, so the TP sum counts them once.
    first_tp = tp_group is None or C.rank(tp_group) == 0
    counted = [g for g, tp in zip(grads, flags) if tp or first_tp]
    local_inf = torch.zeros(1, dtype=torch.float32, device=device)
    stats = _local_stats(counted, inv_scale, local_inf, norm_type, device)
    if found_inf is not None and len(counted) < len(grads):
        # Replicated gradients on TP ranks > 0 are left out of the norm, but an inf/nan there (a rank-local
        # overflow) must still make every rank skip: check them too (flag only; the norm is discarded).
        uncounted = [g for g, tp in zip(grads, flags) if not (tp or first_tp)]
        _local_stats(uncounted, inv_scale, local_inf, norm_type, device)
    stats = torch.cat([stats, local_inf])
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    for group in ([tp_group] if tp_group is not None else []) + list(groups):
        C.all_reduce(stats, group, op=op)
    total = stats[0].sqrt() if norm_type == 2.0 else stats[0].clone()
    coef = torch.clamp(max_norm / (total + _EPS), max=1.0)
    if found_inf is not None:
        found_inf.copy_(torch.where(stats[1:] > 0, torch.ones_like(found_inf), found_inf))
    if apply and grads:
        mult = coef if inv_scale is None else coef * inv_scale.reshape(())
        _scale_(grads, mult, foreach)
    return total, coef


def _scale_(grads: List[torch.Tensor], mult: torch.Tensor, foreach: Optional[bool]) -> None:
    """``g *= mult`` for every gradient; foreach (one launch per device/dtype) unless told otherwise."""
    if foreach is False:
        for g in grads:
            g.mul_(mult.to(g.device))
        return
    by_key: dict = {}
    for g in grads:
        by_key.setdefault((g.device, g.dtype), []).append(g)
    for (dev, _), gs in by_key.items():
        torch._foreach_mul_(gs, mult.to(dev))


def _as_tensor(x, device, name: str) -> torch.Tensor:
    if hasattr(x, "scale") and isinstance(x.scale, torch.Tensor):   # a DynamicLossScaler
        x = x.scale
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.float32).reshape(1)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number, a 1-element tensor or a DynamicLossScaler, got {type(x).__name__}")
    return torch.full((1,), float(x), dtype=torch.float32, device=device)


def grad_multiplier(loss_scale=None, clip_coef=None, *, device=None) -> torch.Tensor:
    """``clip_coef / loss_scale``: what the gradients must be multiplied by before the update. This is the
    ``grad_scale`` argument of ``parallel_layers.ops.adamw_step`` / ``sgd_step`` (the ZeRO shard step).
    ``loss_scale``: a number, a tensor or a :class:`DynamicLossScaler`; None means 1."""
    ref = clip_coef if isinstance(clip_coef, torch.Tensor) else getattr(loss_scale, "scale", loss_scale)
    dev = device if device is not None else (ref.device if isinstance(ref, torch.Tensor) else "cpu")
    m = torch.ones(1, dtype=torch.float32, device=dev)
    if clip_coef is not None:
        m = m * _as_tensor(clip_coef, dev, "clip_coef")
    if loss_scale is not None:
        m = m / _as_tensor(loss_scale, dev, "loss_scale")
    return m


def fused_optimizer_grad_scale(loss_scale=None, clip_coef=None, *, device=None) -> torch.Tensor:
    """``loss_scale / clip_coef``: the ``grad_scale`` of ``FusedAdamW.step`` / ``FusedSGD.step``, which follow
    torch's fused optimizers and *divide* the gradients by it. A zero coefficient (inf norm) gives inf, i.e.
    a zero multiplier; such a step is skipped anyway when ``found_inf`` is passed along."""
    return torch.reciprocal(grad_multiplier(loss_scale, clip_coef, device=device))
