"""ZeRO stage 3 (``ZeroStage3`` + ``ZeroStage3Optimizer``) against FSDP2 (``fully_shard``) on CPU gloo.

    python -m benchmarks.zero3            # full: GPT V8192 L6 d512 (~23.1M parameters), 2 gloo ranks x 1 thread
    python -m benchmarks.zero3 --quick    # GPT V8192 L2 d256 (~3.7M parameters), few reps (see PROFILES)
    python -m benchmarks.zero3 --smoke    # tiny sizes, seconds; never writes CSV

Two processes (one thread each) form a data-parallel group of 2; each trains the same GPT (one seed) on
its half of the batch, one full step per call (forward, backward, optimizer step, zero grad):

* ours: ``ZeroStage3(gpt, group)`` (every block a unit, the root keeps embeddings and final LayerNorm),
  ``ZeroStage3Optimizer`` (one fused AdamW over the rank's flat shard);
* baseline: ``fully_shard(block, mesh)`` for every block, then ``fully_shard(gpt, mesh)``, and
  ``torch.optim.AdamW(foreach=True)`` (FSDP2's DTensor parameters; the multi-tensor path is the fast
  one, the default on CPU would be a per-tensor loop).

Step time: ``harness.compare`` (warm-up, then both interleaved), a barrier before each step; rank 0's
median (p20-p80). Target: ours at most 1.0x FSDP2's (speedup >= 1.0).

Peak memory: each method alone in the rank (the other one not built; both were built and stepped once
before, and deleted, so imports and caches are in the baseline): build, two warm-up steps (so
AdamW's state exists), then reset the high-water mark (``/proc/self/clear_refs`` = 5) and run one step;
the figure is VmHWM minus the RSS the process had before the model was built (so it counts parameters,
gradients, optimizer state and the step's transient memory). The ranks run with
``MALLOC_MMAP_THRESHOLD_=65536`` so freed blocks go back to the OS and RSS follows live memory. Max over
ranks, median over ``reps`` measured steps. Target: at most 1.0x FSDP2's.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness
from .zero import size_text

CSV_NAME = "zero.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 15          # with benchmarks/zero.py (same CSV, same suite group): ~30 s together
WORLD = 2
# mode -> GPT config and global batch, timed reps (step time and memory) and warm-up steps (step time)
PROFILES = {
    "full": dict(size=dict(vocab_size=8192, n_layer=6, d_model=512, n_head=8, max_seq_len=64, batch=8),
                 reps=7, warmup=2),
    "quick": dict(size=dict(vocab_size=8192, n_layer=2, d_model=256, n_head=4, max_seq_len=64, batch=8),
                  reps=3, warmup=1),
    "smoke": dict(size=dict(vocab_size=128, n_layer=2, d_model=32, n_head=2, max_seq_len=16, batch=4),
                  reps=5, warmup=1),
}
LR = 1e-4
BASELINE = "FSDP2 fully_shard per block + root"
MEM_METHOD = "VmHWM - RSS before build, clear_refs=5, MALLOC_MMAP_THRESHOLD_=65536, max over ranks"


def _build(name: str, size: dict, group, device_mesh):
    """A step function for ``name`` ('ours' or 'fsdp2') on a freshly built GPT (same seed for both)."""
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**{k: v for k, v in size.items() if k != "batch"}))
    if name == "ours":
        from parallel_layers.zero.stage3 import ZeroStage3
        from parallel_layers.zero.stage3_optimizer import ZeroStage3Optimizer

        model = ZeroStage3(model, group)
        opt = ZeroStage3Optimizer(model, lr=LR, weight_decay=0.1)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=device_mesh)
        fully_shard(model, mesh=device_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    return model, opt


def _step_fn(model, opt, x, y):
    import torch.distributed as dist

    losses = []

    def step():
        dist.barrier()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return step, losses


def _bench_rank(rank: int, world: int, size: dict, reps: int, warmup: int):
    """One rank: peak memory of each method alone (max over ranks), then both step times interleaved.
    Rank 0 returns the figures; the others None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,))
    group = device_mesh.get_group()
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, size["vocab_size"], (size["batch"], size["max_seq_len"]), generator=gen)
    y = torch.roll(x, -1, dims=1)
    x, y = x.chunk(world)[rank].contiguous(), y.chunk(world)[rank].contiguous()
    out = {}
    # ---- warm the process: lazy imports, dispatch caches and gloo buffers are not a method's memory
    for name in ("ours", "fsdp2"):
        _step_fn(*_build(name, size, group, device_mesh), x, y)[0]()
        gc.collect()
    # ---- peak memory: one method at a time
    for name in ("ours", "fsdp2"):
        gc.collect()
        base = harness.status_mb("VmRSS")
        model, opt = _build(name, size, group, device_mesh)
        step, losses = _step_fn(model, opt, x, y)
        for _ in range(2):
            step()
        peaks = []
        for _ in range(reps):
            gc.collect()
            if not harness.reset_peak_rss():
                raise RuntimeError("cannot reset the peak RSS: /proc/self/clear_refs is not writable")
            step()
            peaks.append(harness.status_mb("VmHWM") - base)
        peak = torch.tensor([statistics.median(peaks)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out[name + "_peak_mb"] = peak.item()
        out[name + "_first_loss"] = losses[0]
        del model, opt, step
        gc.collect()
    # ---- step time: both alive, interleaved
    ours_step, _ = _step_fn(*_build("ours", size, group, device_mesh), x, y)
    base_step, _ = _step_fn(*_build("fsdp2", size, group, device_mesh), x, y)
    out["ours"], out["fsdp2"] = harness.compare(ours_step, base_step, torch.device("cpu"), reps, warmup)
    return out if rank == 0 else None


def _run(mode: str, progress: Optional[Callable[[str], None]] = None):
    """-> (rows, rank 0's figures, the sizes text)."""
    prof = PROFILES[mode]
    size = prof["size"]
    from parallel_layers.models import GPT, GPTConfig

    n_params = sum(p.numel() for p in GPT(GPTConfig(**{k: v for k, v in size.items() if k != "batch"})).parameters())
    sizes = f"{size_text(size)} ({n_params} params)"
    if progress:
        progress(f"ZeRO-3 vs FSDP2, {size_text(size)}")
    # Inherited by the spawned ranks only (glibc reads it at start-up): see the docstring.
    with harness.environ({"MALLOC_MMAP_THRESHOLD_": "65536"}):
        res = harness.run_ranks(_bench_rank, WORLD, (size, prof["reps"], prof["warmup"]), timeout_s=1800)[0]
    ours, base = res["ours"], res["fsdp2"]
    speedup = base.median_ms / ours.median_ms
    # RSS growth: 0 when the step fit in memory an earlier phase freed (tiny sizes); then no ratio is judged
    mem_ratio = res["ours_peak_mb"] / res["fsdp2_peak_mb"] if res["fsdp2_peak_mb"] > 0 else float("nan")
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), sizes=sizes, dtype="float32",
                  backend=f"gloo x{WORLD}")
    rows = [harness.comparison_row(common, f"zero3_train_step_dp{WORLD}", ours, base, target="speedup>=1.0",
                      met="yes" if speedup >= 1.0 else "no", baseline=f"{BASELINE}, AdamW(foreach)"),
            dict(common, case=f"zero3_peak_memory_dp{WORLD}", target="mem_ratio<=1.0",
                 met="-" if mem_ratio != mem_ratio else "yes" if mem_ratio <= 1.0 else "no", mem_mb=res["ours_peak_mb"],
                 baseline=(f"{BASELINE}; peak MB ours {res['ours_peak_mb']:.1f} vs "
                           f"{res['fsdp2_peak_mb']:.1f} = {mem_ratio:.3f}x ({MEM_METHOD})"))]
    return rows, res, sizes


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Run the benchmark (``mode``: smoke | quick | full, see ``PROFILES``) and return the CSV rows (step
    time, peak memory). Writes no CSV; one detail line to stderr. ``device`` only names the run: the
    ranks are gloo processes on CPU."""
    rows, res, _ = _run(mode, progress)
    print(f"zero3: step ours {rows[0]['ours_median_ms']:.1f} ms vs FSDP2 {rows[0]['base_median_ms']:.1f} ms; "
          f"peak MB ours {res['ours_peak_mb']:.1f} vs FSDP2 {res['fsdp2_peak_mb']:.1f}", file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes (seconds); never writes CSV",
                             quick_help="small GPT, few reps (see PROFILES)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows, res, sizes = _run(mode)
    ours, base = res["ours"], res["fsdp2"]
    speedup = rows[0]["speedup"]
    mem_ratio = res["ours_peak_mb"] / res["fsdp2_peak_mb"] if res["fsdp2_peak_mb"] > 0 else float("nan")
    print(f"device: {rows[0]['device']}; torch {rows[0]['torch']}; {WORLD} gloo ranks x 1 thread; GPT {sizes}, fp32")
    print(f"{'method':<28} {'step ms':>9} {'p20-p80':>17} {'peak MB':>9}")
    print(f"{'ours ZeroStage3':<28} {ours.median_ms:>9.1f} {f'{ours.p20_ms:.1f}-{ours.p80_ms:.1f}':>17} "
          f"{res['ours_peak_mb']:>9.1f}")
    print(f"{'FSDP2 fully_shard':<28} {base.median_ms:>9.1f} {f'{base.p20_ms:.1f}-{base.p80_ms:.1f}':>17} "
          f"{res['fsdp2_peak_mb']:>9.1f}")
    print(f"step time ours/FSDP2 {1 / speedup:.3f}x (speedup {speedup:.3f}x, target <= 1.0x); "
          f"peak memory ours/FSDP2 {mem_ratio:.3f}x (target <= 1.0x)")
    print(f"first-step loss ours {res['ours_first_loss']:.6f} FSDP2 {res['fsdp2_first_loss']:.6f}; "
          f"memory: {MEM_METHOD}; {time.time() - t0:.0f} s")
    harness.append_and_report(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
