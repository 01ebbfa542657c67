"""ZeRO stage 3: parameters sharded over the data-parallel group, gathered one unit at a time.

Layout (:mod:`.stage3_units`). The module is cut into *units* (default: every element of every
``nn.ModuleList``, consecutive small ones merged up to ``min_unit_numel`` elements, plus the root for the
parameters left over). A unit's parameters are flattened into one buffer padded to a multiple of
``16 * dp`` elements; rank r keeps shard r of every unit, all of them concatenated in ONE persistent
tensor, ``shard_buffer``: that is the only persistent parameter storage. The gradient shards (fp32, or
the parameter dtype with ``grad_dtype=``) live in ``grad_buffer``, same layout, so an optimizer steps every
unit with one fused kernel call.

Mixed precision (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, what torchtitan trains
Llama 3 with): the shard, and so every all-gather, is in the parameter dtype; a unit's full gradient buffer is
in ``reduce_dtype`` (default: fp32 for bf16/fp16 parameters), so the gradients autograd makes in bf16 are added
into fp32, summed over micro-batches and reduce-scattered in fp32, and averaged into the fp32 gradient shard.
``reduce_dtype=`` the parameter dtype reduces in it (half the traffic and buffer; each sum rounded to bf16).

FP8 all-gather (``fp8_gather=True``, FSDP2's float8 all-gather; :mod:`.stage3_fp8`): the weights of FP8 layers
with per-tensor current scaling are cast to FP8 on each rank, with the whole weight's scale (the per-shard
amaxes max-all-reduced, one small all-reduce per unit gather), all-gathered as 1 byte an element beside the
unit's other parameters in the parameter dtype, and handed to the layers, which use them instead of quantizing
the gathered weight: the same FP8 bytes, so the same training bit for bit, with less traffic
(:attr:`ZeroStage3.all_gather_bytes`). Gradients are reduced as before. The weights' full-precision elements
are not gathered then (reading them raises); :meth:`gathered_parameters` gathers everything in full.

Per unit and step (``timeline`` records each event with a timestamp, so tests can prove the overlap):

* forward pre-hook (of the unit's first module to run): wait for (or issue) the unit's all-gather into
  its full buffer, whose views *are* the module's parameters (no copy-out: the collective writes straight
  into them), then launch the all-gather of the next unit, asynchronously, so it runs while this unit
  computes (prefetch).
* forward hook: hook the module's outputs (the first gradient to reach any of the unit's is the unit's
  *pre-backward*); after the unit's last module, free the full buffer (``untyped_storage().resize_(0)``:
  the parameter views keep their shapes, autograd's saved references stay valid and see the data again
  once it is re-gathered).
* pre-backward: gather again (prefetched by the unit after it) and prefetch the unit before it. Each
  gradient autograd makes is added into the unit's flat gradient buffer (in ``reduce_dtype``) and dropped at
  once.
* post-backward (post-accumulate-grad hooks: once every parameter of the unit has its gradient): free
  the parameters, reduce the full gradient buffer and add this rank's averaged slice into its fp32
  shard (``grad_buffer``: allocated at the first reduction, freed by ``zero_grad()``). At most one
  reduction is in flight: the next one waits for it, then frees its buffer.
* end of backward (an autograd callback): reduce what is left (parameters that got no gradient count
  as zero), wait for everything, free everything, including the root's parameters.

The root unit stays gathered from its forward pre-hook into its backward: its parameters (in the GPT:
embeddings, final LayerNorm, tied LM head) are used both first and last. With ``free_root_early`` (default)
saved-tensor hooks around the forward count the saved tensors that view them, and the first non-root
pre-backward after the last of them was used frees them (embedding backward reads no weight).

Memory (measured, GPT V8192 L6 d512, 2 gloo ranks): the peak is in the first block's backward. Bounded
there: the root's gradients are kept as autograd's tensors until the root's last one (no root-sized
buffer through backward); a unit's gradient buffer is allocated only after the previous unit's reduction
finished (one gradient buffer alive); the fp32 gradient shard is not zeroed at allocation, each unit's
slice is written by its first reduction, so its pages become resident as activations are freed.
At the end of the root's forward the unit that ran last is prefetched, so backward starts with its gather
in flight.

Activation checkpointing (``torch.utils.checkpoint.checkpoint(unit, x, use_reentrant=False)`` or a
checkpoint inside the unit): the recomputation runs after the unit's pre-backward, so its parameters are
gathered; the hooks see that the unit is in backward and neither free nor prefetch.

Collectives (through ``parallel_layers.distributed.collectives``): an all-gather per unit and a
reduce-scatter of its gradients, native on NCCL and a ring of sends/receives on gloo (torch's gloo
versions are emulations slower than an all-reduce of the full buffer; before the ring, this module
all-reduced instead: measured with ``python -m benchmarks.zero3``, 2 ranks, the ring made the step
929 -> 821 ms and the peak 237 -> 233 MB).

Held mode (:meth:`gather_all` / :meth:`reduce_scatter_and_free`), for ZeRO-3 inside a pipeline: the
per-unit schedule above would gather and free every unit once per microbatch (torch issues #164756,
#165467). Instead ``gather_all()`` gathers every unit once and turns the hooks off: forwards and backwards
of all microbatches run on the full parameters and their gradients accumulate in full across them: in
autograd's ``.grad`` when ``reduce_dtype`` is the parameter dtype; else (bf16 parameters, fp32 reduction) each
micro-batch's ``.grad`` is added into the unit's ``reduce_dtype`` gradient buffer and dropped (a
post-accumulate-grad hook), and ``p.grad`` reads that accumulation. Either way :meth:`accumulated_grad` says
where it is, and code summing gradients before the reduction edits it there in place (a pipeline's tied
weights, tp-partial and sequence-parallel gradients, e.g. ``ModelStage.finish_grads``). Then
``reduce_scatter_and_free()`` reduces each unit's gradients once (averaged over dp into ``grad_buffer``,
through the same reduction path as above), drops them, frees every full buffer and turns the hooks back
on (:meth:`release_gathered` leaves without collectives, after an error). Peak memory is then a whole
stage's full parameters and gradients (the gradients in ``reduce_dtype``: 4 bytes per parameter with bf16
parameters reduced in fp32, against 2 for the parameters), for the length of one step.

Gradient accumulation (:meth:`no_sync`, as DDP's): inside it a unit's backward adds into its full gradient
buffer and keeps it, with no reduce-scatter; the first backward outside it adds its own gradients and
reduces the sum once. Memory: every unit's full gradient buffer lives across the micro-batches (FSDP's
no_sync costs the same); the gradients accumulate in ``reduce_dtype``.

Parameters between steps (and whenever their unit is not gathered) hold no elements: each is a
``_ShardedParameter`` (:mod:`.sharded_param`), whose metadata is always there but whose elements can only
be read while its unit is gathered (its forward or backward, or inside :meth:`gathered_parameters`); any
other read raises a ``RuntimeError`` naming the parameter and that context manager (rather than reading
freed memory, which would crash the process); ``p.grad`` after a backward is a guard too.

Which parameters got a gradient since the last step is recorded per rank (the optimizer leaves the others
untouched, as torch does). Ranks that may differ in it (data-dependent use of a parameter inside a unit
every rank runs) need ``find_unused_parameters=True``: the step then agrees on it with one small
all-reduce.

Not supported: a parameter shared between two units (error, by name), a unit called outside the root's
forward (a unit every rank does not run: its gather is a collective), reentrant checkpointing, two
forwards before one backward.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from ..distributed import collectives as C
from ..weak_hooks import weak_hook
from .sharded_param import ParamInfo, is_sharded, raw_grad, set_raw_grad, set_sharded_info, sharded_class, sharded_info
from .stage3_fp8 import fp8_gather_plans
from .stage3_units import (
    MIN_UNIT_NUMEL,
    SHARD_ALIGN,
    Unit,
    Wrap,
    assign_params,
    check_reduce_dtype,
    choose_modules,
    merge_small,
)


class ZeroStage3(nn.Module):
    """Shards ``module``'s parameters over ``dp_group``; see the module docstring for the schedule.

    ``wrap``: a predicate ``(name, module) -> bool`` (outermost match wins) or a list of submodules;
    default: the elements of every ``nn.ModuleList``. The root keeps the remaining parameters.
    ``min_unit_numel``: consecutive wrapped modules smaller than this many elements share a unit until it
    holds as many (fewer collectives and less padding for many small modules; :mod:`.stage3_units`); 0 keeps
    every wrapped module a unit of its own.
    ``param_dtype``: cast the parameters (e.g. ``torch.bfloat16``); fp32 master weights live in the
    optimizer. ``reduce_dtype``: the dtype gradients are accumulated (in each unit's full gradient buffer,
    over micro-batches under :meth:`no_sync` or :meth:`gather_all`) and reduce-scattered in: None (default)
    is fp32 for bf16/fp16 parameters (FSDP2's ``reduce_dtype=torch.float32``) and the parameters' dtype
    otherwise; the parameters' dtype itself (e.g. ``torch.bfloat16``) halves the gradient buffer and the
    reduction's traffic, every sum rounded to it. Anything else is a ``ValueError``.
    ``prefetch``: overlap the next unit's all-gather with this unit's compute.
    ``free_root_early``: free the root's gathered parameters in backward once every autograd-saved tensor
    viewing them has been used (counted by saved-tensor hooks around the forward). Pass False when the
    root's parameters are used inside an activation-checkpointed region (the checkpoint's own hooks hide
    those saves, and its recomputation would read freed parameters).
    ``ignore(p)``: parameters left alone (not sharded, not reduced; another wrapper's, e.g. experts sharded
    over their own expert-data-parallel group).
    ``fp8_gather``: all-gather the weights of FP8 layers with per-tensor current scaling in FP8 (1 byte an
    element instead of the parameter dtype's 2 or 4), cast on each rank with the whole weight's scale (one small
    max all-reduce of amaxes per unit gather), and hand them to the layers, which use them instead of
    quantizing: bit-identical training, less traffic (:attr:`all_gather_bytes`). Other scalings and every other
    parameter are gathered as usual; :mod:`.stage3_fp8` says what, why it is exact, and what is not gathered.
    ``find_unused_parameters``: ranks may differ in which parameters get a gradient (a data-dependent
    branch inside a unit every rank runs); the optimizer's step then agrees on it with one small all-reduce.
    After backward, this rank's averaged gradient shards are in ``grad_buffer`` (accumulated across
    backwards until :meth:`zero_grad`), in ``grad_dtype``: float32 by default, or the parameters' dtype
    (``torch.bfloat16``), which halves the gradient shard (2 bytes per parameter instead of 4: with the
    optimizer state on disk, bf16 parameters and gradients are then all a rank holds, about 4 bytes per
    parameter). What it changes: each reduction's average (in ``reduce_dtype``) is rounded to the
    parameter dtype (with ``reduce_dtype`` the parameter dtype and a power-of-two dp size the averaged
    shard is the same value in both, so one backward per step gives the same step); a sum over several
    backwards without ``no_sync()`` is rounded to the parameter dtype at every backward (``no_sync()``
    accumulates in ``reduce_dtype`` in both cases).

    Use with :class:`ZeroStage3Optimizer` (param groups, schedulers, ``clip_grad_norm_``: see its
    docstring)::

        z = ZeroStage3(model, mesh.dp_group)
        opt = ZeroStage3Optimizer(z, lr=3e-4, weight_decay=0.1, no_decay=lambda name, p: p.ndim < 2)
        for i, (x, y) in enumerate(micro_batches):
            with z.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (z(x, y)[1] / len(micro_batches)).backward()    # reduce-scattered once, on the last
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        with z.gathered_parameters():                           # every rank: reading needs the gather
            print(model.blocks[0].attn.qkv.weight.norm())

    Between steps a parameter's elements are not on any rank in full: reading one outside
    :meth:`gathered_parameters` raises a ``RuntimeError`` that names it (see the module docstring).
    """

    def __init__(self, module: nn.Module, dp_group, *,
                 wrap: Wrap = None, min_unit_numel: int = MIN_UNIT_NUMEL,
                 param_dtype: Optional[torch.dtype] = None, prefetch: bool = True, broadcast_from_rank0: bool = True,
                 free_root_early: bool = True, find_unused_parameters: bool = False,
                 grad_dtype: Optional[torch.dtype] = None, reduce_dtype: Optional[torch.dtype] = None,
                 ignore: Optional[Callable[[nn.Parameter], bool]] = None, fp8_gather: bool = False):
        super().__init__()
        self.module, self.dp_group, self.prefetch = module, dp_group, bool(prefetch)
        self.find_unused_parameters = bool(find_unused_parameters)
        self._grad_seen: set = set()   # ids of the parameters a backward reached since the last step/zero_grad
        self._seen_before_held: set = set()
        self._sync = True              # False inside no_sync(): gradients accumulate, unreduced
        self._full_names = {id(p): n for n, p in module.named_parameters()}
        self._ignored = ignore or (lambda p: False)
        already = [n for n, p in self.managed_named_parameters() if is_sharded(p)]
        if already:
            raise ValueError(f"ZeroStage3: parameter {already[0]!r} already belongs to another ZeroStage3; wrap "
                             f"each module once")
        self.free_root_early = bool(free_root_early)
        self.dp_size, self.dp_rank = C.world_size(dp_group), C.rank(dp_group)
        if min_unit_numel < 0:
            raise ValueError(f"ZeroStage3: min_unit_numel={min_unit_numel}; pass a number of elements >= 0 (0 keeps "
                             f"every wrapped module a unit of its own)")
        owned = [(m, [(n, p) for n, p in named if not self._ignored(p)])
                 for m, named in assign_params(module, choose_modules(module, wrap))]
        plan = merge_small(module, owned, min_unit_numel)
        params = [p for _, _, named in plan for _, p in named]
        if not params:
            raise ValueError("ZeroStage3: the module has no parameters")
        dtypes = {p.dtype for p in params}
        if param_dtype is None and len(dtypes) != 1:
            raise TypeError(f"ZeroStage3: parameters have several dtypes {sorted(map(str, dtypes))}; pass "
                            f"param_dtype= to cast them to one")
        self.param_dtype = param_dtype or params[0].dtype
        self.device = params[0].device
        self.reduce_dtype = check_reduce_dtype(reduce_dtype, self.param_dtype, sum(p.numel() for p in params))
        # held mode accumulates the micro-batches' gradients in the units' gradient buffers (reduce_dtype), not
        # in autograd's .grad (the parameter dtype), when the two differ
        self._widen = self.reduce_dtype != self.param_dtype
        self._held_seen: set = set()   # held mode, _widen: ids of the parameters with a gradient in grad_full
        self.units: List[Unit] = [Unit(i, name, mods, named, self.dp_size, self.dp_rank, self.param_dtype, self.device,
                                       grad_dtype=self.reduce_dtype)
                                  for i, (name, mods, named) in enumerate(plan)]
        self.shard_numel = sum(u.shard_numel for u in self.units)
        self.shard_buffer = torch.zeros(self.shard_numel, dtype=self.param_dtype, device=self.device)
        self.grad_dtype = self._check_grad_dtype(grad_dtype)
        # zeroed (its pages touched) only once _build has freed the module's own parameters: the build's peak
        # is then the module plus its shards, not the module plus shards plus gradient shards
        self.grad_buffer = torch.empty(self.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.grad_nbytes = self.grad_buffer.untyped_storage().nbytes()
        self._build(broadcast_from_rank0)
        self.grad_buffer.zero_()
        self.fp8_gather = bool(fp8_gather)
        self._fp8_plans = (fp8_gather_plans(module, self.units, self.dp_size, self.dp_rank, self.param_dtype,
                                            self.device) if self.fp8_gather else {})
        self.timeline: List[tuple] = []
        self._set_forward_order([u.index for u in self.units])   # refined from each forward
        self._cur_order: List[int] = []
        self._rs_pending: Optional[Unit] = None
        self._callback_queued = False
        self._bytes = _GatheredBytes()
        self._root_tracked = False    # the last forward ran under the wrapper's saved-tensor hooks
        self._held = False             # gather_all() .. reduce_scatter_and_free(): hooks off, all gathered

    # ------------------------------------------------------------------ construction
    @torch.no_grad()
    def _build(self, broadcast: bool) -> None:
        pos = 0
        for u in self.units:
            u.shard = self.shard_buffer[pos:pos + u.shard_numel]
            u.grad_shard = self.grad_buffer[pos:pos + u.shard_numel]
            pos += u.shard_numel
            u.full.untyped_storage().resize_(u.nbytes)       # one unit's full buffer at a time
            u.full[u.numel:].zero_()                          # padding: zero parameters, so Adam keeps it zero
            for p, o in zip(u.params, u.offsets):
                u.full[o:o + p.numel()].copy_(p.detach().reshape(-1))
            if broadcast:
                C.broadcast(u.full, 0, self.dp_group)
            u.shard.copy_(u.full[u.lo:u.hi])
            for p, o, n in zip(u.params, u.offsets, u.numels):
                p.data = u.full[o:o + n].view(p.shape)   # the old storage is released
                p.grad = None
                # from here on, reading its elements while the unit is not gathered raises (see the class)
                set_sharded_info(p, ParamInfo(self, u, self._full_names[id(p)], o, n, p.shape))
                p.__class__ = sharded_class(type(p))
            u.full.untyped_storage().resize_(0)
            u.grad_full.untyped_storage().resize_(0)
            for mod in u.modules:
                # hooks name their unit by index: a unit holds its parameters, whose hooks torch keeps out of
                # the garbage collector's sight, so a hook holding the unit would never be freed
                i = u.index
                mod.register_forward_pre_hook(weak_hook(self, lambda z, m, a, i=i: z._pre_forward(z.units[i], a)))
                mod.register_forward_hook(weak_hook(self, lambda z, m, a, out, i=i: z._post_forward(z.units[i], out)))
            on_grad = weak_hook(self, lambda z, p, i=u.index: z._on_grad(z.units[i], p))
            for p in u.params:
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(on_grad)

    def _check_grad_dtype(self, grad_dtype: Optional[torch.dtype]) -> torch.dtype:
        if grad_dtype is None or grad_dtype == torch.float32:
            return torch.float32
        if grad_dtype != self.param_dtype:
            raise ValueError(f"ZeroStage3: grad_dtype={grad_dtype} for {self.param_dtype} parameters; the gradient "
                             f"shard is float32 (the default) or the parameters' dtype ({self.param_dtype}), which "
                             f"halves its memory for bf16/fp16 parameters")
        return grad_dtype

    # ------------------------------------------------------------------ memory bookkeeping
    @property
    def peak_gathered_bytes(self) -> int:
        """The most bytes of full parameter and gradient buffers alive at once during the last step (with
        ``fp8_gather``, the gathered FP8 weights and the all-gathers' receive buffers too)."""
        return self._bytes.peak

    @property
    def all_gather_bytes(self) -> int:
        """Bytes the parameter all-gathers moved since the last step began (the root's forward, or
        :meth:`gather_all`): each gather's output, every rank's part. A unit's gather is ``padded * itemsize``
        bytes, padding included; with ``fp8_gather``, a unit holding FP8-gathered weights moves its FP8 elements
        at 1 byte and its others at the parameter dtype's size, padding left out, each rank's part padded to the
        largest one (rounded up to 16 bytes), plus a max all-reduce of 4 bytes per FP8 weight (not counted)."""
        return self._bytes.moved

    def _alloc(self, t: torch.Tensor, nbytes: int) -> bool:
        st = t.untyped_storage()
        if st.nbytes():
            return False
        st.resize_(nbytes)
        self._bytes.add(nbytes)
        return True

    def _free(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        self._bytes.add(-st.nbytes())
        st.resize_(0)

    def _event(self, what: str, u: Unit, **extra) -> None:
        self.timeline.append((what, u.index, time.perf_counter(), extra))

    # ------------------------------------------------------------------ gather / free
    @torch.no_grad()
    def _gather(self, u: Unit, prefetch: bool = False, full_precision: bool = False) -> None:
        """Issue ``u``'s all-gather (async) unless it is gathered or in flight; its FP8 weights in FP8 (with
        ``fp8_gather``) unless ``full_precision``."""
        if u.gather_work is not None or not self._alloc(u.full, u.nbytes):
            return
        plan = None if full_precision else self._fp8_plans.get(u.index)
        if plan is None:
            _, work = C.all_gather_dim0(u.shard, self.dp_group, out=u.full, async_op=True)
            nbytes = u.nbytes
        else:
            work, nbytes = plan.launch(u.shard, self.dp_group), plan.recv_bytes
            self._bytes.add(nbytes)                         # the receive buffer, until it is unpacked
        self._bytes.moved += nbytes
        u.gather_work = work if work is not None else _Done()
        self._event("gather_launch", u, prefetch=prefetch, bytes=nbytes)

    def _wait_gather(self, u: Unit) -> None:
        self._gather(u)
        if u.gather_work is not None:
            u.gather_work.wait()
            plan = self._fp8_plans.get(u.index)
            if plan is not None and plan.in_flight:         # unpack: the FP8 weights to their layers
                plan.finish(u.full)
                self._bytes.add(plan.fp8_bytes - plan.recv_bytes)
            u.gather_work = None
            self._event("gather_wait", u)

    @torch.no_grad()
    def _fill_full_precision(self, u: Unit) -> None:
        """``u`` gathered (waited for) with its FP8 weights in FP8 only: gather the full buffer in full
        precision over it (a collective), so every parameter is readable."""
        plan = self._fp8_plans.get(u.index)
        if plan is not None and plan.handed_off:
            C.all_gather_dim0(u.shard, self.dp_group, out=u.full)
            self._bytes.moved += u.nbytes
            plan.full_precision()

    def _reshard(self, u: Unit) -> None:
        if u.gather_work is not None:   # never free memory a collective is writing into
            u.gather_work.wait()
            u.gather_work = None
        plan = self._fp8_plans.get(u.index)
        if plan is not None:
            self._bytes.add(-plan.release())
        if u.gathered():
            self._free(u.full)

    def _set_forward_order(self, order: List[int]) -> None:
        """The units in the order the last forward first ran them: prefetch follows it (backward reversed)."""
        self._fwd_order = order
        self._fwd_position = {}
        for i, index in enumerate(order):
            self._fwd_position.setdefault(index, i)

    def _prefetch_after(self, u: Unit, step: int) -> None:
        i = self._fwd_position.get(u.index) if self.prefetch else None
        if i is None:
            return
        order = self._fwd_order
        i += step
        if 0 <= i < len(order) and order[i] != 0:
            self._gather(self.units[order[i]], prefetch=True)

    # ------------------------------------------------------------------ forward hooks
    # A unit of several modules (small ones merged) is gathered by the first of its modules to run in a
    # forward and freed after the last (its calls counted); one whose modules did not all run is freed at
    # the end of the root's forward. Every module's outputs are hooked for the pre-backward: autograd may
    # reach any of them first.
    def _pre_forward(self, u: Unit, args: tuple = ()) -> Optional[tuple]:
        if self._held:
            return None
        if u.phase == "forward" and u.index != 0 and u.gather_work is None and u.gathered():
            # another module of a merged unit: nothing to gather (the common case, kept cheap)
            if self.find_unused_parameters and torch.is_grad_enabled():
                return self._reduce_after_backward_of(u, args)
            return None
        if u.phase == "backward":          # recomputation under activation checkpointing
            self._wait_gather(u)
            return None
        if u.index == 0:
            self.timeline, self._cur_order = [], []
            self._bytes.reset_peak()
            self._callback_queued = False
            for v in self.units:       # a forward whose graph got no backward (a loss computed, not used)
                if v.phase == "forward":
                    v.phase = "idle"
        if u.phase != "forward" or u.index == 0:      # the unit's first module call in this forward
            self._cur_order.append(u.index)
            u.forward_calls, u.made_graph = 0, False
            u.after_backward_pending, u.reduce_at_end = 0, False
            self._wait_gather(u)
            u.storage_ptr = u.full.untyped_storage().data_ptr()     # the root's: see _pack
            self._prefetch_after(u, +1)
            u.phase = "forward"
            self._event("forward_start", u)
        else:
            self._wait_gather(u)           # (gathered already, unless a module runs again after the unit's end)
        if self.find_unused_parameters and u.index != 0 and torch.is_grad_enabled():
            return self._reduce_after_backward_of(u, args)
        return None

    def _reduce_after_backward_of(self, u: Unit, args: tuple) -> Optional[tuple]:
        """``find_unused_parameters``: the inputs of each of ``u``'s module calls pass through
        :class:`_AfterBackward`, whose backward runs once that call's backward is over (autograd accumulates
        parameter gradients first), whichever of its parameters got a gradient; after the last of them it
        reduces ``u``. Every rank reduces the units in the same order, even when their gradients arrive
        differently (FSDP2's post-backward does the same)."""
        where = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not where:
            u.reduce_at_end = True   # no gradient flows out of this call: u is reduced at the end of backward
            return None
        u.after_backward_pending += 1
        outs = _AfterBackward.apply(lambda u=u: self._after_unit_backward(u), *[args[i] for i in where])
        outs = outs if isinstance(outs, tuple) else (outs,)
        new = list(args)
        for i, o in zip(where, outs):
            new[i] = o
        return tuple(new)

    @torch.no_grad()
    def _after_unit_backward(self, u: Unit) -> None:
        u.after_backward_pending -= 1
        if (not self._held and u.phase == "backward" and u.after_backward_pending <= 0
                and not u.reduce_at_end):
            self._reduce(u)

    def _post_forward(self, u: Unit, out) -> None:
        if self._held:
            return
        if u.phase == "backward":
            return
        if torch.is_grad_enabled():
            outs = (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]
            for t in outs:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    u.made_graph = True
                    self._hook_pre_backward(u, t)
        if u.index != 0:
            u.forward_calls += 1
            if u.forward_calls >= len(u.modules):
                self._end_forward(u)
            return
        # root: forward is over
        for v in self.units:
            if v.index != 0 and v.phase == "forward" and v.forward_calls < len(v.modules):
                self._end_forward(v)       # some of its modules did not run
        self._event("forward_end", u)
        self._set_forward_order(list(self._cur_order))
        if not u.made_graph:
            self._reshard(u)
            u.phase = "idle"
        elif self.prefetch and len(self._fwd_order) > 1:
            self._gather(self.units[self._fwd_order[-1]], prefetch=True)   # backward's first unit

    def _hook_pre_backward(self, u: Unit, t: torch.Tensor) -> None:
        """Call the pre-backward of ``u`` when a gradient reaches ``t``: a pre-hook on the node that made it
        (what ``t.register_hook`` installs too, for less Python per module call), or on ``t`` itself for
        a leaf."""
        if t.grad_fn is not None:
            t.grad_fn.register_prehook(weak_hook(self, lambda z, grads, i=u.index: z._pre_backward(z.units[i])))
        else:
            t.register_hook(weak_hook(self, lambda z, g, i=u.index: z._pre_backward(z.units[i])))

    def _end_forward(self, u: Unit) -> None:
        """``u``'s modules have run: free its parameters (gathered again for its backward)."""
        self._event("forward_end", u)
        u.forward_calls = len(u.modules)
        self._reshard(u)
        u.phase = "forward" if u.made_graph else "idle"

    # ------------------------------------------------------------------ backward hooks
    def _pre_backward(self, u: Unit) -> None:
        if self._held or u.phase == "backward" or u.phase == "reduced":
            return      # (every output of every module of the unit calls it: the first one acts)
        self._start_backward(u)

    @torch.no_grad()
    def _start_backward(self, u: Unit) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        u.phase, u.ready = "backward", 0
        if u.index != 0:
            self._maybe_free_root()
        self._wait_gather(u)
        self._event("backward_start", u)
        self._prefetch_after(u, -1)

    def _on_grad(self, u: Unit, p: torch.nn.Parameter) -> None:
        self._grad_seen.add(id(p))
        if self._held:
            if self._widen:
                with torch.no_grad():
                    self._accumulate_held(u, p)
            return
        with torch.no_grad():
            self._take_grad(u, p)

    def _accumulate_held(self, u: Unit, p: torch.nn.Parameter) -> None:
        # Held mode with reduce_dtype wider than the parameters: each micro-batch's gradient (made by autograd
        # in the parameter dtype) is added into the unit's reduce_dtype buffer and dropped, so the micro-batches
        # sum in reduce_dtype instead of being rounded to bf16 at every one (FSDP2 accumulates its unsharded
        # gradients in reduce_dtype too). The buffer is allocated at the unit's first gradient of the step.
        if self._alloc(u.grad_full, u.grad_nbytes):
            u.grad_full.zero_()
        g = raw_grad(p)
        if g is not None:
            u.grad_view_of[id(p)].add_(g)
            set_raw_grad(p, None)
        self._held_seen.add(id(p))

    def _take_grad(self, u: Unit, p: torch.nn.Parameter) -> None:
        # Copy the gradient autograd just made into the unit's flat buffer and drop it at once: at most one
        # per-parameter gradient is alive beside the buffer, which is allocated at the unit's first gradient.
        if u.phase == "backward" and u.eager_grads:
            if not u.gathered_grad():
                # Finish the previous unit's reduction (and free its buffer) before this unit's buffer is
                # allocated: at most one gradient buffer alive in a block's backward, beside two gathered
                # parameter buffers (this unit's and the prefetched one). The reduction still overlaps the
                # start of this unit's backward (up to its first parameter gradient).
                self._finish_reduce()
                self._alloc(u.grad_full, u.grad_nbytes)
                u.grad_full.zero_()
            u.grad_view_of[id(p)].add_(raw_grad(p))
            set_raw_grad(p, None)
        u.ready += 1
        # all of the unit's gradients are in: reduce now (with find_unused_parameters another rank may
        # miss some, and its order of reductions would differ: _AfterBackward triggers them instead)
        if u.phase == "backward" and u.ready == u.n_grad and not self.find_unused_parameters:
            self._reduce(u)

    @torch.no_grad()
    def _reduce(self, u: Unit) -> None:
        """Launch the reduction of ``u``'s full gradient buffer (async); free its parameters. Inside
        :meth:`no_sync` the buffer is kept instead (the next backward adds to it)."""
        if self._alloc(u.grad_full, u.grad_nbytes):  # no pre-backward ran: gradients were made by autograd
            u.grad_full.zero_()
        for p, o, n in zip(u.params, u.offsets, u.numels):
            view = u.grad_full[o:o + n]
            g = raw_grad(p)
            if g is not None and g.data_ptr() != view.data_ptr():
                self._grad_seen.add(id(p))     # held mode: autograd's (or a pipeline's) gradient
                view.add_(g.reshape(-1))
                set_raw_grad(p, None)         # free it now: at most one such copy alive beside grad_full
        if not self._sync and not self._held:
            u.accumulated, u.phase = True, "reduced"
            self._event("accumulate", u)
            if u.index != 0 and not u.has_frozen:
                self._reshard(u)
            return
        self._finish_reduce()              # one reduction in flight at a time: bounded memory
        u.rs_out, work = C.reduce_scatter_dim0(u.grad_full, self.dp_group, async_op=True)
        u.rs_work, u.phase = work, "reduced"
        self._rs_pending = u
        self._event("reduce_launch", u)
        if u.index != 0 and not u.has_frozen:   # frozen params may still be read by autograd
            self._reshard(u)

    def _finish_reduce(self) -> None:
        u, self._rs_pending = self._rs_pending, None
        if u is None:
            return
        if u.rs_work is not None:
            u.rs_work.wait()
        mine = u.rs_out
        if self.grad_buffer.untyped_storage().nbytes() == 0:   # freed by zero_grad(set_to_none=True)
            # Not zeroed here: each unit's slice is *written* by its first reduction (below) and the slices
            # of units that got no reduction are zeroed at the end of backward. So the shard's pages are
            # first touched unit by unit as backward frees activations (on CPU, a fresh large allocation is
            # not resident until written), not all at once at the first reduction.
            self.grad_buffer.untyped_storage().resize_(self.grad_nbytes)
            for v in self.units:
                v.grad_valid = False
        if u.grad_shard.element_size() < mine.element_size():
            # a bf16 shard of an fp32 reduction: average in place in the reduction's output (ours) and round once
            # into the shard with a casting copy (a mul or add writing bf16 from fp32 would allocate an fp32
            # temporary of the shard's size)
            mine.mul_(1.0 / self.dp_size)
            if u.grad_valid:
                mine.add_(u.grad_shard)
            u.grad_shard.copy_(mine)
            u.grad_valid = True
        elif u.grad_valid:
            u.grad_shard.add_(mine, alpha=1.0 / self.dp_size)   # average; accumulates across backwards
        else:
            torch.mul(mine, 1.0 / self.dp_size, out=u.grad_shard)
            u.grad_valid = True
        u.rs_work = u.rs_out = None
        u.accumulated = False
        for p in u.params:
            set_raw_grad(p, None)
        self._free(u.grad_full)
        self._event("reduce_wait", u)

    def _end_backward(self) -> None:
        for u in self.units:
            # some parameter got no gradient (it counts as zero), or no pre-backward ran for the unit, or
            # (the backward after no_sync) it holds accumulated gradients but got none in this backward
            if u.phase == "backward" or (u.phase != "reduced" and (
                    any(raw_grad(p) is not None for p in u.params) or (self._sync and u.accumulated))):
                self._reduce(u)
        self._finish_reduce()
        if self.has_grads():
            for u in self.units:
                if not u.grad_valid:       # no gradient reached this unit in any backward since zero_grad
                    u.grad_shard.zero_()
                    u.grad_valid = True
        for u in self.units:
            self._reshard(u)
            u.phase = "idle"
        self._callback_queued = False

    # ------------------------------------------------------------------ public
    def forward(self, *args, **kwargs):
        if not (torch.is_grad_enabled() and self.free_root_early):
            self._root_tracked = False
            return self.module(*args, **kwargs)
        # Count the saved tensors that view the root's gathered parameters (in the GPT: the tied LM head's
        # weight and the final LayerNorm's), so backward can free the root's full buffer as soon as the last
        # of them has been used, instead of keeping it to the end of backward (embedding lookups save no
        # weight). A tensor is unpacked once per backward; a second use (retain_graph) re-gathers.
        self.units[0].saved_views, self._root_tracked = 0, False
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        self._root_tracked = True
        return out

    def _pack(self, t):
        # Runs for every tensor autograd saves in the forward: the common cases return after one check.
        root = self.units[0]
        info = sharded_info(t)
        if info is not None:                 # a parameter: the root's if its info says so
            if info.unit is not root:
                return t
        elif t.untyped_storage().data_ptr() != root.storage_ptr or t.device != root.full.device:
            return t                         # an activation, or a view made in the forward of another buffer
        if not root.gathered():
            return t
        root.saved_views += 1
        return (_ROOT_SAVED, t)

    def _unpack(self, packed):
        if isinstance(packed, tuple) and len(packed) == 2 and packed[0] is _ROOT_SAVED:
            root = self.units[0]
            root.saved_views -= 1
            if not root.gathered():          # freed early and used again (retain_graph): gather again
                self._wait_gather(root)
            return packed[1]
        return packed

    def _maybe_free_root(self) -> None:
        root = self.units[0]
        if (self._root_tracked and root.saved_views <= 0 and root.phase in ("backward", "reduced")
                and not root.has_frozen and root.gathered()):
            self._reshard(root)
            self._event("root_free", root)

    # ------------------------------------------------------------------ held mode (pipeline)
    @torch.no_grad()
    def gather_all(self) -> None:
        """Gather every unit now (collectives over dp) and keep the parameters gathered, hooks off, until
        :meth:`reduce_scatter_and_free`: any number of forwards/backwards then accumulate full-size
        ``.grad`` on the parameters."""
        if self._held:
            raise RuntimeError("ZeroStage3.gather_all: already gathered (call reduce_scatter_and_free first)")
        if any(u.phase != "idle" for u in self.units):
            raise RuntimeError("ZeroStage3.gather_all: a per-unit forward/backward is in progress")
        self.timeline = []
        self._bytes.reset_peak()
        for u in self.units:
            self._gather(u)
        for u in self.units:
            self._wait_gather(u)
            for p in u.params:
                set_raw_grad(p, None)
        self._seen_before_held = set(self._grad_seen)   # what release_gathered() goes back to
        self._held_seen = set()
        self._held = True

    @torch.no_grad()
    def reduce_scatter_and_free(self) -> None:
        """End of :meth:`gather_all`: reduce every unit's accumulated gradients over dp (once), add this
        rank's averaged slice into ``grad_buffer`` (a parameter without a gradient counts as zero), drop the
        full gradients and free the gathered parameters (reshard). Collectives over dp."""
        if not self._held:
            raise RuntimeError("ZeroStage3.reduce_scatter_and_free: not gathered (call gather_all first)")
        for u in self.units:
            u.phase = "backward"
            self._reduce(u)              # waits for the previous unit's reduction, launches this one's
        self._finish_reduce()
        for u in self.units:
            self._reshard(u)
            u.phase = "idle"
        self._held = False

    @torch.no_grad()
    def release_gathered(self) -> None:
        """Leave :meth:`gather_all` WITHOUT collectives (e.g. after an exception, when other ranks may not
        reach the reduction): drop the full gradients, free the full buffers; ``grad_buffer`` untouched."""
        self._grad_seen = set(self._seen_before_held)
        for u in self.units:
            for p in u.params:
                set_raw_grad(p, None)
            if u.gathered_grad():
                self._free(u.grad_full)
            self._reshard(u)
            u.phase, u.rs_work, u.rs_out, u.accumulated = "idle", None, None, False
        self._rs_pending = None
        self._held_seen = set()
        self._held = False

    def accumulated_grad(self, p: torch.nn.Parameter, create: bool = False) -> Optional[torch.Tensor]:
        """Between :meth:`gather_all` and :meth:`reduce_scatter_and_free`: where ``p``'s gradient of this step
        accumulates, before the reduction over dp; edit it in place to change what is reduced (a pipeline's
        tied weights and tp-partial gradients are summed there). A view of its unit's ``reduce_dtype``
        gradient buffer when ``reduce_dtype`` is wider than the parameters (``p.grad`` reads the same view
        then), else autograd's ``p.grad``. None when no backward reached ``p`` in this step; ``create=True``
        gives zeros instead, and ``p`` then counts as reached."""
        info = sharded_info(p)
        if info is None or info.wrapper_ref() is not self:
            raise ValueError(f"ZeroStage3.accumulated_grad: {type(p).__name__} of shape {tuple(p.shape)} is not a "
                             f"parameter of this ZeroStage3")
        if not self._held:
            raise RuntimeError(f"ZeroStage3.accumulated_grad({info.name!r}): the gradients are accumulated in full "
                               f"only between gather_all() and reduce_scatter_and_free(); after a backward they are "
                               f"reduced into grad_buffer")
        u = info.unit
        with torch.no_grad():
            if not self._widen:
                if raw_grad(p) is None and create:
                    set_raw_grad(p, torch.zeros(p.shape, dtype=p.dtype, device=p.device))
                    self._grad_seen.add(id(p))
                return raw_grad(p)
            if id(p) not in self._held_seen and raw_grad(p) is None and not create:
                return None
            self._grad_seen.add(id(p))
            self._accumulate_held(u, p)     # (a gradient assigned to p.grad by hand is folded in)
        return u.grad_view_of[id(p)]

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate each unit's gradients in its full gradient buffer, with no
        reduce-scatter; the next backward outside reduces the sum once (DDP's ``no_sync``)::

            for i, (x, y) in enumerate(micro_batches):
                with z.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    (z(x, y)[1] / len(micro_batches)).backward()

        Parameters are still gathered and freed per unit (each micro-batch's forward and backward gathers
        them again); the full gradient buffers stay allocated until that last backward."""
        if self._held:
            raise RuntimeError("ZeroStage3.no_sync: gather_all() is active; its reduce_scatter_and_free() already "
                               "reduces once for any number of micro-batches")
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ------------------------------------------------------------------ what an optimizer asks
    @property
    def gathered_all(self) -> bool:
        """Between :meth:`gather_all` and :meth:`reduce_scatter_and_free` (or :meth:`release_gathered`): every
        unit gathered, the per-unit hooks off, the gradients reduced only at the end."""
        return self._held

    def grad_reached(self, p: torch.nn.Parameter) -> bool:
        """Whether a backward reached ``p`` since the last step or :meth:`zero_grad`."""
        return id(p) in self._grad_seen

    def forget_grads_reached(self, p: Optional[torch.nn.Parameter] = None) -> None:
        """A step consumed the gradients (of ``p`` only, when given: ``p.grad = None``, which in held mode also
        drops what ``p`` accumulated): no parameter counts as reached."""
        if p is None:
            self._grad_seen.clear()
            return
        self._grad_seen.discard(id(p))
        if self._held and id(p) in self._held_seen:
            self._held_seen.discard(id(p))
            u = sharded_info(p).unit
            if u.gathered_grad():
                with torch.no_grad():
                    u.grad_view_of[id(p)].zero_()

    def unreduced_units(self) -> List[str]:
        """Units holding gradients accumulated under :meth:`no_sync` and not reduced yet."""
        return [u.name or "<root>" for u in self.units if u.accumulated]

    def unit_layout(self) -> list:
        """``[unit name, parameter names, padded numel]`` per unit: what a saved shard belongs to."""
        return [[u.name, list(u.names), u.padded] for u in self.units]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradient shards (and gradients accumulated under :meth:`no_sync`); ``set_to_none``
        (torch's default) frees them until the next backward (FSDP2 does the same: between steps a rank
        holds parameters and optimizer state only)."""
        self._grad_seen.clear()
        for u in self.units:
            if u.accumulated:
                self._free(u.grad_full)
                u.accumulated = False
        if set_to_none:
            self.grad_buffer.untyped_storage().resize_(0)
        elif self.has_grads():
            self.grad_buffer.zero_()
            for u in self.units:
                u.grad_valid = True

    def managed_named_parameters(self) -> List[Tuple[str, nn.Parameter]]:
        """The module's parameters this wrapper shards (all of them but those ``ignore`` names), by name."""
        return [(n, p) for n, p in self.module.named_parameters() if not self._ignored(p)]

    def has_grads(self) -> bool:
        return self.grad_buffer.untyped_storage().nbytes() > 0

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = False):
        """Gather every unit (a collective over the dp group: every rank enters it); the parameters are
        readable inside. ``writeback``: copy this rank's slice of the (edited) parameters back on exit.
        Keep clones, not views: the memory is freed on exit."""
        for u in self.units:
            self._gather(u, full_precision=True)
        for u in self.units:
            self._wait_gather(u)
            self._fill_full_precision(u)    # gathered in FP8 before (inside a forward): now in full
        try:
            yield self.module
        finally:
            for u in self.units:
                if writeback:
                    u.shard.copy_(u.full[u.lo:u.hi])
                self._reshard(u)

    def gathered_parameters(self, writeback: bool = False):
        """``with z.gathered_parameters(): ...``: every parameter readable (and with ``writeback``,
        editable) inside; a collective over the dp group. Same as :meth:`summon_full_params`."""
        return self.summon_full_params(writeback=writeback)

    def full_state_dict(self) -> Dict[str, torch.Tensor]:
        """The module's plain ``state_dict`` (clones), gathered (a collective over the DP group)."""
        with self.summon_full_params():
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def state_dict(self, *args, **kwargs) -> dict:   # nn.Module's would read freed parameters
        """This rank's parameter shard, the layout it belongs to and the module's buffers."""
        return {"dp_size": self.dp_size, "dp_rank": self.dp_rank, "shard": self.shard_buffer.clone(),
                "layout": self.unit_layout(),
                "buffers": {n: b.clone() for n, b in self.module.named_buffers()}}

    @torch.no_grad()
    def load_state_dict(self, state: dict, strict: bool = True):
        layout = self.unit_layout()
        if state.get("dp_size") != self.dp_size or state.get("dp_rank") != self.dp_rank:
            raise ValueError(f"ZeroStage3.load_state_dict: shard of dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into rank {self.dp_rank} of {self.dp_size}; resume "
                             f"with the same data-parallel size, each rank from its own file")
        if state["layout"] != layout:
            raise ValueError("ZeroStage3.load_state_dict: the saved unit layout differs from this wrapper's "
                             "(another model or another wrap=)")
        self.shard_buffer.copy_(state["shard"])
        bufs = dict(self.module.named_buffers())
        for n, b in state["buffers"].items():
            bufs[n].copy_(b)


_ROOT_SAVED = object()   # marks a packed saved tensor that views the root's parameters


class _AfterBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward calls ``callback`` (the unit's backward is then over)."""

    @staticmethod
    def forward(ctx, callback, *tensors):
        ctx.callback = callback
        out = tuple(t.view_as(t) for t in tensors)
        return out if len(out) > 1 else out[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


class _GatheredBytes:
    """Bytes of full parameter and gradient buffers alive now, and the most alive at once since the last
    reset. A plain object: it changes at every gather and free, where ``nn.Module.__setattr__`` (the
    wrapper's own attributes) costs microseconds per assignment."""

    __slots__ = ("live", "peak", "moved")

    def __init__(self):
        self.live = self.peak = self.moved = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def reset_peak(self) -> None:
        """A step begins: the peak starts from what is alive, the all-gathers' byte count from 0."""
        self.peak = self.live
        self.moved = 0


class _Done:
    """A finished work (a group of one issues no collective)."""

    def wait(self):
        return True

    def is_completed(self):
        return True


__all__ = ["ZeroStage3", "SHARD_ALIGN"]
