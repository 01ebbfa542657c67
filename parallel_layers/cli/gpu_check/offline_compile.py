"""One fused-linear config compiled by Triton for a GPU target on a machine without a GPU, and what the cubin
uses (registers per thread, stack, shared memory).

The specialisation is a real launch's (contiguous operands: unit strides as constants, pointers and sizes
divisible by 16), for one epilogue (plain, GeLU, pre-activation stored, both). The resource usage comes from
Triton's bundled ``cuobjdump``. Needs ``TRITON_INTERPRET`` unset (it compiles, it runs nothing).

Used by :mod:`.estimate` (what one sm_90 compile costs) and ``python -m benchmarks.linear_registers`` (every
config's registers and spills).
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Dict

EPILOGUES = {"plain": (0, False), "gelu": (1, False), "pre": (0, True), "gelu+pre": (1, True)}
UNIT_STRIDES = ("stride_xk", "stride_wk", "stride_yn", "stride_zn")


def resource_usage(cubin: bytes) -> Dict[str, int]:
    """``{"reg": ..., "stack": ..., "shared": ..., "local": ...}`` of a cubin (those ``cuobjdump`` reports)."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out.stdout))
    return {k.lower(): int(v) for k, v in usage.items()}


def compile_config(cfg, dtype: str, epilogue: str, arch: int) -> Dict[str, int]:
    """Registers per thread, stack bytes (spills) and shared memory of one config, compiled for ``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from parallel_layers.triton_kernels import matmul

    fn = matmul.linear_epilogue_kernel
    activation, store_pre = EPILOGUES[epilogue]
    consts = dict({s: 1 for s in UNIT_STRIDES}, HAS_BIAS=True, ACTIVATION=activation, STORE_PRE=store_pre,
                  INPUT_PRECISION="tf32", EVEN_K=True, UPCAST_DOT=False, **cfg.kwargs)
    signature = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in consts else (f"*{dtype}" if name.endswith("_ptr") else "i32")
    index = {name: (i,) for i, name in enumerate(fn.arg_names)}
    attrs = {index[n]: [["tt.divisibility", 16]] for n, kind in signature.items() if kind != "constexpr"}
    src = ASTSource(fn=fn, signature=signature, constexprs={index[k]: v for k, v in consts.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    usage = resource_usage(kernel.asm["cubin"])
    return {"registers": usage.get("reg", -1), "spill_bytes": usage.get("stack", 0) + usage.get("local", 0),
            "shared_bytes": kernel.metadata.shared}


__all__ = ["EPILOGUES", "UNIT_STRIDES", "compile_config", "resource_usage"]
