"""``python3 -m parallel_layers gpu-check``: the plan a GPU machine runs, the decisions it takes from its
environment (toolkit, prebuilt module), its budget, and results that survive a cut-off; its dry run on this CPU
machine runs every step that needs no GPU for real, so the command cannot rot before a GPU is lent."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from parallel_layers import _extension
from parallel_layers.cli.gpu_check import ROOT, build_step, plan
from parallel_layers.cli.gpu_check import environment as E
from parallel_layers.cli.gpu_check.runner import run_steps
from parallel_layers.cli.gpu_check.steps import Step


def test_plan_orders_what_a_first_run_must_learn(tmp_path):
    steps = {s.name: s for s in plan(str(tmp_path))}
    assert list(steps) == ["build", "extension", "training-parity", "nccl-self", "gloo-dp-cuda", "cuda-tests",
                           "matmul-benchmark", "planner-device", "train-step", "kernel-benchmarks", "fp8-benchmarks",
                           "gemm-efficiency", "host-offload-benchmark", "kernel-benchmarks-full"]
    cuda = steps["cuda-tests"]
    assert cuda.env["TRITON_INTERPRET"] == "0" and "--junitxml" in cuda.argv and "-v" in cuda.argv
    assert cuda.env["PARALLEL_LAYERS_LINEAR_TUNING"] == "one"                  # not hundreds of kernels
    assert steps["training-parity"].env["PARALLEL_LAYERS_LINEAR_TUNING"] == "one"
    assert steps["matmul-benchmark"].env["PARALLEL_LAYERS_LINEAR_TUNING"] == "full"
    assert all(s.dry_argv for s in steps.values() if s.needs_gpu)             # every GPU step has its dry run
    assert not any("pip" in a for s in steps.values() for a in s.argv + s.dry_argv)   # no index on the GPU machine
    assert not any("linear_registers" in " ".join(s.argv) for s in steps.values())    # needs no GPU: runs here


def test_build_step_builds_in_place_for_the_gpu_or_keeps_a_matching_prebuilt_module():
    step = build_step("python3", "9.0", "ok", None)
    assert step.argv[1:] == [os.path.join(ROOT, "setup.py"), "-q", "build_ext", "--inplace"]
    assert step.env["TORCH_CUDA_ARCH_LIST"] == "9.0" and int(step.env["MAX_JOBS"]) == os.cpu_count()
    assert "PARALLEL_LAYERS_CPU_ONLY" not in step.env
    for toolkit in ("missing", "mismatch"):
        step = build_step("python3", "9.0", toolkit, None)
        assert step.env["PARALLEL_LAYERS_CPU_ONLY"] == "1" and toolkit in step.note
    step = build_step("python3", "9.0", "ok", "prebuilt _C matches")
    assert "setup.py" not in " ".join(step.argv) and step.note == "prebuilt _C matches"


def test_toolkit_outcomes():
    assert E.toolkit_status(None, None, None)[0] == "cpu-torch"
    assert E.toolkit_status("13.0", None, None)[0] == "missing"
    assert E.toolkit_status("13.0", "/usr/local/cuda", None)[0] == "missing"
    status, why = E.toolkit_status("13.0", "/usr/local/cuda", "12.4")
    assert status == "mismatch" and "12.4" in why and "13.0" in why
    assert E.toolkit_status("13.0", "/usr/local/cuda", "13.1")[0] == "ok"
    assert E.arch_covered("9.0", "8.0;9.0") and E.arch_covered("9.0", "8.0+PTX") and E.arch_covered(None, None)
    assert not E.arch_covered("9.0", "8.0") and not E.arch_covered("8.0", "9.0+PTX") and not E.arch_covered("9.0", "")


def _fake_module(path, **info):
    full = dict(torch=torch.__version__, cuda=torch.version.cuda, archs="9.0", python="cp3",
                sources=_extension.sources_digest())
    full.update(info)
    # what setup.py compiles in (build/pl_build_info.cpp), between other bytes of a shared object
    path.write_bytes(b"\x7fELF\0junk\0" + _extension.BUILD_INFO_MARKER + json.dumps(full).encode() + b"\0tail")
    return str(path)


def test_prebuilt_module_is_kept_only_when_it_matches_the_running_torch(tmp_path):
    env = E.Environment("3.12", {}, torch.version.cuda, "H100", "9.0", None, None, None, "ok", "")
    use, why = E.prebuilt_decision(env, _fake_module(tmp_path / "a.so"))
    assert use and "matches" in why and "not rebuilt" in why
    for info, says in [(dict(torch="2.11.0+cu130"), "built for torch 2.11.0+cu130"),
                       (dict(sources="0" * 16), "csrc/ changed"),
                       (dict(cuda="12.8"), "built with CUDA 12.8")]:
        if info.get("torch") == torch.__version__:
            continue
        use, why = E.prebuilt_decision(env, _fake_module(tmp_path / "b.so", **info))
        assert not use and says in why and "rebuilding" in why, why
    if torch.version.cuda is not None:      # the arch only counts for a module with a CUDA part
        use, why = E.prebuilt_decision(env, _fake_module(tmp_path / "c.so", archs="8.0"))
        assert not use and "the GPU is 9.0" in why
    (tmp_path / "old.so").write_bytes(b"\x7fELF no info")
    assert "no build info" in E.prebuilt_decision(env, str(tmp_path / "old.so"))[1]


def test_the_built_extension_carries_its_build_info():
    path = _extension.prebuilt_module_path()
    if path is None:
        pytest.skip("no prebuilt parallel_layers/_C for this interpreter (make setup builds it)")
    info = _extension.read_build_info(path)
    if info is None:
        pytest.skip(f"{path} predates the build info (make setup rebuilds it)")
    assert info["torch"] == torch.__version__ and info["python"] == f"cp{sys.version_info[0]}{sys.version_info[1]}"


def _py(code):
    return [sys.executable, "-c", code]


def test_budget_step_limits_and_not_run_steps(tmp_path):
    # a step is waited for max(1, limit - GRACE_S) s: with a 2.5 s budget the first had 1 s, and a Python start
    # took longer under the loaded suite. Here the first has 6 s; the hanging one (3 s: starts while 3 s are
    # left) is stopped after 1 s, which leaves less than the 15.5 s a step needs to start
    steps = [Step("quick", _py("print('hi')"), 30, needs_gpu=False),
             Step("hangs", _py("import time; time.sleep(60)"), 3, needs_gpu=False),
             Step("late", _py("print('never')"), 30, needs_gpu=False)]
    t0 = time.monotonic()
    rc = run_steps(steps, str(tmp_path), ["test"], gpu=False, budget_s=16, min_start_s=15.5)
    assert rc == 1 and time.monotonic() - t0 < 20
    rows = {r["step"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert rows["quick"]["result"].startswith("ok")
    assert rows["hangs"]["result"].startswith("TIMEOUT")
    assert rows["late"]["result"] == "not run: no time left"
    summary = (tmp_path / "summary.md").read_text()
    assert "FAILED: hangs; not run: late" in summary and "| late | not run: no time left |" in summary
    assert (tmp_path / "results.csv").read_text().count("\n") == 4

    # --only reruns one step and keeps the other rows
    steps[1] = Step("hangs", _py("print('fixed')"), 5, needs_gpu=False)
    assert run_steps(steps, str(tmp_path), ["test"], gpu=False, budget_s=30, only=["hangs"]) == 0
    rows = {r["step"]: r for r in json.loads((tmp_path / "results.json").read_text())["steps"]}
    assert rows["hangs"]["result"].startswith("ok") and rows["quick"]["result"].startswith("ok")
    assert rows["late"]["result"] == "not run: no time left"


KILLED_RUN = """
import sys
from parallel_layers.cli.gpu_check.runner import run_steps
from parallel_layers.cli.gpu_check.steps import Step
py = sys.executable
steps = [Step("first", [py, "-c", "print('done')"], 30, needs_gpu=False),
         Step("long", [py, "-c", "import time; print('working', flush=True); time.sleep(120)"], 300, needs_gpu=False),
         Step("after", [py, "-c", "print('never')"], 30, needs_gpu=False)]
sys.exit(run_steps(steps, sys.argv[1], ["killed-run test"], gpu=False, budget_s=600))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_results_survive_a_kill_mid_step(tmp_path, sig):
    """The command's 10-minute limit kills gpu-check while a step runs: the summary on disk still has every
    step done, the one running and the ones never started."""
    out = tmp_path / "gc"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, str(out)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            log = out / "long.log"
            if log.exists() and "working" in log.read_text():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the long step never started")
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        summary = (out / "summary.md").read_text()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        rows = json.loads((out / "results.json").read_text())["steps"]
        group = re.search(r"process group (\d+)", rows[1]["result"])
        if group:                        # a SIGKILLed gpu-check leaves its step running, as on the GPU machine
            try:
                os.killpg(int(group.group(1)), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert "| first | ok (ran) |" in summary, summary
    assert ("| long | running" if sig == signal.SIGKILL else "| long | KILLED") in summary, summary
    assert "| after | not run |" in summary, summary
    assert "killed-run test" in summary


def test_dry_run_runs_and_writes_its_summary(tmp_path):
    out = tmp_path / "gc"
    proc = subprocess.run([sys.executable, "-m", "parallel_layers", "gpu-check", "--out", str(out), "--dry-run"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PIP_NO_INDEX="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (out / "summary.md").read_text()
    assert "dry run on CPU" in summary and "all ok" in summary, summary
    for line in ("versions: torch " + torch.__version__, "toolkit: ", "CUDA_HOME: ", "nvcc --version: ", "build: "):
        assert line in summary, (line, summary)
    for name in ("build", "extension", "training-parity", "gloo-dp-cuda", "matmul-benchmark", "kernel-benchmarks",
                 "cuda-tests"):
        assert f"| {name} | ok" in summary, summary
        assert os.path.getsize(out / f"{name}.log") > 0
    assert "training parity fp32 on cpu" in (out / "training-parity.log").read_text()
    assert "averaged gradients match" in (out / "gloo-dp-cuda.log").read_text()
    assert "CUDA part:" in (out / "extension.log").read_text()
