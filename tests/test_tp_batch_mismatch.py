"""A batch whose shape differs across the ranks of a tensor-parallel group: every rank raises an error naming
the layer, each rank's shape and the fix (gloo used to terminate the process: "Received data size doesn't
match expected size"), the group stays usable, and shapes that change on every rank alike still compute
the dense result, with no shape exchange while the shape stays the same."""
import pytest
import torch
import torch.nn as nn

from parallel_layers.testing import cached_mesh

D_IN, D_HID, VOCAB, SEQ = 8, 16, 12, 4


def _mlp(group):
    """Column -> ReLU -> Row, built by ``parallelize`` from a dense model seeded alike on every rank."""
    from parallel_layers.tensor_parallel.parallelize import parallelize

    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_IN))
    return dense, parallelize(model, group, {"0": "colwise", "2": "rowwise"})


def _layer_and_input(case, group, batch):
    from parallel_layers.tensor_parallel.embedding import VocabParallelEmbedding
    from parallel_layers.tensor_parallel.layers import ColumnParallelLinear

    gen = torch.Generator().manual_seed(batch)
    if case == "parallelize-row":
        return _mlp(group)[1], torch.randn(batch, D_IN, generator=gen)
    if case == "column-sequence-parallel":     # all-gather of the sequence dimension
        layer = ColumnParallelLinear(D_IN, D_HID, tp_group=group, sequence_parallel=True)
        return layer, torch.randn(batch, SEQ // 2, D_IN, generator=gen)
    if case == "column-gather-output":          # all-gather of the feature dimension
        return ColumnParallelLinear(D_IN, D_HID, tp_group=group, gather_output=True), torch.randn(batch, D_IN,
                                                                                                 generator=gen)
    if case == "embedding-sequence-parallel":   # reduce-scatter of the sequence dimension
        layer = VocabParallelEmbedding(VOCAB, D_IN, tp_group=group, sequence_parallel=True)
        return layer, torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    raise AssertionError(case)


def body_mismatch(rank, world, case):
    group = cached_mesh(tp=world).tp_group
    layer, x = _layer_and_input(case, group, batch=3 + 2 * rank)
    try:
        layer(x).sum().backward()
        error = None
    except ValueError as exc:
        error = str(exc)
    # the group still works: the same layer on a batch every rank agrees on
    _, same = _layer_and_input(case, group, batch=2)
    after = layer(same).shape
    return error, tuple(after)


@pytest.mark.parametrize("case,layer,shapes", [
    ("parallelize-row", "RowParallelLinear", ["rank 0: (3, 8); rank 1: (5, 8)"]),
    ("column-sequence-parallel", "ColumnParallelLinear", ["rank 0: (3, 2, 8); rank 1: (5, 2, 8)"]),
    ("column-gather-output", "ColumnParallelLinear", ["rank 0: (3, 8); rank 1: (5, 8)"]),
    ("embedding-sequence-parallel", "VocabParallelEmbedding", ["rank 0: (3, 4, 8); rank 1: (5, 4, 8)"]),
])
def test_batch_shape_differing_across_tp_ranks_is_named_on_every_rank(dist_pools, case, layer, shapes):
    pool = dist_pools(2, "gloo")
    for rank, (error, after) in enumerate(pool.run(body_mismatch, case)):
        assert error is not None, f"rank {rank}: no error for batches of 3 and 5 rows"
        assert error.startswith(layer), (rank, error)
        for shape in shapes:
            assert shape in error, (rank, shape, error)
        assert "same batch" in error and "drop_last" in error, (rank, error)
        assert after[0] == 2, (rank, after)


def body_batch_changes_everywhere(rank, world):
    """Every rank's batch changes size alike (4, 4, 4, 2, 2, 4 rows): the MLP equals the dense one in output and
    input gradient at each, and shapes are exchanged only at the first call and at each change."""
    import parallel_layers.tensor_parallel.agreed_shapes as agreed_shapes

    group = cached_mesh(tp=world).tp_group
    dense, model = _mlp(group)
    errs, exchanges = [], []
    for batch in (4, 4, 4, 2, 2, 4):
        before = agreed_shapes.exchange_count(group)
        x = torch.randn(batch, D_IN, generator=torch.Generator().manual_seed(batch)).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = model(x), dense(x_ref)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        errs.append(max((y - y_ref).abs().max().item(), (x.grad - x_ref.grad).abs().max().item()))
        exchanges.append(agreed_shapes.exchange_count(group) - before)
    return errs, exchanges


def test_batch_shape_changing_on_every_rank_alike_still_computes(dist_pools):
    for rank, (errs, exchanges) in enumerate(dist_pools(2, "gloo").run(body_batch_changes_everywhere)):
        assert all(e < 1e-6 for e in errs), (rank, errs)
        assert exchanges == [1, 0, 0, 1, 0, 1], (rank, exchanges)   # the first batch and each change
