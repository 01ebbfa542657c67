"""The steps of ``gpu-check``, in the order a first run must learn things: the build and the import, the cheap
probes (a training-parity run, NCCL to itself, gloo on CUDA tensors), the CUDA tests, then the benchmarks,
the longest last. Each is a subprocess with its own time limit (the run's budget caps it further)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Everything but the benchmarks compiles one fused-linear config per dtype and shape class (the full autotune
# compiled ~290 kernels for the CUDA tests alone); the benchmarks tune fully, as a training run would.
ONE_CONFIG = {"PARALLEL_LAYERS_LINEAR_TUNING": "one"}
FULL_TUNING = {"PARALLEL_LAYERS_LINEAR_TUNING": "full"}
COMPILED = {"TRITON_INTERPRET": "0"}


@dataclass
class Step:
    name: str
    argv: List[str]
    timeout_s: int
    needs_gpu: bool = True
    env: Dict[str, str] = field(default_factory=dict)
    dry_argv: List[str] = field(default_factory=list)   # what runs instead on a machine without a GPU
    note: str = ""                                       # said in the summary (e.g. why the build was skipped)


CHECK_EXTENSION = (
    "import torch; from parallel_layers import _extension as e; m, why = e.load(); "
    "has = bool(m is not None and getattr(m, 'WITH_CUDA', False)); "
    "print('extension:', 'missing: ' + str(why) if m is None else 'loaded from ' + str(m.__file__), "
    "'| CUDA part:', has, "
    "'| CUDA available:', torch.cuda.is_available(), '| CUDA_HOME:', e.find_cuda_home()); "
    "raise SystemExit(1 if m is None or (torch.cuda.is_available() and not has) else 0)")


# both FP8 benchmarks in one step (one interpreter start); each writes its own CSV under the run's folder
FP8_BENCHMARKS = ("import os, sys; from benchmarks import fp8_cast, fp8_layers; out = {out!r}; "
                  "a = fp8_cast.main(['--quick', '--device', 'cuda', '--csv', os.path.join(out, 'fp8_cast.csv')]); "
                  "b = fp8_layers.main(['--device', 'cuda', '--csv', os.path.join(out, 'fp8_layers.csv')]); "
                  "sys.exit(a or b)")


def build_step(python: str, arch: Optional[str], toolkit: str, prebuilt: Optional[str]) -> Step:
    """``setup.py build_ext --inplace`` (no pip, no wheel, nothing written outside the checkout) with every
    core and the GPU's arch; a CPU-only build when the toolkit is missing or of another major version; or
    nothing when ``prebuilt`` (the reason a matching prebuilt module is kept) is given."""
    if prebuilt is not None:
        return Step("build", [python, "-c", f"print({prebuilt!r})"], 30, needs_gpu=False, note=prebuilt)
    env = {"MAX_JOBS": str(os.cpu_count() or 1),
           "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST") or arch or "8.0;9.0"}
    note = f"built in place for {env['TORCH_CUDA_ARCH_LIST']} with {env['MAX_JOBS']} jobs"
    if toolkit == "cpu-torch":
        note = f"built in place (torch is a CPU build: the CPU part only) with {env['MAX_JOBS']} jobs"
    if toolkit in ("missing", "mismatch"):
        env["PARALLEL_LAYERS_CPU_ONLY"] = "1"
        note = f"toolkit {toolkit}: built the CPU part only"
    return Step("build", [python, os.path.join(ROOT, "setup.py"), "-q", "build_ext", "--inplace"], 300,
                needs_gpu=False, env=env, note=note)


def xdist_workers(python: str) -> List[str]:
    """``-n N`` where ``python`` has pytest-xdist (the GPU image has it): the CUDA tests' Triton compiles are
    CPU-bound, so 8 workers sharing the one GPU took the H200's 353 tests from over 300 s to 77 s."""
    try:
        has = subprocess.run([python, "-c", "import xdist"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        has = False
    n = min(8, (os.cpu_count() or 1) // 2)
    return ["-n", str(n)] if has and n >= 2 else []


def plan(out: str, python: str = sys.executable, build: Optional[Step] = None, workers: Optional[List[str]] = None
         ) -> List[Step]:
    """The steps; ``workers``: the CUDA tests' xdist option (None: ask ``python``)."""
    pytest = [python, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", os.path.join(ROOT, "tests")]
    workers = xdist_workers(python) if workers is None else workers
    probes = [python, "-m", "parallel_layers.testing.gpu_probes"]
    kernels = [python, "-m", "benchmarks.kernels"]
    steps = [
        build or build_step(python, None, "ok", None),
        Step("extension", [python, "-c", CHECK_EXTENSION], 60, needs_gpu=False),
        Step("training-parity", probes + ["training", "--device", "cuda"], 120, env={**COMPILED, **ONE_CONFIG},
             dry_argv=probes + ["training", "--device", "cpu"]),
        Step("nccl-self", probes + ["nccl-self"], 60,
             dry_argv=[python, "-c", "print('nccl-self: needs a GPU (NCCL); nothing to run on CPU')"]),
        Step("gloo-dp-cuda", probes + ["gloo-dp", "--device", "cuda"], 60,
             dry_argv=probes + ["gloo-dp", "--device", "cpu"]),
        # tests/test_cuda_compile.py compiles each .cu alone with nvcc: the build step did all of that already
        Step("cuda-tests", pytest + workers + ["-k", "cuda", "--ignore",
                                               os.path.join(ROOT, "tests", "test_cuda_compile.py"),
                                               "--junitxml", os.path.join(out, "junit-cuda.xml")], 300,
             env={**COMPILED, **ONE_CONFIG},
             dry_argv=pytest[:3] + ["-q"] + pytest[4:] + ["-k", "cuda", "--collect-only"]),
        Step("matmul-benchmark",
             [python, "-m", "benchmarks.matmul", "--quick", "--csv", os.path.join(out, "matmul.csv")],
             120, env={**COMPILED, **FULL_TUNING},
             dry_argv=[python, "-m", "benchmarks.matmul", "--smoke", "--cpu-reference", "--no-csv"]),
        # the layout planner's memory and time predictions against this GPU's allocator and clock (one rank)
        Step("planner-device", [python, "-m", "benchmarks.planner_device", "--quick",
                                "--csv", os.path.join(out, "planner_device.csv")], 120, env={**COMPILED, **ONE_CONFIG},
             dry_argv=[python, "-m", "benchmarks.planner_device", "--smoke", "--no-csv"]),
        # a whole training step of a ~1B Llama: the package (bf16 ZeRO-1, and FP8) against torch eager and
        # torch.compile, tokens/s, MFU and peak memory (issue 46's end-to-end figure)
        Step("train-step", [python, "-m", "benchmarks.train_step", "--device", "cuda",
                            "--csv", os.path.join(out, "train_step.csv")], 300, env=COMPILED,
             dry_argv=[python, "-m", "benchmarks.train_step", "--smoke", "--device", "cpu", "--no-csv",
                       "--variants", "ours fp8"]),
        Step("kernel-benchmarks", kernels + ["--quick", "--device", "cuda", "--csv", os.path.join(out, "kernels.csv")],
             90, env=COMPILED, dry_argv=kernels + ["--smoke", "--device", "cpu", "--no-csv", "--only", "adamw"]),
        # FP8: the cast kernels against torch's casts, and an FP8Linear step per recipe against bf16 nn.Linear
        # (the FP8 tensor cores' speedup, at the full sizes: seconds on a GPU)
        Step("fp8-benchmarks", [python, "-c", FP8_BENCHMARKS.format(out=out)], 120, env=COMPILED,
             dry_argv=[python, "-m", "benchmarks.fp8_layers", "--smoke", "--device", "cpu", "--no-csv"]),
        # the planner's time model: matmul and attention efficiency by shape and dtype (issue 50's profiles)
        Step("gemm-efficiency", [python, "-m", "benchmarks.gemm_efficiency", "--quick",
                                 "--csv", os.path.join(out, "gemm_efficiency.csv")], 90, env=COMPILED,
             dry_argv=[python, "-m", "benchmarks.gemm_efficiency", "--smoke", "--device", "cpu", "--no-csv"]),
        # ZeRO-Offload: the step with the optimizer state in host memory against on the GPU, and the overlap
        # of the gradients' copies with backward (the CUDA tests above check its results)
        Step("host-offload-benchmark", [python, "-m", "benchmarks.host_offload", "--quick",
                                        "--csv", os.path.join(out, "host_offload.csv")], 90, env=COMPILED,
             dry_argv=[python, "-m", "benchmarks.host_offload", "--smoke", "--no-csv"]),
        # the kernels at the sizes the GPU targets are defined at (64M-element flat buffers, 2,000-100,000
        # tensors): last, as it has no bound worth a guess before a first run; `--only` runs it alone
        Step("kernel-benchmarks-full", kernels + ["--device", "cuda", "--csv", os.path.join(out, "kernels.csv")],
             240, env=COMPILED,
             dry_argv=[python, "-c", "print('kernel-benchmarks-full: the kernel-benchmarks command at full sizes, "
                                     "whose dry run rehearses it')"]),
    ]
    return steps


STEP_NAMES = [s.name for s in plan("out", workers=[])]
