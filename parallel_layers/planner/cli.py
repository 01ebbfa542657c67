"""``python -m parallel_layers plan``: rank every layout of a model on a cluster, or calibrate a profile.

    python -m parallel_layers plan --gpt 12,768,12,50257 --world 64 --devices-per-node 8 --memory-gib 80 \\
        --global-batch 512 --seq-len 2048 --precision bf16 --profile h100 [--json out.json] [--png out.png] \
        [--fp8 [tensor|delayed|row|block] [--fp8-gather]]      # FP8 training (planner/fp8.py)
    python -m parallel_layers plan --hf-config path/config.json ...     # a Hugging Face causal LM's config
    python -m parallel_layers plan --calibrate profile.json [--world 2]  # measure this machine, save a profile

Prints the feasible layouts fastest first (tokens/s, MFU, step time, bubble, the largest rank's memory
by term), then the infeasible ones with the
term that overflowed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from ..cpu_affinity import available_cores
from .hardware import BUILTIN, load_profile
from .search import PLANNED_SCHEDULES, candidate_layouts, draw, plan, to_json
from .spec import Request


def usable_cores() -> int:
    """The cores this process may run on."""
    cores = available_cores()
    return len(cores) if cores else (os.cpu_count() or 1)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m parallel_layers plan", description=__doc__.splitlines()[0])
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--gpt", help="the reference GPT: n_layer,d_model,n_head,vocab (d_ff = 4 d_model), or "
                       "n_layer,d_model,n_head,vocab,experts,top_k for its Mixture-of-Experts form")
    model.add_argument("--hf-config", help="a Hugging Face config.json (a causal LM's)")
    model.add_argument("--model-json", help="a model as composition.layout.model_to_json writes it (GPTConfig or HF)")
    ap.add_argument("--world", type=int, default=8, help="ranks (default 8)")
    ap.add_argument("--devices-per-node", type=int, default=8)
    ap.add_argument("--memory-gib", type=float, default=80.0, help="memory per rank, GiB")
    ap.add_argument("--global-batch", type=int, default=32, help="sequences per step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--fp8", nargs="?", const="tensor", default=None, metavar="RECIPE",
                    help="FP8 training: every Linear but the LM head and the MoE router in FP8 (FP8Linear), with the "
                    "scaling RECIPE (tensor, the default; delayed, row, block); needs a profile with an fp8 rate "
                    "(h100, h200)")
    ap.add_argument("--fp8-gather", action="store_true", help="with --fp8 and ZeRO-3: gather the FP8 layers' "
                    "weights in FP8, 1 byte an element")
    ap.add_argument("--compiled", action="store_true", help="the blocks compiled (PipelineConfig(compile=True)): "
                    "the non-matmul ops between two matmuls priced as one fused kernel")
    ap.add_argument("--sequence-parallel", action="store_true", help="at tp > 1, Parallel3D(sequence_parallel=True): "
                    "norms and residuals split along the sequence")
    ap.add_argument("--overlap-dp", action="store_true", help="price the data-parallel reduction and ZeRO-3's "
                    "gathers as overlapped with compute (FSDP2, Megatron-core; not Parallel3D's own step): to "
                    "compare with another framework's runs")
    ap.add_argument("--profile", default="h100", help=f"built-in ({', '.join(BUILTIN)}) or a calibrated JSON file")
    ap.add_argument("--zero", default="0,1,2,3", help="ZeRO stages to consider (default 0,1,2,3)")
    ap.add_argument("--cp", default=None, help="context-parallel sizes to consider, e.g. 1 to leave cp out (each cp "
                    "layout's probe costs minutes on a large model); default: every size the world allows")
    ap.add_argument("--ep", default=None, help="expert-parallel sizes to consider for an MoE model, e.g. 1,2; "
                    "default: every size that divides the world and the experts")
    for dim in ("dp", "tp", "pp"):
        ap.add_argument(f"--{dim}", default=None, help=f"{dim} sizes to consider, e.g. 1,2,4 (default: every divisor "
                                                     f"of --world)")
    ap.add_argument("--schedules", default=",".join(PLANNED_SCHEDULES))
    ap.add_argument("--checkpoint", default="off,on", help="activation checkpointing: off, on or off,on")
    ap.add_argument("--top", type=int, default=10, help="feasible layouts to print")
    ap.add_argument("--jobs", type=int, default=1,
                    help="processes that probe layouts at once (default 1: each process probes its own layouts "
                         "and the probes one process shares across layouts are made again in each, so 2 "
                         "processes searched a 70B model's first 1,000 layouts 2.4x slower than one; "
                         f"{usable_cores()} cores usable here)")
    ap.add_argument("--json", help="write every layout's prediction here")
    ap.add_argument("--png", help="draw the memory bars and step times here")
    ap.add_argument("--calibrate", metavar="PATH", help="measure this machine and save the profile to PATH, then "
                                                        "stop: on a GPU its matmul curve, attention, copy and "
                                                        "per-op rates; on CPUs also collectives over --world "
                                                        "gloo ranks")
    return ap


def request_of(args) -> Request:
    if args.hf_config:
        from transformers import AutoConfig
        model = AutoConfig.from_pretrained(args.hf_config)
    elif args.model_json:
        from ..composition.layout import model_from_json
        with open(args.model_json) as fh:
            model = model_from_json(fh.read())
    else:
        from ..models.gpt import GPTConfig
        sizes = [int(x) for x in (args.gpt or "4,64,4,256").split(",")]
        if len(sizes) not in (4, 6):
            raise SystemExit(f"plan: --gpt {args.gpt!r}: expected n_layer,d_model,n_head,vocab or "
                             f"n_layer,d_model,n_head,vocab,experts,top_k")
        n_layer, d, h, v = sizes[:4]
        moe = dict(num_experts=sizes[4], moe_top_k=sizes[5]) if len(sizes) == 6 else {}
        model = GPTConfig(vocab_size=v, n_layer=n_layer, n_head=h, d_model=d, max_seq_len=args.seq_len, **moe)
    return Request(model, world=args.world, global_batch=args.global_batch, seq_len=args.seq_len,
                   memory_bytes=args.memory_gib * 2**30, devices_per_node=args.devices_per_node,
                   precision=args.precision, fp8=args.fp8 is not None, fp8_recipe=args.fp8 or "tensor",
                   fp8_gather=args.fp8_gather, compiled=args.compiled, overlap_dp=args.overlap_dp,
                   sequence_parallel=args.sequence_parallel)


def _row(p) -> str:
    worst = max(p.memory, key=lambda t: sum(t.values()))
    mem = " ".join(f"{k[:5]} {v / 2**20:.1f}" for k, v in worst.items())
    return (f"{p.layout.name():44s} {p.tokens_per_s:12,.0f} {p.mfu:6.1%} {p.step_s * 1e3:9.2f} {p.bubble:6.1%} "
            f"{p.peak_bytes / 2**20:9.1f}  {mem}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate and torch.cuda.is_available():
        from .calibrate_gpu import calibrate_device
        prof = calibrate_device(torch.device("cuda", torch.cuda.current_device()),
                                progress=lambda s: print(f"  {s}", file=sys.stderr, flush=True))
        prof.save(args.calibrate)
        print(f"calibrated profile saved to {args.calibrate}: {prof.notes}; matmul curve (c0, cK, cN, cM) "
              f"{ {k: [round(c, 4) for c in v] for k, v in (prof.gemm_curve or {}).items()} }")
        return 0
    if args.calibrate:
        from .calibrate import calibrate
        prof = calibrate(world=args.world)
        prof.save(args.calibrate)
        print(f"calibrated profile saved to {args.calibrate}: matmul {prof.flops['fp32'] / 1e9:.1f} GFLOP/s fp32, "
              f"memory {prof.mem_bw / 1e9:.1f} GB/s, all-reduce alpha {prof.intra['all_reduce'].alpha * 1e6:.0f} us "
              f"beta {1 / prof.intra['all_reduce'].beta / 1e9:.2f} GB/s, {prof.compute_slots} cores")
        return 0
    try:
        req = request_of(args)
        prof = load_profile(args.profile)
        if req.fp8:
            from .fp8 import fp8_rate
            fp8_rate(prof, req)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    zero = [int(z) for z in args.zero.split(",")]
    ck = [{"off": False, "on": True}[c] for c in args.checkpoint.split(",")]
    try:
        sizes = {dim: None if getattr(args, dim) is None else [int(c) for c in getattr(args, dim).split(",")]
                 for dim in ("dp", "tp", "pp", "cp", "ep")}
        layouts = list(candidate_layouts(req, zero=zero, schedules=args.schedules.split(","), checkpoint=ck,
                                         **sizes))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not layouts:
        asked = ", ".join(f"--{d} {args_of}" for d, args_of in ((d, getattr(args, d)) for d in sizes) if args_of)
        raise SystemExit(f"planner: no layout has dp x ep x tp x pp x cp = {req.world} ranks with the sizes asked "
                         f"({asked or 'none'}); widen one of them")
    print(f"{req.describe_model()} on {req.world} ranks ({req.devices_per_node} per node, "
          f"{args.memory_gib:g} GiB each), batch {req.global_batch} x {req.seq_len}, {req.precision}"
          f"{f' + FP8 ({req.fp8_recipe} scaling)' if req.fp8 else ''}; profile "
          f"{prof.name} ({'measured' if prof.measured else 'assumed efficiencies: ' + prof.notes}); "
          f"{sum(r is None for _, r in layouts)} layouts to predict", file=sys.stderr)
    ranked = plan(req, prof, layouts, progress=lambda name: print(f"  predicting {name}", file=sys.stderr,
                                                                  flush=True), jobs=args.jobs)
    print(f"{'layout':44s} {'tokens/s':>12s} {'MFU':>6s} {'step ms':>9s} {'bubble':>6s} {'MiB/rank':>9s}  "
          f"largest rank, MiB by term")
    feasible = [p for p in ranked if p.feasible]
    for p in feasible[:args.top]:
        print(_row(p))
    dropped = [p for p in ranked if not p.feasible]
    if dropped:
        print(f"\n{len(dropped)} layouts dropped:")
        for p in dropped[:args.top]:
            print(f"  {p.layout.name():44s} {p.reason}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(to_json(req, prof, ranked), fh, indent=1, default=str)
    if args.png:
        draw(ranked, args.png, req.memory_bytes)
    return 0 if feasible else 1


__all__ = ["main", "build_parser", "request_of"]
