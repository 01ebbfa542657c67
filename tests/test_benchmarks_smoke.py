"""The kernel benchmark program runs end to end (tiny sizes) and prints a table row for every case.

It asserts nothing about speed: benchmarks print figures, tests check behaviour. A subprocess, as a
user runs it, so the CLI, the harness and every case's set-up are exercised without touching the CSV.
"""
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a top-level folder of the repo, not part of the installed package

from benchmarks.kernels import CASES  # noqa: E402


def test_kernels_smoke_prints_a_row_per_case():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               # a missing extension must fall back to the torch reference here, not start a
               # minutes-long just-in-time build; a pre-built parallel_layers._C is still used
               PARALLEL_LAYERS_NO_JIT="1")
    for var in ("PARALLEL_LAYERS_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernels", "--smoke", "--no-csv", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.time() - t0
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    assert any(line.startswith("copy bandwidth:") for line in lines), proc.stdout
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    rows = [line.split() for line in lines[header + 2:] if line.strip() and not line.startswith("(")]
    for case in CASES:
        mine = [r for r in rows if r[0] == case]
        assert mine, f"no table row for {case}:\n{proc.stdout}"
        for r in mine:
            # ours ms, baseline ms, speedup: positive numbers
            assert float(r[4]) > 0 and float(r[5]) > 0 and re.fullmatch(r"[0-9.]+x", r[6]), r
    print(f"benchmarks.kernels --smoke took {elapsed:.1f} s")
