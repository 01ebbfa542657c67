"""ZeRO-Offload on a GPU: a training step with the optimizer state in pinned host memory (stepped by the CPU
kernel) against the same step with the state on the GPU, and how much of the gradients' trip to the host
hides behind backward.

    python -m benchmarks.host_offload --quick    # GPT d 1024 x 8 layers (~110M parameters), bf16
    python -m benchmarks.host_offload            # GPT d 2048 x 16 layers (~0.8B parameters), bf16
    python -m benchmarks.host_offload --smoke    # tiny; on a machine without CUDA it says why it cannot run

One process, one GPU (``make gpu-check`` runs ``--quick``), every CPU core's threads for the CPU step.
The reference GPT in bf16 under ``ZeroStage3`` (dp 1, a unit per block, bf16 gradient shard) trained
three ways side by side, one full step (forward, backward, optimizer step, ``torch.cuda.synchronize``) of
each in turn, the order rotating every rep: ``ZeroStage3Optimizer`` in GPU memory (the baseline),
``offload="cpu"``, and ``offload="cpu", offload_delayed_update=True`` (its step overlaps the next
forward and backward; it changes results: see ``parallel_layers.zero.host_offload``).

Reported per offloaded variant: step time against the baseline, the CPU step's time, gradient bytes
down and parameter bytes up per step and their rate over the step, and the overlap fraction: of the
time the gradient copies took on their stream, the share that ran before backward's last kernel
(``HostShard.overlap_fraction``; 1.0: the copies hid entirely behind backward).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness
from .zero import seeded_gpt, size_text

CSV_NAME = "host_offload.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
LR = 1e-4
PROFILES = {
    "full": dict(size=dict(vocab_size=32768, n_layer=16, d_model=2048, n_head=16, max_seq_len=512, batch=8),
                 reps=5, warmup=2),
    "quick": dict(size=dict(vocab_size=32768, n_layer=8, d_model=1024, n_head=16, max_seq_len=512, batch=8),
                  reps=4, warmup=2),
    "smoke": dict(size=dict(vocab_size=256, n_layer=2, d_model=64, n_head=2, max_seq_len=32, batch=2),
                  reps=2, warmup=1),
}
VARIANTS = {"memory": {}, "offload": dict(offload="cpu"),
            "offload_delayed": dict(offload="cpu", offload_delayed_update=True)}


def _rank(rank: int, world: int, size: dict, reps: int, warmup: int):
    import torch.distributed as dist

    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.set_num_threads(os.cpu_count() or 1)       # the CPU step's threads
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, size["vocab_size"], (size["batch"], size["max_seq_len"]), generator=gen).to(dev)
    y = torch.roll(x, -1, dims=1)
    runs = {}
    for kind, options in VARIANTS.items():
        model = seeded_gpt(size, torch.bfloat16).to(dev)
        z = ZeroStage3(model, dist.group.WORLD, min_unit_numel=0, grad_dtype=torch.bfloat16)
        opt = ZeroStage3Optimizer(z, lr=LR, weight_decay=0.01, **options)
        if opt.host_shard is not None:
            opt.host_shard.timing = True
        runs[kind] = (z, opt)
    n_params = sum(u.numel for u in runs["memory"][0].units)
    times = {kind: [] for kind in runs}
    overlap = {kind: [] for kind in runs}
    kinds = list(runs)
    for rep in range(warmup + reps):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            z, opt = runs[kind]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, loss = z(x, y)
            loss.backward()
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            if rep >= warmup:
                times[kind].append((time.perf_counter() - t0) * 1e3)
                if opt.host_shard is not None:
                    overlap[kind].append(opt.host_shard.overlap_fraction(end))
            elif opt.host_shard is not None:
                opt.host_shard.overlap_fraction(end)        # drop the warm-up's records
    out = {"params": n_params, "threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(dev),
           "memory": times["memory"]}
    for kind in ("offload", "offload_delayed"):
        z, opt = runs[kind]
        st = opt.host_shard.stats
        out[kind] = dict(times=times[kind], overlap=overlap[kind], cpu_step_ms=st["cpu_step_s"] / st["steps"] * 1e3,
                         d2h=st["d2h_bytes"] / (warmup + reps), h2d=st["h2d_bytes"] / max(st["steps"], 1),
                         host_mb=opt.host_shard.host_bytes / 2**20)
        opt.close_offload()
    out["gpu_state_mb"] = runs["memory"][1].memory_report()["optimizer_bytes"] / 2**20
    return out


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: rows on a CUDA machine, none elsewhere (a CPU model has nothing to offload)."""
    if not torch.cuda.is_available():
        return []
    prof = PROFILES[mode]
    if progress:
        progress(f"ZeRO-Offload, {size_text(prof['size'])}")
    out = harness.run_ranks(_rank, 1, (prof["size"], prof["reps"], prof["warmup"]), timeout_s=1800)[0]
    common = dict(harness.common_fields(mode, torch.device("cuda"), out["threads"]), backend="cuda + cpp",
                  dtype="bfloat16")
    sizes = f"{size_text(prof['size'])} ({out['params'] / 1e6:.0f}M params)"
    base = harness.Stats.of(out["memory"])
    rows = []
    for kind in ("offload", "offload_delayed"):
        r = out[kind]
        ours = harness.Stats.of(r["times"])
        step_s = ours.median_ms / 1e3
        frac = harness.Stats.of(r["overlap"]).median_ms if r["overlap"] else float("nan")
        rows.append(harness.comparison_row(
            common, f"zero3_{kind}_train_step", ours, base, sizes=sizes,
            gbps=(r["d2h"] + r["h2d"]) / step_s / 1e9, baseline="ZeroStage3Optimizer in GPU memory", target="-",
            met="-", mem_mb=r["host_mb"],
            x=(f"overlap {frac:.2f}, CPU step {r['cpu_step_ms']:.0f} ms, {r['d2h'] / 2**20:.0f} MiB down "
               f"{r['h2d'] / 2**20:.0f} MiB up per step, {out['gpu_state_mb']:.0f} MiB of state off the GPU")))
    return rows


def _refusal_on_cpu() -> str:
    """What offload='cpu' says on a CPU model (the smoke run on a machine without CUDA)."""
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    try:                 # no process group: a group of one
        ZeroStage3Optimizer(ZeroStage3(torch.nn.Linear(4, 4), None), offload="cpu")
    except ValueError as exc:
        return str(exc)
    return "(no error: this should not happen on a CPU model)"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.host_offload", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes; never writes CSV", quick_help="GPT d 1024 x 8 layers")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    if not torch.cuda.is_available():
        print("no CUDA device: ZeRO-Offload moves the optimizer state off a GPU, and a CPU model has nothing to "
              "move. What offload='cpu' says on one:\n  " + _refusal_on_cpu())
        print("The CPU half (the AdamW kernel the offloaded step runs) is measured by python -m benchmarks.cpu_adam")
        return 0
    rows = collect(mode, torch.device("cuda"), progress=lambda what: print(what, flush=True))
    for r in rows:
        print(f"{r['case']:<34} {r['ours_median_ms']:8.1f} ms vs {r['base_median_ms']:8.1f} ms in GPU memory "
              f"({r['base_median_ms'] / r['ours_median_ms']:.2f}x); {r['x']}; PCIe {r['gbps']:.1f} GB/s")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
