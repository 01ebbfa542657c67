"""``torch.compile`` of the tensor-parallel layers, the reference GPT's blocks and ``Parallel3D`` stages (issue 46).

What each test proves (all on CPU, gloo, fp32; inductor compiles in C++ on this machine):

* ``test_fused_linear_op_passes_opcheck``: ``parallel_layers::fused_linear`` (the custom op ``fused_linear`` calls
  under compile) has a schema, fake implementation and autograd formula that agree with its real kernel
  (``torch.library.opcheck``: fake-tensor shapes, AOT dispatch, autograd registration), and its gradients are the
  eager ``_FusedLinear``'s.
* ``test_tp_pair_has_no_graph_break``: ``ColumnParallelLinear(activation="gelu") -> RowParallelLinear`` traces
  into one graph with 0 breaks (``torch._dynamo.explain``) on a one-rank group and on a 2-rank gloo group, with
  and without sequence parallelism (before this change: 5 breaks at tp 1, from ``grad_needed``'s autograd-node
  lookups and the collectives' host-side shape checks).
* ``test_tp_pair_inductor_matches_eager_tp2``: ``torch.compile(fullgraph=True, backend="inductor")`` of both
  pairs (plain and sequence-parallel) in one graph gives the eager outputs and gradients (input, weights,
  biases) within 1e-5 at tp 2.
* ``test_gpt_blocks_compile_without_break_tp2``: every block of the reference GPT at tp 2 (plain and sequence
  parallel) is one graph with 0 breaks, and with each block compiled (``block.compile(fullgraph=True)``,
  aot_eager: the fake and autograd paths of the ops and collectives, without the C++ compile) the loss and
  every gradient equal eager's within 1e-5.
* ``test_parallel3d_compile_matches_eager``: ``Parallel3D(pipeline=PipelineConfig(compile=...))`` at tp 2 with
  sequence parallelism trains 3 steps with the eager run's losses within 1e-5 (aot_eager, fullgraph: a break
  inside a block would raise); the inductor variant of it is marked slow (about 20 s on 2 cores).
* ``test_compile_refused_with_split_backward``: the zero-bubble schedules refuse ``compile`` when configured.
"""
from __future__ import annotations

import pytest
import torch

from parallel_layers.testing.workers import cached_mesh

TOL = 1e-5


def _tp_group(tp: int):
    # tp 1: the one-rank tp group of a dp=2 mesh (every rank in its own group); tp 2: both ranks
    return cached_mesh(tp=tp, dp=2 // tp).tp_group


def _pair(group, sp: bool, seed: int = 0):
    from parallel_layers.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    torch.manual_seed(seed)
    col = ColumnParallelLinear(16, 32, tp_group=group, activation="gelu", sequence_parallel=sp)
    row = RowParallelLinear(32, 16, tp_group=group, sequence_parallel=sp)
    return col, row


# ---------------------------------------------------------------------- the custom op
def test_fused_linear_op_passes_opcheck():
    from parallel_layers.ops.linear import fused_linear, fused_linear_op
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=g, requires_grad=True)
    w = torch.randn(4, 8, generator=g, requires_grad=True)
    b = torch.randn(4, generator=g, requires_grad=True)
    for activation in (None, "gelu", "silu"):
        torch.library.opcheck(fused_linear_op, (x, w, b, activation, None, None, activation is not None))
        y_op, _ = fused_linear_op(x, w, b, activation, None, None, activation is not None)
        grads_op = torch.autograd.grad(y_op.square().sum(), (x, w, b))
        y = fused_linear(x, w, b, activation=activation)
        grads = torch.autograd.grad(y.square().sum(), (x, w, b))
        assert torch.equal(y_op, y)
        for a, e in zip(grads_op, grads):
            torch.testing.assert_close(a, e, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------- the TP pair
def body_explain(rank, world):
    counts = {}
    for tp in (1, 2):
        for sp in (False, True):
            col, row = _pair(_tp_group(tp), sp)
            x = torch.randn(2, 4 // tp if sp else 4, 16, requires_grad=True)
            torch._dynamo.reset()
            exp = torch._dynamo.explain(lambda t: row(col(t)))(x)
            counts[f"tp{tp} sp={sp}"] = (exp.graph_count, exp.graph_break_count,
                                         [r.reason.splitlines()[0] for r in exp.break_reasons])
    torch._dynamo.reset()
    return counts


def test_tp_pair_has_no_graph_break(dist_pools):
    for counts in dist_pools(2).run(body_explain):
        assert counts == {k: (1, 0, []) for k in counts} and len(counts) == 4, counts


def body_inductor(rank, world):
    group = _tp_group(2)
    col, row = _pair(group, False, seed=0)
    col_sp, row_sp = _pair(group, True, seed=1)
    params = [*col.parameters(), *row.parameters(), *col_sp.parameters(), *row_sp.parameters()]

    def both(x, x_sp):
        return row(col(x)), row_sp(col_sp(x_sp))

    g = torch.Generator().manual_seed(2)
    x, x_sp = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)   # x_sp: this rank's shard
    dy, dy_sp = torch.randn(2, 4, 16, generator=g), torch.randn(2, 2, 16, generator=g)

    def run(fn):
        for p in params:
            p.grad = None
        a, b = x.clone().requires_grad_(), x_sp.clone().requires_grad_()
        y, y_sp = fn(a, b)
        torch.autograd.backward((y, y_sp), (dy, dy_sp))
        return [y.detach(), y_sp.detach(), a.grad, b.grad] + [p.grad.clone() for p in params]

    eager = run(both)
    torch._dynamo.reset()
    compiled = run(torch.compile(both, fullgraph=True, backend="inductor"))
    torch._dynamo.reset()
    return max((c - e).abs().max().item() for c, e in zip(compiled, eager))


def test_tp_pair_inductor_matches_eager_tp2(dist_pools):
    assert max(dist_pools(2).run(body_inductor, timeout=300)) <= TOL


# ---------------------------------------------------------------------- the reference GPT, block by block
def body_gpt_blocks(rank, world, sp):
    from parallel_layers.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, sequence_parallel=sp)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=_tp_group(2))
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    h = model.embed(idx).detach()
    counts = []
    for block in model.blocks:
        torch._dynamo.reset()
        exp = torch._dynamo.explain(block)(h)
        counts.append((exp.graph_count, exp.graph_break_count))
    torch._dynamo.reset()

    def step():
        model.zero_grad(set_to_none=True)
        _, loss = model(idx, targets)
        loss.backward()
        model.finish_grads()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]

    eager = step()
    for block in model.blocks:
        block.compile(backend="aot_eager", fullgraph=True)
    compiled = step()
    torch._dynamo.reset()
    return counts, max((c - e).abs().max().item() for c, e in zip(compiled, eager))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
def test_gpt_blocks_compile_without_break_tp2(dist_pools, sp):
    for counts, err in dist_pools(2).run(body_gpt_blocks, sp, timeout=300):
        assert counts == [(1, 0), (1, 0)]
        assert err <= TOL


# ---------------------------------------------------------------------- Parallel3D
def body_parallel3d(rank, world, options):
    from parallel_layers import Parallel3D, PipelineConfig
    from parallel_layers.models.gpt import GPTConfig
    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16, sequence_parallel=True)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randint(0, 64, (4, 8), generator=g) for _ in range(3)]
    losses = {}
    for name, compile in (("eager", False), ("compiled", options)):
        torch._dynamo.reset()
        model = Parallel3D(cfg, cached_mesh(tp=2), seed=0, replica_check=None,
                           pipeline=PipelineConfig(num_microbatches=2, compile=compile))
        losses[name] = [model.train_step(x, torch.roll(x, -1, 1))["loss"] for x in inputs]
    torch._dynamo.reset()
    return losses


def _check_parallel3d(per_rank):
    for losses in per_rank:
        assert len(losses["compiled"]) == 3
        for c, e in zip(losses["compiled"], losses["eager"]):
            assert abs(c - e) <= TOL, losses


def test_parallel3d_compile_matches_eager(dist_pools):
    _check_parallel3d(dist_pools(2).run(body_parallel3d, {"backend": "aot_eager", "fullgraph": True}, timeout=300))


def test_parallel3d_inductor_matches_eager(dist_pools):
    _check_parallel3d(dist_pools(2).run(body_parallel3d, {"fullgraph": True}, timeout=600))


def test_compile_refused_with_split_backward():
    from parallel_layers import PipelineConfig
    for schedule in ("zb-h1", "zbv"):
        with pytest.raises(ValueError, match="splits each backward"):
            PipelineConfig(schedule=schedule, compile=True)
    with pytest.raises(ValueError, match="compile="):
        PipelineConfig(compile="yes")
    assert PipelineConfig(compile={"backend": "aot_eager"}).compile == {"backend": "aot_eager"}
