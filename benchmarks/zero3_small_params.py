"""ZeRO-3 against ZeRO-2 on a model of many tiny parameters, 2 gloo ranks on CPU.

    python -m benchmarks.zero3_small_params                        # 1,500 modules, 3,004 parameters
    python -m benchmarks.zero3_small_params --min-unit-numel 0     # one unit per module (no merging)

The model: ``Linear(8, 2)``, then a ``ModuleList`` of ``--modules`` alternating ``LayerNorm(2)`` and
``Linear(2, 2)`` (4 and 6 elements each) applied as residual ``tanh`` blocks, then ``Linear(2, 1)``.
Each rank trains it on its own 4 rows, a step being forward, backward, optimizer step and zero_grad:

* ours: ``ZeroStage3(model, group, min_unit_numel=...)`` + ``ZeroStage3Optimizer``;
* baseline: ``DataParallel(model, group, reduce_op="reduce_scatter")`` + ``ZeroOptimizer(stage=2)``.

The two are built in the same processes and stepped interleaved (a barrier before each step) so load from
other processes hits both alike; after one warm-up step each, ``--steps`` timed steps each. Printed: the
median (p20-p80) per rank, the ratio of medians (target: ZeRO-3 at most 2x ZeRO-2), ZeRO-3's unit count
and padded size. No CSV: the figure is a ratio on one model, checked by
``tests/test_zero3_small_params.py``.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn as nn

from . import harness

WORLD = 2


class TinyModules(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.inp = nn.Linear(8, 2)
        self.blocks = nn.ModuleList(nn.LayerNorm(2) if i % 2 == 0 else nn.Linear(2, 2) for i in range(n))
        self.head = nn.Linear(2, 1)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h).square().mean()


def _bench_rank(rank: int, world: int, modules: int, steps: int, min_unit_numel: int) -> dict:
    import torch.distributed as dist

    from parallel_layers.data_parallel import DataParallel
    from parallel_layers.zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer

    group = dist.group.WORLD
    torch.manual_seed(0)
    z = ZeroStage3(TinyModules(modules), group, min_unit_numel=min_unit_numel)
    opt3 = ZeroStage3Optimizer(z, lr=1e-3)
    torch.manual_seed(0)
    dp = DataParallel(TinyModules(modules), group, reduce_op="reduce_scatter")
    opt2 = ZeroOptimizer(dp, stage=2, lr=1e-3)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    runs = {"zero3": (z, opt3), "zero2": (dp, opt2)}
    times = {name: [] for name in runs}
    for i in range(steps + 1):
        for name in (("zero3", "zero2") if i % 2 else ("zero2", "zero3")):
            model, opt = runs[name]
            dist.barrier(group)
            start = time.perf_counter()
            model(x).backward()
            opt.step()
            opt.zero_grad()
            if i:
                times[name].append((time.perf_counter() - start) * 1e3)
    rep = opt3.memory_report()
    return {"stats": {name: harness.Stats.of(t) for name, t in times.items()}, "units": len(z.units),
            "numel": rep["num_params"], "padded": rep["padded_numel"],
            "params": sum(1 for _ in z.module.parameters())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", type=int, default=1500, help="tiny modules in the ModuleList (default 1500)")
    ap.add_argument("--steps", type=int, default=7, help="timed steps of each (default 7)")
    ap.add_argument("--min-unit-numel", type=int, default=None,
                    help="ZeroStage3(min_unit_numel=) (default: the library's; 0: one unit per module)")
    args = ap.parse_args(argv)
    from parallel_layers.zero.stage3_units import MIN_UNIT_NUMEL

    min_unit = MIN_UNIT_NUMEL if args.min_unit_numel is None else args.min_unit_numel
    t0 = time.time()
    out = harness.run_ranks(_bench_rank, WORLD, (args.modules, args.steps, min_unit), timeout_s=1800)
    first = out[0]
    print(f"{args.modules} modules, {first['params']} parameters, {first['numel']} elements; ZeRO-3 "
          f"min_unit_numel={min_unit}: {first['units']} units padded to {first['padded']} elements; "
          f"{WORLD} gloo ranks x 1 thread; torch {torch.__version__}")
    print(f"{'rank':<5} {'ZeRO-3 ms':>10} {'p20-p80':>15} {'ZeRO-2 ms':>10} {'p20-p80':>15} {'ratio':>6}")
    for rank, res in enumerate(out):
        s3, s2 = res["stats"]["zero3"], res["stats"]["zero2"]
        print(f"{rank:<5} {s3.median_ms:>10.1f} {f'{s3.p20_ms:.1f}-{s3.p80_ms:.1f}':>15} {s2.median_ms:>10.1f} "
              f"{f'{s2.p20_ms:.1f}-{s2.p80_ms:.1f}':>15} {s3.median_ms / s2.median_ms:>6.2f}")
    print(f"target: ZeRO-3 / ZeRO-2 <= 2.0; {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
