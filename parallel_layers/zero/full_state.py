"""The whole ZeRO optimizer state by parameter name, whatever the data-parallel size.

A ZeRO rank holds one flat shard of the fp32 master weights and of the two AdamW moments; which
elements of which parameter it holds depends on the dp size and the bucket (or unit) layout. Saved
per rank, that state loads back only on the same dp size: the checkpoint complaint the anchors'
trackers hear most. :func:`gather_full_state` turns the shards into one tensor per parameter and
state, in the parameter's shape (a collective over the dp group: each element is held by exactly one
rank, the others add zero); :func:`scatter_full_state` copies this rank's slice of such tensors back
into its shard, for any dp size and layout (no collective). ``ZeroOptimizer`` (stages 1 and 2) and
``ZeroStage3Optimizer`` expose them as ``full_state_dict()`` / ``load_full_state_dict()``, and the
universal checkpoints of ``Parallel3D`` build on them.

:func:`full_state_dict` and :func:`load_full_state_dict` are those two methods' common part, for
either optimizer (``shard_pieces``, ``master``, ``exp_avg``, ``exp_avg_sq``, ``low``, ``steps_taken`` /
``set_steps_taken``, and the group and per-parameter step helpers of ``optimizer.ShardedAdamW``).

``pieces``: the optimizer's ``shard_pieces()``, ``(param, start in its flat view, start in the flat
state, length)`` for every piece of a parameter in this rank's shard. ``flats``: this rank's flat
``(master, exp_avg, exp_avg_sq)``.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..distributed import collectives as C

STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")

Piece = Tuple[nn.Parameter, int, int, int]


def gather_full_state(named: List[Tuple[str, nn.Parameter]], pieces: Sequence[Piece],
                      flats: Sequence[torch.Tensor], group,
                      device: Optional[torch.device] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """``{name: {"master", "exp_avg", "exp_avg_sq"}}`` (fp32, the parameter's shape) for every parameter
    of ``named`` (a collective over ``group``, on ``device``: the model's, where the group communicates;
    default the shards' own, which differs when they live in host memory: ZeRO-Offload)."""
    base, total = {}, 0
    for _, p in named:
        base[id(p)] = total
        total += p.numel()
    flat = torch.zeros(total, len(STATE_KEYS), dtype=torch.float32, device=device or flats[0].device)
    for p, start_p, start_s, n in pieces:
        b = base[id(p)] + start_p
        for col, src in enumerate(flats):
            flat[b:b + n, col] = src[start_s:start_s + n].to(flat.device, non_blocking=False)
    if C.world_size(group) > 1:
        C.all_reduce(flat, group)
    return {name: {k: flat[base[id(p)]:base[id(p)] + p.numel(), col].reshape(p.shape).clone()
                   for col, k in enumerate(STATE_KEYS)} for name, p in named}


@torch.no_grad()
def scatter_full_state(state: Dict[str, Dict[str, torch.Tensor]], named: List[Tuple[str, nn.Parameter]],
                       pieces: Sequence[Piece], flats: Sequence[torch.Tensor], owner: str) -> None:
    """Copy this rank's pieces of ``state`` (as :func:`gather_full_state` returns it, from any dp size)
    into ``flats``; a missing parameter or one of another size is a ``ValueError`` naming it."""
    missing = [n for n, _ in named if n not in state]
    if missing:
        raise ValueError(f"{owner}.load_full_state_dict: no state for {len(missing)} parameters, e.g. "
                         f"{missing[:3]}; was it saved from another model?")
    by_id = {}
    for name, p in named:
        entry = state[name]
        bad = [k for k in STATE_KEYS if entry[k].numel() != p.numel()]
        if bad:
            raise ValueError(f"{owner}.load_full_state_dict: {name} has {p.numel()} elements here but "
                             f"{entry[bad[0]].numel()} in the state ({bad[0]})")
        by_id[id(p)] = entry
    for p, start_p, start_s, n in pieces:
        entry = by_id[id(p)]
        for k, dst in zip(STATE_KEYS, flats):
            dst[start_s:start_s + n] = entry[k].reshape(-1)[start_p:start_p + n].to(dst.device)


NamedParams = Callable[[], List[Tuple[str, nn.Parameter]]]


def full_state_dict(opt, named_params: NamedParams, group) -> dict:
    """``opt``'s whole state: step counts (``"step"``: steps taken; ``"steps"``: each parameter's own
    count by name, AdamW's bias correction), ``param_groups`` (parameters by name) and
    :func:`gather_full_state` of its shards (a collective over ``group``). ``named_params`` is called after
    ``opt.shard_pieces()``, which may rebuild the layout it lists."""
    pieces = opt.shard_pieces()
    return {"step": opt.steps_taken, "steps": opt.steps_by_name(), "param_groups": opt.named_param_groups(),
            "state": gather_full_state(named_params(), pieces, (opt.master, opt.exp_avg, opt.exp_avg_sq), group,
                                       getattr(opt, "device", None))}


@torch.no_grad()
def load_full_state_dict(opt, state: dict, named_params: NamedParams, owner: str) -> List[Tuple[str, nn.Parameter]]:
    """Load a :func:`full_state_dict` of any dp size into ``opt``: this rank's shard of the masters and
    moments, the low-precision copy from the masters, the step counts (``"steps"`` by name when the dict
    has them, else ``"step"`` for every parameter), and ``param_groups`` when the dict has them (by name:
    the same grouping; or one group without ``"params"``, from before param groups). Returns the named
    parameters it loaded."""
    pieces = opt.shard_pieces()
    named = named_params()
    scatter_full_state(state["state"], named, pieces, (opt.master, opt.exp_avg, opt.exp_avg_sq), owner)
    if opt.low is not None:
        opt.low.copy_(opt.master)
    if "param_groups" in state:
        opt.load_param_groups(state["param_groups"], f"{owner}.load_full_state_dict")
    opt.set_steps_taken(int(state["step"]))
    if state.get("steps") is not None:
        opt.load_steps(state["steps"], int(state["step"]))
    return named


__all__ = ["gather_full_state", "scatter_full_state", "full_state_dict", "load_full_state_dict", "STATE_KEYS"]
