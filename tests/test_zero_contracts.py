"""ZeRO 1/2/3 keep torch.optim's contracts, on real gloo ranks, every rank checked against the plain
single-process model trained with torch.optim.AdamW on the whole batch:

- the optimizers are ``torch.optim.Optimizer``s: param groups with their own lr/betas/eps/weight decay,
  driven by torch's LR schedulers (LambdaLR with a lambda per group, CosineAnnealingLR);
- frozen parameters, parameters no rank used in a step, and every parameter when ``step()`` follows no
  backward stay bit-identical, with per-parameter step counts (bias correction) as torch keeps them;
- ``torch.nn.utils.clip_grad_norm_`` on sharded gradients raises an error naming the right call, and
  ``optimizer.clip_grad_norm_`` returns the single-process norm and clips the step;
- ``ZeroStage3.no_sync()`` accumulates micro-batches locally and reduces once;
- reading a ZeRO-3 parameter outside its gather raises a Python error (a worker's crash would fail the
  test: the pool reports a dead rank), and ``gathered_parameters()`` makes it readable.

The model is tiny (~900 parameters) and every run is 5 steps, so the file costs seconds.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
VOCAB, D, B, T = 11, 16, 8, 4
STEPS = 5


class _Net(nn.Module):
    """Embedding, two LayerNorm + Linear blocks (a ModuleList: ZeRO-3's units), a head and, with ``aux``,
    an auxiliary head used only when asked (its parameters get no gradient in the other steps)."""

    def __init__(self, aux=False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(D, 3)
        self.aux = nn.Linear(D, 3) if aux else None

    def forward(self, idx, target, use_aux=False):
        h = self.emb(idx)
        for block in self.blocks:
            h = h + block(h)
        out = self.head(h)
        if use_aux:
            out = out + self.aux(h)
        return F.mse_loss(out, target)


def _data(n=STEPS, batch=B):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, T), generator=gen), torch.randn(batch, T, 3, generator=gen))
            for _ in range(n)]


def _groups(named, lr=LR):
    """No weight decay for biases and norms; that group also has its own lr, betas and eps."""
    decay = [p for n, p in named if p.ndim >= 2]
    rest = [p for n, p in named if p.ndim < 2]
    return [{"params": decay, "weight_decay": WD},
            {"params": rest, "weight_decay": 0.0, "lr": lr * 0.5, "betas": (0.8, 0.99), "eps": 1e-6}]


def _torch_adamw(ref):
    """The oracle: torch AdamW over the single-process model, with the same groups."""
    return torch.optim.AdamW(_groups(list(ref.named_parameters())), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             foreach=False)


def _wrap(model, stage, world, find_unused=False, cap=0.001):
    """(wrapper, make_optimizer(params)); cap: small buckets (several runs and bucket edges in a shard)."""
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer, ZeroStage3, ZeroStage3Optimizer

    group = cached_mesh(dp=world).dp_group
    if stage == 3:
        z = ZeroStage3(model, group, find_unused_parameters=find_unused)
        return z, lambda params: ZeroStage3Optimizer(z, params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    dp = DataParallel(model, group, reduce_op="reduce_scatter", bucket_cap_mb=cap, first_bucket_cap_mb=cap,
                      find_unused_parameters=find_unused)
    return dp, lambda params: ZeroOptimizer(dp, params, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def _full(wrapper, model, stage):
    """Every parameter, full, by name (ZeRO-3: gathered, a collective)."""
    if stage == 3:
        return wrapper.full_state_dict()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _mean_loss(loss, group, world):
    t = loss.detach().clone()
    torch.distributed.all_reduce(t, group=group)
    return t.item() / world


def _max_diff(full, ref):
    return worst((full[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters())


def _local(t, rank, world):
    return t.chunk(world)[rank]


# ---------------------------------------------------------------------- 1. param groups + schedulers
def body_schedulers(rank, world, stage):
    out = {}
    for kind in ("lambda", "cosine"):
        torch.manual_seed(0)
        model = _Net()
        ref = copy.deepcopy(model)
        wrapper, make = _wrap(model, stage, world)
        opt = make(_groups(list(model.named_parameters())))
        ref_opt = _torch_adamw(ref)
        if kind == "lambda":     # a lambda per group: the groups' learning rates differ at every step
            lambdas = [lambda s: 1.0 / (s + 1), lambda s: 0.8 ** s]
            scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (opt, ref_opt)]
        else:
            scheds = [torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS) for o in (opt, ref_opt)]
        loss_err, lrs = 0.0, []
        for x, y in _data():
            loss_ref = ref(x, y)
            loss_ref.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss = wrapper(_local(x, rank, world), _local(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad()
            loss_err = worst([loss_err, abs(_mean_loss(loss, cached_mesh(dp=world).dp_group, world) - loss_ref.item())])
            lrs.append(([g["lr"] for g in opt.param_groups], [g["lr"] for g in ref_opt.param_groups]))
            for s in scheds:
                s.step()
        out[kind] = dict(is_optimizer=isinstance(opt, torch.optim.Optimizer), loss_err=loss_err,
                         param_err=_max_diff(_full(wrapper, model, stage), ref), lrs=lrs,
                         n_groups=len(opt.param_groups))
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_and_lr_schedulers_match_torch_adamw(dist_pools, stage):
    for rank, out in enumerate(dist_pools(2).run(body_schedulers, stage)):
        for kind, r in out.items():
            assert r["is_optimizer"] and r["n_groups"] == 2
            assert all(a == b for a, b in r["lrs"]), (kind, r["lrs"])
            assert len({tuple(a) for a, _ in r["lrs"]}) == STEPS, "the scheduler changed nothing"
            assert r["loss_err"] < 1e-5, (rank, kind, r["loss_err"])
            assert r["param_err"] < 1e-5, (rank, kind, r["param_err"])


# ---------------------------------------------------------------------- 2. no gradient, no update
# aux head used by (rank 0, rank 1) in each step: never in step 0, by both, by rank 0 only, by none, by both
AUX = [(False, False), (True, True), (True, False), (False, False), (True, True)]


def body_untouched(rank, world, stage):
    torch.manual_seed(0)
    model = _Net(aux=True)
    model.emb.weight.requires_grad_(False)            # frozen: weight decay must not reach it either
    ref = copy.deepcopy(model)
    wrapper, make = _wrap(model, stage, world, find_unused=True)
    opt = make(_groups(list(model.named_parameters())))
    ref_opt = _torch_adamw(ref)
    start = _full(wrapper, model, stage)
    opt.step()                                         # no backward at all: torch's AdamW does nothing
    opt.zero_grad()
    opt.step()
    no_backward = (all(torch.equal(v, start[n]) for n, v in _full(wrapper, model, stage).items()),
                   opt.steps_taken)
    history = []
    for (x, y), flags in zip(_data(), AUX):
        # the single-process model sees every rank's slice with that rank's choice (the mean of the losses)
        loss_ref = sum(ref(_local(x, r, world), _local(y, r, world), use_aux=f) for r, f in enumerate(flags)) / world
        loss_ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        wrapper(_local(x, rank, world), _local(y, rank, world), flags[rank]).backward()
        opt.step()
        opt.zero_grad()
        opt.step()                                     # a second step without a backward changes nothing
        history.append(_full(wrapper, model, stage))
    aux = [{k: v for k, v in h.items() if k.startswith("aux.")} for h in history]
    return dict(no_backward=no_backward,
                frozen=all(torch.equal(h["emb.weight"], start["emb.weight"]) for h in history),
                aux_step0=all(torch.equal(v, start[k]) for k, v in aux[0].items()),
                aux_step3=all(torch.equal(v, aux[2][k]) for k, v in aux[3].items()),
                aux_moved=not torch.equal(aux[4]["aux.weight"], aux[3]["aux.weight"]),
                param_err=_max_diff(history[-1], ref),
                steps=opt.state_dict()["steps"], ref_steps={n: int(ref_opt.state[p]["step"])
                                                            for n, p in ref.named_parameters() if p in ref_opt.state})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_frozen_and_gradless_parameters_stay_bit_identical(dist_pools, stage):
    for rank, r in enumerate(dist_pools(2).run(body_untouched, stage)):
        assert r["no_backward"] == (True, 0), (rank, r["no_backward"])
        assert r["frozen"], f"rank {rank}: the frozen embedding moved"
        assert r["aux_step0"] and r["aux_step3"], f"rank {rank}: a parameter without a gradient moved"
        assert r["aux_moved"]
        assert r["param_err"] < 1e-5, (rank, r["param_err"])
        # per-parameter step counts as torch keeps them (aux: 3 of 5 steps, partly on one rank only)
        assert r["steps"]["aux.weight"] == 3 and r["steps"]["head.weight"] == STEPS
        assert r["steps"]["emb.weight"] == 0
        assert {n: s for n, s in r["steps"].items() if s} == r["ref_steps"]


# ---------------------------------------------------------------------- 3. clipping
MAX_NORM = 0.05


def body_clip(rank, world, stage):
    from parallel_layers.amp import clip_grad_norm_ as pl_clip_grad_norm_

    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    wrapper, make = _wrap(model, stage, world)
    opt = make(_groups(list(model.named_parameters())))
    ref_opt = _torch_adamw(ref)
    norms, errors = [], []
    for i, (x, y) in enumerate(_data()):
        ref(x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        ref_opt.step()
        ref_opt.zero_grad()
        wrapper(_local(x, rank, world), _local(y, rank, world)).backward()
        if i == 0:   # the standard calls cannot see sharded gradients: they must raise, not return a number
            for call in (lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM),
                         lambda: pl_clip_grad_norm_(list(model.parameters()), MAX_NORM),
                         lambda: model.blocks[0][1].weight.grad.norm()):
                try:
                    call()
                    errors.append(None)
                except RuntimeError as exc:
                    errors.append(str(exc))
        norms.append((opt.clip_grad_norm_(MAX_NORM).item(), ref_norm))
        opt.step()
        opt.zero_grad()
    return norms, errors, _max_diff(_full(wrapper, model, stage), ref)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_matches_torch_and_the_standard_call_raises(dist_pools, stage):
    for rank, (norms, errors, param_err) in enumerate(dist_pools(2).run(body_clip, stage)):
        assert all(ref > MAX_NORM for _, ref in norms), "the clipping must bite for the test to mean anything"
        for ours, ref in norms:
            assert abs(ours - ref) <= 1e-5 * ref, (rank, norms)
        assert len(errors) == 3
        for msg in errors:
            assert msg is not None, f"rank {rank}: a standard clip on sharded gradients returned a number"
            assert "optimizer.clip_grad_norm_(max_norm)" in msg and "'" in msg, msg
        assert "blocks.0.1.weight" in errors[2], errors[2]
        assert param_err < 1e-5, (rank, param_err)


def body_clip_low_precision(rank, world):
    """bf16 ZeRO-2: p.grad holds nothing (the fp32 main grads are in the buffer); it is a guard too."""
    torch.manual_seed(0)
    model = _Net().to(torch.bfloat16)
    wrapper, make = _wrap(model, 2, world)
    opt = make(None)
    for x, y in _data(2):
        wrapper(_local(x, rank, world), _local(y, rank, world).bfloat16()).backward()
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            raised = None
        except RuntimeError as exc:
            raised = str(exc)
        norm = opt.clip_grad_norm_(MAX_NORM).item()
        opt.step()
        opt.zero_grad()
    return raised, norm, opt.steps_taken


def test_clipping_bf16_zero2_standard_call_raises(dist_pools):
    for raised, norm, steps in dist_pools(2).run(body_clip_low_precision):
        assert raised and "optimizer.clip_grad_norm_(max_norm)" in raised, raised
        assert norm > 0 and steps == 2


def body_clip_all_reduce(rank, world):
    """Stage 1 over an all-reduce: p.grad is the full averaged gradient and the step slices that buffer,
    so the standard torch call is right (and reaches the step): no guard there."""
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    dp = DataParallel(model, cached_mesh(dp=world).dp_group, reduce_op="all_reduce", bucket_cap_mb=0.001,
                      first_bucket_cap_mb=0.001)
    opt = ZeroOptimizer(dp, _groups(list(model.named_parameters())), stage=1, lr=LR, betas=BETAS, eps=EPS,
                        weight_decay=WD)
    ref_opt = _torch_adamw(ref)
    norm_err = 0.0
    for x, y in _data():
        ref(x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item()
        ref_opt.step()
        ref_opt.zero_grad()
        dp(_local(x, rank, world), _local(y, rank, world)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        norm_err = worst([norm_err, abs(norm - ref_norm) / ref_norm])
        opt.step()
        opt.zero_grad()
    return norm_err, _max_diff(_full(dp, model, 1), ref)


def test_clipping_stage1_over_all_reduce_standard_call_is_right(dist_pools):
    for rank, (norm_err, param_err) in enumerate(dist_pools(2).run(body_clip_all_reduce)):
        assert norm_err < 1e-5 and param_err < 1e-5, (rank, norm_err, param_err)


# ---------------------------------------------------------------------- 4. ZeRO-3 no_sync
def body_no_sync(rank, world, micro):
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    z = ZeroStage3(model, cached_mesh(dp=world).dp_group)
    opt = ZeroStage3Optimizer(z, _groups(list(model.named_parameters())), lr=LR, betas=BETAS, eps=EPS,
                              weight_decay=WD)
    ref_opt = _torch_adamw(ref)
    reduces = []
    for x, y in _data():
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        xs, ys = _local(x, rank, world).chunk(micro), _local(y, rank, world).chunk(micro)
        for i, (xm, ym) in enumerate(zip(xs, ys)):
            if i < micro - 1:
                with z.no_sync():
                    (z(xm, ym) / micro).backward()
            else:
                (z(xm, ym) / micro).backward()
            reduces.append(sum(ev == "reduce_launch" for ev, *_ in z.timeline))
        opt.step()
        opt.zero_grad()
    gathered = opt.memory_report()["gathered_bytes"]
    # stepping on gradients that were only accumulated is an error, not a silent local step
    xm, ym = [_local(t, rank, world) for t in _data(1)[0]]
    with z.no_sync():
        z(xm, ym).backward()
    try:
        opt.step()
        unreduced = None
    except RuntimeError as exc:
        unreduced = str(exc)
    opt.zero_grad()
    return _max_diff(z.full_state_dict(), ref), reduces, len(z.units), gathered, unreduced


def test_zero3_no_sync_accumulates_then_reduces_once(dist_pools):
    micro = 4
    for rank, (err, reduces, units, gathered, unreduced) in enumerate(dist_pools(2).run(body_no_sync, micro)):
        assert err < 1e-5, (rank, err)
        # no reduce-scatter in the first three micro-batches, every unit once in the last
        assert reduces == [0, 0, 0, units] * STEPS, reduces
        assert gathered == 0
        assert unreduced and "no_sync" in unreduced, unreduced


# ---------------------------------------------------------------------- 5. reading ZeRO-3 parameters
class _PeekingNet(_Net):
    """Reads a unit's parameter in the root's forward without calling the unit."""

    def forward(self, idx, target, use_aux=False):
        self.blocks[1][1].weight.sum()
        return super().forward(idx, target, use_aux)


def body_read_parameters(rank, world):
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    z = ZeroStage3(model, cached_mesh(dp=world).dp_group)
    opt = ZeroStage3Optimizer(z, lr=LR)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    for x, y in _data(2):
        ref(x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        z(_local(x, rank, world), _local(y, rank, world)).backward()
        opt.step()
        opt.zero_grad()
    errors = {}
    unit_w, root_w = model.blocks[0][1].weight, model.emb.weight
    for name, read in (("unit norm", lambda: unit_w.norm()), ("root norm", lambda: root_w.norm()),
                       ("repr", lambda: repr(unit_w)), ("detach", lambda: unit_w.detach().sum()),
                       ("vector", lambda: torch.nn.utils.parameters_to_vector(model.parameters()))):
        try:
            read()
            errors[name] = None
        except RuntimeError as exc:
            errors[name] = str(exc)
    meta = (tuple(unit_w.shape), unit_w.dtype, unit_w.numel(), unit_w.grad is None, unit_w.requires_grad)
    with z.gathered_parameters():
        inside = {n: p.norm().item() for n, p in model.named_parameters()}
    after = None
    try:
        unit_w.norm()
    except RuntimeError as exc:
        after = str(exc)
    ref_norms = {n: p.norm().item() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    peek = ZeroStage3(_PeekingNet(), cached_mesh(dp=world).dp_group)
    try:
        peek(*[_local(t, rank, world) for t in _data(1)[0]])
        in_forward = None
    except RuntimeError as exc:
        in_forward = str(exc)
    return errors, meta, inside, ref_norms, after, in_forward


def test_zero3_parameter_reads_raise_instead_of_crashing(dist_pools):
    for rank, (errors, meta, inside, ref_norms, after, in_forward) in enumerate(
            dist_pools(2).run(body_read_parameters)):
        for what, msg in errors.items():
            assert msg is not None, f"rank {rank}: {what} of a sharded parameter returned a value"
            assert "gathered_parameters()" in msg, msg
        assert "'blocks.0.1.weight'" in errors["unit norm"] and "'emb.weight'" in errors["root norm"]
        assert "(16, 16)" in errors["unit norm"]
        assert meta == ((D, D), torch.float32, D * D, True, True)      # metadata stays readable
        for n, v in ref_norms.items():
            assert abs(inside[n] - v) <= 1e-5 * max(1.0, v), (rank, n, inside[n], v)
        assert after and "'blocks.0.1.weight'" in after
        assert in_forward and "'blocks.1.1.weight'" in in_forward, in_forward


# ---------------------------------------------------------------------- state dicts
def _old_format(state):
    """A state dict as saved before param groups: one group without "params", one step count."""
    old = {k: v for k, v in state.items() if k not in ("format", "steps")}
    old["param_groups"] = [{k: v for k, v in state["param_groups"][0].items() if k != "params"}]
    return old


def body_state_dict(rank, world, stage):
    data = _data()
    runs = []
    for resume in (None, "new", "old"):
        torch.manual_seed(0)
        model = _Net(aux=True)
        wrapper, make = _wrap(model, stage, world, find_unused=True)
        opt = make(_groups(list(model.named_parameters())) if resume != "old" else None)
        for i, ((x, y), flags) in enumerate(zip(data, AUX)):
            if resume and i == 3:     # a fresh optimizer from the saved state, same module
                saved = opt.state_dict()
                opt = make(_groups(list(model.named_parameters())) if resume != "old" else None)
                opt.load_state_dict(_old_format(saved) if resume == "old" else saved)
            wrapper(_local(x, rank, world), _local(y, rank, world), flags[rank]).backward()
            opt.step()
            opt.zero_grad()
        runs.append((_full(wrapper, model, stage), opt.state_dict()["steps"]))
    return runs


@pytest.mark.parametrize("stage", [1, 3])
def test_state_dict_round_trip_with_groups_and_step_counts(dist_pools, stage):
    for rank, ((full, steps), (full_new, steps_new), (_, steps_old)) in enumerate(
            dist_pools(2).run(body_state_dict, stage)):
        assert all(torch.equal(v, full_new[n]) for n, v in full.items()), rank
        assert steps == steps_new and steps["aux.weight"] == 3
        # the format before groups holds one count: every parameter resumes from it
        assert steps_old["head.weight"] == STEPS and steps_old["aux.weight"] == STEPS - 1
