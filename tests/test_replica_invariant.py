"""The replica invariant (``composition/replica_check.py``) and the tp-partial gradients of replicated
parameters (``tensor_parallel/partial_grads.py``, placed by ``families/infer_plan.py``).

- the checksum sees every bit (a flipped bit, a permutation, -0.0 against 0.0), in every dtype;
- Qwen3's per-head q/k norms at tp 2 train like one process, every parameter compared, and their copies
  stay bit-identical on both tp ranks (before, each rank trained its copy on its own heads' partial
  gradient: 1e-3 off after 3 steps, the two copies different);
- a replicated parameter that drifted on one rank, and ranks handed different global batches, raise on
  every rank naming the tensor, the group, the ranks and the step (batches: before the step);
- OLMo2's norms over all heads' features train like one process at tp 2 (before: a crash inside its
  attention); a norm over all heads that ShardedRMSNorm does not reproduce is refused naming it;
- labels of the wrong shape are refused at ``train_step``.
"""
import pytest
import torch
import torch.nn.functional as F
from hf_families import VOCAB, family_model

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
from parallel_layers.testing import cached_mesh

pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------ checksum
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                                   torch.bool])
def test_checksum_sees_every_bit(dtype):
    from parallel_layers.composition.replica_check import checksum

    torch.manual_seed(0)
    t = (torch.randn(1001) * 10).to(dtype)
    assert torch.equal(checksum(t), checksum(t.clone()))
    if dtype != torch.bool:
        flipped = t.clone()
        bits = flipped.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        bits[517] ^= 1
        assert not torch.equal(checksum(flipped), checksum(t))
        swapped = t.clone()
        swapped[[3, 900]] = t[[900, 3]]
        assert not torch.equal(checksum(swapped), checksum(t))
    else:
        other = t.clone()
        other[5] = ~other[5]
        assert not torch.equal(checksum(other), checksum(t))


def test_checksum_tells_signed_zeros_and_empty_tensors_apart():
    from parallel_layers.composition.replica_check import checksum

    assert not torch.equal(checksum(torch.tensor([0.0, 1.0])), checksum(torch.tensor([-0.0, 1.0])))
    assert torch.equal(checksum(torch.empty(0)), torch.zeros(2, dtype=torch.int64))
    big = torch.randn(3, 5, 7).transpose(0, 2)                      # not contiguous
    assert torch.equal(checksum(big), checksum(big.contiguous()))


def test_checksums_of_many_tensors_equal_each_ones_checksum(monkeypatch):
    from parallel_layers.composition import replica_check as R

    monkeypatch.setattr(R, "_CHUNK", 64)             # small chunks: tensors folded in several batches, some alone
    monkeypatch.setattr(R, "_CHUNK_CPU", 64)
    torch.manual_seed(0)
    ts = [torch.randn(n).to(dt) for n, dt in [(5, torch.float32), (0, torch.float32), (1, torch.bfloat16),
                                              (17, torch.float32), (40, torch.float16), (300, torch.float32),
                                              (33, torch.float32), (9, torch.int64)]]
    ts.append(torch.rand(12) > 0.5)
    ts.append(torch.randn(6, 4).t())                 # not contiguous
    want = torch.stack([R.checksum(t) for t in ts])
    assert torch.equal(R.checksums(ts), want)
    offsets = [3 * i for i in range(len(ts))]
    assert torch.equal(R.checksums(ts, offsets), torch.stack([R.checksum(t, o) for t, o in zip(ts, offsets)]))


def test_checksums_of_pieces_add_up_to_the_whole():
    from parallel_layers.composition.replica_check import checksum, checksums

    t = torch.randn(1000)
    cuts = [0, 7, 300, 301, 1000]
    pieces = [t[a:b] for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(checksums(pieces, cuts[:-1]).sum(0), checksum(t))
    assert torch.equal(sum(checksum(p, o) for p, o in zip(pieces, cuts)), checksum(t))


def test_replica_check_schedule_and_environment(monkeypatch):
    from parallel_layers.composition.replica_check import ENV, ReplicaCheck

    default = ReplicaCheck()
    assert [s for s in range(1, 301) if default.due(s)] == [1, 2, 3, 100, 200, 300]
    monkeypatch.setenv(ENV, "every")
    assert all(ReplicaCheck.default().due(s) for s in range(1, 50))
    monkeypatch.setenv(ENV, "2,10")
    assert [s for s in range(1, 31) if ReplicaCheck.default().due(s)] == [1, 2, 10, 20, 30]
    monkeypatch.setenv(ENV, "off")
    assert not any(ReplicaCheck.default().due(s) for s in range(1, 500))
    monkeypatch.setenv(ENV, "sometimes")
    with pytest.raises(ValueError, match="'every', 'off' or 'first,every'"):
        ReplicaCheck.default()


# ------------------------------------------------------------------------------------------ Qwen3 at tp 2
STEPS, BATCH, SEQ, LR, WD, CLIP = 3, 4, 12, 1e-4, 0.1, 1.0


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _no_decay(name, p):
    return p.ndim < 2


def _batches(steps=STEPS):
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen))
            for _ in range(steps)]


def _p3d(kind, dims, zero, dtype=torch.float32, **kw):
    from parallel_layers.composition.parallel3d import Parallel3D

    return Parallel3D(family_model(kind, dtype=dtype), cached_mesh(*dims), loss_fn=_loss,
                      optimizer=OptimizerConfig(lr=LR, weight_decay=WD, no_decay=_no_decay, max_grad_norm=CLIP),
                      pipeline=PipelineConfig(schedule="1f1b", num_microbatches=2),
                      data_parallel=DataParallelConfig(zero=zero), **kw)


def body_train(rank, world, kind, dims, zero, dtype=torch.float32):
    p3d = _p3d(kind, dims, zero, dtype)
    losses = [p3d.train_step(ids, tgt)["loss"] for ids, tgt in _batches()]
    with p3d.mode.full_parameters():
        norms = [p.detach().clone() for n, p in p3d.model.named_parameters()
                 if n.endswith(("q_norm.weight", "k_norm.weight"))]
    return dict(losses=losses, weights=p3d.dense_state_dict(), local_norms=norms)


def _reference(kind, dtype=torch.float32):
    dense = family_model(kind, dtype=dtype)
    decay = [p for n, p in dense.named_parameters() if not _no_decay(n, p)]
    plain = [p for n, p in dense.named_parameters() if _no_decay(n, p)]
    opt = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95),
                            eps=1e-8, weight_decay=WD)
    losses = []
    for ids, tgt in _batches():
        opt.zero_grad()
        loss = _loss(dense(input_ids=ids).logits, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in dense.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("kind,zero", [("qwen3", 1), ("qwen3", 3), ("olmo2", 1), ("olmo2", 3)])
def test_q_k_norms_train_like_one_process_at_tp2(dist_pools, kind, zero):
    """Qwen3: per-head norms (partial gradients summed over tp); OLMo2: norms over all heads' features
    (ShardedRMSNorm, its statistics all-reduced; before: a crash inside its attention)."""
    outs = dist_pools(2).run(body_train, kind, (1, 2, 1), zero)
    ref_losses, ref = _reference(kind)
    for rank, out in enumerate(outs):
        for got, want in zip(out["losses"], ref_losses):
            assert abs(got - want) <= 1e-5 * abs(want)
        for name, t in out["weights"].items():
            err = ((t.double() - ref[name].double()).norm() / ref[name].double().norm()).item()
            assert err <= 1e-5, f"rank {rank}: {name} is {err:.2e} off one process after {STEPS} steps"
    assert len(outs[0]["local_norms"]) == 8
    if kind == "qwen3":
        for a, b in zip(outs[0]["local_norms"], outs[1]["local_norms"]):
            assert torch.equal(a, b), "the tp ranks' copies of a q/k norm differ"


def body_drift(rank, world):
    from parallel_layers.composition.replica_check import ReplicaDivergence

    # plain data parallelism: every rank steps its own copy, so a drift stays (ZeRO-1/2 would overwrite
    # the copy with the shard owner's update at the end of the step)
    p3d = _p3d("llama", (2, 2, 1), 0)
    (ids, tgt), = _batches(1)
    p3d.train_step(ids, tgt)
    if rank == 3:                     # tp rank 1 of dp rank 1: its copy of one replicated norm drifts
        chunk = p3d.chunks[0]
        named = {chunk.dense_name(n): p for n, p in chunk.named_parameters()}
        with torch.no_grad():
            named["model.layers.1.post_attention_layernorm.weight"][5] += 1e-6
    with pytest.raises(ReplicaDivergence) as err:
        p3d.train_step(ids, tgt)
    return str(err.value)


def test_a_drifted_replica_is_named_on_every_rank(dist_pools):
    msgs = dist_pools(4).run(body_drift)
    for rank in (2, 3):            # the tp group [2, 3] and the dp group [1, 3] see it
        assert "model.layers.1.post_attention_layernorm.weight" in msgs[rank]
        assert "at step 2" in msgs[rank]
    assert "tp replicas over the group of ranks [2, 3]" in msgs[3]
    assert "ranks [2] / ranks [3]" in msgs[3]
    assert "data-parallel replicas over the group of ranks [1, 3]" in msgs[3]
    assert "another rank of the mesh" in msgs[0]


def body_batches(rank, world, variant):
    from parallel_layers.composition.replica_check import ReplicaDivergence

    p3d = _p3d("llama", (2, 1, 1), 1)
    (ids, tgt), = _batches(1)
    before = {n: p.detach().clone() for n, p in p3d.model.named_parameters()}
    if variant == "different":
        ids = ids.clone()
        ids[0, 0] = (ids[0, 0] + rank) % VOCAB        # a per-rank data loader
        with pytest.raises(ReplicaDivergence) as err:
            p3d.train_step(ids, tgt)
        msg = str(err.value)
    else:
        with pytest.raises(ValueError) as err:
            p3d.train_step(ids, tgt[:, 1:])            # shifted labels one token short
        msg = str(err.value)
    assert all(torch.equal(p, before[n]) for n, p in p3d.model.named_parameters()), "the step was applied"
    return msg


def test_ranks_handed_different_batches_are_refused_before_the_step(dist_pools):
    for msg in dist_pools(2).run(body_batches, "different"):
        assert "the global batch over the group of ranks [0, 1] at step 1" in msg
        assert "inputs (copies differ: ranks [0] / ranks [1])" in msg
        assert "same GLOBAL batch" in msg


def test_labels_of_the_wrong_shape_are_refused_at_train_step(dist_pools):
    for msg in dist_pools(2).run(body_batches, "labels"):
        assert "targets of shape (4, 11) do not match the inputs of shape (4, 12)" in msg


def body_sharded_norm(rank, world, dtype):
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from parallel_layers.tensor_parallel.sharded_norm import ShardedRMSNorm

    torch.manual_seed(0)
    dense = Olmo2RMSNorm(16).to(dtype)
    with torch.no_grad():
        dense.weight.normal_()
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    probe = torch.randn(3, 5, 16, dtype=dtype)
    (dense(x) * probe).sum().backward()
    layer = ShardedRMSNorm.from_dense(dense, cached_mesh(1, 2, 1).tp_group)
    part = slice(8 * rank, 8 * rank + 8)
    x_local = x.detach()[..., part].clone().requires_grad_()
    y = layer(x_local)
    (y * probe[..., part]).sum().backward()       # each rank's loss sees its own features
    return dict(y=y.detach(), want=dense(x).detach()[..., part], dx=x_local.grad, want_dx=x.grad[..., part],
                dw=layer.weight.grad, want_dw=dense.weight.grad[part])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_sharded_rms_norm_matches_the_dense_norm(dist_pools, dtype):
    """Forward and both gradients of OLMo2's norm split over 2 ranks against the dense module: within fp32
    rounding (the module computes its statistics in fp32 whatever the dtype: 1e-6) and a bf16 rounding of
    the output in bf16 (2e-2)."""
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for out in dist_pools(2).run(body_sharded_norm, dtype):
        for got, want in (("y", "want"), ("dx", "want_dx"), ("dw", "want_dw")):
            torch.testing.assert_close(out[got], out[want], rtol=tol, atol=tol)


class OffsetRMSNorm(torch.nn.Module):
    """Gemma's kind of RMSNorm, (1 + w) * x_normed: not a formula ShardedRMSNorm reproduces."""

    def __init__(self, n):
        super().__init__()
        self.weight, self.variance_epsilon = torch.nn.Parameter(torch.zeros(n)), 1e-6

    def forward(self, x):
        x32 = x.float()
        return ((1 + self.weight) * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


def body_refused(rank, world):
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.families.infer_plan import PlanError

    model = family_model("olmo2")
    model.model.layers[0].self_attn.q_norm = OffsetRMSNorm(32)
    with pytest.raises(PlanError) as err:
        Parallel3D(model, cached_mesh(1, 2, 1), loss_fn=_loss)
    return str(err.value)


def test_a_norm_over_all_heads_it_cannot_reproduce_is_refused_naming_the_module(dist_pools):
    for msg in dist_pools(2).run(body_refused):
        assert "cannot place model.layers.0.self_attn.q_norm (OffsetRMSNorm)" in msg
        assert "normalizes over all heads' features at once" in msg and "tp=1" in msg


def body_tied_dp4(rank, world, dims, zero):
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False, tie_embeddings=True)
    model = Parallel3D(cfg, cached_mesh(*dims), optimizer=OptimizerConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=0.5),
                       pipeline=PipelineConfig(num_microbatches=2), data_parallel=DataParallelConfig(zero=zero))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randint(0, 64, (8, 9), generator=gen)
        losses.append(model.train_step(x[:, :-1], x[:, 1:])["loss"])    # the replica check runs every step
    return losses, model.dense_state_dict()


@pytest.mark.parametrize("zero", [1, 3])
def test_tied_weights_stay_bit_identical_at_dp4_and_train_like_one_process(dist_pools, zero):
    """dp 4 x pp 2, tied embedding: the buckets' reduction summed the two copies' gradients in different
    orders (their places in each stage's buckets differ), so the copies came apart by a rounding; the
    tied gradient is now reduced over dp alone first. Every step's replica check passes, and every
    parameter matches one process."""
    (losses, weights), = dist_pools(8).run(body_tied_dp4, (4, 1, 2), zero)[:1]
    (ref_losses, ref), = dist_pools(1).run(body_tied_dp4, (1, 1, 1), 1 if zero == 1 else 0)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want)
    for name, t in weights.items():
        assert ((t - ref[name]).norm() / ref[name].norm()).item() <= 1e-5, name
