"""3D parallelism (dp=2 x tp=2 x pp=2, 8 gloo processes, every rank checked) against the single-process
GPT over 5 steps: plain DP, ZeRO-1 and ZeRO-2, with global gradient clipping active; ZeRO-3 with the
pipeline (dp=2 x pp=2 under 1f1b, gpipe and interleaved, and dp=2 x tp=2 x pp=2); and the demo
(``python -m parallel_layers demo``) end to end in a subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
from parallel_layers.composition.parallel3d import Parallel3D
from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.testing import WorkerPool, cached_mesh
from parallel_layers.testing.compare import worst

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5
BATCH, SEQ, STEPS = 8, 8, 5


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference():
    """The oracle: the single-process fp32 GPT (seed 0) and its torch AdamW."""
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    return dense, torch.optim.AdamW(dense.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def _reference_step(dense, opt, x, y):
    """One clipped step of the oracle: (loss, gradient norm before clipping)."""
    _, loss = dense(x, y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP).item()
    opt.step()
    opt.zero_grad()
    return loss.item(), norm


def _eval_err(model, dense):
    """Relative error of ``model.evaluate`` on a held-out batch of another shape (16 x 6) against the
    dense model's eval-mode loss at the same weights."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG["vocab_size"], (2 * BATCH, SEQ - 1), generator=gen)
    dense.eval()
    with torch.no_grad():
        _, ref = dense(x[:, :-1], x[:, 1:])
    dense.train()
    got = model.evaluate(x[:, :-1].contiguous(), x[:, 1:].contiguous())
    return abs(got - ref.item()) / ref.item()


def _step_errs(out, ref_loss, ref_norm):
    """Relative errors of a train_step's loss and gradient norm against the oracle's."""
    return abs(out["loss"] - ref_loss) / abs(ref_loss), abs(out["grad_norm"] - ref_norm) / ref_norm


def body_3d(rank, world, zero, schedule):
    mesh = cached_mesh(dp=2, tp=2, pp=2)
    cfg = GPTConfig(**CFG)
    dense, ref_opt = _reference()
    model = Parallel3D(cfg, mesh, seed=0,
                       optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                       pipeline=PipelineConfig(schedule=schedule, num_microbatches=2),
                       data_parallel=DataParallelConfig(zero=zero, bucket_cap_mb=0.002))
    loss_errs, norm_errs, clipped, eval_errs = [], [], [], []
    for i, (x, y) in enumerate(_batches(STEPS)):
        ref_loss, ref_norm = _reference_step(dense, ref_opt, x, y)
        out = model.train_step(x, y)
        loss_err, norm_err = _step_errs(out, ref_loss, ref_norm)
        loss_errs.append(loss_err)
        norm_errs.append(norm_err)
        clipped.append(ref_norm > CLIP)
        if i in (0, 2):                  # validation between steps; the later steps must not notice it
            eval_errs.append(_eval_err(model, dense))
    ref = dense.state_dict()
    got = model.dense_state_dict()
    param_errs = {k: _rel(v, ref[k]) for k, v in got.items()}
    return {"loss": loss_errs, "norm": norm_errs, "clipped": clipped, "params": param_errs, "eval": eval_errs}


@pytest.mark.parametrize("zero,schedule", [(0, "1f1b"), (1, "gpipe"), (2, "interleaved")])
def test_3d_matches_single_process(dist_pools, zero, schedule):
    out = dist_pools(8).run(body_3d, zero, schedule, timeout=240)
    names = set()
    for r, res in enumerate(out):
        assert worst(res["loss"]) < 1e-5, (r, res["loss"])
        assert worst(res["norm"]) < 1e-5, (r, res["norm"])
        assert len(res["eval"]) == 2 and worst(res["eval"]) < 1e-5, (r, res["eval"])
        assert any(res["clipped"]), "clipping never active: the test would prove little"
        name, err = worst(res["params"].items(), key=lambda kv: kv[1])
        assert err < 1e-5, (r, name, err)
        names |= set(res["params"])
    torch.manual_seed(0)
    assert names == set(GPT(GPTConfig(**CFG)).state_dict())      # every parameter checked somewhere


# ---------------------------------------------------------------------- ZeRO-3 inside the pipeline
def body_3d_zero3(rank, world, dims, schedule):
    """ZeRO-3 over dp with the pipeline (parameters gathered once per step, kept for every microbatch,
    reduced and resharded at its end) against the single-process fp32 GPT; between steps this rank holds
    only its shard (every stage parameter's storage freed, ~1/dp of the stage in ``shard_buffer``)."""
    dp, tp, pp = dims
    mesh = cached_mesh(dp=dp, tp=tp, pp=pp)
    cfg = GPTConfig(**CFG)
    dense, ref_opt = _reference()
    model = Parallel3D(cfg, mesh, seed=0,
                       optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                       pipeline=PipelineConfig(schedule=schedule, num_microbatches=2),
                       data_parallel=DataParallelConfig(zero=3))
    stage_numel = sum(p.numel() for p in model.model.parameters())
    loss_errs, norm_errs, clipped, resident, gathers = [], [], [], [], []
    z = model.z
    eval_errs, after_eval = [], []
    for i, (x, y) in enumerate(_batches(STEPS)):
        ref_loss, ref_norm = _reference_step(dense, ref_opt, x, y)
        out = model.train_step(x, y)
        # the all-gathers this step launched (ZeroStage3's timeline starts anew with each step's gathering)
        gathers.append(sorted(e[1] for e in z.timeline if e[0] == "gather_launch"))
        loss_err, norm_err = _step_errs(out, ref_loss, ref_norm)
        loss_errs.append(loss_err)
        norm_errs.append(norm_err)
        clipped.append(ref_norm > CLIP)
        resident.append(sum(p.untyped_storage().nbytes() for p in model.model.parameters())
                        + sum(p.grad is not None for p in model.model.parameters()))
        if i == 1:                       # validation between steps: gathered for it, resharded after
            eval_errs.append(_eval_err(model, dense))
            after_eval.append(sum(p.untyped_storage().nbytes() for p in model.model.parameters()))
    rep = model.memory_report()
    ref = dense.state_dict()
    got = model.dense_state_dict()
    after_sd = sum(p.untyped_storage().nbytes() for p in model.model.parameters())
    param_errs = {k: _rel(v, ref[k]) for k, v in got.items()}
    return {"loss": loss_errs, "norm": norm_errs, "clipped": clipped, "params": param_errs,
            "resident": resident, "after_sd": after_sd, "gathers": gathers, "units": len(z.units),
            "eval": eval_errs, "after_eval": after_eval,
            "stage_numel": stage_numel, "rep": {k: rep[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes",
                                                                   "gathered_bytes", "dp_size", "num_params")}}


@pytest.mark.parametrize("dims,schedule", [((2, 1, 2), "1f1b"), ((2, 1, 2), "gpipe"), ((2, 1, 2), "interleaved"),
                                           ((2, 2, 2), "1f1b")])
def test_3d_zero3_matches_single_process(dist_pools, dims, schedule):
    dp, tp, pp = dims
    out = dist_pools(dp * tp * pp).run(body_3d_zero3, dims, schedule, timeout=240)
    names = set()
    for r, res in enumerate(out):
        assert worst(res["loss"]) < 1e-5, (r, res["loss"])
        assert worst(res["norm"]) < 1e-5, (r, res["norm"])
        assert any(res["clipped"]), "clipping never active: the test would prove little"
        name, err = worst(res["params"].items(), key=lambda kv: kv[1])
        assert err < 1e-5, (r, name, err)
        names |= set(res["params"])
        # every unit gathered exactly once per step (not once per microbatch)
        assert res["gathers"] == [list(range(res["units"]))] * STEPS, (r, res["gathers"])
        # between steps (and after dense_state_dict): no full parameter or gradient storage on this rank
        assert res["resident"] == [0] * STEPS and res["after_sd"] == 0, (r, res["resident"], res["after_sd"])
        assert worst(res["eval"]) < 1e-5 and res["after_eval"] == [0], (r, res["eval"], res["after_eval"])
        rep = res["rep"]
        assert rep["gathered_bytes"] == 0 and rep["num_params"] == res["stage_numel"], (r, rep)
        full = 4 * res["stage_numel"]
        # 1/dp of the stage (+ per-unit padding to 16 * dp elements)
        slack = 4 * 16 * (res["units"])
        assert full / dp <= rep["param_bytes"] <= full / dp + slack, (r, rep, full)
        assert rep["grad_bytes"] == rep["param_bytes"] and rep["optimizer_bytes"] == 2 * rep["param_bytes"], rep
    torch.manual_seed(0)
    assert names == set(GPT(GPTConfig(**CFG)).state_dict())      # every parameter checked somewhere


# ---------------------------------------------------------------------- activation checkpointing, dropout on
def body_3d_checkpointing(rank, world, dims, zero, sequence_parallel):
    """Two steps with dropout on: plain, every block checkpointed, and plain with other dropout masks.
    Checkpointing recomputes each block in backward with the forward's RNG state (the default
    generator for replicated activations, the TP tracker's stream for sharded ones), so losses and
    parameters must be bit-identical to the plain run's; a recompute counter proves it ran."""
    dp, tp, pp = dims
    mesh = cached_mesh(dp=dp, tp=tp, pp=pp)
    runs = []
    for ckpt, dropout_seed in ((False, 5), (True, 5), (False, 6)):
        # dropout_seed: the default generator's (replicated activations) and the TP stream's (sharded ones)
        cfg = GPTConfig(**CFG, dropout=0.2, sequence_parallel=sequence_parallel, seed=dropout_seed)
        model = Parallel3D(cfg, mesh, seed=0,
                           optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                           pipeline=PipelineConfig(schedule="1f1b", num_microbatches=2, checkpoint=ckpt),
                           data_parallel=DataParallelConfig(zero=zero))
        calls = [0]
        for chunk in model.chunks:
            for block in chunk.blocks:
                block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        torch.manual_seed(dropout_seed)            # after the constructor (it seeds the weights)
        losses = [model.train_step(x, y)["loss"] for x, y in _batches(2)]
        runs.append((losses, model.dense_state_dict(), calls[0]))
    (plain, plain_sd, plain_calls), (ck, ck_sd, ck_calls), (other, _, _) = runs
    return {"same_loss": plain == ck, "other_loss_differs": plain != other,
            "differing": [k for k in plain_sd if not torch.equal(plain_sd[k], ck_sd[k])],
            "calls": (plain_calls, ck_calls)}


@pytest.mark.parametrize("zero,sequence_parallel", [(1, True), (3, False)], ids=["zero1-sp", "zero3"])
def test_3d_checkpointing_replays_dropout(dist_pools, zero, sequence_parallel):
    """dp=2 x tp=2 x pp=2: checkpointed blocks inside TP regions (with sequence parallelism) and under
    ZeRO-3 (recomputed on the parameters kept gathered for the step) train exactly like plain ones."""
    for r, res in enumerate(dist_pools(8).run(body_3d_checkpointing, (2, 2, 2), zero, sequence_parallel,
                                                timeout=240)):
        assert res["same_loss"] and not res["differing"], (r, res)
        assert res["other_loss_differs"], f"rank {r}: dropout had no effect (the test would prove nothing)"
        # 2 blocks per stage x 2 microbatches x 2 steps; checkpointed: each also recomputed once
        assert res["calls"] == (8, 16), (r, res["calls"])


# ---------------------------------------------------------------------- checkpoint and resume
RESUME_CASES = {"dp-1f1b": (0, "1f1b", torch.float32), "zero2-interleaved-fp16": (2, "interleaved", torch.float16),
                "zero3-gpipe": (3, "gpipe", torch.float32)}


def _resume_model(case, seed):
    zero, schedule, dtype = RESUME_CASES[case]
    mesh = cached_mesh(dp=2, tp=2, pp=2)
    cfg = GPTConfig(**dict(CFG, dropout=0.1))           # dropout on: resuming must restore the random streams
    if dtype == torch.float16:                          # growth_interval 2: the scale changes during the run
        return _fp16_model(mesh, cfg, zero=zero, schedule=schedule, seed=seed, growth_interval=2)
    return Parallel3D(cfg, mesh, seed=seed,
                      optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(schedule=schedule, num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=zero, bucket_cap_mb=0.002),
                      precision=PrecisionConfig(dtype=dtype))


def _resume_result(model, losses):
    scaler = None if model.scaler is None else model.scaler.state_dict()
    return {"losses": losses, "params": model.dense_state_dict(), "scaler": scaler,
            "optimizer": model.optimizer.state_dict()}


def body_train_and_save(rank, world, case, path):
    model = _resume_model(case, seed=0)
    batches = _batches(STEPS)
    for x, y in batches[:2]:
        model.train_step(x, y)
    torch.save(model.state_dict(), f"{path}/rank{rank}.pt")
    return _resume_result(model, [model.train_step(x, y)["loss"] for x, y in batches[2:]])


def body_load_and_resume(rank, world, case, path):
    model = _resume_model(case, seed=99)                # another init: everything must come from the files
    try:                                                # a neighbour's file is refused before anything loads
        model.load_state_dict(torch.load(f"{path}/rank{(rank + 1) % world}.pt", weights_only=True))
        wrong = None
    except ValueError as e:
        wrong = str(e)
    model.load_state_dict(torch.load(f"{path}/rank{rank}.pt", weights_only=True))
    out = _resume_result(model, [model.train_step(x, y)["loss"] for x, y in _batches(STEPS)[2:]])
    out["wrong"] = wrong
    return out


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_3d_checkpoint_resumes_bit_identically_in_fresh_processes(dist_pools, tmp_path, case):
    """dp 2 x tp 2 x pp 2, dropout on: 2 steps, every rank saves Parallel3D.state_dict(), 3 more steps;
    8 new processes build the model from another seed, load their files and take the same 3 steps."""
    straight = dist_pools(8).run(body_train_and_save, case, str(tmp_path), timeout=240)
    with WorkerPool(8) as pool:                         # new processes, new process groups
        resumed = pool.run(body_load_and_resume, case, str(tmp_path), timeout=240)
    for r, (a, b) in enumerate(zip(straight, resumed)):
        assert a["losses"] == b["losses"], (r, a["losses"], b["losses"])
        assert _same(a["params"], b["params"]), f"rank {r}: parameters differ after resuming"
        assert _same(a["optimizer"], b["optimizer"]), f"rank {r}: optimizer state differs after resuming"
        assert a["scaler"] == b["scaler"], (r, a["scaler"], b["scaler"])
        assert "does not belong to this rank of this run" in b["wrong"] and "rank: saved {'pp'" in b["wrong"], b
    if RESUME_CASES[case][2] == torch.float16:          # the scaler really moved, and was restored
        assert straight[0]["scaler"]["scale"] != FP16_INIT_SCALE, straight[0]["scaler"]


def test_3d_zero3_rejects_other_dtypes_than_fp32_bf16_fp16():
    # bf16/fp16 train under ZeRO-3 (fp32 gradient reduction and master weights: tests/test_precision_3d.py)
    with pytest.raises(ValueError, match="zero=3 supports fp32, bf16 and fp16 models"):
        Parallel3D(GPTConfig(**CFG), None, data_parallel=DataParallelConfig(zero=3),
                   precision=PrecisionConfig(dtype=torch.float64))
    with pytest.raises(ValueError, match="must be 0"):
        Parallel3D(GPTConfig(**CFG), None, data_parallel=DataParallelConfig(zero=4))


def test_demo_end_to_end(tmp_path):
    # One 8-rank demo run covers ZeRO-3 with every block recomputed and validation; the plain dp / ZeRO-1 path
    # runs in the NCCL-rules demo below and fp16 in the torchrun one (each demo run costs ~30 s on 2 cores).
    zero = 3
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--steps", "3", "--n-layer", "2", "--d-model", "16",
           "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--corpus-bytes",
           "200000", "--out", str(out), "--no-progress", "--zero", str(zero)]
    cmd += ["--checkpoint", "--eval-interval", "2"]   # every block recomputed; validation after steps 2 and 3
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses agree" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agree"] is True and len(summary["losses"]["parallel"]) == 3
    assert summary["config"]["dp"] == 2 and summary["config"]["tp"] == 2 and summary["config"]["pp"] == 2
    assert len(summary["memory_rss_mb"]) == 8 and summary["tokens_per_s"] > 0
    assert os.path.getsize(out / "timeline.png") > 1000
    assert "checkpointing every block" in proc.stdout, proc.stdout
    assert summary["config"]["checkpoint"] is True and summary["config"]["zero"] == zero, summary["config"]
    # held-out validation, forward only through the pipeline, against the single process in eval mode
    val_steps = [2, 3]
    assert [s for s, _ in summary["val_losses"]["parallel"]] == val_steps, summary["val_losses"]
    assert [s for s, _ in summary["val_losses"]["single_process"]] == val_steps, summary["val_losses"]
    assert worst(summary["val_rel_diff"]) <= summary["tolerance_rel_per_step"], summary["val_rel_diff"]
    assert "losses and validation losses agree" in proc.stdout, proc.stdout
    assert all(f"validation after step {s}: loss" in proc.stdout for s in val_steps), proc.stdout
    # 8 ranks: bound to cores of their own only where the machine has 8 (parallel_layers.cpu_affinity)
    if hasattr(os, "sched_getaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        ranks = [r["cores"] for r in summary["per_rank"]]
        if len(cores) < 8:
            assert all(c == cores for c in ranks), ranks
        else:
            assert all(len(c) == len(cores) // 8 for c in ranks)
            assert len({x for c in ranks for x in c}) == 8 * len(ranks[0])    # disjoint



def test_demo_under_nccl_rules(tmp_path):
    """The demo's own 8-rank job (dp2 x tp2 x pp2, interleaved, ZeRO-1) with NCCL's rules enforced."""
    out = tmp_path / "demo_rules"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--backend", "nccl_rules", "--steps", "2",
           "--n-layer", "4", "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "8",
           "--microbatches", "2", "--schedule", "interleaved", "--zero", "1", "--corpus-bytes", "200000",
           "--eval-interval", "2", "--out", str(out), "--no-progress"]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses and validation losses agree" in proc.stdout, proc.stdout


def test_demo_under_torchrun(tmp_path):
    # The README's cluster command, on CPU: torchrun starts the 8 processes and sets RANK/WORLD_SIZE, so the
    # demo spawns nothing and initialises from the environment (gloo here; NCCL where CUDA is available).
    out = tmp_path / "demo_torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "8",
           "-m", "parallel_layers", "demo", "--dp", "2", "--tp", "2", "--pp", "2", "--steps", "2", "--n-layer", "2",
           "--d-model", "16", "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches", "2",
           "--corpus-bytes", "200000", "--out", str(out), "--no-progress", "--precision", "fp16", "--zero", "1"]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "spawning" not in proc.stdout and "losses agree" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["launcher"] == "torchrun" and summary["agree"] is True and len(summary["losses"]["parallel"]) == 2
    assert len(summary["memory_rss_mb"]) == 8
    # fp16 with dynamic loss scaling over fp32 ZeRO-1 master weights, against the fp32 single process
    assert "losses and validation losses agree" in proc.stdout and "(fp16)" in proc.stdout, proc.stdout
    assert summary["skipped_steps"] == 0 and summary["final_loss_scale"] > 0
    assert summary["tolerance_rel_per_step"] == 5e-2

# ---------------------------------------------------------------------- fp16 with dynamic loss scaling
# fp16 against the fp32 single-process model. fp16 rounds to 11 significant bits (2^-11 ~ 4.9e-4 relative
# per rounding); the loss is reported from an fp16 buffer and the parameters are the fp16 copy of the fp32
# master weights (one rounding each), while the optimizer works on fp32 masters and fp32-reduced gradients.
# Measured on this config (5 steps): loss and gradient norm <= ~1.5e-3 relative, which is what a dense
# single-process fp16 model with the same fp32 master AdamW shows too (dp=2, tp=2 or pp=2 alone give the
# same numbers), so FP16_TOL = 5e-3 (ten fp16 roundings) for the loss, the norm and the whole stage's
# parameters (relative, in norm). Per element the relative error is ill-conditioned (LayerNorm biases start
# at 0; Adam turns tiny gradient noise into full-size sign updates, up to 2 x lr per element per step), so
# there the bound is absolute, FP16_PARAM_ATOL = 2 x lr x steps (measured worst < 5e-3). A missed unscale
# (x 2^12), a dropped microbatch or a wrong init (an fp16-drawn init flipped a 0.25 weight to -0.25: 0.5
# abs) fails these bounds at once.
FP16_TOL = 5e-3
FP16_PARAM_ATOL = 2 * LR * STEPS
FP16_INIT_SCALE = 2.0 ** 12


def _fp16_model(mesh, cfg, **kw):
    from parallel_layers.amp import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=FP16_INIT_SCALE, growth_interval=kw.pop("growth_interval", 3),
                               hysteresis=1)
    return Parallel3D(cfg, mesh, seed=kw.pop("seed", 0),
                      optimizer=OptimizerConfig(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(schedule=kw.pop("schedule", "1f1b"), num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=kw.pop("zero", 1), bucket_cap_mb=0.002),
                      precision=PrecisionConfig(dtype=torch.float16, loss_scaler=scaler))


def body_3d_fp16(rank, world):
    mesh = cached_mesh(dp=2, tp=2, pp=2)
    cfg = GPTConfig(**CFG)
    dense, ref_opt = _reference()
    model = _fp16_model(mesh, cfg)
    loss_errs, norm_errs, skipped, scales = [], [], [], []
    for x, y in _batches(STEPS):
        ref_loss, ref_norm = _reference_step(dense, ref_opt, x, y)
        out = model.train_step(x, y)
        loss_err, norm_err = _step_errs(out, ref_loss, ref_norm)
        loss_errs.append(loss_err)
        norm_errs.append(norm_err)
        skipped.append(out["skipped"])
        scales.append(out["loss_scale"])
    ref = dense.state_dict()
    got = model.dense_state_dict()
    dtypes = {str(v.dtype) for v in got.values()}
    diff2 = sum(((v.double() - ref[k].double()) ** 2).sum().item() for k, v in got.items())
    ref2 = sum((ref[k].double() ** 2).sum().item() for k in got)
    param_errs = {k: (v.double() - ref[k].double()).abs().max().item() for k, v in got.items()}
    return {"loss": loss_errs, "norm": norm_errs, "params": param_errs, "param_rel": (diff2 / ref2) ** 0.5,
            "skipped": skipped, "scales": scales,
            "scaler": model.scaler.state_dict(), "dtypes": dtypes}


def test_3d_fp16_zero1_matches_fp32_single_process(dist_pools):
    out = dist_pools(8).run(body_3d_fp16, timeout=240)
    names = set()
    for r, res in enumerate(out):
        assert res["dtypes"] == {"torch.float16"}, (r, res["dtypes"])
        assert not any(res["skipped"]), (r, res["skipped"])       # parity needs every step taken
        assert worst(res["loss"]) < FP16_TOL, (r, res["loss"])
        assert worst(res["norm"]) < FP16_TOL, (r, res["norm"])
        assert res["param_rel"] < FP16_TOL, (r, res["param_rel"])
        name, err = worst(res["params"].items(), key=lambda kv: kv[1])
        assert err < FP16_PARAM_ATOL, (r, name, err)
        # the scaler grew once (growth_interval 3, 5 clean steps) and is identical on every rank
        assert res["scales"] == [FP16_INIT_SCALE] * 2 + [2 * FP16_INIT_SCALE] * 3, (r, res["scales"])
        assert res["scaler"] == out[0]["scaler"], (r, res["scaler"], out[0]["scaler"])
        names |= set(res["params"])
    torch.manual_seed(0)
    assert names == set(GPT(GPTConfig(**CFG)).state_dict())


def _snapshot(model):
    params = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    opt = {k: v.clone() for k, v in model.optimizer.state_dict().items() if isinstance(v, torch.Tensor)}
    return params, opt


def body_3d_fp16_overflow(rank, world, zero):
    """One rank (dp 0, tp 1, pp 0) puts an inf into a *replicated* gradient (a LayerNorm weight: on tp rank 1
    it is left out of the norm, so only the overflow check sees it) before the dp reduction."""
    mesh = cached_mesh(dp=2, tp=2, pp=2)
    cfg = GPTConfig(**CFG)
    model = _fp16_model(mesh, cfg, zero=zero, growth_interval=2)
    batches = _batches(5)
    first = model.train_step(*batches[0])                 # one clean step: moments and step count nonzero
    culprit = (mesh.dp_rank, mesh.tp_rank, mesh.pp_rank) == (0, 1, 0)
    if culprit:
        target = next(p for n, p in model.model.named_parameters()
                      if "ln" in n and not getattr(p, "tensor_parallel", False))
        sync = model.dp.sync_gradients

        def poisoned_sync(*a, **k):
            target.main_grad.view(-1)[0] = float("inf")
            return sync(*a, **k)
        model.dp.sync_gradients = poisoned_sync
    params, opt = _snapshot(model)
    scale_before = model.scaler.scale_value()
    bad = model.train_step(*batches[1])
    if culprit:
        model.dp.sync_gradients = sync
    params2, opt2 = _snapshot(model)
    unchanged = (all(torch.equal(params[k], params2[k]) for k in params)
                 and all(torch.equal(opt[k], opt2[k]) for k in opt))
    after = [model.train_step(x, y) for x, y in batches[2:]]
    params3, _ = _snapshot(model)
    moved = any(not torch.equal(params[k], params3[k]) for k in params)
    return {"first_skipped": first["skipped"], "skipped": bad["skipped"], "unchanged": unchanged,
            "scale_before": scale_before, "scale_after": bad["loss_scale"],
            "after_skipped": [o["skipped"] for o in after], "after_scales": [o["loss_scale"] for o in after],
            "moved": moved, "culprit": culprit, "scaler": model.scaler.state_dict()}


@pytest.mark.parametrize("zero", [1, 2])
def test_3d_fp16_overflow_on_one_rank_skips_everywhere(dist_pools, zero):
    out = dist_pools(8).run(body_3d_fp16_overflow, zero, timeout=240)
    assert sum(r["culprit"] for r in out) == 1
    for r, res in enumerate(out):
        assert not res["first_skipped"], r
        assert res["skipped"], (r, "this rank did not see the other rank's overflow")
        assert res["unchanged"], (r, "a skipped step changed parameters or optimizer state")
        assert res["scale_after"] == res["scale_before"] / 2, (r, res["scale_before"], res["scale_after"])
        # recovery: the next steps are taken and, after growth_interval=2 clean steps, the scale grows back
        assert res["after_skipped"] == [False] * 3, (r, res["after_skipped"])
        assert res["after_scales"] == [FP16_INIT_SCALE / 2, FP16_INIT_SCALE, FP16_INIT_SCALE], (r, res)
        assert res["moved"], r
        assert res["scaler"] == out[0]["scaler"], r


def test_demo_checkpoint_arguments():
    from parallel_layers.cli import demo
    parse = demo.build_parser().parse_args
    assert [demo.checkpoint_setting(parse(a)) for a in ([], ["--checkpoint"], ["--checkpoint", "1"])] == [0, True, 1]
    with pytest.raises(SystemExit, match="--checkpoint -2 must be a number of blocks"):
        demo.check_args(parse(["--checkpoint", "-2"]))


def test_demo_validation_split_and_steps():
    from parallel_layers.cli import demo
    parse = demo.build_parser().parse_args
    train, val = demo.load_splits(50_000, 16)
    assert torch.equal(train, demo.load_corpus(50_000))       # training text unchanged by the hold-out
    assert val.numel() == 5_000 and torch.equal(torch.cat([train, val]), demo.load_corpus(55_000))
    assert demo.eval_steps(parse(["--steps", "30"])) == [10, 20, 30]
    assert demo.eval_steps(parse(["--steps", "25", "--eval-interval", "0"])) == [25]
    assert demo.eval_steps(parse(["--steps", "7", "--eval-interval", "3"])) == [3, 6, 7]
    assert demo.eval_steps(parse(["--steps", "7", "--eval-iters", "0"])) == []
    args = parse(["--eval-iters", "3", "--batch-size", "4", "--seq-len", "8"])
    batches = demo.validation_batches(val, args)
    assert len(batches) == 3 and batches[0][0].shape == (4, 8)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, demo.validation_batches(val, args)))   # fixed
    with pytest.raises(SystemExit, match="--eval-interval -1 and --eval-iters 2 must be >= 0"):
        demo.check_args(parse(["--eval-interval", "-1"]))


def test_demo_precision_fp16_arguments():
    from parallel_layers.cli import demo
    args = demo.build_parser().parse_args(["--precision", "fp16", "--zero", "1"])
    demo.check_args(args)                                     # accepted with ZeRO (fp32 master weights)
    with pytest.raises(SystemExit, match="fp16 needs fp32 master weights"):
        demo.check_args(demo.build_parser().parse_args(["--precision", "fp16", "--zero", "0"]))
    assert 0 < demo.FP16_RTOL <= demo.BF16_RTOL
    demo.check_args(demo.build_parser().parse_args(["--precision", "bf16", "--zero", "3"]))   # ZeRO-3 keeps fp32 too
    with pytest.raises(ValueError, match="loss_scaler is for fp16"):
        from parallel_layers.amp import DynamicLossScaler
        Parallel3D(GPTConfig(**CFG), None, precision=PrecisionConfig(loss_scaler=DynamicLossScaler()))


