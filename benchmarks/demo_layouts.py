"""Demo throughput for 1D, 2D and 3D layouts on the same 8 processes.

    python -m benchmarks.demo_layouts [--steps 12]    # full: every layout, demo-size GPT, 12 steps
    python -m benchmarks.demo_layouts --quick         # every layout, demo-size GPT, 4 steps (~30 s)
    python -m benchmarks.demo_layouts --smoke         # tiny GPT, 3 steps, 1D and 3D; never writes CSV

Every layout trains the demo's GPT (``python -m parallel_layers demo``: byte-level text of the Python
standard library, 8 gloo ranks, one thread each, same model, data and global batch of 32 sequences; no
single-process reference run) and its own figures are kept: tokens/s (mean over the steps after the
first), the largest per-rank RSS at the end, and the measured pipeline bubble.

* full: each layout is a fresh ``python -m parallel_layers demo`` subprocess, whose summary.json is read
  back (8 new processes per layout: the RSS is that layout's alone).
* quick and smoke: one set of 8 ranks (``harness.run_ranks``) trains the layouts one after the other
  with the demo's own ``train_parallel`` (same step timing), which saves starting 8 processes per
  layout. The RSS then includes what earlier layouts left in the process (the rows say so).

Rows go to benchmarks/results/demo.csv: ``ours_median_ms`` is the mean step time, ``mem_mb`` the largest
RSS per rank, ``baseline`` starts with ``tokens/s N``. This is a program that prints figures, not a test:
on a 2-core machine 8 processes share 2 cores, so the table says how the layouts compare here, not
what they do on 8 real devices.
Ranks keep freed memory for reuse (``harness.run_ranks(retain_memory=True)``, see
``parallel_layers.cpu_allocator``), as a CPU training job should run; the torch baselines share the
processes, so they get it too.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "demo.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 30
WORLD = 8
BATCH = 32
LAYOUTS = [  # (name, dp, tp, pp, zero)
    ("1D dp=8", 8, 1, 1, 0),
    ("1D dp=8 ZeRO-2", 8, 1, 1, 2),
    ("2D dp=4 x tp=2", 4, 2, 1, 0),
    ("2D dp=4 x pp=2", 4, 1, 2, 0),
    ("3D dp=2 x tp=2 x pp=2", 2, 2, 2, 0),
    ("3D dp=2 x tp=2 x pp=2 ZeRO-1", 2, 2, 2, 1),
]
TINY = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16", "--corpus-bytes", "20000"]
# mode -> layouts (indices into LAYOUTS), steps, extra demo flags, launcher ("subprocess" per layout or
# one set of "ranks" for all). Quick keeps full's model (the demo's: 4 layers, d 64, seq 64) and data; it
# runs fewer steps, all in one set of ranks.
PROFILES = {
    "full": dict(layouts=list(range(len(LAYOUTS))), steps=12, extra=[], launcher="subprocess"),
    "quick": dict(layouts=list(range(len(LAYOUTS))), steps=4, extra=[], launcher="ranks"),
    "smoke": dict(layouts=[0, 4], steps=3, extra=TINY, launcher="ranks"),
}


def demo_argv(dp: int, tp: int, pp: int, zero: int, steps: int, extra: List[str], out_dir: str) -> List[str]:
    return ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--zero", str(zero), "--steps", str(steps),
            "--batch-size", str(BATCH), "--no-reference", "--no-progress", "--eval-iters", "0",
            "--out", out_dir] + list(extra)      # training throughput: no validation passes in between


def run_layout(dp, tp, pp, zero, steps, extra, out_dir) -> dict:
    """One layout as a user runs it: ``python -m parallel_layers demo`` in a subprocess; its summary.json."""
    cmd = [sys.executable, "-m", "parallel_layers", "demo"] + demo_argv(dp, tp, pp, zero, steps, extra, out_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(out_dir, "summary.json")) as fh:
        return json.load(fh)


def _layouts_rank(rank: int, world: int, layouts: list, steps: int, extra: List[str], out_dir: str,
                  corpus: torch.Tensor):
    """One of the 8 ranks: every layout in turn through the demo's ``train_parallel`` (its step lines
    silenced) on ``corpus`` (the demo's, loaded once by the caller). Rank 0 returns one summary-like
    dict per layout, the others None."""
    import torch.distributed as dist

    from parallel_layers.cli import demo

    summaries = []
    for _name, dp, tp, pp, zero in layouts:
        args = demo.build_parser().parse_args(demo_argv(dp, tp, pp, zero, steps, extra, out_dir))
        demo.check_args(args)
        with contextlib.redirect_stdout(io.StringIO()):
            res = demo.train_parallel(args, corpus, None)
        dist.barrier()
        summaries.append(res)
    return summaries if rank == 0 else None


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            steps: Optional[int] = None) -> List[dict]:
    """Run the layouts of ``mode``'s profile (smoke | quick | full, see ``PROFILES``; ``steps`` overrides
    the step count) and return one CSV row per layout. Writes no CSV; one line per layout to stderr.
    ``device`` only names the run: the ranks are gloo processes on CPU."""
    prof = PROFILES[mode]
    steps = steps or prof["steps"]
    layouts = [LAYOUTS[i] for i in prof["layouts"]]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="fp32", backend=f"gloo x{WORLD}")
    with tempfile.TemporaryDirectory() as out_dir:
        if prof["launcher"] == "subprocess":
            summaries = []
            for name, dp, tp, pp, zero in layouts:
                if progress:
                    progress(name)
                summaries.append(run_layout(dp, tp, pp, zero, steps, prof["extra"], out_dir))
            note = ""
        else:
            from parallel_layers.cli import demo

            if progress:
                progress(f"{len(layouts)} layouts in one set of {WORLD} ranks")
            corpus = demo.load_corpus(demo.build_parser().parse_args(prof["extra"]).corpus_bytes)
            summaries = harness.run_ranks(_layouts_rank, WORLD, (layouts, steps, prof["extra"], out_dir, corpus),
                                          timeout_s=1800, retain_memory=True)[0]
            note = "; ranks shared by the layouts in turn"
    rows = []
    for (name, *_), summary in zip(layouts, summaries):
        tps = summary["tokens_per_s"]
        rss = max(r["rss_mb"] for r in summary["per_rank"])
        bubble = summary.get("bubble_fraction")
        print(f"demo {name:30s} {tps:10,.0f} tokens/s  step {summary['step_time_s'] * 1e3:7.1f} ms  "
              f"max RSS/rank {rss:5.0f} MB  bubble {'-' if bubble is None else f'{bubble:.1%}'}",
              file=sys.stderr, flush=True)
        rows.append(dict(common, case="demo_tokens_per_s", sizes=name, ours_median_ms=summary["step_time_s"] * 1e3,
                         mem_mb=rss, baseline=f"tokens/s {tps:.0f}; max RSS/rank {rss:.0f} MB"
                         + ("" if bubble is None else f"; bubble {bubble:.3f}") + f"; {steps} steps{note}"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_profile_args(ap, smoke_help="tiny model, 3 steps, two layouts; never writes CSV",
                             quick_help=f"every layout, 4 steps, one set of ranks (~{QUICK_BUDGET_S} s)")
    ap.add_argument("--steps", type=int, default=None, help="steps per layout (default: the mode's profile)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows = collect(mode, torch.device("cpu"), steps=args.steps)
    print(f"({time.time() - t0:.1f} s)")
    harness.print_and_append(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
