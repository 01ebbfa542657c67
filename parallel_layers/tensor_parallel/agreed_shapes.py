"""Tensor-parallel forward collectives that refuse inputs whose shapes differ across the ranks, with no
extra collective once the ranks have agreed on a shape.

Why. Every rank of a tensor-parallel group must feed a layer the same batch. When one rank's batch has
another size (a last, smaller batch on one rank; data sharded over the tp ranks by mistake), the layer's
collective gets buffers of different sizes, and gloo, receiving more bytes than it posted for,
terminates the process from its IO thread ("Received data size doesn't match expected size"): no Python
error, no traceback, and the other ranks wait for the group's timeout. It cannot be caught after the
fact, so the sizes must agree before they reach gloo.

How, off the hot path. A separate shape check before every collective would double the number of
collectives of a forward (a tiny gloo all-reduce costs about what a 64k-element one does). Instead each
kind of collective of a group remembers the shape every rank used last (the *agreed* shape), and
every call sends a buffer of the agreed size plus one element, a flag: 0 when this rank's shape is the
agreed one, 1 otherwise (its payload is then zeros). The sizes on the wire are the agreed ones on every
rank, so gloo never sees a mismatch, and every rank reads the sum of the flags from the same collective:

* 0 (every shape is the agreed one): the result is the answer; one collective, as without the check;
* > 0: every rank exchanges its shape (one small all-gather): the same new shape on every rank (the
  batch size changed everywhere, e.g. validation) is agreed and the collective runs again with it;
  different shapes raise a ``ValueError`` on every rank, naming the layer, each rank's shape and the fix.

The first call of a kind exchanges shapes too. The kind is the operation, dimension, dtype, number of
dimensions and last (feature) dimension: every rank runs the same model, so those agree, while batch and
sequence sizes are what differ in practice; a model that alternates shapes within one kind (two layers
of other feature sizes share none) pays the exchange at each change of shape.

Only on gloo with CPU tensors: there a mismatch kills the process. NCCL (and the NCCL-rules test
backend, which compares every collective's size across ranks) never get here: reading the flag would
synchronise the host with the GPU at every collective.
"""
from __future__ import annotations

import math
import sys
import weakref
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C

_SHAPE_SLOTS = 8        # dimensions sent in a shape exchange (more are folded into the element count)

# Per process group (held weakly: the state goes with the group): the agreed shape of each kind of
# collective, or None for a group whose collectives are not checked (not gloo).
_AGREED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_EXCHANGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # group -> shape exchanges so far


def _agreed_shapes(group) -> Optional[Dict[tuple, Tuple[int, ...]]]:
    key = group if group is not None else dist.group.WORLD
    state = _AGREED.get(key, False)
    if state is False:
        state = {} if dist.get_backend(key) == "gloo" else None
        _AGREED[key] = state
    return state


def exchange_count(group) -> int:
    """How many shape exchanges (the small all-gather) this process has made on ``group``: one per first
    call of a kind of collective and one per change of its shape; none while shapes stay the same."""
    return _EXCHANGES.get(group if group is not None else dist.group.WORLD, 0)


def _calling_layer() -> str:
    """The innermost module whose ``forward`` is on the stack (the layer that called the collective), for
    the error message; walked only when there is an error to report."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if frame.f_code.co_name == "forward" and isinstance(owner, nn.Module):
            extra = owner.extra_repr()
            return f"{type(owner).__name__}({extra})" if extra else type(owner).__name__
        frame = frame.f_back
    return "a tensor-parallel layer (called outside any module's forward)"


def _agree(shape: Tuple[int, ...], group, what: str) -> None:
    """Every rank's ``shape`` (one small all-gather); raise on every rank unless they are all equal."""
    key = group if group is not None else dist.group.WORLD
    _EXCHANGES[key] = _EXCHANGES.get(key, 0) + 1
    header = [len(shape), math.prod(shape)] + list(shape[:_SHAPE_SLOTS])
    header += [-1] * (2 + _SHAPE_SLOTS - len(header))
    rows = C.all_gather_dim0(torch.tensor([header], dtype=torch.int64), group).tolist()
    if all(row == rows[0] for row in rows):
        return
    shapes = "; ".join(f"rank {r}: {tuple(row[2:2 + min(row[0], _SHAPE_SLOTS)])}"
                       f"{' (more dimensions not shown)' if row[0] > _SHAPE_SLOTS else ''}"
                       for r, row in enumerate(rows))
    raise ValueError(
        f"{_calling_layer()}: the tensor its tensor-parallel {what} sends has a different shape on each rank "
        f"({shapes}; group ranks of {C.describe_group(group)}). Every rank of a tensor-parallel group must run "
        f"the layer on the same batch: give the tp ranks identical batches (shard the data over the "
        f"data-parallel ranks only) and make every batch the same size on all of them (drop_last=True, or pad "
        f"the last batch)")


def checked(kind: tuple, x: torch.Tensor, group, what: str,
            flagged: Callable[[torch.Tensor, Tuple[int, ...], bool], Tuple[torch.Tensor, float]],
            plain: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run a forward collective of ``x`` over ``group`` once its shape is agreed (see the module docstring).

    ``flagged(x, agreed_shape, matches)`` runs the collective on a buffer of ``agreed_shape`` plus a flag
    (``x``'s elements if ``matches``, zeros otherwise) and returns ``(result, sum of the flags)``;
    ``plain(x)`` runs it unchecked. ``kind`` (with the dtype, dimensions and last size of ``x``) names the
    collective: the agreed shape is kept per kind."""
    agreed_shapes = _agreed_shapes(group) if x.device.type == "cpu" else None
    if agreed_shapes is None:
        return plain(x)
    shape = tuple(x.shape)
    key = kind + (x.dtype, len(shape), shape[-1] if shape else None)
    agreed = agreed_shapes.get(key)
    if agreed is not None:
        out, flags = flagged(x, agreed, shape == agreed)
        if flags == 0:
            return out
    _agree(shape, group, what)          # every rank: the flags (or the missing agreed shape) are common
    out = plain(x)                      # (may refuse the shape on every rank, e.g. a size not divisible)
    agreed_shapes[key] = shape
    return out


__all__ = ["checked", "exchange_count"]
