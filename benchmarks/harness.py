"""Shared benchmark machinery: timing, the machine's copy bandwidth, device/version info, the CSV.

Timing rules (DESIGN.md, "Benchmarks"): ours and the baseline run back to back in one process on the
same data; each is warmed up, then timed ``reps`` times *interleaved* (ours, baseline, baseline, ours,
...) so that drift from other processes on a shared machine hits both sides alike; we report the
median and the 20th/80th percentiles. On CUDA every call is bracketed by ``torch.cuda.Event``s after a
synchronize, so a call's time includes any host launch gaps the GPU had to wait through (that is what
a training step pays), but never work queued by the previous call.
"""
from __future__ import annotations

import csv
import datetime
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Dict, List, Sequence, Tuple

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CSV_FIELDS = [
    "run_id", "date", "mode", "case", "sizes", "dtype", "backend", "device", "torch", "triton", "threads",
    "ours_median_ms", "ours_p20_ms", "ours_p80_ms", "base_median_ms", "base_p20_ms", "base_p80_ms",
    "speedup", "gbps", "copy_gbps", "inplace_gbps", "bw_fraction", "base_gbps", "base_bw_fraction", "target", "met",
    "baseline",
]


@dataclass
class Stats:
    median_ms: float
    p20_ms: float
    p80_ms: float

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> "Stats":
        s = sorted(samples_ms)
        if len(s) == 1:
            return cls(s[0], s[0], s[0])
        # 'inclusive' keeps the percentiles inside the observed range for small sample counts.
        q = statistics.quantiles(s, n=5, method="inclusive")
        return cls(statistics.median(s), q[0], q[3])


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one call of ``fn`` takes on ``device``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def compare(ours: Callable[[], object], baseline: Callable[[], object], device: torch.device,
            reps: int, warmup: int) -> Tuple[Stats, Stats]:
    """Warm both up, then time them interleaved; returns (ours, baseline) statistics."""
    for _ in range(warmup):
        ours()
        baseline()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_ours: List[float] = []
    t_base: List[float] = []
    for i in range(reps):
        # Alternate which side goes first so neither always runs right after the other's cache state.
        if i % 2 == 0:
            t_ours.append(time_call(ours, device))
            t_base.append(time_call(baseline, device))
        else:
            t_base.append(time_call(baseline, device))
            t_ours.append(time_call(ours, device))
    return Stats.of(t_ours), Stats.of(t_base)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, reps: int = 10, inplace: bool = False) -> float:
    """The machine's achievable memory bandwidth in GB/s: ``dst.copy_(src)`` of ``nbytes`` fp32.

    Bytes counted: ``nbytes`` read + ``nbytes`` written per copy (device-to-device on CUDA). Uses
    torch's own thread count, like every kernel measured against it.

    ``inplace=True`` measures ``x.add_(1)`` instead (same bytes counted). On CPUs that figure is
    higher: a store to a line not in cache first reads it (write-allocate), so ``copy_`` into a
    separate buffer really moves 12 B per element while we count 8, whereas kernels that update in
    place (the optimizers, unscale, unpack-accumulate) do not pay that read. The table's fractions
    use ``copy_`` as specified; the in-place figure is printed and stored beside it for context.
    """
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)  # ones, not empty: fault the pages in now
    dst = torch.zeros_like(src)
    fn = (lambda: src.add_(1.0)) if inplace else (lambda: dst.copy_(src))
    for _ in range(2):
        fn()
    samples = [time_call(fn, device) for _ in range(reps)]
    del src, dst
    free_memory(device)
    return 2 * n * 4 / (statistics.median(samples) * 1e-3) / 1e9


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def versions() -> Dict[str, str]:
    # importlib.metadata rather than ``import triton``: importing triton initialises its drivers,
    # which is slow and pointless on a CPU-only machine.
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version}


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def append_csv(path: str, rows: Sequence[Dict[str, object]]) -> None:
    """Append ``rows``; write the header first if the file is new. An existing file keeps its header
    (columns it lacks are dropped, so an older CSV is never corrupted by a newer harness)."""
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fields = CSV_FIELDS
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), None)
        if header:
            fields = header
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore", restval="")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})


def read_csv(path: str) -> List[Dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM, ...) in MB: how CPU peak memory is read."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs=5); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False

