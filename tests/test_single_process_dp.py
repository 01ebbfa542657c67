"""SingleProcessDataParallel (``parallel_layers.data_parallel.single_process``): one process, a worker thread
per "device" (here CPU threads).

Parity: the reference GPT (tied embedding / LM head, dropout 0) over 3 devices on a batch of 5 rows (split
2, 2, 1) against the same model on one device on the whole batch: the gathered logits, the loss computed on
them, every gradient after backward, and the parameters after three SGD steps, within fp32 rounding (1e-5
relative: the batch's rows are summed in another order). Also an MLP with a frozen layer, a keyword
argument and an input that requires grad (its gradient gathered back), in no-grad evaluation, and a
BatchNorm whose running statistics update on the first device's replica only (torch DataParallel's rule).

The exchanges are counted per batch: scatter of the inputs, replication of the parameters, gather of the
outputs, scatter of the output gradients, reduction of the gradients: one copy per device after the first
in each, with the bytes each must move (parameters: their flat bytes per device, both ways).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from parallel_layers import SingleProcessDataParallel
from parallel_layers.data_parallel.single_process import exchanges_per_batch


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_gpt_over_three_threads_equals_one_device_on_the_whole_batch():
    from parallel_layers.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=48, n_layer=2, n_head=2, d_model=16, max_seq_len=8, dropout=0.0)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    dp = SingleProcessDataParallel(model, ["cpu", "cpu", "cpu"])
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    n_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, 48, (5, 8), generator=g)
        tgt = torch.randint(0, 48, (5, 8), generator=g)
        for o in opts:
            o.zero_grad()
        want_logits, _ = ref(idx)
        want = F.cross_entropy(want_logits.reshape(-1, 48), tgt.reshape(-1))
        want.backward()
        logits, none = dp(idx)
        assert none is None and logits.shape == (5, 8, 48)
        loss = F.cross_entropy(logits.reshape(-1, 48), tgt.reshape(-1))   # on the gathered whole batch
        loss.backward()
        assert _rel(logits, want_logits) < 1e-5 and _rel(loss, want) < 1e-5
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) < 1e-5, f"step {step}: gradient of {n} differs by {_rel(p.grad, q.grad)}"
        log = dp.exchanges.summary()
        assert list(log) == ["scatter_inputs", "replicate_params", "gather_outputs", "scatter_output_grads",
                             "reduce_grads"], log
        assert all(v["copies"] == 2 for v in log.values()), log
        assert log["scatter_inputs"]["bytes"] == 3 * 8 * 8        # rows 2 and 1 of int64 token ids
        assert log["replicate_params"]["bytes"] == log["reduce_grads"]["bytes"] == 2 * n_param_bytes
        assert log["gather_outputs"]["bytes"] == log["scatter_output_grads"]["bytes"] == 3 * 8 * 48 * 4
        assert exchanges_per_batch(dp.exchanges)[0] == 5
        for o in opts:
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p, q) < 1e-5, f"{n} after 3 steps differs by {_rel(p, q)}"
    dp.close()


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, *, scale):
        h = self.bn(F.gelu(self.fc(self.frozen(x) * scale)))
        return {"y": self.out(h), "pair": (h.sum(1), None)}


def test_kwargs_input_grads_frozen_layers_buffers_and_evaluation():
    torch.manual_seed(1)
    ref = _Net().eval()          # BatchNorm in eval: the replicas' per-device statistics are not the batch's
    torch.manual_seed(1)
    model = _Net().eval()
    dp = SingleProcessDataParallel(model, ["cpu", "cpu"])
    x = torch.randn(7, 6)
    scale = torch.full((7, 1), 0.5)
    xr, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = ref(xr, scale=scale)
    got = dp(xo, scale=scale)
    assert got["pair"][1] is None and got["pair"][0].shape == (7,)
    (want["y"].square().sum() + want["pair"][0].sum()).backward()
    (got["y"].square().sum() + got["pair"][0].sum()).backward()
    assert _rel(got["y"], want["y"]) < 1e-5 and _rel(xo.grad, xr.grad) < 1e-5
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert _rel(p.grad, q.grad) < 1e-5, n
    assert model.frozen.weight.grad is None
    assert dp.exchanges.summary()["gather_input_grads"] == {"copies": 1, "bytes": 3 * 6 * 4}
    with torch.no_grad():
        assert _rel(dp(x, scale=scale)["y"], ref(x, scale=scale)["y"]) < 1e-5
    # training-mode BatchNorm: the first device's replica is the module, its running statistics are kept;
    # every replica follows the module's train() (each normalises with its own rows' statistics)
    model.train()
    y = dp(x, scale=scale)["y"]
    assert model.bn.num_batches_tracked.item() == 1
    with torch.no_grad():
        h = [F.gelu(model.fc(model.frozen(x[rows]) * 0.5)) for rows in (slice(0, 4), slice(4, 7))]
    assert torch.allclose(model.bn.running_mean, 0.1 * h[0].mean(0), atol=1e-6)
    per_replica = [model.out(F.batch_norm(hi, None, None, model.bn.weight, model.bn.bias, True)) for hi in h]
    assert _rel(y, torch.cat(per_replica)) < 1e-5
    # one row for two devices: the module runs alone, nothing is exchanged
    model.eval()
    dp(x[:1], scale=scale[:1])
    assert dp.exchanges.summary() == {}
    dp.close()


def test_bad_arguments_name_the_layer_and_the_fix():
    with pytest.raises(ValueError, match="devices is empty"):
        SingleProcessDataParallel(nn.Linear(2, 2), [])
    with pytest.raises(ValueError, match="all CUDA devices or all 'cpu'"):
        SingleProcessDataParallel(nn.Linear(2, 2), ["cpu", "meta"])
    with pytest.raises(ValueError, match=r"weight is on meta, the first device is cpu; move the module to cpu"):
        SingleProcessDataParallel(nn.Linear(2, 2, device="meta"), ["cpu", "cpu"])
    dp = SingleProcessDataParallel(nn.Bilinear(2, 3, 4), ["cpu", "cpu"])
    with pytest.raises(ValueError, match=r"same size there; got dim-0 sizes \['4', '5'\]"):
        dp(torch.ones(4, 2), torch.ones(5, 3))
    dp.close()


def test_benchmark_smoke_rows(dist_pools):
    from benchmarks import single_process_dp as bench

    # the process-per-device variant on the session's ranks (no fresh spawn), the rest in this process
    rows = {r["case"]: r for r in bench.collect("smoke", torch.device("cpu"), processes=False)}
    assert set(rows) == {"dp_single_process_vs_one_device", "dp_single_process_1thread_vs_one_device"}
    assert rows["dp_single_process_vs_one_device"]["baseline"].startswith("one device, whole batch; 5 exchanges")
    assert all(r["ours_median_ms"] > 0 and r["base_median_ms"] > 0 for r in rows.values())
    prof = bench.PROFILES["smoke"]
    for times, buckets, grad_bytes in dist_pools(2).run(bench._processes_rank, prof):
        assert len(times) == prof["reps"] and min(times) > 0 and buckets == 1
        assert grad_bytes >= sum(p.numel() * 4 for p in bench._gpt(prof, "cpu").parameters())
