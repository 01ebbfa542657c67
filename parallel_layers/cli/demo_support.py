"""What ``python -m parallel_layers demo --freeze ...`` needs from freeze training, so the demo itself only
wires it in: its flags' checks, the trainer built from the demo's arguments, the line printed when the
layout changes, and the single-process run's replay of the same freezes.

``--freeze off`` (default), ``auto`` (the adaptive criterion, a decision every ``--freeze-interval``
steps) or ``STEP:BLOCKS,...`` (``2:2,6:3``: the first 2 blocks frozen from step 2, the first 3 from step
6); ``--freeze-cap``: the most of the blocks that may freeze (a fraction, default 0.5). The demo's data
are random windows, never seen twice, so the prefix cache stays off there (the benchmark
``benchmarks/freeze_training.py`` trains epochs of fixed samples, where it serves).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn as nn

from ..freeze_training.auto_freeze import parse_freeze
from ..freeze_training.prefix import freeze_prefix_
from ..freeze_training.relayout import blocks_text


def check_freeze_args(args) -> List[str]:
    """The demo's argument errors for ``--freeze`` (none when it is off)."""
    if args.freeze == "off":
        return []
    errs = []
    try:
        parse_freeze(args.freeze, args.n_layer, args.freeze_cap)
    except ValueError as exc:
        errs.append(f"--freeze {args.freeze}: {exc}")
    if args.tp != 1:
        errs.append(f"--freeze trades pipeline stages for data-parallel replicas at tp 1; got --tp {args.tp}")
    for flag, value in (("--save", args.save), ("--load", args.load)):
        if value:
            errs.append(f"--freeze with {flag}: checkpoints of a freeze-training run are not supported")
    if args.offload != "none":
        errs.append("--freeze with --offload: the optimizer state moves between layouts in memory")
    return errs


def freeze_trainer(args, build_model: Callable[[], nn.Module], loss_fn: Callable, mesh, *, dtype: torch.dtype,
                   device: Optional[torch.device], checkpoint):
    """The demo's ``FreezeTrainer``: ``mesh`` (``--dp`` x ``--pp``) to start, new meshes of the same
    processes for the later layouts, the demo's optimizer and schedule."""
    from ..freeze_training.trainer import FreezeTrainer
    from ..mesh import ParallelMesh
    auto = {"interval": args.freeze_interval} if args.freeze == "auto" else {}
    policy = parse_freeze(args.freeze, args.n_layer, args.freeze_cap, **auto)
    from ..composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
    return FreezeTrainer(build_model, dp=args.dp, pp=args.pp, loss_fn=loss_fn, freeze=policy,
                         optimizer=OptimizerConfig(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                                                   max_grad_norm=args.max_grad_norm),
                         pipeline=PipelineConfig(schedule=args.schedule, num_microbatches=args.microbatches,
                                                 checkpoint=checkpoint),
                         data_parallel=DataParallelConfig(zero=args.zero), precision=PrecisionConfig(dtype=dtype),
                         device=device, seed=args.seed, cache_bytes=0,
                         mesh_factory=lambda d, p: mesh if (d, p) == (mesh.dp, mesh.pp) else ParallelMesh(d, 1, p))


def relayout_line(event: dict) -> str:
    """The progress line of a layout change."""
    return (f"layout after step {event['step']}: froze {blocks_text(event['frozen'])}; {event['from']} -> "
            f"{event['to']} (re-laid out in {event['seconds']:.2f} s)")


def freeze_steps(history: Optional[Sequence[dict]]) -> Dict[int, int]:
    """``{step: frozen blocks}`` from a run's layout changes (``FreezeTrainer.history``)."""
    return {int(e["step"]): int(e["frozen"]) for e in (history or [])}


def replay_freeze(model: nn.Module, freezes: Dict[int, int], step: int) -> None:
    """Before ``step`` of the single-process run: freeze what the parallel run froze before that step."""
    if step in freezes:
        freeze_prefix_(model, freezes[step])


__all__ = ["check_freeze_args", "freeze_trainer", "relayout_line", "freeze_steps", "replay_freeze"]
