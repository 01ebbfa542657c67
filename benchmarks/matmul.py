"""Fused linear (Triton matmul + bias + GeLU epilogue) against what a user would otherwise run.

    python -m benchmarks.matmul                 # CUDA: full shapes, rows appended to results/matmul.csv
    python -m benchmarks.matmul --smoke         # tiny shapes, a few seconds
    python -m benchmarks.matmul --cpu-reference # no GPU: time the torch reference path on CPU (labelled so)

Shapes (bf16, nn.Linear layout, X [M, K] @ W[N, K]^T + b, then GeLU):
- ``prefill``: M=8192 tokens (e.g. batch 4 x sequence 2048), N=K=4096: a transformer MLP/attention
  projection at 7B-model width; compute-bound.
- ``decode``:  M=16 (16 sequences generating one token each), N=K=4096: the same layer during batched
  decoding; bound by streaming W (32 MiB) from memory.

For each shape, back to back in one process on the same data (harness.compare: warm-up, then
interleaved repetitions timed with CUDA events, median and 20th/80th percentiles):
- ours ``fused_linear(x, W, b, activation="gelu")`` vs eager ``F.gelu(F.linear(x, W, b))``
  (cuBLAS with its bias epilogue, then a separate GeLU kernel): target >= 1.1x;
- ours vs ``torch.matmul(x, W.T)`` alone (no bias, no activation: cuBLAS's bare GEMM, the roofline we
  can hope for): target >= 0.9x. That ratio is also ours' TFLOP/s as a fraction of torch.matmul's
  measured TFLOP/s.
Forward only, under ``torch.no_grad()`` (inference: the kernel writes Y alone; in training it also
stores the pre-activation for backward, as eager does).
TFLOP/s counts 2*M*N*K flops per call (the epilogue's are not counted).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "matmul.csv")
CSV_FIELDS = harness.CSV_FIELDS + ["tflops", "base_tflops", "matmul_fraction"]

SHAPES = {
    "full": [("prefill", 8192, 4096, 4096), ("decode", 16, 4096, 4096)],
    "smoke": [("prefill", 512, 512, 256), ("decode", 16, 512, 256)],
}
CPU_SHAPES = {"full": [("prefill", 1024, 1024, 1024)], "smoke": [("prefill", 64, 128, 64)]}
TARGETS = {"eager F.linear+F.gelu": 1.1, "torch.matmul": 0.9}


def _tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def _bench_shape(name, m, n, k, dtype, device, backend, reps, warmup) -> List[Dict[str, object]]:
    from parallel_layers.ops.linear import fused_linear

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w = (torch.randn(n, k, device=device, dtype=dtype, generator=g) / k ** 0.5).contiguous()
    b = torch.randn(n, device=device, dtype=dtype, generator=g)

    def ours():
        return fused_linear(x, w, b, activation="gelu", backend=backend)

    baselines = {
        "eager F.linear+F.gelu": lambda: F.gelu(F.linear(x, w, b)),
        "torch.matmul": lambda: torch.matmul(x, w.t()),
    }
    rows = []
    with torch.no_grad():
        y = ours()  # first call autotunes (CUDA); also the correctness check below
        ref = baselines["eager F.linear+F.gelu"]()
        err = (y.float() - ref.float()).abs().max().item()
        cfg = ""
        if backend == "triton":
            from triton_kernels import matmul as tk

            best = getattr(tk._tuned_kernel, "best_config", None)
            cfg = f" | tuned config: {best}" if best is not None else ""
        print(f"[{name}] M={m} N={n} K={k} {str(dtype).replace('torch.', '')}: max |ours - eager| = {err:.3g}{cfg}")
        del y, ref
        for base_name, base in baselines.items():
            s_ours, s_base = harness.compare(ours, base, device, reps=reps, warmup=warmup)
            speedup = s_base.median_ms / s_ours.median_ms
            target = TARGETS[base_name] if device.type == "cuda" else None
            rows.append(dict(
                case=f"linear_gelu_{name}", sizes=f"M{m}xN{n}xK{k}", dtype=str(dtype).replace("torch.", ""),
                backend=backend, baseline=base_name,
                ours_median_ms=s_ours.median_ms, ours_p20_ms=s_ours.p20_ms, ours_p80_ms=s_ours.p80_ms,
                base_median_ms=s_base.median_ms, base_p20_ms=s_base.p20_ms, base_p80_ms=s_base.p80_ms,
                speedup=speedup, tflops=_tflops(m, n, k, s_ours.median_ms),
                base_tflops=_tflops(m, n, k, s_base.median_ms),
                matmul_fraction=speedup if base_name == "torch.matmul" else "",
                target=f">={target}x" if target else "-",
                met=("yes" if speedup >= target else "no") if target else "-"))
    del x, w, b
    harness.free_memory(device)
    return rows


def _print_table(rows):
    cols = [("case", "case", "{}"), ("sizes", "sizes", "{}"), ("baseline", "baseline", "{}"),
            ("ours_ms", "ours_median_ms", "{:.4f}"), ("base_ms", "base_median_ms", "{:.4f}"),
            ("speedup", "speedup", "{:.2f}x"), ("TFLOP/s", "tflops", "{:.4g}"),
            ("base_TFLOP/s", "base_tflops", "{:.4g}"), ("target", "target", "{}"), ("met", "met", "{}")]
    cells = [[fmt.format(r[key]) for _, key, fmt in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(cols)]
    print("  ".join(h.ljust(wd) for (h, _, _), wd in zip(cols, widths)))
    print("  ".join("-" * wd for wd in widths))
    for c in cells:
        print("  ".join(v.ljust(wd) for v, wd in zip(c, widths)))


def _append(path, rows):
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as fh:
            csv.writer(fh).writerow(CSV_FIELDS)  # our header; append_csv keeps an existing header
    harness.append_csv(path, rows)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matmul", description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, for a quick end-to-end run")
    ap.add_argument("--no-csv", action="store_true", help=f"do not append to {os.path.relpath(CSV_PATH)}")
    ap.add_argument("--csv", default=CSV_PATH, help="CSV file to append to")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 20; 10 with --smoke)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cpu-reference", action="store_true",
                    help="without CUDA: time the torch reference path on CPU (fp32) for the record")
    args = ap.parse_args(argv)
    mode = "smoke" if args.smoke else "full"
    reps = max(10, args.reps or (10 if args.smoke else 20))

    if torch.cuda.is_available():
        device, backend, dtype, shapes = torch.device("cuda"), "triton", torch.bfloat16, SHAPES[mode]
    else:
        print("The matmul benchmark needs a CUDA GPU (the fused Triton kernel runs on CUDA tensors; "
              "no CUDA device here). Nothing measured.")
        if not args.cpu_reference:
            return 0
        print("--cpu-reference: timing the torch reference path on CPU (fp32, backend='torch': "
              "F.linear + F.gelu inside fused_linear's autograd Function) -- NOT the fused kernel.")
        device, backend, dtype, shapes = torch.device("cpu"), "torch", torch.float32, CPU_SHAPES[mode]
    label = backend if device.type == "cuda" else "torch(cpu-reference)"

    common = dict(run_id=harness.now_iso(), mode=mode, device=harness.device_name(device),
                  threads=torch.get_num_threads(), **harness.versions())
    print(f"device: {common['device']} ({device}) | torch {common['torch']} | triton {common['triton']} "
          f"| reps {reps}, warm-up {args.warmup}")
    rows = []
    for name, m, n, k in shapes:
        for r in _bench_shape(name, m, n, k, dtype, device, backend, reps, args.warmup):
            rows.append(dict(common, date=harness.now_iso(), **dict(r, backend=label)))
    print()
    _print_table(rows)
    if mode != "full" and device.type == "cuda":
        print("(--smoke: targets are defined at the full shapes; 'met' here is only indicative)")
    if not args.no_csv:
        _append(args.csv, rows)
        print(f"appended {len(rows)} rows to {os.path.relpath(args.csv)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
