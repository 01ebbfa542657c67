"""parallel_layers._C.GradViewChecker and FlatBuffer's use of it (the fast path of FlatBuffer.collect)."""
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

from parallel_layers import _extension
from parallel_layers.optim import FusedAdamW

warnings.filterwarnings("ignore", message="parallel_layers: no fused kernel backend")

RTOL, ATOL = 1e-5, 1e-6


def _ext():
    ext, why = _extension.load()
    if ext is None or not hasattr(ext, "GradViewChecker"):
        pytest.skip(f"C++ extension with GradViewChecker unavailable: {why}")
    return ext


def _params_and_views(n=7):
    flat = torch.zeros(n * (n + 1) // 2)
    params, views, pos = [], [], 0
    for k in range(1, n + 1):
        params.append(torch.nn.Parameter(torch.randn(k)))
        views.append(flat[pos:pos + k])
        pos += k
    for p, v in zip(params, views):
        p.grad = v
    return params, views


# ---------------------------------------------------------------------------------------- the checker
def test_checker_all_views():
    ext = _ext()
    params, views = _params_and_views()
    ck = ext.GradViewChecker(params, views)
    assert len(ck) == len(params)
    assert ck.all_views()
    assert ext.GradViewChecker([], []).all_views()   # vacuously true, like all([])


def test_checker_fresh_tensor_is_false():
    ext = _ext()
    params, views = _params_and_views()
    ck = ext.GradViewChecker(params, views)
    params[3].grad = views[3].clone()                # equal values, another tensor
    assert not ck.all_views()
    params[3].grad = views[3].view(views[3].shape)   # another view of the same memory is not *the* view
    assert not ck.all_views()
    params[3].grad = views[3]
    assert ck.all_views()


@pytest.mark.parametrize("where", [0, 3, 6])
def test_checker_none_is_false(where):
    ext = _ext()
    params, views = _params_and_views()
    ck = ext.GradViewChecker(params, views)
    params[where].grad = None
    assert not ck.all_views()


def test_checker_never_set_grad_is_false():
    ext = _ext()
    params = [torch.nn.Parameter(torch.randn(3))]
    assert not ext.GradViewChecker(params, [torch.zeros(3)]).all_views()


def test_checker_length_mismatch_raises():
    ext = _ext()
    params, views = _params_and_views()
    with pytest.raises(RuntimeError):
        ext.GradViewChecker(params, views[:-1])


def test_checker_keeps_views_alive():
    """The expected pointers stay valid (no address reuse) even when the caller drops its views."""
    ext = _ext()
    params, views = _params_and_views()
    ck = ext.GradViewChecker(params, views)
    for p in params:
        p.grad = None
    del views
    assert not ck.all_views()


# ---------------------------------------------------------------------------------------- the optimizer
def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 9), torch.nn.Tanh(),
                               torch.nn.Linear(9, 3))


def _backward(models, x):
    for m in models:
        m(x).pow(2).mean().backward()


def test_fast_path_matches_torch_across_set_to_none():
    _ext()
    m1 = make_model()
    m2 = make_model()
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
    o1, o2 = FusedAdamW(m1.parameters(), backend="cpp", **hyper), torch.optim.AdamW(m2.parameters(), **hyper)
    (fb,) = o1.flat_buffers[0]
    x = torch.randn(5, 6)

    def step(set_to_none):
        o1.zero_grad(set_to_none=set_to_none)
        o2.zero_grad(set_to_none=set_to_none)
        _backward((m1, m2), x)
        o1.step()
        o2.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)

    step(True)                      # first step: fresh grads, packed by the Python path
    assert fb.slow_collects == 1 and fb.fast_check_available
    step(False)                     # grads are views now: fast path
    assert fb.slow_collects == 1
    step(True)                      # set_to_none + backward: fresh tensors again -> slow path
    assert fb.slow_collects == 2
    assert all(p.grad is v for p, v in zip(fb.params, fb.grad_views))
    step(False)                     # and back on the fast path
    assert fb.slow_collects == 2
    o1.step()                       # no new backward: same grads (views) stepped again, fast
    o2.step()
    assert fb.slow_collects == 2
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_missing_grad_takes_slow_path_and_matches_torch():
    _ext()
    m1, m2 = make_model(), make_model()
    o1, o2 = FusedAdamW(m1.parameters(), lr=1e-2, backend="cpp"), torch.optim.AdamW(m2.parameters(), lr=1e-2)
    (fb,) = o1.flat_buffers[0]
    x = torch.randn(5, 6)
    for it, drop in enumerate([(), (), (1,), (1,), (), ()]):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad(set_to_none=False)
            m(x).pow(2).mean().backward()
            for i, p in enumerate(m.parameters()):
                if i in drop:
                    p.grad = None
        o1.step()
        o2.step()
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        # step 0 packs fresh grads; steps 2, 3 miss a grad; the rest are on the fast path
        assert fb.slow_collects == [1, 1, 2, 3, 4, 4][it]


def test_rebuilt_after_load_state_dict_and_new_views():
    _ext()
    m = make_model()
    opt = FusedAdamW(m.parameters(), lr=1e-2, backend="cpp")
    (fb,) = opt.flat_buffers[0]
    x = torch.randn(5, 6)
    _backward((m,), x)
    opt.step()
    opt.load_state_dict(opt.state_dict())
    base = fb.slow_collects
    opt.zero_grad(set_to_none=False)
    _backward((m,), x)
    opt.step()
    assert fb.slow_collects - base == 0
    # Replacing the views (new list) rebuilds the checker: the old views are no longer "expected".
    builds = fb.checker_builds
    fb.grad_views = [fb.view(fb.grad, i) for i in range(len(fb.params))]
    opt.step()
    assert fb.slow_collects - base == 1 and fb.checker_builds == builds + 1
    assert all(p.grad is v for p, v in zip(fb.params, fb.grad_views))
    opt.step()
    assert fb.slow_collects - base == 1


class _PassThrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_torch_function_mode_uses_python_path():
    _ext()
    m = make_model()
    opt = FusedAdamW(m.parameters(), backend="cpp")
    (fb,) = opt.flat_buffers[0]
    _backward((m,), torch.randn(5, 6))
    opt.step()
    base = fb.slow_collects
    with _PassThrough():
        opt.step()
    assert fb.slow_collects - base == 1
    opt.step()
    assert fb.slow_collects - base == 1


def test_without_extension_same_results(monkeypatch):
    x = torch.randn(5, 6)
    results = []
    for available in (True, False):
        if not available:
            monkeypatch.setattr(_extension, "load", lambda: (None, "disabled by test"))
        m = make_model()
        opt = FusedAdamW(m.parameters(), lr=1e-2, backend="torch")
        (fb,) = opt.flat_buffers[0]
        for set_to_none in (True, False, True, False):
            opt.zero_grad(set_to_none=set_to_none)
            _backward((m,), x)
            opt.step()
        if not available:
            assert not fb.fast_check_available
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checker_params_in_place():
    ext = _ext()
    params, views = _params_and_views()
    homes = [p.detach() for p in params]                 # where each param's data lives now
    ck = ext.GradViewChecker(params, views, homes)
    assert ck.params_in_place()
    with torch.no_grad():
        params[2].data = params[2].data.clone()           # what a wrapper that re-lays out parameters does
    assert not ck.params_in_place()
    params[2].data = homes[2]
    assert ck.params_in_place()
    with pytest.raises(RuntimeError, match="without data views"):
        ext.GradViewChecker(params, views).params_in_place()
