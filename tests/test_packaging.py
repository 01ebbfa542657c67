"""The installed distribution owns one top-level name, ``parallel_layers``. Its Triton kernels (the
checkout's top-level ``triton_kernels/`` folder) install as ``parallel_layers.triton_kernels``: Triton ships
a top-level package called ``triton_kernels`` of its own, and two distributions owning one top-level name
hide each other.

The import checks run in fresh interpreters started outside the checkout: run from the checkout's root,
Python puts that directory on ``sys.path`` and its ``triton_kernels/`` folder with it, as it would any
folder in the current directory.
"""
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

try:
    importlib.metadata.distribution("parallel_layers")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("parallel_layers is not installed: a checkout used in place (setup.py build_ext --inplace, as "
                "make device-env and gpu-check on the GPU machine build it)", allow_module_level=True)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where ours is found: the checkout's folder (editable install, make setup) or inside the installed package
OURS = (os.path.join(REPO, "triton_kernels", "__init__.py"), os.path.join("parallel_layers", "triton_kernels",
                                                                          "__init__.py"))

PROBE = r"""
import importlib.util, json, os
spec = importlib.util.find_spec("triton_kernels")
top = None
if spec is not None:
    import triton_kernels
    top = {"origin": spec.origin, "other_package": getattr(triton_kernels, "OTHER_PACKAGE", False)}
import parallel_layers.triton_kernels as ours
from parallel_layers.ops import _backend
module, why = _backend._triton_module()
print(json.dumps({"top": top, "ours": os.path.realpath(ours.__file__), "why": why,
                  "ours_has_kernels": hasattr(ours, "adamw_step"), "dispatch_uses_ours": module is ours}))
"""


def _probe(tmp_path, extra_path=None):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    env["TRITON_INTERPRET"] = "1"      # Triton imports on a machine without a GPU
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=str(tmp_path), env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_distribution_owns_only_parallel_layers():
    top_level = importlib.metadata.distribution("parallel_layers").read_text("top_level.txt")
    assert top_level is not None and top_level.split() == ["parallel_layers"], top_level


def test_no_top_level_triton_kernels_comes_from_this_repository(tmp_path):
    out = _probe(tmp_path)
    if out["top"] is not None:       # Triton's own package, where it is installed
        assert not os.path.realpath(out["top"]["origin"]).startswith(REPO + os.sep), out
    assert out["ours"] == OURS[0] or out["ours"].endswith(os.sep + OURS[1]), out
    assert out["ours_has_kernels"] and out["dispatch_uses_ours"], out


def test_another_top_level_triton_kernels_and_ours_do_not_hide_each_other(tmp_path):
    other = tmp_path / "site" / "triton_kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("OTHER_PACKAGE = True\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    out = _probe(workdir, extra_path=str(tmp_path / "site"))
    assert out["top"] is not None and out["top"]["other_package"], out
    assert out["ours"] == OURS[0] or out["ours"].endswith(os.sep + OURS[1]), out
    assert out["ours_has_kernels"] and out["dispatch_uses_ours"], out
