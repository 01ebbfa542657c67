"""The settings of :class:`~parallel_layers.composition.parallel3d.Parallel3D`, grouped by the part of the run
they configure, each checked where it is built (an error names ``Parallel3D``, the field, the value and the
fix before any process group is touched):

* :class:`OptimizerConfig`: AdamW's hyperparameters, weight-decay exclusions, gradient clipping, and the
  options of the ZeRO optimizers (kernel backend, optimizer-state offload; ``zero`` 1-3 only);
* :class:`PipelineConfig`: the schedule, micro-batches, chunks per rank, stage boundaries and activation
  checkpointing;
* :class:`DataParallelConfig`: the ZeRO stage and the gradient bucket size;
* :class:`PrecisionConfig`: the model's dtype, autocast, the fp16 loss scaler, the non-finite step skip and FP8
  GEMMs.

Checks that need two groups together (a ZeRO stage against a dtype) are :func:`check_together`, run by
``Parallel3D`` once the model's dtype is known and the layout planner has chosen. :func:`split_keywords`
takes the groups out of ``Parallel3D``'s keywords; a flat keyword it took before the groups existed (``lr=``,
``zero=``, ...) is a ``TypeError`` naming the group and field that replace it (:data:`MOVED_KEYWORDS`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..activations.checkpoint_policy import resolve_policy
from ..activations.partitioned_checkpoint import MODES as CHECKPOINT_INPUT_MODES
from ..amp.scaler import DynamicLossScaler
from ..fp8.recipes import FP8Recipe
from ..pipeline.schedules import SCHEDULE_SPECS, schedule_names, schedule_spec
from ..zero.offload import DEFAULT_BUFFER_MB
from ..zero.state_file import IO_MODES


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(owner: str, name: str, value, *, minimum: float = 0.0, strict: bool = False, fix: str = "",
                  infinite: bool = False) -> None:
    """``value`` is an int or float >= ``minimum`` (> with ``strict``), finite unless ``infinite``."""
    ok = (_is_number(value) and (math.isfinite(value) or (infinite and value == math.inf))
          and (value > minimum if strict else value >= minimum))
    if not ok:
        bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
        raise ValueError(f"Parallel3D: {owner}({name}={value!r}): {name} must be a {'' if infinite else 'finite '}"
                         f"number {bound}" + (f"; {fix}" if fix else ""))


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW over the model's parameters (``torch.optim.AdamW`` with ``zero=0``, the ZeRO optimizers with
    1-3). Defaults that differ from torch's: ``betas=(0.9, 0.95)`` (GPT-3's, Megatron-LM's, Llama's),
    ``weight_decay=0.0`` and ``max_grad_norm=1.0`` (the global gradient norm is clipped at 1; None: no
    clipping). ``no_decay(name, p)``: the parameters without weight decay (e.g. ``lambda n, p: p.ndim < 2``).

    For the ZeRO optimizers only (``zero`` 1, 2 or 3; see :mod:`parallel_layers.zero.offload`): ``backend``,
    the fused AdamW kernel's (None: the default for the device); ``offload`` (None, ``"disk"`` or ``"cpu"``),
    ``offload_dir``, ``offload_buffer_mb``, ``offload_io`` and ``offload_delayed_update``, where the
    optimizer state lives."""
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    no_decay: Optional[Callable] = None
    max_grad_norm: Optional[float] = 1.0
    backend: Optional[str] = None
    offload: Optional[str] = None
    offload_dir: Optional[str] = None
    offload_buffer_mb: float = DEFAULT_BUFFER_MB
    offload_io: str = "auto"
    offload_delayed_update: bool = False

    def __post_init__(self):
        me = "OptimizerConfig"
        _check_number(me, "lr", self.lr)
        _check_number(me, "eps", self.eps)
        _check_number(me, "weight_decay", self.weight_decay)
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(_is_number(b) and 0.0 <= b < 1.0 for b in self.betas)):
            raise ValueError(f"Parallel3D: {me}(betas={self.betas!r}): betas must be two numbers in [0, 1), e.g. "
                             f"(0.9, 0.95)")
        if self.no_decay is not None and not callable(self.no_decay):
            raise ValueError(f"Parallel3D: {me}(no_decay={self.no_decay!r}) must be None or a function "
                             f"no_decay(name, parameter) -> bool, e.g. lambda n, p: p.ndim < 2")
        if self.max_grad_norm is not None:
            # inf measures the norm and clips nothing
            _check_number(me, "max_grad_norm", self.max_grad_norm, strict=True, infinite=True,
                          fix="pass max_grad_norm=None to turn clipping off")
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"Parallel3D: {me}(backend={self.backend!r}) must be None or a kernel backend's name")
        self._check_offload(me)

    def _check_offload(self, me: str) -> None:
        # what needs the model's device (offload="cpu" needs CUDA, "disk" the CPU) is checked by the optimizer
        if self.offload not in (None, "disk", "cpu"):
            raise ValueError(f"Parallel3D: {me}(offload={self.offload!r}): choose None (state in memory), 'disk' "
                             f"(files under offload_dir) or 'cpu' (a CUDA model's state in host memory)")
        if self.offload == "disk" and not self.offload_dir:
            raise ValueError(f"Parallel3D: {me}(offload='disk') needs offload_dir=DIR, the directory that will hold "
                             f"one state file per rank")
        if self.offload != "disk" and self.offload_dir is not None:
            raise ValueError(f"Parallel3D: {me}(offload_dir={self.offload_dir!r}) is for offload='disk' (offload="
                             f"{self.offload!r}); pass offload='disk' or drop offload_dir")
        _check_number(me, "offload_buffer_mb", self.offload_buffer_mb, strict=True)
        if self.offload_io not in IO_MODES + ("auto",):
            raise ValueError(f"Parallel3D: {me}(offload_io={self.offload_io!r}): choose 'auto', 'direct' (O_DIRECT) "
                             f"or 'buffered'")
        if not isinstance(self.offload_delayed_update, bool):
            raise ValueError(f"Parallel3D: {me}(offload_delayed_update={self.offload_delayed_update!r}) must be "
                             f"True or False")
        if self.offload_delayed_update and self.offload != "cpu":
            raise ValueError(f"Parallel3D: {me}(offload_delayed_update=True) overlaps the host's optimizer step "
                             f"with the device's next step; it needs offload='cpu', not offload={self.offload!r}")

    def adamw_options(self) -> dict:
        """The AdamW keywords every mode's optimizer takes."""
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                    no_decay=self.no_decay)

    def zero_options(self) -> dict:
        """The keywords only the ZeRO optimizers take."""
        return {name: getattr(self, name) for name in ZERO_ONLY_FIELDS}

    def zero_options_set(self) -> List[str]:
        """The ZeRO-only fields that differ from their defaults (``zero=0`` has nothing to apply them to)."""
        return [name for name in ZERO_ONLY_FIELDS if getattr(self, name) != _DEFAULTS[name]]


ZERO_ONLY_FIELDS = ("backend", "offload", "offload_dir", "offload_buffer_mb", "offload_io", "offload_delayed_update")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How the stages run. ``schedule``: ``gpipe``, ``1f1b``, ``interleaved`` (``num_chunks`` virtual
    stages per rank, default 2), or the zero-bubble ``zb-h1`` and ``zbv`` (two chunks per rank in a V; see
    :mod:`parallel_layers.pipeline.schedules`); ``num_microbatches`` per replica and step; ``num_chunks``
    (None: the schedule's ``ScheduleSpec.chunks``, 2 for ``interleaved`` and ``zbv``, else 1). An
    ``nn.Module``'s stage boundaries: balanced by block count (None), by parameter count
    (``boundaries="parameters"``), by per-block costs
    (``block_costs=[...]``) or given (``boundaries=[4, 8, 12]``). ``checkpoint``: activation
    checkpointing, True (every block), an int ``n`` (the first ``n`` of each stage), ``"sqrt"`` or a
    policy such as ``MemoryBudget(bytes)`` (:mod:`parallel_layers.activations.checkpoint_policy`).
    ``checkpoint_inputs``: how a checkpointed block keeps its input until backward: None (whole),
    ``"partition"``, ``"offload"`` or ``"partition+offload"``
    (:mod:`parallel_layers.activations.partitioned_checkpoint`). ``compile``: ``torch.compile`` each block of
    each stage in place (``block.compile()``, the way torchtitan compiles per transformer block; the
    embedding, head, loss and the pipeline's sends stay eager): False, True (torch's defaults: inductor), or
    a dict of ``torch.compile`` options (e.g. ``{"backend": "aot_eager", "fullgraph": True}``); not with a
    schedule that splits the backward (``zb-h1``, ``zbv``: a compiled block's backward is one node)."""
    schedule: str = "1f1b"
    num_microbatches: int = 4
    num_chunks: Optional[int] = None
    boundaries: Union[None, str, Sequence[int]] = None
    block_costs: Optional[Sequence[float]] = None
    checkpoint: Union[bool, int, str, object] = False
    checkpoint_inputs: Optional[str] = None
    compile: Union[bool, dict] = False

    def __post_init__(self):
        me = "PipelineConfig"
        if not isinstance(self.compile, (bool, dict)):
            raise ValueError(f"Parallel3D: {me}(compile={self.compile!r}) must be False, True or a dict of "
                             f"torch.compile options")
        if self.compile is not False and schedule_spec(self.schedule).splits_backward:
            raise ValueError(f"Parallel3D: {me}(compile=...) does not run with schedule={self.schedule!r}, which "
                             f"splits each backward in two (input, then weight gradients) and a compiled block's "
                             f"backward is one node; use 1f1b, gpipe or interleaved")
        if self.schedule not in schedule_names():
            raise ValueError(f"Parallel3D: {me}(schedule={self.schedule!r}): choose one of {schedule_names()}")
        for name in ("num_microbatches", "num_chunks"):
            value = getattr(self, name)
            if value is None and name == "num_chunks":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Parallel3D: {me}({name}={value!r}) must be an int >= 1"
                                 + (f"; None picks {_default_chunks()}" if name == "num_chunks" else ""))
        b = self.boundaries
        if not (b is None or b == "parameters" or (not isinstance(b, str) and isinstance(b, Sequence) and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in b))):
            raise ValueError(f"Parallel3D: {me}(boundaries={b!r}): use None (balanced by block count), "
                             f"'parameters' (by parameter count) or a list of block split points, e.g. [4, 8, 12]")
        if self.block_costs is not None and (isinstance(self.block_costs, str)
                                             or not isinstance(self.block_costs, Sequence)
                                             or not all(_is_number(c) and math.isfinite(c) and c >= 0
                                                        for c in self.block_costs)):
            raise ValueError(f"Parallel3D: {me}(block_costs={self.block_costs!r}) must be one finite cost >= 0 "
                             f"per block (e.g. measured forward times), or None")
        resolve_policy(self.checkpoint, f"Parallel3D: {me}")
        if self.checkpoint_inputs is not None and self.checkpoint_inputs not in CHECKPOINT_INPUT_MODES:
            raise ValueError(f"Parallel3D: {me}(checkpoint_inputs={self.checkpoint_inputs!r}): choose one of "
                             f"{CHECKPOINT_INPUT_MODES} or None")

    def chunks(self) -> int:
        """Chunks per rank: ``num_chunks``, or the schedule's default."""
        if self.num_chunks is not None:
            return self.num_chunks
        return schedule_spec(self.schedule).chunks


def _default_chunks() -> str:
    """What ``num_chunks=None`` picks, schedule by schedule (their declarations), for an error message."""
    by_count: Dict[int, List[str]] = {}
    for spec in SCHEDULE_SPECS.values():
        by_count.setdefault(spec.chunks, []).append(spec.name)
    picks = [f"{n} for {' and '.join(names)}" for n, names in sorted(by_count.items(), reverse=True) if n != 1]
    return ", ".join(picks + ["1 for the rest"])


@dataclasses.dataclass(frozen=True)
class DataParallelConfig:
    """How the replicas keep in step. ``zero``: 0 (plain data parallel: gradients all-reduced, torch AdamW on
    every rank), 1 or 2 (ZeRO over reduce-scatter: sharded optimizer state, and gradients with 2), 3
    (parameters sharded too, gathered once per step; a bf16/fp16 model's gradients accumulated and reduced in
    fp32). ``bucket_cap_mb``: the gradient buckets'
    size (zero 0-2; the first bucket is at most 1 MiB so communication starts early). ``fp8_all_gather``
    (zero 3 with ``PrecisionConfig(fp8=FP8Recipe(scaling="tensor"))``): the FP8 layers' weights are
    all-gathered as FP8 bytes, scaled by the whole weight's amax (FSDP2's float8 all-gather; bit-identical
    training, 1 byte an element on the wire: :mod:`parallel_layers.zero.stage3_fp8`)."""
    zero: int = 0
    bucket_cap_mb: float = 25.0
    fp8_all_gather: bool = False

    def __post_init__(self):
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Parallel3D: zero={self.zero!r} must be 0 (plain data parallel), 1, 2 or 3")
        _check_number("DataParallelConfig", "bucket_cap_mb", self.bucket_cap_mb, strict=True)
        if not isinstance(self.fp8_all_gather, bool):
            raise ValueError(f"Parallel3D: DataParallelConfig(fp8_all_gather={self.fp8_all_gather!r}) must be True "
                             f"or False")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """The numbers the model trains in. ``dtype``: the model's (None: fp32 for a ``GPTConfig``, an
    ``nn.Module``'s own); bf16 and fp16 need ZeRO 1, 2 or 3 (fp32 master weights). ``autocast=torch.bfloat16``:
    an fp32 model's forward under ``torch.autocast``. ``loss_scaler``: for fp16 (None there:
    ``DynamicLossScaler()``, initial scale 2^16). ``skip_nonfinite``: fp32/bf16 steps whose global gradient
    norm is inf or NaN are skipped on every rank (fp16's loss scaler does that already).

    ``fp8``: an :class:`~parallel_layers.fp8.FP8Recipe` runs the GEMMs of the model's linear layers in FP8
    (E4M3 forward, E5M2 gradients by default) on the fp32 or bf16 model, its weights kept as master weights
    (:func:`~parallel_layers.fp8.convert_to_fp8`); ``fp8_modules(name, module) -> bool`` picks the layers
    (default: every linear layer but the LM head and layers whose local sizes are not multiples of 16; the MoE
    router and experts stay in the model's dtype). Amaxes are reduced over exactly the ranks that share a
    tensor (tp for its shards, cp for the sequence's), and the delayed recipe's histories take one amax per
    optimizer step, the max over the whole global batch, so any layout makes the scaling decisions one process
    makes on the same micro-batches."""
    dtype: Optional[torch.dtype] = None
    autocast: Optional[torch.dtype] = None
    loss_scaler: Optional[DynamicLossScaler] = None
    skip_nonfinite: bool = False
    fp8: Optional[FP8Recipe] = None
    fp8_modules: Optional[Callable] = None

    def __post_init__(self):
        me = "PrecisionConfig"
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"Parallel3D: {me}(dtype={self.dtype!r}) must be a floating torch.dtype "
                             f"(torch.float32, torch.bfloat16, torch.float16) or None (the model's own)")
        if self.autocast is not None and self.autocast != torch.bfloat16:
            raise ValueError(f"Parallel3D: autocast={self.autocast} is not supported; autocast=torch.bfloat16 runs an "
                             f"fp32 model's forward in bf16 (fp16 needs loss scaling: train an fp16 model instead, "
                             f"dtype=torch.float16 with zero=1, 2 or 3)")
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, DynamicLossScaler):
            raise ValueError(f"Parallel3D: {me}(loss_scaler={type(self.loss_scaler).__name__}) must be a "
                             f"DynamicLossScaler or None")
        if not isinstance(self.skip_nonfinite, bool):
            raise ValueError(f"Parallel3D: {me}(skip_nonfinite={self.skip_nonfinite!r}) must be True or False")
        if self.fp8 is not None and not isinstance(self.fp8, FP8Recipe):
            raise ValueError(f"Parallel3D: {me}(fp8={self.fp8!r}) must be an FP8Recipe (e.g. FP8Recipe() for "
                             f"per-tensor current scaling, FP8Recipe(scaling='delayed')) or None")
        if self.fp8_modules is not None and (self.fp8 is None or not callable(self.fp8_modules)):
            raise ValueError(f"Parallel3D: {me}(fp8_modules=...) is a callable (name, module) -> bool choosing the "
                             f"FP8 layers, and needs fp8=FP8Recipe(...)")
        if self.fp8 is not None and self.autocast is not None:
            raise ValueError(f"Parallel3D: {me}(fp8=..., autocast=...) do not combine: FP8 layers cast their own "
                             f"GEMM operands; train a bf16 model (dtype=torch.bfloat16, zero=1-3) or an fp32 one")
        if self.dtype is not None:
            self._check_with_dtype(self.dtype)

    def _check_with_dtype(self, dtype: torch.dtype) -> None:
        if self.autocast is not None and dtype != torch.float32:
            raise ValueError(f"Parallel3D: autocast is for fp32 weights (the model is {dtype}); keep the model in "
                             f"fp32 or drop autocast")
        if self.loss_scaler is not None and dtype != torch.float16:
            raise ValueError(f"Parallel3D: a loss_scaler is for fp16 models (dtype={dtype}); bf16 and fp32 have "
                             f"fp32's exponent range and need none (skip_nonfinite=True skips a step whose gradient "
                             f"norm is inf/NaN)")
        if self.fp8 is not None and dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"Parallel3D: fp8 runs on fp32 or bf16 models (dtype={dtype}): FP8 layers take fp32 or "
                             f"bf16 activations; use dtype=torch.bfloat16 with zero=1, 2 or 3")
        if self.skip_nonfinite and dtype == torch.float16:
            raise ValueError("Parallel3D: skip_nonfinite is for fp32/bf16 runs; fp16 runs skip non-finite steps "
                             "through their loss scaler already")

    def with_dtype(self, dtype: torch.dtype) -> "PrecisionConfig":
        """This config with ``dtype`` set (the model's, when it was None), checked again."""
        return dataclasses.replace(self, dtype=dtype)


def check_together(optimizer: OptimizerConfig, data_parallel: DataParallelConfig, precision: PrecisionConfig,
                   chosen_by: str = "") -> None:
    """What one group cannot check alone: the ZeRO stage against the dtype (``precision.dtype`` resolved)
    and against the ZeRO-only optimizer options. ``chosen_by``: where ``zero`` came from, for the message."""
    zero, dtype = data_parallel.zero, precision.dtype
    origin = f" ({chosen_by})" if chosen_by else ""
    # ZeRO-3 of a bf16/fp16 model: the parameters gathered in their dtype, the gradients accumulated and
    # reduce-scattered in fp32, fp32 master weights in ZeroStage3Optimizer (fp16 through the loss scaler)
    if zero == 3 and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"Parallel3D: zero=3{origin} supports fp32, bf16 and fp16 models (dtype={dtype}); use "
                         f"dtype=torch.float32, or zero=0 for a {dtype} model")
    if zero == 0 and dtype not in (torch.float32, torch.float64):
        raise ValueError(f"Parallel3D: a {dtype} model needs fp32 master weights; use zero=1, 2 or 3 "
                         f"(the ZeRO optimizers keep them) or dtype=torch.float32")
    if data_parallel.fp8_all_gather and (zero != 3 or precision.fp8 is None or precision.fp8.scaling != "tensor"):
        raise ValueError(f"Parallel3D: DataParallelConfig(fp8_all_gather=True) all-gathers ZeRO-3's FP8 weights: it "
                         f"needs zero=3 (here {zero}{origin}) and PrecisionConfig(fp8=FP8Recipe(scaling='tensor')) "
                         f"(here {precision.fp8}); the other scalings' scales do not come from the gathered weight")
    unused = optimizer.zero_options_set()
    if zero == 0 and unused:
        raise ValueError(f"Parallel3D: OptimizerConfig({', '.join(f'{n}={getattr(optimizer, n)!r}' for n in unused)}) "
                         f"applies to the ZeRO optimizers, but zero=0{origin} steps torch.optim.AdamW; use zero=1, 2 "
                         f"or 3, or drop {', '.join(unused)}")


@dataclasses.dataclass(frozen=True)
class Parallel3DSettings:
    """The four groups together, as ``Parallel3D`` uses them."""
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    data_parallel: DataParallelConfig = dataclasses.field(default_factory=DataParallelConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)

    def as_keywords(self) -> dict:
        return {name: getattr(self, name) for name in GROUPS}


# keyword of Parallel3D -> its config class
GROUPS = {"optimizer": OptimizerConfig, "pipeline": PipelineConfig, "data_parallel": DataParallelConfig,
          "precision": PrecisionConfig}

# the flat keywords Parallel3D took before the groups -> the group that holds them now; each is the field of
# the same name, but optimizer_options (a dict of OptimizerConfig's ZeRO-only fields)
MOVED_KEYWORDS: Dict[str, str] = {
    **{k: "optimizer" for k in ("lr", "betas", "eps", "weight_decay", "no_decay", "max_grad_norm",
                                "optimizer_options")},
    **{k: "pipeline" for k in ("schedule", "num_microbatches", "num_chunks", "boundaries", "block_costs",
                               "checkpoint", "checkpoint_inputs")},
    **{k: "data_parallel" for k in ("zero", "bucket_cap_mb")},
    **{k: "precision" for k in ("dtype", "autocast", "loss_scaler", "skip_nonfinite")},
}


def split_keywords(keywords: dict, where: str = "Parallel3D") -> Tuple[Parallel3DSettings, dict]:
    """``keywords`` (``optimizer=``, ``pipeline=``, ``data_parallel=``, ``precision=``, None for a group not
    given, and others) -> ``(settings, the other keywords)``. A flat keyword of :data:`MOVED_KEYWORDS` is a
    ``TypeError`` naming the group and field to use instead."""
    moved = [k for k in keywords if k in MOVED_KEYWORDS]
    if moved:
        fields = {g: ["offload=..., ..." if k == "optimizer_options" else f"{k}=..." for k in moved
                      if MOVED_KEYWORDS[k] == g] for g in GROUPS}
        raise TypeError(f"{where}: {', '.join(f'{k}=' for k in moved)} moved into the config groups; pass "
                        + ", ".join(f"{g}={cls.__name__}({', '.join(fields[g])})" for g, cls in GROUPS.items()
                                    if fields[g]))
    given = {g: keywords.get(g) for g in GROUPS}
    for group, cls in GROUPS.items():
        if given[group] is not None and not isinstance(given[group], cls):
            raise TypeError(f"{where}: {group}= takes a {cls.__name__}, not {type(given[group]).__name__}; e.g. "
                            f"{group}={cls.__name__}(...) (from parallel_layers import {cls.__name__})")
    settings = Parallel3DSettings(**{g: given[g] if given[g] is not None else GROUPS[g]() for g in GROUPS})
    return settings, {k: v for k, v in keywords.items() if k not in GROUPS}


__all__ = ["OptimizerConfig", "PipelineConfig", "DataParallelConfig", "PrecisionConfig", "Parallel3DSettings",
           "check_together", "split_keywords", "MOVED_KEYWORDS", "ZERO_ONLY_FIELDS"]
