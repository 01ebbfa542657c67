"""Published H100 training runs beyond Narayanan et al. (:mod:`.published`): the planner's predicted tokens/s
per GPU for each run's layout beside the published figure. Two tables, kept as data with their sources:

* ``torchtitan``: the torchtitan team's Llama 3.1 8B / 70B runs on Meta's Grand Teton H100s (8 a host on
  NVLink, 400 Gb/s RDMA a GPU, 96 GB HBM2e at 2.4 TB/s, 500 W), from the pytorch/torchtitan repository's
  ``benchmarks/llama3_h100_202412_torchtitan.md`` (Tables 1, 3, 4; torchtitan commit 9dec370, 2024-12-26)
  and ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (the vanilla-TP columns). Sequence length
  8192: ``seq_len`` of the repository's ``train_configs/llama3_8b.toml`` / ``llama3_70b.toml`` at 9dec370.
  BF16 and FP8 (Float8 tensorwise) rows; those that ran under ``torch.compile`` are priced compiled
  (``Request.compiled``), FSDP2's prefetched gathers and reductions overlapped (``Request.overlap_dp``);
  the TP runs sequence-parallel (torchtitan's TP plan shards the norms' sequence).
* ``nemo``: NVIDIA NeMo's pre-training table (NVIDIA/NeMo ``docs/source/performance/performance_summary.md``,
  container NeMo 24.07, DGX-H100, FP8): its Llama 2 and Llama 3 rows, with their GPUs, global and micro
  batch, sequence, TP / PP / CP / VP as published (dp the rest; VP: the interleaved schedule's chunks).
  The GPT-3 and Nemotron rows are left out: their model dimensions are not in that table. Transformer
  Engine's fused kernels are priced as a compiled step, the distributed optimizer's overlapped gradient
  reduction and parameter gather (NeMo's defaults) as overlapped, its TP runs sequence-parallel (its
  ``sequence_parallel`` where tp > 1).

Model dimensions: Llama 3.1 8B / 70B from torchtitan's ``torchtitan/models/llama/__init__.py`` at 9dec370
(dim, layers, heads, kv heads; the FFN width from its ``ffn_dim_multiplier`` / ``multiple_of`` rule:
14336 and 28672) and the vocabulary, 128,256, from meta-llama/Meta-Llama-3.1-8B's ``config.json`` (as
quoted in public code); Llama 2 7B / 13B / 70B from NeMo's ``nemo/collections/llm/gpt/model/llama.py``
(``Llama2Config7B`` ...), vocabulary 32,000 (meta-llama/Llama-2-7b-hf ``config.json``).

What the tables do not say, and what is used instead: the planner's best over the settings a source leaves
open (:func:`variants`: activation checkpointing on/off where the run used selective checkpointing or did
not say, micro-batch sizes dividing the local batch where none is given), and the optimizer's
sharding: torchtitan's FSDP2 is ZeRO-3 (``zero=3``), NeMo's distributed optimizer ZeRO-1. Everything else is
the planner unchanged: :func:`~.model.predict` on the built-in ``h100`` profile (DGX-H100); for torchtitan's
Grand Teton GPUs the same profile with its stated 2.4 TB/s HBM and 96 GB (its 500 W compute peak is not
published: the SXM data sheet's, which overstates it).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Optional, Tuple

from ..composition.layout import Layout
from .hardware import BUILTIN, HOPPER_HBM_FRACTION, Profile
from .model import Prediction, predict
from .spec import Request

TORCHTITAN = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Tables 1, 3, 4) and "
              "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md")
TORCHTITAN_URL = "https://github.com/pytorch/torchtitan/tree/main/benchmarks"
NEMO = "NVIDIA/NeMo docs/source/performance/performance_summary.md (NeMo 24.07, DGX-H100, FP8 pre-training)"
NEMO_URL = "https://github.com/NVIDIA/NeMo/blob/main/docs/source/performance/performance_summary.md"

# name -> (layers, hidden, heads, kv heads, ffn, vocab); sources in the module docstring
MODELS: Dict[str, Tuple[int, int, int, int, int, int]] = {
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": (80, 8192, 64, 8, 28672, 128256),
    "llama2-7b": (32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": (40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": (80, 8192, 64, 8, 28672, 32000),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published row: the model, the GPUs and their layout (dp the rest), the batch (global, in sequences;
    ``micro_batch`` None: not published), the precision, what else the run used (``notes``: compile,
    checkpointing) and the published tokens/s per GPU."""
    table: str
    label: str
    model: str
    gpus: int
    tp: int
    pp: int
    cp: int
    vp: int                          # chunks a pipeline rank (interleaved schedule); 1: none
    global_batch: int
    micro_batch: Optional[int]
    seq: int
    fp8: bool
    tokens_per_gpu_s: float
    checkpoint: Optional[bool]       # full activation checkpointing; None: selective or not said (both weighed)
    zero: int
    notes: str = ""
    compiled: bool = False           # its elementwise ops fused: torch.compile, Transformer Engine
    overlap_dp: bool = True          # FSDP2's prefetch; Megatron-core's overlap_grad_reduce / overlap_param_gather
    fp8_recipe: str = "tensor"       # torchtitan's Float8 tensorwise; Transformer Engine's default: delayed

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)


_TT = dict(table="torchtitan", zero=3)
_NM = dict(table="nemo", zero=1, checkpoint=None, notes="NeMo 24.07, FP8", compiled=True, fp8_recipe="delayed")
RUNS: List[Run] = [
    # llama3_h100_202412_torchtitan.md Table 1: 8 GPUs, FSDP, local batch 2, global 16, selective AC
    Run(label="T1 FSDP", model="llama3-8b", gpus=8, tp=1, pp=1, cp=1, vp=1, global_batch=16, micro_batch=None,
        seq=8192, fp8=False, tokens_per_gpu_s=5762, checkpoint=None, notes="eager, selective AC", **_TT),
    Run(label="T1 FSDP + compile + Float8", model="llama3-8b", gpus=8, tp=1, pp=1, cp=1, vp=1, global_batch=16,
        micro_batch=None, seq=8192, fp8=True, tokens_per_gpu_s=8532, checkpoint=None,
        compiled=True, notes="torch.compile, selective AC", **_TT),
    # Table 3: 128 GPUs, FSDP, local batch 2, global 256, selective AC
    Run(label="T3 FSDP", model="llama3-8b", gpus=128, tp=1, pp=1, cp=1, vp=1, global_batch=256, micro_batch=None,
        seq=8192, fp8=False, tokens_per_gpu_s=5605, checkpoint=None, notes="eager, selective AC", **_TT),
    Run(label="T3 FSDP + compile + Float8", model="llama3-8b", gpus=128, tp=1, pp=1, cp=1, vp=1, global_batch=256,
        micro_batch=None, seq=8192, fp8=True, tokens_per_gpu_s=8380, checkpoint=None,
        compiled=True, notes="torch.compile, selective AC", **_TT),
    # Table 4: 70B, 256 GPUs, FSDP 32 x TP 8, local batch 16, global 512, full AC, compile + Float8 (2D, no AsyncTP)
    Run(label="T4 2D", model="llama3-70b", gpus=256, tp=8, pp=1, cp=1, vp=1, global_batch=512, micro_batch=None,
        seq=8192, fp8=True, tokens_per_gpu_s=829, checkpoint=True, compiled=True, notes="torch.compile, full AC",
        **_TT),
    # asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP columns: 70B FSDP 32 x TP 8, full AC, local batch 16;
    # 8B on 64 GPUs FSDP 8 x TP 8, per-op SAC, local batch 12; torch.compile
    Run(label="asyncTP doc 70B bf16", model="llama3-70b", gpus=256, tp=8, pp=1, cp=1, vp=1, global_batch=512,
        micro_batch=None, seq=8192, fp8=False, tokens_per_gpu_s=597.3, checkpoint=True,
        compiled=True, notes="torch.compile, full AC", **_TT),
    Run(label="asyncTP doc 70B float8", model="llama3-70b", gpus=256, tp=8, pp=1, cp=1, vp=1, global_batch=512,
        micro_batch=None, seq=8192, fp8=True, tokens_per_gpu_s=809.8, checkpoint=True,
        compiled=True, notes="torch.compile, full AC, float8 tensorwise", **_TT),
    Run(label="asyncTP doc 8B bf16", model="llama3-8b", gpus=64, tp=8, pp=1, cp=1, vp=1, global_batch=96,
        micro_batch=None, seq=8192, fp8=False, tokens_per_gpu_s=4378, checkpoint=None,
        compiled=True, notes="torch.compile, per-op SAC", **_TT),
    Run(label="asyncTP doc 8B float8", model="llama3-8b", gpus=64, tp=8, pp=1, cp=1, vp=1, global_batch=96,
        micro_batch=None, seq=8192, fp8=True, tokens_per_gpu_s=5078.1, checkpoint=None,
        compiled=True, notes="torch.compile, per-op SAC, float8 tensorwise", **_TT),
    # performance_summary.md, Pretraining table (NeMo 24.07, DGX-H100, FP8): the Llama rows
    Run(label="LLAMA2-7B", model="llama2-7b", gpus=8, tp=1, pp=1, cp=1, vp=1, global_batch=128, micro_batch=1,
        seq=4096, fp8=True, tokens_per_gpu_s=16847, **_NM),
    Run(label="LLAMA2-13B", model="llama2-13b", gpus=16, tp=1, pp=4, cp=1, vp=10, global_batch=128, micro_batch=1,
        seq=4096, fp8=True, tokens_per_gpu_s=8646, **_NM),
    Run(label="LLAMA2-70B", model="llama2-70b", gpus=64, tp=4, pp=4, cp=1, vp=20, global_batch=128, micro_batch=1,
        seq=4096, fp8=True, tokens_per_gpu_s=1707, **_NM),
    Run(label="LLAMA3-8B", model="llama3-8b", gpus=8, tp=1, pp=1, cp=2, vp=1, global_batch=128, micro_batch=1,
        seq=8192, fp8=True, tokens_per_gpu_s=12036, **_NM),
    Run(label="LLAMA3-70B", model="llama3-70b", gpus=64, tp=4, pp=4, cp=2, vp=5, global_batch=128, micro_batch=1,
        seq=8192, fp8=True, tokens_per_gpu_s=1533, **_NM),
]
TABLES = {"torchtitan": (TORCHTITAN, TORCHTITAN_URL), "nemo": (NEMO, NEMO_URL)}


def profile(run: Run) -> Profile:
    """The built-in H100 SXM profile; for torchtitan's Grand Teton GPUs, its stated HBM (2.4 TB/s, the fraction
    of it the Hopper profiles take)."""
    base = BUILTIN["h100"]
    if run.table == "torchtitan":
        return dataclasses.replace(base, name="H100 (Grand Teton: HBM2e 2.4 TB/s, 500 W)",
                                   mem_bw=2.4e12 * HOPPER_HBM_FRACTION)
    return base


# DGX-H100's H100 SXM5 80GB: 80 GiB of HBM3, 81,559 MiB of it usable (nvidia-smi's total)
H100_80GB_BYTES = 81559 * 2**20


def memory_bytes(run: Run) -> float:
    """Grand Teton's 96 GB as its table states it; DGX-H100's 80GB H100 as the device reports it."""
    return 96e9 if run.table == "torchtitan" else H100_80GB_BYTES


def request(run: Run) -> Request:
    from transformers import LlamaConfig
    layers, d, heads, kv, ffn, vocab = MODELS[run.model]
    cfg = LlamaConfig(hidden_size=d, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=run.seq)
    return Request(cfg, world=run.gpus, global_batch=run.global_batch, seq_len=run.seq,
                   memory_bytes=memory_bytes(run), devices_per_node=8, precision="bf16", fp8=run.fp8,
                   compiled=run.compiled, overlap_dp=run.overlap_dp, fp8_recipe=run.fp8_recipe,
                   sequence_parallel=run.tp > 1)


def variants(run: Run) -> List[Layout]:
    """The run's layout under each setting its source leaves open: checkpointing (on and off unless full
    AC is said) and the micro-batch size (the published one, or 1 and the whole local batch)."""
    local = run.global_batch // run.dp
    sizes = [run.micro_batch] if run.micro_batch else sorted({1, local})
    ckpts = [run.checkpoint] if run.checkpoint is not None else [False, True]
    out = []
    for mb in sizes:
        for ck in ckpts:
            m = local // mb
            if run.pp > 1:
                sched = "interleaved" if run.vp > 1 else "1f1b"
                out.append(Layout(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, zero=run.zero, schedule=sched,
                                  num_microbatches=m, num_chunks=run.vp, checkpoint=ck))
            else:
                out.append(Layout(dp=run.dp, tp=run.tp, cp=run.cp, zero=run.zero, num_microbatches=m,
                                  checkpoint=ck))
    return out


@dataclasses.dataclass
class Result:
    run: Run
    best: Optional[Prediction]        # the fastest variant that fits (None: none fits)
    predicted: float                  # its tokens/s per GPU (the fastest variant's where none fits)
    error: float
    fits: bool
    weighed: int


def compare(run: Run, progress=None) -> Result:
    """The planner's prediction for ``run``: the fastest of :func:`variants` that fits in memory."""
    req, prof = request(run), profile(run)
    cache: dict = {}
    preds = []
    for lay in variants(run):
        if progress:
            progress(f"{run.table} {run.label}: {lay.name()}")
        preds.append(predict(req, lay, prof, cache))
    fitting = [p for p in preds if p.feasible]
    best = max(fitting or preds, key=lambda p: p.tokens_per_s)
    tps = best.tokens_per_s / run.gpus
    return Result(run, best, tps, (tps - run.tokens_per_gpu_s) / run.tokens_per_gpu_s, bool(fitting), len(preds))


def median_error(results: List[Result]) -> float:
    return statistics.median(abs(r.error) for r in results)


__all__ = ["Run", "RUNS", "MODELS", "TABLES", "TORCHTITAN", "NEMO", "profile", "request", "variants", "compare",
           "Result", "median_error"]
