"""Fused linear (Triton matmul + bias + GeLU epilogue) against what a user would otherwise run.

    python -m benchmarks.matmul                 # CUDA: full shapes, rows appended to results/matmul.csv
    python -m benchmarks.matmul --quick         # CUDA: the same shapes, fewer repetitions
    python -m benchmarks.matmul --smoke         # tiny shapes, a few seconds
    python -m benchmarks.matmul --cpu-reference # no GPU: time the torch reference path on CPU (labelled so)

Without a GPU there is nothing to measure (the fused kernel runs on CUDA tensors): ``collect`` returns
no rows in quick and full mode on CPU; in smoke mode (and with ``--cpu-reference``) it times the torch
reference path at a CPU shape, labelled ``torch(cpu-reference)``, so the code path is exercised.

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
The same shapes then run with the automatic choice (``backend=None``: ``parallel_layers.ops.linear_dispatch``
measures Triton against torch once per shape class; the row's backend reads ``auto->triton`` or
``auto->torch``), and the prefill shape in float32 without TF32 (torch's default) with both, which is
the measurement behind auto leaving float32 to cuBLAS. Targets apply to the bf16 Triton rows only.
Forward only, under ``torch.no_grad()`` (inference: the kernel writes Y alone; in training it also
stores the pre-activation for backward, as eager does).
TFLOP/s counts 2*M*N*K flops per call (the epilogue's are not counted); both figures are also written
into the ``baseline`` text of the CSV row. The two comparisons of a shape are two cases,
``linear_gelu_<shape>`` (vs eager) and ``linear_gelu_<shape>_vs_gemm`` (vs torch.matmul).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import harness
from .kernels import error_row

CSV_NAME = "matmul.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 2   # on the 2-core CPU machine quick measures nothing (no GPU); on a GPU about a minute

# (name, M, N, K)
SHAPES = {
    "full": [("prefill", 8192, 4096, 4096), ("decode", 16, 4096, 4096)],
    "quick": [("prefill", 8192, 4096, 4096), ("decode", 16, 4096, 4096)],
    "smoke": [("prefill", 512, 512, 256), ("decode", 16, 512, 256)],
}
CPU_SHAPES = {"full": [("prefill", 1024, 1024, 1024)], "quick": [("prefill", 1024, 1024, 1024)],
              "smoke": [("prefill", 64, 128, 64)]}
REPS = {"full": (20, 3), "quick": (10, 2), "smoke": (10, 1)}   # (timed reps, warm-up)
# baseline -> (case suffix, target speedup on CUDA)
BASELINES = {"eager F.linear+F.gelu": ("", 1.1), "torch.matmul": ("_vs_gemm", 0.9)}


def _tflops(m, n, k, ms):
    return 2.0 * m * n * k / (ms * 1e-3) / 1e12


def _bench_shape(name, m, n, k, dtype, device, backend, reps, warmup) -> List[Dict[str, object]]:
    from parallel_layers.ops.linear import fused_linear

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    w = (torch.randn(n, k, device=device, dtype=dtype, generator=g) / k ** 0.5).contiguous()
    b = torch.randn(n, device=device, dtype=dtype, generator=g)

    def ours():
        return fused_linear(x, w, b, activation="gelu", backend=None if backend == "auto" else backend)

    baselines = {
        "eager F.linear+F.gelu": lambda: F.gelu(F.linear(x, w, b)),
        "torch.matmul": lambda: torch.matmul(x, w.t()),
    }
    rows = []
    with torch.no_grad():
        label = backend
        if device.type == "cpu":
            label = "torch(cpu-reference)"
        elif backend == "auto":   # what the automatic choice runs here (measured now if not known)
            from parallel_layers.ops.linear import fused_linear_backend
            chosen, why = fused_linear_backend(x, w, b, activation="gelu")
            label = f"auto->{chosen}"
            print(f"[{name}] auto chooses {chosen}: {why}", file=sys.stderr)
        y = ours()  # first call autotunes (CUDA); also the correctness check below
        ref = baselines["eager F.linear+F.gelu"]()
        err = (y.float() - ref.float()).abs().max().item()
        cfg = ""
        if label in ("triton", "auto->triton"):
            from parallel_layers.triton_kernels import matmul as tk

            best = getattr(tk.tuned_kernel, "best_config", None)
            cfg = f" | tuned config: {best}" if best is not None else ""
        print(f"[{name}] M={m} N={n} K={k} {str(dtype).replace('torch.', '')}: max |ours - eager| = {err:.3g}{cfg}",
              file=sys.stderr)
        del y, ref
        for base_name, base in baselines.items():
            suffix, target = BASELINES[base_name]
            # the targets are the kernel's, in bf16; the automatic choice and float32 are reported
            target = target if device.type == "cuda" and backend == "triton" and dtype == torch.bfloat16 else None
            s_ours, s_base = harness.compare(ours, base, device, reps=reps, warmup=warmup)
            tflops, base_tflops = _tflops(m, n, k, s_ours.median_ms), _tflops(m, n, k, s_base.median_ms)
            row = harness.comparison_row(
                {}, f"linear_gelu_{name}{suffix}", s_ours, s_base, sizes=f"M{m}xN{n}xK{k}",
                dtype=str(dtype).replace("torch.", ""), backend=label, date=harness.now_iso(),
                baseline=f"{base_name}; TFLOP/s ours {tflops:.4g} vs {base_tflops:.4g}",
                tflops=tflops, base_tflops=base_tflops, target=f">={target}x" if target else "-")
            row["met"] = ("yes" if row["speedup"] >= target else "no") if target else "-"
            rows.append(row)
    x = w = b = None       # freed (the timed closures are done with them)
    harness.free_memory(device)
    return rows


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None, *,
            cpu_reference: bool = False, reps: Optional[int] = None, warmup: Optional[int] = None) -> List[dict]:
    """The CSV rows of ``mode`` (smoke | quick | full) on ``device``: on CUDA the fused Triton kernel at
    ``SHAPES[mode]``; on CPU nothing in quick/full unless ``cpu_reference`` (the torch reference path at
    ``CPU_SHAPES[mode]``, labelled so), and that reference in smoke mode. A shape that fails gives
    rows with met "error". Writes no CSV; detail lines go to stderr."""
    if device.type == "cuda":
        # the kernel itself, then the automatic choice (linear_dispatch) on the same shapes; float32
        # (no TF32: torch's default) at the compute-bound shape shows why auto leaves it to cuBLAS
        variants = [(b, torch.bfloat16, SHAPES[mode]) for b in ("triton", "auto")]
        variants += [(b, torch.float32, SHAPES[mode][:1]) for b in ("triton", "auto")]
    elif cpu_reference or mode == "smoke":
        print("matmul: no CUDA device; timing the torch reference path on CPU (fp32, backend='torch': "
              "F.linear + F.gelu inside fused_linear's autograd Function) -- NOT the fused kernel.",
              file=sys.stderr)
        variants = [("torch", torch.float32, CPU_SHAPES[mode])]
    else:
        print("matmul: the fused Triton kernel runs on CUDA tensors and there is no CUDA device here; "
              "nothing measured.", file=sys.stderr)
        return []
    reps = max(10, reps or REPS[mode][0])
    warmup = REPS[mode][1] if warmup is None else warmup
    common = harness.common_fields(mode, device, torch.get_num_threads())
    rows = []
    for backend, dtype, shapes in variants:
        for name, m, n, k in shapes:
            if progress:
                progress(f"{name} M{m}xN{n}xK{k} {backend}")
            try:
                shape_rows = _bench_shape(name, m, n, k, dtype, device, backend, reps, warmup)
            except Exception as exc:  # noqa: BLE001 - one failing shape must not hide the others
                shape_rows = [error_row(f"linear_gelu_{name}{suffix}", backend, exc)
                              for suffix, _ in BASELINES.values()]
                harness.free_memory(device)
            rows += [dict(common, **r) for r in shape_rows]
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.matmul", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny shapes, for a quick end-to-end run",
                             quick_help="full shapes, fewer repetitions")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (at least 10; default 20 full, "
                                                          "10 otherwise)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up calls (default 3 full, fewer otherwise)")
    ap.add_argument("--cpu-reference", action="store_true",
                    help="without CUDA: time the torch reference path on CPU (fp32) for the record")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.cpu_reference:
        print("The matmul benchmark needs a CUDA GPU (the fused Triton kernel runs on CUDA tensors; "
              "no CUDA device here). Nothing measured; --cpu-reference times the torch path on CPU.")
        return 0
    print(f"device: {harness.device_name(device)} ({device}) | torch {torch.__version__} | "
          f"triton {harness.versions()['triton']}")
    rows = collect(mode, device, cpu_reference=args.cpu_reference, reps=args.reps, warmup=args.warmup)
    print()
    harness.print_and_append(rows, None if args.no_csv else args.csv)
    if mode != "full" and device.type == "cuda":
        print(f"(--{mode}: targets are defined at the full shapes and repetitions; 'met' here is only indicative)")
    failed = [r for r in rows if r.get("met") == "error"]
    for r in failed:
        print(f"FAILED {r['case']} [{r['backend']}]: {r['baseline']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
