"""Registers and spills of every fused-linear config, compiled offline for a GPU target (no GPU needed).

    python -m benchmarks.linear_registers              # sm_90 (H100), bf16 and fp16, every epilogue
    python -m benchmarks.linear_registers --check      # exit 1 if a config the pruner keeps spills
    python -m benchmarks.linear_registers --csv        # also write results/linear_registers.csv (or --csv PATH)

Each ``parallel_layers.triton_kernels.matmul.CONFIGS`` entry is compiled by Triton for the target with the
specialisation a real launch gets (contiguous operands: unit strides as constants, pointers and sizes
divisible by 16), for each epilogue (plain, GeLU, pre-activation stored, both). The cubin's resource
usage (Triton's bundled ``cuobjdump``) gives registers per thread and the stack frame: a non-zero
stack on these kernels is register spilling (they call nothing). The compile and its resource usage are
``parallel_layers.cli.gpu_check.offline_compile``'s (``gpu-check``'s estimate times the same compiles).
``kept`` says whether ``prune_configs`` lets the autotuner try that config for that epilogue at a large M:
``--check`` fails when a kept config spills. Needs ``TRITON_INTERPRET`` unset (it compiles, it does not run).
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import List, Optional

from parallel_layers.cli.gpu_check.offline_compile import EPILOGUES, compile_config

DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}
CSV_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "linear_registers.csv")


def _kept(cfg, dtype: str, epilogue: str) -> bool:
    from parallel_layers.triton_kernels import matmul

    class _Elem:   # what the pruner reads of x: its element size
        def __init__(self, size):
            self.size = size

        def element_size(self):
            return self.size

    activation, store_pre = EPILOGUES[epilogue]
    args = {"x_ptr": _Elem(DTYPES[dtype]), "M": 8192, "ACTIVATION": activation, "STORE_PRE": store_pre}
    return any(c is cfg for c in matmul.prune_configs(matmul.CONFIGS, args))


def collect(dtypes: List[str], epilogues: List[str], arch: int, kept_only: bool = False) -> List[dict]:
    from parallel_layers.triton_kernels import matmul
    rows = []
    for dtype in dtypes:
        for epilogue in epilogues:
            for cfg in matmul.CONFIGS:
                kept = _kept(cfg, dtype, epilogue)
                if kept_only and not kept:
                    continue
                k = cfg.kwargs
                rows.append(dict(arch=f"sm_{arch}", dtype=dtype, epilogue=epilogue,
                                 config=f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} g{k['GROUP_M']} "
                                        f"s{cfg.num_stages} w{cfg.num_warps}",
                                 kept=kept, **compile_config(cfg, dtype, epilogue, arch)))
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--epilogues", default=",".join(EPILOGUES))
    ap.add_argument("--check", action="store_true", help="only the kept configs; exit 1 if one spills")
    ap.add_argument("--csv", nargs="?", const=CSV_PATH, default=None, help=f"write the rows (default {CSV_PATH})")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("linear_registers: unset TRITON_INTERPRET (this compiles kernels, it runs none)", file=sys.stderr)
        return 2
    rows = collect(args.dtypes.split(","), args.epilogues.split(","), args.arch, kept_only=args.check)
    print(f"{'dtype':6} {'epilogue':9} {'config':24} {'kept':5} {'regs':>4} {'spill B':>7} {'smem KiB':>8}")
    for r in rows:
        print(f"{r['dtype']:6} {r['epilogue']:9} {r['config']:24} {str(r['kept']):5} {r['registers']:>4} "
              f"{r['spill_bytes']:>7} {r['shared_bytes'] / 1024:>8.0f}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    spilling = [r for r in rows if r["kept"] and r["spill_bytes"]]
    for r in spilling:
        print(f"SPILLS: {r['dtype']} {r['epilogue']} {r['config']}: {r['spill_bytes']} bytes", file=sys.stderr)
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
