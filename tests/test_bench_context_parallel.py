"""The context-parallel benchmark runs end to end at smoke sizes and prints its rows."""
import pytest

pytest.importorskip("transformers")


def test_context_parallel_benchmark_smoke_rows():
    from benchmarks import context_parallel

    rows = context_parallel.collect("smoke")
    cases = [r["case"] for r in rows]
    assert "llama S=64 cp=2 vs cp=1" in cases and any(c.startswith("torch context_parallel") for c in cases)
    row = next(r for r in rows if r["case"] == "llama S=64 cp=2 vs cp=1")
    assert 0 < row["saved_mb"] < row["base_saved_mb"] and row["peak_rss_mb"] > 0
    assert any(c.startswith("longest S within") for c in cases)
