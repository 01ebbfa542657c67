"""The parallel dimensions, each declared once: :data:`DIMENSIONS`.

A :class:`Dimension` says what a run needs to know about one axis of the rank grid: its name (the keyword
of ``ParallelMesh`` and the demo's flag), what happens to a parameter along it (``params``) and to the batch
(``batch``). Everything that lists or sizes the dimensions reads the declaration instead of naming them:
the mesh (its groups, coordinates and the group of the ranks that hold the same parameters), ``Parallel3D``
(which group reduces the gradients, how many replicas average the loss), checkpoints (the layout they
record), the planner's ``Layout`` (its sizes and name), the demo's flags and the test workers' meshes.

The order of :data:`DIMENSIONS` is the rank grid's, outermost first (Megatron-core's): pipeline stages
outermost, tensor-parallel ranks adjacent (same node, fastest links), context-parallel ranks next to them
(they exchange keys and values every attention call), expert-parallel ranks between data and context
parallel ones (an all-to-all per MoE layer). ``rank = (((pp_rank * dp + dp_rank) * ep + ep_rank) * cp + cp_rank)
* tp + tp_rank``.

Adding a dimension is one :class:`Dimension` here (where it sits in the grid, what it does to parameters
and the batch) plus its own folder with the layers that use its group (docs/architecture.md, "Adding a
dimension").
"""
from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Dict, List, Mapping, Sequence, Tuple

import torch

PARAMS = ("replicated", "sharded", "staged", "experts")
READING_ORDER = ("dp", "ep", "cp", "tp", "pp")
BATCH = ("split", "sequence", "whole")


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One axis of the rank grid.

    ``params``: ``"replicated"`` (the ranks along it hold the same parameters and reduce their gradients
    together: dp, cp), ``"sharded"`` (each holds a slice of a parameter: tp), ``"staged"`` (each holds other
    layers: pp) or ``"experts"`` (replicated for the dense parameters, while each rank holds its own experts of
    every Mixture-of-Experts layer: ep). ``batch``: ``"split"`` (each rank its own sequences: dp, ep),
    ``"sequence"`` (each rank its share of every sequence's tokens: cp) or ``"whole"`` (the ranks see the same
    tokens: tp, pp). ``always_grouped``: the
    mesh makes its group even at size 1 (the layers that take it expect one); otherwise only when it is used.
    ``title`` and ``help`` name it in errors and in the demo's ``--<name>`` flag."""
    name: str
    title: str
    params: str
    batch: str
    help: str
    always_grouped: bool = True

    def __post_init__(self):
        if self.params not in PARAMS or self.batch not in BATCH:
            raise ValueError(f"Dimension {self.name}: params={self.params!r} must be one of {PARAMS} and "
                             f"batch={self.batch!r} one of {BATCH}")

    @property
    def replicates(self) -> bool:
        """Whether the ranks along it hold the same dense parameters (their gradients are reduced over it)."""
        return self.params in ("replicated", "experts")

    @property
    def replicates_experts(self) -> bool:
        """Whether the ranks along it hold the same experts (the experts' gradients are reduced over it)."""
        return self.params == "replicated"


#: every dimension, in the rank grid's order (outermost first)
DIMENSIONS: Mapping[str, Dimension] = MappingProxyType({d.name: d for d in (
    Dimension("pp", "pipeline parallel", "staged", "whole",
              "pipeline-parallel size: the model's layers cut into pp stages, micro-batches flowing through"),
    Dimension("dp", "data parallel", "replicated", "split",
              "data-parallel size: replicas (or ZeRO shards) of the model, each on its own sequences"),
    Dimension("ep", "expert parallel", "experts", "split",
              "expert-parallel size: every MoE layer's experts split over ep ranks, each on its own sequences "
              "(tokens sent to their experts by all-to-all); the dense layers replicated as over dp",
              always_grouped=False),
    Dimension("cp", "context parallel", "replicated", "sequence",
              "context-parallel size: every sequence's tokens split over cp ranks (ring or Ulysses attention)",
              always_grouped=False),
    Dimension("tp", "tensor parallel", "sharded", "whole",
              "tensor-parallel size: every layer's weights split over tp ranks (Megatron-style)"),
)})


def names() -> Tuple[str, ...]:
    """The dimensions' names in grid order (outermost first)."""
    return tuple(DIMENSIONS)


def dimension(name: str) -> Dimension:
    """The declaration of ``name``; an error that names the known dimensions."""
    dim = DIMENSIONS.get(name) if isinstance(name, str) else None
    if dim is None:
        raise ValueError(f"unknown parallel dimension {name!r}; the dimensions are {', '.join(names())} "
                         f"(parallel_layers.dimensions.DIMENSIONS)")
    return dim


def replicating(experts: bool = False) -> Tuple[str, ...]:
    """The dimensions whose ranks hold the same parameters, in grid order: their ranks together are a
    parameter's replicas (the gradient reduction's and ZeRO's group). ``experts=True``: those of an expert's
    parameters (ep left out: its ranks hold different experts)."""
    return tuple(d.name for d in DIMENSIONS.values() if (d.replicates_experts if experts else d.replicates))


def check_sizes(sizes: Mapping[str, object], who: str) -> Dict[str, int]:
    """``sizes`` (a size per dimension; missing ones are 1) checked: known names, positive integers. Returns
    every dimension's size, in grid order."""
    unknown = [k for k in sizes if k not in DIMENSIONS]
    if unknown:
        raise TypeError(f"{who}: unknown parallel dimension(s) {', '.join(map(repr, unknown))}; the dimensions "
                        f"are {', '.join(names())}")
    full = {name: sizes.get(name, 1) for name in DIMENSIONS}
    for name, size in full.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{who}: {name}={size!r} must be a positive integer")
    return full


def world_size(sizes: Mapping[str, int]) -> int:
    """The ranks a layout of these sizes needs: their product."""
    total = 1
    for name in DIMENSIONS:
        total *= sizes.get(name, 1)
    return total


def in_reading_order(sizes: Mapping[str, int]) -> List[Tuple[str, int]]:
    """``(name, size)`` pairs in the order users read a layout (data parallel first: dp, cp, tp, pp), then any
    dimension that order does not name, in grid order."""
    shown = [n for n in READING_ORDER if n in DIMENSIONS] + [n for n in DIMENSIONS if n not in READING_ORDER]
    return [(n, sizes.get(n, 1)) for n in shown]


def describe(sizes: Mapping[str, int], sep: str = " x ") -> str:
    """``dp=2 x tp=2 x pp=2``: every always-grouped dimension and each other one larger than 1, in reading
    order."""
    return sep.join(f"{n}={v}" for n, v in in_reading_order(sizes) if DIMENSIONS[n].always_grouped or v > 1)


def grid_ranks(sizes: Mapping[str, int], dims: Sequence[str]) -> List[List[int]]:
    """Every group that spans ``dims`` together (one dimension, or several: the replicas over dp and cp), as
    lists of global ranks, each in the grid's order."""
    full = [sizes.get(n, 1) for n in DIMENSIONS]
    grid = torch.arange(world_size(sizes)).reshape(full)
    axes = [names().index(d) for d in dims]
    rest = [i for i in range(len(full)) if i not in axes]
    grid = grid.permute(rest + axes)
    span = 1
    for d in dims:
        span *= sizes.get(d, 1)
    return grid.reshape(-1, span).tolist()


def coordinates(rank: int, sizes: Mapping[str, int]) -> Dict[str, int]:
    """A global rank's place in the grid: its index along every dimension."""
    out, stride = {}, 1
    for name in reversed(names()):
        size = sizes.get(name, 1)
        out[name] = (rank // stride) % size
        stride *= size
    return {name: out[name] for name in DIMENSIONS}


def index_within(coords: Mapping[str, int], sizes: Mapping[str, int], dims: Sequence[str]) -> int:
    """A rank's index among the ranks that differ from it only along ``dims`` (its rank in their group, as
    :func:`grid_ranks` orders it): its coordinates along ``dims`` read as one mixed-radix number."""
    index = 0
    for name in dims:
        index = index * sizes.get(name, 1) + coords[name]
    return index


__all__ = ["Dimension", "DIMENSIONS", "names", "dimension", "replicating", "check_sizes", "world_size", "describe",
           "in_reading_order", "grid_ranks", "coordinates", "index_within"]
