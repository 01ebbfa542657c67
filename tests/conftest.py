"""Shared test set-up.

TRITON_INTERPRET must be set before triton_kernels is imported (triton reads it when @triton.jit
runs), so it is set here, at collection time, before any test module imports the package: on a machine
without a GPU the Triton kernels run through the interpreter on CPU tensors; with a GPU they are
compiled and run on CUDA tensors (set TRITON_INTERPRET=1 there to test the interpreter instead).

On a GPU machine a CUDA backend that is not there (an extension built without its CUDA part, Triton
missing) fails the CUDA tests instead of skipping them: the point of running there is to run them.
"""
import os

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from parallel_layers.ops import _backend  # noqa: E402

# (device, backend) pairs that are compared against the torch reference.
KERNEL_TARGETS = [("cpu", "cpp"), ("cpu", "triton"), ("cuda", "triton"), ("cuda", "cuda")]


def target_skip_reason(device: str, backend: str):
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    if device == "cpu" and backend == "triton" and not _backend.triton_interpreting():
        return "TRITON_INTERPRET is not set: Triton cannot run on CPU tensors"
    if device == "cuda" and backend == "triton" and _backend.triton_interpreting():
        return "TRITON_INTERPRET=1 runs the interpreter, not the GPU kernels"
    impl, why = _backend._availability(backend, torch.device(device))
    return None if impl is not None else why


@pytest.fixture(params=KERNEL_TARGETS, ids=[f"{d}-{b}" for d, b in KERNEL_TARGETS])
def target(request):
    """A (device, backend) pair to test against the torch reference; skipped when unavailable."""
    device, backend = request.param
    why = target_skip_reason(device, backend)
    if why and device == "cuda" and torch.cuda.is_available() and not _backend.triton_interpreting():
        pytest.fail(f"{backend} on {device} is unavailable on a machine with a GPU: {why}")
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device), backend


def is_interpreted(target) -> bool:
    """Triton under the interpreter is slow: tests use smaller sizes for it."""
    return target[1] == "triton" and target[0].type == "cpu"


@pytest.fixture(scope="session")
def dist_pools():
    """``dist_pools(n)``: a pool of n gloo ranks, started once per session and shared by every test;
    ``dist_pools(n, "nccl_rules")``: the same over the NCCL-rules backend
    (:mod:`parallel_layers.testing.nccl_rules`)."""
    from parallel_layers.testing import WorkerPool

    pools = {}

    default = os.environ.get("PL_TEST_BACKEND", "gloo")   # PL_TEST_BACKEND=nccl_rules: every pool under the rules

    def get(world_size: int, backend: str = None) -> WorkerPool:
        backend = backend or default
        if (world_size, backend) not in pools:
            pools[(world_size, backend)] = WorkerPool(world_size, backend=backend)
        return pools[(world_size, backend)]

    yield get
    for pool in pools.values():
        pool.close()
