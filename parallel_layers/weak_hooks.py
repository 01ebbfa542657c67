"""Tensor hooks that do not keep their owner alive.

torch keeps a tensor's hooks where Python's garbage collector cannot follow them, so a hook that holds the
object that holds the tensor (a wrapper's bound method on its own parameters) is a cycle the collector never
frees: every wrapper built and dropped in one process (a sweep over layouts, a notebook, a test) would keep
its whole model, gradient buffers and optimizer state. A hook made here holds its owner weakly and does
nothing once the owner is gone.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(owner: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A hook that calls ``fn(owner, *args)`` while ``owner`` lives. ``fn`` must not hold ``owner`` itself
    (pass a plain function or an unbound method, with any other values bound as defaults)."""
    ref = weakref.ref(owner)

    def hook(*args):
        obj = ref()
        return None if obj is None else fn(obj, *args)
    return hook


__all__ = ["weak_hook"]
