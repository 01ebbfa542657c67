"""The CPU AdamW step that ZeRO-Offload and ZeRO-Infinity run on the host: our C++ flat-shard kernel against
torch's CPU AdamW, at 1 thread and at every core, with the fraction of the machine's memory bandwidth.

    python -m benchmarks.cpu_adam --quick      # 16M elements
    python -m benchmarks.cpu_adam              # 64M elements (a 1 GiB shard: fp32 param, grad, two moments)
    python -m benchmarks.cpu_adam --smoke      # tiny, never writes CSV

Ours: ``parallel_layers.ops.adamw_step(..., backend="cpp")`` on one flat fp32 shard (the kernel the ZeRO
optimizers call per run of a shard, offloaded or not): one pass, vectorised (AVX-512/AVX2), split over
torch's threads with ``at::parallel_for``. Baselines: ``torch.optim.AdamW`` on one parameter of the same
size, as it ships: the default for a CPU tensor (the single-tensor loop), ``foreach=True`` and
``fused=True``. Same hyper-parameters (weight decay on), interleaved repetitions, each side's own
tensors; torch's step counter is a CPU tensor as ours is.

Elements per second and the ratio (DeepSpeed reports 5-7x for its CPU Adam against torch's of 2020, the
single-tensor loop). Memory traffic: an AdamW step must read the parameter, the gradient and both
moments and write the parameter and the moments, 28 bytes per element; the fraction is those bytes over
the step time against a STREAM-like copy (``dst.copy_(src)`` of 256 MiB, read + write counted) measured at
the same thread count. torch's loop and foreach implementations make several passes (and allocate
temporaries), so they move more than 28 bytes per element; their fraction counts the 28 all the same.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "cpu_adam.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
LR, WD, BETAS = 1e-3, 0.01, (0.9, 0.999)
BYTES_PER_ELEMENT = 28           # read p, g, m, v; write p, m, v (fp32)
PROFILES = {"full": dict(numel=64 << 20, reps=7, warmup=2, copy_mb=256),
            "quick": dict(numel=16 << 20, reps=5, warmup=1, copy_mb=256),
            "smoke": dict(numel=1 << 18, reps=2, warmup=1, copy_mb=8)}
BASELINES = {"loop": dict(), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def thread_counts() -> List[int]:
    """1 and every core (just 1 on a one-core machine)."""
    return sorted({1, max(1, os.cpu_count() or 1)})


def _ours(n: int) -> Callable[[], None]:
    from parallel_layers.ops import adamw_step

    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    m, v, step = torch.zeros(n), torch.zeros(n), torch.zeros(1)

    def run():
        step.add_(1)
        adamw_step(p, g, m, v, lr=LR, step=step, beta1=BETAS[0], beta2=BETAS[1], weight_decay=WD, backend="cpp")
    return run


def _torch(n: int, options: dict) -> Optional[Callable[[], None]]:
    """torch.optim.AdamW with ``options`` over one parameter of ``n`` elements (None if torch refuses them)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n, generator=gen))
    p.grad = torch.randn(n, generator=gen) * 1e-2
    try:
        opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, weight_decay=WD, **options)
        opt.step()                      # builds the state (and fails here if the option is not supported)
    except (RuntimeError, ValueError):
        return None
    return opt.step


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: one row per (thread count, torch baseline); CPU only whatever ``device`` says."""
    prof = PROFILES[mode]
    n = prof["numel"]
    cpu = torch.device("cpu")
    old_threads = torch.get_num_threads()
    rows = []
    try:
        for threads in thread_counts():
            torch.set_num_threads(threads)
            if progress:
                progress(f"CPU AdamW, {threads} thread(s)")
            copy = harness.copy_bandwidth(cpu, prof["copy_mb"] << 20)
            inplace = harness.copy_bandwidth(cpu, prof["copy_mb"] << 20, inplace=True)
            common = dict(harness.common_fields(mode, cpu, threads), backend="cpp", dtype="float32",
                          copy_gbps=copy, inplace_gbps=inplace)
            ours = _ours(n)
            for name, options in BASELINES.items():
                base = _torch(n, options)
                if base is None:
                    continue
                t_ours, t_base = harness.compare(ours, base, cpu, prof["reps"], prof["warmup"])
                gbps = BYTES_PER_ELEMENT * n / (t_ours.median_ms * 1e-3) / 1e9
                base_gbps = BYTES_PER_ELEMENT * n / (t_base.median_ms * 1e-3) / 1e9
                rows.append(harness.comparison_row(
                    common, f"cpu_adamw_vs_torch_{name}", t_ours, t_base, sizes=f"{n >> 20}M elements",
                    gbps=gbps, bw_fraction=gbps / copy, base_gbps=base_gbps, base_bw_fraction=base_gbps / copy,
                    baseline=f"torch.optim.AdamW({', '.join(f'{k}=True' for k in options) or 'default: loop'})",
                    target="-", met="-", x=f"{n / (t_ours.median_ms * 1e-3) / 1e9:.2f}G elem/s ours, "
                                          f"{n / (t_base.median_ms * 1e-3) / 1e9:.2f}G torch"))
                del base
            del ours
            harness.free_memory(cpu)
    finally:
        torch.set_num_threads(old_threads)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_adam", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes; never writes CSV", quick_help="16M elements")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    print(f"device: {harness.device_name(torch.device('cpu'))} | torch {torch.__version__} | mode: {mode}")
    rows = collect(mode, torch.device("cpu"), progress=lambda what: print(what, flush=True))
    for r in rows:
        print(f"  {r['threads']} thread(s) {r['case']:<28} ours {r['ours_median_ms']:8.1f} ms  "
              f"{r['baseline']:<40} {r['base_median_ms']:8.1f} ms  {r['speedup']:5.2f}x  ({r['x']}); "
              f"ours {r['gbps']:.1f} GB/s = {r['bw_fraction']:.2f} of copy {r['copy_gbps']:.1f} GB/s "
              f"(in place {r['inplace_gbps']:.1f}), torch {r['base_bw_fraction']:.2f}")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
