"""``python -m parallel_layers gpu-check --out DIR`` (``make gpu-check``): what a fresh one-GPU machine
must show, in one command, with no network, in under 9 minutes.

Steps (each a subprocess with its own log under DIR, a time limit and a pass/fail line in DIR/summary.md):
build the extension; fail loudly if CUDA is available and the extension lacks its CUDA part; every CUDA
test with compiled Triton (junit XML); single-GPU training parity (the GPT with our fused kernels against
torch eager + torch AdamW, fp32 and bf16); a 1-rank NCCL group with a P2P self send/receive batch; two
processes sharing the GPU with gloo taking CUDA tensors (DataParallel's all-reduce path); the fused
linear against cuBLAS (Triton, the automatic choice, bf16 and float32); every fused-linear config the
autotuner may try compiled for the GPU's target and checked for register spills; the kernel benchmarks
on the GPU (Triton and CUDA against torch, L2 flushed between repetitions); ZeRO-Offload's step with the
optimizer state in host memory against on the GPU (``benchmarks.host_offload``). CSV rows in DIR, and the
fused linear's measured backend choices in DIR/cache.

``--dry-run`` (and any machine without a GPU): says what it would do and actually runs every step that
needs no GPU, on the CPU (the test suite runs it, so the command cannot rot).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 9 * 60


@dataclass
class Step:
    name: str
    argv: List[str]
    timeout_s: int
    needs_gpu: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    dry_argv: List[str] = field(default_factory=list)   # what runs instead on a machine without a GPU


def plan(out: str, python: str = sys.executable) -> List[Step]:
    check_ext = ("import torch; from parallel_layers import _extension as e; m, why = e.load(); "
                 "has = bool(m is not None and getattr(m, 'WITH_CUDA', False)); "
                 "print('extension:', 'missing: ' + str(why) if m is None else 'built', '| CUDA part:', has, "
                 "'| CUDA available:', torch.cuda.is_available(), '| CUDA_HOME:', e.find_cuda_home()); "
                 "raise SystemExit(1 if m is None or (torch.cuda.is_available() and not has) else 0)")
    pytest = [python, "-m", "pytest", "-q", "-rs", os.path.join(ROOT, "tests")]
    probes = [python, "-m", "parallel_layers.testing.gpu_probes"]
    kernels = [python, "-m", "benchmarks.kernels"]
    return [
        Step("build", [python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", ROOT], 240,
             dry_argv=[python, "-c", "print('build: make setup built the extension already; not rebuilt')"]),
        Step("extension", [python, "-c", check_ext], 50, needs_gpu=False),
        Step("cuda-tests", pytest + ["-k", "cuda", "--junitxml", os.path.join(out, "junit-cuda.xml")], 240,
             env={"TRITON_INTERPRET": "0"},
             dry_argv=pytest + ["-k", "cuda", "--collect-only"]),
        Step("training-parity", probes + ["training", "--device", "cuda"], 100,
             dry_argv=probes + ["training", "--device", "cpu"]),
        Step("nccl-self", probes + ["nccl-self"], 50,
             dry_argv=[python, "-c", "print('nccl-self: needs a GPU (NCCL); nothing to run on CPU')"]),
        Step("gloo-dp-cuda", probes + ["gloo-dp", "--device", "cuda"], 80,
             dry_argv=probes + ["gloo-dp", "--device", "cpu"]),
        Step("matmul-benchmark",
             [python, "-m", "benchmarks.matmul", "--quick", "--csv", os.path.join(out, "matmul.csv")],
             150, env={"TRITON_INTERPRET": "0"},
             dry_argv=[python, "-m", "benchmarks.matmul", "--smoke", "--cpu-reference", "--no-csv"]),
        Step("linear-registers", [python, "-m", "benchmarks.linear_registers", "--check",
                                  "--csv", os.path.join(out, "linear_registers.csv")], 90,
             env={"TRITON_INTERPRET": "0"},
             dry_argv=[python, "-c", "print('linear-registers: compiles every config offline; "
                                     "tests/test_fused_linear.py runs its check for bf16 GeLU')"]),
        Step("kernel-benchmarks", kernels + ["--quick", "--device", "cuda", "--csv", os.path.join(out, "kernels.csv")],
             200, env={"TRITON_INTERPRET": "0"},
             dry_argv=kernels + ["--smoke", "--device", "cpu", "--no-csv", "--only", "adamw"]),
        # ZeRO-Offload: the step with the optimizer state in host memory against on the GPU, and the overlap
        # of the gradients' copies with backward (the CUDA tests above check its results)
        Step("host-offload-benchmark", [python, "-m", "benchmarks.host_offload", "--quick",
                                        "--csv", os.path.join(out, "host_offload.csv")], 120,
             env={"TRITON_INTERPRET": "0"},
             dry_argv=[python, "-m", "benchmarks.host_offload", "--smoke", "--no-csv"]),
    ]


def run(out: str, dry_run: bool) -> int:
    import torch

    os.makedirs(out, exist_ok=True)
    gpu = torch.cuda.is_available() and not dry_run
    lines = [f"# gpu-check ({'GPU: ' + torch.cuda.get_device_name(0) if gpu else 'dry run on CPU'})", "",
             f"torch {torch.__version__}, python {sys.version.split()[0]}", "",
             "| step | result | seconds | log |", "|---|---|---|---|"]
    failed, start = [], time.monotonic()
    for step in plan(out):
        argv = step.argv if gpu or not step.needs_gpu else step.dry_argv
        left = BUDGET_S - (time.monotonic() - start)
        log = os.path.join(out, f"{step.name}.log")
        t0 = time.monotonic()
        # the fused linear's measured backend choices land in the output folder (see linear_dispatch)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PARALLEL_LAYERS_CACHE_DIR=os.path.join(os.path.abspath(out), "cache"),
                   **(step.env if gpu else {}))
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(argv) + "\n")
            fh.flush()
            try:
                rc = subprocess.run(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    timeout=max(1, min(step.timeout_s, left))).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        took = time.monotonic() - t0
        ok = rc == 0
        if not ok:
            failed.append(step.name)
        kind = "ran" if argv is step.argv else "dry run"
        result = f"{'ok' if ok else 'FAILED (' + str(rc) + ')'} ({kind})"
        lines.append(f"| {step.name} | {result} | {took:.1f} | {os.path.basename(log)} |")
        print(f"gpu-check {step.name}: {result} in {took:.1f} s (log: {log})", flush=True)
    total = time.monotonic() - start
    verdict = f"FAILED: {', '.join(failed)}" if failed else "all ok"
    lines += ["", f"total {total:.0f} s (budget {BUDGET_S} s); {verdict}"]
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_out", help="folder for logs, junit XML, CSV rows, summary.md")
    ap.add_argument("--dry-run", action="store_true", help="only what needs no GPU, on the CPU (automatic without one)")
    args = ap.parse_args(argv)
    return run(os.path.abspath(args.out), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
