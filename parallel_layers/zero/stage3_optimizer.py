"""AdamW for :class:`ZeroStage3`: one fused kernel call over this rank's shard of every unit.

``ZeroStage3`` keeps all of this rank's parameter shards in one flat tensor (``shard_buffer``) and the
averaged fp32 gradient shards in another of the same layout (``grad_buffer``), so a step is ONE
``parallel_layers.ops.adamw_step`` over ``S = shard_numel`` elements:

* fp32 model: the parameter shard *is* the master copy (stage 3 has no replicated parameters to keep
  apart from it), updated in place; state = exp_avg + exp_avg_sq, 8 bytes per shard element.
* bf16/fp16 model: a separate fp32 master shard; the kernel writes the low-precision copy into
  ``shard_buffer`` in the same pass (``param_copy``); state = 12 bytes per shard element.

Nothing is gathered after the step: the next forward gathers each unit when it needs it. Padding
elements have zero parameter and gradient, so Adam leaves them zero. ``found_inf`` (a device tensor)
skips the step with parameters, states and the step count bit-identical, without a host sync.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..ops.optimizer_step import adamw_step
from . import memory as M
from . import full_state
from .optimizer import step_multipliers
from .stage3 import ZeroStage3

_STATES = ("master", "exp_avg", "exp_avg_sq")


class ZeroStage3Optimizer:
    """Sharded AdamW over a :class:`ZeroStage3` module (same hyper-parameters as ``torch.optim.AdamW``).

    ``step(grad_scale=, found_inf=, clip_coef=)`` as ``ZeroOptimizer.step``: ``grad_scale`` is the loss
    scale the gradients carry (divided out), ``clip_coef`` multiplies them, nonzero ``found_inf`` skips.
    ``no_decay``: parameters (or a predicate on ``(name, param)``) without weight decay.
    """

    def __init__(self, zmodule: ZeroStage3, *, lr: float, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 no_decay: Union[None, Sequence[torch.nn.Parameter], Callable[[str, torch.nn.Parameter], bool]] = None,
                 backend: Optional[str] = None):
        if not isinstance(zmodule, ZeroStage3):
            raise TypeError(f"ZeroStage3Optimizer: expected a ZeroStage3 module, got {type(zmodule).__name__}")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"ZeroStage3Optimizer: lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0")
        if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"ZeroStage3Optimizer: betas={betas!r} must be a pair in [0, 1)")
        self.z, self.backend = zmodule, backend
        self.param_groups = [dict(lr=float(lr), betas=tuple(float(b) for b in betas), eps=float(eps),
                                  weight_decay=float(weight_decay))]
        shard = zmodule.shard_buffer
        self.device = shard.device
        low = shard.dtype != torch.float32
        self.master = shard.float() if low else shard       # fp32: the shard is the master
        self.low = shard if low else None
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self._step = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._decay_vec = self._decay_vector(no_decay)

    def _decay_vector(self, no_decay) -> Optional[torch.Tensor]:
        """Per-element decay mask of the shard when some parameters are excluded, else None."""
        if no_decay is None or self.param_groups[0]["weight_decay"] == 0:
            return None
        if callable(no_decay):
            skip = {id(p) for n, p in self.z.module.named_parameters() if no_decay(n, p)}
        else:
            skip = {id(p) for p in no_decay}
        vec = torch.zeros_like(self.master)
        pos = 0
        for u in self.z.units:
            for p, o in zip(u.params, u.offsets):
                a, b = max(o, u.lo), min(o + p.numel(), u.hi)
                if a < b and id(p) not in skip:
                    vec[pos + a - u.lo:pos + b - u.lo] = 1.0
            pos += u.shard_numel
        return vec

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale=None, found_inf=None, clip_coef=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.z.has_grads():     # no backward since zero_grad(): torch.optim skips such params too
            return loss
        dev, g = self.device, self.param_groups[0]
        scale, inf = step_multipliers("ZeroStage3Optimizer", dev, grad_scale, clip_coef, found_inf)
        keep = (inf == 0).to(torch.float32)
        self._step.add_(keep)          # counts the steps taken; read on the device by the kernel
        lr, wd = g["lr"], g["weight_decay"]
        if self._decay_vec is not None:  # mixed mask: decoupled decay first (skipped with the step)
            self.master.addcmul_(self.master, self._decay_vec * keep, value=-lr * wd)
            wd = 0.0
        beta1, beta2 = g["betas"]
        adamw_step(self.master, self.z.grad_buffer, self.exp_avg, self.exp_avg_sq, lr=lr, step=self._step,
                   beta1=beta1, beta2=beta2, eps=g["eps"], weight_decay=wd, grad_scale=scale, found_inf=inf,
                   param_copy=self.low, backend=self.backend)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.z.zero_grad(set_to_none)

    # ------------------------------------------------------------------ checkpoints
    def shard_pieces(self) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """Where each parameter's state lives on this rank: ``(param, start in the parameter's flat view,
        start in this rank's flat state (master, exp_avg, exp_avg_sq, and the module's ``shard_buffer``
        and ``grad_buffer``), length)`` for every piece of a parameter in this rank's shard."""
        out, pos = [], 0
        for u in self.z.units:
            for p, o in zip(u.params, u.offsets):
                a, b = max(o, u.lo), min(o + p.numel(), u.hi)
                if a < b:
                    out.append((p, a - o, pos + a - u.lo, b - a))
            pos += u.shard_numel
        return out

    @property
    def steps_taken(self) -> int:
        return int(self._step.item())

    def set_steps_taken(self, n: int) -> None:
        """Resume the step count (AdamW's bias correction) at ``n``."""
        self._step.fill_(n)

    def full_state_dict(self) -> dict:
        """The whole state, whatever the dp size (:mod:`.full_state`): every parameter's fp32 master
        weights (the parameters themselves for an fp32 model) and AdamW moments in its shape, by the
        module's parameter name, with the step count and ``param_groups``. A collective over the dp
        group; :meth:`load_full_state_dict` loads it at any dp size (resuming on more or fewer ranks)."""
        return full_state.full_state_dict(self, self._named_params, self.z.dp_group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load a :meth:`full_state_dict` saved at any dp size (no collective): this rank's shard of the
        parameters, masters and moments, the step count, and ``param_groups`` when the dict has them."""
        full_state.load_full_state_dict(self, state, self._named_params, "ZeroStage3Optimizer")

    def _named_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return list(self.z.module.named_parameters())

    def state_dict(self) -> dict:
        """This rank's optimizer shard (clones). Save it with the module's ``state_dict()``, per rank."""
        return {"dp_size": self.z.dp_size, "dp_rank": self.z.dp_rank, "layout": self.z._layout(),
                "param_groups": [dict(grp) for grp in self.param_groups], "step": self._step.clone(),
                **{k: getattr(self, k).clone() for k in _STATES}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if state.get("dp_size") != self.z.dp_size or state.get("dp_rank") != self.z.dp_rank:
            raise ValueError(f"ZeroStage3Optimizer.load_state_dict: state of dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into rank {self.z.dp_rank} of {self.z.dp_size}; "
                             f"resume with the same data-parallel size")
        if state["layout"] != self.z._layout():
            raise ValueError("ZeroStage3Optimizer.load_state_dict: the saved unit layout differs from the module's")
        self.param_groups = [dict(grp, betas=tuple(grp["betas"])) for grp in state["param_groups"]]
        self._step.copy_(state["step"])
        for k in _STATES:
            getattr(self, k).copy_(state[k])
        if self.low is not None:
            self.low.copy_(self.master)

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict:
        """Bytes this rank holds (measured on storages, padding included) and what is gathered transiently.

        ``param_bytes``: the parameter shards (the only persistent parameter storage). ``grad_bytes``: the
        fp32 gradient shards (allocated from a backward's first reduction until ``zero_grad()``).
        ``optimizer_bytes``: exp_avg, exp_avg_sq and, for low-precision models, the
        fp32 master (an fp32 model's master *is* ``param_bytes``). ``gathered_bytes``: full parameter and
        gradient buffers alive now (0 between steps); ``peak_gathered_bytes``: the most alive at once during
        the last step; ``unit_full_bytes``: what one unit's gather allocates (its gradient buffer is as big).
        """
        z = self.z
        num_params = sum(u.numel for u in z.units)
        rep = {"stage": 3, "dp_size": z.dp_size, "dp_rank": z.dp_rank, "num_params": num_params,
               "padded_numel": sum(u.padded for u in z.units), "shard_numel": z.shard_numel,
               "param_bytes": M.storage_bytes([z.shard_buffer]),
               "grad_bytes": z.grad_nbytes,
               "optimizer_bytes": M.storage_bytes([self.exp_avg, self.exp_avg_sq]
                                                  + ([self.master] if self.low is not None else [])),
               "gathered_bytes": sum(M.storage_bytes([u.full]) + M.storage_bytes([u.grad_full])
                                     for u in z.units),
               "peak_gathered_bytes": z.peak_gathered_bytes,
               "unit_full_bytes": [u.nbytes for u in z.units]}
        rep["total_bytes"] = rep["param_bytes"] + rep["grad_bytes"] + rep["optimizer_bytes"]
        rep["bytes_per_param"] = {k: rep[f"{k}_bytes"] / num_params
                                  for k in ("param", "grad", "optimizer", "total")}
        rep["paper_bytes_per_param"] = M.paper_bytes_per_param(3, z.dp_size)
        return rep


__all__ = ["ZeroStage3Optimizer"]
