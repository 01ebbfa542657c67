"""The guard a :class:`~parallel_layers.zero.stage3.ZeroStage3` parameter wears.

Between steps (and whenever its unit is not gathered) a ZeRO-3 parameter holds no elements: its storage
is resized to zero, and a plain ``nn.Parameter`` read then would read freed memory and crash the process.
Each one is turned into a :class:`_ShardedParameter` instead: shape, dtype, device, ``requires_grad``,
hooks and ``p.grad is None`` always work; its elements can only be read while its unit is gathered (the
unit's forward or backward, or inside ``ZeroStage3.gathered_parameters()``); any other read raises a
``RuntimeError`` naming the parameter and that context manager. Between ``gather_all()`` and
``reduce_scatter_and_free()`` (held mode) ``p.grad`` is the gradient accumulated so far, in the wrapper's
``reduce_dtype`` (fp32 for bf16 parameters by default: a view of the unit's gradient buffer, not a tensor of
``p``'s dtype). After a backward ``p.grad`` is a guard (the gradient lives, sharded, in the wrapper's
``grad_buffer``): ``torch.nn.utils.clip_grad_norm_`` on the
parameters raises and names ``ZeroStage3Optimizer.clip_grad_norm_``. Setting ``p.grad = None``
(``module.zero_grad()``) drops the parameter from the next step, as in torch.
"""
from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch
import torch.nn as nn

from .sharded_grad import is_metadata, sharded_grad_message, sharded_grad_placeholder

_GRAD_GET = torch.Tensor.grad.__get__
_GRAD_SET = torch.Tensor.grad.__set__
_GRAD_DEL = torch.Tensor.grad.__delete__


def raw_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """``p.grad`` as autograd holds it (no guard): what the wrapper itself works on."""
    with torch._C.DisableTorchFunctionSubclass():
        return p.grad


def set_raw_grad(p: torch.Tensor, g: Optional[torch.Tensor]) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        p.grad = g


class ParamInfo:
    """What a :class:`_ShardedParameter` knows of its place: wrapper, unit, name, this rank's piece.

    ``wrapper`` is held weakly (the parameters outlive nothing of it) and must offer ``grad_reached(p)`` and
    ``forget_grads_reached(p)`` (did a backward reach ``p`` since the last step; a dropped gradient did
    not), ``gathered_all`` and ``accumulated_grad(p)`` (held mode: where ``p``'s gradient accumulates);
    ``unit`` must offer ``name``, ``lo``, ``hi``, ``full`` (the gathered flat buffer) and
    ``gather_work`` (its all-gather in flight, or None)."""

    def __init__(self, wrapper, unit, name: str, offset: int, numel: int, shape):
        self.wrapper_ref = weakref.ref(wrapper)
        self.unit, self.name, self.shape, self.numel = unit, name, tuple(shape), numel
        self.piece = (max(offset, unit.lo) - offset, min(offset + numel, unit.hi) - offset)
        self.placeholder = None
        # set by the wrapper while the unit is gathered with this weight in FP8 only (ZeroStage3(fp8_gather=True)):
        # its place in the full buffer was not written
        self.fp8_only = False

    def readable(self) -> bool:
        u = self.unit
        return u.gather_work is None and u.full.untyped_storage().nbytes() > 0 and not self.fp8_only

    def read_error(self) -> RuntimeError:
        if self.fp8_only:
            return RuntimeError(
                f"ZeroStage3: parameter {self.name!r} (shape {self.shape}) is gathered in FP8 for its FP8 layer "
                f"(ZeroStage3(fp8_gather=True)): its full-precision value was not gathered, only the layer's own "
                f"GEMMs may use it. Read it inside `with zmodel.gathered_parameters(): ...` (a collective: every "
                f"rank of the group enters it), or leave fp8_gather off when other code reads it")
        a, b = self.piece
        held = (f"elements [{a}, {b}) of its {self.numel} (flattened, in the wrapper's shard_buffer)" if a < b
                else f"none of its {self.numel} elements")
        return RuntimeError(
            f"ZeroStage3: parameter {self.name!r} (shape {self.shape}) is sharded over the data-parallel group: "
            f"this rank holds {held}, and its full value exists only while its unit "
            f"{self.unit.name or '<root>'!r} runs. Read it inside `with zmodel.gathered_parameters(): ...` (a "
            f"collective: every rank of the group enters it), or copy every parameter with "
            f"zmodel.full_state_dict()")

    def grad_pending(self, p) -> bool:
        w = self.wrapper_ref()
        return w is not None and w.grad_reached(p)

    def drop_grad(self, p) -> None:
        w = self.wrapper_ref()
        if w is not None:
            w.forget_grads_reached(p)

    def held_grad(self, p) -> Optional[torch.Tensor]:
        """In the wrapper's held mode, the gradient ``p`` accumulated in its unit's buffer (reduce_dtype wider
        than the parameters: autograd's ``.grad`` was moved there), else None."""
        w = self.wrapper_ref()
        return w.accumulated_grad(p) if w is not None and w.gathered_all else None

    def grad_guard(self, p) -> torch.Tensor:
        if self.placeholder is None:
            how = ("ZeRO-3: after backward it lives in this rank's slice of ZeroStage3.grad_buffer, averaged over "
                   "the group")
            self.placeholder = sharded_grad_placeholder(
                p, sharded_grad_message("ZeroStage3", self.name, self.shape, how))
        return self.placeholder


def _unreadable(a) -> Optional[ParamInfo]:
    # type() against the sharded classes: isinstance on a Parameter class runs _ParameterMeta's Python
    # __instancecheck__, microseconds per argument of every op
    info = getattr(a, "_zero3_info", None) if type(a) in _SHARDED_TYPES else None
    return info if info is not None and not info.readable() else None


def _first_unreadable(args, kwargs) -> Optional[ParamInfo]:
    """The first sharded parameter among ``args``/``kwargs`` (one level into lists and tuples: foreach ops)
    whose elements are not there. Runs on every op that touches a parameter, so it allocates nothing."""
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            if isinstance(a, (list, tuple)):
                for b in a:
                    info = _unreadable(b)
                    if info is not None:
                        return info
            else:
                info = _unreadable(a)
                if info is not None:
                    return info
    return None


class _ShardedParameter(nn.Parameter):
    """A parameter of a ``ZeroStage3`` module (see the module docstring).

    Metadata (shape, dtype, device, ``requires_grad``, hooks, ``p.grad is None``) is always available.
    Elements only while the parameter's unit is gathered; any other read raises a ``RuntimeError`` naming
    the parameter and ``gathered_parameters()``. ``p.grad`` reads as a guard (:mod:`.optimizer`'s
    ``ShardedGrad``) while a gradient for it waits in the wrapper's gradient shard; assigning None drops it.
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _GRAD_GET:
            return cls._read_grad(args[0])
        if func == _GRAD_SET or func == _GRAD_DEL:
            value = args[1] if func == _GRAD_SET and len(args) > 1 else None
            info = getattr(args[0], "_zero3_info", None)
            if value is None and info is not None:
                info.drop_grad(args[0])
        elif not is_metadata(func):
            info = _first_unreadable(args, kwargs)
            if info is not None:
                raise info.read_error()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @staticmethod
    def _read_grad(p):
        g = raw_grad(p)
        info = getattr(p, "_zero3_info", None)
        if g is None and info is not None:
            # held mode (a pipeline's step): the gradient accumulated so far, which code summing gradients
            # before the reduction (tied weights, sequence-parallel norms) reads and edits in place as .grad
            held = info.held_grad(p)
            if held is not None:
                return held
            if info.grad_pending(p):
                return info.grad_guard(p)
        return g


_SHARDED_CLASSES: Dict[type, type] = {nn.Parameter: _ShardedParameter}
_SHARDED_TYPES = {_ShardedParameter}      # the values of _SHARDED_CLASSES: what a parameter's class becomes


def sharded_class(cls: type) -> type:
    """``_ShardedParameter`` for ``nn.Parameter``; for a subclass of it, a class deriving from both."""
    if cls not in _SHARDED_CLASSES:
        _SHARDED_CLASSES[cls] = type(f"Sharded{cls.__name__}", (_ShardedParameter, cls), {})
        _SHARDED_TYPES.add(_SHARDED_CLASSES[cls])
    return _SHARDED_CLASSES[cls]


def is_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, _ShardedParameter)


def set_sharded_info(p: nn.Parameter, info: ParamInfo) -> None:
    """Give ``p`` its place (read back by :func:`sharded_info` once its class is :func:`sharded_class`'s)."""
    p._zero3_info = info


def sharded_info(t) -> Optional[ParamInfo]:
    """``t``'s :class:`ParamInfo` if it is a sharded parameter, else None; cheap enough for every tensor
    autograd saves (no ``isinstance`` on a Parameter class)."""
    return getattr(t, "_zero3_info", None) if type(t) in _SHARDED_TYPES else None


__all__ = ["ParamInfo", "is_sharded", "raw_grad", "set_raw_grad", "set_sharded_info", "sharded_class", "sharded_info"]
