"""The layout planner's predictions against measurements, on this machine (issue 33's proof).

    python -m benchmarks.planner [--quick|--smoke] [--measured]  # full: 26 layouts; quick: no published search

Every case is a layout of 2-8 gloo ranks over the reference GPT or a Hugging Face Llama (tiny: 4 blocks,
d 64), covering dp / tp / pp / cp, ZeRO 0-3, every schedule (gpipe, 1f1b, interleaved) and activation
checkpointing on and off. For each:

* predicted: ``parallel_layers.planner.predict`` (the package's own code run on the meta device under a
  fake process group; fragmentation margin 0, since the measurement counts requested bytes) per
  pipeline rank, and the step time with a profile calibrated in this run (``--calibrate``'s figures:
  one-thread matmul, copy bandwidth, collectives over 2 gloo ranks, 2 cores shared by the ranks);
* measured on every rank (``parallel_layers.planner.measure``): the bytes of every live tensor at a
  step's start plus the allocator's growth during the step (torch's profiler, ``profile_memory``), and
  the slowest rank's step time (median of the timed steps).

Every rank is compared with the prediction for its pipeline stage. Rows go to
benchmarks/results/planner.csv (``case`` planner_memory: ``mem_mb`` measured peak of the worst rank,
``x`` the predicted; planner_time: ``ours_median_ms`` measured, ``base_median_ms`` predicted), then
one summary row each: median and worst absolute memory error (targets 5% / 15%), Spearman rank
correlation of step times (target 0.8), median time error (20%), and whether the layout ranked first
is within 10% of the fastest measured. Time figures on a loaded machine are noise: say so.

At scale, on paper (``case`` planner_published; ``--published`` runs only these, no measurement): every
row of Narayanan et al. 2021's Table 1 (:mod:`parallel_layers.planner.published`: GPT 1.7B-1T on 32-3072
A100s), the planner's per-GPU throughput for their layout (the paper's FLOPs over the predicted step,
``x``) beside the published one, the error, and (full mode) the layout the planner's search picks with its
predicted throughput (``speedup``: the pick's over theirs) and why; then the H100 tables of
:mod:`parallel_layers.planner.published_h100` (torchtitan's Llama 3.1 runs, NeMo 24.07's FP8 Llama runs: ``case``
planner_published_h100, tokens/s per GPU, and one planner_published_h100_error row a table with its median
|error|). Nothing is timed here.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "planner.csv"
GLOBAL_BATCH, SEQ = 8, 64


def _gpt():
    from parallel_layers.models.gpt import GPTConfig
    return GPTConfig(vocab_size=256, n_layer=4, n_head=4, d_model=64, max_seq_len=SEQ)


def _llama():
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256, max_position_embeddings=SEQ)


def _L(**kw):
    from parallel_layers.composition.layout import Layout
    return Layout(**kw)


def cases():
    """(model name, layout) for every case: 2, 4 and 8 ranks."""
    g, ll = "gpt", "llama"
    return [
        (g, _L(dp=2, zero=0, num_microbatches=1)), (g, _L(dp=2, zero=1, num_microbatches=2)),
        (g, _L(dp=2, zero=2, num_microbatches=1)), (g, _L(dp=2, zero=3, num_microbatches=1)),
        (g, _L(tp=2, num_microbatches=1)), (g, _L(pp=2, schedule="gpipe", num_microbatches=4)),
        (g, _L(pp=2, schedule="1f1b", num_microbatches=4, checkpoint=True)), (g, _L(cp=2, num_microbatches=1)),
        (ll, _L(dp=2, zero=1, num_microbatches=2)), (ll, _L(pp=2, schedule="1f1b", num_microbatches=2)),
        (ll, _L(tp=2, num_microbatches=1, checkpoint=True)), (ll, _L(cp=2, zero=2, num_microbatches=1)),
        (g, _L(dp=2, tp=2, zero=1, num_microbatches=1)), (g, _L(dp=2, pp=2, schedule="1f1b", num_microbatches=4)),
        (g, _L(pp=4, schedule="1f1b", num_microbatches=4)),
        (g, _L(dp=2, pp=2, schedule="interleaved", num_chunks=2, num_microbatches=4)),
        (g, _L(tp=2, pp=2, schedule="gpipe", num_microbatches=2, checkpoint=True)),
        (g, _L(dp=2, cp=2, zero=3, num_microbatches=1)), (ll, _L(dp=2, tp=2, zero=2, num_microbatches=1)),
        (ll, _L(tp=2, pp=2, schedule="1f1b", num_microbatches=4)),
        (ll, _L(dp=2, pp=2, zero=1, schedule="interleaved", num_chunks=2, num_microbatches=4)),
        (ll, _L(cp=2, tp=2, num_microbatches=1, checkpoint=True)),
        (g, _L(dp=2, tp=2, pp=2, zero=1, schedule="1f1b", num_microbatches=2)),
        (g, _L(dp=2, cp=2, pp=2, schedule="gpipe", num_microbatches=2, checkpoint=True)),
        (ll, _L(dp=2, tp=2, pp=2, zero=2, schedule="1f1b", num_microbatches=2)),
        (ll, _L(dp=2, cp=2, tp=2, zero=3, num_microbatches=1)),
    ]


PROFILES = {"full": dict(steps=5, smoke=False), "quick": dict(steps=5, smoke=False), "smoke": dict(steps=1, smoke=True)}


def _model(name):
    return _gpt() if name == "gpt" else _llama()


def _ranks(rank: int, world: int, todo: list, steps: int):
    """On every rank: each layout of ``todo`` built, measured, dropped (so the next starts clean)."""
    import gc

    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.planner.measure import measure_layout
    out = []
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=gen)
    y = torch.randint(0, 256, (GLOBAL_BATCH, SEQ), generator=gen)
    from parallel_layers.planner.measure import live_tensor_bytes
    for name, layout in todo:
        before = live_tensor_bytes()       # what earlier layouts left in this process is not this one's
        mesh = ParallelMesh(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp)
        torch.manual_seed(0)
        # no replica check: it runs at the first steps (the measured one among them) and the planner does not
        # count its checksums
        kw = dict(layout.parallel3d_kwargs(), replica_check=None)
        if name == "gpt":
            p3d = Parallel3D(_gpt(), mesh, **kw)
        else:
            from transformers import LlamaForCausalLM
            p3d = Parallel3D(LlamaForCausalLM(_llama()), mesh, **kw)
        out.append(measure_layout(p3d, (x, y), steps, baseline=before))
        del p3d
        gc.collect()
    return out


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            published_only: bool = False, measured_only: bool = False) -> List[dict]:
    """Predict and measure every case of ``mode``; one CSV row per case and measure, then the summaries,
    then (not in smoke mode) the published runs on paper (full mode: with the planner's search).
    ``device`` only names the run: the ranks are gloo processes on CPU."""
    from parallel_layers.planner import Request, calibrate, predict
    prof_cfg = PROFILES[mode]
    pub_common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="fp16", backend="model")
    if published_only:
        return published_rows(pub_common, search=mode == "full", progress=progress)
    todo = cases()[:2] if prof_cfg["smoke"] else cases()
    if progress:
        progress("calibrating (2 gloo ranks)")
    profile = calibrate(world=2, reps=3)
    profile.fragmentation = 0.0
    if progress:
        progress(profile.notes)
    measured = {}
    for world in sorted({lay.world for _, lay in todo}):
        group = [(n, lay) for n, lay in todo if lay.world == world]
        if progress:
            progress(f"{len(group)} layouts on {world} ranks")
        per_rank = harness.run_ranks(_ranks, world, (group, prof_cfg["steps"]), timeout_s=1800)
        for i, case in enumerate(group):
            measured[id(case[1])] = [r[i] for r in per_rank]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="fp32", backend="gloo")
    rows, mem_err, pred_t, meas_t, names = [], [], [], [], []
    for name, layout in todo:
        req = Request(_model(name), world=layout.world, global_batch=GLOBAL_BATCH, seq_len=SEQ, memory_bytes=1e12)
        label = f"{name} {layout.name()}"
        try:
            pred = predict(req, layout, profile)
        except Exception as exc:  # noqa: BLE001 - a case the planner cannot probe is reported, not fatal
            print(f"planner {label}: prediction failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            rows.append(dict(common, case="planner_memory", sizes=label, baseline=f"prediction failed: "
                             f"{type(exc).__name__}", met=False))
            mem_err.append(1.0)
            continue
        ranks = measured[id(layout)]
        errs = []
        for r in ranks:
            want = sum(pred.memory[r["pp_rank"]].values())
            errs.append((r["peak_bytes"] - want) / r["peak_bytes"])
        worst = max(errs, key=abs)
        mem_err.extend(abs(e) for e in errs)
        meas_peak = max(r["peak_bytes"] for r in ranks) / 2**20
        pred_peak = max(sum(t.values()) for t in pred.memory) / 2**20
        step = ranks[0]["step_s"]
        pred_t.append(pred.step_s)
        meas_t.append(step)
        names.append(label)
        print(f"planner {label:42s} memory measured {meas_peak:6.2f} MB predicted {pred_peak:6.2f} MB "
              f"worst rank error {worst:+.1%}  step measured {step * 1e3:7.1f} ms "
              f"predicted {pred.step_s * 1e3:7.1f} ms",
              file=sys.stderr, flush=True)
        rows.append(dict(common, case="planner_memory", sizes=label, mem_mb=meas_peak, x=pred_peak,
                         baseline=f"predicted {pred_peak:.2f} MB; worst rank error {worst:+.1%} "
                                  f"over {len(ranks)} ranks"))
        rows.append(dict(common, case="planner_time", sizes=label, ours_median_ms=step * 1e3,
                         base_median_ms=pred.step_s * 1e3,
                         baseline=f"predicted {pred.step_s * 1e3:.1f} ms ({(pred.step_s - step) / step:+.0%})"))
    med, worst = statistics.median(mem_err), max(mem_err)
    rho = spearman(pred_t, meas_t)
    t_err = statistics.median(abs(p - m) / m for p, m in zip(pred_t, meas_t))
    first = min(range(len(pred_t)), key=lambda i: pred_t[i])
    fastest = min(meas_t)
    same_world = True
    rows.append(dict(common, case="planner_memory_error", sizes=f"{len(todo)} layouts, every rank",
                     x=med, target="median <= 5%, worst <= 15%", met=bool(med <= 0.05 and worst <= 0.15),
                     baseline=f"median |error| {med:.1%}, worst {worst:.1%}"))
    rows.append(dict(common, case="planner_time_rank", sizes=f"{len(todo)} layouts", x=rho,
                     target="Spearman >= 0.8, median error <= 20%, first within 10% of fastest",
                     met=bool(rho >= 0.8 and t_err <= 0.2 and meas_t[first] <= 1.1 * fastest and same_world),
                     baseline=f"Spearman {rho:.2f}; median |error| {t_err:.0%}; ranked first {names[first]} measured "
                              f"{meas_t[first] * 1e3:.1f} ms vs fastest {fastest * 1e3:.1f} ms"))
    print(f"planner memory: median |error| {med:.1%}, worst {worst:.1%}; time: Spearman {rho:.2f}, median |error| "
          f"{t_err:.0%}, first {names[first]} {meas_t[first] * 1e3:.1f} ms vs fastest {fastest * 1e3:.1f} ms",
          file=sys.stderr, flush=True)
    if not prof_cfg["smoke"] and not measured_only:
        rows += published_rows(pub_common, search=mode == "full", progress=progress)
    return rows


def published_rows(common: dict, search: bool, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """One row per published run (predicted against published TFLOP/s per GPU; with ``search`` the
    planner's pick), then the summary: median and worst |error| and how many picks differ from theirs."""
    from parallel_layers.planner.published import MEGATRON_2021, compare
    rows, errors, differ, top3, space3 = [], [], 0, 0, 0
    for run in MEGATRON_2021:
        if progress:
            progress(f"published {run.name} on {run.gpus} GPUs")
        c = compare(run, search=search)
        errors.append(abs(c.error))
        pick = c.pick.layout.name() if c.pick else "-"
        differ += bool(c.pick and c.pick.layout != c.theirs.layout)
        label = (f"{run.name} GPT on {run.gpus} A100: tp{run.tp} x pp{run.pp} x dp{run.dp}, batch {run.batch}, "
                 f"micro-batch {run.micro_batch}")
        text = (f"published {run.tflops_per_gpu:g} TFLOP/s/GPU; predicted {c.predicted_tflops:.1f} ({c.error:+.1%}) "
                f"for {c.theirs.layout.name()}, peak {c.theirs.peak_bytes / 2**30:.0f} GiB"
                + ("" if c.theirs.feasible else f" (does not fit: {c.theirs.reason})"))
        if search:
            top3 += c.their_rank is not None and c.their_rank <= 3
            space3 += c.their_space_rank is not None and c.their_space_rank <= 3
            text += (f" | pick {pick}: {c.pick_tflops:.1f} TFLOP/s/GPU of {c.searched} layouts, theirs ranked "
                     f"{c.their_rank or '-'}; {c.their_space_rank or '-'} of the {c.their_space_size} that fit "
                     f"with their unsharded optimizer | {c.why}")
        print(f"planner published {run.name:>7s}: {text}", file=sys.stderr, flush=True)
        rows.append(dict(common, case="planner_published", sizes=label, x=c.predicted_tflops,
                         speedup=(c.pick_tflops / c.predicted_tflops) if search and c.pick else "",
                         mem_mb=c.theirs.peak_bytes / 2**20, baseline=text))
    med, worst = statistics.median(errors), max(errors)
    rows.append(dict(common, case="planner_published_error", sizes=f"{len(errors)} published runs",
                     x=med, baseline=f"median |error| {med:.1%}, worst {worst:.1%}"
                     + (f"; the planner picks another layout for {differ} of {len(errors)}, ranks theirs in its "
                        f"top three for {top3}, in its top three of the layouts that fit their optimizer (the space "
                        f"they searched) for {space3}" if search else "")))
    print(f"planner published Narayanan et al. 2021 Table 1 (A100): median |error| {med:.1%}, worst {worst:.1%}",
          file=sys.stderr, flush=True)
    return rows + published_h100_rows(common, progress)


def published_h100_rows(common: dict, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The H100 tables of :mod:`parallel_layers.planner.published_h100` (torchtitan, NeMo): one row per run
    (predicted against published tokens/s per GPU, the planner's best of the settings the source leaves
    open), then each table's median and worst |error|."""
    from parallel_layers.planner.published_h100 import RUNS, TABLES, compare
    rows = []
    for table, (source, url) in TABLES.items():
        errors = []
        for run in [r for r in RUNS if r.table == table]:
            if progress:
                progress(f"published {table} {run.label} on {run.gpus} GPUs")
            c = compare(run)
            errors.append(abs(c.error))
            label = (f"{table}: {run.label}, {run.model} on {run.gpus} H100: dp{run.dp} x tp{run.tp} x pp{run.pp}"
                     f" x cp{run.cp}{f' vp{run.vp}' if run.vp > 1 else ''}, batch {run.global_batch} x {run.seq}, "
                     f"{'fp8' if run.fp8 else 'bf16'}")
            text = (f"published {run.tokens_per_gpu_s:g} tokens/s/GPU ({run.notes}); predicted {c.predicted:.0f} "
                    f"({c.error:+.1%}) for {c.best.layout.name()}, peak {c.best.peak_bytes / 2**30:.0f} GiB"
                    + ("" if c.fits else " (no variant fits the memory model)"))
            print(f"planner published {label}: {text}", file=sys.stderr, flush=True)
            rows.append(dict(common, case="planner_published_h100", sizes=label, x=c.predicted,
                             mem_mb=c.best.peak_bytes / 2**20, baseline=text))
        med, worst = statistics.median(errors), max(errors)
        print(f"planner published {table} ({source}): median |error| {med:.1%}, worst {worst:.1%} over "
              f"{len(errors)} runs", file=sys.stderr, flush=True)
        rows.append(dict(common, case="planner_published_h100_error", sizes=f"{table}: {len(errors)} published runs",
                         x=med, target="median |error| <= 15%", met=bool(med <= 0.15),
                         baseline=f"{source} ({url}): median |error| {med:.1%}, worst {worst:.1%}"))
    return rows


def render_published(rows: List[Dict[str, str]]) -> List[str]:
    """The README table of the newest ``planner_published`` rows (for benchmarks/readme.py's section)."""
    from parallel_layers.planner.published import MEGATRON_2021, MICRO_BATCH_SOURCE, PAPER, PAPER_URL
    runs = [r for r in rows if r.get("case") == "planner_published"]
    if not runs:
        return []
    newest = max(r["run_id"] for r in runs)
    runs = [r for r in runs if r["run_id"] == newest]
    published = {run.name: run for run in MEGATRON_2021}
    out = [f"Published: {PAPER} ({PAPER_URL}); micro-batch sizes from {MICRO_BATCH_SOURCE}. Predicted: "
           f"the planner's time model on the A100 SXM 80GB data-sheet profile (50% matmul efficiency assumed), "
           f"the paper's fused kernels priced as a compiled step (``Request.compiled``), as the paper's eq. 3 "
           f"FLOPs per GPU-second. Computed {newest[:16].replace('T', ' ')} UTC.", "",
           "| model | GPUs | their tp x pp (dp) | published TFLOP/s/GPU | predicted | error | planner's pick | "
           "pick TFLOP/s/GPU | why |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        name = r["sizes"].split(" ")[0]
        run = published[name]
        parts = r["baseline"].split(" | ")
        err = parts[0].split("(")[1].split(")")[0]
        pick = parts[1].split(":")[0].replace("pick ", "") if len(parts) > 1 else "-"
        pick_tf = f"{float(r['x']) * float(r['speedup']):.1f}" if r.get("speedup") else "-"
        out.append(f"| {name} | {run.gpus} | {run.tp} x {run.pp} ({run.dp}) | {run.tflops_per_gpu:g} | "
                   f"{float(r['x']):.1f} | {err} | {pick} | {pick_tf} | {parts[2] if len(parts) > 2 else '-'} |")
    return out + [""]


def spearman(a: List[float], b: List[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(v):
            j = i
            while j + 1 < len(v) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_profile_args(ap, smoke_help="two layouts, one step; never writes CSV",
                             quick_help="every layout, 5 timed steps, the published runs without the search")
    ap.add_argument("--published", action="store_true",
                    help="only the published runs on paper (no measurement; full mode: with the planner's search)")
    ap.add_argument("--measured", action="store_true",
                    help="only the layouts measured here (not the published runs on paper, which take minutes)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows = collect(mode, torch.device("cpu"), progress=lambda s: print(s, file=sys.stderr, flush=True),
                   published_only=args.published, measured_only=args.measured)
    print(f"({time.time() - t0:.1f} s)")
    harness.print_and_append(rows, harness.csv_target(args, f"{harness.RESULTS_DIR}/{CSV_NAME}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
