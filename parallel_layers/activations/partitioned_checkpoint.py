"""Partitioned and offloaded checkpoint inputs (ZeRO-R's P_a and CPU checkpointing).

A checkpointed block keeps only its input for backward. Under tensor parallelism (without sequence
parallelism) that input, ``[b, s, d]``, is the same on every rank of the TP group, so each rank keeping all
of it stores ``tp`` copies of one tensor. With ``SavedInputs(partition_group=tp_group)`` each rank keeps only
its ``1/tp`` slice of the flattened input, and the recomputation in backward first all-gathers the slices
(one all-gather per checkpointed block). With ``offload=True`` what is kept (the whole input or the slice)
goes to host memory (:mod:`.activation_offload`) and comes back for the recomputation. Both together keep
``1/tp`` of the input on the host and nothing on the device.

How: torch's non-reentrant checkpoint saves its inputs through autograd's saved-tensor mechanism (the
block's own activations go through its inner hooks, which drop them). :meth:`SavedInputs.hooks` wraps one
checkpoint call in ``saved_tensors_hooks`` that see exactly those inputs: the pack hook turns the input into
a slice and / or a host copy, the unpack hook (run when backward reaches the block) gives back a tensor of
the same shape and values. The recomputation then reads bit for bit the input the forward read, so the
gradients equal plain checkpointing's exactly, dropout masks included (the RNG replay is untouched).

Why the slice is of the flattened tensor: any shape splits into ``tp`` equal pieces (the last one padded),
and the all-gather writes the pieces straight back in order: no transpose, no copy beyond the gather.

Under sequence parallelism the block input is already a ``1/tp`` shard that differs between ranks:
partitioning it would be wrong, so the GPT passes no partition group then (offload still applies).
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Dict, Optional

import torch

from ..distributed import collectives as C
from .activation_offload import HostOffload, OnHost

MODES = ("keep", "partition", "offload", "partition+offload")


class _Kept:
    """What one saved input became: its shape, and its piece (slice or whole), on the device or on the host."""

    __slots__ = ("shape", "numel", "piece", "sliced", "__weakref__")

    def __init__(self, shape, numel: int, piece, sliced: bool):
        self.shape, self.numel, self.piece, self.sliced = shape, numel, piece, sliced

    @property
    def on_host(self) -> bool:
        return isinstance(self.piece, OnHost)

    @property
    def nbytes(self) -> int:
        p = self.piece
        return p.nbytes if isinstance(p, OnHost) else p.numel() * p.element_size()


class SavedInputs:
    """How checkpointed blocks keep their inputs: ``partition_group`` (a TP group: each rank keeps ``1/tp``
    of the input, gathered again for the recomputation; None or a group of one: the whole input) and
    ``offload`` (what is kept lives in host memory). :meth:`hooks` applies it around one checkpoint call;
    :meth:`kept_bytes` tells what the inputs alive now occupy, on the device and on the host."""

    def __init__(self, partition_group=None, offload: bool = False):
        self.partition_group = partition_group
        self.parts = C.world_size(partition_group) if partition_group is not None else 1
        self.part = C.rank(partition_group) if partition_group is not None else 0
        self.offload = HostOffload() if offload else None
        self._alive: "weakref.WeakSet[_Kept]" = weakref.WeakSet()

    @classmethod
    def from_mode(cls, mode: Optional[str], tp_group=None, sequence_parallel: bool = False,
                  where: str = "checkpoint_inputs", *, checkpointed: bool = True,
                  checkpoint=None) -> Optional["SavedInputs"]:
        """``mode`` one of :data:`MODES` (None or ``"keep"``: plain checkpointing, returns None). Under
        sequence parallelism the input is already sharded: ``partition`` keeps it as it is.
        ``checkpointed``: whether the caller checkpoints any block (``checkpoint``: its setting, named in
        the error when it does not)."""
        if mode is None or mode == "keep":
            return None
        if not checkpointed:
            raise ValueError(f"{where}={mode!r} applies to checkpointed blocks, and checkpoint={checkpoint!r} "
                             f"checkpoints none; pass checkpoint=True (or a policy)")
        if mode not in MODES:
            raise ValueError(f"{where}={mode!r}: choose one of {MODES} (or None)")
        partition = "partition" in mode and not sequence_parallel
        return cls(tp_group if partition else None, offload="offload" in mode)

    @property
    def active(self) -> bool:
        return self.parts > 1 or self.offload is not None

    # -------------------------------------------------------------------------------------------- the hooks
    def _pack(self, t: torch.Tensor):
        if not t.is_floating_point() or t.numel() == 0:
            return t                                      # not an activation (e.g. an index): as it is
        shape, n = t.shape, t.numel()
        piece, sliced = t.detach(), False
        if self.parts > 1:
            per = -(-n // self.parts)
            flat = piece.reshape(-1)
            lo, hi = min(self.part * per, n), min((self.part + 1) * per, n)
            piece = flat.new_zeros(per)                   # padded: every rank's piece has one size
            piece[:hi - lo].copy_(flat[lo:hi])
            sliced = True
        if self.offload is not None:
            piece = self.offload.to_host(piece)
        kept = _Kept(shape, n, piece, sliced)
        self._alive.add(kept)
        return kept

    def _unpack(self, kept):
        if not isinstance(kept, _Kept):
            return kept
        piece = self.offload.to_device(kept.piece) if kept.on_host else kept.piece
        if not kept.sliced:
            return piece
        full = C.all_gather_dim0(piece, self.partition_group)
        return full[:kept.numel].view(kept.shape)

    def hooks(self):
        """The context to run one ``torch.utils.checkpoint`` call in (a no-op context when inactive)."""
        if not self.active:
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # -------------------------------------------------------------------------------------------- accounting
    def kept_bytes(self) -> Dict[str, int]:
        """Bytes of the checkpoint inputs kept now (alive until their backward has run): on the device
        (``"device"``) and in host memory (``"host"``)."""
        out = {"device": 0, "host": 0}
        for k in list(self._alive):
            out["host" if k.on_host else "device"] += k.nbytes
        return out

    def __repr__(self):
        return f"SavedInputs(parts={self.parts}, offload={self.offload is not None})"


__all__ = ["SavedInputs", "MODES"]
