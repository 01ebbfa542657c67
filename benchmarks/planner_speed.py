"""How long the layout planner takes to search a large cluster: a Llama-3-70B-like model on 1,024 H100s.

    python -m benchmarks.planner_speed [--quick|--smoke]   # full: every layout without cp (1,554); target 120 s

The model: the reference GPT at Llama 3 70B's sizes (80 blocks, d 8192, 64 heads, FFN 28672, vocabulary
128,256, untied, no biases), sequences of 8,192 tokens, global batch 1,024, bf16, 80 GiB a rank, the
``h100`` profile. The layouts: :func:`parallel_layers.planner.candidate_layouts` with cp 1 (dp x tp x pp,
ZeRO 1-3, every planned schedule at 1, 2 and 4 micro-batches a stage, checkpointing off and on), all
predicted by :func:`parallel_layers.planner.plan` in one process, timed from the first probe to the ranked
list. One row (``case`` planner_search_time) to benchmarks/results/planner_speed.csv: ``ours_median_ms``
the search's wall time, ``x`` the layouts predicted, ``met`` whether the first 1,000 of them (in the order
``candidate_layouts`` gives them, cold caches included) were predicted within 120 s; the baseline column
says both times. On a machine of more than one core a second row: the first 1,000 layouts searched again from
cold caches with their probes over one process a core (``plan --jobs``), end to end, against one process, and
whether its best layout is the one-process search's. Quick:
checkpointing off only (half the layouts); smoke: a 4-block model of the same widths, a dozen layouts, no CSV.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, List, Optional

import torch

from . import harness

CSV_NAME = "planner_speed.csv"
TARGET_S = 120.0
FIRST = 1000                     # the target: this many layouts predicted within TARGET_S


def request(smoke: bool = False):
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.planner import Request
    cfg = GPTConfig(vocab_size=128256, n_layer=4 if smoke else 80, n_head=64, d_model=8192, d_ff=28672,
                    max_seq_len=8192, bias=False, tie_embeddings=False)
    return Request(cfg, world=64 if smoke else 1024, global_batch=64 if smoke else 1024, seq_len=8192,
                   memory_bytes=80 * 2**30, precision="bf16")


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """Time one search (``device`` only names the run: the planner runs on the CPU)."""
    from parallel_layers.planner import candidate_layouts, load_profile, plan
    smoke = mode == "smoke"
    req = request(smoke)
    checkpoint = (False,) if mode != "full" else (False, True)
    layouts = list(candidate_layouts(req, zero=(1, 2, 3), cp=(1,), checkpoint=checkpoint,
                                     microbatch_factors=(1,) if smoke else (1, 2, 4)))
    n = sum(reason is None for _, reason in layouts)
    if progress:
        progress(f"planning {n} layouts of {req.describe_model()} on {req.world} ranks")
    started: List[float] = []          # when each layout's prediction began: the 1,001st marks the first 1,000 done
    t0 = time.perf_counter()
    ranked = plan(req, load_profile("h100"), layouts, progress=lambda name: started.append(time.perf_counter()))
    took = time.perf_counter() - t0
    first = min(FIRST, n)
    first_took = (started[first] if n > first else t0 + took) - t0
    best = ranked[0]
    text = (f"{n} layouts in {took:.1f} s ({took / max(n, 1) * 1e3:.0f} ms a layout; the first {first} in "
            f"{first_took:.1f} s); best "
            f"{best.layout.name()} {best.tokens_per_s:,.0f} tokens/s, {best.peak_bytes / 2**30:.1f} GiB"
            + ("" if best.feasible else " (none fits)"))
    print(f"planner search: {text}", file=sys.stderr, flush=True)
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="bf16", backend="meta")
    sizes = f"{req.describe_model()} on {req.world} h100, batch {req.global_batch} x {req.seq_len}"
    rows = [dict(common, case="planner_search_time", sizes=sizes, x=n, ours_median_ms=took * 1e3,
                 target=f"the first {FIRST:,} layouts < {TARGET_S:g} s (one process)",
                 met=bool(n >= FIRST and first_took < TARGET_S), baseline=text)]
    jobs = cores()
    if mode != "smoke" and jobs > 1 and n >= FIRST:
        rows.append(_parallel_row(req, layouts, jobs, ranked, first_took, common, sizes, progress))
    return rows


def cores() -> int:
    """The cores this machine lets the search use (``plan --jobs``)."""
    from parallel_layers.planner.cli import usable_cores
    return usable_cores()


def _parallel_row(req, layouts, jobs: int, serial, serial_s: float, common: dict, sizes: str, progress) -> dict:
    """The first 1,000 layouts searched with ``plan --jobs`` one process a core (probes over ``jobs`` processes,
    then the predictions), from cold caches, end to end, against the one-process search's first 1,000
    (``serial_s``); its best layout checked against the one-process search's best among the same layouts."""
    from parallel_layers.planner import load_profile, plan
    first, valid = [], 0
    for lay, reason in layouts:
        if valid == FIRST:
            break
        first.append((lay, reason))
        valid += reason is None
    if progress:
        progress(f"planning the first {valid} layouts again, probes over {jobs} processes")
    t0 = time.perf_counter()
    ranked = plan(req, load_profile("h100"), first, jobs=jobs)
    took = time.perf_counter() - t0
    names = {lay.name() for lay, _ in first}
    same = [p for p in serial if p.layout.name() in names][0]
    best = ranked[0]
    agree = best.layout.name() == same.layout.name() and best.tokens_per_s == same.tokens_per_s
    text = (f"the first {valid} layouts in {took:.1f} s over {jobs} processes (one a core; one process: "
            f"{serial_s:.1f} s), "
            f"best {best.layout.name()} {best.tokens_per_s:,.0f} tokens/s"
            + (", as the one-process search ranks them" if agree else f"; one process: {same.layout.name()}"))
    print(f"planner search: {text}", file=sys.stderr, flush=True)
    return dict(common, case=f"planner_search_time_first{FIRST}_jobs{jobs}", sizes=sizes, x=valid,
                ours_median_ms=took * 1e3, target="faster than one process, same best layout",
                met=bool(took < serial_s and agree), baseline=text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_profile_args(ap, smoke_help="a 4-block model, a dozen layouts; never writes CSV",
                             quick_help="checkpointing off only")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    rows = collect(mode, torch.device("cpu"), progress=lambda s: print(s, file=sys.stderr, flush=True))
    harness.print_and_append(rows, harness.csv_target(args, f"{harness.RESULTS_DIR}/{CSV_NAME}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
