"""``FreezeTrainer``: one training run that freezes its bottom blocks and re-lays itself out as it goes.

Every step (:meth:`FreezeTrainer.train_step`, the global batch on every rank, as ``Parallel3D`` takes it):

1. the freeze policy (:mod:`.auto_freeze`) says how many bottom blocks are frozen for this step; when
   that grew, :meth:`FreezeTrainer.relayout` moves the run to a new layout (:mod:`.relayout`): the blocks'
   measured costs are agreed, the new ``(dp, pp)`` and stage boundaries chosen, the dense training state
   shared, and a new ``Parallel3D`` of the active blocks built on a new ``ParallelMesh`` of the same
   processes (every rank creates the new groups in the same order);
2. on the ranks of the first pipeline stage the frozen prefix (:mod:`.prefix`) turns this replica's
   slice of the batch into hidden states, from the cache (:mod:`.cache`) where the sample was seen since
   the prefix last grew;
3. the active blocks train through ``Parallel3D.train_step`` (pipeline, data parallel or ZeRO, clipping);
   between its dp reduction and its optimizer step the active blocks' gradient norms are measured when
   the policy reads them (all-reduced: the same numbers, so the same decision, on every rank).

With nothing frozen the run *is* ``Parallel3D(build_model(), mesh, loss_fn=..., **options)``: the same
construction and steps, bit for bit. A frozen block stays frozen; the frozen prefix keeps its weights
bit-identical; the AdamW moments and step count of every trained parameter carry over every re-layout.

Not carried over a re-layout: the moments of the blocks just frozen (never used again), and tensor
parallelism (``tp`` is 1: the elastic dimension is pp against dp, as in PipeTransformer).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from ..composition.config import split_keywords
from ..composition.parallel3d import Parallel3D
from ..composition.replica_check import ReplicaCheck, check_same_batch
from ..families import Recipe, recipe_for
from ..mesh import ParallelMesh
from .auto_freeze import FreezePolicy, parse_freeze
from .cache import DEFAULT_MAX_BYTES, PrefixCache
from .measure import StageTimer, block_grad_norms
from .prefix import block_index, blocks_of, full_name, split_at
from .relayout import (
    BACKWARD_FACTOR,
    Dense,
    Layout,
    choose_layout,
    load_moments,
    load_parameters,
    local_dense,
    share_dense,
    stage_costs,
)

_NOT_OPTIONS = ("tp_plan", "boundaries", "block_costs")       # tp_plan plain, the others PipelineConfig's


class FreezeTrainer:
    """Freeze training with elastic pipelining over ``dp * pp`` ranks (the world), tp 1.

    ``build_model()``: the whole model, the same weights on every rank (seed it inside); called once at
    the start and once per re-layout (its weights are then overwritten with the run's). ``loss_fn``,
    ``recipe`` (default: the shipped one for the model's class) and ``**options`` (``optimizer=``,
    ``pipeline=``, ``data_parallel=``, ``precision=``, ``seed``, ...) are ``Parallel3D``'s.
    ``freeze``: a :class:`~.auto_freeze.FreezePolicy`, or ``"off"``, ``"auto"``, ``"STEP:BLOCKS,..."``;
    ``freeze_cap``: the most of the blocks that may be frozen (a fraction). ``layouts``: ``"auto"``
    (AutoPipe + AutoDP: :func:`~.relayout.choose_layout`), ``"keep"`` (the same dp x pp while the active
    blocks fill its stages: frozen blocks leave the pipeline, its length stays; re-balanced by cost) or
    ``{frozen blocks: (dp, pp)}`` to fix them.
    ``cache_bytes``: the prefix cache's bound per first-stage rank (0: no cache); it serves only steps
    given ``sample_ids``. ``mesh_factory(dp, pp)``: the ``ParallelMesh`` of a layout (default a new
    ``ParallelMesh(dp, 1, pp, timeout=timeout)``). ``layout_tolerance``: how far over the starting
    layout's most expensive stage a new stage may cost and still fit.
    """

    def __init__(self, build_model: Callable[[], nn.Module], *, dp: int, pp: int, loss_fn: Callable,
                 freeze: Union[str, FreezePolicy] = "off", freeze_cap: float = 0.5, recipe: Optional[Recipe] = None,
                 layouts: Union[str, Mapping[int, Tuple[int, int]]] = "auto", cache_bytes: int = DEFAULT_MAX_BYTES,
                 mesh_factory: Optional[Callable[[int, int], ParallelMesh]] = None, timeout=None,
                 layout_tolerance: float = 0.1, **options):
        settings, plain = split_keywords(options, "FreezeTrainer")
        bad = sorted(set(options) & set(_NOT_OPTIONS)) + [f"pipeline.{k}" for k in _NOT_OPTIONS if k not in options
                                                          and getattr(settings.pipeline, k, None) is not None]
        if bad:
            raise ValueError(f"FreezeTrainer: {bad} are chosen by the trainer (stage boundaries follow the measured "
                             f"costs; tp is 1)")
        world = dist.get_world_size()
        if dp * pp != world:
            raise ValueError(f"FreezeTrainer: dp={dp} x pp={pp} = {dp * pp} ranks, but the world has {world}; "
                             f"freeze training runs tp=1 over every rank")
        if layouts not in ("auto", "keep") and not isinstance(layouts, Mapping):
            raise ValueError(f"FreezeTrainer: layouts={layouts!r}: 'auto', 'keep' or {{frozen blocks: (dp, pp)}}")
        # Parallel3D's keywords, the settings in their groups
        self.build_model, self.loss_fn, self.options = build_model, loss_fn, {**plain, **settings.as_keywords()}
        # the batch is checked here, on the global batch: the active part's Parallel3D is handed the prefix's
        # output, whose rows outside a replica's slice are not filled
        check = self.options.pop("replica_check", "default")
        self.replica_check = ReplicaCheck.default() if check == "default" else check
        self.layouts, self.tolerance = layouts, layout_tolerance
        self.mesh_factory = mesh_factory or (lambda d, p: ParallelMesh(dp=d, tp=1, pp=p, timeout=timeout))
        self.device = torch.device(options["device"]) if options.get("device") is not None else torch.device("cpu")
        self.chunks = settings.pipeline.chunks()
        self.num_microbatches = settings.pipeline.num_microbatches
        model = build_model()
        # a parameter tied under two names (a Llama's lm_head.weight is model.embed_tokens.weight) is known
        # by its first; the active model, without the embedding, reaches it by the other
        first: Dict[int, str] = {}
        self._canonical = {n: first.setdefault(id(p), n) for n, p in model.named_parameters(remove_duplicate=False)}
        self.recipe = recipe if recipe is not None else recipe_for(model)
        self.num_blocks = len(blocks_of(model, self.recipe))
        self.policy = parse_freeze(freeze, self.num_blocks, freeze_cap) if isinstance(freeze, str) else freeze
        self.cache = PrefixCache(cache_bytes)
        self.step = 0
        # per-sample cost estimates (forward + backward), kept for the blocks once they are frozen
        self.block_cost: List[Optional[float]] = [None] * self.num_blocks
        self.block_forward: List[Optional[float]] = [None] * self.num_blocks
        self.block_norms: Optional[torch.Tensor] = None    # per block, after each step's dp reduction
        self.embed_forward = self.head_cost = 0.0
        self.history: List[dict] = []
        self.panels: List[Tuple[str, list]] = []       # rank 0: (title, timelines) of every layout's last step
        self.last_replica_rows: Optional[Tuple[int, int]] = None
        self._last_batch: Optional[int] = None
        self.start = Layout(dp=dp, pp=pp, chunks=self.chunks)
        self._build(model, self.start)

    # ------------------------------------------------------------------ layout
    def _build(self, model: nn.Module, layout: Layout) -> None:
        mesh = self.mesh_factory(layout.dp, layout.pp)
        prefix, active, recipe = split_at(model, self.recipe, layout.frozen, keep_prefix=mesh.pp_rank == 0)
        if prefix is not None:                       # the dtype and device Parallel3D gives the active part
            prefix.model.to(device=self.options.get("device"), dtype=self.options["precision"].dtype)
        pipeline = dataclasses.replace(self.options["pipeline"], boundaries=layout.boundaries)
        check = None if self.replica_check is None else dataclasses.replace(self.replica_check, batch=False)
        self.model = Parallel3D(active, mesh, loss_fn=self.loss_fn, recipe=recipe, replica_check=check,
                                **{**self.options, "pipeline": pipeline})
        self.mesh, self.prefix, self.layout = mesh, prefix, layout
        params, modules = {}, {}
        for chunk in self.model.chunks:
            for n, p in chunk.named_parameters():
                i = block_index(self._rename(chunk.dense_name(n)), self.recipe)
                if i is not None:
                    params[id(p)] = i
            for j, block in enumerate(chunk.blocks):
                first = next(iter(block.named_parameters()), None)
                if first is not None:
                    modules[block] = block_index(self._rename(chunk.dense_name(f"blocks.{j}.{first[0]}")), self.recipe)
        if self.policy.needs_grad_norms:
            self.model.after_reduce = lambda model, params=params: self._measure_block_norms(model, params)
        self.timer = StageTimer(self.model.chunks, modules, self.num_blocks)

    def _measure_block_norms(self, model: Parallel3D, block_of: Dict[int, int]) -> None:
        """Between the dp reduction and the optimizer step: every active block's gradient norm."""
        inv = model.scaler.inv_scale if model.scaler is not None else None
        self.block_norms = block_grad_norms(model, block_of, self.num_blocks, device=model.grad_device, inv_scale=inv)

    def _rename(self, name: str) -> str:
        """A name of the active model -> the whole model's (a tied parameter's first name)."""
        name = full_name(name, self.layout.frozen, self.recipe)
        return self._canonical.get(name, name)

    def _costs(self) -> None:
        """Fold the forward times measured since the last layout into the estimates (a collective)."""
        block, first, last = self.timer.agreed(self.layout.dp, self.device)
        for i, t in enumerate(block):
            if t > 0:
                self.block_forward[i], self.block_cost[i] = t, BACKWARD_FACTOR * t
        if self.layout.frozen == 0 and first > 0:
            self.embed_forward = first
        if last > 0:
            self.head_cost = BACKWARD_FACTOR * last

    def _choose(self, frozen: int, batch: int, cached: bool) -> Layout:
        known = [c for c in self.block_cost if c]
        fallback = sum(known) / len(known) if known else 1.0        # nothing measured yet: equal blocks
        costs = [c if c else fallback for c in self.block_cost]
        forward = [f if f else fallback / BACKWARD_FACTOR for f in self.block_forward]
        start = self.start
        start_bounds = start.split_points(self.num_blocks) if start.pp * start.chunks > 1 else []
        budget = max(stage_costs(costs, start_bounds, BACKWARD_FACTOR * self.embed_forward, self.head_cost))
        prefix = 0.0 if cached else self.embed_forward + sum(forward[:frozen])
        fixed = None
        if isinstance(self.layouts, Mapping) and frozen in self.layouts:
            fixed_dp, fixed = self.layouts[frozen]
            if fixed_dp * fixed != start.dp * start.pp:
                raise ValueError(f"FreezeTrainer: layouts[{frozen}] = ({fixed_dp}, {fixed}) does not use the "
                                 f"{start.dp * start.pp} ranks")
        elif self.layouts == "keep" and (self.num_blocks - frozen) >= self.layout.pp * self.chunks:
            fixed = self.layout.pp
        pp, bounds, per_stage = choose_layout(
            costs[frozen:], world=start.dp * start.pp, current_pp=self.layout.pp, budget=budget, batch=batch,
            microbatches=self.num_microbatches, first_extra=prefix, last_extra=self.head_cost, chunks=self.chunks,
            tolerance=self.tolerance, fixed_pp=fixed)
        return Layout(dp=start.dp * start.pp // pp, pp=pp, frozen=frozen, boundaries=bounds, chunks=self.chunks,
                      first_step=self.step, stage_costs=per_stage)

    def training_state(self) -> Tuple[Dense, int]:
        """The whole model's dense training state on every rank (each parameter, frozen ones included, and
        the AdamW moments of the trained ones, by the whole model's names) and the step count: what a
        re-layout moves. A collective over the world."""
        mine, step = local_dense(self.model, self._rename)
        if self.prefix is not None and dist.get_rank() == 0:      # global rank 0 is always on the first stage
            for n, p in self.prefix.model.named_parameters():
                mine.setdefault(self._canonical.get(n, n), {"param": p.detach().clone()})
        return share_dense(mine, self.device), step

    def relayout(self, frozen: int, batch: Optional[int] = None, cached: bool = False) -> dict:
        """Freeze the first ``frozen`` blocks now and move to the layout chosen for the rest (a collective
        over the world; :meth:`train_step` calls it when the policy says so). ``batch``: the global batch
        size the layout must split (default: the last step's); ``cached``: the prefix cache will serve
        the first stage (its cost then counts as none). Returns the event recorded in :attr:`history`."""
        if not self.layout.frozen < frozen < self.num_blocks:
            raise ValueError(f"FreezeTrainer.relayout: {frozen} frozen blocks; {self.layout.frozen} are already "
                             f"frozen and at least one of {self.num_blocks} must train")
        batch = batch or self._last_batch
        if batch is None:
            raise ValueError("FreezeTrainer.relayout: pass batch= (the global batch size) before the first step")
        t0 = time.perf_counter()
        old = self.layout
        self._record_timeline()
        self._costs()
        new = self._choose(frozen, batch, cached)
        state, step = self.training_state()
        scaler = self.model.scaler.state_dict() if self.model.scaler is not None else None
        skipped = self.model.skipped_steps
        self.timer.close()
        self.model = self.prefix = None                             # the old layout's memory goes first
        model = self.build_model()
        load_parameters(model, state)
        rng = torch.get_rng_state()                                 # Parallel3D seeds the default generator
        self._build(model, new)
        torch.set_rng_state(rng)                                    # ... which carries on as it was
        load_moments(self.model, state, step, self._rename)
        if scaler is not None:
            self.model.scaler.load_state_dict(scaler)
        self.model.skipped_steps = skipped
        self.cache.reset(frozen)
        event = {"step": self.step, "frozen": frozen, "from": old.describe(self.num_blocks),
                 "to": new.describe(self.num_blocks), "dp": new.dp, "pp": new.pp,
                 "stage_costs": [round(c, 9) for c in new.stage_costs], "seconds": time.perf_counter() - t0}
        self.history.append(event)
        return event

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, sample_ids: Optional[torch.Tensor] = None,
                   **side) -> dict:
        """One optimizer step on the GLOBAL batch (every rank passes the same ``inputs``, ``targets``, side
        inputs and ``sample_ids``: the samples' indices, for the prefix cache). Returns ``Parallel3D``'s
        ``{"loss", "grad_norm", ...}`` plus ``frozen``, ``layout`` (``(dp, pp)``) and ``relayout`` (the
        event, on the step that began with one, else None)."""
        self._last_batch = inputs.shape[0]
        event = None
        target = self.policy.frozen_blocks(self.step, self.layout.frozen)
        if target > self.layout.frozen:
            event = self.relayout(target, inputs.shape[0], cached=sample_ids is not None and self.cache.max_bytes > 0)
        check = self.replica_check
        if check is not None and check.batch and check.due(self.step + 1):
            check_same_batch(inputs, targets, side, self.mesh.dim_groups(), self.step + 1, self.model.grad_device)
        x = inputs if self.layout.frozen == 0 else self._prefix_input(inputs, sample_ids, side)
        out = self.model.train_step(x, targets, **side)
        self.timer.count(inputs.shape[0] // self.mesh.dp)
        if self.policy.needs_grad_norms:
            self.policy.observe(self.step, self.layout.frozen, self.block_norms[self.layout.frozen:])
        self.step += 1
        out.update(frozen=self.layout.frozen, layout=(self.layout.dp, self.layout.pp), relayout=event)
        return out

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor, **side) -> float:
        """``Parallel3D.evaluate`` of the whole model (the prefix computed, not cached)."""
        x = inputs if self.layout.frozen == 0 else self._prefix_input(inputs, None, side)
        return self.model.evaluate(x, targets, **side)

    def _prefix_input(self, inputs: torch.Tensor, sample_ids: Optional[torch.Tensor], side: dict):
        """What the active pipeline's first stage takes: the prefix's output for this replica's slice, in
        a global-batch-shaped tensor (``Parallel3D`` keeps only that slice of what it is given; the rest
        is never read); None on the ranks of later stages."""
        if self.mesh.pp_rank != 0:
            return None
        batch, dp = inputs.shape[0], self.mesh.dp
        if batch % dp:
            raise ValueError(f"FreezeTrainer: global batch of {batch} does not split over dp={dp}")
        lo = self.mesh.dp_rank * (batch // dp)
        hi = lo + batch // dp
        self.last_replica_rows = (lo, hi)
        if sample_ids is None or self.cache.max_bytes == 0:
            h = self.prefix(inputs[lo:hi], **{k: v[lo:hi] for k, v in side.items()})
        else:
            h = self._cached(inputs, [int(s) for s in sample_ids.tolist()], side, lo, hi)
        out = h.new_empty((batch,) + tuple(h.shape[1:]))
        out[lo:hi] = h
        return out

    def _cached(self, inputs: torch.Tensor, ids: List[int], side: dict, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the prefix's output, from the cache; while it accepts, the missing samples of the
        whole global batch are computed and kept (so every replica's cache holds the same samples)."""
        cache, computed = self.cache, {}
        held = {r: cache.get(ids[r]) for r in range(lo, hi)}          # hits: computed in an earlier step

        def run(rows: List[int]) -> None:
            index = torch.tensor(rows, dtype=torch.long, device=inputs.device)
            out = self.prefix(inputs[index], **{k: v[index] for k, v in side.items()})
            computed.update({ids[r]: out[j] for j, r in enumerate(rows)})

        if cache.accepting:
            first_seen = {}
            for r, s in enumerate(ids):
                if s not in cache and s not in first_seen:
                    first_seen[s] = r
            if first_seen:                              # dict order: global batch order, the same everywhere
                run(sorted(first_seen.values()))
                for s in first_seen:
                    cache.put(s, computed[s])
        rest = [r for r, hit in held.items() if hit is None and ids[r] not in computed]
        if rest:
            run(rest)
        return torch.stack([hit if hit is not None else computed[ids[r]] for r, hit in held.items()])

    # ------------------------------------------------------------------ inspection
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.model.optimizer

    @property
    def freeze_events(self) -> List[Tuple[int, int]]:
        """``(step, frozen blocks)`` of every freeze so far: what a single-process run replays."""
        return [(e["step"], e["frozen"]) for e in self.history]

    def dense_state_dict(self) -> Dict[str, torch.Tensor]:
        """This rank's parameters under the whole model's names: its stages' and, on the first stage's
        ranks, the frozen prefix's (a collective over dp only under ZeRO-3)."""
        out = {self._rename(n): t for n, t in self.model.dense_state_dict().items()}
        if self.prefix is not None:
            out.update({self._canonical.get(n, n): p.detach().clone() for n, p in self.prefix.model.named_parameters()})
        return out

    def describe(self) -> str:
        return self.layout.describe(self.num_blocks)

    def _record_timeline(self) -> None:
        """The current layout's last step, gathered over its pipeline groups (a collective), kept on rank 0."""
        tls = self.model.engine.gather_timeline()
        if dist.get_rank() == 0 and tls is not None and any(t.events for t in tls):
            self.panels.append((f"steps {self.layout.first_step + 1}-{self.step}: {self.describe()}", tls))

    def timeline_png(self, path: str, title: Optional[str] = None) -> Optional[str]:
        """Every layout's last step, one panel each, to a PNG on global rank 0 (None elsewhere, or without
        matplotlib). A collective (the current layout's timeline is gathered)."""
        self._record_timeline()
        if dist.get_rank() != 0:
            return None
        from .layout_timeline import draw_panels
        return draw_panels(self.panels, path, title or f"freeze training: {self.policy.describe()}")

    def bubble_fraction(self) -> Optional[float]:
        return self.model.bubble_fraction()


__all__ = ["FreezeTrainer"]
