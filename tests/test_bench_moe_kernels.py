"""``python -m benchmarks.moe_kernels --quick`` runs end to end in a few seconds and prints a row per case.

It asserts nothing about speed: a subprocess, as a user runs it, so the CLI and every case's set-up run
without touching the CSV."""
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_moe_kernels_quick_prints_a_row_per_case():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PARALLEL_LAYERS_NO_JIT="1")
    for var in ("PARALLEL_LAYERS_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe_kernels", "--quick", "--no-csv", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("case "))
    rows = {line.split()[0]: line.split() for line in lines[header + 2:] if line.strip()}
    assert set(rows) == {"router_topk", "permute", "unpermute"}, proc.stdout
    for r in rows.values():
        # ours ms, torch ms, speedup, GB/s: positive numbers
        assert float(r[4]) > 0 and float(r[5]) > 0 and re.fullmatch(r"[0-9.]+x", r[6]) and float(r[7]) > 0, r
