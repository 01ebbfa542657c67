"""Ranks started as processes forked from one that imported torch once (the ``forkserver`` start method).

Spawning a rank starts a fresh interpreter that imports torch (and the package, and transformers for a
Hugging Face model) again: seconds of CPU a rank, most of it in the kernel mapping and faulting in torch's
libraries. Eight ranks on a two-core machine waited ~15 s for that before their first step. A forkserver
imports the modules once, in a process that has done nothing else (no threads, no process group, no
CUDA), and forks each rank from it: a rank is ready in a fraction of a second, and it is still a new
process with nothing of its parent's state. The server is started on first use and kept by
``multiprocessing`` for the parent's lifetime, so its environment is the parent's at that moment: a rank
gets the parent's current environment explicitly (:func:`current_environment`).
"""
from __future__ import annotations

import importlib.util
import multiprocessing
import os
from typing import Dict, Sequence

BASE_PRELOAD = ("torch", "torch.distributed", "parallel_layers")


def forked_context(preload: Sequence[str] = ()):
    """A ``multiprocessing`` context whose processes fork from a server that imported ``BASE_PRELOAD`` and
    ``preload`` (each module that is installed; an optional one that is not is left out). The modules are
    imported when the server starts, on the first process of the parent's: later calls reuse it."""
    modules = [m for m in (*BASE_PRELOAD, *preload) if importlib.util.find_spec(m.split(".")[0]) is not None]
    multiprocessing.set_forkserver_preload(modules)
    return multiprocessing.get_context("forkserver")


def current_environment() -> Dict[str, str]:
    """The parent's environment now, to hand to a forked rank (the server's is the one it started with)."""
    return dict(os.environ)


def adopt_environment(env: Dict[str, str]) -> None:
    """In a forked rank: take the parent's environment as it was when the rank was started."""
    os.environ.clear()
    os.environ.update(env)


__all__ = ["forked_context", "current_environment", "adopt_environment", "BASE_PRELOAD"]
