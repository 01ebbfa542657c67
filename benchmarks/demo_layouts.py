"""Demo throughput for 1D, 2D and 3D layouts on the same 8 processes (issue 5's table).

    python -m benchmarks.demo_layouts [--steps 12] [--smoke]

Each layout runs ``python -m parallel_layers demo`` in a fresh subprocess (8 gloo ranks, one thread
each, same model, data and global batch of 32 sequences; no single-process reference run), and its summary.json is
read back: tokens/s (mean over the steps after the first), the largest per-rank RSS, and the
measured pipeline bubble. Rows are appended to benchmarks/results/demo.csv. This is a program that
prints figures, not a test: on a 2-core machine 8 processes share 2 cores, so the table says how the
layouts compare here, not what they do on 8 real devices.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

from . import harness

LAYOUTS = [  # (name, dp, tp, pp, zero)
    ("1D dp=8", 8, 1, 1, 0),
    ("1D dp=8 ZeRO-2", 8, 1, 1, 2),
    ("2D dp=4 x tp=2", 4, 2, 1, 0),
    ("2D dp=4 x pp=2", 4, 1, 2, 0),
    ("3D dp=2 x tp=2 x pp=2", 2, 2, 2, 0),
    ("3D dp=2 x tp=2 x pp=2 ZeRO-1", 2, 2, 2, 1),
]


def run_layout(dp, tp, pp, zero, steps, extra, out_dir):
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
           "--zero", str(zero), "--steps", str(steps), "--batch-size", "32", "--no-reference", "--no-progress", "--out", out_dir] + extra
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(out_dir, "summary.json")) as fh:
        return json.load(fh)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 3 steps, two layouts")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    extra = ["--n-layer", "2", "--d-model", "32", "--n-head", "4", "--seq-len", "16",
             "--corpus-bytes", "20000"] if args.smoke else []
    layouts = LAYOUTS[:1] + LAYOUTS[4:5] if args.smoke else LAYOUTS
    steps = 3 if args.smoke else args.steps
    common = dict(run_id=harness.now_iso(), date=harness.now_iso(), mode="smoke" if args.smoke else "full",
                  dtype="fp32", device=harness.device_name(torch.device("cpu")), torch=harness.versions()["torch"],
                  triton=harness.versions()["triton"], threads=1)
    rows = []
    print(f"{'layout':32s} {'tokens/s':>10s} {'step ms':>9s} {'max RSS/rank MB':>16s} {'bubble':>7s}")
    for name, dp, tp, pp, zero in layouts:
        with tempfile.TemporaryDirectory() as out_dir:
            summary = run_layout(dp, tp, pp, zero, steps, extra, out_dir)
        tps = summary["tokens_per_s"]
        step_ms = summary["step_time_s"] * 1e3
        rss = max(r["rss_mb"] for r in summary["per_rank"])
        bubble = summary.get("bubble_fraction")
        print(f"{name:32s} {tps:10,.0f} {step_ms:9.1f} {rss:16.0f} "
              f"{'-' if bubble is None else f'{bubble:.1%}':>7s}", flush=True)
        rows.append(dict(common, case="demo_tokens_per_s", sizes=name, backend="gloo x8",
                         ours_median_ms=step_ms, baseline=f"tokens/s {tps:.0f}; max RSS/rank {rss:.0f} MB"
                         + ("" if bubble is None else f"; bubble {bubble:.3f}")))
    if not args.no_csv:
        harness.append_csv(os.path.join(os.path.dirname(__file__), "results", "demo.csv"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
