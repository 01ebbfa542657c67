"""Data parallel: our overlapped bucketed all-reduce against torch DDP, gloo ranks on CPU (1 thread each).

    python -m benchmarks.dp                    # full: GPT of ~51M parameters (d 512, 8 layers, vocab 50304, tied)
    python -m benchmarks.dp --quick            # ~7M parameters (d 256, 4 layers, vocab 16384), few reps (~25 s)
    python -m benchmarks.dp --model small      # full reps on the ~7M model
    python -m benchmarks.dp --smoke            # tiny, seconds; never writes CSV

A step is ``zero_grad`` + forward + backward (gradient sync included) of a GPT on ``[1, seq]`` tokens per
rank; the optimizer step is left out (identical for every variant; it only dilutes the ratios). Before every
timed step the ranks meet at a barrier; a step's time is the slowest rank's (all-reduce MAX, outside the
timed region). Variants run interleaved, rep by rep, in the same processes on the same data; median of the
timed reps after warm-up.

(a) 2 ranks: ours overlap on vs off (off: every bucket's all-reduce after backward) -> ratio (target <= 0.9);
    torch DDP (normal) vs DDP with ``no_sync()`` backward + one flat all-reduce of all gradients -> DDP's own
    ratio. Target: our gain at least as large as DDP's.
(b) 4 ranks: our stage 0 (overlap) vs ``torch.nn.parallel.DistributedDataParallel`` with the same bucket
    size (25 MB) -> ratio (target <= 1.0). Reported beside it, without a target: ours with
    ``fuse_grad_accumulation=False`` (the tied embedding / LM head gradient through autograd, as under DDP)
    vs DDP, which says how much of the difference is that fusion.
On a 2-core machine 4 ranks oversubscribe the cores: (b) then measures overheads under contention.
Ranks keep freed memory for reuse (``harness.run_ranks(retain_memory=True)``, see
``parallel_layers.cpu_allocator``), as a CPU training job should run; the torch baselines share the
processes, so they get it too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "dp.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 25
MODELS = {  # name: (vocab, n_layer, n_head, d_model, seq)
    "50m": (50304, 8, 8, 512, 128),
    "small": (16384, 4, 4, 256, 128),
    "smoke": (512, 2, 2, 64, 16),
}
# mode -> model, timed reps, warm-up steps, parts ("a": 2 ranks, "b": 4 ranks)
PROFILES = {
    "smoke": dict(model="smoke", reps=2, warmup=1, parts="ab"),
    "quick": dict(model="small", reps=5, warmup=1, parts="ab"),
    "full": dict(model="50m", reps=10, warmup=2, parts="ab"),
}
BUCKET_MB = 25
PART_WORLD = {"a": 2, "b": 4}   # part -> ranks


def _bench_rank(rank: int, world: int, model_name: str, part: str, reps: int, warmup: int):
    """One rank of part ``part``: the variants' step times (ms, slowest rank's), parameter count and the
    last overlapped step's sync timeline report."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from parallel_layers.data_parallel import DataParallel, overlap_report
    from parallel_layers.models import GPT, GPTConfig

    V, L, H, D, S = MODELS[model_name]
    cfg = GPTConfig(vocab_size=V, n_layer=L, n_head=H, d_model=D, max_seq_len=S, dropout=0.0)

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    gen = torch.Generator().manual_seed(rank)
    idx = torch.randint(0, V, (1, S), generator=gen)
    tgt = torch.randint(0, V, (1, S), generator=gen)
    variants = {"ours_overlap": DataParallel(build(), dist.group.WORLD, bucket_cap_mb=BUCKET_MB)}
    if part == "a":
        variants["ours_no_overlap"] = DataParallel(build(), dist.group.WORLD, bucket_cap_mb=BUCKET_MB, overlap=False)
        variants["ddp"] = DDP(build(), bucket_cap_mb=BUCKET_MB)
        variants["ddp_flat"] = DDP(build(), bucket_cap_mb=BUCKET_MB)
    else:
        variants["ours_unfused"] = DataParallel(build(), dist.group.WORLD, bucket_cap_mb=BUCKET_MB,
                                                fuse_grad_accumulation=False)
        variants["ddp"] = DDP(build(), bucket_cap_mb=BUCKET_MB)

    def step(name, m):
        m.zero_grad()      # set_to_none=True, torch's default, for every variant
        if name == "ddp_flat":
            with m.no_sync():
                m(idx, tgt)[1].backward()
            grads = [p.grad for p in m.parameters()]
            flat = torch._utils._flatten_dense_tensors(grads).div_(world)
            dist.all_reduce(flat)
            for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(f)
        else:
            m(idx, tgt)[1].backward()

    times = {n: [] for n in variants}
    for i in range(warmup + reps):
        names = list(variants) if i % 2 == 0 else list(reversed(variants))   # alternate who goes first
        for n in names:
            step_ms = harness.slowest_rank_ms(lambda: step(n, variants[n]))
            if i >= warmup:
                times[n].append(step_ms)
    overlap = overlap_report(variants["ours_overlap"].last_sync_timeline)
    n_params = sum(p.numel() for p in variants["ddp"].module.parameters())
    return times, n_params, overlap


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            **overrides) -> List[dict]:
    """Run the benchmark (``mode``: smoke | quick | full, see ``PROFILES``; ``overrides`` replace profile
    entries: model, reps, warmup, parts) and return the CSV rows. Writes no CSV; prints per-variant
    medians to stderr. ``device`` only names the run: the ranks are gloo processes on CPU."""
    prof = dict(PROFILES[mode])
    prof.update({k: v for k, v in overrides.items() if v is not None})
    model, reps, warmup = prof["model"], prof["reps"], prof["warmup"]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32")
    med = statistics.median
    rows: List[dict] = []
    for part in "ab":
        if part not in prof["parts"]:
            continue
        world = PART_WORLD[part]
        if progress:
            progress(f"({part}) {world} ranks, {model}")
        times, n_params, overlap = harness.run_ranks(_bench_rank, world, (model, part, reps, warmup),
                                                     timeout_s=1800, retain_memory=True)[0]
        c = dict(common, backend=f"gloo x{world}", sizes=f"{model}:{n_params / 1e6:.1f}M params")
        _note(f"dp ({part}) {world} ranks, {c['sizes']}; last overlapped step: "
              f"{overlap['launched_before_backward_end']} of {overlap['buckets']} buckets launched before "
              f"backward ended")
        for n, t in times.items():
            _note(f"    {n:16s} median {med(t):9.1f} ms   (reps {len(t)})")
        if part == "a":
            ours_ratio = med(times["ours_overlap"]) / med(times["ours_no_overlap"])
            ddp_ratio = med(times["ddp"]) / med(times["ddp_flat"])
            _note(f"    ours overlap/no-overlap = {ours_ratio:.3f}x (target <= 0.9); "
                  f"DDP normal/flat = {ddp_ratio:.3f}x; ours gain >= DDP's: {ours_ratio <= ddp_ratio}")
            rows.append(harness.comparison_row(
                c, "dp_overlap_on_vs_off", times["ours_overlap"], times["ours_no_overlap"],
                target="time ratio<=0.9", met="yes" if ours_ratio <= 0.9 else "no", baseline="ours overlap=False"))
            rows.append(harness.comparison_row(
                c, "ddp_normal_vs_flat_allreduce", times["ddp"], times["ddp_flat"],
                target=f"ours ratio {ours_ratio:.3f} <= this", met="yes" if ours_ratio <= ddp_ratio else "no",
                baseline="DDP no_sync + one flat all-reduce"))
        else:
            ratio = med(times["ours_overlap"]) / med(times["ddp"])
            unfused = med(times["ours_unfused"]) / med(times["ddp"])
            _note(f"    ours stage0 / torch DDP = {ratio:.3f}x (target <= 1.0); without gradient-accumulation "
                  f"fusion {unfused:.3f}x")
            rows.append(harness.comparison_row(
                c, "dp_stage0_vs_torch_ddp", times["ours_overlap"], times["ddp"], target="time ratio<=1.0",
                met="yes" if ratio <= 1.0 else "no",
                baseline=f"torch DistributedDataParallel bucket_cap_mb={BUCKET_MB}"))
            rows.append(harness.comparison_row(
                c, "dp_stage0_unfused_vs_torch_ddp", times["ours_unfused"], times["ddp"], target="-", met="-",
                baseline=f"torch DistributedDataParallel bucket_cap_mb={BUCKET_MB}"))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny model, 2 reps: checks the program runs; never writes CSV",
                             quick_help=f"~7M-parameter model, few reps (~{QUICK_BUDGET_S} s)")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default: the mode's profile")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--parts", default=None, help="a: overlap gain at 2 ranks; b: vs DDP at 4 ranks (default ab)")
    ap.add_argument("--csv", default=None, help=f"CSV to append to (default {os.path.relpath(CSV_PATH)})")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows = collect(mode, torch.device("cpu"), model=args.model, reps=args.reps, warmup=args.warmup, parts=args.parts)
    print(f"({time.time() - t0:.1f} s)")
    harness.print_and_append(rows, harness.csv_target(args, args.csv or CSV_PATH))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
