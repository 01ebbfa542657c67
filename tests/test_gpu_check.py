"""``python -m parallel_layers gpu-check``: its dry run on this CPU machine runs every step that needs no
GPU for real and says what it would run on one, so the command cannot rot before a GPU is lent."""
import os
import subprocess
import sys

from parallel_layers.gpu_check import ROOT, plan


def test_plan_covers_what_a_gpu_machine_must_show(tmp_path):
    steps = {s.name: s for s in plan(str(tmp_path))}
    assert list(steps) == ["build", "extension", "cuda-tests", "training-parity", "nccl-self", "gloo-dp-cuda",
                           "matmul-benchmark", "linear-registers", "kernel-benchmarks", "host-offload-benchmark"]
    assert steps["cuda-tests"].env["TRITON_INTERPRET"] == "0"          # compiled Triton, not the interpreter
    assert "--junitxml" in steps["cuda-tests"].argv
    assert sum(s.timeout_s for s in steps.values()) <= 22 * 60
    assert all(s.dry_argv for s in steps.values() if s.needs_gpu)      # every GPU step has its dry run


def test_dry_run_runs_and_writes_its_summary(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, "-m", "parallel_layers", "gpu-check", "--out", str(out), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    assert "dry run on CPU" in summary and "all ok" in summary, summary
    for name in ("extension", "training-parity", "gloo-dp-cuda", "matmul-benchmark", "kernel-benchmarks",
                 "cuda-tests"):
        assert f"| {name} | ok" in summary, summary
        assert os.path.getsize(out / f"{name}.log") > 0
    assert "training parity fp32 on cpu" in (out / "training-parity.log").read_text()
    assert "averaged gradients match" in (out / "gloo-dp-cuda.log").read_text()
    assert "CUDA part:" in (out / "extension.log").read_text()
