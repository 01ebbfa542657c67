"""Smoke test of benchmarks/train_step.py: a tiny Llama trained one step at a time through torch eager and through
Parallel3D (bf16 ZeRO-1, and FP8) from the same weights: a row per variant, the same first loss, tokens/s."""
import torch

from benchmarks import train_step


def test_train_step_benchmark_smoke(capsys):
    variants = ("torch eager", "ours bf16", "ours fp8")
    assert train_step.main(["--smoke", "--no-csv", "--device", "cpu", "--variants", ",".join(variants)]) == 0
    out = capsys.readouterr().out
    assert all(v in out for v in variants) and "could not run" not in out, out
    rows = train_step.collect("smoke", torch.device("cpu"), variants=("torch eager", "ours bf16"))
    eager, ours = rows
    assert abs(eager["first_loss"] - ours["first_loss"]) < 1e-2 * eager["first_loss"]   # the same weights
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)             # no CPU peak: no MFU
