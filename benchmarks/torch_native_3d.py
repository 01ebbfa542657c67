"""Llama at dp2 x tp2 x pp2: ``Parallel3D`` against the torch-native composition, same processes.

    python -m benchmarks.torch_native_3d            # full: Llama L4 d128 s64, batch 16, 4 microbatches
    python -m benchmarks.torch_native_3d --quick    # the same sizes, fewer reps
    python -m benchmarks.torch_native_3d --smoke    # tiny Llama, seconds; never writes CSV

The same ``LlamaForCausalLM`` (untied embeddings: torch's pipelining has no tied weights across stages),
the same batch and schedule (1F1B, 4 microbatches), no clipping, AdamW, fp32, eight gloo ranks:

* ours: ``Parallel3D(model, ParallelMesh(dp=2, tp=2, pp=2), loss_fn=..., data_parallel=DataParallelConfig(zero=3))``
  (its Llama recipe's tensor-parallel plan, ZeRO-3 over dp);
* torch-native, as torchtitan composes it: a ``DeviceMesh`` (pp, dp, tp); this rank's pipeline stage cut
  from the model by hand (embedding on the first, norm and head on the last, the blocks between; every
  stage rebuilds its causal mask and rotary tables); DTensor ``parallelize_module`` (q/k/v, gate, up
  column-wise, o and down row-wise, embedding row-wise over the vocabulary, head column-wise gathered:
  the same plan as ours); FSDP2 ``fully_shard`` on every block and the stage over dp (parameters kept
  between microbatches: ``reshard_after_forward=False``, torchtitan's choice under pipelining); a
  ``PipelineStage`` driven by ``Schedule1F1B``; ``torch.optim.AdamW(foreach=True)``.

Both start from the same weights, so their first losses agree (printed). Steps interleave, the order
alternating each rep; each step is timed on every rank from a barrier and the slowest rank counts.
Rows go to benchmarks/results/torch_native_3d.csv with speedup = torch-native time / ours.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional

import torch
import torch.nn as nn

from . import harness

CSV_NAME = "torch_native_3d.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
DIMS = (2, 2, 2)          # dp, tp, pp
PROFILES = {
    "full": dict(d=128, layers=4, heads=4, vocab=256, seq=64, batch=16, microbatches=4, reps=10, warmup=2),
    "quick": dict(d=128, layers=4, heads=4, vocab=256, seq=64, batch=16, microbatches=4, reps=4, warmup=1),
    "smoke": dict(d=32, layers=2, heads=4, vocab=64, seq=16, batch=8, microbatches=2, reps=1, warmup=1),
}
BASELINE = "FSDP2 fully_shard + DTensor parallelize_module + pipelining Schedule1F1B"


def _llama(size):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=size["vocab"], hidden_size=size["d"], intermediate_size=4 * size["d"],
                      num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                      num_key_value_heads=size["heads"], max_position_embeddings=size["seq"],
                      tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class _TorchStage(nn.Module):
    """The blocks ``[lo, hi)`` of a Llama, with the embedding on the first stage and norm + head on the last:
    the stage module a torchtitan user writes for ``PipelineStage``."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        from parallel_layers.families import LLAMA
        self._model = [model]                 # config and rotary tables; not a submodule
        self._context = LLAMA.context
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in range(lo, hi)})
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        ctx = self._context(self._model[0], h)
        for block in self.layers.values():
            out = block(h, **ctx)
            h = out[0] if isinstance(out, tuple) else out
        return self.lm_head(self.norm(h)) if self.lm_head is not None else h


def _torch_native(model, size, lr):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp, tp, pp = DIMS
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    pp_rank = dist.get_rank() // (dp * tp)
    per = size["layers"] // pp
    stage = _TorchStage(model, pp_rank * per, (pp_rank + 1) * per, pp_rank == 0, pp_rank == pp - 1)
    plan = {}
    for i in stage.layers:
        plan.update({f"layers.{i}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"})
        plan.update({f"layers.{i}.mlp.{p}_proj": ColwiseParallel() for p in ("gate", "up")})
        plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
        plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
    if stage.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.lm_head is not None:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(stage, mesh["tp"], plan)
    for block in stage.layers.values():
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(stage, mesh=mesh["dp"], reshard_after_forward=False)
    pipe = PipelineStage(stage, pp_rank, pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=size["microbatches"], loss_fn=_loss)
    opt = torch.optim.AdamW(stage.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    dp_rank = (dist.get_rank() // tp) % dp

    def step(x, y):
        rows = x.shape[0] // dp
        xs, ys = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        losses = []
        if pp_rank == 0:
            schedule.step(xs)
        elif pp_rank == pp - 1:
            schedule.step(target=ys, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the loss averaged over the replicas, on every rank (as Parallel3D.train_step reports it): the last
        # stage's dp x tp ranks hold their replica's loss, the others add zero
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
        dist.all_reduce(loss)
        return loss.item() / (dp * tp)

    return step


def _bench_rank(rank, world, size, reps, warmup):
    import copy
    import warnings

    from parallel_layers.composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh

    # FSDP2 warns that the stage returns a view; the schedule never writes into a stage's output
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    dp, tp, pp = DIMS
    lr = 1e-3
    model = _llama(size)
    native_step = _torch_native(copy.deepcopy(model), size, lr)
    ours = Parallel3D(model, ParallelMesh(dp=dp, tp=tp, pp=pp), loss_fn=_loss,
                      optimizer=OptimizerConfig(lr=lr, max_grad_norm=None),
                      pipeline=PipelineConfig(schedule="1f1b", num_microbatches=size["microbatches"]),
                      data_parallel=DataParallelConfig(zero=3), seed=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)
    y = torch.randint(0, size["vocab"], (size["batch"], size["seq"]), generator=gen)
    losses = {"ours": [], "native": []}
    run = {"ours": lambda: losses["ours"].append(ours.train_step(x, y)["loss"]),
           "native": lambda: losses["native"].append(native_step(x, y))}
    for _ in range(warmup):
        run["ours"]()
        run["native"]()
    times = {"ours": [], "native": []}
    for i in range(reps):
        for name in (("ours", "native") if i % 2 == 0 else ("native", "ours")):
            times[name].append(harness.slowest_rank_ms(run[name]))
    # the same training on both sides: every step's loss agrees (fp32 rounding apart)
    return dict(times=times, first=(losses["ours"][0], losses["native"][0]),
                loss_diff=harness.max_abs_diff(losses["ours"], losses["native"]))


def _run(mode: str, progress: Optional[Callable[[str], None]] = None):
    prof = PROFILES[mode]
    dp, tp, pp = DIMS
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo",
                  sizes=f"Llama L{prof['layers']} d{prof['d']} V{prof['vocab']} s{prof['seq']} b{prof['batch']} "
                        f"m{prof['microbatches']}")
    if progress:
        progress("Llama dp2 x tp2 x pp2: Parallel3D zero=3 and the torch-native composition")
    res = harness.run_ranks(_bench_rank, dp * tp * pp, (prof, prof["reps"], prof["warmup"]), timeout_s=1800,
                            retain_memory=True)[0]
    ours, base = harness.Stats.of(res["times"]["ours"]), harness.Stats.of(res["times"]["native"])
    tokens = prof["batch"] * prof["seq"]
    row = harness.comparison_row(
        common, "llama_dp2xtp2xpp2_zero3_vs_torch_native", ours, base, target="speedup>=1.0",
        met="yes" if base.median_ms >= ours.median_ms else "no",
        baseline=f"{BASELINE}; tokens/s ours {tokens / ours.median_ms * 1e3:.0f} vs torch "
                 f"{tokens / base.median_ms * 1e3:.0f}; first loss {res['first'][0]:.6f} vs {res['first'][1]:.6f}, "
                 f"max loss difference over {prof['warmup'] + prof['reps']} steps {res['loss_diff']:.1e}")
    return [row], res["first"]


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None):
    """The suite's entry: the CSV rows of ``mode`` (``device`` only names the run: the ranks are gloo on CPU)."""
    return _run(mode, progress)[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny Llama (seconds); never writes CSV",
                             quick_help="fewer reps (see PROFILES)")
    harness.add_csv_args(ap)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    rows, _ = _run(mode, lambda text: print(f"  {text} ...", flush=True))
    for r in rows:
        print(f"{r['case']}: ours {r['ours_median_ms']:.1f} ms, torch-native {r['base_median_ms']:.1f} ms, "
              f"speedup {r['speedup']:.3f}x\n  {r['baseline']}")
    harness.append_and_report(rows, harness.csv_target(args, CSV_PATH))
    return 0


if __name__ == "__main__":
    sys.exit(main())
