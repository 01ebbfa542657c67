"""The model-level router loss transformers adds to an MoE model's loss with ``output_router_logits=True``,
reproduced for the ``MoELayer``s :func:`~.hf_swap.swap_hf_moe_blocks` put in its blocks, at any pipeline size.

:class:`HFRouterLoss` reproduces ``router_aux_loss_coef * load_balancing_loss_func(router logits of every
layer)``: ``E * sum_e (C_e / R) * (P_e / R)`` with ``C_e`` the top-k assignments to expert ``e`` and ``P_e`` its
softmax probabilities, both summed over ALL layers and tokens, and ``R`` = layers x tokens (not the sum of
per-layer losses). Each layer's router records its ``C``, token count and ``P`` (summed over the replicas with
the layer's ``sum_over_batch``); the gradient ``coef * E * C / R^2`` of each probability needs every layer's
``C``, so it is injected in the layer's backward (through the routing weights), once the whole micro-batch's
forward has recorded them.

With pipeline parallelism the layers are on several stages; every stage's forward of a micro-batch comes
before any stage's backward of it, so the sums can be carried along the pipeline (:class:`PipelineRelay`):
each stage adds its layers' ``[C, R, P]`` to what the previous stage sent and sends it on, the last stage
holds the whole micro-batch's, and each stage's backward receives those totals from the next stage before
its layers' backward runs and passes them back. Two process groups of their own carry them (one per
direction, so that neither direction's messages queue behind the other's under NCCL's in-order rules), in
the order every schedule runs a stage's micro-batches, forward and backward alike.

Activation checkpointing: the recomputation runs the hook's operations again but records nothing (backward
runs the forward's own nodes, which hold the forward's record). A capacity factor is refused (the HF loss
counts the choice before any drop).

Padding: the HF loss leaves padded tokens out of ``C``, ``P`` and ``R``; so do the hooks, reading each
micro-batch's ``attention_mask`` side input (``[batch, seq]``) off the chunk's call (refused with context
parallelism, whose shards that mask does not follow).
"""
from __future__ import annotations

import collections
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from ..activations.recompute import recomputing


class _Record:
    """One micro-batch's router statistics on one chunk: layer index -> ``[C (E), tokens, P (E)]`` fp64, over
    the replicas; ``total``: the whole model's sums, once known (with a pipeline: carried by the relay)."""

    def __init__(self):
        self.slots: Dict[int, torch.Tensor] = {}
        self.total: Optional[torch.Tensor] = None
        self.relayed = False             # the relay has taken this chunk's sums (a new micro-batch starts anew)

    def local_sum(self, size: int, device) -> torch.Tensor:
        if not self.slots:
            return torch.zeros(size, dtype=torch.float64, device=device)
        return torch.stack(list(self.slots.values())).sum(0)

    def totals(self, num_experts: int):
        total = self.total
        return total[:num_experts].float(), total[num_experts].clamp(min=1).float(), total[num_experts + 1:].float()


class _InjectRouterLoss(torch.autograd.Function):
    """Identity on the routing weights; the backward also sends ``scale * coef * E * C / R^2`` (every layer's
    ``C`` and ``R``, read from the record at backward time) into this layer's local probability sums."""

    @staticmethod
    def forward(ctx, weights, p_local, record, owner, scale: float):
        ctx.record, ctx.owner, ctx.scale = record, owner, scale
        return weights

    @staticmethod
    def backward(ctx, grad):
        owner, record = ctx.owner, ctx.record
        if record.total is None:
            raise RuntimeError(f"HFRouterLoss: a backward met {len(record.slots)} of the {owner.num_layers} MoE "
                               f"layers' router statistics of its micro-batch; the model-level router loss needs every "
                               f"layer's forward before any backward")
        counts, rows, _ = record.totals(owner.num_experts)
        d_p = (ctx.scale * owner.coef * owner.num_experts) * counts / rows.square()
        return grad, d_p, None, None, None


class HFRouterLoss:
    """transformers' ``router_aux_loss_coef * load_balancing_loss_func`` over ``layers`` (see the module
    docstring). ``value``: the last micro-batch's ``load_balancing_loss_func`` (without the coefficient), the
    number the HF model returns as ``aux_loss``."""

    def __init__(self, layers: List[nn.Module], coef: float):
        self.coef, self.num_layers = float(coef), len(layers)
        self.layers = list(layers)
        self.num_experts = layers[0].num_experts
        self.chunk_of: Dict[int, int] = {}           # layer index -> this rank's chunk (a pipeline; else 0)
        self.current: Dict[int, _Record] = {}        # chunk -> the record of the micro-batch it runs now
        self.last: Optional[_Record] = None
        self.relay: Optional[PipelineRelay] = None
        self.masks: Dict[int, Optional[torch.Tensor]] = {}    # chunk -> its micro-batch's attention_mask
        for index, layer in enumerate(layers):
            layer.router.register_forward_hook(self._hook(index, layer))

    @property
    def stats_size(self) -> int:
        return 2 * self.num_experts + 1

    def _hook(self, index: int, layer: nn.Module):
        def hook(router, args, routing):
            if not torch.is_grad_enabled():          # evaluation: the loss is not part of the reported one
                return None
            tokens, sum_over_batch = args[0], (args[1] if len(args) > 1 else None)
            chunk = self.chunk_of.get(index, 0)
            keep = self._kept_tokens(chunk, tokens.shape[0])
            probs = torch.softmax(router.logits(tokens).float(), dim=-1)
            p_local = (probs if keep is None else probs * keep[:, None]).sum(0)
            scale = 1.0 if layer.aux_loss_scale is None else layer.aux_loss_scale
            if recomputing():        # activation checkpointing: the forward's record is the one its nodes use
                return routing._replace(weights=_InjectRouterLoss.apply(routing.weights, p_local,
                                                                        self.current[chunk], self, scale))
            if keep is None:
                counts, rows = routing.counts.to(torch.float64), float(tokens.shape[0])
            else:                    # padded tokens left out, as transformers' loss leaves them out
                chosen = routing.experts[keep.bool()]
                counts = torch.bincount(chosen[chosen >= 0], minlength=self.num_experts).to(torch.float64)
                rows = float(keep.sum())
            stats = torch.cat([counts, torch.full((1,), rows, dtype=torch.float64, device=tokens.device),
                               p_local.detach().to(torch.float64)])
            if sum_over_batch is not None:
                stats = sum_over_batch(stats)
            record = self.current.get(chunk)
            if record is None or record.relayed or index in record.slots:   # a new micro-batch
                record = self.current[chunk] = _Record()
            record.slots[index] = stats
            if self.relay is None and len(record.slots) == self.num_layers:
                record.total = record.local_sum(self.stats_size, tokens.device)
                self.last = record
            return routing._replace(weights=_InjectRouterLoss.apply(routing.weights, p_local, record, self, scale))
        return hook

    def watch(self, chunks: Sequence[nn.Module]) -> None:
        """This rank's pipeline chunks (stages): which layers each holds, and the padding mask of the micro-batch
        each runs (its ``attention_mask`` side input: ``[batch, seq]``, 0 where padded)."""
        index_of = {id(layer): i for i, layer in enumerate(self.layers)}
        for c, chunk in enumerate(chunks):
            for m in chunk.modules():
                if id(m) in index_of:
                    self.chunk_of[index_of[id(m)]] = c
            chunk.register_forward_pre_hook(self._mask_hook(c), with_kwargs=True)

    def _mask_hook(self, chunk: int):
        def hook(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            self.masks[chunk] = mask if torch.is_tensor(mask) and mask.dim() == 2 else None
        return hook

    def _kept_tokens(self, chunk: int, num_tokens: int) -> Optional[torch.Tensor]:
        """The chunk's micro-batch's padding mask as one float per token (the layer's rows: batch x sequence),
        None without padding."""
        mask = self.masks.get(chunk)
        if mask is None or bool((mask != 0).all()):
            return None
        if mask.numel() != num_tokens:
            raise ValueError(f"HFRouterLoss: an attention_mask of shape {tuple(mask.shape)} for {num_tokens} tokens "
                             f"of an MoE layer; pass the [batch, sequence] mask of the input ids")
        return (mask.reshape(-1) != 0).to(torch.float32)

    def relay_over_pipeline(self, chunks: Sequence[nn.Module], stages: Sequence[int], num_stages: int,
                            place_of, groups: Tuple[object, object], device) -> None:
        """Carry the sums along the pipeline (see the module docstring): ``chunks`` this rank's stages
        (``stages[c]`` the global stage of chunk ``c``, watched by :meth:`watch`), ``place_of(stage) -> (pipeline
        rank, chunk)``, ``groups`` two process groups of the pipeline ranks (forward, backward messages)."""
        self.relay = PipelineRelay(self, stages, num_stages, place_of, groups, device)
        for c, chunk in enumerate(chunks):
            chunk.register_forward_hook(self.relay.boundary_hook(c))

    def finish_step(self) -> None:
        """End of a training step: wait for the relay's sends."""
        if self.relay is not None:
            self.relay.drain()

    @property
    def value(self) -> Optional[float]:
        if self.last is None:
            return None
        counts, rows, probs = self.last.totals(self.num_experts)
        return float(self.num_experts * torch.sum((counts / rows) * (probs / rows)))


class _Boundary(torch.autograd.Function):
    """Identity on a stage's output; its backward (the first of the stage's) hands the micro-batch's totals
    to the stage's record before any of its layers' backward runs. A zero-bubble schedule's second backward
    call on the same graph finds them there already."""

    @staticmethod
    def forward(ctx, out, relay, chunk: int, record):
        ctx.relay, ctx.chunk, ctx.record = relay, chunk, record
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        if ctx.record.total is None:
            ctx.relay.backward(ctx.chunk, ctx.record)
        return grad, None, None, None


class PipelineRelay:
    """The router sums of each micro-batch carried forward stage by stage, the totals carried back (see the
    module docstring). A stage on this rank next to another on this rank hands them over locally."""

    def __init__(self, owner: HFRouterLoss, stages: Sequence[int], num_stages: int, place_of,
                 groups: Tuple[object, object], device):
        from ..pipeline.p2p import P2P
        self.owner, self.stages, self.num_stages, self.place_of = owner, list(stages), num_stages, place_of
        self.forward_p2p, self.backward_p2p = (P2P(g, device, background=False) for g in groups)
        self.device = device
        self.local: Dict[Tuple[str, int], collections.deque] = collections.defaultdict(collections.deque)

    def boundary_hook(self, chunk: int):
        def hook(module, args, output):
            if not torch.is_grad_enabled():
                return None
            record = self.owner.current.get(chunk)
            if record is None or record.relayed:         # a chunk without MoE layers
                record = self.owner.current[chunk] = _Record()
            self.forward(chunk, record)
            return _wrap_first_tensor(output, lambda t: _Boundary.apply(t, self, chunk, record))
        return hook

    def _receive(self, p2p, direction: str, stage: int, peer_stage: int) -> torch.Tensor:
        rank, _ = self.place_of(peer_stage)
        if rank == self.place_of(stage)[0]:
            return self.local[(direction, peer_stage)].popleft()
        buf = torch.empty(self.owner.stats_size, dtype=torch.float64, device=self.device)
        p2p.wait(p2p.post([("recv", buf, rank, f"the router-loss sums of stage {peer_stage} ({direction})")]))
        return buf

    def _send(self, p2p, direction: str, stage: int, peer_stage: int, t: torch.Tensor) -> None:
        rank, _ = self.place_of(peer_stage)
        if rank == self.place_of(stage)[0]:
            self.local[(direction, stage)].append(t)
        else:
            p2p.post([("send", t, rank, f"the router-loss sums to stage {peer_stage} ({direction})")])

    def forward(self, chunk: int, record: _Record) -> None:
        stage = self.stages[chunk]
        record.relayed = True
        sums = record.local_sum(self.owner.stats_size, self.device)
        if stage > 0:
            sums = sums + self._receive(self.forward_p2p, "forward", stage, stage - 1)
        if stage < self.num_stages - 1:
            self._send(self.forward_p2p, "forward", stage, stage + 1, sums)
        else:                                            # the last stage: the whole micro-batch's, sent back
            self._set_total(stage, record, sums)

    def backward(self, chunk: int, record: _Record) -> None:
        stage = self.stages[chunk]
        self._set_total(stage, record, self._receive(self.backward_p2p, "backward", stage, stage + 1))

    def _set_total(self, stage: int, record: _Record, total: torch.Tensor) -> None:
        record.total = total
        self.owner.last = record
        if stage > 0:
            self._send(self.backward_p2p, "backward", stage, stage - 1, total)

    def drain(self) -> None:
        self.forward_p2p.drain()
        self.backward_p2p.drain()


def _wrap_first_tensor(output, fn):
    """``output`` with its first tensor that requires grad passed through ``fn`` (a stage returns its hidden
    states, or the last one its loss: a tensor or a tuple of them)."""
    if torch.is_tensor(output):
        return fn(output) if output.requires_grad else output
    if isinstance(output, tuple):
        for i, t in enumerate(output):
            if torch.is_tensor(t) and t.requires_grad:
                return output[:i] + (fn(t),) + output[i + 1:]
    return output


def hf_router_loss(model: nn.Module, layers: List[nn.Module]) -> Optional[HFRouterLoss]:
    """The model-level router loss of an HF model whose blocks were swapped, when its config says
    ``output_router_logits=True`` (else None); a ValueError naming the setting and the fix where it cannot
    be reproduced."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not layers:
        return None
    if any(getattr(layer.router, "capacity_factor", None) is not None for layer in layers):
        raise ValueError("Parallel3D: output_router_logits=True with a capacity factor: transformers' loss counts "
                         "the choice before any drop; use capacity_factor=None")
    return HFRouterLoss(layers, getattr(model, "router_aux_loss_coef", config.router_aux_loss_coef))


def check_padding(side: Mapping[str, object], cp: int) -> None:
    """The HF router loss leaves padded tokens out (the hooks read each micro-batch's ``attention_mask``);
    with context parallelism a rank's tokens are a zigzag share of each sequence, which that mask does not
    follow: refuse padding there."""
    mask = side.get("attention_mask")
    if cp > 1 and torch.is_tensor(mask) and mask.dim() == 2 and not bool((mask != 0).all()):
        raise ValueError(f"Parallel3D.train_step: output_router_logits=True with padding (an attention_mask with "
                         f"zeros) at cp={cp}: transformers' router loss leaves padded tokens out, which is not done "
                         f"for context-parallel shards; pack the sequences without padding, train with cp=1, or set "
                         f"config.output_router_logits=False")


__all__ = ["HFRouterLoss", "PipelineRelay", "hf_router_loss", "check_padding"]
