"""Single-process data parallelism (one thread per device) against process-per-device data parallelism and
one device, on the same GPT and the same global batch: step time and the data exchanged per batch.

    python -m benchmarks.single_process_dp            # full: GPT d 256, 6 layers, vocab 8192, 8 x 128 tokens
    python -m benchmarks.single_process_dp --quick    # d 128, 4 layers, vocab 2048, 8 x 64 tokens
    python -m benchmarks.single_process_dp --smoke    # tiny, seconds; never writes CSV

A step is ``zero_grad`` + forward + backward of the whole global batch (the optimizer step is the same for
every variant and left out); the loss is the whole batch's mean. Variants, each timed in turn per
repetition (median of the timed repetitions after warm-up):

* ``one_device``: the model on one device, the whole batch (the baseline of every row);
* ``single_process``: :class:`~parallel_layers.SingleProcessDataParallel` over ``n`` devices (on CPU, ``n``
  worker threads), torch's intra-op threads left at the process default (every replica's ops may use every
  core);
* ``single_process_1thread``: the same with ``torch.set_num_threads(cores // n)`` while it runs (the
  replicas' threads split the cores instead of oversubscribing them);
* ``processes``: our :class:`~parallel_layers.DataParallel` on ``n`` gloo processes of one intra-op thread
  each, ``batch / n`` rows each (the slowest rank's step);
* ``torch.nn.DataParallel``: on ``n`` CUDA devices only (on CPU it does not replicate: with no CUDA device it
  runs the module alone), so on a CPU machine its row says "needs CUDA" and has no time.

Exchanges per batch: the single-process form's five (inputs scattered, parameters replicated, outputs
gathered, output gradients scattered, gradients reduced; :class:`ExchangeLog`, bytes included) against the
processes' one (the gradients' all-reduce, in its buckets, overlapped with backward).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import harness

CSV_NAME = "single_process_dp.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
PROFILES = {
    "full": dict(vocab=8192, layers=6, heads=4, d=256, seq=128, batch=8, devices=2, reps=7, warmup=2),
    "quick": dict(vocab=2048, layers=4, heads=4, d=128, seq=64, batch=8, devices=2, reps=5, warmup=2),
    "smoke": dict(vocab=64, layers=1, heads=2, d=16, seq=8, batch=4, devices=2, reps=2, warmup=1),
}


def _gpt(prof: dict, device):
    from parallel_layers.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=prof["vocab"], n_layer=prof["layers"], n_head=prof["heads"], d_model=prof["d"],
                    max_seq_len=prof["seq"], dropout=0.0)
    torch.manual_seed(0)
    return GPT(cfg, device=device)


def _batch(prof: dict, device, rows=None):
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g)
    tgt = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g)
    if rows is not None:
        idx, tgt = idx[rows], tgt[rows]
    return idx.to(device), tgt.to(device)


def _loss(logits, tgt):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def _processes_rank(rank: int, world: int, prof: dict):
    """One gloo rank of our process-per-device DataParallel: its step times (slowest rank's), buckets, bytes."""
    import torch.distributed as dist

    from parallel_layers.data_parallel import DataParallel

    per = prof["batch"] // world
    model = DataParallel(_gpt(prof, "cpu"), dist.group.WORLD)
    idx, tgt = _batch(prof, "cpu", slice(rank * per, (rank + 1) * per))

    def step():
        model.zero_grad()
        _loss(model(idx)[0], tgt).backward()   # DataParallel averages over ranks: the global batch's mean

    times = []
    for i in range(prof["warmup"] + prof["reps"]):
        t = harness.slowest_rank_ms(step)
        if i >= prof["warmup"]:
            times.append(t)
    grad_bytes = sum(b.numel for b in model.buffer.buckets) * 4
    return times, len(model.buffer.buckets), grad_bytes


def _with_threads(n: Optional[int], fn: Callable[[], object]) -> Callable[[], object]:
    if n is None:
        return fn

    def run():
        old = torch.get_num_threads()
        torch.set_num_threads(n)
        try:
            return fn()
        finally:
            torch.set_num_threads(old)
    return run


def measure(prof: dict, device: torch.device, processes: bool = True) -> Dict[str, dict]:
    """Per variant: step times (ms); the single-process form's exchange log; the processes' buckets and
    gradient bytes (``processes=False``: that variant left out, for a smoke test that runs it elsewhere)."""
    from parallel_layers import SingleProcessDataParallel

    n = prof["devices"]
    devices = [torch.device(f"cuda:{i}") for i in range(n)] if device.type == "cuda" else [device] * n
    idx, tgt = _batch(prof, devices[0])
    one = _gpt(prof, devices[0])
    spdp = SingleProcessDataParallel(_gpt(prof, devices[0]), devices)
    variants: Dict[str, dict] = {"one_device": dict(model=one, fwd=one)}
    variants["single_process"] = dict(model=spdp.module, fwd=spdp)
    cores = max(1, torch.get_num_threads() // n)
    variants["single_process_1thread"] = dict(model=spdp.module, fwd=spdp, threads=cores)
    if device.type == "cuda" and torch.cuda.device_count() >= n:
        tdp = torch.nn.DataParallel(_gpt(prof, devices[0]), device_ids=list(range(n)))
        variants["torch_dataparallel"] = dict(model=tdp.module, fwd=tdp)
    for v in variants.values():
        def step(v=v):
            v["model"].zero_grad()
            _loss(v["fwd"](idx)[0], tgt).backward()
        v["step"] = _with_threads(v.get("threads"), step)
        v["times"] = []
    names = list(variants)
    for i in range(prof["warmup"] + prof["reps"]):
        for name in (names if i % 2 == 0 else names[::-1]):
            t = harness.time_call(variants[name]["step"], device)
            if i >= prof["warmup"]:
                variants[name]["times"].append(t)
    variants["single_process"]["exchanges"] = spdp.exchanges.summary()
    spdp.close()
    if device.type == "cpu" and processes:
        times, buckets, grad_bytes = harness.run_ranks(_processes_rank, n, (prof,), timeout_s=1800,
                                                       retain_memory=True)[0]
        variants["processes"] = dict(times=times, buckets=buckets, grad_bytes=grad_bytes)
    return variants


def _exchanges_text(log: Dict[str, Dict[str, int]]) -> str:
    mb = sum(v["bytes"] for v in log.values()) / 2**20
    parts = ", ".join(f"{k} {v['bytes'] / 2**20:.2f} MB" for k, v in log.items())
    return f"{len(log)} exchanges per batch, {mb:.2f} MB ({parts})"


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            processes: bool = True) -> List[dict]:
    prof = PROFILES[mode]
    n = prof["devices"]
    if progress:
        progress(f"{n} devices: one device, single-process (threads), processes")
    runs = measure(prof, device, processes)
    common = dict(harness.common_fields(mode, device, torch.get_num_threads()), dtype="float32",
                  sizes=f"L{prof['layers']} d{prof['d']} V{prof['vocab']} batch {prof['batch']}x{prof['seq']}")
    base = runs["one_device"]["times"]
    spdp_text = _exchanges_text(runs["single_process"]["exchanges"])
    rows = []
    for name, run in runs.items():
        if name == "one_device":
            continue
        if name.startswith("single_process"):
            backend = f"{n} threads" + (f", {run['threads']} intra-op each" if run.get("threads") else "")
            text = spdp_text
        elif name == "processes":
            backend = f"gloo x{n}, 1 thread each"
            text = (f"1 exchange per batch: the gradients' all-reduce ({run['buckets']} bucket(s), "
                    f"{run['grad_bytes'] / 2**20:.2f} MB per rank), overlapped with backward")
        else:
            backend = f"cuda x{n}"
            text = "torch.nn.DataParallel: 5 exchanges per batch (broadcast, scatter, gather, reduce-add)"
        rows.append(harness.comparison_row(dict(common, backend=backend), f"dp_{name}_vs_one_device",
                                           run["times"], base, baseline=f"one device, whole batch; {text}"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny model (seconds); never writes CSV",
                             quick_help="smaller model, fewer repetitions (see PROFILES)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    device = torch.device(args.device)
    rows = collect(mode, device, lambda text: print(f"  {text} ...", flush=True))
    print(f"{'case':<38} {'backend':<26} {'step ms':>9} {'one device ms':>14} {'speedup':>8}")
    for r in rows:
        print(f"{r['case']:<38} {r['backend']:<26} {r['ours_median_ms']:>9.1f} {r['base_median_ms']:>14.1f} "
              f"{r['speedup']:>7.2f}x")
    for r in rows:
        print(f"  {r['case']}: {r['baseline'].split('; ', 1)[1]}")
    if device.type == "cpu":
        print("  torch.nn.DataParallel: needs CUDA devices (on CPU it runs the module alone): no row")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
