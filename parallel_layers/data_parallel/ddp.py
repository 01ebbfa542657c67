"""Data parallelism with bucketed gradient reduction overlapped with backward.

How a step goes (PyTorch's reducer and Megatron-LM's DDP, in a few hundred lines):

1. Wrap time: parameters move into a :class:`ParamAndGradBuffer` (flat, bucketed; last layers first);
   rank 0's parameters (frozen ones included) and buffers are broadcast so every replica starts identical.
2. Backward: a post-accumulate-grad hook lands each gradient in the grad buffer and marks the parameter
   ready; when the last parameter of a bucket is ready (and all buckets before it were launched: the same
   order of collectives on every rank), the bucket's collective is launched with ``async_op=True`` at once,
   so it runs while autograd computes the gradients of earlier layers.
   Landing: after ``zero_grad()`` (``set_to_none=True``, torch's default) ``.grad`` is None and the buffer is
   left as it was; autograd hands the hook a fresh gradient, which is written over the parameter's slice
   already multiplied by 1/world (one pass, as DDP's copy into its bucket; no memset, no add, no separate
   scaling pass). When gradients accumulate (``no_sync`` micro-batches, ``zero_grad(set_to_none=False)``)
   ``p.grad`` *is* the buffer view, autograd adds into it, and the bucket is scaled at launch. A layer that
   writes its weight gradient itself (:mod:`.fused_grads`) goes through :meth:`DataParallel.write_grad`.
3. End of backward (an autograd callback queued by the first hook): launch what is left, wait on EVERY
   work, unpack low-precision buckets; ``.grad`` then holds the averaged gradient.

Traps handled (docs/architecture.md, "Known traps"): a bucket's buffers belong to it alone (no ping-pong reuse), and are
touched again only after its work was waited on; the bucket order is rebuilt once, from the order gradients
actually arrived on rank 0 (broadcast so all ranks agree), skipped with ``find_unused_parameters``
as in PyTorch; parameters without a gradient are reported by name instead of a hang.

ZeRO-2 (:meth:`DataParallel.shard_gradients_in_backward`, called by ``ZeroOptimizer(stage=2)``): every
bucket gets its own gradient memory, allocated (zeroed) when its first gradient of a backward lands and
freed as soon as its reduce-scatter is done and the averaged shard is in :attr:`grad_shard`; a launch
first finishes the oldest reduction while more than ``max_buckets_in_flight`` are in flight. So a synced
backward holds the gradient shard plus the buckets being filled or reduced, not the full buffer
(DeepSpeed's ZeRO-2). Under ``no_sync`` the buckets are kept until the synced backward (one reduction per
step, the same bits as a kept buffer); several synced backwards without ``zero_grad`` add their averaged
shards (DeepSpeed's accumulation into the partition).

Rebuild timing: with ``all_reduce`` the first backward reduces in the initial layout and the averaged
gradients move into the new layout afterwards (every rank holds all of them). With ``reduce_scatter`` that
would be wrong (each rank holds only its old shard averaged), so the first synced backward launches nothing
until its end, re-lays out the still-local gradients, then reduces in the new layout: one backward without
overlap, and a ZeRO optimizer built before it simply derives its shards from the new layout.
"""
from __future__ import annotations

import contextlib
import time
import weakref
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ..distributed import collectives as C
from ..ops.bucket import pack_bucket, unpack_bucket
from ..weak_hooks import weak_hook
from .buffers import Bucket, ParamAndGradBuffer

_REDUCE_OPS = ("all_reduce", "reduce_scatter")


def _broadcast_coalesced(tensors, group) -> None:
    """Rank 0's values of ``tensors`` on every rank: one collective per (dtype, device)."""
    kinds: Dict[tuple, list] = {}
    for t in tensors:
        if t.numel():
            kinds.setdefault((t.dtype, t.device), []).append(t)
    for same in kinds.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        C.broadcast(flat, 0, group)
        offset = 0
        for t in same:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class DataParallel(nn.Module):
    """Replicates ``module`` over ``dp_group``; after ``backward`` gradients are averaged over the group.

    ``reduce_op="all_reduce"`` (stage 0): every rank ends with the full averaged gradient in ``p.grad``
    (for fp32 params; low-precision params keep theirs in ``p.main_grad`` and ``p.grad`` is None).
    ``reduce_op="reduce_scatter"`` (ZeRO 1/2): each rank ends with the averaged *shard* of every bucket in
    :attr:`grad_shard` (one flat tensor, bucket after bucket; :meth:`bucket_grad_shard` gives a bucket's view),
    mirrored into ``bucket.grad_data[bucket.shard_range(dp_rank)]``; the rest of the grad buffer holds local values.

    ``comm_dtype`` (e.g. bf16): buckets are packed as ``(grad * 1/world).to(comm_dtype)`` (scale BEFORE the
    cast: no overflow for fp16), reduced in that dtype, unpacked into the fp32 main grads.

    Gradients accumulate in the buffer across backwards (``no_sync()`` micro-batches); clear them with
    ``zero_grad()`` (or an optimizer's ``zero_grad()``: ``p.grad is None`` at the next forward is seen). A
    cleared parameter's buffer slice is stale until its next gradient overwrites it; ``p.main_grad`` is
    valid once a backward has run (slices of parameters that got no gradient are zeroed at its end).
    """

    def __init__(self, module: nn.Module, dp_group, *, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
                 overlap: bool = True, reduce_op: str = "all_reduce", comm_dtype: Optional[torch.dtype] = None,
                 find_unused_parameters: bool = False, broadcast_from_rank0: bool = True,
                 grad_dtype: Optional[torch.dtype] = None, rebuild_bucket_order: Optional[bool] = None,
                 fuse_grad_accumulation: bool = True):
        super().__init__()
        if reduce_op not in _REDUCE_OPS:
            raise ValueError(f"DataParallel: reduce_op={reduce_op!r}; choose one of {_REDUCE_OPS}")
        self.module = module
        self.dp_group = dp_group
        self.dp_size, self.dp_rank = C.world_size(dp_group), C.rank(dp_group)
        self.overlap, self.reduce_op = bool(overlap), reduce_op
        self.find_unused_parameters = bool(find_unused_parameters)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # shared params listed once
        if not named:
            raise ValueError("DataParallel: the module has no parameters with requires_grad=True")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise TypeError(f"DataParallel: parameters have several dtypes {sorted(map(str, dtypes))}; cast the "
                            f"module to one dtype first (mixed-precision master weights live in the optimizer)")
        pdtype = dtypes.pop()
        self.grad_dtype = grad_dtype or (pdtype if pdtype == torch.float64 else torch.float32)
        self.comm_dtype = comm_dtype or self.grad_dtype
        self._names: Dict[int, str] = {id(p): n for n, p in named}
        self.buffer = ParamAndGradBuffer([p for _, p in named], dp_group, bucket_cap_mb=bucket_cap_mb,
                                         first_bucket_cap_mb=first_bucket_cap_mb, grad_dtype=self.grad_dtype)
        # Rebuilt once from the arrival order (default on, as PyTorch's reducer; off with unused parameters,
        # whose arrival order says nothing). reduce_scatter re-lays out before reducing: see finish_grad_sync.
        rebuild = True if rebuild_bucket_order is None else bool(rebuild_bucket_order)
        self._rebuild_pending = rebuild and not self.find_unused_parameters and self.dp_size > 1
        self.layout_version = 0          # bumped when the bucket layout is rebuilt (views change)
        if broadcast_from_rank0 and self.dp_size > 1:
            with torch.no_grad():
                C.broadcast(self.buffer.param_buffer, 0, dp_group)   # all trained params in one collective
                # frozen parameters and buffers too (as torch DDP): a frozen embedding initialised from
                # another seed would otherwise differ between replicas for the whole run
                frozen = [p for p in module.parameters() if not p.requires_grad]
                _broadcast_coalesced(frozen + list(module.buffers()), dp_group)
        self._sync = True
        self._release = False            # ZeRO-2: free each bucket's gradient memory once it is reduced
        self.max_buckets_in_flight = 0
        self._shard_filled: set = set()  # buckets whose shard holds an earlier synced backward's gradient
        # reduce_scatter: buckets reduced since their last gradient (their values mix the reduced shard and
        # local ones): zeroed before their next gradient lands
        self._consumed: set = set()
        self._grad_live = self._grad_peak = 0
        self.last_backward_grad_bytes = 0   # ZeRO-2: the most bucket-gradient bytes alive in the last backward
        # Parameters whose buffer slice holds a stale value that counts as zero (cleared by zero_grad with
        # set_to_none=True): their next gradient is written over the slice instead of added to it.
        self._stale: set = set()
        self._unsynced_end_queued = False
        # Scale at landing (fused into the write) when the collective runs in the grad dtype; a low-precision
        # communication scales in the pack kernel instead (scale BEFORE the down-cast).
        self._prescale = self.comm_dtype == self.grad_dtype and self.dp_size > 1
        on_grad = weak_hook(self, type(self)._on_grad_ready)      # a strong one would leak the whole model
        self._hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in self.buffer.params]
        if reduce_op == "reduce_scatter":
            # before autograd accumulates into a .grad that views a reduced bucket (its values are no longer
            # this rank's local sum) or a freed one (ZeRO-2), the bucket is zeroed (brought back)
            for p in self.buffer.params:
                pid = id(p)
                p.register_hook(weak_hook(self, lambda dp, grad, pid=pid: dp._live_id(pid)))
        self._index_params()
        self._reset_iteration()
        self.last_sync_timeline: Optional[dict] = None
        # Layers that can (fused_grads.py) write their weight gradients straight into the buffer; the dtypes
        # must match, since the write is a GEMM / index_add into the fp32 slice. A weak reference: no cycle,
        # and copy.deepcopy of the module (an EMA copy, say) does not try to copy this wrapper.
        self.fuse_grad_accumulation = bool(fuse_grad_accumulation) and self._direct
        sink = weakref.ref(self) if self.fuse_grad_accumulation else None
        for p in self.buffer.params:
            p.grad_sink = sink

    # ------------------------------------------------------------------ set-up helpers
    def _index_params(self) -> None:
        """Per-param bucket index, per-bucket counts and communication buffers (after every (re)layout)."""
        buf = self.buffer
        self._grad_live = sum(t.untyped_storage().nbytes() for t in buf.grad_tensors())
        self._bucket_idx = {id(p): buf.bucket_of(p)[0].index for p in buf.params}
        self._bucket_size = [len(b.params) for b in buf.buckets]
        self._direct = buf.param_dtype == self.grad_dtype   # autograd accumulates straight into the buffer
        for p in buf.params:
            p.grad = p.main_grad if self._direct else None
        # reduce_scatter: this rank's averaged shards of every bucket, concatenated (bucket order) into ONE
        # flat tensor in the grad dtype. The collective writes straight into it (comm dtype = grad dtype), so
        # it is the only persistent copy of the reduced shard: a ZeRO optimizer steps on it directly.
        self.shard_offsets: List[int] = []
        pos = 0
        for b in buf.buckets:
            self.shard_offsets.append(pos)
            pos += b.shard_numel
        self.grad_shard: Optional[torch.Tensor] = (
            torch.zeros(pos, dtype=self.grad_dtype, device=buf.device) if self.reduce_op == "reduce_scatter" else None)
        self._scale = torch.full((1,), 1.0 / self.dp_size, dtype=torch.float32, device=buf.device)
        # the same float32 value, as a GEMM's alpha (rounded on the host: no device sync, and a meta-device
        # model, as the layout planner builds, has no value to read)
        self._scale_value = float(torch.tensor(1.0 / self.dp_size, dtype=torch.float32))
        self._one = torch.ones(1, dtype=torch.float32, device=buf.device)

    def bucket_grad_shard(self, b: Bucket) -> torch.Tensor:
        """reduce_scatter: the view of :attr:`grad_shard` that holds bucket ``b``'s averaged shard."""
        off = self.shard_offsets[b.index]
        return self.grad_shard[off:off + b.shard_numel]

    def _reset_iteration(self) -> None:
        self._ready_count = [0] * len(self.buffer.buckets)
        self._ready: set = set()
        self._works: Dict[int, object] = {}     # bucket index -> async work (None: group of one)
        # bucket index -> (packed input, reduce-scatter output) in the comm dtype, or None where the
        # collective works on the fp32 buffers themselves. Allocated at launch, owned by that bucket alone,
        # dropped only after its work was waited on (no ping-pong reuse: docs/architecture.md, "Known traps").
        self._staged: Dict[int, tuple] = {}
        self._next = 0                          # lowest bucket index not launched yet
        self._arrival: List[torch.nn.Parameter] = []
        self._callback_queued = False
        self._launch_log: List[tuple] = []
        self._prescaled: set = set()            # params whose slice already holds grad * 1/world
        self._in_flight: List[int] = []         # ZeRO-2: launched buckets not finished yet, in launch order
        self._finished: set = set()             # launched buckets whose result is in place

    # ------------------------------------------------------------------ public API
    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self._repoint_grads()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside only accumulate into the grad buffer; the next synced backward reduces the sum."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def shard_gradients_in_backward(self, max_buckets_in_flight: int = 2) -> None:
        """ZeRO-2: from now on each bucket's full gradient memory exists only from its first gradient of a
        backward until its reduce-scatter is done (see the module docstring); at most
        ``max_buckets_in_flight`` reductions are in flight (a launch first finishes the oldest). So a
        backward holds at most ``max_buckets_in_flight + 2`` buckets: those in flight, the one being filled,
        and one whose parameter's gradient arrives in two parts (a tied embedding: its LM-head share is
        written early, its lookup's at the end); :attr:`last_backward_grad_bytes` is what the last one
        held. Between steps this rank holds :attr:`grad_shard` alone. Needs ``reduce_op="reduce_scatter"``.
        The buckets keep their first layout (parameters in reverse order, which is close to the order their
        gradients arrive in): re-laying them out in arrival order, as DataParallel otherwise does at its first
        synced backward, would hold every bucket in that backward, or, done later, move the optimizer's state."""
        if self.reduce_op != "reduce_scatter":
            raise ValueError(f"DataParallel.shard_gradients_in_backward: reduce_op={self.reduce_op!r}; the "
                             f"gradients can only be freed after a reduce-scatter (each rank keeps its shard)")
        if int(max_buckets_in_flight) < 1:
            raise ValueError(f"DataParallel.shard_gradients_in_backward: max_buckets_in_flight="
                             f"{max_buckets_in_flight}; pass 1 or more")
        self.max_buckets_in_flight = int(max_buckets_in_flight)
        if self._release:
            return
        self._rebuild_pending = False
        self.buffer.split_grad_storage()
        self._release = True
        self._index_params()
        self.release_grads()

    @property
    def releases_grads(self) -> bool:
        """Whether each bucket's gradient memory is freed once it is reduced (ZeRO-2)."""
        return self._release

    def release_grads(self) -> None:
        """ZeRO-2: free every bucket's full gradient memory and zero the shard now (the step consumed the
        gradients); the next gradient of each parameter starts from zero."""
        for b in self.buffer.buckets:
            self._free_bucket(b)
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        self._shard_filled, self._consumed = set(), set()

    def _free_bucket(self, b: Bucket) -> None:
        st = b.grad_data.untyped_storage()
        if st.nbytes():
            self._grad_live -= st.nbytes()
            st.resize_(0)
        for p in b.params:
            self._stale.add(id(p))     # .grad may still view the freed memory: see _live_id

    def _live(self, p) -> None:
        """ZeRO-2: bring ``p``'s bucket's gradient memory back (zeroed) before anything writes into it."""
        self._live_id(id(p))

    def _live_id(self, pid: int) -> None:
        if self._consumed:
            b = self.buffer.buckets[self._bucket_idx[pid]]
            if b.index in self._consumed:
                self._consumed.discard(b.index)
                with torch.no_grad():
                    b.grad_data.zero_()
        if self._release:
            b = self.buffer.buckets[self._bucket_idx[pid]]
            st = b.grad_data.untyped_storage()
            if st.nbytes() == 0:
                st.resize_(b.numel * b.grad_data.element_size())
                b.grad_data.zero_()
                self._grad_live += st.nbytes()
                self._grad_peak = max(self._grad_peak, self._grad_live)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``set_to_none=True`` (torch's default): ``.grad`` becomes None and the buffer is not touched; each
        parameter's next gradient is written over its slice (see the module docstring). ``False``: the
        buffer is zeroed (one memset) and ``.grad`` stays the buffer view. ZeRO-2: the buckets are freed."""
        if self.grad_shard is not None:
            self.grad_shard.zero_()
        self._shard_filled, self._consumed = set(), set()
        if self._release:
            self.release_grads()
            return
        if set_to_none:
            self._stale = {id(p) for p in self.buffer.params}
            for p in self.buffer.params:
                p.grad = None
            return
        self.buffer.zero_grad()
        self._stale = set()
        for p in self.buffer.params:
            p.grad = p.main_grad if self._direct else None

    def sync_gradients(self) -> None:
        """Reduce, in one go, the gradients accumulated so far under :meth:`no_sync` (e.g. over every
        microbatch of a pipeline step, where backwards are many separate ``autograd.backward`` calls).
        Every parameter counts as ready (accumulated zeros for those without a gradient); the buckets
        are reduced in bucket order, exactly as at the end of a synced backward. A collective over the
        dp group. No bucket re-layout happens on this path (the buffer keeps its initial order)."""
        self._rebuild_pending = False
        for p in self.buffer.params:
            if id(p) not in self._ready:
                self._fill_stale(p)
                self._mark_ready(p, launch=False)
        self.finish_grad_sync()

    def finish_grad_sync(self) -> None:
        """Launch every bucket not yet launched, wait on every work, unpack. Runs at the end of backward."""
        t_end = time.perf_counter()
        n_hooks = len(self._arrival)
        missing = [p for p in self.buffer.params if id(p) not in self._ready]
        if missing and not self.find_unused_parameters:
            self._wait_all()   # keep the group consistent before raising
            self._reset_iteration()
            names = [self._names[id(p)] for p in missing]
            raise RuntimeError(
                f"DataParallel: {len(names)} parameter(s) got no gradient in this backward: {', '.join(names)}. "
                f"Either make every parameter take part in the loss, set requires_grad=False on unused ones, "
                f"or wrap with DataParallel(..., find_unused_parameters=True)")
        for p in missing:          # their slices hold no_sync sums, or zeros once stale ones are filled
            self._fill_stale(p)
            self._mark_ready(p, launch=False)
        arrival = self._arrival
        if self._rebuild_pending and self.reduce_op == "reduce_scatter":
            # A reduce-scatter leaves each rank only its shard averaged; re-laying out afterwards would give every
            # rank a new shard mixing averaged and local values. So this one backward launched nothing: the local
            # gradients move with their parameters into the arrival-order layout, then they are reduced there.
            self._rebuild_from(arrival)
        for b in self.buffer.buckets:   # bucket order: the same sequence of collectives on every rank
            if b.index not in self._works:
                self._launch(b)
        self._wait_all()
        if self.find_unused_parameters and self.dp_size > 1:
            self._drop_globally_unused(missing)
        self.last_sync_timeline = {"backward_end": t_end, "n_params": len(self.buffer.params),
                                   "grads_ready_at_backward_end": n_hooks, "overlap": self.overlap,
                                   "launches": list(self._launch_log),
                                   "arrival": [self._names[id(p)] for p in arrival]}
        if self._rebuild_pending:      # all_reduce: every rank holds the full averaged gradient; it moves along
            self._rebuild_from(arrival)
        self.last_backward_grad_bytes, self._grad_peak = self._grad_peak, self._grad_live
        self._reset_iteration()

    # ------------------------------------------------------------------ backward machinery
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if id(p) in self._ready:
            raise RuntimeError(f"DataParallel: parameter {self._names[id(p)]} got its gradient twice in one "
                               f"backward (reentrant checkpointing or a second backward through the graph?); "
                               f"its bucket was already being reduced")
        self._live(p)
        with torch.no_grad():
            if self._claim_stale(p):        # first gradient since zero_grad(): write it over the stale slice
                if p.grad is not None and p.grad.data_ptr() == p.main_grad.data_ptr():
                    # ZeRO-2: autograd added it into the bucket brought back zeroed (.grad may be a guard)
                    if id(p) in self._prescaled:
                        p.main_grad.mul_(self._scale)
                elif id(p) in self._prescaled:
                    torch.mul(p.grad, self._scale, out=p.main_grad)   # the average's 1/world, fused in
                else:
                    p.main_grad.copy_(p.grad)
            elif p.grad is None:            # written by a fused layer (write_grad), nothing through autograd
                pass
            elif not self._direct or (p.grad is not p.main_grad and p.grad.data_ptr() != p.main_grad.data_ptr()):
                # low-precision param, .grad replaced after forward, or an unfused share of a weight a fused
                # layer already wrote (averaged at landing): fold it in, at the slice's scale
                if id(p) in self._prescaled:
                    p.main_grad.addcmul_(p.grad, self._scale)
                else:
                    p.main_grad.add_(p.grad)
        p.grad = p.main_grad if self._direct else None   # low-precision param: the fp32 main grad only
        if not self._sync:
            if self._stale and not self._unsynced_end_queued:
                self._unsynced_end_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_unsynced_backward)
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
        self._arrival.append(p)
        # reduce_scatter waits for its one re-layout (see finish_grad_sync) before reducing anything
        defer = self._rebuild_pending and self.reduce_op == "reduce_scatter"
        self._mark_ready(p, launch=self.overlap and not defer)

    def param_name(self, p: torch.Tensor) -> str:
        """``p``'s name in the wrapped module (as ``named_parameters()`` gives it)."""
        return self._names[id(p)]

    @property
    def bucket_names(self) -> List[List[str]]:
        """The parameter names of each gradient bucket, in bucket order (the layout after any re-layout)."""
        return [[self._names[id(p)] for p in b.params] for b in self.buffer.buckets]

    @property
    def launched_reductions(self) -> Dict[int, object]:
        """The buckets whose reduction this synced backward has launched: bucket index -> its async work
        (None for a group of one). A new dict for every backward; read it, never change it."""
        return self._works

    def owns(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the parameters whose gradients live in this wrapper's buffer."""
        return id(p) in self._bucket_idx

    def write_grad(self, p: torch.nn.Parameter, write) -> None:
        """A fused layer's contribution to ``p``'s gradient (see :mod:`.fused_grads`): ``write(out, beta,
        alpha)`` sets ``out = beta * out + alpha * G``. Over a stale slice beta is 0; while syncing, a first
        write lands averaged (alpha 1/world) and later writes in the same backward follow it."""
        self._live(p)
        beta = 0.0 if self._claim_stale(p) else 1.0
        if beta == 0.0 and self._direct and p.grad is not None:
            # .grad views the slice just written (a freed or reduced bucket brought back): a share autograd
            # adds later must arrive as its own tensor, to be folded in at the slice's scale
            p.grad = None
        with torch.no_grad():
            write(p.main_grad, beta, self._scale_value if id(p) in self._prescaled else 1.0)

    def _claim_stale(self, p) -> bool:
        """Whether ``p``'s slice is stale, so the gradient arriving now is written over it; it is then no
        longer stale, and while syncing (in the grad dtype) that write lands averaged: ``p`` counts as
        scaled."""
        if id(p) not in self._stale:
            return False
        self._stale.discard(id(p))
        if self._sync and self._prescale:
            self._prescaled.add(id(p))
        return True

    def _end_unsynced_backward(self) -> None:
        """End of a ``no_sync`` backward: parameters still stale got no gradient; their slices become zeros
        (so ``main_grad`` is valid after every backward, e.g. for a tied-weight all-reduce)."""
        self._unsynced_end_queued = False
        for p in self.buffer.params:
            self._fill_stale(p, syncing=False)

    def _fill_stale(self, p, syncing: bool = True) -> None:
        """A parameter without a gradient in this backward: a stale slice becomes zeros. While syncing it
        then counts as scaled (0 * 1/world is 0); after a ``no_sync`` backward more may be added to it."""
        if id(p) not in self._stale:
            return
        self._stale.discard(id(p))
        self._live(p)
        with torch.no_grad():
            p.main_grad.zero_()
        if syncing:
            self._prescaled.add(id(p))
        if self._direct:
            p.grad = p.main_grad

    def _scale_for_average(self, b: Bucket) -> None:
        """Multiply by 1/world whatever part of the bucket was not scaled when it landed."""
        todo = [p for p in b.params if id(p) not in self._prescaled]
        if len(todo) == len(b.params):
            b.grad_data.mul_(self._scale)     # padding is zero and stays zero
        else:
            for p in todo:
                p.main_grad.mul_(self._scale)

    def _mark_ready(self, p, launch: bool) -> None:
        self._ready.add(id(p))
        bi = self._bucket_idx[id(p)]
        self._ready_count[bi] += 1
        # Launch strictly in bucket order (as PyTorch's reducer): every rank then issues the same sequence of
        # collectives even if gradients (or unused parameters) arrive in a different order on another rank.
        while launch and self._next < len(self._bucket_size) and \
                self._ready_count[self._next] == self._bucket_size[self._next]:
            self._launch(self.buffer.buckets[self._next])
            self._next += 1

    def _launch(self, b: Bucket) -> None:
        if b.index in self._works:
            return
        self._launch_log.append((b.index, time.perf_counter(), len(self._arrival)))
        if self.dp_size == 1:
            self._works[b.index] = None
            self._bound_in_flight(b)
            return
        rs = self.reduce_op == "reduce_scatter"
        with torch.no_grad():
            if self.comm_dtype == self.grad_dtype:
                self._scale_for_average(b)        # average = sum of (g / world); no divide pass later
                src, out = b.grad_data, (self.bucket_grad_shard(b) if rs else None)
                if b.index in self._shard_filled:     # ZeRO-2, another synced backward: added at the end
                    out = torch.empty_like(out)
                    self._staged[b.index] = (None, out)
            else:
                src = torch.empty(b.numel, dtype=self.comm_dtype, device=b.grad_data.device)
                pack_bucket([b.grad_data], src, scale=self._scale, offsets=[0])  # scale, then down-cast
                out = torch.empty(b.shard_numel, dtype=self.comm_dtype, device=src.device) if rs else None
                self._staged[b.index] = (src, out)
            if rs:
                _, work = C.reduce_scatter_dim0(src, self.dp_group, out=out, async_op=True)
            else:
                work = C.all_reduce(src, self.dp_group, async_op=True)
        self._works[b.index] = work
        self._bound_in_flight(b)

    def _bound_in_flight(self, b: Bucket) -> None:
        """ZeRO-2: finish the oldest reductions while more than ``max_buckets_in_flight`` are in flight."""
        if self._release:
            self._in_flight.append(b.index)
            while len(self._in_flight) > self.max_buckets_in_flight:
                self._finish(self._in_flight.pop(0))

    def _wait_all(self) -> None:
        """Finish every launched bucket still in flight, in launch order."""
        for bi in list(self._works):
            self._finish(bi)
        self._works, self._staged, self._in_flight, self._finished = {}, {}, [], set()

    def _finish(self, bi: int) -> None:
        """Wait on bucket ``bi``'s work, then bring its result into the fp32 grad memory.

        reduce_scatter: the averaged shard lands in :attr:`grad_shard` (written by the collective itself, or
        unpacked from the comm dtype, or added to what an earlier synced backward left there) and is mirrored
        into ``bucket.grad_data[shard_range]``; ZeRO-2 frees the bucket's full gradient memory instead."""
        if bi in self._finished:
            return
        self._finished.add(bi)
        work = self._works[bi]
        if work is not None:
            work.wait()
        b = self.buffer.buckets[bi]
        src, out = self._staged.pop(bi, (None, None))
        with torch.no_grad():
            if self.reduce_op == "all_reduce":
                if src is not None:
                    unpack_bucket(src, [b.grad_data], scale=self._one, offsets=[0], accumulate=False)
                return
            shard = self.bucket_grad_shard(b)
            s0, s1 = b.shard_range(self.dp_rank)
            add = bi in self._shard_filled
            if self.dp_size == 1:
                shard.add_(b.grad_data) if add else shard.copy_(b.grad_data)
            elif out is not None:
                unpack_bucket(out, [shard], scale=self._one, offsets=[0], accumulate=add)
            self._shard_filled.add(bi)
            if not self._release:
                b.grad_data[s0:s1].copy_(shard)
                self._consumed.add(bi)
                self._stale.update(id(p) for p in b.params)
                return
            self._free_bucket(b)

    def _drop_globally_unused(self, missing) -> None:
        """Params no rank used get ``.grad = None`` (as in single-process training: the optimizer skips them)."""
        used = torch.ones(len(self.buffer.params), dtype=torch.int32, device=self.buffer.device)
        miss = {id(p) for p in missing}
        for i, p in enumerate(self.buffer.params):
            if id(p) in miss:
                used[i] = 0
        C.all_reduce(used, self.dp_group)
        for i in torch.nonzero(used == 0).flatten().tolist():
            self.buffer.params[i].grad = None

    def _repoint_grads(self) -> None:
        """Before forward: a ``.grad`` set to None (optimizer.zero_grad) means "start from zero" for that param:
        its slice becomes stale (written over by the next gradient). A ``.grad`` assigned by the user becomes
        the accumulation start."""
        if not self._direct or self._release:     # ZeRO-2: .grad holds guards; nothing to start from
            return
        with torch.no_grad():
            for p in self.buffer.params:
                if p.grad is None:
                    self._stale.add(id(p))
                elif p.grad is not p.main_grad and p.grad.data_ptr() != p.main_grad.data_ptr():
                    p.main_grad.copy_(p.grad)
                    p.grad = p.main_grad
                    self._stale.discard(id(p))
                elif id(p) in self._stale:  # the view was put back by hand over a stale slice: zeros
                    p.main_grad.zero_()
                    self._stale.discard(id(p))

    def _rebuild_from(self, arrival: List[torch.nn.Parameter]) -> None:
        """Once: lay buckets out in the order gradients arrived on rank 0 (PyTorch's reducer does the same)."""
        self._rebuild_pending = False
        index = {id(p): i for i, p in enumerate(self.buffer.params)}
        order = torch.full((len(index),), -1, dtype=torch.int64, device=self.buffer.device)
        order[:len(arrival)] = torch.tensor([index[id(p)] for p in arrival], dtype=torch.int64)
        C.broadcast(order, 0, self.dp_group)      # ranks could see different arrival orders (threads, streams)
        new = [self.buffer.params[i] for i in order.tolist() if i >= 0]
        if [id(p) for p in new] == [id(p) for p in self.buffer.params[:len(new)]]:
            return                                # already in arrival order
        self.buffer.rebuild(new)
        self._index_params()         # the caller resets the per-iteration bookkeeping
        self.layout_version += 1


def overlap_report(timeline: dict) -> dict:
    """Summarise ``last_sync_timeline``: how many buckets were launched before backward ended."""
    early = [(bi, n) for bi, t, n in timeline["launches"] if t < timeline["backward_end"]
             and n < timeline["n_params"]]
    return {"buckets": len(timeline["launches"]), "launched_before_backward_end": len(early), "early": early}


__all__ = ["DataParallel", "overlap_report"]
