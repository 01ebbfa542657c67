"""Universal checkpoints: a Parallel3D run trains 2 steps on one mesh and saves; fresh processes on
ANOTHER mesh (other dp, tp, pp, ZeRO stage, schedule), built from another seed, load it and train 3
more steps. Losses, gradient norms and final weights must be the single-process GPT's over the same 5
steps (every rank checked), and the checkpoint must resume that GPT in a single process too.

Integrity: every corruption of a saved checkpoint (a flipped bit, a NaN, a file of another save or stage,
an edited meta.json, a missing tensor or file) is refused naming the file and tensor, on every rank; a
save killed before any of its disk operations leaves the latest complete checkpoint loadable."""
import dataclasses
import json
import math
import os
import shutil
from unittest import mock

import pytest
import torch

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from parallel_layers.composition.parallel3d import Parallel3D
from parallel_layers.composition.universal_checkpoint import (
    STATES,
    check_config,
    dense_states,
    load_dense_adamw,
    load_universal,
    read_meta,
    read_universal,
    resolve_checkpoint,
    save_iteration,
    save_universal,
)
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.testing import WorkerPool, cached_mesh

CFG = dict(vocab_size=63, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)   # 63: vocab padded at tp 2
# (no linear biases: the key bias gets a zero gradient in exact arithmetic, so AdamW steps it on rounding noise)
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5
BATCH, SEQ, SAVED_AT, STEPS = 8, 8, 2, 5
TOL = 1e-5

# name -> (saving layout, resuming layout); a layout is ((dp, tp, pp), zero, schedule, tied embeddings[,
# sequence parallel: a runtime setting, so a run may resume with it switched on])
CASES = {
    "3d-zero1-to-dp2pp2-zero3": (((2, 2, 2), 1, "1f1b", True), ((2, 1, 2), 3, "gpipe", True)),
    "dp2pp2-zero3-interleaved-to-3d-zero2": (((2, 1, 2), 3, "interleaved", True), ((2, 2, 2), 2, "1f1b", True)),
    "3d-dp-untied-to-tp2pp2-interleaved-sp": (((2, 2, 2), 0, "1f1b", False),
                                              ((1, 2, 2), 0, "interleaved", False, True)),
    "dp2pp4-zero2-to-dp2pp2-dp": (((2, 1, 4), 2, "gpipe", True), ((2, 1, 2), 0, "1f1b", True)),
}


def _cfg(tied, sequence_parallel=False):
    return GPTConfig(**CFG, tie_embeddings=tied, sequence_parallel=sequence_parallel)


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _model(layout, seed):
    dims, zero, schedule, tied, *sp = layout
    return Parallel3D(_cfg(tied, *sp), cached_mesh(*dims), seed=seed,
                      optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(schedule=schedule, num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=zero, bucket_cap_mb=0.002))


def body_save(rank, world, layout, path):
    model = _model(layout, seed=0)
    steps = [model.train_step(x, y) for x, y in _batches()[:SAVED_AT]]
    save_universal(model, path)
    return steps


def body_resume(rank, world, layout, path):
    model = _model(layout, seed=99)          # another init: every weight and moment must come from the files
    meta = load_universal(model, path)
    loaded, step = dense_states(model)       # read back through this layout: the files' tensors exactly
    steps = [model.train_step(x, y) for x, y in _batches()[meta["iteration"]:]]
    return {"steps": steps, "params": model.dense_state_dict(), "meta_step": meta["step"], "loaded": loaded,
            "loaded_step": step}


def _assert_loaded_exactly(resumed, ckpt):
    """Every rank's stages, read back from the resumed model, are the checkpoint's tensors bit for bit."""
    seen = set()
    for r, res in enumerate(resumed):
        assert res["loaded_step"] == ckpt["step"], r
        for name, states in res["loaded"].items():
            seen.add(name)
            for k, src in zip(STATES, ("model", "exp_avg", "exp_avg_sq")):
                assert torch.equal(states[k], ckpt[src][name]), (r, name, k)
    assert seen == set(ckpt["model"]), sorted(set(ckpt["model"]) - seen)


def _reference(tied):
    torch.manual_seed(0)
    dense = GPT(_cfg(tied))
    return dense, torch.optim.AdamW(dense.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def _train(dense, opt, batches):
    """Single-process steps: [(loss, gradient norm before clipping)]."""
    out = []
    for x, y in batches:
        _, loss = dense(x, y)
        loss.backward()
        out.append((loss.item(), torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP).item()))
        opt.step()
        opt.zero_grad()
    return out


def _rel(a, b):
    return abs(a - b) / abs(b)


def _rel_t(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _worst(errors):
    """The largest ``(error, name)``, a NaN error counting as the largest (Python's ``max`` keeps a NaN only
    when it comes first)."""
    return max(errors, key=lambda e: math.inf if math.isnan(e[0]) else e[0])


def _world(layout):
    dp, tp, pp = layout[0]
    return dp * tp * pp


@pytest.mark.parametrize("case", list(CASES))
def test_universal_checkpoint_resumes_on_another_mesh(dist_pools, tmp_path, case):
    saving, resuming = CASES[case]
    path = str(tmp_path / "ckpt")
    saved = dist_pools(_world(saving)).run(body_save, saving, path, timeout=240)
    with WorkerPool(_world(resuming)) as pool:        # new processes, new process groups, another mesh
        resumed = pool.run(body_resume, resuming, path, timeout=240)

    dense, opt = _reference(saving[3])
    ref = _train(dense, opt, _batches()[:SAVED_AT])
    ckpt = read_universal(path)
    saved_mesh = dict(zip(("dp", "tp", "pp", "cp", "ep"), (*saving[0], 1, 1)))
    assert ckpt["step"] == SAVED_AT and ckpt["saved from"]["mesh"] == saved_mesh, ckpt["saved from"]
    # the checkpoint is the single-process model after 2 steps: weights and both moments, every parameter
    names = [n for n, _ in dense.named_parameters()]
    assert sorted(ckpt["model"]) == sorted(names) == sorted(ckpt["tensors"])
    for n, entry in ckpt["tensors"].items():  # the manifest a loading rank reads only its own stages' files by
        assert n in torch.load(str(tmp_path / "ckpt" / entry["file"]), weights_only=True, mmap=True)["param"], n
    for n, p in dense.named_parameters():
        st = opt.state[p]
        assert _rel_t(ckpt["model"][n], p.detach()) < TOL, n
        assert _rel_t(ckpt["exp_avg"][n], st["exp_avg"]) < TOL, n
        assert _rel_t(ckpt["exp_avg_sq"][n], st["exp_avg_sq"]) < TOL, n
    _assert_loaded_exactly(resumed, ckpt)
    ref += _train(dense, opt, _batches()[SAVED_AT:])
    final = dense.state_dict()
    for r, (a, b) in enumerate(zip(saved, resumed)):
        assert b["meta_step"] == SAVED_AT
        got = [(s["loss"], s["grad_norm"]) for s in a + b["steps"]]
        for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, ref)):
            assert _rel(loss, ref_loss) < TOL and _rel(norm, ref_norm) < TOL, (r, i, loss, ref_loss, norm, ref_norm)
        worst = _worst([(_rel_t(t, final[n]), n) for n, t in b["params"].items()])
        assert worst[0] < TOL, (r, worst)

    # and in a single process: GPT + torch AdamW from the same files continue like the reference
    single, single_opt = _reference(saving[3])
    single.load_state_dict(ckpt["model"])
    load_dense_adamw(single_opt, single, ckpt)
    cont = _train(single, single_opt, _batches()[SAVED_AT:])
    for (loss, norm), (ref_loss, ref_norm) in zip(cont, ref[SAVED_AT:]):
        assert _rel(loss, ref_loss) < TOL and _rel(norm, ref_norm) < TOL
    assert _worst([(_rel_t(t, final[n]), n) for n, t in single.state_dict().items()])[0] < TOL


def _fp16_model(dims, zero, seed):
    from parallel_layers.amp import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=1, hysteresis=1)   # grows every step
    return Parallel3D(_cfg(True), cached_mesh(*dims), seed=seed,
                      optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=zero, bucket_cap_mb=0.002),
                      precision=PrecisionConfig(dtype=torch.float16, loss_scaler=scaler))


def body_fp16_save(rank, world, path):
    model = _fp16_model((2, 2, 2), 2, seed=0)
    for x, y in _batches()[:SAVED_AT]:
        model.train_step(x, y)
    save_universal(model, path)
    return model.scaler.state_dict()


def body_fp16_resume(rank, world, path):
    model = _fp16_model((2, 1, 2), 1, seed=99)
    load_universal(model, path)
    loaded, step = dense_states(model)
    scaler = model.scaler.state_dict()
    fp16 = model.dense_state_dict()          # the parameters the forward uses
    out = model.train_step(*_batches()[SAVED_AT])
    return {"loaded": loaded, "loaded_step": step, "scaler": scaler, "loss": out["loss"], "fp16": fp16}


def test_universal_checkpoint_fp16_carries_master_weights_and_scaler(dist_pools, tmp_path):
    """An fp16 run (ZeRO-2, dp2 x tp2 x pp2) saves its fp32 master weights, moments and loss scaler; an
    fp16 ZeRO-1 run on dp2 x pp2 loads them bit for bit (the fp16 copy rounded from them) and trains on."""
    path = str(tmp_path / "ckpt")
    saved = dist_pools(8).run(body_fp16_save, path, timeout=240)
    with WorkerPool(4) as pool:
        resumed = pool.run(body_fp16_resume, path, timeout=240)
    ckpt = read_universal(path)
    assert ckpt["scaler"] == saved[0] and ckpt["scaler"]["scale"] > 2.0 ** 10, ckpt["scaler"]   # it moved
    assert all(t.dtype == torch.float32 for t in ckpt["model"].values())
    _assert_loaded_exactly(resumed, ckpt)
    for res in resumed:
        assert res["scaler"] == ckpt["scaler"] and 0 < res["loss"] < 10
        for name, t in res["fp16"].items():      # the fp16 copy is the saved master rounded
            assert t.dtype == torch.float16 and torch.equal(t, ckpt["model"][name].half()), name


def test_universal_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        read_meta(str(tmp_path))
    meta = {"format": "parallel_layers.universal/2", "step": 3, "files": [],
            "config": dict(dataclasses.asdict(_cfg(True)), n_layer=6)}
    with pytest.raises(ValueError, match=r"another model: n_layer: saved 6, here 4"):
        check_config(_cfg(True), meta, str(tmp_path))
    check_config(_cfg(True), dict(meta, config=dataclasses.asdict(_cfg(True))), str(tmp_path))   # same: accepted
    runtime = dataclasses.asdict(_cfg(True, sequence_parallel=True)) | {"dropout": 0.1, "seed": 7}
    check_config(_cfg(True), dict(meta, config=runtime), str(tmp_path))      # runtime settings may differ
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, format="other/9")))
    with pytest.raises(ValueError, match="format 'other/9'"):
        read_meta(str(tmp_path))
    # written before checksums: refused with what to do, never loaded unchecked
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, format="parallel_layers.universal/1")))
    with pytest.raises(ValueError, match=r"written before checkpoints carried checksums.*save it again"):
        read_meta(str(tmp_path))
    shutil.rmtree(tmp_path)


def _demo(tmp_path, *extra):
    import os
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
           "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--corpus-bytes", "200000", "--no-progress",
           "--eval-interval", "2", *extra]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_saves_and_resumes_on_another_layout(tmp_path):
    """``demo --save`` on dp2 x tp2 x pp2 ZeRO-1 (checkpoints after steps 2 and 4), then ``demo --load`` of
    the step-2 one on dp2 x pp2 ZeRO-3 GPipe: steps 3-4 repeat the first run's and agree with the
    single-process run; a resume with nothing left to train is refused before any process starts."""
    ckpt = tmp_path / "ckpt"
    first = _demo(tmp_path, "--steps", "4", "--zero", "1", "--save", str(ckpt), "--save-interval", "2",
                  "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stdout + first.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert read_meta(str(ckpt / "iter_0000002"))["iteration"] == 2
    resumed = _demo(tmp_path, "--steps", "4", "--dp", "2", "--tp", "1", "--pp", "2", "--zero", "3", "--schedule",
                    "gpipe", "--load", str(ckpt / "iter_0000002"), "--out", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout and "losses agree" in resumed.stdout, resumed.stdout
    a = json.loads((tmp_path / "first" / "summary.json").read_text())
    b = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert b["first_step"] == 3 and b["agree"] is True and len(b["losses"]["parallel"]) == 2
    for x, y in zip(a["losses"]["parallel"][2:], b["losses"]["parallel"]):
        assert abs(x - y) <= 1e-6 * abs(x), (a["losses"], b["losses"])
    assert [s for s, _ in b["val_losses"]["parallel"]] == [4]
    done = _demo(tmp_path, "--steps", "4", "--load", str(ckpt), "--out", str(tmp_path / "done"))
    assert done.returncode != 0 and "is at iteration 4" in done.stdout + done.stderr


# ---------------------------------------------------------------------- integrity and crash safety
def body_save_twice(rank, world, root):
    """pp 2 (two stage files): iterations 1 and 2 under ``root``, one training step apart."""
    model = _model(((1, 1, 2), 1, "1f1b", True), seed=0)
    for iteration, (x, y) in enumerate(_batches()[:2], start=1):
        model.train_step(x, y)
        save_iteration(model, root, iteration)


@pytest.fixture(scope="module")
def saved(_pools, tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity") / "root"
    _pools(2, os.environ.get("PL_TEST_BACKEND", "gloo")).run(body_save_twice, str(root), timeout=240)
    return root


def _meta(path):
    return json.loads((path / "meta.json").read_text())


def _stage_file(path, k):
    return path / _meta(path)["files"][k]


def _reseal(path, edit):
    """Edit ``meta.json`` and give it a matching checksum: a consistent forgery, not a corruption."""
    from parallel_layers.composition.universal_checkpoint import meta_checksum
    meta = _meta(path)
    edit(meta)
    meta["checksum"] = meta_checksum(meta)
    (path / "meta.json").write_text(json.dumps(meta))


def _flip_bit(path):
    f = _stage_file(path, 1)
    raw = torch.load(f, weights_only=True)["param"]["blocks.3.mlp.fc.weight"].numpy().tobytes()
    data = bytearray(f.read_bytes())
    at = data.find(raw)
    assert at > 0 and data.find(raw, at + 1) == -1
    data[at + 9] ^= 0x04
    f.write_bytes(bytes(data))


def _nan_resealed(path):
    from parallel_layers.composition.universal_checkpoint import tensor_crc32
    f = _stage_file(path, 0)
    data = torch.load(f, weights_only=True)
    t = data["exp_avg"]["wte.weight"]
    t[3, 1] = float("nan")
    torch.save(data, f)
    _reseal(path, lambda m: m["tensors"]["wte.weight"]["crc32"].update(exp_avg=tensor_crc32(t)))


def _from_iteration_1(path):
    shutil.copy(_stage_file(path.parent / "iter_0000001", 1), _stage_file(path, 1))


def _swap_stage_files(path):
    a, b = _stage_file(path, 0), _stage_file(path, 1)
    a.rename(path / "swap")
    b.rename(a)
    (path / "swap").rename(b)


def _step(step, reseal):
    def corrupt(path):
        if reseal:
            _reseal(path, lambda m: m.update(step=step))
        else:
            (path / "meta.json").write_text(json.dumps(dict(_meta(path), step=step)))
    return corrupt


def _drop_tensor(path):
    f = _stage_file(path, 0)
    data = torch.load(f, weights_only=True)
    del data["param"]["wte.weight"]
    torch.save(data, f)


def _truncate(path):
    f = _stage_file(path, 0)
    f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])


STAGE0, STAGE1 = r"stage0-of-2\.[0-9a-f]+\.pt", r"stage1-of-2\.[0-9a-f]+\.pt"
CORRUPTIONS = {
    "bit-flip": (_flip_bit, STAGE1 + r": blocks\.3\.mlp\.fc\.weight \(param\) does not match its checksum"),
    "nan-tensor": (_nan_resealed, STAGE0 + r": wte\.weight \(exp_avg\) holds NaN or infinite values"),
    "stage-file-of-another-iteration": (_from_iteration_1, STAGE1 + r" belongs to another save \(iteration 1, "
                                        r"step 1\) than its meta\.json \(iteration 2, step 2\)"),
    "swapped-stage-files": (_swap_stage_files, STAGE0 + r" holds stage 1 of 2, but meta\.json lists it as stage 0"),
    "step-1000": (_step(1000, False), r"meta\.json does not match its checksum"),
    "step-minus-5": (_step(-5, False), r"meta\.json: step -5 must be a non-negative integer"),
    "step-1000-resealed": (_step(1000, True), STAGE0 + r" was saved at iteration 2, step 2, but meta\.json says "
                                                      r"iteration 2, step 1000"),
    "missing-tensor": (_drop_tensor, STAGE0 + r" lacks 1 tensor\(s\) meta\.json puts in it: \['wte\.weight'\] "
                                              r"\(param\)"),
    "missing-file": (lambda p: _stage_file(p, 1).unlink(), STAGE1 + " is missing"),
    "truncated-file": (_truncate, STAGE0 + " cannot be read"),
    "meta-not-json": (lambda p: (p / "meta.json").write_text((p / "meta.json").read_text()[:100]),
                      r"meta\.json is not valid JSON"),
}


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "root")
    return tmp_path / "root"


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupted_checkpoint_is_refused_naming_the_file_and_tensor(saved, tmp_path, case):
    from parallel_layers.composition.universal_checkpoint import CheckpointError
    root = _copy(saved, tmp_path)
    corrupt, message = CORRUPTIONS[case]
    read_universal(resolve_checkpoint(str(root)))          # sound before
    corrupt(root / "iter_0000002")
    with pytest.raises(CheckpointError, match=message):
        read_universal(resolve_checkpoint(str(root)))
    read_universal(str(root / "iter_0000001"))              # the earlier checkpoint still loads


def test_latest_that_names_no_iteration_is_refused(saved, tmp_path):
    from parallel_layers.composition.universal_checkpoint import CheckpointError
    root = _copy(saved, tmp_path)
    assert read_universal(resolve_checkpoint(str(root)))["iteration"] == 2
    (root / "latest_checkpointed_iteration.txt").write_text("abc\n")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration\.txt holds 'abc', not an iteration"):
        resolve_checkpoint(str(root))


def body_load_refused(rank, world, path):
    from parallel_layers.composition.universal_checkpoint import CheckpointError
    model = _model(((1, 1, 2), 1, "1f1b", True), seed=99)
    before = model.dense_state_dict()
    try:
        load_universal(model, path)
    except CheckpointError as exc:
        after = model.dense_state_dict()
        return str(exc), all(torch.equal(before[n], after[n]) for n in before)
    return None, None


def test_load_is_refused_on_every_rank_before_the_model_changes(saved, tmp_path, dist_pools):
    """Only rank 1 reads the damaged stage-1 file; rank 0 refuses too (naming rank 1's finding) instead of
    starting a step that would wait on rank 1."""
    root = _copy(saved, tmp_path)
    _flip_bit(root / "iter_0000002")
    for rank, (msg, untouched) in enumerate(dist_pools(2).run(body_load_refused, str(root / "iter_0000002"))):
        assert msg is not None and untouched, (rank, msg)
        assert "rank(s) [1]" in msg and "blocks.3.mlp.fc.weight (param) does not match its checksum" in msg, msg


class _Killed(BaseException):
    """The process died here (a BaseException, so that no ``except Exception`` in the save sees it)."""


class _DyingAt:
    """Counts the disk operations of a save (writes, fsyncs, renames, removals); the ``at``-th kills the
    process instead, a write half done. ``at`` 0: count only."""

    def __init__(self, at):
        self.at, self.count = at, 0
        self._patches = [mock.patch.object(os, n, self._op(n, getattr(os, n))) for n in ("replace", "remove", "fsync")]
        self._patches.append(mock.patch.object(torch, "save", self._op("save", torch.save)))

    def _op(self, name, real):
        def op(*args, **kwargs):
            self.count += 1
            if self.count != self.at:
                return real(*args, **kwargs)
            if name == "save":
                real(*args, **kwargs)
                with open(args[1], "r+b") as f:
                    f.truncate(os.path.getsize(args[1]) // 2)
            raise _Killed(f"{name} #{self.at}")
        return op

    def __enter__(self):
        for p in self._patches:
            p.start()
        return self

    def __exit__(self, *exc):
        for p in self._patches:
            p.stop()


def _same(got, want):
    return sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


def _state_after_kill(root, old, new):
    """(which weights the latest checkpoint under ``root`` holds: "old" | "new" | a reason, its iteration)."""
    try:
        ckpt = read_universal(resolve_checkpoint(root))
    except Exception as exc:  # noqa: BLE001 - reported by the test
        return f"unloadable: {type(exc).__name__}: {exc}", None
    return ("old" if _same(ckpt["model"], old) else "new" if _same(ckpt["model"], new) else "neither",
            ckpt["iteration"])


def body_killed_saves(rank, world, base):
    from parallel_layers.composition.universal_checkpoint import iteration_dir
    model = _model(((1, 1, 1), 0, "1f1b", True), seed=0)
    model.train_step(*_batches()[0])
    pristine = os.path.join(base, "pristine")
    save_iteration(model, pristine, 1)
    old = read_universal(iteration_dir(pristine, 1))["model"]
    model.train_step(*_batches()[1])
    new = {n: st["param"] for n, st in dense_states(model)[0].items()}
    outcomes, leftovers = [], {}
    for iteration in (2, 1):                  # the next iteration, and the saved one again
        with _DyingAt(0) as counter:
            save_iteration(model, os.path.join(base, f"count{iteration}"), iteration)
        for at in range(1, counter.count + 1):
            root = os.path.join(base, f"{iteration}-{at}")
            shutil.copytree(pristine, root)
            try:
                with _DyingAt(at):
                    save_iteration(model, root, iteration)
                died = None
            except _Killed as exc:
                died = str(exc)
            outcomes.append((iteration, at, died, *_state_after_kill(root, old, new)))
        root = os.path.join(base, f"{iteration}-{counter.count // 2}")
        save_iteration(model, root, iteration)        # complete, over what the killed one left
        meta = read_meta(iteration_dir(root, iteration))
        leftovers[iteration] = sorted(set(os.listdir(iteration_dir(root, iteration))) - {"meta.json", *meta["files"]})
    p = next(model.model.parameters())
    keep = p.detach().clone()
    with torch.no_grad():
        p.view(-1)[0] = float("nan")
    try:
        save_iteration(model, pristine, 3)
        refused = None
    except Exception as exc:  # noqa: BLE001 - reported by the test
        refused = str(exc)
    with torch.no_grad():
        p.copy_(keep)
    return outcomes, leftovers, refused, _state_after_kill(pristine, old, new)


def test_a_save_killed_at_any_moment_leaves_the_latest_complete_checkpoint_loadable(dist_pools, tmp_path):
    """A 1-rank run saves iteration 1, trains a step, then saves again (as iteration 2, and as iteration 1
    over the first), killed before each disk operation in turn (a write dies half done): the latest
    checkpoint then loads, holding the old weights until the new save is complete, the new ones after."""
    outcomes, leftovers, refused, pristine = dist_pools(1).run(body_killed_saves, str(tmp_path), timeout=240)[0]
    for iteration in (2, 1):
        mine = [o for o in outcomes if o[0] == iteration]
        held = [o[3] for o in mine]
        assert all(h in ("old", "new") for h in held), [o for o in mine if o[3] not in ("old", "new")]
        assert held[0] == "old" and held[-1] == "new" and held == sorted(held, reverse=True), mine  # old, then new
        assert all(it == (1 if h == "old" else iteration) for _, _, _, h, it in mine), mine
        assert len(mine) >= 8 and all(o[2] for o in mine), mine         # every operation was a kill point
        assert leftovers[iteration] == [], leftovers
    assert refused is not None and "hold NaN or infinite values" in refused, refused
    assert pristine == ("old", 1)        # the refused save left the latest checkpoint as it was
