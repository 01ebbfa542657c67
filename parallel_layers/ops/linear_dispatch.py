"""Which backend runs ``fused_linear`` on CUDA tensors when none is forced: chosen by measurement.

The fused Triton kernel saves the unfused chain's extra passes over Y (bias, activation, cast), but
cuBLAS is the faster GEMM in places the epilogue cannot make up for. The automatic choice, in order:

1. **float32 without TF32** (``torch.backends.cuda.matmul.allow_tf32`` False, torch's default): torch.
   ``tl.dot`` with IEEE float32 inputs compiles to plain FMA loops (no tensor cores), where cuBLAS's
   SGEMM kernels are tuned far beyond what our tiles do; nothing to measure.
2. **Small problems** (``2*M*N*K`` below ``SMALL_FLOPS``): torch. Both sides are bound by launches
   there, and Triton's Python launcher costs more host time than the unfused chain's two or three
   ATen launches; timing them would measure noise.
3. **Otherwise, measured once per shape class**: the first call of a class (device, dtype, output
   dtype, activation, bias, whether the pre-activation is stored, M rounded up to a power of two as
   the Triton autotuner's key does, N, K) runs both forwards on that call's tensors (Triton after
   its own autotuning, so the tuned config is what is timed) and keeps the faster. The result is kept
   in memory and in a JSON file shared by every process of the machine (``cache_path``), so a
   training job's ranks and its next runs do not measure again. Under CUDA graph capture nothing is
   measured: a known result is used, else Triton.

Ranks of one job may measure different winners for one class (timing noise); the two backends agree
to rounding, and data-parallel replicas stay identical because they step on all-reduced gradients.
Force one (``backend=`` or ``PARALLEL_LAYERS_BACKEND``) for bitwise-reproducible runs across machines.
The Triton kernel's own config choice is cached on disk by Triton (``cache_results``, see
``triton_kernels/matmul.py``).
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import tempfile
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

SMALL_FLOPS = 2 ** 27           # ~134 MFLOP: ~0.2 ms of H100 bf16 tensor cores at 80% of peak
CACHE_ENV = "PARALLEL_LAYERS_CACHE_DIR"
CACHE_FILE = "fused_linear_backends.json"
REPS = 10


def default_cache_path() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "parallel_layers")
    return os.path.join(root, CACHE_FILE)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def static_choice(m: int, n: int, k: int, dtype: torch.dtype) -> Optional[Tuple[str, str]]:
    """(backend, reason) when a rule decides without measuring, else None."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "torch", "float32 without TF32: Triton's tl.dot runs FMA loops, cuBLAS SGEMM is faster"
    if 2 * m * n * k < SMALL_FLOPS:
        return "torch", f"2*M*N*K = {2 * m * n * k} < {SMALL_FLOPS}: launch-bound, fewer host cycles in torch"
    return None


def cuda_event_timer(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` on the current stream (one warm-up call, then ``REPS`` timed)."""
    fn()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class BackendChooser:
    """The automatic choice with its caches; ``timer(fn) -> ms`` and ``cache_path`` are injectable so
    the decision logic is tested without a GPU."""

    def __init__(self, cache_path: Optional[str] = None, timer: Optional[Callable] = None):
        self.cache_path = cache_path or default_cache_path()
        self.timer = timer or cuda_event_timer
        self.choices: Dict[str, dict] = {}
        self._loaded = False

    @staticmethod
    def key(x, weight, bias, activation, out_dtype, save_pre) -> str:
        m, k = x.shape
        n = weight.shape[0]
        return (f"{_machine(x.device)} | {str(x.dtype)[6:]}->{str(out_dtype or x.dtype)[6:]} | act {activation} | "
                f"bias {bias is not None} | pre {save_pre} | M<={_next_pow2(m)} N={n} K={k}")

    def choose(self, x, weight, bias, activation, out_dtype, save_pre,
               run: Callable[[str], object]) -> Tuple[str, str]:
        """(backend, reason) for a 2-D call; ``run(backend)`` runs that backend's forward once."""
        m, k = x.shape
        ruled = static_choice(m, weight.shape[0], k, x.dtype)
        if ruled is not None:
            return ruled
        key = self.key(x, weight, bias, activation, out_dtype, save_pre)
        hit = self.choices.get(key) or self._load().get(key)
        if hit is not None:
            return hit["backend"], _reason(hit)
        if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return "triton", "not measured during CUDA graph capture"
        with torch.no_grad():
            run("triton")             # Triton autotunes this class first, so its tuned config is timed
            ms = {name: self.timer(lambda name=name: run(name)) for name in ("triton", "torch")}
        entry = {"backend": min(ms, key=ms.get), "triton_ms": ms["triton"], "torch_ms": ms["torch"]}
        self.choices[key] = entry
        self._store(key, entry)
        return entry["backend"], _reason(entry)

    def _load(self) -> Dict[str, dict]:
        if not self._loaded:
            self._loaded = True
            self.choices = {**_read(self.cache_path), **self.choices}
        return self.choices

    def _store(self, key: str, entry: dict) -> None:
        """Merge into the shared file (another process may have written other classes) and replace it
        atomically, so a reader never sees half a file."""
        try:
            merged = {**_read(self.cache_path), key: entry}
            folder = os.path.dirname(self.cache_path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".fused_linear_", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "choices": merged}, f, indent=1, sort_keys=True)
            os.replace(tmp, self.cache_path)
        except OSError as exc:
            warnings.warn(f"fused_linear: could not write the backend cache {self.cache_path} ({exc}); "
                          f"choices are kept for this process only (set {CACHE_ENV} to a writable folder)",
                          RuntimeWarning, stacklevel=3)


def _read(path: str) -> Dict[str, dict]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    choices = data.get("choices") if isinstance(data, dict) and data.get("version") == 1 else None
    if not isinstance(choices, dict):
        return {}
    return {k: v for k, v in choices.items()
            if isinstance(v, dict) and v.get("backend") in ("triton", "torch")}


def _reason(entry: dict) -> str:
    return (f"measured: triton {entry.get('triton_ms', float('nan')):.4g} ms, "
            f"torch {entry.get('torch_ms', float('nan')):.4g} ms")


@functools.lru_cache(maxsize=None)
def _machine(device: torch.device) -> str:
    """What a measurement depends on besides the shape: the GPU and the library versions (looked up once
    per device: the key is built on every automatic CUDA call)."""
    return _machine_of(device.type, device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else None))


@functools.lru_cache(maxsize=None)
def _machine_of(device_type: str, index: Optional[int]) -> str:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(index) if device_type == "cuda" else device_type
    return f"{name} | torch {torch.__version__} triton {triton_version}"


_chooser: Optional[BackendChooser] = None


def chooser() -> BackendChooser:
    """This process's chooser (created on first use: its cache file is read only if a CUDA call needs it)."""
    global _chooser
    if _chooser is None:
        _chooser = BackendChooser()
    return _chooser
