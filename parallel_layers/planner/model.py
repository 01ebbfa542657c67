"""Predict one layout's per-rank memory and its step time from what :mod:`.probe` read off the
package's own code on the meta device.

Memory of pipeline rank ``r`` (every dp/cp/tp coordinate of it holds the same):

    parameters + gradients + optimizer              (static_terms: the rank's tensors, a step begun)
  + max over its chunks of one micro-batch's peak   (probe: forward or backward, whichever is higher)
  + (in_flight[r] - 1) x bytes a micro-batch keeps  (in_flight: ``simulate`` of the schedule's streams)
  + (its sends - 1) x one activation's bytes         (only where sends are held to the step's end: gloo)

and ``fragmentation`` of the profile on top for the feasibility check (the allocator's gaps).

The gradient term, as the code allocates it (bf16/fp16 models keep fp32 gradients, as fp32 ones do):

* ZeRO 0 / 1: the whole stage's gradient buffer (1: and the rank's reduced shard, 4 bytes / dp a parameter);
* ZeRO 2 at pp = 1 without tp-partial parameters (``probe.streams_gradients``): every micro-batch's backward
  is reduce-scattered bucket by bucket and each bucket freed once reduced, so the shard plus the largest
  run of ``max_buckets_in_flight`` + 1 consecutive buckets (``probe.buckets_in_flight_bytes``);
* ZeRO 2 elsewhere (pp > 1): the whole buffer, kept over the micro-batches until the step's reduction,
  and the shard;
* ZeRO 3 per unit (one stage, nothing tied across stages: ``probe.gathers_per_unit``, FSDP's schedule): the
  fp32 shard; each unit's full parameters and gradients come and go inside the micro-batch, in its peak;
* ZeRO 3 held (``gather_all`` keeps the stage's parameters gathered for the step): the full gradients
  of every chunk of the rank, accumulated over the micro-batches (fp32 for bf16/fp16 parameters: the
  reduce dtype), and the fp32 shard where it outweighs the activations (``zero_grad`` frees it at the
  step's start, the reduction allocates it after the last backward, when the activations are gone).

Step time: every forward and backward of the schedule costs its FLOPs at the profile's matmul rate,
its non-matmul bytes at the memory bandwidth, its operator calls at the per-op overhead (launch or
host dispatch: what dominates small models) and its tensor/context-parallel collectives at their
alpha-beta cost (on a CPU host, ``Profile.compute_stretch``: ranks beyond ``compute_slots`` take turns on the
cores and busy cores are each ``core_contention`` slower; every collective stretches by (ranks / slots) **
``shared_wait_exponent``); ``simulate_timing`` walks the
schedule with those costs and the activation send's cost as latency (the bubble). The package reduces
gradients once per step after the pipeline has drained (no overlap with backward in ``Parallel3D``; a
streaming ZeRO-2 and a per-unit ZeRO-3 reduce once per micro-batch, charged m times here, and the latter
gathers every unit for each forward and backward, 2m times, with no credit for their overlap), so
the data-parallel reduction, ZeRO-3's gather of every parameter, the tied embedding's all-reduce and the
optimizer step (its bytes at memory bandwidth, and where torch's optimizer steps parameter by parameter its
operator calls: ``probe.step_tail_ops``) add to it.

How the step executes, beside the layout (:class:`~.spec.Request`): ``compiled`` prices each forward and
backward with the tally's fused traffic and kernel count (``phase_traffic``) and takes what a compiled graph
recomputes off the saved bytes; ``overlap_dp`` hides the data-parallel collectives behind the compute but one
call's share (``_overlap``: another framework's runs, FSDP2 or Megatron-core; ``Parallel3D`` does not overlap).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional

from ..composition.layout import Layout
from ..dimensions import names, replicating, world_size
from ..pipeline.schedules import SCHEDULE_SPECS, build_all, schedule_spec, simulate, simulate_timing, stage_of
from . import representative as rep
from .accounting import NO_SHAPE
from .fp8 import chunk_terms, fp8_rate
from .hardware import Profile
from .probe import (
    ChunkCost,
    build_rank,
    fake_world,
    gathers_per_unit,
    global_rank,
    microbatch_probe,
    reduction_shard_bytes,
    static_terms,
    step_tail_ops,
    streams_gradients,
    sync_bytes,
    sync_calls,
)
from .spec import Request

_COLL_KIND = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
              "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
              "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
              "reduce_scatter_tensor_coalesced_": "reduce_scatter", "send": "send", "recv_": "send",
              "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "broadcast_": "all_gather"}


@dataclasses.dataclass
class RankProbe:
    static: Dict[str, int]
    sync: Dict[str, int]
    chunks: List[ChunkCost]
    streamed: bool = False     # ZeRO-2 reducing every micro-batch's backward bucket by bucket (probe.streams_gradients)
    reduction_shard: int = 0   # ZeRO-3: gradient shard allocated at the step's reduction (probe.reduction_shard_bytes)
    per_unit: bool = False     # ZeRO-3 gathering unit by unit (probe.gathers_per_unit)
    tail_ops: int = 0          # operator calls of torch's optimizer step (probe.step_tail_ops)
    calls: Dict[str, int] = dataclasses.field(default_factory=dict)   # probe.sync_calls


@dataclasses.dataclass
class Prediction:
    layout: Layout
    memory: List[Dict[str, int]]          # per pipeline rank: term -> bytes
    peak_bytes: int                       # the largest rank's total, fragmentation margin included
    step_s: float
    time_terms: Dict[str, float]
    tokens_per_s: float
    mfu: float
    bubble: float
    feasible: bool
    reason: str = ""

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["name"] = self.layout.name()
        return d


def _twin(req: Request, layout: Layout, r: int) -> Optional[int]:
    """A pipeline rank probed before ``r`` that holds the same shapes (None: probe ``r`` itself). With the
    layers split evenly over ``pp x chunks`` stages (the split is by block count), every rank but the first
    (embedding) and the last (head, tied weights) holds only whole-block chunks of the same size, so rank 1
    stands for ranks 2 .. pp-2: what lets a 64-stage pipeline be predicted in seconds."""
    if 1 < r < layout.pp - 1 and req.n_layer() % (layout.pp * layout.num_chunks) == 0:
        return 1
    return None


def _probe_schedule(layout: Layout) -> str:
    """The schedule a micro-batch is probed under: the first declared one that places the layout's chunks
    as its own schedule does (a probe runs one micro-batch through the chunks, not the schedule), so layouts
    that differ only in their schedule share the probe."""
    placement = schedule_spec(layout.schedule).layout
    return next(spec.name for spec in SCHEDULE_SPECS.values()
                if spec.layout == placement and spec.runs(layout.num_chunks))


def _each_rank(req: Request, layout: Layout, probe) -> list:
    """``probe(p3d)`` of every pipeline rank of ``layout``, each built on meta in its own fake world (twins
    share the rank they stand for)."""
    ranks = []
    for r in range(layout.pp):
        if _twin(req, layout, r) is not None:
            ranks.append(ranks[_twin(req, layout, r)])
            continue
        with fake_world(global_rank(layout, r), layout.world):
            ranks.append(probe(build_rank(req, layout, r)))
    return ranks


def _static_ranks(req: Request, layout: Layout, in_flight: Optional[list] = None) -> list:
    """What every pipeline rank of ``layout`` holds, probed on its own mesh (twins shared). ``in_flight``: a list
    that gets each probed rank's streamed bucket bytes (None where the rank does not stream)."""
    def probe(p3d):
        buckets: dict = {}
        terms = static_terms(p3d, req.seq_len // layout.cp, buckets)
        if in_flight is not None:
            in_flight.append(buckets.get("in_flight"))
        return (terms, sync_bytes(p3d), streams_gradients(p3d), reduction_shard_bytes(p3d), gathers_per_unit(p3d),
                step_tail_ops(p3d), sync_calls(p3d))
    return _each_rank(req, layout, probe)


def _scaled_streaming_static(req: Request, layout: Layout) -> Optional[list]:
    """A streaming ZeRO-2 rank's static terms from probes at 2 and 3 blocks (:func:`.representative.
    scale_streaming`), or None where its streamed bucket bytes are not yet constant at those depths."""
    probes, flights = [], []
    for n in rep.STREAM_BLOCKS:
        flight: list = []
        probes.append(_static_ranks(rep.with_layers(req, n), layout, flight))
        flights.append(flight[0])
    if flights[0] != flights[1]:
        return None
    # (None at both: the rank does not stream after all, e.g. tied embeddings: every term is linear)
    return [rep.scale_streaming(probes[0][0], probes[1][0], flights[0] or 0, req.n_layer())]


def _microbatch_ranks(req: Request, one: Layout, b: int) -> list:
    """Every pipeline rank's chunks of ``one`` (a dp-1 layout), one micro-batch of ``b`` sequences each (each
    rank's input shaped as the previous rank's output)."""
    hidden = [None]

    def probe(p3d):
        chunks, hidden[0] = microbatch_probe(p3d, b, req.seq_len // one.cp, hidden[0], fp8=req.fp8)
        return chunks
    return _each_rank(req, one, probe)


def _scaled_microbatch(req: Request, layout: Layout, b: int, cache: dict) -> list:
    """Every rank's chunks of ``layout`` from its stage shapes probed at 2 and 3 blocks (1 for a 1-block stage;
    cached, shared by every layout with the same micro-batch: :mod:`.representative`)."""
    one, blocks = rep.shape_layout(layout, req.precision), rep.stage_blocks(req, layout)
    shapes: dict = {rep.stage_shape(r, one.pp): {} for r in range(one.pp)}      # shape -> depth -> cost
    for n in rep.shape_depths(blocks):         # only the depths this layout's stages need (a 1-block stage: 1)
        key = ("stage shapes", one, b, n)
        if key not in cache:
            ranks = _microbatch_ranks(rep.with_layers(req, one.pp * n), one, b)
            cache[key] = {rep.stage_shape(r, one.pp): ranks[r][0] for r in range(one.pp)}
        for shape, cost in cache[key].items():
            shapes[shape][n] = cost
    placement = schedule_spec(layout.schedule).layout
    n_stages = layout.pp * layout.num_chunks
    stages = [[stage_of(r, c, layout.pp, layout.num_chunks, placement) for c in range(layout.num_chunks)]
              for r in range(layout.pp)]
    return [[rep.scale_chunk(shapes[rep.stage_shape(stage, n_stages)], blocks[stage]) for stage in mine]
            for mine in stages]


def probe_layout(req: Request, layout: Layout, cache: Optional[dict] = None) -> List[RankProbe]:
    """The probes of every pipeline rank of ``layout``, in two cached parts: what the rank holds
    (depends on the mesh, the ZeRO stage and the chunk count; for a streaming ZeRO-2 rank, whose bucket
    order comes from a backward, on checkpointing too) and what a micro-batch costs (depends on
    tp, pp, cp, chunks, checkpointing, the micro-batch size and whether ZeRO-3 keeps full gradients;
    probed on a mesh with dp 1, since data parallelism does not change a micro-batch). Both at 1 and 2
    blocks a chunk and scaled to the real count where :func:`.representative.why_exact` allows (the
    micro-batch as stage shapes shared across pp, chunks and schedules), else at full depth."""
    cache = {} if cache is None else cache
    b = req.global_batch // (layout.dp * layout.ep * layout.num_microbatches)     # rows split over dp and ep
    scaled = rep.why_exact(req, layout) is None
    # a streaming ZeRO-2 rank (pp 1) runs a backward for its bucket order: checkpointing is part of its key
    skey = ("static", layout.dp, layout.tp, layout.pp, layout.cp, layout.ep, layout.zero, layout.num_chunks,
            layout.checkpoint if layout.zero == 2 and layout.pp == 1 else None)
    if skey not in cache:
        blocks = rep.stage_blocks(req, layout)
        streaming = scaled and rep.streams(layout) and blocks[0] > rep.STREAM_BLOCKS[-1]
        if scaled and not rep.streams(layout) and (len(set(blocks)) > 1 or blocks[0] not in rep.STATIC_BLOCKS):
            probes = [_static_ranks(rep.with_layers(req, layout.pp * layout.num_chunks * n), layout)
                      for n in rep.STATIC_BLOCKS]
            cache[skey] = [rep.scale_static(r1, r2, rep.rank_blocks(req, layout, r))
                           for r, (r1, r2) in enumerate(zip(*probes))]
        else:
            cache[skey] = (streaming and _scaled_streaming_static(req, layout)) or _static_ranks(req, layout)
    z3 = layout.zero == 3
    probe_schedule = _probe_schedule(layout)
    akey = ("micro-batch", layout.tp, layout.pp, layout.cp, layout.ep, layout.num_chunks, probe_schedule,
            layout.checkpoint, b, z3, req.fp8)
    if akey not in cache:
        if scaled:
            cache[akey] = _scaled_microbatch(req, layout, b, cache)
        else:
            # dp 1; ZeRO 0 (1 for bf16/fp16, which need fp32 master weights) or 3: a micro-batch is the same
            plain = 0 if req.precision == "fp32" else 1
            one = dataclasses.replace(layout, dp=1, zero=3 if z3 else plain, num_microbatches=layout.pp,
                                      schedule=probe_schedule)
            cache[akey] = _microbatch_ranks(req, one, b)
    return [RankProbe(st, sy, ch, *rest) for (st, sy, *rest), ch in zip(cache[skey], cache[akey])]


def _group_strides(layout: Layout, dim: str) -> Dict[str, tuple]:
    """(stride, size) in the declared grid (:mod:`parallel_layers.dimensions`, tp fastest; a dimension's stride
    is the grid inside it) of each dimension of a group of ``dim`` (or ``"replicas"``: the replicating dimensions
    together, dp and cp) that has more than one rank."""
    sizes = layout.sizes
    dims = replicating() if dim == "replicas" else (dim,)
    out, stride = {}, 1
    for name in reversed(names()):                # innermost first
        if name in dims and sizes[name] > 1:
            out[name] = (stride, sizes[name])
        stride *= sizes[name]
    return out


def _spans_nodes(req: Request, layout: Layout, dim: str) -> bool:
    """Whether a group of ``dim`` crosses nodes: its ranks lie ``stride x size`` apart at most."""
    return any(stride * size > req.devices_per_node for stride, size in _group_strides(layout, dim).values())


def _node_share(req: Request, layout: Layout, dim: str) -> int:
    """Ranks of one group of ``dim`` on each node it spans: one node's devices over the stride of the group's
    innermost dimension."""
    members = _group_strides(layout, dim)
    if not members:
        return 1
    group = math.prod(size for _, size in members.values())
    return max(1, min(group, req.devices_per_node // min(stride for stride, _ in members.values())))


def phase_seconds(req, layout, prof: Profile, flops, traffic, ops, colls, slow: float, fp8_flops: float = 0.0,
                  cast_bytes: float = 0.0, shape=NO_SHAPE, fp8_shape=NO_SHAPE, wait: Optional[float] = None) -> float:
    """One forward or backward: its FLOPs at the precision's matmul rate (``fp8_flops`` of them, FP8 training's
    GEMMs, at the fp8 rate instead), its memory traffic (and FP8 casts' ``cast_bytes``) at the bandwidth, its
    operator calls' overhead and its collectives; ``shape`` / ``fp8_shape``: the shape tallies of ``flops`` and
    of the FP8 GEMMs among them, which a profile with a measured curve reads; ``wait``: the stretch of its
    collectives (default ``slow ** shared_wait_exponent``)."""
    kept = max(flops - fp8_flops, 0)
    if fp8_flops:
        # the FP8 GEMMs' terms leave the precision's own (attention's, 3 and 4, are never FP8)
        shape = tuple(a if i in (3, 4) else max(a - b, 0.0) for i, (a, b) in enumerate(zip(shape, fp8_shape)))
    device = prof.matmul_seconds(req.precision, kept, shape) + (traffic + cast_bytes) / prof.mem_bw
    if fp8_flops:
        fp8_rate(prof, req)                       # a profile without FP8 tensor cores: refused, said why
        device += prof.matmul_seconds("fp8", fp8_flops, fp8_shape)
    host = ops * prof.op_overhead
    t = (max(device, host) if prof.async_dispatch else device + host) * slow
    wait = slow ** prof.shared_wait_exponent if wait is None else wait
    for name, sizes in colls.items():
        kind = _COLL_KIND.get(name, "all_reduce")
        # (a receive costs as a send: inside a chunk's forward or backward they are context parallelism's ring
        # exchanges, each rank sending and receiving at once and waiting for both; the pipeline's own sends and
        # receives are the schedule's, outside the chunks, and charged as its latency)
        dim, n = ("cp", layout.cp) if kind in ("send", "all_to_all") else ("tp", layout.tp)
        if kind == "all_to_all" and layout.ep > 1:
            # an MoE layer's dispatch and combine (not told apart from Ulysses' all-to-alls when both are on)
            dim, n = "ep", layout.ep
        if kind == "send":
            n = 2
        inter, local = _spans_nodes(req, layout, dim), _node_share(req, layout, dim)
        t += sum(prof.collective_s(kind, n, nb, inter, local) for nb in sizes) * wait
    return t


def phase_traffic(req: Request, cc: ChunkCost) -> tuple:
    """A chunk's (traffic, operator calls) of its forward and of its backward: eager, or fused where the request
    says the blocks are compiled (``Request.compiled``)."""
    if req.compiled:
        return (cc.fused_traffic_f, cc.fused_ops_f), (cc.fused_traffic_b, cc.fused_ops_b)
    return (cc.traffic_f, cc.ops_f), (cc.traffic_b, cc.ops_b)


def fp8_terms(req: Request, layout: Layout, probes: List[RankProbe]) -> List[List[Optional[dict]]]:
    """Per rank and chunk, FP8 training's terms (:func:`.fp8.chunk_terms`), or None where FP8 is not asked."""
    if not req.fp8:
        return [[None] * len(pr.chunks) for pr in probes]
    return [[chunk_terms(c.fp8, req.fp8_recipe, layout.checkpoint, req.compiled) for c in pr.chunks] for pr in probes]


def _step_terms(req: Request, layout: Layout, prof: Profile, probes: List[RankProbe], f8: list, streams,
                placement, act_bytes: int, slow: float):
    """The step's time terms and the schedule's walk with every rank's compute stretched by ``slow``
    (``Profile.compute_stretch``) and its collectives by (ranks / slots) ** ``shared_wait_exponent``. (A model
    where a waiting rank frees its core, the stretch being the ranks busy at once, predicted 4 and 8 gloo ranks
    on 2 cores 34-74% too fast: a rank waiting in gloo does not give its core away as cleanly.)"""
    p, m, v = layout.pp, layout.num_microbatches, layout.num_chunks
    # collectives of ranks that take turns on the cores (Profile.shared_wait_exponent; contention apart)
    wait = (max(1.0, layout.world / prof.compute_slots) if prof.compute_slots else 1.0) ** prof.shared_wait_exponent
    durations = {}
    for r, pr in enumerate(probes):
        for c, cc in enumerate(pr.chunks):
            t8 = f8[r][c] or dict(flops_f=0, flops_b=0, cast_f=0, cast_b=0)
            zero = NO_SHAPE
            (traffic_f, ops_f), (traffic_b, ops_b) = phase_traffic(req, cc)
            f = phase_seconds(req, layout, prof, cc.flops_f, traffic_f, ops_f, cc.coll_f, slow,
                              t8["flops_f"], t8["cast_f"], cc.shape_f, t8.get("shape_f", zero), wait)
            b = phase_seconds(req, layout, prof, cc.flops_b, traffic_b, ops_b, cc.coll_b, slow,
                              t8["flops_b"], t8["cast_b"], cc.shape_b, t8.get("shape_b", zero), wait)
            for mb in range(m):
                durations[(r, "F", mb, c)] = f
                durations[(r, "B", mb, c)] = b
    # (a pipeline's messages: a CPU calibration fits their latency on a pipeline step, apart from context
    # parallelism's ring exchanges, which send and receive at once as the collectives' loop does)
    send = prof.collective_s("pipeline_send", 2, act_bytes, _spans_nodes(req, layout, "pp")) if p > 1 else 0.0
    latency = send * wait
    # a host that moves its messages itself (gloo on a CPU: no device runs them while it computes) spends the
    # link's latency on every send it posts and every receive it completes, beside the message's flight (a
    # 2-rank GPipe step of the tiny GPT, replayed on fixed measurements: -35% -> -10%); a GPU's host only
    # enqueues them
    message = 0.0 if prof.async_dispatch else send
    sim = simulate_timing(streams, v, latency=latency, durations=durations, layout=placement, message_cost=message)
    terms = {"pipeline": sim["step"]}
    busiest = max(range(len(probes)), key=lambda i: sum(probes[i].sync.values()))     # the most dp traffic
    sync, calls = probes[busiest].sync, probes[busiest].calls
    n_rep = world_size({d: layout.sizes[d] for d in replicating()})    # the dense parameters' replicas
    inter, local = _spans_nodes(req, layout, "replicas"), _node_share(req, layout, "replicas")

    def called(kind: str, nbytes: float, n: int) -> float:
        """``n`` calls of ``kind`` moving ``nbytes`` in all: each pays the link's latency."""
        return prof.collective_s(kind, n_rep, nbytes / n, inter, local) * n if nbytes else 0.0
    units = max(calls.get("units", 0), 1)
    terms["dp_reduce"] = 0.0
    n_calls = 1
    for kind in ("all_reduce", "reduce_scatter"):
        nbytes = sync.get(kind, 0)
        if "units" in calls:                      # ZeRO-3: one reduce-scatter a unit
            n = units
        elif "bucket_cap" in calls:               # the buffer's buckets: a small first one, then up to the cap
            n = 1 + math.ceil(max(nbytes - calls["bucket_first"], 0) / max(calls["bucket_cap"], 1))
        else:
            n = 1
        terms["dp_reduce"] += called(kind, nbytes, n)
        n_calls = max(n_calls, n if nbytes else 1)
    if any(pr.streamed or pr.per_unit for pr in probes):   # every micro-batch's gradients reduced
        terms["dp_reduce"] *= m
    # ZeRO 1, 2: the updated parameters gathered after the step; the loss's mean over the replicas (a scalar)
    terms["dp_reduce"] += called("all_gather", sync.get("param_gather", 0), 1) + called("all_reduce", 8, 1)
    gather = sync.get("all_gather", 0)
    if req.fp8_gather and gather:
        # ZeRO-3's gather of the FP8 layers' weights in FP8: 1 byte an element instead of the model dtype's
        # (the rank whose sync is the largest; its chunks' converted weights)
        gather = max(gather - sum(t["gather_saved"] for t in f8[busiest] if t), 0)
    terms["zero3_gather"] = called("all_gather", gather, units)
    if any(pr.per_unit for pr in probes):      # per unit: every unit gathered for each forward and backward
        terms["zero3_gather"] *= 2 * m
    terms["tied"] = prof.collective_s("all_reduce", 2, sync.get("tied_all_reduce", 0), _spans_nodes(req, layout, "pp"))
    for name in ("dp_reduce", "zero3_gather", "tied"):
        terms[name] *= wait
    if req.overlap_dp:
        _overlap(terms, n_calls)
    # the step reads and writes the rank's tensors once: optimizer state, gradients (the shard where sharded),
    # parameters
    opt_bytes = max(2 * (pr.static["optimizer"] + pr.static["gradients"] + pr.static["parameters"]
                         + pr.reduction_shard) for pr in probes)
    tail_ops = max(pr.tail_ops for pr in probes)
    terms["optimizer"] = (opt_bytes / prof.mem_bw + tail_ops * prof.op_overhead) * slow
    return terms, sim


def _overlap(terms: dict, calls: int) -> None:
    """The data-parallel collectives run beside the compute (``Request.overlap_dp``): each unit's gather
    during the previous unit's forward or backward, each bucket's reduction during the next one's backward.
    What stays exposed: the first gather and the last reduction of each pass (a ``1 / calls`` share of all of
    them, passes repeated for every micro-batch alike), and whatever the compute is too short to hide. The
    terms keep their names; their seconds are the exposed part."""
    comm = terms["dp_reduce"] + terms["zero3_gather"]
    if comm <= 0:
        return
    edge = comm / max(calls, 1)
    exposed = max(edge, comm - terms["pipeline"])
    for name in ("dp_reduce", "zero3_gather"):
        terms[name] *= exposed / comm


def predict(req: Request, layout: Layout, prof: Profile, cache: Optional[dict] = None) -> Prediction:
    if req.fp8:
        fp8_rate(prof, req)                       # refused before any probe where the profile has no fp8 rate
    cache = {} if cache is None else cache
    probes = probe_layout(req, layout, cache)
    f8 = fp8_terms(req, layout, probes)
    p, m, v = layout.pp, layout.num_microbatches, layout.num_chunks
    placement = schedule_spec(layout.schedule).layout
    # the schedule's streams and their in-flight counts depend on nothing else: one walk per schedule shape
    skey = ("schedule", layout.schedule, p, m, v)
    if skey not in cache:
        streams = build_all(layout.schedule, p, m, v)
        cache[skey] = streams, simulate(streams, v, layout=placement)["max_in_flight"]
    streams, in_flight = cache[skey]
    memory = []
    act_bytes = probes[0].chunks[0].out_bytes
    for r, pr in enumerate(probes):
        # FP8: the FP8 copies saved for backward instead of the high-precision inputs only the Linears kept
        d_saved = [t["saved"] if t else 0 for t in f8[r]]
        d_peak = [t["peak"] if t else 0 for t in f8[r]]
        if req.compiled:        # what the compiled graph recomputes instead of keeping: off both
            d_saved = [d - c.recomputable for d, c in zip(d_saved, pr.chunks)]
            d_peak = [d - c.recomputable for d, c in zip(d_peak, pr.chunks)]
        saved = max(c.saved + d for c, d in zip(pr.chunks, d_saved))
        # ZeRO-3: every chunk's full gradients stay for the step (a chunk's peak counts its own: taken off)
        full_grads = sum(c.persist for c in pr.chunks)
        mb_peak = max(c.peak - c.persist + d for c, d in zip(pr.chunks, d_peak))
        terms = dict(pr.static)
        terms["activations"] = mb_peak + max(in_flight[r] - 1, 0) * saved
        if full_grads and m == 1:
            # one micro-batch: no later one runs beside the full gradients. Its own peak holds those its
            # backward made so far where the tally saw them made (autograd's), all in unit buffers otherwise
            first = max(c.first_peak + c.persist_untallied + d for c, d in zip(pr.chunks, d_peak))
            terms["activations"] = max(first - full_grads, 0)
        if full_grads or pr.reduction_shard:
            terms["gradients"] += full_grads + max(pr.reduction_shard - terms["activations"], 0)
        if prof.sends_held and p > 1:
            # every activation and gradient this rank sent stays until the step's end; the last one's
            # tensor is still the micro-batch's own at the peak
            sends = sum(1 for item in streams[r] if isinstance(item, tuple) for ins in item
                        if ins.op.startswith("SEND"))
            terms["messages"] = max(sends - 1, 0) * act_bytes
        memory.append(terms)
    totals = [sum(t.values()) for t in memory]
    peak = int(max(totals) * (1 + prof.fragmentation))
    # ---- time
    slow = prof.compute_stretch(layout.world)
    terms, sim = _step_terms(req, layout, prof, probes, f8, streams, placement, act_bytes, slow)
    step = sum(terms.values())
    tokens = req.global_batch * req.seq_len
    per_stage = layout.world // layout.pp          # the ranks of one pipeline stage, each its share of the work
    model_flops = sum((cc.flops_f + cc.flops_b) for pr in probes for cc in pr.chunks) * m * per_stage
    if layout.checkpoint:      # the recomputed forward is not model work
        model_flops -= sum(cc.flops_f for pr in probes for cc in pr.chunks) * m * per_stage
    peak_rate = prof.peak_flops.get(req.precision) or prof.peak_flops["fp32"]
    mfu = model_flops / (step * layout.world * peak_rate) if step > 0 else 0.0
    pred = Prediction(layout=layout, memory=memory, peak_bytes=peak, step_s=step, time_terms=terms,
                      tokens_per_s=tokens / step if step > 0 else 0.0, mfu=mfu, bubble=sim["bubble"], feasible=True)
    if peak > req.memory_bytes:
        worst = max(range(len(memory)), key=lambda r: totals[r])
        term = max(memory[worst], key=memory[worst].get)
        pred.feasible = False
        pred.reason = (f"pipeline rank {worst} needs {peak / 2**20:.1f} MiB > {req.memory_bytes / 2**20:.1f} MiB "
                       f"(largest term: {term} {memory[worst][term] / 2**20:.1f} MiB)")
    return pred


__all__ = ["predict", "probe_layout", "Prediction", "RankProbe"]
