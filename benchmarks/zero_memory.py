"""ZeRO at the memory it promises: each rank's allocator PEAK during a training step, beside the formulas.

    python -m benchmarks.zero_memory            # full: GPT V8192 L6 d384 (~13.8M parameters), 2, 4 and 8 gloo ranks
    python -m benchmarks.zero_memory --quick    # GPT V4096 L2 d256 (~2.7M parameters), 2 and 4 ranks
    python -m benchmarks.zero_memory --smoke    # tiny sizes, 2 ranks, seconds; never writes CSV
    python -m benchmarks.zero_memory --worlds 2,8 --only ours_zero2_fp32,ddp_zero_redundancy

One seed, one GPT, each rank trains on its own ``batch`` sequences (the same per rank at every world size,
so activations stay small and constant and the model states dominate); one full step = forward, backward,
optimizer step, zero grad. The methods (``METHODS``), one after the other in the same gloo ranks:

* ``ddp_zero_redundancy``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.distributed.optim.
  ZeroRedundancyOptimizer(AdamW)``: torch's ZeRO-1, fp32; every ratio in the table is against this row;
* ours, ZeRO-1 and ZeRO-2: ``DataParallel(model, group, reduce_op="reduce_scatter")`` + ``ZeroOptimizer(dp,
  stage=1|2)``, fp32, and bf16 (the model cast to bf16 before wrapping; fp32 master in the optimizer);
* ours, ZeRO-3: ``ZeroStage3(model, group)`` + ``ZeroStage3Optimizer``, fp32, and ``param_dtype=bf16,
  reduce_dtype=fp32`` (that row is skipped, with the reason printed, where ``ZeroStage3`` has no
  ``reduce_dtype``);
* FSDP2: ``fully_shard`` on every block then on the root + ``torch.optim.AdamW(foreach=True)``, fp32, and
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

Memory, per rank, by the tensors' and the allocator's own accounting (``parallel_layers.planner.measure``,
the planner's method), after one warm-up step (lazy optimizer state, bucket rebuilds):

* ``start``: the live tensors' bytes at the start of the measured step minus their bytes before the model
  was built (parameters, gradients kept between steps, optimizer state, buffers: what the rank holds
  between steps, as far as Python sees the tensors): ``planner.measure.live_tensor_bytes()``'s sum, less
  the ``DTensor`` wrappers, whose placeholder storage reports the GLOBAL size (``live_bytes``; counted,
  FSDP2 would be charged every sharded parameter and Adam moment in full: 45 MiB instead of 15 at ~2.6M
  parameters on 2 ranks);
* ``growth``: the most bytes torch's CPU allocator held above its level at the step's start while the step
  ran (profiler memory events, as ``step_growth``); ``peak = start + growth`` is the figure of the table;
* ``alloc``: a check of ``start``: the same profiler session runs from before the build, so this is the
  allocator's own level at the step's peak counted from before the build: it includes what ``start``
  cannot see, tensors held only by C++ between steps (DDP's Reducer buckets, a full fp32 copy of the
  gradients; FSDP2's last reduce-scatter buffers, freed in the next step);
* ``grads`` (ours ZeRO-1/2 only): the largest gradient memory seen at every gradient hook of the measured
  step, at the end of its backward and of the step: the distinct storages of DataParallel's gradient
  buffers (``buffer.grad_tensors()``), its ``grad_shard``, the collectives' staged buffers, every
  ``p.grad`` and ``p.main_grad``.

Max over ranks. Bytes per parameter = peak / the model's parameter count (tied weights once). Beside them:

* ``paper``: ``paper_bytes_per_param(stage, ranks)``, the ZeRO paper's ``2 + 2 + 12`` for bf16 rows; for fp32
  rows the same formula with ``4 + 4 + 8`` (no separate master copy: the fp32 parameter is the master);
  DDP + ZeroRedundancyOptimizer is stage 1, FSDP2 stage 3;
* ``DeepSpeed``: DeepSpeed's own estimators without offload, re-derived here (``deepspeed_zero2_bytes`` /
  ``deepspeed_zero3_bytes``): ZeRO-2 ``4 P + 16 P / N`` (2-byte parameters and gradients, then fp32
  gradient partition, master and Adam moments divided), ZeRO-3 ``18 P / N + 4 L`` (``L``: the largest
  module's own parameters, the gathered layer). Both assume fp16/bf16 training; DeepSpeed has no
  stage-1 estimator.

Step time: the slowest rank's wall time of a step (a barrier before it), median of ``reps`` steps run
after the measured one, outside the profiler. Rows go to ``benchmarks/results/zero_memory.csv`` (one per
method and world size; ``mem_mb`` = peak MiB, ``x`` = ranks, base = DDP + ZeroRedundancyOptimizer).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from . import harness
from .zero import seeded_gpt, size_text

CSV_NAME = "zero_memory.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 60
MIB = float(2 ** 20)
LR = 1e-4
STEP_MARK = "zero_memory.measured_step"
# mode -> GPT config (batch = sequences per rank), world sizes, timed steps per method, and the gradient bucket
# size of DDP and of our DataParallel (scaled down with the model, as 25 MB is to a model of a few GB: ZeRO-2
# holds the gradient shard plus a few buckets in backward, and with 25 MB buckets a ~55 MB model is 4 buckets)
PROFILES = {
    "full": dict(size=dict(vocab_size=8192, n_layer=6, d_model=384, n_head=6, max_seq_len=32, batch=1),
                 worlds=(2, 4, 8), reps=3, bucket_mb=4.0),
    "quick": dict(size=dict(vocab_size=4096, n_layer=2, d_model=256, n_head=4, max_seq_len=32, batch=1),
                  worlds=(2, 4), reps=2, bucket_mb=1.0),
    "smoke": dict(size=dict(vocab_size=128, n_layer=1, d_model=32, n_head=2, max_seq_len=16, batch=1),
                  worlds=(2,), reps=1, bucket_mb=0.01),
}
BASE = "ddp_zero_redundancy"
# name -> (label, family, ZeRO stage, parameter dtype)
METHODS = {
    BASE: ("DDP+ZeroRedundancyOpt", "ddp", 1, torch.float32),
    "ours_zero1_fp32": ("ours ZeRO-1 fp32", "zero", 1, torch.float32),
    "ours_zero1_bf16": ("ours ZeRO-1 bf16", "zero", 1, torch.bfloat16),
    "ours_zero2_fp32": ("ours ZeRO-2 fp32", "zero", 2, torch.float32),
    "ours_zero2_bf16": ("ours ZeRO-2 bf16", "zero", 2, torch.bfloat16),
    "ours_zero3_fp32": ("ours ZeRO-3 fp32", "zero3", 3, torch.float32),
    "ours_zero3_bf16": ("ours ZeRO-3 bf16", "zero3", 3, torch.bfloat16),
    "fsdp2_fp32": ("FSDP2 fp32", "fsdp2", 3, torch.float32),
    "fsdp2_bf16": ("FSDP2 bf16/fp32 reduce", "fsdp2", 3, torch.bfloat16),
}


# ------------------------------------------------------------------------------------- the formulas
def deepspeed_zero2_bytes(total_params: int, ranks: int) -> int:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs(cpu_offload=False)``, per device:
    2-byte parameters and 2-byte gradients whole, 16 bytes a parameter (fp32 gradient partition, fp32
    master, Adam's two moments) divided over the ranks."""
    return 4 * total_params + int(16 * total_params / ranks)


def deepspeed_zero3_bytes(total_params: int, largest_layer_params: int, ranks: int) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs(cpu_offload=False)``, per device: 18 bytes a
    parameter divided over the ranks (2-byte parameter and gradient partitions, 16 of fp32 state),
    plus the largest layer gathered (4 bytes a parameter: 2-byte weights and gradients)."""
    return int(18 * total_params / ranks) + 4 * largest_layer_params


def largest_layer_params(model: torch.nn.Module) -> int:
    """DeepSpeed's ``model_to_params``: the most parameters one module holds itself (not its children)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def paper_total(stage: int, ranks: int, dtype: torch.dtype) -> float:
    """The ZeRO paper's bytes per parameter per rank: 2 + 2 + 12 (bf16), 4 + 4 + 8 (fp32, no master)."""
    from parallel_layers.zero.memory import paper_bytes_per_param

    if dtype == torch.float32:
        return paper_bytes_per_param(stage, ranks, param_bytes=4, grad_bytes=4, k=8)["total"]
    return paper_bytes_per_param(stage, ranks)["total"]


def deepspeed_total(family: str, stage: int, ranks: int, n_params: int, largest: int) -> Optional[float]:
    """DeepSpeed's estimate in bytes per parameter for the row's stage (None: stage 1, no estimator)."""
    if stage == 2:
        return deepspeed_zero2_bytes(n_params, ranks) / n_params
    if stage == 3:
        return deepspeed_zero3_bytes(n_params, largest, ranks) / n_params
    return None


def zero3_has_reduce_dtype() -> bool:
    from parallel_layers.zero.stage3 import ZeroStage3

    return "reduce_dtype" in inspect.signature(ZeroStage3.__init__).parameters


def skip_reason(name: str) -> Optional[str]:
    """Why ``name`` cannot run with this checkout (None: it can)."""
    if name == "ours_zero3_bf16" and not zero3_has_reduce_dtype():
        return "ZeroStage3 has no reduce_dtype= keyword in this checkout (bf16 parameters, fp32 reduction)"
    return None


# ------------------------------------------------------------------------------------- one rank
def _build(name: str, size: dict, group, mesh, bucket_mb: float):
    """(module, optimizer, gradient-memory probe or None) for method ``name``, from seed 0."""
    _, family, stage, dtype = METHODS[name]
    low = dtype != torch.float32
    if family == "ddp":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(seeded_gpt(size), process_group=group, bucket_cap_mb=bucket_mb)
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, process_group=group,
                                      lr=LR, weight_decay=0.01)
        return model, opt, None
    if family == "zero":
        from parallel_layers.data_parallel.ddp import DataParallel
        from parallel_layers.zero import ZeroOptimizer

        model = DataParallel(seeded_gpt(size, dtype if low else None), group, reduce_op="reduce_scatter",
                             bucket_cap_mb=bucket_mb)
        opt = ZeroOptimizer(model, stage=stage, lr=LR, weight_decay=0.01)
        return model, opt, _grad_probe(model)
    if family == "zero3":
        from parallel_layers.zero.stage3 import ZeroStage3
        from parallel_layers.zero.stage3_optimizer import ZeroStage3Optimizer

        kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low else {}
        model = ZeroStage3(seeded_gpt(size), group, **kw)
        return model, ZeroStage3Optimizer(model, lr=LR, weight_decay=0.01), None
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = seeded_gpt(size)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=True), None


def _grad_tensors(dp) -> List[torch.Tensor]:
    """Every tensor of ``dp`` (our DataParallel) that holds gradient memory now (views of one storage
    are counted once by ``held_bytes``; a freed bucket's storage has 0 bytes)."""
    buf = dp.buffer
    out = list(buf.grad_tensors()) if hasattr(buf, "grad_tensors") else [buf.grad_buffer]
    out.append(getattr(dp, "grad_shard", None))
    out += [t for pair in getattr(dp, "_staged", {}).values() for t in pair]
    for p in buf.params:
        out += [p.grad, getattr(p, "main_grad", None)]
    return [t for t in out if isinstance(t, torch.Tensor)]


class _GradProbe:
    """The most gradient memory ``dp`` held at any gradient hook while armed (see ``_grad_tensors``)."""

    def __init__(self, dp):
        from parallel_layers.planner.accounting import held_bytes

        self.dp, self.held_bytes, self.armed, self.peak = dp, held_bytes, False, 0
        # registered after DataParallel's own hooks: they run after it, each parameter's gradient handled
        self.hooks = [p.register_post_accumulate_grad_hook(self._sample) for p in dp.buffer.params]

    def _sample(self, _p=None) -> None:
        if self.armed:
            self.peak = max(self.peak, self.held_bytes(_grad_tensors(self.dp)))

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _grad_probe(dp) -> _GradProbe:
    return _GradProbe(dp)


def live_bytes() -> int:
    """``parallel_layers.planner.measure.live_tensor_bytes()`` without wrapper subclasses: a ``DTensor``'s
    own storage is a placeholder whose ``nbytes()`` is the GLOBAL (unsharded) size (its data pointer
    raises), so counting it would charge FSDP2 every sharded parameter and Adam moment in full; the
    local shard it wraps is a tensor of its own and is counted. Otherwise the same distinct-storage sum."""
    from parallel_layers.planner.accounting import held_bytes
    from parallel_layers.planner.measure import live_tensors

    ts = []
    for obj in live_tensors():
        try:
            if obj.device.type != "cpu":
                continue
            with torch._C.DisableTorchFunctionSubclass():
                obj.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        ts.append(obj)
    return held_bytes(ts)


def _allocator_levels(prof) -> Dict[str, int]:
    """From a profiler session that started before the build: the allocator's level (bytes above the
    session's start) at the marked step's start and its maximum during that step."""
    events = list(prof.profiler.kineto_results.events())
    marks = [(e.start_ns(), e.end_ns()) for e in events if e.name() == STEP_MARK]
    if not marks:
        raise RuntimeError(f"zero_memory: no '{STEP_MARK}' range in the profile")
    t0, t1 = marks[-1]
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    level = start = 0
    top = None
    for t, nbytes in mem:
        if t >= t0 and top is None:
            start = top = level
        if t > t1:
            break
        level += nbytes
        if top is not None:
            top = max(top, level)
    if top is None:
        start = top = level
    return {"alloc_start": start, "alloc_peak": top}


def _measure(name: str, size: dict, group, mesh, x, y, reps: int, bucket_mb: float) -> Dict[str, object]:
    """One method on this rank (a collective): build under the profiler, a warm-up step, the measured
    step, then ``reps`` timed steps. This rank's figures (times: the slowest rank's)."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, record_function

    from parallel_layers.planner.measure import quiet_profile

    gc.collect()
    base = live_bytes()
    with quiet_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, opt, probe = _build(name, size, group, mesh, bucket_mb)
        losses: List[float] = []

        def step():
            _, loss = model(x, y)
            loss.backward()
            if probe is not None:
                probe._sample()          # the end of backward (and the last bucket's reduction)
            opt.step()
            opt.zero_grad()
            if probe is not None:
                probe._sample()
            losses.append(loss.item())

        step()                                    # warm-up
        dist.barrier(group)
        start = live_bytes() - base
        if probe is not None:
            probe.armed = True
        with record_function(STEP_MARK):
            step()
        if probe is not None:
            probe.armed = False
    levels = _allocator_levels(prof)
    del prof
    growth = levels["alloc_peak"] - levels["alloc_start"]
    times = [harness.slowest_rank_ms(step, group) for _ in range(reps)]
    out = dict(start=start, growth=growth, peak=start + growth, alloc_start=levels["alloc_start"],
               alloc_peak=levels["alloc_peak"], grads=probe.peak if probe is not None else None,
               times=times, loss=losses[0],
               # ZeRO-2: DataParallel's own count of the bucket gradients alive in the measured backward
               dp_backward_grads=getattr(model, "last_backward_grad_bytes", None) if METHODS[name][2] == 2 else None)
    if probe is not None:
        probe.remove()
    return out                  # model, optimizer and probe go with this frame (the caller collects)


def _bench_rank(rank: int, world: int, size: dict, names: List[str], reps: int, bucket_mb: float):
    """Every method of ``names`` in turn on this rank; {name: figures or {"error": text}}."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, size["vocab_size"], (size["batch"], size["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)
    out: Dict[str, Dict[str, object]] = {}
    for name in names:
        try:
            out[name] = _measure(name, size, group, mesh, x, y, reps, bucket_mb)
        except Exception as exc:  # noqa: BLE001 - a method this torch cannot run is reported, the others run
            out[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
        gc.collect()
        dist.barrier(group)
    return out


# ------------------------------------------------------------------------------------- the run
def _model_counts(size: dict):
    model = seeded_gpt(size)
    return sum(p.numel() for p in model.parameters()), largest_layer_params(model)


def _results(mode: str, worlds, names: List[str], progress: Optional[Callable[[str], None]] = None):
    """-> (results: list of dicts, one per (world, method) measured or skipped, the sizes text)."""
    prof = PROFILES[mode]
    size = prof["size"]
    n_params, largest = _model_counts(size)
    sizes = f"{size_text(size)} per rank ({n_params} params), buckets {prof['bucket_mb']:g} MB"
    runnable = [n for n in names if skip_reason(n) is None]
    results = []
    for world in worlds:
        if progress:
            progress(f"peak memory, {world} ranks, {size_text(size)}")
        answers = harness.run_ranks(_bench_rank, world, (size, runnable, prof["reps"], prof["bucket_mb"]),
                                    timeout_s=3600)
        for name in names:
            label, family, stage, dtype = METHODS[name]
            res = dict(name=name, label=label, family=family, stage=stage, world=world, n_params=n_params,
                       dtype=str(dtype).replace("torch.", ""), paper=paper_total(stage, world, dtype),
                       deepspeed=deepspeed_total(family, stage, world, n_params, largest))
            reason = skip_reason(name)
            errors = sorted({a[name]["error"] for a in answers if "error" in a.get(name, {})}) if not reason else []
            if reason or errors:
                res["skipped"] = reason or "; ".join(errors)
                results.append(res)
                continue
            per_rank = [a[name] for a in answers]
            for key in ("start", "growth", "peak", "alloc_peak"):
                res[key] = max(r[key] for r in per_rank)
            res["peak_min"] = min(r["peak"] for r in per_rank)
            grads = [r["grads"] for r in per_rank if r["grads"] is not None]
            res["grads"] = max(grads) if grads else None
            dp_grads = [r["dp_backward_grads"] for r in per_rank if r.get("dp_backward_grads")]
            res["dp_backward_grads"] = max(dp_grads) if dp_grads else None
            res["times"] = per_rank[0]["times"]          # every rank returns the same slowest-rank times
            res["step_ms"] = statistics.median(res["times"])
            res["loss"] = per_rank[0]["loss"]
            results.append(res)
        base = next((r for r in results if r["world"] == world and r["name"] == BASE and "peak" in r), None)
        for r in results:
            if r["world"] == world and "peak" in r:
                r["mem_ratio"] = r["peak"] / base["peak"] if base else None
                r["alloc_ratio"] = r["alloc_peak"] / base["alloc_peak"] if base else None
                r["time_ratio"] = r["step_ms"] / base["step_ms"] if base else None
    return results, sizes


def _rows(mode: str, results: List[dict], sizes: str) -> List[dict]:
    common = harness.common_fields(mode, torch.device("cpu"), 1)
    rows = []
    for r in results:
        if "peak" not in r:
            continue
        base = next((b for b in results if b["world"] == r["world"] and b["name"] == BASE and "peak" in b), None)
        ours = harness.Stats.of(r["times"])
        timing = dict(ours_median_ms=ours.median_ms, ours_p20_ms=ours.p20_ms, ours_p80_ms=ours.p80_ms)
        if base is not None:
            theirs = harness.Stats.of(base["times"])
            timing.update(base_median_ms=theirs.median_ms, base_p20_ms=theirs.p20_ms, base_p80_ms=theirs.p80_ms,
                          speedup=theirs.median_ms / ours.median_ms)
        n = r["n_params"]
        ds = f"{r['deepspeed']:.2f}" if r["deepspeed"] is not None else "-"
        grads = f", grads {r['grads'] / MIB:.1f} MiB" if r["grads"] is not None else ""
        if r.get("dp_backward_grads"):
            grads += f" (buckets in backward {r['dp_backward_grads'] / MIB:.1f} MiB)"
        ratio = (f"; peak {r['mem_ratio']:.3f}x the baseline's (allocator since build {r['alloc_ratio']:.3f}x)"
                 if r.get("mem_ratio") is not None else "")
        rows.append(dict(common, case=f"zero_memory_{r['name']}_dp{r['world']}", sizes=sizes, dtype=r["dtype"],
                         backend=f"gloo x{r['world']}", x=r["world"], mem_mb=r["peak"] / MIB, target="-", met="-",
                         baseline=(f"DDP + ZeroRedundancyOptimizer(AdamW){ratio}; {r['label']}: peak "
                                   f"{r['peak'] / MIB:.1f} MiB = {r['peak'] / n:.2f} B/param (start "
                                   f"{r['start'] / MIB:.1f} + growth {r['growth'] / MIB:.1f}; allocator since "
                                   f"build {r['alloc_peak'] / MIB:.1f} MiB{grads}); paper {r['paper']:.2f} "
                                   f"B/param; DeepSpeed {ds} B/param; max over ranks"),
                         **timing))
    return rows


def format_results(results: List[dict]) -> str:
    """The fixed-width table: one line per method and world size (max over ranks)."""
    head = (f"{'method':<23} {'ranks':>5} {'start MiB':>9} {'peak MiB':>8} {'B/param':>7} {'alloc MiB':>9} "
            f"{'grads MiB':>9} {'paper B/p':>9} {'DeepSpd B/p':>11} {'step ms':>8} {'peak/DDP':>8} {'alloc/DDP':>9} "
            f"{'time/DDP':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        paper = f"{r['paper']:.2f}"
        ds = f"{r['deepspeed']:.2f}" if r["deepspeed"] is not None else "-"
        if "peak" not in r:
            lines.append(f"{r['label']:<23} {r['world']:>5} skipped: {r['skipped']}")
            continue

        def opt(v, fmt):
            return fmt.format(v) if v is not None else "-"
        lines.append(f"{r['label']:<23} {r['world']:>5} {r['start'] / MIB:>9.1f} {r['peak'] / MIB:>8.1f} "
                     f"{r['peak'] / r['n_params']:>7.2f} {r['alloc_peak'] / MIB:>9.1f} "
                     f"{opt(r['grads'] and r['grads'] / MIB, '{:.1f}'):>9} {paper:>9} {ds:>11} "
                     f"{r['step_ms']:>8.0f} {opt(r.get('mem_ratio'), '{:.2f}x'):>8} "
                     f"{opt(r.get('alloc_ratio'), '{:.2f}x'):>9} {opt(r.get('time_ratio'), '{:.2f}x'):>8}")
    return "\n".join(lines)


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Run the benchmark (``mode``: smoke | quick | full, see ``PROFILES``) and return the CSV rows, one per
    method and world size. Writes no CSV; the table goes to stderr. ``device`` only names the run: the
    ranks are gloo processes on CPU."""
    results, sizes = _results(mode, PROFILES[mode]["worlds"], list(METHODS), progress)
    print(f"zero_memory ({sizes}):\n{format_results(results)}", file=sys.stderr, flush=True)
    return _rows(mode, results, sizes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.zero_memory", description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes, 2 ranks (seconds); never writes CSV",
                             quick_help=f"small GPT, 2 and 4 ranks (~{QUICK_BUDGET_S} s)")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--worlds", help="comma-separated world sizes (default: the profile's)")
    ap.add_argument("--only", help=f"comma-separated methods of: {', '.join(METHODS)} ({BASE} is always run)")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    worlds = tuple(int(w) for w in args.worlds.split(",")) if args.worlds else PROFILES[mode]["worlds"]
    names = list(METHODS)
    if args.only:
        wanted = {n for n in args.only.split(",") if n} | {BASE}
        unknown = sorted(wanted - set(METHODS))
        if unknown:
            ap.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
        names = [n for n in METHODS if n in wanted]
    for n in names:
        if skip_reason(n):
            print(f"skipping {n}: {skip_reason(n)}")
    t0 = time.time()
    results, sizes = _results(mode, worlds, names)
    prof = PROFILES[mode]
    print(f"device: {harness.device_name(torch.device('cpu'))} | torch {torch.__version__} | gloo ranks x 1 thread "
          f"| GPT {sizes} | mode {mode}: 1 warm-up step, 1 measured step, step time median of {prof['reps']}")
    print(format_results(results))
    print("start: live tensors between steps; peak = start + the allocator's growth during the step (profiler); "
          "alloc: the allocator's own level from before the build (sees C++-held tensors); grads: ours' gradient "
          "memory at its largest; all max over ranks. paper: 2+2+12 (bf16), 4+4+8 (fp32); DeepSpeed: "
          "its no-offload estimators (fp16 training), none for stage 1.")
    for r in results:
        if "peak" in r and r["peak_min"] < 0.9 * r["peak"]:
            print(f"  {r['label']} at {r['world']} ranks: ranks differ, peak {r['peak_min'] / MIB:.1f}-"
                  f"{r['peak'] / MIB:.1f} MiB")
        if r.get("dp_backward_grads"):
            print(f"  {r['label']} at {r['world']} ranks: DataParallel's own count of the bucket gradients alive in "
                  f"backward {r['dp_backward_grads'] / MIB:.1f} MiB (the grads column adds the shard and staging)")
    print(f"({time.time() - t0:.0f} s)")
    harness.append_and_report(_rows(mode, results, sizes), harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
