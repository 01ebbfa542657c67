"""``ParallelMesh``: the process groups of 3D parallelism, handed out explicitly (no globals).

Ranks are laid out as a (pp, dp, tp) grid with tp fastest, as Megatron-LM does: the ranks of one
tensor-parallel group are adjacent (same node, fastest links), data-parallel replicas next, pipeline
stages outermost. Built on ``torch.distributed.device_mesh.DeviceMesh`` after ``init_process_group``.
Two meshes in one process are fine: every layer takes the group it was given.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshCoordinate:
    pp: int
    dp: int
    tp: int


class ParallelMesh:
    """Process groups for ``dp`` x ``tp`` x ``pp`` ranks.

    ``dp_group``, ``tp_group``, ``pp_group``: this rank's groups. ``dp_rank``/``tp_rank``/``pp_rank``:
    its coordinates. ``device_type`` defaults to ``"cuda"`` when the default backend is NCCL, else
    ``"cpu"`` (gloo).
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, device_type: Optional[str] = None):
        for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"ParallelMesh: {name}={size!r} must be a positive integer")
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh: call torch.distributed.init_process_group first "
                               "(torchrun sets up the environment it needs)")
        world = dist.get_world_size()
        if dp * tp * pp != world:
            raise ValueError(f"ParallelMesh: dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, but the world "
                             f"size is {world}; choose sizes whose product is {world}")
        if device_type is None:
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        self.dp, self.tp, self.pp = dp, tp, pp
        self.device_type = device_type
        self.device_mesh = init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=DIMS)
        self.pp_group = self.device_mesh.get_group("pp")
        self.dp_group = self.device_mesh.get_group("dp")
        self.tp_group = self.device_mesh.get_group("tp")
        self.rank = dist.get_rank()
        # Row-major (pp, dp, tp) with tp fastest: rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
        self.tp_rank = self.rank % tp
        self.dp_rank = (self.rank // tp) % dp
        self.pp_rank = self.rank // (tp * dp)
        assert dist.get_rank(self.tp_group) == self.tp_rank, "DeviceMesh layout differs from (pp, dp, tp)"

    @property
    def coordinate(self) -> MeshCoordinate:
        return MeshCoordinate(pp=self.pp_rank, dp=self.dp_rank, tp=self.tp_rank)

    def __getitem__(self, dim: str):
        """The sub-``DeviceMesh`` of one dimension (for DTensor interop), e.g. ``mesh["tp"]``."""
        return self.device_mesh[dim]

    def __repr__(self) -> str:
        return (f"ParallelMesh(dp={self.dp}, tp={self.tp}, pp={self.pp}; rank {self.rank} at "
                f"pp={self.pp_rank}, dp={self.dp_rank}, tp={self.tp_rank})")


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


__all__ = ["ParallelMesh", "MeshCoordinate", "check_group"]
