"""3D parallelism for any model: data parallel or ZeRO 0-3 x tensor parallel x pipeline, over one
``ParallelMesh(dp, tp, pp)``.

Two ways in, one training path:

* ``Parallel3D(config, mesh, ...)`` with a :class:`~parallel_layers.models.gpt.GPTConfig`: the reference
  GPT, built by ``config.build`` on every rank from ``seed`` (the weights of ``torch.manual_seed(seed);
  GPT(config)``, each rank's tensor-parallel slice, holding only the modules its stages run:
  :func:`~parallel_layers.pipeline.any_model.kept_modules`), then cut like any other module below, by its
  recipe (:mod:`~parallel_layers.families.gpt`);
* ``Parallel3D(model, mesh, ...)`` with an ``nn.Module`` you built (a Hugging Face ``*ForCausalLM``,
  ``BertForMaskedLM`` or your own), unmodified: its recipe (:mod:`~parallel_layers.families`:
  shipped for some families, else inferred from the model's structure and config by
  :mod:`~parallel_layers.families.infer_recipe`; a hand-written ``Recipe`` for the rest, see
  docs/custom_recipe.md) says where the blocks are; the recipe's tensor-parallel plan (or ``tp_plan=``)
  splits the layers over ``mesh.tp_group`` (:func:`~parallel_layers.tensor_parallel.parallelize`), and
  :func:`~parallel_layers.pipeline.split_model` keeps this rank's stages, balanced by block count,
  parameter count (``boundaries="parameters"``) or measured costs (``block_costs=``). Side inputs
  (attention masks, position ids, token types) are passed to :meth:`train_step` by keyword; every stage
  rebuilds what its blocks need from them, so one tensor travels between stages. Weights tied between
  the first and last stage stay tied. ``loss_fn(logits, targets)`` is yours (default: token cross
  entropy, :func:`~parallel_layers.pipeline.token_loss.token_cross_entropy`). transformers' sparse MoE
  blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) are first replaced by ``MoELayer``, so ``ep`` shards their
  experts, and ``output_router_logits=True`` adds the model's router loss (:mod:`parallel_layers.moe.hf_swap`).

The loss is torch's: the mean over the labels of the whole GLOBAL batch that are not ``ignore_index``
(default -100), however unevenly the ignored labels fall on micro-batches and data-parallel replicas;
the gradients are those of that mean. The count comes from the labels (every rank holds the global
batch, so it is known before the step: no extra collective). ``loss_fn`` returns either the mean over
its micro-batch's counted labels (``F.cross_entropy(..., ignore_index=-100)``: weighted by its count) or
``(sum, count)`` (never divides by zero; the counts are checked against the labels'). See
:mod:`parallel_layers.pipeline.token_loss`.

One training step (:meth:`train_step`):

1. the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``, ``zbv``) runs over the microbatches of this
   replica's slice of the batch; every backward only accumulates (no reduction per microbatch);
2. tied weight gradients are summed between the first and the last stage;
3. gradients are reduced over dp once: all-reduce (``zero=0``), reduce-scatter into the ZeRO shard
   (``zero=1, 2``), or, with ZeRO-3 (parameters gathered once per step and kept for every microbatch),
   reduce-scatter of the full gradients, freeing them and the parameters;
4. the global gradient norm (:func:`parallel_layers.amp.clip_grad_norm_`): TP shards summed over tp and
   replicated parameters counted once, stages summed over pp, ZeRO shards summed over dp, the last
   stage's tied copy left out;
5. the optimizer step with the clip coefficient: ``torch.optim.AdamW`` (``zero=0``),
   :class:`~parallel_layers.zero.ZeroOptimizer` (1, 2) or :class:`~parallel_layers.zero.ZeroStage3Optimizer`
   (3), both with fp32 master weights for bf16/fp16 models. Each mode is one class of
   :mod:`parallel_layers.composition.replicas` behind one interface.

fp16 (``dtype=torch.float16``, ZeRO 1, 2 or 3) adds a :class:`DynamicLossScaler`: on the last stage every
microbatch's loss is computed in fp32 from the fp16 logits and its *gradient* multiplied by the scale
(:class:`_ScaledLossStage`), so the loss reported stays unscaled; step 4 measures the unscaled norm and
agrees on ``found_inf`` over every group in the same all-reduces; an overflowing step leaves
parameters, master weights, moments and step count bit-identical and the scale backs off.
``skip_nonfinite=True`` (fp32/bf16, off by default, as Megatron-LM's check of the gradient norm): a step
whose global gradient norm is inf or NaN is skipped on every rank, with everything left bit-identical;
``skipped_steps`` counts them and :meth:`train_step` reports ``skipped``.

``checkpoint``: activation checkpointing, True for every block, an int ``n`` for the first ``n`` blocks
of each stage, ``"sqrt"`` or a policy such as ``MemoryBudget(bytes)``
(:mod:`parallel_layers.activations.checkpoint_policy`); backward recomputes them with the forward's RNG state, so
dropout masks replay exactly. ``checkpoint_inputs``: how a checkpointed block keeps its input until
backward: None (whole), ``"partition"`` (a 1/tp slice per TP rank, all-gathered for the recomputation:
ZeRO-R's partitioned activations), ``"offload"`` (in host memory) or ``"partition+offload"``; the gradients
are plain checkpointing's, bit for bit (:mod:`parallel_layers.activations.partitioned_checkpoint`).
``no_decay(name, p)``: parameters without weight decay (biases and norms: ``lambda n, p: p.ndim < 2``);
``optimizer`` is a ``torch.optim.Optimizer`` whose groups torch LR schedulers drive.

Example: Llama at dp2 x tp2 x pp2 (8 ranks) with ZeRO-1::

    mesh = ParallelMesh(dp=2, tp=2, pp=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)                 # same weights on every rank
    loss_fn = lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())
    p3d = Parallel3D(model, mesh, loss_fn=loss_fn,
                     optimizer=OptimizerConfig(lr=3e-4, weight_decay=0.1, no_decay=lambda n, p: p.ndim < 2),
                     pipeline=PipelineConfig(schedule="1f1b", num_microbatches=4),
                     data_parallel=DataParallelConfig(zero=1))
    out = p3d.train_step(input_ids, labels, attention_mask=mask)   # the global batch on every rank
"""
from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable, List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..activations.partitioned_checkpoint import SavedInputs
from ..amp.clip import clip_grad_norm_
from ..amp.scaler import DynamicLossScaler
from ..dimensions import describe, replicating
from ..distributed import collectives as C
from ..families import Recipe, recipe_for
from ..fp8.convert import delayed_scaling_states
from ..fp8.recipes import commit_delayed, pending_kept
from ..mesh import ParallelMesh
from ..models.gpt import GPTConfig
from ..moe.expert_parallel import is_expert
from ..moe.hf_router_loss import check_padding, hf_router_loss
from ..moe.hf_swap import swap_hf_moe_blocks
from ..pipeline import PipelineEngine
from ..pipeline.any_model import kept_modules, split_model
from ..pipeline.schedules import layout_of, place_of, stage_of
from ..pipeline.timeline import draw
from ..pipeline.token_loss import IGNORE_INDEX, NO_LABEL, count_labels, token_cross_entropy
from ..tensor_parallel.partial_grads import mark_partial_param
from .config import (
    DataParallelConfig,
    OptimizerConfig,
    Parallel3DSettings,
    PipelineConfig,
    PrecisionConfig,
    check_together,
    split_keywords,
)
from .replica_check import ReplicaCheck, Summed, check_same_batch, check_tensors, sharded_checksum
from .replicas import replica_mode


def _model_stages(model: nn.Module, mesh: ParallelMesh, tp_group, *, recipe, tp_plan, loss_fn, num_chunks,
                  boundaries, block_costs, checkpoint, layout="loop", saved_inputs=None, precision=None,
                  sequence_parallel: bool = False, ignore_index: Optional[int] = IGNORE_INDEX):
    """This rank's stages of ``model``. ``loss_fn`` None: the token cross entropy, on the head's vocabulary
    shards where the tp plan splits the head (:mod:`~parallel_layers.tensor_parallel.loss_parallel`)."""
    recipe = recipe if recipe is not None else recipe_for(model)
    logits_group = None
    if tp_group is not None:
        from ..tensor_parallel.parallelize import parallelize
        plan = tp_plan if tp_plan is not None else (recipe.tp_plan(model) if recipe.tp_plan else None)
        if plan is None:
            raise ValueError(f"Parallel3D: tp={mesh.tp} needs a tensor-parallel plan for {type(model).__name__}; "
                             f"pass tp_plan={{module pattern: style}} (see tensor_parallel.parallelize) or give its "
                             f"recipe a tp_plan (docs/custom_recipe.md)")
        if sequence_parallel and not plan:
            raise ValueError(f"Parallel3D(sequence_parallel=True): {type(model).__name__} built its tensor-parallel "
                             f"layers itself (an empty tp plan); build it sequence-parallel (the reference GPT: "
                             f"GPTConfig(sequence_parallel=True)) or pass a tp_plan")
        if sequence_parallel:
            from ..tensor_parallel import sequence_parallel as sp
            plan = sp.sequence_parallel_plan(plan, recipe.blocks)
        if loss_fn is None and plan:
            from ..tensor_parallel.loss_parallel import loss_parallel_plan, vocab_parallel_token_loss
            plan, head = loss_parallel_plan(plan, recipe.last)
            if head is not None:
                loss_fn, logits_group = vocab_parallel_token_loss(tp_group, ignore_index), tp_group
        if plan:              # empty: the model built its tensor-parallel layers itself (the reference GPT)
            parallelize(model, tp_group, plan)
        if sequence_parallel:
            sp.gather_region_inputs(model, plan, recipe.blocks, tp_group)
            sp.mark_sequence_parallel_params(model, plan, recipe.blocks)
    if precision is not None and precision.fp8 is not None:
        # once tp has split the layers and before the split into stages: names and the LM head are the model's
        from ..fp8 import convert_to_fp8
        convert_to_fp8(model, precision.fp8, modules=precision.fp8_modules,
                       row_group=mesh.cp_group if mesh.sizes.get("cp", 1) > 1 else None, delayed_update="step")
    if loss_fn is None:
        loss_fn = _default_loss(ignore_index)
    # in a V the first and last stage are both on pipeline rank 0: tied weights are one module there
    tied_group = mesh.tied_stage_group() if mesh.pp > 1 and layout == "loop" else None
    chunks = split_model(model, recipe, mesh.pp_rank, mesh.pp, num_chunks=num_chunks, boundaries=boundaries,
                         block_costs=block_costs, loss_fn=loss_fn, tied_group=tied_group, checkpoint=checkpoint,
                         sum_tied_grads_in_stage=False, layout=layout, saved_inputs=saved_inputs,
                         sequence_parallel_group=tp_group if sequence_parallel else None,
                         logits_group=logits_group)
    # the sequence-parallel norms' and biases' gradients are sums over this rank's tokens: the replica mode
    # sums them over tp where the step's gradients are (fp32 main grads, ZeRO-3's fp32 accumulation)
    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False):
                mark_partial_param(p)
    tied, duplicates = [], set()
    for chunk in chunks:
        tied.extend(chunk.tied)
        if chunk.tied and not chunk.is_first:
            duplicates.update(id(p) for p in chunk.tied)
    return chunks, tied, duplicates, (tied_group if tied else None)


def compile_blocks(chunks: List[nn.Module], options: dict) -> int:
    """``torch.compile`` every block of every stage in place (``nn.Module.compile``: parameter names, hooks and
    state dicts unchanged; a block's first call compiles it). Returns the number of blocks."""
    count = 0
    for chunk in chunks:
        for block in getattr(chunk, "blocks", ()):
            block.compile(**options)
            count += 1
    return count


def _experts_over_mesh(model: nn.Module, mesh: ParallelMesh, num_microbatches: int,
                       sequence_parallel: bool = False) -> list:
    """The model's Mixture-of-Experts layers set up for the mesh: with ``ep > 1`` each holds this rank's experts
    (:func:`~parallel_layers.moe.expert_parallel.shard_experts`); the router's losses take the statistics of
    the whole micro-batch over the replicas (dp x ep x cp; and tp under sequence parallelism, whose ranks
    route different tokens), and their gradient reaches the router through the layer's backward weighted
    ``replicas / num_microbatches`` (the gradients are averaged over the replicas, summed over tp, and each
    micro-batch's losses count ``1 / num_microbatches``, as gradient accumulation over the same micro-batches
    in one process counts them). Under sequence parallelism every MoE parameter's gradient is a partial sum
    over this rank's tokens (``sequence_parallel``: summed over tp like the norms')."""
    from ..moe.expert_parallel import moe_layers, shard_experts
    ep = mesh.sizes.get("ep", 1)
    group = mesh.group_over(replicating() + (("tp",) if sequence_parallel else ()))
    if ep > 1 and not shard_experts(model, mesh.ep_group, group) and not moe_layers(model):
        raise ValueError(f"Parallel3D: ep={ep} splits the experts of Mixture-of-Experts layers, but "
                         f"{type(model).__name__} has none (parallel_layers.moe.MoELayer; e.g. "
                         f"GPTConfig(num_experts=...)); use ep=1 or a model with MoE layers")
    layers = moe_layers(model)
    for layer in layers:
        layer.aux_loss_group = group
        layer.aux_loss_scale = mesh.replicas / num_microbatches
        for p in layer.parameters() if sequence_parallel else ():
            p.sequence_parallel = True
    return layers


def _default_loss(ignore_index: Optional[int]) -> Callable:
    """The loss of a model given without ``loss_fn``: token cross entropy as ``(sum, count)``."""
    def token_loss(logits, targets):
        if ignore_index is None:
            return token_cross_entropy(logits, targets, ignore_index=NO_LABEL)
        return token_cross_entropy(logits, targets, ignore_index=ignore_index)
    return token_loss


def _describe(model: nn.Module) -> dict:
    """What a checkpoint of this model must match: its class and every parameter's dense shape."""
    return {"class": type(model).__name__,
            "parameters": {n: list(p.shape) for n, p in model.named_parameters()}}


class Parallel3D:
    """A model trained over ``mesh``: see the module docstring.

    ``model``: a :class:`GPTConfig` (the reference GPT; ``seed``: its weights are those of
    ``torch.manual_seed(seed); GPT(config)``; then as a module, ``recipe``, ``boundaries`` and ``block_costs``
    included) or an ``nn.Module`` (any model; every rank passes the same weights; ``loss_fn``, ``recipe``,
    ``tp_plan`` and the pipeline's ``boundaries`` and ``block_costs`` apply; the module is changed in place:
    TP layers swapped in, the parts other ranks run dropped; the
    default generator, which its dropout draws from, is seeded with ``seed`` on every rank once the model
    is split, so tensor-parallel ranks draw the same masks on the activations they hold replicated; heads
    split over tp share their masks rank to rank, unlike the reference GPT's per-rank tracker streams).

    The settings, in four groups (:mod:`parallel_layers.composition.config`, each checked when built; None
    takes the defaults): ``optimizer=OptimizerConfig(lr, betas, eps, weight_decay, no_decay,
    max_grad_norm, ...and the ZeRO optimizers' offload options)``, ``pipeline=PipelineConfig(schedule,
    num_microbatches, num_chunks, boundaries, block_costs, checkpoint, checkpoint_inputs)``,
    ``data_parallel=DataParallelConfig(zero, bucket_cap_mb)`` and ``precision=PrecisionConfig(dtype,
    autocast, loss_scaler, skip_nonfinite)``; a flat keyword they replaced (``lr=``, ``zero=``,
    ``optimizer_options=``, ...) is a ``TypeError`` naming its group. ``self.settings``: the groups this run
    uses (after the layout's choices, with the model's dtype).

    ``ignore_index``: labels that do not count in the loss (None: every label counts). ``cp_method``:
    ``"ring"`` or ``"ulysses"``, the attention of a mesh with ``cp > 1`` (each rank holds a zigzag shard of
    every sequence: :mod:`parallel_layers.context_parallel`). ``layout``: ``"auto"`` (or
    ``Auto(global_batch=..., seq_len=..., memory_gib=..., profile=...)``) picks the fastest layout
    that fits with the layout planner (:mod:`parallel_layers.planner`; rank 0 plans in a child process,
    every rank gets its choice), or a ``Layout`` (both :mod:`~parallel_layers.composition.layout`); it sets
    the mesh when ``mesh`` is None, and
    ``zero``, ``schedule``, ``num_microbatches``, ``num_chunks`` and ``checkpoint`` (``self.layout``),
    over those given. ``replica_check``: when every replicated parameter and the global batch are checked
    bit-identical over the ranks that hold them (:class:`~parallel_layers.composition.replica_check.ReplicaCheck`;
    ``"default"``: the first 3 steps and every 100th, or ``PARALLEL_LAYERS_REPLICA_CHECK``; None: never).
    ``sequence_parallel``: at tp > 1, the activations between the tensor-parallel regions (norms, residuals)
    split along the sequence over tp (Megatron-LM's sequence parallelism: ``1 / tp`` of their memory and
    elementwise work, the same bytes moved), for a module model through its plan
    (:mod:`parallel_layers.tensor_parallel.sequence_parallel`; with cp too; not yet with MoE blocks); the
    reference GPT's ``GPTConfig(sequence_parallel=True)`` says the same.
    """

    def __init__(self, model: Union[GPTConfig, nn.Module], mesh: ParallelMesh, *,
                 optimizer: Optional[OptimizerConfig] = None, pipeline: Optional[PipelineConfig] = None,
                 data_parallel: Optional[DataParallelConfig] = None, precision: Optional[PrecisionConfig] = None,
                 seed: int = 0, device: Optional[torch.device] = None, loss_fn: Optional[Callable] = None,
                 recipe: Optional[Recipe] = None, tp_plan: Optional[dict] = None,
                 ignore_index: Optional[int] = IGNORE_INDEX, cp_method: str = "ring", layout=None,
                 replica_check: Union[ReplicaCheck, str, None] = "default", sequence_parallel: bool = False,
                 **unexpected):
        # a flat keyword of the groups (lr=, zero=, ...) lands in **unexpected: split_keywords names its group
        settings, unexpected = split_keywords(
            dict(unexpected, optimizer=optimizer, pipeline=pipeline, data_parallel=data_parallel, precision=precision))
        if unexpected:
            raise TypeError(f"Parallel3D() got unexpected keyword argument(s) {sorted(unexpected)}; its settings are "
                            f"optimizer=OptimizerConfig(...), pipeline=PipelineConfig(...), "
                            f"data_parallel=DataParallelConfig(...), precision=PrecisionConfig(...)")
        optimizer, pipeline, data_parallel, precision = (settings.optimizer, settings.pipeline,
                                                         settings.data_parallel, settings.precision)
        chosen_by = ""
        if layout is not None:
            # the layout planner's choice (composition/layout.py): "auto" / Auto(...) plans on rank 0 (the
            # planner in a child process) and broadcasts; a Layout is used as given. It sets the mesh (when mesh
            # is None) and these:
            from .layout import resolve_layout
            chosen = resolve_layout(layout, model, compiled=pipeline.compile is not False,
                                    sequence_parallel=sequence_parallel)
            if mesh is None:
                mesh = ParallelMesh(**chosen.sizes)
            elif mesh.sizes != chosen.sizes:
                raise ValueError(f"Parallel3D: layout {chosen.name()} does not match the mesh "
                                 f"({describe(mesh.sizes)}); pass mesh=None to let the layout build it")
            data_parallel = dataclasses.replace(data_parallel, zero=chosen.zero)
            pipeline = dataclasses.replace(pipeline, schedule=chosen.schedule, num_microbatches=chosen.num_microbatches,
                                           num_chunks=chosen.num_chunks, checkpoint=chosen.checkpoint)
            chosen_by = f"chosen by layout {chosen.name()}"
            self.layout = chosen
        # a config that builds its model (``config.build(seed=, tp_group=, ...)``: the reference GPT's GPTConfig)
        # is built here, on every rank from ``seed``; a module is used as given; both then take the one path
        # below (recipe, split, replica mode)
        built_here = not isinstance(model, nn.Module)
        if built_here and not callable(getattr(model, "build", None)):
            raise TypeError(f"Parallel3D: model must be a GPTConfig (a config with a build method) or an "
                            f"nn.Module, not {type(model).__name__}")
        if sequence_parallel and built_here and not getattr(model, "sequence_parallel", False):
            model = dataclasses.replace(model, sequence_parallel=True)     # the reference GPT builds it itself
        if precision.dtype is None:
            precision = precision.with_dtype(torch.float32 if built_here else next(model.parameters()).dtype)
        check_together(optimizer, data_parallel, precision, chosen_by)
        if precision.dtype == torch.float16 and precision.loss_scaler is None:
            precision = dataclasses.replace(precision, loss_scaler=DynamicLossScaler(device=device))
        # what this run uses, after the layout's choices and the model's dtype
        self.settings = Parallel3DSettings(optimizer, pipeline, data_parallel, precision)
        dtype, schedule, checkpoint = precision.dtype, pipeline.schedule, pipeline.checkpoint
        num_chunks = pipeline.chunks()
        self.mesh, self.zero, self.dtype, self.scaler = mesh, data_parallel.zero, dtype, precision.loss_scaler
        # called as after_reduce(self) in every train_step once the gradients are reduced over dp, before the
        # norm and the optimizer step: to measure them (FreezeTrainer's per-block norms)
        self.after_reduce: Optional[Callable[["Parallel3D"], None]] = None
        self.max_grad_norm, self.skip_nonfinite, self.skipped_steps = (optimizer.max_grad_norm,
                                                                       precision.skip_nonfinite, 0)
        self.num_microbatches = pipeline.num_microbatches
        self.ignore_index = ignore_index
        # context parallelism: the dp x cp ranks of a (pp, tp) coordinate hold the same parameters, each
        # computes the loss sums of its own tokens, and they reduce their gradients together
        self.cp = mesh.cp if mesh is not None else 1
        self.replica_group = mesh.replica_group if mesh is not None else None
        self.replicas = mesh.replicas if mesh is not None else 1
        self.tp_group = mesh.tp_group if mesh.tp > 1 else None
        # sequence parallelism (the reference GPT's): a stage's hidden states are sequence shards on every TP rank
        config = model if built_here else getattr(model, "config", None)
        builds_its_own = bool(getattr(config, "sequence_parallel", False))
        sequence_parallel = (builds_its_own or sequence_parallel) and self.tp_group is not None
        saved_inputs = SavedInputs.from_mode(pipeline.checkpoint_inputs, self.tp_group, sequence_parallel,
                                             "Parallel3D: checkpoint_inputs", checkpointed=bool(checkpoint),
                                             checkpoint=checkpoint)
        if built_here:
            # its weights are those of torch.manual_seed(seed); GPT(config) on one process, this rank's TP slice
            # (fp16/bf16 drawn in fp32 and rounded); the default generator stays where that leaves it
            # what a checkpoint must match: the config (a resumed run may change its fields that leave the
            # weights alone: universal_checkpoint.check_config)
            self.description = dataclasses.asdict(model) if dataclasses.is_dataclass(model) else None
            options = dict(seed=seed, tp_group=self.tp_group, cp_group=mesh.cp_group,
                           cp_method=cp_method, dtype=dtype)
            # built on meta first (its structure: which modules this rank's stages hold), then for real,
            # holding only those: a rank's memory is its own stages, never the whole model
            skeleton = model.build(device=torch.device("meta"), **options)
            keep = kept_modules(skeleton, recipe if recipe is not None else recipe_for(skeleton), mesh.pp_rank,
                                mesh.pp, num_chunks=num_chunks, boundaries=pipeline.boundaries,
                                block_costs=pipeline.block_costs, layout=layout_of(schedule))
            if device is not None and torch.device(device).type == "meta":
                model = skeleton          # the planner's probe: on meta the skeleton is this rank's model already
            else:
                del skeleton
                model = model.build(device=device, keep=keep.__contains__, **options)
        else:
            if device is not None or next(model.parameters()).dtype != dtype:
                model.to(device=device, dtype=dtype)
            # transformers' sparse MoE blocks become MoELayers before the recipe, its tp plan and the split see
            # the model, so ep shards their experts (_experts_over_mesh below)
            hf_moe_blocks = swap_hf_moe_blocks(model, ep=mesh.sizes.get("ep", 1))
            self.description = _describe(model)
        if self.description is None:
            self.description = _describe(model)
        self.config = getattr(model, "config", None)
        recipe = recipe if recipe is not None else recipe_for(model)
        if self.cp > 1 and getattr(model, "cp_size", 1) == 1:
            # a model whose attention does not take the cp group itself (the reference GPT's does)
            from ..context_parallel.hf import enable_context_parallel, with_context_parallel
            enable_context_parallel(model)
            recipe = with_context_parallel(recipe, mesh.cp_group, cp_method)
        if loss_fn is None and recipe.loss is not None:
            loss_fn = recipe.loss(model, ignore_index)
        self.moe_layers = _experts_over_mesh(model, mesh, pipeline.num_microbatches, sequence_parallel)
        # output_router_logits=True: transformers' loss over all layers' routers, reproduced (or refused)
        self.router_loss = None if built_here or not hf_moe_blocks else hf_router_loss(model, self.moe_layers)
        if sequence_parallel and not builds_its_own and self.moe_layers:
            raise ValueError(f"Parallel3D(sequence_parallel=True): {type(model).__name__} has Mixture-of-Experts "
                             f"blocks, not supported with sequence parallelism yet; use sequence_parallel=False")
        chunks, tied, duplicates, self.tied_group = _model_stages(
            model, mesh, self.tp_group, recipe=recipe, tp_plan=tp_plan, loss_fn=loss_fn, num_chunks=num_chunks,
            boundaries=pipeline.boundaries, block_costs=pipeline.block_costs, checkpoint=checkpoint,
            layout=layout_of(schedule), saved_inputs=saved_inputs, precision=precision,
            sequence_parallel=sequence_parallel and not builds_its_own, ignore_index=ignore_index)
        if self.router_loss is not None:
            self.router_loss.watch(chunks)
        if self.router_loss is not None and mesh.pp > 1:
            # the router sums carried stage to stage, on two groups of the pipeline ranks of their own
            layout = layout_of(schedule)
            self.router_loss.relay_over_pipeline(
                chunks, [stage_of(mesh.pp_rank, c, mesh.pp, num_chunks, layout) for c in range(len(chunks))],
                mesh.pp * num_chunks, lambda stage: place_of(stage, mesh.pp, num_chunks, layout),
                tuple(mesh.new_group_over(("pp",), f"router-loss {way}") for way in ("forward", "backward")),
                device if device is not None else torch.device("cpu"))
        # the FP8 layers' delayed-scaling states by name (this rank's chunks), saved with the training state
        self.fp8_named_states = {f"{i}.{name}": state for i, chunk in enumerate(chunks)
                                 for name, state in delayed_scaling_states(chunk)}
        self.fp8_states = list(self.fp8_named_states.values())
        if not built_here:
            # dropout draws from the default generator: the same stream on every rank, so tensor-parallel
            # ranks drop the same elements of the activations they hold replicated
            torch.manual_seed(seed)
        if pipeline.compile is not False:
            compile_blocks(chunks, {} if pipeline.compile is True else pipeline.compile)
        self.chunks: List[nn.Module] = chunks
        self.model = nn.ModuleList(self.chunks)
        self.duplicate_ids = frozenset(duplicates)
        self.mode = replica_mode(self.model, self.replica_group, tied, duplicates, self.tied_group,
                                 optimizer_config=optimizer, data_parallel=data_parallel, tp_group=self.tp_group,
                                 stream_grads=mesh.pp == 1 and len(self.chunks) == 1
                                 and (schedule == "1f1b" or pipeline.num_microbatches == 1),
                                 expert_group=mesh.expert_replica_group, ep=mesh.sizes.get("ep", 1))
        self.replica_check = ReplicaCheck.default() if replica_check == "default" else replica_check
        self.steps_taken = 0
        self.optimizer = self.mode.optimizer
        self.dp, self.z = getattr(self.mode, "dp", None), getattr(self.mode, "z", None)
        # fp16: the engine runs the last stage through _ScaledLossStage (same parameters, scaled backward)
        engine_chunks = [_ScaledLossStage(c, self.scaler) if (self.scaler is not None and c.is_last) else c
                         for c in self.chunks]
        self.engine = PipelineEngine(engine_chunks, mesh.pp_group, schedule=schedule,
                                     num_microbatches=pipeline.num_microbatches, device=device,
                                     ignore_index=ignore_index, autocast=precision.autocast)

    # ------------------------------------------------------------------ one step
    def local_batch(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This replica's slice (dim 0) of a global batch."""
        if t is None:
            return None
        # the rows split over the dimensions that split the batch (dp)
        dp, m, rank = self.mesh.batch_shards, self.num_microbatches, self.mesh.batch_rank
        if t.shape[0] % (dp * m):
            below, above = t.shape[0] // (dp * m) * dp * m, -(-t.shape[0] // (dp * m)) * dp * m
            dims = " x ".join(f"{n}={self.mesh.sizes[n]}" for n in self.mesh.batch_dims)
            raise ValueError(f"Parallel3D: a global batch of {t.shape[0]} rows does not split into {dims} replicas "
                             f"x num_microbatches={m} equal micro-batches; the global batch must be a multiple of "
                             f"{' x '.join(self.mesh.batch_dims)} x num_microbatches = {dp * m} (e.g. "
                             f"{f'{below} or {above}' if below else above}), or change num_microbatches")
        per = t.shape[0] // dp
        return t[rank * per:(rank + 1) * per]

    def _this_ranks_batch(self, inputs, targets, side):
        """This replica's rows of the global batch and, with cp > 1, this cp rank's tokens of them."""
        x, y = self.local_batch(inputs), self.local_batch(targets)
        side = {k: self.local_batch(v) for k, v in side.items()}
        if self.cp > 1:
            from ..context_parallel.batch import shard_batch
            x, y, side = shard_batch(x, y, side, self.cp, self.mesh.cp_rank)
        return x, y, side

    def _loss_denominator(self, targets: torch.Tensor) -> tuple:
        """``(N, N / (dp x cp))``: the counted labels of the global batch, and what each rank divides its loss
        sums by (the gradients are averaged over the dp x cp ranks that hold the same parameters, so
        ``N / (dp x cp)`` makes the average the gradient of the global mean)."""
        n = count_labels(targets, self.ignore_index)
        return n, n / self.replicas

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, **side) -> dict:
        """One optimizer step on the GLOBAL batch ``inputs``/``targets`` and side inputs (every rank passes
        the same ones; each takes its dp slice). Returns ``{"loss": the mean over the counted labels of the
        global batch (torch's number: nan when none counts), "grad_norm": ...}`` on every rank, plus
        ``skipped`` (fp16, or ``skip_nonfinite``) and ``loss_scale`` (fp16)."""
        mode = self.mode
        self._check_batch_shapes(inputs, targets, side)
        if self.router_loss is not None:
            check_padding(side, self.cp)
        step = self.steps_taken + 1
        checked = self.replica_check is not None and self.replica_check.due(step)
        if checked and self.replica_check.batch:
            check_same_batch(inputs, targets, side, self.mesh.dim_groups(), step, self._flag_device())
        x, y, side = self._this_ranks_batch(inputs, targets, side)
        counted, denominator = self._loss_denominator(targets)
        mode.begin_step()
        try:
            with mode.accumulating():
                loss = self.engine.step(x, y, loss_denominator=denominator, **side)
            if self.router_loss is not None:
                self.router_loss.finish_step()
        except BaseException:
            mode.abandon_step()
            raise
        mode.reduce()
        # the delayed FP8 scales for the next step: this step's amaxes, max over the replicas (whole global batch)
        commit_delayed(self.fp8_states, self.replica_group if self.replicas > 1 else None)
        if self.after_reduce is not None:
            self.after_reduce(self)
        found_inf = None
        if self.scaler is not None or self.skip_nonfinite:
            found_inf = torch.zeros(1, dtype=torch.float32, device=self._flag_device())
        scale = self.scaler.scale.clone() if self.scaler is not None else None   # the scale these grads carry
        norm, coef = self._norm(found_inf)
        if self.max_grad_norm is None:
            coef = None
        mode.step(clip_coef=coef, grad_scale=scale, found_inf=found_inf)
        out = {"loss": self._mean_over_dp(loss, counted), "grad_norm": None if norm is None else float(norm)}
        if found_inf is not None:
            out["skipped"] = bool(found_inf.item())     # same on every rank (agreed by the all-reduce)
            self.skipped_steps += out["skipped"]
        if self.scaler is not None:
            self.scaler.update(found_inf)
            out["loss_scale"] = float(self.scaler.scale.item())
        self.steps_taken = step
        if checked:
            self.check_replicas()
        return out

    # ------------------------------------------------------------------ the replica invariant

    def replica_groups(self) -> list:
        """``(what, group, [(name, tensor)])``: the tensors this rank holds that must be bit-identical on
        every rank of ``group``: parameters tp does not split (over tp), every parameter where ZeRO does
        not shard it (over the dp x cp replicas), the tied embedding's copies (over the first and last
        stage; under ZeRO-3 each copy's checksum is summed from its shards over dp, a collective there), the FP8
        layers' delayed-scaling histories and scales (over the replicas and over tp)."""
        names = {}
        for chunk in self.chunks:
            for n, p in chunk.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), chunk.dense_name(n))
        held = self.mode.held_tensors()
        groups = []
        if self.tp_group is not None:
            groups.append(("tp replicas", self.tp_group, [(names.get(id(p), "?"), t) for p, t, _ in held
                                                          if getattr(p, "partition_dim", None) is None]))
        experts = [(names.get(id(p), "?"), t) for p, t, _ in held if is_expert(p)]
        dense = [(names.get(id(p), "?"), t) for p, t, _ in held if not is_expert(p)]
        if self.replicas > 1 and self.mode.replicated_over_dp:
            groups.append(("data-parallel replicas", self.replica_group, dense))
        if experts and self.mesh.expert_replicas > 1 and self.mode.replicated_over_dp:
            groups.append(("expert replicas", self.mesh.expert_replica_group, experts))
        # FP8 delayed scaling: every rank holding a layer takes the same scaling decisions (the amaxes are
        # reduced over the tensor's shards and the replicas), so the histories and scales are bit-identical
        fp8 = [(f"{key}.{what}", t.reshape(-1)) for key, state in self._fp8_dense_states()
               for what, t in (("amax_history", state.amax_history), ("scale", state.scale))]
        if fp8 and self.replicas > 1:
            groups.append(("FP8 scaling states over the replicas", self.replica_group, fp8))
        if fp8 and self.tp_group is not None:
            groups.append(("FP8 scaling states over tp", self.tp_group, fp8))
        if self.tied_group is not None:
            tied = []
            for p in self.mode.tied:
                if self.mode.replicated_over_dp:
                    tied.append((names.get(id(p), "?"), p))
                else:     # ZeRO-3: the stages' shards lie at other offsets; their checksums add up over dp
                    pieces = [(t, offset) for q, t, offset in held if q is p]
                    tied.append((names.get(id(p), "?"),
                                 Summed(sharded_checksum(pieces, self.replica_group, self._flag_device()))))
            groups.append(("tied weights of the first and last stage", self.tied_group, tied))
        return groups

    def check_replicas(self) -> None:
        """Raise :class:`~parallel_layers.composition.replica_check.ReplicaDivergence` on every rank when a
        replicated tensor (:meth:`replica_groups`) differs between the ranks that hold it. A collective over
        the whole mesh; :meth:`train_step` calls it on the steps ``replica_check`` names."""
        check_tensors(self.replica_groups(), self.mesh.dim_groups(), self.steps_taken, self._flag_device())

    def _check_batch_shapes(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor],
                            side: dict) -> None:
        """Targets and side inputs that do not line up with the inputs, refused before the step (the last
        stage's loss would otherwise meet them mid-schedule)."""
        if not torch.is_tensor(inputs) or not torch.is_tensor(targets):
            return              # a rank whose stages read no token ids may pass None (freeze training does)
        n = 2 if inputs.dim() >= 2 and targets.dim() >= 2 else 1      # rows, and tokens where both have them
        if tuple(targets.shape[:n]) != tuple(inputs.shape[:n]):
            raise ValueError(f"Parallel3D.train_step: targets of shape {tuple(targets.shape)} do not match the "
                             f"inputs of shape {tuple(inputs.shape)}: the labels need one row per sequence"
                             + (" and one label per token (shifted labels keep the input's length: pad the "
                                "last position with the ignore_index)" if n == 2 else ""))
        for k, v in side.items():
            if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] != inputs.shape[0]:
                raise ValueError(f"Parallel3D.train_step: side input {k!r} has {v.shape[0]} rows, the inputs "
                                 f"{inputs.shape[0]}: every rank passes the whole global batch of each")

    @property
    def grad_device(self) -> torch.device:
        """Where the gradients and the step's flags live (the loss scale's device under fp16)."""
        return self._flag_device()

    def _flag_device(self) -> torch.device:
        if self.scaler is not None:
            return self.scaler.scale.device
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, **side) -> float:
        """The mean loss over the GLOBAL batch (every rank passes the same one; each takes its dp slice),
        forward only: the pipeline's forward-only schedule (eval mode, no dropout, no gradients); with
        ZeRO-3 the parameters are gathered once for it and resharded after. Gradients, optimizer state,
        the loss scale and the last training step's timeline are left as they were. The same float on
        every rank."""
        x, y, side = self._this_ranks_batch(inputs, targets, side)
        counted, denominator = self._loss_denominator(targets)
        with self.mode.forward_only(), pending_kept(self.fp8_states):   # the FP8 scaling state left alone
            loss = self.engine.evaluate(x, y, loss_denominator=denominator, **side)
        return self._mean_over_dp(loss, counted)

    def _mean_over_dp(self, loss: torch.Tensor, counted: int) -> float:
        """The ranks' losses (each its loss sums / (N / (dp x cp))) averaged over the dp x cp ranks in
        float64: the global batch's mean, on every rank (nan when no label counts, as torch gives)."""
        loss = loss.detach().to(torch.float64).reshape(1)
        if self.replicas > 1:
            C.all_reduce(loss, self.replica_group)
            loss /= self.replicas
        return loss.item() if counted else math.nan

    def _norm(self, found_inf: Optional[torch.Tensor] = None):
        """``(norm, coef)`` of the global gradient norm. With ``found_inf``: set to 1 on every rank when any
        rank's gradients hold inf/nan (fp16: the norm is that of the unscaled gradients)."""
        if self.max_grad_norm is None and found_inf is None:
            return None, None
        max_norm = math.inf if self.max_grad_norm is None else self.max_grad_norm
        kw = {} if found_inf is None else {"found_inf": found_inf}
        if self.scaler is not None:
            kw["inv_scale"] = self.scaler.inv_scale
        groups = [self.mesh.pp_group] if self.mesh.pp > 1 else []
        pieces = self.mode.norm_pieces()
        if self.mesh.sizes.get("ep", 1) > 1:
            # the experts differ over ep: every piece is summed over all the replicas, each replicated one
            # counted on one rank of the ranks that hold it
            if not self.mode.shards_grads:
                m = self.mesh
                pieces = [p for p in pieces if (m.expert_replica_rank if is_expert(p)
                                                else m.replica_rank) == 0]
            groups = [self.replica_group] + groups
        elif self.mode.shards_grads and self.replicas > 1:
            groups = [self.replica_group] + groups
        return clip_grad_norm_(pieces, max_norm, groups=groups, tp_group=self.tp_group, apply=False, **kw)

    # ------------------------------------------------------------------ checkpoints (resume)
    def _rng_tracker(self):
        return getattr(self.chunks[0], "rng_tracker", None)

    def state_dict(self) -> dict:
        """This rank's part of the training state, to resume from: its stages' parameters (its shard
        under ZeRO-3), its optimizer state (its shard under ZeRO), the loss scaler, the random states
        dropout draws from (default generator and the TP tracker's streams), the FP8 layers' delayed-scaling
        histories, and the layout they belong to. Every rank saves its own (``torch.save``, one file per rank,
        as Megatron-LM and DeepSpeed do) and loads it back on the same mesh with :meth:`load_state_dict`;
        training then continues bit for bit. To resume on another mesh (or in a single process), save a
        universal checkpoint instead (:func:`parallel_layers.composition.universal_checkpoint.save_universal`)."""
        tracker = self._rng_tracker()
        return {"layout": self._checkpoint_layout(), "model": self.mode.model_state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict(),
                "skipped_steps": self.skipped_steps,
                "fp8": {name: state.state_dict() for name, state in self.fp8_named_states.items()},
                "rng": {"default": torch.get_rng_state(),
                        "tracker": None if tracker is None else tracker.get_states()}}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` saved on this same rank of a run with the same mesh, ZeRO stage,
        schedule layout, model and dtype (a collective over dp with ZeRO 1/2 when the gradient bucket
        layout has changed since: call it on every rank). A checkpoint of another rank or run is a
        ``ValueError`` naming what differs, before anything is loaded."""
        mine, saved = self._checkpoint_layout(), state.get("layout") or {}
        differ = [k for k in mine if saved.get(k) != mine[k]]
        if differ:
            raise ValueError("Parallel3D.load_state_dict: the checkpoint does not belong to this rank of this "
                             "run; " + "; ".join(f"{k}: saved {saved.get(k)}, here {mine[k]}" for k in differ)
                             + ". Load each rank's own file on the same mesh and settings (to change the "
                             "layout, save with parallel_layers.composition.universal_checkpoint.save_universal and "
                             "load_universal)")
        fp8 = state.get("fp8") or {}
        if set(fp8) != set(self.fp8_named_states):
            raise ValueError(f"Parallel3D.load_state_dict: the checkpoint's FP8 scaling states "
                             f"({len(fp8)}) do not match this run's delayed-scaling layers "
                             f"({len(self.fp8_named_states)}): save and resume with the same PrecisionConfig(fp8=...)")
        self.mode.load_model_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps = state.get("skipped_steps", 0)
        for name, st in fp8.items():
            self.fp8_named_states[name].load_state_dict(st)
        torch.set_rng_state(state["rng"]["default"])
        tracker = self._rng_tracker()
        if tracker is not None:
            tracker.set_states(state["rng"]["tracker"])

    def fp8_scaling_state(self) -> dict:
        """The FP8 layers' delayed-scaling states of this rank's stages under the whole model's module names
        (``<layer>.fp8.<input|weight|grad>``), as plain numbers: the same on every rank that holds a layer,
        whatever the layout (what a universal checkpoint keeps)."""
        return {key: {"amax_history": state.amax_history.tolist(), "scale": state.scale.item(),
                      "pending_amax": state.pending_amax.item(), "has_history": state.has_history}
                for key, state in self._fp8_dense_states()}

    def _fp8_dense_states(self):
        """``(<layer's name in the whole model>.fp8.<role>, DelayedScaling)`` of this rank's FP8 layers."""
        for chunk in self.chunks:
            for name, state in delayed_scaling_states(chunk):
                layer, _, role = name.rpartition(".fp8.")
                yield f"{chunk.dense_name(f'{layer}.weight')[:-len('.weight')]}.fp8.{role}", state

    def load_fp8_scaling_state(self, saved: dict) -> List[str]:
        """Load what :meth:`fp8_scaling_state` returned (on any layout) into this rank's FP8 layers; returns the
        names of those the saved state has no entry for (they start afresh: their first step scales from its
        own amaxes). A history of another length is a ``ValueError`` naming the layer and the fix."""
        fresh = []
        for key, state in self._fp8_dense_states():
            if key not in saved:
                fresh.append(key)
                continue
            st = saved[key]
            if len(st["amax_history"]) != state.amax_history.numel():
                raise ValueError(f"Parallel3D: the saved FP8 state of {key} holds a history of "
                                 f"{len(st['amax_history'])} amaxes, this run's recipe {state.amax_history.numel()}; "
                                 f"resume with FP8Recipe(history_len={len(st['amax_history'])})")
            as_tensor = partial(torch.tensor, dtype=torch.float32, device=state.amax_history.device)
            state.load_state_dict({"amax_history": as_tensor(st["amax_history"]), "scale": as_tensor(st["scale"]),
                                   "pending_amax": as_tensor(st["pending_amax"]), "has_history": st["has_history"]})
        return fresh

    def random_state(self) -> dict:
        """Every random stream this rank's dropout draws from: the default CPU generator, the current CUDA
        device's (where CUDA is initialised) and the TP tracker's streams (copies)."""
        tracker = self._rng_tracker()
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return {"default": torch.get_rng_state(), "cuda": cuda,
                "tracker": None if tracker is None else tracker.get_states()}

    def load_random_state(self, state: dict) -> None:
        """Restore what :meth:`random_state` returned on this rank of the same layout."""
        torch.set_rng_state(state["default"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        tracker = self._rng_tracker()
        if tracker is not None and state.get("tracker") is not None:
            tracker.set_states(state["tracker"])

    def _checkpoint_layout(self) -> dict:
        m, e = self.mesh, self.engine
        return {"mesh": dict(m.sizes), "rank": dict(m.coordinates), "zero": self.zero,
                "schedule chunks": e.num_chunks, "dtype": str(self.dtype), "config": self.description}

    # ------------------------------------------------------------------ inspection
    def dense_state_dict(self) -> dict:
        """The parameters of this rank's stages under the whole model's names (the full ``GPT``'s, or the
        module's own), in the dense layout, gathered over TP (a collective over the tp group; with ZeRO-3
        also over dp)."""
        with self.mode.full_parameters():
            return self._dense_state_dict()

    def memory_report(self) -> Optional[dict]:
        """The optimizer's per-rank memory report (ZeRO only: shards of parameters, gradients, states)."""
        rep = getattr(self.optimizer, "memory_report", None)
        return rep() if rep is not None else None

    def _dense_state_dict(self) -> dict:
        from ..tensor_parallel.parallelize import gather_partition, tp_partitions
        out = {}
        ep_group = self.mesh.group("ep") if "ep" in self.mesh.sizes else None
        for chunk in self.chunks:
            parts = tp_partitions(chunk)
            for n, t in chunk.state_dict(keep_vars=True).items():
                if ep_group is not None and is_expert(t):
                    t = C.all_gather_dim0(t.detach().contiguous(), ep_group)     # every expert, in order
                    out[chunk.dense_name(n)] = chunk.dense_tensor(n, t)
                    continue
                t = gather_partition(t.detach(), *parts[n]) if n in parts else t.detach().clone()
                out[chunk.dense_name(n)] = chunk.dense_tensor(n, t)
        return out

    def timeline_png(self, path: str, title: Optional[str] = None) -> Optional[str]:
        """Gathers the last step's timeline over the pp group (a collective on every rank) and writes the
        PNG on global rank 0; returns the path there, None elsewhere."""
        tls = self.engine.gather_timeline()
        if dist.get_rank() != 0 or tls is None:
            return None
        e = self.engine
        return draw(tls, path, title or f"{e.schedule}: p={e.pp_size}, m={e.num_microbatches}, chunks={e.num_chunks} "
                                        f"(dp={self.mesh.dp}, tp={self.mesh.tp})")

    def bubble_fraction(self) -> Optional[float]:
        return self.engine.bubble_fraction()


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by the loss scale (the scale is read in
    backward, on the device: no host sync)."""

    @staticmethod
    def forward(ctx, loss, scale):
        ctx.save_for_backward(scale)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        (scale,) = ctx.saved_tensors
        return grad * scale.reshape(()).to(grad.dtype), None


class _ScaledLossStage(nn.Module):
    """The engine's view of the last stage of an fp16 model: the loss in fp32 from the stage's logits, its
    backward scaled by ``scaler.scale``. The value handed back (fp32, a mean or ``(sum, count)``) is the
    *unscaled* loss; the backward into it carries ``scale / D`` in fp32 and the fp16 logits receive
    ``scale * dloss/dlogits`` (what ``scaler.scale_loss(loss)`` would give, without fp16's 65504 cap on
    ``scale / D`` itself)."""

    def __init__(self, stage: nn.Module, scaler: DynamicLossScaler):
        super().__init__()
        self.stage, self.scaler = stage, scaler

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None, **side):
        if targets is None:
            return self.stage(x, **side)
        # the loss takes the head's vocabulary shards where it keeps them (tensor_parallel.loss_parallel)
        keep = {"whole_logits": False} if getattr(self.stage, "logits_group", None) is not None else {}
        shard = self.stage(x, **keep, **side)
        self.scaler.on_device(shard.device)
        loss = self.stage.loss(shard.float(), targets)
        if isinstance(loss, (tuple, list)):          # (sum, count): the sum's backward is scaled
            return _ScaleGrad.apply(loss[0], self.scaler.scale), loss[1]
        return _ScaleGrad.apply(loss, self.scaler.scale)

    def finish_grads(self) -> None:
        if hasattr(self.stage, "finish_grads"):
            self.stage.finish_grads()


__all__ = ["Parallel3D"]
