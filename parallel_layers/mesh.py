"""``ParallelMesh``: the process groups of the parallel dimensions, handed out explicitly (no globals).

The dimensions and their order are declared once, in :mod:`parallel_layers.dimensions`: a (pp, dp, cp, tp)
grid with tp fastest, as Megatron-core lays ranks out: the ranks of one tensor-parallel group are adjacent
(same node, fastest links), the context-parallel ranks of a replica next (they exchange keys and values
every attention call), data-parallel replicas next, pipeline stages outermost. The dimensions that replicate
parameters (dp and cp) form together the group of the ranks that hold the same parameters and reduce their
gradients together (``replica_group``), each over its own tokens. Exposed as a
``torch.distributed.device_mesh.DeviceMesh`` (``mesh.device_mesh``) after ``init_process_group``. Two meshes
in one process are fine: every layer takes the group it was given.

Timeouts: every group of the mesh waits at most ``timeout`` for a peer (default: the world group's, the
``timeout=`` of ``init_process_group``). The groups are built here with ``dist.new_group(timeout=...)``
and handed to ``DeviceMesh.from_group``: ``init_device_mesh`` creates every group smaller than the world
with the backend's default instead (30 minutes for gloo), so one stopped rank would stall all the others
for half an hour whatever the world's timeout said.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .dimensions import (
    check_sizes,
    coordinates,
    describe,
    dimension,
    grid_ranks,
    index_within,
    replicating,
    world_size,
)

Timeout = Union[datetime.timedelta, float, int]


def group_timeout(group) -> Optional[datetime.timedelta]:
    """How long an operation on ``group`` waits for its peers, or None where its backend does not say."""
    seconds = getattr(group, "timeout_s", None)       # a process group written in Python (the NCCL-rules backend)
    if seconds is not None:
        return datetime.timedelta(seconds=seconds)
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def _as_timeout(timeout: Optional[Timeout]) -> datetime.timedelta:
    """``timeout`` as a timedelta; None: the world group's."""
    if timeout is None:
        world = group_timeout(dist.group.WORLD)
        if world is None:
            raise ValueError(f"ParallelMesh: the world group's backend ({dist.get_backend()}) does not tell its "
                             f"timeout; pass ParallelMesh(..., timeout=datetime.timedelta(seconds=...))")
        return world
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"ParallelMesh: timeout={timeout!r} must be a positive datetime.timedelta or number of "
                         f"seconds (or None: the world group's timeout)")
    return timeout


def _new_dim_group(ranks_of_dim: List[List[int]], dim: str, timeout: datetime.timedelta):
    """This rank's group of one mesh dimension. A collective over the world: every rank creates every
    group of the dimension, in the same order (``dist.new_group``'s rule)."""
    world = dist.get_world_size()
    if len(ranks_of_dim) == 1 and group_timeout(dist.group.WORLD) == timeout:
        return dist.group.WORLD                      # the dimension is the world: its group serves
    mine = own_group(ranks_of_dim, dist.get_rank(), timeout, lambda ranks: f"ParallelMesh {dim} group {ranks}")
    assert mine is not None and sum(map(len, ranks_of_dim)) == world
    return mine


def own_group(groups: Sequence[List[int]], me: int, timeout: datetime.timedelta, describe):
    """This rank's group among ``groups`` (rank lists), or None if it is in none. A collective over the world:
    every rank creates every group, in the same order (``dist.new_group``'s rule), except in a world that
    :func:`plays_one_rank`, where only this rank's own are made. ``describe(ranks)``: the group's description."""
    mine, alone = None, plays_one_rank()
    for ranks in groups:
        if alone and me not in ranks:
            continue
        group = dist.new_group(ranks, timeout=timeout, group_desc=describe(ranks))
        if me in ranks:
            mine = group
    return mine


def plays_one_rank() -> bool:
    """Whether this process plays one rank of a world with no peers behind it (torch's ``fake`` backend, which the
    layout planner builds every rank of a 1,000-rank layout under): nothing to agree on, so only this rank's own
    groups are made (a 1,024-rank mesh makes ~680 groups otherwise, each a C++ process group)."""
    return "fake" in str(dist.get_backend())


class ParallelMesh:
    """Process groups for ``dp`` x ``ep`` x ``cp`` x ``tp`` x ``pp`` ranks (every dimension of
    :data:`~parallel_layers.dimensions.DIMENSIONS`: a declared one beyond these four is a keyword too).

    ``<dim>_group`` (``dp_group``, ``ep_group``, ``cp_group``, ``tp_group``, ``pp_group``): this rank's group of
    each dimension (None for a dimension not always grouped, like ep and cp, at size 1); ``replica_group``: the
    ranks that hold the same parameters (the replicating dimensions together, dp, ep and cp: the gradient
    reduction's and ZeRO's group; the dp group itself when the others are 1), ``replicas`` its size and
    ``replica_rank`` this rank's index in it; ``expert_replica_group``, ``expert_replicas`` and
    ``expert_replica_rank``: the same for an expert's parameters (dp and cp: ep ranks hold different experts).
    ``<dim>_rank``: its coordinates; ``sizes``: every dimension's size, in grid order;
    ``batch_shards``/``batch_rank``: how many slices the batch's rows are cut into (over the dimensions that
    split the batch: dp and ep) and which is this rank's. ``device_type`` defaults to ``"cuda"`` when the default
    backend is NCCL, else ``"cpu"`` (gloo). ``timeout`` (a ``datetime.timedelta`` or seconds; default: the world
    group's): how long an operation on any of the mesh's groups waits for a peer before it raises, so a rank that
    stops answering (hung, stopped, dead) fails the others within it.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *,
                 device_type: Optional[str] = None, timeout: Optional[Timeout] = None, **more: int):
        sizes = check_sizes({"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, **more}, "ParallelMesh")
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh: call torch.distributed.init_process_group first "
                               "(torchrun sets up the environment it needs)")
        world = dist.get_world_size()
        if world_size(sizes) != world:
            raise ValueError(f"ParallelMesh: {describe(sizes)} = {world_size(sizes)} ranks, but the world size is "
                             f"{world}; choose sizes whose product is {world}")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.sizes = sizes
        for name, size in sizes.items():
            setattr(self, name, size)
        self.device_type = device_type
        self.timeout = _as_timeout(timeout)
        # a dimension not always grouped (cp) at size 1 gets no group (it would be one rank)
        dims = tuple(n for n in sizes if dimension(n).always_grouped or sizes[n] > 1)
        groups = {dim: _new_dim_group(grid_ranks(sizes, [dim]), dim, self.timeout) for dim in dims}
        self._groups = groups
        for name in sizes:
            setattr(self, f"{name}_group", groups.get(name))
        first, *others = replicating()
        self.replica_group = (groups[first] if all(sizes[n] == 1 for n in others) else
                              _new_dim_group(grid_ranks(sizes, replicating()), "+".join(replicating()), self.timeout))
        shape = tuple(sizes[d] for d in dims)
        self.device_mesh = DeviceMesh.from_group([groups[d] for d in dims], device_type,
                                                 mesh=torch.arange(world).reshape(shape), mesh_dim_names=dims)
        self.rank = dist.get_rank()
        self.coordinates = coordinates(self.rank, sizes)
        for name, index in self.coordinates.items():
            setattr(self, f"{name}_rank", index)
        assert dist.get_rank(self.tp_group) == self.tp_rank, "mesh layout differs from the declared grid"
        # the batch's rows are split over the dimensions that split it (dp, ep), in grid order
        split = [n for n in sizes if dimension(n).batch == "split"]
        self.batch_dims = tuple(split)
        self.batch_shards = world_size({n: sizes[n] for n in split})
        self.batch_rank = index_within(self.coordinates, sizes, split)
        # this rank's index among the ranks that hold its parameters
        self.replica_rank = index_within(self.coordinates, sizes, replicating())
        # an expert's replicas: the replicas above but ep (ep ranks hold different experts); the same group
        # when ep is 1
        self.expert_replicas = world_size({n: sizes[n] for n in replicating(experts=True)})
        self.expert_replica_rank = index_within(self.coordinates, sizes, replicating(experts=True))
        self.expert_replica_group = (self.replica_group if sizes.get("ep", 1) == 1 else
                                     _new_dim_group(grid_ranks(sizes, replicating(experts=True)),
                                                    "+".join(replicating(experts=True)), self.timeout))

    def group(self, dim: str):
        """This rank's group of dimension ``dim`` (None where the mesh made none: a size-1 cp)."""
        if dim not in self.sizes:
            raise ValueError(f"ParallelMesh: no dimension {dim!r}; the dimensions are {', '.join(self.sizes)}")
        return self._groups.get(dim)

    def dim_groups(self) -> list:
        """This rank's group of every dimension the mesh made (in grid order): together they cover the mesh, so
        a value agreed over each in turn is agreed over all of it."""
        return list(self._groups.values())

    def tied_stage_group(self):
        """The group of the first and last stage of this rank's pipeline (where a tied embedding's two copies
        live), or None on a middle stage or with ``pp=1``. Made on first use, a collective over the world
        (every rank calls it then, in the same order), and kept: each model built on the mesh reuses it
        (a new gloo group per model kept three more threads polling in every long-lived process)."""
        if not hasattr(self, "_tied_stage_group"):
            ends = [[ranks[0], ranks[-1]] for ranks in grid_ranks(self.sizes, ["pp"])] if self.pp > 1 else []
            self._tied_stage_group = own_group(ends, self.rank, self.timeout,
                                               lambda ranks: f"tied embedding group {ranks}")
        return self._tied_stage_group

    def group_over(self, dims: Sequence[str]):
        """The group of the ranks that differ only along ``dims`` together (e.g. the replicas and tp: the ranks
        sharing one micro-batch when sequence parallelism splits its tokens over tp), None where that is one
        rank. Made on first use, a collective over the world (every rank calls it then, in the same order), and
        kept, as :meth:`tied_stage_group` is."""
        for dim in dims:
            self.group(dim)                                  # a known dimension, else the error naming them
        dims = tuple(d for d in self.sizes if d in dims and self.sizes[d] > 1)
        if len(dims) <= 1:
            return self._groups.get(dims[0]) if dims else None
        if dims == tuple(d for d in replicating() if self.sizes[d] > 1):
            return self.replica_group
        made = self.__dict__.setdefault("_groups_over", {})
        if dims not in made:
            made[dims] = _new_dim_group(grid_ranks(self.sizes, list(dims)), "+".join(dims), self.timeout)
        return made[dims]

    def new_group_over(self, dims: Sequence[str], purpose: str):
        """A new group of the ranks that differ only along ``dims``, not one the mesh holds: messages on it never
        queue behind the mesh's own (NCCL runs a group's operations in issue order). A collective over the
        world (every rank calls it, in the same order); the caller keeps it."""
        for dim in dims:
            self.group(dim)
        return own_group(grid_ranks(self.sizes, list(dims)), self.rank, self.timeout,
                         lambda ranks: f"{purpose} {ranks}")

    @property
    def replicas(self) -> int:
        """How many ranks hold the same parameters: the product of the replicating dimensions (``dp x cp``)."""
        return world_size({n: self.sizes[n] for n in replicating()})

    def __getitem__(self, dim: str):
        """The sub-``DeviceMesh`` of one dimension (for DTensor interop), e.g. ``mesh["tp"]``."""
        return self.device_mesh[dim]

    def __repr__(self) -> str:
        at = ", ".join(f"{n}={self.coordinates[n]}" for n in self._groups)
        return f"ParallelMesh({describe(self.sizes, ', ')}; rank {self.rank} at {at})"


def check_group(layer: str, group, mesh: Optional[ParallelMesh] = None, dim: str = "tp") -> int:
    """Validate a process group handed to a layer; returns its size. Names the layer on error."""
    if group is None:
        raise ValueError(f"{layer}: tp_group is required (pass mesh.tp_group); there is no implicit global group")
    if not dist.is_initialized():
        raise RuntimeError(f"{layer}: torch.distributed is not initialised")
    if mesh is not None:
        expected = getattr(mesh, f"{dim}_group")
        if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(expected):
            raise ValueError(f"{layer}: the {dim} group given has ranks {dist.get_process_group_ranks(group)} but "
                             f"the mesh's {dim} group on this rank has {dist.get_process_group_ranks(expected)}")
    return dist.get_world_size(group)


__all__ = ["ParallelMesh", "check_group", "group_timeout"]
