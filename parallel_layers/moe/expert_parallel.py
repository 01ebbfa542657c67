"""Expert parallelism: the experts of an MoE layer sharded over a process group, tokens sent to them and back.

:class:`ExpertParallelMoE` is :class:`~.layer.MoELayer` with its ``E`` routed experts split over the
expert-parallel group of ``ep`` ranks: group rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)`` (a
:class:`~.experts.GroupedExperts` of ``E/ep``), while the router and the shared experts are replicated. Each
rank passes its own tokens (ranks hold different tokens, as data-parallel ranks do):

1. route and :func:`~.permute.permute` locally, by global expert id: the rows are grouped by destination rank,
   then by expert within it (a rank's experts have consecutive ids);
2. exchange the counts: an all-to-all of the ``[ep, E/ep]`` rows per (destination rank, expert), so each rank
   knows how many rows it receives from each peer, and for which of its experts;
3. dispatch: an uneven all-to-all of the permuted rows (:func:`all_to_all_rows`);
4. the received rows come grouped by source rank, then by expert: a stable sort by local expert makes each
   expert's rows contiguous (a source's rows in order, sources in rank order: with the batch split over the
   ranks in order, an expert sees its rows in the one-process order), the local experts run, and the rows
   go back to the order they came in;
5. combine: the reverse uneven all-to-all, then :func:`~.permute.unpermute` with the router weights, plus the
   shared experts.

Per forward: one all-to-all of ``ep * E/ep`` counts, two uneven all-to-alls of rows, one host sync for their
sizes, and one all-reduce of at most ``2E + 2`` fp64 numbers when the load-balancing or z loss is on and
``aux_loss_group`` is set (``E + 1``, plus ``E`` with the load-balancing loss, plus 1 with the z loss). Per
backward: two uneven all-to-alls (:func:`all_to_all_rows`' backward is the reverse all-to-all of the gradient),
nothing else.

Bytes rank ``r`` sends to other ranks per forward (rows for its own experts stay on it): the counts, ``E/ep``
int64 to each of the ``ep - 1`` peers; the dispatch, ``n_out * H * s`` bytes, ``n_out`` the assignments of
``r``'s tokens (those kept after capacity) to other ranks' experts, ``H`` the hidden size and ``s`` the element
size; the combine, ``n_in * H * s``, ``n_in`` the other ranks' assignments to ``r``'s experts. The backward
sends the same two again, swapped (the combine's gradient ``n_out`` rows, the dispatch's ``n_in``). Over all
ranks ``sum n_out == sum n_in``: dispatch and combine move the same bytes, though a rank whose experts are
popular sends more in the combine than in the dispatch. ``benchmarks/moe.py`` prints these counted beside the
formula; ``tests/test_moe_bytes.py`` holds the layer to it.

Capacity (``capacity_factor``) is applied on each rank's own tokens, as the one-process layer applies it to
the tokens it is given. The losses: in one process the load-balancing loss of a batch takes ``f`` and ``P``
over all its tokens. With ``aux_loss_group`` (by default the ep group: the group the batch is split over, e.g.
a group spanning data and expert parallelism when tokens differ along both), the per-expert assignments,
probability sums, z sums and token counts are all-reduced over that group, so every rank's ``aux_loss`` has
the whole batch's value, and its gradient with respect to the rank's own logits is that of the whole-batch
loss (see :func:`~.router._batch_sums`). Summing the replicated parameters' gradients over that group (as the
data-parallel reduction does) then gives the one-process gradient of the whole batch's loss: add ``aux_loss``
once per rank to a loss whose gradients are summed over the group (a loop that averages them over the group's
``n`` ranks instead adds ``n * aux_loss``). ``aux_loss_group=None``: each rank's losses over its own tokens only.

Expert parameters carry ``expert_parallel = True``: their gradients are complete on their rank (no
reduction over ep); :meth:`ExpertParallelMoE.replicated_parameters` are the others.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed import collectives as C
from .experts import GroupedExperts
from .layer import (
    MoELayer,
    add_shared_experts,
    attach_aux_loss,
    check_layer_input,
    check_layer_options,
    shared_experts,
    summed_over,
)
from .meta import balanced
from .permute import permute, unpermute
from .router import Router

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send: List[int], recv: List[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return C.all_to_all_uneven(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_to_all_uneven(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all_rows(x: torch.Tensor, send: Sequence[int], recv: Sequence[int], group) -> torch.Tensor:
    """:func:`~parallel_layers.distributed.collectives.all_to_all_uneven` with autograd: ``send[j]`` rows of
    ``x`` to group rank ``j``, ``recv[i]`` rows from rank ``i``; the backward sends the gradient back the
    same way (``recv[i]`` rows to rank ``i``, ``send[j]`` from rank ``j``)."""
    return _AllToAllRows.apply(x, [int(s) for s in send], [int(s) for s in recv], group)


def _check_ep_group(layer: str, group) -> int:
    if group is None:
        raise ValueError(f"{layer}: ep_group is required (the expert-parallel process group, e.g. "
                         f"torch.distributed.new_group(ranks)); there is no implicit global group")
    if not dist.is_initialized():
        raise RuntimeError(f"{layer}: torch.distributed is not initialised")
    return dist.get_world_size(group)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


class ExpertParallelMoE(nn.Module):
    """:class:`~.layer.MoELayer` with its experts sharded over ``ep_group`` (see the module docstring).

    ``forward(x [..., hidden_size]) -> [..., hidden_size]`` on this rank's tokens. Arguments as
    :class:`~.layer.MoELayer` takes them, plus ``ep_group`` (its size must divide ``num_experts``) and
    ``aux_loss_group``: ``"ep"`` (default: the ep group), another group over which the batch is split, or None
    (losses over this rank's tokens). With the same seed on every rank the parameters are those of
    ``MoELayer(same arguments)`` built from that seed: the router and shared experts alike, this rank's slice
    of the experts (each expert is drawn in turn, the other ranks' discarded). :meth:`from_dense` copies a
    built :class:`~.layer.MoELayer`; from transformers: ``from_dense(MoELayer.from_hf_mixtral(block), group)``.

    After a forward, ``aux_loss`` and ``stats`` as :class:`~.layer.MoELayer` sets them (``counts``: this rank's
    tokens' assignments per expert, all ``E``; ``dropped``: this rank's), plus ``stats["received"]``: the rows
    each local expert processed, from all ranks.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, *, ep_group,
                 aux_loss_group="ep", scoring: str = "softmax", norm_topk_prob: bool = True,
                 routed_scaling_factor: float = 1.0, capacity_factor: Optional[float] = None,
                 aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0, num_shared_experts: int = 0,
                 shared_intermediate_size: Optional[int] = None, shared_expert_gate: bool = False,
                 activation: str = "silu", backend: str = "auto", device=None, dtype=None):
        super().__init__()
        name = type(self).__name__
        check_layer_options(name, hidden_size, intermediate_size, num_experts, top_k, scoring=scoring,
                            capacity_factor=capacity_factor, aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef,
                            num_shared_experts=num_shared_experts, shared_expert_gate=shared_expert_gate,
                            activation=activation, backend=backend)
        ep = _check_ep_group(name, ep_group)
        if num_experts % ep:
            sizes = " or ".join(str(s) for s in ((num_experts // ep) * ep, (num_experts // ep + 1) * ep) if s)
            raise ValueError(f"{name}: num_experts={num_experts} does not divide by the expert-parallel size {ep} "
                             f"(the size of ep_group; each rank holds num_experts / ep experts); choose num_experts "
                             f"a multiple of {ep} (e.g. {sizes}) or an ep_group whose size divides {num_experts} "
                             f"(e.g. {_divisors(num_experts)})")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep, C.rank(ep_group)
        if isinstance(aux_loss_group, str) and aux_loss_group != "ep":
            raise ValueError(f"{name}: aux_loss_group={aux_loss_group!r} must be 'ep' (the ep_group), a process "
                             f"group over which the batch is split, or None (each rank's own tokens)")
        self.aux_loss_group = ep_group if isinstance(aux_loss_group, str) else aux_loss_group
        self.num_local_experts = num_experts // ep
        self.first_expert = self.ep_rank * self.num_local_experts
        kw = dict(device=device, dtype=dtype)
        self.router = Router(hidden_size, num_experts, top_k, scoring=scoring, norm_topk_prob=norm_topk_prob,
                             routed_scaling_factor=routed_scaling_factor, capacity_factor=capacity_factor,
                             aux_loss_coef=aux_loss_coef, z_loss_coef=z_loss_coef, **kw)
        self.experts = GroupedExperts(self.num_local_experts, hidden_size, intermediate_size, activation=activation,
                                      backend=backend, device="meta", dtype=dtype)
        self.experts.to_empty(device=device if device is not None else torch.get_default_device())
        self._init_local_experts()
        self._mark_experts()
        self.shared_expert, self.shared_expert_gate = shared_experts(
            hidden_size, intermediate_size, num_shared_experts, shared_intermediate_size, shared_expert_gate,
            activation, **kw)
        self.aux_loss: Optional[torch.Tensor] = None
        self.aux_loss_scale: Optional[float] = None
        self.stats: Dict[str, Optional[torch.Tensor]] = {}

    def _mark_experts(self) -> None:
        for p in self.experts.parameters():
            p.expert_parallel = True

    @torch.no_grad()
    def _init_local_experts(self) -> None:
        """This rank's slice of what :meth:`GroupedExperts.reset_parameters` draws for all ``E`` experts."""
        lo, hi = self.first_expert, self.first_expert + self.num_local_experts
        for name in EXPERT_WEIGHTS:
            local = getattr(self.experts, name)
            if local.device.type == "meta":
                continue
            scratch = torch.empty_like(local[0])
            for e in range(self.num_experts):
                nn.init.kaiming_uniform_(scratch, a=math.sqrt(5))
                if lo <= e < hi:
                    local[e - lo].copy_(scratch)

    @classmethod
    def from_dense(cls, layer: MoELayer, ep_group, *, aux_loss_group="ep") -> "ExpertParallelMoE":
        """The expert-parallel copy of ``layer``: the router and shared experts whole, this rank's experts
        ``[r*E/ep, (r+1)*E/ep)``; same dtype and device."""
        if not isinstance(layer, MoELayer):
            raise TypeError(f"{cls.__name__}.from_dense: expected an MoELayer, got {type(layer).__name__}")
        router, experts, shared = layer.router, layer.experts, layer.shared_expert
        options = dict(scoring=router.scoring, norm_topk_prob=router.norm_topk_prob,
                       routed_scaling_factor=router.routed_scaling_factor, capacity_factor=router.capacity_factor,
                       aux_loss_coef=router.aux_loss_coef, z_loss_coef=router.z_loss_coef,
                       num_shared_experts=int(shared is not None),
                       shared_intermediate_size=shared.gate_proj.out_features if shared is not None else None,
                       shared_expert_gate=layer.shared_expert_gate is not None, activation=experts.activation,
                       backend=experts.backend)
        weight = router.weight
        ep = cls(layer.hidden_size, experts.intermediate_size, layer.num_experts, layer.top_k, ep_group=ep_group,
                 aux_loss_group=aux_loss_group, device="meta", dtype=weight.dtype, **options)
        ep = ep.to_empty(device=weight.device)                     # new parameters: marked again below
        ep._mark_experts()
        lo, hi = ep.first_expert, ep.first_expert + ep.num_local_experts
        state = {k: v[lo:hi] if k.startswith("experts.") else v for k, v in layer.state_dict().items()}
        if weight.device.type != "meta":                           # meta: shapes only, nothing to copy
            ep.load_state_dict(state)
        for mine, theirs in zip(ep.parameters(), layer.parameters()):
            mine.requires_grad_(theirs.requires_grad)
        ep.aux_loss_scale = layer.aux_loss_scale
        return ep

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(type(self).__name__, x, self.hidden_size, self.router.weight.dtype)
        tokens = x.reshape(-1, self.hidden_size)
        routing = self.router(tokens, summed_over(self.aux_loss_group))
        permuted, order, counts = permute(tokens, routing.experts, self.num_experts)
        expert_out, received = self._run_experts(permuted, counts)
        out = unpermute(expert_out, order, routing.weights, tokens.shape[0])
        out = add_shared_experts(out, tokens, self.shared_expert, self.shared_expert_gate)
        out = attach_aux_loss(out, routing.loss, self.aux_loss_scale)
        self.aux_loss = routing.loss
        self.stats = {"aux_loss": routing.aux_loss, "z_loss": routing.z_loss, "counts": routing.counts,
                      "dropped": routing.dropped, "experts": routing.experts, "received": received}
        return out.reshape(x.shape)

    def _run_experts(self, permuted: torch.Tensor, counts: torch.Tensor):
        """Steps 2-5 of the module docstring: ``permuted [N, H]`` (rows by global expert, ``counts [E]``) ->
        the experts' outputs in the same order, and the rows each local expert processed."""
        ep, local = self.ep_size, self.num_local_experts
        if ep == 1:
            return self.experts(permuted, counts), counts
        sent = counts.view(ep, local)
        got = C.all_to_all_dim0(sent.contiguous(), self.ep_group)       # [source rank, local expert]
        if permuted.is_meta:                                           # the planner's probe: balanced load
            send = recv = balanced(permuted.shape[0], ep)
        else:
            sizes = torch.cat([sent.sum(1), got.sum(1)]).tolist()      # the one host sync: the rows per peer
            send, recv = sizes[:ep], sizes[ep:]
        rows = all_to_all_rows(permuted, send, recv, self.ep_group)
        received = got.sum(0)
        if local == 1:                                                 # one expert: already contiguous
            return all_to_all_rows(self.experts(rows, received), recv, send, self.ep_group), received
        expert_of_row = torch.arange(local, device=counts.device).repeat(ep)
        expert_of_row = torch.repeat_interleave(expert_of_row, got.reshape(-1), output_size=rows.shape[0])
        by_expert = torch.argsort(expert_of_row, stable=True)
        out = self.experts(rows.index_select(0, by_expert), received)
        out = torch.empty_like(out).index_copy(0, by_expert, out)     # back to the order the rows came in
        return all_to_all_rows(out, recv, send, self.ep_group), received

    # ------------------------------------------------------------------ parameters
    def replicated_parameters(self) -> List[nn.Parameter]:
        """The router's and shared experts' parameters: the same on every rank, their gradients each rank's
        part (sum them over the group the batch is split over, as data parallelism does)."""
        experts = {id(p) for p in self.experts.parameters()}
        return [p for p in self.parameters() if id(p) not in experts]

    def _gather_experts(self, grad: bool) -> Dict[str, torch.Tensor]:
        out = {}
        for name in EXPERT_WEIGHTS:
            p = getattr(self.experts, name)
            t = p.detach() if not grad else (p.grad if p.grad is not None else torch.zeros_like(p))
            out[f"experts.{name}"] = C.all_gather_dim0(t.contiguous(), self.ep_group)
        return out

    def dense_expert_weights(self) -> Dict[str, torch.Tensor]:
        """Every rank's experts gathered over ep (a collective): ``{"experts.gate_proj": [E, I, H], ...}``, as
        :class:`~.layer.MoELayer` names and shapes them."""
        return self._gather_experts(grad=False)

    def dense_expert_grads(self) -> Dict[str, torch.Tensor]:
        """The experts' gradients gathered over ep (a collective), as :meth:`dense_expert_weights` (zeros for a
        parameter with no gradient yet)."""
        return self._gather_experts(grad=True)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_experts={self.num_experts} ({self.num_local_experts} on this "
                f"rank of ep={self.ep_size}: {self.first_expert}..{self.first_expert + self.num_local_experts - 1})"
                f", top_k={self.top_k}")


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert's parameter (flagged by :class:`ExpertParallelMoE`), held by its
    expert-parallel rank only."""
    return bool(getattr(p, "expert_parallel", False))


def moe_layers(model: nn.Module) -> List[nn.Module]:
    """Every Mixture-of-Experts layer of ``model`` (:class:`MoELayer` or :class:`ExpertParallelMoE`)."""
    return [m for m in model.modules() if isinstance(m, (MoELayer, ExpertParallelMoE))]


def shard_experts(model: nn.Module, ep_group, aux_loss_group) -> int:
    """Replace every :class:`MoELayer` of ``model`` (in place) by its :class:`ExpertParallelMoE` over
    ``ep_group``: this rank's experts only (on the meta device too: the planner's probe, or another
    pipeline stage's layer, dropped later). Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MoELayer):
                setattr(parent, name, ExpertParallelMoE.from_dense(child, ep_group, aux_loss_group=aux_loss_group))
                replaced += 1
    return replaced
