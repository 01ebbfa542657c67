"""Published large-scale runs on paper: the planner's predicted per-GPU throughput for a run's own layout
beside the throughput its authors measured, and the layout the planner would have picked instead.

The runs: the weak-scaling table (Table 1) of Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21 (arXiv:2104.04473): GPT models of 1.7B to 1T
parameters on 32 to 3072 A100 80GB GPUs of NVIDIA's Selene (DGX A100 nodes: 8 GPUs on NVLink/NVSwitch,
8 x 200 Gb/s HDR InfiniBand per node), sequence 2048, vocabulary 51,200, mixed precision (fp16),
interleaved 1F1B, activation recomputation. "Achieved teraFLOP/s per GPU" is the paper's eq. 3 (every
GEMM, the recomputed forward included) over the measured step time and the GPU count:

    F = 96 B s l h^2 (1 + s / 6h + V / 16 l h)

so a prediction is turned into the same figure: :func:`paper_flops` over the predicted step time.

What Table 1 does not give, and what is used here instead (said again in every row's output):

* the micro-batch size: the "Micro BS" column of BigScience's transcription of the table
  (github.com/bigscience-workshop/bigscience, experiments/meg-notes.md), which is not in the paper's
  table and whose origin that note does not give (secondary transcriptions of the paper's Table 2 show
  micro-batch 1 for its PTD-P runs at 175B and 530B, as that column has for the largest models);
* the chunks per rank of the interleaved schedule: the smallest v >= 2 that splits the rank's layers
  evenly (2, or 3 for the 76B and 530B rows: 15 and 3 layers per rank); with pp = 1, no pipeline;
* the optimizer: Megatron-LM of 2021 kept fp32 master weights and Adam state on every data-parallel
  replica; this package's fp16 needs a ZeRO optimizer for those (stage 1, 2 or 3); stage 1 is used here
  (the same bytes reduced, optimizer state sharded), so the memory is less than theirs and the time the
  same but for the all-gather of the updated weights. Which layouts the authors could run is judged with
  their optimizer (:func:`their_peak_bytes`: 12 bytes a parameter on every replica): the planner's search
  is ranked over those too (``Comparison.their_space_rank``), the layouts a ZeRO optimizer adds beside;
* the execution: the paper's fused kernels (section 4.2) priced as a compiled step (``Request.compiled``:
  the non-matmul ops between two matmuls one kernel); its data-parallel all-reduce not overlapped.

Everything else is the planner unchanged: :func:`~.model.predict` on the A100 SXM 80GB data-sheet
profile (:data:`~.hardware.BUILTIN` ``"a100"``, its assumed 50% matmul efficiency included), 8 ranks a
node, 80 GiB a rank.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, List, Optional

from ..composition.layout import Layout
from ..models.gpt import GPTConfig
from ..pipeline.schedules import schedule_spec
from .hardware import BUILTIN, Profile
from .model import Prediction, phase_seconds, phase_traffic, predict, probe_layout
from .search import divisors, plan, why_not
from .spec import Request

PAPER = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM, "
         "SC'21, arXiv:2104.04473, Table 1")
PAPER_URL = "https://arxiv.org/abs/2104.04473"
MICRO_BATCH_SOURCE = "https://github.com/bigscience-workshop/bigscience/blob/master/experiments/meg-notes.md"
SETUP = dict(seq_len=2048, vocab=51200, precision="fp16", devices_per_node=8, memory_bytes=80 * 2**30,
             profile="a100", peak_tflops=312.0, schedule="interleaved 1F1B", recompute=True,
             cluster="Selene: DGX A100 80GB nodes, 8 GPUs on NVLink/NVSwitch, 8 x 200 Gb/s HDR InfiniBand a node")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One row of a published table: the model (GPT: heads, hidden, layers), the layout (tp x pp on
    ``gpus``; dp the rest), the global batch, and what was measured."""
    params_b: float               # billions, as published (the paper's eq. 2)
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float         # achieved, eq. 3 over the measured step
    peak_pct: float               # of the A100's 312 TFLOP/s
    aggregate_pflops: float
    micro_batch: int              # not in the paper's table: MICRO_BATCH_SOURCE
    source: str = PAPER

    @property
    def name(self) -> str:
        return f"{self.params_b:g}B"

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


def _row(p, a, h, n, t, pp, g, b, tf, pct, agg, mb):
    return PublishedRun(p, a, h, n, t, pp, g, b, tf, pct, agg, mb)


# Table 1 of arXiv:2104.04473 (numbers as published; the micro-batch column from MICRO_BATCH_SOURCE)
MEGATRON_2021: List[PublishedRun] = [
    _row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4, 16),
    _row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8, 16),
    _row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2, 16),
    _row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6, 8),
    _row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8, 4),
    _row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8, 2),
    _row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1, 2),
    _row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4, 1),
    _row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2, 1),
    _row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0, 1),
]


def paper_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one training step as the paper counts them (eq. 3: GEMMs, recomputation included)."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def paper_params(layers: int, hidden: int, vocab: int, seq: int) -> float:
    """Parameters as the paper counts them (eq. 2)."""
    return 12 * layers * hidden ** 2 * (1 + 13 / (12 * hidden) + (vocab + seq) / (12 * layers * hidden))


def request(run: PublishedRun) -> Request:
    """The planner's question for a run: a GPT of its dimensions (GELU MLP of 4h, learned positions, tied
    embedding: the paper's model) on its GPUs, 8 to a node, 80 GiB each, its global batch, fp16, its
    elementwise ops fused (``compiled``: the paper's section 4.2, Megatron-LM's fused bias + GeLU,
    bias + dropout + add and scale + mask + softmax kernels)."""
    cfg = GPTConfig(vocab_size=SETUP["vocab"], n_layer=run.layers, n_head=run.heads, d_model=run.hidden,
                    max_seq_len=SETUP["seq_len"])
    return Request(cfg, world=run.gpus, global_batch=run.batch, seq_len=SETUP["seq_len"],
                   memory_bytes=SETUP["memory_bytes"], devices_per_node=SETUP["devices_per_node"],
                   precision=SETUP["precision"], compiled=True)


def _chunks(layers: int, pp: int) -> int:
    """Chunks per rank of the interleaved schedule: the smallest v >= 2 that splits the rank's layers."""
    if pp == 1:
        return 1
    per_rank = layers // pp
    return next((v for v in range(2, per_rank + 1) if per_rank % v == 0), 1)


def layout_of(layers: int, batch: int, tp: int, pp: int, dp: int, micro_batch: int, schedule: str = "interleaved",
              checkpoint: bool = True) -> Layout:
    """A layout with ``micro_batch`` sequences a micro-batch (``batch / (dp x micro_batch)`` micro-batches);
    pp > 1: ``schedule`` (interleaved: :func:`_chunks` chunks a rank)."""
    m = max(batch // (dp * micro_batch), 1)
    if pp == 1:
        return Layout(dp=dp, tp=tp, pp=1, zero=1, schedule="1f1b", num_microbatches=m, checkpoint=checkpoint)
    spec = schedule_spec(schedule)
    v = _chunks(layers, pp) if spec.any_chunks else spec.chunks
    if v == 1:
        schedule = "1f1b"
    return Layout(dp=dp, tp=tp, pp=pp, zero=1, schedule=schedule, num_microbatches=m, num_chunks=v,
                  checkpoint=checkpoint)


def their_layout(run: PublishedRun) -> Layout:
    return layout_of(run.layers, run.batch, run.tp, run.pp, run.dp, run.micro_batch)


def tflops_per_gpu(run: PublishedRun, step_s: float) -> float:
    """The paper's "achieved teraFLOP/s per GPU" for a step of ``step_s`` seconds."""
    return paper_flops(run.batch, SETUP["seq_len"], run.layers, run.hidden, SETUP["vocab"]) / (step_s * run.gpus) / 1e12


OPTIMIZER_BYTES_PER_PARAM = 12     # Megatron-LM 2021: fp32 master weights, Adam's two moments, unsharded


def their_peak_bytes(pred: Prediction, precision_bytes: int = 2) -> int:
    """The busiest rank's memory had its optimizer been Megatron-LM 2021's (fp32 master weights and Adam's
    moments on every data-parallel replica, :data:`OPTIMIZER_BYTES_PER_PARAM` a parameter) instead of the
    planner's ZeRO-1 shard: each rank's ``optimizer`` term replaced by that state of its parameters (its
    ``parameters`` term, ``precision_bytes`` each), fragmentation margin as the prediction's."""
    margin = pred.peak_bytes / max(sum(t.values()) for t in pred.memory)
    totals = [sum(t.values()) - t.get("optimizer", 0)
              + t["parameters"] // precision_bytes * OPTIMIZER_BYTES_PER_PARAM for t in pred.memory]
    return int(max(totals) * margin)


def breakdown(req: Request, pred: Prediction, prof: Profile, cache: Optional[dict] = None) -> Dict[str, float]:
    """Where a predicted step goes, in seconds of the busiest pipeline rank: its matmuls, its other ops'
    memory traffic, its per-op overhead and its tensor-parallel collectives (each the time model's own
    term, :func:`~.model.phase_seconds` with the others left out), the pipeline's idle time (the simulated
    pipeline less that work: bubble and activation sends), then the step's other terms as predicted."""
    lay = pred.layout
    probes = probe_layout(req, lay, cache)
    slow = max(1.0, lay.world / prof.compute_slots) if prof.compute_slots else 1.0
    parts = {"matmul": 0.0, "traffic": 0.0, "op_overhead": 0.0, "tp_comm": 0.0}
    per_rank = []
    for pr in probes:
        acc = dict.fromkeys(parts, 0.0)
        for cc in pr.chunks:
            (tr_f, ops_f), (tr_b, ops_b) = phase_traffic(req, cc)
            for fl, shape, tr, ops, coll in ((cc.flops_f, cc.shape_f, tr_f, ops_f, cc.coll_f),
                                             (cc.flops_b, cc.shape_b, tr_b, ops_b, cc.coll_b)):
                acc["matmul"] += phase_seconds(req, lay, prof, fl, 0, 0, {}, slow, shape=shape) * lay.num_microbatches
                acc["traffic"] += phase_seconds(req, lay, prof, 0, tr, 0, {}, slow) * lay.num_microbatches
                acc["op_overhead"] += phase_seconds(req, lay, prof, 0, 0, ops, {}, slow) * lay.num_microbatches
                acc["tp_comm"] += phase_seconds(req, lay, prof, 0, 0, 0, coll, slow) * lay.num_microbatches
        per_rank.append(acc)
    busiest = max(per_rank, key=lambda a: sum(a.values()))
    out = dict(busiest)
    out["pipeline_idle"] = pred.time_terms["pipeline"] - sum(busiest.values())
    out.update({k: v for k, v in pred.time_terms.items() if k != "pipeline"})
    return out


def candidates(run: PublishedRun, checkpoint=(True,), schedules=("interleaved",)):
    """The layouts the planner weighs for a run's model, GPUs and batch: the paper's design space of mesh
    shapes, tp within a node (1, 2, 4, 8) and dividing the heads, pp splitting the layers evenly, the rest
    data parallel; with the run's micro-batch size, schedule (interleaved 1F1B), recomputation and ZeRO 1
    (the closest to their optimizer that fp16 takes here). Shapes whose fp16 weights alone (the paper's
    eq. 2, 2 bytes each) exceed a GPU are dropped unprobed: a lower bound, so nothing that could fit is.
    ``(layout, reason)`` as :func:`~.search.candidate_layouts`."""
    req = request(run)
    node = SETUP["devices_per_node"]
    params = paper_params(run.layers, run.hidden, SETUP["vocab"], SETUP["seq_len"])
    for tp, pp in itertools.product(divisors(node), divisors(run.layers)):
        if run.gpus % (tp * pp):
            continue
        dp = run.gpus // (tp * pp)
        for sched, ck in itertools.product(schedules if pp > 1 else ("1f1b",), checkpoint):
            lay = layout_of(run.layers, run.batch, tp, pp, dp, run.micro_batch, sched, ck)
            if pp > 1 and lay.schedule != sched and "1f1b" in schedules:
                continue                       # interleaved with one chunk is 1F1B: listed once
            reason = why_not(req, tp, pp, 1, lay.num_chunks)
            if reason is None and 2 * params / (tp * pp) > SETUP["memory_bytes"]:
                reason = f"fp16 weights alone ({2 * params / (tp * pp) / 2**30:.0f} GiB a GPU) exceed the memory"
            if reason is None and run.batch % (dp * run.micro_batch):
                reason = f"the batch ({run.batch}) does not split into dp={dp} x micro-batch {run.micro_batch}"
            spec = schedule_spec(lay.schedule)
            if reason is None and spec.microbatches_multiple_of_pp and lay.num_microbatches % pp:
                reason = f"{spec.title} needs the micro-batches ({lay.num_microbatches}) a multiple of pp={pp}"
            yield lay, reason


@dataclasses.dataclass
class Comparison:
    run: PublishedRun
    theirs: Prediction
    predicted_tflops: float
    error: float                       # (predicted - published) / published
    pick: Optional[Prediction]
    pick_tflops: float
    why: str
    terms_theirs: Dict[str, float]
    terms_pick: Dict[str, float]
    searched: int
    their_rank: Optional[int] = None   # where the search ranks their layout (1: first), None: not searched or absent
    # the same over the layouts that fit with the authors' optimizer (their_peak_bytes): the space they searched
    their_space_rank: Optional[int] = None
    their_space_pick: Optional[Prediction] = None
    their_space_size: int = 0


def _why(run, theirs, pick, t_theirs, t_pick) -> str:
    if pick is None:
        return "no layout the planner weighed fits in memory"
    if not theirs.feasible:
        return f"their layout does not fit the memory model ({theirs.reason}); picks {pick.layout.name()}"
    if pick.layout == theirs.layout:
        return "the planner picks their layout"
    diffs = {k: t_pick.get(k, 0.0) - t_theirs.get(k, 0.0) for k in set(t_theirs) | set(t_pick)}
    gains = sorted((k for k in diffs if abs(diffs[k]) > 1e-3 * theirs.step_s), key=lambda k: diffs[k])
    said = ", ".join(f"{k} {diffs[k]:+.2f} s" for k in gains[:3])
    return (f"{pick.layout.name()} is predicted {theirs.step_s / pick.step_s - 1:+.1%} faster: {said} "
            f"(peak {pick.peak_bytes / 2**30:.0f} GiB vs theirs {theirs.peak_bytes / 2**30:.0f} GiB)")


def compare(run: PublishedRun, profile: Optional[Profile] = None, search: bool = True, progress=None,
            layouts: Optional[list] = None) -> Comparison:
    """The prediction for ``run``'s own layout and (``search``) the planner's pick over :func:`candidates`
    (``layouts``: these ``(layout, reason)`` instead)."""
    prof = profile or BUILTIN[SETUP["profile"]]
    req = request(run)
    cache: dict = {}
    theirs = predict(req, their_layout(run), prof, cache)
    tf = tflops_per_gpu(run, theirs.step_s)
    terms_theirs = breakdown(req, theirs, prof, cache)
    pick, pick_tf, terms_pick, n, their_rank = None, math.nan, {}, 0, None
    space: list = []
    if search:
        layouts = list(candidates(run)) if layouts is None else list(layouts)
        n = sum(1 for _, r in layouts if r is None)
        ranked = plan(req, prof, layouts, progress=progress, cache=cache)
        order = [p.layout for p in ranked if p.feasible]
        their_rank = order.index(theirs.layout) + 1 if theirs.layout in order else None
        space = [p for p in ranked if p.feasible and their_peak_bytes(p) <= req.memory_bytes]
        if ranked and ranked[0].feasible:
            pick = ranked[0]
            pick_tf = tflops_per_gpu(run, pick.step_s)
            terms_pick = breakdown(req, pick, prof, cache)
    why = _why(run, theirs, pick, terms_theirs, terms_pick) if search else "not searched"
    in_space = [p.layout for p in space]
    return Comparison(run, theirs, tf, (tf - run.tflops_per_gpu) / run.tflops_per_gpu, pick, pick_tf, why,
                      terms_theirs, terms_pick, n, their_rank,
                      in_space.index(theirs.layout) + 1 if theirs.layout in in_space else None,
                      space[0] if space else None, len(space))


__all__ = ["PublishedRun", "MEGATRON_2021", "SETUP", "PAPER", "PAPER_URL", "MICRO_BATCH_SOURCE", "paper_flops",
           "paper_params", "request", "their_layout", "their_peak_bytes",
           "OPTIMIZER_BYTES_PER_PARAM", "layout_of", "tflops_per_gpu", "breakdown", "candidates",
           "compare", "Comparison"]
