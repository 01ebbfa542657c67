"""SyncBatchNorm (``parallel_layers.data_parallel.sync_batchnorm``) and its statistics op
(``parallel_layers.ops.batch_stats``).

Kernel: every available backend against a float64 oracle of the same (float32-rounded) input: odd sizes, one
element per channel, no rows, NC and NCHW, bf16 input, and a mean of 1e4 with std 1 (where a float32
``sum(x^2) - n mean^2`` would lose every digit): mean within 1e-6 relative, M2 within 1e-5 relative.

Layer: on real gloo ranks (dp 2 and 4), each rank a different, uneven slice of one global batch (a rank
with 0 rows included), against a single-process ``nn.BatchNorm{1,2}d`` on the whole global batch: the
output and input gradient of every rank's slice, the weight and bias gradients summed over ranks (the
data-parallel reduction), the running statistics on every rank after two steps (momentum 0.1 and None),
then an eval-mode forward. fp32 within 1e-5; bf16 input within 2e-2 (the output and input gradient are
rounded to bf16, 2^-8 relative, on values of a few units). Also against torch's ``SyncBatchNorm``
algorithm (``benchmarks/sync_batchnorm.py``: ``torch.nn.SyncBatchNorm`` itself refuses CPU tensors), and
the collectives counted: one all-reduce in forward, one in backward.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from conftest import target_skip_reason

from parallel_layers.data_parallel import SyncBatchNorm, convert_sync_batchnorm
from parallel_layers.ops import _backend, batch_stats
from parallel_layers.testing import cached_mesh

TARGETS = [("cpu", "torch"), ("cpu", "triton"), ("cuda", "torch"), ("cuda", "triton")]


@pytest.fixture(params=TARGETS, ids=[f"{d}-{b}" for d, b in TARGETS])
def where(request):
    device, backend = request.param
    why = target_skip_reason(device, backend) if backend != "torch" or device == "cuda" else None
    if why and device == "cuda" and torch.cuda.is_available() and not _backend.triton_interpreting():
        pytest.fail(f"{backend} on {device} is unavailable on a machine with a GPU: {why}")
    if why:
        pytest.skip(f"{backend} on {device}: {why}")
    return torch.device(device), backend


# ---------------------------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize("shape,mu,dtype", [
    ((3, 5, 7), 0.0, torch.float32), ((1, 3), 0.0, torch.float32), ((1, 2, 1, 1), 0.0, torch.float32),
    ((5, 3), 2.0, torch.float32), ((7, 4, 33, 3), 1e4, torch.float32), ((1100, 3), 1e4, torch.float32),
    ((9, 6, 13), -3.0, torch.bfloat16), ((0, 3, 4), 0.0, torch.float32), ((2, 0, 3), 0.0, torch.float32)],
    ids=["odd", "nc-1row", "1-per-channel", "nc", "mean1e4", "mean1e4-2splits", "bf16", "no-rows", "no-channels"])
def test_batch_stats_matches_float64(where, shape, mu, dtype):
    device, backend = where
    g = torch.Generator().manual_seed(sum(shape) + 1)
    x = (torch.randn(*shape, generator=g, dtype=torch.float64) + mu).to(dtype)
    mean, m2, count = batch_stats(x.to(device), backend=backend)
    xd = x.double().reshape(shape[0], shape[1], -1) if x.numel() else None
    assert count == (x.numel() // shape[1] if shape[1] else 0) or not x.numel()
    assert mean.dtype == m2.dtype == torch.float32 and mean.shape == m2.shape == (shape[1],)
    if xd is None:
        assert not mean.any() and not m2.any()
        return
    want_mean = xd.mean((0, 2))
    want_m2 = (xd - want_mean[None, :, None]).square().sum((0, 2))
    got_mean, got_m2 = mean.cpu().double(), m2.cpu().double()
    assert ((got_mean - want_mean).abs() <= 1e-6 * want_mean.abs().clamp_min(1)).all(), (got_mean, want_mean)
    assert ((got_m2 - want_m2).abs() <= 1e-5 * want_m2 + 1e-6).all(), (got_m2, want_m2)


def test_batch_stats_rejects_a_1d_input():
    with pytest.raises(ValueError, match="batch_stats: x must have"):
        batch_stats(torch.ones(4))


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("shape", [(6, 4), (5, 4, 9), (6, 4, 5, 3), (3, 4, 2, 3, 2)], ids=["1d", "1d-len", "2d", "3d"])
@pytest.mark.parametrize("affine,momentum", [(True, 0.1), (False, None)], ids=["affine", "plain-cumulative"])
def test_without_a_process_group_it_is_batchnorm(shape, affine, momentum):
    bn = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    torch.manual_seed(0)
    ref = bn(4, affine=affine, momentum=momentum)
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
    ours = convert_sync_batchnorm(copy.deepcopy(ref), None)
    assert isinstance(ours, SyncBatchNorm)
    for step in range(3):
        x = torch.randn(*shape) * 3 + 2
        gy = torch.randn(*shape)
        outs = []
        for m in (ref, ours):
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.backward(gy)
            outs.append((y, xi.grad))
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
        assert ours.num_batches_tracked == ref.num_batches_tracked == step + 1
    for m in (ref, ours):
        m.eval()
    x = torch.randn(*shape)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-6, atol=1e-6)


def test_convert_sync_batchnorm_replaces_every_batchnorm_and_shares_state():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                          nn.Sequential(nn.Flatten(), nn.Linear(4, 5), nn.BatchNorm1d(5, affine=False, momentum=None)),
                          nn.LayerNorm(5))
    model[2][2].eval()
    bn2, bn1 = model[1], model[2][2]
    keys = list(model.state_dict())
    out = convert_sync_batchnorm(model, process_group=None)
    assert out is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][2], SyncBatchNorm)
    assert isinstance(model[3], nn.LayerNorm) and isinstance(model[0], nn.Conv2d)
    assert model[1].weight is bn2.weight and model[1].bias is bn2.bias
    assert model[1].running_mean is bn2.running_mean and model[1].num_batches_tracked is bn2.num_batches_tracked
    assert model[2][2].weight is None and model[2][2].momentum is None and not model[2][2].training
    assert model[1].training and model[2][2].running_var is bn1.running_var
    assert list(model.state_dict()) == keys      # the same state dict: checkpoints load either way
    assert sum(isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
               for m in model.modules()) == 0


# ---------------------------------------------------------------------------------------------- distributed
SIZES = {2: [5, 8], 4: [3, 0, 6, 4]}   # uneven local batches; dp 4 has a rank with no rows


def body_parity(rank, world, shape_rest, affine, momentum, dtype_name, backend):
    from benchmarks.sync_batchnorm import TorchSyncBatchNorm, count_collectives

    dtype = getattr(torch, dtype_name)
    mesh = cached_mesh(dp=world)
    group = mesh.dp_group
    sizes = SIZES[world]
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    channels = shape_rest[0]
    bn = nn.BatchNorm1d if len(shape_rest) < 3 else nn.BatchNorm2d
    torch.manual_seed(0)
    ref = bn(channels, affine=affine, momentum=momentum)
    if affine:
        with torch.no_grad():
            ref.weight.uniform_(0.5, 1.5)
            ref.bias.uniform_(-1, 1)
    ours = convert_sync_batchnorm(copy.deepcopy(ref), group, backend=backend)
    torch_algo = TorchSyncBatchNorm(channels, momentum=momentum or 0.1, affine=affine, process_group=group)
    torch_algo.load_state_dict(ref.state_dict())
    errs = {}

    def err(name, got, want):
        d = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        errs[name] = max(errs.get(name, 0.0), d)

    for step in range(2):
        g = torch.Generator().manual_seed(10 + step)
        x = (torch.randn(sum(sizes), *shape_rest, generator=g) * 2 + 3).to(dtype)
        gy = torch.randn(sum(sizes), *shape_rest, generator=g).to(dtype)
        xr = x.float().clone().requires_grad_()
        yr = ref(xr)
        yr.backward(gy.float())
        xo = x[lo:hi].clone().requires_grad_()
        held = []

        def run():
            held.append(ours(xo))
            held[0].backward(gy[lo:hi])
        counted = count_collectives(run)   # one forward and one backward of the layer
        yo = held[0]
        err("y", yo, yr[lo:hi])
        err("dx", xo.grad, xr.grad[lo:hi])
        if dtype == torch.float32:
            xt = x[lo:hi].clone().requires_grad_()
            yt = torch_algo(xt)
            yt.backward(gy[lo:hi])
            err("y_vs_torch", yo, yt)
            err("dx_vs_torch", xo.grad, xt.grad)
        if affine:
            grads = torch.cat([ours.weight.grad, ours.bias.grad]).float()
            dist.all_reduce(grads, group=group)      # the data-parallel gradient reduction
            err("dw_db", grads, torch.cat([ref.weight.grad, ref.bias.grad]))
            for m in (ref, ours, torch_algo):
                m.zero_grad()
        err("running_mean", ours.running_mean, ref.running_mean)
        err("running_var", ours.running_var, ref.running_var)
    ours.eval()
    ref.eval()
    x = torch.randn(4, *shape_rest).to(dtype)
    err("eval", ours(x), ref(x.float()))
    return dict(errs=errs, counts=counted, tracked=int(ours.num_batches_tracked))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape_rest,affine,momentum", [((6, 5, 3), True, 0.1), ((6,), False, None),
                                                         ((3, 4, 4), True, None)],
                         ids=["2d-affine", "1d-plain-cumulative", "2d-affine-cumulative"])
def test_matches_one_process_on_the_global_batch(dist_pools, world, shape_rest, affine, momentum):
    results = dist_pools(world).run(body_parity, shape_rest, affine, momentum, "float32", None)
    for rank, out in enumerate(results):
        for name, e in out["errs"].items():
            assert e <= 1e-5, f"rank {rank} (rows {SIZES[world][rank]}): {name} differs by {e:.2e}"
        assert out["counts"] == {"all_reduce": 2}, f"rank {rank}: collectives {out['counts']}"
        assert out["tracked"] == 2


def test_bf16_input_and_the_triton_statistics_kernel(dist_pools):
    if not _backend.triton_interpreting():
        pytest.skip("the triton backend on CPU tensors needs TRITON_INTERPRET=1")
    for dtype, backend, tol in (("bfloat16", None, 2e-2), ("float32", "triton", 1e-5)):
        results = dist_pools(2).run(body_parity, (6, 5, 3), True, 0.1, dtype, backend)
        for rank, out in enumerate(results):
            for name, e in out["errs"].items():
                # running statistics come from float32 statistics of the bf16 values: as exact as in fp32
                bound = 1e-5 if name.startswith("running") else tol
                assert e <= bound, f"{dtype}/{backend} rank {rank}: {name} differs by {e:.2e} (bound {bound})"


def test_benchmark_smoke_rows():
    from benchmarks import sync_batchnorm as bench

    rows = bench.collect("smoke", torch.device("cpu"))
    assert len(rows) == len(bench.PROFILES["smoke"]["shapes"])
    for r in rows:
        assert r["ours_collectives"] == 2 and r["base_collectives"] == 2
        assert "1 all_gather + 1 all_reduce" in r["baseline"] and r["ours_median_ms"] > 0 and r["speedup"] > 0


# ---------------------------------------------------------------------------------------------- in DataParallel
def _convnet():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3),
                         nn.BatchNorm2d(4, momentum=None), nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
                         nn.BatchNorm1d(5))


def body_data_parallel(rank, world, steps):
    from parallel_layers.data_parallel import DataParallel

    mesh = cached_mesh(dp=world)
    torch.manual_seed(0)
    dense = _convnet()
    model = convert_sync_batchnorm(copy.deepcopy(dense), mesh.dp_group)
    ddp = DataParallel(model, mesh.dp_group)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (dense, model)]
    per = 8 // world
    sl = slice(rank * per, (rank + 1) * per)
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 3, 6, 6, generator=g) + 1
        y = torch.randint(0, 5, (8,), generator=g)
        for o in opts:
            o.zero_grad()
        nn.functional.cross_entropy(dense(x), y).backward()
        nn.functional.cross_entropy(ddp(x[sl]), y[sl]).backward()   # DataParallel averages: the global mean
        for o in opts:
            o.step()
        got = model.state_dict()
        assert list(got) == list(dense.state_dict())
        for a, b in zip(dense.state_dict().values(), got.values()):
            if a.is_floating_point():
                worst = max(worst, (a - b).abs().max().item() / max(1.0, a.abs().max().item()))
    return worst


def test_inside_data_parallel_trains_like_one_process(dist_pools):
    """A conv net's batch norms converted, wrapped in ``DataParallel`` at dp 2, three SGD steps: parameters
    and running statistics of every rank equal one process on the global batch (1e-5)."""
    for rank, err in enumerate(dist_pools(2).run(body_data_parallel, 3)):
        assert err <= 1e-5, f"rank {rank}: state differs by {err:.2e}"
