"""Regenerate the README's benchmark section from benchmarks/results/kernels.csv.

    python -m benchmarks.readme          # rewrites the text between the BENCHMARKS markers

Nothing in that section is typed by hand: for each device, the latest run of the most complete mode
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
CSV = os.path.join(ROOT, "benchmarks", "results", "kernels.csv")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- BENCHMARKS:BEGIN -->", "<!-- BENCHMARKS:END -->"
MODE_RANK = {"full": 0, "quick": 1}
COMMAND = {"full": "make bench", "quick": "python -m benchmarks.kernels --quick"}


def latest_runs(rows: List[Dict[str, str]]) -> List[List[Dict[str, str]]]:
    """One run per device: the newest run of the best mode available (smoke runs never count)."""
    by_device = defaultdict(list)
    for r in rows:
        if r.get("mode") in MODE_RANK:
            by_device[r["device"]].append(r)
    runs = []
    for device in sorted(by_device):
        device_rows = by_device[device]
        best = min(MODE_RANK[r["mode"]] for r in device_rows)
        candidates = [r for r in device_rows if MODE_RANK[r["mode"]] == best]
        newest = max(r["run_id"] for r in candidates)
        runs.append([r for r in candidates if r["run_id"] == newest])
    return runs


def fmt(value: str, digits: int = 3) -> str:
    try:
        return f"{float(value):.{digits}g}"
    except (TypeError, ValueError):
        return value or "-"


def render(runs: List[List[Dict[str, str]]]) -> str:
    if not runs:
        return "(no results yet: run `make bench`, then `python -m benchmarks.readme`)"
    out = []
    for run in runs:
        r0 = run[0]
        out.append(f"**{r0['device']}**, {r0['threads']} threads, torch {r0['torch']}, triton {r0['triton']}, "
                   f"{r0['date'][:10]}; measured by `{COMMAND[r0['mode']]}` ({r0['mode']} sizes). "
                   f"Speedup = baseline time / our time, median of the timed repetitions; bandwidth as a "
                   f"fraction of the copy bandwidth measured in the same run ({fmt(r0['copy_gbps'])} GB/s).")
        out.append("")
        out.append("| case | sizes | dtype | backend | ours ms | baseline | baseline ms | speedup | GB/s | "
                   "of copy BW | target | met |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in run:
            out.append(f"| {r['case']} | {r['sizes']} | {r['dtype']} | {r['backend']} | {fmt(r['ours_median_ms'])} "
                       f"| {r['baseline']} | {fmt(r['base_median_ms'])} | {fmt(r['speedup'])}x | {fmt(r['gbps'])} "
                       f"| {fmt(r['bw_fraction'], 2)} | {r['target'] or '-'} | {r['met'] or '-'} |")
        missed = [r["case"] + f" ({r['backend']})" for r in run if r.get("met") == "no"]
        out.append("")
        out.append("Targets missed in this run: " + (", ".join(missed) if missed else "none") + ".")
        out.append("")
    if any(os.path.exists(os.path.join(ROOT, "benchmarks", "results", p)) for p in ("speedup.png",)):
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
    section = render(latest_runs(read_csv(CSV)))
    with open(README, "w") as fh:
        fh.write(head + BEGIN + "\n" + section + "\n" + END + tail)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
