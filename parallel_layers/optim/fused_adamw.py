"""FusedAdamW: a drop-in ``torch.optim.AdamW`` / ``Adam`` that steps flat buffers with one fused kernel.

Differences from torch, on purpose:

- Parameters become views into flat buffers when the optimizer is built (see ``flat_buffers``). Do not
  re-create parameters (``module.to(...)``, ``.half()``) afterwards; in-place edits are fine (call
  :meth:`refresh_master_weights` after editing bf16/fp16 parameters in place).
- bf16/fp16 parameters get fp32 master weights and fp32 states (torch keeps states in the param dtype and
  does the math at that precision); the low-precision parameter is rewritten from the master in the same
  pass. Their state entries carry an extra ``"master_param"`` key so a reload continues bit-identically.
- ``foreach``, ``fused`` and ``capturable`` are accepted (and stored in the groups, so state dicts load into
  torch) but ignored: there is one implementation, and it never syncs with the host.
- ``amsgrad=True`` and ``differentiable=True`` are not supported and raise ``ValueError``.
"""
from __future__ import annotations

from typing import Optional

from ..ops.optimizer_step import reference_adamw_step
from .flat_buffers import FlatBuffer, FlatOptimizer


def _number(name: str, value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"FusedAdamW: {name} must be a number, got {type(value).__name__}") from None


class FusedAdamW(FlatOptimizer):
    """AdamW (``decoupled_weight_decay=True``, the default) or Adam with L2 decay (``False``).

    Arguments and param-group semantics are torch's; ``backend`` forces the kernel backend of
    ``parallel_layers.ops.adamw_step`` (``"torch"``, ``"cpp"``, ``"triton"``, ``"cuda"``; default: automatic).
    """

    _name = "FusedAdamW"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize: bool = False, foreach: Optional[bool] = None, capturable: bool = False,
                 differentiable: bool = False, fused: Optional[bool] = None, decoupled_weight_decay: bool = True,
                 backend: Optional[str] = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        self._check_group(defaults)
        defaults["betas"] = tuple(float(b) for b in betas)
        super().__init__(params, defaults, backend)

    def _check_group(self, group: dict) -> None:
        if group.get("amsgrad", False):
            raise ValueError("FusedAdamW: amsgrad=True is not supported; use torch.optim.AdamW(amsgrad=True)")
        if group.get("differentiable", False):
            raise ValueError("FusedAdamW: differentiable=True is not supported (the fused kernel updates in "
                             "place outside autograd); use torch.optim.AdamW(differentiable=True)")
        lr = _number("lr", group["lr"])
        if not lr >= 0:
            raise ValueError(f"FusedAdamW: invalid lr={lr}; it must be >= 0")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"FusedAdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        for k, b in enumerate(betas):
            b = _number(f"betas[{k}]", b)
            if not 0.0 <= b < 1.0:
                raise ValueError(f"FusedAdamW: invalid betas[{k}]={b}; it must be in [0, 1)")
        eps = _number("eps", group["eps"])
        if not eps >= 0:
            raise ValueError(f"FusedAdamW: invalid eps={eps}; it must be >= 0")
        wd = _number("weight_decay", group["weight_decay"])
        if not wd >= 0:
            raise ValueError(f"FusedAdamW: invalid weight_decay={wd}; it must be >= 0")

    def _state_entry(self, fb: FlatBuffer, i: int) -> dict:
        entry = self._common_entry(fb, i)
        entry["exp_avg"] = fb.view(fb.state("exp_avg"), i)
        entry["exp_avg_sq"] = fb.view(fb.state("exp_avg_sq"), i)
        return entry

    def _load_entry(self, fb: FlatBuffer, i: int, entry: dict) -> None:
        self._load_common(fb, i, entry, default_step=0.0)
        for key in ("exp_avg", "exp_avg_sq"):
            if key in entry:
                self._load_tensor(fb, i, fb.state(key), entry[key], key)

    def _update(self, group: dict, fb: FlatBuffer, i: int, j: int, scale, found_inf, cache: dict) -> None:
        s = fb.span(i, j)
        beta1, beta2 = group["betas"]
        kernel = self._kernel("adamw_step", fb.device, reference_adamw_step, cache)
        kernel(fb.master[s], fb.grad[s], fb.state("exp_avg")[s], fb.state("exp_avg_sq")[s],
               None if fb.low is None else fb.low[s], fb.steps[i:i + 1], scale, found_inf,
               float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
               bool(group["decoupled_weight_decay"]), bool(group["maximize"]))
