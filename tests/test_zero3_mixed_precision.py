"""ZeroStage3 with bf16 parameters and fp32 gradient reduction (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``): the gradients autograd makes in bf16 are accumulated over micro-batches and reduced over dp
in fp32, per unit (``no_sync``) and in held mode (``gather_all`` .. ``reduce_scatter_and_free``, as inside a
pipeline). Checked bit for bit against the same sums done by hand on each rank: dp 2, so the reduction's sum of
two terms and its halving are exact whatever the order. ``reduce_dtype=torch.bfloat16`` keeps the low-precision
reduction (each sum rounded to bf16), checked bit for bit too.
"""
import copy

import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh

MICRO, WIDTH = 4, 24


class _Net(nn.Module):
    """Root parameters at both ends (used first and last, as a GPT's embeddings and head) around three units."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.out(h).float().square().mean()


def _micro_batches(rank):
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(5, 8, generator=gen).to(torch.bfloat16) for _ in range(MICRO)]


def _bf16_grads(model, x):
    """The bf16 gradients of one micro-batch, as autograd makes them (one backward from no gradient)."""
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _expected(dense, world, reduce_dtype):
    """Every parameter's gradient shard as ZeroStage3 should hold it after the micro-batches of every rank:
    each rank's micro-batch gradients summed in ``reduce_dtype`` (rounded at each sum when it is bf16), the
    ranks' sums added in ``reduce_dtype``, then halved into fp32."""
    per_rank = []
    for r in range(world):
        acc = {}
        for x in _micro_batches(r):
            for n, g in _bf16_grads(dense, x).items():
                acc[n] = acc[n] + g.to(reduce_dtype) if n in acc else g.to(reduce_dtype)
        per_rank.append(acc)
    assert world == 2          # a sum of two terms: the same bits in any order
    return {n: (per_rank[0][n] + per_rank[1][n]).float() / world for n in per_rank[0]}, per_rank


def _shard_of(z, opt, full):
    """This rank's pieces of ``full`` (by the module's parameter names), laid out as ``z.grad_buffer``."""
    names = {id(p): n for n, p in z.module.named_parameters()}
    out = torch.zeros(z.shard_numel, dtype=torch.float32)
    for p, start_p, start_s, n in opt.shard_pieces():
        out[start_s:start_s + n] = full[names[id(p)]].reshape(-1)[start_p:start_p + n]
    return out


def _run_per_unit(z, rank):
    xs = _micro_batches(rank)
    for i, x in enumerate(xs):
        if i < len(xs) - 1:
            with z.no_sync():
                z(x).backward()
        else:
            z(x).backward()            # the last one reduces the sum once


def _run_held(z, rank):
    """As Parallel3D's ZeRO-3 mode drives it: every unit gathered once, all micro-batches, one reduction."""
    z.gather_all()
    for x in _micro_batches(rank):
        z(x).backward()
    held = {n: (z.accumulated_grad(p).clone(), p.grad.dtype) for n, p in z.module.named_parameters()}
    z.reduce_scatter_and_free()
    return held


def body_reduce_dtype(rank, world, mode, reduce_name):
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    reduce_dtype = getattr(torch, reduce_name)
    torch.manual_seed(0)
    dense = _Net().to(torch.bfloat16)
    z = ZeroStage3(copy.deepcopy(dense), cached_mesh(dp=world).dp_group, min_unit_numel=0,
                   reduce_dtype=reduce_dtype)
    opt = ZeroStage3Optimizer(z, lr=1e-3)
    held = _run_held(z, rank) if mode == "held" else _run_per_unit(z, rank)
    full, per_rank = _expected(dense, world, reduce_dtype)
    want = _shard_of(z, opt, full)
    out = {"dtypes": (z.reduce_dtype, z.units[1].grad_full.dtype, z.grad_buffer.dtype),
           "equal": torch.equal(z.grad_buffer, want),
           "err": ((z.grad_buffer - want).norm() / want.norm()).item()}
    # what the other reduction would have given differs: the test tells the two apart
    other = torch.bfloat16 if reduce_dtype == torch.float32 else torch.float32
    out["differs_from_other"] = not torch.equal(z.grad_buffer, _shard_of(z, opt, _expected(dense, world, other)[0]))
    if held is not None:
        out["held_equal"] = all(torch.equal(g, per_rank[rank][n]) for n, (g, _) in held.items())
        out["held_dtypes"] = {str(g.dtype) for g, _ in held.values()} | {str(d) for _, d in held.values()}
    return out


@pytest.mark.parametrize("mode", ["per_unit", "held"])
@pytest.mark.parametrize("reduce_name", ["float32", "bfloat16"])
def test_gradients_are_reduced_in_reduce_dtype(dist_pools, mode, reduce_name):
    for out in dist_pools(2).run(body_reduce_dtype, mode, reduce_name):
        reduce_dtype = getattr(torch, reduce_name)
        assert out["dtypes"] == (reduce_dtype, reduce_dtype, torch.float32), out["dtypes"]
        assert out["equal"], f"gradient shard off the {reduce_name} sums by {out['err']:.2e}"
        assert out["differs_from_other"]
        if mode == "held":
            # the micro-batches accumulate in reduce_dtype, and p.grad reads that accumulation
            assert out["held_equal"] and out["held_dtypes"] == {str(reduce_dtype)}, out


def body_bf16_shard(rank, world):
    """``grad_dtype=torch.bfloat16`` (the shard) under the default fp32 reduction: each reduction's average is
    rounded once into the shard; a second reduction before zero_grad() adds to it in fp32, rounded once."""
    from parallel_layers.zero import ZeroStage3, ZeroStage3Optimizer

    torch.manual_seed(0)
    dense = _Net().to(torch.bfloat16)
    z = ZeroStage3(copy.deepcopy(dense), cached_mesh(dp=world).dp_group, min_unit_numel=0,
                   grad_dtype=torch.bfloat16)
    opt = ZeroStage3Optimizer(z, lr=1e-3)
    want = _shard_of(z, opt, _expected(dense, world, torch.float32)[0])
    _run_per_unit(z, rank)
    once = z.grad_buffer.clone()
    _run_per_unit(z, rank)            # the same micro-batches again: the same average, added
    first = want.to(torch.bfloat16)
    return (z.reduce_dtype, once.dtype, torch.equal(once, first),
            torch.equal(z.grad_buffer, (want + first.float()).to(torch.bfloat16)))


def test_bf16_gradient_shard_of_an_fp32_reduction(dist_pools):
    for reduce_dtype, shard_dtype, once, twice in dist_pools(2).run(body_bf16_shard):
        assert (reduce_dtype, shard_dtype) == (torch.float32, torch.bfloat16)
        assert once and twice


def test_reduce_dtype_defaults_to_fp32_for_low_precision_parameters():
    from parallel_layers.zero import ZeroStage3

    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32)):
        torch.manual_seed(0)
        z = ZeroStage3(_Net().to(dtype), None, min_unit_numel=0)
        assert z.reduce_dtype == want and all(u.grad_full.dtype == want for u in z.units)
        # the old default (reductions in the parameter dtype) is one argument away
        z = ZeroStage3(_Net().to(dtype), None, min_unit_numel=0, reduce_dtype=dtype)
        assert z.reduce_dtype == dtype


def test_bad_reduce_dtype_is_refused():
    from parallel_layers.zero import ZeroStage3

    for dtype, bad in ((torch.bfloat16, torch.float16), (torch.bfloat16, torch.float64),
                       (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int32)):
        with pytest.raises(ValueError, match=rf"ZeroStage3: reduce_dtype={bad} for {dtype} parameters.*"
                                             rf"float32.*reduce_dtype=None"):
            ZeroStage3(_Net().to(dtype), None, reduce_dtype=bad)
    with pytest.raises(TypeError, match="ZeroStage3: reduce_dtype='fp32' is not a torch.dtype"):
        ZeroStage3(_Net(), None, reduce_dtype="fp32")
