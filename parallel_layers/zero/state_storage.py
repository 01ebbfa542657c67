"""Where a ZeRO optimizer's fp32 state lives: one interface, three places, walked by the same step.

``ShardedAdamW`` (:mod:`.sharded_adamw`) holds ``master``, ``exp_avg`` and ``exp_avg_sq`` (one fp32 element
per shard element) in one of these:

* :class:`ResidentState`: tensors next to the model (the default);
* :class:`DiskState`: a file per rank streamed through a few host buffers (``offload="disk"``,
  :mod:`.offload`); a master that is the model's own fp32 shard (ZeRO-3) stays resident beside it;
* :class:`HostState`: pinned host memory stepped by the CPU kernel while gradients and parameters cross on
  side streams (``offload="cpu"`` on a CUDA model, :mod:`.host_offload`).

The optimizer decides *what* a step computes (the runs, their hyper-parameters and step counts) and hands
it over as a :class:`StepPlan`; the storage decides *how the state is reached* while the fused kernel
steps it. Everything an optimizer asks of its state (read, checkpoint, load, bytes, close) goes through
the same few methods, so the optimizers never ask which storage they have.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Sequence

import torch

from . import memory as M
from .host_offload import HostShard, Span, UploadTargets
from .offload import StreamedShard

STATES = ("master", "exp_avg", "exp_avg_sq")

# (lo, hi, states, grad, wd_of, scale, inf, keep, *, steps=None, low=None): the fused calls of this step's
# runs over shard elements [lo, hi), with states holding exactly those elements (see ShardedAdamW._step_span)
SpanStep = Callable[..., None]


@dataclass
class StepPlan:
    """One optimizer step, as the optimizer hands it to its storage.

    ``spans``: ``(start, end)`` of each run, in shard order. ``step_span``: the fused calls over a stretch
    of the shard. ``grad``: the device gradient shard. ``wd_vector()`` (whole shard) and
    ``wd_fill(a, b, out)`` (elements ``[a, b)`` into ``out``): per-element weight decay, both None when no
    run mixes groups of different weight decay. ``scale``/``inf``/``keep``: the gradient multiplier, the
    overflow flag and ``inf == 0`` as fp32 (device tensors). ``steps``: per-parameter step counts, already
    advanced for this step. ``after_chunk(lo, hi, master)``: told of each sub-group a file-backed state
    stepped (stages 1/2 copy an fp32 master into the parameters from there)."""
    spans: Sequence[Span]
    step_span: SpanStep
    grad: torch.Tensor
    wd_vector: Optional[Callable[[], torch.Tensor]]
    wd_fill: Optional[Callable[[int, int, torch.Tensor], torch.Tensor]]
    scale: torch.Tensor
    inf: torch.Tensor
    keep: torch.Tensor
    steps: torch.Tensor
    after_chunk: Optional[Callable[[int, int, torch.Tensor], None]] = None

    def whole_wd(self) -> Optional[Callable[[int, int], torch.Tensor]]:
        """``wd_of(a, b)`` slicing the whole-shard vector, or None when no run mixes weight decays."""
        if self.wd_vector is None:
            return None
        vec = self.wd_vector()
        return lambda a, b: vec[a:b]


class ShardState:
    """The interface: what every storage of ``master``/``exp_avg``/``exp_avg_sq`` answers.

    ``writes_model_shard``: the step itself writes an fp32 model's parameter shard (an offloaded master is
    not the tensor stages 1 and 2 all-gather from)."""

    writes_model_shard = False

    def __init__(self, owner: str):
        self.owner = owner

    @property
    def numel(self) -> int:
        return self.tensor("master").numel()

    def tensor(self, name: str) -> torch.Tensor:
        """The state ``name`` as a tensor (for an offloaded state: the file mapped; reading or writing it
        touches the file)."""
        raise NotImplementedError

    def step(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def nbytes(self) -> Dict[str, int]:
        """``{"optimizer": bytes in the model's memory, "offload": bytes held elsewhere}``."""
        raise NotImplementedError

    def verify(self) -> None:
        """Raise before a step or a load if the state is no longer there (a missing or foreign file)."""

    def checkpoint(self) -> Dict[str, torch.Tensor]:
        """The state for ``state_dict()``: tensors no later step changes."""
        return {k: self.tensor(k).clone() for k in STATES}

    def load(self, named: Dict[str, torch.Tensor]) -> None:
        """Copy whole states (this shard's size) in; the model follows where the storage feeds it."""
        for k, t in named.items():
            self.tensor(k).copy_(t)
        self.state_written()

    def state_written(self) -> None:
        """The state was written through :meth:`tensor`: bring what the storage feeds up to date."""

    def finish(self) -> bool:
        """Apply a step still in flight; True when there was one (its parameters just went to the model)."""
        return False

    # gradient hooks: a storage that copies gradients away as backward produces them listens here
    def on_grad(self) -> None:
        """A parameter's gradient was accumulated."""

    def after_backward(self) -> None:
        """A synced backward ended."""

    def close(self) -> None:
        """Release threads and files; the optimizer cannot step afterwards."""

    def replace(self, old: "ShardState") -> None:
        """This state took over from ``old`` (a re-layout moved ``old``'s values in): retire ``old``."""
        old.close()


class ResidentState(ShardState):
    """The state as three tensors in memory, stepped in one pass over the runs."""

    def __init__(self, owner: str, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor):
        super().__init__(owner)
        self._tensors = {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def step(self, plan: StepPlan) -> None:
        states = tuple(self._tensors[k] for k in STATES)
        plan.step_span(0, self.numel, states, plan.grad, plan.whole_wd(), plan.scale, plan.inf, plan.keep)

    def nbytes(self) -> Dict[str, int]:
        return {"optimizer": M.storage_bytes(self._tensors.values()), "offload": 0}


class DiskState(ShardState):
    """The state in a file streamed through host buffers (:class:`~.offload.StreamedShard`); ``resident``:
    states that stay in memory (ZeRO-3's fp32 master, which is the parameter shard)."""

    writes_model_shard = True

    def __init__(self, owner: str, stream: StreamedShard, resident: Dict[str, torch.Tensor]):
        super().__init__(owner)
        self.stream = stream
        self._resident = dict(resident)

    @property
    def numel(self) -> int:
        return self.stream.numel

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.stream.states:
            return self.stream.views()[name]
        return self._resident[name]

    def step(self, plan: StepPlan) -> None:
        if plan.inf.item() != 0:      # on the CPU the check is free; a skipped step reads and writes nothing
            return
        stream = self.stream
        wd_of = None
        if plan.wd_fill is not None:
            def wd_of(a: int, b: int) -> torch.Tensor:
                return plan.wd_fill(a, b, stream.scratch()[:b - a])

        def step_chunk(lo: int, hi: int, chunks: Dict[str, torch.Tensor]) -> None:
            states = [chunks[k] if k in chunks else self._resident[k][lo:hi] for k in STATES]
            plan.step_span(lo, hi, states, plan.grad, wd_of, plan.scale, plan.inf, plan.keep)
            if plan.after_chunk is not None:
                plan.after_chunk(lo, hi, states[0])

        stream.stream(stream.groups(plan.spans), step_chunk, self.owner)

    def nbytes(self) -> Dict[str, int]:
        return {"optimizer": self.stream.buffer_bytes + M.storage_bytes(self._resident.values()),
                "offload": self.stream.file.nbytes}

    def verify(self) -> None:
        self.stream.verify(self.owner)

    def checkpoint(self) -> Dict[str, torch.Tensor]:
        """Tensors mapped from a private copy of the state file (no copy in memory; the copy's disk space
        is freed with the tensors), clones of the resident states."""
        out = self.stream.snapshot(self.owner)
        out.update({k: t.clone() for k, t in self._resident.items()})
        return out

    def load(self, named: Dict[str, torch.Tensor]) -> None:
        """Written a sub-group at a time: no copy of the state in memory."""
        self.stream.load({k: t for k, t in named.items() if k in self.stream.states}, self.owner)
        for k, t in named.items():
            if k in self._resident:
                self._resident[k].copy_(t)

    def close(self) -> None:
        self.stream.close()
        self.stream.failed = f"{self.owner}: close_offload() was called; build a new optimizer"

    def replace(self, old: ShardState) -> None:
        if isinstance(old, DiskState):
            self.stream.replace(old.stream)      # the new file takes the old one's name
        else:
            old.close()


class HostState(ShardState):
    """The state in pinned host memory (:class:`~.host_offload.HostShard`), stepped by the CPU kernel.

    The optimizer says where its gradients and parameters are: ``fetch_grads()`` queues the gradient
    copies backward did not queue; ``upload(lo, hi)`` names the device tensors a stepped chunk goes to;
    ``on_grad()`` / ``after_backward()`` (optional) queue copies early, from the gradient hooks."""

    writes_model_shard = True

    def __init__(self, owner: str, host: HostShard, *, fetch_grads: Callable[[], None], upload: UploadTargets,
                 on_grad: Optional[Callable[[], None]] = None, after_backward: Optional[Callable[[], None]] = None):
        super().__init__(owner)
        self.host = host
        self._fetch_grads, self._upload = fetch_grads, upload
        self._on_grad, self._after_backward = on_grad, after_backward

    def tensor(self, name: str) -> torch.Tensor:
        return getattr(self.host, name)

    def step(self, plan: StepPlan) -> None:
        """The gradients copied to the host (the ones backward could not copy yet now), the CPU kernel
        chunk by chunk, each chunk's parameters copied back while the next is stepped."""
        host = self.host
        self._fetch_grads()
        # the scalars the kernel reads, on the host: one small copy (the step waits for the gradients anyway)
        scalars = torch.stack([plan.scale.reshape(()), plan.inf.reshape(())]).float().cpu()
        if scalars[1].item() != 0:        # found_inf: skipped, nothing stepped or copied back
            host.finish()                 # (a delayed step still in flight is applied as usual)
            return
        scale_h, inf_h, keep_h = scalars[0:1], torch.zeros(1), torch.ones(1)
        steps_h = plan.steps.to("cpu", copy=True)       # a copy: a delayed step reads it after the counts moved on
        wd_of = plan.whole_wd()                          # the master lives on the host, so does this

        def step_chunk(lo: int, hi: int, grad: torch.Tensor, low: Optional[torch.Tensor]) -> None:
            states = [t[lo:hi] for t in (host.master, host.exp_avg, host.exp_avg_sq)]
            plan.step_span(lo, hi, states, grad, wd_of, scale_h, inf_h, keep_h, steps=steps_h, low=low)

        # (delayed update: the previous step's parameters are uploaded first; the optimizer gathers them)
        host.step(list(plan.spans), step_chunk, self._upload)

    def nbytes(self) -> Dict[str, int]:
        return {"optimizer": 0, "offload": self.host.host_bytes}

    def state_written(self) -> None:
        self.host.upload_all(self._upload)       # the device's parameters follow the master

    def finish(self) -> bool:
        return self.host.finish()

    def on_grad(self) -> None:
        if self._on_grad is not None:
            self._on_grad()

    def after_backward(self) -> None:
        if self._after_backward is not None:
            self._after_backward()

    def close(self) -> None:
        self.host.close()


__all__ = ["STATES", "StepPlan", "ShardState", "ResidentState", "DiskState", "HostState"]
