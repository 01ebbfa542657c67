"""Scaling curves: how step time and per-rank memory grow with the world size and the model size, and how
kernel time grows with the element count.

    python -m benchmarks.scaling            # full sizes (several minutes on 2 cores)
    python -m benchmarks.scaling --quick    # small sizes (~50 s on 2 cores)
    python -m benchmarks.scaling --smoke --no-csv
    python -m benchmarks.scaling_plots      # the PNGs, from benchmarks/results/scaling.csv

1. World size (``scale_world_zero{0,1,2,3}``, x = world size 1, 2, 4, 8): the same GPT at a fixed per-rank
   batch, trained by every ZeRO stage of ours, one full step per call (zero_grad, forward, backward,
   optimizer step): stage 0 = ``DataParallel(reduce_op="all_reduce")`` + ``FusedAdamW``; stages 1 and 2 =
   ``DataParallel(reduce_op="reduce_scatter")`` + ``ZeroOptimizer(stage=1|2)``; stage 3 = ``ZeroStage3`` +
   ``ZeroStage3Optimizer``. The stage-0 row's baseline is torch ``DistributedDataParallel`` +
   ``torch.optim.AdamW(fused=True)`` (same bucket size, same data, interleaved with ours).
2. Model size (``scale_model_zero{0,1,2,3}``, x = parameter count): three GPT widths at world size 2.
3. Element count (``scale_elems_{adamw,cast,copy}``, x = n from 1e4 to 1e8, in this process on the
   device): our flat AdamW kernel vs ``torch.optim.AdamW(fused=True)`` on one tensor of n fp32 elements,
   our fp32->bf16 ``multi_tensor_cast`` vs torch's ``dst.copy_(src)`` (a ``.to(bfloat16)`` into a preallocated
   tensor, as ours writes), and ``dst.copy_(src)`` itself (fp32): where the time stops being launch overhead
   and becomes bytes / bandwidth. GB/s counts the bytes a kernel must move (AdamW 28, cast 6, copy 8 per
   element); ``bw_fraction`` divides by the copy bandwidth of a large buffer measured in the same run, so
   small n whose data stays in cache can exceed 1. Reps adapt to n (a time budget per point, within bounds).

How the multi-process parts run: ONE spawn of ``max(worlds)`` gloo processes (1 thread each); world size
``w`` is the sub-group of ranks ``0..w-1`` while the other ranks wait at a barrier (blocked, no CPU), so
Python/torch start-up is paid once, not once per world size. Inside a sub-group, every variant of one
model is built, then all are timed rep by rep in rotating order; a barrier precedes each step and a step's
time is the slowest rank's (all-reduce MAX outside the timed region); median and p20/p80 after warm-up.
On this 2-core machine 4 and 8 processes oversubscribe the cores (``w / cores`` processes per core): those
points measure the overheads under CPU contention, not a parallel speed-up; every row says so.

Memory: ``mem_mb`` is the bytes a rank holds between steps for parameters, gradients and optimizer state
(``memory_report()`` of the ZeRO optimizers; stage 0: the storages of DataParallel's flat buffers and
FusedAdamW's flat buffers, measured the same way), max over ranks, in MiB (2**20 bytes). It is what the
1/N sharding divides. The row's ``baseline`` text gives its split and the step's peak RSS growth
(VmHWM after one step - VmRSS before it; before it, ``malloc_trim(0)`` hands the allocator's free pages
back to the OS, so re-using them during the step counts again): the transient memory of a step
(activations, gathered parameters, stage 2's re-allocated gradient buffer). The allocator is left at its
defaults, so the timed steps are not slowed by it.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time
from collections import OrderedDict
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "scaling.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 50

STAGES = (0, 1, 2, 3)
BUCKET_MB = 25.0
LR, WD = 1e-3, 0.01      # a visible training step, so the loss agreement check below means something
MODEL_WORLD = 2          # the world size of the model-size curve

# Per mode: world sizes; the GPT widths of the model-size curve (the middle one is the world-size curve's
# model); the shared GPT shape; per-rank batch; timed reps and warm-up steps; whether to time torch DDP.
PLANS = {
    "full": dict(worlds=(1, 2, 4, 8), widths=((128, 4), (256, 4), (512, 8)), world_model=1,
                 shape=dict(vocab_size=8192, n_layer=4, max_seq_len=64), batch=2, reps=7, warmup=2,
                 peak_reps=3, ddp=True),
    "quick": dict(worlds=(1, 2, 4, 8), widths=((32, 2), (64, 2), (128, 4)), world_model=1,
                  shape=dict(vocab_size=512, n_layer=2, max_seq_len=32), batch=2, reps=4, warmup=1,
                  peak_reps=1, ddp=True),
    "smoke": dict(worlds=(1, 2), widths=((16, 2), (32, 2), (64, 2)), world_model=1,
                  shape=dict(vocab_size=128, n_layer=1, max_seq_len=16), batch=2, reps=3, warmup=1,
                  peak_reps=1, ddp=True),
}
# Element-count curve: n values; seconds of timed calls per (n, case) (reps adapt to it, within bounds);
# warm-up calls; bytes of the reference copy bandwidth measurement.
ELEMS = {
    "full": dict(ns=[int(round(10 ** (e / 2))) for e in range(8, 17)], budget_s=1.0, reps=(7, 400), warmup=2,
                 copy_bytes=256 << 20),
    "quick": dict(ns=[10 ** e for e in range(4, 9)], budget_s=0.25, reps=(3, 200), warmup=1,
                  copy_bytes=128 << 20),
    "smoke": dict(ns=[10 ** e for e in range(3, 6)], budget_s=0.05, reps=(3, 50), warmup=1,
                  copy_bytes=4 << 20),
}


# ================================================================================= multi-process part
def _model_kwargs(plan: dict, i: int) -> dict:
    d, h = plan["widths"][i]
    return dict(plan["shape"], d_model=d, n_head=h)


def _dims(kw: dict, batch: int) -> str:
    return (f"V{kw['vocab_size']}xL{kw['n_layer']}xd{kw['d_model']}xs{kw['max_seq_len']}"
            f"xb{batch}/rank")


class _Variant:
    """One way to train the model: ``step()`` is a full training step; ``memory()`` the bytes it holds."""

    def __init__(self, step: Callable[[], torch.Tensor], memory: Callable[[], Dict[str, int]]):
        self._step, self.memory, self.losses = step, memory, []

    def step(self) -> None:
        self.losses.append(self._step())


def _build_variants(kw: dict, group, x: torch.Tensor, y: torch.Tensor, with_ddp: bool) -> "OrderedDict[str, _Variant]":
    from torch.nn.parallel import DistributedDataParallel

    from parallel_layers.data_parallel import DataParallel
    from parallel_layers.models import GPT, GPTConfig
    from parallel_layers.optim import FusedAdamW
    from parallel_layers.zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer
    from parallel_layers.zero.memory import storage_bytes

    def gpt():
        torch.manual_seed(0)
        return GPT(GPTConfig(**kw, dropout=0.0, bias=False))

    def stepper(model, opt):
        def step():
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    out: "OrderedDict[str, _Variant]" = OrderedDict()

    # stage 0: our DataParallel (all-reduce) + FusedAdamW, built as a user would. DataParallel re-lays its
    # buckets out (moving p.data) after the first backward; FusedAdamW takes the parameters back into its
    # flat buffer at its next step, so both keep parameter and gradient storage (counted below).
    dp0 = DataParallel(gpt(), group, reduce_op="all_reduce", bucket_cap_mb=BUCKET_MB)
    opt0 = FusedAdamW(dp0.parameters(), lr=LR, weight_decay=WD)

    def mem0():
        flats = [fb for group_flats in opt0.flat_buffers for fb in group_flats]
        return dict(params=storage_bytes([dp0.buffer.param_buffer] + [t for fb in flats for t in (fb.master, fb.low)]),
                    grads=storage_bytes([dp0.buffer.grad_buffer] + [fb.grad for fb in flats]),
                    optimizer=storage_bytes([t for fb in flats for t in list(fb.states.values()) + [fb.steps]]),
                    other=0)
    out["zero0"] = _Variant(stepper(dp0, opt0), mem0)

    for stage in (1, 2):
        dp = DataParallel(gpt(), group, reduce_op="reduce_scatter", bucket_cap_mb=BUCKET_MB)
        opt = ZeroOptimizer(dp, stage=stage, lr=LR, weight_decay=WD)

        def mem(opt=opt):
            r = opt.memory_report()
            return dict(params=r["param_bytes"], grads=r["grad_bytes"], optimizer=r["optimizer_bytes"],
                        other=r["comm_bytes"] + r["staging_bytes"])
        out[f"zero{stage}"] = _Variant(stepper(dp, opt), mem)

    z = ZeroStage3(gpt(), group)
    opt3 = ZeroStage3Optimizer(z, lr=LR, weight_decay=WD)

    def mem3():
        r = opt3.memory_report()
        return dict(params=r["param_bytes"], grads=r["grad_bytes"], optimizer=r["optimizer_bytes"],
                    other=r["gathered_bytes"])
    out["zero3"] = _Variant(stepper(z, opt3), mem3)

    if with_ddp:
        ddp = DistributedDataParallel(gpt(), process_group=group, bucket_cap_mb=BUCKET_MB)
        topt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=WD, fused=True)

        def mem_ddp():   # the reducer's own bucket buffers are not visible from Python: not counted
            ps = list(ddp.parameters())
            return dict(params=storage_bytes(ps), grads=storage_bytes([p.grad for p in ps]),
                        optimizer=storage_bytes([t for s in topt.state.values() for t in s.values()
                                                 if isinstance(t, torch.Tensor)]), other=0)
        out["ddp"] = _Variant(stepper(ddp, topt), mem_ddp)
    return out


def _max_over(group, values: List[float]) -> List[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _measure_model(rank: int, group, kw: dict, plan: dict) -> dict:
    """Every variant of one model on this sub-group: slowest-rank step times, memory, peak RSS, losses."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, kw["vocab_size"], (plan["batch"], kw["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)
    variants = _build_variants(kw, group, x, y, plan["ddp"])
    names = list(variants)
    times: Dict[str, List[float]] = {n: [] for n in names}
    for i in range(plan["warmup"] + plan["reps"]):
        k = i % len(names)   # rotate who goes first: each variant takes every position in turn
        for n in names[k:] + names[:k]:
            dist.barrier(group=group)
            t0 = time.perf_counter()
            variants[n].step()
            dt = time.perf_counter() - t0
            slowest = _max_over(group, [dt])[0]
            if i >= plan["warmup"]:
                times[n].append(slowest * 1e3)
    # the step's transient memory: peak RSS during one step over the RSS before it
    trim = _malloc_trim()
    peak: Dict[str, Optional[float]] = {}
    for n in names:
        samples = []
        for _ in range(plan["peak_reps"]):
            gc.collect()
            dist.barrier(group=group)
            if trim is None:
                break
            trim(0)
            before = harness.status_mb("VmRSS")
            if not harness.reset_peak_rss():
                samples = []
                break
            variants[n].step()
            samples.append(harness.status_mb("VmHWM") - before)
        # every rank joins the reduction (-1: this rank could not measure), so none is left waiting
        worst = _max_over(group, [statistics.median(samples) if samples else -1.0])[0]
        peak[n] = worst if worst >= 0 else None
    mem = {}
    for n in names:   # after a step, before the next zero_grad: gradients exist for every stage
        m = variants[n].memory()
        keys = ("params", "grads", "optimizer", "other")
        mem[n] = dict(zip(keys, _max_over(group, [float(m[k]) for k in keys])))
        mem[n]["total"] = sum(mem[n][k] for k in keys)
    ref = "ddp" if "ddp" in variants else "zero0"
    losses = {n: torch.stack(v.losses).double() for n, v in variants.items()}
    loss_diff = {n: float((losses[n] - losses[ref]).abs().max()) for n in names}
    loss_drop = float(losses[ref][0] - losses[ref][-1])
    n_params = _count_params(kw)
    del variants
    gc.collect()
    return dict(kw=kw, n_params=n_params, times=times, peak=peak, mem=mem, loss_diff=loss_diff,
                loss_drop=loss_drop, ref=ref, steps=len(losses[ref]))


def _malloc_trim():
    """glibc's ``malloc_trim`` (free heap pages back to the OS), or None where there is none."""
    try:
        import ctypes

        fn = ctypes.CDLL("libc.so.6").malloc_trim
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        return fn
    except (OSError, AttributeError):
        return None


def _count_params(kw: dict) -> int:
    from parallel_layers.models import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(**kw, dropout=0.0, bias=False))
    return sum(p.numel() for p in model.parameters())


def _ranks_main(rank: int, world: int, plan: dict) -> Optional[dict]:
    """Body of every spawned rank: the world sizes one after the other, as sub-groups of ranks 0..w-1."""
    import torch.distributed as dist

    groups = {w: dist.new_group(list(range(w))) for w in plan["worlds"]}   # collective: every rank, same order
    idle = dist.new_group(timeout=datetime.timedelta(hours=2))             # waiting ranks block here
    results: Dict[int, List[dict]] = {}
    for w in plan["worlds"]:
        t0 = time.perf_counter()
        if rank < w:
            models = range(len(plan["widths"])) if w == MODEL_WORLD else [plan["world_model"]]
            results[w] = [dict(_measure_model(rank, groups[w], _model_kwargs(plan, i), plan), index=i,
                               seconds=time.perf_counter() - t0) for i in models]
        dist.barrier(group=idle)
    return results if rank == 0 else None


def _mem_text(m: dict) -> str:
    mib = 2.0 ** 20
    return (f"params {m['params'] / mib:.4g} + grads {m['grads'] / mib:.4g} + optimizer {m['optimizer'] / mib:.4g}"
            f" + other {m['other'] / mib:.4g} MiB")


def _distributed_rows(mode: str, plan: dict, res: Dict[int, List[dict]]) -> List[dict]:
    cpu = torch.device("cpu")
    common = harness.common_fields(mode, cpu, 1)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    procs = max(plan["worlds"])
    rows = []
    what = {0: "DataParallel(all_reduce) + FusedAdamW (each keeps its own flat param and grad buffers, "
               "p.data living in FusedAdamW's: both counted)",
            1: "DataParallel(reduce_scatter) + ZeroOptimizer(stage=1)",
            2: "DataParallel(reduce_scatter) + ZeroOptimizer(stage=2)", 3: "ZeroStage3 + ZeroStage3Optimizer"}

    def one(case: str, w: int, m: dict, x: float) -> List[dict]:
        out = []
        dims = f"{_dims(m['kw'], plan['batch'])} ({m['n_params'] / 1e6:.3g}M params)"
        oversub = (f"{w} processes on {cores} cores: oversubscribed {w / cores:g}x, CPU contention, not parallel "
                   f"speed-up; " if w > cores else f"{w} process(es) on {cores} cores; ")
        where = (f"ranks 0..{w - 1} of {procs} spawned gloo processes x 1 thread (the rest idle at a barrier); "
                 f"slowest rank's full step (zero_grad, fwd, bwd, optimizer step); "
                 f"rank 0's loss fell {m['loss_drop']:.3g} over {m['steps']} steps")
        for s in STAGES:
            name = f"zero{s}"
            peak = m["peak"][name]
            mem = (f"mem_mb = per-rank bytes between steps (max over ranks): {_mem_text(m['mem'][name])}; "
                   f"step peak RSS growth {'n/a' if peak is None else f'{peak:.1f} MB'}; "
                   f"max |loss - {m['ref']} loss| {m['loss_diff'][name]:.1e}")
            extra = dict(sizes=dims, dtype="float32", backend=f"gloo x{w}", x=x,
                         mem_mb=m["mem"][name]["total"] / 2 ** 20, target="-", met="-")
            if s == 0 and "ddp" in m["times"]:
                d = m["mem"]["ddp"]
                row = harness.comparison_row(common, f"{case}{s}", m["times"][name], m["times"]["ddp"], **extra)
                row["baseline"] = (f"torch DDP + torch.optim.AdamW(fused=True) (params+grads+AdamW state "
                                   f"{d['total'] / 2 ** 20:.4g} MiB, reducer buckets not counted); ours {what[s]}; "
                                   f"{mem}; {oversub}{where}")
            else:
                st = harness.Stats.of(m["times"][name])
                row = dict(common, case=f"{case}{s}", ours_median_ms=st.median_ms, ours_p20_ms=st.p20_ms,
                           ours_p80_ms=st.p80_ms, **extra,
                           baseline=f"none (a curve); ours {what[s]}; {mem}; {oversub}{where}")
            out.append(row)
        return out

    for w in plan["worlds"]:
        m = next(r for r in res[w] if r["index"] == plan["world_model"])
        rows += one("scale_world_zero", w, m, float(w))
    for m in res.get(MODEL_WORLD, []):
        rows += one("scale_model_zero", MODEL_WORLD, m, float(m["n_params"]))
    return rows


def collect_distributed(mode: str, progress=None) -> List[dict]:
    plan = PLANS[mode]
    if progress:
        progress(f"world sizes {','.join(map(str, plan['worlds']))} ({max(plan['worlds'])} processes)")
    res = harness.run_ranks(_ranks_main, max(plan["worlds"]), (plan,), timeout_s=1800)[0]
    for w in plan["worlds"]:
        for m in res[w]:
            t = " ".join(f"{n} {statistics.median(v):.1f}" for n, v in m["times"].items())
            print(f"scaling: w{w} d{m['kw']['d_model']} median step ms: {t} ({m['seconds']:.1f} s)", file=sys.stderr)
    return _distributed_rows(mode, plan, res)


# ================================================================================= element-count part
def _filled(n: int, device: torch.device, seed: int, scale: float = 1.0) -> torch.Tensor:
    """n fp32 values: a seeded random block of up to 2**20 repeated (cheap to make for n = 1e8)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    block = torch.randn(min(n, 1 << 20), device=device, generator=gen) * scale
    out = torch.empty(n, device=device)
    for i in range(0, n, block.numel()):
        k = min(block.numel(), n - i)
        out[i:i + k].copy_(block[:k])
    return out


def _reps(ours, base, device: torch.device, prof: dict) -> int:
    for _ in range(prof["warmup"]):
        ours()
        if base is not None:
            base()
    once = harness.time_call(ours, device) + (harness.time_call(base, device) if base is not None else 0.0)
    lo, hi = prof["reps"]
    return max(lo, min(hi, int(prof["budget_s"] * 1e3 / max(once, 1e-3))))


def _torch_adamw(params, device: torch.device):
    """torch's fastest AdamW for the device: fused where torch has a fused kernel, else foreach."""
    if device.type in ("cpu", "cuda", "xpu", "mps"):
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True), "torch.optim.AdamW(fused=True)"
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True), "torch.optim.AdamW(foreach=True)"


def _elems_case(kind: str, n: int, device: torch.device, prof: dict):
    """(ours stats, baseline stats or None, bytes per call, dtype, backend, baseline text) for one n."""
    from parallel_layers import ops

    if kind == "adamw":
        p, g = _filled(n, device, 0), _filled(n, device, 1, 1e-2)
        m, v = torch.zeros_like(p), torch.zeros_like(p)
        tp = torch.nn.Parameter(p.clone())
        tp.grad = g                       # read only: shared by both sides
        opt, desc = _torch_adamw([tp], device)
        step = torch.zeros(1, device=device)

        def ours():
            step.add_(1)
            ops.adamw_step(p, g, m, v, lr=LR, step=step, weight_decay=WD)
        base, nbytes, dtype = opt.step, 28 * n, "fp32"   # read p, g, m, v + write p, m, v
        backend = ops.resolve_backend("adamw_step", device, None)
    elif kind == "cast":
        src = _filled(n, device, 0)
        d_ours = torch.empty(n, dtype=torch.bfloat16, device=device)
        d_base = torch.empty_like(d_ours)
        one, found = torch.ones(1, device=device), torch.zeros(1, device=device)

        def ours():
            ops.multi_tensor_cast([src], [d_ours], scale=one, found_inf=found)

        def base():
            d_base.copy_(src)
        nbytes, dtype, desc = 6 * n, "fp32->bf16", "torch dst.copy_(src) (.to(bfloat16) into a preallocated tensor)"
        backend = ops.resolve_backend("multi_tensor_cast", device, None)
    else:
        src = _filled(n, device, 0)
        dst = torch.empty_like(src)

        def ours():
            dst.copy_(src)
        base, nbytes, dtype, desc, backend = None, 8 * n, "fp32", "none: the copy is the roofline", "torch"
    reps = _reps(ours, base, device, prof)
    if base is None:
        t_ours, t_base = harness.Stats.of([harness.time_call(ours, device) for _ in range(reps)]), None
    else:
        t_ours, t_base = harness.compare(ours, base, device, reps, 0)
    harness.free_memory(device)
    return t_ours, t_base, nbytes, dtype, backend, desc, reps


def collect_elements(mode: str, device: torch.device, progress=None) -> List[dict]:
    prof = ELEMS[mode]
    if progress:
        progress("copy bandwidth")
    copy_gbps = harness.copy_bandwidth(device, prof["copy_bytes"])
    inplace_gbps = harness.copy_bandwidth(device, prof["copy_bytes"], inplace=True)
    common = harness.common_fields(mode, device, torch.get_num_threads())
    raw = []
    for n in prof["ns"]:
        for kind in ("adamw", "cast", "copy"):
            if progress:
                progress(f"{kind} n={n:.0e}")
            raw.append((kind, n) + _elems_case(kind, n, device, prof))
    copy_gbps = max(copy_gbps, harness.copy_bandwidth(device, prof["copy_bytes"]))  # a busy moment hits once
    rows = []
    for kind, n, t_ours, t_base, nbytes, dtype, backend, desc, reps in raw:
        gbps = nbytes / (t_ours.median_ms * 1e-3) / 1e9
        row = dict(common, case=f"scale_elems_{kind}", sizes=f"n={n:.0e}".replace("e+0", "e"), dtype=dtype,
                   backend=backend, x=float(n), ours_median_ms=t_ours.median_ms, ours_p20_ms=t_ours.p20_ms,
                   ours_p80_ms=t_ours.p80_ms, gbps=gbps, copy_gbps=copy_gbps, inplace_gbps=inplace_gbps,
                   bw_fraction=gbps / copy_gbps, target="-", met="-",
                   baseline=f"{desc}; {reps} reps; bytes counted {nbytes // n} B/element; copy bandwidth "
                            f"{copy_gbps:.1f} GB/s from dst.copy_(src) of {prof['copy_bytes'] >> 20} MiB")
        if t_base is not None:
            base_gbps = nbytes / (t_base.median_ms * 1e-3) / 1e9
            row.update(base_median_ms=t_base.median_ms, base_p20_ms=t_base.p20_ms, base_p80_ms=t_base.p80_ms,
                       speedup=t_base.median_ms / t_ours.median_ms, base_gbps=base_gbps,
                       base_bw_fraction=base_gbps / copy_gbps)
        rows.append(row)
    return rows


# ================================================================================= contract and CLI
def collect(mode: str, device: torch.device, progress=None) -> List[dict]:
    """Every scaling row of one run (see the module docstring); writes nothing, prints a few detail lines."""
    if mode not in PLANS:
        raise ValueError(f"scaling.collect: mode={mode!r}; choose one of {sorted(PLANS)}")
    t0 = time.time()
    rows = collect_distributed(mode, progress)
    t1 = time.time()
    rows += collect_elements(mode, torch.device(device), progress)
    print(f"scaling: multi-process part {t1 - t0:.1f} s, element-count part {time.time() - t1:.1f} s",
          file=sys.stderr)
    for r in rows:   # one run: one id for every row (the plots draw one run per device)
        r["run_id"] = rows[0]["run_id"]
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes, world sizes 1 and 2 (seconds)",
                             quick_help="small sizes, few reps (~50 s on 2 cores)")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="device of the element-count curve (the multi-process parts use gloo on CPU)")
    ap.add_argument("--plot", action="store_true", help="draw the PNGs afterwards (benchmarks.scaling_plots)")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows = collect(mode, torch.device(args.device))
    print(f"scaling ({mode}): {harness.device_name(torch.device('cpu'))}; elements on {args.device}; "
          f"torch {torch.__version__}; {time.time() - t0:.0f} s")
    harness.print_and_append(rows, None if args.no_csv else args.csv)
    if args.plot:
        from . import scaling_plots
        for path in scaling_plots.draw(rows if args.no_csv else args.csv):
            print(f"plot: {os.path.relpath(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
