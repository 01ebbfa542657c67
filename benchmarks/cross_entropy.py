"""Vocab-parallel cross entropy: ours (fused, one pass, two small all-reduces, in-place backward) vs
torch's ``loss_parallel`` (DTensor sharded on the vocabulary dim, ``F.cross_entropy`` inside the context).

    python -m benchmarks.cross_entropy              # CPU: 2 gloo ranks, 4096 x 32000/2 fp32 per rank
    python -m benchmarks.cross_entropy --quick      # 512 x 32000/2 per rank, 5 repetitions
    python -m benchmarks.cross_entropy --smoke      # tiny sizes, a few seconds
    python -m benchmarks.cross_entropy --device cuda   # one GPU: ours vs loss_parallel on a (8192, 32000/tp) shard

CPU: two processes (``harness.run_ranks``: spawned, one thread each) joined by gloo, every rank holding
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
Rows are appended to benchmarks/results/tp.csv (``collect`` returns them for the suite): ``mem_mb`` is
ours' peak extra MB per rank, and the ``baseline`` text carries both peaks and their ratio.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from parallel_layers.testing.workers import free_port

from . import harness

CSV_NAME = "tp.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 12   # seconds --quick should take on the 2-core development machine (guideline)
MEM_METHOD_CPU = "VmHWM-VmRSS, clear_refs=5, MALLOC_MMAP_THRESHOLD_=65536"
MEM_METHOD_CUDA = "torch.cuda.max_memory_allocated"
MEM_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}   # for the spawned CPU ranks (see the docstring)
PROFILES = {"full": dict(rows=4096, vocab=32000, reps=7, warmup=2),
            "quick": dict(rows=512, vocab=32000, reps=5, warmup=1),
            "smoke": dict(rows=64, vocab=512, reps=5, warmup=1)}
CUDA_ROWS = 8192   # rows of the shard on a GPU (quick and full)
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
            del out
            x = None
            x = fresh()
            barrier()
            results[name][1].append(peak_extra_mb(lambda: steps[name](x), device))
            x = None           # freed before the next measurement
    return results


# ---------------------------------------------------------------------------------------------- CPU ranks
def _cpu_rank(rank: int, world: int, prof: dict):
    """One rank (spawned by ``harness.run_ranks``, gloo group initialised, one thread); rank 0's results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    rows, vocab = prof["rows"], prof["vocab"]
    g = torch.Generator().manual_seed(1234 + rank)             # each rank: its own vocabulary slice
    base = torch.randn(rows, vocab // world, generator=g)
    target = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(7))  # same on all
    target[::17] = -100
    steps = make_steps(mesh.get_group(), mesh, target)
    res = measure(base, target, steps, prof["reps"], prof["warmup"], dist.barrier, torch.device("cpu"))
    return res if rank == 0 else None


def run_cpu(prof: dict, world: int = 2):
    with harness.environ(MEM_ENV):
        return harness.run_ranks(_cpu_rank, world, (prof,), timeout_s=1800)[0]


# ---------------------------------------------------------------------------------------------- CUDA
def run_cuda(prof: dict, tp: int):
    """One GPU, one rank: the per-rank work of a tp-way split (a (rows, vocab/tp) shard); with a group of
    one, ours issues no collective, and loss_parallel runs on a 1-device mesh. A process group this
    creates is destroyed afterwards (the suite runs other benchmarks in the same process)."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device())
    created = not dist.is_initialized()
    if created:   # a tcp:// address rather than MASTER_ADDR/PORT: nothing left in os.environ afterwards
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=300), device_id=device)
    try:
        mesh = init_device_mesh("cuda", (1,))
        rows, vocab = prof["rows"], prof["vocab"]
        g = torch.Generator(device=device).manual_seed(1234)
        base = torch.randn(rows, vocab // tp, generator=g, device=device)
        target = torch.randint(0, vocab // tp, (rows,), device=device, generator=g)
        steps = make_steps(mesh.get_group(), mesh, target)
        return measure(base, target, steps, prof["reps"], prof["warmup"], lambda: None, device)
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- rows
def make_rows(res, *, device: torch.device, mode: str, sizes: str, world: int, threads: int) -> List[dict]:
    """CSV rows from ``measure``'s results: ours (in-place backward) and ours without it, each against
    loss_parallel; the memory figures go in ``mem_mb`` (ours) and the ``baseline`` text (both)."""
    base_t, base_m, _ = res["loss_parallel"]
    base_mem = statistics.median(base_m)
    method = MEM_METHOD_CUDA if device.type == "cuda" else MEM_METHOD_CPU
    common = dict(harness.common_fields(mode, device, threads), sizes=sizes, dtype="fp32",
                  backend="triton" if device.type == "cuda" else "torch")
    mem_target = TARGETS["cpu_mem"]
    time_target = TARGETS["cuda_speedup"] if device.type == "cuda" else None
    rows = []
    for name, case in (("ours", "vocab_ce"), ("ours_copy", "vocab_ce_no_inplace")):
        t, m, _ = res[name]
        mem = statistics.median(m)
        ratio = mem / base_mem if base_mem > 0 else float("nan")
        row = harness.comparison_row(common, case, t, base_t)
        mem_ok = ratio <= mem_target
        met = mem_ok and (row["speedup"] >= time_target if time_target else True)
        row.update(
            date=harness.now_iso(), mem_mb=mem,
            target=";".join([f"mem<={mem_target}x"] + ([f"time>={time_target}x"] if time_target else [])),
            met="yes" if met else "no",
            baseline=(f"loss_parallel (DTensor, {world} ranks); peak extra MB ours {mem:.1f} vs {base_mem:.1f} "
                      f"= {ratio:.3f}x ({method})"),
            ours_peak_mb=mem, base_peak_mb=base_mem, mem_ratio=ratio)   # the last three: for the CLI table
        rows.append(row)
    return rows


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None, *,
            rows: Optional[int] = None, vocab: Optional[int] = None, tp: int = 2,
            reps: Optional[int] = None) -> List[dict]:
    """Rows of ``mode`` (smoke | quick | full, see ``PROFILES``; ``rows``, ``vocab``, ``reps`` override
    it; ``vocab`` is the full vocabulary, each rank holds vocab / tp columns). On CUDA one GPU runs one
    rank's shard; on CPU ``tp`` gloo ranks. Writes no CSV, prints nothing."""
    prof = dict(PROFILES[mode])
    if device.type == "cuda" and mode != "smoke":
        prof["rows"] = CUDA_ROWS
    prof.update({k: v for k, v in dict(rows=rows, vocab=vocab, reps=reps).items() if v})
    sizes = f"{prof['rows']}x{prof['vocab']}/{tp}"
    if progress:
        progress(f"logits {sizes} per rank")
    if device.type == "cuda":
        res = run_cuda(prof, tp)
        return make_rows(res, device=device, mode=mode, sizes=sizes, world=1, threads=torch.get_num_threads())
    res = run_cpu(prof, world=tp)
    return make_rows(res, device=torch.device("cpu"), mode=mode, sizes=sizes, world=tp, threads=1)


def print_table(rows: List[dict]) -> None:
    r0 = rows[0]
    lines = [(r["case"], r["ours_median_ms"], r["ours_p20_ms"], r["ours_p80_ms"], r["speedup"], r["ours_peak_mb"],
              r["mem_ratio"]) for r in rows]
    lines.append(("loss_parallel", r0["base_median_ms"], r0["base_p20_ms"], r0["base_p80_ms"], 1.0,
                  r0["base_peak_mb"], 1.0))
    head = f"{'case':<20} {'ms median':>10} {'p20-p80':>16} {'vs base':>8} {'peak MB':>9} {'mem ratio':>10}"
    print(head)
    print("-" * len(head))
    for name, med, p20, p80, speed, mem, ratio in lines:
        print(f"{name:<20} {med:>10.2f} {f'{p20:.2f}-{p80:.2f}':>16} {speed:>7.2f}x {mem:>9.1f} {ratio:>9.2f}x")
    print("(vocab_ce: inplace_backward=True, the gradient written over the logits; vocab_ce_no_inplace: "
          "inplace_backward=False, a new gradient buffer, counted)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes (a few seconds)",
                             quick_help=f"fewer rows and reps (~{QUICK_BUDGET_S} s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--vocab", type=int, help="full vocabulary; each rank holds vocab / tp columns")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size the shard corresponds to")
    ap.add_argument("--reps", type=int)
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    if (args.reps or PROFILES[mode]["reps"]) < 5:
        print("note: fewer than 5 timed repetitions", file=sys.stderr)
    device = torch.device(args.device)
    rows = collect(mode, device, rows=args.rows, vocab=args.vocab, tp=args.tp, reps=args.reps)
    r0, ver = rows[0], harness.versions()
    world = 1 if device.type == "cuda" else args.tp
    print(f"device: {r0['device']}; torch {ver['torch']}, triton {ver['triton']}; {world} rank(s) x "
          f"{r0['threads']} thread(s); logits shard {r0['sizes']} fp32 per rank")
    print(f"peak extra memory: {MEM_METHOD_CUDA if device.type == 'cuda' else MEM_METHOD_CPU}")
    print_table(rows)
    harness.append_and_report(rows, None if args.no_csv else CSV_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main())
