"""The whole benchmark suite: every group, one progress bar, one table, CSV rows, plots, benchmarks/README.md.

    python -m parallel_layers bench                       # everything, full sizes (make bench)
    python -m parallel_layers bench --quick               # everything, small sizes, few repetitions
    python -m parallel_layers bench --only kernels --only dp
    python -m parallel_layers bench --quick --readme      # then redraw the plots and benchmarks/README.md's tables

Each group is one or more modules of ``benchmarks/`` implementing the same small contract:
``CSV_NAME`` (the file under ``benchmarks/results/`` its rows go to) and ``collect(mode, device,
progress)`` returning finished CSV rows (see ``benchmarks/harness.py`` for the columns). The suite runs
them in order, appends each module's rows to its CSV as soon as they exist (a later failure never loses
earlier figures), prints one table and the targets missed, and redraws the PNGs from the CSVs.
A module that fails is reported at the end (exit status 1) and the other groups still run.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import torch

from . import harness

GROUPS: "OrderedDict[str, Sequence[str]]" = OrderedDict([
    ("kernels", ("kernels", "matmul", "moe_kernels", "fp8_cast", "fp8_layers", "dispatch")),
    ("tp", ("tp", "cross_entropy")),
    ("dp", ("dp", "parameter_server", "sync_batchnorm", "single_process_dp")),
    ("zero", ("zero", "zero3", "zero_memory", "zero_offload", "cpu_adam")),
    ("pipeline", ("pipeline", "checkpoint_policy")),
    ("demo", ("demo_layouts", "torch_native_3d", "freeze_training", "replica_check")),
    ("scaling", ("scaling",)),
    ("cp", ("context_parallel",)),
    ("moe", ("moe",)),
    ("fp8", ("fp8_convergence",)),
    ("resilience", ("checkpoint",)),
    ("plan", ("planner",)),
])


def load(name: str):
    return importlib.import_module(f"{__package__}.{name}")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers bench",
                                 description="Run the parallel_layers benchmarks and print one table.")
    harness.add_profile_args(ap, smoke_help="tiny sizes: checks every benchmark runs (no CSV)",
                             quick_help="small sizes, few repetitions")
    ap.add_argument("--only", action="append", default=[], metavar="GROUP",
                    help=f"run only these groups (repeatable or comma-separated): {', '.join(GROUPS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device for single-process benchmarks (multi-process ones use gloo on CPU)")
    harness.add_csv_args(ap, no_csv_help="do not append to benchmarks/results/*.csv")
    ap.add_argument("--no-plots", action="store_true", help="do not redraw the PNGs")
    ap.add_argument("--readme", action="store_true", help="afterwards regenerate the tables in benchmarks/README.md")
    ap.add_argument("--list", action="store_true", help="list the groups and their modules, then exit")
    args = ap.parse_args(argv)

    if args.list:
        for group, modules in GROUPS.items():
            print(f"{group:9s} " + ", ".join(f"benchmarks.{m}" for m in modules))
        return 0
    only = [g for item in args.only for g in item.split(",") if g]
    unknown = sorted(set(only) - set(GROUPS))
    if unknown:
        print(f"unknown group(s) {unknown}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    groups = [g for g in GROUPS if not only or g in only]
    mode = harness.profile_of(args)
    write_csv = not (args.no_csv or args.smoke)
    device = torch.device(args.device)

    from parallel_layers.optional import progress_bar as tqdm

    jobs = [(g, m) for g in groups for m in GROUPS[g]]
    print(f"parallel_layers bench: {mode} | {harness.device_name(device)} ({device}) | torch {torch.__version__}"
          f" | groups: {', '.join(groups)}", flush=True)
    all_rows: List[Dict[str, object]] = []
    failures: List[str] = []
    seconds: "OrderedDict[str, float]" = OrderedDict()
    t_start = time.time()
    bar = tqdm(jobs, desc="bench", unit="module", file=sys.stderr, dynamic_ncols=True)
    for group, name in bar:
        bar.set_description(f"bench {group}/{name}")

        def progress(text: str, _bar=bar, _name=name) -> None:
            _bar.set_postfix_str(f"{_name}: {text}"[:60], refresh=True)

        t0 = time.time()
        try:
            module = load(name)
            rows = module.collect(mode, device, progress=progress)
        except Exception as exc:  # noqa: BLE001 - one broken group must not hide the others' figures
            failures.append(f"{group}/{name}: {type(exc).__name__}: {str(exc)[:2000]}")
            rows = []
        seconds[f"{group}/{name}"] = time.time() - t0
        for r in rows:
            r["group"] = group
            if r.get("met") in ("error",):
                failures.append(f"{group}/{name}: {r['case']} [{r.get('backend', '')}]: {r.get('baseline', '')}")
        if write_csv and rows:
            harness.append_csv(os.path.join(harness.RESULTS_DIR, module.CSV_NAME), rows)
        all_rows.extend(rows)
    bar.close()
    total = time.time() - t_start

    print()
    print(harness.format_table(all_rows) if all_rows else "(no rows)")
    print()
    print("seconds per module: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + f"; total {total:.0f} s")
    misses = harness.missed(all_rows)
    if mode != "full" and misses:
        print(f"(--{mode}: the targets are defined at full sizes; at these sizes 'met' is indicative)")
    print("targets missed: " + ("none" if not misses else f"{len(misses)}"))
    for m in misses:
        print(f"  - {m}")
    if write_csv and all_rows:
        print(f"rows appended under {os.path.relpath(harness.RESULTS_DIR)}/")
    if not args.no_plots and write_csv:
        from . import plots
        for path in plots.draw_all():
            print(f"plot: {os.path.relpath(path)}")
    if args.readme:
        from . import readme
        readme.main(["--quiet"])
        print("benchmarks/README.md tables regenerated")
    for f in failures:
        print(f"FAILED {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
