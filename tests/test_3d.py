"""3D parallelism (dp=2 x tp=2 x pp=2, 8 gloo processes, every rank checked) against the single-process
GPT over 5 steps: plain DP, ZeRO-1 and ZeRO-2, with global gradient clipping active; and the demo
(``python -m parallel_layers demo``) end to end in a subprocess."""
import json
import os
import subprocess
import sys

import pytest
import torch

from parallel_layers.models.gpt import GPT, GPTConfig
from parallel_layers.parallel3d import Parallel3D
from parallel_layers.testing import cached_mesh

CFG = dict(vocab_size=64, n_layer=4, n_head=2, d_model=16, max_seq_len=8, bias=False)
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 0.5
BATCH, SEQ, STEPS = 8, 8, 5


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def body_3d(rank, world, zero, schedule):
    mesh = cached_mesh(dp=2, tp=2, pp=2)
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    dense = GPT(cfg)
    ref_opt = torch.optim.AdamW(dense.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    model = Parallel3D(cfg, mesh, zero=zero, schedule=schedule, num_microbatches=2, lr=LR, betas=BETAS, eps=EPS,
                       weight_decay=WD, max_grad_norm=CLIP, bucket_cap_mb=0.002, seed=0)
    loss_errs, norm_errs, clipped = [], [], []
    for x, y in _batches(STEPS):
        _, ref_loss = dense(x, y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), CLIP).item()
        ref_opt.step()
        ref_opt.zero_grad()
        out = model.train_step(x, y)
        loss_errs.append(abs(out["loss"] - ref_loss.item()) / abs(ref_loss.item()))
        norm_errs.append(abs(out["grad_norm"] - ref_norm) / ref_norm)
        clipped.append(ref_norm > CLIP)
    ref = dense.state_dict()
    got = model.dense_state_dict()
    param_errs = {k: _rel(v, ref[k]) for k, v in got.items()}
    return {"loss": loss_errs, "norm": norm_errs, "clipped": clipped, "params": param_errs}


@pytest.mark.parametrize("zero,schedule", [(0, "1f1b"), (1, "gpipe"), (2, "interleaved")])
def test_3d_matches_single_process(dist_pools, zero, schedule):
    out = dist_pools(8).run(body_3d, zero, schedule, timeout=240)
    names = set()
    for r, res in enumerate(out):
        assert max(res["loss"]) < 1e-5, (r, res["loss"])
        assert max(res["norm"]) < 1e-5, (r, res["norm"])
        assert any(res["clipped"]), "clipping never active: the test would prove little"
        worst = max(res["params"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, (r, worst)
        names |= set(res["params"])
    torch.manual_seed(0)
    assert names == set(GPT(GPTConfig(**CFG)).state_dict())      # every parameter checked somewhere


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "parallel_layers", "demo", "--steps", "3", "--n-layer", "2", "--d-model", "16",
           "--n-head", "2", "--seq-len", "16", "--batch-size", "8", "--microbatches", "2", "--corpus-bytes",
           "200000", "--out", str(out), "--no-progress"]
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "losses agree" in proc.stdout, proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["agree"] is True and len(summary["losses"]["parallel"]) == 3
    assert summary["config"]["dp"] == 2 and summary["config"]["tp"] == 2 and summary["config"]["pp"] == 2
    assert len(summary["memory_rss_mb"]) == 8 and summary["tokens_per_s"] > 0
    assert os.path.getsize(out / "timeline.png") > 1000
