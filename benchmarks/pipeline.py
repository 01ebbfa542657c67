"""Pipeline parallelism on CPU gloo ranks (1 thread each): bubble, activation memory, step time vs torch.

    python -m benchmarks.pipeline            # p = 2 and 4, m = 4 and 8, GPT d 128, 8 layers, seq 64
    python -m benchmarks.pipeline --smoke    # tiny, seconds; no CSV unless --csv is given

For each (p, m), in the same processes on the same data, timed steps interleaved variant by variant:
* our GPipe, 1F1B and interleaved 1F1B (2 chunks per rank), the timeline recorded: measured bubble
  (mean over ranks of idle / step time) against 1F1B's ideal (p-1)/(m+p-1) (target within 15%), and
  interleaved below 1F1B;
* peak activation memory per stage, GPipe vs 1F1B: bytes of the tensors autograd saves, alive at once
  (``saved_tensors_hooks``, parameters excluded, one count per storage); target 1F1B <= p/m of GPipe;
* step time against ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B,
  ScheduleInterleaved1F1B) on the same split and microbatches (target ours/torch <= 1.0).
A step's time is the slowest rank's (all-reduce MAX outside the timed region), median of the reps.
p = 4 runs 4 processes on this 2-core machine: its idle times are distorted by oversubscription.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from typing import List, Optional

import torch
import torch.multiprocessing as mp

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "pipeline.csv")
MODELS = {"default": dict(vocab=256, n_layer=8, n_head=4, d_model=128, seq=64, mbs=2),
          "smoke": dict(vocab=64, n_layer=4, n_head=2, d_model=32, seq=16, mbs=1)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SavedBytes:
    """Peak bytes of autograd-saved activations alive at once (one count per storage; parameters,
    which are not activations, excluded)."""

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.refs, self.alive, self.peak = {}, 0, 0

    def hooks(self):
        meter = self

        class Handle:
            def __init__(self, t, key):
                self.t, self.key = t, key

            def __del__(self):
                meter.refs[self.key][0] -= 1
                if meter.refs[self.key][0] == 0:
                    meter.alive -= meter.refs.pop(self.key)[1]

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key in self.param_ptrs or key == 0:
                return t
            if key not in self.refs:
                self.refs[key] = [0, t.untyped_storage().nbytes()]
                self.alive += self.refs[key][1]
                self.peak = max(self.peak, self.alive)
            self.refs[key][0] += 1
            return Handle(t, key)

        def unpack(h):
            return h.t if isinstance(h, Handle) else h

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _worker(rank, world, port, model, ms, reps, warmup, png_path, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.pipeline import PipelineEngine, build_gpt_stages

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        cfgd = MODELS[model]
        # untied: torch.distributed.pipelining has no tied-weight support; same split for both
        cfg = GPTConfig(vocab_size=cfgd["vocab"], n_layer=cfgd["n_layer"], n_head=cfgd["n_head"],
                        d_model=cfgd["d_model"], max_seq_len=cfgd["seq"], tie_embeddings=False)
        group = dist.group.WORLD
        results = {}

        class TorchChunk(nn.Module):          # torch's stages return logits; loss_fn outside
            def __init__(self, stage):
                super().__init__()
                self.stage = stage

            def forward(self, x):
                return self.stage(x)

        def loss_fn(out, tgt):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), tgt.reshape(-1))

        for m in ms:
            g = torch.Generator().manual_seed(0)
            B = m * cfgd["mbs"]
            idx = torch.randint(0, cfg.vocab_size, (B, cfgd["seq"]), generator=g)
            tgt = torch.randint(0, cfg.vocab_size, (B, cfgd["seq"]), generator=g)
            variants = {}
            for sched, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
                torch.manual_seed(0)
                chunks = build_gpt_stages(cfg, rank, world, num_chunks=v)
                variants[f"ours_{sched}"] = (PipelineEngine(chunks, group, schedule=sched, num_microbatches=m,
                                                            record_timeline=True), chunks)
                torch.manual_seed(0)
                tchunks = build_gpt_stages(cfg, rank, world, num_chunks=v)
                stages = [PipelineStage(TorchChunk(c), c.stage_index, world * v, torch.device("cpu"), group=group)
                          for c in tchunks]
                cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[sched]
                schedule = cls(stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)
                variants[f"torch_{sched}"] = (schedule, tchunks)

            def run(name):
                obj, chunks = variants[name]
                for c in chunks:
                    c.zero_grad(set_to_none=False)
                if name.startswith("ours"):
                    obj.step(idx if rank == 0 else None, tgt if rank == world - 1 else None)
                elif rank == 0:
                    obj.step(idx)
                elif rank == world - 1:
                    obj.step(target=tgt, losses=[])
                else:
                    obj.step()

            times = {n: [] for n in variants}
            bubbles = {n: [] for n in variants if n.startswith("ours")}
            for i in range(warmup + reps):
                names = list(variants) if i % 2 == 0 else list(reversed(variants))
                for n in names:
                    dist.barrier()
                    t0 = time.perf_counter()
                    run(n)
                    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if i >= warmup:
                        times[n].append(t.item() * 1e3)
                        if n in bubbles:
                            tls = variants[n][0].gather_timeline()
                            if rank == 0:
                                bubbles[n].append(variants[n][0].bubble_fraction())
            # activation memory of one step, GPipe vs 1F1B, this rank's stage
            mem = {}
            for n in ("ours_gpipe", "ours_1f1b"):
                engine, chunks = variants[n]
                meter = SavedBytes([p for c in chunks for p in c.parameters()])
                with meter.hooks():
                    run(n)
                mem[n] = meter.peak
            mems = [None] * world
            dist.all_gather_object(mems, mem)
            png = None
            if png_path and m == max(ms):
                for n in ("ours_1f1b", "ours_interleaved"):
                    run(n)
                    path = png_path.replace(".png", f"_{n[5:]}_p{world}_m{m}.png")
                    out = variants[n][0].draw_timeline(path)
                    png = png or out
            results[m] = {"times": times, "bubbles": bubbles, "mem": mems, "png": png}
        queue.put((rank, results, None))
    except Exception as exc:  # noqa: BLE001 - report, do not hang the parent
        import traceback
        queue.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _run(world, model, ms, reps, warmup, png_path):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, model, ms, reps, warmup, png_path, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    answers = {}
    deadline = time.time() + 900
    try:
        while len(answers) < world:
            # a rank that dies before reporting (e.g. it could not reach the store) must not hang us
            if time.time() > deadline or (queue.empty() and not all(p.is_alive() for p in procs)):
                time.sleep(1.0)
                if queue.empty():
                    raise RuntimeError(f"p={world}: a rank exited without a result or the run passed 900 s")
            if queue.empty():
                time.sleep(0.2)
                continue
            rank, res, err = queue.get()
            if err:
                raise RuntimeError(f"rank {rank} failed:\n{err}")
            answers[rank] = res
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return answers[0]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 rep, p = 2 only")
    ap.add_argument("--pp", default="2,4", help="pipeline sizes")
    ap.add_argument("--microbatches", default="4,8")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--csv", default=None, help=f"CSV to append to (default {os.path.relpath(CSV_PATH)}; "
                    "--smoke writes none unless given)")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    model = "smoke" if args.smoke else "default"
    pps = [2] if args.smoke else [int(x) for x in args.pp.split(",")]
    ms = [int(x) for x in args.microbatches.split(",")]
    reps, warmup = (1, 1) if args.smoke else (args.reps, args.warmup)
    csv_path = None if args.no_csv else (args.csv or (None if args.smoke else CSV_PATH))
    png_base = None if args.smoke else os.path.join(harness.RESULTS_DIR, "pipeline_timeline.png")
    common = dict(run_id=harness.now_iso(), date=harness.now_iso(), mode="smoke" if args.smoke else "full",
                  dtype="float32", backend="gloo", device=harness.device_name(torch.device("cpu")), threads=1,
                  **harness.versions())
    rows = []
    print(f"model {MODELS[model]} (untied), gloo, 1 thread per rank, median of {reps} steps")
    print(f"{'p':>2} {'m':>2} {'schedule':<12} {'ours ms':>9} {'torch ms':>9} {'ratio':>6} {'bubble':>7} "
          f"{'ideal':>6} {'act MB/stage (ours)':>22}")
    for p in pps:
        res = _run(p, model, ms, reps, warmup, png_base)
        for m in ms:
            r = res[m]
            ideal = (p - 1) / (m + p - 1)
            for sched in ("gpipe", "1f1b", "interleaved"):
                ours, base = harness.Stats.of(r["times"][f"ours_{sched}"]), harness.Stats.of(r["times"][f"torch_{sched}"])
                bubble = statistics.median(r["bubbles"][f"ours_{sched}"])
                mem = [mm.get(f"ours_{sched}") for mm in r["mem"]]
                mem_s = "/".join(f"{x / 2**20:.1f}" for x in mem) if mem[0] is not None else "-"
                print(f"{p:>2} {m:>2} {sched:<12} {ours.median_ms:>9.1f} {base.median_ms:>9.1f} "
                      f"{ours.median_ms / base.median_ms:>5.2f}x {bubble:>7.1%} {ideal:>6.1%} {mem_s:>22}")
                sizes = f"p={p} m={m} " + " ".join(f"{k}={v}" for k, v in MODELS[model].items())
                rows.append(dict(common, case=f"step_{sched}", sizes=sizes, ours_median_ms=ours.median_ms,
                                 ours_p20_ms=ours.p20_ms, ours_p80_ms=ours.p80_ms, base_median_ms=base.median_ms,
                                 base_p20_ms=base.p20_ms, base_p80_ms=base.p80_ms,
                                 speedup=base.median_ms / ours.median_ms, target="ours/torch <= 1.0",
                                 met=ours.median_ms <= base.median_ms, baseline=f"torch.distributed.pipelining"))
                if sched == "1f1b":
                    rel = abs(bubble - ideal) / ideal
                    rows.append(dict(common, case="bubble_1f1b", sizes=sizes, target=f"within 15% of {ideal:.4f}",
                                     met=rel <= 0.15, baseline=f"measured {bubble:.4f}, rel diff {rel:.3f}"))
            b1 = statistics.median(r["bubbles"]["ours_1f1b"])
            bi = statistics.median(r["bubbles"]["ours_interleaved"])
            ratios = [mm["ours_1f1b"] / mm["ours_gpipe"] for mm in r["mem"]]
            print(f"   bubble interleaved {bi:.1%} vs 1F1B {b1:.1%} ({'below' if bi < b1 else 'NOT below'}); "
                  f"activation memory 1F1B/GPipe per stage {', '.join(f'{x:.2f}' for x in ratios)} "
                  f"(target <= p/m = {p / m:.2f})")
            rows.append(dict(common, case="bubble_interleaved_vs_1f1b", sizes=f"p={p} m={m}", target="below 1F1B",
                             met=bi < b1, baseline=f"interleaved {bi:.4f} vs 1f1b {b1:.4f}"))
            rows.append(dict(common, case="act_memory_1f1b_over_gpipe", sizes=f"p={p} m={m}",
                             target=f"<= p/m = {p / m:.3f}", met=max(ratios) <= p / m + 1e-9,
                             baseline="per stage " + " ".join(f"{x:.3f}" for x in ratios)))
        if r.get("png"):
            print(f"   timeline: {r['png']}")
    if csv_path:
        harness.append_csv(csv_path, rows)
        print(f"appended {len(rows)} rows to {csv_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
