"""Tensor-parallel layers against their dense twins, on real gloo ranks (tp = 1, 2, 4).

Each body builds the dense layer and the sharded layer from one seed on every rank, runs both on the
same (seeded) input, and returns the largest differences of output, input gradient and gathered
weight/bias gradients per configuration; the test process checks every rank's numbers. float64
throughout, so any difference beyond rounding is a bug, not noise.
"""
import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers.distributed import collectives as C
from parallel_layers.tensor_parallel.embedding import VocabParallelEmbedding
from parallel_layers.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
)
from parallel_layers.tensor_parallel.random import TENSOR_PARALLEL_RNG, tensor_parallel_rng_tracker
from parallel_layers.testing import RankFailure, cached_mesh

F64 = torch.float64
TOL = 1e-11


def gather(t, dim, group):
    """Concatenate every rank's ``t`` along ``dim`` (rank order)."""
    return C.all_gather_dim0(t.detach().movedim(dim, 0).contiguous(), group).movedim(0, dim)


def diff(a, b):
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a.detach() - b.detach()).abs().max().item() if a.numel() else 0.0


def assert_small(per_rank, tol=TOL):
    for rank, results in enumerate(per_rank):
        for config, diffs in results.items():
            for what, value in diffs.items():
                assert value <= tol, f"rank {rank}, {config}: {what} differs by {value}"


# ---------------------------------------------------------------------- column parallel
def body_column(rank, world):
    group = cached_mesh(tp=world).tp_group
    b, s, fin, fout = 2, 4 * world, 5, 3 * world
    out = {}
    for sp, gather_output, activation, bias in [c + (True,) for c in itertools.product(
            (False, True), (False, True), (None, "gelu"))] + [(True, False, None, False)]:
        torch.manual_seed(11)
        dense = nn.Linear(fin, fout, bias=bias, dtype=F64)
        torch.manual_seed(11)
        layer = ColumnParallelLinear(fin, fout, bias=bias, tp_group=group, gather_output=gather_output,
                                     sequence_parallel=sp, activation=activation, dtype=F64)
        x = torch.randn(b, s, fin, dtype=F64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        g = torch.randn(b, s, fout, dtype=F64, generator=torch.Generator().manual_seed(2))
        y = dense(x)
        y = F.gelu(y) if activation == "gelu" else y
        y.backward(g)

        xp = (x.detach().chunk(world, 1)[rank] if sp else x.detach()).clone().requires_grad_()
        yp = layer(xp)
        y_ref = y if gather_output else y.chunk(world, -1)[rank]
        yp.backward(g if gather_output else g.chunk(world, -1)[rank])
        d = {"out": diff(yp, y_ref),
             "x.grad": diff(xp.grad, x.grad.chunk(world, 1)[rank] if sp else x.grad),
             "weight": diff(gather(layer.weight, 0, group), dense.weight),
             "weight.grad": diff(gather(layer.weight.grad, 0, group), dense.weight.grad)}
        if bias:
            d["bias.grad"] = diff(gather(layer.bias.grad, 0, group), dense.bias.grad)
        assert layer.weight.shape == (fout // world, fin)
        assert getattr(layer.weight, "tensor_parallel", False) and layer.weight.partition_dim == 0
        out[f"sp={sp} gather_output={gather_output} act={activation} bias={bias}"] = d
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_parallel_matches_dense(dist_pools, world):
    per_rank = dist_pools(world).run(body_column)
    assert len(per_rank) == world and all(len(r) == 9 for r in per_rank)
    assert_small(per_rank)


# ---------------------------------------------------------------------- row parallel
def body_row(rank, world):
    group = cached_mesh(tp=world).tp_group
    b, s, fin, fout = 2, 2 * world, 3 * world, 5
    out = {}
    for sp, parallel_input, bias in [(False, True, True), (False, False, True), (True, True, True),
                                     (False, True, False), (True, True, False)]:
        torch.manual_seed(12)
        dense = nn.Linear(fin, fout, bias=bias, dtype=F64)
        torch.manual_seed(12)
        layer = RowParallelLinear(fin, fout, bias=bias, tp_group=group, input_is_parallel=parallel_input,
                                  sequence_parallel=sp, dtype=F64)
        x = torch.randn(b, s, fin, dtype=F64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        g = torch.randn(b, s, fout, dtype=F64, generator=torch.Generator().manual_seed(4))
        dense(x).backward(g)

        xp = (x.detach().chunk(world, -1)[rank] if parallel_input else x.detach()).clone().requires_grad_()
        yp = layer(xp)
        with torch.no_grad():
            y = dense(x)
        yp.backward(g.chunk(world, 1)[rank] if sp else g)
        d = {"out": diff(yp, y.chunk(world, 1)[rank] if sp else y),
             "x.grad": diff(xp.grad, x.grad.chunk(world, -1)[rank] if parallel_input else x.grad),
             "weight": diff(gather(layer.weight, 1, group), dense.weight),
             "weight.grad": diff(gather(layer.weight.grad, 1, group), dense.weight.grad)}
        if bias:
            assert getattr(layer.bias, "sequence_parallel", False) == sp
            assert not getattr(layer.bias, "tensor_parallel", False)
            if sp:  # before the all-reduce: only this rank's tokens
                d["bias.grad (partial)"] = diff(layer.bias.grad, g.chunk(world, 1)[rank].sum((0, 1)))
                assert allreduce_sequence_parallel_grads(layer, group) == 1
            d["bias.grad"] = diff(layer.bias.grad, dense.bias.grad)
        out[f"sp={sp} input_is_parallel={parallel_input} bias={bias}"] = d
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_row_parallel_matches_dense(dist_pools, world):
    per_rank = dist_pools(world).run(body_row)
    assert all(len(r) == 5 for r in per_rank)
    assert_small(per_rank)


# ---------------------------------------------------------------------- MLP: column -> row, with SP
def body_mlp(rank, world, sp):
    group = cached_mesh(tp=world).tp_group
    b, s, h = 2, 2 * world, 4
    torch.manual_seed(13)
    d1, d2 = nn.Linear(h, 4 * h, dtype=F64), nn.Linear(4 * h, h, dtype=F64)
    torch.manual_seed(13)
    c = ColumnParallelLinear(h, 4 * h, tp_group=group, sequence_parallel=sp, activation="gelu", dtype=F64)
    r = RowParallelLinear(4 * h, h, tp_group=group, sequence_parallel=sp, dtype=F64)
    mlp = nn.Sequential(c, r)
    x = torch.randn(b, s, h, dtype=F64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    g = torch.randn(b, s, h, dtype=F64, generator=torch.Generator().manual_seed(6))
    y = d2(F.gelu(d1(x)))
    y.backward(g)
    xp = (x.detach().chunk(world, 1)[rank] if sp else x.detach()).clone().requires_grad_()
    yp = mlp(xp)
    yp.backward(g.chunk(world, 1)[rank] if sp else g)
    allreduce_sequence_parallel_grads(mlp, group)
    sl = (lambda t: t.chunk(world, 1)[rank]) if sp else (lambda t: t)
    return {"mlp": {"out": diff(yp, sl(y)), "x.grad": diff(xp.grad, sl(x.grad)),
                    "w1.grad": diff(gather(c.weight.grad, 0, group), d1.weight.grad),
                    "b1.grad": diff(gather(c.bias.grad, 0, group), d1.bias.grad),
                    "w2.grad": diff(gather(r.weight.grad, 1, group), d2.weight.grad),
                    "b2.grad": diff(r.bias.grad, d2.bias.grad)}}


@pytest.mark.parametrize("world,sp", [(2, False), (4, True), (2, True)])
def test_mlp_column_then_row_matches_dense(dist_pools, world, sp):
    assert_small(dist_pools(world).run(body_mlp, sp))


# ---------------------------------------------------------------------- vocabulary-parallel embedding
def body_embedding(rank, world):
    group = cached_mesh(tp=world).tp_group
    V, D, b, s = 37, 6, 2, 4 * world
    out = {}
    for padding_idx, sp in [(None, False), (5, False), (-1, True), (36, False), (0, True)]:
        torch.manual_seed(14)
        dense = nn.Embedding(V, D, padding_idx=padding_idx, dtype=F64)
        torch.manual_seed(14)
        emb = VocabParallelEmbedding(V, D, tp_group=group, padding_idx=padding_idx, sequence_parallel=sp,
                                     dtype=F64)
        v_pad = -(-V // world) * world
        assert (emb.num_embeddings, emb.num_embeddings_padded) == (V, v_pad)
        assert (emb.vocab_start_index, emb.vocab_end_index) == (rank * v_pad // world, (rank + 1) * v_pad // world)
        full = gather(emb.weight, 0, group)
        d = {"weight": diff(full[:V], dense.weight), "padded rows": full[V:].abs().sum().item()}
        # Padded rows are never read: garbage in them must not reach the output.
        n_real = max(0, min(V, emb.vocab_end_index) - emb.vocab_start_index)
        with torch.no_grad():
            emb.weight[n_real:] = 1e3
        ids = torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(7))
        ids[0, :3] = torch.tensor([0, V - 1, dense.padding_idx if padding_idx is not None else 1])
        g = torch.randn(b, s, D, dtype=F64, generator=torch.Generator().manual_seed(8))
        y = dense(ids)
        y.backward(g)
        yp = emb(ids)
        yp.backward(g.chunk(world, 1)[rank] if sp else g)
        gfull = gather(emb.weight.grad, 0, group)
        d.update({"out": diff(yp, y.chunk(world, 1)[rank] if sp else y),
                  "weight.grad": diff(gfull[:V], dense.weight.grad),
                  "padded rows grad": gfull[V:].abs().sum().item()})
        if padding_idx is not None:
            d["padding row grad"] = gfull[dense.padding_idx].abs().sum().item()
            assert dense.weight.grad[dense.padding_idx].abs().sum() == 0
        out[f"padding_idx={padding_idx} sp={sp}"] = d
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_vocab_parallel_embedding_matches_dense(dist_pools, world):
    per_rank = dist_pools(world).run(body_embedding)
    assert all(len(r) == 5 for r in per_rank)
    assert_small(per_rank)


# ---------------------------------------------------------------------- from_dense and seeded init
def body_from_dense_and_init(rank, world):
    group = cached_mesh(tp=world).tp_group
    res = {}
    # from_dense: gathering the shards gives back the dense weights, bit for bit; no RNG drawn.
    torch.manual_seed(15)
    lin, emb = nn.Linear(6, 4 * world, dtype=F64), nn.Embedding(37, 3, padding_idx=2, dtype=F64)
    lin.bias.requires_grad_(False)
    state = torch.get_rng_state()
    col = ColumnParallelLinear.from_dense(lin, tp_group=group, gather_output=True)
    row_src = nn.Linear(4 * world, 6, dtype=F64)
    row = RowParallelLinear.from_dense(row_src, tp_group=group, input_is_parallel=False)
    vemb = VocabParallelEmbedding.from_dense(emb, tp_group=group)
    res["from_dense draws no random numbers (1)"] = torch.equal(torch.get_rng_state(), state) is False
    state = torch.get_rng_state()
    ColumnParallelLinear.from_dense(lin, tp_group=group)
    VocabParallelEmbedding.from_dense(emb, tp_group=group)
    res["from_dense draws no random numbers"] = torch.equal(torch.get_rng_state(), state)
    res["column weight"] = torch.equal(gather(col.weight, 0, group), lin.weight.detach())
    res["column bias"] = torch.equal(gather(col.bias, 0, group), lin.bias)
    res["column requires_grad kept"] = col.weight.requires_grad and not col.bias.requires_grad
    res["row weight"] = torch.equal(gather(row.weight, 1, group), row_src.weight.detach())
    res["row bias"] = torch.equal(row.bias, row_src.bias.detach())
    res["embedding weight"] = torch.equal(gather(vemb.weight, 0, group)[:37], emb.weight.detach())
    res["embedding padding_idx"] = vemb.padding_idx == 2
    res["dtype/device"] = all(p.dtype == F64 and p.device.type == "cpu"
                              for m in (col, row, vemb) for p in m.parameters())
    x = torch.randn(3, 6, dtype=F64)
    res["column forward"] = torch.allclose(col(x), lin(x), rtol=0, atol=TOL)
    x = torch.randn(3, 4 * world, dtype=F64)
    res["row forward"] = torch.allclose(row(x), row_src(x), rtol=0, atol=TOL)
    ids = torch.tensor([[0, 2, 36, 17]])
    res["embedding forward"] = torch.equal(vemb(ids), emb(ids))

    # Seeded init: a model built from the sharded layers equals the dense model (default dtype fp32),
    # and the generator ends in the same state.
    def dense_model():
        return [nn.Embedding(37, 8), nn.Linear(8, 4 * world), nn.Linear(4 * world, 8, bias=False),
                nn.Embedding(11, 4, padding_idx=3)]

    def sharded_model():
        return [VocabParallelEmbedding(37, 8, tp_group=group), ColumnParallelLinear(8, 4 * world, tp_group=group),
                RowParallelLinear(4 * world, 8, bias=False, tp_group=group),
                VocabParallelEmbedding(11, 4, padding_idx=3, tp_group=group)]

    torch.manual_seed(16)
    dense = dense_model()
    after_dense = torch.rand(4)
    torch.manual_seed(16)
    sharded = sharded_model()
    res["init consumes the RNG like the dense model"] = torch.equal(torch.rand(4), after_dense)
    e1, c, r, e2 = sharded
    res["init embedding"] = torch.equal(gather(e1.weight, 0, group)[:37], dense[0].weight.detach())
    res["init column weight"] = torch.equal(gather(c.weight, 0, group), dense[1].weight.detach())
    res["init column bias"] = torch.equal(gather(c.bias, 0, group), dense[1].bias.detach())
    res["init row weight"] = torch.equal(gather(r.weight, 1, group), dense[2].weight.detach())
    res["init padded embedding"] = torch.equal(gather(e2.weight, 0, group)[:11], dense[3].weight.detach())
    res["init dtype"] = all(p.dtype == torch.float32 for m in sharded for p in m.parameters())

    # init_method: applied to the full weight, bias zero.
    def init(w):
        nn.init.normal_(w, 0.0, 0.02)

    torch.manual_seed(17)
    ref = torch.empty(4 * world, 5)
    init(ref)
    torch.manual_seed(17)
    c = ColumnParallelLinear(5, 4 * world, tp_group=group, init_method=init)
    res["init_method weight"] = torch.equal(gather(c.weight, 0, group), ref)
    res["init_method bias zero"] = bool((c.bias == 0).all())
    return res


@pytest.mark.parametrize("world", [1, 2, 4])
def test_from_dense_and_seeded_init_equal_the_dense_layers(dist_pools, world):
    for rank, res in enumerate(dist_pools(world).run(body_from_dense_and_init)):
        failed = [k for k, ok in res.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


# ---------------------------------------------------------------------- RNG tracker
def body_rng(rank, world):
    group = cached_mesh(tp=world).tp_group
    torch.manual_seed(7)
    tracker = tensor_parallel_rng_tracker(123, group)
    ones = torch.ones(256)
    outside1 = F.dropout(ones, 0.5)
    with tracker.fork():
        inside1 = F.dropout(ones, 0.5)
    outside2 = F.dropout(ones, 0.5)
    saved = tracker.get_states()
    with tracker.fork(TENSOR_PARALLEL_RNG):
        inside2 = F.dropout(ones, 0.5)
    tracker.set_states(saved)  # replay (what activation recomputation needs)
    with tracker.fork():
        replay = F.dropout(ones, 0.5)
    return {"outside": torch.stack([outside1, outside2]), "inside": torch.stack([inside1, inside2]),
            "replay": replay, "seed": tracker.seed(TENSOR_PARALLEL_RNG)}


@pytest.mark.parametrize("world", [2, 4])
def test_rng_tracker_forks_differ_across_tp_ranks(dist_pools, world):
    per_rank = dist_pools(world).run(body_rng)
    torch.manual_seed(7)
    expected_outside = torch.stack([F.dropout(torch.ones(256), 0.5) for _ in range(2)])
    for rank, res in enumerate(per_rank):
        # Outside the fork: the default stream, untouched by the fork, equal on every rank.
        assert torch.equal(res["outside"], expected_outside), rank
        assert res["seed"] == 123 + 2718 + rank
        torch.manual_seed(123 + 2718 + rank)
        assert torch.equal(res["inside"], torch.stack([F.dropout(torch.ones(256), 0.5) for _ in range(2)])), rank
        assert torch.equal(res["replay"], res["inside"][1]), rank
        assert not torch.equal(res["inside"][0], res["inside"][1])  # the stream advances across forks
    masks = [res["inside"][0] for res in per_rank]
    for a, b in itertools.combinations(range(world), 2):
        assert not torch.equal(masks[a], masks[b]), (a, b)


def test_rng_tracker_errors():
    from parallel_layers.tensor_parallel.random import RNGStatesTracker
    t = RNGStatesTracker()
    t.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        t.add("a", 2)
    with pytest.raises(ValueError, match="seed 1 is already used"):
        t.add("b", 1)
    with pytest.raises(KeyError, match="no stream 'c'"):
        with t.fork("c"):
            pass
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError):
        with t.fork("a"):
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), state)  # restored even when the body raises


# ---------------------------------------------------------------------- bad input
def _message(fn):
    try:
        fn()
    except (ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def body_errors(rank, world):
    mesh = cached_mesh(tp=world)
    other = cached_mesh(dp=world)
    g = mesh.tp_group
    col = ColumnParallelLinear(4, 6, tp_group=g)
    row = RowParallelLinear(6, 4, tp_group=g)
    row_full = RowParallelLinear(6, 4, tp_group=g, input_is_parallel=False)
    emb = VocabParallelEmbedding(37, 4, tp_group=g)
    sp_row = RowParallelLinear(6, 4, tp_group=g, sequence_parallel=True)
    return {
        "column indivisible": _message(lambda: ColumnParallelLinear(4, 5, tp_group=g)),
        "row indivisible": _message(lambda: RowParallelLinear(7, 4, tp_group=g)),
        "no group": _message(lambda: ColumnParallelLinear(4, 6, tp_group=None)),
        "wrong mesh": _message(lambda: RowParallelLinear(6, 4, tp_group=g, mesh=other)),
        "right mesh": _message(lambda: VocabParallelEmbedding(10, 4, tp_group=g, mesh=mesh)),
        "column last dim": _message(lambda: col(torch.randn(2, 3, 5))),
        "row last dim": _message(lambda: row(torch.randn(2, 3, 6))),
        "row full last dim": _message(lambda: row_full(torch.randn(2, 3, 3))),
        "sp needs parallel input": _message(lambda: RowParallelLinear(6, 4, tp_group=g, input_is_parallel=False,
                                                                      sequence_parallel=True)),
        "sp seq length": _message(lambda: sp_row(torch.randn(2, 3, 3))),
        "activation": _message(lambda: ColumnParallelLinear(4, 6, tp_group=g, activation="relu")),
        "ids out of range": _message(lambda: emb(torch.tensor([[0, 37]]))),
        "ids negative": _message(lambda: emb(torch.tensor([[-1, 3]]))),
        "float ids": _message(lambda: emb(torch.zeros(2, 2))),
        "padding_idx": _message(lambda: VocabParallelEmbedding(37, 4, tp_group=g, padding_idx=37)),
        "from_dense type": _message(lambda: ColumnParallelLinear.from_dense(nn.Embedding(3, 4), tp_group=g)),
        "from_dense dtype": _message(lambda: RowParallelLinear.from_dense(nn.Linear(6, 4), tp_group=g,
                                                                          dtype=F64)),
        "from_dense max_norm": _message(lambda: VocabParallelEmbedding.from_dense(
            nn.Embedding(8, 4, max_norm=1.0), tp_group=g)),
    }


def test_bad_input_is_a_clear_error(dist_pools):
    expected = {
        "column indivisible": "ColumnParallelLinear: out_features=5 does not divide by the tensor-parallel size 2; "
                              "choose out_features a multiple of 2 (e.g. 4 or 6) or a tensor-parallel size that "
                              "divides 5 (e.g. 1, 5)",
        "row indivisible": "RowParallelLinear: in_features=7 does not divide by the tensor-parallel size 2",
        "no group": "ColumnParallelLinear: tp_group is required",
        "wrong mesh": "RowParallelLinear: the tp group given has ranks [0, 1] but the mesh's tp group",
        "column last dim": "ColumnParallelLinear: input has last dimension 5, expected in_features=4",
        "row last dim": "RowParallelLinear: input has last dimension 6, expected 3 (in_features/tp = 6/2",
        "row full last dim": "RowParallelLinear: input has last dimension 3, expected 6 (in_features=6",
        "sp needs parallel input": "RowParallelLinear: sequence_parallel=True requires input_is_parallel=True",
        "sp seq length": "RowParallelLinear: sequence length 3",
        "activation": "ColumnParallelLinear: activation='relu' is not one of",
        "ids out of range": "VocabParallelEmbedding: token ids must lie in [0, 37) (the vocabulary size); "
                            "got ids from 0 to 37",
        "ids negative": "got ids from -1 to 3",
        "float ids": "TypeError: VocabParallelEmbedding: token ids must be an integer tensor",
        "padding_idx": "VocabParallelEmbedding: padding_idx=37 is outside the vocabulary of 37",
        "from_dense type": "TypeError: ColumnParallelLinear.from_dense: expected an nn.Linear, got Embedding",
        "from_dense dtype": "TypeError: RowParallelLinear.from_dense: 'dtype' comes from the dense module",
        "from_dense max_norm": "['max_norm'] are not supported",
    }
    for rank, msgs in enumerate(dist_pools(2).run(body_errors)):
        assert msgs["right mesh"] is None, (rank, msgs["right mesh"])
        for key, fragment in expected.items():
            assert msgs[key] is not None and fragment in msgs[key], (rank, key, msgs[key])


def body_errors_one_rank(rank, world):
    g = cached_mesh(tp=1).tp_group
    col, row = ColumnParallelLinear(4, 6, tp_group=g, activation="gelu"), RowParallelLinear(6, 4, tp_group=g)
    emb = VocabParallelEmbedding(37, 4, tp_group=g)
    return {
        "column last dim": _message(lambda: col(torch.randn(2, 5))),
        "row last dim": _message(lambda: row(torch.randn(2, 3))),
        "column dtype": _message(lambda: col(torch.randn(2, 4, dtype=torch.float64))),
        "ids out of range": _message(lambda: emb(torch.tensor([0, 37]))),
        "ids negative": _message(lambda: emb(torch.tensor([-1, 3]))),
    }


def test_bad_input_at_tp_1_is_a_clear_error(dist_pools):
    """At tp 1 the layers call the linear or the embedding first and explain its refusal (no host time spent
    on checks a good input passes): the messages are the same as at tp 2."""
    msgs = dist_pools(1).run(body_errors_one_rank)[0]
    expected = {
        "column last dim": "ColumnParallelLinear: input has last dimension 5, expected in_features=4",
        "row last dim": "RowParallelLinear: input has last dimension 3, expected 6 (in_features/tp = 6/1",
        "column dtype": "fused_linear: weight has dtype torch.float32 but the input has torch.float64",
        "ids out of range": "VocabParallelEmbedding: token ids must lie in [0, 37) (the vocabulary size); "
                            "got ids from 0 to 37",
        "ids negative": "got ids from -1 to 3",
    }
    for key, fragment in expected.items():
        assert msgs[key] is not None and fragment in msgs[key], (key, msgs[key])


def body_sp_input_without_batch(rank, world):
    # An error raised on every rank before any collective: no rank is left waiting in one.
    group = cached_mesh(tp=world).tp_group
    layer = ColumnParallelLinear(4, 4, tp_group=group, sequence_parallel=True)
    layer(torch.randn(3, 4))  # [s/tp, in]: the batch dimension is missing


def test_sequence_parallel_input_without_batch_dim_fails_cleanly(dist_pools):
    with pytest.raises(RankFailure, match=r"ColumnParallelLinear: sequence parallelism needs batch-first input "
                                          r"\[batch, seq, hidden\]; got shape \(3, 4\)"):
        dist_pools(2).run(body_sp_input_without_batch)


# ---------------------------------------------------------------------- CUDA (skipped without a GPU)
def body_cuda(rank, world):
    group = cached_mesh(tp=world).tp_group
    dev = torch.device("cuda")
    res = {}
    torch.manual_seed(21)
    d1, d2, de = nn.Linear(16, 32, device=dev), nn.Linear(32, 16, device=dev), nn.Embedding(50, 16, device=dev)
    torch.manual_seed(21)
    c = ColumnParallelLinear(16, 32, tp_group=group, activation="gelu", device=dev)
    r = RowParallelLinear(32, 16, tp_group=group, device=dev)
    e = VocabParallelEmbedding(50, 16, tp_group=group, device=dev)
    # Seeded init draws from the CUDA generator exactly as the dense layers on that device do.
    res["init"] = all(torch.equal(a.detach(), b.detach()) for a, b in
                      [(c.weight, d1.weight), (c.bias, d1.bias), (r.weight, d2.weight), (r.bias, d2.bias),
                       (e.weight, de.weight)])
    ids = torch.randint(0, 50, (2, 8), device=dev)
    x = e(ids)
    # fp32 matmuls on GPU may use TF32 / a different summation order: loose tolerance, plumbing check.
    res["forward"] = torch.allclose(r(c(x)), d2(F.gelu(d1(de(ids)))), rtol=1e-2, atol=1e-2)
    r(c(x)).sum().backward()
    res["grads on device"] = all(p.grad is not None and p.grad.is_cuda for m in (c, r, e) for p in m.parameters())
    # The tracker keeps and restores the CUDA generator too.
    tracker = tensor_parallel_rng_tracker(5, group)
    torch.cuda.manual_seed(9)
    ones = torch.ones(4096, device=dev)
    outside = F.dropout(ones, 0.5)
    with tracker.fork():
        inside = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)
    torch.cuda.manual_seed(9)
    res["outside stream untouched"] = torch.equal(outside, F.dropout(ones, 0.5)) and torch.equal(
        after, F.dropout(ones, 0.5))
    torch.cuda.manual_seed(5 + 2718)
    res["inside stream seeded"] = torch.equal(inside, F.dropout(ones, 0.5))
    return res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_layers_and_rng_tracker_on_cuda(dist_pools):
    res = dist_pools(1).run(body_cuda)[0]
    failed = [k for k, ok in res.items() if not ok]
    assert not failed, failed
