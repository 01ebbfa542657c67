"""How :class:`~parallel_layers.composition.parallel3d.Parallel3D` keeps its data-parallel replicas in step: one class
per mode, behind one small interface, so the 3D step is the same code for every ZeRO stage.

=====================  ==========================  ======================================================
mode                   gradients over dp           optimizer
=====================  ==========================  ======================================================
:class:`Replicated`    all-reduce (DataParallel)   ``torch.optim.AdamW`` on the full parameters
:class:`ShardedGrads`  reduce-scatter (ZeRO 1, 2)  :class:`~parallel_layers.zero.ZeroOptimizer` (shard)
:class:`ShardedParams` reduce-scatter (ZeRO 3)     :class:`~parallel_layers.zero.ZeroStage3Optimizer`
=====================  ==========================  ======================================================

Expert parallelism (``ep > 1``): the experts of each MoE layer (parameters flagged ``expert_parallel``) are
held by the ranks of one expert-data-parallel group (``expert_group``: dp x cp, ep left out), the dense
parameters by the whole replica group (dp x ep x cp). The bucketed modes keep two gradient buffers, one per
group: the experts' in their own ``DataParallel`` (``expert_dp``), reduced (or ZeRO-sharded, their optimizer
state with them) over the expert group, each expert's reduced gradient then divided by ``ep`` (it holds the
tokens of all ``ep`` ranks' micro-batches, each already weighted for an average over dp x ep x cp). ZeRO-3
shards the experts with a second ``ZeroStage3`` over the expert group (the first ``ignore``s them).

A step, as ``Parallel3D`` drives it: :meth:`begin_step`; the pipeline runs inside :meth:`accumulating`
(every microbatch's backward only accumulates); :meth:`reduce` sums the tp-partial gradients of
replicated parameters over tp (per-head q/k norms: :func:`~parallel_layers.tensor_parallel.partial_grads`),
the tied weights' gradients over the first and last stage, and reduces over dp once;
:meth:`norm_pieces` gives the gradient pieces this rank counts in the global norm (and whether they are
shards, so the norm sums them over dp); :meth:`step` applies the clip coefficient, the loss scale and the skip flag.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence, Set

import torch
import torch.nn as nn

from ..data_parallel.ddp import DataParallel
from ..distributed import collectives as C
from ..moe.expert_parallel import is_expert
from ..tensor_parallel.partial_grads import partial_grad_params, sum_partial_grads
from ..zero.optimizer import ZeroOptimizer
from ..zero.stage3 import ZeroStage3
from ..zero.stage3_optimizer import ZeroStage3Optimizer
from .config import DataParallelConfig, OptimizerConfig


def _flagged(piece: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    piece.tensor_parallel = bool(getattr(p, "tensor_parallel", False))
    return piece


def _torch_adamw_groups(model: nn.Module, weight_decay: float, no_decay) -> list:
    if no_decay is None:
        return [{"params": [p for p in model.parameters() if p.requires_grad]}]
    decay, plain = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (plain if no_decay(name, p) else decay).append(p)
    return [{"params": decay}, {"params": plain, "weight_decay": 0.0}]


class _Subset(nn.Module):
    """Some of a module's parameters (and, with ``buffers``, all its buffers), as a module whose
    ``named_parameters`` lists only those: what a ``DataParallel`` over one kind of parameter wraps."""

    def __init__(self, module: nn.Module, keep, buffers: bool):
        super().__init__()
        self._kept = [(n, p) for n, p in module.named_parameters() if keep(p)]
        self._kept_buffers = list(module.buffers()) if buffers else []

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return iter([(prefix + n, p) for n, p in self._kept])

    def parameters(self, recurse: bool = True):
        return iter([p for _, p in self._kept])

    def buffers(self, recurse: bool = True):
        return iter(self._kept_buffers)


class _Joint:
    """Two ZeRO optimizers (the dense parameters' and the experts') driven as one: the step, the clip
    coefficient and the skip flag reach both; ``param_groups`` lists both's groups (an LR scheduler sets
    each); the state dict holds both."""

    def __init__(self, dense, experts, names):
        self.parts = (dense, experts)
        self.names = names              # each part's parameter names (those its full state dict uses)

    @property
    def steps_taken(self) -> int:
        return self.parts[0].steps_taken

    def full_state_dict(self) -> dict:
        """Both parts' full state dicts as one (collectives over each part's group): ``state`` by parameter
        name, the step count."""
        dense, experts = (o.full_state_dict() for o in self.parts)
        return {**dense, "state": {**dense["state"], **experts["state"]}}

    def load_full_state_dict(self, state: dict) -> None:
        for o, names in zip(self.parts, self.names):
            o.load_full_state_dict({"step": state["step"],
                                    "state": {n: v for n, v in state["state"].items() if n in names}})

    @property
    def param_groups(self) -> list:
        return [g for o in self.parts for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.parts for k, v in o.state.items()}

    def zero_grad(self, *args, **kwargs) -> None:
        for o in self.parts:
            o.zero_grad(*args, **kwargs)

    def step(self, **kwargs) -> None:
        for o in self.parts:
            o.step(**kwargs)

    def state_dict(self) -> dict:
        return {"dense": self.parts[0].state_dict(), "experts": self.parts[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.parts[0].load_state_dict(state["dense"])
        self.parts[1].load_state_dict(state["experts"])

    def memory_report(self) -> dict:
        reports = [o.memory_report() for o in self.parts]
        same = ("stage", "dp_size", "dp_rank")        # the dense optimizer's; the sizes add up
        return {k: reports[0][k] + reports[1][k] if k not in same and isinstance(reports[0][k], (int, float))
                else reports[0][k] for k in reports[0]}

    def close_offload(self) -> None:
        for o in self.parts:
            getattr(o, "close_offload", lambda: None)()


class ReplicaMode:
    """The interface (see the module docstring). ``model``: this rank's stages in one ``nn.ModuleList``;
    ``tied``: the weights tied between the first and last stage that this rank holds; ``duplicates``:
    ids of those that are the last stage's copy (left out of the norm, the first stage counts them);
    ``tp_group``: where the tp-partial gradients of replicated parameters are summed."""
    zero: int
    optimizer: torch.optim.Optimizer
    shards_grads = False            # gradient pieces are disjoint over dp (the norm sums them over dp)
    replicated_over_dp = True       # every dp replica holds whole parameters (not ZeRO-3's shards)

    def __init__(self, model: nn.Module, dp_group, tied: Sequence[nn.Parameter], duplicates: Set[int],
                 tied_group, tp_group=None):
        self.model, self.dp_group, self.tp_group = model, dp_group, tp_group
        self.tied, self.duplicates, self.tied_group = list(tied), set(duplicates), tied_group
        self.partial = partial_grad_params(model) if tp_group is not None else []

    def _grad_of(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """Where ``p``'s accumulated gradient of this step is, before the reduction over dp."""
        return p.grad

    def sum_partial_grads(self) -> None:
        """Sum the tp-partial gradients of replicated parameters over tp (before anything reads them)."""
        if self.partial:
            sum_partial_grads([self._grad_of(p) for p in self.partial], self.tp_group)

    def sum_tied_grads(self) -> None:
        """Sum the tied weights' gradients over the first and last stage, so that the reduction over dp then
        gives both copies the same bits. With more than two dp ranks the buckets' reduction would add a
        tied weight's gradients in an order set by where it lies in this stage's buckets, which differs
        between the two stages (a rounding apart after one step, Gemma at dp 4): there it is reduced over
        dp on its own first (the same layout on both stages), and the buckets add exact zeros to it."""
        grads = [self._tied_grad(p) for p in self.tied]
        alone = self.tied and C.world_size(self.dp_group) > 2
        if alone:
            for g in grads:
                C.all_reduce(g, self.dp_group)
        for g in grads:
            C.all_reduce(g, self.tied_group)
        if alone and C.rank(self.dp_group) != 0:
            for g in grads:
                g.zero_()

    def _tied_grad(self, p: nn.Parameter) -> torch.Tensor:
        return self._grad_of(p)

    def held_tensors(self) -> List[tuple]:
        """``(param, tensor, offset)``: what this rank holds of each parameter between steps (the whole
        parameter, or under ZeRO-3 each piece of its shard, at ``offset`` in the flattened parameter), for
        the replica check."""
        return [(p, p, 0) for p in self.model.parameters()]

    def begin_step(self) -> None:
        raise NotImplementedError

    def accumulating(self):
        return contextlib.nullcontext()

    def reduce(self) -> None:
        raise NotImplementedError

    def norm_pieces(self) -> List[torch.Tensor]:
        raise NotImplementedError

    def step(self, clip_coef=None, grad_scale=None, found_inf=None) -> None:
        raise NotImplementedError

    def abandon_step(self) -> None:
        """After an error inside the step: release what it holds, without collectives."""

    @contextlib.contextmanager
    def forward_only(self):
        yield

    @contextlib.contextmanager
    def full_parameters(self):
        yield

    def model_state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def optimizer_names(self) -> dict:
        """``{id(param): name}``: the names the optimizer's ``full_state_dict`` keys its parameters by."""
        return {id(p): n for n, p in self.model.named_parameters()}

    def load_model_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class _Bucketed(ReplicaMode):
    """The modes over a ``DataParallel`` grad buffer: backwards accumulate under ``no_sync``, then the tied
    gradients (fp32 main grads) are summed and the buffer reduced over dp once."""

    def __init__(self, model, dp_group, tied, duplicates, tied_group, reduce_op: str, bucket_cap_mb: float,
                 tp_group=None, expert_group=None, ep: int = 1):
        super().__init__(model, dp_group, tied, duplicates, tied_group, tp_group)
        kw = dict(reduce_op=reduce_op, bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=min(1.0, bucket_cap_mb))
        self.ep, self.expert_dp = ep, None
        if ep > 1 and any(is_expert(p) for p in model.parameters()):
            self.dp = DataParallel(_Subset(model, lambda p: not is_expert(p), buffers=True), dp_group, **kw)
            self.expert_dp = DataParallel(_Subset(model, is_expert, buffers=False), expert_group, **kw)
        else:
            self.dp = DataParallel(model, dp_group, **kw)

    @property
    def buffers(self) -> list:
        """The gradient buffers: the dense parameters' (and the experts')."""
        return [self.dp] + ([self.expert_dp] if self.expert_dp is not None else [])

    def accumulating(self):
        stack = contextlib.ExitStack()
        for dp in self.buffers:
            stack.enter_context(dp.no_sync())
        return stack

    def _grad_of(self, p):
        return p.main_grad

    def reduce(self) -> None:
        self.sum_partial_grads()
        self.sum_tied_grads()
        self.dp.sync_gradients()
        if self.expert_dp is not None:
            self.expert_dp.sync_gradients()
            torch._foreach_mul_(self._reduced_expert_grads(), 1.0 / self.ep)

    def _reduced_expert_grads(self) -> List[torch.Tensor]:
        """Where the experts' reduced gradients are (the whole gradients here; the shard under ZeRO)."""
        return [p.main_grad for p in self.expert_dp.buffer.params]


class Replicated(_Bucketed):
    """Plain data parallelism: full gradients all-reduced over dp in buckets, torch AdamW on every rank."""
    zero = 0

    def __init__(self, model, dp_group, tied, duplicates, tied_group, *, optimizer_config: OptimizerConfig,
                 data_parallel: DataParallelConfig, tp_group=None, expert_group=None, ep: int = 1):
        super().__init__(model, dp_group, tied, duplicates, tied_group, "all_reduce", data_parallel.bucket_cap_mb,
                         tp_group, expert_group, ep)
        o = optimizer_config
        self.optimizer = torch.optim.AdamW(_torch_adamw_groups(model, o.weight_decay, o.no_decay), lr=o.lr,
                                           betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, foreach=False)

    def begin_step(self) -> None:
        self.optimizer.zero_grad()
        for dp in self.buffers:
            dp.zero_grad()

    def norm_pieces(self) -> List[torch.Tensor]:
        return [p for dp in self.buffers for p in dp.buffer.params if id(p) not in self.duplicates]

    def step(self, clip_coef=None, grad_scale=None, found_inf=None) -> None:
        if clip_coef is not None:
            # every gradient is scaled, the last stage's tied copy included (only left out of the norm)
            for dp in self.buffers:
                torch._foreach_mul_([p.main_grad for p in dp.buffer.params], clip_coef.to(dp.buffer.grad_dtype))
        if found_inf is None or not bool(found_inf.item()):
            self.optimizer.step()


class ShardedGrads(_Bucketed):
    """ZeRO 1 and 2: gradients reduce-scattered over dp into this rank's shard, which it steps (fp32
    master weights and moments for its shard only; stage 2 frees each bucket's full gradients once it is
    reduced). ``stream_grads`` (stage 2 on one pipeline stage, nothing tied, no tp-partial gradients):
    every micro-batch's backward reduces its buckets as they fill, so a backward holds the shard plus a
    few buckets (DeepSpeed's ZeRO-2; the shard sums the micro-batches' averages). Otherwise the
    micro-batches accumulate in the full buffer and it is reduced once, after the tied and tp-partial
    gradients are summed (a pipeline stage's backwards are separate calls that meet those sums only at
    the end)."""
    shards_grads = True

    def __init__(self, model, dp_group, tied, duplicates, tied_group, *, optimizer_config: OptimizerConfig,
                 data_parallel: DataParallelConfig, tp_group=None, stream_grads: bool = False, expert_group=None,
                 ep: int = 1):
        super().__init__(model, dp_group, tied, duplicates, tied_group, "reduce_scatter", data_parallel.bucket_cap_mb,
                         tp_group, expert_group, ep)
        self.zero = data_parallel.zero
        optimizers = [ZeroOptimizer(dp, stage=self.zero, **optimizer_config.adamw_options(),
                                    **optimizer_config.zero_options()) for dp in self.buffers]
        self.optimizer = optimizers[0] if len(optimizers) == 1 else _Joint(
            *optimizers, [{n for n, _ in dp.module.named_parameters()} for dp in self.buffers])
        self.streams = (stream_grads and self.zero == 2 and not self.tied and not self.partial
                        and self.expert_dp is None)

    def begin_step(self) -> None:
        self.optimizer.zero_grad()

    def accumulating(self):
        return contextlib.nullcontext() if self.streams else super().accumulating()

    def reduce(self) -> None:
        if not self.streams:
            super().reduce()

    def _reduced_expert_grads(self) -> List[torch.Tensor]:
        return [self.expert_dp.bucket_grad_shard(b) for b in self.expert_dp.buffer.buckets]

    def norm_pieces(self) -> List[torch.Tensor]:
        items = []
        for dp in self.buffers:
            for b in dp.buffer.buckets:
                shard = dp.bucket_grad_shard(b)
                for p, _, start, n in b.param_shard_overlaps(dp.dp_rank):
                    if id(p) not in self.duplicates:
                        items.append(_flagged(shard[start:start + n], p))
        return items

    def step(self, clip_coef=None, grad_scale=None, found_inf=None) -> None:
        self.optimizer.step(clip_coef=clip_coef, grad_scale=grad_scale, found_inf=found_inf)


class ShardedParams(ReplicaMode):
    """ZeRO 3: this rank holds 1/dp of its stages' parameters, gradients and AdamW state between steps.
    A step gathers every parameter once and keeps them for all microbatches (gathering per microbatch
    would repeat the all-gathers m times), the full gradients accumulate in fp32 (a bf16/fp16 model's too:
    FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), the tp-partial and tied ones are
    summed there, then one reduce-scatter over dp averages them into the fp32 gradient shard and frees the
    full ones; fp32 master weights live in the optimizer.

    ``per_unit`` (one stage per rank whose backwards are whole, nothing tied across stages): FSDP's schedule
    instead, so a rank never holds the whole stage: each block is gathered for its forward and again for its
    backward, and its gradients reduce-scattered as soon as its backward is done (every micro-batch's: the
    shard sums their averages); the tp-partial gradients are then summed over tp on the shard, which the tp
    ranks lay out alike (the sum over tp commutes with the average over dp)."""
    zero = 3
    shards_grads = True
    replicated_over_dp = False

    def __init__(self, model, dp_group, tied, duplicates, tied_group, *, optimizer_config: OptimizerConfig,
                 data_parallel: Optional[DataParallelConfig] = None, tp_group=None, per_unit: bool = False,
                 expert_group=None, ep: int = 1):
        super().__init__(model, dp_group, tied, duplicates, tied_group, tp_group)
        experts = [m for m in model.modules() if any(is_expert(p) for p in m.parameters(recurse=False))]
        self.ep = ep if experts else 1
        self.per_unit = bool(per_unit) and not self.tied and len(model) == 1 and self.ep == 1
        # one wrapper over all of this rank's stages: units = every block, root = the rest (no gradient
        # buckets: data_parallel's bucket_cap_mb does not apply); gradients reduced in its default reduce_dtype,
        # fp32 for every model dtype Parallel3D allows with ZeRO-3. Per unit it wraps the stage itself, whose
        # forward (the pipeline engine calls it) gathers the root. With experts split over ep, a second wrapper
        # shards them over their own group (each expert module a unit), the first leaves them alone.
        options = dict(**optimizer_config.adamw_options(), **optimizer_config.zero_options())
        self.z = ZeroStage3(model[0] if self.per_unit else model, dp_group, prefetch=self.per_unit,
                            ignore=is_expert if self.ep > 1 else None,
                            fp8_gather=data_parallel is not None and data_parallel.fp8_all_gather)
        self.expert_z = None
        if self.ep > 1:
            self.expert_z = ZeroStage3(nn.ModuleList(experts), expert_group, prefetch=False)
            self.optimizer = _Joint(ZeroStage3Optimizer(self.z, **options),
                                    ZeroStage3Optimizer(self.expert_z, **options),
                                    [{n for n, _ in z.managed_named_parameters()} for z in self.wrappers])
        else:
            self.optimizer = ZeroStage3Optimizer(self.z, **options)

    @property
    def wrappers(self) -> list:
        """The ZeRO-3 wrappers: the dense parameters' (and the experts')."""
        return [self.z] + ([self.expert_z] if self.expert_z is not None else [])

    def _pieces(self):
        """``(wrapper, param, offset, start, numel)`` of every piece of this rank's shards."""
        opts = self.optimizer.parts if self.expert_z is not None else (self.optimizer,)
        return [(z, p, offset, start, n) for z, opt in zip(self.wrappers, opts)
                for p, offset, start, n in opt.shard_pieces()]

    def begin_step(self) -> None:
        self.optimizer.zero_grad()                 # frees the gradient shard
        if not self.per_unit:
            for z in self.wrappers:
                z.gather_all()                     # once per step, kept for every microbatch

    def abandon_step(self) -> None:
        for z in self.wrappers:
            z.release_gathered()                   # no collective: the other ranks may never get there

    def _wrapper_of(self, p) -> ZeroStage3:
        return self.expert_z if self.expert_z is not None and is_expert(p) else self.z

    def _grad_of(self, p):
        # fp32 for a bf16 model, not autograd's bf16 .grad. An expert's (tp-partial under sequence parallelism)
        # is in its own wrapper, and zeros where this rank's tokens reached none of its experts: the tp ranks
        # route different tokens, and all of them take part in the sum
        return self._wrapper_of(p).accumulated_grad(p, create=is_expert(p))

    def _tied_grad(self, p):
        return self.z.accumulated_grad(p, create=True)   # zeros where one end did not use the weight this step

    def reduce(self) -> None:
        if self.per_unit:                          # reduced unit by unit in backward
            if self.partial:
                ids = {id(p) for p in self.partial}
                sum_partial_grads([self.z.grad_buffer[start:start + n] for p, _, start, n
                                   in self.optimizer.shard_pieces() if id(p) in ids], self.tp_group)
            return
        self.sum_partial_grads()                   # on the full gradients
        self.sum_tied_grads()
        self.z.reduce_scatter_and_free()           # once per step, over dp; reshard
        if self.expert_z is not None:
            self.expert_z.reduce_scatter_and_free()
            self.expert_z.grad_buffer.mul_(1.0 / self.ep)     # see the module docstring

    def norm_pieces(self) -> List[torch.Tensor]:
        return [_flagged(z.grad_buffer[start:start + n], p)
                for z, p, _, start, n in self._pieces() if id(p) not in self.duplicates]

    def step(self, clip_coef=None, grad_scale=None, found_inf=None) -> None:
        self.optimizer.step(clip_coef=clip_coef, grad_scale=grad_scale, found_inf=found_inf)

    @contextlib.contextmanager
    def forward_only(self):
        for z in self.wrappers:
            z.gather_all()
        try:
            yield
        finally:
            for z in self.wrappers:
                z.release_gathered()               # nothing to reduce: free the gathered parameters

    @contextlib.contextmanager
    def full_parameters(self):
        with contextlib.ExitStack() as stack:
            for z in self.wrappers:
                stack.enter_context(z.summon_full_params())
            yield

    def optimizer_names(self) -> dict:
        return {id(p): n for z in self.wrappers for n, p in z.managed_named_parameters()}

    def held_tensors(self) -> List[tuple]:
        return [(p, z.shard_buffer[start:start + n], offset) for z, p, offset, start, n in self._pieces()]

    def model_state_dict(self) -> dict:
        if self.expert_z is None:
            return self.z.state_dict()
        return {"dense": self.z.state_dict(), "experts": self.expert_z.state_dict()}

    def load_model_state_dict(self, state: dict) -> None:
        if self.expert_z is None:
            self.z.load_state_dict(state)
        else:
            self.z.load_state_dict(state["dense"])
            self.expert_z.load_state_dict(state["experts"])


def replica_mode(model: nn.Module, dp_group, tied, duplicates, tied_group, *, optimizer_config: OptimizerConfig,
                 data_parallel: DataParallelConfig, tp_group=None, stream_grads: bool = False, expert_group=None,
                 ep: int = 1) -> ReplicaMode:
    """The mode for ``data_parallel.zero`` (0: plain data parallelism). ``stream_grads``: the step's
    backwards are whole and each follows its own forward (one pipeline stage, 1F1B), so ZeRO-2 may reduce
    each as it runs (:class:`ShardedGrads`) and ZeRO-3 gather and reduce unit by unit (:class:`ShardedParams`).
    ``expert_group`` and ``ep``: where the experts' gradients are reduced, and over how many ranks the experts
    are split (see the module docstring)."""
    mode = {0: Replicated, 1: ShardedGrads, 2: ShardedGrads, 3: ShardedParams}[data_parallel.zero]
    extra = ({"stream_grads": stream_grads} if mode is ShardedGrads else
             {"per_unit": stream_grads} if mode is ShardedParams else {})
    extra.update(expert_group=expert_group, ep=ep)
    return mode(model, dp_group, tied, duplicates, tied_group, optimizer_config=optimizer_config,
                data_parallel=data_parallel, tp_group=tp_group, **extra)


__all__ = ["ReplicaMode", "Replicated", "ShardedGrads", "ShardedParams", "replica_mode"]
