"""``python -m benchmarks.moe --smoke`` runs end to end and prints its three tables: the step at every ep with
the one-process ratio, the bytes each rank sends equal to the docstring's formula, and the load balance with
the balancing loss on and off.

A subprocess, as a user runs it, writing no CSV. It asserts nothing about speed, nor about the balance a few
smoke steps reach (the benchmark's ``--quick`` run over 30 steps shows the loss keeping the load below the
collapse the run without it reaches; benchmarks/README.md)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _table(lines, header):
    """The rows (split on 2+ spaces) of the table whose header line starts with ``header``."""
    import re
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return rows


def test_moe_benchmark_smoke_prints_step_bytes_and_balance():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PARALLEL_LAYERS_NO_JIT="1")
    for var in ("PARALLEL_LAYERS_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe", "--smoke", "--no-csv"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    assert "not a speedup" in proc.stdout
    steps = _table(lines, "ep  tokens")
    assert [r[0] for r in steps] == ["1", "2"], proc.stdout
    for r in steps:      # ms, tokens/s, one-process ms, ratio: positive numbers
        assert float(r[2]) > 0 and float(r[4].replace(",", "")) > 0 and float(r[5]) > 0 and r[6].endswith("x"), r
    sent = _table(lines, "ep  rank  exchange")
    assert {(r[0], r[2]) for r in sent} >= {("2", "dispatch"), ("2", "combine"), ("2", "counts")}, proc.stdout
    assert all(r[5] == "0" for r in sent), proc.stdout
    assert all(int(r[3].replace(",", "")) > 0 for r in sent if r[2] in ("dispatch", "combine")), proc.stdout
    balance = [r for r in _table(lines, "aux coef") if len(r) == 5]
    assert {r[0] for r in balance} == {"0.01", "0"} and all(float(r[4]) >= 1.0 for r in balance), proc.stdout
