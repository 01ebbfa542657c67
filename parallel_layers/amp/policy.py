"""Precision policy: which dtype the parameters are held and computed in, which dtype gradients are
reduced in, and whether fp32 master weights back low-precision parameters.

Why a policy object instead of flags spread over the wrappers: the data-parallel wrapper (reduce dtype),
the ZeRO optimizer (master weights, param copy) and the training loop (loss scaling) must agree, and a
frozen value passed to all of them is the one place that can be validated once.

bf16 has fp32's exponent range, so gradients do not underflow and no loss scaler is needed; fp16 has 5
exponent bits, small gradients flush to zero without a loss scale (Micikevicius et al. 2018), so
``needs_loss_scaler`` is true only for fp16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class PrecisionPolicy:
    """``param_dtype``: dtype of the model's parameters (forward/backward compute dtype).
    ``reduce_dtype``: dtype of gradient communication (None: the gradient's own dtype, i.e. fp32 main
    grads when ``master_weights`` and the param dtype is low precision, else ``param_dtype``).
    ``master_weights``: keep fp32 copies of low-precision parameters that the optimizer updates (the
    low-precision copy is rewritten from them). Meaningless, hence ignored, for fp32 parameters.
    """

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: Optional[torch.dtype] = None
    master_weights: bool = True

    def __post_init__(self):
        if self.param_dtype not in _FLOATS:
            raise TypeError(f"PrecisionPolicy: param_dtype={self.param_dtype!r}; choose torch.float32, "
                            f"torch.bfloat16 or torch.float16")
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOATS:
            raise TypeError(f"PrecisionPolicy: reduce_dtype={self.reduce_dtype!r}; choose None (the gradient "
                            f"dtype), torch.float32, torch.bfloat16 or torch.float16")
        if not isinstance(self.master_weights, bool):
            raise TypeError(f"PrecisionPolicy: master_weights must be a bool, got "
                            f"{type(self.master_weights).__name__}")
        if self.reduce_dtype == torch.float16 and self.param_dtype != torch.float16:
            # Summing dp gradients in fp16 overflows at 65504 without the loss scale that only an fp16 model
            # carries; a bf16/fp32 model reducing in fp16 is almost certainly a typo for bfloat16.
            raise ValueError(f"PrecisionPolicy: reduce_dtype=float16 with param_dtype={_name(self.param_dtype)} "
                             f"risks overflow in the gradient sum (no loss scale protects it); use "
                             f"reduce_dtype=torch.bfloat16 or torch.float32")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def fp32(cls) -> "PrecisionPolicy":
        return cls(torch.float32, None, master_weights=False)

    @classmethod
    def bf16(cls, reduce_dtype: Optional[torch.dtype] = torch.float32) -> "PrecisionPolicy":
        """bf16 params with fp32 master weights; gradients reduced in fp32 by default (Megatron's choice:
        bf16's 8-bit mantissa loses the small contributions of a large dp sum)."""
        return cls(torch.bfloat16, reduce_dtype, master_weights=True)

    @classmethod
    def fp16(cls, reduce_dtype: Optional[torch.dtype] = torch.float32) -> "PrecisionPolicy":
        """fp16 params with fp32 master weights; needs a :class:`DynamicLossScaler`."""
        return cls(torch.float16, reduce_dtype, master_weights=True)

    # ------------------------------------------------------------------ derived answers
    @property
    def needs_loss_scaler(self) -> bool:
        return self.param_dtype == torch.float16

    @property
    def low_precision(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def uses_master_weights(self) -> bool:
        return self.master_weights and self.low_precision

    @property
    def grad_dtype(self) -> torch.dtype:
        """dtype gradients are accumulated in (the main-grad buffer): fp32 behind master weights."""
        return torch.float32 if self.uses_master_weights else self.param_dtype

    @property
    def comm_dtype(self) -> torch.dtype:
        """dtype gradients travel in during the data-parallel reduction."""
        return self.reduce_dtype if self.reduce_dtype is not None else self.grad_dtype

    def make_scaler(self, **kwargs):
        """A :class:`DynamicLossScaler` for fp16, ``None`` otherwise (bf16/fp32 need none)."""
        if not self.needs_loss_scaler:
            return None
        from .scaler import DynamicLossScaler
        return DynamicLossScaler(**kwargs)

    def cast_module_(self, module: nn.Module, *, keep_fp32=()) -> nn.Module:
        """Cast floating-point parameters and buffers of ``module`` to ``param_dtype`` in place.

        ``keep_fp32``: module types left in fp32 (e.g. ``(nn.LayerNorm,)`` for numerically touchy norms).
        Attributes on parameters (``tensor_parallel``, ``partition_dim``, ...) survive: ``p.data`` is
        replaced, the Parameter object is kept, so optimizers and hooks built later see the same objects.
        Build optimizers *after* casting: flat-buffer optimizers take views of the parameters' data.
        """
        keep = tuple(keep_fp32)
        with torch.no_grad():
            for mod in module.modules():
                if keep and isinstance(mod, keep):
                    continue
                for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)):
                    if t.is_floating_point() and t.dtype != self.param_dtype:
                        t.data = t.data.to(self.param_dtype)
        return module

    def __repr__(self) -> str:
        red = None if self.reduce_dtype is None else _name(self.reduce_dtype)
        return (f"PrecisionPolicy(param_dtype={_name(self.param_dtype)}, reduce_dtype={red}, "
                f"master_weights={self.master_weights})")
