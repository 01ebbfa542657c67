"""ZeRO stage 1 against ``torch.distributed.optim.ZeroRedundancyOptimizer``, and bytes per parameter per stage.

    python -m benchmarks.zero            # a ~10M-parameter GPT, 2 gloo ranks on CPU
    python -m benchmarks.zero --smoke    # tiny sizes, seconds

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
``benchmarks/results/zero.csv``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from typing import List, Optional

import torch
import torch.multiprocessing as mp

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "zero.csv")
WORLD = 2
# GPT config (vocab, n_layer, d_model, n_head, seq) and the global batch
SIZES = {"full": dict(vocab_size=8192, n_layer=4, d_model=384, n_head=6, max_seq_len=64, batch=4),
         "smoke": dict(vocab_size=128, n_layer=1, d_model=32, n_head=2, max_seq_len=16, batch=4)}
REPS = {"full": (9, 2), "smoke": (3, 1)}
BUCKET_MB = 25.0
TARGET = 1.0
LR = 1e-4
# Stage 1 either reduce-scatters (half the traffic on NCCL) or all-reduces and slices (faster on gloo,
# whose reduce-scatter is an emulation): both are measured.
REDUCE_OPS = ("reduce_scatter", "all_reduce")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpt(size: dict, dtype=None):
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

    ours = DataParallel(_gpt(size), group, reduce_op=reduce_op, bucket_cap_mb=BUCKET_MB)
    opt = ZeroOptimizer(ours, stage=1, lr=LR, weight_decay=0.01)
    theirs = DistributedDataParallel(_gpt(size), process_group=group, bucket_cap_mb=BUCKET_MB)
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
    diff = max(abs(a - b) for a, b in zip(losses["ours"], losses["theirs"]))
    return n_params, t_ours, t_base, diff


def _memory_rows(group, size: dict) -> List[dict]:
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    reports = []
    for dtype in (torch.bfloat16, torch.float32):
        for stage in (1, 2):
            dp = DataParallel(_gpt(size, dtype), group, reduce_op="reduce_scatter", bucket_cap_mb=BUCKET_MB)
            opt = ZeroOptimizer(dp, stage=stage, lr=LR)
            rep = opt.memory_report()
            rep["dtype"] = str(dtype).replace("torch.", "")
            reports.append(rep)
            del dp, opt
    return reports


def _worker(rank: int, port: int, size: dict, reps_warmup, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    try:
        group = dist.group.WORLD
        speed = [_measure_speed(group, rank, size, *reps_warmup, op) for op in REDUCE_OPS]
        mem = _memory_rows(group, size)
        queue.put((rank, (speed, mem), None))
    except Exception as exc:  # noqa: BLE001 - report, do not hang the parent
        import traceback
        queue.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run(mode: str, size: dict, reps_warmup):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, size, reps_warmup, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    answers = {}
    for _ in range(WORLD):
        rank, result, err = queue.get()
        if err:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{err}")
        answers[rank] = result
    for p in procs:
        p.join()
    common = dict(run_id=harness.now_iso(), date=harness.now_iso(), mode=mode, backend=f"gloo x{WORLD}",
                  device=harness.device_name(torch.device("cpu")), threads=1, **harness.versions())
    speeds, mem = answers[0]
    dims = f"V{size['vocab_size']}xL{size['n_layer']}xd{size['d_model']}xs{size['max_seq_len']}xb{size['batch']}"
    speed_rows, extra = [], []
    for i, (op, (n_params, t_ours, t_base, diff)) in enumerate(zip(REDUCE_OPS, speeds)):
        slow_ours = max(answers[r][0][i][1].median_ms for r in answers)
        slow_base = max(answers[r][0][i][2].median_ms for r in answers)
        speedup = t_base.median_ms / t_ours.median_ms
        speed_rows.append(dict(common, case=f"zero1_{op}_train_step_dp2", sizes=f"{dims} ({n_params} params)",
                               dtype="float32", ours_median_ms=t_ours.median_ms, ours_p20_ms=t_ours.p20_ms,
                               ours_p80_ms=t_ours.p80_ms, base_median_ms=t_base.median_ms,
                               base_p20_ms=t_base.p20_ms, base_p80_ms=t_base.p80_ms, speedup=speedup,
                               target=f"speedup>={TARGET}", met="yes" if speedup >= TARGET else "no",
                               baseline="DDP + ZeroRedundancyOptimizer(AdamW)"))
        extra.append((slow_ours, slow_base, diff))
    mem_rows = []
    for rep in mem:
        b, p = rep["bytes_per_param"], rep["paper_bytes_per_param"]
        mem_rows.append(dict(common, case=f"zero{rep['stage']}_bytes_per_param_dp{rep['dp_size']}",
                             sizes=f"{dims} ({rep['num_params']} params)", dtype=rep["dtype"],
                             target=f"paper {p['params']:.2f}+{p['grads']:.2f}+{p['optimizer']:.2f}="
                                    f"{p['total']:.2f} B/param",
                             baseline=f"ours params {b['params']:.3f} grads {b['grads']:.3f} comm {b['comm']:.3f} "
                                      f"optimizer {b['optimizer']:.3f} staging {b['staging']:.3f} "
                                      f"total {b['total']:.3f} B/param"))
    return speed_rows, extra, mem, mem_rows


def main(argv: Optional[List[str]] = None) -> int:
    from parallel_layers.zero import format_report

    ap = argparse.ArgumentParser(prog="python -m benchmarks.zero", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--no-csv", action="store_true", help=f"do not append to {os.path.relpath(CSV_PATH)}")
    ap.add_argument("--csv", default=CSV_PATH, help="CSV file to append to")
    ap.add_argument("--reps", type=int, help="timed repetitions")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    reps, warmup = REPS[mode]
    reps = args.reps or reps
    size = SIZES[mode]
    print(f"device: {harness.device_name(torch.device('cpu'))} | {WORLD} gloo ranks, 1 thread each | torch "
          f"{torch.__version__} | mode: {mode}, {reps} reps after {warmup} warm-up (full training step, fp32)")
    speeds, extra, mem, mem_rows = run(mode, size, (reps, warmup))
    for speed, (slow_ours, slow_base, diff) in zip(speeds, extra):
        print(f"\n{speed['case']}  {speed['sizes']}")
        print(f"  ours (DataParallel + ZeroOptimizer stage 1): {speed['ours_median_ms']:.1f} ms "
              f"(p20 {speed['ours_p20_ms']:.1f}, p80 {speed['ours_p80_ms']:.1f})")
        print(f"  DDP + ZeroRedundancyOptimizer(AdamW):         {speed['base_median_ms']:.1f} ms "
              f"(p20 {speed['base_p20_ms']:.1f}, p80 {speed['base_p80_ms']:.1f})")
        print(f"  speedup {speed['speedup']:.2f}x (target >= {TARGET}: {speed['met']}); slowest rank ours/theirs "
              f"{slow_ours:.1f}/{slow_base:.1f} ms; max |loss diff| {diff:.1e}")
    print("\nbytes per parameter held by one rank (ours measured, padding included) vs the ZeRO paper "
          "(2 + 2 + 12, mixed precision)")
    for dtype in ("bfloat16", "float32"):
        print(f"\nparameters in {dtype} (gradients accumulate in fp32 main grads):")
        print(format_report([r for r in mem if r["dtype"] == dtype]))
    if not args.no_csv:
        rows = speeds + mem_rows
        harness.append_csv(args.csv, rows)
        print(f"\nappended {len(rows)} rows to {os.path.relpath(args.csv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
