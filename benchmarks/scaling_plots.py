"""PNG plots of the scaling curves, drawn from the rows of ``benchmarks/scaling.py``.

    python -m benchmarks.scaling_plots [--csv benchmarks/results/scaling.csv] [--out DIR]

* ``scaling_world.png``: step time (median, p20-p80 bars) and per-rank memory against the world size, one
  line per ZeRO stage (stage 0 = plain data parallel), torch DDP + AdamW dashed; log2 x.
* ``scaling_model.png``: the same against the parameter count at a fixed world size.
* ``scaling_elements.png``: kernel time against the element count (log-log), ours, torch's and the copy,
  and the achieved GB/s with the run's copy bandwidth as a reference line.

From a CSV, each figure shows one run per device: the newest run of the most complete mode measured on
that device (full, else quick; smoke runs never count). Rows given directly are drawn whatever their mode
(newest run per device). The first device gets the plain file name; further devices get the file name
with the device appended.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Dict, List, Optional, Sequence, Union

from parallel_layers.optional import pyplot

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "scaling.csv")
FIGURES = {"world": "scale_world_zero", "model": "scale_model_zero", "elements": "scale_elems_"}
MODE_ORDER = ("full", "quick")
STAGE_STYLE = {0: ("tab:blue", "o"), 1: ("tab:orange", "s"), 2: ("tab:green", "^"), 3: ("tab:red", "D")}


def _num(row: dict, key: str) -> float:
    try:
        return float(row.get(key, ""))
    except (TypeError, ValueError):
        return math.nan


def select_runs(rows: Sequence[dict], direct: bool) -> Dict[str, Dict[str, List[dict]]]:
    """{figure: {device: rows of the one run drawn}} (see the module docstring for which run)."""
    out: Dict[str, Dict[str, List[dict]]] = {}
    for fig, prefix in FIGURES.items():
        by_device: Dict[str, List[dict]] = {}
        for r in rows:
            if str(r.get("case", "")).startswith(prefix) and (direct or r.get("mode") in MODE_ORDER):
                by_device.setdefault(str(r.get("device", "?")), []).append(r)
        chosen = {}
        for device, rs in by_device.items():
            if not direct:
                best = min(MODE_ORDER.index(r["mode"]) for r in rs)
                rs = [r for r in rs if r["mode"] == MODE_ORDER[best]]
            newest = max(str(r.get("run_id", "")) for r in rs)
            chosen[device] = [r for r in rs if str(r.get("run_id", "")) == newest]
        # newest run first: it gets the plain file name
        out[fig] = dict(sorted(chosen.items(), key=lambda kv: str(kv[1][0].get("run_id", "")), reverse=True))
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:40]


def _path(out_dir: str, name: str, index: int, device: str) -> str:
    return os.path.join(out_dir, f"{name}.png" if index == 0 else f"{name}_{_slug(device)}.png")


def _subtitle(run: List[dict]) -> str:
    r0 = run[0]
    return (f"{r0.get('device', '?')} | {r0.get('mode', '?')} run {str(r0.get('date', ''))[:16]} | "
            f"torch {r0.get('torch', '?')}, {r0.get('threads', '?')} thread(s) per process")


def _stage_curves(run: List[dict], prefix: str):
    """{stage: sorted [(x, median, p20, p80, mem_mb)]} and the DDP baseline [(x, median, p20, p80)]."""
    curves: Dict[int, list] = {}
    base = []
    for r in run:
        stage = int(str(r["case"])[len(prefix):])
        x = _num(r, "x")
        curves.setdefault(stage, []).append((x, _num(r, "ours_median_ms"), _num(r, "ours_p20_ms"),
                                             _num(r, "ours_p80_ms"), _num(r, "mem_mb")))
        if not math.isnan(_num(r, "base_median_ms")):
            base.append((x, _num(r, "base_median_ms"), _num(r, "base_p20_ms"), _num(r, "base_p80_ms")))
    return {s: sorted(v) for s, v in sorted(curves.items())}, sorted(base)


def _errbar(ax, pts, **kw):
    xs = [p[0] for p in pts]
    med = [p[1] for p in pts]
    err = [[max(p[1] - p[2], 0.0) for p in pts], [max(p[3] - p[1], 0.0) for p in pts]]
    ax.errorbar(xs, med, yerr=err, capsize=3, **kw)


def _draw_stages(plt, run: List[dict], prefix: str, xlabel: str, log2_x: bool, title: str, path: str) -> str:
    from matplotlib.ticker import FormatStrFormatter

    curves, base = _stage_curves(run, prefix)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    for s, pts in curves.items():
        color, marker = STAGE_STYLE.get(s, ("black", "x"))
        label = "stage 0 (DataParallel + FusedAdamW)" if s == 0 else f"ZeRO-{s}"
        _errbar(ax_t, pts, color=color, marker=marker, label=label)
        ax_m.plot([p[0] for p in pts], [p[4] for p in pts], color=color, marker=marker, label=label)
    if base:
        _errbar(ax_t, base, color="black", marker="x", linestyle="--", label="torch DDP + AdamW(fused)")
    for ax in (ax_t, ax_m):
        if log2_x:
            ax.set_xscale("log", base=2)
            xs = sorted({p[0] for pts in curves.values() for p in pts})
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}" for x in xs])
        else:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("step time, ms (slowest rank; median, p20-p80)")
    ax_t.set_title("full training step")
    ax_m.set_yscale("log", base=2)
    ax_m.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax_m.set_ylabel("MiB per rank (params + grads + optimizer state)")
    ax_m.set_title("memory held between steps")
    ax_t.legend(fontsize=8)
    ax_m.legend(fontsize=8)
    sizes = run[0].get("sizes", "")
    fig.suptitle(f"{title}\n{_subtitle(run)}" + (f"\nmodel {sizes}" if "world" in path else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_elements(plt, run: List[dict], path: str) -> str:
    series: Dict[str, List[dict]] = {}
    for r in run:
        series.setdefault(str(r["case"])[len(FIGURES["elements"]):], []).append(r)
    for rs in series.values():
        rs.sort(key=lambda r: _num(r, "x"))
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"adamw": "tab:blue", "cast": "tab:green", "copy": "black"}
    for kind, rs in series.items():
        color = styles.get(kind, "tab:gray")
        xs = [_num(r, "x") for r in rs]
        ours = "copy_ (fp32, the roofline)" if kind == "copy" else f"ours {kind} [{rs[0].get('backend', '')}]"
        ax_t.plot(xs, [_num(r, "ours_median_ms") for r in rs], color=color, marker="o", label=ours)
        ax_b.plot(xs, [_num(r, "gbps") for r in rs], color=color, marker="o", label=ours)
        if any(not math.isnan(_num(r, "base_median_ms")) for r in rs):
            desc = str(rs[0].get("baseline", "")).split(";")[0]
            ax_t.plot(xs, [_num(r, "base_median_ms") for r in rs], color=color, marker="x", linestyle="--",
                      label=f"torch {kind}: {desc}")
            ax_b.plot(xs, [_num(r, "base_gbps") for r in rs], color=color, marker="x", linestyle="--",
                      label=f"torch {kind}")
    copy_gbps = [_num(r, "copy_gbps") for r in run if not math.isnan(_num(r, "copy_gbps"))]
    if copy_gbps:
        ax_b.axhline(copy_gbps[0], color="red", linestyle=":", label=f"copy bandwidth {copy_gbps[0]:.1f} GB/s")
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    ax_t.set_ylabel("time per call, ms (median)")
    ax_t.set_title("time: flat below ~launch overhead, then linear in n")
    ax_b.set_xscale("log")
    ax_b.set_ylabel("GB/s (bytes the kernel must move / time)")
    ax_b.set_title("achieved bandwidth")
    for ax in (ax_t, ax_b):
        ax.set_xlabel("elements n (fp32)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Kernel time against element count\n{_subtitle(run)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(rows_or_csv_path: Union[None, str, Sequence[dict]] = None, out_dir: str = harness.RESULTS_DIR) -> List[str]:
    """Draw the scaling PNGs; returns the paths written (none when there is nothing to draw).

    ``rows_or_csv_path``: rows from ``benchmarks.scaling.collect`` (drawn whatever their mode), or a CSV
    path (default ``benchmarks/results/scaling.csv``; smoke runs ignored); none without matplotlib."""
    plt = pyplot()
    if plt is None:
        return []

    direct = rows_or_csv_path is not None and not isinstance(rows_or_csv_path, (str, os.PathLike))
    rows = list(rows_or_csv_path) if direct else harness.read_csv(rows_or_csv_path or CSV_PATH)
    runs = select_runs(rows, direct)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, (device, run) in enumerate(runs["world"].items()):
        paths.append(_draw_stages(plt, run, FIGURES["world"], "world size (processes)", True,
                                  "Scaling with the world size at a fixed per-rank batch",
                                  _path(out_dir, "scaling_world", i, device)))
    for i, (device, run) in enumerate(runs["model"].items()):
        w = run[0].get("backend", "")
        paths.append(_draw_stages(plt, run, FIGURES["model"], "parameters", False,
                                  f"Scaling with the model size ({w})", _path(out_dir, "scaling_model", i, device)))
    for i, (device, run) in enumerate(runs["elements"].items()):
        paths.append(_draw_elements(plt, run, _path(out_dir, "scaling_elements", i, device)))
    return paths


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling_plots", description=__doc__.split("\n")[0])
    ap.add_argument("--csv", default=CSV_PATH, help="CSV of benchmarks.scaling rows")
    ap.add_argument("--out", default=harness.RESULTS_DIR, help="folder for the PNGs")
    args = ap.parse_args(argv)
    paths = draw(args.csv, out_dir=args.out)
    if not paths:
        print(f"nothing to draw: no full or quick scaling rows in {os.path.relpath(args.csv)}", file=sys.stderr)
        return 1
    for p in paths:
        print(f"plot: {os.path.relpath(p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
