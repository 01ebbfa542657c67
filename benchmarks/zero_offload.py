"""ZeRO-Infinity on this machine's disk: the disk's sequential bandwidth, what each I/O method gets of it,
a training step with the optimizer state on disk against in memory, and a GPT whose optimizer state does
not fit the memory it is given.

    python -m benchmarks.zero_offload --quick     # disk bandwidth, I/O methods, step time (~1-2 min)
    python -m benchmarks.zero_offload             # full: bigger file and model
    python -m benchmarks.zero_offload --smoke     # tiny sizes, seconds; never writes CSV
    python -m benchmarks.zero_offload --largest --params 0.5e9 [--slack-gb 1] [--steps 3] [--dir DIR]
                                      [--grad-dtype bf16|fp32] [--threads N]

Disk bandwidth: one file written sequentially with ``O_DIRECT`` (16 MiB requests from page-aligned
buffers, then ``fsync``) and read back with ``O_DIRECT``, one request at a time and four in flight: the
page cache never holds it, so a read is the device's (on a virtual disk the host may still cache;
nothing in the guest can rule that out). The best of two passes of each: the disk's figure the fractions
below are taken of (on this shared machine passes differ by up to 2x for reads, 4x for writes).

I/O methods, reading the same file in the optimizer's chunk size (8 MiB): ``O_DIRECT`` + ``os.preadv``
into the buffer; buffered ``os.preadv`` after ``posix_fadvise(DONTNEED)`` (cold page cache); buffered
``os.pread`` (allocates a bytes object per chunk, then copies it into the buffer); buffered ``preadv`` with
the file in the page cache (what buffered offload gets while the state fits in RAM).

Step time: two gloo ranks (one thread each), the same GPT trained four ways side by side, one full step
(forward, backward, ``ZeroOptimizer(stage=2)`` step) of each in turn, the order rotating every rep, both
ranks starting each step at a barrier (they share the disk): in memory (the baseline), and offloaded with
``offload_io="direct"``, ``"buffered"`` with the state file written back and dropped from the page cache
at the end of each step (fsync + ``POSIX_FADV_DONTNEED``, timed: the step's writes reach the disk as
O_DIRECT's do, and the next step reads cold: what buffered I/O gets once the state outgrows the page
cache, the regime offload is for), and ``"buffered"`` with the file in the page cache. Disk
throughput: the bytes both ranks' steps read and wrote over the slowest rank's optimizer step time; its
fraction of the disk: the time those bytes need at the measured sequential bandwidth (reads at the read
figure, writes at the write figure) over that step time (1.0: the step runs at the disk's speed; above 1:
reads and writes overlapped beyond the sequential figures; the warm variant's bytes come from memory, so
its figure is not the disk's).

``--largest``: one rank (every core's threads) trains ``parallel_layers.models.GPT`` (built in bf16,
``ZeroStage3`` with dp = 1 and a bf16 gradient shard, ``--grad-dtype fp32`` for an fp32 one) with
``ZeroStage3Optimizer(offload="disk")``: fp32 master and moments on disk, so a rank holds about 4 bytes
per parameter (bf16 parameter and gradient shards). After two warm-up steps (the second measures what a
step allocates beyond the steady state) the address space is capped (``RLIMIT_AS``) at its current size
plus that transient plus ``--slack-gb``: less than the 12 bytes per parameter of optimizer state, so an
in-memory optimizer cannot be built (tried first, the outcome reported); then the offloaded one is built
and trained ``--steps`` steps. Reports step time, disk throughput, and RSS per parameter: after building
the model, the peak of building it into ZeroStage3, after the warm-up, and the peak (``VmHWM``, reset when
the cap is set) while training offloaded. Measured on this machine (2 cores, 24 GiB; ``--steps 2``):
0.49B parameters peaked at 5.85 bytes per parameter (2.69 GiB; 3.69 GB with the fp32 gradient shard
before), 1.02B at 4.95 (4.72 GiB): about 4 bytes per parameter plus 0.9 GiB (torch, one block's gathered
parameters and gradients), so 4.1B parameters (``--params 4.1e9``: d 3072, 36 layers) need about 16.5 GiB
of memory and 49 GB of disk.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch

from . import harness
from .zero import seeded_gpt, size_text

CSV_NAME = "zero_offload.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
WORLD = 2
BLOCK = 16 << 20                 # bandwidth blocks
CHUNK = 8 << 20                  # the I/O-method reads: one state of a ~2M-element sub-group
BUCKET_MB = 25.0
LR = 1e-4
PROFILES = {
    "full": dict(file_bytes=4 << 30, size=dict(vocab_size=8192, n_layer=8, d_model=768, n_head=12, max_seq_len=64,
                                                batch=4), reps=7, warmup=2),
    "quick": dict(file_bytes=1 << 30, size=dict(vocab_size=8192, n_layer=4, d_model=384, n_head=6, max_seq_len=64,
                                                 batch=4), reps=4, warmup=1),
    "smoke": dict(file_bytes=64 << 20, size=dict(vocab_size=128, n_layer=1, d_model=32, n_head=2, max_seq_len=16,
                                                  batch=4), reps=2, warmup=1),
}
# variant -> (offload_io, page cache dropped before each step, label)
VARIANTS = {"direct": ("direct", False, "O_DIRECT"),
            "buffered_cold": ("buffered", True, "buffered, written back and dropped from the page cache in each step"),
            "buffered_warm": ("buffered", False, "buffered, the file in the page cache (it fits in RAM here)")}


# ---------------------------------------------------------------------------------------- the disk itself
def _aligned(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)
    buf.write(os.urandom(1 << 20) * (nbytes >> 20))
    return buf


def disk_bandwidth(directory: str, nbytes: int, passes: int = 2) -> Dict[str, float]:
    """Sequential ``O_DIRECT`` write (+ fsync) and read of one ``nbytes`` file in ``BLOCK`` requests, one
    at a time and four in flight (four threads, interleaved blocks): the best GB/s of ``passes`` of each."""
    from concurrent.futures import ThreadPoolExecutor

    path = os.path.join(directory, "bandwidth.bin")
    best = {"write": 0.0, "read": 0.0}
    offsets = list(range(0, nbytes, BLOCK))
    try:
        for depth in (1, 4):
            bufs = [_aligned(BLOCK) for _ in range(depth)]
            for _ in range(passes):
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
                try:
                    for kind in ("write", "read"):
                        def stripe(k, kind=kind):
                            for off in offsets[k::depth]:
                                if kind == "write":
                                    os.pwrite(fd, bufs[k], off)
                                else:
                                    os.preadv(fd, [bufs[k]], off)
                        t0 = time.perf_counter()
                        with ThreadPoolExecutor(depth) as pool:
                            list(pool.map(stripe, range(depth)))
                        if kind == "write":
                            os.fsync(fd)
                        best[kind] = max(best[kind], nbytes / (time.perf_counter() - t0) / 1e9)
                finally:
                    os.close(fd)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return best


def io_methods(directory: str, nbytes: int) -> Dict[str, float]:
    """GB/s of each way to read a ``nbytes`` file into a buffer in ``CHUNK`` pieces (see the docstring)."""
    path = os.path.join(directory, "methods.bin")
    buf = _aligned(CHUNK)
    view = memoryview(buf)
    with open(path, "wb") as fh:
        for _ in range(0, nbytes, CHUNK):
            fh.write(buf)
        fh.flush()
        os.fsync(fh.fileno())

    def timed(flags: int, read: Callable[[int, int], None], cold: bool) -> float:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            if cold and not flags:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            for off in range(0, nbytes, CHUNK):
                read(fd, off)
            return nbytes / (time.perf_counter() - t0) / 1e9
        finally:
            os.close(fd)

    def preadv(fd, off):
        os.preadv(fd, [view], off)

    def pread(fd, off):
        view[:] = os.pread(fd, CHUNK, off)

    try:
        out = {"direct_preadv": timed(os.O_DIRECT, preadv, True),
               "buffered_preadv_cold": timed(0, preadv, True),
               "buffered_pread_cold": timed(0, pread, True)}
        timed(0, preadv, False)                          # fault the file into the page cache
        out["buffered_preadv_warm"] = timed(0, preadv, False)
        return out
    finally:
        os.unlink(path)


# ---------------------------------------------------------------------------------------- the training step


def _drop_cached(path: str) -> None:
    """Write the file's dirty pages back and drop its pages from the page cache (a cold next read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _step_rank(rank: int, world: int, size: dict, reps: int, warmup: int, root: str):
    """One rank, every variant of ``VARIANTS`` and the in-memory baseline trained side by side, one step of
    each in turn (the order rotating every rep): per variant the full-step and optimizer-step times (ms
    lists), bytes read and written per step, the I/O mode and the memory report; the parameter count."""
    import torch.distributed as dist

    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1 + rank)
    b = size["batch"] // WORLD
    x = torch.randint(0, size["vocab_size"], (b, size["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)
    runs = {}
    for kind in ("memory",) + tuple(VARIANTS):
        dp = DataParallel(seeded_gpt(size), group, reduce_op="reduce_scatter", bucket_cap_mb=BUCKET_MB)
        kw = {} if kind == "memory" else dict(offload="disk", offload_dir=os.path.join(root, kind),
                                              offload_io=VARIANTS[kind][0])
        runs[kind] = (dp, ZeroOptimizer(dp, stage=2, lr=LR, weight_decay=0.01, **kw))
    times = {kind: ([], []) for kind in runs}
    kinds = list(runs)
    for rep in range(warmup + reps):
        for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
            dp, opt = runs[kind]
            dist.barrier(group)                  # both ranks start each step together: they share the disk
            t0 = time.perf_counter()
            _, loss = dp(x, y)
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            if kind != "memory" and VARIANTS[kind][1]:
                # timed: the step's writes reach the disk, as O_DIRECT's do
                _drop_cached(opt.offload_stream.file.path)
            t2 = time.perf_counter()
            opt.zero_grad()
            if rep >= warmup:
                times[kind][0].append((t2 - t0) * 1e3)
                times[kind][1].append((t2 - t1) * 1e3)
    out = {"memory": times["memory"], "params": sum(p.numel() for p in runs["memory"][0].parameters())}
    for kind in VARIANTS:
        opt = runs[kind][1]
        st = opt.offload_stream.stats
        out[kind] = times[kind] + (st["read_bytes"] / st["steps"], st["write_bytes"] / st["steps"],
                                   opt.offload_stream.file.io, opt.memory_report())
        opt.close_offload()
    return out


def _disk_fraction(read_bytes: float, write_bytes: float, seconds: float, bw: Dict[str, float]) -> float:
    """The time ``read_bytes`` + ``write_bytes`` need at the disk's sequential bandwidth over ``seconds``."""
    return (read_bytes / (bw["read"] * 1e9) + write_bytes / (bw["write"] * 1e9)) / seconds


def _run(mode: str, directory: str, progress: Optional[Callable[[str], None]] = None):
    prof = PROFILES[mode]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), backend="disk")
    if progress:
        progress("disk bandwidth")
    bw = disk_bandwidth(directory, prof["file_bytes"])
    file_text = f"{prof['file_bytes'] >> 20} MiB file"
    rows = [dict(common, case=f"disk_sequential_{k}", sizes=f"{file_text}, {BLOCK >> 20} MiB blocks, O_DIRECT",
                 dtype="-", gbps=bw[k], baseline="best of 2 passes at queue depth 1 and 4", target="-", met="-")
            for k in ("write", "read")]
    if progress:
        progress("I/O methods")
    methods = io_methods(directory, prof["file_bytes"])
    for name, gbps in methods.items():
        rows.append(dict(common, case=f"io_read_{name}", sizes=f"{file_text}, {CHUNK >> 20} MiB reads", dtype="-",
                         gbps=gbps, bw_fraction=gbps / bw["read"], baseline="O_DIRECT sequential read", target="-",
                         met="-"))
    if progress:
        progress(f"step time, {size_text(prof['size'])}")
    answers = harness.run_ranks(_step_rank, WORLD, (prof["size"], prof["reps"], prof["warmup"], directory),
                                timeout_s=3600, retain_memory=True)
    step_common = dict(common, backend=f"gloo x{WORLD}")
    details = []
    mem_full = [harness.Stats.of(a["memory"][0]) for a in answers]
    mem_opt = [harness.Stats.of(a["memory"][1]) for a in answers]
    for kind, (_io, _cold, label) in VARIANTS.items():
        per_rank = [a[kind] for a in answers]
        full = [harness.Stats.of(r[0]) for r in per_rank]
        opt = [harness.Stats.of(r[1]) for r in per_rank]
        rep = per_rank[0][5]
        slow_opt_s = max(o.median_ms for o in opt) / 1e3
        total_r, total_w = sum(r[2] for r in per_rank), sum(r[3] for r in per_rank)
        gbps = (total_r + total_w) / slow_opt_s / 1e9
        frac = _disk_fraction(total_r, total_w, slow_opt_s, bw)
        sizes = (f"{size_text(prof['size'])} ({answers[0]['params']} params), state "
                 f"{rep['offload_bytes'] / 2**20:.0f} MiB/rank")
        for what, ours, base in (("train", full, mem_full), ("optimizer", opt, mem_opt)):
            rows.append(harness.comparison_row(step_common, f"zero2_offload_{kind}_{what}_step_dp{WORLD}", ours[0],
                                               base[0], sizes=sizes, dtype="float32", gbps=gbps, bw_fraction=frac,
                                               baseline="ZeroOptimizer(stage=2) in memory", target="-", met="-",
                                               mem_mb=rep["optimizer_bytes"] / 2**20, x=label))
        details.append((kind, label, full[0], mem_full[0], opt[0], mem_opt[0], total_r, total_w, gbps, frac, rep,
                        max(o.median_ms for o in opt)))
    return bw, methods, rows, details


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: the rows of ``mode`` (smoke | quick | full) in a scratch directory under the
    system's temporary directory (on this machine the same disk as the checkout)."""
    directory = tempfile.mkdtemp(prefix="zero_offload_")
    try:
        return _run(mode, directory, progress)[2]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------- --largest
GRAD_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def gpt_size_for(params: float, vocab: int = 8192, seq: int = 64) -> dict:
    """A GPT config of about ``params`` parameters (12 d^2 per layer plus the embeddings)."""
    d = 1024 if params < 2e8 else 1536 if params < 7e8 else 2048 if params < 1.5e9 else 2560 if params < 2.5e9 \
        else 3072
    n_layer = max(1, round((params - (vocab + seq) * d) / (12 * d * d)))
    return dict(vocab_size=vocab, n_layer=n_layer, d_model=d, n_head=d // 128, max_seq_len=seq, batch=1)


def _status(field: str) -> int:
    return int(harness.status_mb(field) * 2**20)


def _largest_rank(rank: int, world: int, size: dict, root: str, steps: int, slack_bytes: int, buffer_mb: float,
                  grad_dtype: str = "bf16", threads: int = 0):
    import gc
    import resource

    import torch.distributed as dist

    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.set_num_threads(threads or os.cpu_count() or 1)     # the one rank has the machine to itself
    t0 = time.perf_counter()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)          # built in bf16: no fp32 copy of the model at any point
    try:
        model = seeded_gpt(size)
    finally:
        torch.set_default_dtype(default)
    n_params = sum(p.numel() for p in model.parameters())
    model_rss = _status("VmRSS")
    z = ZeroStage3(model, dist.group.WORLD, grad_dtype=GRAD_DTYPES[grad_dtype])
    build_peak = _status("VmHWM")                    # the model, then its shards: the peak of the build
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, size["vocab_size"], (size["batch"], size["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)

    def forward_backward():
        _, loss = z(x, y)
        loss.backward()
        return loss

    forward_backward()                               # gradients allocated, everything warmed up
    z.zero_grad()
    gc.collect()
    harness.reset_peak_rss()
    rss = _status("VmRSS")
    forward_backward()                               # what one step needs beyond the steady state
    transient = _status("VmHWM") - rss
    z.zero_grad()
    build_s = time.perf_counter() - t0
    state_bytes = 12 * z.shard_numel
    limit = _status("VmSize") + transient + slack_bytes
    old = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, old[1]))
    try:
        try:
            ZeroStage3Optimizer(z, lr=LR)
            in_memory = "built (the budget does not exclude the in-memory state)"
        except (RuntimeError, MemoryError) as exc:
            in_memory = f"refused: {str(exc).splitlines()[0][:100]}"
        gc.collect()
        harness.reset_peak_rss()
        t0 = time.perf_counter()
        opt = ZeroStage3Optimizer(z, lr=LR, offload="disk", offload_dir=root, offload_buffer_mb=buffer_mb)
        create_s = time.perf_counter() - t0
        step_ms, opt_ms = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = forward_backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t2 = time.perf_counter()
            step_ms.append((t2 - t0) * 1e3)
            opt_ms.append((t2 - t1) * 1e3)
        stats = dict(opt.offload_stream.stats)
        io = opt.offload_stream.file.io
        opt.close_offload()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
    return dict(n_params=n_params, state_bytes=state_bytes, limit=limit, in_memory=in_memory, create_s=create_s,
                build_s=build_s, step_ms=step_ms, opt_ms=opt_ms, stats=stats, peak_rss=_status("VmHWM"), io=io,
                loss=loss.item(), steady_rss=rss, transient=transient, model_rss=model_rss, build_peak=build_peak,
                shard_bytes=z.shard_buffer.untyped_storage().nbytes(), grad_bytes=z.grad_nbytes,
                threads=torch.get_num_threads())


def largest(params: float, directory: str, steps: int, slack_gb: float, buffer_mb: float, bw: Dict[str, float],
            grad_dtype: str = "bf16", threads: int = 0):
    size = gpt_size_for(params)
    out = harness.run_ranks(_largest_rank, 1, (size, directory, steps, int(slack_gb * 2**30), buffer_mb,
                                               grad_dtype, threads), timeout_s=7200)[0]
    out["size"], out["grad_dtype"] = size, grad_dtype
    # the first step also creates the I/O threads; the rest are the steady state
    steady = out["opt_ms"][1:] or out["opt_ms"]
    opt_s = harness.Stats.of(steady).median_ms / 1e3
    per_step_r = out["stats"]["read_bytes"] / max(out["stats"]["steps"], 1)
    per_step_w = out["stats"]["write_bytes"] / max(out["stats"]["steps"], 1)
    out["gbps"] = (per_step_r + per_step_w) / opt_s / 1e9
    out["fraction"] = _disk_fraction(per_step_r, per_step_w, opt_s, bw)
    return out


# ---------------------------------------------------------------------------------------- CLI
def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.zero_offload", description=__doc__.split("\n")[0])
    modes = harness.add_profile_args(ap, smoke_help="tiny sizes; never writes CSV",
                                     quick_help="1 GiB file, small GPT, few reps")
    modes.add_argument("--largest", action="store_true", help="train a GPT whose optimizer state exceeds the budget")
    ap.add_argument("--params", type=float, default=0.5e9, help="--largest: about this many parameters")
    ap.add_argument("--steps", type=int, default=3, help="--largest: training steps")
    ap.add_argument("--slack-gb", type=float, default=1.0,
                    help="--largest: address space allowed beyond the peak of the warm-up step")
    ap.add_argument("--buffer-mb", type=float, default=64.0, help="--largest: offload_buffer_mb")
    ap.add_argument("--grad-dtype", choices=sorted(GRAD_DTYPES), default="bf16",
                    help="--largest: ZeroStage3(grad_dtype=): the gradient shard in bf16 (2 bytes per parameter, "
                         "the default) or fp32 (4)")
    ap.add_argument("--threads", type=int, default=0, help="--largest: torch threads (default: every core)")
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure (default: a temp dir)")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = "largest" if args.largest else harness.profile_of(args)
    directory = tempfile.mkdtemp(prefix="zero_offload_", dir=args.dir)
    t0 = time.time()
    print(f"device: {harness.device_name(torch.device('cpu'))} | torch {torch.__version__} | mode: {mode} | "
          f"scratch: {directory}", flush=True)
    try:
        if mode == "largest":
            bw = disk_bandwidth(directory, 1 << 30)
            print(f"disk: O_DIRECT sequential write {bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s (1 GiB file)")
            out = largest(args.params, directory, args.steps, args.slack_gb, args.buffer_mb, bw, args.grad_dtype,
                          args.threads)
            rows = _largest_rows(out, bw)
            _print_largest(out)
        else:
            bw, methods, rows, details = _run(mode, directory)
            _print_quick(mode, bw, methods, details)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n({time.time() - t0:.1f} s)")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


def _print_quick(mode, bw, methods, details) -> None:
    print(f"\ndisk, sequential O_DIRECT ({PROFILES[mode]['file_bytes'] >> 20} MiB file, {BLOCK >> 20} MiB requests, "
          f"best of 2 passes at queue depth 1 and 4): write {bw['write']:.2f} GB/s, read {bw['read']:.2f} GB/s")
    print(f"reading it in {CHUNK >> 20} MiB chunks:")
    for name, gbps in methods.items():
        print(f"  {name:<22} {gbps:6.2f} GB/s  ({gbps / bw['read']:.0%} of the O_DIRECT sequential read)")
    for kind, label, t_disk, t_mem, o_disk, o_mem, r, w, gbps, frac, rep, slow in details:
        print(f"\n{kind}: {label}")
        print(f"  full step: offloaded {t_disk.median_ms:.1f} ms (p20 {t_disk.p20_ms:.1f}, p80 {t_disk.p80_ms:.1f}) "
              f"vs in memory {t_mem.median_ms:.1f} ms: {t_disk.median_ms / t_mem.median_ms:.2f}x")
        print(f"  optimizer step: offloaded {o_disk.median_ms:.1f} ms vs in memory {o_mem.median_ms:.1f} ms")
        print(f"  traffic per step (both ranks): read {r / 2**20:.0f} MiB, write {w / 2**20:.0f} MiB in the slowest "
              f"rank's {slow:.0f} ms -> {gbps:.2f} GB/s, {frac:.0%} of the disk's sequential bandwidth")
        print(f"  per rank: optimizer state {rep['offload_bytes'] / 2**20:.0f} MiB on disk, "
              f"{rep['optimizer_bytes'] / 2**20:.0f} MiB of host buffers")


def _largest_rows(out, bw) -> List[dict]:
    common = dict(harness.common_fields("largest", torch.device("cpu"), 1), backend="gloo x1")
    size = out["size"]
    sizes = (f"{size_text(size)} ({out['n_params'] / 1e9:.2f}B params), {out['grad_dtype']} grads, state "
             f"{out['state_bytes'] / 2**30:.1f} GiB on disk, RLIMIT_AS {out['limit'] / 2**30:.1f} GiB, "
             f"{out['peak_rss'] / out['n_params']:.2f} B/param peak RSS")
    steady = harness.Stats.of(out["step_ms"][1:] or out["step_ms"])
    common["threads"] = out["threads"]
    return [dict(common, case="zero3_offload_largest_gpt_train_step", sizes=sizes, dtype="bfloat16",
                 ours_median_ms=steady.median_ms, ours_p20_ms=steady.p20_ms, ours_p80_ms=steady.p80_ms,
                 gbps=out["gbps"], bw_fraction=out["fraction"],
                 baseline=f"in-memory ZeroStage3Optimizer {out['in_memory'][:60]}", target="-", met="-",
                 mem_mb=out["peak_rss"] / 2**20)]


def _print_largest(out) -> None:
    size = out["size"]
    print(f"\nGPT {size_text(size)}: {out['n_params'] / 1e9:.3f}B parameters (bf16 in memory), optimizer state "
          f"{out['state_bytes'] / 2**30:.2f} GiB (fp32 master + moments) on disk, I/O {out['io']}")
    n = out["n_params"]
    print(f"{out['grad_dtype']} gradient shard ({out['grad_bytes'] / n:.2f} B/param), bf16 parameter shard "
          f"({out['shard_bytes'] / n:.2f} B/param); {out['threads']} threads")
    print(f"RSS per parameter: model built {out['model_rss'] / n:.2f} B, peak of the build (model + shards) "
          f"{out['build_peak'] / n:.2f} B, after warm-up {out['steady_rss'] / n:.2f} B, peak while training "
          f"offloaded {out['peak_rss'] / n:.2f} B ({out['peak_rss'] / 2**30:.2f} GiB)")
    print(f"after warm-up: RSS {out['steady_rss'] / 2**30:.2f} GiB, a step's transient "
          f"{out['transient'] / 2**20:.0f} MiB; address space capped at {out['limit'] / 2**30:.2f} GiB "
          f"(RLIMIT_AS: now + transient + slack)")
    print(f"in-memory ZeroStage3Optimizer under the cap: {out['in_memory']}")
    print(f"model + warm-up step {out['build_s']:.1f} s, state file created in {out['create_s']:.1f} s")
    pairs = zip(out["step_ms"], out["opt_ms"])
    print("steps (full / optimizer, ms): " + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in pairs))
    print(f"steady optimizer step: disk {out['gbps']:.2f} GB/s, {out['fraction']:.0%} of the disk's sequential "
          f"bandwidth; peak RSS while training offloaded {out['peak_rss'] / 2**30:.2f} GiB; "
          f"last loss {out['loss']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
