"""Asynchronous checkpoints and automatic resume (issue 35), in real processes.

On 4 ranks (dp2 x pp2, ZeRO-1), for the universal and the per-rank format:

* the write really runs behind training: it is held back until the next training step has finished, and
  what lands on disk is still the snapshot of the saved step (bit-identical to a synchronous save of that
  step, universal format);
* a fresh model (another seed) resumes the newest checkpoint by itself, gets the caller's data position
  back, and its next step and weights equal the uninterrupted run's bit for bit; ``keep=1`` leaves one;
* a write that fails on one rank (disk full on one writer) is reported on every rank, publishes nothing,
  and the previous checkpoint stays the one resumed.

In a separate process: a process killed (SIGKILL) while its background write is between the stage files
and ``meta.json`` leaves a half-written checkpoint that is never offered; a restart resumes from the
previous one and repeats the killed run's steps bit for bit.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from unittest import mock

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = dict(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8, bias=False)


def _batches(n=5):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (8, 9), generator=gen)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _model(mesh, seed):
    from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig
    return Parallel3D(GPTConfig(**CFG), mesh, seed=seed,
                      optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                      pipeline=PipelineConfig(num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=1, bucket_cap_mb=0.002))


def _equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- 4 ranks
def body_async_save_and_resume(rank, world, root, fmt):
    from parallel_layers.composition import universal_checkpoint as uc
    from parallel_layers.resilience import AsyncCheckpointer, async_save, complete_checkpoints, resume
    from parallel_layers.testing import cached_mesh
    mesh = cached_mesh(2, 1, 2)
    model, batches = _model(mesh, seed=0), _batches()
    ck = AsyncCheckpointer(model, os.path.join(root, "async"), format=fmt, keep=1)
    gate, held = threading.Event(), {}
    write = async_save.write_universal if fmt == "universal" else async_save.write_per_rank

    def held_back(snap, path, group, latest_root):   # the write of iteration 2 waits until step 3 has finished
        if snap.iteration == 2:
            gate.wait()
        write(snap, path, group, latest_root)
    name = "write_universal" if fmt == "universal" else "write_per_rank"
    losses = []
    with mock.patch.object(async_save, name, held_back):
        for i, (x, y) in enumerate(batches, start=1):
            losses.append(model.train_step(x, y)["loss"])
            if i == 3:
                held["published during step 3"] = os.path.exists(os.path.join(root, "async", "iter_0000002",
                                                                              "meta.json"))
                gate.set()
            if i in (2, 4):
                if fmt == "universal":
                    uc.save_iteration(model, os.path.join(root, "sync"), i)     # the same state, synchronously
                ck.save(i, {"iteration": i, "epoch": 0})
        ck.wait()
    final = model.dense_state_dict()
    fresh = _model(mesh, seed=99)
    got = resume(fresh, os.path.join(root, "async"))
    out = {"losses": losses, "got": {k: got[k] for k in ("iteration", "data", "restored_random_state")},
           "held": held, "failures": ck.failures, "stall_s": [r.stall_s for r in ck.records],
           "kept": [it for it, _ in complete_checkpoints(os.path.join(root, "async"))]}
    out["step 5 again"] = None
    if got["iteration"] == 4:                    # the uninterrupted run's step 5, repeated by the resumed model
        out["step 5 again"] = fresh.train_step(*batches[4])["loss"]
        out["weights equal after step 5"] = _equal_states(final, fresh.dense_state_dict())
    return out


def body_failed_write(rank, world, root):
    from parallel_layers.composition import universal_checkpoint as uc
    from parallel_layers.resilience import AsyncCheckpointer, complete_checkpoints, resume
    from parallel_layers.testing import cached_mesh
    mesh = cached_mesh(2, 1, 2)
    model, batches = _model(mesh, seed=0), _batches()
    ck = AsyncCheckpointer(model, root)
    real = uc._write_stage

    def disk_full(directory, file, header, states):
        if rank == 2:                            # the writer of pipeline stage 1
            raise OSError(28, "No space left on device (injected)")
        return real(directory, file, header, states)
    model.train_step(*batches[0])
    model.train_step(*batches[1])
    ck.save(2)
    model.train_step(*batches[2])
    model.train_step(*batches[3])
    with mock.patch.object(uc, "_write_stage", disk_full), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck.save(4)
        model.train_step(*batches[4])            # training goes on while the write fails
        ck.wait()
    fresh = _model(mesh, seed=99)
    got = resume(fresh, root)
    return {"warned": [str(w.message) for w in caught], "failures": ck.failures,
            "complete": [it for it, _ in complete_checkpoints(root)],
            "iter4 files": sorted(os.listdir(os.path.join(root, "iter_0000004"))), "resumed": got["iteration"]}


@pytest.mark.parametrize("fmt", ["universal", "per_rank"])
def test_async_save_runs_behind_training_and_resumes_bit_identically(_pools, tmp_path, fmt):
    res = _pools(4, "gloo").run(body_async_save_and_resume, str(tmp_path), fmt, timeout=300)
    for rank, r in enumerate(res):
        assert r["losses"] == res[0]["losses"], rank
        assert r["held"] == {"published during step 3": False}, (rank, r["held"])
        assert r["failures"] == [] and r["kept"] == [4], (rank, r)
        assert r["got"] == {"iteration": 4, "data": {"iteration": 4, "epoch": 0}, "restored_random_state": True}, r
        assert r["step 5 again"] == r["losses"][4], (rank, r["step 5 again"], r["losses"])      # bit for bit
        assert r["weights equal after step 5"], rank
    if fmt == "universal":                      # the held-back write wrote step 2's snapshot, not step 3's state
        from parallel_layers.composition.universal_checkpoint import read_universal
        a = read_universal(str(tmp_path / "sync" / "iter_0000004"))
        b = read_universal(str(tmp_path / "async" / "iter_0000004"))
        for state in ("model", "exp_avg", "exp_avg_sq"):
            assert _equal_states(a[state], b[state]), state
        assert b["resume"]["data"] == {"iteration": 4, "epoch": 0} and len(b["resume"]["ranks"]) == 4


def test_failed_write_is_reported_everywhere_and_never_published(_pools, tmp_path):
    res = _pools(4, "gloo").run(body_failed_write, str(tmp_path / "run"), timeout=300)
    for rank, r in enumerate(res):
        assert len(r["failures"]) == 1 and "No space left on device (injected)" in r["failures"][0], (rank, r)
        assert "iteration 4" in r["failures"][0] and any("not saved" in w for w in r["warned"]), (rank, r)
        assert r["complete"] == [2] and r["resumed"] == 2, (rank, r)
        assert "meta.json" not in r["iter4 files"], (rank, r)


# ---------------------------------------------------------------------- the universal snapshot is local
# case -> (mesh (dp, tp, pp), ZeRO stage, the layout that loads it: mesh, ZeRO stage)
UNIVERSAL_CASES = {"zero1-dp2-pp2": ((2, 1, 2), 1, (4, 1, 1), 3), "zero3-dp2-tp2": ((2, 2, 1), 3, (2, 1, 2), 1),
                   "zero0-dp2-tp2": ((2, 2, 1), 0, (2, 1, 2), 1)}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "broadcast",
               "all_gather_object", "broadcast_object_list", "gather_object", "gather", "scatter", "barrier", "send",
               "recv", "isend", "irecv", "all_to_all_single")


@contextlib.contextmanager
def _counting_collectives(calls: list):
    """Every ``torch.distributed`` collective called while active, as ``(thread id, name)``: through
    ``torch.distributed`` or a name ``parallel_layers.distributed.collectives`` bound to one at import."""
    import torch.distributed as dist

    from parallel_layers.distributed import collectives as C

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append((threading.get_ident(), name))
            return fn(*args, **kwargs)
        return call
    originals = {getattr(dist, n): n for n in COLLECTIVES if hasattr(dist, n)}
    originals[getattr(dist, "all_gather_single", None)] = "all_gather_single"
    bound = [(C, n) for n, v in vars(C).items() if callable(v) and v in originals]
    assert bound, "collectives binds no torch collective at import: the counter may miss its gathers"
    targets = [(dist, n) for n in COLLECTIVES if hasattr(dist, n)] + bound
    with contextlib.ExitStack() as stack:
        for module, name in targets:
            stack.enter_context(mock.patch.object(module, name, counted(name, getattr(module, name))))
        yield


def _model_of(dims, zero, seed):
    from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.testing import cached_mesh
    return Parallel3D(GPTConfig(**CFG), cached_mesh(*dims), seed=seed,
                      optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5),
                      pipeline=PipelineConfig(num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=zero, bucket_cap_mb=0.002))


def body_async_universal_is_local(rank, world, root, case):
    from parallel_layers.composition import universal_checkpoint as uc
    from parallel_layers.resilience import AsyncCheckpointer, local_shards
    dims, zero, other_dims, other_zero = UNIVERSAL_CASES[case]
    model, batches = _model_of(dims, zero, seed=0), _batches()
    for x, y in batches[:2]:
        model.train_step(x, y)
    ck = AsyncCheckpointer(model, os.path.join(root, "async"))
    me, calls, control = threading.get_ident(), [], []
    # runs of 300 elements: the ZeRO shards are summed in several collectives, a large parameter alone
    with _counting_collectives(calls), mock.patch.object(local_shards, "CHUNK_ELEMENTS", 300):
        rec = ck.save(2, {"iteration": 2})
        in_save = [name for thread, name in calls if thread == me]
        ck.wait()
    with _counting_collectives(control):         # the counter sees the sync snapshot's gathers
        uc.snapshot_universal(model, 2)
    uc.save_iteration(model, os.path.join(root, "sync"), 2)     # the same state, the synchronous save
    other = _model_of(other_dims, other_zero, seed=7)
    meta = uc.load_universal(other, os.path.join(root, "async", "iter_0000002"))
    loaded, step = uc.dense_states(other)
    return {"in save": in_save, "writer thread": sorted({n for t, n in calls if t != me}),
            "control": sorted({n for _, n in control}), "failures": ck.failures, "gather_s": rec.gather_s,
            "loaded": loaded, "step": step, "meta step": meta["step"]}


@pytest.mark.parametrize("case", list(UNIVERSAL_CASES))
def test_async_universal_snapshot_issues_no_collective_and_writes_the_sync_save(_pools, tmp_path, case):
    from parallel_layers.composition.universal_checkpoint import read_universal
    res = _pools(4, "gloo").run(body_async_universal_is_local, str(tmp_path), case, timeout=300)
    zero = UNIVERSAL_CASES[case][1]
    for rank, r in enumerate(res):
        assert r["failures"] == [] and r["gather_s"] is not None, (rank, r["failures"])
        assert r["in save"] == [], (rank, r["in save"])          # the training thread communicated nothing
        assert "all_gather_object" in r["writer thread"], (rank, r["writer thread"])
        assert "all_gather_object" in r["control"], (rank, r["control"])
        if zero:                                 # the writer summed the shards; the sync snapshot did, in front
            assert "reduce" in r["writer thread"] and "all_reduce" in r["control"], (rank, r)
    sync = read_universal(str(tmp_path / "sync" / "iter_0000002"))
    got = read_universal(str(tmp_path / "async" / "iter_0000002"))
    for state in ("model", "exp_avg", "exp_avg_sq"):
        assert _equal_states(sync[state], got[state]), state
    entry = lambda m: {n: (e["shape"], e["dtype"], e["crc32"]) for n, e in m["tensors"].items()}  # noqa: E731
    assert entry(sync) == entry(got)             # the same bytes in every tensor
    same = set(sync) - {"save", "files", "tensors", "checksum", "model", "exp_avg", "exp_avg_sq"}
    assert {k: sync[k] for k in same} == {k: got[k] for k in same}
    assert got["resume"]["data"] == {"iteration": 2} and len(got["resume"]["ranks"]) == 4
    names = set()
    for rank, r in enumerate(res):               # another layout loaded the async save
        assert r["step"] == r["meta step"] == got["step"] == 2, (rank, r["step"])
        for name, states in r["loaded"].items():
            names.add(name)
            for state, key in (("param", "model"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                assert torch.equal(states[state], got[key][name]), (rank, name, state)
    assert names == set(got["model"])


def body_per_rank_snapshot_is_local(rank, world, root):
    from parallel_layers.resilience import AsyncCheckpointer, resume
    model, batches = _model_of((2, 1, 2), 1, seed=0), _batches()
    model.train_step(*batches[0])
    ck = AsyncCheckpointer(model, root, format="per_rank")
    me, calls = threading.get_ident(), []
    with _counting_collectives(calls):
        ck.save(1)
        in_save = [name for thread, name in calls if thread == me]
        ck.wait()
    fresh = _model_of((2, 1, 2), 1, seed=5)
    resume(fresh, root)
    return {"in save": in_save, "writer thread": sorted({n for t, n in calls if t != me}), "failures": ck.failures,
            "equal": _equal_states(model.dense_state_dict(), fresh.dense_state_dict())}


def test_async_per_rank_snapshot_issues_no_collective(_pools, tmp_path):
    res = _pools(4, "gloo").run(body_per_rank_snapshot_is_local, str(tmp_path), timeout=300)
    for rank, r in enumerate(res):
        assert r["failures"] == [] and r["equal"], (rank, r)
        assert r["in save"] == [] and "all_gather_object" in r["writer thread"], (rank, r)


def body_failed_gather(rank, world, root):
    from parallel_layers.resilience import AsyncCheckpointer, complete_checkpoints, local_shards
    model, batches = _model_of((2, 1, 2), 1, seed=0), _batches()
    ck = AsyncCheckpointer(model, root)
    real = local_shards._check_pieces

    def broken(local):
        if rank == 1:                            # a non-writing rank's part of the assembly
            raise RuntimeError("injected failure in the background gather")
        return real(local)
    for i, (x, y) in enumerate(batches[:3], start=1):
        model.train_step(x, y)
        if i == 2:
            ck.save(2)
        if i == 3:
            with mock.patch.object(local_shards, "_check_pieces", broken), warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                ck.save(3)
                ck.wait()
    after_failure = [it for it, _ in complete_checkpoints(root)]
    model.train_step(*batches[3])
    ck.save(4)                                   # the writer's groups are still in step after the failure
    ck.wait()
    return {"failures": ck.failures, "after failure": after_failure,
            "iter3 files": sorted(os.listdir(os.path.join(root, "iter_0000003")))
            if os.path.isdir(os.path.join(root, "iter_0000003")) else [],
            "complete": [it for it, _ in complete_checkpoints(root)]}


def test_failed_background_gather_publishes_nothing(_pools, tmp_path):
    res = _pools(4, "gloo").run(body_failed_gather, str(tmp_path / "run"), timeout=300)
    for rank, r in enumerate(res):
        assert len(r["failures"]) == 1, (rank, r)
        assert "injected failure in the background gather" in r["failures"][0], (rank, r["failures"])
        assert "rank(s) [1]" in r["failures"][0] and "iteration 3" in r["failures"][0], (rank, r["failures"])
        assert r["after failure"] == [2] and "meta.json" not in r["iter3 files"], (rank, r)
        assert sorted(r["complete"]) == [2, 4], (rank, r)


# ---------------------------------------------------------------------- killed during the write
def _single_process(root: str, kill_during_write: bool) -> None:
    """A one-rank run (its own process group): saves asynchronously after steps 2 and 4 and prints each
    step's loss; ``kill_during_write``: SIGKILL itself in the background write of step 4, after the stage
    file and before ``meta.json``. Otherwise: resume, then train to step 5."""
    import torch.distributed as dist

    from parallel_layers.composition import universal_checkpoint as uc
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.resilience import AsyncCheckpointer, resume
    from parallel_layers.testing.workers import free_port
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model, batches = _model(ParallelMesh(1, 1, 1), seed=0), _batches()
    ck = AsyncCheckpointer(model, root)
    start = 0
    if not kill_during_write:
        start = resume(model, root)["iteration"]
        print(json.dumps({"resumed": start}), flush=True)
    for i in range(start + 1, 6):
        print(json.dumps({"step": i, "loss": model.train_step(*batches[i - 1])["loss"]}), flush=True)
        if i in (2, 4):
            if i == 4 and kill_during_write:
                ck.wait()                # step 2's write is published first; the kill is in step 4's

                def killed(directory, meta, latest_root, iteration):
                    os.kill(os.getpid(), signal.SIGKILL)
                uc._commit = killed
            ck.save(i)
        if i == 5 and kill_during_write:
            time.sleep(60)          # the writer kills the process long before this ends
    ck.wait()


def _run_single(root, kill):
    return subprocess.run([sys.executable, __file__, root, "kill" if kill else "resume"], capture_output=True,
                          text=True, timeout=240, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_kill_during_background_write_resumes_from_the_previous_checkpoint(tmp_path):
    from parallel_layers.resilience import complete_checkpoints
    root = str(tmp_path / "run")
    killed = _run_single(root, kill=True)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    half = os.listdir(os.path.join(root, "iter_0000004"))
    assert any(f.startswith("stage0-of-1.") for f in half) and "meta.json" not in half, half
    assert [it for it, _ in complete_checkpoints(root)] == [2]
    again = _run_single(root, kill=False)
    assert again.returncode == 0, again.stdout + again.stderr
    first = [json.loads(line) for line in killed.stdout.splitlines()]
    second = [json.loads(line) for line in again.stdout.splitlines()]
    assert second[0] == {"resumed": 2}
    losses = {r["step"]: r["loss"] for r in first if "step" in r}
    for r in second[1:]:                         # steps 3 and 4 repeat the killed run's bit for bit
        if r["step"] in losses:
            assert r["loss"] == losses[r["step"]], (first, second)
    assert {r["step"] for r in second[1:]} == {3, 4, 5} and {3, 4} <= set(losses)


if __name__ == "__main__":
    _single_process(sys.argv[1], kill_during_write=sys.argv[2] == "kill")
