"""Finding the compiled extension ``parallel_layers._C``.

Order: the pre-built module (``pip install --no-build-isolation -e .`` builds it); otherwise a
just-in-time build from ``csrc/`` with ``torch.utils.cpp_extension.load`` into a cache directory
(like DeepSpeed's op builder: the first use pays the build, later processes reuse it); otherwise
``None`` with the reason, and the ops fall back to their torch reference. Nothing here raises:
importing ``parallel_layers`` must never fail because a kernel could not be built.

Set ``PARALLEL_LAYERS_NO_JIT=1`` to skip the JIT build (then only a pre-built module is used).
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import threading
from typing import Optional, Tuple

_lock = threading.Lock()
_result: Optional[Tuple[object, Optional[str]]] = None

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO_ROOT, "csrc")


def cpu_sources(root: str = CSRC):
    """C++ sources of the CPU extension (shared by setup.py and the JIT build)."""
    return [os.path.join(root, "bindings.cpp")] + sorted(glob.glob(os.path.join(root, "cpu", "*.cpp")))


def cuda_sources(root: str = CSRC):
    """Plain-CUDA kernels (.cu) and their torch-facing bindings (.cpp)."""
    return sorted(glob.glob(os.path.join(root, "cuda", "*.cu")) + glob.glob(os.path.join(root, "cuda", "*.cpp")))


# -std=c++20: torch >= 2.10 headers need it (torch's own cpp_extension asks for it; a later -std=c++17 would win).
# -ffp-contract=off: no silent a*b+c -> fma, so unpack's accumulate is bit-identical to the torch reference.
# -fopenmp: at::parallel_for's OpenMP backend is an inline `#pragma omp parallel` in ATen's headers; without
#   the flag it runs serially. Compile flag only: nothing links a second libgomp, the GOMP_* symbols resolve to
#   the libgomp.so.1 that libtorch_cpu already loaded. Also enables `#pragma omp simd` reductions.
# No -march: csrc/cpu compiles its hot loops per ISA itself and dispatches at run time.
CXX_FLAGS = ["-O3", "-std=c++20", "-fno-math-errno", "-ffp-contract=off", "-fopenmp"]
# No --use_fast_math: it implies -ftz=true, which flushes subnormal fp32 values to zero and breaks the
# bit-exact cast/pack/unpack/unscale contract; the kernels are memory-bound, so it bought nothing.
NVCC_FLAGS = ["-O3", "-std=c++17", "-lineinfo"]


def _is_toolkit(root: str) -> bool:
    return (os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))
            and os.path.isfile(os.path.join(root, "bin", "nvcc")))


def find_cuda_home(roots: Optional[list] = None) -> Optional[str]:
    """The CUDA toolkit's root: ``CUDA_HOME``/``CUDA_PATH`` if set, else the toolkit ``nvcc`` belongs to,
    else ``/usr/local/cuda`` or the newest ``/usr/local/cuda-*``. torch guesses the parent of the first
    ``nvcc`` on the PATH, which is wrong where that ``nvcc`` is a wrapper script in ``/usr/local/bin``
    (it then compiles against ``/usr/local/include`` and links ``-lcudart`` from ``/usr/local/lib``):
    a candidate counts only if it holds ``include/cuda_runtime.h`` and ``bin/nvcc``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += roots if roots is not None else ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"),
                                                                                reverse=True)
    return next((c for c in candidates if _is_toolkit(c)), None)


def use_cuda_home() -> Optional[str]:
    """Point torch's extension builder at :func:`find_cuda_home` (set before the build); returns it."""
    home = find_cuda_home()
    if home is not None:
        os.environ["CUDA_HOME"] = home
        from torch.utils import cpp_extension
        cpp_extension.CUDA_HOME = home
    return home


def _jit_build():
    import torch
    from torch.utils import cpp_extension

    use_cuda_home()

    sources = cpu_sources()
    if not os.path.exists(sources[0]):
        return None, f"no pre-built parallel_layers._C and no C++ sources at {CSRC} to build it from"
    with_cuda = torch.cuda.is_available() and torch.version.cuda is not None and cpp_extension.CUDA_HOME
    flags = list(CXX_FLAGS)
    if with_cuda:
        sources += cuda_sources()
        flags.append("-DWITH_CUDA")
    digest = hashlib.sha1()
    for path in sources:
        with open(path, "rb") as fh:
            digest.update(fh.read())
    digest.update(torch.__version__.encode())
    cache = os.environ.get("PARALLEL_LAYERS_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "parallel_layers"))
    build_dir = os.path.join(cache, digest.hexdigest()[:16])
    os.makedirs(build_dir, exist_ok=True)
    module = cpp_extension.load(
        name="parallel_layers_C", sources=sources, build_directory=build_dir,
        extra_cflags=flags, extra_cuda_cflags=NVCC_FLAGS + (["-DWITH_CUDA"] if with_cuda else []),
        with_cuda=bool(with_cuda), verbose=False)
    return module, None


def load():
    """Return ``(module, None)`` or ``(None, reason)``. Cached for the life of the process."""
    global _result
    if _result is not None:
        return _result
    with _lock:
        if _result is not None:
            return _result
        try:
            from . import _C  # type: ignore[attr-defined]
            _result = (_C, None)
            return _result
        except ImportError as exc:
            prebuilt_error = f"no pre-built parallel_layers._C ({exc})"
        if os.environ.get("PARALLEL_LAYERS_NO_JIT", "0") not in ("", "0"):
            _result = (None, prebuilt_error + " and PARALLEL_LAYERS_NO_JIT is set")
            return _result
        try:
            _result = _jit_build()
        except Exception as exc:  # compiler missing, build error, ...
            _result = (None, f"{prebuilt_error}; the just-in-time build failed: "
                             f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}")
        return _result
