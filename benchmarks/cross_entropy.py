"""Vocab-parallel cross entropy: ours (fused, one pass, two small all-reduces, in-place backward) vs
torch's ``loss_parallel`` (DTensor sharded on the vocabulary dim, ``F.cross_entropy`` inside the context).

    python -m benchmarks.cross_entropy              # CPU: 2 gloo ranks, 4096 x 32000/2 fp32 per rank
    python -m benchmarks.cross_entropy --smoke      # tiny sizes, a few seconds
    python -m benchmarks.cross_entropy --device cuda   # one GPU: ours vs loss_parallel on a (8192, 32000/tp) shard

CPU: two processes (torch.multiprocessing spawn, one thread each) joined by gloo, every rank holding
its vocabulary shard of the same logits. One step = forward + backward (``torch.autograd.grad`` of the
mean loss with respect to the logits shard, the same for both, so neither pays an accumulation into
``.grad``). The logits are cloned before every step, outside the timed region, because ours writes the
gradient over them.

Peak extra memory (CPU) = VmHWM - VmRSS around one step, with the high-water mark reset just before it
by writing 5 to /proc/self/clear_refs; the inputs (logits shard, targets) exist before and are not
counted, the gradient is (it is an output of the step; ours writes it into the logits). glibc's
dynamic mmap threshold would keep freed blocks resident and hide re-used memory, so the ranks run with
MALLOC_MMAP_THRESHOLD_=65536 (every block of 64 KiB or more is mapped on allocation and unmapped on
free; resident memory then follows live memory). Reported: the median over the measured steps, rank 0
(the ranks are symmetric). On CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the
step.

Times: median (p20-p80) of ``reps`` steps after warm-up, ours and theirs interleaved, both ranks
released together by a barrier before each step; the figure is rank 0's wall time of the step.
Rows are appended to benchmarks/results/tp.csv (harness.CSV_FIELDS, plus the memory columns).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "tp.csv")
CSV_FIELDS = harness.CSV_FIELDS + ["ours_peak_mb", "base_peak_mb", "mem_ratio", "mem_target", "mem_met", "mem_method"]
MEM_METHOD_CPU = "VmHWM-VmRSS, clear_refs=5, MALLOC_MMAP_THRESHOLD_=65536"
MEM_METHOD_CUDA = "torch.cuda.max_memory_allocated"
PROFILES = {"full": dict(rows=4096, vocab=32000, reps=7, warmup=2),
            "smoke": dict(rows=64, vocab=512, reps=5, warmup=1)}
TARGETS = {"cpu_mem": 0.5, "cuda_speedup": 1.5}


# ---------------------------------------------------------------------------------------------- memory
def peak_extra_mb(step: Callable[[], object], device: torch.device) -> float:
    """Peak memory one call of ``step`` adds beyond what exists before it (its result kept until the end)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del out
        return (peak - before) / 2**20
    if not harness.reset_peak_rss():
        raise RuntimeError("cannot reset the peak RSS (/proc/self/clear_refs not writable): no honest CPU "
                           "peak-memory figure on this machine")
    before = harness.status_mb("VmRSS")
    if abs(harness.status_mb("VmHWM") - before) > 1.0:
        raise RuntimeError("writing 5 to /proc/self/clear_refs did not reset VmHWM on this kernel")
    out = step()
    peak = harness.status_mb("VmHWM")
    del out
    return peak - before


# ---------------------------------------------------------------------------------------------- the two steps
def make_steps(group, device_mesh, target):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    from parallel_layers.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    def ours(x, inplace=True):
        loss = vocab_parallel_cross_entropy(x, target, tp_group=group, inplace_backward=inplace)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad

    def theirs(x):
        dt = DTensor.from_local(x, device_mesh, [Shard(x.dim() - 1)], run_check=False)
        with loss_parallel():
            loss = F.cross_entropy(dt, target)
            (grad,) = torch.autograd.grad(loss, x)
        return loss.full_tensor().detach(), grad

    return {"ours": ours, "ours_copy": lambda x: ours(x, inplace=False), "loss_parallel": theirs}


def measure(base: torch.Tensor, target: torch.Tensor, steps: Dict[str, Callable], reps: int, warmup: int,
            barrier: Callable[[], None], device: torch.device):
    """Per step name: (time samples ms, peak extra MB samples, loss); also checks the losses and grads agree."""
    def fresh():
        return base.clone().requires_grad_()

    results = {name: ([], [], None) for name in steps}
    for _ in range(warmup):
        for fn in steps.values():
            barrier()
            fn(fresh())
    # correctness first: same loss and gradient from every step
    ref_loss, ref_grad = steps["loss_parallel"](fresh())
    for name, fn in steps.items():
        loss, grad = fn(fresh())
        torch.testing.assert_close(loss.float(), ref_loss.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=1e-4, atol=1e-7)
        results[name] = ([], [], float(loss))
    del ref_grad
    names = list(steps)
    for i in range(reps):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            x = fresh()
            barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            out = steps[name](x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            results[name][0].append((time.perf_counter() - t0) * 1e3)
            del out, x
            x = fresh()
            barrier()
            results[name][1].append(peak_extra_mb(lambda: steps[name](x), device))
            del x
    return results


# ---------------------------------------------------------------------------------------------- CPU ranks
def _cpu_rank(rank: int, world: int, port: int, prof: dict, queue) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        mesh = init_device_mesh("cpu", (world,))
        group = mesh.get_group()
        rows, vocab = prof["rows"], prof["vocab"]
        g = torch.Generator().manual_seed(1234 + rank)             # each rank: its own vocabulary slice
        base = torch.randn(rows, vocab // world, generator=g)
        target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(7))  # same on all
        target[::17] = -100
        steps = make_steps(group, mesh, target)
        res = measure(base, target, steps, prof["reps"], prof["warmup"], dist.barrier, torch.device("cpu"))
        if rank == 0:
            queue.put(res)
    finally:
        dist.destroy_process_group()


def run_cpu(prof: dict, world: int = 2):
    import torch.multiprocessing as mp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"   # inherited by the spawned ranks (see the docstring)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_cpu_rank, args=(world, harness_free_port(), prof, queue), nprocs=world,
                       start_method="spawn", join=True)
    return queue.get()


def harness_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- CUDA
def run_cuda(prof: dict, tp: int):
    """One GPU, one rank: the per-rank work of a tp-way split (a (rows, vocab/tp) shard); with a group of
    one, ours issues no collective, and loss_parallel runs on a 1-device mesh."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(harness_free_port()))
        dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300),
                                device_id=device)
    mesh = init_device_mesh("cuda", (1,))
    rows, vocab = prof["rows"], prof["vocab"]
    g = torch.Generator(device=device).manual_seed(1234)
    base = torch.randn(rows, vocab // tp, generator=g, device=device)
    target = torch.randint(0, vocab // tp, (rows,), device=device, generator=g)
    steps = make_steps(mesh.get_group(), mesh, target)
    return measure(base, target, steps, prof["reps"], prof["warmup"], lambda: None, device)


# ---------------------------------------------------------------------------------------------- report
def report(res, *, device: torch.device, mode: str, sizes: str, world: int, threads: int, write_csv: bool):
    base_t, base_m, _ = res["loss_parallel"]
    bs = harness.Stats.of(base_t)
    base_mem = statistics.median(base_m)
    method = MEM_METHOD_CUDA if device.type == "cuda" else MEM_METHOD_CPU
    run_id, ver = harness.now_iso(), harness.versions()
    print(f"device: {harness.device_name(device)}; torch {ver['torch']}, triton {ver['triton']}; "
          f"{world} rank(s) x {threads} thread(s); logits shard {sizes} fp32 per rank")
    print(f"peak extra memory: {method}")
    head = (f"{'case':<16} {'ms median':>10} {'p20-p80':>16} {'vs base':>8} {'peak MB':>9} {'mem ratio':>10}")
    print(head)
    print("-" * len(head))
    rows = []
    for name in ("ours", "ours_copy", "loss_parallel"):
        t, m, _ = res[name]
        st, mem = harness.Stats.of(t), statistics.median(m)
        speed, ratio = bs.median_ms / st.median_ms, mem / base_mem if base_mem > 0 else float("nan")
        print(f"{name:<16} {st.median_ms:>10.2f} {f'{st.p20_ms:.2f}-{st.p80_ms:.2f}':>16} {speed:>7.2f}x "
              f"{mem:>9.1f} {ratio:>9.2f}x")
        if name == "loss_parallel":
            continue
        mem_target = TARGETS["cpu_mem"]
        time_target = TARGETS["cuda_speedup"] if device.type == "cuda" else None
        mem_ok = ratio <= mem_target
        targets = [f"mem<={mem_target}x"] + ([f"time>={time_target}x"] if time_target else [])
        met = mem_ok and (speed >= time_target if time_target else True)
        rows.append(dict(
            run_id=run_id, date=harness.now_iso(), mode=mode,
            case="vocab_ce" + ("" if name == "ours" else "_no_inplace"), sizes=sizes, dtype="fp32",
            backend="triton" if device.type == "cuda" else "torch", device=harness.device_name(device),
            torch=ver["torch"], triton=ver["triton"], threads=threads,
            ours_median_ms=st.median_ms, ours_p20_ms=st.p20_ms, ours_p80_ms=st.p80_ms,
            base_median_ms=bs.median_ms, base_p20_ms=bs.p20_ms, base_p80_ms=bs.p80_ms, speedup=speed,
            target=";".join(targets), met="yes" if met else "no",
            # tp.csv is shared and has harness.CSV_FIELDS only: the memory figures also go in the text column
            baseline=(f"loss_parallel (DTensor, {world} ranks); peak extra MB ours {mem:.1f} vs {base_mem:.1f} "
                      f"= {ratio:.3f}x ({method})"),
            ours_peak_mb=mem, base_peak_mb=base_mem, mem_ratio=ratio, mem_target=f"<={mem_target}x",
            mem_met="yes" if mem_ok else "no", mem_method=method))
    print("(ours: inplace_backward=True, the gradient written over the logits; ours_copy: "
          "inplace_backward=False, a new gradient buffer, counted)")
    if write_csv and rows:
        _append(rows)
    return rows


def _append(rows: List[dict]) -> None:
    # harness.append_csv writes harness.CSV_FIELDS for a new file; tp.csv also has the memory columns.
    import csv

    new = not os.path.exists(CSV_PATH) or os.path.getsize(CSV_PATH) == 0
    if new:
        os.makedirs(os.path.dirname(CSV_PATH), exist_ok=True)
        with open(CSV_PATH, "w", newline="") as fh:
            csv.DictWriter(fh, fieldnames=CSV_FIELDS).writeheader()
    harness.append_csv(CSV_PATH, rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (a few seconds)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--vocab", type=int, help="full vocabulary; each rank holds vocab / tp columns")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size the shard corresponds to")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    prof = dict(PROFILES[mode])
    if args.device == "cuda" and not args.smoke:
        prof["rows"] = 8192
    for key in ("rows", "vocab", "reps"):
        if getattr(args, key):
            prof[key] = getattr(args, key)
    if prof["reps"] < 5:
        print("note: fewer than 5 timed repetitions", file=sys.stderr)
    sizes = f"{prof['rows']}x{prof['vocab']}/{args.tp}"
    if args.device == "cuda":
        res = run_cuda(prof, args.tp)
        report(res, device=torch.device("cuda"), mode=mode, sizes=sizes, world=1, threads=torch.get_num_threads(),
               write_csv=not args.no_csv)
    else:
        res = run_cpu(prof, world=args.tp)
        report(res, device=torch.device("cpu"), mode=mode, sizes=sizes, world=args.tp, threads=1,
               write_csv=not args.no_csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
