"""Regenerate the README's benchmark section from the CSVs under benchmarks/results/.

    python -m benchmarks.readme          # rewrites the text between the BENCHMARKS markers

Nothing in that section is typed by hand: for each CSV and device, the newest row of every case from the most complete mode
(full, else quick) is turned into a table, with the machine, versions, date and the command that
measured it, and every missed target is listed plainly.
"""
from __future__ import annotations

import os
import sys
from collections import defaultdict
from typing import Dict, List

from .harness import read_csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- BENCHMARKS:BEGIN -->", "<!-- BENCHMARKS:END -->"
MODE_RANK = {"full": 0, "quick": 1}


SECTIONS = [("kernels.csv", "Fused kernels", "make bench"),
            ("tp.csv", "Tensor parallel (2 ranks)", "python -m benchmarks.tp; python -m benchmarks.cross_entropy"),
            ("dp.csv", "Data parallel", "python -m benchmarks.dp"),
            ("zero.csv", "ZeRO", "python -m benchmarks.zero; python -m benchmarks.zero3"),
            ("pipeline.csv", "Pipeline", "python -m benchmarks.pipeline"),
            ("demo.csv", "Demo layouts, 8 processes on 2 cores (ours ms = step time)", "python -m benchmarks.demo_layouts"),
            ("matmul.csv", "Fused matmul epilogue (GPU)", "python -m benchmarks.matmul")]


def latest_rows(rows: List[Dict[str, str]]) -> Dict[str, List[Dict[str, str]]]:
    """Per device: the newest row of each (case, sizes, dtype, backend), from the best mode measured
    (full, else quick; smoke runs never count). For kernels.csv that is the latest full run."""
    by_device = defaultdict(list)
    for r in rows:
        if r.get("mode") in MODE_RANK:
            by_device[r["device"]].append(r)
    out = {}
    for device in sorted(by_device):
        device_rows = by_device[device]
        best = min(MODE_RANK[r["mode"]] for r in device_rows)
        newest: Dict[tuple, Dict[str, str]] = {}
        for r in device_rows:
            if MODE_RANK[r["mode"]] != best:
                continue
            key = (r["case"], r["sizes"], r["dtype"], r["backend"])
            if key not in newest or r["run_id"] >= newest[key]["run_id"]:
                newest[key] = r
        out[device] = list(newest.values())
    return out


def met_text(value: str) -> str:
    """Benchmarks write yes/no or True/False; the README says yes/no."""
    return {"true": "yes", "false": "no"}.get((value or "").lower(), value or "-")


def fmt(value: str, digits: int = 3) -> str:
    try:
        return f"{float(value):.{digits}g}"
    except (TypeError, ValueError):
        return value or "-"


def render_section(title: str, command: str, per_device: Dict[str, List[Dict[str, str]]]) -> List[str]:
    out = []
    for device, run in per_device.items():
        r0 = run[0]
        dates = sorted({r["date"][:16].replace("T", " ") for r in run})
        copy = {r.get("copy_gbps") for r in run if r.get("copy_gbps")}
        out.append(f"#### {title}: {device}")
        out.append("")
        out.append(f"torch {r0['torch']}, triton {r0['triton']}, {r0['threads']} thread(s) per process, "
                   f"{r0['mode']} sizes, measured {', '.join(dates)} UTC by `{command}`."
                   + (f" Copy bandwidth measured in the same run: {', '.join(fmt(c) for c in sorted(copy))} GB/s."
                      if copy else ""))
        out.append("")
        out.append("| case | sizes | dtype | backend | ours ms | baseline | baseline ms | speedup | GB/s | "
                   "of copy BW | target | met |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in run:
            out.append(f"| {r['case']} | {r['sizes']} | {r['dtype']} | {r['backend']} | {fmt(r['ours_median_ms'])} "
                       f"| {r['baseline']} | {fmt(r['base_median_ms'])} | {fmt(r['speedup'])}x "
                       f"| {fmt(r.get('gbps', ''))} | {fmt(r.get('bw_fraction', ''), 2)} | {r['target'] or '-'} "
                       f"| {met_text(r['met'])} |")
        missed = [f"{r['case']} {r['sizes']} ({r['backend']})" for r in run if met_text(r.get("met")) == "no"]
        out.append("")
        out.append("Targets missed: " + (", ".join(missed) if missed else "none") + ".")
        out.append("")
    return out


def render() -> str:
    out = ["Speedup = baseline time / our time (median of the timed repetitions, ours and the baseline "
           "back to back in one run). Bandwidth as a fraction of the copy bandwidth measured in the same run.",
           ""]
    found = False
    for name, title, command in SECTIONS:
        per_device = latest_rows(read_csv(os.path.join(ROOT, "benchmarks", "results", name)))
        if per_device:
            found = True
            out += render_section(title, command, per_device)
    if not found:
        return "(no results yet: run `make bench`, then `python -m benchmarks.readme`)"
    if os.path.exists(os.path.join(ROOT, "benchmarks", "results", "speedup.png")):
        out.append("![speedup per case](benchmarks/results/speedup.png)")
        out.append("![fraction of copy bandwidth](benchmarks/results/bandwidth_fraction.png)")
    return "\n".join(out).rstrip()


def main(argv=None) -> int:
    text = open(README).read()
    if BEGIN not in text or END not in text:
        print(f"README.md has no {BEGIN} ... {END} section", file=sys.stderr)
        return 1
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    section = render()
    with open(README, "w") as fh:
        fh.write(head + BEGIN + "\n" + section + "\n" + END + tail)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
