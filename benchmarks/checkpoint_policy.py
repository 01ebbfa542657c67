"""Activation checkpointing by placement policy: memory kept and step time against full (every-block)
checkpointing, on the reference GPT and on HF Llama (through ``split_model`` at pp 1), one process.

    python -m benchmarks.checkpoint_policy            # full: 16 blocks, d 256, seq 256, batch 8
    python -m benchmarks.checkpoint_policy --quick    # 12 blocks, d 128, seq 128, batch 4
    python -m benchmarks.checkpoint_policy --smoke    # 4 tiny blocks, seconds; never writes CSV

Policies (``parallel_layers.activations.checkpoint_policy``): ``none``, ``every`` (every block on its own: the
baseline), ``first_half`` (the first n/2 blocks), ``sqrt`` (Chen et al.: ~sqrt(n) segments of ~sqrt(n)
blocks) and ``budget50`` (``MemoryBudget(fraction=0.5)``: the least recomputation whose modelled
activation peak fits half the blocks' bytes without checkpointing; the block sizes measured on the first
step). Per policy, on the same batch, the same weights, dropout 0.1:

* ``kept``: bytes autograd holds for backward at the end of forward (saved-tensor hooks, distinct
  storages, parameters left out);
* ``peak`` (the ``mem_mb`` column): the most bytes alive at once during forward + backward among the
  tensors the step creates, parameter gradients left out (``LiveBytes``: counted at every op; on CPU
  there are no allocator statistics), from one untimed step;
* ``modelled peak of the blocks``: ``plan_memory``'s prediction from the block sizes the budget measured
  (blocks only: the embedding's and the head's bytes are the difference to the measured peak);
* step time: forward + backward (``loss.backward()``, gradients zeroed in between), warmed up, then the
  policies timed in turn, each repetition in another order, median and 20/80 percentiles; ``speedup`` =
  the every-block median / this one (above 1: faster than full checkpointing).

How the checkpoint inputs are kept (``GPT(checkpoint_inputs=)``, ZeRO-R's partitioned activations and CPU
checkpointing), on 2 gloo ranks at tp 2, every block checkpointed, against plain checkpointing (each rank
keeps every block's whole input): ``partition`` (a 1/tp slice per rank, all-gathered for the
recomputation), ``offload`` (in host memory) and ``partition+offload``. Per mode: the bytes the saved
inputs hold on the device and on the host at the end of forward (``mem_mb``: on the device; on CPU the
"host" copy is a second CPU tensor, so there the device / host split says where a GPU would keep them,
and the time includes a memcpy standing in for each transfer) and the slowest rank's step time.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "checkpoint_policy.csv"
CSV_PATH = f"{harness.RESULTS_DIR}/{CSV_NAME}"
PROFILES = {
    "full": dict(layers=16, d=256, heads=4, seq=256, batch=8, vocab=256, reps=7, warmup=2),
    "quick": dict(layers=12, d=128, heads=4, seq=128, batch=4, vocab=256, reps=5, warmup=2),
    "smoke": dict(layers=4, d=32, heads=2, seq=16, batch=2, vocab=64, reps=2, warmup=1),
}
POLICIES = ("none", "every", "first_half", "sqrt", "budget50")
INPUT_MODES = ("keep", "partition", "offload", "partition+offload")


def _checkpoint(policy: str, layers: int):
    from parallel_layers.activations.checkpoint_policy import MemoryBudget
    return {"none": False, "every": True, "first_half": layers // 2, "sqrt": "sqrt",
            "budget50": MemoryBudget(fraction=0.5)}[policy]


def _gpt(prof: dict, checkpoint, device):
    from parallel_layers.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=prof["vocab"], n_layer=prof["layers"], n_head=prof["heads"], d_model=prof["d"],
                    max_seq_len=prof["seq"], dropout=0.1)
    model = GPT(cfg, checkpoint=checkpoint, device=device).train()
    return model, (lambda idx, tgt: model(idx, tgt)[1]), model.checkpointing


def _llama(prof: dict, checkpoint, device):
    import os

    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_layers.families import recipe_for
    from parallel_layers.pipeline.any_model import split_model
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=prof["d"], intermediate_size=prof["d"] * 8 // 3, num_hidden_layers=prof["layers"],
                      num_attention_heads=prof["heads"], num_key_value_heads=max(1, prof["heads"] // 2),
                      vocab_size=prof["vocab"], max_position_embeddings=prof["seq"], attention_dropout=0.1,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device).train()

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    (stage,) = split_model(model, recipe_for(model), 0, 1, loss_fn=loss_fn, checkpoint=checkpoint)
    stage.train()
    return stage, (lambda idx, tgt: stage(idx, tgt)), stage.checkpointing


def measure(kind: str, prof: dict, device: torch.device) -> Dict[str, dict]:
    """Per policy: kept and peak bytes, the plan, the step-time samples (ms)."""
    from parallel_layers.activations.checkpoint_policy import LiveBytes, plan_memory, saved_bytes
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g).to(device)
    tgt = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g).to(device)
    build = _gpt if kind == "gpt" else _llama
    runs: Dict[str, dict] = {}
    for policy in POLICIES:
        model, loss_of, placement = build(prof, _checkpoint(policy, prof["layers"]), device)

        def step(model=model, loss_of=loss_of):
            model.zero_grad(set_to_none=True)
            loss_of(idx, tgt).backward()

        for _ in range(prof["warmup"]):
            step()                                   # the budget measures its blocks here, once
        model.zero_grad(set_to_none=True)
        with LiveBytes() as live:
            loss, kept = saved_bytes(lambda: loss_of(idx, tgt))
            loss.backward()
        peak = live.peak([p.grad for p in model.parameters()])
        plan = next(iter(placement.plans.values())) if placement.plans else placement.plan_for([], idx)
        runs[policy] = dict(step=step, kept=kept, peak=peak, plan=plan, times=[], placement=placement)
    for r in range(prof["reps"]):
        order = list(POLICIES[r % len(POLICIES):] + POLICIES[:r % len(POLICIES)])
        for policy in (order if r % 2 == 0 else order[::-1]):
            runs[policy]["times"].append(harness.time_call(runs[policy]["step"], device))
    profile = next(iter(runs["budget50"]["placement"].profiles.values()))
    for run in runs.values():
        del run["step"], run["placement"]
        run["model_peak"] = plan_memory(run["plan"], profile.block_bytes, profile.input_bytes)[1]
    return runs


def _saved_inputs_rank(rank: int, world: int, prof: dict):
    """One tp rank: per way of keeping the checkpoint inputs, the bytes kept at the end of forward (device,
    host) and the step times (slowest rank's)."""
    import torch.distributed as dist

    from parallel_layers.activations.checkpoint_policy import saved_bytes
    from parallel_layers.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=prof["vocab"], n_layer=prof["layers"], n_head=prof["heads"], d_model=prof["d"],
                    max_seq_len=prof["seq"], dropout=0.1)
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g)
    tgt = torch.randint(0, prof["vocab"], (prof["batch"], prof["seq"]), generator=g)
    runs = {}
    for mode in INPUT_MODES:
        torch.manual_seed(0)
        model = GPT(cfg, tp_group=dist.group.WORLD, checkpoint=True, checkpoint_inputs=mode).train()

        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(idx, tgt)[1].backward()

        step()
        model.zero_grad(set_to_none=True)
        loss, others = saved_bytes(lambda: model(idx, tgt)[1])    # the plain run's inputs are counted here
        kept = model.saved_inputs.kept_bytes() if model.saved_inputs is not None else {"device": 0, "host": 0}
        loss.backward()
        runs[mode] = dict(step=step, device=others + kept["device"], others=others, host=kept["host"], times=[])
    for r in range(prof["reps"]):
        order = list(INPUT_MODES[r % 4:] + INPUT_MODES[:r % 4])
        for mode in (order if r % 2 == 0 else order[::-1]):
            runs[mode]["times"].append(harness.slowest_rank_ms(runs[mode]["step"]))
    for run in runs.values():
        del run["step"]
    return runs


def collect_saved_inputs(mode: str, device: torch.device) -> List[dict]:
    """Rows of the checkpoint-input modes at tp 2 (gloo ranks on CPU), plain checkpointing the baseline."""
    prof = PROFILES[mode]
    runs = harness.run_ranks(_saved_inputs_rank, 2, (prof,), timeout_s=1800)[0]
    whole = prof["layers"] * prof["batch"] * prof["seq"] * prof["d"] * 4      # every block's fp32 input
    common = dict(harness.common_fields(mode, torch.device("cpu"), 1), dtype="float32", backend="gloo tp2",
                  sizes=f"L{prof['layers']} d{prof['d']} s{prof['seq']} b{prof['batch']} V{prof['vocab']}")
    base = runs["keep"]
    rest = runs["offload"]["others"]     # what autograd keeps besides the checkpoint inputs (none on the device)
    rows = []
    for name, run in runs.items():
        inputs_dev = run["device"] - rest
        rows.append(harness.comparison_row(
            common, f"gpt_tp2_inputs_{name}", run["times"], base["times"], mem_mb=run["device"] / 2**20,
            x=inputs_dev / whole,
            baseline=f"every block, inputs kept whole (plain checkpointing); checkpoint inputs on the device "
                     f"{inputs_dev / 2**20:.2f} MB ({inputs_dev / whole:.3f} of plain's {whole / 2**20:.2f} MB), on "
                     f"the host {run['host'] / 2**20:.2f} MB; all kept on the device {run['device'] / 2**20:.2f} MB "
                     f"vs {base['device'] / 2**20:.2f}"))
    return rows


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The suite's entry: one row per model and policy, the every-block run the baseline."""
    prof = PROFILES[mode]
    common = dict(harness.common_fields(mode, device, torch.get_num_threads()), dtype="float32", backend="eager",
                  sizes=f"L{prof['layers']} d{prof['d']} s{prof['seq']} b{prof['batch']} V{prof['vocab']}")
    rows = []
    for kind in ("gpt", "llama"):
        if progress:
            progress(f"{kind}: {', '.join(POLICIES)}")
        runs = measure(kind, prof, device)
        base = runs["every"]
        for policy, run in runs.items():
            rows.append(harness.comparison_row(
                common, f"{kind}_{policy}", run["times"], base["times"], mem_mb=run["peak"] / 2**20,
                baseline=f"every block; plan {run['plan'].describe()} ({run['plan'].recomputed} recomputed); "
                         f"kept {run['kept'] / 2**20:.2f} MB vs {base['kept'] / 2**20:.2f}; peak "
                         f"{run['peak'] / 2**20:.2f} MB vs {base['peak'] / 2**20:.2f}; modelled peak of the blocks "
                         f"{run['model_peak'] / 2**20:.2f} MB"))
    if progress:
        progress(f"gpt tp 2: checkpoint inputs {', '.join(INPUT_MODES)}")
    rows += collect_saved_inputs(mode, device)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny models (seconds); never writes CSV",
                             quick_help="smaller models, fewer repetitions (see PROFILES)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    rows = collect(mode, torch.device(args.device), lambda text: print(f"  {text} ...", flush=True))
    print(f"{'case':<18} {'step ms':>9} {'vs every':>9} {'peak MB':>9}  plan; kept")
    for r in rows:
        print(f"{r['case']:<18} {r['ours_median_ms']:>9.1f} {r['speedup']:>8.2f}x {r['mem_mb']:>9.2f}  "
              f"{'; '.join(r['baseline'].split('; ')[1:])}")
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
