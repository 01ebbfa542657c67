"""Shared benchmark machinery: timing, the machine's copy bandwidth, device/version info, the CSV.

Timing rules (benchmarks/README.md, "How a run is timed"): ours and the baseline run back to back in one
process on the same data; each is warmed up, then timed ``reps`` times *interleaved* (ours, baseline, baseline, ours,
...) so that drift from other processes on a shared machine hits both sides alike; we report the
median and the 20th/80th percentiles. On CUDA every call is bracketed by ``torch.cuda.Event``s after a
synchronize, so a call's time includes any host launch gaps the GPU had to wait through (that is what
a training step pays), but never work queued by the previous call.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import gc
import os
import platform
import statistics
import time
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CSV_FIELDS = [
    "run_id", "date", "mode", "case", "sizes", "dtype", "backend", "device", "torch", "triton", "threads",
    "ours_median_ms", "ours_p20_ms", "ours_p80_ms", "base_median_ms", "base_p20_ms", "base_p80_ms",
    "speedup", "gbps", "copy_gbps", "inplace_gbps", "bw_fraction", "base_gbps", "base_bw_fraction", "target", "met",
    "baseline", "x", "mem_mb",
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
        med = statistics.median(s)
        # quantiles() interpolates as (a*(5-d) + b*d)/5, which for a == b can land an ulp off a; keep
        # p20 <= median <= p80 exact.
        return cls(med, min(q[0], med), max(q[3], med))


@dataclass
class PairedRatio:
    """``ours / baseline`` over paired samples (the two timed back to back, so drift hits both): the
    median of the per-pair ratios and a 95% bootstrap interval of that median."""
    median: float
    low: float
    high: float

    @classmethod
    def of(cls, ours_ms: Sequence[float], base_ms: Sequence[float], resamples: int = 2000) -> "PairedRatio":
        if len(ours_ms) != len(base_ms) or not ours_ms:
            raise ValueError(f"PairedRatio: {len(ours_ms)} samples of ours against {len(base_ms)} of the "
                             f"baseline; time them in pairs")
        ratios = torch.tensor([o / b for o, b in zip(ours_ms, base_ms)], dtype=torch.float64)
        gen = torch.Generator().manual_seed(0)          # the same interval for the same samples
        picks = torch.randint(0, len(ratios), (resamples, len(ratios)), generator=gen)
        medians = ratios[picks].quantile(0.5, dim=1).sort().values
        return cls(float(ratios.quantile(0.5)), float(medians[int(0.025 * resamples)]),
                   float(medians[int(0.975 * resamples) - 1]))


_L2_SCRUB: Dict[torch.device, torch.Tensor] = {}


def flush_l2(device: torch.device) -> None:
    """Evict the GPU's L2 cache (write a buffer twice its size) so a timed call starts cold, as it would
    in a training step where other work ran in between; a no-op on CPU, whose caches the working sets
    here exceed anyway."""
    if device.type != "cuda":
        return
    if device not in _L2_SCRUB:
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
        _L2_SCRUB[device] = torch.empty(2 * l2, dtype=torch.uint8, device=device)
    _L2_SCRUB[device].zero_()


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds one call of ``fn`` takes on ``device`` (L2 flushed first on a GPU)."""
    if device.type == "cuda":
        flush_l2(device)
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
    src = dst = None       # freed (the timed closure is done with them)
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


def peak_flops(device: torch.device, kind: str = "bf16") -> Optional[float]:
    """The data sheet's dense peak FLOP/s of ``kind`` for a GPU the planner has a profile of (the
    denominator of MFU and of a matmul's efficiency); None on a CPU or another GPU."""
    if device.type != "cuda":
        return None
    from parallel_layers.planner.hardware import BUILTIN
    name = torch.cuda.get_device_name(device).lower()
    return next((BUILTIN[key].peak_flops.get(kind) for key in ("h200", "h100", "a100") if key in name), None)


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
    """Append ``rows``; write the header first if the file is new. A file written by an older harness
    whose header lacks some of ``CSV_FIELDS`` is first rewritten with those columns added (empty in
    its old rows), so no figure of a new row is dropped and no old row changes; a row's keys beyond
    ``CSV_FIELDS`` are columns too."""
    if not rows:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # a benchmark's own figures (tokens_per_s, mfu, efficiency...) follow the common columns
    fields = CSV_FIELDS + [k for k in dict.fromkeys(k for row in rows for k in row) if k not in CSV_FIELDS]
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    if not new:
        with open(path, newline="") as fh:
            header = next(csv.reader(fh), None)
        if header:
            fields = header + [f for f in fields if f not in header]
            if len(fields) > len(header):
                old_rows = read_csv(path)
                with open(path, "w", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=fields, restval="")
                    writer.writeheader()
                    writer.writerows(old_rows)
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



# ------------------------------------------------------------------------------------- multi-process
@contextlib.contextmanager
def environ(values: Dict[str, str]):
    """``values`` set in ``os.environ`` for the block (inherited by processes spawned meanwhile: how a
    benchmark gives its ranks e.g. ``MALLOC_MMAP_THRESHOLD_``), restored afterwards so that later
    benchmarks of the same suite run never inherit them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def slowest_rank_ms(fn: Callable[[], object], group=None) -> float:
    """One call of ``fn`` on every rank of ``group``, started together at a barrier; returns the slowest
    rank's time in ms (the all-reduce that finds it runs outside the timed region). A collective."""
    import torch.distributed as dist

    dist.barrier(group)
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item() * 1e3


def run_ranks(fn: Callable, world: int, args: tuple = (), timeout_s: float = 900,
              retain_memory: bool = False, bind_cores: bool = False) -> List[object]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh gloo ranks (one thread each); return the per-rank
    results in rank order. ``fn`` must be a module-level function.

    ``retain_memory``: the ranks start with ``cpu_allocator.RETAIN_ENV`` (glibc keeps freed memory for
    reuse instead of faulting it back in every step, as a CPU training job should run: see
    ``parallel_layers.cpu_allocator``). The timing benchmarks set it, so ours and the torch baselines,
    which run in the same processes, both get it; the benchmarks that measure resident memory do not.

    ``bind_cores``: each rank binds its threads to a core of its own where the machine has a core per
    rank (``parallel_layers.cpu_affinity``), as a CPU training job should run; the torch baselines in the
    same processes are bound too. Set by the benchmarks measured with it (pipeline).

    A one-shot ``parallel_layers.testing.WorkerPool``: fresh processes, so a benchmark's memory figures
    and environment (see :func:`environ`) start clean. A rank that raises, dies, or a run past
    ``timeout_s`` raises ``RankFailure`` with every failing rank's traceback and the others are killed:
    a benchmark never hangs its caller.
    """
    from parallel_layers.cpu_allocator import RETAIN_ENV
    from parallel_layers.testing.workers import WorkerPool

    pool = WorkerPool(world, pg_timeout_s=300, bind_cores=bind_cores)
    with environ(RETAIN_ENV if retain_memory else {}), pool:
        return pool.run(fn, *args, timeout=timeout_s)


def common_fields(mode: str, device: torch.device, threads: int) -> Dict[str, object]:
    """The CSV columns every row of one run shares: run id, date, mode, machine, versions, threads."""
    stamp = now_iso()
    return dict(run_id=stamp, date=stamp, mode=mode, device=device_name(device), threads=threads, **versions())


def max_abs_diff(ours, theirs) -> float:
    """The largest ``|ours - theirs|`` over two equally long sequences of numbers (or tensors of one shape),
    NaN if either holds a NaN or an infinity: a diverged run must never look close to the other (Python's
    ``max`` returns a NaN only when it comes first)."""
    a = torch.as_tensor(ours, dtype=torch.float64).flatten()
    b = torch.as_tensor(theirs, dtype=torch.float64).flatten()
    if a.shape != b.shape:
        raise ValueError(f"max_abs_diff: {a.numel()} values against {b.numel()}; compare runs of the same length")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    return float((a - b).abs().max()) if a.numel() else 0.0


def comparison_row(common: Dict[str, object], case: str, ours_ms, base_ms, **extra) -> Dict[str, object]:
    """A CSV row from the timings of ours and the baseline (raw samples in ms, or ``Stats`` already
    reduced, as ``compare`` returns them): median, p20, p80 of each and
    speedup = baseline median / our median (above 1: ours is faster)."""
    so = ours_ms if isinstance(ours_ms, Stats) else Stats.of(ours_ms)
    sb = base_ms if isinstance(base_ms, Stats) else Stats.of(base_ms)
    return dict(common, case=case, ours_median_ms=so.median_ms, ours_p20_ms=so.p20_ms, ours_p80_ms=so.p80_ms,
                base_median_ms=sb.median_ms, base_p20_ms=sb.p20_ms, base_p80_ms=sb.p80_ms,
                speedup=sb.median_ms / so.median_ms, **extra)


def latest_rows(rows: Sequence[Dict[str, str]], modes: Sequence[str] = ("full", "quick"),
                key_fields: Sequence[str] = ("case", "sizes", "dtype", "backend")) -> Dict[str, List[Dict[str, str]]]:
    """What benchmarks/README.md and the plots show: per device, the rows of the most complete mode measured on it
    (the first of ``modes`` present; smoke runs never count by default); of those, for every case, the
    rows of the newest run that measured that case (so a run at new sizes replaces the old sizes' rows,
    while a case a later ``--only`` run skipped keeps its figures); one row per ``key_fields``.
    Devices in sorted order; rows in first-seen order."""
    by_device: Dict[str, List[Dict[str, str]]] = {}
    for r in rows:
        if r.get("mode") in modes:
            by_device.setdefault(r.get("device", "?"), []).append(r)
    out: Dict[str, List[Dict[str, str]]] = {}
    for device in sorted(by_device):
        device_rows = by_device[device]
        best = min(modes.index(r["mode"]) for r in device_rows)
        device_rows = [r for r in device_rows if modes.index(r["mode"]) == best]
        newest_run: Dict[str, str] = {}
        for r in device_rows:
            newest_run[r["case"]] = max(newest_run.get(r["case"], ""), r.get("run_id", ""))
        newest: Dict[tuple, Dict[str, str]] = {}
        for r in device_rows:
            if r.get("run_id", "") == newest_run[r["case"]]:
                newest[tuple(r.get(k, "") for k in key_fields)] = r
        out[device] = list(newest.values())
    return out


# ------------------------------------------------------------------------------------- the printed table
def _short(text: object, width: int) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= width else s[: width - 1] + "~"


def _num(row: Dict[str, object], key: str, fmt: str) -> str:
    value = row.get(key, "")
    if value in ("", None):
        return "-"
    try:
        return fmt.format(float(value))
    except (TypeError, ValueError):
        return str(value)


def format_table(rows: List[Dict[str, object]]) -> str:
    """One plain-text table for every row of the run: what was measured, ours, the baseline, the ratio
    (baseline time / ours: above 1 means ours is faster), the fraction of the copy bandwidth measured in
    the same run (memory-bound kernels), the target and whether it was met."""
    cols = [("group", lambda r: r.get("group", ""))] if any(r.get("group") for r in rows) else []
    cols += [("case", lambda r: r["case"]),
            ("sizes", lambda r: _short(r.get("sizes"), 34)), ("backend", lambda r: r.get("backend", "")),
            ("ours ms", lambda r: _num(r, "ours_median_ms", "{:.3g}")),
            ("p20-p80", lambda r: (_num(r, "ours_p20_ms", "{:.3g}") + "-" + _num(r, "ours_p80_ms", "{:.3g}"))
             if r.get("ours_p20_ms", "") not in ("", None) else "-"),
            ("baseline", lambda r: _short(r.get("baseline"), 30)),
            ("base ms", lambda r: _num(r, "base_median_ms", "{:.3g}")),
            ("ratio", lambda r: _num(r, "speedup", "{:.2f}x")),
            ("of copy", lambda r: _num(r, "bw_fraction", "{:.0%}")),
            ("MB/rank", lambda r: _num(r, "mem_mb", "{:.1f}")),
            ("target", lambda r: _short(r.get("target") or "-", 24)),
            ("met", lambda r: "-" if r.get("met") in (None, "") else str(r["met"]))]
    cells = [[fn(r) for _, fn in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _) in enumerate(cols)]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip() for c in cells]
    return "\n".join(lines)


def missed(rows: List[Dict[str, object]]) -> List[str]:
    return [f"{r.get('group', '')}/{r['case']} [{r.get('sizes', '')}, {r.get('backend', '')}]: "
            f"target {r.get('target')}, {_short(r.get('baseline'), 80)}"
            for r in rows if str(r.get("met", "")).lower() in ("no", "false")]


def print_and_append(rows: List[Dict[str, object]], csv_path: Optional[str]) -> None:
    """What every benchmark's CLI ends with: the table, then the rows appended to ``csv_path`` (None: not)."""
    print(format_table(rows) if rows else "(no rows)")
    append_and_report(rows, csv_path)


def append_and_report(rows: List[Dict[str, object]], csv_path: Optional[str]) -> None:
    """The rows appended to ``csv_path`` and a line saying so; nothing if ``csv_path`` is None or no rows."""
    if csv_path and rows:
        append_csv(csv_path, rows)
        print(f"appended {len(rows)} rows to {os.path.relpath(csv_path)}")


# ------------------------------------------------------------------------------------- the command line
def add_profile_args(parser: argparse.ArgumentParser, smoke_help: str, quick_help: str):
    """``--smoke`` or ``--quick``, the sizes a benchmark runs at (neither: the full run; see :func:`profile_of`).
    Returns their mutually exclusive group, to which a benchmark with a mode of its own adds it."""
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument("--smoke", action="store_true", help=smoke_help)
    modes.add_argument("--quick", action="store_true", help=quick_help)
    return modes


def add_csv_args(parser: argparse.ArgumentParser, csv_path: Optional[str] = None,
                 no_csv_help: Optional[str] = None) -> None:
    """``--no-csv``; given ``csv_path``, also ``--csv PATH`` (default ``csv_path``), and ``--no-csv``'s help
    then names that file unless ``no_csv_help`` is given."""
    if csv_path is not None and no_csv_help is None:
        no_csv_help = f"do not append to {os.path.relpath(csv_path)}"
    parser.add_argument("--no-csv", action="store_true", help=no_csv_help)
    if csv_path is not None:
        parser.add_argument("--csv", default=csv_path, help="CSV file to append to")


def profile_of(args: argparse.Namespace) -> str:
    """The profile :func:`add_profile_args`' options chose: "smoke", "quick" or "full"."""
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def csv_target(args: argparse.Namespace, csv_path: str) -> Optional[str]:
    """``csv_path``, or None where the run must not write: with ``--no-csv``, and in a smoke run (its tiny
    sizes check that the program runs; its figures are no results to keep)."""
    return None if args.no_csv or args.smoke else csv_path
