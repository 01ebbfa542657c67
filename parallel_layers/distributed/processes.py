"""Ranks started as processes forked from one that imported torch once (the ``forkserver`` start method).

Spawning a rank starts a fresh interpreter that imports torch (and the package, and transformers for a
Hugging Face model) again: seconds of CPU a rank, most of it in the kernel mapping and faulting in torch's
libraries. Eight ranks on a two-core machine waited ~15 s for that before their first step. A forkserver
imports the modules once, in a process that has done nothing else (no threads, no process group, no
CUDA), and forks each rank from it: a rank is ready in a fraction of a second, and it is still a new
process with nothing of its parent's state.

The server is started on first use and kept by ``multiprocessing`` for the parent's lifetime, so what a
process reads only when it starts (glibc's ``MALLOC_*`` tunables, the loader's ``LD_*``, OpenMP's, Python's,
torch's at import) is the server's. :func:`start_context` therefore forks only when those variables are
what the server started with, and spawns otherwise (a memory benchmark's ``MALLOC_MMAP_THRESHOLD_``); a
forked rank takes the rest of the parent's current environment (:func:`adopt_environment`).
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
from typing import Dict, Mapping, Optional, Sequence

# torch._dynamo: torch.optim imports it at the first optimizer a rank builds (over a second of its setup)
BASE_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "parallel_layers")
READ_AT_START = ("MALLOC_", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "PYTHON", "TORCH", "TRITON_", "CUDA_")

# The start-up variables the forkserver was started with. multiprocessing keeps one forkserver per process,
# so this is a fact of the process, recorded by the first start_context that starts it.
_server_start_env: Optional[Dict[str, str]] = None


def _read_at_start(env: Mapping[str, str]) -> Dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_START)}


def start_context(env: Optional[Mapping[str, str]] = None, preload: Sequence[str] = ()):
    """The ``multiprocessing`` context to start ranks whose environment is ``env`` (default: the current
    one): ``forkserver`` (the server imports ``BASE_PRELOAD`` and ``preload``, each that is installed) unless
    a variable read at process start differs from the server's, then ``spawn``."""
    global _server_start_env
    wanted = _read_at_start(os.environ if env is None else env)
    if _server_start_env is None:
        if wanted != _read_at_start(os.environ):
            return multiprocessing.get_context("spawn")      # the server would start with the parent's
        modules = [m for m in (*BASE_PRELOAD, *preload) if importlib.util.find_spec(m.split(".")[0]) is not None]
        multiprocessing.set_forkserver_preload(modules)
        _server_start_env = wanted
    if wanted != _server_start_env:
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


def current_environment() -> Dict[str, str]:
    """The parent's environment now, to hand to a forked rank (the server's is the one it started with)."""
    return dict(os.environ)


def adopt_environment(env: Mapping[str, str]) -> None:
    """In a rank: take the environment its parent handed it."""
    os.environ.clear()
    os.environ.update(env)


__all__ = ["start_context", "current_environment", "adopt_environment", "BASE_PRELOAD", "READ_AT_START"]
