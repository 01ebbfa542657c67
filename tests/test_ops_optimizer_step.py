"""Flat-buffer AdamW / SGD kernels on every backend against the torch reference (the oracle)."""
import itertools

import pytest
import torch
from conftest import is_interpreted

from parallel_layers import ops
from parallel_layers.ops.optimizer_step import reference_adamw_step, reference_sgd_step

RTOL, ATOL = 1e-5, 1e-7  # fp32 rounding only: kernels fuse the same arithmetic in another order


def sizes_for(target):
    return [0, 1, 7, 1023, 4097] if is_interpreted(target) else [0, 1, 7, 1023, 4097, (1 << 20) + 3]


def make_adam_state(n, device, grad_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 3).to(grad_dtype)
    exp_avg = torch.randn(n, generator=g) * 0.1
    exp_avg_sq = torch.rand(n, generator=g) * 0.01
    return [t.to(device) for t in (param, grad, exp_avg, exp_avg_sq)]


def clone_all(ts):
    return [None if t is None else t.clone() for t in ts]


def run_adamw(state, copy, backend, step, **hp):
    p, g, m, v = state
    ops.adamw_step(p, g, m, v, step=step, param_copy=copy, backend=backend, **hp)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_adamw_matches_reference_over_sizes(target, grad_dtype):
    device, backend = target
    for n in sizes_for(target):
        ours = make_adam_state(n, device, grad_dtype)
        ref = clone_all(ours)
        for step in (1, 2, 3):
            run_adamw(ours, None, backend, step, lr=1e-2, weight_decay=0.1)
            run_adamw(ref, None, "torch", step, lr=1e-2, weight_decay=0.1)
        for name, a, b in zip(("param", "grad", "exp_avg", "exp_avg_sq"), ours, ref):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"n={n} {name}: {m}")


@pytest.mark.parametrize("decoupled,maximize,copy_dtype", list(itertools.product(
    [True, False], [False, True], [None, torch.bfloat16, torch.float16])))
def test_adamw_variants(target, decoupled, maximize, copy_dtype):
    device, backend = target
    n = 2053
    ours = make_adam_state(n, device, torch.float32, seed=1)
    ref = clone_all(ours)
    copy_ours = None if copy_dtype is None else torch.zeros(n, dtype=copy_dtype, device=device)
    copy_ref = None if copy_ours is None else copy_ours.clone()
    scale = torch.full((1,), 0.25, device=device)  # a device-side multiplier (1/loss_scale x clip coef)
    hp = dict(lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.05,
              decoupled_weight_decay=decoupled, maximize=maximize, grad_scale=scale)
    for step in (1, 2, 5):
        run_adamw(ours, copy_ours, backend, step, **hp)
        run_adamw(ref, copy_ref, "torch", step, **hp)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    if copy_dtype is not None:
        # The copy is exactly the kernel's own updated fp32 params, rounded once.
        assert torch.equal(copy_ours, ours[0].to(copy_dtype))


def test_adamw_step_as_device_tensor(target):
    device, backend = target
    ours = make_adam_state(515, device, torch.float32)
    ref = clone_all(ours)
    run_adamw(ours, None, backend, torch.full((1,), 4.0, device=device), lr=1e-3)
    run_adamw(ref, None, "torch", 4, lr=1e-3)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16])
def test_found_inf_skips_adamw_bit_identically(target, copy_dtype):
    device, backend = target
    state = make_adam_state(3001, device, torch.float16)
    state[1][17] = float("inf")
    state[1][33] = float("nan")
    copy = None if copy_dtype is None else torch.randn(3001, device=device).to(copy_dtype)
    before = clone_all(state + [copy])
    found_inf = torch.ones(1, device=device)
    ops.adamw_step(*state, lr=1e-2, step=3, weight_decay=0.1, found_inf=found_inf, param_copy=copy,
                   backend=backend)
    for a, b in zip(state + [copy], before):
        if a is not None:
            assert torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a, b.view(torch.uint8))


def test_adamw_flat_equals_torch_adamw(target):
    """Five steps of the flat kernel equal torch.optim.AdamW on the same parameter."""
    device, backend = target
    torch.manual_seed(0)
    w = torch.randn(777, device=device)
    torch_param = torch.nn.Parameter(w.clone())
    opt = torch.optim.AdamW([torch_param], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    p, m, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, 6):
        grad = torch.randn_like(w)
        torch_param.grad = grad.clone()
        opt.step()
        ops.adamw_step(p, grad, m, v, lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, step=step,
                       backend=backend)
    torch.testing.assert_close(p, torch_param.detach(), rtol=RTOL, atol=1e-6)
    torch.testing.assert_close(m, opt.state[torch_param]["exp_avg"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(v, opt.state[torch_param]["exp_avg_sq"], rtol=RTOL, atol=ATOL)


SGD_CASES = [dict(momentum=0.0), dict(momentum=0.9), dict(momentum=0.9, dampening=0.1),
             dict(momentum=0.9, nesterov=True, weight_decay=0.01), dict(momentum=0.5, maximize=True),
             dict(weight_decay=0.1, maximize=True)]


@pytest.mark.parametrize("hp", SGD_CASES, ids=[str(c) for c in SGD_CASES])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_sgd_matches_reference(target, hp, grad_dtype):
    device, backend = target
    for n in sizes_for(target)[:5]:
        p, g, buf, _ = make_adam_state(n, device, grad_dtype, seed=2)
        p2, g2, buf2 = p.clone(), g.clone(), buf.clone()
        copy, copy2 = torch.zeros(n, dtype=torch.bfloat16, device=device), torch.zeros(n, dtype=torch.bfloat16,
                                                                                       device=device)
        for step in (1, 2, 3):
            ops.sgd_step(p, g, buf, lr=0.1, step=step, param_copy=copy, backend=backend, grad_scale=0.5, **hp)
            ops.sgd_step(p2, g2, buf2, lr=0.1, step=step, param_copy=copy2, backend="torch", grad_scale=0.5, **hp)
        torch.testing.assert_close(p, p2, rtol=RTOL, atol=ATOL)
        if hp.get("momentum"):
            torch.testing.assert_close(buf, buf2, rtol=RTOL, atol=ATOL)
        assert torch.equal(copy, p.to(torch.bfloat16))


def test_sgd_equals_torch_sgd(target):
    device, backend = target
    torch.manual_seed(1)
    w = torch.randn(1000, device=device)
    torch_param = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([torch_param], lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=False)
    p, buf = w.clone(), torch.zeros_like(w)
    for step in range(1, 6):
        grad = torch.randn_like(w)
        torch_param.grad = grad.clone()
        opt.step()
        ops.sgd_step(p, grad, buf, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01, step=step,
                     backend=backend)
    torch.testing.assert_close(p, torch_param.detach(), rtol=RTOL, atol=1e-6)


def test_found_inf_skips_sgd_bit_identically(target):
    device, backend = target
    p, g, buf, _ = make_adam_state(2000, device, torch.float32)
    g[5] = float("nan")
    before = clone_all([p, g, buf])
    ops.sgd_step(p, g, buf, lr=0.1, momentum=0.9, step=2, found_inf=torch.ones(1, device=device), backend=backend)
    for a, b in zip((p, g, buf), before):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    p, g, m, v = make_adam_state(10, "cpu", torch.float32)
    with pytest.raises(ValueError, match="grad has 9 elements"):
        ops.adamw_step(p, g[:9], m, v, lr=1e-3, step=1)
    with pytest.raises(TypeError, match="exp_avg has dtype bfloat16"):
        ops.adamw_step(p, g, m.bfloat16(), v, lr=1e-3, step=1)
    with pytest.raises(TypeError, match="param has dtype float16"):
        ops.adamw_step(p.half(), g, m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="exp_avg_sq is on meta"):
        ops.adamw_step(p, g, m, torch.empty(10, device="meta"), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="param must be a 1-D flat buffer"):
        ops.adamw_step(p.view(2, 5), g, m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="grad must be contiguous"):
        ops.adamw_step(p, torch.randn(20)[::2], m, v, lr=1e-3, step=1)
    with pytest.raises(ValueError, match="beta1=1.0 must be < 1"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=1, beta1=1.0)
    with pytest.raises(ValueError, match="lr=-1.0 must be >= 0"):
        ops.adamw_step(p, g, m, v, lr=-1, step=1)
    with pytest.raises(ValueError, match="step=0 must be >= 1"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=0)
    with pytest.raises(TypeError, match="param_copy has dtype float32"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=1, param_copy=torch.empty(10))
    with pytest.raises(ValueError, match="momentum=0.9 needs a momentum_buffer"):
        ops.sgd_step(p, g, None, lr=0.1, momentum=0.9, step=1)
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        ops.sgd_step(p, g, m, lr=0.1, momentum=0.0, nesterov=True, step=1)
    with pytest.raises(ValueError, match="grad_scale is on meta"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=1, grad_scale=torch.ones(1, device="meta"))
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=1, backend="fast")
    with pytest.raises(RuntimeError, match="backend 'cuda' was forced but cannot run"):
        ops.adamw_step(p, g, m, v, lr=1e-3, step=1, backend="cuda")


def test_reference_functions_are_the_torch_backend():
    # The "torch" backend is literally the reference: no third implementation to drift.
    from parallel_layers.ops import _backend
    assert _backend.kernel("adamw_step", torch.device("cpu"), "torch", reference_adamw_step) is reference_adamw_step
    assert _backend.kernel("sgd_step", torch.device("cpu"), "torch", reference_sgd_step) is reference_sgd_step
