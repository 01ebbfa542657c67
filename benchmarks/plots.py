"""PNG plots drawn from the CSVs under benchmarks/results/.

    python -m benchmarks.plots [--results DIR] [--out DIR]

Draws, with one panel per device:
  ratios.png              every case of every group: baseline time / ours, coloured by target met/missed;
  scaling_*.png           the scaling curves (benchmarks/scaling_plots.py);
  speedup.png             ours / baseline time per case and backend (log scale), the target as a red bar;
  bandwidth_fraction.png  achieved GB/s as a fraction of that run's copy bandwidth, per case, for each
                          backend and for the torch baseline; the GPU target (85%) as a dashed line.
Per device, the rows the benchmark tables show (``harness.latest_rows``): the most complete mode measured (full,
else quick; smoke too for the kernel plots) and, per case, the newest run that measured it, so a later
``--only`` run updates its cases without hiding the others.
"""
from __future__ import annotations

import argparse
import os
import re
from collections import OrderedDict
from typing import List, Optional

from parallel_layers.optional import pyplot

from . import harness


def _is_number(text) -> bool:
    try:
        float(text)
        return True
    except (TypeError, ValueError):
        return False


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
    """Draw both PNGs from ``rows`` (or the CSV); returns the paths written (none without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []

    if rows is None:
        rows = harness.read_csv(csv_path or os.path.join(harness.RESULTS_DIR, "kernels.csv"))
    # The rows the benchmark tables show (harness.latest_rows); smoke rows count here so that a smoke run's own
    # rows (kernels --smoke --plot --no-csv) can be drawn.
    per_device = harness.latest_rows([{k: str(v) for k, v in r.items()} for r in rows],
                                     modes=("full", "quick", "smoke"))
    rows = [r for run in per_device.values() for r in run if _is_number(r.get("speedup"))]
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


# Every CSV whose rows carry a time ratio, with the group name the suite gives it.
RATIO_CSVS = [("kernels.csv", "kernels"), ("matmul.csv", "kernels"), ("tp.csv", "tp"), ("dp.csv", "dp"),
              ("zero.csv", "zero"), ("pipeline.csv", "pipeline")]
MET_COLORS = {"yes": "tab:green", "true": "tab:green", "no": "tab:red", "false": "tab:red"}


def draw_ratios(results_dir: str = harness.RESULTS_DIR, out_dir: str = harness.RESULTS_DIR) -> List[str]:
    """ratios.png: one horizontal bar per measured case of every group (baseline time / ours, log scale;
    right of 1 means ours is faster), green where its target is met, red where missed, gray without one.
    The rows are those the benchmark tables show (per device: the most complete mode, the newest row per case)."""
    plt = pyplot()
    if plt is None:
        return []

    per_device: "OrderedDict[str, list]" = OrderedDict()
    for name, group in RATIO_CSVS:
        for device, rows in harness.latest_rows(harness.read_csv(os.path.join(results_dir, name))).items():
            for r in rows:
                if not _is_number(r.get("speedup")):
                    continue
                ratio = float(r["speedup"])
                sizes = r.get("sizes", "")
                label = f"{group}: {r['case']} [{sizes[:22]}{'~' if len(sizes) > 22 else ''}, {r.get('backend', '')}]"
                per_device.setdefault(device, []).append((label, ratio, (r.get("met") or "").lower(), r["mode"]))
    if not per_device:
        return []
    heights = [max(2.5, 0.22 * len(v) + 1.2) for v in per_device.values()]
    fig, axes = plt.subplots(len(per_device), 1, figsize=(11, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (device, bars) in zip(axes[:, 0], per_device.items()):
        ys = list(range(len(bars)))[::-1]
        ax.barh(ys, [b[1] for b in bars], color=[MET_COLORS.get(b[2], "lightgray") for b in bars])
        for y, b in zip(ys, bars):
            ax.text(b[1], y, f" {b[1]:.2f}x", va="center", fontsize=6)
        ax.set_yticks(ys, [b[0] for b in bars], fontsize=6)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        modes = "/".join(sorted({b[3] for b in bars}))
        ax.set_title(f"{device} ({modes} sizes): green = target met, red = missed, gray = no target", fontsize=9)
        ax.set_xlabel("baseline time / our time (right of 1: ours faster)")
    fig.suptitle("parallel_layers: every benchmarked case against what a user would otherwise use")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "ratios.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def draw_all(results_dir: str = harness.RESULTS_DIR, out_dir: str = harness.RESULTS_DIR) -> List[str]:
    """Every PNG the benchmark tables show, from the CSVs: kernel speedups and bandwidth fractions, the ratio bars
    of all groups, and the scaling curves."""
    paths = []
    kernels_csv = os.path.join(results_dir, "kernels.csv")
    if os.path.exists(kernels_csv):
        paths += draw(kernels_csv, out_dir=out_dir)
    paths += draw_ratios(results_dir, out_dir)
    scaling_csv = os.path.join(results_dir, "scaling.csv")
    if os.path.exists(scaling_csv):
        from . import scaling_plots
        paths += scaling_plots.draw(scaling_csv, out_dir=out_dir)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=harness.RESULTS_DIR, help="folder of the CSVs")
    ap.add_argument("--out", default=harness.RESULTS_DIR)
    args = ap.parse_args(argv)
    paths = draw_all(args.results, args.out)
    if not paths:
        print(f"no results under {args.results}; run python -m parallel_layers bench first")
        return 1
    for p in paths:
        print(f"wrote {os.path.relpath(p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
