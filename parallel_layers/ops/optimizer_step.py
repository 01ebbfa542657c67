"""Fused optimizer steps on flat fp32 buffers (what ZeRO calls on each rank's shard).

Kernel contract (every backend implements exactly these signatures; all tensors on one device,
flat, contiguous, same number of elements ``n``; ``step``, ``grad_scale``, ``found_inf`` are 1-element
float32 tensors on that device, read by the kernel so nothing syncs with the host):

    adamw_step(param, grad, exp_avg, exp_avg_sq, param_copy, step, grad_scale, found_inf,
               lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize) -> None
    sgd_step(param, grad, momentum_buffer, param_copy, step, grad_scale, found_inf,
             lr, momentum, dampening, weight_decay, nesterov, maximize) -> None

- ``param``, ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``: float32. ``grad``: float32, bfloat16 or float16.
- ``param_copy``: None, or a bfloat16/float16 buffer that receives the updated parameters in the same pass.
- ``momentum_buffer``: None when ``momentum == 0``.
- ``step``: the step number of *this* update (1 on the first), as float32. Bias corrections use it.
- If ``found_inf[0] != 0`` the kernel changes nothing at all (params, states and copy stay bit-identical).
- Gradients are read as ``g = float(grad) * grad_scale`` (grad_scale = 1/loss_scale x clip coefficient).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from . import _backend, _checks

Number = Union[float, int]
ScalarLike = Union[float, int, torch.Tensor]


# ----------------------------------------------------------------------------------------------
# torch references (the oracle in tests, and the fallback backend)
# ----------------------------------------------------------------------------------------------
def reference_adamw_step(param, grad, exp_avg, exp_avg_sq, param_copy, step, grad_scale, found_inf,
                         lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize):
    if found_inf.item() != 0:
        return
    t = step.item()
    g = grad.float() * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        if decoupled_weight_decay:
            param.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * param
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** t
    bias_correction2_sqrt = math.sqrt(1 - beta2 ** t)
    step_size = lr / bias_correction1
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if param_copy is not None:
        param_copy.copy_(param)


def reference_sgd_step(param, grad, momentum_buffer, param_copy, step, grad_scale, found_inf,
                       lr, momentum, dampening, weight_decay, nesterov, maximize):
    if found_inf.item() != 0:
        return
    g = grad.float() * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + weight_decay * param
    if momentum != 0:
        if step.item() == 1:
            momentum_buffer.copy_(g)
        else:
            momentum_buffer.mul_(momentum).add_(g, alpha=1 - dampening)
        g = g + momentum * momentum_buffer if nesterov else momentum_buffer
    param.add_(g, alpha=-lr)
    if param_copy is not None:
        param_copy.copy_(param)


# ----------------------------------------------------------------------------------------------
# public ops
# ----------------------------------------------------------------------------------------------
def _check_flat_state(op, param, grad, param_copy):
    _checks.tensor(op, "param", param, dtypes=(torch.float32,), flat=True)
    n, dev = param.numel(), param.device
    _checks.tensor(op, "grad", grad, dtypes=_checks.FLOAT_DTYPES, device=dev, numel=n, flat=True)
    if param_copy is not None:
        _checks.tensor(op, "param_copy", param_copy, dtypes=_checks.LOW_PRECISION, device=dev, numel=n, flat=True)
    return n, dev


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               lr: Number, step: ScalarLike, beta1: Number = 0.9, beta2: Number = 0.999, eps: Number = 1e-8,
               weight_decay: Number = 0.0, decoupled_weight_decay: bool = True, maximize: bool = False,
               grad_scale: ScalarLike = 1.0, found_inf: Optional[torch.Tensor] = None,
               param_copy: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> None:
    """One AdamW (or Adam, with ``decoupled_weight_decay=False`` / ``weight_decay=0``) update, in place.

    ``step`` is the step number of this update (1 first). ``grad_scale`` multiplies the gradient
    (1/loss_scale x clip coefficient; a 1-element tensor keeps it on the device). A nonzero
    ``found_inf`` skips the update entirely.
    """
    op = "adamw_step"
    n, dev = _check_flat_state(op, param, grad, param_copy)
    _checks.tensor(op, "exp_avg", exp_avg, dtypes=(torch.float32,), device=dev, numel=n, flat=True)
    _checks.tensor(op, "exp_avg_sq", exp_avg_sq, dtypes=(torch.float32,), device=dev, numel=n, flat=True)
    lr = _checks.hyper(op, "lr", lr, low=0)
    beta1 = _checks.hyper(op, "beta1", beta1, low=0, high=1, high_open=True)
    beta2 = _checks.hyper(op, "beta2", beta2, low=0, high=1, high_open=True)
    eps = _checks.hyper(op, "eps", eps, low=0)
    weight_decay = _checks.hyper(op, "weight_decay", weight_decay, low=0)
    step_t = _checks.scalar_tensor(op, "step", step, dev)
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"{op}: step={step} must be >= 1 (the number of this update, counting from 1)")
    scale_t = _checks.scalar_tensor(op, "grad_scale", grad_scale, dev)
    inf_t = _checks.scalar_tensor(op, "found_inf", found_inf, dev, default=0.0)
    impl = _backend.kernel(op, dev, backend, reference_adamw_step)
    impl(param, grad, exp_avg, exp_avg_sq, param_copy, step_t, scale_t, inf_t,
         lr, beta1, beta2, eps, weight_decay, bool(decoupled_weight_decay), bool(maximize))


def sgd_step(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor] = None, *,
             lr: Number, step: ScalarLike, momentum: Number = 0.0, dampening: Number = 0.0,
             weight_decay: Number = 0.0, nesterov: bool = False, maximize: bool = False,
             grad_scale: ScalarLike = 1.0, found_inf: Optional[torch.Tensor] = None,
             param_copy: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> None:
    """One SGD (with optional momentum/Nesterov, torch semantics) update, in place.

    On ``step == 1`` the momentum buffer is initialised to the gradient, as torch.optim.SGD does.
    """
    op = "sgd_step"
    n, dev = _check_flat_state(op, param, grad, param_copy)
    lr = _checks.hyper(op, "lr", lr, low=0)
    momentum = _checks.hyper(op, "momentum", momentum, low=0)
    dampening = _checks.hyper(op, "dampening", dampening)
    weight_decay = _checks.hyper(op, "weight_decay", weight_decay, low=0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov=True needs momentum > 0 and dampening == 0 "
                         f"(got momentum={momentum}, dampening={dampening})")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(f"{op}: momentum={momentum} needs a momentum_buffer of {n} float32 elements")
        _checks.tensor(op, "momentum_buffer", momentum_buffer, dtypes=(torch.float32,), device=dev,
                       numel=n, flat=True)
    else:
        momentum_buffer = None
    step_t = _checks.scalar_tensor(op, "step", step, dev)
    if not isinstance(step, torch.Tensor) and step < 1:
        raise ValueError(f"{op}: step={step} must be >= 1 (the number of this update, counting from 1)")
    scale_t = _checks.scalar_tensor(op, "grad_scale", grad_scale, dev)
    inf_t = _checks.scalar_tensor(op, "found_inf", found_inf, dev, default=0.0)
    impl = _backend.kernel(op, dev, backend, reference_sgd_step)
    impl(param, grad, momentum_buffer, param_copy, step_t, scale_t, inf_t,
         lr, momentum, dampening, weight_decay, bool(nesterov), bool(maximize))
