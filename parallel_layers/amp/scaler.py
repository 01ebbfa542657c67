"""Dynamic loss scaling for fp16 training, with every decision kept on the device.

Why: fp16 gradients below ~6e-8 flush to zero, so the loss is multiplied by a large scale before
backward and the gradients are divided by it before the optimizer step. Too large a scale overflows to
inf/nan; the step is then skipped and the scale backed off. After ``growth_interval`` clean steps it is
grown again. ``hysteresis`` (Megatron-LM's) tolerates that many overflowing steps before backing off:
a single spike then costs one skipped step, not a halved scale for the next ``growth_interval`` steps.

No host syncs. DeepSpeed's legacy scaler asked the device "any inf?" per tensor and branched on the host.
Here the overflow flag comes from one fused kernel per dtype (``ops.unscale_and_norm``), is agreed across
ranks by an all-reduce (MAX) over every group the caller names, and is handed as a tensor to the fused
optimizer (``found_inf``: the kernel leaves everything unchanged) and to :meth:`update`, which computes
the new scale and counters with tensor ops, in the style of torch's ``_amp_update_scale_``. Only
:meth:`scale_value` and :meth:`state_dict` read values to the host.

The one host-side decision left is the ``min_scale`` error: a scale that must fall below ``min_scale`` means
the gradients overflow even barely scaled, i.e. training has diverged; looping forever on skipped steps
(what a plain halving scaler does) hides that. :meth:`update` records such an event in a sticky device flag;
on CPU it is read at once (no device to wait for); on CUDA it is copied to pinned host memory
asynchronously and read at a later :meth:`update` once the copy is done (``Event.query``, never blocking),
so the error surfaces a step or two late instead of stalling the stream. :meth:`scale_value` and
:meth:`state_dict` check it too.
"""
from __future__ import annotations

import math
from typing import Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..ops import unscale_and_norm
from .clip import grads_and_flags


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"DynamicLossScaler: {name}={value!r} must be an integer >= 1")
    return value


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"DynamicLossScaler: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"DynamicLossScaler: {name}={value} must be a finite number > 0")
    return value


class DynamicLossScaler:
    """Megatron-LM's dynamic grad scaler (growth, backoff, hysteresis) with device-side state.

    Typical fp16 step (``groups``: every group whose ranks must skip together, e.g. dp, tp and pp)::

        scaler.scale_loss(loss).backward()
        found_inf, _ = scaler.unscale_and_check(grads, groups=(dp, tp, pp))
        optimizer.step(found_inf=found_inf)            # FusedAdamW: skips on device when found_inf
        scaler.update(found_inf)

    or, one pass over the gradients less, leave them scaled and give the optimizer the scale: see
    :func:`parallel_layers.amp.clip_grad_norm_` (``inv_scale=scaler.inv_scale``) and
    :func:`parallel_layers.amp.fused_optimizer_grad_scale`.

    With ``hysteresis=1`` the update rule is exactly ``torch.amp.GradScaler``'s.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 2, min_scale: float = 1.0, *, device=None):
        self._configure(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                        growth_interval=growth_interval, hysteresis=hysteresis, min_scale=min_scale)
        if self.init_scale < self.min_scale:
            raise ValueError(f"DynamicLossScaler: init_scale={self.init_scale} is below min_scale={self.min_scale}")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        # State (device tensors, moved to the gradients' device on first use): scale, clean steps since
        # the last overflow or growth, overflows still tolerated before a backoff, and the sticky
        # "would have fallen below min_scale" flag (holds that would-be scale; 0: never).
        self._scale = torch.full((1,), self.init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.zeros(1, dtype=torch.int32, device=dev)
        self._hysteresis_tracker = torch.full((1,), self.hysteresis, dtype=torch.int32, device=dev)
        self._underflow = torch.zeros(1, dtype=torch.float32, device=dev)
        self._pending = None   # CUDA: (pinned host copy of _underflow, event after the copy)

    def _configure(self, *, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, min_scale):
        self.init_scale = _number("init_scale", init_scale)
        self.growth_factor = _number("growth_factor", growth_factor)
        if self.growth_factor <= 1.0:
            raise ValueError(f"DynamicLossScaler: growth_factor={self.growth_factor} must be > 1")
        self.backoff_factor = _number("backoff_factor", backoff_factor)
        if self.backoff_factor >= 1.0:
            raise ValueError(f"DynamicLossScaler: backoff_factor={self.backoff_factor} must be in (0, 1)")
        self.growth_interval = _positive_int("growth_interval", growth_interval)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_scale = _number("min_scale", min_scale)

    # ------------------------------------------------------------------ device placement
    def on_device(self, device: torch.device) -> None:
        """Move the state to ``device`` (once: the first loss or gradients decide where it lives)."""
        if self._scale.device == device:
            return
        for name in ("_scale", "_growth_tracker", "_hysteresis_tracker", "_underflow"):
            setattr(self, name, getattr(self, name).to(device))
        self._pending = None

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale: a 1-element float32 tensor on the device (reading it does not sync)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` as a fresh 1-element device tensor (the multiplier that unscales gradients)."""
        return torch.reciprocal(self._scale)

    def scale_value(self) -> float:
        """The scale as a Python float. **Synchronises with the device**: for logging, not every step."""
        self._check_underflow(self._underflow.item())
        return float(self._scale.item())

    # ------------------------------------------------------------------ the step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, in fp32 (an fp16 loss times 2^16 would itself overflow)."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"DynamicLossScaler.scale_loss: loss must be a tensor, got {type(loss).__name__}")
        self.on_device(loss.device)
        return loss * self._scale.reshape(()) if loss.dim() == 0 else loss * self._scale

    def unscale_and_check(self, tensors, *, groups: Sequence = (), unscale: bool = True
                          ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Unscale gradients in place, detect inf/nan, and agree on it across ranks; no host sync.

        ``tensors``: gradients, or parameters (their ``main_grad`` if set, else ``.grad``; None skipped).
        One ``ops.unscale_and_norm`` call per dtype. ``found_inf`` (1-element float32, 1.0 = overflow) is
        all-reduced with MAX over every group in ``groups`` (data, tensor and pipeline parallel groups), so
        a rank whose own gradients are finite still skips when a peer overflowed. ``norm`` is the L2 norm
        of this rank's unscaled gradients, *not* reduced (use ``clip_grad_norm_`` for the global norm).
        ``unscale=False`` only checks (and measures the unscaled norm) without writing.
        """
        grads, _ = grads_and_flags(tensors, "DynamicLossScaler.unscale_and_check")
        dev = grads[0].device if grads else self._scale.device
        self.on_device(dev)
        inv = torch.reciprocal(self._scale)
        found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
        sq = torch.zeros(1, dtype=torch.float32, device=dev)
        by_dtype: dict = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for ts in by_dtype.values():
            norm, _ = unscale_and_norm(ts, inv_scale=inv, found_inf=found_inf, unscale=unscale)
            sq += norm * norm
        for group in groups:
            C.all_reduce(found_inf, group, op=dist.ReduceOp.MAX)
        return found_inf, sq.sqrt()

    @torch.no_grad()
    def update(self, found_inf) -> None:
        """Advance the schedule by one step (``found_inf``: nonzero if this step overflowed). No host sync.

        Overflow: the clean-step count restarts and the hysteresis budget drops by one; once it reaches 0
        the scale is multiplied by ``backoff_factor`` (and every further overflow backs off again until
        the next growth refills the budget, as in Megatron). Clean step: after ``growth_interval`` of them
        in a row the scale is multiplied by ``growth_factor`` (unless that overflows fp32, as torch) and the
        hysteresis budget is refilled.
        """
        if isinstance(found_inf, torch.Tensor):
            self.on_device(found_inf.device)
        s = self._scale
        if isinstance(found_inf, torch.Tensor):
            inf = found_inf.reshape(1) != 0
        else:
            inf = torch.full((1,), bool(found_inf), dtype=torch.bool, device=s.device)
        # clamped at 0 (Megatron lets it go negative; same decisions, tidier checkpoints)
        hyst = torch.where(inf, (self._hysteresis_tracker - 1).clamp_(min=0), self._hysteresis_tracker)
        backoff = inf & (hyst <= 0)
        backed = s * self.backoff_factor
        under = backoff & (backed < self.min_scale)
        growth = torch.where(inf, torch.zeros_like(self._growth_tracker), self._growth_tracker + 1)
        grow = ~inf & (growth >= self.growth_interval)
        grown = s * self.growth_factor
        new_scale = torch.where(backoff & ~under, backed, torch.where(grow & torch.isfinite(grown), grown, s))
        self._growth_tracker.copy_(torch.where(grow, torch.zeros_like(growth), growth))
        self._hysteresis_tracker.copy_(torch.where(grow, torch.full_like(hyst, self.hysteresis), hyst))
        self._underflow.copy_(torch.where(under, backed, self._underflow))
        s.copy_(new_scale)
        self._poll_underflow()

    # ------------------------------------------------------------------ the min_scale error
    def _poll_underflow(self) -> None:
        if self._underflow.device.type != "cuda":
            self._check_underflow(self._underflow.item())   # CPU: reading is not a device sync
            return
        if self._pending is not None:
            host, event = self._pending
            if not event.query():
                return          # copy still in flight: look next step (the flag is sticky)
            self._check_underflow(host.item())
        else:
            host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        host.copy_(self._underflow, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)

    def _check_underflow(self, would_be: float) -> None:
        if would_be != 0.0:
            raise RuntimeError(
                f"DynamicLossScaler: the loss scale would drop to {would_be:g}, below min_scale={self.min_scale:g}: "
                f"the gradients are inf/nan even with almost no loss scaling, so this is not an fp16 range problem "
                f"a smaller scale can fix. Likely causes: training diverged (a nan/inf loss or weights: lower the "
                f"learning rate, add gradient clipping, check the data), or an fp16 overflow in the forward pass "
                f"(activations above 65504: keep that op in fp32 or train in bf16). Steps were being skipped, so "
                f"the parameters are those of the last good step.")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Plain Python values (one device sync); keys follow ``torch.amp.GradScaler`` plus Megatron's."""
        self._check_underflow(self._underflow.item())
        return {"scale": float(self._scale.item()), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self._growth_tracker.item()), "hysteresis": self.hysteresis,
                "_hysteresis_tracker": int(self._hysteresis_tracker.item()), "min_scale": self.min_scale}

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` (also takes a ``torch.amp.GradScaler`` state dict: hysteresis 1)."""
        if not isinstance(state, dict) or "scale" not in state:
            raise ValueError("DynamicLossScaler.load_state_dict: expected a dict with at least 'scale' (from "
                             "DynamicLossScaler.state_dict() or torch.amp.GradScaler.state_dict())")
        self._configure(init_scale=float(state["scale"]),
                        growth_factor=state.get("growth_factor", self.growth_factor),
                        backoff_factor=state.get("backoff_factor", self.backoff_factor),
                        growth_interval=state.get("growth_interval", self.growth_interval),
                        hysteresis=state.get("hysteresis",
                                             1 if "_hysteresis_tracker" not in state else self.hysteresis),
                        min_scale=state.get("min_scale", self.min_scale))
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state.get("_growth_tracker", 0)))
        self._hysteresis_tracker.fill_(int(state.get("_hysteresis_tracker", self.hysteresis)))
        self._underflow.zero_()
        self._pending = None

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(growth_factor={self.growth_factor}, backoff_factor={self.backoff_factor}, "
                f"growth_interval={self.growth_interval}, hysteresis={self.hysteresis}, min_scale={self.min_scale})")
