"""Tensor-parallel GPT block: our layers against DTensor's ``parallelize_module``, 2 gloo ranks on CPU.

    python -m benchmarks.tp            # full sizes
    python -m benchmarks.tp --quick    # the two smaller sizes, fewer repetitions (~10 s)
    python -m benchmarks.tp --smoke    # tiny sizes, seconds

Two processes (one thread each) form a TP group of 2. On every rank, from one seed:

* ours: ``GPT(cfg, tp_group=mesh.tp_group).blocks[0]``: ``ColumnParallelLinear`` qkv (heads split),
  causal SDPA on the local heads, ``RowParallelLinear`` proj; ``ColumnParallelLinear(activation="gelu")``
  fc and ``RowParallelLinear`` fc2; LayerNorms and residuals replicated.
* baseline: the same block built dense (``GPT(cfg).blocks[0]``, identical weights) and split with
  ``torch.distributed.tensor.parallel.parallelize_module`` on the same ``DeviceMesh`` (``mesh["tp"]``):
  ``ColwiseParallel`` on qkv and fc, ``RowwiseParallel`` on proj and fc2: the same shards and the same
  two all-reduces forward (and two backward) as ours.

A step is forward + backward of ``[b, s, d]`` fp32 activations (input requires grad, upstream gradient
fixed), gradients reset to None first. Both run back to back, interleaved (harness.compare), median of
the timed reps after warm-up, on both ranks; the table shows rank 0's figures and the slower rank's
median. Target: ours at most 1.0x the baseline's time (speedup >= 1.0). Rows go to
``benchmarks/results/tp.csv`` (shared with the vocab-parallel cross-entropy benchmark); ``collect``
returns them for the suite (``python -m parallel_layers bench --only tp``). The ranks are gloo
processes on CPU whatever device the suite names.
Ranks keep freed memory for reuse (``harness.run_ranks(retain_memory=True)``, see
``parallel_layers.cpu_allocator``), as a CPU training job should run; the torch baselines share the
processes, so they get it too.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "tp.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
QUICK_BUDGET_S = 12   # seconds --quick should take on the 2-core development machine (guideline)
# (batch, seq, d_model, n_head); d_ff = 4 d_model
SIZES = {
    "full": [(4, 128, 256, 4), (4, 256, 512, 8), (2, 512, 1024, 16)],
    "quick": [(4, 128, 256, 4), (4, 256, 512, 8)],
    "smoke": [(2, 16, 64, 4)],
}
REPS = {"full": (15, 3), "quick": (7, 2), "smoke": (10, 1)}   # (timed reps, warm-up)
TARGET = 1.0
WORLD = 2


def _measure(mesh, b, s, d, h, reps, warmup):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from parallel_layers.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=1, n_head=h, d_model=d, max_seq_len=s, dropout=0.0)
    torch.manual_seed(0)
    ours = GPT(cfg, tp_group=mesh.tp_group).blocks[0]
    torch.manual_seed(0)
    theirs = copy.deepcopy(GPT(cfg).blocks[0])
    parallelize_module(theirs, mesh["tp"], {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                            "mlp.fc": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, s, d, generator=gen).requires_grad_()
    upstream = torch.randn(b, s, d, generator=gen)

    def step(block):
        def run():
            x.grad = None
            for p in block.parameters():
                p.grad = None
            block(x).backward(upstream)
        return run

    with torch.no_grad():  # same weights, same function: the outputs agree up to rounding
        diff = (ours(x) - theirs(x)).abs().max().item()
    t_ours, t_base = harness.compare(step(ours), step(theirs), torch.device("cpu"), reps, warmup)
    return t_ours, t_base, diff


def _bench_rank(rank: int, world: int, sizes, reps: int, warmup: int):
    """One TP rank (spawned by ``harness.run_ranks``, gloo group initialised, one thread): every size."""
    from parallel_layers.mesh import ParallelMesh

    mesh = ParallelMesh(tp=world)
    return [_measure(mesh, *shape, reps, warmup) for shape in sizes]


def collect(mode: str, device: Optional[torch.device] = None, progress: Optional[Callable[[str], None]] = None, *,
            sizes=None, reps: Optional[int] = None) -> List[dict]:
    """Rows of ``mode`` (smoke | quick | full; ``sizes`` [(b, s, d, h), ...] and ``reps`` override the
    profile). ``device`` is ignored: the ranks are gloo processes on CPU. Writes no CSV."""
    reps_, warmup = REPS[mode]
    reps = reps or reps_
    sizes = [tuple(t) for t in (sizes or SIZES[mode])]
    if progress:
        progress(f"{len(sizes)} size(s) on {WORLD} ranks")
    answers = harness.run_ranks(_bench_rank, WORLD, (sizes, reps, warmup), timeout_s=1800, retain_memory=True)
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend=f"gloo x{WORLD}")
    rows = []
    for i, (b, s, d, h) in enumerate(sizes):
        t_ours, t_base, diff = answers[0][i]
        slow_ours, slow_base = (max(a[i][k].median_ms for a in answers) for k in (0, 1))
        row = harness.comparison_row(common, "gpt_block_fwd_bwd_tp2", t_ours, t_base, sizes=f"b{b}xs{s}xd{d}xh{h}",
                                     target=f"speedup>={TARGET}",
                                     baseline="DTensor parallelize_module(ColwiseParallel/RowwiseParallel)",
                                     slowest_rank=(slow_ours, slow_base), max_diff=diff)
        row["met"] = "yes" if row["speedup"] >= TARGET else "no"
        rows.append(row)
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tp", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes, for the smoke test",
                             quick_help=f"smaller sizes, fewer reps (~{QUICK_BUDGET_S} s)")
    harness.add_csv_args(ap, CSV_PATH)
    ap.add_argument("--sizes", action="append", metavar="BxSxDxH",
                    help="batch x seq x d_model x n_head (repeatable); default: the mode's sizes")
    ap.add_argument("--reps", type=int, help="timed repetitions")
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    reps, warmup = REPS[mode]
    reps = args.reps or reps
    sizes = [tuple(int(v) for v in t.split("x")) for t in args.sizes] if args.sizes else SIZES[mode]
    if any(len(t) != 4 for t in sizes):
        ap.error("--sizes takes BxSxDxH, e.g. 4x256x512x8")
    print(f"device: {harness.device_name(torch.device('cpu'))} | {WORLD} gloo ranks, 1 thread each | torch "
          f"{torch.__version__} | mode: {mode}, {reps} reps after {warmup} warm-up (forward + backward, fp32)")
    rows = collect(mode, sizes=sizes, reps=reps)
    harness.print_and_append(rows, None if args.no_csv else args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
