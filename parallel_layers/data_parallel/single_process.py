"""Single-process, multi-device data parallelism: the original ``nn.DataParallel`` design.

One process drives every device, one thread per device. Each batch goes through five exchanges:

1. **scatter** the inputs: the batch is cut along dim 0, one piece per device;
2. **replicate** the trained parameters: packed into one flat buffer on the first device (the fused
   ``pack_bucket`` kernel) and copied to every other device, where the replica's parameters are views of it;
3. every device runs its replica's forward in its own thread; the outputs are **gathered** on the first
   device, where the loss is computed on the whole batch;
4. backward **scatters** the output gradient back to the devices;
5. each replica's parameter gradients are packed into one flat buffer (``pack_bucket`` again), copied to the
   first device and **reduced** there (one add per device), where they land in the module's ``.grad``.

The first device's replica is the module itself (no copy): its gradients reach ``.grad`` through autograd,
and in-place updates of its buffers (BatchNorm running statistics) are kept, as in torch's DataParallel; the
other replicas' buffers are copies whose updates are dropped. Process-per-device data parallelism
(:class:`~parallel_layers.data_parallel.DataParallel`) has one exchange per batch, the gradients'
all-reduce, overlapped with backward: ``benchmarks/single_process_dp.py`` counts and times both.

Devices: CUDA devices, or on CPU the same device listed several times: each entry is then a worker thread
with its own copy of the parameters and of its part of the batch (the copies are plain memcpy's, standing
in for the device-to-device transfers), so the design runs, and is tested, on a CPU machine. What threads
on a CPU mean: the replicas share the cores (each replica's ops also use torch's intra-op threads, so
``n`` replicas on ``c`` cores run ``n x`` that many threads), and autograd runs the backward of every CPU
replica on one thread (it keeps one ready queue per device): on CPU only the forward is parallel.

Gradients: the loss is computed on the gathered whole batch, so each replica's gradient is its part of
the whole batch's gradient and the reduction is a sum: after backward ``.grad`` is the gradient of one
device on the whole batch (up to fp32 rounding: the batch is split and the parts summed in another order).
Dropout in the replicas draws from the shared generators in an order the threads decide: train with
dropout 0 where the masks must be reproducible.
"""
from __future__ import annotations

import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
from torch.func import functional_call

from ..ops.bucket import pack_bucket

PHASES = ("scatter_inputs", "replicate_params", "gather_outputs", "scatter_output_grads", "reduce_grads",
          "gather_input_grads")


class ExchangeLog:
    """The exchanges of the last batch: per phase, the copies between devices and their bytes. A copy
    from the first device to itself (its own part of the batch, its own replica) is not an exchange."""

    def __init__(self):
        self._lock = threading.Lock()          # the backward phases may be logged from autograd's threads
        self.phases: Dict[str, List[int]] = {}

    def reset(self) -> None:
        with self._lock:
            self.phases = {}

    def add(self, phase: str, copies: int, nbytes: int) -> None:
        with self._lock:
            got = self.phases.setdefault(phase, [0, 0])
            got[0] += copies
            got[1] += nbytes

    def summary(self) -> Dict[str, Dict[str, int]]:
        """``{phase: {"copies": n, "bytes": b}}`` for the phases that moved something, in batch order."""
        return {p: {"copies": self.phases[p][0], "bytes": self.phases[p][1]} for p in PHASES if p in self.phases}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (a copy even on the same device: a replica owns its memory)."""
    return t.to(device, copy=True)


# ----------------------------------------------------------------------------------------------- exchanges
class _Scatter(torch.autograd.Function):
    """``x`` cut along dim 0 into ``sizes``, piece ``i`` on ``devices[i]`` (piece 0 a view: it stays)."""

    @staticmethod
    def forward(ctx, devices, sizes, log, x):
        ctx.device, ctx.log = x.device, log
        pieces = torch.split(x, sizes)
        ctx.shapes = [p.shape for p in pieces]
        out = [pieces[0]] + [_to(p, d) for p, d in zip(pieces[1:], devices[1:])]
        log.add("scatter_inputs", len(out) - 1, sum(_nbytes(p) for p in out[1:]))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        grads = [torch.zeros(shape, device=ctx.device) if g is None else g for g, shape in zip(grads, ctx.shapes)]
        ctx.log.add("gather_input_grads", len(grads) - 1, sum(_nbytes(g) for g in grads[1:]))
        return None, None, None, torch.cat([g.to(ctx.device) for g in grads])


class _Gather(torch.autograd.Function):
    """The replicas' outputs concatenated along dim 0 on the first one's device."""

    @staticmethod
    def forward(ctx, log, *outs):
        ctx.log = log
        ctx.devices = [o.device for o in outs]
        ctx.sizes = [o.shape[0] for o in outs]
        log.add("gather_outputs", len(outs) - 1, sum(_nbytes(o) for o in outs[1:]))
        return torch.cat([outs[0]] + [o.to(outs[0].device) for o in outs[1:]])

    @staticmethod
    def backward(ctx, grad):
        pieces = torch.split(grad, ctx.sizes)
        out = [pieces[0]] + [_to(p, d) for p, d in zip(pieces[1:], ctx.devices[1:])]
        ctx.log.add("scatter_output_grads", len(out) - 1, sum(_nbytes(p) for p in out[1:]))
        return (None, *out)


class _Replicate(torch.autograd.Function):
    """The trained parameters on ``devices``: forward packs them into one flat buffer (one kernel) and copies
    it to each device, whose replica's parameters are views of its copy; backward packs each replica's
    gradients into a flat buffer, copies it to the parameters' device and sums them there."""

    @staticmethod
    def forward(ctx, devices, log, *params):
        ctx.log, ctx.n = log, len(params)
        ctx.offsets = [0]
        for p in params:
            ctx.offsets.append(ctx.offsets[-1] + p.numel())
        ctx.home, ctx.dtype, ctx.shapes = params[0].device, params[0].dtype, [p.shape for p in params]
        ctx.elt = params[0].element_size()
        flat = pack_bucket([p.detach() for p in params], dtype=params[0].dtype)
        out = []
        for d in devices:
            copy_ = _to(flat, d)
            out.extend(copy_[a:b].view_as(p) for p, a, b in zip(params, ctx.offsets, ctx.offsets[1:]))
        log.add("replicate_params", len(devices), len(devices) * _nbytes(flat))
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        n, total = ctx.n, ctx.offsets[-1]
        summed: Optional[torch.Tensor] = None
        copies = 0
        for r in range(len(grads) // n):
            mine = grads[r * n:(r + 1) * n]
            have = [(g, o) for g, o in zip(mine, ctx.offsets) if g is not None]
            if not have:
                continue                                   # this replica touched no parameter
            g0 = have[0][0]
            # zeros where a parameter got no gradient from this replica
            flat = (torch.empty if len(have) == n else torch.zeros)(total, dtype=ctx.dtype, device=g0.device)
            pack_bucket([g.contiguous() for g, _ in have], flat, offsets=[o for _, o in have])
            flat = flat.to(ctx.home)
            copies += 1
            summed = flat if summed is None else summed.add_(flat)
        ctx.log.add("reduce_grads", copies, copies * total * ctx.elt)
        if summed is None:
            return (None, None) + (None,) * n
        return (None, None) + tuple(summed[a:b].view(g_shape) for a, b, g_shape in
                                    zip(ctx.offsets, ctx.offsets[1:], ctx.shapes))


# ----------------------------------------------------------------------------------------------- the module
def _tensors_in(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_in(o)]
    return []


class SingleProcessDataParallel(nn.Module):
    """``module`` (on ``devices[0]``) replicated over ``devices`` at every forward, in one process.

    ``forward(*args, **kwargs)``: every tensor in the arguments (nested in tuples, lists, dicts) is cut
    along dim 0 over the devices (all must have the same dim 0; a batch of ``b < len(devices)`` rows uses
    the first ``b`` devices), other values go to every replica as they are; each replica runs in its own
    thread; the outputs (a tensor, or tuples / lists / dicts of them) are concatenated along dim 0 on
    ``devices[0]`` (0-dim outputs, one per replica, are stacked). After ``backward`` the module's ``.grad``
    holds the gradient of the whole batch. :attr:`exchanges` logs the last batch's copies between devices.
    """

    def __init__(self, module: nn.Module, devices: Sequence[Union[str, torch.device]]):
        super().__init__()
        self.devices = [torch.device(d) for d in devices]
        if not self.devices:
            raise ValueError("SingleProcessDataParallel: devices is empty; give at least one device, e.g. "
                             "['cuda:0', 'cuda:1'] or ['cpu', 'cpu'] (two worker threads on the CPU)")
        kinds = {d.type for d in self.devices}
        if len(kinds) != 1 or kinds.pop() not in ("cpu", "cuda"):
            raise ValueError(f"SingleProcessDataParallel: devices {[str(d) for d in self.devices]} must be all "
                             f"CUDA devices or all 'cpu' (each 'cpu' entry a worker thread)")
        self.module = module
        self._trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        home = self.devices[0]
        for n, t in list(module.named_parameters()) + list(module.named_buffers()):
            if t.device != home and not (home.type == "cuda" and home.index is None and t.device.type == "cuda"):
                raise ValueError(f"SingleProcessDataParallel: {n} is on {t.device}, the first device is {home}; "
                                 f"move the module to {home} first (module.to('{home}'))")
        dtypes = {p.dtype for _, p in self._trained}
        if len(dtypes) > 1:
            raise TypeError(f"SingleProcessDataParallel: trained parameters have several dtypes "
                            f"{sorted(map(str, dtypes))}; cast the module to one dtype first")
        # Replicas 1.. are the module's structure on the meta device: every tensor comes from the
        # replication at each forward (functional_call), so they hold no memory of their own.
        self._replicas = [copy.deepcopy(module).to("meta") for _ in self.devices[1:]]
        self._pool = ThreadPoolExecutor(max_workers=len(self.devices) - 1) if len(self.devices) > 1 else None
        self.exchanges = ExchangeLog()

    # ------------------------------------------------------------------------------------------- pieces
    def _split_sizes(self, args, kwargs) -> List[int]:
        tensors = _tensors_in((args, kwargs))
        if not tensors:
            raise ValueError("SingleProcessDataParallel: the arguments hold no tensor to scatter along dim 0")
        rows = {t.shape[0] if t.dim() else None for t in tensors}
        if len(rows) != 1 or None in rows:
            raise ValueError(f"SingleProcessDataParallel: every tensor argument is cut along dim 0 and must "
                             f"have the same size there; got dim-0 sizes {sorted(map(str, rows))}")
        b = rows.pop()
        n = min(len(self.devices), b) or 1
        return [b // n + (1 if i < b % n else 0) for i in range(n)]

    def _scatter(self, obj, sizes, used):
        if isinstance(obj, torch.Tensor):
            return _Scatter.apply(used, sizes, self.exchanges, obj)
        if isinstance(obj, (list, tuple)):
            parts = [self._scatter(o, sizes, used) for o in obj]
            return [type(obj)(p[i] for p in parts) if parts else type(obj)() for i in range(len(sizes))]
        if isinstance(obj, dict):
            parts = {k: self._scatter(v, sizes, used) for k, v in obj.items()}
            return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]
        return [obj] * len(sizes)

    def _replica_state(self, used) -> List[Dict[str, torch.Tensor]]:
        """Per replica 1..: its parameters (through :class:`_Replicate`) and copies of the rest."""
        others = used[1:]
        if not others:
            return []
        params = [p for _, p in self._trained]
        copies = _Replicate.apply(others, self.exchanges, *params) if params else ()
        trained = {id(p) for p in params}
        rest = [(n, t) for n, t in list(self.module.named_parameters()) + list(self.module.named_buffers())
                if id(t) not in trained]
        states = []
        for r, d in enumerate(others):
            state = {n: copies[r * len(params) + i] for i, (n, _) in enumerate(self._trained)}
            state.update({n: _to(t.detach(), d) for n, t in rest})
            states.append(state)
        return states

    def _gather(self, outs):
        first = outs[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                outs = [o.reshape(1) for o in outs]
            return _Gather.apply(self.exchanges, *outs)
        if isinstance(first, (list, tuple)):
            return type(first)(self._gather([o[i] for o in outs]) for i in range(len(first)))
        if isinstance(first, dict):
            return {k: self._gather([o[k] for o in outs]) for k in first}
        return first

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        self.exchanges.reset()
        sizes = self._split_sizes(args, kwargs)
        used = self.devices[:len(sizes)]
        if len(used) == 1:
            return self.module(*args, **kwargs)
        pieces = self._scatter((args, kwargs), sizes, used)
        states = self._replica_state(used)
        grad_on = torch.is_grad_enabled()
        modes = [m.training for m in self.module.modules()]
        for replica in self._replicas[:len(used) - 1]:     # train() / eval() of the module: the replicas follow
            for m, training in zip(replica.modules(), modes):
                m.training = training

        def run(r):
            a, k = pieces[r]
            with torch.set_grad_enabled(grad_on), _device_context(used[r]):
                return functional_call(self._replicas[r - 1], states[r - 1], tuple(a), k)

        futures = [self._pool.submit(run, r) for r in range(1, len(used))]
        a0, k0 = pieces[0]
        outs = [self.module(*a0, **k0)]                    # the first device's replica: this thread
        outs += [f.result() for f in futures]
        return self._gather(outs)

    def close(self) -> None:
        """Stop the worker threads (also done when the module is garbage-collected)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self):
        pool = self.__dict__.get("_pool")
        if pool is not None:
            pool.shutdown(wait=False)


def _device_context(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def exchanges_per_batch(log: ExchangeLog) -> Tuple[int, int]:
    """``(phases, bytes)``: how many of the five exchanges moved data in the last batch, and the bytes."""
    s = log.summary()
    return len(s), sum(v["bytes"] for v in s.values())


__all__ = ["SingleProcessDataParallel", "ExchangeLog", "exchanges_per_batch", "PHASES"]
