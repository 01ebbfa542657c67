"""Expert parallelism as a mesh dimension: the reference MoE GPT in ``Parallel3D`` at ep 2 and 4, dp x ep,
dp x ep x pp, tp x ep, with ZeRO 0-2, against one process training the same model on the same micro-batches.

Compared on every rank: the losses, the routers' auxiliary losses (each layer's, on the last micro-batch: the
whole micro-batch's value over all ranks), and every parameter (the experts gathered over ep), within 1e-5;
the replica check (on by default for the first steps) holds the dense parameters bit-identical over dp x ep
and each expert over its own replicas.
"""
from __future__ import annotations

import pytest
import torch

# bias=False as in test_3d: the key bias's gradient is zero up to rounding, which Adam turns into full steps
CONFIG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False, num_experts=4,
              moe_top_k=2, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.001)
LR, STEPS, ROWS = 1e-3, 5, 8


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CONFIG["vocab_size"], (ROWS, 9), generator=g) for _ in range(STEPS)]


def _moe_aux(modules) -> dict:
    """``{router weight's dense name: (the layer's last auxiliary loss, its tokens' experts)}`` for
    ``(dense_name, module)`` pairs."""
    from parallel_layers.moe.expert_parallel import moe_layers
    return {name: (float(layer.stats["aux_loss"]), layer.stats["experts"]) for name, m in modules
            for layer in moe_layers(m)}


def one_process(shards: int, microbatches: int):
    """The plain GPT trained on the global batches, gradient accumulation over the micro-batches the mesh
    runs (micro-batch m: the m-th slice of every replica's rows), AdamW and clipping as Parallel3D's."""
    import torch.nn.functional as F

    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.moe.expert_parallel import moe_layers
    model = GPTConfig(**CONFIG).build(seed=0)
    for layer in moe_layers(model):
        layer.aux_loss_scale = 1.0 / microbatches
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)
    per = ROWS // shards
    mb = per // microbatches
    losses = []
    for b in _batches():
        x, y = b[:, :-1], b[:, 1:]
        total = 0.0
        for m in range(microbatches):
            rows = torch.cat([torch.arange(r * per + m * mb, r * per + (m + 1) * mb) for r in range(shards)])
            logits, _ = model(x[rows])
            loss = F.cross_entropy(logits.flatten(0, 1), y[rows].flatten(), reduction="sum") / y.numel()
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    aux = {f"blocks.{i}.mlp.router.weight": (float(layer.stats["aux_loss"]), layer.stats["experts"])
           for i, layer in enumerate(moe_layers(model))}
    return losses, {k: v.detach() for k, v in model.state_dict().items()}, aux


def body_moe_parity(rank, world, sizes, zero, schedule, microbatches, sequence_parallel=False):
    from parallel_layers import DataParallelConfig, OptimizerConfig, Parallel3D, PipelineConfig
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.moe import ExpertParallelMoE
    from parallel_layers.testing import cached_mesh

    mesh = cached_mesh(**sizes)
    config = GPTConfig(**CONFIG, sequence_parallel=sequence_parallel)
    p3d = Parallel3D(config, mesh, seed=0, optimizer=OptimizerConfig(lr=LR),
                     pipeline=PipelineConfig(schedule=schedule, num_microbatches=microbatches),
                     data_parallel=DataParallelConfig(zero=zero))
    sharded = [m for c in p3d.chunks for m in c.modules() if isinstance(m, ExpertParallelMoE)]
    losses = [p3d.train_step(b[:, :-1], b[:, 1:])["loss"] for b in _batches()]
    state = p3d.dense_state_dict()
    aux = _moe_aux([(c.dense_name(n + ".router.weight"), m) for c in p3d.chunks for n, m in c.named_modules()
                    if n.endswith("mlp")])
    ref_losses, ref_state, ref_aux = one_process(mesh.batch_shards, microbatches)
    # routing decisions, token by token: this rank's tokens of the last micro-batch are the batch_rank-th
    # slice of the one-process micro-batch's rows (under sequence parallelism the tp_rank-th piece of each row)
    same_routes = []
    seq, pieces, piece = CONFIG["max_seq_len"], *((mesh.tp, mesh.tp_rank) if sequence_parallel else (1, 0))
    for k, (_, experts) in aux.items():
        if mesh.cp == 1:       # (with cp a rank's tokens are a zigzag share of each sequence's)
            ref = ref_aux[k][1].view(-1, seq, experts.shape[-1])
            rows = ref.shape[0] // mesh.batch_shards
            mine = ref[mesh.batch_rank * rows:(mesh.batch_rank + 1) * rows,
                       piece * seq // pieces:(piece + 1) * seq // pieces]
            same_routes.append(torch.equal(experts, mine.reshape(experts.shape)))
    out = {"loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
           "param": max((state[k] - ref_state[k]).abs().max().item() for k in state),
           "aux": max(abs(aux[k][0] - ref_aux[k][0]) for k in aux), "layers": len(aux), "params": len(state),
           "same_routes": same_routes,
           "local_experts": sorted({m.num_local_experts for m in sharded}),
           "worst": sorted(((state[k] - ref_state[k]).abs().max().item(), k) for k in state)[-4:]}
    return out


CASES = {
    "ep2": (2, dict(ep=2), 0, "1f1b", 1),
    "ep4": (4, dict(ep=4), 0, "1f1b", 1),
    "dp2ep2-zero1": (4, dict(dp=2, ep=2), 1, "1f1b", 1),
    "tp2ep2-zero2": (4, dict(tp=2, ep=2), 2, "1f1b", 2),
    "dp2ep2pp2-zero1": (8, dict(dp=2, ep=2, pp=2), 1, "1f1b", 2),
    "dp2ep2-zero3": (4, dict(dp=2, ep=2), 3, "1f1b", 2),
    "ep2pp2-zero3": (4, dict(ep=2, pp=2), 3, "1f1b", 2),
    "ep2pp2-zbv": (4, dict(ep=2, pp=2), 1, "zbv", 2),
    "ep2pp2-interleaved": (4, dict(ep=2, pp=2), 0, "interleaved", 4),
    "ep2pp2-zb-h1": (4, dict(ep=2, pp=2), 2, "zb-h1", 2),
    "cp2ep2": (4, dict(cp=2, ep=2), 1, "1f1b", 1),
    # sequence parallelism: each tp rank routes its piece of the sequence, the experts' gradients summed over tp
    "tp2ep2-sp-zero2": (4, dict(tp=2, ep=2), 2, "1f1b", 2, True),
    "tp2ep2pp2-sp-zero3": (8, dict(tp=2, ep=2, pp=2), 3, "1f1b", 2, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_gpt_trains_like_one_process(case, dist_pools):
    world, sizes, zero, schedule, m, *sp = CASES[case]
    ep = sizes.get("ep", 1)
    for rank, out in enumerate(dist_pools(world).run(body_moe_parity, sizes, zero, schedule, m, *sp)):
        assert out["local_experts"] == ([CONFIG["num_experts"] // ep] if out["layers"] and ep > 1 else []), (rank,
                                                                                                            out)
        assert out["loss"] < 1e-5 and out["aux"] < 1e-5 and out["param"] < 1e-5, (case, rank, out["worst"], out)
        assert out["layers"] >= 1 and out["params"] >= 1 and all(out["same_routes"]), out


def body_refusals(rank, world):
    from parallel_layers import DataParallelConfig, Parallel3D
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.testing import cached_mesh
    errors = {}
    for what, cfg, zero in (("dense", dict(CONFIG, num_experts=0), 0),):
        try:
            Parallel3D(GPTConfig(**cfg), cached_mesh(ep=2), seed=0, data_parallel=DataParallelConfig(zero=zero))
        except ValueError as e:
            errors[what] = str(e)
    return errors


def test_expert_parallel_refusals_name_the_fix(dist_pools):
    for errors in dist_pools(2).run(body_refusals):
        assert "has none" in errors["dense"] and "GPTConfig(num_experts" in errors["dense"], errors


# ---------------------------------------------------------------------- universal checkpoints across ep sizes
def _p3d(sizes, zero, seed):
    from parallel_layers import DataParallelConfig, OptimizerConfig, Parallel3D, PipelineConfig
    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.testing import cached_mesh
    return Parallel3D(GPTConfig(**CONFIG), cached_mesh(**sizes), seed=seed, optimizer=OptimizerConfig(lr=LR),
                      pipeline=PipelineConfig(num_microbatches=1), data_parallel=DataParallelConfig(zero=zero))


def body_save_moe(rank, world, sizes, zero, path):
    from parallel_layers.composition.universal_checkpoint import save_universal
    model = _p3d(sizes, zero, seed=0)
    losses = [model.train_step(b[:, :-1], b[:, 1:])["loss"] for b in _batches()[:2]]
    save_universal(model, path)
    return losses


def body_resume_moe(rank, world, sizes, zero, path):
    from parallel_layers.composition.universal_checkpoint import load_universal
    model = _p3d(sizes, zero, seed=99)           # another init: every expert must come from the files
    load_universal(model, path)
    losses = [model.train_step(b[:, :-1], b[:, 1:])["loss"] for b in _batches()[2:]]
    return losses, model.dense_state_dict()


@pytest.mark.parametrize("saving,resuming", [((dict(ep=2), 1), (dict(ep=4), 0)), ((dict(ep=2), 3), (dict(dp=2), 1))],
                         ids=["ep2-zero1-to-ep4", "ep2-zero3-to-dp2-zero1"])
def test_universal_checkpoint_reshards_experts_across_ep_sizes(saving, resuming, dist_pools, tmp_path):
    from parallel_layers.composition.universal_checkpoint import read_universal
    from parallel_layers.testing import WorkerPool
    path = str(tmp_path / "ckpt")
    world = lambda sizes: sizes.get("ep", 1) * sizes.get("dp", 1)          # noqa: E731
    saved = dist_pools(world(saving[0])).run(body_save_moe, *saving, path)
    with WorkerPool(world(resuming[0])) as pool:                     # new processes, another ep size
        resumed = pool.run(body_resume_moe, *resuming, path)
    ref_losses, ref_state, _ = one_process(1, 1)
    ckpt = read_universal(path)
    assert ckpt["model"]["blocks.0.mlp.experts.up_proj"].shape[0] == CONFIG["num_experts"]
    for r, (before, (after, state)) in enumerate(zip(saved * 2, resumed)):
        assert max(abs(a - b) for a, b in zip(before + after, ref_losses)) < 1e-5, (r, before, after, ref_losses)
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        assert worst < 1e-5, (r, worst)


def test_demo_trains_the_moe_gpt_with_expert_parallelism(tmp_path):
    """``demo --model moe --ep 2``: the MoE GPT at ep2 x pp2 with ZeRO-1 agrees with one process (which
    accumulates the same micro-batches), and its universal checkpoint holds every expert."""
    import json
    import os
    import subprocess
    import sys

    out, save = tmp_path / "demo", tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--model", "moe", "--ep", "2", "--dp", "1", "--tp", "1",
           "--pp", "2", "--zero", "1", "--steps", "3", "--n-layer", "2", "--d-model", "16", "--n-head", "2",
           "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--corpus-bytes", "200000",
           "--eval-interval", "0", "--out", str(out), "--no-progress", "--save", str(save)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3D run (moe): dp=1 ep=2 tp=1 pp=2, zero=1" in proc.stdout and "losses and validation losses agree" in \
        proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agree"] is True and len(summary["losses"]["parallel"]) == 3
    meta = json.loads((save / "iter_0000003" / "meta.json").read_text())
    assert meta["tensors"]["blocks.1.mlp.experts.down_proj"]["shape"][0] == 4, meta["tensors"]


def test_demo_refuses_ep_without_experts():
    from parallel_layers.cli import demo
    args = demo.build_parser().parse_args(["--ep", "2"])
    with pytest.raises(SystemExit, match="--ep 2 splits the experts of an MoE model: use --model moe"):
        demo.check_args(args)
