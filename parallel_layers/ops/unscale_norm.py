"""Unscale + non-finite check + global L2 norm over many tensors, in one pass, with no host sync.

Kernel contract:

    unscale_and_norm(tensors, inv_scale, found_inf, norm_out, unscale) -> None

- ``tensors``: list of contiguous tensors of one dtype (float32, bfloat16 or float16) on one device.
- ``inv_scale``, ``found_inf``, ``norm_out``: 1-element float32 tensors on that device.
- Each element is read as ``y = float(x) * inv_scale``; if ``unscale`` is true, ``y`` is written back in
  the tensor's dtype (in place). ``norm_out[0] = sqrt(sum of y*y)`` over all tensors, accumulated in
  float32 or wider. If any ``y`` is inf or nan, ``found_inf[0]`` is set to 1.0 (never cleared: it
  accumulates, like ``torch._amp_foreach_non_finite_check_and_unscale_``).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from . import _backend, _checks


def reference_unscale_and_norm(tensors, inv_scale, found_inf, norm_out, unscale):
    total = torch.zeros((), dtype=torch.float32, device=norm_out.device)
    nonfinite = torch.zeros((), dtype=torch.bool, device=norm_out.device)
    for x in tensors:
        if x.numel() == 0:
            continue
        y = x.float() * inv_scale
        nonfinite |= ~torch.isfinite(y).all()
        total += (y * y).sum()
        if unscale:
            x.copy_(y)
    norm_out.copy_(total.sqrt().reshape(1))
    found_inf.copy_(torch.where(nonfinite, torch.ones_like(found_inf), found_inf))


def unscale_and_norm(tensors: Sequence[torch.Tensor], *, inv_scale: Union[float, torch.Tensor, None] = None,
                     found_inf: Optional[torch.Tensor] = None, unscale: Optional[bool] = None,
                     backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm, found_inf)``, both 1-element float32 tensors on the tensors' device.

    With ``inv_scale`` given, the tensors are unscaled in place (GradScaler's unscale) unless
    ``unscale=False``; ``norm`` is the L2 norm of the unscaled values (clip_grad_norm_'s total norm).
    ``found_inf`` may be passed in to accumulate into (e.g. one flag across several dtypes).
    """
    op = "unscale_and_norm"
    first = tensors[0] if isinstance(tensors, (list, tuple)) and tensors else None
    native = _backend.checks_inputs(op, getattr(first, "device", None), backend)
    tensors = _checks.tensor_list(op, "tensors", tensors, dtypes=_checks.FLOAT_DTYPES, kernel_checks=native)
    if tensors:
        dev = tensors[0].device
    elif isinstance(found_inf, torch.Tensor):
        dev = found_inf.device
    else:
        dev = torch.device("cpu")
    if unscale is None:
        unscale = inv_scale is not None
    inv_t = _checks.scalar_tensor(op, "inv_scale", inv_scale, dev, default=1.0)
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
    inf_t = _checks.scalar_tensor(op, "found_inf", found_inf, dev)
    norm = torch.empty(1, dtype=torch.float32, device=dev)
    if not tensors:
        norm.zero_()
        return norm, inf_t
    impl = _backend.kernel(op, dev, backend, reference_unscale_and_norm)
    _checks.explain_kernel_error(lambda: impl(tensors, inv_t, inf_t, norm, bool(unscale)),
                                 lambda: _checks.tensor_list(op, "tensors", tensors, dtypes=_checks.FLOAT_DTYPES))
    return norm, inf_t
