"""Smoke test of benchmarks/fp8_layers.py: it runs at tiny sizes, prints a row per case (fp32 and the four FP8
recipes against bf16 nn.Linear) with the step time and the bytes saved for backward, and says on CPU that FP8
is expected slower there."""
import torch

from benchmarks import fp8_layers
from parallel_layers.planner.fp8 import FP8Gemm, saved_bytes


def test_fp8_layers_benchmark_smoke(capsys):
    assert fp8_layers.main(["--smoke", "--no-csv", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert all(f"fp8_{r}" in out for r in fp8_layers.RECIPES) and "fp32" in out
    assert "expected slower" in out
    rows = fp8_layers.collect("smoke", torch.device("cpu"))
    assert [r["case"] for r in rows] == ["fp32"] + [f"fp8_{r}" for r in fp8_layers.RECIPES]
    assert all(r["ours_median_ms"] > 0 and r["base_median_ms"] > 0 for r in rows)
    m = n = 128
    for r in rows:
        assert r["base_saved_mb"] * 2**20 == m * n * 2            # bf16 nn.Linear keeps its input
        if r["case"].startswith("fp8_"):                          # FP8Linear: the planner's formula, measured
            assert r["saved_mb"] * 2**20 == saved_bytes(FP8Gemm("l", m, n, n), r["case"][4:])
