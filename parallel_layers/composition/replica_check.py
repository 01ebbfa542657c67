"""The replica invariant, checked: what several ranks hold as copies of one thing is bit-identical.

A parameter replicated over a group (tp always, the dp x cp replicas where ZeRO does not shard it, the
first and last stage's copies of a tied embedding) must hold the same bits on every rank of that group
after every step; so must the global batch every rank is handed. A loss that agrees can hide replicas
that drifted apart (a per-head q/k norm whose tp-partial gradient nobody summed trains each rank's copy
differently), and a per-rank data loader silently trains on a batch no single process ever saw. Both
are checked here, cheaply, and a mismatch raises naming the tensor, the group, the ranks and the step.

How: each tensor's raw bits are read as int32 words and folded into two int64 checksums (their sum, and
the sum of each word times its position, so a permutation shows too), with wrap-around arithmetic that
is exact in any summation order (so a GPU's reduction order cannot make equal tensors differ), and
additive over pieces (ZeRO-3's shards of a tied weight sum to the weight's checksum). One
all-reduce per group compares them (``MIN`` of ``[c, -c]`` gives both the minimum and the maximum);
only when they differ is the group's checksum table gathered to name the ranks. Every rank of the mesh
then learns that some check failed (a ``MAX`` over each mesh dimension in turn), so all raise together
instead of leaving the others waiting in the next collective.

:class:`ReplicaCheck` says when: by default the first 3 steps of every run, then every 100th; ``every=1``
checks every step (the test suite's setting, ``PARALLEL_LAYERS_REPLICA_CHECK=every``), ``None`` turns it
off. Its cost is measured in benchmarks/README.md ("Replica check").
"""
from __future__ import annotations

import dataclasses
import os
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives as C

ENV = "PARALLEL_LAYERS_REPLICA_CHECK"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# words folded at once: on a CPU a chunk that stays in cache (1 MiB; 16M words ran 11x slower, each pass
# faulting in fresh pages), on a GPU a large one (few launches); it bounds the temporaries either way
_CHUNK = 1 << 24
_CHUNK_CPU = 1 << 18
_ABSENT = torch.iinfo(torch.int64).max     # a row a rank does not hold: neutral in the MIN all-reduce


class ReplicaDivergence(RuntimeError):
    """Copies that must be bit-identical differ between ranks (names the tensors, group, ranks, step)."""


@dataclasses.dataclass(frozen=True)
class ReplicaCheck:
    """When :class:`~parallel_layers.composition.parallel3d.Parallel3D` checks its replicas: at steps
    ``1 .. first`` and then at every ``every``-th step (None: only the first ones). Pass
    ``replica_check=None`` to ``Parallel3D`` to turn the check off."""
    first: int = 3
    every: Optional[int] = 100
    batch: bool = True          # also check that every rank was handed the same global batch

    def __post_init__(self):
        if self.first < 0 or (self.every is not None and self.every < 1):
            raise ValueError(f"ReplicaCheck: first={self.first} must be >= 0 and every={self.every} >= 1 or None")

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1 for the first step of the run) is checked."""
        return step <= self.first or (self.every is not None and step % self.every == 0)

    @classmethod
    def default(cls) -> "ReplicaCheck":
        """The default, or what ``PARALLEL_LAYERS_REPLICA_CHECK`` says: ``every`` (each step), ``off``, or
        ``first,every`` (``3,100``)."""
        value = os.environ.get(ENV, "").strip().lower()
        if not value:
            return cls()
        if value == "every":
            return cls(first=0, every=1)
        if value == "off":
            return cls(first=0, every=None, batch=False)
        try:
            first, every = (int(v) for v in value.split(","))
        except ValueError:
            raise ValueError(f"{ENV}={value!r}: use 'every', 'off' or 'first,every' (e.g. '3,100')") from None
        return cls(first=first, every=every)


def _words(t: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``t``'s bits as int32 words (a 4- or 8-byte element is 1 or 2 words; a 1- or 2-byte one is widened
    to one word) and the words per element."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    size = flat.element_size()
    if size >= 4:
        return flat.view(torch.int32), size // 4
    return flat.view(_INT_OF_SIZE[size]).to(torch.int32), 1


def _fold_words(w: torch.Tensor, first_position: int, base: torch.Tensor, work: torch.Tensor) -> torch.Tensor:
    """``[sum(w), sum(w * p)]`` (int64) with ``p`` the words' positions plus one, modulo 2^32:
    ``first_position`` plus 0, 1, ...; the products wrap in int32, exactly and in any order. ``base``:
    ``arange`` of at least ``w``'s length, ``work``: int32 scratch as long (no allocation per chunk: each
    would fault in fresh pages)."""
    n = w.numel()
    pos = torch.add(base[:n], first_position, out=work[:n])
    prod = torch.mul(w, pos, out=pos)
    return torch.stack([w.sum(dtype=torch.int64), prod.sum(dtype=torch.int64)])


def _wrapped(n: int) -> int:
    """``n`` modulo 2^32 as a signed int32 value."""
    n &= 0xFFFFFFFF
    return n - (1 << 32) if n >= 1 << 31 else n


def checksum(t: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """Two int64 checksums of ``t``'s bits (see the module docstring), on ``t``'s device: over its int32 words
    ``w_i``, ``sum(w_i)`` and ``sum(w_i * (i + 1 + words of the offset))`` (products modulo 2^32). Both are
    sums over positions in the whole tensor, so a tensor's checksum is the sum of its pieces' (each with its
    ``offset``, in elements): ZeRO-3's shards of one parameter add up to the parameter's."""
    words, per = _words(t)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    chunk = min(_CHUNK_CPU if t.device.type == "cpu" else _CHUNK, max(1, words.numel()))
    base = torch.arange(chunk, dtype=torch.int32, device=t.device)
    work = torch.empty(chunk, dtype=torch.int32, device=t.device)
    for start in range(0, words.numel(), chunk):
        out += _fold_words(words[start:start + chunk], _wrapped(offset * per + start + 1), base, work)
    return out


def checksums(tensors: Sequence[torch.Tensor], offsets: Optional[Sequence[int]] = None) -> torch.Tensor:
    """:func:`checksum` of each of ``tensors`` (with its offset), ``[len(tensors), 2]``. Small tensors are
    folded together, a few operations for any number of them (a model's norms and biases are hundreds of
    tiny tensors: one pass each would cost more in dispatch than in bytes)."""
    if not tensors:
        return torch.zeros(0, 2, dtype=torch.int64)
    offsets = list(offsets) if offsets is not None else [0] * len(tensors)
    device = tensors[0].device
    out = torch.zeros(len(tensors), 2, dtype=torch.int64, device=device)
    small = []
    for i, t in enumerate(tensors):
        if t.numel() > _CHUNK // 8 or t.device != device:
            out[i] = checksum(t, offsets[i]).to(device)
        elif t.numel():
            small.append(i)
    start = 0
    while start < len(small):
        take, total = [], 0
        while start < len(small) and (not take or total + tensors[small[start]].numel() <= _CHUNK // 2):
            take.append(small[start])
            total += tensors[small[start]].numel()
            start += 1
        _fold(tensors, offsets, take, out)
    return out


def _fold(tensors, offsets, take: List[int], out: torch.Tensor) -> None:
    parts = [_words(tensors[i]) for i in take]
    sizes = torch.tensor([w.numel() for w, _ in parts], dtype=torch.int64, device=out.device)
    w = torch.cat([w.to(out.device) for w, _ in parts])
    rows = torch.tensor(take, dtype=torch.int64, device=out.device)
    seg = torch.repeat_interleave(rows, sizes)
    # each word's position in its tensor plus one (mod 2^32): the running index, shifted per tensor
    firsts = torch.cumsum(sizes, 0) - sizes
    shift = torch.tensor([_wrapped(offsets[i] * per + 1 - int(f)) for i, (_, per), f in zip(take, parts, firsts)],
                         dtype=torch.int32, device=out.device)
    pos = torch.arange(w.numel(), dtype=torch.int32, device=out.device).add_(torch.repeat_interleave(shift, sizes))
    out[:, 0].index_add_(0, seg, w.to(torch.int64))
    out[:, 1].index_add_(0, seg, (w * pos).to(torch.int64))


def sharded_checksum(pieces: Sequence[Tuple[torch.Tensor, int]], group, device: torch.device) -> torch.Tensor:
    """The :func:`checksum` of a tensor whose pieces ``(piece, offset in the tensor)`` lie on the ranks of
    ``group`` (ZeRO-3's shards): this rank's pieces' sums, summed over ``group`` (a collective)."""
    sums = checksums([t for t, _ in pieces], [o for _, o in pieces]).to(device).sum(0) if pieces else \
        torch.zeros(2, dtype=torch.int64, device=device)
    C.all_reduce(sums, group)
    return sums


def _ranks(group) -> List[int]:
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a group c10d does not know: its group ranks still tell
        return list(range(C.world_size(group)))


class _Pending:
    """The checks of one call: (what, group, names, checksum table) per group, compared together."""

    def __init__(self):
        self.failures: List[str] = []

    def compare(self, what: str, group, names: Sequence[str], sums: torch.Tensor, step: int,
                present: Optional[torch.Tensor] = None) -> None:
        """Compare ``sums`` ``[len(names), 2]`` over ``group``; a mismatch is recorded, naming the ranks.
        ``present`` (a bool per row): rows this rank does not hold are compared among the ranks that do."""
        if group is None or C.world_size(group) == 1 or not names:
            return
        both = torch.cat([sums, -sums], dim=1)
        if present is not None:
            both[~present] = _ABSENT                                  # neutral in the minimum
        C.all_reduce(both, group, op=dist.ReduceOp.MIN)
        nobody = (both == _ABSENT).all(dim=1)
        differ = (both[:, :2] != -both[:, 2:]).any(dim=1) & ~nobody
        if not bool(differ.any()):
            return
        mine = sums.clone()
        if present is not None:
            mine[~present] = _ABSENT
        table = C.all_gather_dim0(mine.unsqueeze(0), group)          # [ranks, names, 2]; the whole group is here
        ranks = _ranks(group)
        lines = []
        for i in torch.nonzero(differ).flatten().tolist():
            kinds: Dict[Tuple[int, int], List[int]] = {}
            for r, row in enumerate(table[:, i].tolist()):
                kinds.setdefault(tuple(row), []).append(ranks[r])
            split = " / ".join(("not passed on " if k[0] == _ABSENT else "") + f"ranks {v}"
                               for k, v in sorted(kinds.items(), key=lambda kv: kv[1]))
            lines.append(f"{names[i]} (copies differ: {split})")
        shown = "; ".join(lines[:8]) + (f"; and {len(lines) - 8} more" if len(lines) > 8 else "")
        self.failures.append(f"{what} over the group of ranks {ranks} at step {step}: {shown}")


def _agree_failed(failed: bool, mesh_groups: Sequence, device: torch.device) -> bool:
    """Whether any rank of the mesh failed a check (a MAX over each mesh dimension in turn)."""
    flag = torch.tensor([1 if failed else 0], dtype=torch.int64, device=device)
    for g in mesh_groups:
        if g is not None and C.world_size(g) > 1:
            C.all_reduce(flag, g, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _raise(pending: _Pending, mesh_groups: Sequence, device: torch.device, fix: str) -> None:
    if not _agree_failed(bool(pending.failures), mesh_groups, device):
        return
    if pending.failures:
        raise ReplicaDivergence("Parallel3D replica check: " + " | ".join(pending.failures) + f". {fix}")
    raise ReplicaDivergence(f"Parallel3D replica check: another rank of the mesh found copies that differ "
                            f"(its error names them); this rank stops with it. {fix}")


PARAMETER_FIX = ("A replicated parameter trained differently on these ranks: its gradient was not the same "
                 "on every copy (a tp-partial gradient left unsummed, a module the tensor-parallel plan did "
                 "not place) or the ranks started from different weights. Give the model's recipe a tp_plan "
                 "that places it (docs/custom_recipe.md), or report the model")
BATCH_FIX = ("Every rank must be handed the same GLOBAL batch (each takes its own slice): a per-rank data "
             "loader breaks that. Build the batch from the same seed/sampler on every rank, or gather the "
             "ranks' batches into one before train_step")


@dataclasses.dataclass
class Summed:
    """A checksum already computed (``[2]`` int64), e.g. :func:`sharded_checksum`'s, in place of a tensor."""
    sums: torch.Tensor


def check_tensors(groups: Sequence[Tuple[str, object, Sequence[Tuple[str, object]]]], mesh_groups: Sequence,
                  step: int, device: torch.device, fix: str = PARAMETER_FIX) -> None:
    """Raise :class:`ReplicaDivergence` on every rank when, for any ``(what, group, [(name, tensor or
    Summed)])``, a tensor differs between the ranks of ``group``. A collective over every group of
    ``mesh_groups``."""
    pending = _Pending()
    unique: Dict[int, int] = {}             # a tensor checked over several groups is read once
    tensors: List[torch.Tensor] = []
    for _, _, named in groups:
        for _, t in named:
            if not isinstance(t, Summed) and id(t) not in unique:
                unique[id(t)] = len(tensors)
                tensors.append(t)
    sums = checksums(tensors).to(device)
    for what, group, named in groups:
        if named:
            table = torch.stack([t.sums.to(device) if isinstance(t, Summed) else sums[unique[id(t)]]
                                 for _, t in named])
            pending.compare(what, group, [n for n, _ in named], table, step)
    _raise(pending, mesh_groups, device, fix)


def check_same_batch(inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor], side: Dict[str, object],
                     mesh_groups: Sequence, step: int, device: torch.device) -> None:
    """Raise on every rank when the ranks of the mesh were handed different global batches: the inputs, the
    targets and the side inputs (their names, shapes and bits), each compared among the ranks that pass it
    (a pipeline rank that reads no token ids may pass None), over each mesh dimension's group, which
    together cover the mesh."""
    def shaped(t):
        return checksum(t).to(device) + checksum(torch.tensor(list(t.shape) + [t.dim()], dtype=torch.int64)).to(device)

    rows = torch.zeros(3, 2, dtype=torch.int64, device=device)
    present = torch.zeros(3, dtype=torch.bool, device=device)
    for i, t in enumerate((inputs, targets)):
        if torch.is_tensor(t):
            rows[i], present[i] = shaped(t), True
    for name in sorted(k for k, v in side.items() if torch.is_tensor(v)):
        rows[2] += shaped(side[name]) * (zlib.crc32(name.encode()) | 1)
        present[2] = True
    pending = _Pending()
    for g in mesh_groups:
        if g is not None:
            pending.compare("the global batch", g, ["inputs", "targets", "side inputs"], rows, step, present)
    _raise(pending, mesh_groups, device, BATCH_FIX)


__all__ = ["ReplicaCheck", "ReplicaDivergence", "Summed", "checksum", "checksums", "sharded_checksum",
           "check_tensors", "check_same_batch", "ENV"]
