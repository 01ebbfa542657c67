"""Parameter-server data parallelism on real gloo ranks: synchronous parity with one process, the
staleness bound and convergence of asynchronous training, and what a dead worker does to each mode.

Parity: every worker trains the reference GPT on its slice of each batch through the servers; in the same
process the plain GPT trains on the whole batch with ``torch.optim.AdamW``. Every worker's parameters
(relative norm per tensor) and the mean of the workers' losses must stay within 1e-5 of it for 5 steps.
Small buckets (a few KiB) give several buckets, pushed while backward runs and pulled per module.
"""
import datetime
import multiprocessing
import os
import queue
import signal
import sys
import time
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from parallel_layers.models import GPT, GPTConfig
from parallel_layers.parameter_server import ParameterServerWorker, predicted_bytes_per_step, ps_layout, serve
from parallel_layers.parameter_server.protocol import ALIGN, plan_buckets
from parallel_layers.testing.compare import worst

SMALL = dict(vocab_size=101, n_layer=2, n_head=4, d_model=32, max_seq_len=16, dropout=0.0, bias=False)
CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.004)
BATCH = 12
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
_LAYOUTS: dict = {}


def _layout(num_servers, timeout=None):
    """One layout per shape in each pool worker (creating its links is a collective over the pool)."""
    key = (num_servers, timeout)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = ps_layout(num_servers, timeout=timeout)
    return _LAYOUTS[key]


def _batches(steps, cfg, seed=123):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen),
             torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen)) for _ in range(steps)]


def _rel_norm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------- synchronous: parity with one process
def body_sync_parity(rank, world, num_servers, steps):
    layout = _layout(num_servers)
    if layout.is_server:
        shard = serve(layout, **HYPER)
        return {"server": shard.status()}
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0 if rank == 0 else 1000 + rank)   # worker 0 holds the oracle's init; the others start off
    worker = ParameterServerWorker(GPT(cfg), layout, **CAPS)
    ref_opt = torch.optim.AdamW(dense.parameters(), **HYPER)
    per = BATCH // layout.num_workers
    sl = slice(worker.index * per, (worker.index + 1) * per)
    losses, errs = [], []
    for idx, tgt in _batches(steps, cfg):
        ref_opt.zero_grad()
        _, ref_loss = dense(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        _, loss = worker(idx[sl], tgt[sl])
        loss.backward()
        losses.append((ref_loss.item(), loss.item()))
        worker.synchronize()
        got = dict(worker.module.named_parameters())
        errs.append(worst((_rel_norm(got[n], p), n) for n, p in dense.named_parameters()))
    worker.close()
    return {"losses": losses, "errs": errs, "buckets": len(worker.plan.numel), "traffic": worker.traffic.as_dict(),
            "numel": worker.plan.total, "staleness": worker.staleness_log, "pushes": worker.last_push_log,
            "params": len(worker.params)}


@pytest.mark.parametrize("num_servers", [1, 2])
def test_sync_matches_single_process(dist_pools, num_servers):
    steps = 5
    results = dist_pools(4).run(body_sync_parity, num_servers, steps)
    workers = [r for r in results if "losses" in r]
    assert len(workers) == 4 - num_servers
    for step in range(steps):
        ref = workers[0]["losses"][step][0]
        mean = sum(w["losses"][step][1] for w in workers) / len(workers)   # equal slices: the full batch's mean
        assert abs(mean - ref) <= 1e-5 * abs(ref), f"step {step}: mean worker loss {mean} vs single process {ref}"
    for rank, out in enumerate(workers):
        assert out["buckets"] >= 4
        # every bucket pushed, in order, the first ones while backward still produced the others' gradients
        assert [b for b, _ in out["pushes"]] == list(range(out["buckets"]))
        assert out["pushes"][0][1] < out["params"] and out["pushes"][-1][1] == out["params"]
        for step, (err, name) in enumerate(out["errs"]):
            assert err <= 1e-5, f"worker {rank} step {step}: {name} differs by {err:.2e} (relative norm)"
        assert out["staleness"] == [0] * (steps + 1)
    for server in (r["server"] for r in results if "server" in r):
        assert server["steps_taken"] == steps and not server["dead_workers"]
        assert sorted(server["left_workers"]) == list(range(4 - num_servers))
    # each push and each pull carries the worker's whole (padded) model once, whatever the server count:
    # worker 0 sent the initial values, 5 pushes and its leave; it received the first pull and 5 more
    model_bytes = 4 * workers[0]["numel"]
    for traffic, models in ((workers[0]["traffic"]["sent"], steps + 2), (workers[0]["traffic"]["received"], steps + 1)):
        assert model_bytes * models <= traffic <= model_bytes * models + 4096, (traffic, model_bytes, models)


def test_bucket_plan_and_traffic_model():
    plan = plan_buckets([10, 300, 7, 5000], 3, bucket_cap_mb=0.001, first_bucket_cap_mb=0.0001)
    assert plan.params[0] == [3]                        # last parameter first (its gradient arrives first)
    assert sorted(i for g in plan.params for i in g) == [0, 1, 2, 3]
    for b, n in enumerate(plan.numel):
        assert n % (ALIGN * 3) == 0
        ranges = [plan.piece_range(b, s) for s in range(3)]
        assert ranges[0][0] == plan.start[b] and ranges[-1][1] == plan.start[b] + n
    assert plan.shard_numel * 3 == plan.total
    model = predicted_bytes_per_step(100.0, workers=8, servers=2)
    assert model == {"ps_worker": 100.0, "ps_server": 400.0, "ps_busiest": 400.0, "ring": 175.0}


# ---------------------------------------------------------------------- misuse: clear errors, the protocol intact
class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).square().mean()


def body_misuse(rank, world):
    layout = _layout(1)
    errors = {}
    for name, call in (("no servers", lambda: ps_layout(0)), ("no workers", lambda: ps_layout(world)),
                       ("wrong role", lambda: serve(layout) if layout.is_worker else
                        ParameterServerWorker(torch.nn.Linear(2, 2), layout))):
        with pytest.raises(ValueError) as info:
            call()
        errors[name] = str(info.value)
    if layout.is_server:
        return {"errors": errors, "status": serve(layout, lr=0.1).status()}
    torch.manual_seed(rank)                      # different weights: the first pull makes them worker 0's
    worker = ParameterServerWorker(_WithUnused(), layout, wait_per_module=False)
    with pytest.raises(RuntimeError) as info:    # pushed as zeros, so every rank stays in step, then named
        worker(torch.ones(2, 4)).backward()
    errors["unused"] = str(info.value)
    with pytest.raises(RuntimeError):            # and again at the next step: the run goes on
        worker(torch.ones(2, 4)).backward()
    worker.synchronize()
    moved = [p.detach().clone() for p in worker.module.used.parameters()]
    worker.close()
    return {"errors": errors, "moved": moved}


def test_misuse_is_named_and_keeps_the_protocol(dist_pools):
    results = dist_pools(4).run(body_misuse)
    assert "num_servers=0" in results[0]["errors"]["no servers"]
    assert "num_servers=4" in results[0]["errors"]["no workers"]
    assert "rank 0 is a worker" in results[0]["errors"]["wrong role"]
    assert "rank 3 is a server" in results[3]["errors"]["wrong role"]
    assert "unused.weight, unused.bias" in results[0]["errors"]["unused"]
    assert results[3]["status"]["steps_taken"] == 2 and not results[3]["status"]["dead_workers"]
    for w in results[1:3]:         # the workers still agree: they all pulled the same parameters
        assert all(torch.equal(a, b) for a, b in zip(w["moved"], results[0]["moved"]))


# ---------------------------------------------------------------------- asynchronous: staleness and convergence
def body_async(rank, world, staleness, steps):
    from parallel_layers.cli.demo import get_batch, load_corpus

    layout = _layout(1)
    if layout.is_server:
        shard = serve(layout, lr=3e-3, weight_decay=0.0, staleness=staleness)
        return {"server": shard.status(), "release_log": shard.release_log}
    corpus = load_corpus(200_000)
    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=32, dropout=0.0, bias=False)
    torch.manual_seed(0)
    worker = ParameterServerWorker(GPT(cfg), layout, **CAPS)
    losses = []
    for step in range(steps):
        x, y = get_batch(corpus, step * 8 + worker.index, 8, cfg.max_seq_len, seed=0)
        _, loss = worker(x, y)
        loss.backward()
        losses.append(loss.item())
        time.sleep(0.004 * worker.index)     # workers of different speeds: the fast ones run ahead
    worker.close()
    return {"losses": losses, "staleness": worker.staleness_log, "clock": worker.clock}


@pytest.mark.parametrize("staleness", [1, 2])
def test_async_keeps_the_staleness_bound_and_converges(dist_pools, staleness):
    steps = 40
    results = dist_pools(4).run(body_async, staleness, steps)
    server = results[3]
    workers = results[:3]
    assert server["server"]["steps_taken"] == 3 * steps and not server["server"]["dead_workers"]
    ahead = [clock - slowest for _, clock, slowest in server["release_log"]]
    assert max(ahead) <= staleness, f"a pull was answered {max(ahead)} pushes ahead of the slowest worker"
    assert max(ahead) == staleness, "no worker ever ran ahead: the bound was never exercised"
    for w in workers:
        assert max(w["staleness"]) <= staleness and w["clock"] == steps
        first, last = sum(w["losses"][:3]) / 3, sum(w["losses"][-5:]) / 5
        assert last < first - 1.0, f"asynchronous training did not converge: loss {first:.3f} -> {last:.3f}"


# ---------------------------------------------------------------------- a worker that dies or stops
TIMEOUT_S = 2.0
SLACK_S = 6.0


def _rank_main(rank, world, port, results, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results.put((rank, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - what a rank says is the point
        results.put((rank, {"setup_error": traceback.format_exc()}))


def body_fault(rank, world, staleness, fault):
    """2 workers, 1 server; worker 1 is killed in its third backward, or stopped before its third step.
    Asynchronous runs bound the staleness at 1, so worker 0 waits for worker 1 until the server finds it
    dead (at once when killed: its links close; after the timeout when stopped)."""
    layout = ps_layout(1, timeout=TIMEOUT_S)
    if layout.is_server:
        start = time.monotonic()
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                shard = serve(layout, lr=1e-3, staleness=staleness)
            return {"status": shard.status(), "warnings": [str(w.message) for w in said],
                    "seconds": time.monotonic() - start}
        except RuntimeError as exc:
            return {"error": str(exc), "seconds": time.monotonic() - start}
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    worker = ParameterServerWorker(GPT(cfg), layout, **CAPS)
    idx, tgt = _batches(1, cfg)[0]
    start, steps = None, 0
    try:
        for step in range(8):
            if step == 2 and rank == 1:
                if fault == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                p = next(worker.module.parameters())    # wte: its gradient is among the last of backward
                p.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
            if step == 2:
                start = time.monotonic()
            _, loss = worker(idx, tgt)
            loss.backward()
            steps += 1
        worker.close()
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start, "steps": steps}
    return {"error": None, "steps": steps, "seconds": time.monotonic() - start}


def _run_faults(cases):
    """Each case on 3 fresh processes (forked from a server that imported torch once), all at once."""
    from parallel_layers.testing.workers import free_port
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "parallel_layers.data_parallel",
                                "parallel_layers.models"])
    runs = {}
    for case in cases:
        results, port = ctx.Queue(), free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, 3, port, results, body_fault, case), daemon=True)
                 for r in range(3)]
        for p in procs:
            p.start()
        runs[case] = (results, procs)
    deadline = time.monotonic() + 60 + TIMEOUT_S + SLACK_S
    out = {}
    for case, (results, procs) in runs.items():
        got = {}
        while len(got) < 2 and time.monotonic() < deadline:       # ranks 0 (worker) and 2 (server) answer
            try:
                rank, answer = results.get(timeout=0.2)
                got[rank] = answer
            except queue.Empty:
                pass
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(timeout=5)
        out[case] = got
    return out


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL/SIGSTOP are POSIX signals")
def test_a_dead_worker_stops_a_sync_run_but_not_an_async_one():
    out = _run_faults([(0, "kill"), (0, "stop"), (1, "kill"), (1, "stop")])
    for fault in ("kill", "stop"):            # synchronous: the survivor and the server error out in time
        got = out[(0, fault)]
        assert set(got) == {0, 2}, f"sync {fault}: not every survivor answered: {got}"
        worker, server = got[0], got[2]
        assert "worker rank 1 failed or timed out in synchronous round 2" in server.get("error", ""), (fault, server)
        assert worker.get("error") and "worker rank 1" in worker["error"], (fault, worker)
        assert worker["seconds"] < TIMEOUT_S + SLACK_S, (fault, worker)
        assert server["seconds"] < 60 + TIMEOUT_S + SLACK_S, (fault, server)
    for fault in ("kill", "stop"):            # asynchronous: the server serves worker 0 to the end and says why
        got = out[(1, fault)]
        assert set(got) == {0, 2}, (fault, got)
        worker, server = got[0], got[2]
        assert worker["error"] is None and worker["steps"] == 8, (fault, worker)
        assert list(server["status"]["dead_workers"]) == [1], (fault, server)
        assert server["status"]["left_workers"] == [0] and server["status"]["clocks"][0] == 8, (fault, server)
        assert any("worker rank 1 is dead" in w and "serving the remaining worker ranks [0]" in w
                   for w in server["warnings"]), (fault, server["warnings"])
        assert worker["seconds"] < TIMEOUT_S + SLACK_S, (fault, worker)   # held back at most until it was found


# ---------------------------------------------------------------------- the benchmark, in the shared pool
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def body_bench(rank, world, fn_name, *args):
    """In a pool worker: the benchmark's rank body (benchmarks/ is a folder of the repo, not the package)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from benchmarks import parameter_server
    return getattr(parameter_server, fn_name)(rank, world, *args)


def test_benchmark_smoke_rows(monkeypatch, dist_pools):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from benchmarks import harness, parameter_server

    def run_ranks(fn, world, args=(), timeout_s=900, retain_memory=False, bind_cores=False):  # noqa: ARG001
        return dist_pools(world).run(body_bench, fn.__name__, *args, timeout=min(timeout_s, 300))

    monkeypatch.setattr(harness, "run_ranks", run_ranks)
    rows = parameter_server.collect("smoke", torch.device("cpu"))
    assert [r["case"] for r in rows] == ["ps_w2_s2_vs_ring"]
    row = rows[0]
    csv_row = {k: v for k, v in row.items() if k in harness.CSV_FIELDS}
    for key in ("run_id", "device", "torch", "sizes", "backend", "baseline"):
        assert csv_row.get(key), key
    assert row["ours_median_ms"] > 0 and row["base_median_ms"] > 0 and row["speedup"] > 0 and row["x"] == 2
    # the counters give the model exactly: a worker sends its padded model (and a 64-byte header to each of the
    # S = 2 servers), a server sends W / S of it (and a header to each of the W = 2 workers)
    assert row["ps_worker"] == row["ps_worker_model"] + 2 * 64 and row["ps_server"] == row["ps_server_model"] + 2 * 64
