"""Dispatch tax: host time per call of every fused op and TP layer against the torch code it replaces.

    python -m benchmarks.dispatch --quick            # ~1 minute on 2 cores
    python -m benchmarks.dispatch --smoke --no-csv   # a few seconds: checks that it runs

Tiny tensors (a 4 x 16 x 16 input, flat buffers of 256 elements), CPU, one thread
(``torch.set_num_threads(1)``): the kernels take next to nothing, so what is timed is the Python and
dispatch work around them. For every public op of ``parallel_layers.ops`` (``ops/__init__.py``) the
baseline is that op's own torch reference (``reference_*`` beside it in ``ops/``), called with what the
op would hand its kernel; for the TP layers (``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding`` on a 1-rank gloo group made in this process) it is the torch module the layer
replaces, holding the same parameters (``nn.Linear`` then ``F.gelu``, ``nn.Linear``, ``nn.Embedding``):
both sides pay an ``nn.Module`` call. Rows ``fwd`` time the call; rows ``fwd+bwd`` (the
ops with a backward) time the call, ``.sum()`` and ``.backward()``.

Timing: ours and the baseline run *paired and interleaved* in one loop (a batch of ``inner`` calls of one,
then of the other, the order alternating), so load from other processes hits both alike; the table gives
the medians over the samples, per call, in microseconds, and the overhead (ours - torch).

Target: the overhead is at most 5 us per call (``fwd``) and 10 us (``fwd+bwd``); ``met`` says yes/no per
row. What cannot meet it and why is in each row's ``baseline`` column and in benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import time
from typing import Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F

from . import harness

ops = importlib.import_module("parallel_layers.ops")

CSV_NAME = "dispatch.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
PROFILES = {"full": dict(samples=200, inner=50, warmup=200), "quick": dict(samples=60, inner=20, warmup=50),
            "smoke": dict(samples=3, inner=3, warmup=2)}
TARGET_US = {"fwd": 5.0, "fwd+bwd": 10.0}


def _mod(name: str):
    return importlib.import_module(f"parallel_layers.ops.{name}")


def paired_us(ours: Callable[[], object], base: Callable[[], object], samples: int, inner: int,
              warmup: int) -> Tuple[List[float], List[float]]:
    """Per-call microseconds of ``ours`` and ``base``: ``samples`` pairs of ``inner``-call batches, interleaved."""
    for _ in range(warmup):
        ours()
        base()
    t_ours, t_base = [], []
    clock = time.perf_counter
    for i in range(samples):
        for first in ((ours, t_ours), (base, t_base)) if i % 2 == 0 else ((base, t_base), (ours, t_ours)):
            fn, out = first
            t0 = clock()
            for _ in range(inner):
                fn()
            out.append((clock() - t0) * 1e6 / inner)
    return t_ours, t_base


def _backward(fn: Callable[[], object]) -> Callable[[], None]:
    def run():
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.float().sum().backward()
    return run


def op_cases() -> Iterator[Tuple[str, str, str, Callable, Callable]]:
    """(case, phase, sizes, ours, baseline) for every public op of ``parallel_layers.ops``."""
    g = torch.Generator().manual_seed(0)
    lin = _mod("linear")

    def rnd(*shape, grad=False):
        t = torch.randn(*shape, generator=g)
        return t.requires_grad_() if grad else t

    # fused_linear: the case (4 x 16 x 16 input, gelu) and the activation-free one
    for act in ("gelu", None):
        x, w, b = rnd(4, 16, 16), rnd(16, 16), rnd(16)
        name = f"fused_linear[{act}]"
        yield (name, "fwd", "x 4x16x16, W 16x16",
               lambda x=x, w=w, b=b, act=act: ops.fused_linear(x, w, b, activation=act),
               lambda x=x, w=w, b=b, act=act: lin.reference_linear_epilogue(x, w, b, act, None))
        xg, wg, bg = rnd(4, 16, 16, grad=True), rnd(16, 16, grad=True), rnd(16, grad=True)
        yield (name, "fwd+bwd", "x 4x16x16, W 16x16",
               _backward(lambda act=act: ops.fused_linear(xg, wg, bg, activation=act)),
               _backward(lambda act=act: lin.reference_linear_epilogue(xg, wg, bg, act, None)))

    n = 256
    opt = _mod("optimizer_step")
    p, gr, m, v = rnd(n), rnd(n), torch.zeros(n), torch.zeros(n)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    one, zero = torch.ones(1), torch.zeros(1)
    yield ("adamw_step", "fwd", f"{n}",
           lambda: ops.adamw_step(p, gr, m, v, lr=1e-6, step=1),
           lambda: opt.reference_adamw_step(p2, gr, m2, v2, None, one, one, zero, 1e-6, 0.9, 0.999, 1e-8, 0.0,
                                            True, False))
    buf, buf2 = torch.zeros(n), torch.zeros(n)
    yield ("sgd_step", "fwd", f"{n}",
           lambda: ops.sgd_step(p, gr, buf, lr=1e-6, step=2, momentum=0.9),
           lambda: opt.reference_sgd_step(p2, gr, buf2, None, 2 * one, one, zero, 1e-6, 0.9, 0.0, 0.0, False, False))

    ts = [rnd(n) for _ in range(4)]
    ts2 = [t.clone() for t in ts]
    un = _mod("unscale_norm")
    yield ("unscale_and_norm", "fwd", f"4 x {n}",
           lambda: ops.unscale_and_norm(ts, inv_scale=1.0),
           lambda: un.reference_unscale_and_norm(ts2, one, torch.zeros(1), torch.empty(1), True))

    dsts = [torch.empty(n, dtype=torch.bfloat16) for _ in ts]
    cast = _mod("cast")
    yield ("multi_tensor_cast", "fwd", f"4 x {n} -> bf16",
           lambda: ops.multi_tensor_cast(ts, dsts),
           lambda: cast.reference_multi_tensor_cast(ts, dsts, one, torch.zeros(1)))

    bucket = torch.empty(4 * n)
    offs = [i * n for i in range(4)]
    bk = _mod("bucket")
    yield ("pack_bucket", "fwd", f"4 x {n}",
           lambda: ops.pack_bucket(ts, bucket),
           lambda: bk.reference_pack_bucket(ts, bucket, offs, one))
    yield ("unpack_bucket", "fwd", f"4 x {n}",
           lambda: ops.unpack_bucket(bucket, ts2, scale=1.0, accumulate=False),
           lambda: bk.reference_unpack_bucket(bucket, ts2, offs, one, False))

    xs = rnd(4, 8, 16)
    bs = _mod("batch_stats")
    yield ("batch_stats", "fwd", "4x8x16",
           lambda: ops.batch_stats(xs),
           lambda: bs.reference_batch_stats(xs, torch.empty(8), torch.empty(8)))

    logits = rnd(16, 8)
    rt = _mod("moe_routing")
    yield ("router_topk", "fwd", "16 tokens x 8 experts, k 2",
           lambda: ops.router_topk(logits, 2), lambda: rt.reference_router_topk(logits, 2))
    lg = rnd(16, 8, grad=True)
    yield ("router_topk", "fwd+bwd", "16 tokens x 8 experts, k 2",
           _backward(lambda: ops.router_topk(lg, 2)), _backward(lambda: rt.reference_router_topk(lg, 2)))

    pm = _mod("moe_permute")
    hidden, hg = rnd(16, 16), rnd(16, 16, grad=True)
    experts = torch.randint(0, 8, (16, 2), generator=g)
    yield ("permute_tokens", "fwd", "16 tokens x 16, k 2, 8 experts",
           lambda: ops.permute_tokens(hidden, experts, 8), lambda: pm.reference_permute(hidden, experts, 8, 32))
    yield ("permute_tokens", "fwd+bwd", "16 tokens x 16, k 2, 8 experts",
           _backward(lambda: ops.permute_tokens(hg, experts, 8)),
           _backward(lambda: pm.reference_permute(hg, experts, 8, 32)))
    _, order, _ = pm.reference_permute(hidden, experts, 8, 32)
    rows, rg = rnd(32, 16), rnd(32, 16, grad=True)
    wts, wg = torch.rand(16, 2, generator=g), torch.rand(16, 2, generator=g).requires_grad_()
    yield ("unpermute_tokens", "fwd", "32 rows x 16 -> 16 tokens",
           lambda: ops.unpermute_tokens(rows, order, wts, 16), lambda: pm.reference_unpermute(rows, order, wts, 16))
    yield ("unpermute_tokens", "fwd+bwd", "32 rows x 16 -> 16 tokens",
           _backward(lambda: ops.unpermute_tokens(rg, order, wg, 16)),
           _backward(lambda: pm.reference_unpermute(rg, order, wg, 16)))

    ba = _mod("block_attention")
    q, k, vv = rnd(1, 2, 8, 16), rnd(1, 2, 8, 16), rnd(1, 2, 8, 16)
    pos = torch.arange(8)
    seg = torch.zeros(1, 8, dtype=torch.int64)
    out, lse = torch.zeros(1, 2, 8, 16), torch.full((1, 2, 8), float("-inf"))
    out2, lse2 = out.clone(), lse.clone()
    yield ("block_attention_forward", "fwd", "q, k, v 1x2x8x16, causal",
           lambda: ops.block_attention_forward(q, k, vv, pos, pos, seg, seg, True, 0.25, out, lse),
           lambda: ba.reference_block_attention_forward(q, k, vv, pos, pos, seg, seg, True, 0.25, out2, lse2))
    ops.block_attention_forward(q, k, vv, pos, pos, seg, seg, True, 0.25, out, lse)
    dout, delta = rnd(1, 2, 8, 16), (out * rnd(1, 2, 8, 16)).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(vv)
    # with the queries' final ``out``, as ring attention (its one caller) hands it: on CPU the op then runs
    # ATen's flash backward; the reference takes ``delta`` alone
    yield ("block_attention_backward", "fwd", "q, k, v 1x2x8x16, causal",
           lambda: ops.block_attention_backward(q, k, vv, pos, pos, seg, seg, True, 0.25, lse, dout, delta,
                                                dq, dk, dv, out=out),
           lambda: ba.reference_block_attention_backward(q, k, vv, pos, pos, seg, seg, True, 0.25, lse, dout,
                                                         delta, dq, dk, dv))


@contextlib.contextmanager
def one_rank_group() -> Iterator[object]:
    """A 1-rank gloo group in this process (the default group if one exists already)."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if made:
            dist.destroy_process_group()


def layer_cases(group) -> Iterator[Tuple[str, str, str, Callable, Callable]]:
    from parallel_layers.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(0)
    x = torch.randn(4, 16, 16)
    col = ColumnParallelLinear(16, 16, tp_group=group, activation="gelu")
    row = RowParallelLinear(16, 16, tp_group=group)
    emb = VocabParallelEmbedding(64, 16, tp_group=group)
    ids = torch.randint(0, 64, (4, 16))
    # the torch modules the layers replace, holding the same parameters: an nn.Module call either way
    dense_col, dense_row, dense_emb = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Embedding(64, 16)
    dense_col.weight, dense_col.bias = col.weight, col.bias
    dense_row.weight, dense_row.bias = row.weight, row.bias
    dense_emb.weight = emb.weight
    for name, layer, base in (
            ("ColumnParallelLinear[gelu]", col, lambda t: F.gelu(dense_col(t))),
            ("RowParallelLinear", row, dense_row)):
        yield name, "fwd", "x 4x16x16, 16 -> 16, tp 1", lambda layer=layer: layer(x), lambda base=base: base(x)
        yield (name, "fwd+bwd", "x 4x16x16, 16 -> 16, tp 1", _backward(lambda layer=layer: layer(x)),
               _backward(lambda base=base: base(x)))
    yield ("VocabParallelEmbedding", "fwd", "ids 4x16, 64 x 16, tp 1", lambda: emb(ids), lambda: dense_emb(ids))
    yield ("VocabParallelEmbedding", "fwd+bwd", "ids 4x16, 64 x 16, tp 1", _backward(lambda: emb(ids)),
           _backward(lambda: dense_emb(ids)))


def row_of(common, group: str, case: str, phase: str, sizes: str, ours_us, base_us) -> Dict[str, object]:
    o, b = statistics.median(ours_us), statistics.median(base_us)
    overhead = o - b
    target = TARGET_US[phase]
    met = overhead <= target
    return harness.comparison_row(
        common, f"{case} {phase}", [t / 1e3 for t in ours_us], [t / 1e3 for t in base_us], group=group,
        sizes=sizes, dtype="float32", backend="auto", target=f"overhead <= {target:g} us", met="yes" if met else "no",
        baseline=f"torch reference; ours {o:.1f} us, torch {b:.1f} us, overhead {overhead:+.1f} us",
        ours_us=o, base_us=b, overhead_us=overhead)


def collect(profile: str, device: torch.device, progress=None) -> List[Dict[str, object]]:
    """The rows (``parallel_layers bench`` calls it as every benchmark's ``collect``). Always on CPU: host
    time is what is measured (``device`` is accepted for the suite's contract)."""
    del device
    p = PROFILES[profile]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        common = harness.common_fields(profile, torch.device("cpu"), 1)
        rows = []
        with one_rank_group() as group:
            for grp, cases in (("ops", op_cases()), ("tp", layer_cases(group))):
                for case, phase, sizes, ours, base in cases:
                    t_ours, t_base = paired_us(ours, base, p["samples"], p["inner"], p["warmup"])
                    rows.append(row_of(common, grp, case, phase, sizes, t_ours, t_base))
                    if progress is not None:
                        progress(f"dispatch {case} {phase}")
        return rows
    finally:
        torch.set_num_threads(threads)


def format_rows(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'case':40s} {'ours us':>8s} {'torch us':>8s} {'overhead':>9s}  target      met"]
    for r in rows:
        lines.append(f"{r['case']:40s} {r['ours_us']:8.1f} {r['base_us']:8.1f} {r['overhead_us']:+9.1f}  "
                     f"{r['target'].replace('overhead ', ''):11s} {r['met']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(parser, "a few calls per op: check that it runs", "fewer samples, ~1 minute")
    harness.add_csv_args(parser, CSV_PATH)
    args = parser.parse_args(argv)
    rows = collect(harness.profile_of(args), torch.device("cpu"))
    print(format_rows(rows))
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
