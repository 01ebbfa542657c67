"""DataParallel (stage 0) on real gloo ranks against single-process training of the same GPT.

Every rank builds the plain ``GPT(cfg)`` from seed 0 (the oracle, trained on the FULL batch) and a replica
from a rank-dependent seed (so the wrap-time broadcast is what makes the replicas equal), wraps the replica
over the DP group and trains it on its slice of the batch. Small buckets (a few KiB) give ~7 buckets, so
ordering, overlap and rebuild are exercised.

fp32 tolerance 1e-5 relative: losses elementwise, parameters per tensor in norm (``|a - b| / |b|``). The
configs use ``bias=False``: with a key bias its exact gradient is zero and Adam turns rounding noise into
steps of size lr (see tests/test_gpt_tp.py); LayerNorm biases remain.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parallel_layers.data_parallel import DataParallel, ParamAndGradBuffer, overlap_report
from parallel_layers.data_parallel.fused_grads import grad_sink
from parallel_layers.models import GPT, GPTConfig
from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

SMALL = dict(vocab_size=101, n_layer=2, n_head=4, d_model=32, max_seq_len=16, dropout=0.0, bias=False)
CAPS = dict(bucket_cap_mb=0.01, first_bucket_cap_mb=0.004)
BATCH = 8


def _batches(steps, cfg, seed=123):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen),
             torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen)) for _ in range(steps)]


def _rel_norm(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _max_param_err(ref: dict, got: dict):
    return worst((_rel_norm(got[k], v), k) for k, v in ref.items())


def _mean_over(group, x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


# ---------------------------------------------------------------------- parity with single-process training
def body_parity(rank, world, dp, tp, steps, checkpoint=False):
    mesh = cached_mesh(dp=dp, tp=tp)
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0 if tp > 1 or rank == 0 else 1000 + rank)   # dp rank 0 holds the oracle init
    model = GPT(cfg, tp_group=mesh.tp_group if tp > 1 else None, checkpoint=checkpoint)
    if tp > 1:   # perturb so the broadcast matters here too (shards of dp rank 0 win)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * mesh.dp_rank)
    ddp = DataParallel(model, mesh.dp_group, **CAPS)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (dense, model)]
    per = BATCH // dp
    sl = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    losses, errs, versions = [], [], []
    for step, (idx, tgt) in enumerate(_batches(steps, cfg)):
        if step == 2:    # validation between steps: an eval-mode forward under no_grad through the wrapper
            for m in (dense, ddp):
                m.eval()
            with torch.no_grad():
                val = (dense(idx, tgt)[1].item(), _mean_over(mesh.dp_group, ddp(idx[sl], tgt[sl])[1].item()))
            for m in (dense, ddp):
                m.train()
            losses.append(val)
        for o in opts:
            o.zero_grad()
        _, ref_loss = dense(idx, tgt)
        ref_loss.backward()
        _, loss = ddp(idx[sl], tgt[sl])
        loss.backward()
        losses.append((ref_loss.item(), _mean_over(mesh.dp_group, loss.item())))
        versions.append(ddp.layout_version)
        for o in opts:
            o.step()
        got = model.dense_state_dict() if tp > 1 else model.state_dict()
        errs.append(_max_param_err(dense.state_dict(), got))
    layout = [name for bucket in ddp.bucket_names for name in bucket]
    return dict(losses=losses, errs=errs, versions=versions, n_buckets=len(ddp.buffer.buckets),
                layout=layout, arrival=ddp.last_sync_timeline["arrival"])


@pytest.mark.parametrize("world,dp,tp,checkpoint", [(2, 2, 1, False), (4, 4, 1, False), (4, 2, 2, False),
                                                    (2, 2, 1, True)], ids=["dp2", "dp4", "tp2xdp2", "dp2-ckpt"])
def test_stage0_matches_single_process(dist_pools, world, dp, tp, checkpoint):
    # checkpoint: every block recomputed in backward, its gradients landing through the same hooks
    results = dist_pools(world).run(body_parity, dp, tp, 10, checkpoint)
    for rank, out in enumerate(results):
        assert out["n_buckets"] >= 4
        for step, (ref, got) in enumerate(out["losses"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), f"rank {rank} step {step}: loss {got} vs single {ref}"
        for step, (err, name) in enumerate(out["errs"]):
            assert err <= 1e-5, f"rank {rank} step {step}: {name} differs by {err:.2e} (relative norm)"
        # Bucket order rebuilt once, from the arrival order of the first backward; stable afterwards.
        assert out["versions"][-1] == out["versions"][0] <= 1
        assert out["layout"] == out["arrival"], f"rank {rank}: layout is not the gradient arrival order"
    assert all(r["layout"] == results[0]["layout"] for r in results)


# ---------------------------------------------------------------------- with our FusedAdamW, in either order
def body_fused_optimizer(rank, world, optimizer_first, steps):
    """DataParallel re-points ``p.data`` into its buffers at wrap time and again at its bucket rebuild
    after the first backward; FusedAdamW keeps ``p.data`` as views of its own flat storage. Whichever
    order the two are built in, the optimizer must keep stepping the tensors the model reads."""
    from parallel_layers.optim import FusedAdamW

    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    if optimizer_first:
        opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        ddp = DataParallel(model, group, **CAPS)
    else:
        ddp = DataParallel(model, group, **CAPS)
        opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=1e-3, weight_decay=0.1)
    per = BATCH // world
    sl = slice(rank * per, (rank + 1) * per)
    losses, errs = [], []
    for idx, tgt in _batches(steps, cfg):
        ref_opt.zero_grad()
        opt.zero_grad()
        _, ref_loss = dense(idx, tgt)
        ref_loss.backward()
        _, loss = ddp(idx[sl], tgt[sl])
        loss.backward()
        losses.append((ref_loss.item(), _mean_over(group, loss.item())))
        ref_opt.step()
        opt.step()
        errs.append(_max_param_err(dense.state_dict(), model.state_dict()))
    return dict(losses=losses, errs=errs, layout_version=ddp.layout_version)


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer_first", "wrapper_first"])
def test_fused_adamw_under_data_parallel(dist_pools, optimizer_first):
    results = dist_pools(2).run(body_fused_optimizer, optimizer_first, 4)
    for rank, out in enumerate(results):
        assert out["layout_version"] == 1, "the bucket rebuild (the case that moved p.data) did not happen"
        for step, (ref, got) in enumerate(out["losses"]):
            assert abs(got - ref) <= 1e-5 * abs(ref), f"rank {rank} step {step}: loss {got} vs single {ref}"
        for step, (err, name) in enumerate(out["errs"]):
            assert err <= 1e-5, f"rank {rank} step {step}: {name} differs by {err:.2e} (relative norm)"


# ---------------------------------------------------------------------- overlap: bit-identical and real
def body_overlap(rank, world, comm_dtype):
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    models = []
    for overlap in (True, False):
        torch.manual_seed(rank)
        models.append(DataParallel(GPT(cfg), group, overlap=overlap, comm_dtype=comm_dtype, **CAPS))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    per = BATCH // world
    identical, reports = True, []
    for idx, tgt in _batches(3, cfg):
        grads = []
        for m, o in zip(models, opts):
            o.zero_grad()
            _, loss = m(idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
            loss.backward()
            grads.append([p.grad.clone() for p in m.module.parameters()])
            reports.append(overlap_report(m.last_sync_timeline))
            o.step()
        identical &= all(torch.equal(a, b) for a, b in zip(*grads))
        identical &= all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))
    return identical, reports


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_overlap_is_bit_identical_and_real(dist_pools, comm_dtype):
    for rank, (identical, reports) in enumerate(dist_pools(2).run(body_overlap, comm_dtype)):
        assert identical, f"rank {rank}: overlapped and non-overlapped gradients differ"
        on, off = reports[0::2], reports[1::2]
        # Recorded, not inferred: launches before backward ended, while some gradients were not yet computed.
        assert all(r["launched_before_backward_end"] >= 1 for r in on), on
        assert all(r["launched_before_backward_end"] == 0 for r in off), off


# ---------------------------------------------------------------------- no_sync accumulation
def body_no_sync(rank, world):
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    dense = GPT(cfg)
    torch.manual_seed(0)
    ddp = DataParallel(GPT(cfg), group, **CAPS)
    idx, tgt = _batches(1, cfg)[0]
    _, loss = dense(idx, tgt)
    loss.backward()
    per, half = BATCH // world, BATCH // world // 2
    ddp.zero_grad()
    lo = rank * per
    with ddp.no_sync():
        _, l1 = ddp(idx[lo:lo + half], tgt[lo:lo + half])
        (l1 / 2).backward()
    launched_in_no_sync = ddp.last_sync_timeline is not None
    _, l2 = ddp(idx[lo + half:lo + per], tgt[lo + half:lo + per])
    (l2 / 2).backward()
    err = worst((_rel_norm(p.grad, q.grad), n) for (n, p), q in zip(ddp.module.named_parameters(), dense.parameters()))
    return launched_in_no_sync, err


def test_no_sync_accumulation_equals_large_batch(dist_pools):
    for rank, (launched, (err, name)) in enumerate(dist_pools(2).run(body_no_sync)):
        assert not launched, f"rank {rank}: a collective ran inside no_sync()"
        assert err <= 1e-5, f"rank {rank}: accumulated gradient of {name} differs by {err:.2e}"


# ---------------------------------------------------------------------- unused parameters
class WithExtra(nn.Module):
    """GPT plus a layer used only when ``use_extra`` (rank-dependent in the test)."""

    def __init__(self, cfg):
        super().__init__()
        self.gpt = GPT(cfg)
        self.extra = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, idx, tgt, use_extra=False):
        _, loss = self.gpt(idx, tgt)
        if use_extra:
            loss = loss + self.extra(self.gpt.wte.weight[:4]).square().mean()
        return loss


def body_unused(rank, world):
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    idx, tgt = _batches(1, cfg)[0]
    per = BATCH // world
    mine = slice(rank * per, (rank + 1) * per)
    out = {}
    torch.manual_seed(0)
    ddp = DataParallel(WithExtra(cfg), group, **CAPS)
    try:
        ddp(idx[mine], tgt[mine]).backward()
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    # find_unused_parameters=True, unused on every rank: same as single process (extra untouched, grad None).
    torch.manual_seed(0)
    dense = WithExtra(cfg)
    torch.manual_seed(0)
    ddp = DataParallel(WithExtra(cfg), group, find_unused_parameters=True, **CAPS)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (dense, ddp)]
    for idx, tgt in _batches(3, cfg):
        for o in opts:
            o.zero_grad()
        dense(idx, tgt).backward()
        ddp(idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per]).backward()
        out["extra_grad_none"] = ddp.module.extra.weight.grad is None
        for o in opts:
            o.step()
    out["err"] = _max_param_err(dense.state_dict(), ddp.module.state_dict())
    # Used on ranks > 0 only: averaged gradient = sum of the users' gradients / world; rank 0 does not hang.
    expected = torch.zeros_like(dense.extra.weight)
    for r in range(1, world):
        dense.zero_grad()
        dense(idx[r * per:(r + 1) * per], tgt[r * per:(r + 1) * per], use_extra=True).backward()
        expected += dense.extra.weight.grad / world
    ddp.zero_grad()
    ddp(idx[mine], tgt[mine], use_extra=rank > 0).backward()
    out["partial_err"] = _rel_norm(ddp.module.extra.weight.grad, expected)
    return out


def test_unused_parameters(dist_pools):
    for rank, out in enumerate(dist_pools(2).run(body_unused)):
        msg = out["error"]
        assert msg and "extra.weight" in msg and "extra.bias" in msg and "find_unused_parameters=True" in msg, msg
        assert "Expected to have finished reduction" not in msg
        assert out["extra_grad_none"], f"rank {rank}: a globally unused parameter got a gradient"
        err, name = out["err"]
        assert err <= 1e-5, f"rank {rank}: {name} differs by {err:.2e}"
        assert out["partial_err"] <= 1e-5, f"rank {rank}: locally unused parameter: {out['partial_err']:.2e}"


# ---------------------------------------------------------------------- gradient-accumulation fusion
def body_fused_writes(rank, world, tie, autocast=None):
    """The GPT's embedding / LM head write their weight gradients into the buffer (fused_grads.py): same
    averaged gradients as through autograd, over two steps with a no_sync micro-batch; the writes happen.
    ``autocast``: the forwards run under ``torch.autocast("cpu", autocast)`` over the fp32 weights."""
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**dict(SMALL, tie_embeddings=tie))
    per, half = BATCH // world, BATCH // world // 2
    lo = rank * per
    grads, writes = {}, {}
    for fuse in (True, False):
        torch.manual_seed(0)
        ddp = DataParallel(GPT(cfg), group, fuse_grad_accumulation=fuse, **CAPS)
        calls = []
        original = ddp.write_grad
        ddp.write_grad = lambda p, write, original=original: (calls.append(ddp.param_name(p)), original(p, write))
        out = []
        for idx, tgt in _batches(2, cfg):
            ddp.zero_grad()
            with ddp.no_sync(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                (0.5 * ddp(idx[lo:lo + half], tgt[lo:lo + half])[1]).backward()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                (0.5 * ddp(idx[lo + half:lo + per], tgt[lo + half:lo + per])[1]).backward()
            out.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
        grads[fuse], writes[fuse] = out, calls
    err = worst((_rel_norm(a[n], b[n]), n) for a, b in zip(grads[True], grads[False]) for n in a)
    bf16 = DataParallel(GPT(cfg).to(torch.bfloat16), group)
    copied = copy.deepcopy(ddp.module)            # e.g. an EMA copy: plain autograd, its own .grad
    copied(idx, tgt)[1].backward()
    copy_plain = grad_sink(copied.wte.weight) is None and copied.wte.weight.grad is not None
    return err, writes, grad_sink(bf16.module.wte.weight), copy_plain


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_fused_gradient_writes_match_autograd(dist_pools, tie, autocast):
    """Also under bf16 autocast over fp32 weights: the fused backward casts as autograd's cast nodes do
    (it used to multiply a bf16 output gradient by the fp32 weight and fail)."""
    for rank, (err, writes, bf16_sink, copy_plain) in enumerate(dist_pools(2).run(body_fused_writes, tie,
                                                                                  autocast)):
        heads = ["wte.weight", "wte.weight"] if tie else ["lm_head.weight", "wte.weight"]
        # per backward: the head's GEMM, then the embedding's rows; 2 steps x 2 micro-batches
        assert writes[True] == heads * 4 and writes[False] == [], f"rank {rank}: writes {writes}"
        assert err[0] <= 1e-6, f"rank {rank}: fused gradient of {err[1]} differs by {err[0]:.2e}"
        assert bf16_sink is None, f"rank {rank}: bf16 parameters cannot take fp32 GEMM writes"
        assert copy_plain, f"rank {rank}: a deep copy of the wrapped model still wrote into the buffer"


# ---------------------------------------------------------------------- zero_grad(set_to_none=True): stale slices
def body_stale_slices(rank, world):
    """zero_grad() leaves the buffer as it was (each first gradient is written over its slice, times 1/world);
    the buffer is poisoned with NaN first, so any stale value that reaches a gradient shows. Paths: a
    parameter unused on one rank, a no_sync micro-batch without it, a user-assigned .grad among landed ones
    in the same bucket, and sync_gradients() with no backward at all."""
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    idx, tgt = _batches(1, cfg)[0]
    per, half = BATCH // world, BATCH // world // 2
    lo = rank * per
    torch.manual_seed(0)
    dense = WithExtra(cfg)
    torch.manual_seed(0)
    ddp = DataParallel(WithExtra(cfg), group, find_unused_parameters=True, first_bucket_cap_mb=1.0)
    assert len(ddp.buffer.buckets) == 1          # one bucket: landed and added gradients share it

    def poison_and_clear():
        ddp.buffer.grad_buffer.fill_(float("nan"))
        ddp.zero_grad()

    def dense_grads(*parts):       # parts: (slice of the batch, use_extra, weight)
        dense.zero_grad()
        for sl, use, w in parts:
            (w * dense(idx[sl], tgt[sl], use_extra=use)).backward()
        return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in dense.named_parameters()}

    def worst_grad(ref):
        got = {n: p.main_grad for n, p in ddp.module.named_parameters()}
        return worst((_rel_norm(got[n], r) if r.norm() > 0 else got[n].abs().max().item(), n) for n, r in ref.items())

    out = {}
    # 1. synced backward; the extra layer is used on rank 1 only (zeros on rank 0 count, scaled by 1/world)
    poison_and_clear()
    assert all(p.grad is None for p in ddp.module.parameters())
    ddp(idx[lo:lo + per], tgt[lo:lo + per], use_extra=rank == 1).backward()
    ref = dense_grads(*[(slice(r * per, (r + 1) * per), r == 1, 1.0 / world) for r in range(world)])
    out["unused_on_one_rank"] = worst_grad(ref)
    # 2. no_sync micro-batch without the extra layer, then a synced one with it
    poison_and_clear()
    with ddp.no_sync():
        (0.5 * ddp(idx[lo:lo + half], tgt[lo:lo + half])).backward()
    out["no_sync_extra_zeros"] = bool((ddp.module.extra.weight.main_grad == 0).all())
    (0.5 * ddp(idx[lo + half:lo + per], tgt[lo + half:lo + per], use_extra=True)).backward()
    parts = []
    for r in range(world):
        parts += [(slice(r * per, r * per + half), False, 0.5 / world),
                  (slice(r * per + half, (r + 1) * per), True, 0.5 / world)]
    out["no_sync_then_sync"] = worst_grad(dense_grads(*parts))
    # 3. a user-assigned .grad (added to, scaled at launch) beside landed gradients (scaled when written)
    poison_and_clear()
    head = ddp.module.gpt.blocks[-1].mlp.fc2.weight
    head.grad = torch.ones_like(head)
    ddp(idx[lo:lo + per], tgt[lo:lo + per]).backward()
    ref = dense_grads(*[(slice(r * per, (r + 1) * per), False, 1.0 / world) for r in range(world)])
    ref["gpt.blocks.1.mlp.fc2.weight"] += 1.0
    out["user_grad_mixed_bucket"] = worst_grad(ref)
    # 4. sync_gradients() right after zero_grad(): every gradient is zero
    poison_and_clear()
    ddp.sync_gradients()
    out["sync_without_backward_zero"] = bool((ddp.buffer.grad_buffer == 0).all())
    return out


def test_zero_grad_leaves_no_stale_value_in_any_path(dist_pools):
    for rank, out in enumerate(dist_pools(2).run(body_stale_slices)):
        assert out["no_sync_extra_zeros"], f"rank {rank}: a no_sync backward left a stale slice in main_grad"
        assert out["sync_without_backward_zero"], f"rank {rank}: sync_gradients reduced stale values"
        for key in ("unused_on_one_rank", "no_sync_then_sync", "user_grad_mixed_bucket"):
            err, name = out[key]
            assert err <= 1e-5, f"rank {rank} ({key}): gradient of {name} is off by {err:.2e}"


# ---------------------------------------------------------------------- bf16 communication
def body_bf16_bound(rank, world):
    """Per element: pack rounds g_r / w to bf16 (rel. error <= u = 2^-8), then (w - 1) bf16 additions each round
    a partial sum bounded by S = sum_r |g_r| / w (error <= u S each); unpack to fp32 is exact. Bound: w u S."""
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    idx, tgt = _batches(1, cfg)[0]
    per = BATCH // world
    mine = (idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
    got = {}
    for comm in (None, torch.bfloat16):
        torch.manual_seed(0)
        ddp = DataParallel(GPT(cfg), group, comm_dtype=comm, **CAPS)
        ddp(*mine)[1].backward()
        got[comm] = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
    torch.manual_seed(0)
    local = GPT(cfg)
    local(*mine)[1].backward()
    ratios = []
    for n, p in local.named_parameters():
        s = p.grad.abs() / world
        dist.all_reduce(s, group=group)
        bound = world * 2.0 ** -8 * s * 1.001 + 1e-30
        ratios.append(((got[torch.bfloat16][n] - got[None][n]).abs() / bound).max().item())
    return worst(ratios)


def test_bf16_communication_within_rounding_bound(dist_pools):
    for rank, ratio in enumerate(dist_pools(2).run(body_bf16_bound)):
        assert ratio <= 1.0, f"rank {rank}: bf16-communicated gradient exceeds the bound by {ratio:.2f}x"


# ---------------------------------------------------------------------- wrap-time broadcast, buffer layout
class WithBuffer(nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.register_buffer("stat", torch.full((4,), float(rank)))
        with torch.no_grad():
            self.lin.weight.fill_(rank)


def body_broadcast(rank, world):
    group = cached_mesh(dp=world).dp_group
    ddp = DataParallel(WithBuffer(rank), group)
    return ddp.module.lin.weight.detach().clone(), ddp.module.stat.clone()


def test_params_and_buffers_broadcast_at_wrap(dist_pools):
    for rank, (w, stat) in enumerate(dist_pools(2).run(body_broadcast)):
        assert torch.equal(w, torch.zeros(3, 5)) and torch.equal(stat, torch.zeros(4)), f"rank {rank}"


def test_buffer_layout_single_process():
    ps = [nn.Parameter(torch.randn(300, 100)) for _ in range(4)] + [nn.Parameter(torch.randn(7))]
    vals = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(ps, None, bucket_cap_mb=0.2, first_bucket_cap_mb=0.1, pad_to_multiple=64)
    assert [list(map(id, b.params)) for b in buf.buckets][0] == [id(ps[4]), id(ps[3])]   # reversed, small first
    assert all(b.numel % 64 == 0 for b in buf.buckets)
    assert all(torch.equal(p, v) for p, v in zip(ps, vals))
    # Shards: dp=4 view of the same bucket arithmetic; overlaps tile each shard's parameter part.
    b = buf.buckets[1]
    b.dp_size, b.shard_numel = 4, b.numel // 4
    covered = sum(n for r in range(4) for _, _, _, n in b.param_shard_overlaps(r))
    assert covered == sum(p.numel() for p in b.params)
    for p in ps:
        b, off = buf.bucket_of(p)
        assert p.data_ptr() == b.param_data[off:].data_ptr()
        assert p.main_grad.data_ptr() == b.grad_data[off:].data_ptr()
    buf.rebuild(ps[:2])
    flat = [id(p) for b in buf.buckets for p in b.params]
    assert flat == [id(p) for p in ps[:2] + [ps[4], ps[3], ps[2]]]    # given order first, the rest as before
    assert all(torch.equal(p, v) for p, v in zip(ps, vals))


def body_reduce_scatter(rank, world, rebuild):
    """ZeRO's path: each rank's shard of every bucket equals the same elements of the all-reduced gradient.

    With ``rebuild``, the first backward re-lays the buckets out in arrival order BEFORE reducing (a
    reduce-scatter cannot be re-laid out afterwards: each rank holds only its own shard averaged), so it
    launches nothing early; the second backward reduces in the new layout with overlap again."""
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    per = BATCH // world
    ref = {}
    torch.manual_seed(0)
    ar = DataParallel(GPT(cfg), group, reduce_op="all_reduce", rebuild_bucket_order=False, **CAPS)
    torch.manual_seed(0)
    rs = DataParallel(GPT(cfg), group, reduce_op="reduce_scatter", rebuild_bucket_order=rebuild, **CAPS)
    out = dict(versions=[], early=[])
    errs, shard_errs = [], []
    for idx, tgt in _batches(2, cfg):
        for m in (ar, rs):
            m.zero_grad()
            m(idx[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])[1].backward()
        ref = {id(q): p.grad for p, q in zip(ar.module.parameters(), rs.module.parameters())}
        for b in rs.buffer.buckets:
            shard = rs.bucket_grad_shard(b)
            s0, s1 = b.shard_range(rank)
            shard_errs.append((shard - b.grad_data[s0:s1]).abs().max().item())
            for p, start_p, start_s, n in b.param_shard_overlaps(rank):
                want = ref[id(p)].reshape(-1)[start_p:start_p + n]
                errs.append((shard[start_s:start_s + n] - want).abs().max().item())
        out["versions"].append(rs.layout_version)
        out["early"].append(overlap_report(rs.last_sync_timeline)["launched_before_backward_end"])
    out["err"], out["shard_err"] = worst(errs), worst(shard_errs)
    out["layout"] = [name for bucket in rs.bucket_names for name in bucket]
    out["arrival"] = rs.last_sync_timeline["arrival"]
    return out


@pytest.mark.parametrize("rebuild", [False, True], ids=["fixed", "rebuild"])
def test_reduce_scatter_shards_match_all_reduce(dist_pools, rebuild):
    for rank, out in enumerate(dist_pools(2).run(body_reduce_scatter, rebuild)):
        assert out["err"] <= 1e-7, f"rank {rank}: reduce-scattered shard differs by {out['err']:.2e}"
        assert out["shard_err"] == 0.0, f"rank {rank}: grad_shard and grad_data's shard disagree"
        if rebuild:
            assert out["versions"] == [1, 1], out["versions"]
            assert out["layout"] == out["arrival"]
            assert out["early"][0] == 0 and out["early"][1] >= 1, out["early"]
        else:
            assert out["versions"] == [0, 0] and all(e >= 1 for e in out["early"]), out


def body_frozen_broadcast(rank, world):
    """Replicas built from different seeds, with a frozen embedding and a buffer: after wrapping, every
    rank holds rank 0's values of all of them, and training leaves the frozen weight untouched."""
    group = cached_mesh(dp=world).dp_group
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(rank)
    model = GPT(cfg)
    model.wpe.weight.requires_grad_(False)
    model.register_buffer("counter", torch.full((3,), float(rank)))
    ddp = DataParallel(model, group, **CAPS)
    gathered = [torch.empty_like(model.wpe.weight) for _ in range(world)]
    dist.all_gather(gathered, model.wpe.weight.detach(), group=group)
    frozen_before = model.wpe.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    idx, tgt = _batches(1, cfg)[0]
    ddp(idx, tgt)[1].backward()
    opt.step()
    return (all(torch.equal(g, gathered[0]) for g in gathered), model.counter.tolist(),
            torch.equal(model.wpe.weight, frozen_before))


def test_frozen_parameters_and_buffers_are_broadcast(dist_pools):
    for rank, (same, counter, untouched) in enumerate(dist_pools(2).run(body_frozen_broadcast)):
        assert same, f"rank {rank}: the frozen embedding differs between replicas"
        assert counter == [0.0, 0.0, 0.0], (rank, counter)
        assert untouched, rank
