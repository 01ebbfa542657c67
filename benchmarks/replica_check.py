"""What the replica check costs (``parallel_layers/composition/replica_check.py``).

    python -m benchmarks.replica_check            # full: demo-size GPT, dp2 x tp2 (4 ranks), 60 paired steps
    python -m benchmarks.replica_check --quick    # the same, 16 paired steps
    python -m benchmarks.replica_check --smoke    # tiny GPT, seconds; never writes CSV

Two figures:

* ``checksum``: one process, one thread: the two int64 checksums of a 16M-element fp32 tensor, as a
  fraction of this machine's measured copy bandwidth (bytes read / time), and against ``x.sum()``;
* ``step``: ``Parallel3D`` on the reference GPT at dp2 x tp2, ZeRO-1, the same processes running two
  models from one seed, one checking every step (``ReplicaCheck(first=0, every=1)``: what the test suite
  does) and one never, steps interleaved; the figure is the median of the paired ratios checked /
  unchecked with its 95% bootstrap interval. By default only steps 1-3 and every 100th are checked, so a
  run pays about a hundredth of that overhead.

Rows go to benchmarks/results/replica_check.csv.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from . import harness

CSV_NAME = "replica_check.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
DEMO = dict(vocab_size=256, n_layer=4, d_model=64, n_head=4, max_seq_len=64)
PROFILES = {
    "full": dict(size=DEMO, batch=16, reps=60, warmup=3, numel=1 << 24, sum_reps=20),
    "quick": dict(size=DEMO, batch=16, reps=16, warmup=2, numel=1 << 24, sum_reps=8),
    "smoke": dict(size=dict(vocab_size=64, n_layer=2, d_model=16, n_head=2, max_seq_len=16), batch=8, reps=2,
                  warmup=1, numel=1 << 16, sum_reps=2),
}


def _bench_rank(rank, world, size, batch, reps, warmup):
    from parallel_layers.composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.composition.replica_check import ReplicaCheck
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPTConfig

    mesh = ParallelMesh(dp=2, tp=2, pp=1)
    cfg = GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=True)
    opts = dict(optimizer=OptimizerConfig(lr=1e-3), pipeline=PipelineConfig(schedule="1f1b", num_microbatches=2),
                data_parallel=DataParallelConfig(zero=1), seed=0)
    runs = {"checked": Parallel3D(cfg, mesh, replica_check=ReplicaCheck(first=0, every=1), **opts),
            "unchecked": Parallel3D(cfg, mesh, replica_check=None, **opts)}
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=gen)
    for _ in range(warmup):
        for run in runs.values():
            run.train_step(x, y)
    times = {k: [] for k in runs}
    for i in range(reps):
        for name in (("checked", "unchecked") if i % 2 == 0 else ("unchecked", "checked")):
            times[name].append(harness.slowest_rank_ms(lambda run=runs[name]: run.train_step(x, y)))
    held = sum(t.numel() * t.element_size() for _, t, _ in runs["checked"].mode.held_tensors())
    return dict(times=times, bytes=held)


def _checksum_ms(numel, reps):
    from parallel_layers.composition.replica_check import checksum

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(numel)
        out = {"checksum": [], "sum": []}
        for i in range(reps + 2):
            for name, fn in (("checksum", lambda: checksum(x)), ("sum", lambda: x.sum())):
                t0 = time.perf_counter()
                fn()
                if i >= 2:
                    out[name].append((time.perf_counter() - t0) * 1e3)
        return out
    finally:
        torch.set_num_threads(threads)


def collect(mode: str, device: torch.device, progress=None) -> list:
    """The suite's entry: the CSV rows of ``mode`` (``device`` only names the run: the ranks are gloo on CPU)."""
    p = PROFILES[mode]
    cpu = torch.device("cpu")
    common = harness.common_fields(mode, cpu, 1)
    if progress:
        progress("checksum")
    sums = _checksum_ms(p["numel"], p["sum_reps"])
    nbytes = p["numel"] * 4
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        copy_gbs = harness.copy_bandwidth(cpu, nbytes=max(nbytes, 1 << 20), reps=5)
    finally:
        torch.set_num_threads(threads)
    ck, base = harness.Stats.of(sums["checksum"]), harness.Stats.of(sums["sum"])
    gbs = nbytes / (ck.median_ms * 1e-3) / 1e9
    rows = [harness.comparison_row(common, f"checksum fp32 {p['numel']} elements (1 thread)", ck, base,
                                   baseline=f"x.sum(); {gbs:.2f} GB/s read = {gbs / copy_gbs:.2f} of copy "
                                            f"bandwidth ({copy_gbs:.2f} GB/s, 1 thread)")]
    if progress:
        progress("step, 4 ranks")
    outs = harness.run_ranks(_bench_rank, 4, args=(p["size"], p["batch"], p["reps"], p["warmup"]))
    times = outs[0]["times"]
    ratio = harness.PairedRatio.of(times["checked"], times["unchecked"])
    so, sb = harness.Stats.of(times["checked"]), harness.Stats.of(times["unchecked"])
    row = harness.comparison_row(
        common, "step dp2 x tp2 ZeRO-1, GPT L4 d64, checked every step", so, sb,
        baseline=f"unchecked; checked/unchecked {ratio.median:.3f} (95% CI {ratio.low:.3f}-{ratio.high:.3f}, "
                 f"{len(times['checked'])} pairs); {outs[0]['bytes'] / 1e6:.2f} MB checksummed per rank")
    row["speedup"] = 1.0 / ratio.median        # the paired estimate, not the ratio of the two medians
    rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(parser, "tiny sizes, seconds, no CSV", "fewer repetitions")
    harness.add_csv_args(parser, CSV_PATH)
    args = parser.parse_args(argv)
    rows = collect(harness.profile_of(args), torch.device("cpu"))
    for r in rows:
        print(f"{r['case']}: {r['ours_median_ms']:.3f} ms against {r['base_median_ms']:.3f} ms; {r['baseline']}")
    harness.append_and_report(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
