"""PNG plots of benchmarks/results/kernels.csv.

    python -m benchmarks.plots [--csv PATH] [--out DIR]

Draws, with one panel per device:
  speedup.png             ours / baseline time per case and backend (log scale), the target as a red bar;
  bandwidth_fraction.png  achieved GB/s as a fraction of that run's copy bandwidth, per case, for each
                          backend and for the torch baseline; the GPU target (85%) as a dashed line.
For each (device, case, backend) the latest row is used, preferring full-size runs over --quick over
--smoke, so a later ``--only`` run updates its cases without hiding the others.
"""
from __future__ import annotations

import argparse
import os
import re
from collections import OrderedDict
from typing import Dict, List, Optional

from . import harness

MODE_RANK = {"full": 2, "quick": 1, "smoke": 0}


def latest_rows(rows: List[Dict[str, str]]) -> List[Dict[str, str]]:
    best: "OrderedDict[tuple, Dict[str, str]]" = OrderedDict()
    for r in rows:
        try:
            float(r["speedup"])
        except (KeyError, TypeError, ValueError):
            continue
        key = (r.get("device", "?"), r["case"], r.get("backend", "?"))
        rank = (MODE_RANK.get(r.get("mode", "full"), 2), r.get("date", ""))
        if key not in best or rank >= (MODE_RANK.get(best[key].get("mode", "full"), 2), best[key].get("date", "")):
            best[key] = r
    return list(best.values())


def _speedup_target(text: str) -> Optional[float]:
    m = re.search(r">=\s*([0-9.]+)x", text or "")
    return float(m.group(1)) if m else None


def _bw_target(text: str) -> Optional[float]:
    m = re.search(r">=\s*([0-9.]+)%\s*bw", text or "")
    return float(m.group(1)) / 100 if m else None


def _panels(rows):
    """{device: (cases in order, backends in order, {(case, backend): row})}."""
    out: "OrderedDict[str, tuple]" = OrderedDict()
    for r in rows:
        cases, backends, table = out.setdefault(r.get("device", "?"), ([], [], {}))
        if r["case"] not in cases:
            cases.append(r["case"])
        if r["backend"] not in backends:
            backends.append(r["backend"])
        table[(r["case"], r["backend"])] = r
    return out


def _modes(table) -> str:
    modes = sorted({r.get("mode", "full") for r in table.values()})
    dates = sorted(r.get("date", "")[:10] for r in table.values())
    return f"{'/'.join(modes)}, {dates[0]}..{dates[-1]}" if dates and dates[0] != dates[-1] else \
        f"{'/'.join(modes)}, {dates[0] if dates else ''}"


def draw(csv_path: Optional[str] = None, rows: Optional[List[dict]] = None,
         out_dir: str = harness.RESULTS_DIR) -> List[str]:
    """Draw both PNGs from ``rows`` (or the CSV); returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rows is None:
        rows = harness.read_csv(csv_path or os.path.join(harness.RESULTS_DIR, "kernels.csv"))
    rows = latest_rows([{k: str(v) for k, v in r.items()} for r in rows])
    if not rows:
        return []
    panels = _panels(rows)
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    # (a) speedup per case and backend
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for ax, (device, (cases, backends, table)) in zip(axes[:, 0], panels.items()):
        width = 0.8 / len(backends)
        for j, b in enumerate(backends):
            xs = [i + (j - (len(backends) - 1) / 2) * width for i, c in enumerate(cases) if (c, b) in table]
            ys = [float(table[(c, b)]["speedup"]) for c in cases if (c, b) in table]
            bars = ax.bar(xs, ys, width * 0.9, label=f"ours ({b})")
            ax.bar_label(bars, labels=[f"{y:.2f}x" for y in ys], fontsize=7, padding=1)
        for i, c in enumerate(cases):
            t = next((_speedup_target(table[(c, b)].get("target", "")) for b in backends if (c, b) in table), None)
            if t:
                ax.plot([i - 0.45, i + 0.45], [t, t], color="red", lw=2.5,
                        label="target" if "target" not in ax.get_legend_handles_labels()[1] else None)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("speedup = baseline / ours")
        ax.set_title(f"{device}  ({_modes(table)})", fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("parallel_layers kernels: speedup over the torch baseline (higher is better)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "speedup.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    # (b) fraction of copy bandwidth per kernel, per backend and for the torch baseline
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4.2 * len(panels)), squeeze=False)
    for ax, (device, (cases, backends, table)) in zip(axes[:, 0], panels.items()):
        series = [(f"ours ({b})", b, "bw_fraction") for b in backends] + [("torch baseline", None, "base_bw_fraction")]
        width = 0.8 / len(series)
        for j, (label, b, key) in enumerate(series):
            xs, ys = [], []
            for i, c in enumerate(cases):
                r = table.get((c, b)) if b else next((table[(c, bb)] for bb in backends if (c, bb) in table), None)
                if r is not None and r.get(key):
                    xs.append(i + (j - (len(series) - 1) / 2) * width)
                    ys.append(float(r[key]))
            ax.bar(xs, ys, width * 0.9, label=label, color="lightgray" if b is None else None,
                   edgecolor="gray" if b is None else None)
        bw_t = next((_bw_target(r.get("target", "")) for r in table.values() if _bw_target(r.get("target", ""))), None)
        if bw_t:
            ax.axhline(bw_t, color="red", ls="--", lw=1.2, label=f"target {bw_t:.0%}")
        copy = next(iter(table.values())).get("copy_gbps", "")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(cases)), cases, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel("GB/s / copy GB/s")
        ax.set_title(f"{device}  (copy bandwidth {float(copy):.1f} GB/s; {_modes(table)})" if copy else device,
                     fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("parallel_layers kernels: achieved bandwidth as a fraction of dst.copy_(src)")
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bandwidth_fraction.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default=os.path.join(harness.RESULTS_DIR, "kernels.csv"))
    ap.add_argument("--out", default=harness.RESULTS_DIR)
    args = ap.parse_args(argv)
    if not os.path.exists(args.csv):
        print(f"no results at {args.csv}; run python -m benchmarks.kernels first")
        return 1
    for p in draw(args.csv, out_dir=args.out):
        print(f"wrote {os.path.relpath(p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
