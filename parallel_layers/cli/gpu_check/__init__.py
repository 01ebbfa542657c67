"""``python3 -m parallel_layers gpu-check --out DIR`` (``make gpu-check``): what a fresh one-GPU machine must show,
in one command on its own python3 (no venv, no network, no pip), within one 10-minute slot.

It prints the GPU, the versions, ``CUDA_HOME`` and ``nvcc --version`` first (DIR/summary.md keeps them), says
whether the CUDA toolkit is missing or of another major version than torch's, then runs its steps
(:mod:`.steps`, each a subprocess with its log in DIR, a time limit and a row in DIR/summary.md):

- ``build``: the prebuilt ``parallel_layers/_C`` if its build info matches the running torch (version, CUDA),
  the sources and the GPU's arch, else ``setup.py build_ext --inplace`` with every core for the GPU's arch;
  the summary says which. Later steps run with ``PARALLEL_LAYERS_NO_JIT=1`` and ``PIP_NO_INDEX=1``.
- ``extension``: it imports, with its CUDA part.
- ``training-parity``, ``nccl-self``, ``gloo-dp-cuda``: the cheap probes (the GPT with our kernels against torch
  eager + AdamW; a 1-rank NCCL group sending to itself; DataParallel over gloo with CUDA tensors).
- ``cuda-tests``: every CUDA test with compiled Triton (``pytest -v``, junit XML), the fused linear on one config
  per dtype and shape class (``PARALLEL_LAYERS_LINEAR_TUNING=one``).
- ``matmul-benchmark`` (full autotune), ``planner-device`` (the planner's predicted memory and step time against
  this GPU's, one rank), ``train-step`` (a ~1B Llama: ours against torch eager and torch.compile),
  ``kernel-benchmarks`` (quick sizes), ``fp8-benchmarks``, ``gemm-efficiency``, ``host-offload-benchmark``,
  ``kernel-benchmarks-full``
  (the kernels at the sizes the GPU targets are defined at): CSV rows in DIR.

``--budget`` caps the whole run (steps not started once it is spent are listed "not run: no time left");
``--only STEP`` reruns one step and keeps the other rows. Results are rewritten after every step, so a run
cut off mid-step keeps what it learned. ``python -m benchmarks.linear_registers`` (every fused-linear config
compiled offline, checked for spills) needs no GPU: it runs on the CPU machines, not here.

``--dry-run`` (and any machine without a GPU): the build decision and every step that needs no GPU for real,
the others' CPU stand-ins (the test suite runs it, so the command cannot rot).
"""
from __future__ import annotations

import argparse
import os
import sys

from .runner import BUDGET_S, run_steps
from .steps import ROOT, STEP_NAMES, Step, build_step, plan

__all__ = ["BUDGET_S", "ROOT", "STEP_NAMES", "Step", "build_step", "main", "plan", "run"]


def run(out: str, dry_run: bool, budget_s: float = BUDGET_S, only=None) -> int:
    from . import environment

    env = environment.collect()
    gpu = env.gpu is not None and not dry_run
    use_prebuilt, why = environment.prebuilt_decision(env)
    header = [("GPU run" if gpu else "dry run on CPU") + f" in {ROOT}"] + env.lines() + [f"build: {why}"]
    for line in header:
        print("gpu-check: " + line, flush=True)
    build = build_step(sys.executable, env.arch, env.toolkit, why if use_prebuilt else None)
    return run_steps(plan(out, sys.executable, build), out, header, gpu, budget_s, only)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m parallel_layers gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_out", help="folder for logs, junit XML, CSV rows, summary.md")
    ap.add_argument("--dry-run", action="store_true", help="only what needs no GPU, on the CPU (automatic without one)")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help=f"seconds for the whole run (default {BUDGET_S}: one 10-minute command with a margin)")
    ap.add_argument("--only", action="append", choices=STEP_NAMES, metavar="STEP",
                    help="run only this step (repeatable), keeping the other rows of DIR/summary.md; steps: "
                         + ", ".join(STEP_NAMES))
    args = ap.parse_args(argv)
    return run(os.path.abspath(args.out), args.dry_run, args.budget, args.only)


if __name__ == "__main__":
    sys.exit(main())
