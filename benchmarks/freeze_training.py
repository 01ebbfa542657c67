"""Freeze training (``parallel_layers.freeze_training``, after PipeTransformer) against the static layout: wall time
to the same training loss on the demo corpus, 4 ranks.

    python -m benchmarks.freeze_training            # full: GPT L8 d64, 640 steps, + static dp2 x pp2
    python -m benchmarks.freeze_training --quick    # the same model, 320 steps (a few minutes)
    python -m benchmarks.freeze_training --smoke    # tiny GPT, seconds; never writes CSV

PipeTransformer's setting is fine-tuning a pretrained model, whose bottom blocks have settled. So the
demo's GPT (bytes of the Python standard library's sources, tied embeddings, AdamW, clipping) is first
pretrained in one process on random windows of the first half of the corpus (untimed, once), and every
run then fine-tunes those weights, with a fresh optimizer, on the same batches of the second half:
epochs over a fixed set of windows, each epoch in its own order. The runs, in the same 4 processes, take
their steps interleaved (a step of each, in alternating order), so load from elsewhere on the machine
falls on all of them alike:

* ``static pp4``, the baseline: ``Parallel3D`` at dp 1 x pp 4 for every step;
* ``freeze elastic``: ``FreezeTrainer`` from dp 1 x pp 4, ``freeze="auto"`` (cap 0.5), ``layouts="auto"``:
  all four parts (AutoFreeze, AutoPipe, AutoDP, AutoCache);
* ``freeze keep-pp``: the same freezing with ``layouts="keep"``: frozen blocks leave the pipeline and the
  cache serves them, the pipeline keeps its 4 stages (AutoFreeze + AutoCache, stages re-balanced);
* (full only) ``static dp2 x pp2``: the layout the elastic run moves to, from the start.

Each step is timed on every rank from a common barrier and the slowest rank counts
(``harness.slowest_rank_ms``); a re-layout counts in the step it starts. The loss is smoothed over one
epoch of steps (a window that saw every sample once); the target is the highest of the runs' final
smoothed losses, so every run reaches it; each run's time to the target is the sum of its step times up
to the first step whose smoothed loss is at or below it. Speedup = the static run's time / the freeze
run's. Rows go to benchmarks/results/freeze_training.csv (``baseline``: the target, the layouts visited,
median step times, final smoothed losses).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "freeze_training.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
DEMO = dict(vocab_size=256, n_layer=8, d_model=64, n_head=4, max_seq_len=64)
AUTO = dict(interval=32, threshold=0.15, rate=0.25)          # a decision per epoch (512 samples / 16)
PROFILES = {
    "full": dict(size=DEMO, batch=16, microbatches=4, samples=512, steps=640, pretrain=800, auto=AUTO,
                 static_dp2=True),
    "quick": dict(size=DEMO, batch=16, microbatches=4, samples=512, steps=320, pretrain=200, auto=AUTO,
                  static_dp2=False),
    "smoke": dict(size=dict(vocab_size=256, n_layer=4, d_model=16, n_head=2, max_seq_len=16), batch=8,
                  microbatches=4, samples=32, steps=12, pretrain=2,
                  auto=dict(interval=2, threshold=10.0, rate=0.5, warmup_windows=1), static_dp2=False),
}
CORPUS_BYTES = 2_000_000
OPTIONS = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0, schedule="1f1b")


def _halves():
    from parallel_layers.cli.demo import load_corpus
    corpus = load_corpus(CORPUS_BYTES)
    return corpus[:corpus.numel() // 2], corpus[corpus.numel() // 2:]


def pretrained(size: dict, steps: int, batch: int) -> Dict[str, torch.Tensor]:
    """The GPT's weights after ``steps`` single-process AdamW steps on random windows of the first half."""
    from parallel_layers.cli.demo import get_batch
    from parallel_layers.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=False))
    opt = torch.optim.AdamW(model.parameters(), lr=OPTIONS["lr"], betas=OPTIONS["betas"],
                            weight_decay=OPTIONS["weight_decay"])
    text = _halves()[0]
    for step in range(steps):
        model(*get_batch(text, step, batch, size["max_seq_len"], seed=7))[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIONS["max_grad_norm"])
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _data(size: dict, samples: int, steps: int, batch: int) -> List[tuple]:
    """``steps`` of ``(inputs, targets, sample ids)``: epochs over ``samples`` fixed windows of the second
    half of the demo corpus, each epoch its own order."""
    seq = size["max_seq_len"]
    corpus = _halves()[1]
    starts = torch.randint(0, corpus.numel() - seq - 1, (samples,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()
    out, epoch = [], 0
    while len(out) < steps:
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(1000 + epoch))
        out += [(windows[ids, :-1], windows[ids, 1:], ids) for ids in order.split(batch) if len(ids) == batch]
        epoch += 1
    return out[:steps]


def _interleaved(models: Dict[str, object], data) -> Dict[str, dict]:
    """Every model's losses and step times (ms, slowest rank) on ``data``, a step of each in turn."""
    runs = {name: dict(losses=[], times=[]) for name in models}
    for i, (x, y, ids) in enumerate(data):
        for name in (list(models) if i % 2 == 0 else list(reversed(models))):
            model, box = models[name], {}
            extra = {"sample_ids": ids} if hasattr(model, "policy") else {}   # FreezeTrainer: for its prefix cache
            runs[name]["times"].append(harness.slowest_rank_ms(lambda: box.update(out=model.train_step(x, y, **extra))))
            runs[name]["losses"].append(box["out"]["loss"])
    for name, model in models.items():
        mesh = model.start if hasattr(model, "start") else model.mesh      # FreezeTrainer: the layout it began in
        runs[name]["start"] = f"dp{mesh.dp} x pp{mesh.pp}"
        runs[name]["history"] = [{k: e[k] for k in ("step", "frozen", "dp", "pp", "to", "seconds")}
                                 for e in getattr(model, "history", [])]
        if hasattr(model, "policy"):
            runs[name]["decisions"] = model.policy.decisions
    return runs


def _bench_rank(rank, world, size, weights, batch, microbatches, samples, steps, auto, static_dp2):
    from parallel_layers.composition.config import OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.freeze_training import AutoFreeze, FreezeTrainer
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(**size, dropout=0.0, bias=False, tie_embeddings=False)
    meshes: Dict[tuple, ParallelMesh] = {}

    def mesh(dp, pp):
        if (dp, pp) not in meshes:
            meshes[(dp, pp)] = ParallelMesh(dp=dp, pp=pp)
        return meshes[(dp, pp)]

    def gpt():
        torch.manual_seed(0)
        model = GPT(cfg)
        model.load_state_dict(weights)
        return model

    loss_fn = gpt().loss
    settings = dict(optimizer=OptimizerConfig(lr=OPTIONS["lr"], betas=OPTIONS["betas"],
                                              weight_decay=OPTIONS["weight_decay"],
                                              max_grad_norm=OPTIONS["max_grad_norm"]),
                    pipeline=PipelineConfig(schedule=OPTIONS["schedule"], num_microbatches=microbatches))
    models = {"static pp4": Parallel3D(gpt(), mesh(1, 4), loss_fn=loss_fn, **settings)}
    for name, layouts in (("freeze elastic", "auto"), ("freeze keep-pp", "keep")):
        models[name] = FreezeTrainer(gpt, dp=1, pp=4, loss_fn=loss_fn, freeze=AutoFreeze(cfg.n_layer, cap=0.5, **auto),
                                     layouts=layouts, mesh_factory=mesh, **settings)
    if static_dp2:
        models["static dp2 x pp2"] = Parallel3D(gpt(), mesh(2, 2), loss_fn=loss_fn, **settings)
    return _interleaved(models, _data(size, samples, steps, batch))


def smoothed(losses: List[float], window: int) -> List[float]:
    """The mean of the last ``window`` losses at every step (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(losses):
        total += v
        if i >= window:
            total -= losses[i - window]
        out.append(total / min(i + 1, window))
    return out


def time_to(losses: List[float], times_ms: List[float], target: float, window: int) -> Optional[float]:
    """Milliseconds of steps until the smoothed loss first reaches ``target`` (None: never)."""
    spent = 0.0
    for s, t in zip(smoothed(losses, window), times_ms):
        spent += t
        if s <= target:
            return spent
    return None


def analyse(runs: Dict[str, dict], window: int) -> Dict[str, dict]:
    """Per run: the smoothed final loss, the time to the common target, the median step time."""
    finals = {name: smoothed(r["losses"], window)[-1] for name, r in runs.items()}
    target = max(finals.values())
    out = {}
    for name, r in runs.items():
        times = sorted(r["times"])
        out[name] = dict(final=finals[name], target=target, time_ms=time_to(r["losses"], r["times"], target, window),
                         median_step_ms=times[len(times) // 2], history=r.get("history", []), start=r["start"])
    return out


def _layouts(run: dict) -> str:
    if not run["history"]:
        return f"{run['start']} throughout"
    return f"{run['start']} -> " + " -> ".join(f"step {e['step']}: {e['frozen']} frozen, dp{e['dp']} x pp{e['pp']}"
                                               for e in run["history"])


def _collect(mode: str, progress: Optional[Callable[[str], None]] = None):
    prof = PROFILES[mode]
    size = prof["size"]
    if progress:
        progress(f"pretraining {prof['pretrain']} steps in one process")
    weights = pretrained(size, prof["pretrain"], prof["batch"])
    if progress:
        progress(f"4 ranks, {prof['steps']} fine-tuning steps per run")
    runs = harness.run_ranks(_bench_rank, 4, (size, weights, prof["batch"], prof["microbatches"], prof["samples"],
                                               prof["steps"], prof["auto"], prof["static_dp2"]),
                             timeout_s=3600, retain_memory=True)[0]
    window = prof["samples"] // prof["batch"]
    res = analyse(runs, window)
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo",
                  sizes=f"GPT L{size['n_layer']} d{size['d_model']} V{size['vocab_size']} s{size['max_seq_len']} "
                        f"b{prof['batch']} m{prof['microbatches']} samples{prof['samples']} steps{prof['steps']} "
                        f"pretrained{prof['pretrain']}")
    base = res["static pp4"]
    rows = []
    for name in [n for n in res if n != "static pp4"]:
        r = res[name]
        if r["time_ms"] is None or base["time_ms"] is None:
            continue
        rows.append(harness.comparison_row(
            common, f"{name.replace(' ', '_').replace('-', '_')}_vs_static_pp4", [r["time_ms"]],
            [base["time_ms"]], target="speedup>1" if name.startswith("freeze") else "",       # static: for reference
            met=("yes" if base["time_ms"] > r["time_ms"] else "no") if name.startswith("freeze") else "",
            baseline=f"time to smoothed loss {r['target']:.4f}; {_layouts(r)}; median step "
                     f"{r['median_step_ms']:.1f} vs {base['median_step_ms']:.1f} ms; final smoothed loss "
                     f"{r['final']:.4f} vs {base['final']:.4f}"))
    return rows, res, runs


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: the CSV rows of ``mode`` (``device`` only names the run: the ranks are gloo on CPU)."""
    return _collect(mode, progress)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny GPT (seconds); never writes CSV",
                             quick_help="fewer steps (see PROFILES)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    rows, res, runs = _collect(mode, lambda text: print(f"  {text} ...", flush=True))
    print(f"{'run':<18} {'time to target':>15} {'median step':>12} {'final loss':>11}  layouts")
    for name, r in res.items():
        t = "not reached" if r["time_ms"] is None else f"{r['time_ms'] / 1e3:.2f} s"
        print(f"{name:<18} {t:>15} {r['median_step_ms']:>9.1f} ms {r['final']:>11.4f}  {_layouts(r)}")
    target = next(iter(res.values()))["target"]
    print(f"target: smoothed training loss {target:.4f} (the highest final one)")
    for row in rows:
        print(f"{row['case']}: speedup {row['speedup']:.2f}x")
    for name, run in runs.items():
        changed = [d for i, d in enumerate(run.get("decisions") or [])
                   if d["frozen"] != (run["decisions"][i - 1]["frozen"] if i else 0)]
        if run.get("decisions"):
            print(f"{name}: AutoFreeze froze " + ("; ".join(f"{d['frozen']} blocks after step {d['step']}"
                                                             for d in changed) or "nothing")
                  + f" ({len(run['decisions'])} windows decided)")
    harness.append_and_report(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
