"""Backend choice for every fused op, in one place.

Four backends implement the same *kernel contract* (see each op module's docstring):

- ``torch``:  the reference implementation, written with plain torch ops. It is the oracle in tests
  and the fallback when nothing faster is available.
- ``cpp``:    the C++ CPU kernels in ``parallel_layers._C`` (vectorised loops on ATen's thread pool).
- ``triton``: the Triton kernels in ``parallel_layers.triton_kernels`` (CUDA tensors; CPU tensors only under
  ``TRITON_INTERPRET=1``, which is how CI tests them).
- ``cuda``:   the plain-CUDA kernels in ``parallel_layers._C`` (built only with a CUDA build of torch).

Automatic choice: CUDA tensors -> cuda, else triton, else torch; CPU tensors -> cpp, else torch. The CUDA
kernels come first where an op has both: on an H200 each was as fast or faster (multi-tensor cast 2.15x
``_foreach_copy_`` against Triton's 0.37x, unscale + norm 8.4x against 2.8x, AdamW 1.14x against 1.10x:
``benchmarks/kernels.py``), the difference being the host's time per launch.
When the automatic choice has to fall back to ``torch`` it warns once, saying why.
Forcing: ``backend=`` on any op, or the environment variable ``PARALLEL_LAYERS_BACKEND``
(``auto``, ``torch``, ``cpp``, ``triton``, ``cuda``). A forced backend that cannot run raises
``RuntimeError`` with the reason instead of silently running something else.

Not every op has every backend: an op declares the ones it implements with ``backends=`` (default: all
four). The automatic choice only considers those, and for a device type none of them covers (e.g. an op
with no C++ kernel, on CPU) the torch reference *is* that op's implementation, with no warning.
``backend=`` naming one the op lacks raises ``ValueError``; the environment variable naming one the
op lacks falls back to the automatic choice with a one-time warning (the variable is set for whole
test runs, and an op without that kernel has nothing else to offer).

Cost per call: the choice is made once per (op, device, ``backend=``, op's backends) and kept, as is the
kernel function it names, so a call pays two dict look-ups. ``PARALLEL_LAYERS_BACKEND`` is read at the first
op call and again after ``clear_cache()`` (``parallel_layers.ops.clear_backend_cache``), as torch reads its
own ``TORCH_*`` variables once: reading ``os.environ`` costs ~2.5 us a call inside a training loop (a raised
and caught ``KeyError`` when it is unset), half of the host time an op may add over torch's. So set it
before the first call, or call ``clear_cache()`` after changing it. Not kept: choices that warned (the
warning must show again if ``_warned`` is cleared) and a forced ``triton`` on CPU, which depends on
``TRITON_INTERPRET``. ``clear_cache()`` forgets them all.
"""
from __future__ import annotations

import functools
import os
import warnings
from typing import Callable, Dict, Optional, Sequence

import torch

BACKENDS = ("torch", "cpp", "triton", "cuda")
ENV_VAR = "PARALLEL_LAYERS_BACKEND"

_warned: set = set()
_resolved: Dict[tuple, str] = {}       # (op, device, backend, backends) -> backend name
_impls: Dict[tuple, Callable] = {}     # (op, device, backend name) -> kernel function
_requested: Dict[tuple, str] = {}      # (backend, env value) -> requested_backend's answer



_UNREAD = object()
_env_snapshot: list = [_UNREAD]         # PARALLEL_LAYERS_BACKEND as last read (module docstring)


def _env_value() -> Optional[str]:
    """``PARALLEL_LAYERS_BACKEND``'s value or None, as read at the first call after ``clear_cache()``."""
    value = _env_snapshot[0]
    if value is _UNREAD:
        value = _env_snapshot[0] = os.environ.get(ENV_VAR)
    return value


def env_changed() -> bool:
    """Whether ``PARALLEL_LAYERS_BACKEND`` differs from what the cached choices were made with."""
    value = _env_snapshot[0]
    return value is not _UNREAD and value != os.environ.get(ENV_VAR)


def clear_cache() -> None:
    """Forget every cached backend choice and kernel, and read ``PARALLEL_LAYERS_BACKEND`` again at the next
    call (after changing the variable, or what ``_availability`` sees)."""
    _resolved.clear()
    _impls.clear()
    _requested.clear()
    _env_snapshot[0] = _UNREAD


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _triton_module():
    """Import ``parallel_layers.triton_kernels`` once. Returns (module, None) or (None, reason)."""
    try:
        from .. import triton_kernels  # defines the @triton.jit kernels
        return triton_kernels, None
    except Exception as exc:  # ImportError, or triton failing to initialise
        return None, f"parallel_layers.triton_kernels could not be imported: {type(exc).__name__}: {exc}"


def _availability(backend: str, device: torch.device):
    """(implementation module, None) if ``backend`` can run on ``device``, else (None, reason)."""
    from .. import _extension

    if backend == "torch":
        return "torch", None
    if backend == "cpp":
        if device.type != "cpu":
            return None, f"the cpp backend runs on CPU tensors only, got {device}"
        ext, why = _extension.load()
        if ext is None:
            return None, why
        return ext, None
    if backend == "cuda":
        if device.type != "cuda":
            return None, f"the cuda backend runs on CUDA tensors only, got {device}"
        ext, why = _extension.load()
        if ext is None:
            return None, why
        if not getattr(ext, "WITH_CUDA", False):
            return None, "parallel_layers._C was built without CUDA kernels (CPU-only torch or no nvcc)"
        return ext, None
    if backend == "triton":
        if device.type == "cpu" and not triton_interpreting():
            return None, ("Triton kernels run on CPU tensors only with TRITON_INTERPRET=1 set before "
                          "parallel_layers.triton_kernels is imported")
        if device.type not in ("cpu", "cuda"):
            return None, f"the triton backend does not support device {device}"
        return _triton_module()
    raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS} or 'auto'")


def requested_backend(backend: Optional[str] = None) -> str:
    """The backend asked for, lower-case: the argument if given, else ``PARALLEL_LAYERS_BACKEND``, else "auto"."""
    env = None if backend is not None else _env_value()
    key = (backend, env)
    found = _requested.get(key)
    if found is None:
        requested = backend if backend is not None else (env or "auto")
        found = _requested[key] = requested.strip().lower() or "auto"
    return found


def resolve(op: str, device: torch.device, backend: Optional[str] = None,
            backends: Sequence[str] = BACKENDS) -> str:
    """Return the backend name that will run ``op`` on ``device`` (cached: see the module docstring).

    ``backends``: the backends ``op`` implements (``torch`` is implied: every op has its reference).
    """
    # no variable's value in the key: the choices are made with the value read since the last clear_cache(),
    # which forgets them all
    key = (op, device, backend, backends)
    try:
        name = _resolved.get(key)
    except TypeError:               # backends given as a list: not hashable, decide without the cache
        return _resolve(op, device, backend, backends)[0]
    if name is None:
        name, keep = _resolve(op, device, backend, backends)
        if keep:
            _resolved[key] = name
    return name


def _resolve(op: str, device: torch.device, backend: Optional[str], backends: Sequence[str]):
    """``(backend name, whether the answer may be cached)`` (see ``resolve``)."""
    from_arg = backend is not None
    requested = requested_backend(backend)
    warned = False
    if requested != "auto":
        if requested not in BACKENDS:
            raise ValueError(f"{op}: unknown backend {requested!r} (from "
                             f"{'argument backend=' if from_arg else ENV_VAR}); "
                             f"choose one of {BACKENDS} or 'auto'")
        if requested != "torch" and requested not in backends:
            has = ("torch",) + tuple(b for b in backends if b != "torch")
            if from_arg:
                raise ValueError(f"{op}: backend={requested!r}, but {op} has no {requested} kernel; it has {has}")
            warned = True
            _warn_once(f"missing:{op}:{requested}",
                       f"parallel_layers: {ENV_VAR}={requested} but {op} has no {requested} kernel (it has "
                       f"{has}); {op} uses the automatic choice")
            requested = "auto"
    if requested != "auto":
        impl, why = _availability(requested, device)
        if impl is None:
            raise RuntimeError(f"{op}: backend {requested!r} was forced but cannot run: {why}")
        # a forced triton on CPU depends on TRITON_INTERPRET, read at each call
        return requested, not warned and not (requested == "triton" and device.type != "cuda")
    order = [b for b in (("cuda", "triton") if device.type == "cuda" else ("cpp",)) if b in backends]
    if not order:
        return "torch", not warned  # this op's implementation for this device type is the torch one
    reasons = []
    for name in order:
        impl, why = _availability(name, device)
        if impl is not None:
            return name, not warned
        reasons.append(f"{name}: {why}")
    _warn_once(f"fallback:{device.type}",
               f"parallel_layers: no fused kernel backend for {device.type} tensors, using the torch "
               f"reference implementation (slower). Reasons: {'; '.join(reasons)}")
    return "torch", False


# backends whose entry points check every tensor of a list (type, dtype, device, layout, sizes) before any work
SELF_CHECKING = ("cpp", "cuda")


def checks_inputs(op: str, device: Optional[torch.device], backend: Optional[str],
                  backends: Sequence[str] = BACKENDS) -> bool:
    """Whether the backend chosen for ``op`` on ``device`` validates its arguments itself (``SELF_CHECKING``)."""
    return isinstance(device, torch.device) and resolve(op, device, backend, backends) in SELF_CHECKING


def kernel(op: str, device: torch.device, backend: Optional[str], reference: Callable,
           backends: Sequence[str] = BACKENDS) -> Callable:
    """The function implementing ``op``'s kernel contract on the chosen backend (``backends``: the
    ones ``op`` implements, see ``resolve``)."""
    name = resolve(op, device, backend, backends)
    if name == "torch":
        return reference
    key = (op, device, name)
    fn = _impls.get(key)
    if fn is None:
        fn = _impls[key] = _kernel_of(op, device, name)
    return fn


def _kernel_of(op: str, device: torch.device, name: str) -> Callable:
    impl, _ = _availability(name, device)
    if name == "cpp":
        return getattr(impl, f"cpu_{op}")
    if name == "cuda":
        fn = getattr(impl, f"cuda_{op}")

        def run_on_current_stream(*args):
            # The .cu launchers take a raw cudaStream_t; torch's current stream is passed as an int.
            return fn(*args, torch.cuda.current_stream(device).cuda_stream)
        return run_on_current_stream
    return getattr(impl, op)
