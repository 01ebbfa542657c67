"""Data parallelism with bucketed gradient reduction overlapped with backward.

How a step goes (PyTorch's reducer and Megatron-LM's DDP, in a few hundred lines):

1. Wrap time: parameters move into a :class:`ParamAndGradBuffer` (flat, bucketed; last layers first);
   rank 0's parameters and buffers are broadcast so every replica starts identical.
2. Backward: autograd accumulates each fp32 gradient straight into the grad buffer (``p.grad`` *is* a view
   of it). A post-accumulate-grad hook marks the parameter ready; when the last parameter of a bucket is
   ready (and all buckets before it were launched: the same order of collectives on every rank), the bucket is
   scaled by 1/world and its collective is launched with ``async_op=True`` at once, so it runs while autograd
   computes the gradients of earlier layers.
3. End of backward (an autograd callback queued by the first hook): launch what is left, wait on EVERY
   work, unpack low-precision buckets; ``.grad`` then holds the averaged gradient.

Traps handled (DESIGN.md, "Known traps"): a bucket's buffers belong to it alone (no ping-pong reuse), and are
touched again only after its work was waited on; the bucket order is rebuilt once, from the order gradients
actually arrived on rank 0 (broadcast so all ranks agree), skipped with ``find_unused_parameters``
as in PyTorch; parameters without a gradient are reported by name instead of a hang.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from ..ops.bucket import pack_bucket, unpack_bucket
from .buffers import Bucket, ParamAndGradBuffer

_REDUCE_OPS = ("all_reduce", "reduce_scatter")


class DataParallel(nn.Module):
    """Replicates ``module`` over ``dp_group``; after ``backward`` gradients are averaged over the group.

    ``reduce_op="all_reduce"`` (stage 0): every rank ends with the full averaged gradient in ``p.grad``
    (for fp32 params; low-precision params keep theirs in ``p.main_grad`` and ``p.grad`` is None).
    ``reduce_op="reduce_scatter"`` (ZeRO 1/2): each rank ends with the averaged *shard* of every bucket in
    ``bucket.grad_data[bucket.shard_range(dp_rank)]``; the rest of the grad buffer holds local values.

    ``comm_dtype`` (e.g. bf16): buckets are packed as ``(grad * 1/world).to(comm_dtype)`` (scale BEFORE the
    cast: no overflow for fp16), reduced in that dtype, unpacked into the fp32 main grads.

    Gradients accumulate in the buffer across backwards (``no_sync()`` micro-batches); clear them with
    ``zero_grad()`` (or an optimizer's ``zero_grad()``: ``p.grad is None`` at the next forward is seen and the
    buffer slice zeroed).
    """

    def __init__(self, module: nn.Module, dp_group, *, bucket_cap_mb: float = 25.0, first_bucket_cap_mb: float = 1.0,
                 overlap: bool = True, reduce_op: str = "all_reduce", comm_dtype: Optional[torch.dtype] = None,
                 find_unused_parameters: bool = False, broadcast_from_rank0: bool = True,
                 grad_dtype: Optional[torch.dtype] = None, rebuild_bucket_order: Optional[bool] = None):
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
        # Sharded optimizers own shards of the layout they were built on: by default only stage 0 rebuilds.
        self._rebuild_pending = (reduce_op == "all_reduce") if rebuild_bucket_order is None else bool(rebuild_bucket_order)
        self._rebuild_pending = self._rebuild_pending and not self.find_unused_parameters and self.dp_size > 1
        self.layout_version = 0          # bumped when the bucket layout is rebuilt (views change)
        if broadcast_from_rank0 and self.dp_size > 1:
            with torch.no_grad():
                C.broadcast(self.buffer.param_buffer, 0, dp_group)   # all params in one collective
                for b in module.buffers():
                    C.broadcast(b, 0, dp_group)
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.buffer.params]
        self._index_params()
        self._reset_iteration()
        self.last_sync_timeline: Optional[dict] = None

    # ------------------------------------------------------------------ set-up helpers
    def _index_params(self) -> None:
        """Per-param bucket index, per-bucket counts and communication buffers (after every (re)layout)."""
        buf = self.buffer
        self._bucket_idx = {id(p): buf.bucket_of(p)[0].index for p in buf.params}
        self._bucket_size = [len(b.params) for b in buf.buckets]
        self._direct = buf.param_dtype == self.grad_dtype   # autograd accumulates straight into the buffer
        for p in buf.params:
            p.grad = p.main_grad if self._direct else None
        low = self.comm_dtype != self.grad_dtype
        # One comm buffer per bucket, never shared: a bucket's memory is reused only after its work finished.
        self._comm_in = [torch.empty(b.numel, dtype=self.comm_dtype, device=buf.device) if low else None
                         for b in buf.buckets]
        self._comm_out = [torch.empty(b.shard_numel, dtype=self.comm_dtype, device=buf.device)
                          if self.reduce_op == "reduce_scatter" else None for b in buf.buckets]
        self._scale = torch.full((1,), 1.0 / self.dp_size, dtype=torch.float32, device=buf.device)
        self._one = torch.ones(1, dtype=torch.float32, device=buf.device)

    def _reset_iteration(self) -> None:
        self._ready_count = [0] * len(self.buffer.buckets)
        self._ready: set = set()
        self._works: Dict[int, object] = {}     # bucket index -> async work (None: group of one)
        self._next = 0                          # lowest bucket index not launched yet
        self._arrival: List[torch.nn.Parameter] = []
        self._callback_queued = False
        self._launch_log: List[tuple] = []

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

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 (views must survive: always zero)
        self.buffer.zero_grad()
        if self._direct:
            for p in self.buffer.params:
                p.grad = p.main_grad
        else:
            for p in self.buffer.params:
                p.grad = None

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
        for p in missing:          # their buffer slices hold zeros (or no_sync sums): reduce them as they are
            self._mark_ready(p, launch=False)
        for b in self.buffer.buckets:   # bucket order: the same sequence of collectives on every rank
            if b.index not in self._works:
                self._launch(b)
        self._wait_all()
        if self.find_unused_parameters and self.dp_size > 1:
            self._drop_globally_unused(missing)
        self.last_sync_timeline = {"backward_end": t_end, "n_params": len(self.buffer.params),
                                   "grads_ready_at_backward_end": n_hooks, "overlap": self.overlap,
                                   "launches": list(self._launch_log),
                                   "arrival": [self._names[id(p)] for p in self._arrival]}
        arrival = self._arrival
        self._reset_iteration()
        if self._rebuild_pending:
            self._rebuild_from(arrival)

    # ------------------------------------------------------------------ backward machinery
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self._direct:            # low-precision param: accumulate into the fp32 main grad, free p.grad
            p.main_grad.add_(p.grad)
            p.grad = None
        elif p.grad is not p.main_grad and p.grad.data_ptr() != p.main_grad.data_ptr():
            p.main_grad.add_(p.grad)    # someone replaced .grad after forward: fold it in, restore the view
            p.grad = p.main_grad
        if not self._sync:
            return
        if id(p) in self._ready:
            raise RuntimeError(f"DataParallel: parameter {self._names[id(p)]} got its gradient twice in one "
                               f"backward (reentrant checkpointing or a second backward through the graph?); "
                               f"its bucket was already being reduced")
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_grad_sync)
        self._arrival.append(p)
        self._mark_ready(p, launch=self.overlap)

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
            return
        src = self._comm_in[b.index]
        with torch.no_grad():
            if src is None:
                b.grad_data.mul_(self._scale)      # average = sum of (g / world); no separate divide pass later
                src = b.grad_data
            else:
                pack_bucket([b.grad_data], src, scale=self._scale, offsets=[0])  # scale, then down-cast
            if self.reduce_op == "all_reduce":
                work = C.all_reduce(src, self.dp_group, async_op=True)
            else:
                _, work = C.reduce_scatter_dim0(src, self.dp_group, out=self._comm_out[b.index], async_op=True)
        self._works[b.index] = work

    def _wait_all(self) -> None:
        """Wait on every launched work (in launch order), then bring results into the fp32 grad buffer."""
        for bi, work in list(self._works.items()):
            if work is not None:
                work.wait()
            if self.dp_size == 1:
                continue
            b = self.buffer.buckets[bi]
            with torch.no_grad():
                if self.reduce_op == "all_reduce":
                    if self._comm_in[bi] is not None:
                        unpack_bucket(self._comm_in[bi], [b.grad_data], scale=self._one, offsets=[0], accumulate=False)
                else:
                    s0, s1 = b.shard_range(self.dp_rank)
                    out = self._comm_out[bi]
                    if out.dtype == b.grad_data.dtype:
                        b.grad_data[s0:s1].copy_(out)
                    else:
                        unpack_bucket(out, [b.grad_data[s0:s1]], scale=self._one, offsets=[0], accumulate=False)
        self._works = {}

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
        """Before forward: a ``.grad`` set to None (optimizer.zero_grad) means "start from zero" for that param."""
        if not self._direct:
            return
        params = self.buffer.params
        nones = [p.grad is None for p in params]
        if all(nones):
            self.buffer.zero_grad()
            for p in params:
                p.grad = p.main_grad
            return
        for p, none in zip(params, nones):
            if none:
                p.main_grad.zero_()
                p.grad = p.main_grad
            elif p.grad is not p.main_grad and p.grad.data_ptr() != p.main_grad.data_ptr():
                p.main_grad.copy_(p.grad)   # a user-assigned .grad becomes the accumulation start
                p.grad = p.main_grad

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
        self._index_params()
        self._reset_iteration()
        self.layout_version += 1


def overlap_report(timeline: dict) -> dict:
    """Summarise ``last_sync_timeline``: how many buckets were launched before backward ended."""
    early = [(bi, n) for bi, t, n in timeline["launches"] if t < timeline["backward_end"]
             and n < timeline["n_params"]]
    return {"buckets": len(timeline["launches"]), "launched_before_backward_end": len(early), "early": early}


__all__ = ["DataParallel", "overlap_report"]
