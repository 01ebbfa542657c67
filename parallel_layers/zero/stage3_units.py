"""The unit layout of :class:`~parallel_layers.zero.stage3.ZeroStage3`: which modules' parameters share one
flat buffer (gathered, freed and reduced together), where each parameter sits in it, and the dtype its
gradients are reduced in (:func:`check_reduce_dtype`).

Units. ``wrap`` chooses modules (default: every element of every ``nn.ModuleList``); the root unit keeps
every parameter no chosen module claims. Then consecutive chosen modules smaller than ``min_unit_numel``
elements are merged into one unit, until the merged unit reaches ``min_unit_numel``. Why: every unit
costs an all-gather in forward, another in backward and a reduce-scatter, a collective's time is flat in
its size up to tens of thousands of elements (measured, 2 gloo ranks on 2 cores: 0.34 ms per ring
all-gather or reduce-scatter from 1,024 to 16,384 elements, 0.40 ms at 65,536, 1.6 ms at 1M), and each
unit is padded to ``SHARD_ALIGN * dp`` elements. A model of 1,500 LayerNorm(2)/Linear(2, 2) modules (3,004
parameters, 7,521 elements) was 1,501 units padded to 48,032 elements, a step 3.9 s against ZeRO-2's
0.12 s; merged it is 3 units padded to 7,584, a step 1.2x ZeRO-2's (``python -m
benchmarks.zero3_small_params``, 2 gloo ranks). Most of what is left is Python per module call (the
hooks, the parameter guard), not communication. Modules of a layer's size (a 64 x 64 Linear: 4,160
elements) keep a unit of their own, as the user's ``wrap`` chose: the gather of one overlaps the compute
of another and at most two are gathered at once.

A unit's parameters are flattened in order (each module's ``named_parameters``) into one buffer padded
to a multiple of ``SHARD_ALIGN * dp`` elements, so it splits into ``dp`` equal shards and every shard
starts 64-byte aligned in fp32 (never a divisibility error). Rank r keeps shard r of every unit.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

SHARD_ALIGN = 16   # elements; every shard (and so every unit's slice of shard_buffer) starts aligned
MIN_UNIT_NUMEL = 4096   # default of ZeroStage3(min_unit_numel=): see the module docstring

Wrap = Union[None, Callable[[str, nn.Module], bool], Sequence[nn.Module]]
Named = List[Tuple[str, nn.Parameter]]


class Unit:
    """Modules whose parameters share one flat buffer: the shard is persistent, the full buffer (and its
    gradient buffer) transient. ``modules`` run their hooks; the unit is gathered while any of them runs."""

    def __init__(self, index: int, name: str, modules: List[nn.Module], named: Named, dp: int, rank: int,
                 dtype: torch.dtype, device: torch.device, grad_dtype: Optional[torch.dtype] = None):
        self.index, self.name, self.modules = index, name, modules
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.numels = [p.numel() for p in self.params]
        self.offsets, self.offset_of, pos = [], {}, 0
        for p, n in zip(self.params, self.numels):
            self.offsets.append(pos)
            self.offset_of[id(p)] = pos
            pos += n
        self.numel = pos
        self.padded = max(1, math.ceil(pos / (SHARD_ALIGN * dp))) * SHARD_ALIGN * dp
        self.shard_numel = self.padded // dp
        self.lo, self.hi = rank * self.shard_numel, (rank + 1) * self.shard_numel
        # Both full buffers start without storage (the wrapper allocates them while a unit is gathered or
        # reduced): allocated here for every unit at once they would hold twice the model while it is built.
        # The gradient buffer is in the reduction's dtype (``grad_dtype``: fp32 for bf16 parameters by
        # default), which may be wider than the parameters': each gradient autograd makes is added into it.
        self.full = torch.empty(self.padded, dtype=dtype, device=device)
        self.grad_full = torch.empty(self.padded, dtype=grad_dtype or dtype, device=device)
        # each parameter's gradient slice, shaped like it (views stay valid while the storage is freed)
        self.grad_view_of = {id(p): self.grad_full[o:o + n].view(p.shape)
                             for p, o, n in zip(self.params, self.offsets, self.numels)}
        self.nbytes = self.full.untyped_storage().nbytes()
        self.grad_nbytes = self.grad_full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.grad_full.untyped_storage().resize_(0)
        self.n_grad = sum(p.requires_grad for p in self.params)
        self.has_frozen = self.n_grad < len(self.params)
        self.shard = self.grad_shard = None     # views of the wrapper's flat buffers, set by the wrapper
        self.gather_work = None                 # in-flight all-gather
        self.rs_work = self.rs_out = None       # in-flight gradient reduction and its output
        # eager: each gradient is added into grad_full as it arrives (the unit's gradients arrive together,
        # in its backward). The root's arrive at both ends of backward (final LayerNorm first, embeddings
        # last): they stay autograd's tensors until the last one, so no full buffer lives through backward.
        self.eager_grads = index != 0
        self.grad_valid = False                 # grad_shard holds this backward's (or an earlier) sum
        self.accumulated = False                # grad_full holds no_sync() sums not reduced yet
        self.phase = "idle"                     # idle | forward | backward | reduced
        self.ready = 0                          # parameters whose gradient has been accumulated
        self.forward_calls = 0                  # module calls finished in this forward
        self.made_graph = False                 # a call in this forward produced a tensor needing grad
        self.after_backward_pending = 0         # find_unused_parameters: module backwards still to finish
        self.reduce_at_end = False              # find_unused_parameters: a call had no input needing grad
        self.storage_ptr = 0                    # the full buffer's address while gathered (set by the wrapper)
        self.saved_views = 0                    # root: autograd-saved tensors viewing its full buffer

    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def gathered_grad(self) -> bool:
        return self.grad_full.untyped_storage().nbytes() > 0

    def __repr__(self) -> str:
        return (f"Unit({self.index}, {self.name or '<root>'}, modules={len(self.modules)}, "
                f"params={len(self.params)}, padded={self.padded})")


def check_reduce_dtype(reduce_dtype, param_dtype: torch.dtype, numel: int) -> torch.dtype:
    """``ZeroStage3(reduce_dtype=)``, checked: None -> fp32 for bf16/fp16 parameters (FSDP2's
    ``reduce_dtype=torch.float32``, as torchtitan trains), else the parameters' dtype; given: the parameters'
    dtype, or fp32 for bf16/fp16 parameters. ``numel``: the parameters' elements, for the message."""
    low = param_dtype in (torch.bfloat16, torch.float16)
    if reduce_dtype is None:
        return torch.float32 if low else param_dtype
    allowed = [param_dtype] + ([torch.float32] if low else [])
    if not isinstance(reduce_dtype, torch.dtype):
        raise TypeError(f"ZeroStage3: reduce_dtype={reduce_dtype!r} is not a torch.dtype; pass one of "
                        f"{', '.join(map(str, allowed))}, or None")
    if reduce_dtype not in allowed:
        choices = [f"{d} ({d.itemsize * numel:,} bytes per reduction of the {numel:,} elements"
                   + (": half the traffic, every sum rounded to it)" if d != torch.float32 and low else ")")
                   for d in sorted(allowed, key=lambda d: -d.itemsize)]
        raise ValueError(f"ZeroStage3: reduce_dtype={reduce_dtype} for {param_dtype} parameters; the gradients are "
                         f"accumulated and reduce-scattered in " + " or in ".join(choices)
                         + f"; pass {'one of those' if low else 'that'}, or reduce_dtype=None ("
                         f"{torch.float32 if low else param_dtype} here)")
    return reduce_dtype


def _default_units(module: nn.Module) -> List[nn.Module]:
    """Every element of every ``nn.ModuleList`` (outermost ones: no unit inside another)."""
    out: List[nn.Module] = []

    def walk(m: nn.Module):
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                out.extend(child)
            else:
                walk(child)
    walk(module)
    return out


def choose_modules(module: nn.Module, wrap: Wrap) -> List[nn.Module]:
    """The modules ``wrap`` names (a predicate ``(name, module) -> bool``, outermost match wins, or a list),
    default every element of every ``nn.ModuleList``; each must be a proper submodule."""
    names = {id(m): n for n, m in module.named_modules()}
    if wrap is None:
        chosen = _default_units(module)
    elif callable(wrap):
        chosen, inside = [], set()
        for n, m in module.named_modules():
            if m is not module and wrap(n, m) and not any(n.startswith(o + ".") for o in inside):
                chosen.append(m)
                inside.add(n)
    else:
        chosen = list(wrap)
    for m in chosen:
        if id(m) not in names or m is module:
            raise ValueError(f"ZeroStage3: wrap names a module that is not a proper submodule of "
                             f"{type(module).__name__}: {type(m).__name__}")
    return chosen


def assign_params(module: nn.Module, chosen: List[nn.Module]) -> List[Tuple[nn.Module, Named]]:
    """``[(root, its parameters), (chosen module, its parameters), ...]``: each parameter belongs to one
    module (the root keeps those no chosen module claims); one shared by two chosen modules is an error."""
    names = {id(m): n for n, m in module.named_modules()}
    owner: Dict[int, str] = {}
    plan = []
    for m in chosen + [module]:   # root last: it keeps what no unit claimed
        named = []
        for n, p in m.named_parameters():
            if id(p) in owner:
                if m is module:
                    continue
                raise ValueError(f"ZeroStage3: parameter {names[id(m)]}.{n} is shared with unit "
                                 f"{owner[id(p)]!r}; a parameter must belong to one unit (wrap the module "
                                 f"that contains both uses)")
            owner[id(p)] = names[id(m)] or "<root>"
            named.append((n, p))
        plan.append((m, named))
    return [plan[-1]] + plan[:-1]  # root is unit 0 (it runs first)


def merge_small(module: nn.Module, plan: List[Tuple[nn.Module, Named]], min_unit_numel: int
                ) -> List[Tuple[str, List[nn.Module], Named]]:
    """``[(unit name, modules, parameters)]``: the root alone, then the chosen modules in order, runs of
    consecutive ones smaller than ``min_unit_numel`` elements merged until a merged unit reaches it. A unit
    of one module names its parameters relative to it; a merged one, relative to the root."""
    names = {id(m): n for n, m in module.named_modules()}
    root, named_root = plan[0]
    out: List[Tuple[str, List[nn.Module], Named]] = [(names[id(root)], [root], named_root)]
    run: List[Tuple[nn.Module, Named]] = []

    def close_run():
        if len(run) == 1:
            m, named = run[0]
            out.append((names[id(m)], [m], named))
        elif run:
            first, last = names[id(run[0][0])], names[id(run[-1][0])]
            out.append((f"{first}..{last} ({len(run)} modules)", [m for m, _ in run],
                        [(f"{names[id(m)]}.{n}", p) for m, named in run for n, p in named]))
        run.clear()

    run_numel = 0
    for m, named in plan[1:]:
        numel = sum(p.numel() for _, p in named)
        if numel >= min_unit_numel:
            close_run()
            out.append((names[id(m)], [m], named))
            run_numel = 0
            continue
        run.append((m, named))
        run_numel += numel
        if run_numel >= min_unit_numel:
            close_run()
            run_numel = 0
    close_run()
    return out


__all__ = ["MIN_UNIT_NUMEL", "SHARD_ALIGN", "Unit", "assign_params", "check_reduce_dtype", "choose_modules",
           "merge_small"]
