"""The generic 3D path against the GPT-specific one, on the reference GPT, same layout, same processes.

    python -m benchmarks.generic_3d            # full: demo-size GPT (L4 d64 s64), batch 16, dp2xpp2, dp2xtp2xpp2
    python -m benchmarks.generic_3d --quick    # the same sizes, fewer reps
    python -m benchmarks.generic_3d --smoke    # tiny GPT, seconds; never writes CSV

Both are ``Parallel3D``; what differs is how the stages come to be:

* config (baseline): ``Parallel3D(config, mesh)``: until issue 47 every rank built only its own ``GPTStage``s
  (``build_gpt_stages``); now ``config.build`` builds the GPT holding only this rank's modules and it is cut by
  the same recipe, so the two layouts' ratio measures building inside ``Parallel3D`` against handing it a
  module (expected 1.0);
* generic (ours): ``Parallel3D(GPT(config, tp_group=...), mesh, loss_fn=gpt.loss)``: the whole model as a
  user would hand it over, cut by its recipe (``families.gpt_recipe``) into ``ModelStage``s.

Same seed, so the same weights; the first losses are printed side by side. Each step is timed on every
rank from a common barrier and the slowest rank counts (``harness.slowest_rank_ms``); the two runs are
interleaved step by step, and each pair of steps gives one ratio generic / GPT-specific. On a shared
2-core machine with 4-8 ranks a single step's time swings by 5-10%, so the figure judged is the median
of those paired ratios with its 95% bootstrap interval (``harness.PairedRatio``), over many pairs.
Target: the generic path at most 3% slower (median paired ratio <= 1.03). Rows go to
benchmarks/results/generic_3d.csv with tokens/s and the interval in ``baseline``; their ``speedup`` is
1 / the median paired ratio.

The ``stage`` rows isolate the stages themselves: one process, one thread, a pipeline stage's forward and
backward (``ModelStage`` cut by the recipe against ``GPTStage``), first and last stage of pp2, nothing
else running in between; any difference there is the generic path's own per-call cost.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "generic_3d.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
LAYOUTS = [("dp2 x pp2", 2, 1, 2), ("dp2 x tp2 x pp2", 2, 2, 2)]   # (name, dp, tp, pp)
DEMO = dict(vocab_size=256, n_layer=4, d_model=64, n_head=4, max_seq_len=64)
PROFILES = {
    "full": dict(size=DEMO, batch=16, microbatches=4, reps=100, warmup=3, layouts=LAYOUTS, stage_reps=400),
    "quick": dict(size=DEMO, batch=16, microbatches=4, reps=12, warmup=1, layouts=LAYOUTS, stage_reps=100),
    "smoke": dict(size=dict(vocab_size=64, n_layer=2, d_model=16, n_head=2, max_seq_len=16), batch=8,
                  microbatches=2, reps=2, warmup=1, layouts=LAYOUTS[:1], stage_reps=4),
}


def _bench_rank(rank, world, dims, size, batch, microbatches, reps, warmup, zero):
    from parallel_layers.composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPT, GPTConfig

    dp, tp, pp = dims
    mesh = ParallelMesh(dp=dp, tp=tp, pp=pp)
    cfg = GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=True)
    opts = dict(optimizer=OptimizerConfig(lr=1e-3),
                pipeline=PipelineConfig(schedule="1f1b", num_microbatches=microbatches),
                data_parallel=DataParallelConfig(zero=zero), seed=0)
    specific = Parallel3D(cfg, mesh, **opts)
    torch.manual_seed(0)
    gpt = GPT(cfg, tp_group=mesh.tp_group if tp > 1 else None)
    generic = Parallel3D(gpt, mesh, loss_fn=gpt.loss, **opts)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    first = (generic.train_step(x, y)["loss"], specific.train_step(x, y)["loss"])
    for _ in range(warmup - 1):
        generic.train_step(x, y)
        specific.train_step(x, y)
    times = {"generic": [], "specific": []}
    for i in range(reps):
        order = ("generic", "specific") if i % 2 == 0 else ("specific", "generic")
        for name in order:
            run = generic if name == "generic" else specific
            times[name].append(harness.slowest_rank_ms(lambda run=run: run.train_step(x, y)))
    return dict(times=times, first=first)


def _stage_times(size, batch, reps):
    """Per pp2 stage: ``(generic ms, GPT-specific ms)`` samples of one stage's forward + backward, paired.
    Untied embeddings: the tied weight's gradient sum runs after backward, outside what is timed here."""
    import time

    from parallel_layers.families import gpt_recipe
    from parallel_layers.models.gpt import GPT, GPTConfig
    from parallel_layers.models.gpt_stages import build_gpt_stages
    from parallel_layers.pipeline.any_model import split_model

    cfg = GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = []
    try:
        for rank in (0, 1):
            torch.manual_seed(0)
            specific = build_gpt_stages(cfg, rank, 2)[0]
            torch.manual_seed(0)
            gpt = GPT(cfg)
            generic = split_model(gpt, gpt_recipe(gpt), rank, 2, loss_fn=gpt.loss)[0]
            gen = torch.Generator().manual_seed(1)
            t = cfg.max_seq_len
            x = (torch.randint(0, cfg.vocab_size, (batch, t), generator=gen) if rank == 0
                 else torch.randn(batch, t, cfg.d_model, generator=gen, requires_grad=True))
            y = torch.randint(0, cfg.vocab_size, (batch, t), generator=gen)

            def step(stage):
                o = stage(x, y) if rank == 1 else stage(x)
                if isinstance(o, tuple):                       # GPTStage's loss: (sum, count)
                    o = o[0] / o[1]
                (o if o.dim() == 0 else o.square().mean()).backward()
            times = {"generic": [], "specific": []}
            for i in range(reps + max(4, reps // 10)):         # the first tenth warms up
                for name in (("generic", "specific") if i % 2 == 0 else ("specific", "generic")):
                    stage = generic if name == "generic" else specific
                    t0 = time.perf_counter()
                    step(stage)
                    times[name].append((time.perf_counter() - t0) * 1e3)
            out.append((times["generic"][-reps:], times["specific"][-reps:]))
    finally:
        torch.set_num_threads(threads)
    return out


def _row(common, case, ours, base, tokens):
    ratio = harness.PairedRatio.of(ours, base)
    so, sb = harness.Stats.of(ours), harness.Stats.of(base)
    row = harness.comparison_row(
        common, case, so, sb, target="generic/specific<=1.03", met="yes" if ratio.median <= 1.03 else "no",
        baseline=f"generic/specific {ratio.median:.3f} (95% CI {ratio.low:.3f}-{ratio.high:.3f}, {len(ours)} "
                 f"pairs); tokens/s generic {tokens / so.median_ms * 1e3:.0f} vs GPT-specific "
                 f"{tokens / sb.median_ms * 1e3:.0f}")
    # the paired estimate, not the ratio of the two medians: a burst of load that lands on a run of steps
    # moves both medians apart without being either path's cost
    row["speedup"] = 1.0 / ratio.median
    return row


def _run(mode: str, progress: Optional[Callable[[str], None]] = None):
    prof = PROFILES[mode]
    size = prof["size"]
    sizes = (f"GPT L{size['n_layer']} d{size['d_model']} V{size['vocab_size']} s{size['max_seq_len']} "
             f"b{prof['batch']} m{prof['microbatches']}")
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo", sizes=sizes)
    rows, firsts = [], []
    for name, dp, tp, pp in prof["layouts"]:
        for zero in (0, 1):
            if progress:
                progress(f"{name} zero{zero}")
            res = harness.run_ranks(_bench_rank, dp * tp * pp, ((dp, tp, pp), size, prof["batch"],
                                    prof["microbatches"], prof["reps"], prof["warmup"], zero),
                                    timeout_s=1800, retain_memory=True)[0]
            row = _row(common, f"generic_3d_{name.replace(' ', '')}_zero{zero}", res["times"]["generic"],
                       res["times"]["specific"], prof["batch"] * size["max_seq_len"])
            row["baseline"] += f"; first loss {res['first'][0]:.6f} vs {res['first'][1]:.6f}"
            rows.append(row)
            firsts.append(res["first"])
    if progress:
        progress("stages alone (one process, one thread)")
    micro = prof["batch"] // (2 * prof["microbatches"])       # one microbatch of one dp2 replica
    stage_common = dict(common, backend="none", sizes=sizes.rsplit(" b", 1)[0] + f" microbatch {micro}")
    for rank, (ours, base) in enumerate(_stage_times(size, micro, prof["stage_reps"])):
        rows.append(_row(stage_common, f"generic_3d_stage{rank}_of_pp2_fwd_bwd", ours, base,
                         micro * size["max_seq_len"]))
    return rows, firsts


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: the CSV rows of ``mode`` (``device`` only names the run: the ranks are gloo on CPU)."""
    return _run(mode, progress)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny GPT (seconds); never writes CSV",
                             quick_help="fewer reps (see PROFILES)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    rows, _ = _run(mode, lambda text: print(f"  {text} ...", flush=True))
    print(f"{'case':<34} {'generic ms':>11} {'specific ms':>12}   paired ratio, tokens/s")
    for r in rows:
        print(f"{r['case']:<34} {r['ours_median_ms']:>11.2f} {r['base_median_ms']:>12.2f}   {r['baseline']}")
    harness.append_and_report(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
