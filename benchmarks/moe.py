"""Mixture of Experts over expert parallelism: step time, all-to-all bytes, load balance (CPU, gloo ranks).

    python -m benchmarks.moe                   # full: hidden 256, 8 experts, top-2, 4096 tokens per rank
    python -m benchmarks.moe --quick           # small sizes, well under a minute on 2 cores
    python -m benchmarks.moe --smoke --no-csv  # tiny, seconds; never writes CSV

1. **step**: forward + backward (router losses included) of one MoE block, ``MoELayer`` in one process at
   ep 1, ``ExpertParallelMoE`` over gloo ranks at ep 2 and 4, each rank its own ``T`` tokens (ep ranks process
   ``ep * T`` in all). A step's time is the slowest rank's, the ranks starting at a barrier. Each ep is set
   against one process (every core's threads) doing the same ``ep * T`` tokens, timed in this process. On a
   machine with fewer cores than ranks (2 cores here), the ranks share the cores: the ratio measures the
   overhead of expert parallelism (routing exchange, all-to-alls, gloo's copies), not a speedup.
2. **bytes**: what each rank hands ``torch.distributed`` in one forward and one backward, counted by wrapping
   ``all_to_all_single`` and ``all_reduce`` (:class:`SentBytes`), set beside the formula of
   ``parallel_layers/moe/expert_parallel.py``'s docstring evaluated on the routing decisions
   (:func:`formula_bytes`); the difference must be 0. Bytes a rank keeps for itself are not sent and not
   counted (gloo copies them locally).
3. **balance**: the reference MoE GPT trained through ``Parallel3D`` at ep 2 on the demo corpus (the stdlib's
   Python sources, bytes as tokens), once with the load-balancing loss (coef 0.01) and once without: per layer,
   the assignments per expert over the whole batch and max/mean, at the first and the last step.

Rows go to ``benchmarks/results/moe.csv`` (``collect`` returns them for the suite): the step rows as every
comparison row (ours: the ep ranks; baseline: one process), the bytes and balance rows with their figure in
``x`` and the detail in ``baseline``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from . import harness

CSV_NAME = "moe.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
COEF = 0.01                      # the load-balancing loss coefficient of the step and the "on" balance run
PROFILES = {
    # H hidden, I expert width (GPTConfig's default 4H / k), E experts, k top-k, T tokens per rank
    "full": dict(H=256, I=512, E=8, k=2, T=4096, eps=(1, 2, 4), reps=10, warmup=2, steps=50, batch=16,
                 gpt=dict(vocab_size=256, n_layer=4, n_head=4, d_model=128, max_seq_len=128), lr=1e-3),
    "quick": dict(H=64, I=128, E=8, k=2, T=256, eps=(1, 2, 4), reps=5, warmup=1, steps=30, batch=8,
                  gpt=dict(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=64), lr=1e-3),
    "smoke": dict(H=32, I=64, E=4, k=2, T=32, eps=(1, 2), reps=2, warmup=1, steps=3, batch=4,
                  gpt=dict(vocab_size=256, n_layer=1, n_head=2, d_model=32, max_seq_len=16), lr=1e-3),
}
OVERHEAD_NOTE = ("ranks share the machine's cores: on 2 cores the ep rows measure the overhead of expert "
                 "parallelism (exchanges, gloo's copies, contention), not a speedup")


# ------------------------------------------------------------------------------------------- bytes
class SentBytes:
    """While active, records every ``torch.distributed.all_to_all_single`` and ``all_reduce`` this process
    makes: ``calls`` holds ``(op, dtype, bytes sent to other ranks, bytes of the whole buffer)``. The layer
    reaches them through ``parallel_layers.distributed.collectives``, which looks them up on the module at
    each call, so patching the module's attributes sees every call."""

    def __init__(self):
        self.calls: List[tuple] = []

    def __enter__(self) -> "SentBytes":
        self._saved = dist.all_to_all_single, dist.all_reduce
        a2a, all_reduce = self._saved

        def counted_a2a(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
            n, me = dist.get_world_size(group), dist.get_rank(group)
            splits = list(input_split_sizes) if input_split_sizes else [input.shape[0] // n] * n
            row = math.prod(input.shape[1:]) * input.element_size()          # a row: whatever follows dim 0
            self.calls.append(("all_to_all", input.dtype, (sum(splits) - splits[me]) * row, sum(splits) * row))
            return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

        def counted_all_reduce(tensor, *args, **kw):
            size = tensor.numel() * tensor.element_size()
            self.calls.append(("all_reduce", tensor.dtype, size, size))
            return all_reduce(tensor, *args, **kw)

        dist.all_to_all_single, dist.all_reduce = counted_a2a, counted_all_reduce
        return self

    def __exit__(self, *exc) -> None:
        dist.all_to_all_single, dist.all_reduce = self._saved

    def forward_exchanges(self) -> Dict[str, int]:
        """Bytes sent to other ranks by one ExpertParallelMoE forward's collectives, by name: its all-to-alls
        are the counts (int64), then the rows' dispatch and combine (module docstring, steps 2, 3 and 5)."""
        a2a = [c for c in self.calls if c[0] == "all_to_all"]
        assert len(a2a) == 3 and a2a[0][1] == torch.int64, f"expected counts, dispatch, combine; got {a2a}"
        out = {"counts": a2a[0][2], "dispatch": a2a[1][2], "combine": a2a[2][2]}
        out["aux all-reduce"] = sum(c[3] for c in self.calls if c[0] == "all_reduce")
        return out


def formula_bytes(counts: torch.Tensor, rank: int, hidden: int, element_size: int, *, aux_loss: bool = True,
                  z_loss: bool = False) -> Dict[str, int]:
    """The bytes rank ``rank`` sends per forward by the docstring's formula, from the routing decisions
    ``counts [ep, E]`` (row ``q``: the assignments rank ``q``'s router kept per expert). Dispatch sends the
    rank's assignments to other ranks' experts, combine sends back the rows other ranks' tokens sent to its
    experts, each row ``hidden * element_size`` bytes; the counts exchange sends ``E/ep`` int64 to each peer.
    The losses' all-reduce (whose bytes on the wire depend on gloo's algorithm: this is the buffer) sums ``E + 1``
    fp64 numbers, ``E`` more with the load-balancing loss and 1 more with the z loss (none when both are off)."""
    ep, experts = counts.shape
    local = experts // ep
    mine = slice(rank * local, (rank + 1) * local)
    own = int(counts[rank, mine].sum())
    return {"counts": (ep - 1) * local * 8,
            "dispatch": (int(counts[rank].sum()) - own) * hidden * element_size,
            "combine": (int(counts[:, mine].sum()) - own) * hidden * element_size,
            "aux all-reduce": 8 * (experts + 1 + experts * aux_loss + z_loss) if aux_loss or z_loss else 0}


# ------------------------------------------------------------------------------------------- step
def _layer(p: dict, group=None):
    """The MoE block: ``MoELayer`` from seed 0, or its expert-parallel copy over ``group``; the router's
    load-balancing loss trained through the output's backward (``aux_loss_scale``), as the GPT does."""
    from parallel_layers.moe import ExpertParallelMoE, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(p["H"], p["I"], p["E"], p["k"], aux_loss_coef=COEF)
    layer.aux_loss_scale = 1.0
    return layer if group is None else ExpertParallelMoE.from_dense(layer, group)


def _tokens(p: dict, rank: int):
    """Rank ``rank``'s tokens and the gradient its output receives (one process takes every rank's)."""
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(p["T"], p["H"], generator=g), torch.randn(p["T"], p["H"], generator=g)


def _step(layer, x, upstream):
    def run():
        x.grad = None
        for q in layer.parameters():
            q.grad = None
        layer(x).backward(upstream)
    return run


def _one_process(p: dict, ranks: int):
    """A step of the one-process block on the tokens of ``ranks`` ranks together."""
    parts = [_tokens(p, r) for r in range(ranks)]
    return _step(_layer(p), torch.cat([a for a, _ in parts]).requires_grad_(), torch.cat([b for _, b in parts]))


def _ep_rank(rank: int, world: int, p: dict, alone: List[int]):
    """One rank of ep ``world``: the bytes of one forward and one backward against the formula, then the step
    times (slowest rank's). Rank 0 also times one process on the tokens of each of ``alone`` ranks, with
    every core's threads while the others wait at a barrier, interleaved rep by rep with the ep steps (the
    harness's rule: drift from other processes hits both sides alike)."""
    group = dist.group.WORLD
    layer = _layer(p, group)
    x, upstream = _tokens(p, rank)
    x.requires_grad_()
    with SentBytes() as fwd:
        out = layer(x)
    with SentBytes() as bwd:
        out.backward(upstream)
    counts = [torch.zeros_like(layer.stats["counts"]) for _ in range(world)]
    dist.all_gather(counts, layer.stats["counts"], group=group)
    backward = sum(c[2] for c in bwd.calls if c[0] == "all_to_all")
    formula = formula_bytes(torch.stack(counts), rank, p["H"], x.element_size())
    result = {"bytes": {"sent": fwd.forward_exchanges(), "backward": backward, "formula": formula},
              "ms": [], "alone_ms": {n: [] for n in alone}}
    step = _step(layer, x, upstream)
    baselines = {n: _one_process(p, n) for n in alone} if rank == 0 else {}
    cores = os.cpu_count() or 1
    for i in range(p["warmup"] + p["reps"]):
        ms = harness.slowest_rank_ms(step, group)
        for n, base in baselines.items():
            torch.set_num_threads(cores)
            base_ms = harness.time_call(base, torch.device("cpu"))
            torch.set_num_threads(1)
            if i >= p["warmup"]:
                result["alone_ms"][n].append(base_ms)
        dist.barrier(group)
        if i >= p["warmup"]:
            result["ms"].append(ms)
    return result


# ------------------------------------------------------------------------------------------- balance
def _balance_rank(rank: int, world: int, p: dict):
    """The MoE GPT trained at ep ``world`` with the load-balancing loss on and off: per coefficient, the whole
    batch's assignments per expert, per layer, at the first and the last step, and the losses."""
    from parallel_layers import OptimizerConfig, Parallel3D, ParallelMesh, PipelineConfig
    from parallel_layers.cli.demo import get_batch, load_corpus
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.moe.expert_parallel import moe_layers

    seq = p["gpt"]["max_seq_len"]
    corpus = load_corpus(1_000_000)
    mesh = ParallelMesh(ep=world)
    out = {}
    for coef in (COEF, 0.0):
        config = GPTConfig(**p["gpt"], num_experts=p["E"], moe_top_k=p["k"], moe_aux_loss_coef=coef)
        model = Parallel3D(config, mesh, seed=0, optimizer=OptimizerConfig(lr=p["lr"]),
                           pipeline=PipelineConfig(num_microbatches=1))
        layers = [m for chunk in model.chunks for m in moe_layers(chunk)]
        seen, losses = {}, []
        for step in range(p["steps"]):
            x, y = get_batch(corpus, step, p["batch"], seq, seed=0)
            losses.append(model.train_step(x, y)["loss"])
            if step in (0, p["steps"] - 1):
                counts = torch.stack([m.stats["counts"] for m in layers])      # this rank's tokens
                dist.all_reduce(counts, group=mesh.ep_group)                    # the whole batch's
                seen[step + 1] = counts.tolist()
        out[coef] = {"counts": seen, "loss": (losses[0], losses[-1])}
    return out


def max_over_mean(counts: List[int]) -> float:
    return max(counts) * len(counts) / sum(counts)


# ------------------------------------------------------------------------------------------- collect
def _step_and_bytes(p: dict, common: dict, sizes: str, say) -> tuple:
    """The step rows (ep 1 from the first pool's one-process timings) and the bytes rows, with what the
    tables print."""
    rows, step_lines, byte_lines = [], [], []
    measured, first = {}, True
    for ep in [e for e in p["eps"] if e > 1]:
        say(f"step and bytes, ep={ep}")
        alone = [1, ep] if first and 1 in p["eps"] else [ep]
        per_rank = harness.run_ranks(_ep_rank, ep, (p, alone), timeout_s=900, retain_memory=True)
        first = False
        measured.update({n: (harness.Stats.of(ms), n) for n, ms in per_rank[0]["alone_ms"].items() if n == 1})
        measured[ep] = (harness.Stats.of(per_rank[0]["ms"]), harness.Stats.of(per_rank[0]["alone_ms"][ep]))
        for rank, r in enumerate(per_rank):
            sent, formula = r["bytes"]["sent"], r["bytes"]["formula"]
            byte_lines += [(ep, rank, name, sent[name], formula[name]) for name in formula]
            diff = sum(abs(sent[k] - formula[k]) for k in formula)
            rows.append(dict(common, case=f"moe_a2a_bytes ep={ep} rank={rank}", sizes=sizes, backend=f"gloo x{ep}",
                             x=sent["dispatch"] + sent["combine"], target="measured == formula",
                             met="yes" if diff == 0 else "no",
                             baseline="bytes sent to other ranks per forward: " + ", ".join(
                                 f"{k} {sent[k]} (formula {formula[k]})" for k in formula)
                             + f"; backward all-to-alls {r['bytes']['backward']}"))
    for ep in p["eps"]:
        if ep not in measured:
            continue
        ours, base = measured[ep] if ep > 1 else (measured[1][0], measured[1][0])
        tokens_s = ep * p["T"] / (ours.median_ms * 1e-3)
        row = harness.comparison_row(
            common, f"moe_step ep={ep}", ours, base, sizes=sizes, backend="one process" if ep == 1 else f"gloo x{ep}",
            x=tokens_s, target="-", met="-",
            baseline=f"one process, {os.cpu_count()} threads, {ep * p['T']} tokens (ratio = its time / ep's)")
        rows.insert(len(step_lines), row)
        step_lines.append((ep, ours, tokens_s, base, row["speedup"]))
    return rows, step_lines, byte_lines


def _balance(p: dict, common: dict, say) -> tuple:
    say("balance, ep=2")
    balance = harness.run_ranks(_balance_rank, 2, (p,), timeout_s=900)[0]
    gpt = f"GPT d{p['gpt']['d_model']} L{p['gpt']['n_layer']}, E={p['E']} k={p['k']}, {p['steps']} steps"
    rows = []
    for coef, res in balance.items():
        last = max(res["counts"])
        for layer, counts in enumerate(res["counts"][last]):
            first = res["counts"][1][layer]
            rows.append(dict(common, case=f"moe_balance aux={coef:g} layer={layer}", sizes=gpt, backend="gloo x2",
                             x=max_over_mean(counts), target="-", met="-",
                             baseline=f"max/mean step 1 {max_over_mean(first):.2f} -> step {last} "
                                      f"{max_over_mean(counts):.2f}; per expert {counts}"))
    return rows, balance


def collect(mode: str, device: Optional[torch.device] = None, progress: Optional[Callable[[str], None]] = None,
            *, out=sys.stderr) -> List[dict]:
    """The rows of one run (``device`` is ignored: CPU, gloo ranks); the tables are printed to ``out``."""
    p = PROFILES[mode]
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32")
    sizes = f"T={p['T']}/rank,H={p['H']},I={p['I']},E={p['E']},k={p['k']}"
    say = progress or (lambda text: None)
    print(f"moe: {common['device']} | {mode}: {sizes}, {p['reps']} reps | ep ranks: 1 thread each; one process: "
          f"{os.cpu_count()} threads | {os.cpu_count()} cores: {OVERHEAD_NOTE}", file=out)
    rows, step_lines, byte_lines = _step_and_bytes(p, common, sizes, say)
    balance_rows, balance = _balance(p, common, say)
    _print_tables(p, step_lines, byte_lines, balance, out)
    return rows + balance_rows


def _table(header: List[str], lines: List[List[str]]) -> str:
    widths = [max([len(h)] + [len(c[i]) for c in lines]) for i, h in enumerate(header)]
    text = ["  ".join(h.ljust(w) for h, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(text + ["  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines])


def _print_tables(p, step_lines, byte_lines, balance, out) -> None:
    print(f"\nMoE block forward+backward, {p['T']} tokens per rank ({OVERHEAD_NOTE}):", file=out)
    print(_table(["ep", "tokens", "ms median", "p20-p80", "tokens/s", "1 process ms", "1 process / ep"],
                 [[str(ep), str(ep * p["T"]), f"{s.median_ms:.1f}", f"{s.p20_ms:.1f}-{s.p80_ms:.1f}", f"{tps:,.0f}",
                   f"{b.median_ms:.1f}", f"{ratio:.2f}x"] for ep, s, tps, b, ratio in step_lines]), file=out)
    print("\nBytes each rank sends to other ranks per forward (the backward sends dispatch and combine again, "
          "swapped). Formula (parallel_layers/moe/expert_parallel.py): rows x hidden x 4 B, dispatch rows = this "
          "rank's assignments to other ranks' experts, combine rows = other ranks' assignments to this rank's "
          "experts; counts: (ep-1) x E/ep x 8 B; the losses' all-reduce: its buffer, (2E + 1) x 8 B:", file=out)
    print(_table(["ep", "rank", "exchange", "measured B", "formula B", "difference"],
                 [[str(ep), str(rank), name, f"{got:,}", f"{want:,}", f"{got - want:,}"]
                  for ep, rank, name, got, want in byte_lines]), file=out)
    print(f"\nLoad balance: assignments per expert over the whole batch, ep 2, {p['steps']} steps "
          f"(max/mean 1.00 = perfectly balanced):", file=out)
    lines = []
    for coef, res in balance.items():
        for step, per_layer in res["counts"].items():
            for layer, counts in enumerate(per_layer):
                lines.append([f"{coef:g}", str(step), str(layer), " ".join(map(str, counts)),
                              f"{max_over_mean(counts):.2f}"])
        lines.append([f"{coef:g}", "", "", f"loss {res['loss'][0]:.3f} -> {res['loss'][1]:.3f}", ""])
    print(_table(["aux coef", "step", "layer", "assignments per expert", "max/mean"], lines), file=out)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny sizes; never writes CSV", quick_help="small sizes, under a minute")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    rows = collect(harness.profile_of(args), out=sys.stdout)
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0 if all(r.get("met") != "no" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
