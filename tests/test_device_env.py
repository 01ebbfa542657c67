"""The GPU machine's first shot, rehearsed on CPU: ``gpu-check --dry-run`` under the device's interpreter (``make
device-env``: Python 3.12, torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0) from a clean clone of this
checkout, with the prebuilt module carried over as the device run tool carries it, no ``.venv``, and no package
index (``PIP_NO_INDEX=1``, proxies pointed at a closed port). Skipped where ``.venv-device`` was not made (CI's
fresh clone); ``make device-test`` runs it."""
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICE_PYTHON = os.environ.get("PL_DEVICE_PYTHON", os.path.join(ROOT, ".venv-device", "bin", "python"))


def _device_python():
    if not os.path.isfile(DEVICE_PYTHON):
        pytest.skip(f"no device interpreter at {DEVICE_PYTHON} (make device-env makes it)")
    return DEVICE_PYTHON


def _device_module():
    out = subprocess.run([_device_python(), "-c", "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    path = os.path.join(ROOT, "parallel_layers", "_C" + out)
    if not os.path.isfile(path):
        pytest.skip(f"no prebuilt {os.path.relpath(path, ROOT)} (make device-env builds it)")
    return path


def _offline_env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.lower().endswith("_proxy")}
    closed = "http://127.0.0.1:9"       # the discard port: nothing listens, any download fails at once
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, http_proxy=closed, https_proxy=closed,
               HTTP_PROXY=closed, HTTPS_PROXY=closed, HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1",
               HOME=str(tmp_path / "home"),      # no user caches (Triton's, ours) from earlier runs
               PATH=os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p))
    os.makedirs(env["HOME"], exist_ok=True)
    return env


@pytest.mark.slow
def test_first_shot_dry_run_from_a_clean_clone_offline(tmp_path):
    python = _device_python()
    module = _device_module()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", ROOT, str(clone)], check=True, timeout=120)
    assert not (clone / ".venv").exists() and not (clone / ".venv-device").exists()
    shutil.copy2(module, clone / "parallel_layers")            # the run tool carries the ignored build output
    out = tmp_path / "gc"
    proc = subprocess.run([python, "-m", "parallel_layers", "gpu-check", "--dry-run", "--out", str(out)],
                          cwd=clone, env=_offline_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = (out / "summary.md").read_text()
    assert "all ok" in summary, summary
    assert "versions: torch 2.11.0" in summary and "triton 3.6.0" in summary, summary
    rows = {r["step"]: r for r in json.loads((out / "results.json").read_text())["steps"]}
    assert "matches" in rows["build"]["note"] and "not rebuilt" in rows["build"]["note"], rows["build"]
    assert "CUDA part: True" in (out / "extension.log").read_text()     # the carried module has its CUDA part
    assert "training parity fp32 on cpu" in (out / "training-parity.log").read_text()


@pytest.mark.slow
def test_fused_linear_one_config_compiles_for_sm90_under_the_device_triton(tmp_path):
    """tests/test_fused_linear.py's stand-in compile, under triton 3.6 (the GPU image's)."""
    from test_fused_linear import STANDIN_RUN
    env = dict(os.environ, TRITON_INTERPRET="0", PARALLEL_LAYERS_LINEAR_TUNING="one",
               TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=ROOT)
    out = subprocess.run([_device_python(), "-W", "ignore", "-c", STANDIN_RUN], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "reached 2 of 2" in out.stdout, out.stdout + out.stderr[-3000:]
