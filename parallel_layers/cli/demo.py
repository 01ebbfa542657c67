"""``python -m parallel_layers demo``: the reference GPT (or, ``--model llama``, a Hugging Face Llama)
trained with 3D parallelism, checked against the single-process model.

Launching: without ``RANK``/``WORLD_SIZE`` in the environment the demo starts a process per rank itself
(gloo on CPU, one thread each, a free local port), forked from a server that imported torch and the demo
once (:mod:`parallel_layers.distributed.processes`). Under ``torchrun`` (those variables set) it
starts nothing: it initialises from the environment, with NCCL and one GPU per process
(``LOCAL_RANK``) when CUDA is available, gloo otherwise. CPU ranks bind their threads to cores of
their own where the machine has at least one core per local rank (``parallel_layers.cpu_affinity``;
``--no-bind-cores`` to keep them free); the demo's default 8 processes on a 2-core machine are not bound.

Data: byte-level text (vocabulary 256) of the Python standard library's own ``.py`` sources, read in
sorted path order (every machine has them). Each step draws a global batch of random windows from a
generator seeded by ``(seed, step)``, so every rank and the single-process reference see the same data.
Validation (Megatron-LM's ``--eval-interval`` / ``--eval-iters``): the bytes that follow the training
text in the same file order (a tenth as many, never trained on) give ``--eval-iters`` fixed batches; every
``--eval-interval`` steps and after the last one the model's mean loss on them is computed forward only
(:meth:`Parallel3D.evaluate`: the pipeline's forward-only schedule, eval mode) and compared too.

Checkpoints (Megatron-LM's ``--save`` / ``--save-interval`` / ``--load``): universal ones
(:mod:`parallel_layers.composition.universal_checkpoint`) under ``DIR/iter_NNNNNNN``, so a run saved on one layout
resumes on any other; a resumed run trains from the saved iteration to ``--steps`` on the same data.
They are asynchronous by default (:mod:`parallel_layers.resilience`: training waits for the snapshot to
host memory only; ``--save-mode sync`` waits for the write; ``--save-format per_rank``, ``--keep K``).
A run started with ``--save DIR`` where DIR already holds a complete checkpoint resumes from the newest
one by itself, so under ``torchrun --max-restarts N`` a run whose rank died comes back and ends where an
uninterrupted run ends (every rank's random streams are restored on the same layout; the data position
is the step, global, so another dp size continues the same sample order).

Models (:mod:`parallel_layers.cli.demo_models`): ``--model gpt`` builds the reference GPT as stages;
``--model llama`` builds a ``LlamaForCausalLM`` of the same sizes from a ``transformers`` config and hands
it, unmodified, to the same ``Parallel3D`` (its recipe splits it into stages and over tp).

At the end the loss curve is compared with the single-process model of the same config, seed, data and
optimizer (``torch.optim.AdamW`` + ``torch.nn.utils.clip_grad_norm_``), run in the launcher (or on rank
0 under torchrun); ``summary.json`` and ``timeline.png`` (the last step's pipeline schedule) go to
``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sysconfig
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from ..cpu_affinity import available_cores, bind_rank_to_cores
from ..cpu_allocator import retain_freed_memory
from ..dimensions import describe, dimension, in_reading_order, names
from ..dimensions import world_size as sizes_world
from ..distributed.processes import start_context
from ..pipeline.schedules import schedule_names, schedule_spec
from ..testing.compare import worst as worst_error
from ..testing.workers import free_port
from .demo_models import (
    MODELS,
    fp8_recipe,
    lm_loss,
    model_description,
    parallel_model,
    reference,
    reference_microbatches,
)

FP32_RTOL = 1e-4          # per-step relative loss agreement in fp32 (rounding only)
BF16_RTOL = 5e-2          # bf16 model (fp32 master weights) against the fp32 reference
# fp16 (fp32 master weights, dynamic loss scaling): fp16 carries 3 more mantissa bits than bf16 (11 vs 8
# significant bits), so its rounding error is ~8x smaller and the bf16 bound is safe. Its narrower exponent
# range is what the loss scaler covers; a skipped (overflowing) step would make the losses drift apart from
# the reference, so the demo reports how many steps were skipped.
FP16_RTOL = BF16_RTOL
# FP8 GEMMs on the fp32 model against the one-process FP8 model on the same micro-batches: the same scaling
# decisions, but a value on an FP8 rounding boundary lands on either side as the order of sums differs (tp's
# partial sums), and 3-bit mantissas make that step 2^-4 of the element; over the demo's steps the losses stay
# within this (measured at most 5e-4 over 30 steps at dp2 x tp2, pp2 x cp2, tp2 x pp2 zbv and dp2 x tp2 ZeRO-3; the
# noise floor is measured in tests/test_fp8_3d.py)
FP8_RTOL = 3e-3


# ---------------------------------------------------------------------- data
def python_sources(directory: Path):
    """The ``.py`` files under ``directory`` in ``sorted(directory.rglob("*.py"))`` order (no symbolic links to
    directories followed, none under a ``site-packages`` or ``dist-packages`` folder), found as they are read:
    a directory's entries sorted by name, each subdirectory's files in its place. The same order, because a
    path sorts by its parts: everything under ``a/`` comes after ``a`` itself and before the next name. A
    demo reads its first hundreds of kilobytes only, so it lists a few folders, not the ~13,000 files of
    the whole library (a third of a second of every rank's start)."""
    try:
        with os.scandir(directory) as it:
            entries = sorted(it, key=lambda e: os.path.normcase(e.name))
    except OSError:
        return
    for entry in entries:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            if entry.name not in ("site-packages", "dist-packages"):
                yield from python_sources(Path(entry.path))
        elif os.path.normcase(entry.name).endswith(".py"):
            yield Path(entry.path)


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The stdlib's ``.py`` files (sorted paths, no site-packages), concatenated, as uint8, at most
    ``max_bytes`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in python_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 1024:
        raise RuntimeError(f"demo: found only {len(blob)} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone()


def load_splits(train_bytes: int, seq_len: int):
    """``(train, validation)``: the first ``train_bytes`` bytes of :func:`load_corpus` (exactly what
    ``load_corpus(train_bytes)`` gives) and the bytes after them, a tenth as many (at least 4 windows). A
    machine with less Python source holds out the last tenth of what there is instead."""
    val_bytes = max(train_bytes // 10, 4 * (seq_len + 1))
    blob = load_corpus(train_bytes + val_bytes)
    cut = train_bytes if blob.numel() >= train_bytes + seq_len + 2 else blob.numel() * 9 // 10
    return blob[:cut], blob[cut:]


def eval_steps(args) -> List[int]:
    """The steps (1-based) after which the validation loss is computed: every ``--eval-interval`` and
    the last; none with ``--eval-iters 0``."""
    if args.eval_iters == 0 or args.steps == 0:
        return []
    every = set(range(args.eval_interval, args.steps + 1, args.eval_interval)) if args.eval_interval else set()
    return sorted(every | {args.steps})


# validation batches draw from their own generator stream, apart from the training steps'
VAL_STREAM = 1 << 40


def validation_batches(val: torch.Tensor, args):
    """The ``--eval-iters`` fixed global batches of the validation text (the same at every evaluation)."""
    return [get_batch(val, VAL_STREAM + i, args.batch_size, args.seq_len, args.seed) for i in range(args.eval_iters)]


def validation_plan(val: Optional[torch.Tensor], args):
    """``(steps, batches)``: after which steps to validate, on which batches (none without ``val``)."""
    steps = set(eval_steps(args)) if val is not None else set()
    return steps, (validation_batches(val, args) if steps else [])


def get_batch(corpus: torch.Tensor, step: int, batch: int, seq: int, seed: int):
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, corpus.numel() - seq - 1, (batch,), generator=gen)
    win = torch.stack([corpus[s:s + seq + 1] for s in starts.tolist()]).long()
    return win[:, :-1].contiguous(), win[:, 1:].contiguous()


# ---------------------------------------------------------------------- set-up
DEFAULT_SIZES = {"dp": 2, "tp": 2, "pp": 2}        # the demo's 3D layout; every other dimension 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parallel_layers demo",
                                description="Train the reference GPT with dp x tp x pp parallelism on the "
                                            "Python standard library's sources and compare with one process.")
    p.add_argument("--model", default="gpt", choices=MODELS,
                   help="gpt: the reference GPT; moe: the reference GPT with Mixture-of-Experts MLPs (--experts, "
                        "--top-k; split over --ep); llama: transformers' LlamaForCausalLM of the same sizes")
    p.add_argument("--experts", type=int, default=4, help="with --model moe: experts per MoE layer")
    p.add_argument("--top-k", type=int, default=2, help="with --model moe: experts each token goes to")
    for name, _ in in_reading_order({}):        # a flag per parallel dimension (parallel_layers.dimensions)
        p.add_argument(f"--{name}", type=int, default=DEFAULT_SIZES.get(name, 1), help=dimension(name).help)
    p.add_argument("--cp-method", default="ring", choices=("ring", "ulysses"),
                   help="with --cp: ring attention or Ulysses (all-to-all over heads)")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--schedule", default="1f1b", choices=schedule_names())
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"),
                   help="fp8: the linear layers' GEMMs in FP8 (E4M3 forward, E5M2 gradients; not the LM head) on "
                        "the fp32 model, compared with one process running the same FP8 model")
    p.add_argument("--fp8-recipe", default="tensor", choices=("tensor", "delayed", "row", "block"),
                   help="with --precision fp8: per-tensor current or delayed scaling, per row, or DeepSeek-V3 "
                        "blocks")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--offload", default="none", choices=("none", "cpu", "disk"),
                   help="ZeRO's optimizer state (fp32 master, moments) in host memory or in files under "
                        "--offload-dir, streamed through a few host buffers (ZeRO-Infinity); needs --zero 1-3")
    p.add_argument("--offload-dir", metavar="DIR", help="with --offload disk: where each rank's state file goes")
    p.add_argument("--checkpoint", nargs="?", type=int, const=-1, default=0, metavar="N",
                   help="activation checkpointing: recompute every block in backward, or with N only the "
                        "first N blocks of each pipeline stage (Megatron-LM's --recompute-method block)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer block of each stage (PipelineConfig(compile=True): inductor; "
                        "the first steps compile)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences per step)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-bytes", type=int, default=4_000_000, help="training text (the validation text "
                   "is the next tenth as many bytes)")
    p.add_argument("--eval-interval", type=int, default=10, metavar="N",
                   help="validation loss every N steps (and after the last); 0: after the last only")
    p.add_argument("--eval-iters", type=int, default=2, metavar="K",
                   help="validation batches (global batch size each); 0 turns validation off")
    p.add_argument("--save", metavar="DIR", help="save universal checkpoints under DIR (DIR/iter_NNNNNNN, Megatron-"
                   "LM's layout) after the last step and every --save-interval steps; any layout can --load them")
    p.add_argument("--save-interval", type=int, default=0, metavar="N", help="with --save: also every N steps")
    p.add_argument("--save-mode", default="async", choices=("async", "sync"),
                   help="async: training waits only for the snapshot to host memory, a background thread writes "
                        "it (parallel_layers.resilience); sync: training waits for the whole write")
    p.add_argument("--save-format", default="universal", choices=("universal", "per_rank"),
                   help="universal: any layout resumes it; per_rank: each rank's own file, the same layout only")
    p.add_argument("--keep", type=int, default=0, metavar="K", help="with --save: keep the newest K checkpoints "
                   "(0: all)")
    p.add_argument("--inject-kill", action="append", default=[], metavar="STEP:RANK",
                   help="testing: kill -9 global rank RANK right after step STEP (once its checkpoint write in "
                        "flight is published), once per run directory (a marker file under --save remembers it "
                        "fired, so the restarted run goes past it); repeatable")
    p.add_argument("--load", metavar="DIR", help="resume from a universal checkpoint (DIR/iter_NNNNNNN, or a --save "
                   "DIR: its latest) saved with any --dp/--tp/--pp/--zero/--schedule/--precision, and train up to "
                   "--steps; the comparison covers the resumed steps. Without --load, a --save DIR that holds a "
                   "complete checkpoint is resumed from its newest one (a restarted run continues by itself)")
    p.add_argument("--freeze", default="off", metavar="off|auto|STEP:BLOCKS,...",
                   help="freeze training (PipeTransformer): freeze the bottom blocks as training goes and give the "
                        "pipeline ranks they free to data parallelism; auto: when their gradient norms stop changing; "
                        "2:2,6:3: the first 2 blocks from step 2, the first 3 from step 6 (needs --tp 1)")
    p.add_argument("--freeze-cap", type=float, default=0.5, metavar="F",
                   help="with --freeze: at most this fraction of the blocks freezes")
    p.add_argument("--freeze-interval", type=int, default=10, metavar="N",
                   help="with --freeze auto: steps per gradient-norm window (a decision after each)")
    p.add_argument("--out", default="demo_out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per step instead)")
    p.add_argument("--no-reference", action="store_true", help="skip the single-process comparison")
    p.add_argument("--backend", default="gloo", choices=("gloo", "nccl_rules"),
                   help="process-group backend of the spawned ranks: nccl_rules runs gloo with NCCL's rules "
                        "enforced (parallel_layers.testing.nccl_rules), the CPU proof that this layout's "
                        "communication would also run under NCCL")
    p.add_argument("--no-bind-cores", action="store_true",
                   help="leave CPU ranks free on every core (default: each bound to cores of its own where "
                        "this machine has at least one per local rank; never on CUDA)")
    return p


def checkpoint_setting(args):
    """``--checkpoint`` -> ``PipelineConfig(checkpoint=)``: True (flag alone: every block), False (absent) or N."""
    return True if args.checkpoint == -1 else args.checkpoint


def mesh_sizes(args) -> dict:
    """The size of every parallel dimension the flags ask for: ``ParallelMesh(**mesh_sizes(args))``."""
    return {name: getattr(args, name) for name in names()}


def world_size(args) -> int:
    return sizes_world(mesh_sizes(args))


def batch_shards(args) -> int:
    """Into how many replicas' rows the global batch is cut (the dimensions that split it: dp, ep)."""
    return sizes_world({n: getattr(args, n) for n in names() if dimension(n).batch == "split"})


def check_args(args) -> None:
    world = world_size(args)
    chunks = schedule_spec(args.schedule).chunks
    errs = []
    shards = batch_shards(args)
    if args.batch_size % (shards * args.microbatches):
        errs.append(f"--batch-size {args.batch_size} must be a multiple of dp x ep x microbatches = "
                    f"{shards * args.microbatches}")
    if args.ep > 1 and args.model != "moe":
        errs.append(f"--ep {args.ep} splits the experts of an MoE model: use --model moe")
    if args.model == "moe" and (args.experts % args.ep or not 1 <= args.top_k <= args.experts):
        errs.append(f"--experts {args.experts} must be a multiple of --ep {args.ep}, and --top-k {args.top_k} "
                    f"between 1 and --experts")
    if args.n_head % args.tp or (4 * args.d_model) % args.tp or 256 % args.tp:
        errs.append(f"--n-head {args.n_head} and 4 x d_model must divide by --tp {args.tp}")
    if args.n_layer < args.pp * chunks or (chunks > 1 and args.n_layer % (args.pp * chunks)):
        errs.append(f"--n-layer {args.n_layer} must be a multiple of pp x chunks = {args.pp * chunks} "
                    f"for the {args.schedule} schedule" if chunks > 1 else
                    f"--n-layer {args.n_layer} must be at least --pp {args.pp}")
    if args.precision in ("bf16", "fp16") and args.zero == 0:
        errs.append(f"--precision {args.precision} needs fp32 master weights: use --zero 1 or --zero 2")
    if args.precision == "fp8" and args.freeze != "off":
        errs.append("--precision fp8 with --freeze is not supported: use --precision fp32 or bf16")
    if args.precision == "fp8" and args.model == "moe" and batch_shards(args) > 1:
        errs.append("--precision fp8 with --model moe and --dp/--ep > 1: the one-process reference cannot cut the "
                    "batch both as the router's statistics (every replica's m-th slice) and as the FP8 scales "
                    "(each replica's own) do; use --dp 1 --ep 1, or --precision fp32")
    if args.cp > 1 and args.seq_len % (2 * args.cp):
        errs.append(f"--seq-len {args.seq_len} must be a multiple of 2 x --cp = {2 * args.cp} (the load-balanced "
                    f"split cuts every sequence into 2 x cp chunks)")
    if args.cp > 1 and args.freeze != "off":
        errs.append("--freeze with --cp is not supported: use --cp 1")
    if args.offload != "none" and args.zero == 0:
        errs.append(f"--offload {args.offload} moves ZeRO's optimizer shard: use --zero 1, 2 or 3")
    if args.offload == "disk" and not args.offload_dir:
        errs.append("--offload disk needs --offload-dir DIR (each rank writes its state file there)")
    if args.offload == "cpu" and not torch.cuda.is_available():
        errs.append("--offload cpu: a CPU run keeps its optimizer state in host memory already, there is "
                    "nothing to move; use --offload disk to stream it from files")
    if args.compile and schedule_spec(args.schedule).splits_backward:
        errs.append(f"--compile does not run with --schedule {args.schedule}, which splits each backward in two; "
                    f"use 1f1b, gpipe or interleaved")
    if args.compile and args.freeze != "off":
        errs.append("--compile is not supported with --freeze (its trainer re-lays the model out as it goes)")
    if args.checkpoint < -1:
        errs.append(f"--checkpoint {args.checkpoint} must be a number of blocks >= 0 (or the flag alone for "
                    f"every block)")
    if args.save_interval < 0 or (args.save_interval and not args.save):
        errs.append(f"--save-interval {args.save_interval} needs --save DIR and must be >= 0")
    if args.keep < 0:
        errs.append(f"--keep {args.keep} must be >= 0")
    if args.inject_kill and not args.save:
        errs.append("--inject-kill needs --save DIR (its markers and the restarted run's checkpoints live there)")
    for fault in args.inject_kill:
        if not (len(fault.split(":")) == 2 and all(t.isdigit() for t in fault.split(":"))):
            errs.append(f"--inject-kill {fault!r}: expected STEP:RANK, e.g. 3:5")
    if args.save_format == "per_rank" and args.load:
        errs.append("--load takes universal checkpoints; a per_rank --save DIR is resumed by itself (same layout)")
    if args.eval_interval < 0 or args.eval_iters < 0:
        errs.append(f"--eval-interval {args.eval_interval} and --eval-iters {args.eval_iters} must be >= 0")
    if world < 1:
        errs.append("dp, tp and pp must be positive")
    if args.model == "llama":
        from ..optional import have
        if not have("transformers"):
            errs.append("--model llama needs transformers (pip install transformers)")
    from .demo_support import check_freeze_args
    errs += check_freeze_args(args)
    if errs:
        raise SystemExit("demo: " + "; ".join(errs))


# the demo's training recipe: a resumed run must use the saved one for its data and single-process comparison
RECIPE = ("seed", "batch_size", "seq_len", "lr", "weight_decay", "max_grad_norm", "corpus_bytes")


def check_resume(args) -> None:
    """``--load``, checked before any process starts: the checkpoint must hold this model, come from the
    same recipe (:data:`RECIPE`) and leave steps to train (each rank reads its iteration when loading)."""
    if not args.load:
        return
    from ..composition.universal_checkpoint import check_config, read_meta, resolve_checkpoint
    try:
        path = resolve_checkpoint(args.load)
        meta = read_meta(path)
        check_config(model_description(args), meta, path)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"demo: --load {args.load}: {e}") from e
    check_recipe(args, path, meta)
    if meta["iteration"] >= args.steps:
        raise SystemExit(f"demo: --load {path} is at iteration {meta['iteration']}: --steps {args.steps} leaves "
                         f"nothing to train; pass --steps > {meta['iteration']}")


def check_recipe(args, path: str, meta: dict) -> None:
    """The checkpoint at ``path`` (its ``meta``) was trained with this run's :data:`RECIPE`, else SystemExit."""
    saved = ((meta.get("resume") or {}).get("data") or {}).get("recipe") or {}
    if os.path.exists(os.path.join(path, "demo_recipe.json")):       # checkpoints saved before the recipe was in meta
        with open(os.path.join(path, "demo_recipe.json")) as f:
            saved = json.load(f)
    differ = [k for k in RECIPE if k in saved and saved[k] != getattr(args, k)]
    if differ:
        raise SystemExit(f"demo: {path} was trained with " + ", ".join(
            f"--{k.replace('_', '-')} {saved[k]}" for k in differ) + " (here " + ", ".join(
            f"{getattr(args, k)}" for k in differ) + "); pass the same values, so the data and the "
            "single-process comparison continue the saved run")


def rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _maybe_kill(root: str, fault: str, step: int, rank: int, checkpointer=None) -> None:
    """``--inject-kill STEP:RANK``: SIGKILL this process (kill -9: no cleanup, no exception) right after
    step STEP on global rank RANK, the first time a run under ``root`` gets there. The asynchronous write in
    flight, if any, is let finish first: the work a kill loses is then at most the save interval, whatever
    the machine's speed (a kill during a write, which loses the write too, is tests/test_async_checkpoint's)."""
    at, who = (int(t) for t in fault.split(":"))
    if (at, who) != (step, rank):
        return
    if checkpointer is not None:
        checkpointer.wait()
    marker = os.path.join(root, f".injected-kill-step{at}-rank{who}")
    if os.path.exists(marker):
        return
    os.makedirs(root, exist_ok=True)
    with open(marker, "w") as f:
        f.write(f"killed after step {at}\n")
        f.flush()
        os.fsync(f.fileno())
    print(f"demo: injected failure: kill -9 of rank {rank} after step {step}", flush=True)
    import signal
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------------- the parallel run
def train_parallel(args, corpus: torch.Tensor, device: Optional[torch.device],
                   val: Optional[torch.Tensor] = None) -> Optional[dict]:
    """Runs on every rank of an initialised process group; returns the results on rank 0. ``val``: the
    validation text (None: no validation)."""
    import torch.distributed as dist

    from ..composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig, PrecisionConfig
    from ..composition.parallel3d import Parallel3D
    from ..composition.universal_checkpoint import load_universal, resolve_checkpoint, save_iteration
    from ..mesh import ParallelMesh
    rank = dist.get_rank()
    mesh = ParallelMesh(**mesh_sizes(args))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
    what, extra = parallel_model(args)
    if args.freeze != "off":                     # the whole model, re-laid out as its bottom blocks freeze
        from .demo_support import freeze_trainer
        model = freeze_trainer(args, lambda: reference(args)[0], lm_loss, mesh, dtype=dtype, device=device,
                               checkpoint=checkpoint_setting(args))
    else:
        offload = {} if args.offload == "none" else {"offload": args.offload, "offload_dir": args.offload_dir}
        model = Parallel3D(what, mesh, device=device, cp_method=args.cp_method, **extra,
                           optimizer=OptimizerConfig(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay,
                                                     max_grad_norm=args.max_grad_norm, **offload),
                           pipeline=PipelineConfig(schedule=args.schedule, num_microbatches=args.microbatches,
                                                   checkpoint=checkpoint_setting(args), compile=args.compile),
                           data_parallel=DataParallelConfig(zero=args.zero),
                           precision=PrecisionConfig(dtype=dtype, fp8=fp8_recipe(args)))
    start, saved, load_s = 0, [], None
    checkpointer = None
    if args.save and args.freeze == "off":       # a FreezeTrainer changes layout as it goes: saved synchronously
        from ..resilience import AsyncCheckpointer
        checkpointer = AsyncCheckpointer(model, args.save, format=args.save_format, keep=args.keep,
                                         asynchronous=args.save_mode == "async")
    t_load = time.perf_counter()
    if args.load:
        start = load_universal(model, resolve_checkpoint(args.load))["iteration"]
        load_s = round(time.perf_counter() - t_load, 3)
    elif checkpointer is not None:               # a restarted run: the newest complete checkpoint of --save
        from ..resilience import resume
        resumed = resume(model, args.save)
        if resumed is not None:
            check_recipe(args, resumed["path"], {"resume": {"data": resumed["data"]}})
            start, load_s = resumed["iteration"], round(time.perf_counter() - t_load, 3)
            args.load = resumed["path"]
            if rank == 0:
                print(f"demo: resumed from {resumed['path']} at iteration {start} (random streams "
                      f"{'restored' if resumed['restored_random_state'] else 'not restored: another layout'})",
                      flush=True)
        elif rank == 0:
            print(f"demo: no complete checkpoint under {args.save}: starting at iteration 0", flush=True)
    if start >= args.steps:                      # restarted after the last save: nothing left to train
        return {"already_done": start, "resumed_from": args.load} if rank == 0 else None
    bar = None
    if rank == 0 and not args.no_progress:
        from ..optional import progress_bar
        bar = progress_bar(total=args.steps, initial=start, desc=f"{args.model} {describe(mesh_sizes(args), ' ')}",
                   unit="step", dynamic_ncols=True)
    losses, step_times, skipped, val_losses = [], [], 0, []
    tokens_per_step = args.batch_size * args.seq_len
    # on the device the model trains on (device None: the CPU), the one NCCL would reduce it on
    mem = torch.zeros(1, dtype=torch.float64, device=device if device is not None else torch.device("cpu"))
    evals, val_batches = validation_plan(val, args)
    for step in range(start, args.steps):
        x, y = get_batch(corpus, step, args.batch_size, args.seq_len, args.seed)   # the data position: the step
        if device is not None:
            x, y = x.to(device), y.to(device)
        t0 = time.perf_counter()
        out = model.train_step(x, y)
        step_times.append(time.perf_counter() - t0)
        losses.append(out["loss"])
        skipped += int(out.get("skipped", False))
        if out.get("relayout"):                  # --freeze: this step began in a new layout
            from .demo_support import relayout_line
            line = relayout_line(out["relayout"])
            if bar is not None:
                bar.write(line)
                bar.set_description(f"{args.model} dp={model.mesh.dp} tp=1 pp={model.mesh.pp}")
            elif rank == 0:
                print(line, flush=True)
        mem.fill_(rss_mb())
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        tps = tokens_per_step / step_times[-1]
        if bar is not None:
            bar.set_postfix(loss=f"{out['loss']:.4f}", tok_s=f"{tps:,.0f}", max_rss=f"{mem.item():.0f}MB")
            bar.update(1)
        elif rank == 0:
            print(f"step {step + 1}/{args.steps}  loss {out['loss']:.5f}  tokens/s {tps:,.0f}  "
                  f"max RSS/rank {mem.item():.0f} MB", flush=True)
        if step + 1 in evals:
            vl = sum(model.evaluate(*(t.to(device) if device is not None else t for t in b))
                     for b in val_batches) / len(val_batches)
            val_losses.append([step + 1, vl])
            line = f"validation after step {step + 1}: loss {vl:.5f}"
            if bar is not None:
                bar.write(line)              # above the progress bar
            elif rank == 0:
                print(line, flush=True)
        for fault in args.inject_kill:
            _maybe_kill(args.save, fault, step + 1, rank, checkpointer)
        if args.save and (step + 1 == args.steps or (args.save_interval and (step + 1) % args.save_interval == 0)):
            data = {"iteration": step + 1, "recipe": {k: getattr(args, k) for k in RECIPE}}
            if checkpointer is None:
                t_save = time.perf_counter()
                path = save_iteration(model, args.save, step + 1)
                saved.append({"path": path, "seconds": round(time.perf_counter() - t_save, 3)})
                if rank == 0:
                    with open(os.path.join(path, "demo_recipe.json"), "w") as f:
                        json.dump(data["recipe"], f)
            else:
                checkpointer.save(step + 1, data)
    if checkpointer is not None:
        checkpointer.wait()
        saved += [{"path": r.path, "seconds": round(r.stall_s, 4), "write_seconds": round(r.write_s, 4),
                   "error": r.error} for r in checkpointer.records]
    if bar is not None:
        bar.close()
    if args.offload != "none":
        model.optimizer.close_offload()          # the state files go with the run
    os.makedirs(args.out, exist_ok=True)
    png = model.timeline_png(os.path.join(args.out, "timeline.png"))
    bubble = model.bubble_fraction() if rank == 0 else None
    per_rank = [None] * dist.get_world_size()
    info = {"rank": rank, "rss_mb": round(rss_mb(), 1),
            "coord": {"dp": model.mesh.dp_rank, "tp": model.mesh.tp_rank, "pp": model.mesh.pp_rank},
            "cores": available_cores()}
    if device is not None and device.type == "cuda":
        info["cuda_max_allocated_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    dist.all_gather_object(per_rank, info)
    if rank != 0:
        return None
    timed = step_times[1:] or step_times                # the first step includes warm-up
    return {"losses": losses, "tokens_per_s": tokens_per_step * len(timed) / sum(timed),
            "step_time_s": sum(timed) / len(timed), "per_rank": per_rank, "timeline_png": png,
            "bubble_fraction": bubble, "skipped_steps": skipped if args.precision == "fp16" else None,
            "val_losses": val_losses, "first_step": start + 1, "saved": saved, "load_seconds": load_s,
            "resumed_from": args.load,
            "loss_scale": out["loss_scale"] if args.precision == "fp16" and args.steps else None,
            "freeze": model.history if args.freeze != "off" else None}


def _worker(rank: int, world: int, args, port: int) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    retain_freed_memory()        # a CPU rank reuses freed activations instead of faulting them back in
    if args.backend == "nccl_rules":
        from ..testing import nccl_rules
        nccl_rules.register()
        nccl_rules.track_host_tensors()
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    if not args.no_bind_cores:   # after the process group, so gloo's threads are bound too
        bind_rank_to_cores(rank, world)
    try:
        corpus, val = load_splits(args.corpus_bytes, args.seq_len)
        res = train_parallel(args, corpus, None, val)
        if res is not None:
            with open(os.path.join(args.out, "_parallel.json"), "w") as f:
                json.dump(res, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- the reference
def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def train_reference(args, corpus: torch.Tensor, val: Optional[torch.Tensor] = None, freeze=None):
    """The single-process run: ``(losses, val_losses)`` (``[[step, loss], ...]``, empty without ``val``).
    ``freeze``: the parallel run's layout changes (``--freeze``), whose freezes it replays."""
    from ..moe.expert_parallel import moe_layers
    from .demo_support import freeze_steps, replay_freeze
    freezes = freeze_steps(freeze)
    model, loss_of = reference(args)
    from ..fp8.recipes import pending_kept
    fp8_states = []
    if args.precision == "fp8":             # the same FP8 layers, their delayed histories committed per step
        from ..fp8 import convert_to_fp8, delayed_scaling_states
        convert_to_fp8(model, fp8_recipe(args), delayed_update="step")
        fp8_states = [s for _, s in delayed_scaling_states(model)]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=args.weight_decay, foreach=False)
    losses, val_losses = [], []
    evals, val_batches = validation_plan(val, args)
    microbatches = reference_microbatches(args, batch_shards(args))
    if microbatches is not None:            # the router losses over each micro-batch, as the parallel run
        for layer in moe_layers(model):
            layer.aux_loss_scale = 1.0 / len(microbatches)
    for step in range(args.steps):
        x, y = get_batch(corpus, step, args.batch_size, args.seq_len, args.seed)
        replay_freeze(model, freezes, step)
        if microbatches is None:
            loss = loss_of(model, x, y)
            loss.backward()
        else:                               # gradient accumulation: each micro-batch's mean, weighted by its rows
            loss = sum(_backward(loss_of(model, x[rows], y[rows]) * (len(rows) / len(x))) for rows in microbatches)
        if fp8_states:
            from ..fp8 import commit_delayed
            commit_delayed(fp8_states)
        if args.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step + 1 in evals:
            model.eval()
            with torch.no_grad(), pending_kept(fp8_states):     # evaluation leaves the FP8 scaling alone
                vl = sum(loss_of(model, x, y).item() for x, y in val_batches) / len(val_batches)
            model.train()
            val_losses.append([step + 1, vl])
    return losses, val_losses


def _checkpoint_text(args) -> str:
    ckpt = checkpoint_setting(args)
    if ckpt is True:
        return ", checkpointing every block"
    return f", checkpointing the first {ckpt} block(s) of each stage" if ckpt else ""


def relative_difference(got: float, want: float) -> float:
    """``|got - want| / |want|``, or NaN where either value is NaN or infinite: a diverged run never agrees."""
    if not (math.isfinite(got) and math.isfinite(want)):
        return math.nan
    if want == 0:
        return 0.0 if got == 0 else math.inf
    return abs(got - want) / abs(want)


def within_tolerance(diffs: Sequence[float], tol: float) -> Tuple[bool, float]:
    """``(every difference <= tol, the worst)``; the worst is NaN if any difference is
    (:func:`~parallel_layers.testing.compare.worst`), and a NaN never passes."""
    return all(d <= tol for d in diffs), (worst_error(diffs) if diffs else 0.0)


def _not_finite_text(first_step: int, losses, ref_losses, val, ref_val) -> str:
    steps = [first_step + i for i, (a, b) in enumerate(zip(losses, ref_losses))
             if not (math.isfinite(a) and math.isfinite(b))]
    steps += [f"val {s}" for (s, a), (_, b) in zip(val, ref_val) if not (math.isfinite(a) and math.isfinite(b))]
    return f"NaN or infinite loss at step(s) {', '.join(map(str, steps))}; " if steps else ""


def summarize(args, par: dict, ref: Optional[tuple], corpus_bytes: int, launcher: str) -> dict:
    """Prints the run and its comparison with the single-process one (``ref``: ``(losses, val_losses)``
    from :func:`train_reference`, or None) and writes ``summary.json``."""
    if par.get("already_done") is not None:
        print(f"demo: {par['resumed_from']} is at iteration {par['already_done']} >= --steps {args.steps}: the run "
              f"had finished; nothing to train")
        summary = {"config": vars(args), "already_done": par["already_done"], "agree": None}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        return summary
    tol = {"fp32": FP32_RTOL, "bf16": BF16_RTOL, "fp16": FP16_RTOL, "fp8": FP8_RTOL}[args.precision]
    config = {k: getattr(args, k) for k in vars(args)}
    config["checkpoint"] = checkpoint_setting(args)          # True (every block), or a block count
    start = par.get("first_step", 1) - 1                    # > 0: resumed (--load); the reference ran from 0
    ref_losses, ref_val = ref if ref is not None else (None, None)
    if ref is not None:
        ref_losses, ref_val = ref_losses[start:], [v for v in ref_val if v[0] > start]
    val = par.get("val_losses") or []
    summary = {"config": config, "launcher": launcher,
               "corpus": {"source": "Python standard library .py sources", "bytes": corpus_bytes,
                          "vocab": 256},
               "first_step": start + 1, "saved_checkpoints": par.get("saved") or [],
               "load_seconds": par.get("load_seconds"),
               "losses": {"parallel": par["losses"], "single_process": ref_losses},
               "val_losses": {"parallel": val, "single_process": ref_val},
               "tokens_per_s": par["tokens_per_s"], "step_time_s": par["step_time_s"],
               "memory_rss_mb": [r["rss_mb"] for r in par["per_rank"]], "per_rank": par["per_rank"],
               "bubble_fraction": par["bubble_fraction"], "tolerance_rel_per_step": tol,
               "skipped_steps": par.get("skipped_steps"), "final_loss_scale": par.get("loss_scale"),
               "freeze": par.get("freeze")}
    if start:
        print(f"\nresumed from {par.get('resumed_from') or args.load} at step {start} (a universal checkpoint: any "
              f"layout loads it; "
              f"{par['load_seconds']:.2f} s on rank 0)")
    sizes = describe(mesh_sizes(args), " ")
    if args.cp > 1:                           # which attention shards the sequence
        sizes = sizes.replace(f"cp={args.cp}", f"cp={args.cp} ({args.cp_method})")
    print(f"\n3D run ({args.model}): {sizes}, zero={args.zero}, {args.schedule}, "
          f"{args.microbatches} microbatches, {args.precision}{_checkpoint_text(args)}: "
          f"{par['tokens_per_s']:,.0f} tokens/s, "
          f"loss {par['losses'][0]:.4f} -> {par['losses'][-1]:.4f}"
          + (f", validation loss {val[-1][1]:.4f}" if val else ""))
    print("memory RSS per rank (MB): " + ", ".join(f"{m:.0f}" for m in summary["memory_rss_mb"]))
    if par.get("skipped_steps") is not None:
        print(f"fp16 dynamic loss scaling: {par['skipped_steps']} of {args.steps - start} steps skipped (inf/nan), "
              f"final loss scale {par['loss_scale']:g}")
    if par["bubble_fraction"] is not None:
        print(f"pipeline bubble (last step, measured): {par['bubble_fraction']:.1%}")
    for event in par.get("freeze") or []:
        print(f"freeze training: from step {event['step'] + 1}: {event['to']}")
    if ref is None:
        summary["agree"], summary["max_rel_diff"] = None, None
        print("single-process comparison skipped (--no-reference)")
    else:
        if len(par["losses"]) != len(ref_losses):
            raise RuntimeError(f"demo: the 3D run has {len(par['losses'])} losses but the single process "
                               f"{len(ref_losses)} from step {start + 1}")
        if [s for s, _ in val] != [s for s, _ in ref_val]:
            raise RuntimeError(f"demo: validation ran after steps {[s for s, _ in val]} in the 3D run but "
                               f"{[s for s, _ in ref_val]} in the single process")
        diffs = [relative_difference(a, b) for a, b in zip(par["losses"], ref_losses)]
        val_diffs = [relative_difference(a, b) for (_, a), (_, b) in zip(val, ref_val)]
        agree, worst = within_tolerance(diffs + val_diffs, tol)
        summary["agree"], summary["max_rel_diff"] = agree, worst
        summary["rel_diff_per_step"], summary["val_rel_diff"] = diffs, val_diffs
        print(f"{'step':>5} {'3D loss':>12} {'1-process':>12} {'rel diff':>10}")
        for i, (a, b, d) in enumerate(zip(par["losses"], ref_losses, diffs)):
            print(f"{start + i + 1:>5} {a:>12.6f} {b:>12.6f} {d:>10.2e}")
        for (step, a), (_, b), d in zip(val, ref_val, val_diffs):
            print(f"{'val ' + str(step):>5} {a:>12.6f} {b:>12.6f} {d:>10.2e}")
        what = "losses" + (" and validation losses" if val else "")
        if agree:
            print(f"{what} agree with the single-process run: max relative difference {worst:.2e} "
                  f"<= tolerance {tol:g} ({args.precision})")
        else:
            print(f"{what} DISAGREE with the single-process run: "
                  + _not_finite_text(start + 1, par["losses"], ref_losses, val, ref_val)
                  + f"max relative difference {worst:.2e}, tolerance {tol:g} ({args.precision})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    for ckpt in par.get("saved") or []:
        print(f"saved a universal checkpoint: {ckpt['path']} ({ckpt['seconds']:.2f} s on rank 0)")
    png = par.get("timeline_png")
    print(f"wrote {os.path.join(args.out, 'summary.json')}" + (f" and {png}" if png else
                                                               " (no timeline.png: matplotlib is not installed)"))
    return summary


# ---------------------------------------------------------------------- entry points
def _run_torchrun(args) -> int:
    import torch.distributed as dist
    use_cuda = torch.cuda.is_available()
    device = None
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not use_cuda:
        retain_freed_memory()
    backend = "nccl" if use_cuda else args.backend
    if backend == "nccl_rules":
        from ..testing import nccl_rules
        nccl_rules.register()
        nccl_rules.track_host_tensors()
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=600))
    if not use_cuda and not args.no_bind_cores:
        bind_rank_to_cores(int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    world = dist.get_world_size()
    if world != world_size(args):
        raise SystemExit(f"demo: WORLD_SIZE={world} but dp x cp x tp x pp = {world_size(args)}")
    try:
        corpus, val = load_splits(args.corpus_bytes, args.seq_len)
        par = train_parallel(args, corpus, device, val)
        code = 0
        if par is not None:
            ref = (None if args.no_reference or "already_done" in par else
                   train_reference(args, corpus, val, par.get("freeze")))
            summary = summarize(args, par, ref, corpus.numel(), "torchrun")
            code = 0 if summary["agree"] in (True, None) else 1
        flag = torch.tensor([code], device=device)
        dist.broadcast(flag, 0)
        return int(flag.item())
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    check_resume(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_torchrun(args)
    import torch.multiprocessing as mp
    world = world_size(args)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"demo: starting {world} processes ({describe(mesh_sizes(args))}) over gloo on CPU, "
          f"one thread each", flush=True)
    t0 = time.perf_counter()
    # the ranks fork from a server that imported torch and the demo once (not a fresh interpreter each)
    ctx = start_context(None, ("parallel_layers.cli.demo",) + (("transformers",) if args.model == "llama" else ()))
    mp.start_processes(_worker, args=(world, args, free_port()), nprocs=world, join=True,
                       start_method=ctx.get_start_method())
    wall = time.perf_counter() - t0
    part = os.path.join(args.out, "_parallel.json")
    with open(part) as f:
        par = json.load(f)
    os.remove(part)
    corpus, val = load_splits(args.corpus_bytes, args.seq_len)
    ref = None
    if not args.no_reference and "already_done" not in par:
        print("single-process reference run ...", flush=True)
        ref = train_reference(args, corpus, val, par.get("freeze"))
    summary = summarize(args, par, ref, corpus.numel(), f"torch.multiprocessing, forkserver ({wall:.1f}s)")
    return 0 if summary["agree"] in (True, None) else 1


__all__ = ["main", "load_corpus", "load_splits", "get_batch", "train_reference", "build_parser", "summarize",
           "relative_difference", "within_tolerance"]
