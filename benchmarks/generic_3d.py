"""The generic 3D path against the GPT-specific one, on the reference GPT, same layout, same processes.

    python -m benchmarks.generic_3d            # full: demo-size GPT (L4 d64 s64), batch 16, dp2xpp2, dp2xtp2xpp2
    python -m benchmarks.generic_3d --quick    # the same sizes, fewer reps
    python -m benchmarks.generic_3d --smoke    # tiny GPT, seconds; never writes CSV

Both are ``Parallel3D``; what differs is how the stages come to be:

* GPT-specific (baseline): ``Parallel3D(config, mesh)``: every rank builds only its own ``GPTStage``s
  (``build_gpt_stages``);
* generic (ours): ``Parallel3D(GPT(config, tp_group=...), mesh, loss_fn=gpt.loss)``: the whole model as a
  user would hand it over, cut by its recipe (``pipeline.recipes.gpt_recipe``) into ``ModelStage``s.

Same seed, so the same weights; the first losses are printed side by side. Each step is timed on every
rank from a common barrier and the slowest rank counts (``harness.slowest_rank_ms``); the two runs are
interleaved step by step. Target: the generic path at most 3% slower (speedup >= 0.97). Rows go to
benchmarks/results/generic_3d.csv with tokens/s in ``baseline``.
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
    "full": dict(size=DEMO, batch=16, microbatches=4, reps=12, warmup=2, layouts=LAYOUTS),
    "quick": dict(size=DEMO, batch=16, microbatches=4, reps=5, warmup=1, layouts=LAYOUTS),
    "smoke": dict(size=dict(vocab_size=64, n_layer=2, d_model=16, n_head=2, max_seq_len=16), batch=8,
                  microbatches=2, reps=2, warmup=1, layouts=LAYOUTS[:1]),
}


def _bench_rank(rank, world, dims, size, batch, microbatches, reps, warmup, zero):
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPT, GPTConfig
    from parallel_layers.parallel3d import Parallel3D

    dp, tp, pp = dims
    mesh = ParallelMesh(dp=dp, tp=tp, pp=pp)
    cfg = GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=True)
    opts = dict(zero=zero, schedule="1f1b", num_microbatches=microbatches, lr=1e-3, seed=0)
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


def _run(mode: str, progress: Optional[Callable[[str], None]] = None):
    prof = PROFILES[mode]
    size = prof["size"]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo",
                  sizes=f"GPT L{size['n_layer']} d{size['d_model']} V{size['vocab_size']} s{size['max_seq_len']} "
                        f"b{prof['batch']} m{prof['microbatches']}")
    rows, firsts = [], []
    for name, dp, tp, pp in prof["layouts"]:
        for zero in (0, 1):
            if progress:
                progress(f"{name} zero{zero}")
            res = harness.run_ranks(_bench_rank, dp * tp * pp, ((dp, tp, pp), size, prof["batch"],
                                    prof["microbatches"], prof["reps"], prof["warmup"], zero),
                                    timeout_s=1800, retain_memory=True)[0]
            ours, base = harness.Stats.of(res["times"]["generic"]), harness.Stats.of(res["times"]["specific"])
            tokens = prof["batch"] * size["max_seq_len"]
            rows.append(harness.comparison_row(
                common, f"generic_3d_{name.replace(' ', '')}_zero{zero}", ours, base, target="speedup>=0.97",
                met="yes" if base.median_ms / ours.median_ms >= 0.97 else "no",
                baseline=f"tokens/s generic {tokens / ours.median_ms * 1e3:.0f} vs GPT-specific "
                         f"{tokens / base.median_ms * 1e3:.0f}; first loss {res['first'][0]:.6f} vs "
                         f"{res['first'][1]:.6f}"))
            firsts.append(res["first"])
    return rows, firsts


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: the CSV rows of ``mode`` (``device`` only names the run: the ranks are gloo on CPU)."""
    return _run(mode, progress)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--smoke", action="store_true", help="tiny GPT (seconds); never writes CSV")
    size.add_argument("--quick", action="store_true", help="fewer reps (see PROFILES)")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows, _ = _run(mode, lambda text: print(f"  {text} ...", flush=True))
    print(f"{'case':<34} {'generic ms':>11} {'specific ms':>12} {'generic/specific':>17}")
    for r in rows:
        print(f"{r['case']:<34} {r['ours_median_ms']:>11.1f} {r['base_median_ms']:>12.1f} "
              f"{1 / r['speedup']:>16.3f}x   {r['baseline']}")
    if not (args.no_csv or mode == "smoke"):
        harness.append_csv(CSV_PATH, rows)
        print(f"appended {len(rows)} rows to {os.path.relpath(CSV_PATH)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
