"""3D parallelism: the reference GPT over one ``ParallelMesh(dp, tp, pp)``.

TP inside each stage (``mesh.tp_group``), the pipeline across stages (``mesh.pp_group``), and plain data
parallelism or ZeRO stage 1/2 (or 3, below) across replicas (``mesh.dp_group``). One training step
(:meth:`Parallel3D.train_step`):

1. the pipeline schedule runs over the microbatches of this replica's slice of the batch; every
   backward only accumulates into DataParallel's flat fp32 grad buffer (``no_sync``);
2. tied input/output embedding gradients are summed between the first and the last stage (on the fp32
   main grads, so it holds for bf16 models too);
3. gradients are reduced over dp ONCE (:meth:`DataParallel.sync_gradients`: all-reduce, or
   reduce-scatter into the ZeRO shard);
4. the global gradient norm (:func:`parallel_layers.amp.clip_grad_norm_`): TP shards summed over tp and
   replicated parameters counted once, stages summed over pp, ZeRO shards summed over dp (plain DP
   holds identical full gradients: dp is not summed), the last stage's tied embedding copy left out;
5. the optimizer step (``torch.optim.AdamW`` for plain DP in fp32; :class:`ZeroOptimizer` otherwise,
   which keeps fp32 master weights for bf16/fp16 models), with the clip coefficient.

fp16 (``dtype=torch.float16``, ZeRO 1 or 2 only: it needs the fp32 master weights) adds a
:class:`DynamicLossScaler`. On the last stage every microbatch's loss is computed in fp32 from the fp16
logits (Megatron's default: an fp16 loss would cap ``scale / m`` at fp16's 65504 in its backward) and its
*gradient* multiplied by the scale (:class:`_ScaledLossStage`), so the loss the engine reports stays
unscaled. Step 4 then measures the norm of the unscaled gradients (``inv_scale``) and, in the same two
all-reduces (over tp, dp for ZeRO shards, and pp: every group, so every rank of the mesh), agrees on
``found_inf``. The ZeRO step divides the scale out on the fly and, when ``found_inf`` is set, leaves
parameters, master weights, moments and step count bit-identical; ``scaler.update(found_inf)`` then backs
off or grows the scale, the same decision on every rank since the flag is the same everywhere.

ZeRO-3 (``zero=3``, fp32 only): this rank's stages are wrapped in ONE :class:`ZeroStage3` over the dp
group, so between steps a rank holds 1/dp of its stages' parameters (``shard_buffer``), of the fp32
gradients (the shard) and of the AdamW state (:meth:`memory_report`), and no full parameter or
gradient. A step gathers every parameter of the stages once (:meth:`ZeroStage3.gather_all`) and keeps
them gathered for the forward and backward of every microbatch
(gathering per microbatch would repeat the all-gathers m times, torch issues #164756, #165467); autograd
accumulates full-size gradients across the microbatches, the tied embedding gradients are summed between
the first and last stage (on those full gradients, over the tied-embedding group), then
:meth:`ZeroStage3.reduce_scatter_and_free` reduces them over dp once (averaged into the fp32 gradient
shard) and frees the full parameters and gradients. The norm sums the shards over dp (each element once;
the last stage's tied copy left out) and :class:`ZeroStage3Optimizer` steps the shard. The tied copies
stay equal: both get the same summed gradient, the same clip coefficient and the same AdamW update.

Every rank builds only its own stages (:func:`build_gpt_stages`), from the same seed as ``GPT(config)``,
so the result matches the single-process model trained on the full batch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from .amp.clip import clip_grad_norm_
from .amp.scaler import DynamicLossScaler
from .data_parallel.ddp import DataParallel
from .distributed import collectives as C
from .mesh import ParallelMesh
from .models.gpt import GPTConfig
from .pipeline import PipelineEngine, build_gpt_stages, tied_embedding_group
from .pipeline.stage import sum_tied_grads
from .pipeline.timeline import draw
from .zero.optimizer import ZeroOptimizer
from .zero.stage3 import ZeroStage3
from .zero.stage3_optimizer import ZeroStage3Optimizer


class Parallel3D:
    """The reference GPT trained over ``mesh``: see the module docstring.

    ``zero``: 0 (plain DP, all-reduce), 1 or 2 (ZeRO over reduce-scatter), 3 (parameters sharded too,
    gathered once per step; fp32 only). ``schedule``: ``gpipe``,
    ``1f1b`` or ``interleaved`` (``num_chunks`` virtual stages per rank, default 2). ``max_grad_norm``:
    None disables clipping. ``seed``: the weights are those of ``torch.manual_seed(seed); GPT(config)``.
    ``loss_scaler``: for ``dtype=torch.float16`` (default: ``DynamicLossScaler()``, initial scale 2^16);
    must be None for other dtypes. ``checkpoint``: activation checkpointing, True for every block, an int
    ``n`` for the first ``n`` blocks of each stage (Megatron-LM's ``--recompute-method block``); backward
    recomputes them with the forward's RNG state (default generator and TP dropout stream), so dropout
    masks replay exactly; with ZeRO-3 the recomputation uses the parameters kept gathered for the step.
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, *, zero: int = 0, schedule: str = "1f1b",
                 num_microbatches: int = 4, num_chunks: Optional[int] = None, lr: float = 1e-3,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: Optional[float] = 1.0, dtype: torch.dtype = torch.float32,
                 bucket_cap_mb: float = 25.0, seed: int = 0,
                 device: Optional[torch.device] = None, loss_scaler: Optional[DynamicLossScaler] = None,
                 checkpoint: Union[bool, int] = False):
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"Parallel3D: zero={zero!r} must be 0 (plain data parallel), 1, 2 or 3")
        if zero == 3 and dtype != torch.float32:
            raise ValueError(f"Parallel3D: zero=3 supports fp32 models only (dtype={dtype}); use zero=1 or 2 for "
                             f"bf16/fp16 (fp32 master weights, loss scaling)")
        if zero == 0 and dtype != torch.float32 and dtype != torch.float64:
            raise ValueError(f"Parallel3D: a {dtype} model needs fp32 master weights; use zero=1 or 2 "
                             f"(ZeroOptimizer keeps them) or dtype=torch.float32")
        if loss_scaler is not None and dtype != torch.float16:
            raise ValueError(f"Parallel3D: a loss_scaler is for fp16 models (dtype={dtype}); bf16 and fp32 have "
                             f"fp32's exponent range and need none")
        if dtype == torch.float16 and loss_scaler is None:
            loss_scaler = DynamicLossScaler(device=device)
        self.scaler = loss_scaler
        if num_chunks is None:
            num_chunks = 2 if schedule == "interleaved" else 1
        self.config, self.mesh, self.zero, self.dtype = config, mesh, zero, dtype
        self.max_grad_norm = max_grad_norm
        self.num_microbatches = num_microbatches
        self.tp_group = mesh.tp_group if mesh.tp > 1 else None
        # a collective over the whole world: every rank calls it, in the same order
        self.tied_group = tied_embedding_group(mesh.pp_group) if (config.tie_embeddings and mesh.pp > 1) else None
        torch.manual_seed(seed)
        # build_gpt_stages draws fp16/bf16 weights in fp32 and rounds them (models/gpt.py: draw_dtype), so
        # every dtype starts from the fp32 model's weights.
        self.chunks: List[nn.Module] = build_gpt_stages(
            config, mesh.pp_rank, mesh.pp, num_chunks=num_chunks, tp_group=self.tp_group,
            require_divisible=schedule == "interleaved", checkpoint=checkpoint, dtype=dtype, device=device)
        self.model = nn.ModuleList(self.chunks)
        self.dp = self.z = None
        if zero == 3:
            # one wrapper over all of this rank's chunks: units = every block, root = embeddings, final LN, head
            self.z = ZeroStage3(self.model, mesh.dp_group, prefetch=False)
        else:
            self.dp = DataParallel(self.model, mesh.dp_group, reduce_op="reduce_scatter" if zero else "all_reduce",
                                   bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=min(1.0, bucket_cap_mb))
        # the tied copies: first stage (counted in the norm) and last stage (its duplicate)
        self._tied_params, self._dup = [], set()
        for chunk in self.chunks:
            if self.tied_group is not None and hasattr(chunk, "wte"):
                self._tied_params.append(chunk.wte.weight)
                if not chunk.is_first:
                    self._dup.add(id(chunk.wte.weight))
        if zero == 3:
            self.optimizer = ZeroStage3Optimizer(self.z, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        elif zero:
            self.optimizer = ZeroOptimizer(self.dp, stage=zero, lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, eps=eps,
                                               weight_decay=weight_decay, foreach=False)
        # fp16: the engine runs the last stage through _ScaledLossStage (same parameters, scaled backward)
        engine_chunks = [_ScaledLossStage(c, self.scaler) if (self.scaler is not None and c.is_last) else c
                         for c in self.chunks]
        self.engine = PipelineEngine(engine_chunks, mesh.pp_group, schedule=schedule,
                                     num_microbatches=num_microbatches,
                                     device=device)

    # ------------------------------------------------------------------ one step
    def local_batch(self, t: torch.Tensor) -> torch.Tensor:
        """This replica's slice (dim 0) of a global batch."""
        if t.shape[0] % self.mesh.dp:
            raise ValueError(f"Parallel3D: global batch of {t.shape[0]} does not split over dp={self.mesh.dp}; "
                             f"use a multiple of dp x microbatches = {self.mesh.dp * self.num_microbatches}")
        per = t.shape[0] // self.mesh.dp
        return t[self.mesh.dp_rank * per:(self.mesh.dp_rank + 1) * per]

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        """One optimizer step on the GLOBAL batch ``inputs``/``targets`` (every rank passes the same one;
        each takes its dp slice). Returns ``{"loss": mean loss over the global batch, "grad_norm": ...}``
        on every rank."""
        if self.zero == 3:
            return self._train_step_zero3(inputs, targets)
        if self.zero == 2:
            self.optimizer._materialize_grads()     # ZeRO-2 frees the full grad buffer between steps
        self.optimizer.zero_grad()
        if self.zero == 0:
            self.dp.zero_grad()
        x, y = self.local_batch(inputs), self.local_batch(targets)
        with self.dp.no_sync():
            loss = self.engine.step(x, y)
        for p in self._tied_params:                  # first and last stage: sum the tied gradients
            C.all_reduce(p.main_grad, self.tied_group)
        self.dp.sync_gradients()                     # once per step, over dp
        found_inf = None
        if self.scaler is not None:
            found_inf = torch.zeros(1, dtype=torch.float32, device=self.scaler.scale.device)
            scale = self.scaler.scale.clone()       # the scale these gradients carry
        norm, coef = self._clip(found_inf)
        if self.scaler is not None:
            if self.max_grad_norm is None:
                coef = None
            self.optimizer.step(grad_scale=scale, found_inf=found_inf, clip_coef=coef)
            self.scaler.update(found_inf)
        elif self.zero:
            self.optimizer.step(clip_coef=coef)
        else:
            self.optimizer.step()
        out = {"loss": self._mean_over_dp(loss), "grad_norm": None if norm is None else float(norm)}
        if self.scaler is not None:
            out["skipped"] = bool(found_inf.item())     # same on every rank (agreed by the all-reduce)
            out["loss_scale"] = float(self.scaler.scale.item())
        return out

    def _train_step_zero3(self, inputs: torch.Tensor, targets: torch.Tensor) -> dict:
        self.optimizer.zero_grad()                  # frees the gradient shard
        x, y = self.local_batch(inputs), self.local_batch(targets)
        self.z.gather_all()                          # once per step, kept for every microbatch
        try:
            loss = self.engine.step(x, y)
        except BaseException:
            self.z.release_gathered()                # no collective: the other ranks may never get there
            raise
        sum_tied_grads(self._tied_params, self.tied_group)   # first and last stage: the tied (full) gradients
        self.z.reduce_scatter_and_free()             # once per step, over dp; reshard
        norm, coef = self._clip()
        self.optimizer.step(clip_coef=coef)
        return {"loss": self._mean_over_dp(loss), "grad_norm": None if norm is None else float(norm)}

    def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """The mean loss over the GLOBAL batch ``inputs``/``targets`` (every rank passes the same one; each
        takes its dp slice), forward only: validation between training steps. The pipeline runs its
        forward-only schedule (:meth:`PipelineEngine.evaluate`: eval mode, no dropout, no gradients);
        with ZeRO-3 the parameters are gathered once for it and resharded after. Gradients, optimizer
        state, the loss scale and the last training step's timeline are left as they were. The same
        float on every rank."""
        x, y = self.local_batch(inputs), self.local_batch(targets)
        if self.z is not None:
            self.z.gather_all()
        try:
            loss = self.engine.evaluate(x, y)
        finally:
            if self.z is not None:
                self.z.release_gathered()           # nothing to reduce: free the gathered parameters
        return self._mean_over_dp(loss)

    def _mean_over_dp(self, loss: torch.Tensor) -> float:
        """This replica's mean loss averaged over the dp group (in float64): the global batch's, on every rank."""
        loss = loss.detach().to(torch.float64).reshape(1)
        if self.mesh.dp > 1:
            C.all_reduce(loss, self.mesh.dp_group)
            loss /= self.mesh.dp
        return loss.item()

    def _zero3_grad_pieces(self) -> list:
        """This rank's slices of the fp32 gradient shard, one per parameter overlapping it, flagged
        ``tensor_parallel`` like the parameter; the last stage's tied embedding copy left out."""
        items = []
        for p, _, start, n in self.optimizer.shard_pieces():
            if id(p) in self._dup:
                continue
            piece = self.z.grad_buffer[start:start + n]
            piece.tensor_parallel = bool(getattr(p, "tensor_parallel", False))
            items.append(piece)
        return items

    def _clip(self, found_inf: Optional[torch.Tensor] = None):
        """``(norm, coef)`` of the global gradient norm. With ``found_inf`` (fp16): the norm of the unscaled
        gradients, and ``found_inf`` set to 1 on every rank when any rank's gradients hold inf/nan."""
        if self.max_grad_norm is None and found_inf is None:
            return None, None
        max_norm = math.inf if self.max_grad_norm is None else self.max_grad_norm
        kw = {} if found_inf is None else {"inv_scale": self.scaler.inv_scale, "found_inf": found_inf}
        groups = [self.mesh.pp_group] if self.mesh.pp > 1 else []
        if self.zero == 3:
            if self.mesh.dp > 1:
                groups = [self.mesh.dp_group] + groups
            return clip_grad_norm_(self._zero3_grad_pieces(), max_norm, groups=groups, tp_group=self.tp_group,
                                   apply=False, **kw)
        if self.zero:
            items = []
            for b in self.dp.buffer.buckets:
                shard = self.dp.bucket_grad_shard(b)
                for p, _, start, n in b.param_shard_overlaps(self.dp.dp_rank):
                    if id(p) in self._dup:
                        continue
                    piece = shard[start:start + n]
                    piece.tensor_parallel = bool(getattr(p, "tensor_parallel", False))
                    items.append(piece)
            if self.mesh.dp > 1:
                groups = [self.mesh.dp_group] + groups
            return clip_grad_norm_(items, max_norm, groups=groups, tp_group=self.tp_group, apply=False, **kw)
        items = [p for p in self.dp.buffer.params if id(p) not in self._dup]
        norm, coef = clip_grad_norm_(items, max_norm, groups=groups, tp_group=self.tp_group, apply=False, **kw)
        # every gradient is scaled, the last stage's tied copy included (it was only left out of the norm)
        torch._foreach_mul_([p.main_grad for p in self.dp.buffer.params], coef.to(self.dp.buffer.grad_dtype))
        return norm, coef

    # ------------------------------------------------------------------ checkpoints (resume)
    def state_dict(self) -> dict:
        """This rank's part of the training state, to resume from: its stages' parameters (its shard
        under ZeRO-3), its optimizer state (its shard under ZeRO), the loss scaler, the random states
        dropout draws from (default generator and the TP tracker's streams), and the layout they belong
        to. Every rank saves its own (``torch.save``, one file per rank, as Megatron-LM and DeepSpeed
        do) and loads it back on the same mesh with :meth:`load_state_dict`; training then continues
        bit for bit. To resume on another mesh (or in a single process), save a universal checkpoint
        instead (:func:`parallel_layers.universal_checkpoint.save_universal`)."""
        if self.z is not None:
            model = self.z.state_dict()
        else:
            model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        tracker = self.chunks[0].rng_tracker
        return {"layout": self._checkpoint_layout(), "model": model, "optimizer": self.optimizer.state_dict(),
                "scaler": None if self.scaler is None else self.scaler.state_dict(),
                "rng": {"default": torch.get_rng_state(),
                        "tracker": None if tracker is None else tracker.get_states()}}

    def load_state_dict(self, state: dict) -> None:
        """Load what :meth:`state_dict` saved on this same rank of a run with the same mesh, ZeRO stage,
        schedule layout, model config and dtype (a collective over dp with ZeRO 1/2 when the gradient
        bucket layout has changed since: call it on every rank). A checkpoint of another rank or run is
        a ``ValueError`` naming what differs, before anything is loaded."""
        mine, saved = self._checkpoint_layout(), state.get("layout") or {}
        differ = [k for k in mine if saved.get(k) != mine[k]]
        if differ:
            raise ValueError("Parallel3D.load_state_dict: the checkpoint does not belong to this rank of this "
                             "run; " + "; ".join(f"{k}: saved {saved.get(k)}, here {mine[k]}" for k in differ)
                             + ". Load each rank's own file on the same mesh and settings (to change the layout, "
                             "save with parallel_layers.universal_checkpoint.save_universal and load_universal)")
        if self.z is not None:
            self.z.load_state_dict(state["model"])
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        torch.set_rng_state(state["rng"]["default"])
        tracker = self.chunks[0].rng_tracker
        if tracker is not None:
            tracker.set_states(state["rng"]["tracker"])

    def _checkpoint_layout(self) -> dict:
        m, e = self.mesh, self.engine
        return {"mesh (dp, tp, pp)": [m.dp, m.tp, m.pp], "rank (dp, tp, pp)": [m.dp_rank, m.tp_rank, m.pp_rank],
                "zero": self.zero, "schedule chunks": e.v, "dtype": str(self.dtype),
                "config": dataclasses.asdict(self.config)}

    # ------------------------------------------------------------------ inspection
    def dense_state_dict(self) -> dict:
        """The parameters of this rank's stages under the full ``GPT``'s names, gathered over TP (a
        collective over the tp group; with ZeRO-3 also over dp)."""
        if self.z is not None:
            with self.z.summon_full_params():
                return self._dense_state_dict()
        return self._dense_state_dict()

    def memory_report(self) -> Optional[dict]:
        """The optimizer's per-rank memory report (ZeRO only: shards of parameters, gradients, states)."""
        rep = getattr(self.optimizer, "memory_report", None)
        return rep() if rep is not None else None

    def _dense_state_dict(self) -> dict:
        from .tensor_parallel.parallelize import gather_dense_state_dict
        out = {}
        for chunk in self.chunks:
            sd = gather_dense_state_dict(chunk) if self.tp_group is not None else \
                {n: t.detach().clone() for n, t in chunk.state_dict().items()}
            for n, t in sd.items():
                if n.startswith("lm_head.") and t.shape[0] > self.config.vocab_size:
                    t = t[:self.config.vocab_size]
                out[chunk.dense_name(n)] = t
        return out

    def timeline_png(self, path: str, title: Optional[str] = None) -> Optional[str]:
        """Gathers the last step's timeline over the pp group (a collective on every rank) and writes the
        PNG on global rank 0; returns the path there, None elsewhere."""
        tls = self.engine.gather_timeline()
        if dist.get_rank() != 0 or tls is None:
            return None
        e = self.engine
        return draw(tls, path, title or f"{e.schedule}: p={e.p}, m={e.m}, chunks={e.v} "
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
    backward scaled by ``scaler.scale``. The value handed back (cast to the model dtype, as every pipeline
    rank's loss buffer is) is the *unscaled* loss; the backward into the fp32 loss carries ``scale / m``
    in fp32 and the fp16 logits receive ``scale * dloss/dlogits`` (what ``scaler.scale_loss(loss)`` would
    give, without fp16's 65504 cap on ``scale / m`` itself)."""

    def __init__(self, stage: nn.Module, scaler: DynamicLossScaler):
        super().__init__()
        self.stage, self.scaler = stage, scaler

    def forward(self, x: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        shard = self.stage(x)
        if targets is None:
            return shard
        self.scaler._on(shard.device)
        loss = self.stage.loss(shard.float(), targets)
        return _ScaleGrad.apply(loss, self.scaler.scale).to(shard.dtype)

    def finish_grads(self) -> None:
        if hasattr(self.stage, "finish_grads"):
            self.stage.finish_grads()


__all__ = ["Parallel3D"]
