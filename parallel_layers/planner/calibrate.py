"""``--calibrate``: measure this machine's figures for the time model and save them as a profile.

* matmul FLOP/s of one rank (one thread, as the package's CPU ranks run; square fp32 and bf16
  matmuls of the size given, median of a few: the peak), and how many ranks compute at once (the CPU cores
  this process may use: more ranks than that share them);
* the fp32 matmul rate by shape over a small model's projection shapes (``calibrate_gpu.gemm_shapes("cpu")``:
  one thread runs a 64 x 192 x 64 GEMM at a tenth of the 512-cube's rate), fitted as the GPU profiles' curve
  (``hardware.fit_gemm_curve``), and causal attention's rate (SDPA forward + backward at small heads, the
  same FLOP formula the probe's tally uses) as ``attention_efficiency``;
* memory bandwidth: a rank's copy of a buffer far larger than its caches (bytes read + written / s);
* the same rates inside real training steps, by operator kind (:mod:`.calibrate_steps`): the GEMM curve
  scaled to the steps' GEMM time, attention's efficiency from the steps' kernels, and the time a small op
  and a byte of its traffic cost, fitted on what the GEMMs and attention leave of each step;
* every collective the package issues, over real process groups of ``world`` gloo ranks through the
  package's own helpers (:mod:`parallel_layers.distributed.collectives`), at two message sizes, each call
  timed alone after some compute; alpha (per ring step) and beta (per byte) solved from the two, per kind;
* a pipeline message's latency and how much longer collectives take on ranks that share cores
  (``Profile.shared_wait_exponent``), each fitted on a real step of a reference layout (:mod:`.calibrate_steps`);
* how much slower a rank computes while every core computes (``Profile.core_contention``).

One host: its links are "intra"; the inter-node link is set equal (nothing else to measure here).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, List, Optional

import torch

from .calibrate_steps import (
    GPT_SIZES,
    apply_step_rates,
    fit_send_latency,
    fit_wait_exponent,
    reference_config,
    step_rates,
)
from .hardware import RING_BYTES, RING_STEPS, Link, Profile

SMALL, LARGE = 1 << 14, 1 << 23          # bytes of the two message sizes each collective is timed at
# the most gloo ranks the shared-core fit starts (4 a core); a host with more cores keeps the exponent 1.0
MAX_WAIT_RANKS = 16


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


def _reference_step(n_layer: int, d: int, b: int, s: int):
    """The reference GPT's forward + backward at this size, as a function (run once: warm)."""
    torch.manual_seed(0)
    model = reference_config(n_layer, d, s).build(seed=0)
    x = torch.randint(0, 256, (b, s))

    def step():
        model(x, x)[1].backward()
    step()
    return step


def _contention_rank(rank: int, world: int, reps: int) -> float:
    """On every rank at once: the median time of a reference step (one thread), the slowest rank's."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    step = _reference_step(*GPT_SIZES[2])
    dist.barrier()
    t = torch.tensor([_median_time(step, reps)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def core_contention(slots: int, reps: int = 30) -> float:
    """How much slower a rank computes while every core runs one (``slots`` ranks at once) than alone: the
    cores of a virtual machine can be one physical core's hyperthreads, and they share caches and memory
    bandwidth. 1.0 where nothing is shared."""
    from ..testing.workers import WorkerPool
    times = {}
    for world in (1, slots):
        with WorkerPool(world, pg_timeout_s=120) as pool:
            times[world] = pool.run(_contention_rank, reps, timeout=600)[0]
    return max(times[slots] / times[1], 1.0)


def _collective_rank(rank: int, world: int, reps: int) -> Dict[str, List[float]]:
    """On every rank: the mean time of each collective kind at SMALL and LARGE bytes (the slowest rank's),
    each call timed alone after about a millisecond of matmuls, as a training step calls them: between
    pieces of compute, not back to back (a rank that has computed meanwhile wakes gloo's threads from sleep
    and meets its peers a little apart; back to back, a 2-rank all-reduce took half the time).

    The mean, not the median: a step pays every collective's time, the slow wake-ups included, and on a
    shared CPU those are frequent (on the 2-core CI machine a 16 KB all-reduce of 2 ranks takes 0.2 ms or
    3.7 ms: the median of a few reps landed on either, so the fitted latency varied 10x between runs)."""
    import torch.distributed as dist

    from ..distributed import collectives as C
    group = dist.group.WORLD
    filler = torch.randn(256, 256)
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
            op()
            dist.barrier()
            spent = 0.0
            for _ in range(reps):
                for _ in range(5):
                    filler @ filler
                t0 = time.perf_counter()
                op()
                spent += time.perf_counter() - t0
            dist.barrier()
            t = torch.tensor([spent / reps], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(t.item())
        out[kind] = times
    return out


def _links(world: int, reps: int) -> Dict[str, Link]:
    """alpha-beta links per collective kind measured over ``world`` gloo ranks started here."""
    from ..testing.workers import WorkerPool
    with WorkerPool(world, pg_timeout_s=120) as pool:
        times = pool.run(_collective_rank, reps, timeout=600)[0]
    links = {kind: _solve(kind, world, *ts) for kind, ts in times.items()}
    links["*"] = links["all_reduce"]
    links["all_to_all"] = links["all_gather"]
    return links


def _solve(kind: str, n: int, t_small: float, t_large: float) -> Link:
    """alpha, beta from ``t = steps * alpha + factor * bytes * beta`` at the two sizes (the wait for the
    peers is charged to alpha, as a collective's synchronisation is)."""
    steps, factor = RING_STEPS[kind](n), RING_BYTES[kind](n)
    beta = max((t_large - t_small) / (factor * (LARGE - SMALL)), 1e-15)
    alpha = max((t_small - factor * SMALL * beta) / steps, 0.0)
    return Link(alpha=alpha, beta=beta)


def calibrate(world: int = 2, reps: int = 5, name: str = "this machine", collective_reps: int = 100) -> Profile:
    """Measure and return a profile (collectives over ``world`` gloo ranks started here; each timed over
    ``collective_reps`` calls, the compute figures as the median of ``reps``)."""
    from .calibrate_gpu import measure_rates
    from .hardware import fit_gemm_curve
    torch.set_num_threads(1)
    flops = {"fp32": matmul_flops(), "bf16": matmul_flops(dtype=torch.bfloat16)}
    rates = measure_rates(torch.device("cpu"), "cpu", reps=reps)
    peak = max([flops["fp32"]] + [r for *_, r in rates["gemm"]["fp32"]])
    curve = {"fp32": fit_gemm_curve([(m, n, k, r / peak) for m, n, k, r in rates["gemm"]["fp32"]])}
    attention = statistics.median(rates["attention"]) / peak
    copy_bw = memory_bandwidth()
    try:
        slots = len(os.sched_getaffinity(0))
    except AttributeError:
        slots = os.cpu_count() or 1
    links = _links(world, collective_reps)
    prof = Profile(name=name, flops=flops, peak_flops=dict(flops, fp32=peak), mem_bw=copy_bw, intra=links,
                   inter={k: Link(v.alpha, v.beta) for k, v in links.items()}, compute_slots=slots,
                   fragmentation=0.0, measured=True, sends_held=True,
                   gemm_curve=curve, attention_efficiency=attention)
    rates = step_rates(prof, reps)
    apply_step_rates(prof, rates)
    prof.core_contention = core_contention(slots) if slots > 1 else 1.0
    looped, send = prof.intra["send"].alpha, fit_send_latency(prof, reps)
    for table in (prof.intra, prof.inter):
        table["pipeline_send"] = Link(alpha=send, beta=table["send"].beta)
    if 4 * slots <= MAX_WAIT_RANKS:
        # four times as many ranks as cores, in a real step: how much longer a rank's collectives take
        prof.shared_wait_exponent = fit_wait_exponent(prof, reps)
    exponent = prof.shared_wait_exponent
    prof.notes = (f"calibrated: one-thread matmul (by shape for fp32; {rates['gemm_scale']:.2f}x the time alone inside "
                  f"training steps), causal attention {prof.attention_efficiency:.0%} of the matmul peak (in steps; "
                  f"{attention:.0%} alone), a training step's small ops {prof.op_overhead * 1e6:.1f} us a call and "
                  f"{prof.mem_bw / 1e9:.1f} GB/s of their traffic (copy {copy_bw / 1e9:.1f} GB/s), collectives over "
                  f"{world} gloo ranks (a message's latency {send * 1e6:.0f} us in a pipeline step, "
                  f"{looped * 1e6:.0f} us in a loop); {slots} cores shared by the ranks (each "
                  f"{prof.core_contention:.2f}x slower while all compute; collectives stretched by the "
                  f"oversubscription to the power {exponent:.2f})")
    return prof


__all__ = ["calibrate", "matmul_flops", "memory_bandwidth", "step_rates", "op_overhead"]
