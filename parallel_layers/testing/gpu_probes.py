"""The checks ``gpu-check`` runs that are programs rather than tests; each also runs on CPU (its dry run).

    python -m parallel_layers.testing.gpu_probes training --device cuda      # GPT: ours vs torch eager
    python -m parallel_layers.testing.gpu_probes nccl-self                   # 1-rank NCCL group, P2P to itself
    python -m parallel_layers.testing.gpu_probes gloo-dp --device cuda       # 2 ranks share one GPU over gloo

Each prints one line per figure and exits non-zero when a check fails.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

from .compare import worst

# fp32: ours and the reference differ by summation order only (Triton's tiles against cuBLAS's, the fused
# AdamW's one pass against torch's foreach); bf16: both round every activation to 8 significant bits, so
# the per-step loss may differ by a few bf16 ulps (2^-8 ~ 4e-3) after 5 steps of drift.
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


def training_parity(device: torch.device, precision: str, steps: int = 5) -> float:
    """Largest relative loss difference over ``steps`` AdamW steps: the reference GPT with our fused
    kernels (fused_linear on its automatic backend, FusedAdamW) against the same model and data in torch
    eager (``fused_linear`` forced to torch) with ``torch.optim.AdamW``."""
    from parallel_layers.models import GPT, GPTConfig
    from parallel_layers.ops import clear_backend_cache
    from parallel_layers.optim.fused_adamw import FusedAdamW

    cfg = GPTConfig(vocab_size=256, n_layer=2, n_head=4, d_model=128, max_seq_len=64)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 256, (8, 64), generator=g).to(device),
             torch.randint(0, 256, (8, 64), generator=g).to(device))
            for _ in range(steps)]
    losses = {}
    for which in ("ours", "torch"):
        os.environ["PARALLEL_LAYERS_BACKEND"] = "auto" if which == "ours" else "torch"
        clear_backend_cache()  # the variable is read once, at the first op call after this
        torch.manual_seed(0)
        model = GPT(cfg, device=device)
        opt = (FusedAdamW if which == "ours" else torch.optim.AdamW)(model.parameters(), lr=1e-3, weight_decay=0.1)
        losses[which] = []
        for idx, targets in data:
            with torch.autocast(device.type, dtype=dtype, enabled=precision == "bf16"):
                _, loss = model(idx, targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[which].append(loss.item())
    os.environ.pop("PARALLEL_LAYERS_BACKEND", None)
    clear_backend_cache()
    return worst(abs(a - b) / abs(b) for a, b in zip(losses["ours"], losses["torch"]))


def _nccl_self(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0),
                            timeout=datetime.timedelta(seconds=60))
    from parallel_layers.pipeline.p2p import P2P
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    p2p = P2P(dist.group.WORLD, torch.device("cuda"))
    sent, got = torch.arange(6.0, device="cuda"), torch.empty(6, device="cuda")
    p2p.wait(p2p.post([("send", sent, 0, "self-send"), ("recv", got, 0, "self-receive")]))
    p2p.drain()
    assert torch.equal(sent, got) and t.tolist() == [1.0] * 4, (got, t)
    print(f"nccl 1-rank group: all_reduce and a P2P self send/receive batch ok (backend {dist.get_backend()}, "
          f"P2P.ordered={p2p.ordered})")
    dist.destroy_process_group()


def _gloo_dp(rank: int, world: int, port: int, device_type: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    from parallel_layers.data_parallel.ddp import DataParallel
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    ref = [p.detach().clone() for p in net.parameters()]
    model = DataParallel(net, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 32, generator=g).to(device)
    model(x).square().mean().backward()
    # the reference: the mean of both ranks' gradients, each computed alone
    grads = []
    for r in range(world):
        dense = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
        with torch.no_grad():
            for p, w in zip(dense.parameters(), ref):
                p.copy_(w)
        xr = torch.randn(16, 32, generator=torch.Generator().manual_seed(r)).to(device)
        dense(xr).square().mean().backward()
        grads.append([p.grad for p in dense.parameters()])
    err = worst(((p.grad - sum(gs) / world).abs().max() / (sum(gs) / world).abs().max()).item()
                for p, *gs in zip(net.parameters(), *grads))
    assert err < 1e-5, err
    print(f"rank {rank}: DataParallel over gloo with {device} tensors: averaged gradients match (rel {err:.1e})")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers.testing.gpu_probes")
    ap.add_argument("probe", choices=["training", "nccl-self", "gloo-dp"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from .workers import free_port
    if args.probe == "training":
        failed = False
        for precision in ("fp32", "bf16"):
            if precision == "bf16" and args.device == "cpu":
                print("training parity bf16: skipped on CPU (autocast to bf16 is the GPU path)")
                continue
            err = training_parity(torch.device(args.device), precision)
            ok = err <= TOLERANCE[precision]
            failed |= not ok
            print(f"training parity {precision} on {args.device}: max relative loss difference {err:.2e} over 5 "
                  f"steps (tolerance {TOLERANCE[precision]:g}) {'ok' if ok else 'FAILED'}")
        return 1 if failed else 0
    if args.probe == "nccl-self":
        if not torch.cuda.is_available():
            print("nccl-self: needs a GPU")
            return 1
        torch.multiprocessing.spawn(_nccl_self, args=(1, free_port()), nprocs=1)
        return 0
    torch.multiprocessing.spawn(_gloo_dp, args=(2, free_port(), "cuda" if args.device == "cuda" else "cpu"),
                                nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
