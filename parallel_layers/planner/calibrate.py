"""``--calibrate``: measure this machine's figures for the time model and save them as a profile.

* matmul FLOP/s of one rank (one thread, as the package's CPU ranks run; square fp32 and bf16
  matmuls of the size given, median of a few), and how many ranks compute at once (the CPU cores this
  process may use: more ranks than that share them);
* memory bandwidth: a rank's copy of a buffer far larger than its caches (bytes read + written / s);
* every collective the package issues, over real process groups of ``world`` gloo ranks through the
  package's own helpers (:mod:`parallel_layers.distributed.collectives`), at two message sizes; alpha
  (per ring step) and beta (per byte) solved from the two, per kind.

One host: its links are "intra"; the inter-node link is set equal (nothing else to measure here).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Optional

import torch

from .hardware import RING_BYTES, RING_STEPS, Link, Profile

SMALL, LARGE = 1 << 14, 1 << 23          # bytes of the two message sizes each collective is timed at


def _median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mean_time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def matmul_flops(n: int = 512, dtype=torch.float32, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_time(lambda: a @ b, reps)


def memory_bandwidth(nbytes: int = 128 << 20, reps: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), reps)


def op_overhead(reps: int = 20, device: Optional[torch.device] = None) -> float:
    """Seconds per operator call of a training step's small ops, with everything around them (Python
    module calls, autograd's graph, hooks, a GPU's launches): a tiny block (LayerNorm, Linear, GELU, Linear)
    forward and backward on ``device`` (default the CPU), timed to the device's end, divided by the operator
    calls the planner's tally counts for it."""
    from .accounting import OpTally
    device = device or torch.device("cpu")
    block = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 16)).to(device)
    x = torch.randn(4, 16, device=device, requires_grad=True)

    def step():
        block(x).sum().backward()
    with OpTally() as tally:
        step()

    def steps():
        for _ in range(reps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return _median_time(steps, 5) / (reps * tally.ops)


def _collective_rank(rank: int, world: int, reps: int) -> Dict[str, List[float]]:
    """On every rank: the mean time of each collective kind at SMALL and LARGE bytes (the slowest rank's).

    The mean, not the median: a step pays every collective's time, the slow wake-ups included, and on a
    shared CPU those are frequent (on the 2-core CI machine a 16 KB all-reduce of 2 ranks takes 0.2 ms or
    3.7 ms: the median of a few reps landed on either, so the fitted latency varied 10x between runs)."""
    import torch.distributed as dist

    from ..distributed import collectives as C
    group = dist.group.WORLD
    out = {}
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "send"):
        times = []
        for nbytes in (SMALL, LARGE):
            n = nbytes // 4 // world * world
            full = torch.ones(n)
            part = torch.ones(n // world)

            def op(kind=kind, full=full, part=part):
                if kind == "all_reduce":
                    C.all_reduce(full, group)
                elif kind == "reduce_scatter":
                    C.reduce_scatter_dim0(full, group, out=part)
                elif kind == "all_gather":
                    C.all_gather_dim0(part, group, out=full)
                elif rank < 2:                   # one pair: rank 0 sends, rank 1 receives
                    (dist.send if rank == 0 else dist.recv)(full, 1 - rank)
                dist.barrier()
            t = torch.tensor([_mean_time(op, reps)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        out[kind] = times
    return out


def _solve(kind: str, n: int, t_small: float, t_large: float) -> Link:
    """alpha, beta from ``t = steps * alpha + factor * bytes * beta`` at the two sizes (the barrier each
    op ends with is charged to alpha, as a collective's synchronisation is)."""
    steps, factor = RING_STEPS[kind](n), RING_BYTES[kind](n)
    beta = max((t_large - t_small) / (factor * (LARGE - SMALL)), 1e-15)
    alpha = max((t_small - factor * SMALL * beta) / steps, 0.0)
    return Link(alpha=alpha, beta=beta)


def calibrate(world: int = 2, reps: int = 5, name: str = "this machine", collective_reps: int = 30) -> Profile:
    """Measure and return a profile (collectives over ``world`` gloo ranks started here; each timed over
    ``collective_reps`` calls, the compute figures as the median of ``reps``)."""
    from ..testing.workers import WorkerPool
    torch.set_num_threads(1)
    flops = {"fp32": matmul_flops(), "bf16": matmul_flops(dtype=torch.bfloat16)}
    bw = memory_bandwidth()
    overhead = op_overhead()
    with WorkerPool(world, pg_timeout_s=120) as pool:
        times = pool.run(_collective_rank, collective_reps, timeout=600)[0]
    links = {kind: _solve(kind, world, *ts) for kind, ts in times.items()}
    links["*"] = links["all_reduce"]
    links["all_to_all"] = links["all_gather"]
    try:
        slots = len(os.sched_getaffinity(0))
    except AttributeError:
        slots = os.cpu_count() or 1
    return Profile(name=name, flops=flops, peak_flops=dict(flops), mem_bw=bw, intra=links,
                   inter={k: Link(v.alpha, v.beta) for k, v in links.items()}, compute_slots=slots,
                   fragmentation=0.0, op_overhead=overhead, measured=True, sends_held=True,
                   notes=f"calibrated: one-thread matmul and copy, collectives over {world} gloo ranks; "
                         f"{slots} cores shared by the ranks")


__all__ = ["calibrate", "matmul_flops", "memory_bandwidth"]
