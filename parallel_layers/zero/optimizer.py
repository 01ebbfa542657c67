"""ZeroOptimizer: AdamW with its state sharded over the data-parallel group (ZeRO stages 1 and 2).

Layout (Megatron-LM's distributed optimizer): ``DataParallel`` keeps parameters and gradients in flat
buffers cut into buckets, each padded to a multiple of lcm(dp, 64) elements, so every bucket splits into
``dp`` equal shards and rank r owns shard r of *every* bucket. This rank's shards, concatenated bucket
after bucket, form one flat "local shard" of ``S = sum(bucket.numel) / dp`` elements, and the optimizer
state is three fp32 tensors of ``S`` elements: master weights, exp_avg, exp_avg_sq.

A step, all on the device (no host sync, so an AMP ``found_inf`` costs nothing):

1. gradients: ``DataParallel(reduce_op="reduce_scatter")`` reduce-scattered every bucket during backward
   straight into its flat ``grad_shard`` (this rank's averaged shards, bucket after bucket: exactly the
   layout of the optimizer state), which the optimizer steps on as it is: no copy, no second shard.
   Stage 1 keeps the full grad buffer as well; stage 2 frees it between steps (see ``_release_grads``).
   (Stage 1 over ``reduce_op="all_reduce"`` slices the shard out of the full buffer instead.)
2. the fused ``adamw_step`` updates the local shard (master, moments, and for bf16/fp16 models the
   low-precision copy in the same pass): one call per *run*, a stretch of the shard whose parameters share
   their group's lr/betas/eps and their step count (the common case, every parameter with a gradient and
   one learning rate, is ONE call; groups that differ only in weight decay share a run, their decay applied
   by one extra elementwise pass: decoupled decay does not depend on the moments), then
3. every bucket's updated shard is all-gathered (model dtype) into ``bucket.param_data``, so every rank
   holds the full updated model.

Padding elements have zero parameters and zero gradients, so Adam leaves them at zero.

``torch.optim.Optimizer`` contract (:class:`_ZeroAdamW`): ``param_groups`` as ``torch.optim.AdamW`` takes
them (each with its own lr, betas, eps, weight_decay, maximize), read at every step, so torch's LR
schedulers drive it. As in torch, a parameter is updated only in a step where it has a gradient: frozen
parameters, parameters no rank used since the last step, and every parameter when ``step()`` follows no
backward are left bit-identical, and each parameter's AdamW step count (its bias correction) advances
only with its own updates. A step consumes the gradients it was given (ZeRO-2 frees them): a second
``step()`` without a backward in between changes nothing.

Gradient clipping: the gradients are shards, so ``torch.nn.utils.clip_grad_norm_(model.parameters())``
cannot see them. After a backward every ``p.grad`` is a guard (:class:`_ShardedGrad`) that raises a
``RuntimeError`` naming the parameter and :meth:`_ZeroAdamW.clip_grad_norm_`, which computes the global norm
over every rank's shard and folds the coefficient into the next step. (Stage 1 over an all-reduce with fp32
parameters has the full averaged gradient in ``p.grad``, stepped from that buffer: the standard call works
there and no guard is set.)

The buffer may be re-laid out once (``DataParallel`` rebuilds buckets from the order gradients arrived,
at the end of the first synced backward and, with reduce-scatter, *before* reducing, so the gradients are
already reduced in the new layout): the optimizer notices (the buffer storage changed) and re-derives its
shards. Before the first step that is free; when the state already holds something (``load_state_dict``
into a fresh wrapper, whose first backward then re-lays out) it is one all-gather of the state per old
bucket: a collective, all ranks of the DP group take part.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from ..amp.clip import clip_grad_norm_ as _global_clip_grad_norm
from ..distributed import collectives as C
from ..ops.optimizer_step import adamw_step
from ..ops._checks import scalar_tensor
from . import memory as M
from . import full_state

_STATES = ("master", "exp_avg", "exp_avg_sq")
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


# ---------------------------------------------------------------------- guards on sharded gradients
def _metadata_functions() -> frozenset:
    """Tensor attributes that read no element: what a guard lets through (shape, dtype, hooks, ...)."""
    getters = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim", "is_cuda",
               "is_cpu", "is_meta", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested",
               "is_xpu", "is_mps", "names", "itemsize", "output_nr", "_version", "retains_grad",
               "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
               "data_ptr", "untyped_storage", "is_floating_point", "is_complex", "is_signed", "get_device",
               "requires_grad_", "register_hook", "register_post_accumulate_grad_hook", "__hash__", "_is_view",
               "__len__")
    out = set()
    for name in getters:
        desc = getattr(torch.Tensor, name, None)
        if desc is not None and hasattr(desc, "__get__"):
            out.add(desc.__get__)
    for name in methods:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out.add(fn)
    for name in ("grad", "data", "requires_grad"):
        out.add(getattr(torch.Tensor, name).__set__)
    out.add(torch.Tensor.grad.__delete__)
    return frozenset(out)


METADATA_FUNCTIONS = _metadata_functions()


def is_metadata(func) -> bool:
    try:
        return func in METADATA_FUNCTIONS
    except TypeError:        # an unhashable callable: not one of them
        return False


def guarded_in(args, kwargs, cls) -> list:
    """Instances of ``cls`` among ``args``/``kwargs`` (and one level into lists and tuples: foreach ops)."""
    found = []
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, cls):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, cls))
    return found


class _ShardedGrad(torch.Tensor):
    """What ``p.grad`` holds while ``p``'s gradient lives in a ZeRO shard.

    Its shape, dtype and device are ``p``'s; reading its elements (``torch.nn.utils.clip_grad_norm_``,
    ``p.grad.norm()``, printing it) raises a ``RuntimeError`` with :attr:`sharded_grad_message`, which names
    the parameter and the call that does it right, instead of returning a number that is this rank's
    local view. ``parallel_layers.amp.clip_grad_norm_`` checks the message too (it would read
    ``p.main_grad``)."""

    sharded_grad_message = "this gradient is sharded over the data-parallel group"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_metadata(func):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        guards = guarded_in(args, kwargs, _ShardedGrad)
        raise RuntimeError(guards[0].sharded_grad_message if guards else cls.sharded_grad_message)


def sharded_grad_view(t: torch.Tensor, message: str) -> _ShardedGrad:
    """A guard aliasing ``t`` (same memory: autograd keeps accumulating into it)."""
    g = t.as_subclass(_ShardedGrad)
    g.sharded_grad_message = message
    return g


def sharded_grad_placeholder(p: torch.Tensor, message: str) -> _ShardedGrad:
    """A guard shaped like ``p`` backed by one element (for parameters whose ``.grad`` holds nothing)."""
    with torch._C.DisableTorchFunctionSubclass():
        g = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(_ShardedGrad)
    g.sharded_grad_message = message
    return g


def sharded_grad_message(owner: str, name: str, shape, how: str) -> str:
    return (f"{owner}: the gradient of parameter {name!r} (shape {tuple(shape)}) is sharded over the "
            f"data-parallel group ({how}), so p.grad cannot be read: torch.nn.utils.clip_grad_norm_(model."
            f"parameters(), max_norm) would measure this rank's local values and its clipping would never "
            f"reach the step. Clip with optimizer.clip_grad_norm_(max_norm) between backward and step (the "
            f"global norm over every rank's shard; the coefficient is applied by the next step)")


# ---------------------------------------------------------------------- the torch.optim.Optimizer side
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


class _ZeroAdamW(torch.optim.Optimizer):
    """AdamW over a flat shard, as a ``torch.optim.Optimizer``: param groups, per-parameter step counts,
    one fused kernel call per run of the shard, clipping over the shards, group and step state by name.

    A subclass sets ``device``, ``backend``, ``master``/``exp_avg``/``exp_avg_sq``/``low`` and says where the
    shard's pieces and gradients are (``_module_named_params``, ``_shard_pieces_raw``, ``_grad_source``,
    ``_local_had_grads``, ``_consume_grads``, ``_agree_on_grads``, ``_grad_group``, ``_zero_grads``).
    """

    _owner = "ZeroOptimizer"

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

    def _named_param_groups(self) -> List[dict]:
        """``param_groups`` with parameter *names* (``"params"``): what checkpoints hold."""
        out = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            d["params"] = [self._names[id(p)] for p in g["params"]]
            out.append(d)
        return out

    def _load_param_groups(self, saved: Sequence[dict], where: str) -> None:
        """Hyper-parameters from :meth:`_named_param_groups` (same grouping required) or, for a state saved
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

    def _steps_by_name(self) -> Dict[str, int]:
        return {self._names[id(p)]: int(v) for p, v in zip(self._all_params, self._steps.tolist())}

    def _load_steps(self, steps: Optional[Dict[str, int]], default: int) -> None:
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
            self._wd_cache = None
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
        wd_vec = self._wd_vector() if any(r[4] is None for r in runs) else None
        for ((lr, beta1, beta2, eps, maximize), _), s, e, idx, wd in runs:
            if wd is None:                # decoupled decay first (skipped with the step: keep = 0)
                m = self.master[s:e]
                m.addcmul_(m, wd_vec[s:e] * keep, value=-lr)
                wd = 0.0
            adamw_step(self.master[s:e], grad[s:e], self.exp_avg[s:e], self.exp_avg_sq[s:e], lr=lr,
                       step=self._steps[idx:idx + 1], beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                       maximize=maximize, grad_scale=scale, found_inf=inf,
                       param_copy=None if self.low is None else self.low[s:e], backend=self.backend)
        self._after_step(stepped=True)
        return loss

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


class ZeroOptimizer(_ZeroAdamW):
    """Sharded AdamW over a ``DataParallel(module, dp_group, reduce_op="reduce_scatter")`` wrapper; a
    ``torch.optim.Optimizer`` that takes ``torch.optim.AdamW``'s param groups.

    ``stage=1``: optimizer state sharded. ``stage=2``: gradients sharded too (see :meth:`_release_grads`).

    Typical use (biases and norms without weight decay, a scheduler, clipping, accumulation)::

        dp = DataParallel(model, mesh.dp_group, reduce_op="reduce_scatter")
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        opt = ZeroOptimizer(dp, [{"params": decay, "weight_decay": 0.1},
                                 {"params": rest, "weight_decay": 0.0}], stage=2, lr=3e-4, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        for micro_batches in loader:
            for i, (x, y) in enumerate(micro_batches):      # gradient accumulation
                ctx = dp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
                with ctx:
                    loss_fn(dp(x), y).div(len(micro_batches)).backward()
            norm = opt.clip_grad_norm_(1.0)     # NOT torch.nn.utils.clip_grad_norm_: the grads are shards
            opt.step()
            opt.zero_grad()
            sched.step()

    ``params=None`` takes every parameter of the module in one group (``no_decay=[params]`` or a predicate
    ``(name, param) -> bool`` splits off a group without weight decay). Parameters must be the module's;
    frozen ones may be listed (they never change). ``step(grad_scale=, found_inf=, clip_coef=)``:
    ``grad_scale`` is the loss scale the gradients carry (divided out, torch's convention, as
    ``FusedAdamW``), ``clip_coef`` multiplies them, a nonzero ``found_inf`` skips the step with params,
    states and step counts left bit-identical. All three may be 1-element device tensors.

    Which parameters have a gradient: the ones a backward reached since the last step or ``zero_grad``
    (and whose ``.grad`` was not set to None since). With ``DataParallel(find_unused_parameters=True)``
    ranks may differ, and the step agrees on it with one small all-reduce; otherwise every synced backward
    reaches every parameter on every rank (DataParallel raises if not).
    """

    _owner = "ZeroOptimizer"

    def __init__(self, dp_module, params=None, *, stage: int, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 no_decay: NoDecay = None, backend: Optional[str] = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer: stage={stage!r} must be 1 (sharded optimizer state) or 2 (also "
                             f"sharded gradients); stage 3 shards parameters and needs its own wrapper")
        reduce_op = getattr(dp_module, "reduce_op", "reduce_scatter")
        # Stage 1 may also slice all-reduced gradients (on gloo, whose reduce-scatter is an emulation,
        # all-reduce is faster); stage 2 must not keep full gradients, so it needs the reduce-scatter.
        if reduce_op != "reduce_scatter" and not (stage == 1 and reduce_op == "all_reduce"):
            raise ValueError(f"ZeroOptimizer: the DataParallel wrapper uses reduce_op={reduce_op!r}; ZeRO stage "
                             f"{stage} needs reduce_op='reduce_scatter' (each rank reduces only the shard it steps)"
                             + ("" if stage == 2 else " or 'all_reduce' (stage 1 then slices its shard)"))
        self.dp, self.stage, self.backend = dp_module, stage, backend
        self.group = dp_module.dp_group
        self.dp_size, self.dp_rank = C.world_size(self.group), C.rank(self.group)
        self._module = getattr(dp_module, "module", dp_module)
        buckets = self._buckets()
        self.device = buckets[0].param_data.device
        self.param_dtype = buckets[0].param_data.dtype
        if any(b.param_data.dtype != self.param_dtype for b in buckets):
            raise ValueError("ZeroOptimizer: the buckets hold parameters of several dtypes "
                             f"{sorted({str(b.param_data.dtype) for b in buckets})}; use one param dtype")
        self._owned = {id(p) for p in dp_module.buffer.params}
        # fp32 params: p.grad is the buffer's view (autograd accumulates into it); else p.grad stays None
        self._direct = dp_module.buffer.param_dtype == dp_module.grad_dtype
        self._init_groups(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_decay=no_decay)
        self._use_broadcast = self.dp_size > 1 and dist.get_backend(self.group) == "gloo"
        self._grad_nbytes = 0      # stage 2: size of the grad buffer while it is materialised
        self._started = False      # has the state left its initial value (step taken or state loaded)?
        self._layout_key = None
        self._seen: set = set()    # ids of the parameters a backward reached since the last step/zero_grad
        self._callback_queued = False
        self._messages: Dict[int, str] = {}
        self._placeholders: Dict[int, torch.Tensor] = {}
        self._build(buckets)
        self._register_grad_hooks()
        if stage == 2:
            # The grad buffer only needs to exist from forward to the step; see _release_grads.
            self._hook = dp_module.register_forward_pre_hook(self._materialize_grads)
            self._release_grads()

    def _module_named_params(self):
        return list(self._module.named_parameters())

    def _check_param(self, p, name):
        if p.requires_grad and id(p) not in self._owned:
            raise ValueError(f"ZeroOptimizer: parameter {name!r} requires grad but is not in the DataParallel "
                             f"wrapper's gradient buffer (it was frozen when the wrapper was built); build "
                             f"DataParallel after setting requires_grad, or leave it out of the optimizer")

    # ------------------------------------------------------------------ gradients: record and guards
    def _register_grad_hooks(self) -> None:
        """Record which parameters a backward reaches and, at its end, put guards in ``p.grad``. The hooks
        run after DataParallel's (registered earlier), and the end-of-backward callback after its
        reduction. A weak reference: a dropped optimizer leaves inert hooks."""
        ref = weakref.ref(self)

        def on_grad(p):
            opt = ref()
            if opt is not None:
                opt._on_grad(p)

        def drop_placeholder(grad, pref):
            # before autograd accumulates into .grad: a placeholder holds nothing to add to
            p, opt = pref(), ref()
            if p is not None and opt is not None and isinstance(p.grad, _ShardedGrad):
                p.grad = None

        for p in self.dp.buffer.params:
            p.register_post_accumulate_grad_hook(on_grad)
            if not self._direct:
                pref = weakref.ref(p)
                p.register_hook(lambda grad, pref=pref: drop_placeholder(grad, pref))

    def _on_grad(self, p) -> None:
        self._seen.add(id(p))
        if not self._callback_queued:
            self._callback_queued = True
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: ref() is not None and ref()._after_backward())

    def _after_backward(self) -> None:
        """Guards in ``p.grad`` where reading it would be wrong. Not for fp32 parameters over an all-reduce
        (stage 1): there ``p.grad`` is the full averaged gradient and the step slices that very buffer, so
        ``torch.nn.utils.clip_grad_norm_`` is right and its clipping reaches the step."""
        self._callback_queued = False
        for p in self.dp.buffer.params:
            g = p.grad
            if self._direct:
                if not self._scattered():
                    continue
                if g is not None and not isinstance(g, _ShardedGrad) and g.data_ptr() == p.main_grad.data_ptr():
                    p.grad = sharded_grad_view(p.main_grad, self._message(p))
            elif g is None and id(p) in self._seen:
                if id(p) not in self._placeholders:
                    self._placeholders[id(p)] = sharded_grad_placeholder(p, self._message(p))
                p.grad = self._placeholders[id(p)]

    def _message(self, p) -> str:
        if id(p) not in self._messages:
            how = (f"ZeRO-{self.stage}: this rank holds the averaged gradient of its shard of the flat buffer only; "
                   f"p.grad and p.main_grad hold this rank's local, unaveraged values")
            self._messages[id(p)] = sharded_grad_message("ZeroOptimizer", self._names.get(id(p), "?"), p.shape, how)
        return self._messages[id(p)]

    def _local_had_grads(self) -> List[bool]:
        return [id(p) in self._seen and p.grad is not None for p in self._all_params]

    def _agree_on_grads(self) -> bool:
        return bool(getattr(self.dp, "find_unused_parameters", False)) and self.dp_size > 1

    def _grad_group(self):
        return self.group

    def _consume_grads(self) -> None:
        self._seen.clear()

    def _zero_grads(self, set_to_none: bool) -> None:
        if self.stage == 2 and self._grad_storage().nbytes() == 0:
            # released by the step: the next forward re-allocates the buffer zeroed, so what backward adds
            # starts from zero; only the placeholders of low-precision parameters go
            if not self._direct:
                for p in self.dp.buffer.params:
                    p.grad = None
            return
        self.dp.zero_grad()

    # ------------------------------------------------------------------ stage 2: gradient memory
    def _grad_storage(self):
        return self.dp.buffer.grad_buffer.untyped_storage()

    def _release_grads(self) -> None:
        """Stage 2: free the full grad buffer; only this rank's gradient shard persists.

        What remains between steps: ONE copy of the gradient shard, DataParallel's flat fp32 ``grad_shard``
        (``S`` elements), which the reduce-scatter wrote and the optimizer stepped on (zeroed here: the step
        consumed it). The full buffer (autograd accumulates into it, so it is also the buckets' send
        memory) is re-allocated, zeroed, at the next forward of the wrapper and lives through backward:
        peak memory during backward is that of stage 1; the saving is on everything that happens between
        steps (optimizer step, evaluation, a forward's activations). The storage is resized in place, so
        ``p.grad``/``p.main_grad`` views stay valid. Consequence: each step consumes the gradients (as if
        ``zero_grad`` followed every step).
        """
        st = self._grad_storage()
        if st.nbytes():
            self._grad_nbytes = st.nbytes()
            st.resize_(0)
        self.dp.grad_shard.zero_()

    def _materialize_grads(self, *_unused) -> None:
        st = self._grad_storage()
        if st.nbytes() == 0 and self._grad_nbytes:
            st.resize_(self._grad_nbytes)
            self.dp.buffer.grad_buffer.zero_()

    # ------------------------------------------------------------------ layout
    def _buckets(self) -> list:
        return list(self.dp.buffer.buckets)

    def _key(self, buckets) -> tuple:
        return tuple((b.param_data.data_ptr(), b.numel) for b in buckets)

    def _describe(self, buckets) -> List[dict]:
        """Layout of the buckets by parameter *name* (survives a fresh model and a rebuild)."""
        return [dict(numel=b.numel, params=[(self._names.get(id(p), f"<unnamed {i}>"), o, p.numel())
                                            for i, (p, o) in enumerate(zip(b.params, b.param_offsets))])
                for b in buckets]

    def _build(self, buckets) -> None:
        """(Re)derive shard bookkeeping and buffers from the current bucket layout."""
        self._bucket_list = buckets
        self._layout_key = self._key(buckets)
        self._layout = self._describe(buckets)
        self._offsets, pos = [], 0
        for b in buckets:
            self._offsets.append(pos)
            pos += b.shard_numel
        self.shard_numel = pos
        dev = self.device
        with torch.no_grad():
            params = torch.empty(pos, dtype=self.param_dtype, device=dev)
            for b, off in zip(buckets, self._offsets):
                s, e = b.shard_range(self.dp_rank)
                params[off:off + b.shard_numel].copy_(b.param_data[s:e])
            low = self.param_dtype != torch.float32
            self.master = params.float() if low else params
            # Staging for the low-precision copy the kernel writes; it is what the all-gather sends.
            self.low = params if low else None
            self.exp_avg = torch.zeros(pos, dtype=torch.float32, device=dev)
            self.exp_avg_sq = torch.zeros(pos, dtype=torch.float32, device=dev)
            # reduce_scatter: DataParallel.grad_shard already is the flat shard. Stage 1 over all_reduce with
            # several buckets: the shards are not adjacent in the grad buffer; they are gathered here.
            own = not self._scattered() and len(buckets) > 1
            self._grad_flat = torch.zeros(pos, dtype=torch.float32, device=dev) if own else None
        self._pieces_cache = None

    def _check_layout(self) -> None:
        buckets = self._buckets()
        if self._key(buckets) == self._layout_key:
            return
        old_layout, old = self._layout, (self.master, self.exp_avg, self.exp_avg_sq)
        self._build(buckets)
        if self._started:       # else nothing learned yet: the new shards start from the params
            self._remap(old_layout, old)

    def _remap(self, old_layout: List[dict], old: Sequence[torch.Tensor]) -> None:
        """Move this rank's state from ``old_layout`` to the current one (a collective over the DP group).

        Each old bucket's shards of the three states are all-gathered (one [shard, 3] gather per bucket),
        then every parameter's slice is copied to where the new layout puts it on this rank.
        """
        stacked = torch.stack([t.float() for t in old], dim=1)          # [S_old, 3]
        where: Dict[str, Tuple[torch.Tensor, int, int]] = {}
        pos = 0
        for desc in old_layout:
            n_shard = desc["numel"] // self.dp_size
            full = C.all_gather_dim0(stacked[pos:pos + n_shard], self.group)   # [numel, 3]
            pos += n_shard
            for name, o, n in desc["params"]:
                where[name] = (full, o, n)
        new = torch.stack([self.master, self.exp_avg, self.exp_avg_sq], dim=1)
        for b, off in zip(self._bucket_list, self._offsets):
            for p, start_p, start_s, length in b.param_shard_overlaps(self.dp_rank):
                name = self._names.get(id(p))
                if name not in where or where[name][2] != p.numel():
                    raise ValueError(f"ZeroOptimizer: parameter {name!r} ({p.numel()} elements) is not in the "
                                     f"saved layout with that size; was the state saved from another model?")
                full, o, _ = where[name]
                new[off + start_s:off + start_s + length] = full[o + start_p:o + start_p + length]
        self.master.copy_(new[:, 0])
        self.exp_avg.copy_(new[:, 1])
        self.exp_avg_sq.copy_(new[:, 2])
        if self.low is not None:
            self.low.copy_(self.master)

    # ------------------------------------------------------------------ step
    def _scattered(self) -> bool:
        return getattr(self.dp, "reduce_op", "reduce_scatter") == "reduce_scatter"

    def _grad_shard(self) -> torch.Tensor:
        """This rank's averaged gradient shard, flat fp32: DataParallel's ``grad_shard`` itself after a
        reduce-scatter; sliced from the all-reduced buffer otherwise (a view when there is one bucket)."""
        if self._scattered():
            g = self.dp.grad_shard
            if g.numel() != self.shard_numel or g.dtype != torch.float32:
                raise ValueError(f"ZeroOptimizer: DataParallel's grad_shard has {g.numel()} {g.dtype} elements, "
                                 f"expected {self.shard_numel} float32; build DataParallel with the default "
                                 f"grad_dtype (fp32 main grads)")
            return g
        views = []
        for b in self._bucket_list:
            s, e = b.shard_range(self.dp_rank)
            views.append(b.grad_data[s:e])
        if self._grad_flat is None:
            return views[0]
        for v, off in zip(views, self._offsets):
            self._grad_flat[off:off + v.numel()].copy_(v)
        return self._grad_flat

    _grad_source = _grad_shard

    def _shard_pieces_raw(self):
        return [(p, start_p, off + start_s, n) for b, off in zip(self._bucket_list, self._offsets)
                for p, start_p, start_s, n in b.param_shard_overlaps(self.dp_rank)]

    def _before_step(self) -> None:
        self._check_layout()

    def _after_step(self, stepped: bool) -> None:
        if self.stage == 2:
            self._release_grads()
        if stepped:
            self._started = True
            self._gather_params()

    def _gather_params(self) -> None:
        """All-gather every bucket's updated shard into ``param_data`` (model dtype), async then wait.

        On gloo torch's all-gather is ~4x slower than broadcasting the same bytes (measured: 24 MB, 2 ranks,
        50 ms vs 12 ms), so there each rank broadcasts its shard into place instead (same result); our
        ring all-gather (``distributed.ring``) measured no faster than the broadcasts in the ZeRO-1 step."""
        src = self.master if self.low is None else self.low
        if self._use_broadcast:
            for b, off in zip(self._bucket_list, self._offsets):
                mine = b.param_data[self.dp_rank * b.shard_numel:(self.dp_rank + 1) * b.shard_numel]
                mine.copy_(src[off:off + b.shard_numel])
                for r in range(self.dp_size):
                    C.broadcast(b.param_data[r * b.shard_numel:(r + 1) * b.shard_numel], r, self.group)
            return
        works = []
        for b, off in zip(self._bucket_list, self._offsets):
            _, work = C.all_gather_dim0(src[off:off + b.shard_numel], self.group, out=b.param_data, async_op=True)
            if work is not None:
                works.append(work)
        for w in works:
            w.wait()

    # ------------------------------------------------------------------ checkpoints
    def shard_pieces(self) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """Where each parameter's state lives on this rank: ``(param, start in the parameter's flat view,
        start in this rank's flat state (master, exp_avg, exp_avg_sq), length)`` for every piece of a
        parameter in this rank's shard (the universal checkpoint reads and writes the state through it)."""
        self._check_layout()
        return self._shard_pieces_raw()

    def set_steps_taken(self, n: int) -> None:
        """Resume every step count (AdamW's bias correction) at ``n``; the state counts as learned."""
        super().set_steps_taken(n)
        self._started = True

    def _named_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return [(self._names.get(id(p), f"<unnamed {i}>"), p) for b in self._bucket_list
                for i, p in enumerate(b.params)]

    def full_state_dict(self) -> dict:
        """The whole state, whatever the dp size (:mod:`.full_state`): every parameter's fp32 master
        weights and AdamW moments in its shape, by the module's parameter name, with the step counts and
        ``param_groups`` (parameters by name). A collective over the dp group; :meth:`load_full_state_dict`
        loads it at any dp size or bucket layout (resuming on more or fewer ranks)."""
        return full_state.full_state_dict(self, self._named_params, self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load a :meth:`full_state_dict` saved at any dp size (no collective): this rank's shard of the
        masters and moments, the parameters (the masters in the parameters' dtype), the step counts, and
        ``param_groups`` when the dict has them."""
        named = full_state.load_full_state_dict(self, state, self._named_params, "ZeroOptimizer")
        for name, p in named:                       # every rank holds the full parameters in stages 1 and 2
            p.copy_(state["state"][name]["master"].to(device=p.device, dtype=p.dtype))

    def state_dict(self) -> dict:
        """This rank's shard of the state (clones), the layout it belongs to, ``param_groups`` (parameters
        by name) and every parameter's step count. Save one per rank."""
        self._check_layout()
        return {"format": STATE_FORMAT, "stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "param_groups": self._named_param_groups(), "layout": self._layout,
                "step": self._step.clone(), "steps": self._steps_by_name(), "started": self._started,
                **{k: getattr(self, k).clone() for k in _STATES}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` saved by the same DP rank of a run with the same DP size and param
        groups. A state saved before param groups existed (one group, one step count) loads too: its
        lr/betas/eps go to every group, its weight decay to the groups that decay, its count to every
        parameter.

        If the saved bucket layout differs from the current one (e.g. it was saved after the buffer's
        rebuild), the state is moved over with a collective: call it on every rank of the DP group.
        Parameters are left as they are: load the model's own state dict for them."""
        if state.get("dp_size") != self.dp_size or state.get("dp_rank") != self.dp_rank:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state saved by dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into dp rank {self.dp_rank} of {self.dp_size}; "
                             f"resume with the same data-parallel size and give each rank its own file")
        self._check_layout()
        self._load_param_groups(state["param_groups"], "ZeroOptimizer.load_state_dict")
        self._step.copy_(state["step"])
        self._load_steps(state.get("steps"), int(state["step"].item()))
        tensors = [state[k].to(self.device) for k in _STATES]
        if state["layout"] == self._layout:
            self.master.copy_(tensors[0])
            self.exp_avg.copy_(tensors[1])
            self.exp_avg_sq.copy_(tensors[2])
            if self.low is not None:
                self.low.copy_(self.master)
        else:
            self._remap(state["layout"], tensors)
        self._started = True

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict:
        """Bytes this rank holds now (measured on the tensors' storages, padding included), per real
        parameter, beside the ZeRO paper's bytes per parameter for this stage.

        ``param_bytes``: the flat parameter buffer (full model, every rank). ``grad_bytes``: gradient memory
        that persists between steps: DataParallel's reduced fp32 shard (the one copy the optimizer steps on),
        plus, stage 1 only, the full grad buffer. ``comm_bytes``: communication buffers alive now (the
        low-precision pack/reduce-scatter buffers live only from a bucket's launch to its wait: 0 between
        steps). ``optimizer_bytes``: fp32 master, exp_avg, exp_avg_sq shards. ``staging_bytes``: the
        low-precision param-copy shard (bf16/fp16 models) and, stage 1 over all_reduce with several
        buckets, the flat grad shard gathered from the buffer.
        ``transient_grad_bytes``: stage 2's full grad buffer, allocated from forward to the step only.
        """
        self._check_layout()
        buckets = self._bucket_list
        num_params = sum(p.numel() for b in buckets for p in b.params)
        grad_mem = [self.dp.buffer.grad_buffer, getattr(self.dp, "grad_shard", None)]   # released: 0 bytes
        staged = [t for pair in getattr(self.dp, "_staged", {}).values() for t in pair]
        rep = {"stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank, "num_params": num_params,
               "padded_numel": sum(b.numel for b in buckets), "shard_numel": self.shard_numel,
               "param_bytes": M.storage_bytes(b.param_data for b in buckets),
               "grad_bytes": M.storage_bytes(grad_mem),
               "comm_bytes": M.storage_bytes(staged),
               "optimizer_bytes": M.storage_bytes([self.master, self.exp_avg, self.exp_avg_sq]),
               "staging_bytes": M.storage_bytes([self.low, self._grad_flat]),
               "transient_grad_bytes": self._grad_nbytes if self.stage == 2 else 0}
        rep["total_bytes"] = sum(rep[k] for k in ("param_bytes", "grad_bytes", "comm_bytes", "optimizer_bytes",
                                                  "staging_bytes"))
        per = {"params": "param", "grads": "grad", "comm": "comm", "optimizer": "optimizer",
               "staging": "staging", "total": "total"}
        rep["bytes_per_param"] = {k: rep[f"{v}_bytes"] / num_params for k, v in per.items()}
        rep["paper_bytes_per_param"] = M.paper_bytes_per_param(self.stage, self.dp_size)
        return rep


__all__ = ["ZeroOptimizer", "step_multipliers"]
