"""Parameter servers against ``DataParallel``'s ring all-reduce: step time and bytes moved per step, gloo on CPU.

    python -m benchmarks.parameter_server            # 2, 4, 8 workers x 1, 2 servers; GPT of ~7.4M parameters
    python -m benchmarks.parameter_server --quick    # the same counts, GPT of ~1.1M, few reps (a couple of minutes)
    python -m benchmarks.parameter_server --smoke    # 2 workers x 2 servers, a tiny GPT, seconds; never writes CSV

For each (workers W, servers S): the parameter-server run (``ps_layout(S)`` over W + S ranks, a synchronous
``serve`` on the servers, ``ParameterServerWorker`` on the workers) against ``DataParallel`` (all-reduce, the
ring of gloo's allreduce) + ``FusedAdamW`` over the same W worker ranks, the same GPT and data: a step of
2 x seq tokens per worker, interleaved rep by rep in the same processes (the servers idle in their receive
while DataParallel steps). A parameter-server step is forward, backward (gradients pushed per bucket) and
the wait for the pulled parameters; a DataParallel step is forward, backward (buckets all-reduced) and the
optimizer step, which the servers take in the other. A barrier precedes each step; its time is the slowest
worker's. Median (p20-p80) after warm-up.

Bytes per step, per direction (sent; received is the same): measured by the ranks' own counters for the
parameter server (``step_traffic``: the busiest server's and a worker's), and predicted by
``predicted_bytes_per_step`` for both (``DataParallel``'s ring: ``2 (n - 1) / n`` of the model per rank). As
a cross-check of both, the machine's loopback byte counter (``/proc/net/dev``, every process on the machine:
only meaningful on an otherwise idle machine) over a few steps of each alone, divided by the ranks.

How it runs: ONE spawn of ``max(W + S)`` processes; a configuration uses ranks ``0..W+S-1`` (servers last)
while the others wait at a barrier. On a 2-core machine 4 to 10 processes oversubscribe the cores, so the
times measure the overheads under contention: a server competes with the workers for the same cores
instead of adding a machine's bandwidth. ``parameter_server.png`` (next to the CSV) plots both against the
number of workers beside the model, and the model's prediction for real networks.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "parameter_server.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
PLOT_PATH = os.path.join(harness.RESULTS_DIR, "parameter_server.png")
MODELS = {  # name: (vocab, n_layer, n_head, d_model, seq)
    "small": (16384, 4, 4, 256, 128),
    "1m": (2048, 4, 4, 128, 64),
    "smoke": (256, 2, 2, 32, 16),
}
CONFIGS = [(2, 1), (2, 2), (4, 1), (4, 2), (8, 1), (8, 2)]        # (workers, servers)
PROFILES = {
    "smoke": dict(model="smoke", reps=2, warmup=1, configs=[(2, 2)], lo_steps=1),
    "quick": dict(model="1m", reps=4, warmup=1, configs=CONFIGS, lo_steps=2),
    "full": dict(model="small", reps=10, warmup=2, configs=CONFIGS, lo_steps=3),
}
BUCKET_MB = 4.0
NIC_GBPS = (10, 100)          # the networks the model's prediction is drawn for, Gb/s per rank each way


def _loopback_bytes() -> float:
    """Bytes the loopback interface has received so far (the whole machine), NaN where unreadable."""
    try:
        with open("/proc/net/dev") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name.strip() == "lo":
                    return float(rest.split()[0])
    except OSError:
        pass
    return float("nan")


def _config_rank(rank: int, workers: int, servers: int, model: str, reps: int, warmup: int, lo_steps: int):
    """One rank of one configuration: a server serves; a worker times both variants and counts bytes."""
    import torch.distributed as dist

    from parallel_layers.data_parallel import DataParallel
    from parallel_layers.models import GPT, GPTConfig
    from parallel_layers.optim import FusedAdamW
    from parallel_layers.parameter_server import ParameterServerWorker, ps_layout, serve

    ranks = list(range(workers + servers))
    layout = ps_layout(servers, ranks=ranks)               # collectives over the world: every rank calls them
    worker_group = dist.new_group(ranks[:workers])
    if rank not in ranks:
        return None
    if layout.is_server:
        shard = serve(layout, lr=1e-4, weight_decay=0.0)
        return {"server_step": shard.step_traffic, "steps": shard.steps_taken}
    V, L, H, D, S = MODELS[model]
    cfg = GPTConfig(vocab_size=V, n_layer=L, n_head=H, d_model=D, max_seq_len=S, dropout=0.0)
    torch.manual_seed(0)
    ps = ParameterServerWorker(GPT(cfg), layout, bucket_cap_mb=BUCKET_MB)
    torch.manual_seed(0)
    dp = DataParallel(GPT(cfg), worker_group, bucket_cap_mb=BUCKET_MB)
    opt = FusedAdamW(dp.parameters(), lr=1e-4, weight_decay=0.0)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randint(0, V, (2, S), generator=gen), torch.randint(0, V, (2, S), generator=gen)

    def ps_step():
        ps(x, y)[1].backward()
        ps.synchronize()

    def dp_step():
        opt.zero_grad()
        dp(x, y)[1].backward()
        opt.step()

    steps = {"ps": ps_step, "dp": dp_step}
    times: Dict[str, List[float]] = {k: [] for k in steps}
    for i in range(warmup + reps):
        for name in (("ps", "dp") if i % 2 == 0 else ("dp", "ps")):
            ms = harness.slowest_rank_ms(steps[name], worker_group)
            if i >= warmup:
                times[name].append(ms)
    loopback = {}
    for name, fn in steps.items():                 # each alone, for the machine's byte counter
        dist.barrier(worker_group)
        before = _loopback_bytes()
        for _ in range(lo_steps):
            fn()
        dist.barrier(worker_group)
        loopback[name] = (_loopback_bytes() - before) / lo_steps
    worker_step = dict(ps.step_traffic)
    ps.close()
    numel = sum(p.numel() for p in dp.module.parameters())
    return {"times": times, "worker_step": worker_step, "loopback": loopback, "numel": numel,
            "padded": ps.plan.total}


def _bench_rank(rank: int, world: int, model: str, reps: int, warmup: int, configs, lo_steps: int):
    import torch.distributed as dist

    out = []
    for workers, servers in configs:
        out.append(_config_rank(rank, workers, servers, model, reps, warmup, lo_steps))
        dist.barrier()
    return out


def _mb(x: float) -> float:
    return x / 2 ** 20


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None,
            **overrides) -> List[dict]:
    """The rows of ``mode`` (smoke | quick | full; ``overrides`` replace profile entries). Each row also
    carries the byte figures under ``ps_*``/``ring_*``/``lo_*`` keys (the CSV keeps them in ``sizes``)."""
    from parallel_layers.parameter_server import predicted_bytes_per_step

    prof = dict(PROFILES[mode])
    prof.update({k: v for k, v in overrides.items() if v is not None})
    configs = [tuple(c) for c in prof["configs"]]
    world = max(w + s for w, s in configs)
    if progress:
        progress(f"{world} ranks, {len(configs)} configurations, {prof['model']}")
    per_rank = harness.run_ranks(_bench_rank, world, (prof["model"], prof["reps"], prof["warmup"], configs,
                                                      prof["lo_steps"]), timeout_s=1800, retain_memory=True)
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32")
    rows = []
    for k, (workers, servers) in enumerate(configs):
        ranks = [per_rank[r][k] for r in range(workers + servers)]
        w0, server_steps = ranks[0], [r["server_step"] for r in ranks[workers:]]
        model_bytes = 4 * w0["numel"]
        model = predicted_bytes_per_step(4 * w0["padded"], workers, servers)
        ring = predicted_bytes_per_step(model_bytes, workers, servers)["ring"]
        measured = {"ps_worker": w0["worker_step"]["sent"], "ps_server": max(s["sent"] for s in server_steps),
                    "lo_ps": w0["loopback"]["ps"] / (workers + servers), "lo_ring": w0["loopback"]["dp"] / workers}
        sizes = (f"W{workers} S{servers}; {w0['numel'] / 1e6:.2f}M params; MB/step each way: PS worker "
                 f"{_mb(measured['ps_worker']):.2f} server {_mb(measured['ps_server']):.2f} (model "
                 f"{_mb(model['ps_worker']):.2f}/{_mb(model['ps_server']):.2f}), ring model {_mb(ring):.2f}; "
                 f"loopback per rank PS {_mb(measured['lo_ps']):.2f} ring {_mb(measured['lo_ring']):.2f}")
        row = harness.comparison_row(
            dict(common, backend=f"gloo x{workers + servers}", sizes=sizes), f"ps_w{workers}_s{servers}_vs_ring",
            w0["times"]["ps"], w0["times"]["dp"], x=workers, target="-", met="-",
            baseline=f"DataParallel all-reduce (gloo ring) + FusedAdamW over {workers} ranks")
        row.update(workers=workers, servers=servers, model_bytes=model_bytes, ring_model=ring,
                   ps_worker_model=model["ps_worker"], ps_server_model=model["ps_server"], **measured)
        rows.append(row)
        print(f"W={workers} S={servers}: PS {row['ours_median_ms']:.1f} ms, ring {row['base_median_ms']:.1f} ms; "
              f"{sizes}", file=sys.stderr, flush=True)
    if mode != "smoke":
        draw(rows)
    return rows


def draw(rows: List[dict], path: str = PLOT_PATH) -> Optional[str]:
    """Step time, bytes per step at the busiest rank (measured and predicted) and the model's communication
    time on real networks, against the number of workers."""
    from parallel_layers.optional import pyplot

    plt = pyplot()
    if plt is None or not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    servers = sorted({r["servers"] for r in rows})
    workers = sorted({r["workers"] for r in rows})
    colors = {1: "tab:orange", 2: "tab:green"}
    for s in servers:
        rs = sorted((r for r in rows if r["servers"] == s), key=lambda r: r["workers"])
        xs = [r["workers"] for r in rs]
        axes[0].errorbar(xs, [r["ours_median_ms"] for r in rs],
                         yerr=[[r["ours_median_ms"] - r["ours_p20_ms"] for r in rs],
                               [r["ours_p80_ms"] - r["ours_median_ms"] for r in rs]],
                         marker="o", capsize=3, color=colors.get(s), label=f"parameter server, {s} server(s)")
        axes[1].plot(xs, [_mb(r["ps_server"]) for r in rs], marker="o", color=colors.get(s),
                     label=f"PS server, measured ({s} server(s))")
        axes[1].plot(xs, [_mb(r["ps_server_model"]) for r in rs], ls="--", color=colors.get(s),
                     label=f"PS server, model: W/S models ({s})")
    for s, marker in zip(servers, ("s", "D")):           # the baseline as measured beside each server count
        rs = sorted((r for r in rows if r["servers"] == s), key=lambda r: r["workers"])
        axes[0].plot([r["workers"] for r in rs], [r["base_median_ms"] for r in rs], marker=marker, color="tab:blue",
                     ls="-" if s == servers[0] else ":", label=f"DataParallel ring all-reduce (beside {s} server(s))")
    ring_rows = {r["workers"]: r for r in rows}
    ring = [ring_rows[w] for w in workers]
    axes[1].plot(workers, [_mb(r["ring_model"]) for r in ring], marker="s", ls="--", color="tab:blue",
                 label="ring, model: 2(n-1)/n models")
    axes[1].plot(workers, [_mb(r["lo_ring"]) for r in ring], marker="x", ls=":", color="tab:blue",
                 label="ring, loopback bytes / rank")
    axes[1].plot(workers, [_mb(r["ps_worker"]) for r in ring], marker="^", color="gray",
                 label="PS worker, measured (any S)")
    model_mb = _mb(ring[0]["model_bytes"])
    for w_ax in axes[:2]:
        w_ax.set_xscale("log", base=2)
        w_ax.set_xticks(workers, [str(w) for w in workers])
        w_ax.set_xlabel("workers (PS world = workers + servers)")
    axes[0].set_ylabel("step time, ms (median, p20-p80)")
    axes[0].set_title("step time on this machine (gloo, CPU)", fontsize=10)
    axes[1].set_ylabel("MB per step, each way, at the busiest rank")
    axes[1].set_title(f"bytes per step (model {model_mb:.1f} MB fp32)", fontsize=10)
    xs = list(range(2, 65))
    for s, style in ((1, "-"), (2, "--"), ("W/2", "-."), ("W", ":")):
        ys = []
        for w in xs:
            n_s = s if isinstance(s, int) else (w / 2 if s == "W/2" else w)
            ys.append(max(1.0, w / n_s) / (2.0 * (w - 1) / w))
        axes[2].plot(xs, ys, ls=style, label=f"S = {s}")
    axes[2].axhline(1.0, color="black", lw=0.8)
    axes[2].set_xscale("log", base=2)
    axes[2].set_yscale("log", base=2)
    axes[2].set_xlabel("workers")
    axes[2].set_ylabel("PS / ring communication time")
    axes[2].set_title("model, bandwidth-bound links: below 1 the servers win", fontsize=10)
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    r0 = rows[0]
    fig.suptitle(f"parameter servers vs ring all-reduce | {r0.get('device', '?')} | {r0.get('mode', '?')} run "
                 f"{str(r0.get('date', ''))[:16]} | 1 thread per process")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def network_prediction(model_bytes: float, workers: int, servers: int, gbps: float) -> Dict[str, float]:
    """Seconds of communication per step on links of ``gbps`` Gb/s each way, bandwidth-bound (no latency)."""
    from parallel_layers.parameter_server import predicted_bytes_per_step

    m = predicted_bytes_per_step(model_bytes, workers, servers)
    bytes_per_s = gbps * 1e9 / 8
    return {"ps": m["ps_busiest"] / bytes_per_s, "ring": m["ring"] / bytes_per_s}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="2 workers x 2 servers, tiny GPT; never writes CSV",
                             quick_help="GPT of ~1.1M parameters, few reps")
    ap.add_argument("--model", choices=sorted(MODELS), default=None, help="default: the mode's profile")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--csv", default=None, help=f"CSV to append to (default {os.path.relpath(CSV_PATH)})")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    t0 = time.time()
    rows = collect(mode, torch.device("cpu"), model=args.model, reps=args.reps, warmup=args.warmup)
    print(f"({time.time() - t0:.1f} s)")
    harness.print_and_append(rows, harness.csv_target(args, args.csv or CSV_PATH))
    print("model, bandwidth-bound, a 1 GB fp32 model (250M parameters), communication seconds per step:")
    for gbps in NIC_GBPS:
        for workers, servers in ((8, 1), (8, 2), (8, 4), (8, 8), (64, 8), (64, 64)):
            p = network_prediction(1e9, workers, servers, gbps)
            print(f"  {gbps:>4} Gb/s  W={workers:<3} S={servers:<3} PS {p['ps']:.3f} s  ring {p['ring']:.3f} s  "
                  f"PS/ring {p['ps'] / p['ring']:.2f}")
    if mode != "smoke" and os.path.exists(PLOT_PATH):
        print(f"plot: {os.path.relpath(PLOT_PATH)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
