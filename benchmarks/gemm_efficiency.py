"""How much of the data sheet's peak a GPU's matmuls and attention reach, by shape and dtype: what the
planner's time model charges per FLOP (issue 50: profiles from measurement, not an assumed 50%).

    python -m benchmarks.gemm_efficiency              # CUDA: the transformer shapes below, rows to results/
    python -m benchmarks.gemm_efficiency --quick      # CUDA: fewer shapes and repetitions
    python -m benchmarks.gemm_efficiency --smoke      # tiny shapes on any device: checks that it runs

GEMMs: ``torch.matmul`` of X [M, K] by W^T (W [N, K], nn.Linear's layout) in bf16, the shapes of a
transformer layer's projections (M tokens of a micro-batch; N, K from hidden sizes 1k-16k and their MLP
widths, as tp splits them), plus ``torch._scaled_mm`` in FP8 e4m3 with per-tensor scales (what
``parallel_layers.fp8`` runs) where the device has FP8 units. Attention: ``scaled_dot_product_attention``
(causal, bf16, head dim 64/128; forward, and forward + backward) at sequence lengths 1k-8k, counted as
4*b*h*s^2*d/2 FLOPs forward (causal half) and 3.5x that forward + backward (the backward's five products
against the forward's two, flash attention's recompute included). At the end, the curve
``planner.hardware.fit_gemm_curve`` fits to the GEMM rows of each dtype (what ``HOPPER_GEMM_CURVE`` holds for
the H200 run of 2026-11-29, whose rows had M 8192 only; the M term is now measured with M 2048 and 8192).

Each case: warm-up, then the median of CUDA-event-timed calls with L2 flushed (``harness.time_call``);
``tflops`` the achieved rate, ``efficiency`` that over the data sheet's dense peak of the dtype
(``planner.hardware.BUILTIN``; None when the GPU is not one of the built-ins). No baseline: the figure
is the machine's, there is nothing of ours to compare (``speedup`` is left empty).
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List, Optional

import torch

from parallel_layers.planner.calibrate_gpu import (
    attention_calls,
    attention_flops,
    attention_shapes,
    fp8_matmul_call,
    gemm_shapes,
    matmul_call,
)
from parallel_layers.planner.hardware import fit_gemm_curve

from . import harness

CSV_NAME = "gemm_efficiency.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)

def _median_ms(fn, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return harness.Stats.of([harness.time_call(fn, device) for _ in range(reps)]).median_ms


def collect(profile: str, device: Optional[torch.device] = None, progress=None) -> List[Dict[str, object]]:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reps, warmup = {"full": (20, 3), "quick": (10, 2), "smoke": (3, 1)}[profile]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    common = harness.common_fields(profile, device, torch.get_num_threads())
    rows = []

    def row(case, sizes, kind, flops, ms):
        tflops = flops / (ms / 1e3) / 1e12
        peak = harness.peak_flops(device, kind)
        rows.append(dict(common, case=case, sizes=sizes, dtype=kind, backend="torch", ours_median_ms=ms,
                         tflops=tflops, efficiency=None if peak is None else tflops * 1e12 / peak,
                         baseline=f"data-sheet peak {peak / 1e12:.0f} TFLOP/s" if peak else "no peak known"))
        if progress:
            progress(f"{case} {sizes} {kind}: {tflops:.0f} TFLOP/s")

    kind = "bf16" if dtype == torch.bfloat16 else "fp32"
    for m, n, k in gemm_shapes(profile):
        sizes = f"M{m} N{n} K{k}"
        row("gemm", sizes, kind, 2.0 * m * n * k, _median_ms(matmul_call(m, n, k, device, dtype), device, reps,
                                                              warmup))
        fp8 = fp8_matmul_call(m, n, k, device)
        if fp8 is not None:
            row("gemm", sizes, "fp8", 2.0 * m * n * k, _median_ms(fp8, device, reps, warmup))
    for b, h, s, d in attention_shapes(profile):
        fwd, fwd_bwd = attention_calls(b, h, s, d, device, dtype)
        fwd_flops, both_flops = attention_flops(b, h, s, d)
        row("attention_fwd", f"b{b} h{h} s{s} d{d}", kind, fwd_flops, _median_ms(fwd, device, reps, warmup))
        row("attention_fwd_bwd", f"b{b} h{h} s{s} d{d}", kind, both_flops, _median_ms(fwd_bwd, device, reps, warmup))
    harness.free_memory(device)
    return rows


def format_rows(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'case':<18} {'sizes':<24} {'dtype':<5} {'ms':>9} {'TFLOP/s':>8} {'of peak':>8}"]
    for r in rows:
        eff = "-" if r["efficiency"] is None else f"{r['efficiency']:.1%}"
        lines.append(f"{r['case']:<18} {r['sizes']:<24} {r['dtype']:<5} {r['ours_median_ms']:>9.3f} "
                     f"{r['tflops']:>8.1f} {eff:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(parser, "tiny shapes: checks that it runs", "fewer shapes and repetitions")
    harness.add_csv_args(parser, CSV_PATH)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    rows = collect(harness.profile_of(args), torch.device(args.device), progress=lambda s: print(s, flush=True))
    print(format_rows(rows))
    for dtype in ("bf16", "fp8"):
        samples = [tuple(int(part[1:]) for part in r["sizes"].split()) + (r["efficiency"],) for r in rows
                   if r["case"] == "gemm" and r["dtype"] == dtype and r["efficiency"]]
        if len(samples) >= 4:       # what planner.hardware.HOPPER_GEMM_CURVE holds, refitted on this GPU
            print(f"fitted {dtype} curve (c0, cK, cN, cM):", [round(c, 6) for c in fit_gemm_curve(samples)])
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
