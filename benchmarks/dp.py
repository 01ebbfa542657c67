"""Data parallel: our overlapped bucketed all-reduce against torch DDP, gloo ranks on CPU (1 thread each).

    python -m benchmarks.dp                    # GPT of ~51M parameters (d 512, 8 layers, vocab 50304, tied)
    python -m benchmarks.dp --model small      # ~7M parameters (d 256, 4 layers, vocab 16384)
    python -m benchmarks.dp --smoke            # tiny, seconds; no CSV unless --csv is given

A step is ``zero_grad`` + forward + backward (gradient sync included) of a GPT on ``[1, seq]`` tokens per
rank; the optimizer step is left out (identical for every variant; it only dilutes the ratios). Before every
timed step the ranks meet at a barrier; a step's time is the slowest rank's (all-reduce MAX, outside the
timed region). Variants run interleaved, rep by rep, in the same processes on the same data; median of the
timed reps after warm-up.

(a) 2 ranks: ours overlap on vs off (off: every bucket's all-reduce after backward) -> ratio (target <= 0.9);
    torch DDP (normal) vs DDP with ``no_sync()`` backward + one flat all-reduce of all gradients -> DDP's own
    ratio. Target: our gain at least as large as DDP's.
(b) 4 ranks: our stage 0 (overlap) vs ``torch.nn.parallel.DistributedDataParallel`` with the same bucket
    size (25 MB) -> ratio (target <= 1.0).
On a 2-core machine 4 ranks oversubscribe the cores: (b) then measures overheads under contention.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from typing import List, Optional

import torch
import torch.multiprocessing as mp

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "dp.csv")
MODELS = {  # name: (vocab, n_layer, n_head, d_model, seq)
    "50m": (50304, 8, 8, 512, 128),
    "small": (16384, 4, 4, 256, 128),
    "smoke": (512, 2, 2, 64, 16),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, model_name, part, reps, warmup, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from parallel_layers.data_parallel import DataParallel
    from parallel_layers.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        V, L, H, D, S = MODELS[model_name]
        cfg = GPTConfig(vocab_size=V, n_layer=L, n_head=H, d_model=D, max_seq_len=S, dropout=0.0)

        def build():
            torch.manual_seed(0)
            return GPT(cfg)

        gen = torch.Generator().manual_seed(rank)
        idx = torch.randint(0, V, (1, S), generator=gen)
        tgt = torch.randint(0, V, (1, S), generator=gen)
        variants = {}
        if part == "a":
            on = DataParallel(build(), dist.group.WORLD, bucket_cap_mb=25)
            off = DataParallel(build(), dist.group.WORLD, bucket_cap_mb=25, overlap=False)
            ddp, ddp_flat = DDP(build(), bucket_cap_mb=25), DDP(build(), bucket_cap_mb=25)
            variants = {"ours_overlap": on, "ours_no_overlap": off, "ddp": ddp, "ddp_flat": ddp_flat}
        else:
            variants = {"ours_overlap": DataParallel(build(), dist.group.WORLD, bucket_cap_mb=25),
                        "ddp": DDP(build(), bucket_cap_mb=25)}

        def step(name, m):
            m.zero_grad(set_to_none=False) if name.startswith("ours") else m.zero_grad(set_to_none=True)
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
                dist.barrier()
                t0 = time.perf_counter()
                step(n, variants[n])
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if i >= warmup:
                    times[n].append(t.item() * 1e3)
        overlap = None
        if "ours_overlap" in variants:
            from parallel_layers.data_parallel import overlap_report
            overlap = overlap_report(variants["ours_overlap"].last_sync_timeline)
        n_params = sum(p.numel() for p in build().parameters())
        queue.put((rank, (times, n_params, overlap), None))
    except Exception as exc:  # noqa: BLE001 - report, do not hang the parent
        import traceback
        queue.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _run(world, model_name, part, reps, warmup):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, model_name, part, reps, warmup, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    answers = {}
    for _ in range(world):
        rank, res, err = queue.get()
        if err:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed:\n{err}")
        answers[rank] = res
    for p in procs:
        p.join()
    return answers[0]


def _row(common, case, ours, base, target, baseline, met):
    so, sb = harness.Stats.of(ours), harness.Stats.of(base)
    return dict(common, case=case, ours_median_ms=so.median_ms, ours_p20_ms=so.p20_ms, ours_p80_ms=so.p80_ms,
                base_median_ms=sb.median_ms, base_p20_ms=sb.p20_ms, base_p80_ms=sb.p80_ms,
                speedup=sb.median_ms / so.median_ms, target=target, met="yes" if met else "no", baseline=baseline)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 reps: checks the program runs")
    ap.add_argument("--model", choices=sorted(MODELS), default="50m")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--parts", default="ab", help="a: overlap gain at 2 ranks; b: vs DDP at 4 ranks")
    ap.add_argument("--csv", default=None, help=f"CSV to append to (default {os.path.relpath(CSV_PATH)}; "
                                                f"none with --smoke)")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    model = "smoke" if args.smoke else args.model
    reps, warmup = (2, 1) if args.smoke else (args.reps, args.warmup)
    mode = "smoke" if args.smoke else "full"
    common = dict(run_id=harness.now_iso(), date=harness.now_iso(), mode=mode, dtype="float32",
                  device=harness.device_name(torch.device("cpu")), threads=1, **harness.versions())
    rows = []
    med = statistics.median
    if "a" in args.parts:
        times, n_params, overlap = _run(2, model, "a", reps, warmup)
        sizes = f"{model}:{n_params / 1e6:.1f}M params"
        ours_ratio = med(times["ours_overlap"]) / med(times["ours_no_overlap"])
        ddp_ratio = med(times["ddp"]) / med(times["ddp_flat"])
        print(f"(a) 2 ranks, {sizes}; last overlapped step: {overlap['launched_before_backward_end']} of "
              f"{overlap['buckets']} buckets launched before backward ended")
        for n, t in times.items():
            print(f"    {n:16s} median {med(t):9.1f} ms   (reps {len(t)})")
        print(f"    ours overlap/no-overlap = {ours_ratio:.3f}x (target <= 0.9); "
              f"DDP normal/flat = {ddp_ratio:.3f}x; ours gain >= DDP's: {ours_ratio <= ddp_ratio}")
        rows.append(_row(dict(common, backend="gloo x2", sizes=sizes), "dp_overlap_on_vs_off", times["ours_overlap"],
                         times["ours_no_overlap"], "time ratio<=0.9", "ours overlap=False", ours_ratio <= 0.9))
        rows.append(_row(dict(common, backend="gloo x2", sizes=sizes), "ddp_normal_vs_flat_allreduce", times["ddp"],
                         times["ddp_flat"], f"ours ratio {ours_ratio:.3f} <= this", "DDP no_sync + one flat all-reduce",
                         ours_ratio <= ddp_ratio))
    if "b" in args.parts:
        times, n_params, _ = _run(4, model, "b", reps, warmup)
        sizes = f"{model}:{n_params / 1e6:.1f}M params"
        ratio = med(times["ours_overlap"]) / med(times["ddp"])
        print(f"(b) 4 ranks, {sizes}")
        for n, t in times.items():
            print(f"    {n:16s} median {med(t):9.1f} ms   (reps {len(t)})")
        print(f"    ours stage0 / torch DDP = {ratio:.3f}x (target <= 1.0)")
        rows.append(_row(dict(common, backend="gloo x4", sizes=sizes), "dp_stage0_vs_torch_ddp", times["ours_overlap"],
                         times["ddp"], "time ratio<=1.0", "torch DistributedDataParallel bucket_cap_mb=25",
                         ratio <= 1.0))
    path = args.csv or (None if args.smoke or args.no_csv else CSV_PATH)
    if path and not args.no_csv:
        harness.append_csv(path, rows)
        print(f"appended {len(rows)} rows to {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
