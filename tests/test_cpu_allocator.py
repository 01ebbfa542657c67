"""retain_freed_memory: freed activation-sized blocks are reused instead of faulted back in.

Each case runs in a fresh interpreter: malloc settings belong to the whole process, and the pytest
process must keep glibc's defaults for the other tests."""
import os
import subprocess
import sys

import pytest

from parallel_layers import cpu_allocator

# A microbatch-like pattern: 24 blocks of 2 MiB alive at once, all freed, 8 times over; the faults of
# the last 6 rounds are counted (the first rounds grow the heap either way). Both processes start with
# MALLOC_MMAP_THRESHOLD_=65536 (what the memory benchmarks use: every such block is mapped on allocation
# and unmapped on free, so each round faults all its pages back in). glibc's defaults fall somewhere
# in between, run to run (their thresholds adapt), so they are no reliable control.
PROBE = r"""
import resource, sys, torch
from parallel_layers.cpu_allocator import retain_freed_memory
ok = retain_freed_memory() if sys.argv[1] == "retain" else None
faults = []
for i in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(1 << 19) for _ in range(24)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(ok, sum(faults[2:]))
"""


def _probe(mode: str):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    ok, faults = out.stdout.split()
    return ok, int(faults)


@pytest.mark.skipif(cpu_allocator._glibc() is None, reason="the C library is not glibc")
def test_retained_memory_is_reused_without_page_faults():
    _, returned_faults = _probe("return")
    ok, retained_faults = _probe("retain")
    assert ok == "True"
    pages = 6 * 48 * 2**20 // os.sysconf("SC_PAGE_SIZE")     # what refaulting every round costs
    assert returned_faults > pages // 2, (returned_faults, pages)    # memory handed back: it faults ...
    assert retained_faults < pages // 50, (retained_faults, pages)   # ... kept (the call overrides the env): not


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="retain_freed_memory: trim_threshold_mb=-1"):
        cpu_allocator.retain_freed_memory(trim_threshold_mb=-1)


def test_env_matches_the_runtime_settings():
    assert int(cpu_allocator.RETAIN_ENV["MALLOC_MMAP_THRESHOLD_"]) == cpu_allocator.MAX_MMAP_THRESHOLD
    assert int(cpu_allocator.RETAIN_ENV["MALLOC_TRIM_THRESHOLD_"]) == 1024 << 20
    assert int(cpu_allocator.RETAIN_ENV["MALLOC_TOP_PAD_"]) == 64 << 20


def rank_malloc_env(rank, world):
    return {k: os.environ.get(k) for k in cpu_allocator.RETAIN_ENV}


def test_benchmark_ranks_start_with_the_retain_settings():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from benchmarks import harness
    before = {k: os.environ.get(k) for k in cpu_allocator.RETAIN_ENV}
    assert harness.run_ranks(rank_malloc_env, 2, retain_memory=True, timeout_s=120) == [cpu_allocator.RETAIN_ENV] * 2
    assert {k: os.environ.get(k) for k in cpu_allocator.RETAIN_ENV} == before   # later benchmarks do not inherit it
