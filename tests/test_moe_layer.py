"""The single-process Mixture-of-Experts layer (parallel_layers/moe/), piece by piece against loops, and whole
against transformers' sparse MoE blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): outputs and every gradient."""
import math

import pytest
import torch
import torch.nn.functional as F

from parallel_layers.moe import (
    GroupedExperts,
    MoELayer,
    Router,
    expert_capacity,
    grouped_mm,
    grouped_mm_reference,
    permute,
    permute_reference,
    route,
    unpermute,
    unpermute_reference,
)

F32 = dict(atol=1e-6, rtol=1e-6)
F64 = dict(atol=1e-12, rtol=0)


@pytest.fixture(autouse=True)
def one_thread_and_seeded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(threads)


def _logits(tokens=24, experts=6, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g, dtype=dtype) * 2


# ---------------------------------------------------------------------- routing
def _route_loop(logits, top_k, scoring, norm, bias=None, scale=1.0):
    """Token by token in float64: (weights, experts, counts)."""
    T, E = logits.shape
    weights, experts, counts = [], [], [0] * E
    for t in range(T):
        row = [float(v) for v in logits[t]]
        if scoring == "softmax":
            m = max(row)
            z = sum(math.exp(v - m) for v in row)
            score = [math.exp(v - m) / z for v in row]
            choice = score
        else:
            score = [1 / (1 + math.exp(-v)) for v in row]
            choice = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(score)]
        picked = sorted(range(E), key=lambda i: -choice[i])[:top_k]
        w = [score[i] for i in picked]
        if norm:
            total = sum(w) + (1e-20 if scoring == "sigmoid" else 0.0)
            w = [v / total for v in w]
        weights.append([v * scale for v in w])
        experts.append(picked)
        for i in picked:
            counts[i] += 1
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(experts), torch.tensor(counts)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_route_matches_the_loop(scoring, top_k, norm):
    logits = _logits()
    bias = scale = None
    if scoring == "sigmoid":
        bias = torch.tensor([0.5, 0.0, -0.3, 0.2, 0.0, 0.4])
        scale = 2.5
    r = route(logits, top_k, scoring=scoring, norm_topk_prob=norm, expert_bias=bias,
              routed_scaling_factor=scale or 1.0)
    w, e, c = _route_loop(logits, top_k, scoring, norm, bias, scale or 1.0)
    assert torch.equal(r.experts, e)
    assert r.experts.dtype == torch.int64 and r.counts.dtype == torch.int64
    assert torch.equal(r.counts, c)
    torch.testing.assert_close(r.weights.double(), w, **F32)
    assert r.weights.dtype == logits.dtype and r.dropped.item() == 0
    assert r.aux_loss is None and r.z_loss is None and r.loss.item() == 0
    if scoring == "sigmoid":                     # the bias changed choices, and the weights ignore it
        unbiased = route(logits, top_k, scoring="sigmoid", norm_topk_prob=norm).experts
        assert not torch.equal(unbiased, r.experts)
        chosen = torch.sigmoid(logits).gather(1, r.experts)
        expected = chosen / (chosen.sum(-1, keepdim=True) + 1e-20) if norm else chosen
        torch.testing.assert_close(r.weights, expected * scale, **F32)


def test_route_weights_take_the_output_dtype_and_score_in_fp32():
    logits = _logits().bfloat16()
    r = route(logits, 2)
    assert r.weights.dtype == torch.bfloat16
    ref = torch.topk(torch.softmax(logits.float(), -1), 2)
    assert torch.equal(r.experts, ref.indices)
    torch.testing.assert_close(r.weights, (ref.values / ref.values.sum(-1, keepdim=True)).bfloat16(), atol=0, rtol=0)


@pytest.mark.parametrize("top_k", [1, 2])
def test_aux_loss_equals_transformers_and_carries_its_gradient(top_k):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    hf_loss = getattr(mixtral, "load_balancing_loss_func", None)
    if hf_loss is None:
        pytest.skip("transformers has no load_balancing_loss_func")
    ours_in = _logits(seed=top_k).requires_grad_()
    hf_in = ours_in.detach().clone().requires_grad_()
    r = route(ours_in, top_k, aux_loss_coef=1.0)
    expected = hf_loss((hf_in,), 6, top_k)
    torch.testing.assert_close(r.aux_loss, expected.detach(), **F32)
    assert not r.aux_loss.requires_grad and r.loss.requires_grad
    (g_ours,) = torch.autograd.grad(r.loss * 0.3, ours_in)
    (g_hf,) = torch.autograd.grad(expected * 0.3, hf_in)
    assert g_hf.abs().max() > 1e-4
    torch.testing.assert_close(g_ours, g_hf, **F32)


def test_aux_loss_of_sigmoid_scoring_uses_normalised_scores():
    logits = _logits()
    r = route(logits, 2, scoring="sigmoid", aux_loss_coef=1.0)
    s = torch.sigmoid(logits)
    p = (s / s.sum(-1, keepdim=True)).mean(0)
    f = r.counts.float() / logits.shape[0]
    torch.testing.assert_close(r.aux_loss, 6 * (f * p).sum(), **F32)


def test_z_loss_and_the_weighted_sum():
    logits = _logits().double().requires_grad_()
    r = route(logits, 2, aux_loss_coef=0.01, z_loss_coef=0.002)
    lse = torch.log(torch.exp(logits.detach()).sum(-1))
    torch.testing.assert_close(r.z_loss.double(), (lse ** 2).mean(), **F32)
    torch.testing.assert_close(r.loss, 0.01 * r.aux_loss + 0.002 * r.z_loss, **F32)
    z_only = route(logits, 2, z_loss_coef=1.0)
    assert z_only.aux_loss is None
    (grad,) = torch.autograd.grad(z_only.loss, logits)
    expected = 2 * lse[:, None] * torch.softmax(logits.detach(), -1) / logits.shape[0]
    torch.testing.assert_close(grad.double(), expected, **F32)


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_keeps_the_first_assignments_in_token_order(top_k):
    logits = _logits(tokens=20, experts=4, seed=3)
    logits[:, 0] += 3.0                                   # expert 0 overloaded
    factor = 0.75
    r = route(logits, top_k, capacity_factor=factor)
    free = route(logits, top_k)
    capacity = math.ceil(factor * 20 * top_k / 4)
    assert expert_capacity(factor, 20, top_k, 4) == capacity
    seen, keep = [0] * 4, torch.zeros(20, top_k, dtype=torch.bool)
    for t in range(20):
        for j in range(top_k):
            e = int(free.experts[t, j])
            keep[t, j] = seen[e] < capacity
            seen[e] += 1
    assert (~keep).sum() > 0                              # something was dropped
    assert torch.equal(r.experts, free.experts.masked_fill(~keep, -1))
    assert torch.equal(r.weights, free.weights.masked_fill(~keep, 0.0))
    assert r.dropped.item() == int((~keep).sum())
    assert torch.equal(r.counts, free.counts.clamp(max=capacity))


def test_update_bias_moves_toward_balance():
    router = Router(16, 4, 2, scoring="sigmoid")
    router.update_bias(torch.tensor([10, 2, 6, 6]), 0.1)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]), atol=0, rtol=0)
    router.expert_bias.zero_()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(4, 16, generator=g) * 0.2)
        router.weight[0] += 0.5                           # expert 0 favoured by every token of a positive mean
    x = torch.randn(256, 16, generator=g).abs()

    def imbalance():
        with torch.no_grad():
            counts = router(x).counts
        return counts, int(counts.max() - counts.min())

    counts, before = imbalance()
    for _ in range(100):
        router.update_bias(counts, 0.02)
        counts, _ = imbalance()
    after = imbalance()[1]
    assert before > 100 and after < before / 4, (before, after)
    assert "expert_bias" in router.state_dict() and not router.expert_bias.requires_grad
    with pytest.raises(ValueError, match="scoring='sigmoid'"):
        Router(16, 4, 2).update_bias(counts, 0.1)


# ---------------------------------------------------------------------- permute / unpermute
def _assignments(tokens=9, top_k=2, experts=6, dropped=True):
    """Experts 1 and 5 get nothing; a few slots dropped (-1)."""
    g = torch.Generator().manual_seed(1)
    used = torch.tensor([0, 2, 3, 4])
    e = torch.stack([used[torch.randperm(4, generator=g)[:top_k]] for _ in range(tokens)])
    if dropped:
        e[2, top_k - 1] = -1
        e[6, 0] = -1
    return e


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropped", [False, True])
def test_permute_matches_the_loop_forward_and_backward(top_k, dropped):
    experts = _assignments(top_k=top_k, dropped=dropped)
    hidden = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    permuted, order, counts = permute(hidden, experts, 6)
    ref_hidden = hidden.detach().clone().requires_grad_()
    ref_permuted, ref_order, ref_counts = permute_reference(ref_hidden, experts, 6)
    assert torch.equal(order, ref_order) and torch.equal(counts, ref_counts)
    assert counts[1] == 0 and counts[5] == 0 and permuted.shape[0] == int((experts >= 0).sum())
    assert torch.equal(permuted, ref_permuted)
    g = torch.randn_like(permuted)
    (grad,) = torch.autograd.grad(permuted, hidden, g)
    (ref_grad,) = torch.autograd.grad(ref_permuted, ref_hidden, g)
    torch.testing.assert_close(grad, ref_grad, **F64)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dropped", [False, True])
def test_unpermute_matches_the_loop_forward_and_backward(top_k, dropped):
    experts = _assignments(top_k=top_k, dropped=dropped)
    _, order, _ = permute(torch.zeros(9, 1), experts, 6)
    expert_out = torch.randn(order.shape[0], 5, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(9, top_k, dtype=torch.float64, requires_grad=True)
    out = unpermute(expert_out, order, weights, 9)
    ref_inputs = [expert_out.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()]
    ref = unpermute_reference(ref_inputs[0], order, ref_inputs[1], 9)
    torch.testing.assert_close(out, ref, **F64)
    if dropped:
        torch.testing.assert_close(out[6], weights[6, 1] * expert_out[list(order).index(6 * 2 + 1)] if top_k == 2
                                   else torch.zeros(5, dtype=torch.float64), **F64)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (expert_out, weights), g)
    ref_grads = torch.autograd.grad(ref, ref_inputs, g)
    for a, b in zip(grads, ref_grads):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, **F64)


def test_unpermute_of_bf16_rounds_once():
    """Slot 0 gives (1 + 2^-7)^2 = 1 + 2^-6 + 2^-14, slot 1 gives 2^-8: the sum lies just above the midpoint
    between the bf16 neighbours 1 + 2^-6 and 1 + 3 * 2^-7, so it rounds up; a product rounded to bf16 first
    loses the 2^-14 and the sum, then on the midpoint, rounds to even (down)."""
    experts = torch.tensor([[0, 1]] * 3)
    _, order, _ = permute(torch.zeros(3, 1), experts, 2)
    slot = order % 2
    expert_out = torch.where(slot[:, None] == 0, 1 + 2 ** -7, 2 ** -8).expand(6, 4).bfloat16()
    weights = torch.tensor([[1 + 2 ** -7, 1.0]] * 3).bfloat16()
    out = unpermute(expert_out, order, weights, 3)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((3, 4), 1 + 3 * 2 ** -7).bfloat16())
    assert torch.equal(unpermute_reference(expert_out, order, weights, 3), out)


# ---------------------------------------------------------------------- grouped products and experts
COUNTS = torch.tensor([3, 0, 5, 0, 4])                     # experts 1 and 3 have no tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_mm_loop_matches_the_reference(dtype):
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    w = (torch.randn(5, 32, 16, dtype=dtype) * 0.25).requires_grad_()    # nn.Linear's scale: outputs ~1
    out = grouped_mm(x, w, COUNTS, backend="loop")
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = grouped_mm_reference(ref_x, ref_w, COUNTS)
    tol = F64 if dtype == torch.float64 else F32
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (x, w), g)
    ref_grads = torch.autograd.grad(ref, (ref_x, ref_w), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, **tol)
    assert grads[1][1].abs().max() == 0 and grads[1][3].abs().max() == 0


def test_grouped_mm_kernel_where_torch_has_it():
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    x = torch.randn(12, 16, requires_grad=True)
    w = (torch.randn(5, 32, 16) * 0.25).requires_grad_()
    try:
        out = grouped_mm(x, w, COUNTS, backend="grouped_mm")
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"torch._grouped_mm does not run on this CPU build: {err}")
    ref_x, ref_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = grouped_mm_reference(ref_x, ref_w, COUNTS)
    torch.testing.assert_close(out, ref, **F32)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (x, w), g), torch.autograd.grad(ref, (ref_x, ref_w), g)):
        torch.testing.assert_close(a, b, **F32)
    torch.manual_seed(0)
    loop = GroupedExperts(5, 16, 32, backend="loop")
    kernel = GroupedExperts(5, 16, 32, backend="grouped_mm")
    kernel.load_state_dict(loop.state_dict())
    h = torch.randn(12, 16)
    out_loop, out_kernel = loop(h, COUNTS), kernel(h, COUNTS)
    torch.testing.assert_close(out_kernel, out_loop, **F32)
    g = torch.randn_like(out_loop)
    for a, b in zip(torch.autograd.grad(out_kernel, list(kernel.parameters()), g),
                    torch.autograd.grad(out_loop, list(loop.parameters()), g)):
        torch.testing.assert_close(a, b, **F32)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        grouped_mm(x.double(), w.double(), COUNTS, backend="grouped_mm")
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        grouped_mm(x[:, :6], w[:, :, :6], COUNTS, backend="grouped_mm")


def _experts_reference(module, x, counts):
    """Row by row: down[e] @ (act(gate[e] @ x) * (up[e] @ x))."""
    expert_of_row = torch.repeat_interleave(torch.arange(module.num_experts), counts)
    rows = [module.down_proj[e] @ (F.silu(module.gate_proj[e] @ x[i]) * (module.up_proj[e] @ x[i]))
            for i, e in enumerate(expert_of_row.tolist())]
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_experts_match_the_reference(dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(5, 16, 32, backend="loop", dtype=dtype)
    x = torch.randn(12, 16, dtype=dtype, requires_grad=True)
    out = experts(x, COUNTS)
    ref = _experts_reference(experts, x, COUNTS)
    tol = F64 if dtype == torch.float64 else F32
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn_like(out)
    params = [x, experts.gate_proj, experts.up_proj, experts.down_proj]
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        assert b.abs().max() > 0
        torch.testing.assert_close(a, b, **tol)
    no_tokens = torch.autograd.grad(experts(x[:0], torch.zeros(5, dtype=torch.int64)).sum(), experts.down_proj)[0]
    assert no_tokens.shape == experts.down_proj.shape and no_tokens.abs().max() == 0


def test_grouped_experts_init_like_linear():
    torch.manual_seed(0)
    experts = GroupedExperts(3, 64, 128)
    bound_in, bound_mid = 1 / math.sqrt(64), 1 / math.sqrt(128)
    assert experts.gate_proj.abs().max() <= bound_in and experts.gate_proj.abs().max() > 0.9 * bound_in
    assert experts.down_proj.abs().max() <= bound_mid and experts.down_proj.abs().max() > 0.9 * bound_mid


# ---------------------------------------------------------------------- the layer on its own
def test_layer_equals_a_token_by_token_loop():
    """Sigmoid routing with a bias, a capacity that drops, a shared expert without gate: each token's output
    is its kept experts' weighted outputs plus the shared MLP's."""
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 5, 2, scoring="sigmoid", routed_scaling_factor=1.5, capacity_factor=0.6,
                     aux_loss_coef=0.01, num_shared_experts=2, dtype=torch.float64)
    layer.router.expert_bias.copy_(torch.tensor([0.3, 0.0, 0.0, -0.2, 0.1]))
    x = torch.randn(2, 7, 16, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    tokens = x.reshape(-1, 16)
    routing = layer.router(tokens)
    assert layer.stats["dropped"] > 0 and torch.equal(layer.stats["counts"], routing.counts)
    ex = layer.experts
    rows = []
    for t in range(tokens.shape[0]):
        total = layer.shared_expert(tokens[t])
        for j in range(2):
            e = int(routing.experts[t, j])
            if e >= 0:
                h = F.silu(ex.gate_proj[e] @ tokens[t]) * (ex.up_proj[e] @ tokens[t])
                total = total + routing.weights[t, j] * (ex.down_proj[e] @ h)
        rows.append(total)
    torch.testing.assert_close(y, torch.stack(rows).view_as(y), **F64)
    assert layer.shared_expert.gate_proj.weight.shape == (48, 16)
    torch.testing.assert_close(layer(tokens), y.view_as(tokens), **F64)          # [T, H] in, [T, H] out
    (g,) = torch.autograd.grad(layer.aux_loss, layer.router.weight)
    assert g.abs().max() > 0
    empty = layer(x[:, :0])
    assert empty.shape == (2, 0, 16) and layer.stats["counts"].sum() == 0


# ---------------------------------------------------------------------- against transformers' blocks
def _hf_block(family):
    pytest.importorskip("transformers")
    if family == "mixtral":
        from transformers.models.mixtral.configuration_mixtral import MixtralConfig as Config
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        kw = dict(intermediate_size=64, num_local_experts=4)
    elif family == "qwen2_moe":
        from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig as Config
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        kw = dict(moe_intermediate_size=64, shared_expert_intermediate_size=48, num_experts=4, norm_topk_prob=False)
    elif family == "qwen3_moe":
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig as Config
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        kw = dict(moe_intermediate_size=64, num_experts=4, norm_topk_prob=True)
    else:
        from transformers.models.olmoe.configuration_olmoe import OlmoeConfig as Config
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block
        kw = dict(intermediate_size=64, num_experts=4, norm_topk_prob=False)
    config = Config(hidden_size=32, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, **kw)
    config._experts_implementation = "eager"
    block = Block(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "gate.weight" else 0.15))
    return block


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_block_equals_it_outputs_and_gradients(family):
    block = _hf_block(family)
    layer = getattr(MoELayer, f"from_hf_{family}")(block)
    assert (layer.shared_expert is not None) == (family == "qwen2_moe")
    assert layer.router.norm_topk_prob == (family in ("mixtral", "qwen3_moe"))
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y_ours = block(x_hf), layer(x_ours)
    torch.testing.assert_close(y_ours, y_hf, **F32)
    g = torch.randn_like(y_hf)
    hf_params = dict(block.named_parameters())
    grads_hf = torch.autograd.grad(y_hf, [x_hf] + list(hf_params.values()), g)
    ours_params = dict(layer.named_parameters())
    grads_ours = torch.autograd.grad(y_ours, [x_ours] + list(ours_params.values()), g)
    torch.testing.assert_close(grads_ours[0], grads_hf[0], **F32)
    mapped = layer.hf_state_dict(dict(zip(ours_params, grads_ours[1:])))
    assert set(mapped) == set(hf_params)
    for (name, grad_hf) in zip(hf_params, grads_hf[1:]):
        assert grad_hf.abs().max() > 0, name
        torch.testing.assert_close(mapped[name], grad_hf, atol=1e-6, rtol=1e-5, msg=name)
    assert set(layer.hf_state_dict()) == set(hf_params)


BF16_TOL = dict(atol=2e-2, rtol=2e-2)   # a few bf16 ulps of outputs of magnitude ~1


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_from_hf_block_in_bf16(family):
    block = _hf_block(family)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        exact = getattr(MoELayer, f"from_hf_{family}")(block)(x)
        block = block.to(torch.bfloat16)
        layer = getattr(MoELayer, f"from_hf_{family}")(block)
        assert layer.router.weight.dtype == torch.bfloat16
        y_hf, y_ours = block(x.bfloat16()), layer(x.bfloat16())
    assert y_ours.dtype == torch.bfloat16
    torch.testing.assert_close(y_ours.float(), y_hf.float(), **BF16_TOL)
    # the bf16 layer is no further from the fp32 result than transformers' own bf16 block
    err_ours = (y_ours.float() - exact).abs().max()
    err_hf = (y_hf.float() - exact).abs().max()
    assert err_ours <= 1.5 * err_hf, (err_ours, err_hf)


# ---------------------------------------------------------------------- errors name the layer, the sizes, the fix
def test_bad_inputs_are_refused_with_the_sizes():
    with pytest.raises(ValueError, match=r"MoELayer: top_k=5 is larger than num_experts=4.*top_k <= 4"):
        MoELayer(32, 64, 4, 5)
    layer = MoELayer(32, 64, 4, 2)
    with pytest.raises(ValueError, match=r"MoELayer: input must be \[\.\.\., hidden_size\] with hidden_size=32.*"
                                         r"got shape \(2, 3, 48\).*hidden_size=48"):
        layer(torch.randn(2, 3, 48))
    with pytest.raises(ValueError, match=r"MoELayer: input dtype torch.float64 differs from the layer's torch.float32"):
        layer(torch.randn(2, 3, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"MoELayer: shared_expert_gate=True.*num_shared_experts=0"):
        MoELayer(32, 64, 4, 2, shared_expert_gate=True)
    with pytest.raises(ValueError, match=r"MoELayer: scoring='relu' must be one of"):
        MoELayer(32, 64, 4, 2, scoring="relu")
    with pytest.raises(ValueError, match=r"MoELayer: capacity_factor=0 must be positive"):
        MoELayer(32, 64, 4, 2, capacity_factor=0)
    with pytest.raises(ValueError, match=r"permute: experts holds index 4 but there are num_experts=4"):
        permute(torch.randn(3, 8), torch.tensor([[0, 4], [1, 2], [3, 0]]), 4)
    with pytest.raises(ValueError, match=r"GroupedExperts: counts must be \[num_experts=4\]; got \(3,\)"):
        GroupedExperts(4, 8, 16)(torch.randn(3, 8), torch.tensor([1, 1, 1]))


def test_from_hf_refuses_a_block_of_another_family():
    block = _hf_block("qwen2_moe")
    with pytest.raises(ValueError, match=r"from_hf_mixtral\(Qwen2MoeSparseMoeBlock\).*shared expert"):
        MoELayer.from_hf_mixtral(block)
    with pytest.raises(ValueError, match=r"from_hf_qwen3_moe\(MixtralSparseMoeBlock\).*norm_topk_prob"):
        MoELayer.from_hf_qwen3_moe(_hf_block("mixtral"))
