"""One training step (forward + backward) of an ``FP8Linear`` against ``nn.Linear`` in bf16 and fp32.

    python -m benchmarks.fp8_layers                  # M = 2048, K = N = 1024 and 4096: minutes on 2 cores
    python -m benchmarks.fp8_layers --quick          # M = K = N = 512: seconds
    python -m benchmarks.fp8_layers --device cuda    # on a GPU: where FP8 tensor cores show the speedup

Cases, each timed against the bf16 ``nn.Linear`` step (the baseline; ``speedup`` = bf16 time / the case's,
above 1: faster than bf16): ``fp32`` (``nn.Linear`` in float32) and ``fp8_<recipe>`` for the recipes
"tensor", "delayed", "row", "block" (``FP8Linear`` with bf16 parameters and activations; see
``parallel_layers.fp8``). A step is ``y = layer(x)`` then ``torch.autograd.grad(y, (x, W, b), dy)``.

``saved_mb``: what the layer keeps from its forward to its backward beyond its parameters: for ``nn.Linear``
its input (autograd holds it), for ``FP8Linear`` the FP8 copies it makes (the input's and the weight's, with
their transposes for per-tensor recipes, and their scales: measured as the tensors alive after the forward, less
the output); its high-precision input is not needed after the forward. ``base_saved_mb``: the bf16 layer's.

A CPU has no FP8 tensor cores: ``torch._scaled_mm`` on CPU and the dequantized fallback of the row and block
recipes multiply in float32, and the casts add passes over the input, the weight and the gradient, so FP8 is
expected to be *slower* than bf16 here (about 2-3x). On CPU the point is to track that overhead and the memory;
on an H100/H200 (``--device cuda``) the per-tensor GEMMs run on FP8 tensor cores and the same rows show the
speedup (the row and block recipes' dgrad / wgrad still take the dequantized fallback there).
"""
from __future__ import annotations

import argparse
import os
from typing import Dict, List

import torch
import torch.nn as nn

from . import harness

CSV_NAME = "fp8_layers.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
RECIPES = ("tensor", "delayed", "row", "block")
PROFILES = {"full": dict(m=2048, sizes=(1024, 4096), reps=5, warmup=1),
            "quick": dict(m=512, sizes=(512,), reps=3, warmup=1),
            "smoke": dict(m=128, sizes=(128,), reps=1, warmup=1)}
CPU_NOTE = "CPU: no FP8 tensor cores, FP8 is expected slower than bf16 (overhead and memory tracked)"


def make_layer(case: str, k: int, n: int, device: torch.device) -> nn.Module:
    """The layer of ``case``: "bf16", "fp32" (``nn.Linear``) or "fp8_<recipe>" (``FP8Linear``, bf16)."""
    torch.manual_seed(0)
    if case in ("bf16", "fp32"):
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
        return nn.Linear(k, n, dtype=dtype, device=device)
    from parallel_layers.fp8 import FP8Linear, FP8Recipe
    return FP8Linear(k, n, recipe=FP8Recipe(scaling=case[len("fp8_"):]), dtype=torch.bfloat16, device=device)


def step_fn(layer: nn.Module, m: int, device: torch.device):
    """A closure running one forward + backward of ``layer`` on an ``[m, in]`` input."""
    dtype = layer.weight.dtype
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(m, layer.in_features, generator=g).to(dtype).to(device).requires_grad_(True)
    dy = torch.randn(m, layer.out_features, generator=g).to(dtype).to(device)
    params = [x, layer.weight, layer.bias]

    def step():
        return torch.autograd.grad(layer(x), params, dy)
    return step, x


def _live_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    from parallel_layers.planner.measure import live_tensor_bytes
    return live_tensor_bytes()


def saved_bytes(layer: nn.Module, x: torch.Tensor) -> int:
    """Bytes ``layer`` keeps from a forward on ``x`` to its backward, beyond its parameters (module docstring)."""
    if isinstance(layer, nn.Linear):
        return x.numel() * x.element_size()
    before = _live_bytes(x.device)
    y = layer(x)
    kept = _live_bytes(x.device) - before - y.numel() * y.element_size()
    del y
    return kept


def collect(profile: str, device: torch.device, progress=None) -> List[Dict[str, object]]:
    """The rows (``parallel_layers bench`` calls it as every benchmark's ``collect``)."""
    p = PROFILES[profile]
    common = harness.common_fields(profile, device, torch.get_num_threads())
    note = CPU_NOTE if device.type == "cpu" else "FP8 GEMMs on the device's FP8 tensor cores where it has them"
    rows = []
    for size in p["sizes"]:
        m, k, n = p["m"], size, size
        base_layer = make_layer("bf16", k, n, device)
        base, bx = step_fn(base_layer, m, device)
        base_saved = saved_bytes(base_layer, bx)
        for case in ("fp32",) + tuple(f"fp8_{r}" for r in RECIPES):
            if progress:
                progress(f"fp8_layers {case} M={m} K=N={size}")
            layer = make_layer(case, k, n, device)
            ours, x = step_fn(layer, m, device)
            so, sb = harness.compare(ours, base, device, p["reps"], p["warmup"])
            rows.append(harness.comparison_row(
                common, case, so, sb, sizes=f"M{m} K{k} N{n}", dtype="bf16" if case != "fp32" else "fp32",
                saved_mb=saved_bytes(layer, x) / 2**20, base_saved_mb=base_saved / 2**20,
                tflops=6 * m * k * n / (so.median_ms * 1e-3) / 1e12,
                baseline="nn.Linear bf16 step", note=note))
            del layer, ours, x
            harness.free_memory(device)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(parser, "tiny sizes: check that it runs", "M = K = N = 512, seconds")
    harness.add_csv_args(parser, CSV_PATH)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = collect(harness.profile_of(args), device)
    harness.print_and_append(rows, harness.csv_target(args, args.csv))
    print("\nsaved for backward (MiB), the layer against bf16 nn.Linear's input:")
    for r in rows:
        print(f"  {r['sizes']:18s} {r['case']:12s} {r['saved_mb']:9.2f} vs {r['base_saved_mb']:9.2f}  "
              f"step {r['ours_median_ms']:9.2f} ms = {1 / r['speedup']:.2f}x bf16's {r['base_median_ms']:.2f} ms")
    if device.type == "cpu":
        print(f"\n{CPU_NOTE}; on an FP8 GPU run with --device cuda.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
