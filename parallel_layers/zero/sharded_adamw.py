"""``ShardedAdamW``: AdamW over one flat shard per rank, as a ``torch.optim.Optimizer``: the part of the ZeRO
optimizers that stages 1-3 share (``ZeroOptimizer`` in :mod:`.optimizer`, ``ZeroStage3Optimizer`` in
:mod:`.stage3_optimizer`).

``param_groups`` as ``torch.optim.AdamW`` takes them (each with its own lr, betas, eps, weight_decay,
maximize), read at every step, so torch's LR schedulers drive it. As in torch, a parameter is updated only
in a step where it has a gradient: frozen parameters, parameters no rank used since the last step, and
every parameter when ``step()`` follows no backward are left bit-identical, and each parameter's AdamW step
count (its bias correction) advances only with its own updates. A step consumes the gradients it was given.

The shard is stepped in *runs*: maximal stretches whose parameters share their group's lr/betas/eps and
their step count (the common case is ONE fused ``adamw_step`` call; groups that differ only in weight decay
share a run, their decay applied by one extra elementwise pass: decoupled decay does not depend on the
moments). The state (``master``, ``exp_avg``, ``exp_avg_sq``: fp32, one element per shard element) lives
where its storage object says (:mod:`.state_storage`: in memory, in a file streamed through a few host
buffers, or in pinned host memory); the step hands the storage the runs and it walks them over the state
(a file's sub-groups cut the runs, which changes no result: the step is elementwise).

Gradient clipping: the gradients are shards, so :meth:`ShardedAdamW.clip_grad_norm_` computes the global norm
over every rank's shard and folds the coefficient into the next step.
"""
from __future__ import annotations

import bisect
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..amp.clip import clip_grad_norm_ as _global_clip_grad_norm
from ..distributed import collectives as C
from ..ops import scalar_tensor
from ..ops.optimizer_step import adamw_step
from .host_offload import HostShard
from .offload import DiskOffload, StreamedShard, open_streamed_shard
from .state_storage import STATES, DiskState, HostState, ShardState, StepPlan

STATE_FORMAT = "parallel_layers.zero/2"      # state dicts before it: one group, one step count

NoDecay = Union[None, Sequence[torch.nn.Parameter], Callable[[str, torch.nn.Parameter], bool]]


def _scalar(owner: str, name: str, value, device) -> torch.Tensor:
    return scalar_tensor(f"{owner}.step", name, value, device, convert=True)


def step_multipliers(owner: str, device, grad_scale, clip_coef, found_inf):
    """``(gradient multiplier, found_inf)`` for the fused step, both on ``device``: the multiplier is
    ``clip_coef / grad_scale`` (``grad_scale`` is the loss scale the gradients carry)."""
    scale = (torch.ones(1, device=device) if grad_scale is None
             else torch.reciprocal(_scalar(owner, "grad_scale", grad_scale, device)))
    if clip_coef is not None:
        scale = scale * _scalar(owner, "clip_coef", clip_coef, device)
    inf = torch.zeros(1, device=device) if found_inf is None else _scalar(owner, "found_inf", found_inf, device)
    return scale, inf


class _ShardState:
    """``master`` / ``exp_avg`` / ``exp_avg_sq`` of a ``ShardedAdamW``, read from its storage (for a state
    offloaded to disk: the file mapped as a tensor; the step itself streams the file through its buffers)."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        storage = obj.state_storage
        if storage is None:
            raise AttributeError(f"{type(obj).__name__} has no state {self.name!r} yet")
        return storage.tensor(self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{type(obj).__name__}.{self.name} lives in the optimizer's state storage; write "
                             f"into it ({self.name}.copy_(...)) or load_state_dict()")


def _check_hypers(owner: str, where: str, lr, betas, eps, weight_decay) -> None:
    try:
        bad = not (float(lr) >= 0 and float(eps) >= 0 and float(weight_decay) >= 0)
    except (TypeError, ValueError):
        bad = True
    if bad:
        raise ValueError(f"{owner}: {where} has lr={lr!r}, eps={eps!r}, weight_decay={weight_decay!r}; each must "
                         f"be a number >= 0")
    if len(tuple(betas)) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
        raise ValueError(f"{owner}: {where} has betas={betas!r}; it must be a pair in [0, 1)")


def _default_groups(named, weight_decay: float, no_decay: NoDecay) -> list:
    """Every parameter, in one group, or in two when ``no_decay`` excludes some from weight decay."""
    params = [p for _, p in named]
    if no_decay is None or weight_decay == 0:
        return [{"params": params}]
    if callable(no_decay):
        skip = {id(p) for n, p in named if no_decay(n, p)}
    else:
        skip = {id(p) for p in no_decay}
    decay = [p for p in params if id(p) not in skip]
    rest = [p for p in params if id(p) in skip]
    return [g for g in ({"params": decay}, {"params": rest, "weight_decay": 0.0}) if g["params"]]


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over a flat shard, as a ``torch.optim.Optimizer``: param groups, per-parameter step counts,
    one fused kernel call per run of the shard, clipping over the shards, group and step state by name.

    A subclass sets ``device``, ``backend``, ``low`` and ``_storage`` (a :class:`~.state_storage.ShardState`:
    where ``master``/``exp_avg``/``exp_avg_sq`` live; :meth:`_open_state_file` for a file), and says where
    the shard's pieces and gradients are (``_module_named_params``, ``_shard_pieces_raw``, ``_grad_source``,
    ``_local_had_grads``, ``_consume_grads``, ``_agree_on_grads``, ``_grad_group``, ``_zero_grads``).
    """

    _owner = "ZeroOptimizer"
    master = _ShardState()
    exp_avg = _ShardState()
    exp_avg_sq = _ShardState()
    _storage: Optional[ShardState] = None        # where master / exp_avg / exp_avg_sq live

    @property
    def state_storage(self) -> Optional[ShardState]:
        """Where ``master`` / ``exp_avg`` / ``exp_avg_sq`` live (None until the subclass has built it)."""
        return self._storage

    @property
    def offload_stream(self) -> Optional[StreamedShard]:
        """The state streamed from disk (``offload="disk"``: its ``file``, ``stats``, ``buffer_bytes``), else None."""
        return self._storage.stream if isinstance(self._storage, DiskState) else None

    @property
    def host_shard(self) -> Optional[HostShard]:
        """The state in pinned host memory (``offload="cpu"`` on a CUDA model), else None."""
        return self._storage.host if isinstance(self._storage, HostState) else None

    # ------------------------------------------------------------------ where the state lives
    def _open_state_file(self, config: DiskOffload, *, tag: str, group, layout: object, numel: int,
                         resident_master: Optional[torch.Tensor], init_master: Callable) -> DiskState:
        """Create the state file (``init_master(lo, hi, out)``: the initial fp32 master of elements
        ``[lo, hi)``; the moments start at zero) and return it as a storage; it becomes the state only when
        the caller assigns it to ``_storage``. ``resident_master``: a master that stays in memory (ZeRO-3's
        fp32 parameter shard), so the file holds the moments only."""
        states = STATES[1:] if resident_master is not None else STATES
        init = {} if resident_master is not None else {"master": init_master}
        # a re-layout: the old file is still read while the new one is written
        suffix = ".new" if isinstance(self._storage, DiskState) else ""
        stream = open_streamed_shard(config, owner=self._owner, tag=tag, group=group, layout=layout, numel=numel,
                                     states=states, init=init, suffix=suffix)
        resident = {} if resident_master is None else {"master": resident_master}
        return DiskState(self._owner, stream, resident)

    def _verify_state(self) -> None:
        self._storage.verify()

    def _checkpoint_states(self) -> Dict[str, torch.Tensor]:
        """The state for ``state_dict()``: clones, or, offloaded to disk, tensors mapped from a private copy
        of the state file (no copy in memory; the copy's disk space is freed with the tensors)."""
        self.wait_for_step()
        return self._storage.checkpoint()

    def _load_states(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy whole states (``master, exp_avg, exp_avg_sq`` of this shard's size) into the state, a
        sub-group at a time when offloaded; the low-precision copy follows the master."""
        named = dict(zip(STATES, tensors))
        size = self._storage.numel
        for k, t in named.items():
            if t.numel() != size:
                raise ValueError(f"{self._owner}.load_state_dict: state {k!r} has {t.numel()} elements, this "
                                 f"rank's shard {size}; was it saved from another model or layout?")
        self.wait_for_step()
        self._storage.load(named)
        if self.low is not None:
            self.low.copy_(named["master"])

    def _state_bytes(self) -> Dict[str, int]:
        """``{"optimizer": bytes of state in memory, "offload": bytes held elsewhere}``; the memory of a state
        offloaded to disk is its streaming buffers (and a resident master)."""
        return self._storage.nbytes()

    def close_offload(self) -> None:
        """Stop the offload I/O threads and remove the state file now; the optimizer cannot step afterwards.
        Garbage collection does it too, but an optimizer lives as long as its wrapper's hooks reach it
        (``ZeroOptimizer(stage=2)`` registers a forward hook), so a script that is done with one calls this."""
        self.wait_for_step()
        self._storage.close()

    def wait_for_step(self) -> None:
        """``offload="cpu", offload_delayed_update=True``: apply the step whose CPU work is still in flight
        (upload its parameters; stages 1 and 2 all-gather them: a collective over the dp group). Until then
        the model holds the parameters of one step before. Called by every checkpoint and state read; a
        no-op otherwise."""
        if self._storage is not None and self._storage.finish():
            self._after_host_upload()

    def _after_host_upload(self) -> None:
        """Subclass hook: a delayed step's parameters were uploaded (stages 1 and 2 gather them)."""

    def _init_groups(self, params, *, lr, betas, eps, weight_decay, no_decay: NoDecay) -> None:
        named = self._module_named_params()
        self._names: Dict[int, str] = {id(p): n for n, p in named}
        _check_hypers(self._owner, "the defaults", lr, betas, eps, weight_decay)
        if params is None:
            params = _default_groups(named, float(weight_decay), no_decay)
        elif no_decay is not None:
            raise ValueError(f"{self._owner}: pass param groups or no_decay=, not both; put the parameters "
                             f"without weight decay in their own group: {{'params': [...], 'weight_decay': 0.0}}")
        self._steps = torch.zeros(0, dtype=torch.float32, device=self.device)   # per parameter
        self._step = torch.zeros(1, dtype=torch.float32, device=self.device)    # steps that updated anything
        self._hist: List[int] = []     # equal ids: same steps updated them, so equal step counts (runs merge)
        self._hist_next = 1
        self._pending_clip: Optional[torch.Tensor] = None
        self._pieces_cache = None
        self._wd_cache = None
        self._wd_segs = None
        defaults = dict(lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                        weight_decay=float(weight_decay), maximize=False, amsgrad=False)
        torch.optim.Optimizer.__init__(self, params, defaults)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        """As ``torch.optim.Optimizer.add_param_group``; the parameters must be the wrapped module's."""
        super().add_param_group(param_group)
        group, k = self.param_groups[-1], len(self.param_groups) - 1
        try:
            self._check_group(group, k)
        except Exception:
            self.param_groups.pop()
            raise
        group["betas"] = tuple(float(b) for b in group["betas"])
        self._index_groups()

    def _check_group(self, group: dict, k: int) -> None:
        _check_hypers(self._owner, f"param_groups[{k}]", group["lr"], group["betas"], group["eps"],
                      group["weight_decay"])
        if group.get("amsgrad") or group.get("differentiable"):
            raise ValueError(f"{self._owner}: param_groups[{k}] asks for amsgrad/differentiable, which the fused "
                             f"shard step does not implement; use plain AdamW (amsgrad=False)")
        for i, p in enumerate(group["params"]):
            if id(p) not in self._names:
                raise ValueError(f"{self._owner}: param_groups[{k}]['params'][{i}] (shape {tuple(p.shape)}) is not "
                                 f"a parameter of the wrapped module; pass that module's own parameters "
                                 f"(e.g. from model.named_parameters())")
            self._check_param(p, self._names[id(p)])

    def _check_param(self, p: torch.nn.Parameter, name: str) -> None:
        """Subclass hook: reject a parameter the shard cannot step."""

    def _index_groups(self) -> None:
        self._all_params = [p for g in self.param_groups for p in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._all_params)}
        self._group_of = [k for k, g in enumerate(self.param_groups) for _ in g["params"]]
        n_old = self._steps.numel()
        if len(self._all_params) > n_old:       # a new group: its parameters have taken no step
            self._steps = torch.cat([self._steps, torch.zeros(len(self._all_params) - n_old,
                                                              dtype=torch.float32, device=self.device)])
            self._hist += [0] * (len(self._all_params) - n_old)
        self._pieces_cache = None

    def named_param_groups(self) -> List[dict]:
        """``param_groups`` with parameter *names* (``"params"``): what checkpoints hold."""
        out = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            d["params"] = [self._names[id(p)] for p in g["params"]]
            out.append(d)
        return out

    def load_param_groups(self, saved: Sequence[dict], where: str) -> None:
        """Hyper-parameters from :meth:`named_param_groups` (same grouping required) or, for a state saved
        before param groups existed (one group, no ``"params"``), lr/betas/eps for every group and weight decay
        for every group that decays (the groups of ``no_decay=`` keep their zero)."""
        if not saved:
            return
        if all("params" in s for s in saved):
            if len(saved) != len(self.param_groups):
                raise ValueError(f"{where}: the checkpoint has {len(saved)} param groups, this optimizer "
                                 f"{len(self.param_groups)}; build it with the same param groups")
            for k, (s, g) in enumerate(zip(saved, self.param_groups)):
                mine = {self._names[id(p)] for p in g["params"]}
                if set(s["params"]) != mine:
                    diff = sorted(mine.symmetric_difference(s["params"]))
                    raise ValueError(f"{where}: param_groups[{k}] differs from the checkpoint's (e.g. {diff[:3]}); "
                                     f"build the optimizer with the same param groups")
            for s, g in zip(saved, self.param_groups):
                g.update({k: v for k, v in s.items() if k != "params"})
                g["betas"] = tuple(g["betas"])
            return
        s = saved[0]
        for g in self.param_groups:
            for key in ("lr", "betas", "eps", "maximize"):
                if key in s:
                    g[key] = s[key]
            if g["weight_decay"] != 0 and "weight_decay" in s:
                g["weight_decay"] = s["weight_decay"]
            g["betas"] = tuple(g["betas"])

    # ------------------------------------------------------------------ step counts
    @property
    def steps_taken(self) -> int:
        """Steps that updated at least one parameter (skipped ``found_inf`` steps do not count)."""
        return int(self._step.item())

    def set_steps_taken(self, n: int) -> None:
        """Resume every step count (AdamW's bias correction) at ``n``."""
        self._step.fill_(n)
        self._steps.fill_(n)
        self._reset_hist()

    def steps_by_name(self) -> Dict[str, int]:
        return {self._names[id(p)]: int(v) for p, v in zip(self._all_params, self._steps.tolist())}

    def load_steps(self, steps: Optional[Dict[str, int]], default: int) -> None:
        """Per-parameter step counts by name (a parameter missing from ``steps``, or all of them when it is
        None: a state saved with one count, gets ``default``)."""
        steps = steps or {}
        vals = [float(steps.get(self._names[id(p)], default)) for p in self._all_params]
        self._steps.copy_(torch.tensor(vals, dtype=torch.float32))
        self._reset_hist()

    def _reset_hist(self) -> None:
        ids: Dict[float, int] = {0.0: 0}
        self._hist = [ids.setdefault(v, len(ids)) for v in self._steps.tolist()]
        self._hist_next = len(ids)

    def _advance(self, had: List[bool], keep: torch.Tensor) -> None:
        """Count this step for the parameters it updates (on the device: ``keep`` is 0 on overflow)."""
        if all(had):
            self._steps.add_(keep)
        else:
            self._steps.add_(torch.tensor(had, dtype=torch.float32, device=self.device) * keep)
        self._step.add_(keep)
        renamed: Dict[int, int] = {}
        for i, h in enumerate(had):
            if h:
                old = self._hist[i]
                if old not in renamed:
                    renamed[old] = self._hist_next
                    self._hist_next += 1
                self._hist[i] = renamed[old]

    # ------------------------------------------------------------------ which parameters have gradients
    def _had_grads(self) -> List[bool]:
        """Per parameter (optimizer order): has it a gradient for this step, on any rank of the group."""
        local = self._local_had_grads()
        if not self._agree_on_grads():
            return local
        flags = torch.tensor(local, dtype=torch.int32, device=self.device)
        C.all_reduce(flags, self._grad_group(), op=dist.ReduceOp.MAX)
        return [bool(v) for v in flags.tolist()]

    # ------------------------------------------------------------------ the shard, in runs
    def _pieces(self) -> List[Tuple[Optional[int], int, int]]:
        """``(parameter index or None, start in the shard, length)`` in shard order; None: a parameter in
        no group (never stepped, and it keeps runs apart)."""
        if self._pieces_cache is None:
            self._pieces_cache = [(self._index.get(id(p)), start, n) for p, _, start, n in self._shard_pieces_raw()]
            self._wd_cache = self._wd_segs = None
        return self._pieces_cache

    def _runs(self, had: List[bool]) -> list:
        """``[key, start, end, first parameter index, weight decay or None when mixed]``: maximal stretches of
        consecutive pieces with a gradient, the same lr/betas/eps/maximize and the same step count. Between
        two pieces of one run there is only padding (zero parameter and gradient: Adam keeps it zero)."""
        keys = [(float(g["lr"]), float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]), bool(g["maximize"]))
                for g in self.param_groups]
        runs, cur = [], None
        for idx, start, n in self._pieces():
            if idx is None or not had[idx]:
                cur = None
                continue
            k = self._group_of[idx]
            key, wd = (keys[k], self._hist[idx]), float(self.param_groups[k]["weight_decay"])
            if cur is not None and cur[0] == key:
                cur[2] = start + n
                if cur[4] is not None and cur[4] != wd:
                    cur[4] = None
            else:
                cur = [key, start, start + n, idx, wd]
                runs.append(cur)
        return runs

    def _wd_vector(self) -> torch.Tensor:
        """Per-element weight decay of the shard (for runs mixing groups of different weight decay)."""
        wds = tuple(float(g["weight_decay"]) for g in self.param_groups)
        if self._wd_cache is None or self._wd_cache[0] != wds:
            vec = torch.zeros_like(self.master)
            for idx, start, n in self._pieces():
                if idx is not None:
                    vec[start:start + n] = wds[self._group_of[idx]]
            self._wd_cache = (wds, vec)
        return self._wd_cache[1]

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None, clip_coef=None):
        """One AdamW update of every parameter that has a gradient, each with its group's hyper-parameters
        (read now: schedulers work) and its own step count. ``grad_scale``: the loss scale the gradients
        carry (divided out); ``clip_coef``: multiplies them (also the one :meth:`clip_grad_norm_` left);
        nonzero ``found_inf``: skip, parameters, states and step counts bit-identical. All three may be
        1-element device tensors (no host sync)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_step()
        self._verify_state()              # a missing, truncated or foreign state file: refused before anything
        had = self._had_grads()
        self._consume_grads()
        clip, self._pending_clip = self._pending_clip, None
        if not any(had):                  # torch.optim: parameters without a gradient are not touched
            self._after_step(stepped=False)
            return loss
        scale, inf = step_multipliers(self._owner, self.device, grad_scale, clip_coef, found_inf)
        if clip is not None:
            scale = scale * clip
        keep = (inf == 0).to(torch.float32)
        self._advance(had, keep)
        grad = self._grad_source()
        runs = self._runs(had)
        mixed = any(r[4] is None for r in runs)
        self._storage.step(StepPlan(spans=[(r[1], r[2]) for r in runs], step_span=partial(self._step_span, runs),
                                    grad=grad, wd_vector=self._wd_vector if mixed else None,
                                    wd_fill=self._wd_fill if mixed else None, scale=scale, inf=inf, keep=keep,
                                    steps=self._steps, after_chunk=self._after_chunk))
        self._after_step(stepped=True)
        return loss

    def _step_span(self, runs, lo: int, hi: int, states: Sequence[torch.Tensor], grad: torch.Tensor,
                   wd_of: Optional[Callable[[int, int], torch.Tensor]], scale, inf, keep, *,
                   steps: Optional[torch.Tensor] = None, low: Optional[torch.Tensor] = None) -> None:
        """The fused AdamW calls of ``runs`` over shard elements ``[lo, hi)``. ``states``: master, exp_avg,
        exp_avg_sq holding exactly those elements (index 0 is element ``lo``); ``grad`` and ``low`` (default
        ``self.low``) are whole shards. ``wd_of(a, b)``: per-element weight decay of ``[a, b)`` for runs
        mixing groups. ``steps``: the per-parameter step counts (default ``self._steps``; a host copy when
        the state is in host memory)."""
        master, exp_avg, exp_avg_sq = states
        steps = self._steps if steps is None else steps
        low = self.low if low is None else low
        for ((lr, beta1, beta2, eps, maximize), _), s, e, idx, wd in runs:
            a, b = max(s, lo), min(e, hi)
            if a >= b:
                continue
            m = master[a - lo:b - lo]
            if wd is None:                # decoupled decay first (skipped with the step: keep = 0)
                m.mul_(self._decay_factors(wd_of(a, b), lr, keep))
                wd = 0.0
            adamw_step(m, grad[a:b], exp_avg[a - lo:b - lo], exp_avg_sq[a - lo:b - lo], lr=lr,
                       step=steps[idx:idx + 1], beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                       maximize=maximize, grad_scale=scale, found_inf=inf,
                       param_copy=None if low is None else low[a:b], backend=self.backend)

    def _decay_factors(self, wd: torch.Tensor, lr: float, keep: torch.Tensor) -> torch.Tensor:
        """Per element ``float(1 - lr * wd)`` (1 where ``keep`` is 0), rounded once from double as the fused
        kernel rounds its scalar: a parameter's update must not depend on whether its run mixes weight decays
        (the same tied weight lies in a mixed run on one stage and a plain one on the other, and an
        ``m - lr * wd * m`` here came out a rounding apart from the kernel's ``m * (1 - lr * wd)``)."""
        factors = torch.ones_like(wd)
        for value in {float(g["weight_decay"]) for g in self.param_groups}:
            if value:
                factors.masked_fill_(wd == value, 1.0 - lr * value)
        return torch.where(keep > 0, factors, torch.ones_like(factors))

    def _wd_fill(self, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """``_wd_vector()[a:b]`` without the whole vector: filled from the pieces into ``out`` (a sub-group
        buffer of ``b - a`` elements)."""
        wds = tuple(float(g["weight_decay"]) for g in self.param_groups)
        if self._wd_segs is None or self._wd_segs[0] != wds:
            segs = [(start, start + n, wds[self._group_of[idx]]) for idx, start, n in self._pieces()
                    if idx is not None]
            self._wd_segs = (wds, segs, [sg[1] for sg in segs])
        _, segs, ends = self._wd_segs
        out.zero_()
        for i in range(bisect.bisect_right(ends, a), len(segs)):
            s, e, wd = segs[i]
            if s >= b:
                break
            out[max(s, a) - a:min(e, b) - a] = wd
        return out

    def _after_chunk(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Subclass hook, a state offloaded to disk: sub-group ``[lo, hi)`` was stepped (``master``: its
        fp32 values)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and a clip coefficient not yet used). Cleared gradients count as absent
        whatever ``set_to_none`` says: the next step updates only what a later backward reaches."""
        self._pending_clip = None
        self._consume_grads()
        self._zero_grads(set_to_none)

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, tp_group=None,
                        inv_scale=None, found_inf: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` for sharded gradients: the total norm of the gradients of this
        optimizer's parameters over every rank's shard (a collective over the data-parallel group; on the
        device, no host sync), returned as a 0-dim tensor on every rank; the clip coefficient
        ``min(1, max_norm / (norm + 1e-6))`` multiplies the gradients in the next :meth:`step`.
        ``tp_group``: tensor-parallel shards (``p.tensor_parallel``) summed over it, replicated parameters
        counted once. ``inv_scale``/``found_inf``: as ``parallel_layers.amp.clip_grad_norm_`` (loss-scaled
        gradients; inf/nan detection agreed across ranks)."""
        self._before_step()
        grad = self._grad_source()
        items = []
        for p, _, start, n in self._shard_pieces_raw():
            if id(p) not in self._index:
                continue
            piece = grad[start:start + n]
            if getattr(p, "tensor_parallel", False):
                piece.tensor_parallel = True
            items.append(piece)
        groups = [self._grad_group()] if C.world_size(self._grad_group()) > 1 else []
        norm, coef = _global_clip_grad_norm(items, max_norm, groups=groups, tp_group=tp_group,
                                            norm_type=norm_type, apply=False, inv_scale=inv_scale,
                                            found_inf=found_inf)
        coef = coef.reshape(1).to(device=self.device, dtype=torch.float32)
        self._pending_clip = coef if self._pending_clip is None else self._pending_clip * coef
        return norm

    # ------------------------------------------------------------------ subclass hooks (defaults)
    def _before_step(self) -> None:
        pass

    def _after_step(self, stepped: bool) -> None:
        pass
