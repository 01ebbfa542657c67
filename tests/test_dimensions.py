"""A parallel dimension is declared once (``parallel_layers.dimensions.DIMENSIONS``): the mesh, ``Parallel3D``,
checkpoints, the planner's ``Layout``, the demo's flags, the usage text and the test workers read the
declaration, and a new dimension is one ``Dimension`` more: a toy one, declared inside the test, builds its
groups, joins the replicas, splits the batch and trains a GPT exactly as the data-parallel run of the same
ranks does."""
import itertools
from types import MappingProxyType

import pytest
import torch

import parallel_layers.__main__ as entry
from parallel_layers import dimensions
from parallel_layers.cli import demo
from parallel_layers.composition.layout import Layout
from parallel_layers.dimensions import (
    DIMENSIONS,
    Dimension,
    check_sizes,
    coordinates,
    describe,
    grid_ranks,
    names,
    replicating,
)


def test_the_declared_grid():
    assert names() == ("pp", "dp", "ep", "cp", "tp") and replicating() == ("dp", "ep", "cp")
    assert replicating(experts=True) == ("dp", "cp")          # ep ranks hold different experts
    assert [DIMENSIONS[n].params for n in names()] == ["staged", "replicated", "experts", "replicated", "sharded"]
    assert [DIMENSIONS[n].batch for n in names()] == ["whole", "split", "split", "sequence", "whole"]
    with pytest.raises(TypeError):
        DIMENSIONS["xp"] = DIMENSIONS["dp"]                    # the registry is read-only
    with pytest.raises(ValueError, match="unknown parallel dimension 'xp'; the dimensions are pp, dp, ep, cp, tp"):
        dimensions.dimension("xp")
    with pytest.raises(TypeError, match=r"ParallelMesh: unknown parallel dimension\(s\) 'xp'"):
        check_sizes({"dp": 2, "xp": 2}, "ParallelMesh")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"cp={bad!r} must be a positive integer"):
            check_sizes({"cp": bad}, "ParallelMesh")
    with pytest.raises(ValueError, match="params='copied' must be one of"):
        Dimension("xp", "toy", "copied", "split", "")
    assert describe({"dp": 2, "tp": 2, "pp": 2}) == "dp=2 x tp=2 x pp=2"
    assert describe({"dp": 2, "cp": 2, "tp": 1, "pp": 1}) == "dp=2 x cp=2 x tp=1 x pp=1"


@pytest.mark.parametrize("pp,dp,cp,tp", [(1, 1, 1, 1), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (3, 2, 2, 1)])
def test_grid_ranks_and_coordinates_are_megatrons_layout(pp, dp, cp, tp):
    sizes = dict(pp=pp, dp=dp, cp=cp, tp=tp)
    world = pp * dp * cp * tp
    for rank in range(world):
        c = coordinates(rank, sizes)
        assert rank == ((c["pp"] * dp + c["dp"]) * cp + c["cp"]) * tp + c["tp"]
    for dims in [(n,) for n in names()] + [("dp", "cp")]:
        groups = grid_ranks(sizes, dims)
        assert sorted(itertools.chain(*groups)) == list(range(world))      # a partition of the ranks
        for group in groups:                                                 # ... that moves along dims only
            coords = [coordinates(r, sizes) for r in group]
            fixed = [n for n in names() if n not in dims]
            assert all(all(c[n] == coords[0][n] for n in fixed) for c in coords), (dims, group)
            assert len(group) == len({tuple(c[n] for n in dims) for c in coords})


def test_every_consumer_reads_the_declaration():
    parser = demo.build_parser()
    flags = {a.dest: a for a in parser._actions}
    for name in names():
        assert flags[name].help == DIMENSIONS[name].help and f"--{name} N" in entry.USAGE
    args = parser.parse_args(["--cp", "2"])
    assert demo.mesh_sizes(args) == {"pp": 2, "dp": 2, "ep": 1, "cp": 2, "tp": 2} and demo.world_size(args) == 16
    layout = Layout(dp=2, cp=2, pp=2, schedule="gpipe", num_microbatches=2)
    assert layout.sizes == {"pp": 2, "dp": 2, "ep": 1, "cp": 2, "tp": 1} and layout.world == 8
    assert layout.name() == "dp2xcp2xpp2 z0 gpipe m2"
    assert set(names()) <= set(layout.as_dict())


# ---------------------------------------------------------------------- a toy dimension: one declaration
# "hp": replicas of a replica (HSDP's outer replication), outermost, its ranks on their own rows of the batch
TOY = Dimension("hp", "hybrid replicas", "replicated", "split", "hybrid-replica size: replicas of the replicas")


def _declare_toy():
    saved = dimensions.DIMENSIONS
    dimensions.DIMENSIONS = MappingProxyType({"hp": TOY, **saved})
    return saved


def body_toy_dimension(rank, world):
    import torch.distributed as dist

    from parallel_layers import OptimizerConfig, Parallel3D, PipelineConfig
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.testing import cached_mesh

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 9), generator=g) for _ in range(2)]

    def train(mesh):
        p3d = Parallel3D(cfg, mesh, seed=0, optimizer=OptimizerConfig(lr=1e-2),
                         pipeline=PipelineConfig(num_microbatches=1))
        losses = [p3d.train_step(b[:, :-1], b[:, 1:])["loss"] for b in batches]
        return losses, {k: v.clone() for k, v in p3d.dense_state_dict().items()}

    plain = train(cached_mesh(dp=4))
    saved = _declare_toy()
    try:
        mesh = ParallelMesh(dp=2, hp=2)
        out = {"sizes": mesh.sizes, "coords": mesh.coordinates, "replicas": mesh.replicas,
               "replica_ranks": dist.get_process_group_ranks(mesh.replica_group),
               "hp_ranks": dist.get_process_group_ranks(mesh.hp_group), "batch": (mesh.batch_shards, mesh.batch_rank),
               "repr": repr(mesh), "flag": demo.build_parser().parse_args(["--hp", "2"]).hp}
        toy = train(mesh)
    finally:
        dimensions.DIMENSIONS = saved
    out["same_losses"] = toy[0] == plain[0]
    out["same_params"] = all(torch.equal(toy[1][k], plain[1][k]) for k in plain[1])
    return out


def test_a_toy_dimension_is_one_declaration(dist_pools):
    for rank, out in enumerate(dist_pools(4).run(body_toy_dimension)):
        assert out["sizes"] == {"hp": 2, "pp": 1, "dp": 2, "ep": 1, "cp": 1, "tp": 1}, out
        assert out["coords"]["hp"] == rank // 2 and out["coords"]["dp"] == rank % 2
        assert out["hp_ranks"] == [rank % 2, rank % 2 + 2]
        assert out["replicas"] == 4 and out["replica_ranks"] == [0, 1, 2, 3]
        assert out["batch"] == (4, rank) and "hp=2" in out["repr"] and out["flag"] == 2
        # the same ranks, the same rows, the same reduction: the dp=4 run's losses and weights, bit for bit
        assert out["same_losses"] and out["same_params"], (rank, out)
