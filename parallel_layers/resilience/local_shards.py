"""This rank's own pieces of a universal checkpoint, copied to host memory with no collective, and the
dense tensors assembled from every rank's pieces later, on the checkpoint writer's own groups.

The synchronous universal save (:func:`~parallel_layers.composition.universal_checkpoint.dense_states`)
gathers the ZeRO shards over dp and the TP partitions over tp while training waits. An asynchronous save
splits that in two:

* :func:`snapshot_local` (the training thread): clones of this rank's ZeRO shards (fp32 ``master``,
  ``exp_avg``, ``exp_avg_sq`` in the optimizer's flat layout; without ZeRO, the dp-0 rank's whole
  per-parameter state), plus what assembling them needs: which element ranges of which parameter the
  flat shards hold (the optimizer's ``shard_pieces()``), each parameter's TP partition (dimension, the
  TP group's ranks, dense size) and the dense model's name and layout change;
* :func:`assemble` (the writer thread): the shards summed over the ZeRO group (each element is held by
  exactly one rank, every other adds zero: exact, the sync save's arithmetic) onto the ranks that write,
  then the TP partitions gathered and put in the dense layout, exactly as the sync save does; every
  collective runs on the writer's mirrors of the model's groups (:mod:`.writer_groups`).

A local step that fails on one rank (placing the pieces, the dense layout change) is agreed over the
writer's world group before the next collective, so every rank raises together instead of waiting.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..composition.universal_checkpoint import STATES
from ..tensor_parallel.parallelize import gather_partition, tp_partitions
from .writer_groups import Ranks, WriterGroups, ranks_of

# an agreement over the writer's world group: runs ``fn`` here, raises on every rank if it failed on any
Agree = Callable[[Callable[[], object], str], object]


@dataclasses.dataclass
class LocalParam:
    """One parameter of this rank's stages: ``slot`` (its position in the flat layout ``assemble`` builds;
    a parameter shared by two chunks has one), its dense name, ``partition`` ``(dim, TP ranks, dense
    size)`` or None (replicated over tp), ``to_dense`` (gathered tensor -> the dense model's layout) and
    ``saved`` (False: the tied duplicate the first stage saves)."""
    slot: int
    name: str
    partition: Optional[Tuple[int, Ranks, int]]
    to_dense: Callable[[torch.Tensor], torch.Tensor]
    saved: bool


@dataclasses.dataclass
class LocalShards:
    """This rank's state in host memory (see the module docstring). ``shapes``: each slot's TP-local shape.
    ``replicas``: the ZeRO group's ranks (ZeRO only); ``holder``: this rank ends up with the dense-over-dp
    state (dp 0, cp 0: the sum lands on it; its TP peers are holders too). ``flats``: this rank's flat
    ``(master, exp_avg, exp_avg_sq)`` shards and ``pieces`` ``(slot, start in the parameter, start in the
    flats, length)`` (ZeRO); ``whole``: every slot's states (no ZeRO, holders only)."""
    params: List[LocalParam]
    shapes: List[Tuple[int, ...]]
    step: int
    holder: bool
    replicas: Ranks = ()
    flats: Optional[Tuple[torch.Tensor, ...]] = None
    pieces: List[Tuple[int, int, int, int]] = dataclasses.field(default_factory=list)
    whole: Optional[List[Dict[str, torch.Tensor]]] = None

    @property
    def nbytes(self) -> int:
        tensors = list(self.flats or ()) + [t for st in self.whole or () for t in st.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float32, copy=True)


def groups_to_mirror(model) -> List[Ranks]:
    """The rank tuples of the model groups :func:`assemble` communicates over on this rank (for
    :class:`~.writer_groups.WriterGroups`)."""
    needed = [ranks_of(model.replica_group)] if model.zero else []
    for chunk in model.chunks:
        needed += [ranks_of(group) for _, group, _ in tp_partitions(chunk).values()]
    return needed


def _describe(model) -> Tuple[List[LocalParam], List[Tuple[int, ...]], Dict[int, int]]:
    params, shapes, slot_of = [], [], {}
    for chunk in model.chunks:
        parts = tp_partitions(chunk)
        for name, p in chunk.named_parameters():
            if id(p) not in slot_of:
                slot_of[id(p)] = len(shapes)
                shapes.append(tuple(p.shape))
            part = parts.get(name)
            params.append(LocalParam(slot_of[id(p)], chunk.dense_name(name),
                                     None if part is None else (part[0], ranks_of(part[1]), part[2]),
                                     functools.partial(chunk.dense_tensor, name), id(p) not in model.duplicate_ids))
    return params, shapes, slot_of


@torch.no_grad()
def snapshot_local(model) -> LocalShards:
    """This rank's pieces of ``model``'s (a ``Parallel3D``) universal checkpoint, copied to host memory;
    no collective of its own (a ZeRO optimizer with a delayed offloaded step applies it first, the
    collective its next step would run anyway). Training may change the model once it returns."""
    m = model.mesh
    holder = m.replica_rank == 0
    params, shapes, slot_of = _describe(model)
    opt = model.optimizer
    if not model.zero:                               # torch AdamW: every dp rank holds the whole state
        out = LocalShards(params, shapes, 0, holder)
        if holder:
            out.whole = [None] * len(shapes)
            for p in (p for chunk in model.chunks for p in chunk.parameters()):
                st = opt.state.get(p, {})
                out.whole[slot_of[id(p)]] = {"param": _host_copy(p), **{
                    k: _host_copy(st[k]) if k in st else torch.zeros(p.shape) for k in STATES[1:]}}
                if "step" in st:
                    out.step = int(st["step"])
        return out
    opt.wait_for_step()
    pieces = opt.shard_pieces()                      # before the flats: it may re-lay them out
    unknown = [tuple(p.shape) for p, *_ in pieces if id(p) not in slot_of]
    if unknown:
        raise ValueError(f"snapshot_local: the optimizer holds {len(unknown)} parameter piece(s) of no stage of "
                         f"this rank (shapes {unknown[:3]})")
    replicas = ranks_of(model.replica_group)
    if holder != (dist.get_rank() == min(replicas)):
        raise ValueError(f"snapshot_local: rank {dist.get_rank()} (dp {m.dp_rank}) and its ZeRO group {replicas} "
                         f"disagree on which rank is dp 0; the mesh's layout is not (pp, dp, cp, tp)")
    return LocalShards(params, shapes, opt.steps_taken, holder, replicas,
                       tuple(_host_copy(t) for t in (opt.master, opt.exp_avg, opt.exp_avg_sq)),
                       [(slot_of[id(p)], start_p, start_s, n) for p, start_p, start_s, n in pieces])


# ---------------------------------------------------------------------- the writer's side
# elements summed over the ZeRO group per collective: the writer's buffer is [this, 3] fp32 (48 MiB), not the
# whole stage on every dp rank
CHUNK_ELEMENTS = 1 << 22


def _chunks(shapes: Sequence[Tuple[int, ...]], cap: int) -> List[Tuple[int, int]]:
    """Runs of slots ``[a, b)`` of at most ``cap`` elements (a larger parameter alone), in slot order."""
    out, start, size = [], 0, 0
    for i, shape in enumerate(shapes):
        n = torch.Size(shape).numel()
        if size and size + n > cap:
            out.append((start, i))
            start, size = i, 0
        size += n
    if start < len(shapes):
        out.append((start, len(shapes)))
    return out


def _place_pieces(local: LocalShards, first: int, last: int) -> torch.Tensor:
    """``[elements of slots first..last-1, 3]``: this rank's pieces of those slots where the flat layout
    puts them, zeros elsewhere."""
    bases, total = {}, 0
    for slot in range(first, last):
        bases[slot] = total
        total += torch.Size(local.shapes[slot]).numel()
    flat = torch.zeros(total, len(STATES), dtype=torch.float32)
    for slot, start_p, start_s, n in local.pieces:
        if first <= slot < last:
            b = bases[slot] + start_p
            for col, src in enumerate(local.flats):
                flat[b:b + n, col] = src[start_s:start_s + n]
    return flat


def _check_pieces(local: LocalShards) -> None:
    """Every piece inside its parameter and inside the flat shards (so that placing them cannot fail
    between the collectives)."""
    held = min(t.numel() for t in local.flats)
    for slot, start_p, start_s, n in local.pieces:
        numel = torch.Size(local.shapes[slot]).numel()
        if not (n >= 0 and 0 <= start_p and start_p + n <= numel and 0 <= start_s and start_s + n <= held):
            raise ValueError(f"a ZeRO shard piece (elements {start_p}..{start_p + n} of a parameter of shape "
                             f"{local.shapes[slot]}, flat {start_s}..{start_s + n} of {held}) lies outside its "
                             f"parameter or the shard")


def _states_over_dp(local: LocalShards, groups: WriterGroups, agree: Agree) -> List[Dict[str, torch.Tensor]]:
    """Every slot's states complete over dp on a holder (ZeRO: summed onto it, a run of slots at a time;
    [] on the other ranks)."""
    if local.flats is None:
        return local.whole if local.holder else []
    agree(functools.partial(_check_pieces, local), "checking this rank's ZeRO shards")
    group = groups.mirror(local.replicas)
    out = []
    # the number of runs differs between pipeline stages: no collective on the world group in this loop
    for first, last in _chunks(local.shapes, CHUNK_ELEMENTS):
        flat = _place_pieces(local, first, last)
        if group is not None:
            dist.reduce(flat, dst=min(local.replicas), group=group)
        if local.holder:
            pos = 0
            for shape in local.shapes[first:last]:
                n = torch.Size(shape).numel()
                out.append({k: flat[pos:pos + n, col].reshape(shape).clone() for col, k in enumerate(STATES)})
                pos += n
    return out


def assemble(local: LocalShards, groups: WriterGroups, agree: Agree) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{dense name: {"param", "exp_avg", "exp_avg_sq"}}`` (dense fp32, on the CPU) of this rank's stages on
    the holders (the TP ranks of dp 0, cp 0), ``{}`` elsewhere: what ``dense_states`` gives the sync save's
    writers. A collective over the mirrors of the ZeRO group and the TP groups (every rank calls it)."""
    slots = _states_over_dp(local, groups, agree)
    gathered = []
    for param in local.params if local.holder else ():
        if not param.saved:
            continue
        states = slots[param.slot]
        if param.partition is not None:
            dim, ranks, size = param.partition
            group = groups.mirror(ranks)
            states = {k: (t.narrow(dim, 0, size) if group is None else gather_partition(t, dim, group, size))
                      for k, t in states.items()}
        gathered.append((param, states))
    return agree(lambda: {p.name: {k: p.to_dense(t).clone() for k, t in st.items()} for p, st in gathered},
                 "putting the tensors in the dense model's layout")


__all__ = ["LocalShards", "LocalParam", "snapshot_local", "assemble", "groups_to_mirror"]
