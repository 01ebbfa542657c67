"""Fused AdamW / SGD steps on flat buffers: one streaming pass, no host sync.

Every program reads ``found_inf``, ``step`` and ``grad_scale`` from device memory. When ``found_inf``
is nonzero the whole body is skipped: nothing is read or written, so params, states and the copy stay
bit-identical (the step is "skipped" as GradScaler does, without the host ever seeing the flag).

Bias corrections ``1 - beta**t`` are computed per program in float64 from the loaded step, as
``1 - exp(t * log(beta))``. Triton passes Python floats as float32, which would cost ~1e-5 relative in
``1 - beta2`` (0.999 is not a float32), so ``log(beta)`` and ``lr`` arrive as float32 (hi, lo) pairs
and are rebuilt in float64.

The per-element math is float32 in the reference's order of operations, with an explicit tl.fma
exactly where torch's kernels fuse (``add_(x, alpha=a)`` and ``addcmul_`` are FMAs in ATen's CPU
kernels, checked numerically; ``addcdiv_`` and ``g + wd * p`` are not), launched with
``enable_fp_fusion=False`` so the compiler adds no other contractions; sqrt and division use the
IEEE-rounded tl.sqrt_rn / tl.div_rn, not the GPU's approximate ones. Under the interpreter this is
bit-identical to the CPU reference for SGD, and for AdamW except rare 1-ulp differences where the
float64 bias-correction scalars round differently.

Full blocks run unmasked (vectorised); only the last block of the buffer is masked.
"""
from __future__ import annotations

import math

import triton
import triton.language as tl

from . import multi_tensor as mt

BLOCK = 2048
NUM_WARPS = 8


@triton.jit
def _f64(hi, lo):
    # tl.cast, not .to: under the interpreter scalar arguments arrive as plain Python floats.
    return tl.cast(hi, tl.float32).to(tl.float64) + tl.cast(lo, tl.float32).to(tl.float64)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, n, scale, neg_step_size, bc2_sqrt,
                 beta1, omb1, beta2, omb2, eps, wd_mul, wd,
                 WD_MODE: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    g = mt.load_block(g_ptr, offs, n, MASKED).to(tl.float32) * scale
    if MAXIMIZE:
        g = -g
    p = mt.load_block(p_ptr, offs, n, MASKED)
    if WD_MODE == 1:      # decoupled (AdamW): param *= 1 - lr * wd
        p = p * wd_mul
    elif WD_MODE == 2:    # L2 (Adam): g += wd * param
        g = g + wd * p
    # exp_avg.mul_(beta1).add_(g, alpha=1-beta1); exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1-beta2)
    m = tl.fma(g, omb1, mt.load_block(m_ptr, offs, n, MASKED) * beta1)
    v = tl.fma(omb2 * g, g, mt.load_block(v_ptr, offs, n, MASKED) * beta2)
    # param.addcdiv_(exp_avg, sqrt(v) / bc2_sqrt + eps, value=-step_size)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)
    mt.store_block(m_ptr, offs, m, n, MASKED)
    mt.store_block(v_ptr, offs, v, n, MASKED)
    mt.store_block(p_ptr, offs, p, n, MASKED)
    if HAS_COPY:
        mt.store_block(c_ptr, offs, p, n, MASKED)


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, step_ptr, scale_ptr, found_inf_ptr, n,
                  lr_hi, lr_lo, lb1_hi, lb1_lo, lb2_hi, lb2_lo,
                  beta1, omb1, beta2, omb2, eps, wd_mul, wd,
                  WD_MODE: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):
    if tl.load(found_inf_ptr) == 0:
        t = tl.load(step_ptr).to(tl.float64)
        bc1 = 1.0 - tl.exp(t * _f64(lb1_hi, lb1_lo))
        bc2 = 1.0 - tl.exp(t * _f64(lb2_hi, lb2_lo))
        neg_step_size = (-_f64(lr_hi, lr_lo) / bc1).to(tl.float32)
        bc2_sqrt = tl.sqrt(bc2).to(tl.float32)
        scale = tl.load(scale_ptr)
        off0 = tl.program_id(0).to(tl.int64) * BLOCK
        offs = off0 + tl.arange(0, BLOCK)
        if off0 + BLOCK <= n:
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, n, scale, neg_step_size, bc2_sqrt,
                         beta1, omb1, beta2, omb2, eps, wd_mul, wd, WD_MODE, MAXIMIZE, HAS_COPY, False)
        else:
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, offs, n, scale, neg_step_size, bc2_sqrt,
                         beta1, omb1, beta2, omb2, eps, wd_mul, wd, WD_MODE, MAXIMIZE, HAS_COPY, True)


@triton.jit
def _sgd_block(p_ptr, g_ptr, b_ptr, c_ptr, offs, n, scale, first_step, neg_lr, momentum, omd, wd,
               HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
               MAXIMIZE: tl.constexpr, HAS_COPY: tl.constexpr, MASKED: tl.constexpr):
    g = mt.load_block(g_ptr, offs, n, MASKED).to(tl.float32) * scale
    if MAXIMIZE:
        g = -g
    p = mt.load_block(p_ptr, offs, n, MASKED)
    if HAS_WD:
        g = g + wd * p
    if HAS_MOMENTUM:
        # torch.optim.SGD: the buffer starts as the gradient on the first step.
        buf = tl.fma(g, omd, mt.load_block(b_ptr, offs, n, MASKED) * momentum)
        buf = tl.where(first_step, g, buf)
        mt.store_block(b_ptr, offs, buf, n, MASKED)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = tl.fma(g, neg_lr, p)   # param.add_(g, alpha=-lr)
    mt.store_block(p_ptr, offs, p, n, MASKED)
    if HAS_COPY:
        mt.store_block(c_ptr, offs, p, n, MASKED)


@triton.jit
def _sgd_kernel(p_ptr, g_ptr, b_ptr, c_ptr, step_ptr, scale_ptr, found_inf_ptr, n,
                neg_lr, momentum, omd, wd,
                HAS_WD: tl.constexpr, HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    if tl.load(found_inf_ptr) == 0:
        first_step = tl.load(step_ptr) == 1.0
        scale = tl.load(scale_ptr)
        off0 = tl.program_id(0).to(tl.int64) * BLOCK
        offs = off0 + tl.arange(0, BLOCK)
        if off0 + BLOCK <= n:
            _sgd_block(p_ptr, g_ptr, b_ptr, c_ptr, offs, n, scale, first_step, neg_lr, momentum, omd, wd,
                       HAS_WD, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_COPY, False)
        else:
            _sgd_block(p_ptr, g_ptr, b_ptr, c_ptr, offs, n, scale, first_step, neg_lr, momentum, omd, wd,
                       HAS_WD, HAS_MOMENTUM, NESTEROV, MAXIMIZE, HAS_COPY, True)


def _log_pair(beta: float):
    # beta == 0: beta**t == 0 for t >= 1, i.e. exp(t * -inf) == 0 (lo must be 0, not -inf - -inf).
    if beta == 0:
        return float("-inf"), 0.0
    return mt.f32_pair(math.log(beta))


def adamw_step(param, grad, exp_avg, exp_avg_sq, param_copy, step, grad_scale, found_inf,
               lr, beta1, beta2, eps, weight_decay, decoupled_weight_decay, maximize) -> None:
    """Kernel contract (see parallel_layers/ops/optimizer_step.py)."""
    n = param.numel()
    if n == 0:
        return
    wd_mode = 0 if weight_decay == 0 else (1 if decoupled_weight_decay else 2)
    lr_hi, lr_lo = mt.f32_pair(float(lr))
    lb1_hi, lb1_lo = _log_pair(float(beta1))
    lb2_hi, lb2_lo = _log_pair(float(beta2))
    with mt.launch_guard(param):
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, param_copy if param_copy is not None else param,
            step, grad_scale, found_inf, n,
            lr_hi, lr_lo, lb1_hi, lb1_lo, lb2_hi, lb2_lo,
            float(beta1), 1.0 - beta1, float(beta2), 1.0 - beta2, float(eps),
            1.0 - lr * weight_decay, float(weight_decay),
            WD_MODE=wd_mode, MAXIMIZE=bool(maximize), HAS_COPY=param_copy is not None,
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False)


def sgd_step(param, grad, momentum_buffer, param_copy, step, grad_scale, found_inf,
             lr, momentum, dampening, weight_decay, nesterov, maximize) -> None:
    """Kernel contract (see parallel_layers/ops/optimizer_step.py)."""
    n = param.numel()
    if n == 0:
        return
    has_momentum = momentum != 0
    with mt.launch_guard(param):
        _sgd_kernel[(triton.cdiv(n, BLOCK),)](
            param, grad, momentum_buffer if has_momentum else param,
            param_copy if param_copy is not None else param,
            step, grad_scale, found_inf, n,
            -float(lr), float(momentum), 1.0 - dampening, float(weight_decay),
            HAS_WD=weight_decay != 0, HAS_MOMENTUM=has_momentum, NESTEROV=bool(nesterov) and has_momentum,
            MAXIMIZE=bool(maximize), HAS_COPY=param_copy is not None, BLOCK=BLOCK, num_warps=NUM_WARPS,
            enable_fp_fusion=False)
