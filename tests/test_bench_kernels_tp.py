"""The suite contract of benchmarks.kernels, .matmul, .tp and .cross_entropy: ``collect`` returns finished
CSV rows, writes no CSV, and a case that fails leaves an error row instead of hiding the others.

Tiny sizes; nothing here asserts a speed."""
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a top-level folder of the repo, not part of the installed package

from benchmarks import cross_entropy, harness, kernels, matmul, tp  # noqa: E402

CPU = torch.device("cpu")
CORE = {"run_id", "date", "mode", "case", "sizes", "dtype", "backend", "device", "torch", "triton", "threads",
        "target", "met", "baseline"}


@pytest.fixture
def csvs_untouched():
    """collect must not write any CSV: every file under benchmarks/results/ is the same afterwards."""
    def snapshot():
        return {name: os.path.getsize(os.path.join(harness.RESULTS_DIR, name))
                for name in os.listdir(harness.RESULTS_DIR) if name.endswith(".csv")}
    before = snapshot()
    yield
    assert snapshot() == before


def _check_timed(rows, mode):
    for r in rows:
        assert CORE <= set(r), sorted(CORE - set(r))
        assert r["mode"] == mode and r["met"] in ("yes", "no", "-"), r
        assert r["ours_median_ms"] > 0 and r["base_median_ms"] > 0
        assert r["speedup"] == pytest.approx(r["base_median_ms"] / r["ours_median_ms"])


def test_module_constants():
    assert kernels.CSV_NAME == "kernels.csv" and matmul.CSV_NAME == "matmul.csv"
    assert tp.CSV_NAME == cross_entropy.CSV_NAME == "tp.csv"
    assert kernels.QUICK_BUDGET_S <= 50 and tp.QUICK_BUDGET_S + cross_entropy.QUICK_BUDGET_S <= 25


def test_kernels_on_cuda_measure_both_fused_backends():
    # The kernel table shows Triton and CUDA side by side; an unavailable one must show up as error rows,
    # not silently vanish, so the list does not depend on what this machine has.
    assert kernels.default_backends(torch.device("cuda")) == ["triton", "cuda"]


def test_kernels_failure_is_a_row_and_the_other_cases_still_run(monkeypatch, csvs_untouched):
    def broken(ctx):
        raise ValueError("boom\nsecond line")

    monkeypatch.setitem(kernels.CASES, "broken", broken)
    seen = []
    rows = kernels.collect("smoke", CPU, seen.append, cases=["broken", "sgd_flat"], backends=["torch", "cuda"],
                           out=open(os.devnull, "w"))
    assert [(r["case"], r["backend"]) for r in rows] == [("broken", "torch"), ("broken", "cuda"),
                                                          ("sgd_flat", "torch"), ("sgd_flat", "cuda")]
    assert seen == ["broken [torch]", "broken [cuda]", "sgd_flat [torch]", "sgd_flat [cuda]"]
    err = [r for r in rows if r["met"] == "error"]
    assert len(err) == 3 and "boom second line" in err[0]["baseline"]
    assert all(r["baseline"].startswith("error: ") and "\n" not in r["baseline"] for r in err)
    assert "cannot run on cpu" in err[-1]["baseline"]          # the CUDA backend on a CPU tensor
    good = [r for r in rows if r["met"] != "error"]
    _check_timed(good, "smoke")
    assert good[0]["copy_gbps"] > 0 and good[0]["bw_fraction"] == pytest.approx(good[0]["gbps"] / good[0]["copy_gbps"])
    assert all(CORE <= set(r) for r in rows)


def test_matmul_measures_nothing_on_cpu_outside_smoke(csvs_untouched):
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert matmul.collect("quick", CPU) == [] and matmul.collect("full", CPU) == []
    rows = matmul.collect("smoke", CPU)
    assert len({(r["case"], r["sizes"], r["dtype"], r["backend"]) for r in rows}) == len(rows) == 2
    assert all(r["backend"] == "torch(cpu-reference)" and "TFLOP/s" in r["baseline"] for r in rows)
    _check_timed(rows, "smoke")


def test_tp_smoke_rows(csvs_untouched):
    rows = tp.collect("smoke", CPU)
    assert [r["case"] for r in rows] == ["gpt_block_fwd_bwd_tp2"]
    _check_timed(rows, "smoke")
    assert rows[0]["max_diff"] < 1e-4


def test_cross_entropy_smoke_rows_and_environment_restored(csvs_untouched):
    before = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    rows = cross_entropy.collect("smoke", CPU)
    assert os.environ.get("MALLOC_MMAP_THRESHOLD_") == before   # later benchmarks must not inherit it
    assert [r["case"] for r in rows] == ["vocab_ce", "vocab_ce_no_inplace"]
    _check_timed(rows, "smoke")
    assert all(r["mem_mb"] >= 0 and "peak extra MB" in r["baseline"] for r in rows)
