"""ZeroStage3(fp8_gather=True): FP8 layers' weights (per-tensor current scaling) all-gathered as FP8 bytes.

On real ranks: training with the FP8 all-gather gives the same losses and parameters, bit for bit, as the same
ZeroStage3 run without it (fp32 and bf16 parameters, dp 2 and 4, tp 2 x dp 2 with the TP FP8 layers); close to
one process running the FP8 layers on the ranks' micro-batches in turn (the same FP8 operands, gradients
summed in another order: state tolerance); each unit's gather moves the bytes the layout says (FP8 elements 1 byte, the
others the parameter dtype's size); recipes other than "tensor" fall back to the usual gather.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from parallel_layers.fp8 import FP8ColumnParallelLinear, FP8Linear, FP8Recipe, FP8RowParallelLinear
from parallel_layers.testing import cached_mesh

W, STEPS, LR = 64, 3, 1e-3
ADAM = dict(lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
# one process running the ranks' micro-batches in turn (the same FP8 scales as each rank), gradients averaged,
# torch's AdamW: the same losses; parameters within Adam's rounding (measured 9e-8 at dp 2)
STATE_REL = 1e-6


class _Block(nn.Module):
    """A unit mixing FP8 weights with parameters gathered in the parameter dtype (norm, fc1's bias)."""

    def __init__(self, recipe, tp_group=None):
        super().__init__()
        self.norm = nn.LayerNorm(W)
        fc1, fc2 = nn.Linear(W, 2 * W), nn.Linear(2 * W, W, bias=False)
        if tp_group is None:
            self.fc1 = FP8Linear.from_linear(fc1, recipe=recipe)
            self.fc2 = FP8Linear.from_linear(fc2, recipe=recipe)
        else:
            self.fc1 = FP8ColumnParallelLinear.from_dense(fc1, tp_group=tp_group, recipe=recipe)
            self.fc2 = FP8RowParallelLinear.from_dense(fc2, tp_group=tp_group, recipe=recipe)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _Net(nn.Module):
    """Root: plain Linears (gathered as usual); units: two mixed blocks and one FP8 weight alone."""

    def __init__(self, recipe, tp_group=None, ckpt=False):
        super().__init__()
        self.ckpt = ckpt
        self.inp = nn.Linear(16, W)
        self.blocks = nn.ModuleList([_Block(recipe, tp_group), _Block(recipe, tp_group)])
        self.proj = nn.ModuleList([FP8Linear(W, W, bias=False, recipe=recipe)])
        self.out = nn.Linear(W, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:       # ckpt: recomputed in backward, on the FP8 weights gathered again there
            h = checkpoint(b, h, use_reentrant=False) if self.ckpt else b(h)
        return self.out(self.proj[0](h)).float().square().mean()


def _batch(step, dtype):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(8, 6, 16, generator=gen) * (1 + step)).to(dtype)


def _expected_gather_bytes(z, u):
    """One gather of unit ``u`` by the layout alone: normal ``padded * itemsize``; with FP8 weights, each rank's
    FP8 elements at 1 byte and its other (non-padding) elements at the parameter dtype's size, the largest
    rank's part rounded up to 16 bytes, times dp."""
    fp8 = {id(m.weight) for m in z.module.modules() if isinstance(m, (FP8Linear, FP8ColumnParallelLinear,
                                                                   FP8RowParallelLinear))
           and m.recipe.scaling == "tensor"}
    isz = z.param_dtype.itemsize
    if not z.fp8_gather or not any(id(p) in fp8 for p in u.params):
        return u.padded * isz
    parts = []
    for r in range(z.dp_size):
        lo, hi = r * u.shard_numel, (r + 1) * u.shard_numel
        part = 0
        for p, o, n in zip(u.params, u.offsets, u.numels):
            k = max(0, min(o + n, hi) - max(o, lo))
            part += k * (1 if id(p) in fp8 else isz)
        parts.append(part)
    return z.dp_size * max(16, -(-max(parts) // 16) * 16)


def body_train(rank, world, scaling, dtype_name, fp8_gather, tp):
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    mesh = cached_mesh(dp=world // tp, tp=tp)
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = _Net(FP8Recipe(scaling), mesh.tp_group if tp > 1 else None)
    ref = copy.deepcopy(model) if tp == 1 else None
    z = ZeroStage3(model, mesh.dp_group, min_unit_numel=0, fp8_gather=fp8_gather,
                   param_dtype=dtype if dtype != torch.float32 else None)
    opt = ZeroStage3Optimizer(z, **ADAM)
    out = {"losses": [], "bytes": [], "expected": [], "fp8_units": 0}
    for step in range(STEPS):
        x = _batch(step, dtype)
        loss = z(x.chunk(world // tp)[mesh.dp_rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.detach().float())
        launches = [(u, extra["bytes"]) for ev, u, _, extra in z.timeline if ev == "gather_launch"]
        out["bytes"].append(z.all_gather_bytes)
        out["expected"].append(sum(_expected_gather_bytes(z, z.units[u]) for u, _ in launches))
        out["per_gather_ok"] = all(b == _expected_gather_bytes(z, z.units[u]) for u, b in launches)
    out["handed_off_after"] = [m.fp8_gathered_weight is not None for m in model.modules()
                               if hasattr(m, "fp8_gathered_weight")]
    out["state"] = z.full_state_dict()
    out["nonfinite"] = sum(float(m.fp8_nonfinite.item()) for m in model.modules() if hasattr(m, "fp8_nonfinite"))
    out["unit_bytes"] = [(len(u.params), u.padded, _expected_gather_bytes(z, u)) for u in z.units]
    if ref is not None and dtype == torch.float32:
        # one process, torch's AdamW, each step the ranks' micro-batches one after the other, their gradients
        # averaged: each FP8 GEMM sees the operands (and so the scales) a rank sees
        ref_opt = torch.optim.AdamW(ref.parameters(), foreach=False, **ADAM)
        ref_losses = []
        for step in range(STEPS):
            chunks = _batch(step, dtype).chunk(world)
            losses = [ref(c) for c in chunks]
            for lo in losses:
                (lo / world).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(losses[rank])
        out["loss_err"] = max(abs(a.item() - b.item()) / abs(b.item()) for a, b in zip(out["losses"], ref_losses))
        out["param_err"] = max(((out["state"][n] - p.detach()).norm() / p.detach().norm()).item()
                               for n, p in ref.named_parameters())
    return out


def _pair(dist_pools, world, scaling, dtype_name, tp=1):
    pool = dist_pools(world)
    return pool.run(body_train, scaling, dtype_name, False, tp), pool.run(body_train, scaling, dtype_name, True, tp)


def _assert_bit_identical(plain, fp8):
    for rank, (a, b) in enumerate(zip(plain, fp8)):
        for step, (la, lb) in enumerate(zip(a["losses"], b["losses"])):
            assert torch.equal(la, lb), f"rank {rank} step {step}: loss {la.item()!r} vs {lb.item()!r} with fp8_gather"
        for n, t in a["state"].items():
            assert torch.equal(t, b["state"][n]), f"rank {rank}: {n} differs with fp8_gather"
        assert a["nonfinite"] == b["nonfinite"] == 0.0
        assert not any(b["handed_off_after"]), "a layer kept its gathered FP8 weight after the step"
        assert a["per_gather_ok"] and b["per_gather_ok"]
        assert a["bytes"] == a["expected"] and b["bytes"] == b["expected"], (a["bytes"], b["bytes"], b["expected"])


@pytest.mark.parametrize("world,dtype_name", [(2, "float32"), (2, "bfloat16"), (4, "float32")])
def test_fp8_gather_trains_bit_identically(dist_pools, world, dtype_name):
    plain, fp8 = _pair(dist_pools, world, "tensor", dtype_name)
    _assert_bit_identical(plain, fp8)
    isz = getattr(torch, dtype_name).itemsize
    for b in fp8:
        # the unit of one FP8Linear(W, W, bias=False) moves exactly its W*W elements at 1 byte; the root (no FP8
        # layer) its padded buffer at itemsize; every step's total is less than the plain run's
        assert (1, W * W, W * W) in b["unit_bytes"], b["unit_bytes"]
        assert b["unit_bytes"][0][2] == b["unit_bytes"][0][1] * isz
    assert all(f < p for f, p in zip(fp8[0]["bytes"], plain[0]["bytes"])), (fp8[0]["bytes"], plain[0]["bytes"])
    if dtype_name == "float32":
        for out in fp8:
            assert out["loss_err"] < STATE_REL and out["param_err"] < STATE_REL, (out["loss_err"], out["param_err"])


def test_fp8_gather_tp2_dp2_bit_identical(dist_pools):
    plain, fp8 = _pair(dist_pools, 4, "tensor", "float32", tp=2)
    _assert_bit_identical(plain, fp8)
    assert all(f < p for f, p in zip(fp8[0]["bytes"], plain[0]["bytes"]))


@pytest.mark.parametrize("scaling", ["delayed", "row"])
def test_other_recipes_gather_as_usual(dist_pools, scaling):
    plain, fp8 = _pair(dist_pools, 2, scaling, "float32")
    _assert_bit_identical(plain, fp8)
    assert fp8[0]["bytes"] == plain[0]["bytes"]       # nothing gathered in FP8


def body_guard(rank, world):
    """Inside the forward an FP8-gathered weight cannot be read (its full-precision value was never gathered);
    the layer holds the FP8 weight only while its unit is gathered; gathered_parameters() reads every weight."""
    from parallel_layers.zero import ZeroStage3

    torch.manual_seed(0)
    model = _Net(FP8Recipe("tensor"))
    dense = copy.deepcopy(model)
    z = ZeroStage3(model, cached_mesh(dp=world).dp_group, min_unit_numel=0, fp8_gather=True)
    seen = {}

    def peek(module, args):
        seen["handed"] = module.fp8_gathered_weight is not None
        try:
            module.weight.sum()
        except RuntimeError as exc:
            seen["error"] = str(exc)

    handle = model.proj[0].register_forward_pre_hook(peek)
    z(_batch(0, torch.float32).chunk(world)[rank]).backward()
    handle.remove()
    with z.gathered_parameters():
        same = all(torch.equal(p, q) for p, q in zip(model.parameters(), dense.parameters()))
    return seen, same, model.proj[0].fp8_gathered_weight is None


def test_fp8_gathered_weight_is_guarded(dist_pools):
    for seen, same, cleared in dist_pools(2).run(body_guard):
        assert seen["handed"] and "gathered in FP8" in seen.get("error", ""), seen
        assert same and cleared, seen


def body_modes(rank, world, fp8_gather):
    """Activation checkpointing (the recomputation runs on the backward's FP8 gather) for two steps, then held
    mode (gather_all, two micro-batches, reduce_scatter_and_free: a pipeline's use), with or without the FP8
    all-gather."""
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.manual_seed(0)
    model = _Net(FP8Recipe("tensor"), ckpt=True)
    z = ZeroStage3(model, cached_mesh(dp=world).dp_group, min_unit_numel=0, fp8_gather=fp8_gather)
    opt = ZeroStage3Optimizer(z, **ADAM)
    losses = []
    for step in range(2):
        loss = z(_batch(step, torch.float32).chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    z.gather_all()
    held_bytes = z.all_gather_bytes
    for step in range(2, 4):
        z(_batch(step, torch.float32).chunk(world)[rank]).backward()
    z.reduce_scatter_and_free()
    grads = z.grad_buffer.clone()
    opt.step()
    return losses, grads, z.full_state_dict(), held_bytes


def test_fp8_gather_under_checkpointing_and_held_mode(dist_pools):
    pool = dist_pools(2)
    plain, fp8 = pool.run(body_modes, False), pool.run(body_modes, True)
    for (la, ga, sa, ba), (lb, gb, sb, bb) in zip(plain, fp8):
        assert all(torch.equal(a, b) for a, b in zip(la, lb)), (la, lb)
        assert torch.equal(ga, gb)
        assert all(torch.equal(sa[n], sb[n]) for n in sa)
        assert bb < ba, (bb, ba)
