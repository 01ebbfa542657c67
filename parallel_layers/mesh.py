"""``ParallelMesh``: the process groups of 4D parallelism, handed out explicitly (no globals).

Ranks are laid out as a (pp, dp, cp, tp) grid with tp fastest, as Megatron-core does: the ranks of one
tensor-parallel group are adjacent (same node, fastest links), the context-parallel ranks of a replica
next (they exchange keys and values every attention call), data-parallel replicas next, pipeline stages
outermost. Context parallelism sits inside data parallelism: the ``dp x cp`` ranks of a (pp, tp)
coordinate hold the same parameters and reduce their gradients together (``dp_cp_group``), each over its
own tokens. Exposed as a ``torch.distributed.device_mesh.DeviceMesh`` (``mesh.device_mesh``) after
``init_process_group``. Two meshes in one process are fine: every layer takes the group it was given.

Timeouts: every group of the mesh waits at most ``timeout`` for a peer (default: the world group's, the
``timeout=`` of ``init_process_group``). The groups are built here with ``dist.new_group(timeout=...)``
and handed to ``DeviceMesh.from_group``: ``init_device_mesh`` creates every group smaller than the world
with the backend's default instead (30 minutes for gloo), so one stopped rank would stall all the others
for half an hour whatever the world's timeout said.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "dp", "cp", "tp")


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


def _dim_ranks(pp: int, dp: int, cp: int, tp: int, dim: str) -> List[List[int]]:
    """Every group of mesh dimension ``dim`` (or ``"dp_cp"``: dp and cp together), as lists of global ranks
    (grid (pp, dp, cp, tp), tp fastest)."""
    grid = torch.arange(pp * dp * cp * tp).reshape(pp, dp, cp, tp)
    if dim == "dp_cp":
        grid = grid.movedim(3, 1).reshape(pp, tp, dp * cp)
    else:
        grid = grid.movedim(DIMS.index(dim), -1)
    return grid.reshape(-1, grid.shape[-1]).tolist()


def _new_dim_group(ranks_of_dim: List[List[int]], dim: str, timeout: datetime.timedelta):
    """This rank's group of one mesh dimension. A collective over the world: every rank creates every
    group of the dimension, in the same order (``dist.new_group``'s rule)."""
    world = dist.get_world_size()
    if len(ranks_of_dim) == 1 and group_timeout(dist.group.WORLD) == timeout:
        return dist.group.WORLD                      # the dimension is the world: its group serves
    mine = None
    for ranks in ranks_of_dim:
        group = dist.new_group(ranks, timeout=timeout, group_desc=f"ParallelMesh {dim} group {ranks}")
        if dist.get_rank() in ranks:
            mine = group
    assert mine is not None and sum(map(len, ranks_of_dim)) == world
    return mine


class ParallelMesh:
    """Process groups for ``dp`` x ``cp`` x ``tp`` x ``pp`` ranks.

    ``dp_group``, ``cp_group``, ``tp_group``, ``pp_group``: this rank's groups; ``dp_cp_group``: the ranks
    that hold the same parameters (dp and cp together: the gradient reduction's and ZeRO's group; the dp
    group itself when ``cp == 1``; ``cp_group`` is None then). ``dp_rank``/``cp_rank``/``tp_rank``/``pp_rank``:
    its coordinates. ``device_type`` defaults to ``"cuda"`` when the default backend is NCCL, else ``"cpu"``
    (gloo). ``timeout`` (a ``datetime.timedelta`` or seconds; default: the world group's): how
    long an operation on any of the mesh's groups waits for a peer before it raises, so a rank that stops
    answering (hung, stopped, dead) fails the others within it.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, *, device_type: Optional[str] = None,
                 timeout: Optional[Timeout] = None):
        for name, size in (("dp", dp), ("cp", cp), ("tp", tp), ("pp", pp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelMesh: {name}={size!r} must be a positive integer")
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh: call torch.distributed.init_process_group first "
                               "(torchrun sets up the environment it needs)")
        world = dist.get_world_size()
        if dp * cp * tp * pp != world:
            cp_text = f"cp={cp} x " if cp > 1 else ""
            raise ValueError(f"ParallelMesh: dp={dp} x {cp_text}tp={tp} x pp={pp} = {dp * cp * tp * pp} ranks, but "
                             f"the world size is {world}; choose sizes whose product is {world}")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.dp, self.cp, self.tp, self.pp = dp, cp, tp, pp
        self.device_type = device_type
        self.timeout = _as_timeout(timeout)
        # without cp the mesh keeps its three dimensions (and its groups: the cp group would be one rank)
        dims = DIMS if cp > 1 else tuple(d for d in DIMS if d != "cp")
        groups = {dim: _new_dim_group(_dim_ranks(pp, dp, cp, tp, dim), dim, self.timeout) for dim in dims}
        self.pp_group, self.dp_group, self.tp_group = groups["pp"], groups["dp"], groups["tp"]
        self.cp_group = groups.get("cp")
        self.dp_cp_group = (_new_dim_group(_dim_ranks(pp, dp, cp, tp, "dp_cp"), "dp_cp", self.timeout) if cp > 1
                            else self.dp_group)
        shape = tuple({"pp": pp, "dp": dp, "cp": cp, "tp": tp}[d] for d in dims)
        self.device_mesh = DeviceMesh.from_group([groups[d] for d in dims], device_type,
                                                 mesh=torch.arange(world).reshape(shape), mesh_dim_names=dims)
        self.rank = dist.get_rank()
        # Row-major (pp, dp, cp, tp) with tp fastest: rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
        self.tp_rank = self.rank % tp
        self.cp_rank = (self.rank // tp) % cp
        self.dp_rank = (self.rank // (tp * cp)) % dp
        self.pp_rank = self.rank // (tp * cp * dp)
        assert dist.get_rank(self.tp_group) == self.tp_rank, "mesh layout differs from (pp, dp, cp, tp)"

    def dim_groups(self) -> list:
        """This rank's group of every dimension (pp, dp, cp where cp > 1, tp): together they cover the mesh, so
        a value agreed over each in turn is agreed over all of it."""
        return [self.pp_group, self.dp_group] + ([self.cp_group] if self.cp > 1 else []) + [self.tp_group]

    def tied_stage_group(self):
        """The group of the first and last stage of this rank's pipeline (where a tied embedding's two copies
        live), or None on a middle stage or with ``pp=1``. Made on first use, a collective over the world
        (every rank calls it then, in the same order), and kept: each model built on the mesh reuses it
        (a new gloo group per model kept three more threads polling in every long-lived process)."""
        if not hasattr(self, "_tied_stage_group"):
            mine = None
            for ranks in _dim_ranks(self.pp, self.dp, self.cp, self.tp, "pp") if self.pp > 1 else []:
                group = dist.new_group([ranks[0], ranks[-1]], timeout=self.timeout,
                                       group_desc=f"tied embedding group [{ranks[0]}, {ranks[-1]}]")
                if self.rank in (ranks[0], ranks[-1]):
                    mine = group
            self._tied_stage_group = mine
        return self._tied_stage_group

    @property
    def replicas(self) -> int:
        """How many ranks hold the same parameters: ``dp x cp``."""
        return self.dp * self.cp

    def __getitem__(self, dim: str):
        """The sub-``DeviceMesh`` of one dimension (for DTensor interop), e.g. ``mesh["tp"]``."""
        return self.device_mesh[dim]

    def __repr__(self) -> str:
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        at = f", cp={self.cp_rank}" if self.cp > 1 else ""
        return (f"ParallelMesh(dp={self.dp}{cp}, tp={self.tp}, pp={self.pp}; rank {self.rank} at "
                f"pp={self.pp_rank}, dp={self.dp_rank}{at}, tp={self.tp_rank})")


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
