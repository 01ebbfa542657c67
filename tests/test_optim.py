"""FusedAdamW / FusedSGD against torch.optim.AdamW / Adam / SGD on small CPU models.

Parity is fp32 rounding only (the kernels fuse torch's arithmetic in another order): RTOL/ATOL below.
bf16 parameters are compared with a torch AdamW on fp32 master weights fed the same bf16 gradients.
"""
import copy
import io
import warnings

import pytest
import torch

from parallel_layers import _extension
from parallel_layers.optim import FusedAdamW, FusedSGD

RTOL, ATOL = 1e-5, 1e-6

warnings.filterwarnings("ignore", message="parallel_layers: no fused kernel backend")


@pytest.fixture(params=["torch", "cpp"])
def backend(request):
    if request.param == "cpp":
        ext, why = _extension.load()
        if ext is None:
            pytest.skip(f"cpp backend unavailable: {why}")
    return request.param


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 9), torch.nn.Tanh(),
                            torch.nn.Linear(9, 3))
    return m.to(dtype)


def groups_of(model, hypers):
    """Split the model's parameters round-robin into len(hypers) param groups."""
    params = list(model.parameters())
    return [dict(params=params[k::len(hypers)], **h) for k, h in enumerate(hypers)]


def grads_step(models, opts, x, drop=(), set_to_none=True, scale=1.0):
    """Same forward/backward on every model; parameters whose index is in ``drop`` get no gradient."""
    for m, o in zip(models, opts):
        o.zero_grad(set_to_none=set_to_none)
        (m(x).pow(2).mean() * scale).backward()
        for i, p in enumerate(m.parameters()):
            if i in drop:
                p.grad = None


def assert_params_close(m1, m2, rtol=RTOL, atol=ATOL):
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda msg: f"{name}: {msg}")


def assert_states_equal(sd1, sd2, exact=False):
    assert sd1["state"].keys() == sd2["state"].keys()
    for k in sd1["state"]:
        for key, v in sd1["state"][k].items():
            w = sd2["state"][k][key]
            if v is None:
                assert w is None
            elif exact:
                assert torch.equal(v, w), (k, key)
            else:
                torch.testing.assert_close(v.float(), w.float(), rtol=RTOL, atol=ATOL)


# Participation patterns: params that get no gradient in some steps (torch skips them entirely).
DROPS = [(), (), (1,), (1, 4), (), (0, 5), (), (2, 3, 4), (), ()]


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_adamw_parity_groups_drops_scheduler(backend, decoupled, set_to_none):
    hypers = [dict(lr=1e-2, weight_decay=0.1), dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.0),
              dict(lr=5e-3, weight_decay=0.05, maximize=True)]
    m1, m2 = make_model(), make_model()
    torch_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    o1 = torch_cls(groups_of(m1, hypers), lr=1e-3, foreach=False)
    o2 = FusedAdamW(groups_of(m2, hypers), lr=1e-3, decoupled_weight_decay=decoupled, backend=backend)
    s1 = torch.optim.lr_scheduler.StepLR(o1, step_size=3, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=3, gamma=0.5)
    x = torch.randn(5, 6)
    for drop in DROPS:
        grads_step((m1, m2), (o1, o2), x, drop if set_to_none else (), set_to_none)
        o1.step(), o2.step()
        s1.step(), s2.step()
        assert_params_close(m1, m2)
    assert_states_equal(o1.state_dict(), o2.state_dict())
    assert o2.param_groups[0]["lr"] == o1.param_groups[0]["lr"]


@pytest.mark.parametrize("hp", [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, dampening=0.3),
                                dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01),
                                dict(lr=0.05, momentum=0.5, weight_decay=0.1, maximize=True)])
def test_sgd_parity(backend, hp):
    m1, m2 = make_model(), make_model()
    hypers = [dict(), dict(lr=hp["lr"] / 2)]
    o1 = torch.optim.SGD(groups_of(m1, hypers), foreach=False, **hp)
    o2 = FusedSGD(groups_of(m2, hypers), backend=backend, **hp)
    x = torch.randn(5, 6)
    for drop in DROPS:
        grads_step((m1, m2), (o1, o2), x, drop)
        o1.step(), o2.step()
        assert_params_close(m1, m2)
    for k, st in o1.state_dict()["state"].items():
        torch.testing.assert_close(o2.state_dict()["state"][k]["momentum_buffer"], st["momentum_buffer"],
                                   rtol=RTOL, atol=ATOL)


def test_params_and_grads_are_flat_views():
    m = make_model()
    opt = FusedAdamW(m.parameters())
    (fb,) = opt.flat_buffers[0]
    for p, _v in zip(m.parameters(), fb.grad_views):
        assert p.untyped_storage().data_ptr() == fb.master.untyped_storage().data_ptr()
    m(torch.randn(2, 6)).sum().backward()
    opt.step()
    assert all(p.grad is v for p, v in zip(m.parameters(), fb.grad_views))  # packed and re-pointed
    assert fb.kernel_runs == [(0, len(fb.params))]   # the common case: one kernel call for the whole buffer
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is v for p, v in zip(m.parameters(), fb.grad_views)) and not fb.grad.any()
    m(torch.randn(2, 6)).sum().backward()          # autograd accumulates into the flat buffer
    assert fb.grad.abs().sum() > 0
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("checker", [True, False], ids=["cpp_check", "python_check"])
def test_params_moved_by_a_wrapper_are_taken_back(backend, dtype, checker):
    """A wrapper (DataParallel at its bucket rebuild) re-points some p.data to buffers of its own after the
    optimizer was built: the step must still update the tensors the model reads, as torch's AdamW does."""
    if checker and _extension.load()[0] is None:
        pytest.skip("no extension: the C++ check is unavailable")
    models = [make_model(0, dtype), make_model(0, dtype)]
    master = [p.detach().float().clone().requires_grad_() for p in models[1].parameters()]
    opts = [FusedAdamW(models[0].parameters(), lr=0.05, backend=backend), torch.optim.AdamW(master, lr=0.05)]
    (fb,) = opts[0].flat_buffers[0]
    if not checker:
        fb.fast_check = False
    x = torch.randn(4, 6, dtype=dtype)
    for step in range(3):
        with torch.no_grad():
            for i, p in enumerate(models[0].parameters()):
                if (i + step) % 2 == 0:
                    p.data = p.data.clone()          # moved out of the flat storage, same value
        for o in opts:
            o.zero_grad()
        models[1].zero_grad()
        models[0](x).float().pow(2).mean().backward()
        with torch.no_grad():                          # the fp32-master reference: same low-precision forward
            for p, m in zip(models[1].parameters(), master):
                p.copy_(m)
        models[1](x).float().pow(2).mean().backward()
        for p, m in zip(models[1].parameters(), master):
            m.grad = p.grad.float()
        for o in opts:
            o.step()
        for (name, p), m in zip(models[0].named_parameters(), master):
            assert p.untyped_storage().data_ptr() == fb.param_views[0].untyped_storage().data_ptr(), name
            torch.testing.assert_close(p.float(), m.detach().to(dtype).float(), rtol=RTOL, atol=ATOL,
                                       msg=lambda msg: f"step {step} {name}: {msg}")


def test_add_param_group_and_closure(backend):
    m1, m2 = make_model(), make_model()
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    o1 = torch.optim.AdamW(p1[:3], lr=1e-2, foreach=False)
    o2 = FusedAdamW(p2[:3], lr=1e-2, backend=backend)
    x = torch.randn(4, 6)
    for step in range(4):
        if step == 2:
            o1.add_param_group(dict(params=p1[3:], lr=2e-2, weight_decay=0.3))
            o2.add_param_group(dict(params=p2[3:], lr=2e-2, weight_decay=0.3))
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            o.step(lambda m=m: m(x).pow(2).sum().backward())
    assert_params_close(m1, m2)


# ------------------------------------------------------------------------------------------ state dicts
def _train(model, opt, xs, drops=None):
    for k, x in enumerate(xs):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for i, p in enumerate(model.parameters()):
            if drops and i in drops[k % len(drops)]:
                p.grad = None
        opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda ps, b: FusedAdamW(ps, lr=1e-2, weight_decay=0.1, backend=b),
    lambda ps, b: FusedSGD(ps, lr=0.05, momentum=0.9, dampening=0.1, backend=b)], ids=["adamw", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_is_bit_identical(backend, make_opt, dtype):
    xs = [torch.randn(4, 6, dtype=dtype) for _ in range(6)]
    drops = [(), (2,), (0, 5)]
    m1 = make_model(dtype=dtype)
    o1 = make_opt(m1.parameters(), backend)
    _train(m1, o1, xs[:3], drops)
    saved_model = copy.deepcopy(m1.state_dict())
    buf = io.BytesIO()
    torch.save(o1.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    m2 = make_model(seed=1, dtype=dtype)
    m2.load_state_dict(saved_model)
    o2 = make_opt(m2.parameters(), backend)
    o2.load_state_dict(saved)
    _train(m1, o1, xs[3:], drops)
    _train(m2, o2, xs[3:], drops)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert_states_equal(o1.state_dict(), o2.state_dict(), exact=True)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_state_dict_interchanges_with_torch(backend, kind):
    if kind == "adamw":
        ours = lambda ps: FusedAdamW(ps, lr=1e-2, backend=backend)      # noqa: E731
        theirs = lambda ps: torch.optim.AdamW(ps, lr=1e-2)              # noqa: E731
    else:
        ours, theirs = (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, backend=backend)), \
            (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    xs = [torch.randn(4, 6) for _ in range(6)]
    for first, second in ((ours, theirs), (theirs, ours)):
        m1 = make_model()
        o1 = first(m1.parameters())
        _train(m1, o1, xs[:3], [(), (1,)])
        m2 = copy.deepcopy(m1)
        o2 = second(m2.parameters())
        o2.load_state_dict(copy.deepcopy(o1.state_dict()))
        _train(m1, o1, xs[3:])
        _train(m2, o2, xs[3:])
        assert_params_close(m1, m2)


# ------------------------------------------------------------------------------------------ mixed precision
def test_found_inf_skips_bit_for_bit(backend):
    m = make_model()
    opt = FusedAdamW(m.parameters(), lr=1e-2, backend=backend)
    x = torch.randn(4, 6)
    for drop in [(), (3,), ()]:
        grads_step((m,), (opt,), x, drop)
        opt.step()
    before_p = [p.detach().clone() for p in m.parameters()]
    before_s = copy.deepcopy(opt.state_dict())
    for drop in [(), (1, 4)]:   # a skipped step, also with a new participation pattern
        grads_step((m,), (opt,), x, drop)
        opt.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.ones(1))
    for a, b in zip(before_p, m.parameters()):
        assert torch.equal(a, b)
    assert_states_equal(before_s, opt.state_dict(), exact=True)
    # and the next real step equals a run that never saw the skipped steps
    ref = make_model()
    ref.load_state_dict(m.state_dict())
    ref_opt = FusedAdamW(ref.parameters(), lr=1e-2, backend=backend)
    ref_opt.load_state_dict(copy.deepcopy(before_s))
    grads_step((m, ref), (opt, ref_opt), x, (2,))
    opt.step(found_inf=torch.zeros(1))
    ref_opt.step()
    for a, b in zip(ref.parameters(), m.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_grad_scale_and_grad_scaler(backend, kind):
    make = (lambda ps: FusedAdamW(ps, lr=1e-2, backend=backend)) if kind == "adamw" else \
        (lambda ps: FusedSGD(ps, lr=0.05, momentum=0.9, backend=backend))
    m1, m2 = make_model(), make_model()
    o1, o2 = make(m1.parameters()), make(m2.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1000)
    x = torch.randn(4, 6)
    for step in range(4):
        grads_step((m1,), (o1,), x)
        o1.step()
        o2.zero_grad()
        scaler.scale(m2(x).pow(2).mean()).backward()
        if step == 2:   # an overflow: GradScaler passes found_inf, the step is skipped, the scale backs off
            next(m2.parameters()).grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in m2.parameters()]
        scaler.step(o2)
        scaler.update()
        if step == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))
            assert scaler.get_scale() == 2.0 ** 9
            o2.zero_grad()               # m2 redoes the step it skipped (m1 took it once)
            scaler.scale(m2(x).pow(2).mean()).backward()
            scaler.step(o2)
            scaler.update()
    assert_params_close(m1, m2)
    assert not hasattr(o2, "found_inf") and not hasattr(o2, "grad_scale")


@pytest.mark.parametrize("dtype,ulp", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -11)])
def test_low_precision_params_against_fp32_master_reference(backend, dtype, ulp):
    """bf16/fp16 params: fp32 master weights, fp32 states; params are the master rounded to the dtype.

    Tolerance: the fp32 masters match the torch reference to fp32 rounding; the low-precision params are
    the masters rounded to nearest, so they may differ from the reference by one ulp (2^-8 relative for
    bf16, 2^-11 for fp16).
    """
    m = make_model(dtype=dtype)
    master = [p.detach().float().clone().requires_grad_(True) for p in m.parameters()]
    ref = torch.optim.AdamW(master, lr=1e-2, weight_decay=0.1, foreach=False)
    opt = FusedAdamW(m.parameters(), lr=1e-2, weight_decay=0.1, backend=backend)
    for _step in range(5):
        opt.zero_grad()
        m(torch.randn(4, 6, dtype=dtype)).float().pow(2).mean().backward()
        for p, q in zip(m.parameters(), master):
            assert p.grad.dtype == dtype
            q.grad = p.grad.float()
        opt.step()
        ref.step()
        for p, q, mp in zip(m.parameters(), master, opt.master_params()):
            torch.testing.assert_close(mp, q.detach(), rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(p.float(), q.detach(), rtol=ulp, atol=1e-6)
            assert p.dtype == dtype
    sd = opt.state_dict()["state"][0]
    assert sd["exp_avg"].dtype == torch.float32 and sd["master_param"].dtype == torch.float32


def test_mixed_dtypes_in_one_group(backend):
    """fp32 and bf16 params in one group become two flat buffers; the fp32 ones match torch exactly."""
    m1, m2 = make_model(), make_model()
    m2[2].to(torch.bfloat16)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1, momentum=0.9, foreach=False)
    o2 = FusedSGD(m2.parameters(), lr=0.1, momentum=0.9, backend=backend)
    assert [fb.dtype for fb in o2.flat_buffers[0]] == [torch.float32, torch.bfloat16]
    x = torch.randn(4, 6)
    for _ in range(3):
        o1.zero_grad()
        m1(x).pow(2).mean().backward()
        for a, b in zip(m1.parameters(), m2.parameters()):   # the same gradients, in each param's dtype
            b.grad = a.grad.to(b.dtype)
        o1.step(), o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        if b.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        else:
            torch.testing.assert_close(a, b.float(), rtol=2e-2, atol=1e-2)


def test_grad_scaler_unscale_and_clip(backend):
    """scaler.unscale_ + clip_grad_norm_ (GradScaler then passes no grad_scale, only found_inf)."""
    m1, m2 = make_model(), make_model()
    o1 = torch.optim.AdamW(m1.parameters(), lr=1e-2, foreach=False)
    o2 = FusedAdamW(m2.parameters(), lr=1e-2, backend=backend)
    x = torch.randn(4, 6)
    for m, o in ((m1, o1), (m2, o2)):
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for _ in range(3):
            o.zero_grad()
            scaler.scale(m(x).pow(2).mean()).backward()
            scaler.unscale_(o)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            scaler.step(o)
            scaler.update()
    assert_params_close(m1, m2)


def test_many_params_random_participation(backend):
    """Hundreds of params, random gradient patterns and skipped steps: the run splitting must stay exact."""
    gen = torch.Generator().manual_seed(0)
    ps1 = [torch.randn(int(n), generator=gen, requires_grad=True) for n in torch.randint(0, 30, (300,), generator=gen)]
    ps2 = [p.detach().clone().requires_grad_(True) for p in ps1]
    o1 = torch.optim.AdamW(ps1, lr=1e-2, foreach=False)
    o2 = FusedAdamW(ps2, lr=1e-2, backend=backend)
    for step in range(8):
        mask = torch.rand(len(ps1), generator=gen) < (0.5 if step % 3 else 1.0)
        skip = step == 4
        for p1, p2, keep in zip(ps1, ps2, mask.tolist()):
            g = torch.randn(p1.shape, generator=gen) if keep else None
            p1.grad, p2.grad = g, None if g is None else g.clone()
        if not skip:
            o1.step()
        o2.step(found_inf=torch.full((1,), float(skip)))
    for a, b in zip(ps1, ps2):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    assert_states_equal(o1.state_dict(), o2.state_dict())


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(lr=-1.0), ValueError, "lr"), (dict(betas=(1.0, 0.9)), ValueError, "betas[0]"),
    (dict(betas=(0.9, -0.1)), ValueError, "betas[1]"), (dict(eps=-1e-8), ValueError, "eps"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"), (dict(amsgrad=True), ValueError, "amsgrad"),
    (dict(differentiable=True), ValueError, "differentiable"), (dict(lr="fast"), TypeError, "lr"),
    (dict(backend="gpu"), ValueError, "backend")])
def test_adamw_bad_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        FusedAdamW(make_model().parameters(), **kwargs)


@pytest.mark.parametrize("kwargs,word", [(dict(lr=-1.0), "lr"), (dict(momentum=-0.5), "momentum"),
                                         (dict(weight_decay=-1.0), "weight_decay"), (dict(nesterov=True), "nesterov"),
                                         (dict(differentiable=True), "differentiable")])
def test_sgd_bad_arguments(kwargs, word):
    with pytest.raises(ValueError, match=word):
        FusedSGD(make_model().parameters(), **kwargs)


def test_bad_params_and_grads():
    with pytest.raises(TypeError, match="params"):
        FusedAdamW(torch.nn.Parameter(torch.randn(3)))
    with pytest.raises(ValueError, match="empty parameter list"):
        FusedSGD([])
    with pytest.raises(TypeError, match="float64"):
        FusedAdamW([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="amsgrad"):
        FusedAdamW([dict(params=[torch.nn.Parameter(torch.randn(3))], amsgrad=True)])
    opt = FusedAdamW([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group(dict(params=[torch.nn.Parameter(torch.randn(3))], lr=-1))
    assert len(opt.param_groups) == 1
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = FusedSGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    opt = FusedAdamW([torch.nn.Parameter(torch.randn(3))])
    with pytest.raises(TypeError, match="grad_scale"):
        opt.step(grad_scale="big")
