"""One gloo transport device per test worker, shared by every gloo process group the worker makes.

torch gives each gloo process group a transport device of its own, and each device keeps a loop thread that
wakes every 10 ms (gloo's ``epoll_wait`` timeout) for as long as the group lives. A long-lived test worker holds
the groups of every mesh shape its tests cached, 15-67 of them, and the two workers of ``make test`` each keep
pools of 2, 4 and 8 ranks over two backends: about 1,100 loop threads at once, measured spending 0.8 of one of the
two cores in the kernel, waking up to find nothing to do. Sharing one device per process is gloo's own design
(a device serves any number of contexts, each group's pairs registering with its loop); the collectives and
their results are unchanged, and a group is still destroyed as before.

Only the test pool's ranks (:mod:`.workers`) and the NCCL-rules backend (:mod:`.nccl_rules`) use this: a
training process holds a handful of groups.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class _Device:
    """The process's device, created at the first group (after the worker has set its environment)."""
    device = None

    @classmethod
    def get(cls):
        if cls.device is None:
            cls.device = dist.ProcessGroupGloo.create_default_device()
        return cls.device


def options(timeout: datetime.timedelta = _DEFAULT_TIMEOUT):
    """gloo options naming the shared device (two worker threads per group, torch's default)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [_Device.get()]
    opts._threads = 2
    return opts


def process_group(store, rank: int, size: int, timeout: datetime.timedelta = _DEFAULT_TIMEOUT):
    """A gloo process group (the backend object) on the shared device."""
    return dist.ProcessGroupGloo(store, rank, size, options(timeout))


class _SharedDeviceGloo(dist.ProcessGroupGloo):
    """What ``torch.distributed`` constructs for a gloo group once :func:`install` ran: the same class, built
    with the shared device instead of a new one."""

    def __init__(self, store, rank, size, timeout=_DEFAULT_TIMEOUT):
        super().__init__(store, rank, size, options(timeout))


def install() -> None:
    """From now on every gloo group this process creates through ``torch.distributed`` (``init_process_group``,
    ``new_group``) uses the shared device."""
    distributed_c10d.ProcessGroupGloo = _SharedDeviceGloo


__all__ = ["install", "options", "process_group"]
