"""The dp, ZeRO, pipeline and demo benchmarks' ``collect("smoke")`` returns complete rows for every case.

Nothing here asserts a speed (benchmarks print figures, tests check behaviour): each row has every CSV
column, a positive timing ratio where it compares two timings, and the cases the module promises.
The 2- and 4-rank bodies run in the session's worker pools (``harness.run_ranks`` redirected to them:
starting processes and importing torch is most of a benchmark's smoke time); the demo's 8 ranks are
spawned by ``harness.run_ranks`` itself.
"""
import importlib
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # benchmarks/ is a top-level folder of the repo, not part of the installed package

from benchmarks import demo_layouts, dp, harness, pipeline, torch_native_3d, zero, zero3  # noqa: E402

CPU = torch.device("cpu")


def body_bench(rank, world, module, fn_name, *args):
    """In a pool worker: the benchmark module's rank body (the worker may lack the repo on its path)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    return getattr(importlib.import_module(f"benchmarks.{module}"), fn_name)(rank, world, *args)


def _in_pools(monkeypatch, dist_pools):
    def run_ranks(fn, world, args=(), timeout_s=900, retain_memory=False, bind_cores=False):  # noqa: ARG001
        # (the shared pools run as they are: fresh processes, binding and allocator settings are the real runs')
        return dist_pools(world).run(body_bench, fn.__module__.rsplit(".", 1)[-1], fn.__name__, *args,
                                     timeout=min(timeout_s, 300))
    monkeypatch.setattr(harness, "run_ranks", run_ranks)


def _check(rows, cases, mode="smoke"):
    assert sorted(r["case"] for r in rows) == sorted(cases)
    for r in rows:
        assert set(r) <= set(harness.CSV_FIELDS), set(r) - set(harness.CSV_FIELDS)
        for key in ("run_id", "date", "device", "torch", "triton", "sizes", "dtype", "backend", "baseline"):
            assert r.get(key), (key, r)
        assert r["mode"] == mode and r["threads"] == 1
        if r.get("ours_median_ms", "") != "":
            assert r["ours_median_ms"] > 0
        if r.get("speedup", "") != "":
            assert r["base_median_ms"] > 0 and r["speedup"] > 0
            assert r["ours_p20_ms"] <= r["ours_median_ms"] <= r["ours_p80_ms"]
        if r.get("target"):
            # "reported": a row not judged here (pipeline evaluation, or a zero-bubble row whose target applies
            # at m 8 only); every other row is judged
            assert r["met"] in ("yes", "no", "-", "reported"), r
            assert r["met"] != "reported" or r["target"] == "none (reported)" or r["case"].startswith(
                ("bubble_zb", "step_zb", "act_memory_zb")), r


def test_dp_and_zero_smoke_rows(monkeypatch, dist_pools):
    _in_pools(monkeypatch, dist_pools)
    seen = []
    rows = dp.collect("smoke", CPU, progress=seen.append)
    _check(rows, ["dp_overlap_on_vs_off", "ddp_normal_vs_flat_allreduce", "dp_stage0_vs_torch_ddp",
                  "dp_stage0_unfused_vs_torch_ddp"])
    assert all(r["speedup"] > 0 for r in rows) and len(seen) == 2
    rows = zero.collect("smoke", CPU)
    _check(rows, [f"zero1_{op}_train_step_dp2" for op in zero.REDUCE_OPS]
           + ["collective_reduce_scatter_dp2", "collective_all_gather_dp2"]
           + [f"zero{s}_bytes_per_param_dp2" for s in (1, 2) for _ in ("bf16", "fp32")])
    assert all(r["mem_mb"] > 0 for r in rows if "bytes_per_param" in r["case"])
    rows = zero3.collect("smoke", CPU)
    _check(rows, ["zero3_train_step_dp2", "zero3_peak_memory_dp2"])
    # RSS growth: at smoke sizes a step can fit in memory an earlier phase freed (0 MB, no ratio judged)
    assert rows[0]["speedup"] > 0 and rows[1]["mem_mb"] >= 0


def test_paired_ratio():
    """The median of per-pair ratios, with an interval that holds it; unequal counts are an error."""
    r = harness.PairedRatio.of([11.0, 20.0, 33.0], [10.0, 20.0, 30.0])
    assert r.median == pytest.approx(1.1) and r.low <= r.median <= r.high
    same = harness.PairedRatio.of([5.0] * 8, [5.0] * 8)
    assert (same.median, same.low, same.high) == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="in pairs"):
        harness.PairedRatio.of([1.0, 2.0], [1.0])


def test_torch_native_3d_smoke_row(monkeypatch, dist_pools):
    """Llama at dp2 x tp2 x pp2, Parallel3D against FSDP2 + DTensor + pipelining: a row, and both sides train
    the same model on the same batches (every step's loss agrees)."""
    _in_pools(monkeypatch, dist_pools)
    rows, first = torch_native_3d._run("smoke")
    _check(rows, ["llama_dp2xtp2xpp2_zero3_vs_torch_native"])
    assert abs(first[0] - first[1]) < 1e-5 and rows[0]["speedup"] > 0, (first, rows[0])
    diff = float(rows[0]["baseline"].split("max loss difference over ")[1].split()[2])
    assert diff < 1e-5, rows[0]["baseline"]


def test_pipeline_smoke_rows_and_timeline_pngs(monkeypatch, dist_pools, tmp_path):
    """Two microbatch counts and the PNGs on: the full profile's code paths on the tiny model."""
    _in_pools(monkeypatch, dist_pools)
    monkeypatch.setattr(harness, "RESULTS_DIR", str(tmp_path))
    rows = pipeline.collect("smoke", CPU, ms=[2, 4], png=True)
    per_m = [f"step_{s}" for s in pipeline.SCHEDS] + [f"eval_{s}" for s in pipeline.EVAL_SCHEDS] + [
        "bubble_1f1b", "bubble_interleaved_vs_1f1b", "act_memory_1f1b_over_gpipe",
        # the zero-bubble schedules against 1F1B (issue 36)
        "bubble_zb-h1_over_1f1b", "bubble_zbv_vs_zb-h1", "step_zb-h1_over_1f1b", "act_memory_zb-h1_over_1f1b"]
    _check(rows, per_m * 2)
    assert all(r["met"] == "reported" and r["speedup"] > 0 for r in rows if r["case"].startswith("eval_"))
    for r in rows:
        if r["case"].startswith("bubble"):
            assert "median rep" in r["baseline"] and "schedule" in r["baseline"], r["baseline"]
        if r["case"] == "act_memory_zb-h1_over_1f1b":      # the allocator's peak, ours and torch's
            assert "allocator peak" in r["baseline"] and "torch's zb-h1" in r["baseline"], r["baseline"]
            assert r["mem_mb"] > 0, r
        if r["case"] == "bubble_1f1b":    # the shared pools are not bound
            assert "ranks not bound" in r["baseline"] or "binding unknown" in r["baseline"], r["baseline"]
    pngs = sorted(os.listdir(tmp_path))
    assert pngs == [f"pipeline_timeline_{s}_p2_m4.png" for s in ("1f1b", "interleaved", "zb-h1", "zbv")], pngs


def test_demo_layouts_smoke_rows():
    rows = demo_layouts.collect("smoke", CPU)
    _check(rows, ["demo_tokens_per_s"] * len(demo_layouts.PROFILES["smoke"]["layouts"]))
    names = [r["sizes"] for r in rows]
    assert names[0].startswith("1D") and names[-1].startswith("3D"), names
    for r in rows:
        assert r["ours_median_ms"] > 0 and r["mem_mb"] > 0
        assert float(r["baseline"].split(";")[0].split()[1]) > 0, r["baseline"]   # "tokens/s N; ..."
