"""Run one layout's rank of the package on the meta device, to read what it allocates and computes.

The planner does not keep a second, hand-written copy of what each layout holds: it builds the
rank with the package's own code (``Parallel3D`` on ``device="meta"``: the same stage split, tensor
parallel sharding, ZeRO partitioning, gradient buckets and padding) inside a *fake* process group of the
layout's world size (``torch.distributed``'s ``fake`` backend: every collective returns at once, so one
process can play any rank), then

* :func:`static_terms`: the bytes it holds once a step has begun (parameters, gradient buffers and
  shards, optimizer state, ZeRO-3's gathered parameters), read from its tensors' storages;
* :func:`microbatch_probe`: runs two micro-batches of each of the rank's stages forward and backward
  under :class:`~.accounting.OpTally` and :class:`~.accounting.FlopTally`: the bytes kept
  for backward, the peak of one micro-batch, the FLOPs, the memory traffic of the other ops and every
  tensor-parallel / context-parallel collective, each per phase.

Symmetry: ranks that differ only in their dp, cp or tp coordinate hold the same shapes, so one rank per
pipeline stage (dp = cp = tp coordinate 0) stands for all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..composition.layout import Layout
from .accounting import (
    NO_SHAPE,
    FlopTally,
    OpTally,
    attention_flop_formulas,
    fused_attention_on_meta,
    held_bytes,
    sampled_loss_rows,
    tensors_reachable,
)
from .spec import Request

META = torch.device("meta")


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` under the fake backend (no peers, no data moved)."""
    if dist.is_initialized():
        raise RuntimeError("planner: torch.distributed is already initialised in this process; the planner plays "
                           "every rank itself under a fake process group, so run it in a process of its own "
                           "(python -m parallel_layers plan, or Parallel3D(layout='auto'), which does that)")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    # meta too: collectives and point-to-point batches on meta tensors ask for the backend of "meta"
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    # a group of two device backends has no default one, and its teardown warns so on stderr, once a probe
    # (hundreds in a search): the fake backend is the default of every device here
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank(req: Request, layout: Layout, pp_rank: int, device: torch.device = META):
    """``Parallel3D`` of ``layout``'s pipeline rank ``pp_rank`` on meta (call inside :func:`fake_world`;
    ``device``: another one to check the probe against real tensors)."""
    from ..composition.config import PrecisionConfig
    from ..composition.parallel3d import Parallel3D
    from ..mesh import ParallelMesh
    mesh = ParallelMesh(**layout.sizes, timeout=60)
    kw = dict(layout.parallel3d_kwargs(), precision=PrecisionConfig(dtype=req.dtype),
              sequence_parallel=_sequence_parallel(req, layout))
    if callable(getattr(req.model, "build", None)):      # a config Parallel3D builds the model of (GPTConfig)
        return Parallel3D(req.model, mesh, device=device, **kw)
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(req.model, dtype=req.dtype)
    return Parallel3D(model, mesh, device=device, **kw)


def _sequence_parallel(req: Request, layout: Layout) -> bool:
    """``Request.sequence_parallel`` where ``Parallel3D`` takes it: the reference GPT always; a module model
    without MoE blocks (it refuses those: they run without it)."""
    if not req.sequence_parallel:
        return False
    if callable(getattr(req.model, "build", None)):
        return True
    return req.experts() == 0


def global_rank(layout: Layout, pp_rank: int) -> int:
    """The global rank at pipeline rank ``pp_rank`` and index 0 along every other dimension (pp is outermost)."""
    return pp_rank * (layout.world // layout.pp)


def _keys(tensors) -> set:
    return {t.untyped_storage()._cdata for t in tensors}


MAX_BUCKETS_IN_FLIGHT = 2      # DataParallel's default, where its object does not say


def streams_gradients(p3d) -> bool:
    """Whether this rank's ZeRO-2 reduces every micro-batch's backward bucket by bucket, freeing each bucket's
    full gradient memory once its reduction completed (DeepSpeed's ZeRO-2: the shard accumulates over the
    micro-batches): ``Parallel3D`` does so on one pipeline stage (pp = 1) with nothing tied and no tp-partial
    parameters (per-head q/k norms at tp > 1, whose gradients are summed over tp before the reduction):
    its mode says so (``ShardedGrads.streams``). Elsewhere ZeRO-2 keeps the whole stage's fp32 gradient
    buffer through the step, as ZeRO-1 does."""
    mode = p3d.mode
    if hasattr(mode, "streams"):
        return bool(mode.streams)
    # a mode without the attribute: the same rule from what the rank holds
    return (getattr(p3d, "zero", 0) == 2 and getattr(mode, "dp", None) is not None and p3d.mesh.pp == 1
            and not getattr(mode, "partial", None) and not getattr(mode, "tied", None))


def bucket_grad_bytes(dp) -> List[int]:
    """The full gradient bytes of each of ``dp``'s buckets, in bucket (reduction) order (their padded size
    in the gradient dtype, whether their memory is allocated now or not)."""
    esize = torch.empty(0, dtype=dp.grad_dtype).element_size()
    return [b.numel * esize for b in dp.buffer.buckets]


def buckets_in_flight_bytes(dp, early: Optional[Dict[int, int]] = None) -> int:
    """The most full-gradient bytes a streaming ZeRO-2 backward holds at once, by ``DataParallel``'s rule:
    buckets fill in bucket order (after the first backward, arrival order), each allocated at its first
    gradient, launched once full, and a launch first finishes the oldest reduction while more than
    ``max_buckets_in_flight`` are in flight, freeing its bucket. So while a bucket fills, it and the
    ``max_buckets_in_flight`` before it are alive: the largest run of that many + 1 consecutive buckets (a
    bucket is at least one parameter, so a large embedding is one bucket of its own whatever
    ``bucket_cap_mb`` says). ``early``: bucket index -> the bucket (by index) that was filling when a
    fused layer first wrote into it, where that is before its own turn (a tied embedding whose LM head
    writes its share first): it is alive from then on."""
    sizes = bucket_grad_bytes(dp)
    k = int(getattr(dp, "max_buckets_in_flight", MAX_BUCKETS_IN_FLIGHT) or MAX_BUCKETS_IN_FLIGHT)
    early = early or {}
    most = 0
    for c in range(len(sizes)):              # bucket c filling
        alive = set(range(max(c - k, 0), c + 1)) | {b for b, w in early.items() if w <= c < b}
        most = max(most, sum(sizes[b] for b in alive))
    return most


def simulated_backward_bytes(sizes: List[int], counts: List[int], events: List[tuple], k: int) -> int:
    """The most full-gradient bytes ``DataParallel``'s streaming backward holds for gradients landing as
    ``events`` say (``("write" | "arrive", bucket index)`` in backward order), whatever the layout: a bucket
    is allocated at its first write or arrival, launched in bucket order once all its ``counts`` parameters
    arrived, and a launch finishes (frees) the oldest while more than ``k`` are in flight."""
    live, got, inflight, nxt, most = set(), [0] * len(sizes), [], 0, 0
    for kind, b in events:
        live.add(b)
        most = max(most, sum(sizes[i] for i in live))
        if kind == "arrive":
            got[b] += 1
            while nxt < len(sizes) and got[nxt] == counts[nxt]:
                inflight.append(nxt)
                nxt += 1
                while len(inflight) > k:
                    live.discard(inflight.pop(0))
    return most


def arrival_order_bytes(p3d, seq_len: int, batch: int = 1) -> int:
    """The most full-gradient bytes a streaming ZeRO-2 rank's backward holds: one backward on meta, under
    ``no_sync``, records the order the gradients arrive in (each parameter's post-accumulate-grad hook, where
    ``DataParallel`` takes it from) and where a fused layer writes a parameter's share before it arrives
    (``DataParallel.write_grad``: the reference GPT's tied embedding, whose LM head writes first); the buckets'
    life is then :func:`simulated_backward_bytes` in the wrapper's layout (ZeRO-2 keeps its first layout,
    parameters in reverse order, close to the order they arrive in)."""
    import torch.fx.experimental._config as fx_config
    dp = p3d.mode.dp
    chunk = p3d.chunks[0]
    dev = next(p3d.model.parameters()).device
    side = _cp_side(p3d, batch, seq_len, dev)
    order: List[torch.nn.Parameter] = []
    arrived_at: Dict[int, int] = {}
    written_at: Dict[int, int] = {}          # id -> arrivals before a fused layer's first write into it

    def arrived(q):
        if id(q) not in arrived_at:
            arrived_at[id(q)] = len(order)
            order.append(q)

    write = dp.write_grad

    def write_grad(q, fn):
        written_at.setdefault(id(q), len(order))
        return write(q, fn)

    hooks = [q.register_post_accumulate_grad_hook(arrived) for q in dp.buffer.params]
    dp.write_grad = write_grad
    try:
        with OpTally(), fused_attention_on_meta(), fx_config.patch(meta_nonzero_assume_all_nonzero=True), \
                dp.no_sync(), _on_meta(dev, ()):
            x = torch.zeros(batch, seq_len, dtype=torch.long, device=dev)
            torch.autograd.backward(_run_forward(chunk, x, x, True, side))
    finally:
        del dp.write_grad
        for h in hooks:
            h.remove()
    gc.collect()
    for q in dp.buffer.params:                # a parameter without a gradient goes last, as in the rebuild
        if id(q) not in arrived_at and id(q) in written_at:
            arrived(q)
    for q in dp.buffer.params:                # a parameter without a gradient: written only, or never
        if id(q) not in arrived_at and id(q) in written_at:
            arrived(q)
    bucket = {id(q): dp.buffer.bucket_of(q)[0].index for q in dp.buffer.params}
    writes_at: Dict[int, List[int]] = {}
    for pid, w in written_at.items():
        writes_at.setdefault(w, []).append(bucket[pid])
    events: List[tuple] = []
    for i, q in enumerate(order):
        events += [("write", b) for b in writes_at.get(i, [])] + [("arrive", bucket[id(q)])]
    events += [("write", b) for b in writes_at.get(len(order), [])]
    counts = [len(b.params) for b in dp.buffer.buckets]
    for q in dp.buffer.params:                # never reached: counted ready at the end, as DataParallel does
        if id(q) not in arrived_at:
            events.append(("arrive", bucket[id(q)]))
    k = int(getattr(dp, "max_buckets_in_flight", MAX_BUCKETS_IN_FLIGHT) or MAX_BUCKETS_IN_FLIGHT)
    return simulated_backward_bytes(bucket_grad_bytes(dp), counts, events, k)


def static_terms(p3d, seq_len: Optional[int] = None, buckets: Optional[dict] = None) -> Dict[str, int]:
    """Bytes this rank holds with a step begun (``mode.begin_step()`` run: ZeRO-3's parameters gathered),
    split into parameters (ZeRO-3: its shard too), gradients (what the data-parallel wrapper holds besides
    the parameters: buffers, shards) and optimizer state (the rest the optimizer holds). torch's AdamW
    (``zero=0``) makes its state at the first step: exp_avg and exp_avg_sq like each parameter and a float32
    step count, added here as that rule.

    Gradients where the rank streams them (:func:`streams_gradients`): the shard and the other tensors the
    wrapper holds, plus, instead of the full buffer, the most bucket memory a synced backward holds: with
    ``seq_len`` (this rank's tokens a sequence) :func:`arrival_order_bytes`, the buckets as a run lays them
    out (this leaves the rank's wrapper unusable), else :func:`buckets_in_flight_bytes` as they are laid out.
    ZeRO-3: per unit (:func:`gathers_per_unit`), the fp32 gradient shard, which ``begin_step`` frees and the
    first unit's reduction brings back; held, not here (:func:`reduction_shard_bytes`). ``buckets``: a dict that
    gets, for a streaming rank, ``in_flight`` (the bucket bytes counted) and ``all`` (every bucket's)."""
    p3d.mode.begin_step()
    params = [p for p in p3d.model.parameters()] + list(p3d.model.buffers())
    wrapper = getattr(p3d.mode, "dp", None) or getattr(p3d.mode, "z", None)
    # with experts split over ep, a second wrapper holds theirs (replicas.py: ``buffers`` / ``wrappers``)
    wrappers = getattr(p3d.mode, "buffers", None) or getattr(p3d.mode, "wrappers", None) or [wrapper]
    params += [w.shard_buffer for w in wrappers if getattr(w, "shard_buffer", None) is not None]
    pkeys = _keys(params)
    grads = [t for t in tensors_reachable(wrappers) if t.untyped_storage()._cdata not in pkeys]
    taken = pkeys | _keys(grads)
    optim = [t for t in tensors_reachable([p3d.optimizer]) if t.untyped_storage()._cdata not in taken]
    out = {"parameters": held_bytes(params), "gradients": held_bytes(grads), "optimizer": held_bytes(optim)}
    if isinstance(p3d.optimizer, torch.optim.AdamW) and not p3d.optimizer.state:
        out["optimizer"] += sum(2 * p.numel() * p.element_size() + 4 for g in p3d.optimizer.param_groups
                                for p in g["params"])
    if gathers_per_unit(p3d) and not wrapper.grad_buffer.untyped_storage().nbytes():
        # per unit, the gradient shard comes back at the first unit's reduction, early in the first backward
        out["gradients"] += wrapper.grad_nbytes
    if streams_gradients(p3d):
        full = _keys([b.grad_data for b in wrapper.buffer.buckets])
        in_flight = arrival_order_bytes(p3d, seq_len) if seq_len else buckets_in_flight_bytes(wrapper)
        out["gradients"] = held_bytes([t for t in grads if t.untyped_storage()._cdata not in full]) + in_flight
        if buckets is not None:
            buckets.update(in_flight=in_flight, all=sum(bucket_grad_bytes(wrapper)))
    return out


def step_tail_ops(p3d) -> int:
    """Operator calls of the optimizer step where the optimizer is torch's (``zero=0``: AdamW steps parameter
    by parameter, ~10 calls each: a step's largest host cost after the backward on a small model), run on
    meta with zero gradients that are taken off again; linear in the blocks, as the representative probes
    scale it. The package's ZeRO optimizers step flat buffers through one fused kernel a shard (a few calls:
    0 here; on meta they would run the kernels' torch references instead), and the reduction's own calls,
    which vary with the bucket count, are not counted. Call after :func:`static_terms` (whose first step
    makes the optimizer's state)."""
    if not type(p3d.optimizer).__module__.startswith("torch.optim"):
        return 0
    made = [p for g in p3d.optimizer.param_groups for p in g["params"] if p.grad is None]
    for p in made:
        p.grad = torch.zeros_like(p)
    try:
        with OpTally() as tally:
            p3d.optimizer.step()
    finally:
        for p in made:
            p.grad = None
    return tally.ops


def gathers_per_unit(p3d) -> bool:
    """Whether this rank's ZeRO-3 runs FSDP's schedule (``ShardedParams.per_unit``: one stage whose backwards
    are whole, nothing tied across stages): each unit gathered for its forward and again for its backward,
    its gradients reduce-scattered once its backward is done. Otherwise (held mode) a step gathers the whole
    stage once and keeps it, with every unit's full gradients, until its one reduction."""
    return bool(getattr(p3d.mode, "per_unit", False))


def reduction_shard_bytes(p3d) -> int:
    """ZeRO-3 in held mode: the bytes of the fp32 gradient shard that a step frees at its start
    (``zero_grad``, in ``begin_step``) and allocates again at its reduction, after the last backward, while
    the stage's full gradients still live but the activations are gone (0 where :func:`static_terms` holds
    it already: per unit, or without ZeRO-3)."""
    z = getattr(p3d.mode, "z", None)
    if z is None or z.grad_buffer.untyped_storage().nbytes() or gathers_per_unit(p3d):
        return 0
    return z.grad_nbytes


def unit_buffer_bytes(z) -> int:
    """The bytes of a ZeRO-3 wrapper's full parameter and gradient buffers alive now (storages resized in
    place as units are gathered and freed: no op makes them)."""
    return sum(u.full.untyped_storage().nbytes() + u.grad_full.untyped_storage().nbytes() for u in z.units)


@dataclasses.dataclass
class ChunkCost:
    """One stage (chunk) of a rank, per micro-batch."""
    saved: int                 # bytes kept from a forward until its backward (the received input included)
    peak: int                  # the most bytes one micro-batch has live at once, forward or backward
    persist: int               # bytes left after backward that stay for the step (ZeRO-3's full gradients)
    flops_f: float
    flops_b: float
    traffic_f: int             # bytes read + written by the non-matmul ops
    traffic_b: int
    ops_f: int                 # operator calls of a forward / backward (their launch or dispatch overhead)
    ops_b: int
    coll_f: Dict[str, List[int]]   # collective -> bytes per call
    coll_b: Dict[str, List[int]]
    out_shape: tuple
    out_bytes: int
    first_peak: int = 0        # the first micro-batch's peak (what its backward made of those counted as it went)
    persist_untallied: int = 0  # of ``persist``, what the tally did not see made (ZeRO-3's unit buffers, resized)
    fp8: Optional[object] = None  # FP8 training asked: the chunk's converted GEMMs (``planner.fp8.FP8Account``)
    # the matmuls' FLOPs over K, N, M and the attention FLOPs counted and computed (``accounting.FlopTally.shape``),
    # forward / backward
    shape_f: tuple = NO_SHAPE
    shape_b: tuple = NO_SHAPE
    # the traffic and kernel calls of the same forward / backward with its non-matmul ops fused (a compiled
    # step: ``accounting.OpTally.fused_traffic``)
    fused_traffic_f: int = 0
    fused_traffic_b: int = 0
    fused_ops_f: int = 0
    fused_ops_b: int = 0
    # of ``saved``, what a compiled graph recomputes in backward instead of keeping (elementwise results)
    recomputable: int = 0


def _on_meta(dev, tallies):
    """On meta, the loss's row loop sampled and its skipped chunks charged to ``tallies``
    (:func:`~.accounting.sampled_loss_rows`: the same counts, seconds instead of minutes at a 128k vocabulary);
    on a real device (a test checking the probe against real tensors) every row runs."""
    return sampled_loss_rows(tallies) if dev.type == "meta" else contextlib.nullcontext()


def _run_forward(chunk, x, y, is_last, side):
    if is_last:
        out = chunk(x, y, **side)
        return out[0] if isinstance(out, (tuple, list)) else out
    return chunk(x, **side)


def _cp_side(p3d, b: int, s: int, dev) -> dict:
    """Under cp a stage takes its shard's positions and the sequence's segment ids as side inputs: made by the
    same function ``Parallel3D`` cuts a batch with (the reference GPT ignores them)."""
    cp = p3d.cp
    if cp == 1:
        return {}
    from ..context_parallel.batch import shard_batch
    full = torch.zeros(b, s * cp, dtype=torch.long, device=dev)
    return shard_batch(full, None, {}, cp, 0)[2]


def sync_bytes(p3d) -> Dict[str, int]:
    """Bytes each data-parallel collective of a step moves on this rank: the gradient buffer reduced over
    dp (``all_reduce`` for ZeRO 0, ``reduce_scatter`` for 1, 2: its padded size; streaming ZeRO-2 moves it
    once per micro-batch; ZeRO 1, 2: ``param_gather``, the updated parameters shared after the step), ZeRO-3's
    gather of every unit's parameters (their dtype) and reduce-scatter of
    their gradients (the reduce dtype; padded sizes), and the tied embedding's all-reduce between the first
    and last stage."""
    out: Dict[str, int] = {}
    dp = getattr(p3d.mode, "dp", None)
    if dp is not None:     # the buckets' sizes: the buffer may be one flat tensor or one per bucket
        out["all_reduce" if p3d.zero == 0 else "reduce_scatter"] = sum(bucket_grad_bytes(dp))
        if p3d.zero in (1, 2):
            # after the sharded step every rank's updated shard goes to the others (the parameters' dtype)
            grad_size = torch.empty(0, dtype=dp.grad_dtype).element_size()
            param_size = next(p3d.model.parameters()).element_size()
            out["param_gather"] = sum(bucket_grad_bytes(dp)) // grad_size * param_size
    z = getattr(p3d.mode, "z", None)
    if z is not None:
        padded = sum(u.padded for u in z.units)
        out["all_gather"] = padded * z.shard_buffer.element_size()
        # the full gradients are reduced in the units' gradient dtype (reduce_dtype: fp32 for bf16/fp16)
        out["reduce_scatter"] = padded * torch.empty(0, dtype=getattr(z, "reduce_dtype", z.grad_dtype)).element_size()
    tied = getattr(p3d.mode, "tied", [])
    if tied and p3d.tied_group is not None:
        out["tied_all_reduce"] = sum(p.numel() * 4 for p in tied)
    return out


def sync_calls(p3d) -> Dict[str, int]:
    """What the number of data-parallel collective calls of a step is made of (each call pays the link's
    latency): ``units``, ZeRO-3's units (one gather and one reduce-scatter each; linear in the blocks), and the
    gradient buffer's bucket caps in bytes (``bucket_first``, ``bucket_cap``), from which the model counts the
    buckets of the (scaled) reduced bytes."""
    out: Dict[str, int] = {}
    dp = getattr(p3d.mode, "dp", None)
    if dp is not None:
        out["bucket_first"] = int(dp.buffer.first_bucket_cap_mb * 2**20)
        out["bucket_cap"] = int(dp.buffer.bucket_cap_mb * 2**20)
    z = getattr(p3d.mode, "z", None)
    if z is not None:
        out["units"] = len(z.units)
    return out


def zero3_full_grad_bytes(p3d, chunk, counted: set) -> Tuple[int, int]:
    """ZeRO-3 in held mode (``gather_all``): the full gradients of ``chunk``'s parameters that stay until the
    step's reduction, wherever the code keeps them: autograd's ``.grad`` and each unit's flat gradient
    buffer (``grad_full``, in the reduce dtype: fp32 for bf16/fp16 parameters). A unit counts with the first
    chunk that holds one of its parameters (``counted``: the ids of units counted already). Returns all of
    them and the part in unit buffers (allocated by a storage resize: no op's output, unseen by a tally)."""
    ids = {id(q) for q in chunk.parameters()}
    grads = [q.grad for q in chunk.parameters() if q.grad is not None]
    units = []
    for u in getattr(p3d.mode.z, "units", []):
        if id(u) not in counted and any(id(q) in ids for q in u.params):
            counted.add(id(u))
            units.append(u.grad_full)
    return held_bytes(grads + units), held_bytes(units)


def microbatch_probe(p3d, b: int, s: int, hidden_shape: Optional[tuple], fp8: bool = False) -> List[ChunkCost]:
    """Every chunk of the rank, two micro-batches of ``b`` sequences of ``s`` tokens (this rank's share
    under cp) forward and backward each, on meta. ``hidden_shape``: (shape, dtype) of what stage 0 sends
    (None when this rank holds stage 0: it is found here). ``fp8``: a third micro-batch, outside the tallies,
    records the Linear layers FP8 training converts (:func:`.fp8.linear_calls`)."""
    costs = []
    counted: set = set()                 # ZeRO-3 units already counted with an earlier chunk (the root spans two)
    dev = next(p3d.model.parameters()).device       # meta when planning; a real device to check the probe itself
    side = _cp_side(p3d, b, s, dev)
    p3d.mode.begin_step()            # ZeRO-3 gathers its parameters here (outside the tally: held, not activations)
    import torch.fx.experimental._config as fx_config
    # nonzero on meta (the ignore-index rows of the loss): assume every row counts, the most memory
    with p3d.mode.accumulating(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        for chunk in p3d.chunks:
            is_first, is_last = bool(getattr(chunk, "is_first", False)), bool(getattr(chunk, "is_last", False))
            # per unit, the gathered units and their gradient buffers come and go inside the micro-batch
            z = p3d.mode.z if gathers_per_unit(p3d) else None
            tally = OpTally(extra=(lambda z=z: unit_buffer_bytes(z)) if z is not None else None)
            flops = FlopTally(attention_flop_formulas())
            phases = []
            with fused_attention_on_meta(), flops, tally, _on_meta(dev, (tally, flops)):
                for _mb in range(2):
                    for phase in ("F", "B"):
                        # what the last phase dropped in cycles is gone before we count (a full pass before a
                        # forward: a checkpointed backward leaves its recomputation's tensors to the collector)
                        gc.collect() if phase == "F" else gc.collect(0)
                        before_flops, before_shape = flops.get_total_flops(), list(flops.shape)
                        before_traffic, before_ops = tally.traffic, tally.ops
                        before_fused = tally.fused_traffic, tally.fused_ops
                        before_coll = {k: len(v) for k, v in tally.collectives.items()}
                        tally.reset_peak()
                        if phase == "F":
                            x = (torch.zeros(b, s, dtype=torch.long, device=dev) if is_first
                                 else torch.zeros(hidden_shape[0], dtype=hidden_shape[1], device=dev,
                                                  requires_grad=True))
                            y = torch.zeros(b, s, dtype=torch.long, device=dev)
                            start = tally.live
                            out = _run_forward(chunk, x, y, is_last, side)
                            del y
                            saved = tally.live - start
                            if not is_last:
                                shape = (tuple(out.shape), out.dtype)
                        else:
                            grad = None if is_last else torch.ones_like(out)
                            torch.autograd.backward(out, grad)
                            del out, grad, x
                            saved = None
                        tally.end_phase(forward=phase == "F")
                        coll = {k: v[before_coll.get(k, 0):] for k, v in tally.collectives.items()
                                if len(v) > before_coll.get(k, 0)}
                        phases.append(dict(peak=tally.peak - start, live=tally.live - start, saved=saved,
                                           flops=flops.get_total_flops() - before_flops,
                                           shape=tuple(now - was for now, was in zip(flops.shape, before_shape)),
                                           traffic=tally.traffic - before_traffic, coll=coll,
                                           ops=tally.ops - before_ops,
                                           fused_traffic=tally.fused_traffic - before_fused[0],
                                           fused_ops=tally.fused_ops - before_fused[1],
                                           recomputable=tally.recomputable if phase == "F" else 0))
            f1, b1, f2, b2 = phases
            # what stays for the step: ZeRO-3's full gradients, held across micro-batches; other stages'
            # gradients live in the data-parallel buffers, counted with the rank's tensors. (Read off the
            # parameters and units themselves: the gradients are what stays, whatever else the tally saw.)
            persist, untallied = zero3_full_grad_bytes(p3d, chunk, counted) if p3d.zero == 3 else (0, 0)
            acct = None
            if fp8:
                from .fp8 import linear_calls

                def third(chunk=chunk, is_first=is_first, is_last=is_last, hidden_shape=hidden_shape):
                    x = (torch.zeros(b, s, dtype=torch.long, device=dev) if is_first
                         else torch.zeros(hidden_shape[0], dtype=hidden_shape[1], device=dev, requires_grad=True))
                    y = torch.zeros(b, s, dtype=torch.long, device=dev)
                    return _run_forward(chunk, x, y, is_last, side)
                with fused_attention_on_meta(), _on_meta(dev, ()):
                    acct = linear_calls(chunk, third)
                gc.collect()
            if not is_last:
                hidden_shape = shape
            costs.append(ChunkCost(
                saved=f2["saved"], peak=max(f1["peak"], b1["peak"], f2["peak"] + persist, b2["peak"] + persist),
                persist=persist, first_peak=max(f1["peak"], b1["peak"]), persist_untallied=untallied, fp8=acct,
                flops_f=f2["flops"], flops_b=b2["flops"], shape_f=f2["shape"], shape_b=b2["shape"],
                traffic_f=f2["traffic"],
                traffic_b=b2["traffic"], ops_f=f2["ops"], ops_b=b2["ops"], coll_f=f2["coll"], coll_b=b2["coll"],
                fused_traffic_f=f2["fused_traffic"], fused_traffic_b=b2["fused_traffic"],
                fused_ops_f=f2["fused_ops"], fused_ops_b=b2["fused_ops"], recomputable=f2["recomputable"],
                out_shape=hidden_shape[0] if hidden_shape else (),
                out_bytes=(torch.Size(hidden_shape[0]).numel() * torch.empty(0, dtype=hidden_shape[1]).element_size()
                           if hidden_shape else 0)))
    return costs, hidden_shape


__all__ = ["fake_world", "build_rank", "static_terms", "sync_bytes", "streams_gradients", "bucket_grad_bytes",
           "buckets_in_flight_bytes", "arrival_order_bytes", "MAX_BUCKETS_IN_FLIGHT", "zero3_full_grad_bytes",
           "reduction_shard_bytes", "gathers_per_unit", "step_tail_ops", "sync_calls", "unit_buffer_bytes",
           "microbatch_probe", "ChunkCost", "global_rank", "META"]
