"""ZeRO stage 1 against ``torch.distributed.optim.ZeroRedundancyOptimizer``, and bytes per parameter per stage.

    python -m benchmarks.zero            # full: a ~10M-parameter GPT, 2 gloo ranks on CPU
    python -m benchmarks.zero --quick    # a ~3M-parameter GPT, few reps (see PROFILES)
    python -m benchmarks.zero --smoke    # tiny sizes, seconds; never writes CSV

Two processes (one thread each) form a data-parallel group of 2. On every rank, from one seed, the same
GPT is trained two ways, back to back and interleaved (``harness.compare``), one full step each call
(forward, backward, optimizer step, zero grad) on the rank's half of the batch:

* ours: ``DataParallel(reduce_op="reduce_scatter")`` + ``ZeroOptimizer(stage=1)``: buckets reduce-scattered
  during backward, one fused AdamW over the rank's flat shard, one all-gather per bucket (on gloo: one
  broadcast per shard, faster there); and the same with ``reduce_op="all_reduce"`` (gradients all-reduced
  during backward, the shard sliced out: gloo's reduce-scatter is an emulation slower than all-reduce);
* baseline: ``torch.nn.parallel.DistributedDataParallel`` (same bucket size) +
  ``ZeroRedundancyOptimizer(optimizer_class=torch.optim.AdamW)``: gradients all-reduced, each rank steps
  the whole tensors assigned to it, then parameters are broadcast.

Target: ours at most 1.0x the baseline's step time (speedup >= 1.0). Then the memory table: for stages 1
and 2, fp32 and bf16 parameters, the bytes per parameter a rank holds (measured by ``memory_report()``)
beside the ZeRO paper's 2 + 2 + 12 divided as each stage divides them. Rows go to
``benchmarks/results/zero.csv`` (stage 3 against FSDP2: ``benchmarks/zero3.py``, same CSV).
Ranks keep freed memory for reuse (``harness.run_ranks(retain_memory=True)``, see
``parallel_layers.cpu_allocator``), as a CPU training job should run; the torch baselines share the
processes, so they get it too.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "zero.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 15          # with benchmarks/zero3.py (same CSV, same suite group): ~30 s together
WORLD = 2
# mode -> GPT config (vocab, n_layer, d_model, n_head, seq), the global batch, timed reps and warm-up steps
PROFILES = {
    "full": dict(size=dict(vocab_size=8192, n_layer=4, d_model=384, n_head=6, max_seq_len=64, batch=4),
                 reps=9, warmup=2, coll_bytes=25 << 20),
    "quick": dict(size=dict(vocab_size=8192, n_layer=2, d_model=256, n_head=4, max_seq_len=64, batch=4),
                  reps=5, warmup=1, coll_bytes=8 << 20),
    "smoke": dict(size=dict(vocab_size=128, n_layer=1, d_model=32, n_head=2, max_seq_len=16, batch=4),
                  reps=3, warmup=1, coll_bytes=1 << 16),
}
BUCKET_MB = 25.0
TARGET = 1.0
LR = 1e-4
BASELINE = "DDP + ZeroRedundancyOptimizer(AdamW)"
# Stage 1 either reduce-scatters (half the traffic on NCCL) or all-reduces and slices (faster on gloo,
# whose reduce-scatter is an emulation): both are measured.
REDUCE_OPS = ("reduce_scatter", "all_reduce")


def size_text(size: dict) -> str:
    return f"V{size['vocab_size']}xL{size['n_layer']}xd{size['d_model']}xs{size['max_seq_len']}xb{size['batch']}"


def seeded_gpt(size: dict, dtype=None):
    """The GPT of ``size`` (its ``batch`` left out), dropout off, drawn from seed 0 (same on every rank)."""
    from parallel_layers.models import GPT, GPTConfig

    cfg = {k: v for k, v in size.items() if k != "batch"}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg, dropout=0.0))
    return model if dtype is None else model.to(dtype)


def _measure_speed(group, rank: int, size: dict, reps: int, warmup: int, reduce_op: str):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    ours = DataParallel(seeded_gpt(size), group, reduce_op=reduce_op, bucket_cap_mb=BUCKET_MB)
    opt = ZeroOptimizer(ours, stage=1, lr=LR, weight_decay=0.01)
    theirs = DistributedDataParallel(seeded_gpt(size), process_group=group, bucket_cap_mb=BUCKET_MB)
    zro = ZeroRedundancyOptimizer(theirs.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                  lr=LR, weight_decay=0.01)
    n_params = sum(p.numel() for p in theirs.parameters())
    gen = torch.Generator().manual_seed(1 + rank)
    b = size["batch"] // WORLD
    x = torch.randint(0, size["vocab_size"], (b, size["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses = {"ours": [], "theirs": []}

    def step(model, optim, key):
        def run():
            _, loss = model(x, y)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[key].append(loss.item())
        return run

    t_ours, t_base = harness.compare(step(ours, opt, "ours"), step(theirs, zro, "theirs"),
                                     torch.device("cpu"), reps, warmup)
    # same data, same init, same updates: the loss curves agree up to rounding
    diff = harness.max_abs_diff(losses["ours"], losses["theirs"])
    return n_params, t_ours, t_base, diff


def _memory_reports(group, size: dict) -> List[dict]:
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    reports = []
    for dtype in (torch.bfloat16, torch.float32):
        for stage in (1, 2):
            dp = DataParallel(seeded_gpt(size, dtype), group, reduce_op="reduce_scatter", bucket_cap_mb=BUCKET_MB)
            opt = ZeroOptimizer(dp, stage=stage, lr=LR)
            rep = opt.memory_report()
            rep["dtype"] = str(dtype).replace("torch.", "")
            reports.append(rep)
            del dp, opt
    return reports


def _measure_collectives(group, nbytes: int, reps: int, warmup: int):
    """ZeRO's two collectives on gloo: ours (``collectives.*_dim0``: a ring of sends and receives) against
    torch's ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` on the same buffers. Each call starts
    at a barrier; its time is the slowest rank's. Returns {name: (ours ms list, torch ms list)}."""
    import warnings

    import torch.distributed as dist

    from parallel_layers.distributed import collectives as C

    n = dist.get_world_size(group)
    numel = nbytes // 4 // n * n
    full, shard = torch.randn(numel), torch.empty(numel // n)
    gathered = torch.empty(numel)
    rs, ag = C.torch_reduce_scatter_flat, C.torch_all_gather_flat
    pairs = {"reduce_scatter": (lambda: C.reduce_scatter_dim0(full, group, out=shard),
                                lambda: rs(shard, full, group=group)),
             "all_gather": (lambda: C.all_gather_dim0(shard, group, out=gathered),
                            lambda: ag(gathered, shard, group=group))}

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)       # torch 2.13 renames the two collectives
        for name, (ours, theirs) in pairs.items():
            for _ in range(warmup):
                ours(), theirs()
            t_ours, t_theirs = [], []
            for i in range(reps):
                first, second = (ours, theirs) if i % 2 == 0 else (theirs, ours)
                a, b = harness.slowest_rank_ms(first, group), harness.slowest_rank_ms(second, group)
                t_ours.append(a if i % 2 == 0 else b)
                t_theirs.append(b if i % 2 == 0 else a)
            out[name] = (t_ours, t_theirs)
    return out


def _bench_rank(rank: int, world: int, size: dict, reps: int, warmup: int, coll_bytes: int):
    """One rank: (n_params, Stats ours, Stats baseline, max loss diff) per reduce op, the memory reports
    and the collectives' timings."""
    import torch.distributed as dist

    group = dist.group.WORLD
    speed = [_measure_speed(group, rank, size, reps, warmup, op) for op in REDUCE_OPS]
    return speed, _memory_reports(group, size), _measure_collectives(group, coll_bytes, reps, warmup)


def _run(mode: str, progress: Optional[Callable[[str], None]] = None, reps: Optional[int] = None):
    """Both ranks' measurements -> (speed rows, per speed row (slowest rank ours ms, theirs ms, loss diff),
    memory reports, memory rows)."""
    prof = PROFILES[mode]
    size, reps, warmup = prof["size"], reps or prof["reps"], prof["warmup"]
    if progress:
        progress(f"ZeRO-1 vs ZeroRedundancyOptimizer, {size_text(size)}")
    answers = harness.run_ranks(_bench_rank, WORLD, (size, reps, warmup, prof["coll_bytes"]), timeout_s=1800,
                                retain_memory=True)
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), backend=f"gloo x{WORLD}")
    speeds, mem, colls = answers[0]
    dims = size_text(size)
    speed_rows, extra = [], []
    for i, (op, (n_params, t_ours, t_base, diff)) in enumerate(zip(REDUCE_OPS, speeds)):
        slow_ours = max(a[0][i][1].median_ms for a in answers)
        slow_base = max(a[0][i][2].median_ms for a in answers)
        speedup = t_base.median_ms / t_ours.median_ms
        speed_rows.append(harness.comparison_row(common, f"zero1_{op}_train_step_dp{WORLD}", t_ours, t_base,
                                    sizes=f"{dims} ({n_params} params)", dtype="float32",
                                    target=f"speedup>={TARGET}", met="yes" if speedup >= TARGET else "no",
                                    baseline=BASELINE))
        extra.append((slow_ours, slow_base, diff))
    for name, (t_ours, t_theirs) in colls.items():
        ok = harness.Stats.of(t_theirs).median_ms >= harness.Stats.of(t_ours).median_ms
        torch_name = {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor"}[name]
        speed_rows.append(harness.comparison_row(
            common, f"collective_{name}_dp{WORLD}", t_ours, t_theirs, sizes=f"{prof['coll_bytes'] / 2**20:g} MB fp32",
            dtype="float32", target="speedup>=1.0", met="yes" if ok else "no",
            baseline=f"torch.distributed.{torch_name} (gloo)"))
        extra.append(None)
    mem_rows = []
    for rep in mem:
        b, p = rep["bytes_per_param"], rep["paper_bytes_per_param"]
        mem_rows.append(dict(common, case=f"zero{rep['stage']}_bytes_per_param_dp{rep['dp_size']}",
                             sizes=f"{dims} ({rep['num_params']} params)", dtype=rep["dtype"],
                             target=f"paper {p['params']:.2f}+{p['grads']:.2f}+{p['optimizer']:.2f}="
                                    f"{p['total']:.2f} B/param", met="-",
                             baseline=f"ours params {b['params']:.3f} grads {b['grads']:.3f} comm {b['comm']:.3f} "
                                      f"optimizer {b['optimizer']:.3f} staging {b['staging']:.3f} "
                                      f"total {b['total']:.3f} B/param",
                             mem_mb=b["total"] * rep["num_params"] / 2**20))
    return speed_rows, extra, mem, mem_rows


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            reps: Optional[int] = None) -> List[dict]:
    """Run the benchmark (``mode``: smoke | quick | full, see ``PROFILES``; ``reps`` overrides the
    profile's timed repetitions) and return the CSV rows: the two ZeRO-1 step-time comparisons, then
    the bytes-per-parameter rows. Writes no CSV; one detail line per comparison goes to stderr.
    ``device`` only names the run: the ranks are gloo processes on CPU."""
    speeds, extra, _, mem_rows = _run(mode, progress, reps)
    for r, ex in zip(speeds, extra):
        if ex is None:
            print(f"zero {r['case']} ({r['sizes']}): ours (ring) {r['ours_median_ms']:.2f} ms vs {r['baseline']} "
                  f"{r['base_median_ms']:.2f} ms (speedup {r['speedup']:.2f}x)", file=sys.stderr, flush=True)
            continue
        slow_ours, slow_base, diff = ex
        print(f"zero {r['case']}: ours {r['ours_median_ms']:.1f} ms vs {BASELINE} {r['base_median_ms']:.1f} ms "
              f"(speedup {r['speedup']:.2f}x); slowest rank {slow_ours:.1f}/{slow_base:.1f} ms; "
              f"max |loss diff| {diff:.1e}", file=sys.stderr, flush=True)
    return speeds + mem_rows


def main(argv: Optional[List[str]] = None) -> int:
    from parallel_layers.zero import format_report

    ap = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes, for the smoke test; never writes CSV",
                             quick_help="small GPT, few reps (see PROFILES)")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--reps", type=int, help="timed repetitions")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    reps, warmup = args.reps or PROFILES[mode]["reps"], PROFILES[mode]["warmup"]
    t0 = time.time()
    print(f"device: {harness.device_name(torch.device('cpu'))} | {WORLD} gloo ranks, 1 thread each | torch "
          f"{torch.__version__} | mode: {mode}, {reps} reps after {warmup} warm-up (full training step, fp32)")
    speeds, extra, mem, mem_rows = _run(mode, reps=args.reps)
    for speed, ex in zip(speeds, extra):
        if ex is None:
            print(f"\n{speed['case']}  {speed['sizes']}\n"
                  f"  ours (ring of sends/receives): {speed['ours_median_ms']:.2f} ms"
                  f" vs {speed['baseline']}: {speed['base_median_ms']:.2f} ms; speedup {speed['speedup']:.2f}x")
            continue
        slow_ours, slow_base, diff = ex
        print(f"\n{speed['case']}  {speed['sizes']}")
        print(f"  ours (DataParallel + ZeroOptimizer stage 1): {speed['ours_median_ms']:.1f} ms "
              f"(p20 {speed['ours_p20_ms']:.1f}, p80 {speed['ours_p80_ms']:.1f})")
        print(f"  {BASELINE + ':':<44} {speed['base_median_ms']:.1f} ms "
              f"(p20 {speed['base_p20_ms']:.1f}, p80 {speed['base_p80_ms']:.1f})")
        print(f"  speedup {speed['speedup']:.2f}x (target >= {TARGET}: {speed['met']}); slowest rank ours/theirs "
              f"{slow_ours:.1f}/{slow_base:.1f} ms; max |loss diff| {diff:.1e}")
    print("\nbytes per parameter held by one rank (ours measured, padding included) vs the ZeRO paper "
          "(2 + 2 + 12, mixed precision)")
    for dtype in ("bfloat16", "float32"):
        print(f"\nparameters in {dtype} (gradients accumulate in fp32 main grads):")
        print(format_report([r for r in mem if r["dtype"] == dtype]))
    print(f"\n({time.time() - t0:.1f} s)")
    harness.append_and_report(speeds + mem_rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
