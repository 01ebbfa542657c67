"""Pipeline parallelism on CPU gloo ranks (1 thread each): bubble, activation memory, step time vs torch.

    python -m benchmarks.pipeline            # full: p = 2 and 4, m = 4, 8, 16, GPT d 256 seq 128 (+ d 128 at p = 2)
    python -m benchmarks.pipeline --quick    # p = 2, GPT d 256 seq 64, few reps (~30 s)
    python -m benchmarks.pipeline --smoke    # tiny, seconds; never writes CSV

For each (p, m), in the same processes on the same data, timed steps interleaved variant by variant:
* our GPipe, 1F1B and interleaved 1F1B (2 chunks per rank), the timeline recorded: measured bubble
  (mean over ranks of idle / step time) against 1F1B's ideal (p-1)/(m+p-1) (target within 15%), and
  interleaved below 1F1B;
* peak activation memory per stage, GPipe vs 1F1B: bytes of the tensors autograd saves, alive at once
  (``saved_tensors_hooks``, one count per storage; parameters and the step's input token ids / targets,
  which the caller holds for the whole step whatever the schedule, excluded); target 1F1B <= p/m of GPipe;
* step time against ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B) on the same split and microbatches (target ours/torch <= 1.0). Ours runs
  with ``broadcast_loss=False``: torch's schedules leave the loss on the last stage only, too;
* the zero-bubble schedules (issue 36), ZB-H1 and ZBV (two chunks per rank in a V): their measured bubble
  against 1F1B's and interleaved 1F1B's (targets at m = 8: ZB-H1 <= 0.5x 1F1B, ZBV below ZB-H1), ZB-H1's
  step time against 1F1B's (<= 0.95x) and peak activation memory (<= 1.1x; the most bytes torch's
  allocator held above the step's start, per rank, max over ranks, for both: what is kept between B and
  W, the backward's transients and the messages included; torch's schedules measured the same way
  beside), and the step time against torch's
  ScheduleInterleavedZeroBubble (one stage per rank) and ScheduleZBVZeroBubble on the same model;
* forward-only evaluation of the same batch: ``PipelineEngine.evaluate`` against the same torch
  schedule's ``eval`` (called as a user would for validation: chunks in eval mode, under
  ``torch.no_grad``), timed interleaved after the training reps (reported: evaluation has no target).
A step's time is the slowest rank's (all-reduce MAX outside the timed region), median of the reps.
p = 4 runs 4 processes on this 2-core machine: its idle times are distorted by oversubscription, so
(the targets are set at p = 2) its rows are reported without pass/fail where the machine
has fewer cores than stages.

Bubble: from the engine's recorded timeline (ranks on one host share the perf_counter clock): per rank
1 - (forward + backward compute) / (first entry to last end), mean over ranks; waiting for messages,
posting them and engine overhead all count as idle. Same definition for every schedule. Each bubble
row also says where it came from (``PipelineEngine.bubble_breakdown``: the recorded instruction
times replayed through the schedule's timing model): the schedule's own bubble, + unequal stages and
compute jitter, + engine time between instructions, + message latency. The ideal
assumes equal stages, so each bubble row also reports each rank's compute time (the last stage holds
LM head + loss, the first the embedding; with V=256 they cost a few % of a stage).

Models: "representative" (d 256, seq 128: ~20 ms forward and ~40 ms backward per microbatch and stage
on one core) carries the targets; "small" (d 128, seq 64, ~1-3 ms per stage op, the earlier benchmark
model) is reported too at p = 2, without pass/fail: there message latency and Python overhead are a
large share of a step.
Ranks keep freed memory for reuse (``harness.run_ranks(retain_memory=True)``, see
``parallel_layers.cpu_allocator``) and, where the machine has a core per rank, each rank's threads are
bound to a core of its own (``bind_cores=True``, see ``parallel_layers.cpu_affinity``; ``--no-bind-cores``
to compare), as a CPU training job should run; the torch baselines share the processes, so they get
both too. The bubble rows say how the ranks were bound.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "pipeline.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 30
SCHEDS = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")     # the schedules torch.distributed.pipelining has too
ALLOC_SCHEDS = ("1f1b", "zb-h1", "zbv")    # activation memory from the allocator, ours and torch's
# evaluation is forward-only whatever the schedule, and torch's zero-bubble schedules have no eval() (their
# backward actions run anyway: "can't steal_bwd_input if this stage doesn't have backward", torch 2.13)
EVAL_SCHEDS = ("gpipe", "1f1b", "interleaved")
MODELS = {
    # per-stage compute of real training (tens of ms per microbatch and stage on one core): the targets
    "representative": dict(vocab=256, n_layer=8, n_head=4, d_model=256, seq=128, mbs=2),
    # the earlier benchmark model: ~1-3 ms per stage op, so message latency and Python overhead dominate
    "small": dict(vocab=256, n_layer=8, n_head=4, d_model=128, seq=64, mbs=2),
    "quick": dict(vocab=256, n_layer=8, n_head=4, d_model=256, seq=64, mbs=2),
    "smoke": dict(vocab=64, n_layer=4, n_head=2, d_model=32, seq=16, mbs=1),
}
# mode -> what runs: (model, pipeline sizes) pairs, microbatch counts, timed reps, warm-up steps, PNGs
PROFILES = {
    "smoke": dict(runs=[("smoke", [2])], ms=[4], reps=1, warmup=1, png=False),
    "quick": dict(runs=[("quick", [2])], ms=[4, 8], reps=3, warmup=1, png=False),
    "full": dict(runs=[("representative", [2, 4]), ("small", [2])], ms=[4, 8, 16], reps=7, warmup=2, png=True),
}


def _sizes(p: int, m: int, cfgd: dict) -> str:
    return (f"p={p} m={m} d={cfgd['d_model']} seq={cfgd['seq']} mbs={cfgd['mbs']} L={cfgd['n_layer']} "
            f"V={cfgd['vocab']} h={cfgd['n_head']}")


class SavedBytes:
    """Peak bytes of autograd-saved activations alive at once (one count per storage). Storages of
    ``exclude`` (parameters; the step's inputs and targets, held by the caller all step whatever the
    schedule) are not activations and are not counted."""

    def __init__(self, exclude):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs, self.alive, self.peak = {}, 0, 0

    def hooks(self):
        meter = self

        class Handle:
            def __init__(self, t, key):
                self.t, self.key = t, key

            def __del__(self):
                meter.refs[self.key][0] -= 1
                if meter.refs[self.key][0] == 0:
                    meter.alive -= meter.refs.pop(self.key)[1]

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key in self.excluded or key == 0:
                return t
            if key not in self.refs:
                self.refs[key] = [0, t.untyped_storage().nbytes()]
                self.alive += self.refs[key][1]
                self.peak = max(self.peak, self.alive)
            self.refs[key][0] += 1
            # detached: a handle holding a saved OUTPUT with its grad_fn would make a reference cycle
            # (tensor -> node -> saved variable -> handle -> tensor) that outlives the graph wherever a
            # node's saved variables are not released by its backward (retain_graph: a zero-bubble B)
            return Handle(t.detach(), key)

        def unpack(h):
            return h.t if isinstance(h, Handle) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _bench_rank(rank: int, world: int, cfgd: dict, ms: List[int], reps: int, warmup: int,
                png_base: Optional[str]) -> Optional[dict]:
    """One pipeline rank (spawned by ``harness.run_ranks``, gloo group initialised): every (m, schedule,
    ours/torch) variant, timed interleaved. Returns the results on rank 0, None elsewhere."""
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    from parallel_layers.cpu_affinity import available_cores
    from parallel_layers.families import recipe_for
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.pipeline import PipelineEngine, split_model
    from parallel_layers.pipeline.schedules import schedule_spec
    from parallel_layers.pipeline.stage import stage_ids
    from parallel_layers.planner.measure import step_growth

    # untied: torch.distributed.pipelining has no tied-weight support; same split for both
    cfg = GPTConfig(vocab_size=cfgd["vocab"], n_layer=cfgd["n_layer"], n_head=cfgd["n_head"],
                    d_model=cfgd["d_model"], max_seq_len=cfgd["seq"], tie_embeddings=False)
    group = dist.group.WORLD
    results = {}

    class TorchChunk(nn.Module):          # torch's stages return logits; loss_fn outside
        def __init__(self, stage):
            super().__init__()
            self.stage = stage

        def forward(self, x):
            return self.stage(x)

    def loss_fn(out, tgt):
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

    def gpt_stages(v, layout):            # the one-process GPT's weights (seed 0), this rank's stages
        gpt = cfg.build(seed=0)
        return split_model(gpt, recipe_for(gpt), rank, world, num_chunks=v, layout=layout)

    cores = [None] * world       # each rank's affinity, for the rows (bound or free); fixed for the run
    dist.all_gather_object(cores, available_cores())
    for m in ms:
        g = torch.Generator().manual_seed(0)
        B = m * cfgd["mbs"]
        idx = torch.randint(0, cfg.vocab_size, (B, cfgd["seq"]), generator=g)
        tgt = torch.randint(0, cfg.vocab_size, (B, cfgd["seq"]), generator=g)
        variants = {}
        ends = {}                 # variant -> (this rank holds the first stage, holds the last)
        for sched in SCHEDS:
            spec = schedule_spec(sched)
            v, layout = spec.chunks, spec.layout
            chunks = gpt_stages(v, layout)
            ids = stage_ids(rank, world, v, layout)
            variants[f"ours_{sched}"] = (PipelineEngine(chunks, group, schedule=sched, num_microbatches=m,
                                                        broadcast_loss=False), chunks)
            tchunks = gpt_stages(v, layout)
            stages = [PipelineStage(TorchChunk(c), i, world * v, torch.device("cpu"), group=group)
                      for c, i in zip(tchunks, ids)]
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
                   "zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble}[sched]
            schedule = cls(stages if (v > 1 or spec.splits_backward) else stages[0], n_microbatches=m,
                           loss_fn=loss_fn)
            variants[f"torch_{sched}"] = (schedule, tchunks)
            here = set(ids)
            ends[f"ours_{sched}"] = ends[f"torch_{sched}"] = (0 in here, world * v - 1 in here)

        def call(name, ours_method, torch_method):
            """One step or evaluation of a variant, each rank passing what its stage takes."""
            obj = variants[name][0]
            first, last = ends[name]
            if name.startswith("ours"):
                getattr(obj, ours_method)(idx if first else None, tgt if last else None)
            elif first and last:      # ZBV: the V's two ends on rank 0
                getattr(obj, torch_method)(idx, target=tgt, losses=[])
            elif first:
                getattr(obj, torch_method)(idx)
            elif last:
                getattr(obj, torch_method)(target=tgt, losses=[])
            else:
                getattr(obj, torch_method)()

        def run(name):
            for c in variants[name][1]:
                c.zero_grad(set_to_none=False)
            call(name, "step", "step")

        def run_eval(name):
            if name.startswith("ours"):              # eval mode and no_grad inside evaluate()
                return call(name, "evaluate", None)
            chunks = variants[name][1]
            for c in chunks:
                c.eval()
            with torch.no_grad():
                call(name, None, "eval")
            for c in chunks:
                c.train()

        times = {n: [] for n in variants}
        eval_times = {n: [] for n in variants}
        bubbles = {n: [] for n in variants if n.startswith("ours")}
        busy = {n: [] for n in bubbles}          # per rep: each rank's compute (F + B) time, ms
        parts = {n: [] for n in bubbles}         # per rep: engine.bubble_breakdown()
        for i in range(warmup + reps):
            names = list(variants) if i % 2 == 0 else list(reversed(variants))
            for n in names:
                step_ms = harness.slowest_rank_ms(lambda: run(n))
                if i >= warmup:
                    times[n].append(step_ms)
                    if n in bubbles:
                        tls = variants[n][0].gather_timeline()
                        if rank == 0:
                            bubbles[n].append(variants[n][0].bubble_fraction())
                            busy[n].append([tl.busy * 1e3 for tl in tls])
                            parts[n].append(variants[n][0].bubble_breakdown())
        # evaluation after all training reps, as validation runs (several batches in a row): torch's
        # schedules re-initialise their stages when switching between step() and eval(), which must
        # not land in the training rows above
        evaluated = [n for n in variants if n.split("_", 1)[1] in EVAL_SCHEDS]
        for i in range(warmup + reps):
            for n in (evaluated if i % 2 == 0 else list(reversed(evaluated))):
                eval_ms = harness.slowest_rank_ms(lambda: run_eval(n))
                if i >= warmup:
                    eval_times[n].append(eval_ms)
        # activation memory of one step, this rank's stages, two ways: the saved tensors alive at once
        # (GPipe and 1F1B, whose graphs autograd frees as it goes), and the most bytes torch's allocator
        # held above the step's start (every schedule, ours and torch's: what a zero-bubble schedule keeps
        # between B and W, its kept gradients, the messages and the backward's transients included; the
        # zero-bubble engine saves its tensors through hooks of its own, which a counting hook would shadow)
        mem = {}
        for n in ("ours_gpipe", "ours_1f1b"):
            meter = SavedBytes([p for c in variants[n][1] for p in c.parameters()] + [idx, tgt])
            with meter.hooks():
                run(n)
            mem[n] = meter.peak
        for n in [f"{who}_{s}" for who in ("ours", "torch") for s in ALLOC_SCHEDS]:
            mem[f"alloc_{n}"] = step_growth(lambda: run(n))
            if n.startswith("ours") and schedule_spec(n.split("_", 1)[1]).splits_backward:
                mem[f"held_{n}"] = variants[n][0].peak_pending_w_bytes
        mems = [None] * world
        dist.all_gather_object(mems, mem)
        png = None
        if png_base and m == max(ms):
            for n in ("ours_1f1b", "ours_interleaved", "ours_zb-h1", "ours_zbv"):
                dist.barrier()     # rank 0 drew the previous PNG: the others would wait for it inside the step
                run(n)
                path = png_base.replace(".png", f"_{n[5:]}_p{world}_m{m}.png")
                out = variants[n][0].draw_timeline(path)
                png = png or out
        results[m] = {"times": times, "eval_times": eval_times, "bubbles": bubbles, "busy": busy, "parts": parts,
                      "mem": mems, "png": png, "cores": cores}
    return results if rank == 0 else None


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            **overrides) -> List[dict]:
    """Run the benchmark (``mode``: smoke | quick | full, see ``PROFILES``; ``overrides`` replace profile
    entries: ms, reps, warmup, png, and ``model``/``pps`` together replace ``runs``) and return the CSV
    rows. Writes no CSV; prints a few detail lines to stderr. ``device`` only names the machine: the
    ranks are gloo processes on CPU."""
    prof = dict(PROFILES[mode])
    if overrides.get("model") or overrides.get("pps"):
        model = overrides.get("model") or prof["runs"][0][0]
        pps = overrides.get("pps") or sorted({p for _, ps in prof["runs"] for p in ps})
        prof["runs"] = [(model, pps)]
    prof["bind_cores"] = True     # see parallel_layers.cpu_affinity (measured there); --no-bind-cores to compare
    prof.update({k: v for k, v in overrides.items()
                 if v is not None and k in ("ms", "reps", "warmup", "png", "bind_cores")})
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo")
    rows: List[dict] = []
    for run_i, (model, pps) in enumerate(prof["runs"]):
        cfgd = MODELS[model]
        png_base = (os.path.join(harness.RESULTS_DIR, "pipeline_timeline.png")
                    if prof["png"] and run_i == 0 else None)
        for p in pps:
            if progress:
                progress(f"{model} p={p} m={','.join(map(str, prof['ms']))}")
            res = harness.run_ranks(_bench_rank, p, (cfgd, prof["ms"], prof["reps"], prof["warmup"], png_base),
                                    timeout_s=1800, retain_memory=True, bind_cores=prof["bind_cores"])[0]
            for m in prof["ms"]:
                rows += _rows(common, res[m], p, m, cfgd, model not in REPORTED_MODELS)
            if res[max(prof["ms"])].get("png"):
                _note(f"pipeline timeline: {res[max(prof['ms'])]['png']}")
    return rows


# The targets are set at p = 2 (one process per core of the 2-core machine they were written
# for); p = 4 runs 4 processes on those cores and is reported with the same rows, without pass/fail.
TARGET_PS = (2,)
# Models reported beside the one that carries the targets (see the module docstring), without pass/fail.
REPORTED_MODELS = ("small",)


def _judge(p: int, ok: bool, judged: bool = True) -> str:
    if not judged or (p not in TARGET_PS and (os.cpu_count() or 1) < p):
        return "reported"
    return "yes" if ok else "no"


def _breakdown_text(parts: List[dict]) -> str:
    """The parts of the bubble (``PipelineEngine.bubble_breakdown``) of the rep whose measured bubble is
    the median (medians of the parts would not add up to it)."""
    b = sorted(parts, key=lambda x: x["measured"])[(len(parts) - 1) // 2]
    return (f"(median rep {b['measured']:.3f} = schedule {b['ideal']:.3f} + imbalance/jitter "
            f"{b['imbalance_jitter']:+.3f} + engine {b['engine_overhead']:+.3f} + messages {b['messages']:+.3f})")


def _paired_text(ours: List[float], base: List[float]) -> str:
    """Torch's time over ours rep by rep (the two ran back to back in each rep, so drift of the machine
    between reps cancels): the median and the 20th-80th percentile range of those ratios."""
    ratios = harness.Stats.of([b / a for a, b in zip(ours, base)])
    return f"torch/ours paired per rep {ratios.median_ms:.3f} (p20-p80 {ratios.p20_ms:.3f}-{ratios.p80_ms:.3f})"


def _binding_text(cores: Optional[List[List[int]]]) -> str:
    """Which cores each rank ran on: bound (``parallel_layers.cpu_affinity``) or free."""
    if not cores or not all(cores):
        return "core binding unknown"
    if len({tuple(c) for c in cores}) == 1 and len(cores) > 1:
        return f"ranks not bound (each free on {len(cores[0])} cores)"
    return "ranks bound to cores " + "|".join(",".join(map(str, c)) for c in cores)


def _rows(common: dict, r: dict, p: int, m: int, cfgd: dict, judged: bool = True) -> List[dict]:
    """The CSV rows of one (p, m): step time of each schedule against torch, 1F1B's bubble against
    (p-1)/(m+p-1) with where it came from, interleaved's bubble against 1F1B's, activation memory
    1F1B / GPipe."""
    rows = []
    ideal = (p - 1) / (m + p - 1)
    sizes = _sizes(p, m, cfgd)
    bub = {s: statistics.median(r["bubbles"][f"ours_{s}"]) for s in SCHEDS}
    for sched in SCHEDS:
        ours, base = r["times"][f"ours_{sched}"], r["times"][f"torch_{sched}"]
        ok = statistics.median(ours) <= statistics.median(base)
        rows.append(harness.comparison_row(
            common, f"step_{sched}", ours, base, sizes=sizes, target="speedup>=1.0", met=_judge(p, ok, judged),
            baseline=f"torch.distributed.pipelining {sched}; our bubble {bub[sched]:.3f}; {_paired_text(ours, base)}"))
    for sched in EVAL_SCHEDS:     # evaluation has no target: reported beside the steps
        rows.append(harness.comparison_row(
            common, f"eval_{sched}", r["eval_times"][f"ours_{sched}"], r["eval_times"][f"torch_{sched}"],
            sizes=sizes, target="none (reported)", met="reported",
            baseline=f"torch.distributed.pipelining {sched} .eval() under no_grad, eval mode"))
    # compute per rank (median over reps): the ideal bubble assumes equal stages
    stage_ms = [statistics.median(b[k] for b in r["busy"]["ours_1f1b"]) for k in range(p)]
    imbalance = max(stage_ms) / min(stage_ms) - 1
    rel = abs(bub["1f1b"] - ideal) / ideal
    rows.append(dict(common, case="bubble_1f1b", sizes=sizes, target=f"within 15% of {ideal:.4f}",
                     met=_judge(p, rel <= 0.15, judged),
                     baseline=f"measured {bub['1f1b']:.4f} {_breakdown_text(r['parts']['ours_1f1b'])}; "
                              f"rel diff {rel:.3f}; compute per rank ms "
                              + "/".join(f"{x:.0f}" for x in stage_ms) + f" (imbalance {imbalance:.1%}); "
                              + _binding_text(r.get("cores"))))
    rows.append(dict(common, case="bubble_interleaved_vs_1f1b", sizes=sizes, target="below 1F1B",
                     met=_judge(p, bub["interleaved"] < bub["1f1b"], judged),
                     baseline=f"interleaved {bub['interleaved']:.4f} "
                              f"{_breakdown_text(r['parts']['ours_interleaved'])} vs 1f1b {bub['1f1b']:.4f}"))
    ratios = [mm["ours_1f1b"] / mm["ours_gpipe"] for mm in r["mem"]]
    rows.append(dict(common, case="act_memory_1f1b_over_gpipe", sizes=sizes,
                     target=f"<= p/m = {p / m:.3f}", met=_judge(p, max(ratios) <= p / m + 1e-9, judged),
                     baseline="per stage " + " ".join(f"{x:.3f}" for x in ratios),
                     mem_mb=max(mm["ours_1f1b"] for mm in r["mem"]) / 2**20))
    rows += _zero_bubble_rows(common, r, p, m, sizes, bub, judged)
    _note(f"pipeline {sizes}: bubble " + ", ".join(f"{s} {bub[s]:.1%}" for s in SCHEDS) +
          f" (1F1B ideal {ideal:.1%}); 1F1B {bub['1f1b']:.3f} {_breakdown_text(r['parts']['ours_1f1b'])}"
          f"; 1F1B compute per rank ms " + "/".join(f"{x:.0f}" for x in stage_ms) +
          "; act 1F1B/GPipe per stage " + " ".join(f"{x:.3f}" for x in ratios))
    return rows


# Issue 36's targets for the zero-bubble schedules, judged at this microbatch count (reported at the others)
ZB_TARGET_M = 8


def _zero_bubble_rows(common: dict, r: dict, p: int, m: int, sizes: str, bub: dict, judged: bool) -> List[dict]:
    """ZB-H1 against 1F1B (bubble <= 0.5x, step time <= 0.95x, peak activation memory <= 1.1x, paired rep
    by rep where it is a time) and ZBV's bubble below ZB-H1's, each with where the bubble came from; the
    step-time rows against torch's zero-bubble schedules are the ``step_zb-h1`` / ``step_zbv`` rows."""
    at_target = judged and m == ZB_TARGET_M
    rows = []
    zb, f1b = r["times"]["ours_zb-h1"], r["times"]["ours_1f1b"]
    step_ratio = statistics.median(zb) / statistics.median(f1b)
    paired = harness.Stats.of([a / b for a, b in zip(zb, f1b)])
    rows.append(dict(common, case="bubble_zb-h1_over_1f1b", sizes=sizes, target="<= 0.5",
                     met=_judge(p, bub["zb-h1"] <= 0.5 * bub["1f1b"], at_target),
                     baseline=f"zb-h1 {bub['zb-h1']:.4f} {_breakdown_text(r['parts']['ours_zb-h1'])} vs 1f1b "
                              f"{bub['1f1b']:.4f} {_breakdown_text(r['parts']['ours_1f1b'])}; ratio "
                              f"{bub['zb-h1'] / max(bub['1f1b'], 1e-12):.3f}; interleaved {bub['interleaved']:.4f}"))
    rows.append(dict(common, case="step_zb-h1_over_1f1b", sizes=sizes, target="<= 0.95",
                     met=_judge(p, step_ratio <= 0.95, at_target),
                     baseline=f"median {statistics.median(zb):.1f} / {statistics.median(f1b):.1f} ms = "
                              f"{step_ratio:.3f}; paired per rep {paired.median_ms:.3f} "
                              f"(p20-p80 {paired.p20_ms:.3f}-{paired.p80_ms:.3f}); "
                              f"interleaved {statistics.median(r['times']['ours_interleaved']):.1f} ms, zbv "
                              f"{statistics.median(r['times']['ours_zbv']):.1f} ms"))
    peak = {n: max(mm[f"alloc_{n}"] for mm in r["mem"]) for n in
            [f"{who}_{s}" for who in ("ours", "torch") for s in ALLOC_SCHEDS]}

    def per_rank(n):
        return " ".join(f"{mm[f'alloc_{n}'] / 2**20:.2f}" for mm in r["mem"])
    rows.append(dict(common, case="act_memory_zb-h1_over_1f1b", sizes=sizes, target="<= 1.1",
                     met=_judge(p, peak["ours_zb-h1"] <= 1.1 * peak["ours_1f1b"], at_target),
                     baseline=f"allocator peak above the step's start, max over ranks, MB: zb-h1 "
                              f"{peak['ours_zb-h1'] / 2**20:.2f} / 1f1b {peak['ours_1f1b'] / 2**20:.2f} = "
                              f"{peak['ours_zb-h1'] / peak['ours_1f1b']:.3f}; per rank zb-h1 {per_rank('ours_zb-h1')}, "
                              f"1f1b {per_rank('ours_1f1b')}, zbv {per_rank('ours_zbv')}; held between B and W "
                              "(kept gradients + saved tensors, most at once) zb-h1 "
                              + " ".join(f"{mm['held_ours_zb-h1'] / 2**20:.2f}" for mm in r["mem"])
                              + f"; torch's zb-h1 {per_rank('torch_zb-h1')} (its 1f1b {per_rank('torch_1f1b')}), "
                              f"zbv {per_rank('torch_zbv')}",
                     mem_mb=peak["ours_zb-h1"] / 2**20))
    rows.append(dict(common, case="bubble_zbv_vs_zb-h1", sizes=sizes, target="below ZB-H1",
                     met=_judge(p, bub["zbv"] < bub["zb-h1"], at_target),
                     baseline=f"zbv {bub['zbv']:.4f} {_breakdown_text(r['parts']['ours_zbv'])} vs zb-h1 "
                              f"{bub['zb-h1']:.4f}", mem_mb=peak["ours_zbv"] / 2**20))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny model, 1 rep, p = 2 only; never writes CSV",
                             quick_help=f"small profile (~{QUICK_BUDGET_S} s)")
    ap.add_argument("--pp", default=None, help="pipeline sizes, e.g. 2,4 (default: the mode's profile)")
    ap.add_argument("--microbatches", default=None, help="e.g. 4,8 (default: the mode's profile)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--model", choices=sorted(MODELS), default=None)
    ap.add_argument("--csv", default=None, help=f"CSV to append to (default {os.path.relpath(CSV_PATH)})")
    harness.add_csv_args(ap)
    ap.add_argument("--no-bind-cores", action="store_true",
                    help="leave the ranks free on every core (default: each bound to its own where cores suffice)")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    ints = lambda s: None if s is None else [int(x) for x in s.split(",")]  # noqa: E731
    t0 = time.time()
    rows = collect(mode, torch.device("cpu"), pps=ints(args.pp), ms=ints(args.microbatches), reps=args.reps,
                   warmup=args.warmup, model=args.model, bind_cores=False if args.no_bind_cores else None)
    print(f"({time.time() - t0:.1f} s)")
    harness.print_and_append(rows, harness.csv_target(args, args.csv or CSV_PATH))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
