"""Smoke test of benchmarks/fp8_cast.py: it runs at tiny sizes, prints a row per case and dtype, and every
row says ours is bit-identical to the torch baseline."""
import torch

from benchmarks import fp8_cast


def test_fp8_cast_benchmark_smoke(capsys):
    assert fp8_cast.main(["--smoke", "--no-csv", "--device", "cpu", "--backend", "torch"]) == 0
    rows = fp8_cast.collect("smoke", torch.device("cpu"), "cpp")
    assert len(rows) == 2 * len(fp8_cast.cases(torch.zeros(128, 128), "cpp"))
    assert all(r["exact"] == "yes" and r["ours_median_ms"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert all(name in out for name in ("amax_then_cast", "cast_with_amax", "cast_transpose", "blockwise_1x128"))
