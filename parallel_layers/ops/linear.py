"""Linear with a fused epilogue: ``act(x @ weight.T + bias)`` cast to ``out_dtype``, with autograd.

Kernel contract (``parallel_layers.triton_kernels.matmul.linear_epilogue``): ``x [M, K]``, ``weight [N, K]`` (nn.Linear
layout), ``bias [N]`` or None, all one dtype (float32, bfloat16, float16); ``activation`` None, "gelu"
(exact erf form, as ``F.gelu``) or "silu"; the product is accumulated in float32 and the bias add,
activation and cast to ``out_dtype`` happen on the accumulator before the single store of Y. When the
backward needs it, the kernel also stores the pre-activation ``z = x @ weight.T + bias`` (in x's dtype).

Backends:
- ``triton``: the fused kernel. On CUDA tensors the automatic choice takes it where it measured faster
  than torch for the call's shape class, and never for float32 without TF32 or for small problems
  (``linear_dispatch``; ``fused_linear_backend`` says what it picks and why). CPU tensors only when
  forced with ``TRITON_INTERPRET=1`` set before ``parallel_layers.triton_kernels`` is imported (that is
  how CI tests it).
- ``torch``: the reference ``F.linear`` then ``F.gelu``/``F.silu`` then ``.to(out_dtype)``. The
  implementation for CPU tensors (this op has no C++ kernel, so no fallback warning) and for CUDA when
  Triton is missing or the dtype is not one the kernel takes (e.g. float64).
- ``cpp`` / ``cuda``: this op has no such kernel; asking for one by argument is a ``ValueError``, and
  ``PARALLEL_LAYERS_BACKEND=cpp|cuda`` (set for whole test runs) means the automatic choice for this op.

Backward: where the choice is ``torch``, ``fused_linear`` calls torch's ops directly and their own autograd
runs (eager's, bit for bit, with none of a Python Function's host time per call). The Triton kernel's
Function (and the custom op under ``torch.compile``): torch matmuls (cuBLAS / MKL), ``grad_z = act'(z) *
grad_y`` via ATen's own ``gelu_backward`` / ``silu_backward``, then ``grad_x = grad_z @ W``, ``grad_W =
grad_z^T @ x``, ``grad_b = sum(grad_z)``: the ATen calls eager autograd makes for the unfused chain (grad_W is
formed as ``grad_z^T @ x`` rather than eager's ``(x^T @ grad_z)^T``, so it comes out contiguous).

Why the pre-activation is *saved* rather than recomputed: recomputing ``z`` in backward costs one more
``M x N x K`` matmul, +50% on the backward's two matmuls, to save ``M x N`` elements of activation memory;
eager ``F.linear`` + ``F.gelu`` keeps exactly that tensor too, so saving it makes the fused op no worse than
eager in memory and strictly cheaper in FLOPs. The extra store happens only when a gradient is needed
and an activation is used (inference and activation-free layers write Y alone). Trading memory for
recompute is what activation checkpointing is for, one level up.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..grad_needed import grad_needed
from . import _backend, linear_dispatch

ACTIVATIONS = (None, "gelu", "silu")
OP = "fused_linear"
_KERNELS = ("triton",)  # the backends with a kernel for this op, besides the torch reference
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _activate(y: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return y
    if activation == "gelu":
        return F.gelu(y)
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"fused_linear: activation={activation!r} is not one of {ACTIVATIONS}")


def reference_linear_epilogue(x, weight, bias, activation, out_dtype):
    y = _activate(F.linear(x, weight, bias), activation)
    return y if out_dtype is None else y.to(out_dtype)


def _choose_backend(x2d, weight, bias, activation, out_dtype, save_pre, backend: Optional[str],
                    resolved: Optional[str] = None) -> Tuple[str, str]:
    """("triton" or "torch", why) for this 2-D call (see the module docstring): ``_backend.resolve`` for an
    op whose only kernel is Triton (``resolved``: its answer, where the caller has it), the kernel's dtype rule
    (forced: an error; automatic: the reference), then on CUDA the measured choice of ``linear_dispatch``."""
    name = resolved or _backend.resolve(OP, x2d.device, backend, backends=_KERNELS)
    forced = _backend.requested_backend(backend) != "auto"
    if name != "triton":
        return name, "forced" if forced else f"no triton kernel for {x2d.device.type} tensors here"
    if x2d.dtype not in TRITON_DTYPES:
        if forced:
            raise TypeError(f"{OP}: the triton kernel takes inputs of dtype {TRITON_DTYPES}, got {x2d.dtype}; "
                            f"use backend='torch' for {x2d.dtype}")
        return "torch", f"the triton kernel does not take {x2d.dtype}"
    if forced or x2d.device.type != "cuda":
        return name, "forced"

    def run(which):
        forward = _triton_forward if which == "triton" else _torch_forward
        return forward(x2d, weight, bias, activation, out_dtype, save_pre)
    return linear_dispatch.chooser().choose(x2d, weight, bias, activation, out_dtype, save_pre, run)


def fused_linear_backend(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         activation: Optional[str] = None, out_dtype: Optional[torch.dtype] = None,
                         backend: Optional[str] = None) -> Tuple[str, str]:
    """``(backend, reason)``: what ``fused_linear`` with these arguments runs on (measuring it first if
    the automatic choice has not seen this shape class; the pre-activation counted as stored when a
    gradient will be needed, as in the call itself)."""
    _check(x, weight, bias, activation, out_dtype)
    x2d = x.reshape(-1, x.shape[-1])
    return _choose_backend(x2d, weight, bias, activation, out_dtype, _needs_pre(x, weight, bias, activation), backend)


def _needs_pre(x, weight, bias, activation) -> bool:
    # The pre-activation is kept only when autograd will need it (decided here: inside forward grad
    # mode is off, and under no_grad parameters still have requires_grad set).
    return activation is not None and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias))


def _triton_forward(x, weight, bias, activation, out_dtype, save_pre):
    from ..triton_kernels.matmul import linear_epilogue

    pre = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device) if save_pre else None
    y = linear_epilogue(x, weight, bias, activation, out_dtype, pre)
    return y, pre


def _torch_forward(x, weight, bias, activation, out_dtype, save_pre):
    z = F.linear(x, weight, bias)
    y = _activate(z, activation)
    if out_dtype is not None:
        y = y.to(out_dtype)
    return y, (z if save_pre else None)


class _FusedLinear(torch.autograd.Function):
    """2-D ``act(x @ W^T + b)``; forward on the chosen backend, backward with torch matmuls."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, out_dtype, backend, save_pre):
        run = _triton_forward if backend == "triton" else _torch_forward
        y, pre = run(x, weight, bias, activation, out_dtype, save_pre)
        ctx.activation = activation
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, pre)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, pre = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # a zero-bubble pipeline's B wants only grad_x, its W only grad_w and grad_b (grad_needed.py)
        # (the bias goes with the weight: not saved, and W's call wants both)
        w_wanted = grad_needed(weight)
        need_x, need_w, need_b = need_x and grad_needed(x), need_w and w_wanted, need_b and w_wanted
        grad_x, grad_w, grad_b = _linear_backward(grad_y, x, weight, pre, ctx.activation, need_x, need_w,
                                                  need_b and ctx.has_bias)
        return grad_x, grad_w, grad_b, None, None, None, None


def _linear_backward(grad_y, x, weight, pre, activation, need_x, need_w, need_b):
    """(grad_x, grad_w, grad_b), each None unless wanted: the backward of every backend (module docstring)."""
    grad_z = grad_y.to(x.dtype)  # the reference's ``.to(out_dtype)`` backward
    if activation == "gelu":
        grad_z = torch.ops.aten.gelu_backward(grad_z, pre, approximate="none")
    elif activation == "silu":
        grad_z = torch.ops.aten.silu_backward(grad_z, pre)
    grad_x = grad_z.mm(weight) if need_x else None
    grad_w = grad_z.t().mm(x) if need_w else None
    grad_b = grad_z.sum(0) if need_b else None
    return grad_x, grad_w, grad_b


# ---------------------------------------------------------------------- the op for torch.compile
# Under ``torch.compile`` ``fused_linear`` calls this custom op instead of ``_FusedLinear``: dynamo cannot
# trace the backend choice (environment, measurement on CUDA) nor ``grad_needed`` (autograd graph nodes),
# and it must not trace into the Triton kernel. The op is opaque to the compiler: its fake implementation
# gives the output shapes, its autograd formula is ``_linear_backward`` (traced into the backward graph,
# torch matmuls as in eager), and the backend is chosen when the op runs, on the real tensors. It always
# returns the pre-activation (an empty tensor when it is not kept: a custom op cannot return None).
# Eager calls keep ``_FusedLinear`` (no dispatcher round trip on the hot path).

@torch.library.custom_op("parallel_layers::fused_linear", mutates_args=())
def fused_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                    out_dtype: Optional[torch.dtype], backend: Optional[str],
                    save_pre: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """2-D ``(act(x @ W^T + b) as out_dtype, pre-activation or an empty tensor)`` on the chosen backend."""
    name, _ = _choose_backend(x, weight, bias, activation, out_dtype, save_pre, backend)
    run = _triton_forward if name == "triton" else _torch_forward
    y, pre = run(x, weight, bias, activation, out_dtype, save_pre)
    # (pre is never y: it is kept only with an activation, whose output is a new tensor)
    return y, (x.new_empty(0) if pre is None else pre)


@fused_linear_op.register_fake
def _(x, weight, bias, activation, out_dtype, backend, save_pre):
    y = x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype or x.dtype)
    pre = x.new_empty((x.shape[0], weight.shape[0]) if save_pre else (0,))
    return y, pre


def _op_setup_context(ctx, inputs, output):
    x, weight, bias, activation = inputs[:4]
    ctx.activation, ctx.has_bias = activation, bias is not None
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, grad_y, grad_pre):
    x, weight, pre = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    grad_x, grad_w, grad_b = _linear_backward(grad_y, x, weight, pre, ctx.activation, need_x, need_w,
                                              need_b and ctx.has_bias)
    return grad_x, grad_w, grad_b, None, None, None, None


fused_linear_op.register_autograd(_op_backward, setup_context=_op_setup_context)


def _check(x, weight, bias, activation, out_dtype):
    dtype, device = x.dtype, x.device
    if (activation in ACTIVATIONS and weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
            and weight.dtype == dtype and weight.device == device and x.is_floating_point()
            and (bias is None or (bias.dim() == 1 and bias.shape[0] == weight.shape[0] and bias.dtype == dtype
                                  and bias.device == device))
            and (out_dtype is None or out_dtype.is_floating_point)):
        return  # every check below passes: one expression instead of a dozen (host time per call)
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_linear: activation={activation!r} is not one of {ACTIVATIONS}")
    if weight.dim() != 2:
        raise ValueError(f"fused_linear: weight must be 2-D [out_features, in_features], got shape "
                         f"{tuple(weight.shape)}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear: input has last dimension {x.shape[-1] if x.dim() else None} but the "
                         f"weight expects {weight.shape[1]} (weight shape {tuple(weight.shape)})")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"fused_linear: bias has shape {tuple(bias.shape)}, expected ({weight.shape[0]},) "
                         f"for weight shape {tuple(weight.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype != x.dtype:
            raise TypeError(f"fused_linear: {name} has dtype {t.dtype} but the input has {x.dtype}; "
                            f"cast them to one dtype")
        if t.device != x.device:
            raise ValueError(f"fused_linear: {name} is on {t.device} but the input is on {x.device}")
    if not x.is_floating_point():
        raise TypeError(f"fused_linear: input must be floating point, got {x.dtype}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise TypeError(f"fused_linear: out_dtype must be a floating-point dtype, got {out_dtype}")


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 activation: Optional[str] = None, out_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)`` cast to ``out_dtype``; differentiable. ``activation``: None, "gelu" or
    "silu". ``x`` may have leading dimensions ``[..., in_features]``; ``backend``: None/"auto", "triton"
    or "torch" (see the module docstring)."""
    device_type = "cpu" if x.is_cpu else ("cuda" if x.is_cuda else x.device.type)  # .device.type: 0.3 us
    if device_type != "meta" and torch.is_autocast_enabled(device_type) and x.is_floating_point():
        # What autocast does to F.linear: run it in the autocast dtype. The Function then runs with
        # autocast off, so its forward and backward see exactly the dtypes chosen here.
        dt = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dt), weight.to(dt)
        bias = bias.to(dt) if bias is not None else None
        with torch.autocast(device_type, enabled=False):
            return fused_linear(x, weight, bias, activation=activation, out_dtype=out_dtype, backend=backend)
    compiling = torch.compiler.is_compiling()
    resolved = None if compiling else _backend.resolve(OP, x.device, backend, _KERNELS)
    if resolved == "torch":
        # torch's own kernels, called as a user calls them, with their own autograd (the Function's results,
        # ATen's ops either way, without its host time), written out here: every Python call on this path is
        # host time a training step pays. Checked first only what torch would *accept* wrongly: a weight that
        # is not 2-D (``F.linear`` takes a 1-D one), a bias that would broadcast, a non-float input or
        # ``out_dtype``, an unknown activation, a meta parameter beside a real input (a model never
        # materialized: torch would return a meta result); what torch refuses (sizes, dtypes, devices)
        # ``_check`` then explains (its ~1 us a call is paid only on error).
        if (weight.dim() != 2 or not x.is_floating_point() or activation not in ACTIVATIONS
                or weight.is_meta != x.is_meta or (out_dtype is not None and not out_dtype.is_floating_point)
                or (bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]
                                          or bias.is_meta != x.is_meta))):
            _check(x, weight, bias, activation, out_dtype)
        try:
            y = F.linear(x, weight, bias)
        except (RuntimeError, TypeError):
            _check(x, weight, bias, activation, out_dtype)
            raise
        if activation is not None:
            y = F.gelu(y) if activation == "gelu" else F.silu(y)
        return y if out_dtype is None else y.to(out_dtype)
    _check(x, weight, bias, activation, out_dtype)
    two_d = x.dim() == 2  # no reshapes (and no view nodes in the graph) for the common 2-D call
    lead = x.shape[:-1]
    x2d = x if two_d else x.reshape(lead.numel(), x.shape[-1])
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                        or (bias is not None and bias.requires_grad))
    save_pre = grad and activation is not None  # = _needs_pre(x, weight, bias, activation)
    if compiling:
        y = fused_linear_op(x2d, weight, bias, activation, out_dtype, backend, save_pre)[0]
        return y if two_d else y.reshape(*lead, weight.shape[0])
    name, _ = _choose_backend(x2d, weight, bias, activation, out_dtype, save_pre, backend, resolved)
    if name == "torch":
        return reference_linear_epilogue(x, weight, bias, activation, out_dtype)
    if grad:
        y = _FusedLinear.apply(x2d, weight, bias, activation, out_dtype, name, save_pre)
    else:  # no autograd graph to build: the Function's forward alone (its apply costs ~8 us of host time)
        y = (_triton_forward if name == "triton" else _torch_forward)(x2d, weight, bias, activation, out_dtype,
                                                                       False)[0]
    return y if two_d else y.reshape(*lead, weight.shape[0])
