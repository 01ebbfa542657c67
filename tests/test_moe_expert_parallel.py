"""Expert parallelism (parallel_layers/moe/expert_parallel.py) against the one-process MoELayer on real gloo
ranks: the parity principle.

Every rank builds the same seeded MoELayer and runs it on the whole batch (loss: a fixed random projection of
the outputs summed over the batch, plus the aux loss); the ExpertParallelMoE copied from it runs on the rank's
own slice of the batch (the same loss over its tokens, plus its aux loss, whose value is the whole batch's).
The outputs and input gradients of the rank's tokens, the aux and z losses, the replicated (router, shared
expert) gradients summed over ep, and the rank's expert gradients must equal the one-process ones: 1e-6
(relative to the largest value compared, or absolute below 1) in fp32, 1e-12 in float64, except the losses'
values, which are computed in fp32 whatever the layer's dtype (1e-6), and float64 under sigmoid scoring (1e-6):
the router scores in fp32, and torch's fp32 sigmoid rounds an element differently (by an ulp) in the vectorised
body of a tensor and in its tail, so the one-process layer's own routing weights for a token depend on where
the token sits in the batch: on a rank's slice alone it differs from itself on the whole batch as much (5e-8
measured). Softmax is computed row by row, the same for a row in any batch."""
import pytest
import torch

from parallel_layers.distributed import collectives as C
from parallel_layers.moe import ExpertParallelMoE, MoELayer
from parallel_layers.testing import cached_mesh

H, INTER, K = 16, 12, 2
TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
LOSS_TOL = 1e-6                      # the router's losses are fp32 values in every dtype
SIGMOID_F64_TOL = 1e-6               # fp32 sigmoid scores: see the module docstring
BF16_TOL = 1e-2                      # ep 2 against the one-process bf16 layer, relative (measured: see the test)
SHARED = ("shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight")


def _group(world):
    """The ep group: every rank of the pool, each holding different tokens (as data-parallel ranks do)."""
    return cached_mesh(dp=world).dp_group


# case -> (experts per rank, MoELayer options, expert_bias as a function of E or None, token split)
CASES = {
    # Mixtral-like softmax top-2, [batch, seq, H] input split by batch rows
    "softmax": (2, dict(aux_loss_coef=0.02), None, "batch"),
    # softmax without renormalisation, aux and z losses, a gated shared expert; one expert per rank (no re-order)
    "softmax-one-expert-per-rank": (1, dict(norm_topk_prob=False, aux_loss_coef=0.02, z_loss_coef=1e-3,
                                            num_shared_experts=1, shared_expert_gate=True), None, "uneven"),
    # DeepSeek-V3-like: sigmoid, a balancing bias, scaled weights, two shared experts
    "sigmoid-shared": (2, dict(scoring="sigmoid", routed_scaling_factor=2.5, aux_loss_coef=0.02, z_loss_coef=1e-3,
                               num_shared_experts=2),
                       lambda E: torch.linspace(-0.3, 0.3, E), "uneven"),
    # skewed: expert 0 chosen by every token, the last by none; a rank with no tokens at all
    "skewed": (2, dict(scoring="sigmoid", aux_loss_coef=0.02),
               lambda E: torch.cat([torch.tensor([5.0]), torch.zeros(E - 2), torch.tensor([-100.0])]), "empty"),
    # every token to rank 0's two experts: the other ranks receive no row, every rank sends none to them
    "one-rank-busy": (2, dict(scoring="sigmoid", aux_loss_coef=0.02, num_shared_experts=1),
                      lambda E: torch.cat([torch.full((2,), 5.0), torch.full((E - 2,), -100.0)]), "uneven"),
}


def _split(world, kind):
    """Tokens per rank, and the global input's shape."""
    if kind == "batch":
        return [10] * world, (2 * world, 5, H)
    sizes = {"uneven": [7, 3, 11, 5], "empty": [9, 0, 6, 13]}[kind][:world]
    return sizes, (sum(sizes), H)


def _rel(a, b):
    """Largest difference of ``a`` and ``b``, relative to the largest magnitude of ``b`` when above 1."""
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    if not a.numel():
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1)).item()


def _run_both(rank, world, case, dtype, group):
    """The one-process layer on the whole batch and its expert-parallel copy on this rank's slice, forward
    and backward; returns (dense, ep layer, x, y, local x, local y, this rank's token range)."""
    local, options, bias, kind = CASES[case]
    E = local * world
    torch.manual_seed(5)
    dense = MoELayer(H, INTER, E, K, dtype=dtype, **options)
    if bias is not None:
        dense.router.expert_bias.copy_(bias(E))
    ep = ExpertParallelMoE.from_dense(dense, group)
    sizes, shape = _split(world, kind)
    gen = torch.Generator().manual_seed(7)
    x_all = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    proj = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    x = x_all.clone().requires_grad_()
    y = dense(x)
    ((y * proj).sum() + dense.aux_loss).backward()
    if kind == "batch":
        lo, hi = 2 * rank, 2 * rank + 2
    else:
        lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    xl = x_all[lo:hi].clone().requires_grad_()
    yl = ep(xl)
    ((yl * proj[lo:hi]).sum() + ep.aux_loss).backward()
    return dense, ep, x, y, xl, yl, (lo, hi)


def body_parity(rank, world, dtype):
    group = _group(world)
    out = {}
    for case in CASES:
        dense, ep, x, y, xl, yl, (lo, hi) = _run_both(rank, world, case, dtype, group)
        d = {"out": _rel(yl, y[lo:hi]), "x.grad": _rel(xl.grad, x.grad[lo:hi])}
        losses = {"aux_loss": (ep.aux_loss, dense.aux_loss), "z_loss": (ep.stats["z_loss"], dense.stats["z_loss"])}
        for what, (mine, ref) in losses.items():
            if ref is not None:
                d[what] = abs(mine.item() - ref.item()) / max(1.0, abs(ref.item()))
        dense_params = dict(dense.named_parameters())
        for name, p in ep.named_parameters():
            ref = dense_params[name].grad
            if name.startswith("experts."):                # this rank's slice of the experts
                e0 = ep.first_expert
                d[f"{name}.grad"] = _rel(p.grad, ref[e0:e0 + ep.num_local_experts])
            else:                                          # replicated: this rank's part, summed over ep
                total = p.grad.clone()
                C.all_reduce(total, group)
                d[f"{name}.grad (sum over ep)"] = _rel(total, ref)
        for name, full in ep.dense_expert_grads().items():
            d[f"{name}.grad gathered"] = _rel(full, dense_params[name].grad)
        counts = ep.stats["counts"].clone()
        C.all_reduce(counts, group)
        e0 = ep.first_expert
        facts = {"counts": torch.equal(counts, dense.stats["counts"]),
                 "received": torch.equal(ep.stats["received"], dense.stats["counts"][e0:e0 + ep.num_local_experts]),
                 "idle experts": int((dense.stats["counts"] == 0).sum()),
                 "peers sent no row": [j for j, n in enumerate(ep.stats["counts"].view(world, -1).sum(1).tolist())
                                       if n == 0 and j != rank],
                 "tokens": hi - lo}
        out[case] = (d, facts)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("world", [2, 4], ids=["ep2", "ep4"])
def test_expert_parallel_matches_one_process(dist_pools, world, dtype):
    per_rank = dist_pools(world).run(body_parity, dtype)
    for rank, cases in enumerate(per_rank):
        for case, (diffs, facts) in cases.items():
            for what, value in diffs.items():
                sigmoid = CASES[case][1].get("scoring") == "sigmoid"
                tol = LOSS_TOL if what in ("aux_loss", "z_loss") else TOL[dtype]
                tol = max(tol, SIGMOID_F64_TOL) if sigmoid else tol
                assert value <= tol, f"rank {rank}, {case}: {what} differs by {value:.3g} (tolerance {tol})"
            assert facts["counts"] and facts["received"], (rank, case, facts)
            if case == "skewed":
                assert facts["idle experts"] >= 1, facts
                assert (facts["tokens"] == 0) == (rank == 1), facts
            if case == "one-rank-busy":
                assert facts["idle experts"] == 2 * world - 2, facts
                assert facts["peers sent no row"] == [j for j in range(1, world) if j != rank], facts


# ---------------------------------------------------------------------- bf16
def body_bf16(rank, world):
    group = _group(world)
    out = {}
    for case in ("softmax", "sigmoid-shared"):
        dense, ep, x, y, xl, yl, (lo, hi) = _run_both(rank, world, case, torch.bfloat16, group)
        with torch.no_grad():
            exact = dense.double()(x.detach().double())[lo:hi]      # how far bf16 itself is from the exact value
        router = ep.router.weight.grad.float()
        C.all_reduce(router, group)
        e0, n = ep.first_expert, ep.num_local_experts
        out[case] = {"out": _rel(yl, y[lo:hi]), "x.grad": _rel(xl.grad, x.grad[lo:hi]),
                     "router.weight.grad (sum over ep)": _rel(router, dense.router.weight.grad.float()),
                     "experts.down_proj.grad": _rel(ep.experts.down_proj.grad,
                                                    dense.experts.down_proj.grad[e0:e0 + n]),
                     "aux_loss": abs(ep.aux_loss.item() - dense.aux_loss.item()),
                     "bf16 rounding of out": _rel(y[lo:hi], exact)}
    return out


def test_expert_parallel_bf16_matches_one_process_bf16(dist_pools):
    """bf16 at ep 2 against the one-process bf16 layer: within BF16_TOL (1e-2 relative, between 2 and 3 bf16
    ulps). Measured: outputs, input and expert gradients 0 (the experts see the one-process rows in the
    one-process order); the router's gradient summed over the ranks 3e-3 (each rank's part rounded to bf16,
    then added, against one rounding of the whole sum); the aux loss 1.2e-6 (fp32). The outputs must also be
    no further from the bf16 layer than bf16 itself is from float64 (2e-3 to 6e-3)."""
    for rank, cases in enumerate(dist_pools(2).run(body_bf16)):
        for case, d in cases.items():
            for what, value in d.items():
                if what != "bf16 rounding of out":
                    assert value <= BF16_TOL, f"rank {rank}, {case}: {what} differs by {value:.3g}"
            assert d["out"] <= d["bf16 rounding of out"], (rank, case, d)


# ---------------------------------------------------------------------- one SGD step
def body_sgd_step(rank, world):
    group = _group(world)
    dense, ep, *_ = _run_both(rank, world, "sigmoid-shared", torch.float32, group)
    replicated = ep.replicated_parameters()
    names = [n for n, p in ep.named_parameters() if any(p is q for q in replicated)]
    local = torch.cat([p.grad.reshape(-1) for p in replicated])
    gathered = C.all_gather_dim0(local.unsqueeze(0), group)
    differed = not all(torch.equal(gathered[0], g) for g in gathered[1:])   # each rank's part differs
    for p in replicated:
        C.all_reduce(p.grad, group)
    torch.optim.SGD(ep.parameters(), lr=0.1).step()
    torch.optim.SGD(dense.parameters(), lr=0.1).step()
    counts = ep.stats["counts"].clone()
    C.all_reduce(counts, group)
    ep.router.update_bias(counts, 1e-3)                    # the balancing bias moves alike everywhere too
    state = torch.cat([p.detach().reshape(-1) for p in replicated] + [ep.router.expert_bias])
    every = C.all_gather_dim0(state.unsqueeze(0), group)
    identical = [all(torch.equal(every[0], e) for e in every[1:])]
    dense_params = dict(dense.named_parameters())
    after = max(_rel(p.detach(), dense_params[n].detach()) for n, p in zip(names, replicated))
    experts = ep.dense_expert_weights()
    after = max([after] + [_rel(experts[n], dense_params[n].detach()) for n in experts])
    return {"names": names, "differed before": differed, "identical after": identical[0], "vs dense": after}


def test_replicated_parameters_stay_bit_identical_after_a_step(dist_pools):
    for rank, r in enumerate(dist_pools(4).run(body_sgd_step)):
        assert set(r["names"]) == {"router.weight", *SHARED}, r["names"]
        assert r["differed before"], "the ranks' replicated gradients should differ before the all-reduce"
        assert r["identical after"], f"rank {rank}: replicated parameters differ across ranks after the step"
        assert r["vs dense"] <= 1e-6, f"rank {rank}: the step differs from the one-process step by {r['vs dense']}"


# ---------------------------------------------------------------------- construction, capacity, errors
def body_construct(rank, world):
    group = _group(world)
    out = {}
    torch.manual_seed(3)
    dense = MoELayer(H, INTER, 4, K, num_shared_experts=1)
    torch.manual_seed(3)
    ep = ExpertParallelMoE(H, INTER, 4, K, ep_group=group, num_shared_experts=1)
    full = ep.dense_expert_weights()
    mine = dict(ep.state_dict())
    out["seeded like MoELayer"] = all(
        torch.equal(full[k] if k in full else mine[k], v) for k, v in dense.state_dict().items())
    out["expert slice"] = tuple(ep.experts.gate_proj.shape)

    torch.manual_seed(3)             # capacity: applied to each rank's own tokens, as one process does
    dense = MoELayer(H, INTER, 4, K, capacity_factor=0.6, dtype=torch.float64)
    ep = ExpertParallelMoE.from_dense(dense, group)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    y = ep(x)
    out["capacity"] = (_rel(y, dense(x)), int(ep.stats["dropped"]), int(dense.stats["dropped"]))

    errors = []
    for make in (lambda: ExpertParallelMoE(H, INTER, 3, K, ep_group=group),
                 lambda: ExpertParallelMoE.from_dense(MoELayer(H, INTER, 5, K), group),
                 lambda: ExpertParallelMoE(H, INTER, 4, K, ep_group=None),
                 lambda: ExpertParallelMoE(H, INTER, 4, K, ep_group=group, aux_loss_group="dp")):
        try:
            make()
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def test_construction_capacity_and_errors(dist_pools):
    for r in dist_pools(2).run(body_construct):
        assert r["seeded like MoELayer"], "the seeded constructor must draw the one-process layer's parameters"
        assert r["expert slice"] == (2, INTER, H)
        diff, dropped, dense_dropped = r["capacity"]
        assert diff <= 1e-12 and dropped == dense_dropped > 0, r["capacity"]
        not_divisible, from_dense, no_group, bad_aux = r["errors"]
        assert not_divisible and (
            "ExpertParallelMoE: num_experts=3 does not divide by the expert-parallel size 2" in not_divisible
            and "a multiple of 2 (e.g. 2 or 4)" in not_divisible and "divides 3 (e.g. 1, 3)" in not_divisible
        ), not_divisible
        assert from_dense and "num_experts=5 does not divide by the expert-parallel size 2" in from_dense, from_dense
        assert no_group and "ExpertParallelMoE: ep_group is required" in no_group, no_group
        assert bad_aux and "aux_loss_group='dp' must be 'ep'" in bad_aux, bad_aux
