"""Builds parallel_layers._C: the C++ CPU kernels always, the CUDA kernels when torch is a CUDA
build and nvcc is found. Use ``pip install --no-build-isolation -e .`` (the build needs the torch
you run with). Set PARALLEL_LAYERS_CPU_ONLY=1 to skip the CUDA kernels."""
import os
import runpy

import torch
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
# The source lists, flags and the toolkit's location live in one place, shared with the just-in-time build.
_ext = runpy.run_path(os.path.join(ROOT, "parallel_layers", "_extension.py"))
CUDA_HOME = _ext["use_cuda_home"]() if torch.version.cuda is not None else None

from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402


def relative(paths):
    return [os.path.relpath(p, ROOT) for p in paths]


with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None
             and os.environ.get("PARALLEL_LAYERS_CPU_ONLY", "0") in ("", "0"))
if with_cuda:
    extension = CUDAExtension(
        "parallel_layers._C",
        sources=relative(_ext["cpu_sources"](os.path.join(ROOT, "csrc"))
                         + _ext["cuda_sources"](os.path.join(ROOT, "csrc"))),
        extra_compile_args={"cxx": _ext["CXX_FLAGS"] + ["-DWITH_CUDA"],
                            "nvcc": _ext["NVCC_FLAGS"] + ["-DWITH_CUDA"]})
else:
    extension = CppExtension(
        "parallel_layers._C",
        sources=relative(_ext["cpu_sources"](os.path.join(ROOT, "csrc"))),
        extra_compile_args={"cxx": _ext["CXX_FLAGS"]})

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
