"""Guards on sharded gradients: what ``p.grad`` holds while a parameter's gradient lives in a ZeRO shard.

Reading such a gradient's elements (``torch.nn.utils.clip_grad_norm_``, ``p.grad.norm()``, printing it)
would give this rank's local, unaveraged values, and clipping by them would never reach the step; the
guard raises a ``RuntimeError`` naming the parameter and the call that does it right
(``optimizer.clip_grad_norm_``). Metadata (shape, dtype, hooks, ...) reads through. Used by
``ZeroOptimizer`` (stages 1 and 2) and ``ZeroStage3``.
"""
from __future__ import annotations

import torch


def _metadata_functions() -> frozenset:
    """Tensor attributes that read no element: what a guard lets through (shape, dtype, hooks, ...)."""
    getters = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda",
               "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested",
               "is_xpu", "is_mps", "names", "itemsize", "output_nr", "_version", "retains_grad",
               "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
               "data_ptr", "untyped_storage", "is_floating_point", "is_complex", "is_signed", "get_device",
               "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__hash__", "_is_view",
               "__len__")
    out = set()
    for name in getters:
        desc = getattr(torch.Tensor, name, None)
        if desc is not None and hasattr(desc, "__get__"):
            out.add(desc.__get__)
    for name in methods:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out.add(fn)
    for name in ("grad", "data", "requires_grad"):
        out.add(getattr(torch.Tensor, name).__set__)
    out.add(torch.Tensor.grad.__delete__)
    return frozenset(out)


METADATA_FUNCTIONS = _metadata_functions()


def is_metadata(func) -> bool:
    try:
        return func in METADATA_FUNCTIONS
    except TypeError:        # an unhashable callable: not one of them
        return False


def guarded_in(args, kwargs, cls) -> list:
    """Instances of ``cls`` among ``args``/``kwargs`` (and one level into lists and tuples: foreach ops)."""
    found = []
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, cls):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, cls))
    return found


class ShardedGrad(torch.Tensor):
    """What ``p.grad`` holds while ``p``'s gradient lives in a ZeRO shard.

    Its shape, dtype and device are ``p``'s; reading its elements (``torch.nn.utils.clip_grad_norm_``,
    ``p.grad.norm()``, printing it) raises a ``RuntimeError`` with :attr:`sharded_grad_message`, which names
    the parameter and the call that does it right, instead of returning a number that is this rank's
    local view. ``parallel_layers.amp.clip_grad_norm_`` checks the message too (it would read
    ``p.main_grad``)."""

    sharded_grad_message = "this gradient is sharded over the data-parallel group"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        guards = guarded_in(args, kwargs, ShardedGrad)
        raise RuntimeError(guards[0].sharded_grad_message if guards else cls.sharded_grad_message)


def sharded_grad_view(t: torch.Tensor, message: str) -> ShardedGrad:
    """A guard aliasing ``t`` (same memory: autograd keeps accumulating into it)."""
    g = t.as_subclass(ShardedGrad)
    g.sharded_grad_message = message
    return g


def sharded_grad_placeholder(p: torch.Tensor, message: str) -> ShardedGrad:
    """A guard shaped like ``p`` backed by one element (for parameters whose ``.grad`` holds nothing)."""
    with torch._C.DisableTorchFunctionSubclass():
        g = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(ShardedGrad)
    g.sharded_grad_message = message
    return g


def sharded_grad_message(owner: str, name: str, shape, how: str) -> str:
    return (f"{owner}: the gradient of parameter {name!r} (shape {tuple(shape)}) is sharded over the "
            f"data-parallel group ({how}), so p.grad cannot be read: torch.nn.utils.clip_grad_norm_(model."
            f"parameters(), max_norm) would measure this rank's local values and its clipping would never "
            f"reach the step. Clip with optimizer.clip_grad_norm_(max_norm) between backward and step (the "
            f"global norm over every rank's shard; the coefficient is applied by the next step)")


__all__ = ["METADATA_FUNCTIONS", "ShardedGrad", "is_metadata", "guarded_in", "sharded_grad_view",
           "sharded_grad_placeholder", "sharded_grad_message"]
