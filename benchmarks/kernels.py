"""Kernel microbenchmarks: each fused op against what a user would otherwise run.

    python -m benchmarks.kernels            # full sizes (the targets are defined at these)
    python -m benchmarks.kernels --quick    # smaller sizes, under a minute on 2 cores
    python -m benchmarks.kernels --smoke --no-csv --only adamw --backend cpp --plot

Every case times ours and the baseline back to back, interleaved, on the same data (see harness.py),
on every fused backend of the device (CPU: the C++ extension; CUDA: Triton *and* the CUDA extension),
prints one table row per (case, backend) and appends the same figures to benchmarks/results/kernels.csv
(``collect`` returns the rows for the suite, ``python -m parallel_layers bench``). GB/s counts the bytes
a kernel *must* move (each case states its formula); its fraction of the machine's copy bandwidth,
measured in the same run, says how close to the memory roofline the kernel is.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from parallel_layers import ops
from parallel_layers.optional import progress_bar

from . import harness

CSV_NAME = "kernels.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 50   # seconds --quick should take on the 2-core development machine (guideline)

# Sizes per mode. "many": (count, min elements, max elements) of a list of tensors, sizes drawn
# uniformly with a fixed seed (the same draw for every case that uses it, so rows are comparable).
PROFILES = {
    "full":  dict(flat=64 << 20, many=(2000, 10_000, 100_000), small=(5000, 100, 2000),
                  reps=15, warmup=3, copy_bytes=256 << 20),
    # quick: 1/8 of the flat elements, 1/20 and 1/10 of the tensor counts, 7 reps (~7 s on a quiet
    # 2-core VM). The buffers are still tens of MB, far past the 2 MB per-core L2, but a large shared
    # L3 (480 MB reported on the development VM) can hold them, so quick fractions of the copy bandwidth
    # (still measured at 256 MB, the DRAM figure of full runs) can exceed 100%: indicative only
    "quick": dict(flat=8 << 20, many=(100, 10_000, 100_000), small=(500, 100, 2000),
                  reps=7, warmup=1, copy_bytes=256 << 20),
    "smoke": dict(flat=4096, many=(8, 100, 1000), small=(16, 100, 1000),
                  reps=10, warmup=1, copy_bytes=4 << 20),
}
LR, WD, SEED = 1e-3, 1e-2, 0
ADAMW_CASES = ("adamw_flat", "fused_adamw_medium", "fused_adamw_small", "adamw_bf16_copy")
# Speedup targets on CPU (full sizes). On GPU every case (all are memory-bound) must reach 85% of the
# copy bandwidth, and the AdamW cases must also match or beat torch's fused AdamW.
CPU_TARGETS = {"adamw_flat": 1.0, "fused_adamw_medium": 1.0, "fused_adamw_small": 10.0,
               "adamw_bf16_copy": 1.25, "unscale_norm": 1.5, "bucket_pack": 1.5}
GPU_BW_TARGET = 0.85


@dataclass
class Ctx:
    device: torch.device
    backend: str
    prof: dict

    def randn(self, n: int, scale: float = 1.0) -> torch.Tensor:
        # One generator per tensor list, seeded, on the device: same data on every run and backend.
        return torch.randn(n, device=self.device, generator=self.gen) * scale

    def sizes(self, key: str) -> List[int]:
        count, lo, hi = self.prof[key]
        g = torch.Generator().manual_seed(SEED)
        return torch.randint(lo, hi + 1, (count,), generator=g).tolist()

    def __post_init__(self):
        self.gen = torch.Generator(device=self.device).manual_seed(SEED)


@dataclass
class Bench:
    sizes: str          # human description of the sizes
    dtype: str
    nbytes: int         # bytes the kernel must read + write per call
    ours: Callable[[], object]
    baseline: Callable[[], object]
    baseline_desc: str


def _fmt_n(n: int) -> str:
    # Flat buffers are powers of two (64M = 64 * 2**20); tensor-size bounds are decimal (10k, 100k).
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return f"{n / 1e6:.1f}M" if n >= 100_000 else str(n)


def _many_desc(ctx: Ctx, key: str, sizes: List[int]) -> str:
    count, lo, hi = ctx.prof[key]
    total = sum(sizes)
    return f"{count}x[{_fmt_n(lo)},{_fmt_n(hi)}]={total / 1e6:.1f}M" if total >= 100_000 else \
        f"{count}x[{lo},{hi}]={total}"


def _step_tensor(ctx: Ctx) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=ctx.device)


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------
def _flat_optimizer(ctx: Ctx, kind: str) -> Bench:
    """adamw_flat / adamw_bf16_copy / sgd_flat: one flat fp32 buffer, fp32 grads."""
    n = ctx.prof["flat"]
    p0, grad = ctx.randn(n), ctx.randn(n, 1e-2)   # grad is read-only: both sides share it
    p, tp = p0.clone(), torch.nn.Parameter(p0.clone())
    del p0
    tp.grad = grad
    step = _step_tensor(ctx)
    b = ctx.backend
    if kind == "sgd":
        buf = torch.zeros_like(p)
        opt = torch.optim.SGD([tp], lr=LR, momentum=0.9, fused=True)

        def ours():
            step.add_(1)   # the optimizer's step counter lives on the device, as in torch
            ops.sgd_step(p, grad, buf, lr=LR, step=step, momentum=0.9, backend=b)
        # read p, g, momentum (3 x 4 B) + write p, momentum (2 x 4 B)
        return Bench(_fmt_n(n), "fp32", 20 * n, ours, opt.step, "torch.optim.SGD(fused=True, momentum=0.9)")

    m, v = torch.zeros_like(p), torch.zeros_like(p)
    opt = torch.optim.AdamW([tp], lr=LR, weight_decay=WD, fused=True)
    if kind == "adamw":
        def ours():
            step.add_(1)
            ops.adamw_step(p, grad, m, v, lr=LR, step=step, weight_decay=WD, backend=b)
        # read p, g, m, v (4 x 4 B) + write p, m, v (3 x 4 B)
        return Bench(_fmt_n(n), "fp32", 28 * n, ours, opt.step, "torch.optim.AdamW(fused=True)")

    w16, tw16 = p.to(torch.bfloat16), p.to(torch.bfloat16)

    def ours_copy():
        step.add_(1)
        ops.adamw_step(p, grad, m, v, lr=LR, step=step, weight_decay=WD, param_copy=w16, backend=b)

    def base_copy():
        opt.step()
        tw16.copy_(tp.detach())
    # AdamW's 28 B plus writing the bf16 copy (2 B); the baseline also re-reads p (4 B), not counted
    return Bench(_fmt_n(n), "fp32(+bf16)", 30 * n, ours_copy, base_copy,
                 "AdamW(fused=True).step(); w_bf16.copy_(p)")


def case_adamw_flat(ctx):
    return _flat_optimizer(ctx, "adamw")


def case_adamw_bf16_copy(ctx):
    return _flat_optimizer(ctx, "adamw_copy")


def case_sgd_flat(ctx):
    return _flat_optimizer(ctx, "sgd")


def _fused_adamw(ctx: Ctx, key: str) -> Bench:
    from parallel_layers import FusedAdamW
    sizes = ctx.sizes(key)
    ours_ps, base_ps = [], []
    for n in sizes:
        p0 = ctx.randn(n)
        ours_ps.append(torch.nn.Parameter(p0))
        base_ps.append(torch.nn.Parameter(p0.clone()))
    ours_opt = FusedAdamW(ours_ps, lr=LR, weight_decay=WD, backend=ctx.backend)
    base_opt = torch.optim.AdamW(base_ps, lr=LR, weight_decay=WD, fused=True)
    # Grads are set once; FusedAdamW copies them into its flat gradient buffer on the first (warm-up)
    # step and points p.grad at views of it, which is where autograd accumulates in training. Only
    # .step() is timed.
    for po, pb, n in zip(ours_ps, base_ps, sizes):
        po.grad = pb.grad = ctx.randn(n, 1e-2)
    # same per-element traffic as adamw_flat: 28 B per element
    return Bench(_many_desc(ctx, key, sizes), "fp32", 28 * sum(sizes), ours_opt.step, base_opt.step,
                 "torch.optim.AdamW(fused=True)")


def case_fused_adamw_medium(ctx):
    return _fused_adamw(ctx, "many")


def case_fused_adamw_small(ctx):
    return _fused_adamw(ctx, "small")


def _tensor_list(ctx: Ctx, sizes: List[int], scale: float = 1.0) -> List[torch.Tensor]:
    return [ctx.randn(n, scale) for n in sizes]


def case_unscale_norm(ctx):
    sizes = ctx.sizes("many")
    ts = _tensor_list(ctx, sizes)
    tb = [t.clone() for t in ts]
    # The unscale is in place, so repeated calls would keep dividing. Instead of inv_scale = 1.0
    # (which a kernel could short-cut), both sides alternate inv_scale 0.5 and 2.0: powers of two,
    # so the data returns bit-exactly to where it started and every call does the full work.
    invs = [torch.full((1,), s, device=ctx.device) for s in (0.5, 2.0)]
    found_o, found_b = torch.zeros(1, device=ctx.device), torch.zeros(1, device=ctx.device)
    calls = {"ours": 0, "base": 0}
    b = ctx.backend

    def ours():
        calls["ours"] += 1
        return ops.unscale_and_norm(ts, inv_scale=invs[calls["ours"] % 2], found_inf=found_o, backend=b)

    def base():
        calls["base"] += 1
        torch._amp_foreach_non_finite_check_and_unscale_(tb, found_b, invs[calls["base"] % 2])
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tb)))
    # read x (4 B) + write x back unscaled (4 B)
    return Bench(_many_desc(ctx, "many", sizes), "fp32", 8 * sum(sizes), ours, base,
                 "_amp_foreach_non_finite_check_and_unscale_ + _foreach_norm + vector_norm(stack)")


WORLD = 8   # the 1/world_size scale of a DDP bucket


def case_bucket_pack(ctx):
    sizes = ctx.sizes("many")
    grads = _tensor_list(ctx, sizes, 1e-2)  # read-only: shared by both sides
    s = 1.0 / WORLD
    s_t = torch.full((1,), s, device=ctx.device)  # a DDP hook keeps its scale as a device tensor
    b = ctx.backend

    def ours():
        return ops.pack_bucket(grads, dtype=torch.bfloat16, scale=s_t, backend=b)

    def base():
        return _flatten_dense_tensors(grads).mul_(s).to(torch.bfloat16)
    # read fp32 grads (4 B) + write the bf16 bucket (2 B); both sides allocate their bucket
    return Bench(_many_desc(ctx, "many", sizes), "fp32->bf16", 6 * sum(sizes), ours, base,
                 "_flatten_dense_tensors(g).mul_(s).to(bf16)")


def case_bucket_unpack(ctx):
    sizes = ctx.sizes("many")
    bucket = ctx.randn(sum(sizes), 1e-2).to(torch.bfloat16)
    go = _tensor_list(ctx, sizes, 1e-2)
    gb = [g.clone() for g in go]
    s = 1.0 / WORLD
    s_t = torch.full((1,), s, device=ctx.device)
    b = ctx.backend

    def ours():
        ops.unpack_bucket(bucket, go, scale=s_t, accumulate=True, backend=b)

    def base():
        for g, sl in zip(gb, _unflatten_dense_tensors(bucket, gb)):
            g.add_(sl.float() * s)
    # read the bf16 bucket (2 B) + read and write the fp32 grad (4 + 4 B)
    return Bench(_many_desc(ctx, "many", sizes), "bf16->fp32", 10 * sum(sizes), ours, base,
                 "for g, sl in unflatten(bucket): g.add_(sl.float() * s)")


def case_multi_tensor_cast(ctx):
    sizes = ctx.sizes("many")
    srcs = _tensor_list(ctx, sizes)
    do = [torch.empty(n, dtype=torch.bfloat16, device=ctx.device) for n in sizes]
    db = [torch.empty_like(d) for d in do]
    one = torch.ones(1, device=ctx.device)
    found = torch.zeros(1, device=ctx.device)
    b = ctx.backend

    def ours():
        ops.multi_tensor_cast(srcs, do, scale=one, found_inf=found, backend=b)

    def base():
        torch._foreach_copy_(db, srcs)
    # read fp32 (4 B) + write bf16 (2 B)
    return Bench(_many_desc(ctx, "many", sizes), "fp32->bf16", 6 * sum(sizes), ours, base,
                 "torch._foreach_copy_(bf16 dsts, fp32 srcs)")


CASES: Dict[str, Callable[[Ctx], Bench]] = {
    "adamw_flat": case_adamw_flat,
    "fused_adamw_medium": case_fused_adamw_medium,
    "fused_adamw_small": case_fused_adamw_small,
    "adamw_bf16_copy": case_adamw_bf16_copy,
    "unscale_norm": case_unscale_norm,
    "bucket_pack": case_bucket_pack,
    "bucket_unpack": case_bucket_unpack,
    "multi_tensor_cast": case_multi_tensor_cast,
    "sgd_flat": case_sgd_flat,
}


def target_for(case: str, device: torch.device):
    """(speedup target or None, copy-bandwidth-fraction target or None)."""
    if device.type == "cuda":
        return (1.0 if case in ADAMW_CASES else None), GPU_BW_TARGET
    return CPU_TARGETS.get(case), None


def _target_text(speedup_t, bw_t) -> str:
    parts = ([f">={speedup_t:g}x"] if speedup_t else []) + ([f">={bw_t:.0%} bw"] if bw_t else [])
    return " & ".join(parts) or "-"


# ----------------------------------------------------------------------------------------------
# driver
# ----------------------------------------------------------------------------------------------
def default_backends(device: torch.device) -> List[str]:
    """CUDA: both fused backends, Triton and the CUDA extension, always: one that cannot run here gives
    error rows saying why instead of silently leaving the table. CPU: the C++ extension, or (when it
    is missing) the torch reference backend with a note."""
    if device.type == "cuda":
        return ["triton", "cuda"]
    problem = backend_problem("cpp", device)
    if problem is None:
        return ["cpp"]
    print(f"note: no fused backend available on {device.type} (cpp: {problem}); measuring the torch "
          f"reference backend instead, which says nothing about the kernels", file=sys.stderr)
    return ["torch"]


def backend_problem(backend: str, device: torch.device) -> Optional[str]:
    try:
        ops.resolve_backend("adamw_step", device, backend)
        return None
    except (RuntimeError, ValueError) as exc:
        return str(exc)


def forced_backend(backend: str):
    """Force the backend for code that takes no backend= argument (FusedAdamW's internals)."""
    return harness.environ({ops.ENV_VAR: backend})


def measure(case: str, ctx: Ctx) -> dict:
    """Time one case on one backend; the copy-bandwidth fractions are added by ``finish``."""
    with forced_backend(ctx.backend):
        bench = CASES[case](ctx)
        t_ours, t_base = harness.compare(bench.ours, bench.baseline, ctx.device,
                                         reps=ctx.prof["reps"], warmup=ctx.prof["warmup"])
    row = harness.comparison_row({}, case, t_ours, t_base, sizes=bench.sizes, dtype=bench.dtype,
                                 backend=ctx.backend, date=harness.now_iso(),
                                 gbps=bench.nbytes / (t_ours.median_ms * 1e-3) / 1e9,
                                 base_gbps=bench.nbytes / (t_base.median_ms * 1e-3) / 1e9,
                                 baseline=bench.baseline_desc)
    del bench
    harness.free_memory(ctx.device)
    return row


def finish(row: dict, copy_gbps: float, device: torch.device) -> dict:
    sp_t, bw_t = target_for(row["case"], device)
    row["target"] = _target_text(sp_t, bw_t)
    if row.get("met") == "error":
        return row
    row.update(copy_gbps=copy_gbps, bw_fraction=row["gbps"] / copy_gbps,
               base_bw_fraction=row["base_gbps"] / copy_gbps, met="-")
    if sp_t or bw_t:
        ok = (not sp_t or row["speedup"] >= sp_t) and (not bw_t or row["bw_fraction"] >= bw_t)
        row["met"] = "yes" if ok else "no"
    return row


def error_row(case: str, backend: str, exc: BaseException) -> dict:
    """What a case that could not run leaves in the table and the CSV: met "error", the reason in
    ``baseline`` (one line), no figures."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return dict(case=case, sizes="", dtype="", backend=backend, date=harness.now_iso(), met="error",
                baseline=f"error: {text[:400]}")


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None, *,
            cases: Optional[List[str]] = None, backends: Optional[List[str]] = None, reps: Optional[int] = None,
            out=sys.stderr) -> List[dict]:
    """Every case (or ``cases``) on every default backend (or ``backends``) in ``mode`` (smoke | quick |
    full, see ``PROFILES``; ``reps`` overrides the profile's); returns the finished CSV rows. Writes no
    CSV and prints no table: the run's header and the copy bandwidth go to ``out``.

    The copy bandwidth is measured before the cases and again after them, and the better figure is
    used: on a shared machine a busy moment during one measurement would otherwise inflate every
    fraction of the run. A case that fails gives a row with met "error" (see ``error_row``) and the
    others still run.
    """
    prof = dict(PROFILES[mode])
    if reps:
        prof["reps"] = reps
    cases = list(cases or CASES)
    backends = list(backends or default_backends(device))
    problems = {b: backend_problem(b, device) for b in backends}
    common = harness.common_fields(mode, device, torch.get_num_threads())

    copy_gbps = harness.copy_bandwidth(device, prof["copy_bytes"])
    inplace_gbps = harness.copy_bandwidth(device, prof["copy_bytes"], inplace=True)
    print(f"device: {common['device']} ({device}) | threads: {common['threads']} | torch {common['torch']}"
          f" | triton {common['triton']} | mode: {mode}, {prof['reps']} reps after {prof['warmup']} warm-up",
          file=out)
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s (dst.copy_(src) of {prof['copy_bytes'] >> 20} MB, "
          f"bytes read + written per second); in place (x.add_(1), same bytes): {inplace_gbps:.1f} GB/s",
          file=out, flush=True)

    rows = []
    for case in cases:
        for backend in backends:
            if progress:
                progress(f"{case} [{backend}]")
            try:
                if problems[backend]:
                    raise RuntimeError(f"backend {backend!r} cannot run on {device}: {problems[backend]}")
                rows.append(measure(case, Ctx(device, backend, prof)))
            except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others' figures
                rows.append(error_row(case, backend, exc))
                harness.free_memory(device)
    copy_end = harness.copy_bandwidth(device, prof["copy_bytes"])
    copy_gbps = max(copy_gbps, copy_end)
    print(f"copy bandwidth at the end: {copy_end:.1f} GB/s; fractions below use {copy_gbps:.1f} GB/s", file=out)
    return [finish(dict(common, inplace_gbps=inplace_gbps, **r), copy_gbps, device) for r in rows]


def print_table(rows: List[dict], mode: str) -> None:
    cols = [("case", "case", "{}"), ("sizes", "sizes", "{}"), ("dtype", "dtype", "{}"),
            ("backend", "backend", "{}"), ("ours ms", "ours_median_ms", "{:.3f}"),
            ("base ms", "base_median_ms", "{:.3f}"), ("speedup", "speedup", "{:.2f}x"),
            ("GB/s", "gbps", "{:.1f}"), ("of copy", "bw_fraction", "{:.0%}"),
            ("target", "target", "{}"), ("met", "met", "{}"), ("p20-p80 spread ours/base", "spread", "{}")]

    def spread(r):  # how noisy the timings were: (p80 - p20) / median, for ours and the baseline
        return (f"{(r['ours_p80_ms'] - r['ours_p20_ms']) / r['ours_median_ms']:.0%}/"
                f"{(r['base_p80_ms'] - r['base_p20_ms']) / r['base_median_ms']:.0%}")

    # no spaces inside cells before "target": tests/test_benchmarks_smoke.py splits rows on whitespace;
    # a failed case shows "-" for its figures and "error" under met (its reason is printed by main)
    cells = [[fmt.format(r[key]) if r.get("met") != "error" or key in ("case", "backend", "target", "met")
              else "-" for _, key, fmt in cols[:-1]] + [spread(r) if r.get("met") != "error" else "-"]
             for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (h, _, _), w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())
    if mode != "full" and any(r["met"] not in ("-", "error") for r in rows):
        print(f"(--{mode}: targets are defined at full sizes; 'met' here is only indicative)")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes, for the smoke test",
                             quick_help=f"smaller sizes, fewer reps (~{QUICK_BUDGET_S} s)")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                    help="run only cases whose name contains this (repeatable)")
    ap.add_argument("--backend", help="one backend (torch, cpp, triton, cuda); default: every fused "
                                      "backend of the device")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, help="timed repetitions (default: the mode's profile)")
    ap.add_argument("--plot", action="store_true", help="draw PNGs under benchmarks/results/ afterwards")
    args = ap.parse_args(argv)

    mode = harness.profile_of(args)
    device = torch.device(args.device)
    cases = [c for c in CASES if not args.only or any(s in c for s in args.only)]
    if not cases:
        print(f"no case matches --only {args.only}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if args.backend:
        problem = backend_problem(args.backend, device)
        if problem:
            print(f"backend {args.backend!r} cannot run on {device}: {problem}", file=sys.stderr)
            return 2
    backends = [args.backend] if args.backend else default_backends(device)

    bars = []   # the progress bar starts with the first case, after collect's header lines

    def progress(text: str) -> None:  # called before each case: the bar counts the ones started
        if not bars:
            bars.append(progress_bar(total=len(cases) * len(backends), desc="kernels", unit="case", file=sys.stderr,
                             leave=False))
        bars[0].set_postfix_str(text, refresh=False)
        bars[0].update(1)
    try:
        rows = collect(mode, device, progress, cases=cases, backends=backends, reps=args.reps, out=sys.stdout)
    finally:
        for bar in bars:
            bar.close()
    print()
    print_table(rows, mode)
    if not args.no_csv:
        harness.append_csv(args.csv, rows)
        print(f"\nappended {len(rows)} rows to {os.path.relpath(args.csv)}")
    good = [r for r in rows if r["met"] != "error"]
    if args.plot and good:
        from . import plots
        # with --no-csv, plot this run's rows; otherwise the whole CSV (latest row per case and device)
        for path in (plots.draw(rows=good) if args.no_csv else plots.draw(args.csv)):
            print(f"plot: {os.path.relpath(path)}")
    failures = [r for r in rows if r["met"] == "error"]
    for r in failures:
        print(f"FAILED {r['case']} [{r['backend']}]: {r['baseline']}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
