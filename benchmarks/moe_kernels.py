"""Mixture-of-Experts kernels against the torch paths they replace.

    python -m benchmarks.moe_kernels            # full sizes
    python -m benchmarks.moe_kernels --quick    # small sizes, a few seconds on 2 cores
    python -m benchmarks.moe_kernels --smoke --no-csv --backend cpp

Cases, each timed back to back with its torch baseline on the same data (harness.compare):
- ``router_topk``: ``ops.router_topk`` (scores, top-k, normalisation and counts in one pass) vs the torch
  route math (its ``backend="torch"``: softmax, topk, divide, scatter-add counts).
- ``permute``: ``ops.permute_tokens`` (counts and stable positions by per-expert prefix sums, then the row
  gather) vs the reference (stable argsort, ``index_select``).
- ``unpermute``: ``ops.unpermute_tokens`` (weighted slot-order gather-sum) vs the reference (``index_select``
  of the weights, multiply, ``index_copy`` into slots, slot-by-slot sum).
- ``grouped_mm`` (CUDA only: the Triton kernel needs a GPU outside the interpreter): one Triton launch for all
  experts vs a loop of ``F.linear`` over the experts' blocks.
Both sides go through the same op with its argument checks (the baseline with ``backend="torch"``). Forward
only. GB/s counts the bytes a kernel must move (each case states its formula). Rows go to
``benchmarks/results/moe_kernels.csv`` (``collect`` returns them for the suite).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Tuple

import torch

from parallel_layers import ops
from parallel_layers.ops import moe_permute, moe_routing
from parallel_layers.ops.grouped_mm import grouped_mm, reference_grouped_mm

from . import harness
from .kernels import backend_problem, error_row

CSV_NAME = "moe_kernels.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
# tokens, hidden, experts, top_k, intermediate (grouped_mm's output width), reps, warm-up
PROFILES = {
    "full": dict(T=16384, H=4096, E=64, k=8, I=1024, reps=10, warmup=2),
    "quick": dict(T=2048, H=512, E=16, k=2, I=256, reps=5, warmup=1),
    "smoke": dict(T=64, H=64, E=8, k=2, I=32, reps=3, warmup=1),
}
CPU_FULL = dict(T=8192, H=1024, E=32, k=4, I=512)   # the full sizes would not fit a small CPU box's memory


def _data(prof: dict, device: torch.device, dtype: torch.dtype):
    g = torch.Generator(device=device).manual_seed(0)
    T, H, E, k = prof["T"], prof["H"], prof["E"], prof["k"]
    logits = torch.randn(T, E, device=device, generator=g)
    weights, experts, counts = moe_routing.reference_router_topk(logits, k)
    hidden = torch.randn(T, H, device=device, generator=g).to(dtype)
    return logits, weights, experts, counts, hidden


def _cases(prof: dict, device: torch.device, backend: str, dtype: torch.dtype
           ) -> List[Tuple[str, int, Callable, Callable, str]]:
    """``(case, bytes moved, ours, baseline, baseline description)`` for every case that runs here."""
    T, H, E, k = prof["T"], prof["H"], prof["E"], prof["k"]
    logits, weights, experts, counts, hidden = _data(prof, device, dtype)
    size = hidden.element_size()
    N = int(counts.sum())
    _, order, _ = moe_permute.reference_permute(hidden, experts, E, N)
    expert_out = torch.randn(N, H, device=device).to(dtype)
    cases = [
        # read logits (4 B each), write weights (4 B) and experts (8 B) per slot
        ("router_topk", 4 * T * E + 12 * T * k, lambda: ops.router_topk(logits, k, backend=backend),
         lambda: ops.router_topk(logits, k, backend="torch"), "softmax + topk + divide + scatter_add"),
        # read and write every kept row once
        ("permute", 2 * N * H * size, lambda: ops.permute_tokens(hidden, experts, E, backend=backend),
         lambda: ops.permute_tokens(hidden, experts, E, backend="torch"), "argsort(stable) + index_select"),
        # read every kept row, write every token's row
        ("unpermute", (N + T) * H * size, lambda: ops.unpermute_tokens(expert_out, order, weights, T, backend=backend),
         lambda: ops.unpermute_tokens(expert_out, order, weights, T, backend="torch"),
         "index_copy into slots + slot sum"),
    ]
    if device.type == "cuda" and backend == "triton":
        w = torch.randn(E, prof["I"], H, device=device).to(dtype) * H ** -0.5
        x = hidden.repeat_interleave(k, 0)[:N]
        # read x and W, write the product
        cases.append(("grouped_mm", (N * H + E * prof["I"] * H + N * prof["I"]) * size,
                      lambda: grouped_mm(x, w, counts, backend="triton"),
                      lambda: reference_grouped_mm(x, w, counts), "loop of F.linear per expert"))
    return cases


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None, *,
            backends: Optional[List[str]] = None, out=sys.stderr) -> List[dict]:
    """Every case on every fused backend of ``device`` (or ``backends``) in ``mode``; the finished CSV rows."""
    prof = dict(PROFILES[mode])
    if device.type == "cpu" and mode == "full":
        prof.update(CPU_FULL)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backends = backends or (["triton"] if device.type == "cuda" else ["cpp"])
    common = harness.common_fields(mode, device, torch.get_num_threads())
    sizes = f"T={prof['T']},H={prof['H']},E={prof['E']},k={prof['k']}"
    print(f"moe kernels: {common['device']} ({device}) | {mode}: {sizes}, {prof['reps']} reps", file=out)
    if device.type != "cuda":
        print("grouped_mm: the Triton kernel runs on CUDA only here; no row on CPU", file=out)
    rows = []
    for backend in backends:
        problem = backend_problem(backend, device)
        if problem:
            rows.append(error_row("moe", backend, RuntimeError(problem)))
            continue
        with torch.no_grad():
            for case, nbytes, ours, base, desc in _cases(prof, device, backend, dtype):
                if progress:
                    progress(f"{case} [{backend}]")
                try:
                    t_ours, t_base = harness.compare(ours, base, device, reps=prof["reps"], warmup=prof["warmup"])
                except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others' figures
                    rows.append(error_row(case, backend, exc))
                    continue
                rows.append(harness.comparison_row(
                    common, case, t_ours, t_base, sizes=sizes, dtype=str(dtype).replace("torch.", ""),
                    backend=backend, baseline=desc, gbps=nbytes / (t_ours.median_ms * 1e-3) / 1e9,
                    base_gbps=nbytes / (t_base.median_ms * 1e-3) / 1e9, target="-", met="-"))
    return rows


def print_table(rows: List[dict]) -> None:
    cols = [("case", "case", "{}"), ("sizes", "sizes", "{}"), ("dtype", "dtype", "{}"), ("backend", "backend", "{}"),
            ("ours ms", "ours_median_ms", "{:.3f}"), ("torch ms", "base_median_ms", "{:.3f}"),
            ("speedup", "speedup", "{:.2f}x"), ("GB/s", "gbps", "{:.2f}"), ("torch GB/s", "base_gbps", "{:.2f}")]
    cells = [[fmt.format(r[key]) if r.get("met") != "error" or key in ("case", "backend") else "-"
              for _, key, fmt in cols] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (h, _, _), w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for c in cells:
        print("  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe_kernels", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes", quick_help="small sizes, a few seconds")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--backend", help="one backend (torch, cpp, triton); default: the device's fused one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    device = torch.device(args.device)
    rows = collect(mode, device, backends=[args.backend] if args.backend else None, out=sys.stdout)
    print()
    print_table(rows)
    target = harness.csv_target(args, args.csv)
    if target and rows:
        harness.append_csv(target, rows)
        print(f"\nappended {len(rows)} rows to {os.path.relpath(target)}")
    failures = [r for r in rows if r.get("met") == "error"]
    for r in failures:
        print(f"FAILED {r['case']} [{r['backend']}]: {r['baseline']}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
