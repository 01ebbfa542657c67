"""Synchronized batch norm: ours (fused Welford statistics, one all-reduce forward, one backward) vs
torch's ``SyncBatchNorm`` algorithm, on 2 gloo ranks, forward + backward of one layer.

    python -m benchmarks.sync_batchnorm              # [32, 64, 28, 28], [64, 256, 14, 14], [256, 1024] per rank
    python -m benchmarks.sync_batchnorm --quick      # the first two shapes, fewer repetitions
    python -m benchmarks.sync_batchnorm --smoke      # tiny shapes, a few seconds (no CSV)

The baseline: ``torch.nn.SyncBatchNorm`` refuses CPU tensors ("expected input tensor to be on GPU"), and
its ATen statistics ops (``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``,
``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``) have no CPU kernels. So the baseline is
``TorchSyncBatchNorm`` below: torch's autograd Function (``torch/nn/modules/_functions.py``) line for line,
with its collectives as torch issues them on gloo (forward: ``all_gather`` of every rank's
``[mean, invstd, count]``, the empty ranks masked out with a host sync, then the per-rank merge; backward:
one ``all_reduce`` of ``[sum dy, sum dy * (x - mean)]``) and each of those four CUDA-only ops replaced by
its CPU equivalent (ATen's ``var_mean``, the same Chan merge, ATen's batch-norm backward for the
reductions, the same elementwise formulas). It is also the tests' second oracle.

Each rank holds its own slice (a different seed) of the global batch; one step = forward + backward
(``torch.autograd.grad`` of ``(y * g).sum()`` with respect to the input, weight and bias). Times: median
(p20-p80) of ``reps`` steps after warm-up, ours and the baseline interleaved, both ranks released together
by a barrier before each step; the figure is the slowest rank's time (``harness.slowest_rank_ms``). The
collectives per layer and step are counted by wrapping ``torch.distributed``'s functions during one step.
Rows go to benchmarks/results/dp.csv (``collect`` returns them for the suite).
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import harness

CSV_NAME = "dp.csv"
PROFILES = {"full": dict(shapes=[(32, 64, 28, 28), (64, 256, 14, 14), (256, 1024)], reps=15, warmup=3),
            "quick": dict(shapes=[(32, 64, 28, 28), (64, 256, 14, 14)], reps=7, warmup=2),
            "smoke": dict(shapes=[(4, 8, 5, 5), (6, 16)], reps=3, warmup=1)}
COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "broadcast")


# ---------------------------------------------------------------------------------------------- the baseline
class _TorchSyncBatchNormCPU(torch.autograd.Function):
    """``torch.nn.modules._functions.SyncBatchNorm`` on CPU (see the module docstring): same collectives."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group, world_size):
        x = x.contiguous()
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        if x.numel() > 0:
            var, mean = torch.var_mean(x, dim=dims, correction=0)          # batch_norm_stats
            invstd = torch.rsqrt(var + eps)
            count = torch.full((1,), x.numel() // channels, dtype=mean.dtype)
            combined = torch.cat([mean, invstd, count])
        else:
            combined = torch.zeros(2 * channels + 1, dtype=x.dtype)
        combined_list = [torch.empty_like(combined) for _ in range(world_size)]
        dist.all_gather(combined_list, combined, group)                    # torch's gloo path
        combined = torch.stack(combined_list)
        mean_all, invstd_all, count_all = torch.split(combined, channels, dim=1)
        mask = count_all.squeeze(-1) >= 1                                  # the host sync torch has too
        count_all, mean_all, invstd_all = count_all[mask], mean_all[mask], invstd_all[mask]
        # batch_norm_gather_stats_with_counts: Chan's merge of the ranks' (n, mean, var)
        n = count_all                                                      # [R, 1]
        total = n.sum()
        mean = (n * mean_all).sum(0) / total
        var_all = 1.0 / invstd_all.square() - eps
        var = ((n * var_all).sum(0) + (n * (mean_all - mean).square()).sum(0)) / total
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
                running_var.mul_(1 - momentum).add_(var * total / (total - 1), alpha=momentum)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group = group
        if x.numel() == 0:
            return torch.empty_like(x)
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)  # batch_norm_elemt

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, invstd, total = ctx.saved_tensors
        dy = dy.contiguous()
        channels = x.shape[1]
        dx = dw = db = None
        if x.numel() > 0:
            # batch_norm_backward_reduce: sum dy, sum dy * (x - mean) (= sum dy * xhat / invstd)
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, None, None, None, mean, invstd, True, 0.0, [False, True, True])
            sum_dy_xmu = sum_dy_xhat / invstd
            if weight is not None:
                dw, db = sum_dy_xhat, sum_dy.clone()
            if ctx.needs_input_grad[0]:
                combined = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(combined, dist.ReduceOp.SUM, ctx.group)
                sum_dy, sum_dy_xmu = torch.split(combined, channels)
                # batch_norm_backward_elemt
                w = torch.ones_like(invstd) if weight is None else weight
                shape = (1, -1) + (1,) * (x.dim() - 2)
                mean_dy = (sum_dy / total).view(shape)
                mean_dy_xmu = (sum_dy_xmu / total).view(shape)
                m, s = mean.view(shape), invstd.view(shape)
                dx = (dy - mean_dy - (x - m) * s * s * mean_dy_xmu) * s * w.view(shape)
        elif ctx.needs_input_grad[0]:
            dist.all_reduce(torch.zeros(2 * channels, dtype=x.dtype), dist.ReduceOp.SUM, ctx.group)
        return dx, dw, db, None, None, None, None, None, None


class TorchSyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """``torch.nn.SyncBatchNorm``'s module (training mode, momentum given) over ``_TorchSyncBatchNormCPU``."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, process_group=None):
        super().__init__(num_features, eps, momentum, affine, True)
        self.process_group = process_group

    def _check_input_dim(self, x):
        pass

    def forward(self, x):
        self.num_batches_tracked.add_(1)
        return _TorchSyncBatchNormCPU.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, self.momentum, self.process_group,
                                            dist.get_world_size(self.process_group))


# ---------------------------------------------------------------------------------------------- counting
def count_collectives(fn: Callable[[], object]) -> dict:
    """Run ``fn`` once with ``torch.distributed``'s collectives wrapped; returns {name: calls}."""
    counts = {}
    saved = {name: getattr(dist, name) for name in COUNTED if hasattr(dist, name)}

    def wrap(name, f):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return f(*args, **kwargs)
        return counted

    try:
        for name, f in saved.items():
            setattr(dist, name, wrap(name, f))
        fn()
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)
    return counts


def _counts_text(counts: dict) -> str:
    return " + ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none"


# ---------------------------------------------------------------------------------------------- one rank
def _rank(rank: int, world: int, prof: dict):
    from parallel_layers.data_parallel.sync_batchnorm import SyncBatchNorm

    group = dist.group.WORLD
    out = []
    for shape in prof["shapes"]:
        channels = shape[1]
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(*shape, generator=g) * 2 + 3
        gy = torch.randn(*shape, generator=g)
        ours = SyncBatchNorm(channels, process_group=group)
        base = TorchSyncBatchNorm(channels, process_group=group)

        def step(layer):
            xi = x.detach().requires_grad_()
            y = layer(xi)
            return torch.autograd.grad(y, (xi, layer.weight, layer.bias), gy)

        got, want = step(ours), step(base)
        err = max(float((a - b).abs().max()) for a, b in zip(got, want))
        counts = (count_collectives(lambda: step(ours)), count_collectives(lambda: step(base)))
        for _ in range(prof["warmup"]):
            step(ours)
            step(base)
        t_ours, t_base = [], []
        for i in range(prof["reps"]):
            pair = [(t_ours, ours), (t_base, base)]
            for samples, layer in (pair if i % 2 == 0 else pair[::-1]):
                samples.append(harness.slowest_rank_ms(lambda layer=layer: step(layer), group))
        out.append(dict(shape=shape, ours=t_ours, base=t_base, counts=counts, err=err))
    return out if rank == 0 else None


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None, *,
            world: int = 2) -> List[dict]:
    """Rows of ``mode`` (smoke | quick | full): CPU, ``world`` gloo ranks of one thread each (``device`` is
    ignored: the comparison needs the gloo ranks). Writes no CSV, prints nothing."""
    prof = PROFILES[mode]
    if progress:
        progress(f"{len(prof['shapes'])} shapes x {world} ranks")
    res = harness.run_ranks(_rank, world, (prof,), timeout_s=900, retain_memory=True)[0]
    cpu = torch.device("cpu")
    common = dict(harness.common_fields(mode, cpu, 1), dtype="fp32", backend="torch")
    rows = []
    for r in res:
        ours_c, base_c = r["counts"]
        rows.append(harness.comparison_row(
            common, "sync_batchnorm", r["ours"], r["base"], sizes="x".join(map(str, r["shape"])) + f" /rank x{world}",
            baseline=(f"torch SyncBatchNorm algorithm on CPU ({world} gloo ranks); collectives per layer: ours "
                      f"{_counts_text(ours_c)}, torch {_counts_text(base_c)}; max |diff| {r['err']:.1e}"),
            ours_collectives=sum(ours_c.values()), base_collectives=sum(base_c.values())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny shapes (a few seconds, no CSV)",
                             quick_help="two shapes, fewer repetitions")
    harness.add_csv_args(ap, csv_path=f"{harness.RESULTS_DIR}/{CSV_NAME}")
    args = ap.parse_args(argv)
    rows = collect(harness.profile_of(args), torch.device("cpu"))
    r0 = rows[0]
    print(f"device: {r0['device']}; torch {r0['torch']}; 2 gloo ranks x 1 thread; forward + backward of one layer")
    harness.print_and_append(rows, harness.csv_target(args, args.csv))
    for r in rows:
        print(f"{r['sizes']}: {r['baseline']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
