"""ZeRO stage 3 on real gloo ranks, every rank checked, against single-process torch.optim.AdamW."""
import copy

import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

# bias=False: see tests/test_zero.py (the attention key bias has a true gradient of zero, pure rounding
# noise that Adam amplifies to +-lr; no data-parallel run can match that to 1e-5).
CFG = dict(vocab_size=64, n_layer=3, n_head=2, d_model=32, max_seq_len=16, bias=False)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _batches(n, batch=8, seq=12):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (batch, seq), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _wrap(model, group, prefetch=True, dtype=None, lr=LR):
    from parallel_layers.zero.stage3 import ZeroStage3
    from parallel_layers.zero.stage3_optimizer import ZeroStage3Optimizer

    z = ZeroStage3(model, group, prefetch=prefetch, param_dtype=dtype)
    return z, ZeroStage3Optimizer(z, lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)


def _train(z, opt, batches, rank, world, losses=None):
    for x, y in batches:
        _, loss = z(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean, group=z.dp_group)
            losses.append(mean.item() / world)


def _overlaps(timeline):
    """Prefetched gathers that were in flight while ANOTHER unit computed (forward and backward).

    Forward: launch(j) < forward_start(i) < forward_end(i) <= wait(j). Backward: launch(j) after
    backward_start(i) and before i's gradients were complete (reduce_launch(i)), waited after that."""
    fwd = bwd = 0
    launches = [(u, t) for ev, u, t, x in timeline if ev == "gather_launch" and x.get("prefetch")]
    for j, t0 in launches:
        t_wait = next((t for ev, u, t, _ in timeline if ev == "gather_wait" and u == j and t >= t0), None)
        if t_wait is None:
            continue
        for ev, i, t1, _ in timeline:
            if i == j:
                continue
            if ev == "forward_start" and t0 < t1:
                end = next(t for e, u, t, _ in timeline if e == "forward_end" and u == i and t >= t1)
                fwd += end <= t_wait
            if ev == "backward_start" and t1 <= t0:
                end = next((t for e, u, t, _ in timeline if e == "reduce_launch" and u == i and t >= t0), None)
                bwd += end is not None and end <= t_wait
    return fwd, bwd


def body_parity(rank, world, ckpt):
    from parallel_layers.models import GPT, GPTConfig

    group = cached_mesh(dp=world).dp_group
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG), checkpoint=ckpt)     # every block (a ZeRO-3 unit) recomputed in backward
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**CFG))
    z, opt = _wrap(model, group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    batches = _batches(10)
    held_out = _batches(11)[10]
    losses, ref_losses, evals = [], [], []

    def evaluate(m, x, y):                        # validation: eval mode, no autograd graph
        m.eval()
        with torch.no_grad():
            _, loss = m(x, y)
        m.train()
        return loss.item()

    for i, (x, y) in enumerate(batches):
        _, loss = ref(x, y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
        if i == 4:
            evals.append(evaluate(ref, *held_out))
    # halfway, a forward without autograd (the hooks gather and reshard each unit; no backward follows)
    _train(z, opt, batches[:5], rank, world, losses)
    x, y = held_out
    evals.append(evaluate(z, x, y))              # the whole held-out batch on every rank
    after_eval = opt.memory_report()["gathered_bytes"]
    _train(z, opt, batches[5:], rank, world, losses)
    loss_err = worst(abs(a - b) / abs(b) for a, b in zip(losses + evals[1:], ref_losses + evals[:1]))
    assert after_eval == 0, f"rank {rank}: {after_eval} bytes left gathered after a no_grad forward"
    full = z.full_state_dict()
    param_err = worst(_rel(full[n], p.detach()) for n, p in ref.named_parameters())
    rep = opt.memory_report()
    return loss_err, param_err, _overlaps(z.timeline), full, z.shard_buffer.clone(), rep["gathered_bytes"]


@pytest.mark.parametrize("world,ckpt", [(2, False), (4, False), (2, True)])
def test_parity_with_single_process_adamw(dist_pools, world, ckpt):
    out = dist_pools(world).run(body_parity, ckpt)
    for rank, (loss_err, param_err, (fwd, bwd), full, shard, gathered) in enumerate(out):
        assert loss_err < 1e-5, (rank, loss_err)
        assert param_err < 1e-5, (rank, param_err)
        assert gathered == 0, "everything is resharded after backward"
        # recorded, not inferred: a prefetched gather was in flight while another unit computed
        assert fwd >= 1 and bwd >= 1, (rank, fwd, bwd)
        for k, v in full.items():           # every rank gathers the same model
            assert torch.equal(v, out[0][3][k]), (rank, k)
        if rank:
            assert not torch.equal(shard, out[0][4]), "ranks hold different shards"


def body_prefetch_off(rank, world):
    """Prefetch changes when gathers are issued, never what they compute: bit-identical shards."""
    from parallel_layers.models import GPT, GPTConfig

    group = cached_mesh(dp=world).dp_group
    shards = []
    for prefetch in (True, False):
        torch.manual_seed(0)
        z, opt = _wrap(GPT(GPTConfig(**CFG)), group, prefetch=prefetch)
        _train(z, opt, _batches(3), rank, world)
        shards.append((z.shard_buffer.clone(), opt.exp_avg_sq.clone(), _overlaps(z.timeline)))
    return shards


def test_prefetch_on_off_bit_identical(dist_pools):
    for (s_on, v_on, ov_on), (s_off, v_off, ov_off) in dist_pools(2).run(body_prefetch_off):
        assert torch.equal(s_on, s_off) and torch.equal(v_on, v_off)
        assert ov_off == (0, 0) and min(ov_on) >= 1


# lr 1e-3 here: TP alone (plain GPT(tp_group=...) with torch.optim.AdamW, no ZeRO) already differs from the
# dense model by 2e-5 after 10 steps at lr 1e-2 (row-parallel partial sums round differently and Adam
# magnifies the noise of near-zero gradients); at 1e-3 that baseline is 2e-6.
TP_LR = 1e-3


def body_tp_dp(rank, world):
    from parallel_layers.models import GPT, GPTConfig

    mesh = cached_mesh(dp=2, tp=2)
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=mesh.tp_group)
    z, opt = _wrap(model, mesh.dp_group, lr=TP_LR)   # sharded over dp only; TP shards stay TP shards
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=TP_LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    batches = _batches(10)
    for x, y in batches:
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _train(z, opt, batches, mesh.dp_rank, 2)
    with z.summon_full_params():
        dense = model.dense_state_dict()       # a TP collective
    return worst(_rel(dense[n], p.detach()) for n, p in ref.named_parameters()), z.shard_numel


def test_tp2_dp2_parity(dist_pools):
    out = dist_pools(4).run(body_tp_dp)
    for rank, (err, _shard_numel) in enumerate(out):
        assert err < 1e-5, (rank, err)


def body_tp_dp_checkpoint_dropout(rank, world):
    """tp 2 x dp 2, dropout on: two ZeRO-3 steps with every block checkpointed equal the plain ones bit
    for bit (each recomputation runs on parameters ZeRO-3 gathers again in backward, with the forward's
    masks); other masks (both streams reseeded) change the result."""
    from parallel_layers.models import GPT, GPTConfig

    mesh = cached_mesh(dp=2, tp=2)
    runs = []
    for ckpt, seed in ((False, 5), (True, 5), (False, 6)):
        cfg = GPTConfig(**{**CFG, "dropout": 0.2, "seed": seed})
        torch.manual_seed(0)
        model = GPT(cfg, tp_group=mesh.tp_group, checkpoint=ckpt)
        calls = [0]
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        z, opt = _wrap(model, mesh.dp_group, lr=TP_LR)
        torch.manual_seed(seed)
        losses = []
        _train(z, opt, _batches(2), mesh.dp_rank, 2, losses)
        with z.summon_full_params():
            runs.append((losses, model.dense_state_dict(), calls[0]))
    (plain, plain_sd, plain_calls), (ck, ck_sd, ck_calls), (other, _, _) = runs
    return (plain == ck, [k for k in plain_sd if not torch.equal(plain_sd[k], ck_sd[k])], plain != other,
            (plain_calls, ck_calls))


def test_checkpointing_under_zero3_with_tp_replays_dropout(dist_pools):
    for rank, (same_loss, differing, other_differs, calls) in enumerate(dist_pools(4).run(
            body_tp_dp_checkpoint_dropout)):
        assert same_loss and not differing, (rank, differing)
        assert other_differs, f"rank {rank}: dropout had no effect (the test would prove nothing)"
        assert calls == (6, 12), (rank, calls)        # 3 blocks x 2 steps; checkpointed: twice each


class _Odd(nn.Module):
    """Units of 5050 and 153 parameters (ModuleList) and a root of 7: nothing divides by 16 * dp."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(100, 50), nn.Linear(50, 3)])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, x):
        x = torch.tanh(self.layers[0](x))
        return (self.layers[1](x).sum(-1, keepdim=True) * self.scale).square().mean()


def body_memory(rank, world, dtype):
    group = cached_mesh(dp=world).dp_group
    torch.manual_seed(0)
    model = _Odd()
    ref = copy.deepcopy(model)
    z, opt = _wrap(model, group, dtype=dtype)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        x = torch.randn(4 * world, 100, generator=gen)
        ref(x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        z(x.chunk(world)[rank].to(dtype)).backward()
        opt.step()
        opt.zero_grad()
    full = z.full_state_dict()
    err = worst(_rel(full[n], p.detach()) for n, p in ref.named_parameters())
    return opt.memory_report(), err


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_report_and_padding(dist_pools, world, dtype):
    align = 16 * world
    padded = [-(-n // align) * align for n in (7, 5050, 153)]      # root, layers.0, layers.1
    shard = sum(padded) // world
    psize = 4 if dtype == torch.float32 else 2
    for rep, err in dist_pools(world).run(body_memory, dtype):
        # bf16: parameters rounded to 2^-8 relative and a bf16 forward/backward vs fp32 torch AdamW
        assert err < (1e-5 if dtype == torch.float32 else 2e-2), err
        assert rep["num_params"] == 5210 and rep["padded_numel"] == sum(padded)
        assert rep["shard_numel"] == shard
        assert rep["param_bytes"] == shard * psize                      # 1/dp, the only parameter storage
        assert rep["grad_bytes"] == shard * 4                           # fp32 gradient shards
        # exp_avg + exp_avg_sq; an fp32 model's master is its parameter shard, bf16 needs its own
        assert rep["optimizer_bytes"] == shard * (8 if dtype == torch.float32 else 12)
        assert rep["unit_full_bytes"] == [n * psize for n in padded]
        assert rep["unit_grad_bytes"] == [n * 4 for n in padded]       # reduced in fp32 (bf16 too: the default)
        assert rep["gathered_bytes"] == 0
        assert 0 < rep["peak_gathered_bytes"] <= sum(padded) * (psize + 4)
        assert rep["paper_bytes_per_param"]["total"] == 16 / world


def body_checkpoint(rank, world):
    from parallel_layers.models import GPT, GPTConfig

    group = cached_mesh(dp=world).dp_group
    batches = _batches(10)
    torch.manual_seed(0)
    z, opt = _wrap(GPT(GPTConfig(**CFG)), group)
    _train(z, opt, batches[:5], rank, world)
    model_sd, opt_sd = z.state_dict(), opt.state_dict()
    _train(z, opt, batches[5:], rank, world)
    torch.manual_seed(99)                 # another init: everything must come from the checkpoint
    z2, opt2 = _wrap(GPT(GPTConfig(**CFG)), group)
    z2.load_state_dict(model_sd)
    opt2.load_state_dict(opt_sd)
    _train(z2, opt2, batches[5:], rank, world)
    return (torch.equal(z.shard_buffer, z2.shard_buffer)
            and all(torch.equal(getattr(opt, k), getattr(opt2, k)) for k in ("master", "exp_avg", "exp_avg_sq")))


def test_checkpoint_round_trip(dist_pools):
    assert all(dist_pools(2).run(body_checkpoint))


def body_found_inf(rank, world):
    from parallel_layers.models import GPT, GPTConfig

    torch.manual_seed(0)
    z, opt = _wrap(GPT(GPTConfig(**CFG)), cached_mesh(dp=world).dp_group, dtype=torch.bfloat16)
    batches = _batches(3)
    _train(z, opt, batches[:2], rank, world)
    keys = ("master", "exp_avg", "exp_avg_sq", "_step")
    before = [getattr(opt, k).clone() for k in keys] + [z.shard_buffer.clone()]
    x, y = batches[2]
    z(x.chunk(world)[rank], y.chunk(world)[rank])[1].backward()
    opt.step(found_inf=torch.ones(1), grad_scale=torch.full((1,), 1024.0))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, [getattr(opt, k) for k in keys] + [z.shard_buffer]))
    opt.zero_grad()
    _train(z, opt, batches[2:], rank, world)
    moved = not torch.equal(before[0], opt.master) and opt.steps_taken == 3
    return unchanged, moved, torch.equal(z.shard_buffer, opt.master.to(torch.bfloat16))


def test_found_inf_skips_bit_identically(dist_pools):
    for unchanged, moved, consistent in dist_pools(2).run(body_found_inf):
        assert unchanged and moved and consistent


def body_errors(rank, world):
    from parallel_layers.zero.stage3 import ZeroStage3

    lin = nn.Linear(3, 3)
    model = nn.Sequential(nn.ModuleList([lin]), nn.ModuleList([nn.Sequential(lin)]))
    try:
        ZeroStage3(model, cached_mesh(dp=world).dp_group)
    except ValueError as exc:
        return str(exc)
    return None


def test_shared_parameter_across_units_is_named(dist_pools):
    for msg in dist_pools(2).run(body_errors):
        assert msg and "shared" in msg and "weight" in msg, msg


def body_held(rank, world):
    """gather_all() .. reduce_scatter_and_free() (ZeRO-3 inside a pipeline): each unit gathered once, kept
    for several forward/backward passes (microbatches), gradients reduced once; same result as torch AdamW
    on the full batch; between steps nothing full is alive; release_gathered() frees without collectives."""
    from parallel_layers.models import GPT, GPTConfig

    group = cached_mesh(dp=world).dp_group
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    ref = copy.deepcopy(model)
    z, opt = _wrap(model, group)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    gathers, alive = [], []
    for x, y in _batches(4):
        ref(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad()
        z.gather_all()
        for xm, ym in zip(x.chunk(world)[rank].chunk(2), y.chunk(world)[rank].chunk(2)):   # 2 microbatches
            (z.module(xm, ym)[1] / 2).backward()
        gathers.append(sum(ev == "gather_launch" for ev, *_ in z.timeline))
        z.reduce_scatter_and_free()
        opt.step()
        opt.zero_grad()
        alive.append(sum(p.untyped_storage().nbytes() + (p.grad is not None) for p in model.parameters()))
    full = z.full_state_dict()
    err = worst(_rel(full[n], p.detach()) for n, p in ref.named_parameters())
    z.gather_all()
    z.module(*[t.chunk(world)[rank] for t in _batches(1)[0]])[1].backward()
    z.release_gathered()
    released = sum(p.untyped_storage().nbytes() + (p.grad is not None) for p in model.parameters())
    return err, gathers, len(z.units), alive, released


def test_held_gather_across_microbatches(dist_pools):
    for err, gathers, units, alive, released in dist_pools(2).run(body_held):
        assert err < 1e-5, err
        assert gathers == [units] * 4, (gathers, units)     # once per step, none in the microbatches
        assert alive == [0] * 4 and released == 0, (alive, released)
