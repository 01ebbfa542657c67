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
   Stage 1 keeps the full grad buffer as well; stage 2 frees each bucket's full gradients as soon as its
   reduce-scatter is done (``DataParallel.shard_gradients_in_backward``): during backward a rank holds its
   shard plus the buckets being filled or in flight (at most ``max_buckets_in_flight`` + 1 after the
   first backward, whose re-layout holds every bucket once), between steps the shard alone.
   (Stage 1 over ``reduce_op="all_reduce"`` slices the shard out of the full buffer instead.)
2. the fused ``adamw_step`` updates the local shard (master, moments, and for bf16/fp16 models the
   low-precision copy in the same pass): one call per *run*, a stretch of the shard whose parameters share
   their group's lr/betas/eps and their step count (the common case, every parameter with a gradient and
   one learning rate, is ONE call; groups that differ only in weight decay share a run, their decay applied
   by one extra elementwise pass: decoupled decay does not depend on the moments), then
3. every bucket's updated shard is all-gathered (model dtype) into ``bucket.param_data``, so every rank
   holds the full updated model.

Padding elements have zero parameters and zero gradients, so Adam leaves them at zero.

``torch.optim.Optimizer`` contract, param groups, per-parameter step counts and the runs: see
:mod:`.sharded_adamw` (``ShardedAdamW``, shared with ZeRO-3).

Gradient clipping: the gradients are shards, so ``torch.nn.utils.clip_grad_norm_(model.parameters())``
cannot see them. After a backward every ``p.grad`` is a guard (:class:`ShardedGrad`, :mod:`.sharded_grad`)
that raises a ``RuntimeError`` naming the parameter and :meth:`ShardedAdamW.clip_grad_norm_`, which computes
the global norm over every rank's shard and folds the coefficient into the next step. (Stage 1 over an
all-reduce with fp32 parameters has the full averaged gradient in ``p.grad``, stepped from that buffer: the
standard call works there and no guard is set.)

The buffer may be re-laid out once (``DataParallel`` rebuilds buckets from the order gradients arrived,
at the end of the first synced backward and, with reduce-scatter, *before* reducing, so the gradients are
already reduced in the new layout): the optimizer notices (the buffer storage changed) and re-derives its
shards. Before the first step that is free; when the state already holds something (``load_state_dict``
into a fresh wrapper, whose first backward then re-lays out) it is one all-gather of the state per old
bucket: a collective, all ranks of the DP group take part.

ZeRO-Infinity (``offload="disk", offload_dir=DIR``, :mod:`.offload`): master and moments live in one file
per rank, streamed through a few host buffers in the step. The updated shard then goes straight into the
rank's slice of ``param_data`` (fp32 models: no in-memory master) or into the low-precision staging shard
(bf16/fp16), and is all-gathered from there as usual.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..weak_hooks import weak_hook
from . import full_state
from . import memory as M
from .host_offload import HostOffload, HostShard, LaunchedBuckets, segments_of
from .offload import DEFAULT_BUFFER_MB, resolve_offload
from .sharded_adamw import STATE_FORMAT, NoDecay, ShardedAdamW, step_multipliers
from .sharded_adamw import STATES as _STATES
from .sharded_grad import ShardedGrad, sharded_grad_message, sharded_grad_placeholder, sharded_grad_view
from .state_storage import HostState, ResidentState, ShardState


class ZeroOptimizer(ShardedAdamW):
    """Sharded AdamW over a ``DataParallel(module, dp_group, reduce_op="reduce_scatter")`` wrapper; a
    ``torch.optim.Optimizer`` that takes ``torch.optim.AdamW``'s param groups.

    ``stage=1``: optimizer state sharded. ``stage=2``: gradients sharded too, each bucket's full gradients
    freed as soon as it is reduced (``max_buckets_in_flight`` reductions in flight at most).

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

    ZeRO-Infinity: ``offload="disk", offload_dir=DIR`` keeps this rank's master weights and moments in a
    file under ``DIR``, streamed through ``offload_buffer_mb`` of host buffers in each step (bit-identical
    results; ``offload_io``: ``"auto"``, ``"direct"``, ``"buffered"``); see
    :mod:`parallel_layers.zero.offload`. ZeRO-Offload: ``offload="cpu"`` on a CUDA model keeps them in
    pinned host memory and steps them on the CPU, each bucket's gradient copied to the host as soon as it
    is reduced (``offload_delayed_update=True``: the CPU step overlaps the next forward and backward, one
    update stale; call :meth:`wait_for_step` to apply the last one); it raises on a CPU model (nothing to
    move). See :mod:`parallel_layers.zero.host_offload`.
    """

    _owner = "ZeroOptimizer"

    def __init__(self, dp_module, params=None, *, stage: int, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 no_decay: NoDecay = None, backend: Optional[str] = None, offload: Optional[str] = None,
                 offload_dir: Optional[str] = None, offload_buffer_mb: float = DEFAULT_BUFFER_MB,
                 offload_io: str = "auto", offload_delayed_update: bool = False, max_buckets_in_flight: int = 2):
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
        if stage == 2:
            dp_module.shard_gradients_in_backward(max_buckets_in_flight)
        self.group = dp_module.dp_group
        self.dp_size, self.dp_rank = C.world_size(self.group), C.rank(self.group)
        self._module = getattr(dp_module, "module", dp_module)
        buckets = self._buckets()
        self.device = buckets[0].param_data.device
        self.param_dtype = buckets[0].param_data.dtype
        if any(b.param_data.dtype != self.param_dtype for b in buckets):
            raise ValueError("ZeroOptimizer: the buckets hold parameters of several dtypes "
                             f"{sorted({str(b.param_data.dtype) for b in buckets})}; use one param dtype")
        self._offload = resolve_offload("ZeroOptimizer", offload, offload_dir, self.device, offload_buffer_mb,
                                        offload_io, offload_delayed_update)
        self._owned = {id(p) for p in dp_module.buffer.params}
        # fp32 params: p.grad is the buffer's view (autograd accumulates into it); else p.grad stays None
        self._direct = dp_module.buffer.param_dtype == dp_module.grad_dtype
        self._init_groups(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_decay=no_decay)
        self._use_broadcast = self.dp_size > 1 and dist.get_backend(self.group) == "gloo"
        self._started = False      # has the state left its initial value (step taken or state loaded)?
        self._layout_key = None
        self._seen: set = set()    # ids of the parameters a backward reached since the last step/zero_grad
        self._callback_queued = False
        self._messages: Dict[int, str] = {}
        self._placeholders: Dict[int, torch.Tensor] = {}
        self._storage = self._build(buckets)
        self._register_grad_hooks()

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
        ref, on_grad = weakref.ref(self), weak_hook(self, type(self)._on_grad)

        def drop_placeholder(grad, pref):
            # before autograd accumulates into .grad: a placeholder holds nothing to add to
            p, opt = pref(), ref()
            if p is not None and opt is not None and p.grad is not None and p.grad is opt._placeholders.get(id(p)):
                p.grad = None

        for p in self.dp.buffer.params:
            p.register_post_accumulate_grad_hook(on_grad)
            if not self._direct or self.stage == 2:
                pref = weakref.ref(p)
                p.register_hook(lambda grad, pref=pref: drop_placeholder(grad, pref))

    def _on_grad(self, p) -> None:
        self._seen.add(id(p))
        if not self._callback_queued:
            self._callback_queued = True
            after_backward = weakref.WeakMethod(self._after_backward)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: after_backward() is not None and after_backward()())
        self._storage.on_grad()

    def _after_backward(self) -> None:
        """Guards in ``p.grad`` where reading it would be wrong. Not for fp32 parameters over an all-reduce
        (stage 1): there ``p.grad`` is the full averaged gradient and the step slices that very buffer, so
        ``torch.nn.utils.clip_grad_norm_`` is right and its clipping reaches the step."""
        self._callback_queued = False
        self._storage.after_backward()
        for p in self.dp.buffer.params:
            g = p.grad
            if self._direct and (self.stage == 1 or g is not None):
                if not self._scattered():
                    continue
                if g is not None and not isinstance(g, ShardedGrad) and g.data_ptr() == p.main_grad.data_ptr():
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
        self._h_fresh = False
        self.dp.zero_grad()
        if self.stage == 2:
            for p in self.dp.buffer.params:
                p.grad = None         # the guards go; the buckets were freed

    # ------------------------------------------------------------------ stage 2: gradient memory
    def _release_grads(self) -> None:
        """Stage 2, after a step: the step consumed the gradients. Every bucket's full gradient memory is
        freed (the synced backward freed each as it was reduced; this frees what ``no_sync`` backwards left)
        and the shard is zeroed, so the next backward starts from zero (as if ``zero_grad`` followed every
        step)."""
        self.dp.release_grads()

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

    def _build(self, buckets) -> ShardState:
        """(Re)derive shard bookkeeping and buffers from the current bucket layout and return a new state
        for it (the caller puts it in place: a re-layout still reads the old one)."""
        self._bucket_list = buckets
        self._layout_key = self._key(buckets)
        self._layout = self._describe(buckets)
        self._offsets, pos = [], 0
        for b in buckets:
            self._offsets.append(pos)
            pos += b.shard_numel
        self.shard_numel = pos
        dev = self.device
        low = self.param_dtype != torch.float32
        with torch.no_grad():
            # reduce_scatter: DataParallel.grad_shard already is the flat shard. Stage 1 over all_reduce with
            # several buckets: the shards are not adjacent in the grad buffer; they are gathered here.
            own = not self._scattered() and len(buckets) > 1
            self._grad_flat = torch.zeros(pos, dtype=torch.float32, device=dev) if own else None
            self._pieces_cache = None
            if isinstance(self._offload, HostOffload):
                return self._build_host(buckets, pos, low)
            if self._offload is not None:
                # Staging for the low-precision copy the kernel writes; fp32: the step writes param_data.
                self.low = (self._own_params(0, pos, torch.empty(pos, dtype=self.param_dtype, device=dev)) if low
                            else None)
                return self._open_state_file(
                    self._offload, tag=f"stage{self.stage}", group=self.group, layout=self._layout, numel=pos,
                    resident_master=None, init_master=lambda lo, hi, out: self._own_params(lo, hi, out))
            params = self._own_params(0, pos, torch.empty(pos, dtype=self.param_dtype, device=dev))
            # Staging for the low-precision copy the kernel writes; it is what the all-gather sends.
            self.low = params if low else None
            return ResidentState(self._owner, params.float() if low else params,
                                 torch.zeros(pos, dtype=torch.float32, device=dev),
                                 torch.zeros(pos, dtype=torch.float32, device=dev))

    # ------------------------------------------------------------------ ZeRO-Offload (offload="cpu")
    def _build_host(self, buckets, pos: int, low: bool) -> HostState:
        """The state in pinned host memory (:mod:`.host_offload`), one gradient segment per bucket; the
        device keeps the low-precision staging shard the all-gather sends (bf16/fp16 models)."""
        dev = self.device
        host = HostShard(self._owner, pos, dev, grad_dtype=self.dp.grad_dtype,
                         low_dtype=self.param_dtype if low else None, config=self._offload,
                         segments=segments_of([b.shard_numel for b in buckets]))
        self._own_params(0, pos, host.master)
        self.low = self._own_params(0, pos, torch.empty(pos, dtype=self.param_dtype, device=dev)) if low else None
        self._h_launched = LaunchedBuckets(self.dp)
        self._h_early: set = set()   # buckets whose gradient backward copied as soon as it was reduced
        self._h_sync = self._h_launched.sync_token()
        self._h_fresh = False        # the host holds the device's gradient shard as it is now
        # where a bucket's reduced shard is final when its reduction is queued: a group of one (the
        # bucket's own gradients), or NCCL writing the fp32 shard itself (the copy waits for the collective)
        nccl = self.dp_size > 1 and dist.get_backend(self.group) == "nccl"
        self._h_early_ok = self.dp_size == 1 or (
            nccl and self._scattered() and getattr(self.dp, "comm_dtype", None) == self.dp.grad_dtype)
        return HostState(self._owner, host, fetch_grads=self._fetch_host_grads, upload=self._upload_targets,
                         on_grad=self._host_poll, after_backward=lambda: self._host_catch_up(after_backward=True))

    def _host_grad_src(self, i: int) -> torch.Tensor:
        b = self._bucket_list[i]
        if self._scattered():
            return self.dp.bucket_grad_shard(b)
        s, e = b.shard_range(self.dp_rank)
        return b.grad_data[s:e]

    def _host_poll(self) -> None:
        """A gradient hook, in backward: queue the host copy of every bucket launched since the last look
        whose reduced shard is final once its reduction ran (see :meth:`_build_host`)."""
        if not self._h_early_ok or self._key(self._buckets()) != self._layout_key:
            return
        for bi, work in self._h_launched.new():
            if self.dp_size == 1:
                s, e = self._bucket_list[bi].shard_range(0)
                src, work = self._bucket_list[bi].grad_data[s:e], None
            else:
                src = self.dp.bucket_grad_shard(self._bucket_list[bi])
            self.host_shard.copy_grad(bi, src, work)
            self._h_early.add(bi)

    def _host_catch_up(self, after_backward: bool) -> None:
        """After a synced backward (its end: ``after_backward``) or a ``sync_gradients()`` (seen by the
        step): queue the copies of the buckets not copied early. Only the end-of-backward call trusts the
        early copies (they belong to the backward just ended); the step's copies everything."""
        token = self._h_launched.sync_token()
        if token is None or token is self._h_sync or self._key(self._buckets()) != self._layout_key:
            return
        for i in range(len(self._bucket_list)):
            if not (after_backward and i in self._h_early):
                self.host_shard.copy_grad(i, self._host_grad_src(i))
        self._h_early.clear()
        self._h_sync, self._h_fresh = token, True

    def _fetch_host_grads(self) -> None:
        self._host_catch_up(after_backward=False)
        if not self._h_fresh:            # e.g. zero_grad() since: the device's shard as it is now
            for i in range(len(self._bucket_list)):
                self.host_shard.copy_grad(i, self._host_grad_src(i))
        self._h_fresh = False            # consumed: stage 2 zeroes it, and the next backward changes it

    def _upload_targets(self, lo: int, hi: int):
        if self.low is not None:
            return [(lo, hi, self.low[lo:hi])]
        return list(self._own_segments(lo, hi))      # fp32: straight into this rank's param_data slices

    def _after_host_upload(self) -> None:
        self._gather_params()

    def _own_segments(self, lo: int, hi: int):
        """``(a, b, param_data slice)``: where shard elements ``[a, b)`` (within ``[lo, hi)``) live in this
        rank's slices of the buckets' ``param_data``."""
        i = max(bisect.bisect_right(self._offsets, lo) - 1, 0)
        for b, off in zip(self._bucket_list[i:], self._offsets[i:]):
            if off >= hi:
                break
            a, e = max(lo, off), min(hi, off + b.shard_numel)
            if a < e:
                s, _ = b.shard_range(self.dp_rank)
                yield a, e, b.param_data[s + a - off:s + e - off]

    def _own_params(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Shard elements ``[lo, hi)`` of the parameters (this rank's slices of ``param_data``) into ``out``
        (converted to its dtype)."""
        for a, e, src in self._own_segments(lo, hi):
            out[a - lo:e - lo].copy_(src)
        return out

    def _after_chunk(self, lo: int, hi: int, master: torch.Tensor) -> None:
        """Offloaded fp32 model: the stepped master goes straight into this rank's slice of ``param_data``,
        whence the all-gather sends it (bf16/fp16 models: the kernel wrote ``low`` already)."""
        if self.low is None:
            for a, e, dst in self._own_segments(lo, hi):
                dst.copy_(master[a - lo:e - lo])

    def _check_layout(self) -> None:
        buckets = self._buckets()
        if self._key(buckets) == self._layout_key:
            return
        self._verify_state()
        self.wait_for_step()
        old_layout, old_storage = self._layout, self._storage
        old = tuple(old_storage.tensor(k) for k in _STATES)     # a file: mapped
        self._storage = self._build(buckets)
        try:
            if self._started:       # else nothing learned yet: the new shards start from the params
                self._remap(old_layout, old)
        except BaseException:
            self._storage, new_storage = old_storage, self._storage
            new_storage.close()
            raise
        del old                     # (the old file's mapping goes before the new file takes its name)
        self._storage.replace(old_storage)

    def _remap(self, old_layout: List[dict], old: Sequence[torch.Tensor]) -> None:
        """Move this rank's state from ``old_layout`` to the current one (a collective over the DP group).

        One old bucket at a time: its shards of the three states are all-gathered (one [shard, 3] gather),
        then every parameter piece it holds is copied to where the new layout puts it on this rank. Memory:
        one bucket's full state at a time (the states themselves may be mapped files).
        """
        targets: Dict[str, List[Tuple[int, int, int]]] = {}
        for b, off in zip(self._bucket_list, self._offsets):
            for p, start_p, start_s, length in b.param_shard_overlaps(self.dp_rank):
                targets.setdefault(self._names.get(id(p)), []).append((start_p, off + start_s, length))
        saved = {name: n for desc in old_layout for name, _, n in desc["params"]}
        for b in self._bucket_list:            # checked on every rank before any collective
            for p in b.params:
                name = self._names.get(id(p))
                if saved.get(name) != p.numel():
                    raise ValueError(f"ZeroOptimizer: parameter {name!r} ({p.numel()} elements) is not in the "
                                     f"saved layout with that size; was the state saved from another model?")
        new = (self.master, self.exp_avg, self.exp_avg_sq)
        pos = 0
        for desc in old_layout:
            n_shard = desc["numel"] // self.dp_size
            part = torch.stack([t[pos:pos + n_shard].float() for t in old], dim=1).to(self.device)
            full = C.all_gather_dim0(part, self.group)       # [numel, 3]
            pos += n_shard
            for name, o, _ in desc["params"]:
                for start_p, start_s, length in targets.get(name, ()):
                    for col, dst in enumerate(new):
                        dst[start_s:start_s + length] = full[o + start_p:o + start_p + length, col]
        if self.low is not None:
            self.low.copy_(self.master)

    # ------------------------------------------------------------------ read-only views of the layout
    @property
    def bucket_shards(self) -> List[Tuple[object, int]]:
        """``(bucket, offset)`` per DataParallel bucket: its shard on this rank starts at ``offset`` of the flat
        ``master`` / ``exp_avg`` / ``exp_avg_sq``."""
        return list(zip(self._bucket_list, self._offsets))

    @property
    def layout(self) -> list:
        """The bucket layout this state is laid out in (what ``state_dict()["layout"]`` records)."""
        return self._layout

    @property
    def layout_key(self) -> tuple:
        """Identifies the buckets' current storage; changes when DataParallel re-lays them out."""
        return self._layout_key

    @property
    def grad_shard(self) -> torch.Tensor:
        """This rank's averaged gradient shard (flat fp32), as the step reads it."""
        return self._grad_shard()

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
        # offloaded fp32 model: the step wrote the shard into param_data already (src None)
        src = self.low if self.low is not None else None if self._storage.writes_model_shard else self.master
        if self._use_broadcast:
            for b, off in zip(self._bucket_list, self._offsets):
                mine = b.param_data[self.dp_rank * b.shard_numel:(self.dp_rank + 1) * b.shard_numel]
                if src is not None:
                    mine.copy_(src[off:off + b.shard_numel])
                for r in range(self.dp_size):
                    C.broadcast(b.param_data[r * b.shard_numel:(r + 1) * b.shard_numel], r, self.group)
            return
        works = []
        for b, off in zip(self._bucket_list, self._offsets):
            if src is None:
                # in place: the input is this rank's own chunk of the output (NCCL's in-place all-gather,
                # the ring's and gloo's alike), so no copy of the shard is made
                s, e = b.shard_range(self.dp_rank)
                send = b.param_data[s:e]
            else:
                send = src[off:off + b.shard_numel]
            _, work = C.all_gather_dim0(send, self.group, out=b.param_data, async_op=True)
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
        self.wait_for_step()
        return full_state.full_state_dict(self, self._named_params, self.group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load a :meth:`full_state_dict` saved at any dp size (no collective): this rank's shard of the
        masters and moments, the parameters (the masters in the parameters' dtype), the step counts, and
        ``param_groups`` when the dict has them."""
        self.wait_for_step()
        named = full_state.load_full_state_dict(self, state, self._named_params, "ZeroOptimizer")
        for name, p in named:                       # every rank holds the full parameters in stages 1 and 2
            p.copy_(state["state"][name]["master"].to(device=p.device, dtype=p.dtype))

    def state_dict(self) -> dict:
        """This rank's shard of the state (clones), the layout it belongs to, ``param_groups`` (parameters
        by name) and every parameter's step count. Save one per rank. Offloaded: the states are tensors
        mapped from a private copy of the state file (``torch.save`` streams them; the copy needs as much
        disk as the state file and is freed with the tensors)."""
        self._check_layout()
        return {"format": STATE_FORMAT, "stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank,
                "param_groups": self.named_param_groups(), "layout": self._layout,
                "step": self._step.clone(), "steps": self.steps_by_name(), "started": self._started,
                **self._checkpoint_states()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` saved by the same DP rank of a run with the same DP size and param
        groups. A state saved before param groups existed (one group, one step count) loads too: its
        lr/betas/eps go to every group, its weight decay to the groups that decay, its count to every
        parameter.

        If the saved bucket layout differs from the current one (e.g. it was saved after the buffer's
        rebuild), the state is moved over with a collective: call it on every rank of the DP group.
        Parameters are left as they are: load the model's own state dict for them. A state saved with or
        without offload loads into an optimizer with or without it (offloaded: written a sub-group at a
        time, no copy in memory)."""
        if state.get("dp_size") != self.dp_size or state.get("dp_rank") != self.dp_rank:
            raise ValueError(f"ZeroOptimizer.load_state_dict: state saved by dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into dp rank {self.dp_rank} of {self.dp_size}; "
                             f"resume with the same data-parallel size and give each rank its own file")
        self._check_layout()
        self._verify_state()
        self.load_param_groups(state["param_groups"], "ZeroOptimizer.load_state_dict")
        self._step.copy_(state["step"])
        self.load_steps(state.get("steps"), int(state["step"].item()))
        tensors = [state[k].to(self.device) for k in _STATES]
        if state["layout"] == self._layout:
            self._load_states(tensors)
        else:
            self._remap(state["layout"], tensors)
        self._started = True

    # ------------------------------------------------------------------ memory
    def _backward_grad_bound(self) -> int:
        """Stage 2: the most full-gradient bytes a synced backward holds (after the first): the largest
        ``max_buckets_in_flight`` + 2 buckets (see ``DataParallel.shard_gradients_in_backward``)."""
        esize = self.dp.grad_shard.element_size()
        sizes = sorted((b.numel for b in self._bucket_list), reverse=True)
        return esize * sum(sizes[:self.dp.max_buckets_in_flight + 2])

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
        ``transient_grad_bytes``: stage 2's bound on the full-gradient bytes alive during a synced backward
        (the largest ``max_buckets_in_flight`` + 2 buckets; each is freed once it is reduced);
        ``backward_grad_bytes``: what the last backward held at most, measured on the buckets.
        Offloaded (``offload="disk"``): ``optimizer_bytes`` is the host buffers the state streams through,
        ``offload_bytes`` the state file (0 in memory); ``offload="cpu"``: ``optimizer_bytes`` 0 (none on the
        device), ``offload_bytes`` the pinned host memory.
        """
        self._check_layout()
        buckets = self._bucket_list
        num_params = sum(p.numel() for b in buckets for p in b.params)
        grad_mem = self.dp.buffer.grad_tensors() + [getattr(self.dp, "grad_shard", None)]   # freed: 0 bytes
        staged = [t for pair in getattr(self.dp, "_staged", {}).values() for t in pair]
        state = self._state_bytes()
        rep = {"stage": self.stage, "dp_size": self.dp_size, "dp_rank": self.dp_rank, "num_params": num_params,
               "padded_numel": sum(b.numel for b in buckets), "shard_numel": self.shard_numel,
               "param_bytes": M.storage_bytes(b.param_data for b in buckets),
               "grad_bytes": M.storage_bytes(grad_mem),
               "comm_bytes": M.storage_bytes(staged),
               "optimizer_bytes": state["optimizer"], "offload_bytes": state["offload"],
               "staging_bytes": M.storage_bytes([self.low, self._grad_flat]),
               "transient_grad_bytes": self._backward_grad_bound() if self.stage == 2 else 0,
               "backward_grad_bytes": self.dp.last_backward_grad_bytes if self.stage == 2 else 0}
        rep["total_bytes"] = sum(rep[k] for k in ("param_bytes", "grad_bytes", "comm_bytes", "optimizer_bytes",
                                                  "staging_bytes"))
        per = {"params": "param", "grads": "grad", "comm": "comm", "optimizer": "optimizer",
               "staging": "staging", "total": "total"}
        rep["bytes_per_param"] = {k: rep[f"{v}_bytes"] / num_params for k, v in per.items()}
        rep["paper_bytes_per_param"] = M.paper_bytes_per_param(self.stage, self.dp_size)
        return rep


__all__ = ["ZeroOptimizer", "step_multipliers"]
