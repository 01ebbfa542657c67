"""Mixed precision: precision policy, dynamic loss scaler (schedule, torch parity, min_scale error,
checkpoints), overflow agreement and step skipping on real gloo ranks, and global gradient clipping
at tp=2, tp=2 x pp=2 and with ZeRO-style dp gradient shards against torch on the dense model."""
import copy
import dataclasses
import io
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.amp import (
    DynamicLossScaler,
    PrecisionPolicy,
    clip_grad_norm_,
    fused_optimizer_grad_scale,
    grad_multiplier,
)
from parallel_layers.optim import FusedAdamW
from parallel_layers.testing import cached_mesh


# ---------------------------------------------------------------------- policy
def test_policy_constructors_and_validation():
    p = PrecisionPolicy()
    assert (p.param_dtype, p.reduce_dtype, p.master_weights) == (torch.float32, None, True)
    assert not p.needs_loss_scaler and not p.uses_master_weights and p.grad_dtype == torch.float32
    bf = PrecisionPolicy.bf16()
    assert bf.param_dtype == torch.bfloat16 and not bf.needs_loss_scaler and bf.make_scaler() is None
    assert bf.grad_dtype == torch.float32 and bf.comm_dtype == torch.float32
    assert PrecisionPolicy.bf16(reduce_dtype=torch.bfloat16).comm_dtype == torch.bfloat16
    fp = PrecisionPolicy.fp16()
    assert fp.needs_loss_scaler and isinstance(fp.make_scaler(growth_interval=7), DynamicLossScaler)
    assert PrecisionPolicy.fp32().param_dtype == torch.float32
    pure = PrecisionPolicy(torch.bfloat16, master_weights=False)
    assert pure.grad_dtype == torch.bfloat16 and pure.comm_dtype == torch.bfloat16
    with pytest.raises(TypeError, match="param_dtype"):
        PrecisionPolicy(torch.float64)
    with pytest.raises(TypeError, match="reduce_dtype"):
        PrecisionPolicy(torch.bfloat16, reduce_dtype=torch.int8)
    with pytest.raises(TypeError, match="master_weights"):
        PrecisionPolicy(torch.float16, master_weights=1)
    with pytest.raises(ValueError, match="overflow"):
        PrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float16)
    with pytest.raises(dataclasses.FrozenInstanceError):   # frozen: one validated value shared by every wrapper
        p.param_dtype = torch.float16


def test_policy_cast_module_keeps_parameter_objects_and_attributes():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    m[0].weight.tensor_parallel = True
    w = m[0].weight
    PrecisionPolicy.bf16().cast_module_(m, keep_fp32=(nn.LayerNorm,))
    assert m[0].weight is w and w.dtype == torch.bfloat16 and w.tensor_parallel
    assert m[1].weight.dtype == torch.float32


# ---------------------------------------------------------------------- scaler schedule
def _run(scaler, flags):
    out = []
    for f in flags:
        scaler.update(torch.tensor([float(f)]))
        state = scaler.state_dict()
        out.append((scaler.scale_value(), state["_growth_tracker"], state["_hysteresis_tracker"]))
    return out


def test_scaler_schedule_hand_computed():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=2, min_scale=1.0)
    flags = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    expected = [  # (scale, clean steps since overflow/growth, overflows still tolerated)
        (8, 1, 2), (16, 0, 2),        # two clean steps: grow, budget stays full
        (16, 0, 1),                   # first overflow absorbed by hysteresis
        (8, 0, 0),                    # second: back off
        (8, 1, 0),
        (4, 0, 0),                    # budget spent: every overflow backs off until the next growth
        (4, 1, 0), (8, 0, 2),         # growth refills the budget
        (8, 0, 1), (4, 0, 0), (2, 0, 0)]
    assert _run(s, flags) == [(float(a), b, c) for a, b, c in expected]


def test_scaler_matches_torch_gradscaler_rule_with_hysteresis_1():
    rng = random.Random(0)
    flags = [int(rng.random() < 0.3) for _ in range(200)]
    ours = DynamicLossScaler(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
                             hysteresis=1, min_scale=2.0 ** -60)
    scale, tracker = torch.full((1,), 2.0 ** 10), torch.zeros(1, dtype=torch.int32)
    for f in flags:
        ours.update(torch.tensor([float(f)]))
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(f)]), 2.0, 0.5, 3)
        assert ours.scale_value() == scale.item() and ours.state_dict()["_growth_tracker"] == tracker.item()
    # growth that would overflow fp32 is refused, as torch does
    big = DynamicLossScaler(init_scale=2.0 ** 127, growth_interval=1, hysteresis=1)
    big.update(torch.zeros(1))
    assert big.scale_value() == 2.0 ** 127 and big.state_dict()["_growth_tracker"] == 0


def test_scaler_below_min_scale_is_a_clear_error():
    s = DynamicLossScaler(init_scale=2.0, hysteresis=2, min_scale=1.0)
    s.update(torch.ones(1))
    s.update(torch.ones(1))          # 2 -> 1 after the hysteresis budget is spent
    assert s.scale_value() == 1.0
    with pytest.raises(RuntimeError, match=r"would drop to 0.5, below min_scale=1.*diverged"):
        s.update(torch.ones(1))
    with pytest.raises(ValueError, match="init_scale"):
        DynamicLossScaler(init_scale=0.5, min_scale=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)
    with pytest.raises(ValueError, match="hysteresis"):
        DynamicLossScaler(hysteresis=0)


def test_scaler_state_dict_round_trip():
    a = DynamicLossScaler(init_scale=64.0, growth_interval=3, hysteresis=2)
    _run(a, [0, 1, 0, 0])
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = DynamicLossScaler()
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert b.state_dict() == a.state_dict()
    tail = [0, 0, 1, 1, 1, 0, 0, 0]
    assert _run(b, tail) == _run(a, tail)
    # a torch.amp.GradScaler state dict loads as hysteresis 1
    t = torch.amp.GradScaler("cpu", init_scale=32.0, growth_interval=5)
    t._lazy_init_scale_growth_tracker(torch.device("cpu"))
    c = DynamicLossScaler()
    c.load_state_dict(t.state_dict())
    assert c.scale_value() == 32.0 and c.hysteresis == 1 and c.growth_interval == 5


def test_scale_loss_unscale_and_check_single_process():
    s = DynamicLossScaler(init_scale=2.0 ** 16)
    loss = torch.tensor(3.0, dtype=torch.float16)
    scaled = s.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 3.0 * 2 ** 16   # fp16 would overflow
    s = DynamicLossScaler(init_scale=2.0 ** 8)
    torch.manual_seed(0)
    g16 = [torch.randn(5, 3).half(), torch.randn(7).half()]
    g32 = [torch.randn(4, 4)]
    true = [g.float() for g in g16 + g32]
    scaled_grads = [(g * 2 ** 8).to(g.dtype) for g in g16] + [g * 2 ** 8 for g in g32]
    found, norm = s.unscale_and_check(scaled_grads)
    assert found.item() == 0
    for got, want in zip(scaled_grads, true):
        torch.testing.assert_close(got.float(), want, rtol=0, atol=0)   # powers of two: exact
    assert math.isclose(norm.item(), torch.cat([t.flatten() for t in true]).norm().item(), rel_tol=1e-5)
    scaled_grads[1][2] = float("nan")
    found, norm = s.unscale_and_check(scaled_grads, unscale=False)
    assert found.item() == 1 and not math.isfinite(norm.item())


# ---------------------------------------------------------------------- clip helpers, single process
def _dense_grads(seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 5), nn.LayerNorm(5))
    m(torch.randn(3, 6)).pow(2).sum().backward()
    return m


def _clone(m):
    """deepcopy drops .grad; copy it along."""
    c = copy.deepcopy(m)
    for p, q in zip(c.parameters(), m.parameters()):
        p.grad = q.grad.clone()
    return c


def test_clip_single_process_matches_torch_and_fused_multiplier():
    m = _dense_grads()
    ref = _clone(m)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert want.item() > 0.5
    for foreach in (None, False):
        mm = _clone(m)
        norm, coef = clip_grad_norm_(mm.parameters(), 0.5, foreach=foreach)
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
        torch.testing.assert_close(coef, torch.clamp(0.5 / (want + 1e-6), max=1.0), rtol=1e-5, atol=0)
        for p, q in zip(mm.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    inf_norm, _ = clip_grad_norm_(_clone(m).parameters(), 0.5, norm_type=math.inf, apply=False)
    torch.testing.assert_close(inf_norm, torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], math.inf))
    # loss-scaled grads: norm of the unscaled ones; the optimizer multiplier carries 1/scale x coef
    scaler = DynamicLossScaler(init_scale=1024.0)
    scaled = [p.grad * 1024 for p in m.parameters()]
    norm, coef = clip_grad_norm_(scaled, 0.5, inv_scale=scaler.inv_scale, apply=False)
    torch.testing.assert_close(norm, want, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_multiplier(scaler, coef), (coef / 1024).reshape(1))
    torch.testing.assert_close(fused_optimizer_grad_scale(scaler, coef), (1024 / coef).reshape(1))
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(m.parameters(), 1.0, norm_type=1.0)


def test_fused_route_equals_unscale_then_clip_then_step():
    """Leaving grads scaled and giving FusedAdamW ``loss_scale / clip_coef`` == unscale, clip, plain step."""
    ms = [_dense_grads(1) for _ in range(2)]
    opts = [FusedAdamW(m.parameters(), lr=1e-2) for m in ms]
    for m in ms:
        for p in m.parameters():
            p.grad.mul_(256)
    scaler = DynamicLossScaler(init_scale=256.0)
    # (a) two passes over the gradients, then a plain step
    found_a, _ = scaler.unscale_and_check(list(ms[0].parameters()))
    clip_grad_norm_(ms[0].parameters(), 0.1)
    opts[0].step(found_inf=found_a)
    # (b) one read pass; the kernel applies 1/scale x coef
    found_b = torch.zeros(1)
    _, coef = clip_grad_norm_(ms[1].parameters(), 0.1, inv_scale=scaler.inv_scale, apply=False, found_inf=found_b)
    opts[1].step(grad_scale=fused_optimizer_grad_scale(scaler, coef), found_inf=found_b)
    for p, q in zip(ms[0].parameters(), ms[1].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- distributed: overflow agreement
def _snapshot(model, opt):
    sd = opt.state_dict()["state"]
    return ([p.detach().clone() for p in model.parameters()],
            {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in e.items()} for k, e in sd.items()})


def _bit_equal(a, b):
    pa, sa = a
    pb, sb = b
    same = all(torch.equal(x.view(torch.int16 if x.dtype == torch.float16 else torch.int32),
                           y.view(torch.int16 if y.dtype == torch.float16 else torch.int32)) for x, y in zip(pa, pb))
    for k in sa:
        for n, v in sa[k].items():
            w = sb[k][n]
            same &= torch.equal(v, w) if torch.is_tensor(v) else v == w
    return bool(same)


def body_fp16_overflow(rank, world, inject_rank, inject_step, agree_over):
    mesh = cached_mesh(dp=2, tp=2)
    groups = {"all": (mesh.dp_group, mesh.tp_group), "tp": (mesh.tp_group,)}[agree_over]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).half()
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=100, hysteresis=1)
    x, y = torch.randn(16, 8).half(), torch.randn(16, 4)
    log = []
    for step in range(8):
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x).float(), y)
        scaler.scale_loss(loss).backward()
        if rank == inject_rank and step == inject_step:
            model[0].weight.grad[1, 2] = float("inf") if step % 2 else float("nan")
        # grads stay scaled: the fused kernel divides by grad_scale and skips on found_inf, on device
        found, _ = scaler.unscale_and_check(list(model.parameters()), groups=groups, unscale=False)
        before = _snapshot(model, opt)
        opt.step(grad_scale=scaler.scale, found_inf=found)
        scaler.update(found)
        log.append((found.item(), scaler.scale_value(), _bit_equal(before, _snapshot(model, opt)), loss.item()))
    return log


@pytest.mark.parametrize("agree_over", ["all", "tp"])
def test_fp16_overflow_is_agreed_skipped_backed_off_and_recovered(dist_pools, agree_over):
    inject_rank, inject_step = 3, 3       # rank 3 = (dp 1, tp 1): reaches rank 0 only through dp AND tp
    logs = dist_pools(4).run(body_fp16_overflow, inject_rank, inject_step, agree_over)
    for rank, log in enumerate(logs):
        sees = agree_over == "all" or rank // 2 == inject_rank // 2   # tp groups: {0, 1}, {2, 3}
        for step, (found, scale, unchanged, _loss) in enumerate(log):
            hit = sees and step == inject_step
            assert found == (1.0 if hit else 0.0), (rank, step, found)
            assert unchanged == hit, (rank, step)          # skipped step: bit-identical params and states
            expect = 2.0 ** 12 if not sees or step < inject_step else 2.0 ** 11
            assert scale == expect, (rank, step, scale)
        losses = [entry[3] for entry in log]
        assert losses[-1] < losses[inject_step] and all(math.isfinite(v) for v in losses)   # recovered
    if agree_over == "all":
        assert all(log == logs[0] for log in logs)         # every rank took the identical path


# ---------------------------------------------------------------------- distributed: clipping
def _dense_block_model(seed):
    torch.manual_seed(seed)
    blocks = nn.ModuleList()
    for _ in range(2):
        blocks.append(nn.ModuleDict({"fc1": nn.Linear(6, 8), "fc2": nn.Linear(8, 6), "ln": nn.LayerNorm(6)}))
        with torch.no_grad():   # non-trivial LayerNorm grads and params
            blocks[-1]["ln"].weight.uniform_(0.5, 1.5)
            blocks[-1]["ln"].bias.uniform_(-0.5, 0.5)
    return blocks


def _forward(blocks, x):
    for b in blocks:
        x = b["ln"](x + b["fc2"](F.gelu(b["fc1"](x))))
    return x


def body_clip_tp(rank, world, tp, pp, max_norm):
    from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    mesh = cached_mesh(tp=tp, pp=pp)
    dense = _dense_block_model(0)
    par = nn.ModuleList(nn.ModuleDict({
        "fc1": ColumnParallelLinear.from_dense(b["fc1"], tp_group=mesh.tp_group),
        "fc2": RowParallelLinear.from_dense(b["fc2"], tp_group=mesh.tp_group),
        "ln": copy.deepcopy(b["ln"])}) for b in dense)
    torch.manual_seed(1)
    x = torch.randn(2, 3, 6)
    for m in (dense, par):
        _forward(m, x).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    # pipeline stage s owns block s (every rank ran the whole model: only the grads matter here)
    mine = par if pp == 1 else par[mesh.pp_rank:mesh.pp_rank + 1]
    dense_mine = dense if pp == 1 else dense[mesh.pp_rank:mesh.pp_rank + 1]
    norm, coef = clip_grad_norm_(mine.parameters(), max_norm, tp_group=mesh.tp_group,
                                 groups=(mesh.pp_group,) if pp > 1 else ())
    grads_ok = []
    for (_name, p), q in zip(mine.named_parameters(), dense_mine.parameters()):
        g = q.grad
        if getattr(p, "tensor_parallel", False):
            g = g.chunk(tp, dim=p.partition_dim)[mesh.tp_rank]
        # the TP forward rounds differently from the dense one: compare relative to the tensor norm
        grads_ok.append(bool((p.grad - g).norm() <= 1e-5 * g.norm()))
    return norm, want, coef, grads_ok


@pytest.mark.parametrize("tp,pp,world", [(2, 1, 2), (2, 2, 4)])
def test_clip_grad_norm_tensor_and_pipeline_parallel_equals_dense(dist_pools, tp, pp, world):
    for max_norm in (0.5, 1e6):     # clipping active / inactive
        for rank, (norm, want, coef, grads_ok) in enumerate(dist_pools(world).run(body_clip_tp, tp, pp, max_norm)):
            torch.testing.assert_close(norm, want, rtol=1e-5, atol=0, msg=f"rank {rank}")
            torch.testing.assert_close(coef, torch.clamp(max_norm / (want + 1e-6), max=1.0), rtol=1e-5, atol=0)
            assert all(grads_ok), (rank, grads_ok)


def body_clip_dp_shards(rank, world, max_norm):
    mesh = cached_mesh(dp=world)
    dense = _dense_block_model(0)
    torch.manual_seed(1)
    _forward(dense, torch.randn(2, 3, 6)).pow(2).sum().backward()
    flat = torch.cat([p.grad.flatten() for p in dense.parameters()])
    pad = (-flat.numel()) % (world * 64)                     # ZeRO-style padded shards
    shard = F.pad(flat, (0, pad)).chunk(world)[mesh.dp_rank].clone()
    found = torch.zeros(1)
    norm, coef = clip_grad_norm_([shard], max_norm, groups=(mesh.dp_group,), found_inf=found)
    want = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm)
    clipped = F.pad(torch.cat([p.grad.flatten() for p in dense.parameters()]), (0, pad)).chunk(world)[mesh.dp_rank]
    return norm, want, coef, torch.allclose(shard, clipped, rtol=1e-5, atol=1e-7), found


def test_clip_grad_norm_dp_sharded_grads_equals_full(dist_pools):
    for rank, (norm, want, coef, ok, found) in enumerate(dist_pools(2).run(body_clip_dp_shards, 0.5)):
        torch.testing.assert_close(norm, want, rtol=1e-5, atol=0, msg=f"rank {rank}")
        assert coef.item() < 1 and ok and found.item() == 0
