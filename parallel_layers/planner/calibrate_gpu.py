"""``plan --calibrate`` on a GPU: this device's matmul and attention rates by shape, its copy bandwidth and its
time per operator call, written into the same profile fields as the built-in Hopper profiles.

* GEMMs: ``torch.matmul`` of X [M, K] by W^T (nn.Linear's layout) at a transformer layer's projection shapes
  (``gemm_shapes``: hidden 2048-8192, tp 1 and 4, M 2048 and 8192), in bf16 and, where the device has FP8 units,
  ``torch._scaled_mm`` in e4m3; each precision's efficiency (achieved over the data sheet's peak) fitted by
  ``hardware.fit_gemm_curve`` into ``Profile.gemm_curve``; the flat ``flops`` rate is the median efficiency.
* Attention: causal ``scaled_dot_product_attention`` forward + backward (FLOPs it computes: half of the square);
  the median over ``attention_shapes`` is ``Profile.attention_efficiency``.
* Memory bandwidth: ``dst.copy_(src)`` of 256 MiB, bytes read + written per second.
* Per operator call: a tiny block's forward + backward over the operator calls the planner's tally counts.

The peaks and links come from the built-in profile of the GPU's name (h100, h200, a100), which are data-sheet
figures: one GPU cannot measure NVLink or InfiniBand. On a GPU the planner does not know, the highest rate
measured stands for the peak, and the notes say so. ``benchmarks/gemm_efficiency.py`` runs the same
measurements over more shapes and writes them as rows.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .calibrate import op_overhead
from .hardware import BUILTIN, Profile, fit_gemm_curve

_HIDDEN = [(1024, 2816), (2048, 5632), (4096, 14336), (8192, 28672), (16384, 53248)]


def gemm_shapes(profile: str = "quick") -> List[Tuple[int, int, int]]:
    """(M, N, K) of a layer's four projections (fused qkv, attention out, gate+up, down) at each hidden size,
    at tp 1 and tp 4, for a few token counts M. ``smoke``: two tiny shapes that run anywhere."""
    if profile == "smoke":
        return [(64, 128, 64), (128, 64, 128), (64, 64, 256), (256, 128, 64)]
    if profile == "cpu":
        # a CPU rank's models are small: hidden 64-512 (ffn 4x), tp 1 and 2, a micro-batch of 128-2048 tokens
        return sorted({(m, n, k) for h in (64, 128, 256, 512) for tp in (1, 2) for m in (128, 512, 2048)
                       for n, k in ((3 * h // tp, h), (h, h // tp), (4 * h // tp, h), (h, 4 * h // tp))})
    hidden = _HIDDEN if profile == "full" else _HIDDEN[1:4]
    tokens = (2048, 4096, 16384) if profile == "full" else (2048, 8192)
    shapes = set()
    for h, ffn in hidden:
        for tp in (1, 4):
            for m in tokens:
                shapes |= {(m, 3 * h // tp, h), (m, h, h // tp), (m, 2 * ffn // tp, h), (m, h, ffn // tp)}
    return sorted(shapes)


def attention_shapes(profile: str = "quick") -> List[Tuple[int, int, int, int]]:
    """(batch, heads, seq, head_dim), 16k tokens each."""
    if profile == "smoke":
        return [(1, 2, 64, 32)]
    if profile == "cpu":
        return [(8, 4, 64, 16), (4, 2, 128, 32), (2, 8, 256, 64), (1, 4, 512, 64)]
    seqs = (1024, 2048, 4096, 8192) if profile == "full" else (2048, 8192)
    return [(max(1, 16384 // s), h, s, d) for s in seqs for h, d in ((32, 128), (16, 64))]


def matmul_call(m: int, n: int, k: int, device, dtype) -> Callable:
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    return lambda: torch.matmul(x, w.t())


def fp8_matmul_call(m: int, n: int, k: int, device) -> Optional[Callable]:
    """``torch._scaled_mm`` in e4m3 with per-tensor scales at this shape, or None where it cannot run here."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
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


def attention_calls(b: int, h: int, s: int, d: int, device, dtype) -> Tuple[Callable, Callable]:
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


def attention_flops(b: int, h: int, s: int, d: int) -> Tuple[float, float]:
    """FLOPs causal attention computes, forward and forward + backward (two products forward, five backward
    with flash attention's recompute: 3.5x the forward)."""
    fwd = 4.0 * b * h * s * s * d / 2
    return fwd, 3.5 * fwd


def seconds(fn: Callable, device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of one call (CUDA events on a GPU, the wall clock elsewhere)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.zeros_like(src)
    return 2 * nbytes / seconds(lambda: dst.copy_(src), device)


def builtin_for(device: torch.device) -> Optional[Profile]:
    """The built-in profile of this GPU's name, if the planner has one."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).lower()
    return next((BUILTIN[key] for key in ("h200", "h100", "a100") if key in name), None)


def measure_rates(device: torch.device, profile: str = "quick", reps: int = 10,
                  progress: Optional[Callable[[str], None]] = None) -> Dict[str, object]:
    """Achieved FLOP/s: ``gemm[precision]`` a list of (M, N, K, rate) and ``attention`` a list of rates."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prec = "bf16" if dtype == torch.bfloat16 else "fp32"
    gemm: Dict[str, List[tuple]] = {prec: []}
    for m, n, k in gemm_shapes(profile):
        gemm[prec].append((m, n, k, 2.0 * m * n * k / seconds(matmul_call(m, n, k, device, dtype), device, reps)))
        fp8 = fp8_matmul_call(m, n, k, device)
        if fp8 is not None:
            gemm.setdefault("fp8", []).append((m, n, k, 2.0 * m * n * k / seconds(fp8, device, reps)))
        if progress:
            progress(f"gemm M{m} N{n} K{k}: {gemm[prec][-1][3] / 1e12:.1f} TFLOP/s {prec}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    attention = []
    for b, h, s, d in attention_shapes(profile):
        _, fwd_bwd = attention_calls(b, h, s, d, device, dtype)
        attention.append(attention_flops(b, h, s, d)[1] / seconds(fwd_bwd, device, reps))
    return {"gemm": gemm, "attention": attention}


def calibrate_device(device: torch.device, profile: str = "quick", name: Optional[str] = None,
                     progress: Optional[Callable[[str], None]] = None) -> Profile:
    """A profile of ``device`` from measurement: the built-in one of its name (peaks, links) with this device's
    matmul curve per precision, attention efficiency, flat rates, copy bandwidth and per-operator time."""
    base = builtin_for(device)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    rates = measure_rates(device, profile, progress=progress)
    peaks = dict(base.peak_flops) if base is not None else {}
    for prec, samples in rates["gemm"].items():
        peaks.setdefault(prec, max(r for *_, r in samples))      # an unknown GPU: its best measured rate
    curve, flat, told = {}, {}, []
    for prec, samples in rates["gemm"].items():
        effs = [(m, n, k, r / peaks[prec]) for m, n, k, r in samples]
        median = statistics.median(e for *_, e in effs)
        flat[prec] = median * peaks[prec]
        told.append(f"{prec} matmul {median:.0%} of peak (median of {len(effs)} shapes)")
        if len(effs) >= 4:
            curve[prec] = fit_gemm_curve(effs)
    if "bf16" in curve:
        curve.setdefault("fp16", curve["bf16"])
        flat.setdefault("fp16", flat["bf16"])
    top = "bf16" if "bf16" in peaks else "fp32"
    attention = statistics.median(rates["attention"]) / peaks[top] if rates["attention"] else None
    bw = copy_bandwidth(device)
    per_op = op_overhead(device=device)
    source = (f"peaks and links: the data sheet ({base.name})" if base is not None else
              "peaks: the best rate measured here (an unknown GPU); links: assumed NVLink 450 GB/s")
    notes = (f"measured on {label}: "
             f"{', '.join(told)}, causal attention {attention or 0:.0%}, copy {bw / 1e9:.0f} GB/s, "
             f"{per_op * 1e6:.1f} us per op; {source}")
    if base is None:
        base = dataclasses.replace(BUILTIN["h100"], flops={}, peak_flops={})
    return dataclasses.replace(base, name=name or f"{label} (calibrated)",
                               flops=dict(base.flops, **flat), peak_flops=peaks, mem_bw=bw, op_overhead=per_op,
                               gemm_curve=curve or None, attention_efficiency=attention, fragmentation=0.0,
                               measured=True, async_dispatch=device.type == "cuda", notes=notes)


__all__ = ["calibrate_device", "measure_rates", "gemm_shapes", "attention_shapes", "builtin_for"]
