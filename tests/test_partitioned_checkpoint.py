"""Partitioned and offloaded checkpoint inputs (``parallel_layers.activations.partitioned_checkpoint``, ZeRO-R's P_a).

On two real gloo ranks (tp 2), the reference GPT with dropout 0.1 and every block checkpointed, trained for
two SGD steps from one seed, once per way of keeping the checkpoint inputs: whole (plain checkpointing, the
oracle), ``partition``, ``offload`` and ``partition+offload``. On every rank: the losses, every gradient and
every parameter after the steps equal plain checkpointing's bit for bit (``torch.equal``: the recomputation
reads the very values the forward read, and replays the same dropout masks, TP stream included; that plain
checkpointing equals no checkpointing is test_gpt_tp's). At the end of forward the inputs kept are measured
(``SavedInputs.kept_bytes``): partition keeps 1/tp of plain checkpointing's bytes on the device, offload none
on the device (all of it on the host), both 1/tp on the host; after backward nothing is kept. The
recomputation all-gathers once per checkpointed block. Under sequence parallelism (the input already a
shard) ``partition+offload`` only offloads, with the same exactness.
"""
import pytest
import torch

from parallel_layers import DataParallelConfig, OptimizerConfig, PipelineConfig
from parallel_layers.activations.partitioned_checkpoint import SavedInputs
from parallel_layers.testing import cached_mesh

MODES = ("partition", "offload", "partition+offload")


def _train(rank, mesh, checkpoint, mode, sp=False, steps=2):
    from parallel_layers.distributed import collectives
    from parallel_layers.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=3, n_head=2, d_model=16, max_seq_len=8, dropout=0.1,
                    sequence_parallel=sp)
    torch.manual_seed(0)
    model = GPT(cfg, tp_group=mesh.tp_group, checkpoint=checkpoint, checkpoint_inputs=mode).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gathered, kept_fwd, kept_after = [], None, None
    real = collectives.all_gather_dim0

    def counting(t, group, *a, **k):
        gathered.append(tuple(t.shape))
        return real(t, group, *a, **k)

    losses, grads = [], {}
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        idx = torch.randint(0, 64, (2, 8), generator=g)
        tgt = torch.randint(0, 64, (2, 8), generator=g)
        torch.manual_seed(7 + step)                     # the default stream (replicated dropout), alike
        opt.zero_grad()
        _, loss = model(idx, tgt)
        if step == 0 and model.saved_inputs is not None:
            kept_fwd = model.saved_inputs.kept_bytes()
        collectives.all_gather_dim0 = counting
        try:
            loss.backward()
        finally:
            collectives.all_gather_dim0 = real
        model.finish_grads()
        if step == 0:
            kept_after = model.saved_inputs.kept_bytes() if model.saved_inputs is not None else None
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.detach())
        opt.step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, kept_fwd=kept_fwd, kept_after=kept_after, gathers=gathered)


def body_modes(rank, world):
    mesh = cached_mesh(tp=world)
    plain = _train(rank, mesh, True, None)
    out = {"rank": rank}
    # The whole input of one block [2, 8, 16] float32, per checkpointed block (3 blocks)
    whole = 3 * 2 * 8 * 16 * 4
    for mode in MODES:
        run = _train(rank, mesh, True, mode)
        out[mode] = dict(same=_same(run, plain), kept_fwd=run["kept_fwd"], kept_after=run["kept_after"],
                         gathers=run["gathers"])
    sp_plain = _train(rank, mesh, True, None, sp=True)
    sp_run = _train(rank, mesh, True, "partition+offload", sp=True)
    out["sp"] = dict(same=_same(sp_run, sp_plain), kept_fwd=sp_run["kept_fwd"], gathers=sp_run["gathers"])
    out["whole"] = whole
    return out


def _same(a, b):
    """Names of what differs (bit for bit) between two runs: [] when everything is equal."""
    diff = [f"loss{i}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"])) if not torch.equal(x, y)]
    for key in ("grads", "params"):
        diff += [f"{key}:{n}" for n in a[key] if not torch.equal(a[key][n], b[key][n])]
    return diff


def test_partitioned_and_offloaded_inputs_equal_plain_checkpointing(dist_pools):
    results = dist_pools(2).run(body_modes)
    for out in results:
        r = out["rank"]
        whole = out["whole"]
        for mode in MODES:
            m = out[mode]
            assert m["same"] == [], f"rank {r} {mode}: differs from plain checkpointing in {m['same'][:5]}"
            assert m["kept_after"] == {"device": 0, "host": 0}, f"rank {r} {mode}: kept after backward {m}"
            part = "partition" in mode
            want = whole // 2 if part else whole
            if "offload" in mode:
                assert m["kept_fwd"] == {"device": 0, "host": want}, f"rank {r} {mode}: {m['kept_fwd']}"
            else:
                assert m["kept_fwd"] == {"device": want, "host": 0}, f"rank {r} {mode}: {m['kept_fwd']}"
            slices = [s for s in m["gathers"] if s == (2 * 8 * 16 // 2,)]
            # one all-gather per checkpointed block (3) per backward (2 steps)
            assert len(slices) == (6 if part else 0), f"rank {r} {mode}: all-gathers {m['gathers']}"
        sp = out["sp"]
        assert sp["same"] == [], f"rank {r} sequence parallel: differs in {sp['same'][:5]}"
        # the input is already a [2, 8/2, 16] shard: kept whole (not sliced again), on the host
        assert sp["kept_fwd"] == {"device": 0, "host": whole // 2}, f"rank {r} sequence parallel: {sp['kept_fwd']}"


def test_one_process_offload_and_bad_modes():
    from parallel_layers.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=8, max_seq_len=4, dropout=0.1)
    runs = []
    for mode in (None, "offload", "partition"):    # partition without a TP group: kept whole
        torch.manual_seed(0)
        model = GPT(cfg, checkpoint=True, checkpoint_inputs=mode).train()
        idx = torch.arange(8).reshape(2, 4) % 32
        torch.manual_seed(1)
        model(idx, idx)[1].backward()
        runs.append([p.grad for p in model.parameters()])
        if mode == "partition":
            assert not model.saved_inputs.active
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))
    with pytest.raises(ValueError, match="checkpoint_inputs='offload' applies to checkpointed blocks"):
        GPT(cfg, checkpoint=False, checkpoint_inputs="offload")
    with pytest.raises(ValueError, match="choose one of"):
        SavedInputs.from_mode("sliced")


# ------------------------------------------------------------------------------------------- in Parallel3D
def _train_3d(mesh, model, mode, **opts):
    from parallel_layers.composition.parallel3d import Parallel3D

    p3d = Parallel3D(model, mesh, optimizer=OptimizerConfig(lr=1e-2),
                     pipeline=PipelineConfig(num_microbatches=2, checkpoint=True, checkpoint_inputs=mode),
                     data_parallel=DataParallelConfig(zero=1), **opts)
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(2):
        idx, tgt = torch.randint(0, 64, (4, 8), generator=gen), torch.randint(0, 64, (4, 8), generator=gen)
        losses.append(p3d.train_step(idx, tgt)["loss"])
    parts = {c.saved_inputs.parts if c.saved_inputs is not None else 1 for c in p3d.chunks}
    return losses, [p.detach().clone() for p in p3d.model.parameters()], parts


def body_parallel3d(rank, world):
    """tp 2 x pp 2, ZeRO-1: the reference GPT (dropout 0.1) and HF Llama through Parallel3D(checkpoint_inputs=)."""
    import copy

    from hf_models import hf_model, loss_fn

    from parallel_layers.models.gpt import GPTConfig

    mesh = cached_mesh(1, 2, 2)
    cfg = GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, dropout=0.1)
    llama = hf_model("llama", tie=False)
    cases = {"gpt": (lambda: cfg, {}), "llama": (lambda: copy.deepcopy(llama), {"loss_fn": loss_fn})}
    out = {}
    for name, (make, opts) in cases.items():
        plain_losses, plain_params, _ = _train_3d(mesh, make(), None, **opts)
        for mode in (("partition+offload", "partition") if name == "gpt" else ("partition",)):
            losses, params, parts = _train_3d(mesh, make(), mode, **opts)
            out[f"{name}-{mode}"] = dict(
                parts=parts, losses=[float(x) for x in losses],
                same=[float(x) for x in losses] == [float(x) for x in plain_losses]
                and len(params) == len(plain_params) and all(torch.equal(a, b) for a, b in zip(params, plain_params)))
    return out


def test_parallel3d_checkpoint_inputs_equal_plain_checkpointing(dist_pools):
    for rank, out in enumerate(dist_pools(4).run(body_parallel3d)):
        assert set(out) == {"gpt-partition+offload", "gpt-partition", "llama-partition"}, out
        for case, got in out.items():
            assert got["same"], (rank, case, got)           # losses and every weight after 2 steps: bit for bit
            assert got["parts"] == {2}, (rank, case, got)   # the inputs really were cut over the 2 TP ranks


def test_parallel3d_checkpoint_inputs_need_checkpointing():
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=8)
    with pytest.raises(ValueError, match="checkpoint_inputs='partition' applies to checkpointed blocks"):
        Parallel3D(cfg, _mesh_stub(), pipeline=PipelineConfig(checkpoint_inputs="partition"))


def _mesh_stub():
    """A stand-in mesh for an argument check that fails before any group is used."""
    from types import SimpleNamespace
    return SimpleNamespace(dp=1, tp=1, pp=1, cp=1, tp_group=None, dp_group=None, pp_group=None, cp_group=None,
                           replica_group=None, replicas=1)
