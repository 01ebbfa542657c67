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


# ------------------------------------------------------------------ the suite: python -m parallel_layers bench
def _row(**kw):
    from benchmarks import harness

    base = dict(run_id="2026-01-01T00:00:00", date="2026-01-01T00:00:00", mode="full", sizes="n=1", dtype="fp32",
                backend="cpp", device="Test CPU", torch="2.x", triton="3.x", threads=1, baseline="torch",
                ours_median_ms=1.0, ours_p20_ms=0.9, ours_p80_ms=1.1, base_median_ms=2.0, base_p20_ms=1.9,
                base_p80_ms=2.1, speedup=2.0, target="speedup>=1.0", met="yes")
    base.update(kw)
    return {k: base.get(k, "") for k in harness.CSV_FIELDS}


def test_readme_names_the_machine_lists_misses_and_prefers_full_runs(tmp_path):
    from benchmarks import harness, readme

    harness.append_csv(str(tmp_path / "kernels.csv"), [
        _row(case="adamw_flat"),
        _row(case="unscale_norm", speedup=0.8, met="no"),
        # a newer quick run must not replace the full run in the README
        _row(case="adamw_flat", mode="quick", run_id="2026-02-01T00:00:00", speedup=0.5, met="no"),
        _row(case="adamw_flat", mode="smoke", run_id="2026-03-01T00:00:00", speedup=0.1, met="no"),
    ])
    text = readme.render(str(tmp_path))
    assert "Machines measured: Test CPU." in text and "No GPU results" in text
    assert "**Targets missed (1):**" in text and "unscale_norm n=1 (cpp)" in text
    adamw = [line for line in text.splitlines() if line.startswith("| adamw_flat")]
    assert len(adamw) == 1 and "| 2x |" in adamw[0], adamw
    harness.append_csv(str(tmp_path / "kernels.csv"), [_row(case="adamw_flat", device="NVIDIA H200")])
    text = readme.render(str(tmp_path))
    assert "No GPU results" not in text and "#### Fused kernels: NVIDIA H200" in text


def test_suite_table_and_misses():
    from benchmarks import harness

    rows = [dict(_row(case="a"), group="kernels"), dict(_row(case="b", speedup=0.5, met="no"), group="dp"),
            dict(_row(case="bubble", ours_median_ms="", speedup="", target="<= 0.2", met="no"), group="pipeline")]
    table = harness.format_table(rows).splitlines()
    assert table[0].split()[:3] == ["group", "case", "sizes"] and len(table) == 2 + len(rows)
    assert "2.00x" in table[2] and "0.50x" in table[3]
    misses = harness.missed(rows)
    assert len(misses) == 2 and misses[0].startswith("dp/b") and misses[1].startswith("pipeline/bubble")
    # summaries carry met as a bool (benchmarks/planner.py): both values print as themselves
    judged = harness.format_table([_row(case="yes", met=True), _row(case="no", met=False)]).splitlines()
    assert judged[2].endswith("True") and judged[3].endswith("False")


def test_bench_cli_rejects_unknown_group_and_lists_groups():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bad = subprocess.run([sys.executable, "-m", "parallel_layers", "bench", "--only", "nope"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown group" in bad.stderr
    ok = subprocess.run([sys.executable, "-m", "parallel_layers", "bench", "--list"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "scaling" in ok.stdout and "benchmarks.zero3" in ok.stdout


def test_bench_suite_smoke_runs_a_group_end_to_end():
    """The suite as a user runs it: one group at smoke sizes, its rows in the one table, exit status 0.
    (Every group's collect() is exercised at smoke sizes by its own test file.)"""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PARALLEL_LAYERS_NO_JIT="1")
    for var in ("PARALLEL_LAYERS_BACKEND", "TRITON_INTERPRET"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "parallel_layers", "bench", "--smoke", "--only", "dp"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("group "))
    rows = [line.split() for line in lines[header + 2:] if line.startswith("dp ")]
    assert {r[1] for r in rows} >= {"dp_overlap_on_vs_off", "dp_stage0_vs_torch_ddp"}, proc.stdout
    assert any(line.startswith("seconds per module: dp/dp") for line in lines), proc.stdout
    assert "targets missed:" in proc.stdout


def test_append_csv_adds_new_columns_to_an_old_file(tmp_path):
    from benchmarks import harness

    path = tmp_path / "old.csv"
    path.write_text("run_id,case,speedup\n1,a,2.0\n")
    harness.append_csv(str(path), [dict(run_id="2", case="b", speedup=3.0, mem_mb=5.0)])
    rows = harness.read_csv(str(path))
    assert [(r["case"], r["speedup"], r["mem_mb"]) for r in rows] == [("a", "2.0", ""), ("b", "3", "5")]


def test_latest_rows_newest_run_per_case():
    from benchmarks import harness

    rows = [_row(case="step", sizes="old model", run_id="1"), _row(case="step", sizes="new model p2", run_id="2"),
            _row(case="step", sizes="new model p4", run_id="2"), _row(case="pack", sizes="n=1", run_id="1"),
            _row(case="step", sizes="new model p2", run_id="3", mode="quick")]
    (device, got), = harness.latest_rows([{k: str(v) for k, v in r.items()} for r in rows]).items()
    # the old model's row is superseded by the newer full run of the same case; a case the newer run
    # skipped keeps its figures; quick rows never replace full ones
    assert sorted((r["case"], r["sizes"], r["run_id"]) for r in got) == [
        ("pack", "n=1", "1"), ("step", "new model p2", "2"), ("step", "new model p4", "2")]


def test_zero_memory_smoke_prints_a_row_per_method():
    """``python -m benchmarks.zero_memory --smoke`` (2 gloo ranks, a tiny GPT) prints the peak-memory table:
    a row per method with a positive peak and step time, or the reason a method cannot run here."""
    from benchmarks.zero_memory import METHODS, skip_reason

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PARALLEL_LAYERS_NO_JIT="1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.zero_memory", "--smoke", "--no-csv"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    lines = proc.stdout.splitlines()
    for name, (label, *_rest) in METHODS.items():
        row = next((line[len(label):].split() for line in lines if line.startswith(label + " ")), None)
        assert row is not None, f"no row for {name}:\n{proc.stdout}"
        if skip_reason(name):
            assert row[1] == "skipped:", row
            continue
        # ranks, start MiB, peak MiB, B/param, alloc MiB, grads MiB, paper, DeepSpeed, step ms, 3 ratios
        assert row[0] == "2" and float(row[2]) > 0 and float(row[3]) > 0 and float(row[8]) > 0, (name, row)
        assert re.fullmatch(r"[0-9.]+x", row[-1]), (name, row)
