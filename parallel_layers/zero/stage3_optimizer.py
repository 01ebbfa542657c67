"""AdamW for :class:`ZeroStage3`: fused kernel calls over this rank's shard of every unit.

``ZeroStage3`` keeps all of this rank's parameter shards in one flat tensor (``shard_buffer``) and the
averaged gradient shards in another of the same layout (``grad_buffer``: fp32, or bf16/fp16 with
``ZeroStage3(grad_dtype=)``, which the kernel reads as it is), so a step is one
``parallel_layers.ops.adamw_step`` call per *run* of ``S = shard_numel`` elements (pieces of parameters
with a gradient, the same lr/betas/eps and the same step count: one call in the common case):

* fp32 model: the parameter shard *is* the master copy (stage 3 has no replicated parameters to keep
  apart from it), updated in place; state = exp_avg + exp_avg_sq, 8 bytes per shard element.
* bf16/fp16 model: a separate fp32 master shard; the kernel writes the low-precision copy into
  ``shard_buffer`` in the same pass (``param_copy``); state = 12 bytes per shard element.

Nothing is gathered after the step: the next forward gathers each unit when it needs it. Padding
elements have zero parameter and gradient, so Adam leaves them zero. ``found_inf`` (a device tensor)
skips the step with parameters, states and step counts bit-identical, without a host sync. Param groups,
schedulers, per-parameter step counts, parameters without a gradient (frozen ones included: they live
in the shard too) and clipping behave as in :mod:`.optimizer`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..weak_hooks import weak_hook
from . import full_state
from . import memory as M
from .host_offload import HostOffload, HostShard, ReducedUnits, segments_of
from .offload import DEFAULT_BUFFER_MB, resolve_offload
from .sharded_adamw import STATE_FORMAT, NoDecay, ShardedAdamW
from .stage3 import ZeroStage3
from .state_storage import HostState, ResidentState


class ZeroStage3Optimizer(ShardedAdamW):
    """Sharded AdamW over a :class:`ZeroStage3` module; a ``torch.optim.Optimizer`` taking
    ``torch.optim.AdamW``'s param groups (hyper-parameters read at every step).

    Typical use (biases and norms without weight decay, a scheduler, accumulation, clipping)::

        z = ZeroStage3(model, mesh.dp_group)
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        opt = ZeroStage3Optimizer(z, [{"params": decay, "weight_decay": 0.1},
                                      {"params": rest, "weight_decay": 0.0}], lr=3e-4, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        for micro_batches in loader:
            for i, (x, y) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                with contextlib.nullcontext() if last else z.no_sync():   # reduce once, on the last
                    (z(x, y)[1] / len(micro_batches)).backward()
            norm = opt.clip_grad_norm_(1.0)     # NOT torch.nn.utils.clip_grad_norm_: the grads are shards
            opt.step()
            opt.zero_grad()
            sched.step()

    ``params=None``: every parameter of the module, one group (``no_decay=`` parameters or a predicate on
    ``(name, param)`` splits off a group without weight decay). ``step(grad_scale=, found_inf=,
    clip_coef=)`` as ``ZeroOptimizer.step``. A parameter is updated only in a step where a backward
    reached it (on any rank when the module was built with ``find_unused_parameters=True``, on this rank
    otherwise); frozen parameters never change.

    ``offload="disk", offload_dir=DIR, offload_buffer_mb=, offload_io=``: the fp32 master (bf16/fp16
    models; an fp32 model's master is its parameter shard, which stays) and the moments live in a file per
    rank, streamed through the buffers in each step, as ``ZeroOptimizer``'s (:mod:`.offload`). With
    ``ZeroStage3(grad_dtype=torch.bfloat16)`` a rank then holds about 4 bytes per parameter.
    ``offload="cpu"`` (a CUDA model; ``offload_delayed_update=``): master and moments in pinned host memory,
    each unit's gradient shard copied to the host as soon as backward has reduced it, the step on the CPU,
    the updated shard copied back (:mod:`.host_offload`).
    """

    _owner = "ZeroStage3Optimizer"

    def __init__(self, zmodule: ZeroStage3, params=None, *, lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 no_decay: NoDecay = None, backend: Optional[str] = None, offload: Optional[str] = None,
                 offload_dir: Optional[str] = None, offload_buffer_mb: float = DEFAULT_BUFFER_MB,
                 offload_io: str = "auto", offload_delayed_update: bool = False):
        if not isinstance(zmodule, ZeroStage3):
            raise TypeError(f"ZeroStage3Optimizer: expected a ZeroStage3 module, got {type(zmodule).__name__}")
        self.z, self.backend = zmodule, backend
        shard = zmodule.shard_buffer
        self.device = shard.device
        low = shard.dtype != torch.float32
        self.low = shard if low else None
        where = resolve_offload(self._owner, offload, offload_dir, self.device, offload_buffer_mb, offload_io,
                               offload_delayed_update)
        self._h_copied: set = set()     # offload="cpu": units whose gradient shard the host holds as the device does
        if isinstance(where, HostOffload):
            self._storage = self._build_host(where, shard, low)
        elif where is not None:
            self._storage = self._open_state_file(
                where, tag="stage3", group=zmodule.dp_group, layout=zmodule.unit_layout(), numel=shard.numel(),
                resident_master=None if low else shard, init_master=lambda lo, hi, out: out.copy_(shard[lo:hi]))
        else:
            master = shard.float() if low else shard       # fp32: the shard is the master
            self._storage = ResidentState(self._owner, master, torch.zeros_like(master), torch.zeros_like(master))
        self._init_groups(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, no_decay=no_decay)

    # ------------------------------------------------------------------ ZeRO-Offload (offload="cpu")
    def _build_host(self, config: HostOffload, shard: torch.Tensor, low: bool) -> HostState:
        """The state in pinned host memory (:mod:`.host_offload`), one gradient segment per unit; the
        device keeps the parameter shard (which the step's upload updates) and the gradient shard."""
        z = self.z
        host = HostShard(self._owner, shard.numel(), self.device, grad_dtype=z.grad_dtype,
                         low_dtype=shard.dtype if low else None, config=config,
                         segments=segments_of([u.shard_numel for u in z.units]))
        host.master.copy_(shard)
        self._h_reduced = ReducedUnits(z)
        poll = weak_hook(self, lambda opt, p: opt._host_poll())

        for _, p in z.managed_named_parameters():
            if p.requires_grad:       # after ZeroStage3's own hooks: they reduce the unit before it
                p.register_post_accumulate_grad_hook(poll)
        return HostState(self._owner, host, fetch_grads=self._fetch_host_grads, upload=self._upload_targets)

    def _host_poll(self) -> None:
        """In backward (and at the step): queue the host copy of every unit reduced since the last look."""
        if self.z.gathered_all:       # gather_all(): reduced later, by reduce_scatter_and_free()
            return
        for i in self._h_reduced.new():
            lo, hi = self.host_shard.segments[i]
            self.host_shard.copy_grad(i, self.z.grad_buffer[lo:hi])
            self._h_copied.add(i)

    def _fetch_host_grads(self) -> None:
        self._host_poll()
        for i, (lo, hi) in enumerate(self.host_shard.segments):
            if i not in self._h_copied:   # reduced without a hook seeing it, or no gradient (zeros)
                self.host_shard.copy_grad(i, self.z.grad_buffer[lo:hi])
        self._h_copied.clear()        # consumed (and with a delayed update the next backward fills the other buffer)

    def _upload_targets(self, lo: int, hi: int):
        return [(lo, hi, self.z.shard_buffer[lo:hi])]

    # ------------------------------------------------------------------ what ShardedAdamW asks
    def _module_named_params(self):
        return self.z.managed_named_parameters()

    def _shard_pieces_raw(self):
        out, pos = [], 0
        for u in self.z.units:
            for p, o, n in zip(u.params, u.offsets, u.numels):
                a, b = max(o, u.lo), min(o + n, u.hi)
                if a < b:
                    out.append((p, a - o, pos + a - u.lo, b - a))
            pos += u.shard_numel
        return out

    def _grad_source(self) -> torch.Tensor:
        if not self.z.has_grads():
            raise RuntimeError("ZeroStage3Optimizer: there is no gradient shard (no backward since zero_grad(), "
                               "which frees it); run a backward first")
        return self.z.grad_buffer

    def _local_had_grads(self) -> List[bool]:
        return [self.z.grad_reached(p) for p in self._all_params]

    def _agree_on_grads(self) -> bool:
        return self.z.find_unused_parameters and self.z.dp_size > 1

    def _grad_group(self):
        return self.z.dp_group

    def _consume_grads(self) -> None:
        self.z.forget_grads_reached()

    def _zero_grads(self, set_to_none: bool) -> None:
        self.z.zero_grad(set_to_none)
        self._h_copied.clear()

    def _before_step(self) -> None:
        unreduced = self.z.unreduced_units()
        if unreduced:
            raise RuntimeError(f"ZeroStage3Optimizer: the gradients of {len(unreduced)} unit(s) (e.g. "
                               f"{unreduced[0]!r}) were accumulated under ZeroStage3.no_sync() and never reduced "
                               f"over the data-parallel group; run the last micro-batch's backward outside "
                               f"no_sync() before clipping or stepping")

    # ------------------------------------------------------------------ checkpoints
    def shard_pieces(self) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """Where each parameter's state lives on this rank: ``(param, start in the parameter's flat view,
        start in this rank's flat state (master, exp_avg, exp_avg_sq, and the module's ``shard_buffer``
        and ``grad_buffer``), length)`` for every piece of a parameter in this rank's shard."""
        return self._shard_pieces_raw()

    def full_state_dict(self) -> dict:
        """The whole state, whatever the dp size (:mod:`.full_state`): every parameter's fp32 master
        weights (the parameters themselves for an fp32 model) and AdamW moments in its shape, by the
        module's parameter name, with the step counts and ``param_groups`` (parameters by name). A
        collective over the dp group; :meth:`load_full_state_dict` loads it at any dp size (resuming on
        more or fewer ranks)."""
        self.wait_for_step()
        return full_state.full_state_dict(self, self._named_params, self.z.dp_group)

    @torch.no_grad()
    def load_full_state_dict(self, state: dict) -> None:
        """Load a :meth:`full_state_dict` saved at any dp size (no collective): this rank's shard of the
        parameters, masters and moments, the step counts, and ``param_groups`` when the dict has them."""
        self.wait_for_step()
        full_state.load_full_state_dict(self, state, self._named_params, "ZeroStage3Optimizer")
        self._storage.state_written()

    def _named_params(self) -> List[Tuple[str, torch.nn.Parameter]]:
        return self.z.managed_named_parameters()

    def state_dict(self) -> dict:
        """This rank's optimizer shard (clones), ``param_groups`` (parameters by name) and every
        parameter's step count. Save it with the module's ``state_dict()``, per rank. Offloaded: the states
        are mapped from a private copy of the state file, as ``ZeroOptimizer.state_dict``."""
        return {"format": STATE_FORMAT, "dp_size": self.z.dp_size, "dp_rank": self.z.dp_rank,
                "layout": self.z.unit_layout(), "param_groups": self.named_param_groups(), "step": self._step.clone(),
                "steps": self.steps_by_name(), **self._checkpoint_states()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of the same dp rank, dp size, units and param groups (a state saved
        before param groups existed loads too, as in ``ZeroOptimizer.load_state_dict``)."""
        if state.get("dp_size") != self.z.dp_size or state.get("dp_rank") != self.z.dp_rank:
            raise ValueError(f"ZeroStage3Optimizer.load_state_dict: state of dp rank {state.get('dp_rank')} of "
                             f"{state.get('dp_size')}, loading into rank {self.z.dp_rank} of {self.z.dp_size}; "
                             f"resume with the same data-parallel size")
        if state["layout"] != self.z.unit_layout():
            raise ValueError("ZeroStage3Optimizer.load_state_dict: the saved unit layout differs from the module's")
        self._verify_state()
        self.load_param_groups(state["param_groups"], "ZeroStage3Optimizer.load_state_dict")
        self._step.copy_(state["step"])
        self.load_steps(state.get("steps"), int(state["step"].item()))
        self._load_states([state[k] for k in ("master", "exp_avg", "exp_avg_sq")])

    # ------------------------------------------------------------------ memory
    def memory_report(self) -> dict:
        """Bytes this rank holds (measured on storages, padding included) and what is gathered transiently.

        ``param_bytes``: the parameter shards (the only persistent parameter storage). ``grad_bytes``: the
        gradient shards, in ``ZeroStage3(grad_dtype=)`` (allocated from a backward's first reduction until
        ``zero_grad()``).
        ``optimizer_bytes``: exp_avg, exp_avg_sq and, for low-precision models, the
        fp32 master (an fp32 model's master *is* ``param_bytes``). ``gathered_bytes``: full parameter and
        gradient buffers alive now (0 between steps); ``peak_gathered_bytes``: the most alive at once during
        the last step; ``unit_full_bytes``: what one unit's gather allocates; ``unit_grad_bytes``: its full
        gradient buffer, in ``ZeroStage3(reduce_dtype=)`` (twice ``unit_full_bytes`` for bf16 parameters
        reduced in fp32, the default).
        """
        z = self.z
        num_params = sum(u.numel for u in z.units)
        state = self._state_bytes()
        rep = {"stage": 3, "dp_size": z.dp_size, "dp_rank": z.dp_rank, "num_params": num_params,
               "padded_numel": sum(u.padded for u in z.units), "shard_numel": z.shard_numel,
               "param_bytes": M.storage_bytes([z.shard_buffer]),
               "grad_bytes": z.grad_nbytes,
               # an fp32 model's master is its parameter shard (param_bytes)
               "optimizer_bytes": state["optimizer"] - (M.storage_bytes([self.master])
                                                        if self.low is None and self.host_shard is None else 0),
               "offload_bytes": state["offload"],
               "gathered_bytes": sum(M.storage_bytes([u.full]) + M.storage_bytes([u.grad_full])
                                     for u in z.units),
               "peak_gathered_bytes": z.peak_gathered_bytes,
               "unit_full_bytes": [u.nbytes for u in z.units],
               "unit_grad_bytes": [u.grad_nbytes for u in z.units]}
        rep["total_bytes"] = rep["param_bytes"] + rep["grad_bytes"] + rep["optimizer_bytes"]
        rep["bytes_per_param"] = {k: rep[f"{k}_bytes"] / num_params
                                  for k in ("param", "grad", "optimizer", "total")}
        rep["paper_bytes_per_param"] = M.paper_bytes_per_param(3, z.dp_size)
        return rep


__all__ = ["ZeroStage3Optimizer"]
