"""A checkpoint is data: loading one never runs code (issue: per-rank and resume-state loads unpickled with
``weights_only=False``).

A checkpoint directory from someone else can hold a pickle that calls any function while it is read. Here
a crafted pickle calls ``os.mkdir(marker)`` (harmless, and visible afterwards), planted where the package
reads pickles back (the per-rank file, in its own crc32 and a recomputed ``meta.json`` checksum: the
checks a careful attacker passes; a universal checkpoint's ``meta["resume"]`` random streams, with the
checksum recomputed), in the two public ways a run loads a checkpoint (``load_checkpoint``, ``resume``) and
in ``resume_state.restore`` called directly. Every rank refuses it together with a ``CheckpointError``
naming what was refused and why, before the model is touched; the marker is never created. The
checkpoints the package writes itself load as before (``weights_only=True`` holds all they contain).
"""
import base64
import io
import json
import os
import types
import warnings
import zlib

import pytest
import torch

CFG = dict(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8, bias=False)


class _RunsCode:
    """Unpickling this calls ``os.mkdir(path)``: what any pickled callable could do instead."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (8, 9), generator=gen)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _model(seed):
    from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.testing import cached_mesh
    return Parallel3D(GPTConfig(**dict(CFG, dropout=0.1)), cached_mesh(2, 1, 1), seed=seed,
                      optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.1), pipeline=PipelineConfig(num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=1, bucket_cap_mb=0.002))


def _pickled(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _rewrite_meta(path: str, change) -> None:
    from parallel_layers.composition.universal_checkpoint import META, meta_checksum
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    change(meta)
    meta["checksum"] = meta_checksum(meta)
    with open(os.path.join(path, META), "w") as f:
        json.dump(meta, f)


def _plant_in_per_rank_file(path: str, rank: int, marker: str) -> str:
    """Rank ``rank``'s file replaced by one whose pickle runs code, its crc32 in meta.json updated."""
    with open(os.path.join(path, "meta.json")) as f:
        entry = json.load(f)["files"][rank]
    with open(os.path.join(path, entry["file"]), "rb") as f:
        saved = torch.load(f, weights_only=True)         # the package's own file loads as plain data
    data = _pickled({**saved, "state": _RunsCode(marker)})
    with open(os.path.join(path, entry["file"]), "wb") as f:
        f.write(data)

    def change(meta):
        meta["files"][rank].update(crc32=zlib.crc32(data), bytes=len(data))
    _rewrite_meta(path, change)
    return os.path.join(path, entry["file"])


def _plant_in_resume_state(path: str, rank: int, marker: str) -> None:
    """Rank ``rank``'s random streams in ``meta["resume"]`` replaced by a pickle that runs code."""
    def change(meta):
        payload = {"random": _RunsCode(marker), "skipped_steps": 0}
        meta["resume"]["ranks"][rank] = base64.b64encode(_pickled(payload)).decode("ascii")
    _rewrite_meta(path, change)


def _attempt(fn):
    try:
        return {"ok": fn()}
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks the type and message
        return {"error": type(exc).__name__, "message": str(exc)}


def body_crafted_checkpoint(rank, world, root, fmt):
    import torch.distributed as dist

    from parallel_layers.resilience import AsyncCheckpointer, load_checkpoint, resume
    model, batches = _model(seed=0), _batches(3)
    model.train_step(*batches[0])
    ck = AsyncCheckpointer(model, root, format=fmt, asynchronous=False, raise_errors=True)
    ck.save(1)
    path = ck.records[-1].path
    saved = {k: v.clone() for k, v in model.dense_state_dict().items()}

    fresh = _model(seed=7)                                # the package's own checkpoint loads (weights_only)
    good = load_checkpoint(fresh, path)
    own_loads = good["restored_random_state"] and all(torch.equal(saved[k], v)
                                                      for k, v in fresh.dense_state_dict().items())
    fresh.train_step(*batches[1])                        # it moves on from the checkpoint
    before = {k: v.clone() for k, v in fresh.dense_state_dict().items()}

    marker = os.path.join(root, "code-ran")
    planted = None
    if rank == 0:                                         # rank 1's part runs code
        if fmt == "per_rank":
            planted = _plant_in_per_rank_file(path, 1, marker)
        else:
            _plant_in_resume_state(path, 1, marker)
    dist.barrier()
    refused = _attempt(lambda: load_checkpoint(fresh, path))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _attempt(lambda: resume(fresh, root))
    dist.barrier()
    untouched = fmt == "universal" or all(torch.equal(before[k], v) for k, v in fresh.dense_state_dict().items())
    return {"own loads": own_loads, "refused": refused, "resumed": resumed, "untouched": untouched,
            "warnings": [str(w.message) for w in caught if "resume: skipping" in str(w.message)],
            "code ran": os.path.exists(marker), "planted": planted}


@pytest.mark.parametrize("fmt", ["per_rank", "universal"])
def test_crafted_checkpoint_is_refused_and_runs_no_code(dist_pools, tmp_path, fmt):
    res = dist_pools(2).run(body_crafted_checkpoint, str(tmp_path), fmt, timeout=300)
    planted = res[0]["planted"]
    for rank, r in enumerate(res):
        assert not r["code ran"], f"rank {rank}: loading the checkpoint ran the pickled code ({fmt})"
        assert r["own loads"], (rank, r)
        err = r["refused"]
        assert err.get("error") == "CheckpointError", (rank, err)     # on every rank, together
        msg = err["message"]
        assert "refused" in msg and "posix.mkdir" in msg and "weights_only=True" in msg, msg
        if fmt == "per_rank":
            assert planted in msg, msg                    # names the file
            assert r["untouched"], f"rank {rank}: the refused checkpoint changed the model"
        else:
            assert "resume state of rank 1" in msg and "meta.json" in msg, msg
        assert r["resumed"] == {"ok": None}, (rank, r["resumed"])      # the only checkpoint is skipped
        if rank == 0:
            assert len(r["warnings"]) == 1 and "refused" in r["warnings"][0], r["warnings"]
    assert not os.path.exists(tmp_path / "code-ran")


def body_restore_refuses_code(rank, world, marker):
    from parallel_layers.composition.universal_checkpoint import CheckpointError
    from parallel_layers.resilience import resume_state
    restored = []
    model = types.SimpleNamespace(mesh=types.SimpleNamespace(sizes={"pp": 1, "dp": world, "cp": 1, "tp": 1}),
                                  engine=types.SimpleNamespace(num_chunks=1), skipped_steps=0,
                                  load_random_state=restored.append)
    good = {"random": {"default": torch.get_rng_state(), "cuda": None, "tracker": None}, "skipped_steps": 3}
    text = base64.b64encode(_pickled(good)).decode("ascii")
    ok = resume_state.restore(model, {"layout": resume_state.layout_of(model), "ranks": [text] * world,
                                      "data": None})
    ok = ok and len(restored) == 1 and torch.equal(restored[0]["default"], good["random"]["default"])
    ok = ok and model.skipped_steps == 3

    crafted = base64.b64encode(_pickled({"random": _RunsCode(marker), "skipped_steps": 0})).decode("ascii")
    model.skipped_steps = 0
    try:                                                  # only rank 1's entry is crafted: both refuse
        resume_state.restore(model, {"layout": resume_state.layout_of(model), "ranks": [text, crafted],
                                     "data": None})
        refused = None
    except CheckpointError as exc:
        refused = str(exc)
    return {"good restored": ok, "refused": refused, "untouched": len(restored) == 1 and model.skipped_steps == 0,
            "code ran": os.path.exists(marker)}


def test_restore_refuses_resume_state_that_runs_code(dist_pools, tmp_path):
    marker = str(tmp_path / "code-ran")
    for rank, r in enumerate(dist_pools(2).run(body_restore_refuses_code, marker)):
        assert not r["code ran"], f"rank {rank}: restoring the random streams ran the pickled code"
        assert r["good restored"], (rank, r)
        assert r["refused"] is not None and "resume state of rank 1" in r["refused"], (rank, r)
        assert "posix.mkdir" in r["refused"] and "refused" in r["refused"], r["refused"]
        assert r["untouched"], (rank, r)
    assert not os.path.exists(marker)
