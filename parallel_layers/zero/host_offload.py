"""ZeRO-Offload: a CUDA model's optimizer shard (fp32 master + AdamW moments) in pinned host memory, stepped
on the CPU by the same C++ flat-shard AdamW kernel as in-memory CPU training (multi-threaded over torch's
threads, ``at::parallel_for``), with the gradients and the updated parameters crossing PCIe on side streams.

``offload="cpu"`` of ``ZeroOptimizer`` (stages 1, 2) and ``ZeroStage3Optimizer`` on a CUDA model (on a
CPU model it raises: the state already is in host memory). Per rank, in pinned host memory: master,
exp_avg, exp_avg_sq (12 bytes per shard element), the gradient shard as the device holds it (4 bytes, or
2 for ``ZeroStage3(grad_dtype=torch.bfloat16)``; twice with ``offload_delayed_update``) and, for bf16/fp16
models, the low-precision copy the kernel writes (2 bytes). The device keeps parameters and gradients
only: the 12 bytes per parameter of optimizer state are gone from it.

A step (:meth:`HostShard.step`):

1. **Gradients, device to host, bucket by bucket while backward runs.** Each *segment* of the shard (a
   ``DataParallel`` bucket's shard for stages 1/2, a unit's for stage 3) is copied on a side stream as
   soon as its reduction has written it: the optimizer looks at the buckets ``DataParallel`` launched /
   the units ``ZeroStage3`` reduced from its gradient hooks (:class:`LaunchedBuckets`,
   :class:`ReducedUnits`) and queues ``copy_(non_blocking=True)`` into pinned memory behind an event
   (stages 1/2 on NCCL behind the bucket's collective itself). What a hook could not copy early (the
   last units, buckets reduced at the end of backward, a gloo group, a low-precision communication dtype)
   is copied when the step starts. The step waits for the side stream once.
2. **The CPU step**, in chunks of ``chunk_numel`` elements of the runs the step updates (param groups and
   step counts as in memory: :mod:`.sharded_adamw`), each writing the fp32 master, the moments and the
   low-precision copy in one pass;
3. **the updated parameters, host to device,** each chunk queued on a second side stream as soon as the
   CPU has stepped it, so the copy of chunk ``i`` runs while the CPU steps chunk ``i + 1``; the device's
   current stream then waits for the last one (a device-side wait: the host goes on to the next forward,
   whose kernels queue behind it). Stages 1/2 all-gather the updated shards from there as in memory.

``offload_delayed_update=True`` (DeepSpeed's "delayed parameter update", off by default): the CPU step runs
on a worker thread while the device computes the next forward and backward; ``step()`` first waits for
the previous step's CPU work, uploads it and (stages 1/2) all-gathers it, then hands this step's
gradients to the worker and returns. **It changes the results**: the forward of step ``t + 1`` runs on
the parameters of step ``t - 1`` (one update stale), so gradients are computed one update behind the
weights they are applied to. :meth:`HostShard.finish` (the optimizer's ``wait_for_step()``, and every
checkpoint or state read) applies the step in flight. The worker only computes on host tensors; every
CUDA call stays on the caller's thread.

Results: the CPU kernel rounds as the in-memory CPU step does, which is not bit for bit what the GPU
kernels do (Triton fuses ``m * beta1 + (1 - beta1) * g`` and ``v * beta2 + ...`` into FMAs and divides
where the C++ kernel multiplies by a reciprocal): an offloaded run follows the in-memory GPU run to a few
float32 ulps per step, not bit-identically. A ``found_inf`` step is checked on the host (the scalars
cross with the gradients) and copies nothing back.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

DEFAULT_CHUNK_NUMEL = 1 << 22        # 16 MiB of fp32 master per CPU-step chunk / host-to-device copy

Span = Tuple[int, int]
UploadTargets = Callable[[int, int], Iterable[Tuple[int, int, torch.Tensor]]]
StepChunk = Callable[[int, int, torch.Tensor, Optional[torch.Tensor]], None]


@dataclass(frozen=True)
class HostOffload:
    """``offload="cpu"`` on an accelerator (see the module docstring)."""
    delayed_update: bool = False
    chunk_numel: int = DEFAULT_CHUNK_NUMEL


def split_spans(spans: Sequence[Span], chunk_numel: int) -> List[Span]:
    """The elements of ``spans`` (``(start, end)`` in shard order, disjoint) cut into chunks of at most
    ``chunk_numel``, in order: what one CPU-step call covers and one host-to-device copy moves."""
    if chunk_numel < 1:
        raise ValueError(f"split_spans: chunk_numel={chunk_numel} must be >= 1")
    out: List[Span] = []
    for s, e in spans:
        for lo in range(s, e, chunk_numel):
            out.append((lo, min(lo + chunk_numel, e)))
    return out


def segments_of(sizes: Sequence[int]) -> List[Span]:
    """Consecutive ``(start, end)`` ranges of the given sizes: the shard's buckets or units, in order."""
    out, pos = [], 0
    for n in sizes:
        out.append((pos, pos + n))
        pos += n
    return out


class ReducedUnits:
    """The :class:`ZeroStage3` units whose gradient shard was written since the last look: the
    ``"reduce_wait"`` events of its ``timeline`` (a new list at every root forward)."""

    def __init__(self, zmodule):
        self.z = zmodule
        self._timeline: Optional[list] = None
        self._seen = 0

    def new(self) -> List[int]:
        tl = self.z.timeline
        if tl is not self._timeline:
            self._timeline, self._seen = tl, 0
        out = [event[1] for event in tl[self._seen:] if event[0] == "reduce_wait"]
        self._seen = len(tl)
        return out


class LaunchedBuckets:
    """The ``DataParallel`` buckets launched (their reduction queued) in the current synced backward and
    not reported yet, with their works: ``(bucket index, work or None)``."""

    def __init__(self, dp_module):
        self.dp = dp_module
        self.reported: Set[int] = set()
        self._works: Optional[dict] = None

    def new(self) -> List[Tuple[int, object]]:
        # DataParallel's bucket index -> work of the reduction in progress: a new dict for every sync
        works: Dict[int, object] = self.dp.launched_reductions
        if works is not self._works:
            self._works, self.reported = works, set()
        out = [(bi, w) for bi, w in works.items() if bi not in self.reported]
        self.reported.update(bi for bi, _ in out)
        return out

    def synced_since(self, seen) -> bool:
        """Whether a synced backward (or ``sync_gradients``) finished since ``seen`` (a previous
        :meth:`sync_token`)."""
        return self.sync_token() is not seen

    def sync_token(self):
        return getattr(self.dp, "last_sync_timeline", None)     # a new dict at the end of every sync


class HostShard:
    """One optimizer shard in pinned host memory, its gradient copy and the two copy streams; see the
    module docstring. ``segments``: the shard's ranges whose gradients become ready together."""

    def __init__(self, owner: str, numel: int, device: torch.device, *, grad_dtype: torch.dtype,
                 low_dtype: Optional[torch.dtype], config: HostOffload, segments: Sequence[Span]):
        if device.type != "cuda":
            raise ValueError(f"{owner}: offload='cpu' needs a CUDA model; this one is on {device}")
        self.owner, self.numel, self.device, self.config = owner, int(numel), device, config
        pin = dict(pin_memory=True)
        self.master = torch.empty(self.numel, dtype=torch.float32, **pin)
        self.exp_avg = torch.zeros(self.numel, dtype=torch.float32, **pin)
        self.exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, **pin)
        # delayed update: the worker reads one gradient buffer while the next backward fills the other
        self._grads = [torch.zeros(self.numel, dtype=grad_dtype, **pin)
                       for _ in range(2 if config.delayed_update else 1)]
        self._g = 0
        self.low = None if low_dtype is None else torch.empty(self.numel, dtype=low_dtype, **pin)
        self.segments = list(segments)
        self._d2h = torch.cuda.Stream(device)
        self._h2d = torch.cuda.Stream(device)
        self._d2h_done: Optional[torch.cuda.Event] = None
        self._h2d_done: Optional[torch.cuda.Event] = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="zero-offload-step") if config.delayed_update else None
        self._pending: Optional[Tuple[Future, List[Span], UploadTargets]] = None
        self.timing = False            # record each gradient copy's CUDA events (overlap_fraction)
        self._copy_events: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.stats = {"d2h_bytes": 0, "h2d_bytes": 0, "grad_wait_s": 0.0, "cpu_step_s": 0.0, "steps": 0}

    # ------------------------------------------------------------------ sizes
    @property
    def host_bytes(self) -> int:
        """Pinned host memory held: master, moments, gradient buffer(s), low-precision copy."""
        ts = [self.master, self.exp_avg, self.exp_avg_sq, *self._grads] + ([self.low] if self.low is not None else [])
        return sum(t.untyped_storage().nbytes() for t in ts)

    def grad(self) -> torch.Tensor:
        """The host gradient buffer this backward's copies land in."""
        return self._grads[self._g]

    # ------------------------------------------------------------------ gradients, device to host
    def copy_grad(self, segment: int, src: torch.Tensor, work=None) -> None:
        """Queue the copy of segment ``segment``'s gradient (``src``, on the device) into the host buffer,
        on the side stream, after ``work`` (an NCCL collective that writes ``src``: the side stream waits
        for it) or else after what the current stream has queued so far (the reduction that wrote it)."""
        lo, hi = self.segments[segment]
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._d2h):
            if work is not None:
                work.wait()              # NCCL: this stream (not the host) waits for the collective
            else:
                self._d2h.wait_stream(current)
            start = self._timing_event()
            self.grad()[lo:hi].copy_(src.reshape(-1), non_blocking=True)
            end = self._timing_event()
        src.record_stream(self._d2h)     # the allocator must not hand src out again before the copy ran
        if start is not None:
            self._copy_events.append((start, end))
        self._d2h_done = self._d2h.record_event()
        self.stats["d2h_bytes"] += src.numel() * src.element_size()

    def _timing_event(self) -> Optional[torch.cuda.Event]:
        if not self.timing:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self._d2h)
        return ev

    def wait_grads(self) -> None:
        """Block the host until every queued gradient copy has landed."""
        if self._d2h_done is not None:
            t0 = time.perf_counter()
            self._d2h_done.synchronize()
            self.stats["grad_wait_s"] += time.perf_counter() - t0

    def overlap_fraction(self, backward_end: torch.cuda.Event) -> float:
        """Of the time the recorded gradient copies (``timing = True``) took, the fraction that ran before
        ``backward_end`` (an event with timing, recorded on the current stream when backward was queued):
        1.0 when every copy hid behind backward. Clears the records."""
        backward_end.synchronize()
        total = hidden = 0.0
        for start, end in self._copy_events:
            end.synchronize()
            took = start.elapsed_time(end)
            exposed = min(max(backward_end.elapsed_time(end), 0.0), took)
            total += took
            hidden += took - exposed
        self._copy_events = []
        return hidden / total if total > 0 else float("nan")

    # ------------------------------------------------------------------ the step
    def step(self, spans: Sequence[Span], step_chunk: StepChunk, upload: UploadTargets) -> None:
        """Step the elements of ``spans``: ``step_chunk(lo, hi, grad, low)`` runs the CPU kernel over
        ``[lo, hi)`` (``grad``: the whole host gradient buffer; ``low``: the whole host low-precision copy
        or None) and ``upload(lo, hi)`` names the device tensors that chunk goes to, as ``(a, b, dst)``:
        elements ``[a, b)`` of the host copy (``low``, or the master for fp32 models) into ``dst``."""
        chunks = split_spans(spans, self.config.chunk_numel)
        if self.config.delayed_update:
            self.finish()
            if self._h2d_done is not None:
                self._h2d_done.synchronize()     # that upload reads the host copy the worker writes next
            self.wait_grads()
            grad = self.grad()
            self._g = 1 - self._g            # the next backward's copies go to the other buffer
            self._pending = (self._pool.submit(self._cpu_steps, chunks, step_chunk, grad), chunks, upload)
            return
        self.wait_grads()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()     # the last upload read the host copy this step overwrites
        ready = torch.cuda.current_stream(self.device).record_event()
        t0 = time.perf_counter()
        for lo, hi in chunks:
            step_chunk(lo, hi, self.grad(), self.low)
            self._upload(lo, hi, upload, ready)
        self.stats["cpu_step_s"] += time.perf_counter() - t0
        self._end_upload()

    def _cpu_steps(self, chunks: List[Span], step_chunk: StepChunk, grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        for lo, hi in chunks:
            step_chunk(lo, hi, grad, self.low)
        self.stats["cpu_step_s"] += time.perf_counter() - t0

    def finish(self) -> bool:
        """Delayed update: wait for the step in flight and upload it (False when there was none)."""
        if self._pending is None:
            return False
        future, chunks, upload = self._pending
        self._pending = None
        future.result()
        ready = torch.cuda.current_stream(self.device).record_event()
        for lo, hi in chunks:
            self._upload(lo, hi, upload, ready)
        self._end_upload()
        return True

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def _upload(self, lo: int, hi: int, upload: UploadTargets, ready: torch.cuda.Event) -> None:
        src = self.low if self.low is not None else self.master
        with torch.cuda.stream(self._h2d):
            self._h2d.wait_event(ready)      # the device tensors may still be read by queued work
            for a, b, dst in upload(lo, hi):
                dst.copy_(src[a:b], non_blocking=True)
                self.stats["h2d_bytes"] += (b - a) * src.element_size()

    def _end_upload(self) -> None:
        self._h2d_done = self._h2d.record_event()
        torch.cuda.current_stream(self.device).wait_event(self._h2d_done)
        self.stats["steps"] += 1

    def upload_all(self, upload: UploadTargets) -> None:
        """Copy the whole master (through the low-precision copy) to the device: after a load."""
        self.finish()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()
        ready = torch.cuda.current_stream(self.device).record_event()
        for lo, hi in split_spans([(0, self.numel)], self.config.chunk_numel):
            if self.low is not None:
                self.low[lo:hi].copy_(self.master[lo:hi])
            self._upload(lo, hi, upload, ready)
        self._end_upload()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


__all__ = ["HostOffload", "HostShard", "ReducedUnits", "LaunchedBuckets", "split_spans", "segments_of",
           "DEFAULT_CHUNK_NUMEL"]
