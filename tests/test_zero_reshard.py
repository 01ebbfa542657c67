"""ZeRO state saved at one data-parallel size and resumed at another (``full_state_dict`` /
``load_full_state_dict``): 2 steps at dp = 4, the full state saved, 3 steps at dp = 2 in fresh processes
(and the other way round) from another init, against single-process torch AdamW over the same 5
steps, every rank checked. Stages 1 and 2 (bucket order rebuilt after the first backward, so the state
is also moved within the resumed run) and stage 3."""
import pytest
import torch

from parallel_layers.testing import WorkerPool, cached_mesh
from parallel_layers.testing.compare import worst

# bias=False: see tests/test_zero.py (the key bias's gradient is rounding noise that Adam amplifies)
CFG = dict(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, bias=False)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
SAVED_AT, STEPS = 2, 5


def _batches():
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, CFG["vocab_size"], (8, 12), generator=gen)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _build(world, stage, seed):
    """(module to call, optimizer, function returning the full parameters) at dp = ``world``."""
    from parallel_layers.data_parallel.ddp import DataParallel
    from parallel_layers.models import GPT, GPTConfig
    from parallel_layers.zero import ZeroOptimizer
    from parallel_layers.zero.stage3 import ZeroStage3
    from parallel_layers.zero.stage3_optimizer import ZeroStage3Optimizer

    group = cached_mesh(dp=world).dp_group
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    if stage == 3:
        z = ZeroStage3(model, group)
        return z, ZeroStage3Optimizer(z, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), z.full_state_dict
    dp = DataParallel(model, group, reduce_op="reduce_scatter", bucket_cap_mb=0.02, first_bucket_cap_mb=0.02,
                      rebuild_bucket_order=True)
    opt = ZeroOptimizer(dp, stage=stage, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return dp, opt, lambda: {k: v.clone() for k, v in model.state_dict().items()}


def _train(module, opt, batches, rank, world):
    for x, y in batches:
        _, loss = module(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()


def body_save(rank, world, stage, path):
    module, opt, _ = _build(world, stage, seed=0)
    _train(module, opt, _batches()[:SAVED_AT], rank, world)
    full = opt.full_state_dict()                       # a collective: every rank calls it
    if rank == 0:
        torch.save(full, path)
    return full["step"]


def body_resume(rank, world, stage, path):
    module, opt, params = _build(world, stage, seed=99)    # another init: everything comes from the file
    opt.load_full_state_dict(torch.load(path, weights_only=True))
    _train(module, opt, _batches()[SAVED_AT:], rank, world)
    return params()


def _reference():
    from parallel_layers.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for x, y in _batches():
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


STAGES = (1, 2, 3)


def body_save_stages(rank, world, path):
    return [body_save(rank, world, stage, f"{path}.{stage}") for stage in STAGES]


def body_resume_stages(rank, world, path):
    return [body_resume(rank, world, stage, f"{path}.{stage}") for stage in STAGES]


@pytest.mark.parametrize("saved_dp,resumed_dp", [(4, 2), (2, 4)])
def test_zero_state_resumes_at_another_dp_size(dist_pools, tmp_path, saved_dp, resumed_dp):
    """Every stage (1, 2, 3), each from its own file; the fresh processes that resume are started once for
    the three."""
    path = str(tmp_path / "zero_full.pt")
    assert dist_pools(saved_dp).run(body_save_stages, path, timeout=240) == [[SAVED_AT] * 3] * saved_dp
    with WorkerPool(resumed_dp) as pool:
        resumed = pool.run(body_resume_stages, path, timeout=240)
    ref = _reference()
    for r, per_stage in enumerate(resumed):
        for stage, params in zip(STAGES, per_stage):
            err, name = worst((_rel(params[k], v), k) for k, v in ref.items())
            assert err < 1e-5, (r, stage, name, err)


def test_load_full_state_dict_names_what_is_missing(dist_pools, tmp_path):
    path = str(tmp_path / "zero_full.pt")
    dist_pools(2).run(body_save, 1, path, timeout=120)
    full = torch.load(path, weights_only=True)
    del full["state"]["wte.weight"]
    torch.save(full, path)
    with WorkerPool(2) as pool, pytest.raises(Exception, match=r"no state for 1 parameters.*wte.weight"):
        pool.run(body_resume, 1, path, timeout=120)
