"""The global data position (issue 35): a restarted run continues the same sample order, whatever its dp
size, because the position is global and every rank draws the same global batch."""
import json

import pytest
import torch

from parallel_layers.resilience.data_position import GlobalBatches


def test_resumed_order_continues_exactly_and_every_epoch_is_a_permutation():
    plain = GlobalBatches(num_samples=10, batch=4, seed=3)
    whole = [plain.next_batch() for _ in range(7)]            # 28 samples: crosses two epoch ends mid-batch
    first = GlobalBatches(10, 4, seed=3)
    for _ in range(3):
        first.next_batch()
    saved = json.loads(json.dumps(first.state_dict()))        # what meta.json keeps
    again = GlobalBatches(10, 4, seed=3)
    again.load_state_dict(saved)
    for want in whole[3:]:
        assert torch.equal(again.next_batch(), want)
    flat = torch.cat(whole)
    for epoch in range(2):
        assert sorted(flat[10 * epoch:10 * (epoch + 1)].tolist()) == list(range(10))
    assert not torch.equal(flat[:10], flat[10:20])            # each epoch its own order


def test_position_of_another_order_is_refused():
    with pytest.raises(ValueError, match="another order"):
        GlobalBatches(10, 4, seed=1).load_state_dict(GlobalBatches(10, 4, seed=2).state_dict())
