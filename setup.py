"""Builds parallel_layers._C: the C++ CPU kernels always, the CUDA kernels when torch is a CUDA
build and nvcc is found. Use ``pip install --no-build-isolation -e .`` (the build needs the torch
you run with), or ``python setup.py build_ext --inplace`` (no pip, no wheel, no write to site-packages: what
``gpu-check`` runs on the GPU machine). Set PARALLEL_LAYERS_CPU_ONLY=1 to skip the CUDA kernels.

CUDA targets: ``TORCH_CUDA_ARCH_LIST`` if set; else the visible GPUs' (torch's own choice); else, a CUDA torch
on a machine without a GPU, ``DEFAULT_ARCHS`` (A100 and H100), where torch's builder would stop with an
IndexError (it appends "+PTX" to an empty list)."""
import os
import runpy
import sys

import torch
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# The source lists, flags and the toolkit's location live in one place, shared with the just-in-time build.
_ext = runpy.run_path(os.path.join(ROOT, "parallel_layers", "_extension.py"))
CUDA_HOME = _ext["use_cuda_home"]() if torch.version.cuda is not None else None

DEFAULT_ARCHS = "8.0;9.0"
if torch.version.cuda is not None and not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
    os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCHS

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def relative(paths):
    return [os.path.relpath(p, ROOT) for p in paths]


def build_info_file(with_cuda: bool) -> str:
    """build/pl_build_info.cpp: what this build is against, compiled into the module (``_extension.read_build_info``
    reads it back; gpu-check keeps a prebuilt module only when it matches the running torch). Rewritten only
    when it changes, so ninja's rebuild stays incremental."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda if with_cuda else None,
            "archs": os.environ.get("TORCH_CUDA_ARCH_LIST") if with_cuda else None,
            "python": f"cp{sys.version_info[0]}{sys.version_info[1]}", "sources": _ext["sources_digest"]()}
    path = os.path.join(ROOT, "build", "pl_build_info.cpp")
    text = _ext["build_info_source"](info)
    if not os.path.isfile(path) or open(path).read() != text:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(text)
    return path


# No host debug info in the module (Python's own CFLAGS add -g): the CUDA build is 3.2 MB instead of 27.6, small
# enough to carry to the GPU machine prebuilt; the kernels keep nvcc's -lineinfo (it lives in the fatbin).
LINK_FLAGS = ["-Wl,--strip-debug"]

with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
             and os.environ.get("PARALLEL_LAYERS_CPU_ONLY", "0") in ("", "0"))
if with_cuda:
    extension = CUDAExtension(
        "parallel_layers._C",
        sources=relative(_ext["cpu_sources"](os.path.join(ROOT, "csrc"))
                         + _ext["cuda_sources"](os.path.join(ROOT, "csrc")) + [build_info_file(True)]),
        extra_compile_args={"cxx": _ext["CXX_FLAGS"] + ["-DWITH_CUDA"],
                            "nvcc": _ext["NVCC_FLAGS"] + ["-DWITH_CUDA"]},
        extra_link_args=LINK_FLAGS)
else:
    extension = CppExtension(
        "parallel_layers._C",
        sources=relative(_ext["cpu_sources"](os.path.join(ROOT, "csrc")) + [build_info_file(False)]),
        extra_compile_args={"cxx": _ext["CXX_FLAGS"]}, extra_link_args=LINK_FLAGS)

setup(
    name="parallel_layers",
    version="0.1.0",
    # triton_kernels/ stays a top-level folder of the checkout but installs as parallel_layers.triton_kernels:
    # Triton ships a top-level package of that name, and two distributions owning one top-level name hide
    # each other.
    packages=find_packages(include=["parallel_layers", "parallel_layers.*"]) + ["parallel_layers.triton_kernels"],
    package_dir={"parallel_layers.triton_kernels": "triton_kernels"},
    ext_modules=[extension],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
