"""The fused Mixture-of-Experts kernels (router top-k, permute/unpermute, grouped product) on every backend
against their torch references.

Bit-identical: the permutation (order, counts, rows), unpermute's output and both its gradients, and permute's
gradient in fp32. Within tolerance: the router's weights (the kernels' own exp and row sums: rtol 1e-6,
atol 1e-7; the choice and counts are identical), permute's gradient in bf16 (fp32 accumulation, one
rounding, where the reference's index_add_ rounds after each add) and the Triton grouped product (fp32,
tile-order sums: atol = rtol = 1e-5).
"""
import pytest
import torch
from conftest import target_skip_reason

from parallel_layers.moe import grouped_mm_reference
from parallel_layers.moe.experts import grouped_mm as experts_grouped_mm
from parallel_layers.ops import moe_permute, moe_routing
from parallel_layers.ops.grouped_mm import grouped_mm

MOE_TARGETS = [("cpu", "cpp"), ("cpu", "triton"), ("cuda", "triton")]
ROUTER_TOL = dict(rtol=1e-6, atol=1e-7)
MM_TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(params=MOE_TARGETS, ids=[f"{d}-{b}" for d, b in MOE_TARGETS])
def target(request):
    device, backend = request.param
    why = target_skip_reason(device, backend)
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device), backend


def bits_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# ---------------------------------------------------------------------- router top-k
@pytest.mark.parametrize("scoring,norm,top_k,dtype", [
    ("softmax", True, 2, torch.float32), ("softmax", False, 1, torch.float32), ("softmax", True, 6, torch.bfloat16),
    ("sigmoid", True, 2, torch.float32), ("sigmoid", False, 3, torch.float16)])
def test_router_topk_matches_the_reference(target, scoring, norm, top_k, dtype):
    device, backend = target
    g = torch.Generator().manual_seed(top_k)
    logits = (torch.randn(13, 6, generator=g) * 2).to(dtype).to(device).requires_grad_()
    bias = torch.tensor([0.5, 0.0, -0.3, 0.2, 0.0, 0.4], device=device) if scoring == "sigmoid" else None
    scale = 2.5 if scoring == "sigmoid" else 1.0
    args = (top_k, scoring, norm, bias, scale)
    w, e, c = moe_routing.router_topk(logits, *args, backend=backend)
    ref_in = logits.detach().clone().requires_grad_()
    rw, re, rc = moe_routing.reference_router_topk(ref_in, *args)
    assert bits_equal(e, re) and bits_equal(c, rc) and w.dtype == torch.float32
    torch.testing.assert_close(w, rw, **ROUTER_TOL)
    gw = torch.randn(w.shape, generator=g).to(device)
    (grad,) = torch.autograd.grad(w, logits, gw)
    (ref_grad,) = torch.autograd.grad(rw, ref_in, gw)
    assert grad.dtype == dtype and ref_grad.abs().max() > 0
    torch.testing.assert_close(grad.float(), ref_grad.float(), **ROUTER_TOL)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_router_backward_formula_is_autograds_bit_for_bit(scoring, norm, scale):
    """The fused router's backward (ATen's backward formulas, called without building a graph) gives the bits
    autograd gives through the reference's weight formula for the same choice."""
    g = torch.Generator().manual_seed(3)
    for _ in range(10):
        logits = torch.randn(37, 8, generator=g) * 3
        experts = torch.topk(torch.rand(37, 8, generator=g), 3, dim=-1).indices
        grad = torch.randn(37, 3, generator=g)
        x = logits.clone().requires_grad_()
        (want,) = torch.autograd.grad(moe_routing.chosen_weights(x, experts, scoring, norm, scale), x, grad)
        got = moe_routing.chosen_weights_backward(grad, logits, experts, scoring, norm, scale)
        assert bits_equal(got, want)


def test_router_topk_ties(target):
    """Equal scores: the C++ kernel picks what torch.topk picks on CPU (its own algorithm); Triton takes the
    lower index first."""
    device, backend = target
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (40, 8), generator=g).float().to(device)
    w, e, c = moe_routing.router_topk(logits, 3, backend=backend)
    if backend == "cpp":
        assert bits_equal(e, moe_routing.reference_router_topk(logits, 3)[1])
    else:
        key = -logits.double() * 64 + torch.arange(8, device=device)
        assert bits_equal(e, torch.sort(key, dim=-1, stable=True).indices[:, :3])
    assert bits_equal(c, torch.bincount(e.reshape(-1), minlength=8))


def test_router_topk_edges_and_errors(target):
    device, backend = target
    empty = torch.zeros(0, 4, device=device)
    w, e, c = moe_routing.router_topk(empty, 2, backend=backend)
    assert w.shape == (0, 2) and e.shape == (0, 2) and c.tolist() == [0, 0, 0, 0]
    one = torch.zeros(5, 4, device=device)
    one[:, 2] = 9.0                                            # every token to expert 2
    assert moe_routing.router_topk(one, 1, backend=backend)[2].tolist() == [0, 0, 5, 0]
    with pytest.raises(ValueError, match=r"router_topk: top_k=5 must be an integer in \[1, num_experts=4\].*"
                                         r"top_k <= 4"):
        moe_routing.router_topk(one, 5, backend=backend)
    with pytest.raises(ValueError, match=r"router_topk: logits must be \[tokens, num_experts\]; got \(2, 5, 4\)"):
        moe_routing.router_topk(one.view(1, 5, 4).expand(2, 5, 4), 1, backend=backend)
    with pytest.raises(ValueError, match=r"router_topk: expert_bias must be \[num_experts\]=\[4\]; got \(3,\)"):
        moe_routing.router_topk(one, 1, "sigmoid", expert_bias=torch.zeros(3, device=device), backend=backend)


# ---------------------------------------------------------------------- permute / unpermute
def _experts(tokens, top_k, num_experts, dropped, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    e = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    if dropped and tokens:
        e.view(-1)[torch.randperm(e.numel(), generator=g)[:max(1, e.numel() // 5)]] = -1
    return e.to(device)


CASES = {                       # tokens, top_k, experts, dropped slots
    "k2-dropped": (11, 2, 5, True),
    "k3": (9, 3, 6, False),
    "topk=E": (7, 4, 4, True),
    "no-tokens": (0, 2, 4, False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_and_unpermute_match_the_reference(target, case, dtype):
    device, backend = target
    tokens, top_k, num_experts, dropped = CASES[case]
    experts = _experts(tokens, top_k, num_experts, dropped, device=device)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, 33, generator=g).to(dtype).to(device).requires_grad_()
    ref_hidden = hidden.detach().clone().requires_grad_()
    permuted, order, counts = moe_permute.permute_tokens(hidden, experts, num_experts, backend=backend)
    n_kept = int((experts >= 0).sum())
    r_permuted, r_order, r_counts = moe_permute.reference_permute(ref_hidden, experts, num_experts, n_kept)
    assert bits_equal(order, r_order) and bits_equal(counts, r_counts) and bits_equal(permuted, r_permuted)

    gp = torch.randn(permuted.shape, generator=g).to(dtype).to(device)
    (grad,) = torch.autograd.grad(permuted, hidden, gp)
    (ref_grad,) = torch.autograd.grad(r_permuted, ref_hidden, gp)
    # the kernel's contract: a float32 sum in ascending position order, rounded once; the CPU's index_add_ adds
    # in that order (CUDA's adds with atomics, in no fixed order: the reference's grad is a rounding apart there)
    exact = torch.zeros(tokens, 33).index_add_(0, (order // top_k).cpu(), gp.float().cpu()).to(dtype)
    assert bits_equal(grad.cpu(), exact)
    if dtype == torch.float32 and device == "cpu":
        assert bits_equal(grad, ref_grad)
    else:                                                      # fp32 accumulation vs index_add_ in bf16
        torch.testing.assert_close(grad, ref_grad, atol=2e-2, rtol=2e-2)

    expert_out = torch.randn(permuted.shape, generator=g).to(dtype).to(device).requires_grad_()
    weights = torch.rand(tokens, top_k, generator=g).to(dtype).to(device).requires_grad_()
    out = moe_permute.unpermute_tokens(expert_out, order, weights, tokens, backend=backend)
    ref_in = [expert_out.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()]
    ref = moe_permute.reference_unpermute(ref_in[0], order, ref_in[1], tokens)
    assert bits_equal(out, ref)
    go = torch.randn(out.shape, generator=g).to(dtype).to(device)
    if tokens:
        grads = torch.autograd.grad(out, (expert_out, weights), go)
        ref_grads = torch.autograd.grad(ref, ref_in, go)
        for a, b in zip(grads, ref_grads):
            assert bits_equal(a, b)


def test_all_tokens_to_one_expert(target):
    device, backend = target
    experts = torch.full((6, 2), -1, dtype=torch.int64, device=device)
    experts[:, 0] = 3
    hidden = torch.arange(12.0, device=device).view(6, 2)
    permuted, order, counts = moe_permute.permute_tokens(hidden, experts, 4, backend=backend)
    assert counts.tolist() == [0, 0, 0, 6] and order.tolist() == [0, 2, 4, 6, 8, 10]
    assert bits_equal(permuted, hidden)
    out = moe_permute.unpermute_tokens(permuted, order, torch.full((6, 2), 0.5, device=device), 6, backend=backend)
    assert bits_equal(out, hidden * 0.5)


def test_permute_errors_name_the_op_the_sizes_and_the_fix(target):
    device, backend = target
    hidden = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match=r"permute: experts holds index 4 but there are num_experts=4"):
        moe_permute.permute_tokens(hidden, torch.tensor([[0, 4], [1, 2], [3, 0]], device=device), 4, backend=backend)
    with pytest.raises(ValueError, match=r"permute: hidden must be \[T, H\] and experts \[T, k\] with the same T; "
                                         r"got hidden \(3, 8\) and experts \(2, 2\)"):
        moe_permute.permute_tokens(hidden, torch.zeros(2, 2, dtype=torch.int64, device=device), 4, backend=backend)
    with pytest.raises(ValueError, match=r"permute: experts must be int64.*convert"):
        moe_permute.permute_tokens(hidden, torch.zeros(3, 2, dtype=torch.int32, device=device), 4, backend=backend)
    order = torch.arange(4, device=device)
    with pytest.raises(ValueError, match=r"unpermute: weights must be \[num_tokens, k\] = \[3, k\]; got \(2, 2\)"):
        moe_permute.unpermute_tokens(torch.randn(4, 8, device=device), order, torch.ones(2, 2, device=device), 3,
                                     backend=backend)
    with pytest.raises(ValueError, match=r"unpermute: expert_out must be \[N, H\] with N = len\(order\) = 4; "
                                         r"got \(5, 8\)"):
        moe_permute.unpermute_tokens(torch.randn(5, 8, device=device), order, torch.ones(2, 2, device=device), 2,
                                     backend=backend)


# ---------------------------------------------------------------------- grouped product (Triton)
COUNTS = [3, 0, 17, 0, 4]                       # experts 1 and 3 without rows; 17 spans two row tiles


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_mm_matches_the_reference(target, dtype):
    device, backend = target
    if backend != "triton":
        pytest.skip("the grouped product has a Triton kernel only")
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor(COUNTS, device=device)
    x = torch.randn(sum(COUNTS), 24, generator=g).to(dtype).to(device).requires_grad_()
    w = (torch.randn(5, 40, 24, generator=g) * 0.2).to(dtype).to(device).requires_grad_()
    out = grouped_mm(x, w, counts, backend="triton")
    ref_x, ref_w = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = grouped_mm_reference(ref_x, ref_w, counts.cpu())
    tol = MM_TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    gy = torch.randn(out.shape, generator=g).to(dtype).to(device)
    grads = torch.autograd.grad(out, (x, w), gy)
    ref_grads = torch.autograd.grad(ref, (ref_x, ref_w), gy.float())
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.float(), b, **tol)
    assert grads[1][1].abs().max() == 0 and grads[1][3].abs().max() == 0
    via_experts = experts_grouped_mm(x.detach(), w.detach(), counts, backend="triton")
    assert torch.equal(via_experts, out.detach())
    empty = grouped_mm(x[:0], w, torch.zeros(5, dtype=torch.int64, device=device), backend="triton")
    assert empty.shape == (0, 40)


def test_grouped_mm_errors(target):
    device, backend = target
    x, w = torch.randn(4, 8, device=device), torch.randn(2, 6, 8, device=device)
    with pytest.raises(ValueError, match=r"grouped_mm: x must be \[N, in\], weight \[E, out, in\] and counts \[E\]; "
                                         r"got x \(4, 8\), weight \(2, 6, 8\), counts \(3,\)"):
        grouped_mm(x, w, torch.tensor([1, 1, 2], device=device), backend="torch")
    if backend == "triton":
        with pytest.raises(ValueError, match=r"grouped_mm: the triton kernel takes fp32, bf16 or fp16"):
            grouped_mm(x.double(), w.double(), torch.tensor([1, 3], device=device), backend="triton")
