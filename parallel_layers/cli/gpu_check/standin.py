"""Triton's real launch path compiled for sm_90 on a machine without a GPU: a stand-in driver answers Triton's
questions (target ``cuda:90``, device 0, stream 0) and stops each launch where the GPU would be needed, after
the kernel was specialised and compiled exactly as a launch on an H100 compiles it. The fused linear's launcher
runs on ``meta`` tensors (aligned, no storage), so its host code (config choice, keyword arguments, grid) runs
as it will there.

    python -m parallel_layers.cli.gpu_check.standin [one|full]      # PARALLEL_LAYERS_LINEAR_TUNING for the run

Used by ``tests/test_fused_linear.py`` (the one-config path gpu-check's tests take compiles for sm_90). The
compiled kernels land in ``TRITON_CACHE_DIR``; carrying them to the GPU machine is not done (the cache's group
files hold absolute paths, and a kernel's entry is ~1.2 MB, ~0.3 MB as cubin and metadata alone).
"""
from __future__ import annotations

import os
import sys
import time

ARCH = 90


class NotOnThisMachine(Exception):
    """Raised where a launch would need the GPU: the kernel was compiled by then."""


def install(arch: int = ARCH) -> None:
    """Make the stand-in Triton's active driver (call before the first launch)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.driver import driver

    class StandIn(DriverBase):
        def __init__(self):
            pass

        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device=None):
            return 0

        def get_device_interface(self):
            return torch.cuda

        def get_benchmarker(self):
            raise NotOnThisMachine("the autotuner benchmarks on the GPU")

        def get_empty_cache_for_benchmark(self):
            raise NotOnThisMachine("the autotuner benchmarks on the GPU")

        def clear_cache(self, cache):
            pass

        def map_python_to_cpp_type(self, ty):
            return ty

        @property
        def utils(self):
            raise NotOnThisMachine("loading a compiled kernel needs the GPU")

        @property
        def launcher_cls(self):
            raise NotOnThisMachine("launching needs the GPU")

    driver.set_active(StandIn())


def compile_fused_linear_launches(cases) -> int:
    """Run ``linear_epilogue`` for each (M, K, N, dtype, activation, bias) on meta tensors up to its launch;
    returns how many reached the launch (each compiled its kernel for the stand-in's target)."""
    import torch

    from parallel_layers.triton_kernels import matmul
    reached = 0
    for m, k, n, dtype, act, bias in cases:
        x = torch.empty(m, k, dtype=dtype, device="meta")
        w = torch.empty(n, k, dtype=dtype, device="meta")
        b = torch.empty(n, dtype=dtype, device="meta") if bias else None
        try:
            matmul.linear_epilogue(x, w, b, act, None)
        except NotOnThisMachine:
            reached += 1
    return reached


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    os.environ["PARALLEL_LAYERS_LINEAR_TUNING"] = argv[0] if argv else "one"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("standin: needs TRITON_INTERPRET unset (it compiles)", file=sys.stderr)
        return 2
    import torch
    install()
    cases = [(m, k, n, dtype, act, True) for dtype in (torch.bfloat16, torch.float32)
             for m, k, n in ((33, 29, 47), (512, 512, 768)) for act in (None, "gelu")]
    t0 = time.perf_counter()
    reached = compile_fused_linear_launches(cases)
    took = time.perf_counter() - t0
    print(f"standin: {reached} of {len(cases)} fused-linear launches compiled for sm_{ARCH} through Triton's launch "
          f"path ({os.environ['PARALLEL_LAYERS_LINEAR_TUNING']}) in {took:.1f} s")
    return 0 if reached == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
