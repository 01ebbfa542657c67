"""FusedSGD: a drop-in ``torch.optim.SGD`` that steps flat buffers with one fused kernel.

torch semantics: weight decay is L2 (added to the gradient), the momentum buffer is initialised to the
first gradient (then ``buf = momentum * buf + (1 - dampening) * g``), Nesterov uses ``g + momentum * buf``.

Differences from torch, on purpose (see also ``fused_adamw``'s notes on flat buffers and bf16/fp16):

- Each parameter's state entry also holds ``"step"`` (how many momentum updates it has had), because the
  kernel initialises the momentum buffer on step 1; torch's SGD ignores the extra key when loading. Entries
  exist for every parameter that had a gradient, with ``"momentum_buffer": None`` while momentum is 0.
- The momentum buffers are allocated (one flat buffer) the first time a group steps with momentum != 0.
- ``foreach`` and ``fused`` are accepted and ignored; ``differentiable=True`` raises ``ValueError``.
"""
from __future__ import annotations

from typing import Optional

from ..ops.optimizer_step import reference_sgd_step
from .flat_buffers import FlatBuffer, FlatOptimizer


def _number(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"FusedSGD: {name} must be a number, got {type(value).__name__}") from None


class FusedSGD(FlatOptimizer):
    """SGD with optional momentum / dampening / Nesterov / weight decay / maximize, torch's arguments.

    ``backend`` forces the kernel backend of ``parallel_layers.ops.sgd_step`` (default: automatic).
    """

    _name = "FusedSGD"

    def __init__(self, params, lr=1e-3, momentum=0, dampening=0, weight_decay=0, nesterov=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, differentiable: bool = False,
                 fused: Optional[bool] = None, backend: Optional[str] = None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        self._check_group(defaults)
        super().__init__(params, defaults, backend)

    def _check_group(self, group: dict) -> None:
        if group.get("differentiable", False):
            raise ValueError("FusedSGD: differentiable=True is not supported (the fused kernel updates in "
                             "place outside autograd); use torch.optim.SGD(differentiable=True)")
        lr = _number("lr", group["lr"])
        if not lr >= 0:
            raise ValueError(f"FusedSGD: invalid lr={lr}; it must be >= 0")
        momentum = _number("momentum", group["momentum"])
        if not momentum >= 0:
            raise ValueError(f"FusedSGD: invalid momentum={momentum}; it must be >= 0")
        dampening = _number("dampening", group["dampening"])
        wd = _number("weight_decay", group["weight_decay"])
        if not wd >= 0:
            raise ValueError(f"FusedSGD: invalid weight_decay={wd}; it must be >= 0")
        if group.get("nesterov", False) and (momentum <= 0 or dampening != 0):
            raise ValueError(f"FusedSGD: nesterov=True needs momentum > 0 and dampening == 0 "
                             f"(got momentum={momentum}, dampening={dampening})")

    def _prepare(self, group: dict, fb: FlatBuffer) -> None:
        if group["momentum"] != 0 and "momentum_buffer" not in fb.states:
            # First step with momentum: the buffers start from the gradient, as in torch, so the
            # momentum step counts restart (they exist only to tell the kernel "first step").
            buf = fb.state("momentum_buffer")
            fb.steps.zero_()
            for i, p in enumerate(fb.params):
                if fb.started[i]:
                    self.state[p]["momentum_buffer"] = fb.view(buf, i)

    def _state_entry(self, fb: FlatBuffer, i: int) -> dict:
        entry = self._common_entry(fb, i)
        buf = fb.states.get("momentum_buffer")
        entry["momentum_buffer"] = None if buf is None else fb.view(buf, i)
        return entry

    def _load_entry(self, fb: FlatBuffer, i: int, entry: dict) -> None:
        buf = entry.get("momentum_buffer")
        # torch's SGD has no step count: a saved buffer means "past the first momentum step".
        self._load_common(fb, i, entry, default_step=0.0 if buf is None else 1.0)
        if buf is not None:
            self._load_tensor(fb, i, fb.state("momentum_buffer"), buf, "momentum_buffer")

    def _update(self, group: dict, fb: FlatBuffer, i: int, j: int, scale, found_inf, cache: dict) -> None:
        s = fb.span(i, j)
        momentum = float(group["momentum"])
        buf = fb.states["momentum_buffer"][s] if momentum != 0 else None
        kernel = self._kernel("sgd_step", fb.device, reference_sgd_step, cache)
        kernel(fb.master[s], fb.grad[s], buf, None if fb.low is None else fb.low[s], fb.steps[i:i + 1], scale,
               found_inf, float(group["lr"]), momentum, float(group["dampening"]), float(group["weight_decay"]),
               bool(group["nesterov"]), bool(group["maximize"]))
