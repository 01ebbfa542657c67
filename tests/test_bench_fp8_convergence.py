"""Smoke test of benchmarks/fp8_convergence.py: it trains the demo GPT a few steps in bf16 and in FP8 from the same
weights and batches, prints each variant's losses and gap to bf16, and the rows carry the bound."""
from benchmarks import fp8_convergence


def test_fp8_convergence_benchmark_smoke(capsys, monkeypatch):
    made = []
    collect = fp8_convergence.collect
    monkeypatch.setattr(fp8_convergence, "collect", lambda profile: made.append(collect(profile)) or made[-1])
    assert fp8_convergence.main(["--smoke", "--no-csv"]) == 0
    out = capsys.readouterr().out
    assert "fp8-tensor" in out and "bf16" in out and "bound 1%" in out
    rows, = made
    assert [r["case"] for r in rows] == ["bf16", "fp8-tensor"]
    bf16, fp8 = rows
    assert bf16["val_gap_vs_bf16"] == 0 and bf16["first_loss"] == fp8["first_loss"] or \
        abs(bf16["first_loss"] - fp8["first_loss"]) < 1e-2 * bf16["first_loss"]
    assert all(r["val_loss"] < r["first_loss"] for r in rows)     # it trains
