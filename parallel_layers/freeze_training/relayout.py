"""AutoPipe and AutoDP: the layout for the blocks still training, and moving the training state into it.

**Choosing** (:func:`choose_layout`, a pure function of numbers every rank agrees on). The ranks stay the
same; what changes is how many pipeline stages the active blocks use (``pp``) and so how many
data-parallel replicas there are (``dp = world / pp``). The *budget* is the most expensive stage of the
layout the run started with (blocks, embedding, head, at the costs measured since). The new ``pp`` is the
smallest one (a divisor of the world, no larger than the current one) whose stages, cut from the active
blocks' measured costs by :func:`~parallel_layers.pipeline.balanced_boundaries` (the exact min-max
partition), all fit the budget: fewer stages suffice once enough blocks are frozen, and every rank they
free becomes a replica. Where none fits, the ``pp`` with the cheapest most expensive stage. Costs per
block are measured forward times times 3 (backward about twice the forward); the first stage also
carries the frozen prefix's forward, unless the prefix cache will serve it.

**Moving** (:func:`gather_dense`, :func:`load_dense`): the state goes through the universal checkpoint's
form, in memory: every parameter under the whole model's name in its dense layout, with its AdamW
moments and the step count (:func:`parallel_layers.composition.universal_checkpoint.dense_states` reads it the same
way from a run; here ZeRO's ``full_state_dict`` gives the fp32 masters and moments by name). Each
pipeline stage's first replica sends its part to every rank (one broadcast per stage and dtype: the
stage's tensors flat), the first stage also the frozen prefix, so any rank can build any part of the
new layout. The new run loads parameters before ``Parallel3D`` is built and the moments and step count
after (ZeRO: ``load_full_state_dict``, whatever the new dp size).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..pipeline.any_model import balanced_boundaries
from ..pipeline.stage import partition_layers

BACKWARD_FACTOR = 3.0          # forward + backward ~ 3 x forward (backward: input and weight gradients)
STATES = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class Layout:
    """One layout of the run: ``frozen`` blocks in the prefix; the active ones over ``pp`` stages
    (``boundaries``: split points among the active blocks, None: balanced by count) and ``dp`` replicas."""
    dp: int
    pp: int
    frozen: int = 0
    boundaries: Optional[List[int]] = None
    chunks: int = 1
    first_step: int = 0
    stage_costs: List[float] = field(default_factory=list)

    def stages(self, num_blocks: int) -> List[Tuple[int, int]]:
        """Each stage's ``[start, end)`` in the whole model's block numbering (``pp x chunks`` stages)."""
        active = num_blocks - self.frozen
        return [(a + self.frozen, b + self.frozen)
                for a, b in partition_layers(active, self.pp * self.chunks, self.boundaries)]

    def split_points(self, num_blocks: int) -> List[int]:
        """The stage boundaries among the active blocks, explicit."""
        return [b - self.frozen for _, b in self.stages(num_blocks)][:-1]

    def describe(self, num_blocks: int) -> str:
        frozen = f"{blocks_text(self.frozen)} frozen" if self.frozen else "nothing frozen"
        stages = " | ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in self.stages(num_blocks))
        return f"dp {self.dp} x pp {self.pp}, {frozen}, stages [{stages}]"


def blocks_text(frozen: int) -> str:
    """``frozen`` bottom blocks in words: "block 0", "blocks 0-3"."""
    return "block 0" if frozen == 1 else f"blocks 0-{frozen - 1}"


def stage_costs(costs: Sequence[float], boundaries: Sequence[int], first_extra: float = 0.0,
                last_extra: float = 0.0) -> List[float]:
    """Each stage's cost: its blocks' ``costs``, plus the extras on the first and last stage."""
    edges = [0] + list(boundaries) + [len(costs)]
    out = [sum(costs[edges[i]:edges[i + 1]]) for i in range(len(edges) - 1)]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def choose_layout(costs: Sequence[float], *, world: int, current_pp: int, budget: float, batch: int,
                  microbatches: int, first_extra: float = 0.0, last_extra: float = 0.0, chunks: int = 1,
                  tolerance: float = 0.1, fixed_pp: Optional[int] = None) -> Tuple[int, List[int], List[float]]:
    """``(pp, boundaries, stage costs)`` for the active blocks of ``costs`` (see the module docstring).
    ``pp`` ranges over divisors of ``world`` up to ``current_pp`` with ``pp * chunks`` stages no more than
    the blocks and a global ``batch`` that splits into ``world / pp`` replicas of ``microbatches``;
    ``tolerance``: how far over ``budget`` still fits (measured times are noisy); ``fixed_pp``: the pp to
    use (only the boundaries are chosen)."""
    options = []
    for pp in range(1, world + 1):
        if world % pp or pp > current_pp or pp * chunks > len(costs) or batch % ((world // pp) * microbatches):
            continue
        if fixed_pp is not None and pp != fixed_pp:
            continue
        bounds = balanced_boundaries(costs, pp * chunks, first_extra, last_extra) if pp * chunks > 1 else []
        options.append((pp, bounds, stage_costs(costs, bounds, first_extra, last_extra)))
    if not options:
        what = f"pp={fixed_pp}" if fixed_pp is not None else f"any pp up to {current_pp}"
        raise ValueError(f"freeze training: no layout of {world} ranks fits {len(costs)} active blocks with {what} "
                         f"({chunks} chunk(s) per rank, global batch {batch}, {microbatches} microbatches per "
                         f"replica); use a batch divisible by world x microbatches, or freeze fewer blocks")
    fitting = [o for o in options if max(o[2]) <= budget * (1 + tolerance)]
    if fitting:
        return min(fitting, key=lambda o: o[0])
    return min(options, key=lambda o: (max(o[2]), o[0]))


# ---------------------------------------------------------------------- the state, dense, on every rank
Dense = Dict[str, Dict[str, torch.Tensor]]        # whole-model name -> {"param", "exp_avg", "exp_avg_sq"}


def _adamw_moments(model, trained: Sequence[Tuple[str, nn.Parameter]]) -> Tuple[Dict[int, dict], int]:
    """``{id(p): {"param", "exp_avg", "exp_avg_sq"}}`` of the trained parameters and the step count. A
    collective over dp under ZeRO (its ``full_state_dict``): every rank calls it."""
    opt = model.optimizer
    out, step = {}, 0
    if model.zero == 0:                              # torch AdamW: each parameter's state, on every replica
        for _, p in trained:
            st = opt.state.get(p, {})
            out[id(p)] = {k: (st[k].detach().clone() if k in st else torch.zeros_like(p)) for k in STATES[1:]}
            if "step" in st:
                step = int(st["step"])
        return out, step
    full = opt.full_state_dict()["state"]            # fp32 masters and moments by the ModuleList's names
    name_of = {id(p): n for n, p in model.model.named_parameters()}
    for _, p in trained:
        entry = full[name_of[id(p)]]
        out[id(p)] = {"param": entry["master"], "exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
    return out, opt.steps_taken


def local_dense(model, rename: Callable[[str], str]) -> Tuple[Dense, int]:
    """This rank's stages of ``model`` (a ``Parallel3D`` at tp 1) as ``{whole-model name: states}``: every
    parameter, frozen ones included, with moments for the trained ones; held on data-parallel rank 0
    only (empty elsewhere), and the step count. A collective over dp (ZeRO) and, under ZeRO-3, the
    gathering of the parameters."""
    named = [(chunk, n, p) for chunk in model.chunks for n, p in chunk.named_parameters()
             if id(p) not in model.duplicate_ids]
    moments, step = _adamw_moments(model, [(n, p) for _, n, p in named if p.requires_grad])
    out: Dense = {}
    with model.mode.full_parameters():               # ZeRO-3: a collective over dp, every rank enters it
        if model.mesh.dp_rank != 0:
            return out, step
        for chunk, n, p in named:
            name = rename(chunk.dense_name(n))
            entry = {"param": p.detach().clone()}
            entry.update(moments.get(id(p), {}))     # ZeRO's fp32 master replaces a low-precision parameter
            out[name] = {k: chunk.dense_tensor(n, t) for k, t in entry.items()}
    return out, step


def share_dense(mine: Dense, device: torch.device) -> Dense:
    """Every rank's ``mine`` merged, on every rank: a collective over the world (the names and shapes as
    objects, then one broadcast per sending rank and dtype of its tensors, flat)."""
    listing = [(name, key, tuple(t.shape), str(t.dtype)) for name, st in sorted(mine.items())
               for key, t in sorted(st.items())]
    every: List = [None] * dist.get_world_size()
    dist.all_gather_object(every, listing)
    out: Dense = {}
    me = dist.get_rank()
    for src, items in enumerate(every):
        for dtype_name in sorted({d for *_, d in items}):
            group = [(n, k, s) for n, k, s, d in items if d == dtype_name]
            dtype = getattr(torch, dtype_name.replace("torch.", ""))
            sizes = [int(torch.Size(s).numel()) for _, _, s in group]
            if src == me:
                flat = torch.cat([mine[n][k].reshape(-1).to(device=device, dtype=dtype) for n, k, _ in group])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            C.broadcast(flat, src, dist.group.WORLD)
            for (n, k, s), piece in zip(group, flat.split(sizes)):
                out.setdefault(n, {})[k] = piece.view(s)
    return out


@torch.no_grad()
def load_parameters(model: nn.Module, dense: Dense) -> None:
    """Copy ``dense``'s parameters into a whole model (by name), before it is cut and built."""
    missing = [n for n, _ in model.named_parameters() if n not in dense]
    if missing:
        raise ValueError(f"freeze training: the re-layout lost {len(missing)} parameter(s), e.g. {missing[:3]}; every "
                         f"parameter of the model must be held by a stage or the frozen prefix")
    for n, p in model.named_parameters():
        p.copy_(dense[n]["param"].to(device=p.device, dtype=p.dtype))


@torch.no_grad()
def load_moments(model, dense: Dense, step: int, rename: Callable[[str], str]) -> None:
    """The AdamW moments and step count of ``dense`` into a freshly built ``Parallel3D`` whose parameters
    were loaded with :func:`load_parameters` (ZeRO: also its fp32 masters, from ``dense``'s values)."""
    if step == 0:
        return                                       # nothing learned yet: AdamW starts its state itself
    opt = model.optimizer
    if model.zero == 0:
        for chunk in model.chunks:
            for n, p in chunk.named_parameters():
                if p.requires_grad:
                    st = dense[rename(chunk.dense_name(n))]
                    opt.state[p] = {"step": torch.tensor(float(step)),
                                    "exp_avg": chunk.local_tensor(n, st["exp_avg"]).to(p).clone(),
                                    "exp_avg_sq": chunk.local_tensor(n, st["exp_avg_sq"]).to(p).clone()}
        return
    where = {id(p): (chunk, n) for chunk in model.chunks for n, p in chunk.named_parameters()}
    state = {}
    for name, p in model.model.named_parameters():    # ZeRO's names; frozen ones too (ZeRO-3 shards them)
        chunk, n = where[id(p)]
        st = dense[rename(chunk.dense_name(n))]
        zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        state[name] = {"master": chunk.local_tensor(n, st["param"]).float().reshape(p.shape),
                       "exp_avg": chunk.local_tensor(n, st.get("exp_avg", zeros)).float().reshape(p.shape),
                       "exp_avg_sq": chunk.local_tensor(n, st.get("exp_avg_sq", zeros)).float().reshape(p.shape)}
    opt.load_full_state_dict({"step": step, "state": state})


__all__ = ["Layout", "blocks_text", "choose_layout", "stage_costs", "local_dense", "share_dense", "load_parameters",
           "load_moments", "BACKWARD_FACTOR"]
