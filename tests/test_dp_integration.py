"""Data parallelism + ZeRO composed with the rest: TP x DP, bf16 / fp16 mixed precision with the loss scaler,
gradient clipping over ZeRO shards, and a checkpoint resumed in a fresh process group.

Real gloo processes, every rank checked. The oracle is always the plain single-process model built from
the same seed and trained on the full batch with ``torch.optim.AdamW`` (and ``torch.nn.utils.clip_grad_norm_``).
``bias=False``: an attention key bias has an exact gradient of zero, and Adam turns its rounding noise into
+-lr steps (see tests/test_zero.py), which no parallel implementation can reproduce.
"""
import copy
import math

import pytest
import torch
import torch.distributed as dist

from parallel_layers.amp.clip import clip_grad_norm_
from parallel_layers.amp.scaler import DynamicLossScaler
from parallel_layers.data_parallel.ddp import DataParallel
from parallel_layers.models import GPT, GPTConfig
from parallel_layers.testing import WorkerPool, cached_mesh
from parallel_layers.testing.compare import worst
from parallel_layers.zero.optimizer import ZeroOptimizer

CFG = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, bias=False)
CAPS = dict(bucket_cap_mb=0.02, first_bucket_cap_mb=0.01)     # a few buckets: ordering and rebuild exercised
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
BATCH, SEQ = 8, 12


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _mean(group, x):
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def _ref_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)


def _zero(dp, stage):
    return ZeroOptimizer(dp, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


# ---------------------------------------------------------------------- TP x DP with ZeRO-2
def body_tp_dp(rank, world, steps):
    mesh = cached_mesh(dp=2, tp=2)
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=mesh.tp_group)     # seeded-slice init: the shards of ``dense``
    dp = DataParallel(model, mesh.dp_group, reduce_op="reduce_scatter", **CAPS)
    opt, ref_opt = _zero(dp, 2), _ref_opt(dense)
    per = BATCH // 2
    sl = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    loss_errs, param_errs = [], []
    for x, y in _batches(steps):
        _, ref_loss = dense(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _, loss = dp(x[sl], y[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_errs.append(abs(_mean(mesh.dp_group, loss.item()) - ref_loss.item()) / abs(ref_loss.item()))
        got = model.dense_state_dict()           # gathered over TP
        param_errs.append(worst((_rel(got[k], v), k) for k, v in dense.state_dict().items()))
    return loss_errs, param_errs, len(dp.buffer.buckets), dp.layout_version


def test_tp2_x_dp2_zero2_matches_single_process(dist_pools):
    for rank, (loss_errs, param_errs, n_buckets, version) in enumerate(dist_pools(4).run(body_tp_dp, 8)):
        assert n_buckets > 1 and version == 0, (rank, n_buckets, version)     # ZeRO-2 keeps its first layout
        assert worst(loss_errs) <= 1e-5, (rank, loss_errs)
        err, name = worst(param_errs)
        assert err <= 1e-5, f"rank {rank}: {name} differs by {err:.2e} (relative norm)"


# ---------------------------------------------------------------------- bf16 parameters, fp32 master
def body_bf16(rank, world, stage, comm_dtype, steps):
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    init = {k: v.clone() for k, v in dense.state_dict().items()}
    model = copy.deepcopy(dense).to(torch.bfloat16)
    dp = DataParallel(model, cached_mesh(dp=world).dp_group, reduce_op="reduce_scatter", comm_dtype=comm_dtype,
                      **CAPS)
    opt, ref_opt = _zero(dp, stage), _ref_opt(dense)
    per = BATCH // world
    loss_errs = []
    for x, y in _batches(steps):
        _, ref_loss = dense(x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _, loss = dp(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss_errs.append(abs(_mean(dp.dp_group, loss.float().item()) - ref_loss.item()) / abs(ref_loss.item()))
    ref = dense.state_dict()
    got = dp.module.state_dict()
    # bf16 parameters against fp32 training: |bf16 - fp32| (norm), |fp32| and sqrt(numel) per tensor
    params = {k: ((got[k].double() - v.double()).norm().item(), v.double().norm().item(), math.sqrt(v.numel()))
              for k, v in ref.items()}
    # the fp32 master shards against the same elements of fp32 training, and how far those moved from init:
    # squared sums per tensor over this rank's pieces, then summed over the dp group
    names = dict((id(p), n) for n, p in dp.module.named_parameters())
    keys = sorted(ref)
    sq = torch.zeros(len(keys), 2, dtype=torch.float64)
    for b, off in opt.bucket_shards:
        for p, start_p, start_s, n in b.param_shard_overlaps(dp.dp_rank):
            k = names[id(p)]
            want = ref[k].reshape(-1)[start_p:start_p + n].double()
            have = opt.master[off + start_s:off + start_s + n].double()
            sq[keys.index(k), 0] += (have - want).square().sum()
            sq[keys.index(k), 1] += (want - init[k].reshape(-1)[start_p:start_p + n].double()).square().sum()
    dist.all_reduce(sq, group=dp.dp_group)
    master = {k: (sq[i, 0].sqrt().item(), sq[i, 1].sqrt().item()) for i, k in enumerate(keys)}
    return loss_errs, params, master, got["wte.weight"].dtype


@pytest.mark.parametrize("stage,comm", [(1, None), (2, None), (1, torch.bfloat16), (2, torch.bfloat16)],
                         ids=["zero1", "zero2", "zero1-comm_bf16", "zero2-comm_bf16"])
def test_bf16_params_fp32_master_track_fp32_training(dist_pools, stage, comm):
    """Tolerances, and why. bf16 keeps 8 significant bits: unit roundoff u = 2^-8 ~ 3.9e-3.

    - bf16 parameters (what the model computes with) vs fp32 training, per tensor in norm:
      ``|p_bf16 - p_fp32| <= u |p_fp32| + 0.1 T lr sqrt(n)``. First term: the parameters are the fp32 master
      rounded to bf16 after every step (<= u relative per element); it dominates for weights that moved little
      (LayerNorm gains near 1.0 move ~1e-3, below bf16's resolution there). Second term: the master drifts
      because the bf16 forward/backward gives gradients with errors of a few u (much more where terms cancel),
      and Adam's normalised update (each element moves by <= ~lr per step) carries them into the step; we
      allow 10% of the largest possible T-step movement, T lr per element. Measured: <= 0.41 of the bound.
    - fp32 master vs fp32 training: the drift alone, at most 25% of the distance fp32 training moved that
      tensor from the initialisation (measured <= 11%); a master that was not updated, or updated with the
      wrong gradients, would sit near 100%.
    - losses: the bf16 forward rounds activations at every op and the loss itself is a bf16 number (u):
      2e-2 relative (measured 6e-3).
    - comm_dtype=bf16 adds one rounding of g / world and (world - 1) bf16 additions per element: a few u on
      each gradient, the same order as the bf16 backward's own error; same bounds."""
    steps, u = 10, 2.0 ** -8
    for rank, (loss_errs, params, master, dtype) in enumerate(dist_pools(2).run(body_bf16, stage, comm, steps)):
        assert dtype == torch.bfloat16
        assert worst(loss_errs) <= 2e-2, (rank, loss_errs)
        for k, (err, norm, sqrt_n) in params.items():
            bound = u * norm + 0.1 * steps * LR * sqrt_n
            assert err <= bound, f"rank {rank}: bf16 {k} differs by {err:.2e} (bound {bound:.2e})"
        for k, (err, moved) in master.items():
            assert err <= 0.25 * moved, f"rank {rank}: fp32 master of {k} drifted {err:.2e}, moved {moved:.2e}"


# ---------------------------------------------------------------------- fp16 + loss scaler: injected inf on one rank
def _amp_step(dp, opt, scaler, x, y):
    """One fp16 step: scaled backward, overflow agreed over the dp group, the optimizer divides the scale out."""
    _, loss = dp(x, y)
    scaler.scale_loss(loss).backward()
    found_inf, _ = scaler.unscale_and_check([dp.grad_shard], groups=[dp.dp_group], unscale=False)
    opt.step(grad_scale=scaler.scale.clone(), found_inf=found_inf)
    scaler.update(found_inf)
    opt.zero_grad()
    return loss.float().item(), found_inf.item()


def body_fp16_inf(rank, world):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).half()
    dp = DataParallel(model, cached_mesh(dp=world).dp_group, reduce_op="reduce_scatter", **CAPS)
    opt = ZeroOptimizer(dp, stage=2, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
    scaler = DynamicLossScaler(init_scale=2.0 ** 10, growth_interval=100, hysteresis=1)
    per = BATCH // world
    x, y = _batches(1)[0]
    mine = (x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    for _ in range(2):
        _, inf = _amp_step(dp, opt, scaler, *mine)
        assert inf == 0.0
    before = [t.clone() for t in (opt.master, opt.exp_avg, opt.exp_avg_sq, torch.tensor(opt.steps_taken),
                                  dp.buffer.param_buffer)]
    scale_before = scaler.scale_value()
    # Inject inf into rank 1's LOCAL gradient, at an element that rank 0 owns after the reduce-scatter: only
    # rank 0's shard sees it, so only the agreement over the dp group can make rank 1 skip too.
    _, loss = dp(*mine)
    first = dp.buffer.buckets[0].params[0]      # ZeRO-2: its bucket's memory exists only once gradients land

    def inf_at_first_element(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad
    hook = first.register_hook(inf_at_first_element) if rank == 1 else None
    scaler.scale_loss(loss).backward()
    if hook is not None:
        hook.remove()
    shard_finite = bool(torch.isfinite(dp.grad_shard).all())
    found_inf, _ = scaler.unscale_and_check([dp.grad_shard], groups=[dp.dp_group], unscale=False)
    opt.step(grad_scale=scaler.scale.clone(), found_inf=found_inf)
    scaler.update(found_inf)
    opt.zero_grad()
    after = (opt.master, opt.exp_avg, opt.exp_avg_sq, torch.tensor(opt.steps_taken), dp.buffer.param_buffer)
    unchanged = [torch.equal(a, c) for a, c in zip(before, after)]
    # recovery: the same batch, the loss goes down again
    losses = [_amp_step(dp, opt, scaler, *mine) for _ in range(6)]
    return dict(shard_finite=shard_finite, found_inf=found_inf.item(), unchanged=unchanged,
                scales=(scale_before, scaler.scale_value()), losses=losses, step=opt.steps_taken)


def test_fp16_overflow_on_one_rank_skips_everywhere_and_recovers(dist_pools):
    for rank, out in enumerate(dist_pools(2).run(body_fp16_inf)):
        assert out["shard_finite"] == (rank == 1), f"rank {rank}: the inf must reach rank 0's shard only"
        assert out["found_inf"] == 1.0, f"rank {rank} did not agree on the overflow"
        assert all(out["unchanged"]), f"rank {rank}: master/exp_avg/exp_avg_sq/step/params changed: {out['unchanged']}"
        before, after = out["scales"]
        assert after == before / 2, (rank, before, after)
        losses = [loss for loss, _ in out["losses"]]
        assert all(inf == 0.0 for _, inf in out["losses"]), out["losses"]
        assert losses[-1] < losses[0] and all(math.isfinite(v) for v in losses), losses
        assert out["step"] == 2 + 6


# ---------------------------------------------------------------------- clipping over ZeRO shards
def body_clip(rank, world, stage, apply, steps):
    torch.manual_seed(0)
    dense = GPT(GPTConfig(**CFG))
    model = copy.deepcopy(dense)
    dp = DataParallel(model, cached_mesh(dp=world).dp_group, reduce_op="reduce_scatter", **CAPS)
    opt, ref_opt = _zero(dp, stage), _ref_opt(dense)
    per = BATCH // world
    norm_errs, coefs, param_errs = [], [], []
    for x, y in _batches(steps):
        dense(x, y)[1].backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm=0.2)
        ref_opt.step()
        ref_opt.zero_grad()
        dp(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])[1].backward()
        # the shards are disjoint pieces of the gradient: their squares are summed over the dp group
        norm, coef = clip_grad_norm_([dp.grad_shard], 0.2, groups=[dp.dp_group], apply=apply)
        opt.step(clip_coef=None if apply else coef)
        opt.zero_grad()
        norm_errs.append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
        coefs.append(coef.item())
        ref = dense.state_dict()
        param_errs.append(worst((_rel(v, ref[k]), k) for k, v in dp.module.state_dict().items()))
    return norm_errs, coefs, param_errs


@pytest.mark.parametrize("stage,apply", [(1, True), (2, False)], ids=["zero1-apply", "zero2-coef_to_step"])
def test_clip_grad_norm_over_zero_shards(dist_pools, stage, apply):
    for rank, (norm_errs, coefs, param_errs) in enumerate(dist_pools(2).run(body_clip, stage, apply, 4)):
        assert worst(norm_errs) <= 1e-5, (rank, norm_errs)
        assert all(c < 1.0 for c in coefs), f"clipping must be active: {coefs}"
        err, name = worst(param_errs)
        assert err <= 1e-5, f"rank {rank}: {name} differs by {err:.2e} after clipped steps"


# ---------------------------------------------------------------------- checkpoint resumed in a fresh process group
def _ckpt_setup(seed):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG)).half()
    dp = DataParallel(model, cached_mesh(dp=2).dp_group, reduce_op="reduce_scatter", **CAPS)
    opt = ZeroOptimizer(dp, stage=2, lr=1e-2, betas=BETAS, eps=EPS, weight_decay=WD)
    # growth every 2 clean steps, so the scale and its counters change during the run and must be restored
    scaler = DynamicLossScaler(init_scale=2.0 ** 8, growth_interval=2, hysteresis=2)
    return dp, opt, scaler


def _ckpt_run(rank, dp, opt, scaler, batches):
    per = BATCH // 2
    return [_amp_step(dp, opt, scaler, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])[0]
            for x, y in batches]


def _ckpt_result(dp, opt, scaler, losses):
    return dict(params=[p.detach().clone() for p in dp.module.parameters()], layout=opt.layout,
                states=[getattr(opt, k).clone() for k in ("master", "exp_avg", "exp_avg_sq", "_step")],
                scaler=scaler.state_dict(), losses=losses)


def body_ckpt_first(rank, world, path):
    batches = _batches(10, seed=7)
    dp, opt, scaler = _ckpt_setup(0)
    _ckpt_run(rank, dp, opt, scaler, batches[:5])
    torch.save({"model": dp.module.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict()},
               f"{path}/rank{rank}.pt")
    losses = _ckpt_run(rank, dp, opt, scaler, batches[5:])
    return _ckpt_result(dp, opt, scaler, losses)


def body_ckpt_resume(rank, world, path):
    batches = _batches(10, seed=7)
    ckpt = torch.load(f"{path}/rank{rank}.pt")
    dp, opt, scaler = _ckpt_setup(99)           # another init: everything must come from the files
    dp.module.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    losses = _ckpt_run(rank, dp, opt, scaler, batches[5:])
    return _ckpt_result(dp, opt, scaler, losses)


def test_checkpoint_resumes_bit_identically_in_a_fresh_process_group(dist_pools, tmp_path):
    straight = dist_pools(2).run(body_ckpt_first, str(tmp_path))
    pool = WorkerPool(2)            # new processes, new process group
    try:
        resumed = pool.run(body_ckpt_resume, str(tmp_path))
    finally:
        pool.close()
    for rank, (a, b) in enumerate(zip(straight, resumed)):
        assert a["losses"] == b["losses"], (rank, a["losses"], b["losses"])
        assert a["scaler"] == b["scaler"], (rank, a["scaler"], b["scaler"])
        assert a["layout"] == b["layout"]
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"])), f"rank {rank}: params differ"
        assert all(torch.equal(s, t) for s, t in zip(a["states"], b["states"])), f"rank {rank}: states differ"
    # the run really exercised the scaler (the scale grew) and every rank holds the same model
    assert straight[0]["scaler"]["scale"] > 2.0 ** 8
    assert all(torch.equal(p, q) for p, q in zip(straight[0]["params"], straight[1]["params"]))
