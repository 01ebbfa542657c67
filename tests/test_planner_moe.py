"""The planner on a Mixture-of-Experts model: it searches ep, prices each rank's memory by term with its share
of the experts (the package's own code on the meta device, routing taken as balanced there: moe/meta.py), and
charges the dispatch and combine all-to-alls; the predicted parameter and optimizer bytes are those a real
rank of the same layout holds."""
from __future__ import annotations

import pytest

from parallel_layers.composition.layout import Layout
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import Request, candidate_layouts, load_profile, predict
from parallel_layers.planner.model import probe_layout

MOE = dict(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=32, bias=False, num_experts=4, moe_top_k=2)


def _request(world, **cfg):
    return Request(GPTConfig(**{**MOE, **cfg}), world=world, global_batch=8, seq_len=32, memory_bytes=2**30,
                   precision="fp32")


def test_the_search_offers_every_ep_that_divides_the_experts_and_only_ep1_for_a_dense_model():
    moe = {lay.ep for lay, why in candidate_layouts(_request(8), zero=(1,), cp=(1,)) if why is None}
    dense = {lay.ep for lay, why in candidate_layouts(_request(8, num_experts=0), zero=(1,), cp=(1,))}
    assert moe == {1, 2, 4} and dense == {1}                     # 8 does not divide 4 experts
    chosen = {lay.name(): why for lay, why in candidate_layouts(_request(8), zero=(1,), cp=(1,), ep=(2,))}
    assert {name.split(" ")[0] for name in chosen} >= {"dp4xep2", "ep2xtp4", "dp2xep2xpp2"}, chosen
    assert all("ep2" in name for name in chosen), chosen
    assert "does not split into dp=1 x ep=2 x 8" in chosen["ep2xtp2xpp2 z1 1f1b m8"], chosen


def test_ep_layouts_hold_their_share_of_the_experts_and_pay_all_to_alls():
    req, prof = _request(2), load_profile("h100")
    dp, ep = (predict(req, Layout(**sizes, zero=1), prof) for sizes in (dict(dp=2), dict(ep=2)))
    # the experts are most of the parameters: ep 2 holds half of them
    assert ep.memory[0]["parameters"] < 0.75 * dp.memory[0]["parameters"], (ep.memory, dp.memory)
    colls = [set(cc.coll_f) | set(cc.coll_b) for lay in (Layout(dp=2, zero=1), Layout(ep=2, zero=1))
             for pr in probe_layout(req, lay) for cc in pr.chunks]
    assert not any("all" in name and "to" in name for name in colls[0]), colls
    assert any(name.startswith("alltoall") for name in colls[1]), colls


def body_real_bytes(rank, world, sizes, zero):
    from parallel_layers import DataParallelConfig, Parallel3D
    from parallel_layers.testing import cached_mesh
    p3d = Parallel3D(GPTConfig(**MOE), cached_mesh(**sizes), seed=0, data_parallel=DataParallelConfig(zero=zero))
    return sum(p.numel() * p.element_size() for p in p3d.model.parameters())


@pytest.mark.parametrize("sizes", [dict(ep=2), dict(dp=2)], ids=["ep2", "dp2"])
def test_predicted_parameter_bytes_are_what_a_real_rank_holds(sizes, dist_pools):
    predicted = predict(_request(2), Layout(**sizes, zero=1), load_profile("h100")).memory[0]["parameters"]
    for held in dist_pools(2).run(body_real_bytes, sizes, 1):
        assert held == predicted, (sizes, held, predicted)
