"""Smoke test of benchmarks/gemm_efficiency.py (the planner's measured matmul and attention rates) and of the
harness keeping a benchmark's own CSV columns."""
import csv

import torch

from benchmarks import gemm_efficiency, harness


def test_gemm_efficiency_smoke_counts_flops_of_each_case():
    rows = gemm_efficiency.collect("smoke", torch.device("cpu"))
    cases = [(r["case"], r["sizes"]) for r in rows]
    assert cases == [("gemm", "M64 N128 K64"), ("gemm", "M128 N64 K128"), ("gemm", "M64 N64 K256"),
                     ("gemm", "M256 N128 K64"), ("attention_fwd", "b1 h2 s64 d32"),
                     ("attention_fwd_bwd", "b1 h2 s64 d32")]
    gemm = rows[0]
    assert abs(gemm["tflops"] - 2 * 64 * 128 * 64 / (gemm["ours_median_ms"] / 1e3) / 1e12) < 1e-12
    fwd, both = rows[4], rows[5]
    fwd_flops = 4 * 1 * 2 * 64 * 64 * 32 / 2
    assert abs(fwd["tflops"] * fwd["ours_median_ms"] / 1e3 * 1e12 - fwd_flops) < 1e-3 * fwd_flops
    assert abs(both["tflops"] * both["ours_median_ms"] / 1e3 * 1e12 - 3.5 * fwd_flops) < 1e-3 * fwd_flops
    assert all(r["efficiency"] is None and r["dtype"] == "fp32" for r in rows)   # no data sheet for a CPU


def test_transformer_shapes_cover_tp_splits():
    shapes = gemm_efficiency.gemm_shapes("quick")
    assert (8192, 3 * 4096, 4096) in shapes and (8192, 3 * 4096 // 4, 4096) in shapes   # QKV at tp 1 and 4
    assert (8192, 4096, 14336 // 4) in shapes                                            # down projection, tp 4
    assert len(shapes) == len(set(shapes))


def test_csv_keeps_a_benchmarks_own_columns(tmp_path):
    path = str(tmp_path / "rows.csv")
    harness.append_csv(path, [dict(case="a", tflops=1.5, efficiency=0.5)])
    harness.append_csv(path, [dict(case="b", tflops=2.0, mfu=0.25)])    # a new column rewrites the header
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["case"], r["tflops"], r["efficiency"], r["mfu"]) for r in rows] == [("a", "1.5", "0.5", ""),
                                                                                    ("b", "2", "", "0.25")]
