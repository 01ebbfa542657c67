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
import torch.nn.functional as F

from parallel_layers.planner.hardware import fit_gemm_curve

from . import harness

CSV_NAME = "gemm_efficiency.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)

_HIDDEN = [(1024, 2816), (2048, 5632), (4096, 14336), (8192, 28672), (16384, 53248)]


def gemm_shapes(profile: str) -> List[tuple]:
    """(M, N, K) of a layer's four projections at each hidden size, at tp 1 and tp 4, for two token counts."""
    if profile == "smoke":
        return [(64, 128, 64), (128, 64, 128)]
    hidden = _HIDDEN if profile == "full" else _HIDDEN[1:4]
    tokens = (2048, 4096, 16384) if profile == "full" else (2048, 8192)     # M varied: the curve's M term
    shapes = []
    for h, ffn in hidden:
        for tp in (1, 4):
            for m in tokens:
                shapes += [(m, 3 * h // tp, h), (m, h, h // tp), (m, 2 * ffn // tp, h), (m, h, ffn // tp)]
    return sorted(set(shapes))


def attention_shapes(profile: str) -> List[tuple]:
    """(batch, heads, seq, head_dim)."""
    if profile == "smoke":
        return [(1, 2, 64, 32)]
    seqs = (1024, 2048, 4096, 8192) if profile == "full" else (2048, 8192)
    return [(max(1, 16384 // s), h, s, d) for s in seqs for h, d in ((32, 128), (16, 64))]


def _median_ms(fn, device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return harness.Stats.of([harness.time_call(fn, device) for _ in range(reps)]).median_ms


def _fp8_matmul(m: int, n: int, k: int, device):
    """A callable running ``torch._scaled_mm`` in e4m3 at this shape, or None where it cannot run here."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return None
    if torch.cuda.get_device_capability(device) < (8, 9):
        return None
    a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
    one = torch.ones((), device=device)
    fn = lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    try:
        fn()
    except RuntimeError:
        return None
    return fn


def _matmul(m: int, n: int, k: int, device, dtype):
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    return lambda: torch.matmul(x, w.t())


def _attention(b: int, h: int, s: int, d: int, device, dtype):
    """Causal SDPA's forward alone (no autograd) and its forward + backward, at these sizes."""
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

    def fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(out, (q, k, v), grad)
    return fwd, fwd_bwd


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
        row("gemm", sizes, kind, 2.0 * m * n * k, _median_ms(_matmul(m, n, k, device, dtype), device, reps, warmup))
        fp8 = _fp8_matmul(m, n, k, device)
        if fp8 is not None:
            row("gemm", sizes, "fp8", 2.0 * m * n * k, _median_ms(fp8, device, reps, warmup))
    for b, h, s, d in attention_shapes(profile):
        fwd, fwd_bwd = _attention(b, h, s, d, device, dtype)
        fwd_flops = 4.0 * b * h * s * s * d / 2
        row("attention_fwd", f"b{b} h{h} s{s} d{d}", kind, fwd_flops, _median_ms(fwd, device, reps, warmup))
        row("attention_fwd_bwd", f"b{b} h{h} s{s} d{d}", kind, 3.5 * fwd_flops,
            _median_ms(fwd_bwd, device, reps, warmup))
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
