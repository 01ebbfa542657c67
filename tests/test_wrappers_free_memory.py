"""A wrapper dropped by its user frees its model, buffers and optimizer state (a sweep over layouts in one
process, a notebook, the planner's one-GPU check). torch keeps a parameter's hooks where Python's garbage
collector cannot follow them, so a hook holding its wrapper made an uncollectable cycle: on an H100 the
planner check ran out of memory after eleven layouts of one process (74 GB held). Every rank is checked."""
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _live_bytes():
    from parallel_layers.planner.measure import live_tensor_bytes
    return live_tensor_bytes()


def _dp(group):
    from parallel_layers.data_parallel.ddp import DataParallel
    return DataParallel(_model(), group), None


def _zero(stage):
    def build(group):
        from parallel_layers.data_parallel.ddp import DataParallel
        from parallel_layers.zero.optimizer import ZeroOptimizer
        dp = DataParallel(_model(), group, reduce_op="reduce_scatter" if stage == 2 else "all_reduce")
        return dp, ZeroOptimizer(dp, stage=stage, lr=1e-3)
    return build


def _zero3(group):
    from parallel_layers.zero.stage3 import ZeroStage3
    from parallel_layers.zero.stage3_optimizer import ZeroStage3Optimizer
    z = ZeroStage3(_model(), group)
    return z, ZeroStage3Optimizer(z, lr=1e-3)


def _parallel3d(group):
    from parallel_layers.composition.config import DataParallelConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPTConfig
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)
    return Parallel3D(cfg, ParallelMesh(dp=2), data_parallel=DataParallelConfig(zero=1)), None


BUILDERS = {"data_parallel": _dp, "zero1": _zero(1), "zero2": _zero(2), "zero3": _zero3, "parallel3d": _parallel3d}


def body_dropped_wrappers_free_everything(rank, world, name):
    group = cached_mesh(dp=world).dp_group
    before = None
    for i in range(3):     # built, trained one step, dropped; the first round leaves what a process keeps once
        wrapper, opt = BUILDERS[name](group)
        if name == "parallel3d":
            x = torch.randint(0, 64, (8, 16))
            wrapper.train_step(x, x)
        else:
            wrapper(torch.randn(4, 32)).square().mean().backward()
            if opt is not None:
                opt.step()
        held = _live_bytes() - before if before is not None else 0
        ref = weakref.ref(wrapper)
        del wrapper, opt
        gc.collect()
        if i == 0:
            before = _live_bytes()
            continue
        alive = ref() is not None
        after = _live_bytes() - before
        if alive or after > 0:
            return alive, held, after
    return False, held, after


@pytest.mark.parametrize("name", list(BUILDERS))
def test_dropped_wrappers_free_everything(dist_pools, name):
    for rank, (alive, held, after) in enumerate(dist_pools(2).run(body_dropped_wrappers_free_everything, name)):
        assert held > 0, (rank, name, "the wrapper held no tensors: the check would measure nothing")
        assert not alive, (rank, name, "the wrapper is still alive after del and gc.collect()")
        assert after <= 0, (rank, name, f"{after} bytes of tensors outlive each dropped wrapper")
