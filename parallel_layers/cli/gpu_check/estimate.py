"""How many Triton kernels ``gpu-check``'s CUDA tests compile, and what one compile costs for sm_90, measured
on a machine without a GPU (the estimate behind the first run's time plan, docs/gpu.md).

    python -m parallel_layers.cli.gpu_check.estimate                 # count, then time a few sm_90 compiles
    python -m parallel_layers.cli.gpu_check.estimate --no-compile    # the count only

Counting: the CUDA Triton tests have CPU twins (the same parametrisations on ``cpu-triton``, run by the
interpreter). Every launch of those is recorded with what Triton specialises a compiled kernel on: the
kernel, its constexprs, the pointer dtypes (and 16-byte alignment), and each integer argument's class (1,
a multiple of 16, other). Distinct keys = kernels compiled. For the fused linear the interpreter runs one
fixed tile, so its keys are re-made with the tile ``PARALLEL_LAYERS_LINEAR_TUNING=one`` picks (and EVEN_K for
it), and, for the full autotune, multiplied by the configs ``prune_configs`` keeps for the call.
Timing: the fused linear's one-config kernels (:func:`.offline_compile.compile_config`) and an AdamW
kernel compiled for sm_90 here, one after another (Triton compiles a process's kernels serially).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Tuple

if "--time-only" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _int_class(v: int) -> str:
    return "1" if v == 1 else ("16" if v % 16 == 0 else "i")


class Recorder:
    """Wraps the interpreter's launch: records each kernel specialisation a compiled run would need."""

    def __init__(self):
        self.keys: Dict[tuple, int] = {}      # key -> configs the full autotune would compile for it

    def record(self, fn, args, kwargs) -> None:
        import inspect

        import torch
        names = fn.arg_names
        constexprs = {n for n, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}
        bound = dict(zip(names, args), **kwargs)
        parts: List[Tuple[str, str]] = []
        for name in names:
            v = bound.get(name)
            if isinstance(v, torch.Tensor):
                parts.append((name, f"{v.dtype}:{'a16' if v.data_ptr() % 16 == 0 else 'a'}"))
            elif isinstance(v, bool) or v is None or isinstance(v, (str, float)):
                parts.append((name, repr(v)))
            elif isinstance(v, int):
                parts.append((name, _int_class(v) if name not in constexprs else repr(v)))
        name = fn.fn.__name__
        configs = 1
        if name == "linear_epilogue_kernel":
            parts, configs = self._linear(bound, parts)
        self.keys[(name, tuple(parts))] = configs

    @staticmethod
    def _linear(bound, parts):
        import triton

        from parallel_layers.triton_kernels import matmul
        x, m, k, act = bound["x_ptr"], bound["M"], bound["K"], bound["ACTIVATION"]
        c = matmul.one_config(x.element_size(), triton.next_power_of_2(m), act)
        keep = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "EVEN_K", "UPCAST_DOT"}
        even_k = str(k % c.kwargs["BLOCK_K"] == 0)
        parts = [p for p in parts if p[0] not in keep] + [("one", repr(c)), ("EVEN_K", even_k)]
        full = matmul.prune_configs(matmul.CONFIGS, {"x_ptr": x, "M": m}, ACTIVATION=act)
        return parts, len(full)


def count(pytest_args: List[str]) -> Recorder:
    import pytest
    from triton.runtime import interpreter

    rec = Recorder()
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        rec.record(self, args, kwargs)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        pytest.main(["-q", "-p", "no:cacheprovider", "-x"] + pytest_args)
    finally:
        interpreter.InterpretedFunction.run = original
    return rec


def time_compiles(n: int) -> List[Tuple[str, float]]:
    """Seconds per sm_90 compile of the fused linear's one-config kernels (a fresh cache each)."""
    import tempfile
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="pl-estimate-")
    from parallel_layers.triton_kernels import matmul

    from .offline_compile import compile_config
    out = []
    cases = [(2, 64, 0, "bf16", "plain"), (2, 64, 1, "bf16", "gelu+pre"), (2, 16, 1, "bf16", "gelu"),
             (4, 64, 0, "fp32", "plain"), (4, 16, 1, "fp32", "gelu+pre")][:n]
    for elem, m, act, dtype, epilogue in cases:
        cfg = matmul.one_config(elem, m, act)
        t0 = time.perf_counter()
        compile_config(cfg, dtype, epilogue, 90)
        out.append((f"fused linear {dtype} {epilogue} M~{m} {cfg.kwargs}", time.perf_counter() - t0))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers.cli.gpu_check.estimate")
    ap.add_argument("--no-compile", action="store_true", help="count only")
    ap.add_argument("--compiles", type=int, default=5, help="sm_90 compiles to time (at most 5)")
    ap.add_argument("pytest_args", nargs="*", default=None,
                    help="the CPU twins of the CUDA Triton tests (default: tests -k cpu-triton)")
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)
    args, extra = ap.parse_known_args(argv)
    if extra:
        args.pytest_args = list(args.pytest_args) + extra
    if args.time_only:
        for what, seconds in time_compiles(args.compiles):
            print(f"  sm_90 compile {seconds:5.2f} s  {what}", flush=True)
        return 0
    args.pytest_args = args.pytest_args or ["tests", "-k", "cpu-triton"]
    rec = count(args.pytest_args)
    linear = {k: v for k, v in rec.keys.items() if k[0] == "linear_epilogue_kernel"}
    other = len(rec.keys) - len(linear)
    print(f"kernels compiled by the CUDA twins of: {' '.join(args.pytest_args)}")
    print(f"  fused linear: {len(linear)} with PARALLEL_LAYERS_LINEAR_TUNING=one, "
          f"{sum(linear.values())} with the full autotune")
    print(f"  other Triton kernels: {other}")
    if not args.no_compile:     # compiled, not interpreted: a fresh process with TRITON_INTERPRET=0
        import subprocess
        subprocess.run([sys.executable, "-m", "parallel_layers.cli.gpu_check.estimate", "--time-only",
                        "--compiles", str(args.compiles)], env=dict(os.environ, TRITON_INTERPRET="0"), check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
