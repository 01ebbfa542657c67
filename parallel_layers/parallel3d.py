"""3D parallelism: the reference GPT over one ``ParallelMesh(dp, tp, pp)``.

TP inside each stage (``mesh.tp_group``), the pipeline across stages (``mesh.pp_group``), and plain data
parallelism or ZeRO stage 1/2 across replicas (``mesh.dp_group``). One training step
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
   which keeps fp32 master weights for bf16 models), with the clip coefficient.

Every rank builds only its own stages (:func:`build_gpt_stages`), from the same seed as ``GPT(config)``,
so the result matches the single-process model trained on the full batch.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .amp.clip import clip_grad_norm_
from .data_parallel.ddp import DataParallel
from .distributed import collectives as C
from .mesh import ParallelMesh
from .models.gpt import GPTConfig
from .pipeline import PipelineEngine, build_gpt_stages, tied_embedding_group
from .pipeline.timeline import draw
from .zero.optimizer import ZeroOptimizer


class Parallel3D:
    """The reference GPT trained over ``mesh``: see the module docstring.

    ``zero``: 0 (plain DP, all-reduce), 1 or 2 (ZeRO over reduce-scatter). ``schedule``: ``gpipe``,
    ``1f1b`` or ``interleaved`` (``num_chunks`` virtual stages per rank, default 2). ``max_grad_norm``:
    None disables clipping. ``seed``: the weights are those of ``torch.manual_seed(seed); GPT(config)``.
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, *, zero: int = 0, schedule: str = "1f1b",
                 num_microbatches: int = 4, num_chunks: Optional[int] = None, lr: float = 1e-3,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: Optional[float] = 1.0, dtype: torch.dtype = torch.float32,
                 bucket_cap_mb: float = 25.0, record_timeline: bool = False, seed: int = 0,
                 device: Optional[torch.device] = None):
        if zero not in (0, 1, 2):
            raise ValueError(f"Parallel3D: zero={zero!r} must be 0 (plain data parallel), 1 or 2; ZeRO-3 with "
                             f"the pipeline is not supported here")
        if zero == 0 and dtype != torch.float32 and dtype != torch.float64:
            raise ValueError(f"Parallel3D: a {dtype} model needs fp32 master weights; use zero=1 or 2 "
                             f"(ZeroOptimizer keeps them) or dtype=torch.float32")
        if num_chunks is None:
            num_chunks = 2 if schedule == "interleaved" else 1
        self.config, self.mesh, self.zero = config, mesh, zero
        self.max_grad_norm = max_grad_norm
        self.num_microbatches = num_microbatches
        self.tp_group = mesh.tp_group if mesh.tp > 1 else None
        # a collective over the whole world: every rank calls it, in the same order
        self.tied_group = tied_embedding_group(mesh.pp_group) if (config.tie_embeddings and mesh.pp > 1) else None
        torch.manual_seed(seed)
        self.chunks: List[nn.Module] = build_gpt_stages(
            config, mesh.pp_rank, mesh.pp, num_chunks=num_chunks, tp_group=self.tp_group,
            require_divisible=schedule == "interleaved", dtype=dtype, device=device)
        self.model = nn.ModuleList(self.chunks)
        self.dp = DataParallel(self.model, mesh.dp_group, reduce_op="reduce_scatter" if zero else "all_reduce",
                               bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=min(1.0, bucket_cap_mb))
        # the tied copies: first stage (counted in the norm) and last stage (its duplicate)
        self._tied_params, self._dup = [], set()
        for chunk in self.chunks:
            if self.tied_group is not None and hasattr(chunk, "wte"):
                self._tied_params.append(chunk.wte.weight)
                if not chunk.is_first:
                    self._dup.add(id(chunk.wte.weight))
        if zero:
            self.optimizer = ZeroOptimizer(self.dp, stage=zero, lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay)
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=betas, eps=eps,
                                               weight_decay=weight_decay, foreach=False)
        self.engine = PipelineEngine(self.chunks, mesh.pp_group, schedule=schedule,
                                     num_microbatches=num_microbatches, record_timeline=record_timeline,
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
        norm, coef = self._clip()
        if self.zero:
            self.optimizer.step(clip_coef=coef)
        else:
            self.optimizer.step()
        loss = loss.detach().to(torch.float64).reshape(1)
        if self.mesh.dp > 1:
            C.all_reduce(loss, self.mesh.dp_group)
            loss /= self.mesh.dp
        return {"loss": loss.item(), "grad_norm": None if norm is None else float(norm)}

    def _clip(self):
        if self.max_grad_norm is None:
            return None, None
        groups = [self.mesh.pp_group] if self.mesh.pp > 1 else []
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
            return clip_grad_norm_(items, self.max_grad_norm, groups=groups, tp_group=self.tp_group, apply=False)
        items = [p for p in self.dp.buffer.params if id(p) not in self._dup]
        norm, coef = clip_grad_norm_(items, self.max_grad_norm, groups=groups, tp_group=self.tp_group, apply=False)
        # every gradient is scaled, the last stage's tied copy included (it was only left out of the norm)
        torch._foreach_mul_([p.main_grad for p in self.dp.buffer.params], coef.to(self.dp.buffer.grad_dtype))
        return norm, coef

    # ------------------------------------------------------------------ inspection
    def dense_state_dict(self) -> dict:
        """The parameters of this rank's stages under the full ``GPT``'s names, gathered over TP (a
        collective over the tp group)."""
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


__all__ = ["Parallel3D"]
