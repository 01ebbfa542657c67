"""FP8 cast kernels against what a user would otherwise write in torch.

    python -m benchmarks.fp8_cast --quick            # a few seconds on 2 cores
    python -m benchmarks.fp8_cast --smoke --no-csv   # tiny sizes: checks that it runs

Cases (x is a float32 or bfloat16 [n, n] matrix; the baseline is plain torch):

- ``amax_then_cast``: per-tensor current scaling, ``fp8_amax`` + ``fp8_cast`` vs ``x.abs().amax()`` then
  ``(x * scale).clamp(-max, max).to(float8)``;
- ``cast_with_amax``: delayed scaling's one pass (cast + amax of x) vs the cast and ``x.abs().amax()``;
- ``cast_transpose``: the cast writing both layouts vs the cast and ``.t().contiguous()``;
- ``blockwise_1x128``: 1 x 128 block amax + cast vs the same in reshaped torch ops.

Each row also says whether ours is bit-identical to the baseline (it must be: the casts are exact).
"""
from __future__ import annotations

import argparse
import importlib
import os
from typing import Dict, List

import torch

from . import harness

F = importlib.import_module("parallel_layers.ops.fp8_cast")

CSV_NAME = "fp8_cast.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
PROFILES = {"full": dict(n=4096, reps=9, warmup=2), "quick": dict(n=1024, reps=5, warmup=1),
            "smoke": dict(n=256, reps=2, warmup=1)}
FMAX = 448.0
E4M3 = torch.float8_e4m3fn


def _torch_cast(x, scale):
    return (x.float() * scale).clamp(-FMAX, FMAX).to(E4M3)


def cases(x: torch.Tensor, backend: str) -> Dict[str, tuple]:
    """name -> (ours, baseline), each returning the tensors to compare."""
    scale = torch.full((1, 1), 3.0, device=x.device)

    def amax_then_cast():
        amax = F.fp8_amax(x, backend=backend)
        return F.fp8_cast(x, FMAX / amax, backend=backend)[0], amax

    def amax_then_cast_torch():
        amax = x.float().abs().amax().reshape(1, 1)
        return _torch_cast(x, FMAX / amax), amax

    def blocks_torch():
        xb = x.float().reshape(x.shape[0], -1, 128)
        amax = xb.abs().amax(-1)
        return (xb * (FMAX / amax).unsqueeze(-1)).clamp(-FMAX, FMAX).to(E4M3).reshape(x.shape), amax

    def blocks_ours():
        amax = F.fp8_amax(x, block=(1, 128), backend=backend)
        return F.fp8_cast(x, FMAX / amax, block=(1, 128), backend=backend)[0], amax

    return {
        "amax_then_cast": (amax_then_cast, amax_then_cast_torch),
        "cast_with_amax": (lambda: F.fp8_cast(x, scale, with_amax=True, backend=backend)[::2],
                           lambda: (_torch_cast(x, scale), x.float().abs().amax().reshape(1, 1))),
        "cast_transpose": (lambda: F.fp8_cast(x, scale, transpose=True, backend=backend)[:2],
                           lambda: (_torch_cast(x, scale), _torch_cast(x, scale).t().contiguous())),
        "blockwise_1x128": (blocks_ours, blocks_torch),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def collect(profile: str, device: torch.device, progress=None, backend=None) -> List[Dict[str, object]]:
    """The rows (``parallel_layers bench`` calls it as every benchmark's ``collect``); ``backend``: the cast
    kernels' (default: cpp on CPU, triton on CUDA)."""
    backend = backend or ("triton" if device.type == "cuda" else "cpp")
    p = PROFILES[profile]
    common = harness.common_fields(profile, device, torch.get_num_threads())
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(p["n"], p["n"], generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
        for name, (ours, base) in cases(x, backend).items():
            exact = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ours(), base()))
            so, sb = harness.compare(ours, base, device, p["reps"], p["warmup"])
            rows.append(harness.comparison_row(common, name, so, sb, sizes=f"{p['n']}x{p['n']}",
                                               dtype=str(dtype).replace("torch.", ""), backend=backend,
                                               exact="yes" if exact else "NO",
                                               baseline="torch ops; " + ("bit-identical" if exact else "DIFFERS")))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(parser, "tiny sizes: check that it runs", "small sizes, a few seconds")
    harness.add_csv_args(parser, CSV_PATH)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default=None, help="cast kernels' backend (default: cpp on CPU, triton on CUDA)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows = collect(harness.profile_of(args), device, backend=args.backend)
    harness.print_and_append(rows, harness.csv_target(args, args.csv))
    return 0 if all(r["exact"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
