"""Flat buffers behind the fused optimizers, and the optimizer base class that drives them.

Why flat buffers: ``torch.optim.AdamW(fused=True)`` pays host work for every tensor on every step
(~18 us per parameter on a small CPU), so a model with thousands of small parameters spends its
optimizer step in Python and dispatch. Here each param group is split by (device, dtype) into a
:class:`FlatBuffer` that owns, back to back in one allocation each:

- the fp32 master weights (``p.data`` becomes a view into them for fp32 params; for bf16/fp16 params
  ``p.data`` is a view into a flat low-precision buffer that the kernel rewrites as ``param_copy``),
- the gradients (``p.grad`` is set to a view, so autograd accumulates straight into the flat buffer),
- the optimizer states (fp32), and one fp32 step counter per parameter.

A step is then one fused kernel call per buffer in the common case. The per-parameter host work left is
one check that every ``p.grad`` is still its expected view: a loop in C++ over stored ``TensorImpl``
pointers (``parallel_layers._C.GradViewChecker``) when the extension is available, else two C-level
passes over the parameter list (read ``p.grad``, compare with the expected view).

Per-parameter step counts. torch skips parameters whose ``.grad`` is None (no state change, no weight
decay), so step counts (bias correction) can differ between parameters. Counts live on the device (a
skipped AMP step must not need a host sync), so the host tracks which parameters are *known* to share
a count: an id per parameter, refined every time the set of parameters with gradients changes. Two
parameters with equal ids took part in exactly the same steps, hence have the same count. The kernel
runs over maximal runs of consecutive parameters that have gradients and equal ids; when the pattern of
present gradients repeats (every training loop), the runs are reused without any per-parameter work.
"""
from __future__ import annotations

import operator
from itertools import chain
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import _extension
from ..ops import BACKENDS, backend_kernel, pack_bucket, scalar_tensor
from ..ops.bucket import reference_pack_bucket

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_grad_of = operator.attrgetter("grad")
_ALL = True  # participation pattern meaning "every parameter has a gradient"
# Parameter types whose Python ``.grad`` getter is the plain one, so ``p.grad is v`` is exactly "the grad's
# TensorImpl is v's" (what GradViewChecker compares). Other subclasses may override the getter.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_mode_enabled = torch._C._is_torch_function_mode_enabled


class FlatBuffer:
    """Parameters of one param group that share a (device, dtype), packed into flat storage."""

    def __init__(self, params: List[torch.Tensor], backend: Optional[str] = None):
        self.params = params
        self.device, self.dtype = params[0].device, params[0].dtype
        self.backend = backend
        self.shapes = [p.shape for p in params]
        self.offsets, self.ends, pos = [], [], 0
        for p in params:
            self.offsets.append(pos)
            pos += p.numel()
            self.ends.append(pos)
        self.numel = pos
        with torch.no_grad():
            data = torch.empty(pos, dtype=self.dtype, device=self.device)
            srcs = [p.detach().contiguous() for p in params]
            pack_bucket(srcs, data, offsets=self.offsets, backend=backend)
            del srcs
            self.low = None if self.dtype == torch.float32 else data
            self.master = data if self.low is None else data.float()
            # Kept to notice a wrapper re-pointing p.data later (see ensure_params_in_place).
            self.param_views = self._views(data)
            for p, view in zip(params, self.param_views):
                p.data = view
        self.grad = torch.zeros(pos, dtype=self.dtype, device=self.device)
        self.grad_views = self._views(self.grad)
        self.states: Dict[str, torch.Tensor] = {}
        self.steps = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        self.started = [False] * len(params)   # has an entry in optimizer.state
        self._ids: Optional[list] = None        # None: every parameter has the same step count
        self._last_has = None                   # participation pattern the cached runs belong to
        self._runs: List[Tuple[int, int]] = []
        # C++ fast path of the "all grads are their views" check (see _all_views_fast), built on first use;
        # False: unavailable. _checker_for: the (params, grad_views, len(params)) it was built for, so
        # assigning new lists to params / grad_views rebuilds it (replace the lists, don't edit them).
        self._checker = None
        self._checker_for: Optional[tuple] = None
        self._checker_builds = 0
        self._slow_collects = 0
        # False: always check the gradients in Python (a parameter type whose ``.grad`` getter the C++
        # check cannot see through, or debugging)
        self.fast_check = True

    # ------------------------------------------------------------------ read-only views of the fast path
    @property
    def kernel_runs(self) -> List[Tuple[int, int]]:
        """The parameter runs ``(i, j)`` the last step ran the kernel on (one run: every parameter had a grad)."""
        return list(self._runs)

    @property
    def slow_collects(self) -> int:
        """How many steps gathered the gradients in Python (fresh grads after ``set_to_none``, a missing
        grad, a torch function mode, or no C++ check) instead of the C++ all-views check."""
        return self._slow_collects

    @property
    def fast_check_available(self) -> bool:
        """The C++ all-views check is built for the current ``params`` / ``grad_views``."""
        return self._checker is not None and self._checker is not False

    @property
    def checker_builds(self) -> int:
        """How many times the C++ check was (re)built: once, plus once per new ``params``/``grad_views`` list."""
        return self._checker_builds

    # ------------------------------------------------------------------ views and lazily made states
    def _views(self, flat: torch.Tensor) -> List[torch.Tensor]:
        return [flat[a:b].view(s) for a, b, s in zip(self.offsets, self.ends, self.shapes)]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        return flat[self.offsets[i]:self.ends[i]].view(self.shapes[i])

    def state(self, name: str) -> torch.Tensor:
        """The flat fp32 state ``name``, allocated (zeros) the first time it is asked for."""
        buf = self.states.get(name)
        if buf is None:
            buf = self.states[name] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return buf

    def span(self, i: int, j: int) -> slice:
        """Element range of parameters ``i .. j-1``."""
        return slice(self.offsets[i], self.ends[j - 1])

    # ------------------------------------------------------------------ parameters
    def ensure_params_in_place(self) -> None:
        """Take back parameters that something re-pointed out of the flat storage since the last step.

        Wrappers that lay parameters out in buffers of their own do that: ``DataParallel`` when it is
        applied after the optimizer was built, and at its one-time bucket rebuild after the first backward.
        The step would otherwise update a copy the model no longer reads. The parameter's current value is
        copied into its flat slot and ``p.data`` points there again (for bf16/fp16 params the fp32 master,
        which the wrapper never saw, is kept). Cost per step when nothing moved: one pointer comparison per
        parameter in C++ (a Python loop without the extension).
        """
        ck = self._checker_now()
        if ck is not False and ck.params_in_place():
            return
        moved = [i for i, (p, v) in enumerate(zip(self.params, self.param_views)) if p.data_ptr() != v.data_ptr()]
        if not moved:
            return
        with torch.no_grad():
            for i in moved:
                p, view = self.params[i], self.param_views[i]
                view.copy_(p.data)
                p.data = view

    # ------------------------------------------------------------------ gradients
    def collect(self, on_first: Callable[["FlatBuffer", int], None]) -> List[Tuple[int, int]]:
        """Point every present ``.grad`` at the flat gradient buffer; return runs ``(i, j)`` to step.

        Gradients autograd allocated afresh (after ``zero_grad(set_to_none=True)``) are copied in with
        one ``pack_bucket`` call. ``on_first(self, i)`` is called for a parameter's first gradient.
        """
        if self._all_views_fast():
            if self._last_has is not _ALL:
                self._refine(_ALL, on_first)
        else:
            self._collect_slow(on_first)
        return self._runs

    def _all_views_fast(self) -> bool:
        """True only if every ``p.grad`` is exactly its view, checked in C++; False: unknown, use Python.

        Same answer as ``p.grad is view`` for all params: a tensor's Python object and its ``TensorImpl``
        are one-to-one. Not used while a torch function mode is active (it could intercept ``p.grad``).
        """
        if _mode_enabled() or not self.fast_check:
            return False
        ck = self._checker_now()
        return ck is not False and ck.all_views()

    def _checker_now(self):
        """The C++ checker for the current ``params`` / ``grad_views``; False if unavailable."""
        key, params = self._checker_for, self.params
        if key is None or key[0] is not params or key[1] is not self.grad_views or key[2] != len(params):
            return self._build_checker()   # first use, or params / grad_views were replaced
        return self._checker

    def _build_checker(self):
        """(Re)build the C++ checker for the current ``params`` / ``grad_views``; False if unavailable."""
        params, views = self.params, self.grad_views
        self._checker_for = (params, views, len(params))
        self._checker_builds += 1
        ext = _extension.load()[0]
        ck = False
        if ext is not None and hasattr(ext, "GradViewChecker") and len(params) == len(views) \
                and all(type(p) in _PLAIN_TYPES for p in params):
            try:
                ck = ext.GradViewChecker(list(params), list(views), list(self.param_views))
            except Exception:   # never let the fast path break a step
                ck = False
        self._checker = ck
        return ck

    def _collect_slow(self, on_first) -> None:
        """The Python path of :meth:`collect` (some grad is not its view, or no C++ checker)."""
        self._slow_collects += 1
        grads = list(map(_grad_of, self.params))
        if all(map(operator.is_, grads, self.grad_views)):
            has = _ALL
        else:
            foreign = [i for i, (g, v) in enumerate(zip(grads, self.grad_views)) if g is not None and g is not v]
            if foreign:
                self._pack(foreign, grads)
            has = tuple(g is not None for g in grads)
            if all(has):
                has = _ALL
        if has != self._last_has:
            self._refine(has, on_first)

    def _pack(self, idx: List[int], grads: list) -> None:
        srcs = []
        for i in idx:
            g = grads[i]
            if g.layout != torch.strided:
                raise ValueError(f"parameter {i} of a {self.dtype} group has a {g.layout} gradient; the fused "
                                 f"optimizers need dense gradients (use torch.optim.SparseAdam for sparse ones)")
            if g.dtype != self.dtype or g.device != self.device:
                raise TypeError(f"parameter {i} ({self.dtype} on {self.device}) has a {g.dtype} gradient on "
                                f"{g.device}; gradients must match their parameter")
            srcs.append(g if g.is_contiguous() else g.contiguous())
        # The offsets are ours and every source was checked above, so the kernel of ops.pack_bucket is
        # called directly: the op's per-tensor argument checks would cost more than the copy itself.
        pack = backend_kernel("pack_bucket", self.device, self.backend, reference_pack_bucket)
        pack(srcs, self.grad, [self.offsets[i] for i in idx], torch.ones(1, device=self.device))
        views, params = self.grad_views, self.params
        for i in idx:
            params[i].grad = views[i]

    def _refine(self, has, on_first) -> None:
        """Split the step-count classes by this call's participation and rebuild the runs."""
        n = len(self.params)
        part = [True] * n if has is _ALL else has
        for i in range(n):
            if part[i] and not self.started[i]:
                on_first(self, i)
                self.started[i] = True
        old = self._ids if self._ids is not None else [0] * n
        relabel: dict = {}
        ids = [relabel.setdefault((o, h), len(relabel)) for o, h in zip(old, part)]
        self._ids = None if len(relabel) == 1 else ids
        runs, i = [], 0
        while i < n:
            if not part[i]:
                i += 1
                continue
            j = i + 1
            while j < n and part[j] and ids[j] == ids[i]:
                j += 1
            runs.append((i, j))
            i = j
        self._runs, self._last_has = runs, has

    def zero_grad(self) -> None:
        """``zero_grad(set_to_none=False)``: present grads become zeroed views (one memset)."""
        if self._all_views_fast():
            self.grad.zero_()
            return
        grads = list(map(_grad_of, self.params))
        if not all(map(operator.is_, grads, self.grad_views)):
            for p, g, v in zip(self.params, grads, self.grad_views):
                if g is not None and g is not v:
                    p.grad = v
        self.grad.zero_()

    # ------------------------------------------------------------------ loading
    def reset(self) -> None:
        """Forget all state (before a load): zero steps and states, master weights from the params."""
        self.steps.zero_()
        for buf in self.states.values():
            buf.zero_()
        if self.low is not None:
            self.master.copy_(self.low)
        self.started = [False] * len(self.params)

    def rebuild_history(self) -> None:
        """After loaded step counts were written: parameters with equal counts share a class (one sync)."""
        counts = self.steps.tolist()
        self._ids = None if len(set(counts)) <= 1 else counts
        self._last_has = None


class FlatOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose param groups live in :class:`FlatBuffer` s.

    Subclasses define ``_check_group(group)`` (raise on bad hyper-parameters), ``_state_entry(fb, i)``
    (the torch-format state dict of one parameter, as views into ``fb``), ``_load_entry(fb, i, entry)``
    (write a loaded entry into ``fb``) and ``_update(group, fb, i, j, scale, found_inf, cache)`` (run the
    kernel on parameters ``i .. j-1`` of ``fb``, whose step counters already hold the number of this
    update; ``scale`` and ``found_inf`` are 1-element float32 tensors on ``fb``'s device).

    ``self.state[p]`` entries are views into the flat state buffers, created when ``p`` first has a
    gradient at a step (as torch creates them), so ``state_dict()`` is torch's format with no copying;
    like torch's, it returns references to live state: copy or save it before stepping on. Pickling the
    optimizer object itself is not supported (``torch.optim.Optimizer.__getstate__`` drops the buffers);
    save ``state_dict()`` instead.
    """

    _name = "FlatOptimizer"

    def __init__(self, params, defaults: dict, backend: Optional[str] = None):
        if backend is not None and (not isinstance(backend, str) or backend.lower() not in BACKENDS + ("auto",)):
            raise ValueError(f"{self._name}: backend={backend!r}; choose one of {BACKENDS}, 'auto' or None")
        self._backend = backend
        self._flats: List[List[FlatBuffer]] = []   # aligned with self.param_groups
        self._where: Dict[torch.Tensor, Tuple[FlatBuffer, int]] = {}
        super().__init__(params, defaults)
        # torch.amp.GradScaler then passes `grad_scale` / `found_inf` instead of unscaling and syncing.
        self._step_supports_amp_scaling = True

    @property
    def flat_buffers(self) -> Tuple[Tuple[FlatBuffer, ...], ...]:
        """The flat buffers of each param group (one per (device, dtype) in it), in group order."""
        return tuple(tuple(flats) for flats in self._flats)

    # ------------------------------------------------------------------ groups
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            buckets: Dict[tuple, list] = {}
            for i, p in enumerate(group["params"]):
                if p.layout != torch.strided:
                    raise ValueError(f"{self._name}: params[{i}] of group {len(self.param_groups) - 1} is a "
                                     f"{p.layout} tensor; only dense parameters are supported")
                if p.dtype not in SUPPORTED_DTYPES:
                    raise TypeError(f"{self._name}: params[{i}] has dtype {p.dtype}; supported: float32, "
                                    f"bfloat16, float16")
                buckets.setdefault((p.device, p.dtype), []).append(p)
        except Exception:
            self.param_groups.pop()
            raise
        flats = [FlatBuffer(ps, self._backend) for ps in buckets.values()]
        for fb in flats:
            for i, p in enumerate(fb.params):
                self._where[p] = (fb, i)
        self._flats.append(flats)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    # ------------------------------------------------------------------ step
    def _on_first(self, fb: FlatBuffer, i: int) -> None:
        self.state[fb.params[i]] = self._state_entry(fb, i)

    def _prepare(self, group: dict, fb: FlatBuffer) -> None:
        """Hook run before a buffer's gradients are collected (lazy state allocation)."""

    def _scalar(self, name: str, value, device) -> torch.Tensor:
        return scalar_tensor(f"{type(self).__name__}.step", name, value, device, convert=True)

    def _amp(self, device, grad_scale, found_inf, cache: dict):
        """(gradient multiplier, found_inf, step increment) on ``device``, all without host syncs.

        ``grad_scale`` follows torch's fused optimizers: the factor the gradients were *multiplied* by
        (the loss scale), so the kernel is given its reciprocal.
        """
        if device not in cache:
            if grad_scale is None:
                scale = torch.ones(1, device=device)
            else:
                scale = torch.reciprocal(self._scalar("grad_scale", grad_scale, device))
            if found_inf is None:
                cache[device] = (scale, torch.zeros(1, device=device), 1)
            else:
                inf = self._scalar("found_inf", found_inf, device)
                cache[device] = (scale, inf, (inf == 0).to(torch.float32))
        return cache[device]

    def _kernel(self, op: str, device: torch.device, reference, cache: dict):
        """The backend implementation of ``op``'s kernel contract (see ``parallel_layers.ops``).

        The optimizer calls kernels directly instead of the public ops: its buffers are consistent by
        construction and its hyper-parameters are checked once per group by ``_check_group``, so the
        op's per-call checks would only add host time per run of parameters.
        """
        key = (op, device)
        if key not in cache:
            cache[key] = backend_kernel(op, device, self._backend, reference)
        return cache[key]

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None):
        """One update of every parameter that has a gradient.

        ``grad_scale`` (loss scale the gradients carry) and ``found_inf`` (nonzero: skip the step; params,
        states and step counts stay bit-identical) default to the attributes ``torch.amp.GradScaler``
        sets on optimizers with ``_step_supports_amp_scaling``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is None:
            grad_scale = getattr(self, "grad_scale", None)
        if found_inf is None:
            found_inf = getattr(self, "found_inf", None)
        for name, value in (("grad_scale", grad_scale), ("found_inf", found_inf)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor))):
                raise TypeError(f"{self._name}.step: {name} must be a number or a 1-element tensor, "
                                f"got {type(value).__name__}")
        cache: dict = {}
        for k, (group, flats) in enumerate(zip(self.param_groups, self._flats)):
            if len(group["params"]) != sum(len(fb.params) for fb in flats):
                raise RuntimeError(f"{self._name}: param_groups[{k}]['params'] was changed in place; add "
                                   f"parameters with add_param_group instead")
            self._check_group(group)
            for fb in flats:
                self._prepare(group, fb)
                fb.ensure_params_in_place()
                runs = fb.collect(self._on_first)
                if not runs:
                    continue
                scale, inf, inc = self._amp(fb.device, grad_scale, found_inf, cache)
                for i, j in runs:
                    fb.steps[i:j].add_(inc)
                    self._update(group, fb, i, j, scale, inf, cache)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; ``set_to_none=False`` is the fast path (grads stay views, one memset per buffer)."""
        if set_to_none:
            return super().zero_grad(set_to_none=True)
        for fb in chain.from_iterable(self._flats):
            fb.zero_grad()

    # ------------------------------------------------------------------ state dict
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this class or of the torch optimizer it replaces.

        torch's loader would cast states to the parameter dtype (lossy for the fp32 states of bf16/fp16
        params), so it only handles the param groups here; the states are copied into the flat buffers
        and ``self.state`` is rebuilt as views of them.
        """
        state_dict = dict(state_dict)
        saved_state = state_dict.get("state", {})
        saved_groups = state_dict["param_groups"]
        state_dict["state"] = {}
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            self._check_group(group)
        id_map = dict(zip(chain.from_iterable(g["params"] for g in saved_groups),
                          chain.from_iterable(g["params"] for g in self.param_groups)))
        flats = list(chain.from_iterable(self._flats))
        for fb in flats:
            fb.reset()
        with torch.no_grad():
            for key, entry in saved_state.items():
                p = id_map.get(key)
                if p is None:
                    self.state[key] = entry   # as torch: state that belongs to no param is kept as is
                    continue
                fb, i = self._where[p]
                if entry:
                    self._load_entry(fb, i, entry)
                    fb.started[i] = True
        for fb in flats:
            fb.rebuild_history()
            for i, started in enumerate(fb.started):
                if started:
                    self.state[fb.params[i]] = self._state_entry(fb, i)

    def _load_tensor(self, fb: FlatBuffer, i: int, flat: torch.Tensor, value, key: str) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() != fb.ends[i] - fb.offsets[i]:
            raise ValueError(f"{self._name}.load_state_dict: state '{key}' of a parameter of shape "
                             f"{tuple(fb.shapes[i])} has {getattr(value, 'shape', type(value).__name__)}")
        flat[fb.offsets[i]:fb.ends[i]].copy_(value.reshape(-1))

    def _load_common(self, fb: FlatBuffer, i: int, entry: dict, default_step: float) -> None:
        step = entry.get("step", default_step)
        fb.steps[i].copy_(step if isinstance(step, torch.Tensor) else torch.tensor(float(step)))
        master = entry.get("master_param")
        if fb.low is not None and master is not None:
            self._load_tensor(fb, i, fb.master, master, "master_param")

    def _common_entry(self, fb: FlatBuffer, i: int) -> dict:
        entry = {"step": fb.steps[i]}
        if fb.low is not None:   # fp32 master weights, so a reload continues bit-identically
            entry["master_param"] = fb.view(fb.master, i)
        return entry

    def master_params(self) -> List[torch.Tensor]:
        """The fp32 master weights, one view per parameter (the parameters themselves when fp32)."""
        return [fb.view(fb.master, i) for fb in chain.from_iterable(self._flats) for i in range(len(fb.params))]

    def refresh_master_weights(self) -> None:
        """Copy bf16/fp16 parameters into their fp32 master weights (after editing params in place)."""
        with torch.no_grad():
            for fb in chain.from_iterable(self._flats):
                if fb.low is not None:
                    fb.master.copy_(fb.low)
