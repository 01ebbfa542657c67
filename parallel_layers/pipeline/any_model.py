"""Pipeline stages cut from a model you did not write (Hugging Face included), without rewriting it.

:func:`split_model` keeps this rank's stages of the model, as described by its :class:`~.recipes.Recipe`
(which blocks, which embedding and head, what the blocks need besides the hidden states), and drops the
rest (their parameters are freed): ``stages = split_model(model, recipe_for(model), pp_rank, pp_size,
loss_fn=...)``, then ``PipelineEngine(stages, pp_group, ...)``. The user's ``loss_fn(logits, targets)``
runs on the last stage. Weights tied between the first and last stage (``lm_head.weight is
embed_tokens.weight``) stay tied: both ranks hold the parameter, it starts as the first stage's
(broadcast) and its gradients are summed over the two (``finish_grads``), as Megatron-LM does for its
word embeddings.

Stage boundaries: balanced by block count (default), by parameter count (``boundaries="parameters"``:
the embedding counts on the first stage and the head on the last), by a cost per block you measured
(``block_costs=[...]``), or given (``boundaries=[4, 8, 12]``). Balancing minimises the most expensive
stage (an exact linear partition, not a greedy cut).
"""
from __future__ import annotations

import inspect
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from ..activations.recompute import checkpoint_placement, run_blocks
from ..distributed import collectives as C
from ..families import Recipe, get_module
from ..tensor_parallel.dense_layouts import from_dense, to_dense
from ..tensor_parallel.layers import check_sequence_input
from ..tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
)
from .stage import partition_layers, stage_ids, start_tied_equal, sum_tied_grads

_get = get_module


def _set(model: nn.Module, dotted: str, value) -> None:
    parent, _, attr = dotted.rpartition(".")
    setattr(_get(model, parent) if parent else model, attr, value)


class ModelStage(nn.Module):
    """One pipeline stage of a model cut by :func:`split_model`: ``stage(x, targets=None, **side)``.

    ``checkpoint``: activation checkpointing of every block (True), of the first ``n`` (an int) or by a
    placement policy (``"sqrt"``, ``MemoryBudget``: :mod:`~parallel_layers.activations.checkpoint_policy`), in
    training mode; the recomputation replays the forward's dropout masks (default generator restored).
    ``sequence_parallel_group``: the blocks run sequence-parallel over this tp group (their hidden states split
    along the sequence after the first stage's context is built, passed between stages as shards, gathered
    before the head:
    :mod:`parallel_layers.tensor_parallel.sequence_parallel`). ``logits_group``: the head's logits are vocabulary
    shards over this group (:mod:`parallel_layers.tensor_parallel.loss_parallel`): the loss takes them so, logits
    handed back are gathered unless ``whole_logits=False``. ``dense_name(name)``: a parameter's name here ->
    its name in the whole model."""

    def __init__(self, model: nn.Module, recipe: Recipe, blocks: List[nn.Module], is_first: bool, is_last: bool,
                 loss_fn: Optional[Callable], tied_group=None, *, dense_names: Optional[Dict[int, str]] = None,
                 checkpoint: Union[bool, int] = False, sums_tied_grads: bool = True, saved_inputs=None,
                 sequence_parallel_group=None, logits_group=None):
        super().__init__()
        self.sequence_parallel_group = sequence_parallel_group
        self.logits_group = logits_group
        self._model = [model]              # in a list: not a submodule, its dropped parts stay out of parameters()
        self.recipe, self.is_first, self.is_last, self.loss_fn = recipe, is_first, is_last, loss_fn
        kept = list(recipe.shared) + (list(recipe.first) if is_first else []) + (list(recipe.last) if is_last else [])
        kept = [name for i, name in enumerate(kept) if name not in kept[:i] and _get(model, name) is not None]
        # registered in the model's order (embeddings, blocks, head), so the parameters (and the flat buffers
        # and ZeRO shards built from them) come as the whole model has them
        before = [name for name in kept if name in recipe.shared or (is_first and name in recipe.first)]
        self.parts = nn.ModuleDict({name.replace(".", "__"): _get(model, name) for name in before})
        self.blocks = nn.ModuleList(blocks)
        self.last_parts = nn.ModuleDict({name.replace(".", "__"): _get(model, name) for name in kept
                                         if name not in before})
        self.tied_group = tied_group
        self.tied: List[nn.Parameter] = []
        self.sums_tied_grads = sums_tied_grads
        self.checkpointing = checkpoint_placement(checkpoint, len(blocks), "split_model")
        self.checkpoint_blocks = self.checkpointing.static_count
        # how a checkpointed block keeps its input (activations.partitioned_checkpoint)
        self.saved_inputs = saved_inputs
        ids = dense_names or {}
        self._dense = {n: ids[id(p)] for n, p in self.named_parameters(remove_duplicate=False) if id(p) in ids}
        self._side_ok: set = set()          # side-input names already checked against the recipe

    def _check_side(self, model, x, side) -> None:
        """The side inputs must be ones the recipe's embed/context take (checked against their signatures,
        once per set of names: a TypeError raised inside them is theirs, not a wrong side input)."""
        names = frozenset(side)
        if names in self._side_ok:
            return
        for fn in ((self.recipe.embed,) if self.is_first else ()) + (self.recipe.context,):
            try:
                inspect.signature(fn).bind(model, x, **side)
            except TypeError as exc:
                raise TypeError(f"ModelStage: the recipe of {type(model).__name__} does not take the side inputs "
                                f"{sorted(side)} ({exc}); pass only what its embed/context functions accept, or "
                                f"write a Recipe whose context carries them to the blocks") from exc
        self._side_ok.add(names)

    def forward(self, x, targets=None, *, whole_logits: bool = True, **side):
        model = self._model[0]
        # the model is not a submodule (its dropped parts stay out): its own flag follows the stage's, for the
        # methods the recipe calls on it (the reference GPT's embedding dropout reads model.training)
        model.training = self.training
        self._check_side(model, x, side)
        h = self.recipe.embed(model, x, **side) if self.is_first else x
        group = self.sequence_parallel_group
        # sequence parallel: the stages pass each other their tp rank's sequence shard, so a later stage builds
        # its context (masks, rotary tables: shaped from the whole sequence) from a stand-in of the whole's shape
        whole = h if group is None or self.is_first else self._whole_sequence(h, group)
        ctx = self.recipe.context(model, whole, **side)
        fns = [lambda t, block=block: self.recipe.block(block, t, ctx) for block in self.blocks]
        if group is not None and self.is_first:
            h = self._split_sequence(h, group)
        h = run_blocks(fns, h, self.checkpointing if self.training else 0, self.rng_tracker, self.saved_inputs)
        if not self.is_last:
            return h
        if group is not None:
            # the head sees every token; each tp rank's gradient of the whole is the same
            h = gather_from_sequence_parallel_region(h, group, dim=1, tensor_parallel_output_grad=False)
        logits = self.recipe.head(model, h)
        if targets is not None and self.loss_fn is not None:
            return self.loss_fn(logits, targets)
        if self.logits_group is not None and whole_logits:
            # the head keeps its vocabulary shard for the loss (tensor_parallel.loss_parallel); a caller gets them whole
            logits = gather_from_tensor_parallel_region(logits, self.logits_group)
        return logits

    @staticmethod
    def _whole_sequence(shard: torch.Tensor, group) -> torch.Tensor:
        """A tensor of the whole sequence's shape, dtype and device over ``shard``'s first token (a view: the
        context reads shapes, not values)."""
        size = list(shard.shape)
        size[1] *= C.world_size(group)
        return shard[:, :1].expand(size)

    def _split_sequence(self, h: torch.Tensor, group) -> torch.Tensor:
        check_sequence_input("ModelStage (sequence parallel)", h, C.world_size(group), "the hidden states' tokens")
        return scatter_to_sequence_parallel_region(h, group, dim=1)

    @property
    def rng_tracker(self):
        """The model's tensor-parallel dropout streams (its ``rng_tracker``: the reference GPT's), replayed by a
        checkpointed block's recomputation; None for a model without them."""
        return getattr(self._model[0], "rng_tracker", None)

    def dense_name(self, name: str) -> str:
        """This stage's parameter name -> the whole model's (as ``model.named_parameters()`` had it)."""
        return self._dense.get(name, name)

    def _owner(self, name: str):
        module_name, _, pname = name.rpartition(".")
        return self.get_submodule(module_name) if module_name else self, pname

    def dense_tensor(self, name: str, gathered: torch.Tensor) -> torch.Tensor:
        """A parameter gathered over TP -> the dense model's layout (``Conv1D`` transposed back, fused
        sections un-permuted: see ``tensor_parallel.dense_layouts``)."""
        return to_dense(*self._owner(name), gathered)

    def local_tensor(self, name: str, dense: torch.Tensor) -> torch.Tensor:
        """The dense model's tensor -> the parallel layer's layout, before it is cut into TP shards."""
        return from_dense(*self._owner(name), dense)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The user's loss (the last stage's): ``Parallel3D`` calls it on fp32 logits under fp16."""
        return self.loss_fn(logits, targets)

    def finish_grads(self) -> None:
        """After backward: the tied weights' gradients summed over the first and last stage (unless the
        caller sums them itself: ``Parallel3D`` does, on its gradient buffers)."""
        if self.sums_tied_grads:
            sum_tied_grads(self.tied, self.tied_group)


def _tied_between(model: nn.Module, recipe: Recipe) -> List[nn.Parameter]:
    """Parameters held both by a first-stage part and a last-stage part (tied embeddings)."""
    def params(names):
        return {id(p): p for n in names if _get(model, n) is not None for p in _get(model, n).parameters()}
    first, last = params(recipe.first), params(recipe.last)
    return [first[i] for i in first if i in last]


def _numel(modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def balanced_boundaries(costs: Sequence[float], num_stages: int, first_extra: float = 0.0,
                        last_extra: float = 0.0) -> List[int]:
    """Split points of ``costs`` (one per block, in order) into ``num_stages`` non-empty contiguous stages
    minimising the most expensive stage; ``first_extra``/``last_extra`` are added to the first and last
    stage (embedding, head). Exact: a dynamic programme over (blocks, stages)."""
    n = len(costs)
    if n < num_stages:
        raise ValueError(f"balanced_boundaries: {n} blocks cannot fill {num_stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(i, j, s):          # blocks [i, j) as stage s
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == num_stages - 1 else 0.0)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n - (num_stages - s) + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], cost(i, j, s - 1))
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    edges, j = [], n
    for s in range(num_stages, 0, -1):
        edges.append(j)
        j = cut[s][j]
    return sorted(edges)[:-1]


def _boundaries(model: nn.Module, recipe: Recipe, blocks: nn.ModuleList, S: int, boundaries, block_costs):
    if block_costs is not None:
        if len(block_costs) != len(blocks):
            raise ValueError(f"split_model: block_costs has {len(block_costs)} entries for {len(blocks)} blocks")
        return balanced_boundaries(block_costs, S)
    if boundaries == "parameters":
        return balanced_boundaries([_numel([b]) for b in blocks], S,
                                   _numel(_get(model, n) for n in recipe.first),
                                   _numel(_get(model, n) for n in recipe.last))
    if isinstance(boundaries, str):
        raise ValueError(f"split_model: boundaries={boundaries!r}: use 'parameters', a list of split points or None")
    return boundaries


def _plan(model: nn.Module, recipe: Recipe, pp_rank: int, pp_size: int, num_chunks: int, boundaries, block_costs,
          layout: str):
    """``(blocks, ranges, mine)``: the model's blocks, every stage's block range, this rank's stage ids."""
    blocks = _get(model, recipe.blocks)
    if not isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"split_model: {type(model).__name__} has no nn.ModuleList or nn.Sequential of blocks at "
                         f"{recipe.blocks!r} (found {type(blocks).__name__}); name the container of its blocks")
    for name in list(recipe.first) + list(recipe.last):
        if _get(model, name) is None:
            raise ValueError(f"split_model: {type(model).__name__} has no module {name!r} (named by the recipe's "
                             f"first/last parts); fix the recipe's module names")
    S = pp_size * num_chunks
    if len(blocks) < S and (boundaries is None or isinstance(boundaries, str) or block_costs is not None):
        raise ValueError(f"split_model: {len(blocks)} blocks cannot fill {S} pipeline stages (pipeline size "
                         f"{pp_size} x {num_chunks} chunk(s)); use fewer stages or pass explicit boundaries")
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"split_model: pp_rank={pp_rank} outside 0..{pp_size - 1}")
    ranges = partition_layers(len(blocks), S, _boundaries(model, recipe, blocks, S, boundaries, block_costs))
    mine = stage_ids(pp_rank, pp_size, num_chunks, layout)
    return blocks, ranges, mine


def kept_modules(model: nn.Module, recipe: Recipe, pp_rank: int, pp_size: int, *, num_chunks: int = 1,
                 boundaries: Union[None, str, Sequence[int]] = None, block_costs: Optional[Sequence[float]] = None,
                 layout: str = "loop") -> set:
    """The names of the modules :func:`split_model` (same arguments) keeps on this rank: its blocks
    (``"blocks.3"``), the shared parts and the first/last stage's parts it holds. ``model`` may be on the meta
    device (only its structure and shapes are read): a model that builds itself can then build only these
    (``GPTConfig.build(keep=)``)."""
    blocks, ranges, mine = _plan(model, recipe, pp_rank, pp_size, num_chunks, boundaries, block_costs, layout)
    S = pp_size * num_chunks
    names = {f"{recipe.blocks}.{i}" for s in mine for i in range(*ranges[s])} | set(recipe.shared)
    names |= set(recipe.first) if 0 in mine else set()
    names |= set(recipe.last) if S - 1 in mine else set()
    return names


def split_model(model: nn.Module, recipe: Recipe, pp_rank: int, pp_size: int, *, num_chunks: int = 1,
                boundaries: Union[None, str, Sequence[int]] = None, block_costs: Optional[Sequence[float]] = None,
                loss_fn: Optional[Callable] = None, tied_group=None, checkpoint: Union[bool, int] = False,
                sum_tied_grads_in_stage: bool = True, layout: str = "loop", saved_inputs=None,
                sequence_parallel_group=None, logits_group=None) -> List[ModelStage]:
    """This rank's stages (one per chunk) of ``model``; the parts no stage of this rank needs are dropped
    from ``model``. Every rank passes the same model (built from the same seed or loaded from the same
    weights). ``boundaries``: block split points, ``"parameters"`` (balanced by parameter count) or None
    (balanced by block count); ``block_costs``: balance by these per-block costs (e.g. measured forward
    times); ``tied_group``: the group of the first and last pipeline rank
    (:func:`~parallel_layers.pipeline.tied_embedding_group`), needed when weights are tied between them;
    ``checkpoint``: activation checkpointing (see :class:`ModelStage`); ``sum_tied_grads_in_stage``:
    False when the caller sums the tied gradients itself (``Parallel3D``); ``layout``: ``"v"`` for the ZBV
    schedule (:func:`~parallel_layers.pipeline.stage.stage_ids`; the first and last stage are both on rank
    0, where tied weights stay one module); ``saved_inputs``: how a checkpointed block keeps its input
    (:class:`~parallel_layers.activations.partitioned_checkpoint.SavedInputs`; None: whole); ``loss_fn``: None
    takes the recipe's own loss where it has one (the reference GPT's ``(sum, count)`` over labels other than
    -100, torch's ``ignore_index``), else the last stage returns the logits; ``sequence_parallel_group``: the
    blocks run sequence-parallel over it; ``logits_group``: the head's logits are vocabulary shards over it
    (see :class:`ModelStage`)."""
    if loss_fn is None and recipe.loss is not None:
        loss_fn = recipe.loss(model, -100)
    blocks, ranges, mine = _plan(model, recipe, pp_rank, pp_size, num_chunks, boundaries, block_costs, layout)
    S = pp_size * num_chunks
    has_first, has_last = 0 in mine, S - 1 in mine
    tied = _tied_between(model, recipe) if not (has_first and has_last) else []
    if tied and (has_first or has_last) and tied_group is None:
        raise ValueError(f"split_model: {len(tied)} weight(s) are tied between the first and last stage; pass "
                         f"tied_group=tied_embedding_group(pp_group) (every rank calls it)")
    dense_names = {id(p): n for n, p in model.named_parameters()}
    stages = [ModelStage(model, recipe, [blocks[i] for i in range(*ranges[s])], s == 0, s == S - 1, loss_fn,
                         tied_group if (has_first or has_last) and tied else None, dense_names=dense_names,
                         checkpoint=checkpoint, sums_tied_grads=sum_tied_grads_in_stage,
                         saved_inputs=saved_inputs, sequence_parallel_group=sequence_parallel_group,
                         logits_group=logits_group) for s in mine]
    owned = {i for s in mine for i in range(*ranges[s])}
    for i in range(len(blocks)):           # free what this rank does not run
        if i not in owned:
            blocks[i] = nn.Identity()
    kept = set(recipe.shared) | set(recipe.first if has_first else ()) | set(recipe.last if has_last else ())
    for name in (set(recipe.first) | set(recipe.last)) - kept:
        _set(model, name, None)
    if tied and (has_first or has_last):
        start_tied_equal(tied, tied_group)
        holder = next(st for st in stages if st.is_first or st.is_last)
        holder.tied = tied
    return stages


__all__ = ["ModelStage", "split_model", "kept_modules", "balanced_boundaries"]
