"""Training that survives failures (issue 35), end to end under torchrun.

Two torchrun agents on this machine stand in for two nodes (``--nnodes 2``, the c10d rendezvous on localhost,
``--max-restarts``) and run the demo unchanged with asynchronous universal checkpoints every 2 steps: at
dp2 x tp2 with ZeRO-3 and at dp2 x pp2 with ZeRO-1 (each two agents of 2 workers: 8 workers took 125 s of the
suite's time on 2 cores for the same mechanisms). A random rank is
killed with SIGKILL after a random step, twice in one run (``--inject-kill``: after the checkpoint write in
flight is published; a kill during a write is tests/test_async_checkpoint.py's). torchrun restarts the
workers; each restart finds the newest complete checkpoint under ``--save`` by itself and continues. Checked:

* every logged loss after the last resume, the validation losses and the final weights and AdamW moments
  are bit-identical to an uninterrupted run of the same layout;
* the work lost per failure (the killed step minus the iteration resumed from) is at most the save
  interval;
* the last attempt agrees with the single process (the demo's own comparison);
* shrink: a run of half the ranks and another layout (dp2 without tp or pp, ZeRO-2) resumes from the same
  directory and matches the single process trained on the same samples in the same order (the data position
  is global).

Under torchrun the run needs ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the agents' shared TCPStore a
restarted worker group finds the previous group's gloo addresses in the store and fails to connect
(torch 2.13); without sharing each rendezvous round gets a store of its own.
"""
import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from parallel_layers.composition.universal_checkpoint import read_universal
from parallel_layers.testing.workers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, INTERVAL = 6, 2
TINY = ["--n-layer", "2", "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
        "--microbatches", "2", "--corpus-bytes", "200000", "--no-progress", "--eval-interval", "4",
        "--save-interval", str(INTERVAL)]


def _env():
    return dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"), OMP_NUM_THREADS="1",
                TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def _start(cmd, log):
    """``cmd`` started with its output (stdout and stderr) going to the file ``log``: a process never waits
    on a pipe nobody reads while the test waits on another."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)


def _finish(procs, logs, timeout=900, tail=6000):
    """Waits for ``procs`` (each killed if it outlives ``timeout`` or the test fails); their joined output,
    each asserted to have exited 0."""
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        with open(log) as f:
            outs.append(f.read())
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-tail:]
    return "\n".join(outs)


def _start_demo(log, *args):
    """``python -m parallel_layers demo`` (ranks it starts itself), running; :func:`_finish` waits for it."""
    return _start([sys.executable, "-m", "parallel_layers", "demo", *TINY, *args], log)


def _demo(log, *args, timeout=900):
    return _finish([_start_demo(log, *args)], [log], timeout, tail=8000)


def _two_agents(demo_args, logs, per_agent: int, timeout=900):
    """Two torchrun agents of ``per_agent`` workers each, one c10d rendezvous on localhost; their joined
    output."""
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_agent),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"issue35-{port}",
           "--max-restarts", "2", "--monitor-interval", "0.5",
           "-m", "parallel_layers", "demo", *TINY, *demo_args]
    return _finish([_start(cmd, log) for log in logs], logs, timeout)


def _same_checkpoint(a, b):
    x, y = read_universal(a), read_universal(b)
    assert (x["step"], x["iteration"]) == (y["step"], y["iteration"])
    for state in ("model", "exp_avg", "exp_avg_sq"):
        assert x[state].keys() == y[state].keys()
        for name in x[state]:
            assert torch.equal(x[state][name], y[state][name]), (state, name)


# ZeRO stage -> (the killed run's layout, workers per agent, the shrunk run's layout)
LAYOUTS = {3: (("--dp", "2", "--tp", "2", "--pp", "1"), 2, ("--dp", "2", "--tp", "1", "--pp", "1")),
           1: (("--dp", "2", "--tp", "1", "--pp", "2"), 2, ("--dp", "2", "--tp", "1", "--pp", "1"))}


@pytest.mark.parametrize("zero", [1, 3], ids=["zero1", "zero3"])
def test_killed_twice_under_two_agents_ends_bit_identical_then_resumes_on_fewer_ranks(tmp_path, zero):
    killed_twice_then_shrink(tmp_path, zero=zero)


def killed_twice_then_shrink(tmp_path, zero: int) -> dict:
    """The test's whole run at ZeRO stage ``zero``; returns what it measured (``python
    tests/test_torchrun_restart.py --zero 3`` runs one case by itself)."""
    sizes, per_agent, shrunk_sizes = LAYOUTS[zero]
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    first = rng.randint(1, STEPS - 2)
    world = 2 * per_agent
    kills = [(first, rng.randrange(world)), (rng.randint(first + 1, STEPS), rng.randrange(world))]
    why = f"(random seed {seed}: kill -9 rank {kills[0][1]} after step {kills[0][0]}, rank {kills[1][1]} after " \
          f"step {kills[1][0]})"
    layout = [*sizes, "--zero", str(zero), "--steps", str(STEPS)]
    killed, plain = tmp_path / "killed", tmp_path / "plain"
    # the uninterrupted run of the same layout runs beside the killed one: on its own directories, in the
    # time the agents' processes spend waiting (rendezvous, restarts, a dead rank noticed)
    uninterrupted = _start_demo(tmp_path / "plain.log", *layout, "--save", str(plain / "ckpt"),
                                "--out", str(plain / "out"), "--no-reference")
    try:
        out = _two_agents([*layout, "--save", str(killed / "ckpt"), "--out", str(killed / "out"),
                           *[a for step, rank in kills for a in ("--inject-kill", f"{step}:{rank}")]],
                          [tmp_path / "agent0.log", tmp_path / "agent1.log"], per_agent)
    except BaseException:
        uninterrupted.kill()
        uninterrupted.wait()
        raise
    _finish([uninterrupted], [tmp_path / "plain.log"], tail=8000)
    assert out.count("demo: injected failure") == 2, why + out[-6000:]
    # every attempt says where it started: the first and each restart (from no checkpoint yet: iteration 0)
    started = sorted(int(n) for n in re.findall(r"demo: (?:resumed from \S+|no complete checkpoint under \S+: "
                                                r"starting) at iteration (\d+)", out))
    assert len(started) == 3 and started[0] == 0, why + out[-6000:]
    resumed = started[1:]
    for (step, _), it in zip(kills, resumed):      # the work lost per failure
        assert step - INTERVAL <= it <= step, (why, resumed)

    a = json.loads((killed / "out" / "summary.json").read_text())
    b = json.loads((plain / "out" / "summary.json").read_text())
    assert a["launcher"] == "torchrun" and a["first_step"] == resumed[-1] + 1 and a["agree"] is True, why
    assert a["losses"]["parallel"] == b["losses"]["parallel"][resumed[-1]:], why       # bit for bit
    assert a["val_losses"]["parallel"] == [v for v in b["val_losses"]["parallel"] if v[0] > resumed[-1]], why
    _same_checkpoint(str(killed / "ckpt" / f"iter_{STEPS:07d}"), str(plain / "ckpt" / f"iter_{STEPS:07d}"))

    # shrink: half the ranks, in another layout, continue the killed run's directory by themselves
    shrunk = _demo(tmp_path / "shrunk.log", *shrunk_sizes, "--zero", "2",
                   "--steps", str(STEPS + 2), "--save", str(killed / "ckpt"), "--out", str(tmp_path / "shrunk"))
    assert f"at iteration {STEPS} (random streams not restored: another layout)" in shrunk, shrunk
    s = json.loads((tmp_path / "shrunk" / "summary.json").read_text())
    assert s["first_step"] == STEPS + 1 and len(s["losses"]["parallel"]) == 2 and s["agree"] is True, shrunk
    return {"kills": kills, "resumed at": resumed, "lost steps": [k - it for (k, _), it in zip(kills, resumed)],
            "shrunk max rel diff": s["max_rel_diff"], "seed": seed}


if __name__ == "__main__":
    import argparse
    import pathlib
    import tempfile
    ap = argparse.ArgumentParser(description="the killed-twice run once, at a ZeRO stage of your choice")
    ap.add_argument("--zero", type=int, default=3)
    with tempfile.TemporaryDirectory() as tmp:
        print(killed_twice_then_shrink(pathlib.Path(tmp), ap.parse_args().zero))
