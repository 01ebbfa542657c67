"""A daemon thread that runs callables in submission order, and the work a caller waits on.

Used where a sequence of c10d calls must leave the caller's thread but keep its order: the gloo ring
collectives (one worker per group, :mod:`.ring`) and the posting of the pipeline's receives on gloo
(:class:`parallel_layers.pipeline.p2p.P2P`). The thread spends its time in c10d calls and torch ops,
which release the GIL, so it runs beside the caller's compute.
"""
from __future__ import annotations

import queue
import threading
from typing import Callable, Optional


class BackgroundWork:
    """What :meth:`OrderedWorker.submit` returns: ``wait()`` blocks until the callable finished and
    re-raises its error (naming what it was), ``is_completed()`` polls."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (the group's timeout bounds every c10d call)
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"{self.what} failed: {self._error}") from self._error
        return True


class OrderedWorker:
    """One daemon thread running submitted callables in order. After a failure it is unusable (a peer
    is gone or out of step): later callables fail at once with the first error."""

    def __init__(self, name: str):
        self._queue: "queue.Queue" = queue.Queue()
        self._failed: Optional[BaseException] = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], None], what: str) -> BackgroundWork:
        work = BackgroundWork(what)
        self._queue.put((fn, work))
        return work

    def _loop(self) -> None:
        while True:
            fn, work = self._queue.get()
            if self._failed is not None:
                work._finish(self._failed)
                continue
            try:
                fn()
                work._finish()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                self._failed = exc
                work._finish(exc)
            # not held while the thread waits for the next: the callable's tensors belong to its caller
            fn = work = None


__all__ = ["BackgroundWork", "OrderedWorker"]
