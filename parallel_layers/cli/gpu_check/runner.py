"""Runs the steps within the budget and keeps the results where a cut-off cannot take them: ``results.json``,
``results.csv`` and ``summary.md`` are rewritten before and after every step (a step being run when the command
is killed is listed as "running", the steps after it as "not run"). A step that outlives its limit gets SIGINT
first (pytest then writes its junit file and its summary of what ran), then SIGKILL, with its whole process
group."""
from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from .steps import ROOT, Step

BUDGET_S = 540          # one 10-minute command, with a minute's margin for start-up and the copy back
MIN_START_S = 20        # a step is not started with less budget than this left
GRACE_S = 10            # between SIGINT and SIGKILL


class Results:
    """The table of steps, written out in full whenever it changes; ``--only`` reruns update their rows."""

    def __init__(self, out: str, header: List[str], names: List[str], budget_s: float, keep: bool):
        self.out, self.header, self.budget_s = out, header, budget_s
        self.rows: Dict[str, dict] = {}
        path = os.path.join(out, "results.json")
        if keep and os.path.isfile(path):
            with open(path) as fh:
                self.rows = {r["step"]: r for r in json.load(fh)["steps"]}
        for name in names:
            self.rows.setdefault(name, {"step": name, "result": "not run", "seconds": None, "note": ""})
        self.order = names
        self.start = time.monotonic()

    def set(self, name: str, result: str, seconds: Optional[float] = None, note: str = "") -> None:
        self.rows[name] = {"step": name, "result": result, "seconds": None if seconds is None else round(seconds, 1),
                           "note": note}
        self.write()

    def failed(self) -> List[str]:
        return [n for n in self.order if not self.rows[n]["result"].startswith(("ok", "not run"))]

    def verdict(self) -> str:
        failed, skipped = self.failed(), [n for n in self.order if self.rows[n]["result"].startswith("not run")]
        text = f"FAILED: {', '.join(failed)}" if failed else "all ok"
        return text + (f"; not run: {', '.join(skipped)}" if skipped else "")

    def write(self) -> None:
        elapsed = time.monotonic() - self.start
        rows = [self.rows[n] for n in self.order]
        tmp = os.path.join(self.out, ".results.tmp")
        with open(tmp, "w") as fh:
            json.dump({"header": self.header, "elapsed_s": round(elapsed, 1), "budget_s": self.budget_s,
                       "steps": rows}, fh, indent=1)
        os.replace(tmp, os.path.join(self.out, "results.json"))
        with open(tmp, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=["step", "result", "seconds", "note"])
            w.writeheader()
            w.writerows(rows)
        os.replace(tmp, os.path.join(self.out, "results.csv"))
        lines = ["# gpu-check", ""] + [f"- {h}" for h in self.header] + [
            "", "| step | result | seconds | log | note |", "|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['result']} | {'' if r['seconds'] is None else r['seconds']} | "
                  f"{r['step']}.log | {r['note']} |" for r in rows]
        lines += ["", f"{elapsed:.0f} s of the {self.budget_s:.0f} s budget so far; {self.verdict()}"]
        with open(tmp, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        os.replace(tmp, os.path.join(self.out, "summary.md"))


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_step(step: Step, argv: List[str], env: dict, log: str, limit_s: float, on_start=None) -> str:
    """Run one step in its own process group; 'ok', 'FAILED (rc)' or 'TIMEOUT after N s'."""
    with open(log, "w") as fh:
        fh.write("$ " + " ".join(argv) + "\n")
        fh.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        _running.append(proc)
        if on_start is not None:
            on_start(proc)
        try:
            try:
                rc = proc.wait(timeout=max(1.0, limit_s - GRACE_S))
            except subprocess.TimeoutExpired:
                _kill_group(proc, signal.SIGINT)       # pytest: writes its junit XML and what ran
                try:
                    proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    _kill_group(proc, signal.SIGKILL)
                    proc.wait()
                return f"TIMEOUT after {limit_s:.0f} s"
        finally:
            _running.remove(proc)
        _kill_group(proc, signal.SIGKILL)              # leftovers of the step (spawned ranks)
    return "ok" if rc == 0 else f"FAILED (exit {rc})"


_running: List[subprocess.Popen] = []


def _on_term(results: Results, current: List[str]):
    def handler(signum, frame):
        for proc in list(_running):
            _kill_group(proc, signal.SIGKILL)
        if current:
            results.set(current[0], f"KILLED (signal {signum}) while running", None, "gpu-check itself was stopped")
        print(f"gpu-check: stopped by signal {signum}; results so far in {results.out}/summary.md", flush=True)
        sys.exit(128 + signum)
    return handler


def run_steps(steps: List[Step], out: str, header: List[str], gpu: bool, budget_s: float,
              only: Optional[List[str]] = None, min_start_s: float = MIN_START_S) -> int:
    os.makedirs(out, exist_ok=True)
    names = [s.name for s in steps]
    results = Results(out, header, names, budget_s, keep=bool(only))
    selected = [s for s in steps if not only or s.name in only]
    current: List[str] = []
    signal.signal(signal.SIGTERM, _on_term(results, current))
    for step in selected:        # a cut-off leaves the plan visible
        results.rows[step.name] = {"step": step.name, "result": "not run", "seconds": None, "note": ""}
    results.write()
    for step in selected:
        argv = step.argv if gpu or not step.needs_gpu else step.dry_argv
        left = budget_s - (time.monotonic() - results.start)
        if left < min(step.timeout_s, min_start_s):
            results.set(step.name, "not run: no time left", None, f"{left:.0f} s of budget left")
            print(f"gpu-check {step.name}: not run: no time left ({left:.0f} s)", flush=True)
            continue
        limit = min(step.timeout_s, left)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PARALLEL_LAYERS_CACHE_DIR=os.path.join(out, "cache"), PIP_NO_INDEX="1",
                   **({} if step.name == "build" else {"PARALLEL_LAYERS_NO_JIT": "1"}),
                   **(step.env if gpu or step.name == "build" else {}))
        current[:] = [step.name]
        results.set(step.name, f"running (limit {limit:.0f} s)", None, step.note)
        t0 = time.monotonic()

        def started(proc, name=step.name, limit=limit, note=step.note):   # the pid, for whoever finds it hung
            results.set(name, f"running (limit {limit:.0f} s, process group {proc.pid})", None, note)

        result = run_step(step, argv, env, os.path.join(out, f"{step.name}.log"), limit, started)
        current.clear()
        took = time.monotonic() - t0
        kind = "ran" if argv is step.argv else "dry run"
        results.set(step.name, f"{result} ({kind})", took, step.note)
        print(f"gpu-check {step.name}: {result} ({kind}) in {took:.1f} s (log: {out}/{step.name}.log)", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with open(os.path.join(out, "summary.md")) as fh:
        print(fh.read())
    return 1 if results.failed() else 0
