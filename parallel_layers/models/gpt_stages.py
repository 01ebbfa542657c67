"""The reference GPT built directly as pipeline stages (:func:`build_gpt_stages`, :class:`GPTStage`).

A lower-level builder, kept for the pipeline tests and benchmarks that drive a ``PipelineEngine`` by hand:
``Parallel3D`` does not use it (a ``GPTConfig`` there is built by ``GPTConfig.build`` holding only the rank's
modules and cut by its recipe, :mod:`parallel_layers.families.gpt`, like any other model).

Every rank walks the *full* construction order of :class:`~parallel_layers.models.gpt.GPT` (``wte, wpe,
blocks..., ln_f, lm_head``), constructing each module from the default generator, and keeps only the modules
its stages own; a module it does not own is dropped as soon as it is built. Why not the meta device: weights
are drawn from one generator stream in construction order, and the only exact way to advance that stream past
a module is to draw its numbers (the CPU generator's consumption depends on the sampling kernel's
vectorisation). So ``torch.manual_seed(s); build_gpt_stages(...)`` holds exactly the slices of
``torch.manual_seed(s); GPT(cfg)`` at any pipeline size, and a rank's peak memory is its own layers plus the
single largest module it does not own (one block or the embedding), never the whole model.

The stage split itself (layer ranges, stage ids, tied-weight groups) is the pipeline's:
:mod:`parallel_layers.pipeline.stage`.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from ..activations.recompute import checkpoint_placement, run_blocks
from ..pipeline.stage import partition_layers, stage_ids, start_tied_equal, sum_tied_grads
from .gpt import GPT, Block, GPTConfig, ParallelContext, draw_dtype, resolve_tp_group, round_to, untied_head


class GPTStage(nn.Module):
    """One pipeline stage of the reference GPT: embeddings on stage 0, blocks ``layer_range``, final
    LayerNorm + LM head + loss on the last stage. ``forward(x, targets=None)``: token ids (first stage)
    or hidden states in; hidden states out, or on the last stage the logits shard (no targets) or the
    loss as ``(sum, count)`` over the targets that are not -100 (see ``pipeline.token_loss``). Built by
    :func:`build_gpt_stages` (which makes the weights equal the full GPT's).
    ``checkpoint``: see :func:`~parallel_layers.activations.recompute.checkpointed_block_count`; in
    training mode only (eval keeps nothing for backward anyway)."""

    # The pieces are GPT's own, so a stage computes exactly what the full model does.
    embed = GPT.embed
    head = GPT.head

    def loss(self, logits_shard: torch.Tensor, targets: torch.Tensor):
        """``(sum of the token cross entropies, count)`` over the targets that are not -100, in fp32 (a sum of
        thousands of bf16 terms would keep 3 significant digits)."""
        logits_shard = logits_shard.to(torch.promote_types(logits_shard.dtype, torch.float32))
        return GPT.loss(self, logits_shard, targets, reduction="sum"), (targets != -100).sum()

    def __init__(self, config: GPTConfig, stage_index: int, num_stages: int, layer_range: Tuple[int, int],
                 tp: ParallelContext, modules: dict, *, checkpoint: Union[bool, int] = False, tied_group=None,
                 saved_inputs=None, sums_sequence_parallel_grads: bool = True):
        super().__init__()
        self.config, self.stage_index, self.num_stages = config, stage_index, num_stages
        self.layer_range = tuple(layer_range)
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self._tp, self.tp_group, self.tp_size, self.tp_rank = tp, tp.group, tp.size, tp.rank
        self.tied_group = tied_group
        self.sums_sequence_parallel_grads = sums_sequence_parallel_grads
        if self.is_first or (self.is_last and config.tie_embeddings):
            self.wte = modules["wte"]
        if self.is_first:
            self.wpe = modules["wpe"]
        self.blocks = nn.ModuleList(modules["blocks"][i] for i in range(*self.layer_range))
        if self.is_last:
            self.ln_f = modules["ln_f"]
            self.lm_head = modules["lm_head"]
        self.checkpoint = checkpoint
        self.checkpointing = checkpoint_placement(checkpoint, len(self.blocks), "GPTStage")
        self.checkpoint_blocks = self.checkpointing.static_count
        # how a checkpointed block keeps its input (activations.partitioned_checkpoint)
        self.saved_inputs = saved_inputs

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.embed(x) if self.is_first else x
        h = run_blocks(self.blocks, h, self.checkpointing if self.training else 0, self._tp.rng, self.saved_inputs)
        if not self.is_last:
            return h
        shard = self.head(h)
        return shard if targets is None else self.loss(shard, targets)

    @property
    def rng_tracker(self):
        """The tensor-parallel dropout streams (``tensor_parallel_rng_tracker``), None without TP."""
        return self._tp.rng

    def dense_name(self, name: str) -> str:
        """This stage's parameter name -> the full ``GPT``'s (``blocks.i`` renumbered)."""
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            return f"blocks.{int(i) + self.layer_range[0]}.{rest}"
        return name

    def dense_tensor(self, name: str, gathered: torch.Tensor) -> torch.Tensor:
        """A parameter gathered over TP -> the full ``GPT``'s tensor (the untied head's vocabulary padding
        dropped)."""
        if name.startswith("lm_head.") and gathered.shape[0] > self.config.vocab_size:
            return gathered[:self.config.vocab_size]
        return gathered

    def local_tensor(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """The inverse layout change before a dense tensor is cut into TP shards: none for the GPT."""
        return dense

    def finish_grads(self) -> None:
        """After backward: sequence-parallel partial grads over TP, tied embedding grads over the
        first/last stage group."""
        if self._tp.sp and self.sums_sequence_parallel_grads:
            from ..tensor_parallel.layers import allreduce_sequence_parallel_grads
            allreduce_sequence_parallel_grads(self, self.tp_group)
        if self.tied_group is not None and hasattr(self, "wte") and self.config.tie_embeddings:
            sum_tied_grads([self.wte.weight], self.tied_group)


def build_gpt_stages(config: GPTConfig, pp_rank: int, pp_size: int, *, num_chunks: int = 1,
                     boundaries: Optional[Sequence[int]] = None, require_divisible: bool = False,
                     tp_group=None, tied_group=None, checkpoint: Union[bool, int] = False, dtype=None,
                     device=None, cp_group=None, cp_method: str = "ring", layout: str = "loop",
                     saved_inputs=None, sums_sequence_parallel_grads: bool = True) -> List[GPTStage]:
    """The stages (one per chunk) that pipeline rank ``pp_rank`` of ``pp_size`` owns, with the weights
    of ``GPT(config)`` built from the same seed (see the module docstring). ``boundaries``: explicit
    layer split points across all ``pp_size * num_chunks`` stages; ``tied_group``: from
    :func:`tied_embedding_group` when ``config.tie_embeddings`` and ``pp_size > 1``; ``checkpoint``:
    activation checkpointing of every block (True), of the first ``n`` blocks of each stage (an int), or a
    placement policy per stage (``"sqrt"``, ``MemoryBudget``: :mod:`~parallel_layers.activations.checkpoint_policy`),
    see :func:`~parallel_layers.activations.recompute.checkpointed_block_count`; ``cp_group``: context
    parallelism (every sequence's zigzag shard on this rank, ``cp_method`` ring or Ulysses); ``layout``:
    ``"v"`` for the ZBV schedule (see :func:`stage_ids`; the first and last stage are then both on rank 0,
    which shares one embedding between them: no ``tied_group``); ``saved_inputs``: how a checkpointed block
    keeps its input until backward (a :class:`~parallel_layers.activations.partitioned_checkpoint.SavedInputs`:
    a 1/tp slice, in host memory; None: whole); ``sums_sequence_parallel_grads=False``: the caller sums the
    sequence-parallel parameters' gradients over tp itself (``Parallel3D`` does, on its fp32 gradient
    buffers: a bf16 model's ``p.grad`` is not where they are)."""
    checkpoint_placement(checkpoint, 0, "build_gpt_stages")   # a bad value fails before anything is built
    S = pp_size * num_chunks
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"build_gpt_stages: pp_rank={pp_rank} outside 0..{pp_size - 1}")
    ranges = partition_layers(config.n_layer, S, boundaries, require_divisible)
    if boundaries is None and config.n_layer < S:
        # a stage without blocks holds no parameters (its data-parallel wrapper has nothing to reduce)
        # and only relays activations: refuse it here, on every rank alike, before any communication
        raise ValueError(f"build_gpt_stages: {config.n_layer} blocks (n_layer) cannot fill {S} pipeline stages "
                         f"(pipeline size {pp_size} x {num_chunks} chunk(s)); every stage needs a block: use "
                         f"n_layer >= {S}, a smaller pipeline size or fewer chunks, or pass explicit boundaries")
    mine = stage_ids(pp_rank, pp_size, num_chunks, layout)
    owned_layers = {i for s in mine for i in range(*ranges[s])}
    has_first, has_last = 0 in mine, S - 1 in mine
    group = resolve_tp_group(tp_group)
    tp = ParallelContext(group, config, draw_dtype(dtype), device)
    tp.context_parallel(cp_group, cp_method, config.dropout)
    for name, size in (("n_head", config.n_head), ("d_ff", config.d_ff)):
        if size % tp.size:
            raise ValueError(f"build_gpt_stages: {name}={size} does not divide by the tensor-parallel size {tp.size}")
    d, V = config.d_model, config.vocab_size
    # Same construction order as GPT.__init__ (it fixes which random numbers each weight gets).
    if group is None:
        wte = nn.Embedding(V, d, **tp.factory)
    else:
        from ..tensor_parallel.embedding import VocabParallelEmbedding
        wte = VocabParallelEmbedding(V, d, tp_group=group, sequence_parallel=tp.sp, **tp.factory)
    keep_wte = has_first or (has_last and config.tie_embeddings)
    if not keep_wte:
        wte = None
    wpe = nn.Embedding(config.max_seq_len, d, **tp.factory)
    wpe.weight.sequence_parallel = tp.sp
    if not has_first:
        wpe = None
    blocks = {}
    for i in range(config.n_layer):
        block = Block(config, tp)            # built (drawing its numbers) even when not ours ...
        if i in owned_layers:
            blocks[i] = block
        del block                            # ... and freed at once when not
    ln_f = tp.layer_norm(d, config.layer_norm_eps) if has_last else None
    lm_head = None
    if not config.tie_embeddings:
        lm_head = untied_head(config, tp)
        if not has_last:
            lm_head = None
    with torch.no_grad():
        if wte is not None:
            wte.weight.mul_(config.init_std)
        if wpe is not None:
            wpe.weight.mul_(config.init_std)
    round_to([wte, wpe, ln_f, lm_head, *blocks.values()], dtype)
    tp.factory["dtype"] = dtype
    modules = {"wte": wte, "wpe": wpe, "blocks": blocks, "ln_f": ln_f, "lm_head": lm_head}
    if has_first and has_last:
        tied_group = None                    # one rank holds both ends: they share the module
    if tied_group is not None and config.tie_embeddings:
        start_tied_equal([wte.weight], tied_group)
    return [GPTStage(config, s, S, ranges[s], tp, modules, checkpoint=checkpoint,
                     tied_group=tied_group if (s in (0, S - 1)) else None, saved_inputs=saved_inputs,
                     sums_sequence_parallel_grads=sums_sequence_parallel_grads) for s in mine]


__all__ = ["GPTStage", "build_gpt_stages"]
