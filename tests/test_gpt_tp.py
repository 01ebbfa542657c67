"""The reference GPT at tp = 2 and 4 equals the plain single-process GPT built from the same seed.

Each rank builds both models (``GPT(cfg)`` and ``GPT(cfg, tp_group=...)``) from one seed, trains both
5 AdamW steps on the same batches and compares the losses, the gathered gradients of the first step
and the gathered parameters after every step; every rank's figures are checked.

Two precisions:

* float64, every case, tolerance 1e-10 relative (to each tensor's largest entry): rounding only.
* fp32, tolerance 1e-5 relative: losses and step-0 gradients elementwise (to the tensor's largest
  entry), parameters in norm (``|a - b| / |b|``). The key bias is left out of the fp32 parameter
  check: its exact gradient is zero (softmax is shift-invariant, ``q . b_k`` adds the same number to a
  whole row of scores), so both models' key-bias gradients are pure rounding noise and Adam's
  ``m / sqrt(v)`` turns any noise into steps of size ``lr``: the two copies drift apart by up to
  ``lr`` per step whatever the implementation. The float64 runs cover it (noise far below Adam's eps).
"""
import pytest
import torch

from parallel_layers.models import GPT, GPTConfig
from parallel_layers.testing import cached_mesh
from parallel_layers.testing.compare import worst

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
SMALL = dict(vocab_size=101, n_layer=2, n_head=4, d_model=32, max_seq_len=16, dropout=0.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _not_key_bias(cfg, name, t):
    """fp32 parameter check: the key rows of the qkv bias are left out (see the module docstring)."""
    if not name.endswith("attn.qkv.bias"):
        return t
    hd = cfg.d_model // cfg.n_head
    return t.view(cfg.n_head, 3, hd)[:, [0, 2]]


def _max_rel(full: dict, ref: dict, metric=_rel, select=None) -> tuple:
    assert full.keys() == ref.keys(), (sorted(full), sorted(ref))
    for k in full:
        assert full[k].shape == ref[k].shape, (k, full[k].shape, ref[k].shape)
    if select is not None:
        full = {k: select(k, v) for k, v in full.items()}
        ref = {k: select(k, v) for k, v in ref.items()}
    return worst((metric(full[k], ref[k]), k) for k in full)


def body_parity(rank, world, tp, overrides, dtype, steps=5, seed=7):
    cfg = GPTConfig(**{**SMALL, **overrides})
    group = cached_mesh(dp=world // tp, tp=tp).tp_group
    torch.manual_seed(seed)
    dense = GPT(cfg, dtype=dtype)
    torch.manual_seed(seed)
    model = GPT(cfg, tp_group=group, dtype=dtype)
    if dtype == torch.float64:
        metric, select = _rel, None
    else:
        metric, select = _rel_norm, lambda k, t: _not_key_bias(cfg, k, t)
    out = {"init_equal": all(torch.equal(a, dense.state_dict()[k]) for k, a in model.dense_state_dict().items())}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (dense, model)]
    gen = torch.Generator().manual_seed(123)
    losses, param_err = [], []
    for step in range(steps):
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=gen)
        tgt = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=gen)
        tgt[0, :3] = -100  # ignored positions
        pair = []
        for m, opt in zip((dense, model), opts):
            opt.zero_grad(set_to_none=True)
            logits, loss = m(idx, tgt)
            assert logits is None
            loss.backward()
            if m is model:
                m.finish_grads()
            pair.append(loss.item())
        losses.append(pair)
        if step == 0:
            out["grad_err"] = _max_rel(model.dense_state_dict(grads=True),
                                       {n: p.grad for n, p in dense.named_parameters()})
        for opt in opts:
            opt.step()
        param_err.append(_max_rel(model.dense_state_dict(), dense.state_dict(), metric, select))
    # Logits: gathered to the true vocabulary, equal to the dense model's.
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=gen)
    with torch.no_grad():
        logits, loss = model(idx)
        ref, _ = dense(idx)
    out.update(losses=losses, param_err=param_err, logits_shape=tuple(logits.shape), logits_err=_rel(logits, ref),
               padded=model.vocab_size_padded, n_params=sum(p.numel() for p in model.parameters()))
    return out


F64, F32 = torch.float64, torch.float32
CASES = [  # (world, tp, overrides, dtype); vocab 101 is padded to 102 (tp 2) and 104 (tp 4)
    (2, 2, dict(tie_embeddings=True), F64),
    (2, 2, dict(tie_embeddings=False), F64),
    (2, 2, dict(tie_embeddings=True, sequence_parallel=True), F64),
    (2, 2, dict(tie_embeddings=False, sequence_parallel=True, vocab_size=100), F64),
    (4, 4, dict(tie_embeddings=True), F64),
    (4, 4, dict(tie_embeddings=False, sequence_parallel=True), F64),
    (2, 2, dict(tie_embeddings=True), F32),
    (2, 2, dict(tie_embeddings=False, sequence_parallel=True), F32),
    (4, 4, dict(tie_embeddings=False), F32),
    (4, 4, dict(tie_embeddings=True, sequence_parallel=True), F32),
]


@pytest.mark.parametrize("world,tp,overrides,dtype", CASES,
                         ids=[f"tp{tp}-{str(d)[6:]}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              for _, tp, o, d in CASES])
def test_gpt_tp_matches_dense(dist_pools, world, tp, overrides, dtype):
    results = dist_pools(world).run(body_parity, tp, overrides, dtype)
    tol = TOL[dtype]
    vocab = overrides.get("vocab_size", SMALL["vocab_size"])
    dense_params = None
    for rank, out in enumerate(results):
        assert out["init_equal"], f"rank {rank}: the TP model's initial weights differ from the dense model's"
        assert out["padded"] == -(-vocab // tp) * tp
        if dense_params is None:
            dense_params = out["n_params"]
        err, name = out["grad_err"]
        assert err < tol, f"rank {rank}: gradient of {name} differs by {err:.2e} (relative)"
        for step, (ref, got) in enumerate(out["losses"]):
            assert abs(got - ref) <= tol * abs(ref), f"rank {rank} step {step}: loss {got} vs dense {ref}"
            assert got == results[0]["losses"][step][1], "the TP loss must be identical on every rank"
        for step, (err, name) in enumerate(out["param_err"]):
            assert err < tol, f"rank {rank} after step {step}: {name} differs by {err:.2e} (relative)"
        assert out["logits_shape"] == (2, SMALL["max_seq_len"], vocab)
        assert out["logits_err"] < tol, out["logits_err"]


def body_dropout(rank, world, sequence_parallel):
    """With dropout on, training runs; every TP rank sees the same loss (replicated dropout agrees)."""
    cfg = GPTConfig(**{**SMALL, "dropout": 0.1, "sequence_parallel": sequence_parallel})
    torch.manual_seed(3)
    model = GPT(cfg, tp_group=cached_mesh(tp=world).tp_group)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))
    _, loss_train = model(idx, idx)
    loss_train.backward()
    model.finish_grads()
    model.eval()
    _, loss_eval = model(idx, idx)
    return loss_train.item(), loss_eval.item()


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_runs_and_ranks_agree(dist_pools, sequence_parallel):
    out = dist_pools(2).run(body_dropout, sequence_parallel)
    assert out[0] == out[1]
    assert out[0][0] != out[0][1]  # dropout did something in training mode


def body_checkpoint_dropout(rank, world, sequence_parallel):
    """One forward/backward at tp = 2 with dropout on: plain, every block checkpointed, the first block
    checkpointed, and plain with other masks (both streams reseeded). Returns whether each run's local
    gradients equal the plain run's, and each run's block forward count."""
    group = cached_mesh(tp=world).tp_group
    idx = torch.randint(0, SMALL["vocab_size"], (2, SMALL["max_seq_len"]), generator=torch.Generator().manual_seed(2))
    grads, calls = [], []
    for ckpt, seed in ((False, 5), (True, 5), (1, 5), (False, 6)):
        cfg = GPTConfig(**{**SMALL, "dropout": 0.2, "sequence_parallel": sequence_parallel, "seed": seed})
        torch.manual_seed(3)
        model = GPT(cfg, tp_group=group, checkpoint=ckpt)
        count = [0]
        for block in model.blocks:
            block.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        torch.manual_seed(seed)
        model(idx, idx)[1].backward()
        model.finish_grads()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        calls.append(count[0])
    return [torch.equal(grads[0], g) for g in grads[1:]], calls


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_checkpointing_inside_tp_regions_replays_dropout(dist_pools, sequence_parallel):
    for r, (same, calls) in enumerate(dist_pools(2).run(body_checkpoint_dropout, sequence_parallel)):
        assert same == [True, True, False], (r, same)      # the last: other masks must change something
        assert calls == [2, 4, 3, 2], (r, calls)           # 2 blocks; recomputed ones run twice


def body_bad_inputs(rank, world):
    mesh = cached_mesh(tp=world)
    msgs = {}
    for key, fn in {
        "heads": lambda: GPT(GPTConfig(**{**SMALL, "n_head": 3, "d_model": 24}), tp_group=mesh.tp_group),
        "d_ff": lambda: GPT(GPTConfig(**{**SMALL, "d_ff": 33}), tp_group=mesh.tp_group),
        "group_type": lambda: GPT(GPTConfig(**SMALL), tp_group="tp"),
        "sp_seq": lambda: GPT(GPTConfig(**{**SMALL, "sequence_parallel": True}),
                              tp_group=mesh.tp_group)(torch.zeros(2, 15, dtype=torch.long)),
        "too_long": lambda: GPT(GPTConfig(**SMALL), tp_group=mesh)(torch.zeros(2, 17, dtype=torch.long)),
        "bad_id": lambda: GPT(GPTConfig(**SMALL), tp_group=mesh)(torch.full((2, 4), 101)),
    }.items():
        try:
            fn()
            msgs[key] = None
        except (TypeError, ValueError) as exc:
            msgs[key] = f"{type(exc).__name__}: {exc}"
    # A ParallelMesh is accepted in place of its TP group.
    msgs["mesh_ok"] = GPT(GPTConfig(**SMALL), tp_group=mesh).tp_size
    return msgs


def test_bad_inputs_are_clear_errors(dist_pools):
    for _rank, m in enumerate(dist_pools(2).run(body_bad_inputs)):
        assert m["heads"] and "n_head=3 does not divide by the tensor-parallel size 2" in m["heads"], m
        assert m["d_ff"] and "d_ff=33" in m["d_ff"], m
        assert m["group_type"] and m["group_type"].startswith("TypeError") and "ProcessGroup" in m["group_type"]
        assert m["sp_seq"] and "sequence length 15 does not divide" in m["sp_seq"], m
        assert m["too_long"] and "max_seq_len=16" in m["too_long"], m
        assert m["bad_id"] and "[0, 101)" in m["bad_id"], m
        assert m["mesh_ok"] == 2


def test_dense_model_single_process():
    """tp_group=None: the plain model, no torch.distributed needed; blocks are an nn.ModuleList."""
    torch.manual_seed(0)
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    logits, loss = model(idx, idx, return_logits=True)
    assert logits.shape == (2, 16, 101)
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 101), idx.reshape(-1)))
    # Causal: changing a later token leaves earlier logits alone.
    idx2 = idx.clone()
    idx2[:, 10] = (idx2[:, 10] + 1) % 101
    torch.testing.assert_close(model(idx2)[0][:, :10], logits[:, :10])
    assert model.wte.weight is not None and model.lm_head is None  # tied head reads the embedding
    with pytest.raises(ValueError, match="d_model=30 does not divide by n_head=4"):
        GPTConfig(**{**SMALL, "d_model": 30})



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduced_precision_model_starts_from_the_rounded_fp32_weights(dtype):
    """Weights are drawn in fp32 and rounded: a reduced-precision draw is not the fp32 draw rounded
    (torch's uniform_ maps values that round up to the bound to the lower bound, flipping their sign)."""
    cfg = GPTConfig(vocab_size=101, n_layer=4, n_head=4, d_model=256, max_seq_len=16)
    torch.manual_seed(0)
    ref = {k: v.to(dtype) for k, v in GPT(cfg).state_dict().items()}
    torch.manual_seed(0)
    low = GPT(cfg, dtype=dtype)
    for k, v in low.state_dict().items():
        assert v.dtype == dtype and torch.equal(v, ref[k]), k
    built = cfg.build(seed=0, dtype=dtype)          # what Parallel3D builds from a config
    for k, v in built.state_dict().items():
        assert v.dtype == dtype and torch.equal(v, ref[k]), k
