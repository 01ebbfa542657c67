"""A whole training step on one device: a Llama-shaped model trained through the package against plain PyTorch.

    python -m benchmarks.train_step --device cuda          # ~1B Llama, seq 2048 (what gpu-check runs)
    python -m benchmarks.train_step --device cuda --quick  # ~300M Llama, seq 1024
    python -m benchmarks.train_step --smoke                # a tiny Llama on the CPU: checks that it runs

The same ``LlamaForCausalLM`` (transformers), the same weights and batches, next-token cross entropy, AdamW
(betas 0.9/0.95, weight decay 0.1, lr 3e-4), gradient clipping at 1.0, in bf16 with fp32 master weights:

* ``torch eager``: the fp32 model under ``torch.autocast(bfloat16)``, ``AdamW(fused=True)`` (what a user writes
  first; torch's mixed precision keeps the fp32 weights as the master);
* ``torch.compile``: the same, the model compiled (``torch.compile(model)``: torchtitan's choice compiles each
  block; the whole model is the simpler call and compiles the same blocks);
* ``ours bf16``: ``Parallel3D`` on one rank: the bf16 model, ZeRO-1's fused AdamW over fp32 master weights
  and its fused casts (``DataParallelConfig(zero=1)``, ``PrecisionConfig(dtype=bfloat16)``);
* ``ours bf16 compiled``: the same with ``PipelineConfig(compile=True)`` (each block compiled, as torchtitan
  does);
* ``ours fp8``: ``ours bf16`` with ``PrecisionConfig(fp8=FP8Recipe())``: every linear layer but the LM head in FP8
  (per-tensor current scaling; ``torch._scaled_mm``). On a device without FP8 units (this CPU) it is slower.

Reported per variant: the median step time after the warm-up steps (compilation is in the warm-up), tokens
per second, MFU and peak memory. MFU = model FLOPs per step / (step time x the device's peak bf16 FLOP/s),
model FLOPs = 6 x (parameters but the embeddings) x tokens + 6 x layers x seq x hidden x tokens (attention's
score and value products, causal half counted, forward + backward: PaLM's formula); the peak is the
planner's profile of the device (H100/H200: 989 TFLOP/s dense bf16), None on a CPU. Peak memory:
``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS growth on a CPU. The baseline column is
``torch.compile``'s time (speedup = its time / ours); the first loss of every variant is printed (they start
from the same weights).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from parallel_layers.testing.workers import free_port

from . import harness

CSV_NAME = "train_step.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
PROFILES = {
    # ~1.1B: Llama-3-style proportions at TinyLlama's width
    "full": dict(hidden=2048, layers=20, heads=16, kv=8, ffn=5632, vocab=32000, seq=2048, batch=4, steps=6, warmup=3),
    "quick": dict(hidden=1024, layers=16, heads=16, kv=8, ffn=2816, vocab=32000, seq=1024, batch=4, steps=5,
                  warmup=2),
    "smoke": dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=256, seq=32, batch=2, steps=2, warmup=1),
}
# the compiled variants last: their compilation is the longest part, and a run cut off keeps the others
VARIANTS = ("torch eager", "ours bf16", "ours fp8", "torch.compile", "ours bf16 compiled")
LR, BETAS, WD, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


def llama(size: dict):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["ffn"],
                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                      num_key_value_heads=size["kv"], max_position_embeddings=size["seq"],
                      tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def model_flops(model, size: dict, tokens: int) -> float:
    """PaLM's model FLOPs of one step (see the module docstring)."""
    embed = model.get_input_embeddings().weight.numel()
    n = sum(p.numel() for p in model.parameters()) - embed
    return 6.0 * n * tokens + 6.0 * size["layers"] * size["seq"] * size["hidden"] * tokens


def _batches(size: dict, device, count: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g).to(device)
            for _ in range(count)]


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _torch_step(dense, device, compiled: bool):
    model = copy.deepcopy(dense).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD,
                            fused=device.type == "cuda")
    run = torch.compile(model) if compiled else model

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = _loss(run(input_ids=batch[:, :-1]).logits, batch[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _ours_step(dense, device, fp8: bool, compiled: bool = False):
    from parallel_layers import (
        DataParallelConfig,
        OptimizerConfig,
        Parallel3D,
        ParallelMesh,
        PipelineConfig,
        PrecisionConfig,
    )
    from parallel_layers.fp8 import FP8Recipe
    model = copy.deepcopy(dense).to(device=device, dtype=torch.bfloat16)
    p3d = Parallel3D(model, ParallelMesh(), loss_fn=_loss, device=device,
                     optimizer=OptimizerConfig(lr=LR, betas=BETAS, weight_decay=WD, max_grad_norm=CLIP),
                     pipeline=PipelineConfig(num_microbatches=1, compile=compiled),
                     data_parallel=DataParallelConfig(zero=1),
                     precision=PrecisionConfig(dtype=torch.bfloat16, fp8=FP8Recipe() if fp8 else None),
                     replica_check=None)

    def step(batch):
        return torch.tensor(p3d.train_step(batch[:, :-1], batch[:, 1:])["loss"])
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    harness.reset_peak_rss()
    return harness.status_mb("VmHWM") * 2**20


def _peak_bytes(device, start: float) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return max(harness.status_mb("VmHWM") * 2**20 - start, 0.0)


def measure(variant: str, dense, size: dict, device) -> Dict[str, object]:
    """One variant: its step built from ``dense``'s weights, ``warmup`` steps, then ``steps`` timed."""
    start = _peak_reset(device)
    if variant.startswith("torch"):
        step = _torch_step(dense, device, compiled=variant == "torch.compile")
    else:
        step = _ours_step(dense, device, fp8=variant == "ours fp8", compiled=variant.endswith("compiled"))
    batches = _batches(size, device, size["warmup"] + size["steps"])
    first = float(step(batches[0]))
    for b in batches[1:size["warmup"]]:
        step(b)
    times = []
    for b in batches[size["warmup"]:]:
        _sync(device)
        t0 = time.perf_counter()
        step(b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"first_loss": first, "times_ms": [t * 1e3 for t in times], "peak_bytes": _peak_bytes(device, start)}


@contextlib.contextmanager
def _one_rank_world(device):
    """A process group of one rank (``Parallel3D`` needs one): NCCL on a GPU, gloo on the CPU."""
    import torch.distributed as dist
    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def collect(profile: str, device: Optional[torch.device] = None, progress=None,
            variants=VARIANTS) -> List[Dict[str, object]]:
    """The rows (``parallel_layers bench`` calls it as every benchmark's ``collect``)."""
    device = device or torch.device("cpu")
    if device.type == "cuda":                 # "cuda" alone names no index, which set_device needs
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    size = PROFILES[profile]
    dense = llama(size)
    tokens = size["batch"] * size["seq"]
    flops, peak = model_flops(dense, size, tokens), harness.peak_flops(device)
    common = harness.common_fields(profile, device, torch.get_num_threads())
    results = {}
    with _one_rank_world(device):
        for v in variants:
            if progress:
                progress(v)
            try:
                results[v] = measure(v, dense, size, device)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run here is a row saying why
                results[v] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            if progress:              # each variant said as it ends: a run cut off keeps what it measured
                r = results[v]
                progress(f"{v}: " + (r["error"] if "error" in r else
                                     f"median {harness.Stats.of(r['times_ms']).median_ms:.1f} ms, "
                                     f"first loss {r['first_loss']:.4f}, peak {r['peak_bytes'] / 2**20:,.0f} MB"))
            gc.collect()                  # the variant's model and optimizer go before the next one starts
            harness.free_memory(device)
    base = results.get("torch.compile", {})
    base_ms = harness.Stats.of(base["times_ms"]) if "times_ms" in base else None
    rows = []
    params = sum(p.numel() for p in dense.parameters())
    for v, r in results.items():
        sizes = f"Llama {params / 1e6:.0f}M, {size['batch']} x {size['seq']} tokens"
        if "error" in r:
            rows.append(dict(common, case=v, sizes=sizes, backend=device.type, baseline=r["error"], met="error"))
            continue
        ours = harness.Stats.of(r["times_ms"])
        row = dict(common, case=v, sizes=sizes, backend=device.type, first_loss=r["first_loss"],
                   ours_median_ms=ours.median_ms, ours_p20_ms=ours.p20_ms, ours_p80_ms=ours.p80_ms,
                   tokens_per_s=tokens / (ours.median_ms / 1e3), mem_mb=r["peak_bytes"] / 2**20,
                   mfu=None if peak is None else flops / (ours.median_ms / 1e3) / peak,
                   baseline="torch.compile")
        if base_ms is not None:
            row.update(base_median_ms=base_ms.median_ms, base_p20_ms=base_ms.p20_ms, base_p80_ms=base_ms.p80_ms,
                       speedup=base_ms.median_ms / ours.median_ms)
        rows.append(row)
    return rows


def format_rows(rows: List[Dict[str, object]]) -> str:
    lines = [f"{'variant':<18} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} {'peak MB':>9} {'first loss':>10} "
             f"{'vs compile':>10}"]
    for r in rows:
        if r.get("met") == "error":
            lines.append(f"{r['case']:<18} could not run: {r['baseline']}")
            continue
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        ratio = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(f"{r['case']:<18} {r['ours_median_ms']:>9.1f} {r['tokens_per_s']:>10,.0f} {mfu:>6} "
                     f"{r['mem_mb']:>9,.0f} {r['first_loss']:>10.4f} {ratio:>10}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_profile_args(parser, "a tiny Llama: checks that it runs", "a ~300M Llama, seq 1024")
    harness.add_csv_args(parser, CSV_PATH)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)}")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {VARIANTS}")
    rows = collect(harness.profile_of(args), torch.device(args.device), variants=variants,
                   progress=lambda line: print(line, flush=True))
    print(format_rows(rows))
    if torch.device(args.device).type == "cpu":
        print("(CPU: no bf16 matrix units or FP8; the figures check the step runs and track its overhead)")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 1 if any(r.get("met") == "error" for r in rows if r["case"] != "ours fp8") else 0


if __name__ == "__main__":
    raise SystemExit(main())
