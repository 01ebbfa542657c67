"""A pool of ``world_size`` real processes over gloo that runs many test bodies.

Starting a process costs time on a small CPU, so the pool is started once (its ranks forked from a server
that imported torch once: :mod:`parallel_layers.distributed.processes`) and each test sends it a function to
run on every rank. A body is a module-level
function ``body(rank, world_size, *args)``; ``pool.run(body, *args)`` returns the list of per-rank
results, rank order. If any rank raises, ``RankFailure`` carries every failing rank's traceback, and
the pool is restarted (the other ranks may be stuck in a collective). If a call takes longer than
its timeout, the pool is killed and the call fails: a bug makes a test fail, never hang CI.

Each worker runs one thread (``torch.set_num_threads(1)``) so ranks do not fight over cores, and its
default process group has a timeout, so a rank waiting on a dead peer errors out. The process groups a body
makes are destroyed when it returns (a cached mesh's are kept: :func:`cached_mesh`).
"""
from __future__ import annotations

import datetime
import gc
import importlib
import importlib.util
import os
import pickle
import queue
import socket
import sys
import traceback
from typing import Any, Callable, List

from ..distributed.processes import adopt_environment, current_environment, start_context

# what test bodies import: the composition, pytest (every test module), transformers (the Hugging Face models)
PRELOAD = ("parallel_layers.composition.parallel3d", "pytest", "transformers")


class RankFailure(AssertionError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def free_port() -> int:
    """A TCP port free on localhost right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _import_root(module_name: str, module_file: str) -> str:
    """The folder ``module_name`` is imported from: ``module_file``'s folder, one level up per dot
    (``benchmarks.pipeline`` in ``repo/benchmarks/pipeline.py`` -> ``repo``)."""
    root = os.path.dirname(os.path.abspath(module_file))
    for _ in range(module_name.count(".")):
        root = os.path.dirname(root)
    return root


def _resolve(module_name: str, module_file: str, qualname: str) -> Callable:
    module = sys.modules.get(module_name)
    if module is None:
        # Appended, never put first: a package's own folder at the front of sys.path would let its
        # modules shadow installed packages of the same name (benchmarks/kernels.py hid the `kernels`
        # package that transformers probes for).
        root = _import_root(module_name, module_file)
        if root not in sys.path:
            sys.path.append(root)
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            spec = importlib.util.spec_from_file_location(module_name, module_file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _detached(obj):
    """Results cross a process boundary: tensors lose their autograd history."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    return obj


def _torch_group_maps() -> list:
    """The containers in which torch.distributed keeps its process groups. No public call lists the groups,
    hence the read of ``distributed_c10d._world``'s properties (its maps: group -> name, ranks, tag, ...)."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    names = [n for n in dir(type(world)) if isinstance(getattr(type(world), n), property)]
    maps = {id(m): m for m in (getattr(world, n) for n in names) if isinstance(m, (dict, list))}
    return list(maps.values())


def _process_groups() -> set:
    import torch.distributed as dist

    return set(dist.distributed_c10d._world.pg_map)


def _references_in(maps: list, group) -> int:
    """How many references to ``group`` torch's own maps hold (as a key or a value, two levels down)."""
    count, todo = 0, [(m, 2) for m in maps]
    while todo:
        obj, depth = todo.pop()
        if obj is group:
            count += 1
        elif depth and isinstance(obj, dict):
            count += sum(k is group for k in obj)
            todo.extend((v, depth - 1) for v in obj.values())
        elif depth and isinstance(obj, (list, tuple)):
            todo.extend((v, depth - 1) for v in obj)
    return count


def _release_groups_since(before: set) -> None:
    """Destroy each process group made since ``before`` that nothing but torch holds any more. A gloo group
    keeps a loop thread that wakes every 10 ms while it lives: kept across a test run's hundreds of bodies
    (tens per worker, twelve workers), they spent much of the machine's time in the kernel. A group that a
    cached mesh or any other live object holds stays."""
    import torch.distributed as dist

    made = _process_groups() - before
    if not made:                      # most bodies reuse a cached mesh: no collection (~0.2 s a rank) for them
        return
    gc.collect()                      # a model and its wrapper in a cycle still hold their groups
    maps = _torch_group_maps()
    while made:
        group = made.pop()
        # getrefcount's own argument and the local name `group` are the two references besides torch's
        if sys.getrefcount(group) - 2 == _references_in(maps, group):
            dist.destroy_process_group(group)
        del group


def _worker(rank: int, world_size: int, port: int, tasks, results, pg_timeout_s: float, env: dict,
            bind_cores: bool = False, backend: str = "gloo") -> None:
    adopt_environment(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from . import gloo_device
    gloo_device.install()           # one transport device (one polling loop thread) for all the worker's groups
    if backend == "nccl_rules":     # NCCL's rules over gloo, host tensors of the package tracked
        from . import nccl_rules
        nccl_rules.register()
        nccl_rules.track_host_tensors()
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    if bind_cores:    # after the process group, so gloo's threads are bound too
        from parallel_layers.cpu_affinity import bind_rank_to_cores
        bind_rank_to_cores(rank, world_size)
    # What the server preloaded (torch, transformers, the package: ~340k objects) lives as long as the worker:
    # set aside from the collector, so a full collection (ours after a body that made groups, or Python's
    # own) walks only what the bodies made: 0.25-0.5 s -> microseconds a rank.
    gc.collect()
    gc.freeze()
    while True:
        task = tasks.get()
        if task is None:
            break
        call_id, module_name, module_file, qualname, args, kwargs = task
        groups_before = _process_groups()
        try:
            fn = _resolve(module_name, module_file, qualname)
            out = fn(rank, world_size, *args, **kwargs)
            # Pickled here (plain pickle copies tensor data) so an unpicklable result is reported as
            # this rank's failure instead of dying silently in the queue's feeder thread.
            payload = pickle.dumps(_detached(out))
            results.put((call_id, rank, True, payload))
        except BaseException:  # noqa: BLE001 - report everything, including assertion failures
            results.put((call_id, rank, False, traceback.format_exc()))
            continue            # the pool restarts after a failure; a peer may still be in a collective
        _release_groups_since(groups_before)
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo ranks kept alive across calls. Use as a context manager or call ``close()``.
    ``bind_cores``: each rank binds its threads to cores of its own where there are enough cores
    (:func:`parallel_layers.cpu_affinity.bind_rank_to_cores`). ``backend="nccl_rules"``: the ranks run
    over :mod:`.nccl_rules` (gloo with NCCL's rules enforced) instead of plain gloo."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0, env: dict | None = None,
                 bind_cores: bool = False, backend: str = "gloo"):
        if backend not in ("gloo", "nccl_rules"):
            raise ValueError(f"WorkerPool: backend {backend!r} is not 'gloo' or 'nccl_rules'")
        self.backend = backend
        self.world_size = world_size
        self.bind_cores = bind_cores
        self.pg_timeout_s = pg_timeout_s
        self.env = dict(env or {})
        self._procs: List = []
        self._calls = 0

    # ------------------------------------------------------------------ lifecycle
    def _start(self) -> None:
        # forked from a server that imported torch, the package and transformers once (15 s -> 1 s for 8 ranks
        # on two cores) unless a variable read at start-up differs (then spawned); the parent's environment now,
        # then the pool's own variables
        env = {**current_environment(), **self.env}
        ctx = start_context(env, PRELOAD)
        port = free_port()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._results = ctx.Queue()
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._tasks[r], self._results,
                                                         self.pg_timeout_s, env, self.bind_cores,
                                                         self.backend),
                                    daemon=True)
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ running bodies
    def run(self, fn: Callable, *args: Any, timeout: float = 180.0, **kwargs: Any) -> List[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return results in rank order."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._calls += 1
        call_id = self._calls
        module = sys.modules[fn.__module__]
        task = (call_id, fn.__module__, os.path.abspath(module.__file__), fn.__qualname__, args, kwargs)
        for q in self._tasks:
            q.put(task)
        results: dict = {}
        failures: dict = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        grace_set = False
        while len(results) + len(failures) < self.world_size:
            if failures and not grace_set:  # others may be stuck in a collective: a moment, then restart
                deadline = min(deadline, datetime.datetime.now() + datetime.timedelta(seconds=3))
                grace_set = True
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            if remaining <= 0 or not all(p.is_alive() for p in self._procs):
                break
            try:
                cid, rank, ok, out = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if cid != call_id:
                continue  # a late answer from an earlier, failed call
            (results if ok else failures)[rank] = out
        if failures or len(results) < self.world_size:
            missing = sorted(set(range(self.world_size)) - set(results) - set(failures))
            self.close()
            parts = [f"--- rank {r} raised:\n{tb}" for r, tb in sorted(failures.items())]
            if missing:
                parts.append(f"--- ranks {missing} did not answer within {timeout:.0f}s (timeout or crash; "
                             f"the pool was restarted)")
            raise RankFailure(f"{fn.__qualname__} failed on {self.world_size} ranks:\n" + "\n".join(parts))
        return [pickle.loads(results[r]) for r in range(self.world_size)]


_MESHES: dict = {}


def cached_mesh(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, **more: int):
    """Inside a worker: one ``ParallelMesh`` per shape (``ParallelMesh``'s sizes: any dimension of
    :data:`~parallel_layers.dimensions.DIMENSIONS`, missing ones 1), reused across test bodies (creating
    process groups is a collective and costs time on every call)."""
    from ..dimensions import check_sizes
    key = tuple(check_sizes(dict(dp=dp, tp=tp, pp=pp, cp=cp, **more), "cached_mesh").items())
    if key not in _MESHES:
        from ..mesh import ParallelMesh
        _MESHES[key] = ParallelMesh(**dict(key))
    return _MESHES[key]
