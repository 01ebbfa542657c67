"""The tensors autograd saves in one stage forward, held through handles a zero-bubble B can release.

Between B (input gradient) and W (weight gradients) a stage's graph is kept (``retain_graph``), so by
default every activation the forward saved stays until W, including the ones only the input path used
(attention's, the activation function's input, dropout masks, a norm's input whose weights were done in
B). For a GPT block that is about half of what the forward saved, and ZB-H1's last rank holds ``p``
microbatches between B and W, so it would hold far more than 1F1B's peak.

Autograd offers no way to release one node's saved tensors from a retained graph, so the engine runs
each stage forward of a zero-bubble schedule under :meth:`SavedTensors.hooks` (``saved_tensors_hooks``):
every saved tensor is packed into a handle this ledger keeps, with the sequence number of the node
that saves it (autograd creates the node, then packs its tensors). While B runs, each unpack records
the autograd node that asked for it (torch's current-node query). A handle unpacked by its own node,
when that node is on the input path (which W never runs again), is released then, as a backward
without ``retain_graph`` frees a node's saved tensors once it ran, so B's peak is not the forward's
saved tensors plus every gradient kept for W (a custom Function's node may read ``ctx.saved_tensors``
twice: its tensors go once B is over, :meth:`release_only_used_by`). A handle a weight
branch's node unpacked, or that nothing unpacked in B, is kept; so is one a node unpacked that did not
save it: torch's non-reentrant checkpoint reads its segment's saved inputs inside the unpack of
whichever node of the segment asks first, and reads them again when W's backward recomputes the
segment. Releasing drops the handle's reference; the storage is freed when
nothing else holds it (a view saved by a node that W runs keeps its base alive).

A released handle that is unpacked again (a schedule that ran a node twice) raises, naming the node,
instead of computing with a missing tensor.

Tensors are held detached: the saved variables' unpack hook references this ledger, so a held tensor
with a ``grad_fn`` would close a reference cycle (ledger, handle, tensor, node, saved variable, hook)
through C++ that Python's collector cannot see, and every microbatch's graph would outlive its W
(measured: 7.5 MB per microbatch of the pipeline benchmark's stage). Torch rebuilds the autograd
metadata of what an unpack hook returns; like under any saved-tensor hooks, a custom Function's
``ctx.saved_tensors`` then gives plain tensors, not the ``Parameter`` objects it saved (keep one on
``ctx`` to read its attributes).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, List, Optional, Set

import torch
from torch.autograd.function import BackwardCFunction

_current_node: Optional[Callable] = getattr(torch._C, "_current_autograd_node", None)
_next_sequence_nr: Optional[Callable] = getattr(torch._C._autograd, "_get_sequence_nr", None)


class _Handle:
    __slots__ = ("tensor", "users", "owner", "released_by")

    def __init__(self, tensor: torch.Tensor, owner: int):
        self.tensor: Optional[torch.Tensor] = tensor
        self.users: List = []                  # autograd nodes that unpacked it while recording
        self.owner = owner                     # sequence number of the node that saved it
        self.released_by: Optional[str] = None


class SavedTensors:
    """Saved tensors of one stage forward (one microbatch, one chunk)."""

    def __init__(self):
        self._handles: List[_Handle] = []
        self._owners: Set[int] = set()              # sequence numbers of the nodes that saved through it
        self._releasable: Optional[Set] = None      # while recording B

    @staticmethod
    def supported() -> bool:
        """Whether this torch tells an unpack hook which node is running and a pack hook which node is
        saving (else nothing is released)."""
        return _current_node is not None and _next_sequence_nr is not None

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context manager for the forward: every tensor autograd saves goes through this ledger."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def saved_by(self, node) -> bool:
        """Whether ``node``'s saved tensors went through this ledger (not through a checkpoint's hooks)."""
        return _sequence_nr(node) in self._owners

    def _pack(self, t: torch.Tensor) -> _Handle:
        # autograd creates a node (taking the thread's next sequence number), then saves its tensors
        owner = _next_sequence_nr() - 1 if _next_sequence_nr is not None else -1
        handle = _Handle(t.detach(), owner)     # detached: see the module docstring
        self._handles.append(handle)
        self._owners.add(owner)
        return handle

    def _unpack(self, handle: _Handle) -> torch.Tensor:
        if handle.tensor is None:
            raise RuntimeError(f"pipeline zero-bubble split: autograd node {_node_name()} needs a tensor saved in "
                               f"the forward that was released ({handle.released_by}); only nodes on "
                               f"the input path may be released, and W must not run them again")
        t = handle.tensor
        if self._releasable is not None:
            node = _current_node()
            if node is not None:
                if (node in self._releasable and _sequence_nr(node) == handle.owner
                        and not isinstance(node, BackwardCFunction)):
                    # a built-in node unpacks each saved tensor once per run: it is the last use
                    handle.tensor, handle.released_by = None, "used by the input gradient only, in B"
                else:
                    handle.users.append(node)
        return t

    @contextmanager
    def recording(self, releasable: Set) -> Iterator["SavedTensors"]:
        """Context manager around B: each tensor whose own node is in ``releasable`` (the input path's
        nodes that W never runs) is released as that node unpacks it, the way a backward without
        ``retain_graph`` frees a node's saved tensors after running it; a custom Function's node may read
        ``ctx.saved_tensors`` more than once, so its tensors are released after B
        (:meth:`release_only_used_by`). Other unpacks are remembered for that call."""
        self._releasable = releasable if self.supported() else None
        try:
            yield self
        finally:
            self._releasable = None

    def release_only_used_by(self, releasable: Set, why: str) -> int:
        """Drop every handle that nodes of ``releasable``, and no other node, unpacked while recording.
        Returns how many were released; the ledger keeps the others (for :meth:`held_bytes`)."""
        if not self.supported():
            return 0
        kept, released = [], 0
        for handle in self._handles:
            if handle.tensor is None:
                released += 1
            elif handle.users and all(node in releasable and _sequence_nr(node) == handle.owner
                                      for node in handle.users):
                handle.tensor, handle.released_by = None, why
                released += 1
            else:
                kept.append(handle)
            handle.users = []
        self._handles = kept
        return released

    def held_bytes(self, exclude: Iterable[torch.Tensor] = ()) -> int:
        """Bytes of the distinct storages the handles still hold, less those of ``exclude`` (weights)."""
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        seen = {}
        for handle in self._handles:
            t = handle.tensor
            if t is None or t.device.type == "meta":
                continue
            key = t.untyped_storage().data_ptr()
            if key and key not in skip:
                seen[key] = t.untyped_storage().nbytes()
        return sum(seen.values())


def _sequence_nr(node) -> int:
    seq = getattr(node, "_sequence_nr", None)
    return seq() if seq is not None else -2


def _node_name() -> str:
    node = _current_node() if _current_node is not None else None
    return type(node).__name__ if node is not None else "(unknown)"


__all__ = ["SavedTensors"]
