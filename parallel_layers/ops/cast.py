"""Multi-tensor mixed-precision cast (fp32 <-> bf16/fp16) with an optional scale and overflow detection.

Kernel contract:

    multi_tensor_cast(srcs, dsts, scale, found_inf) -> None

- ``srcs``: contiguous tensors of one dtype; ``dsts``: contiguous tensors of one dtype, ``dsts[i]``
  with as many elements as ``srcs[i]`` (shapes may differ). Dtypes: float32, bfloat16, float16.
- ``dsts[i] = (float(srcs[i]) * scale).to(dsts[i].dtype)``, rounding to nearest even.
- ``found_inf[0]`` is set to 1.0 if any written value is inf or nan (an fp16 overflow, or a
  non-finite input); it is never cleared.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from . import _backend, _checks


def reference_multi_tensor_cast(srcs, dsts, scale, found_inf):
    nonfinite = torch.zeros((), dtype=torch.bool, device=found_inf.device)
    for s, d in zip(srcs, dsts):
        if s.numel() == 0:
            continue
        y = (s.float() * scale).to(d.dtype)
        nonfinite |= ~torch.isfinite(y).all()
        d.copy_(y.view(d.shape))
    found_inf.copy_(torch.where(nonfinite, torch.ones_like(found_inf), found_inf))


def _check_sizes(op, srcs, dsts) -> None:
    for i, (s, d) in enumerate(zip(srcs, dsts)):
        if s.numel() != d.numel():
            raise ValueError(f"{op}: srcs[{i}] has {s.numel()} elements but dsts[{i}] has {d.numel()}")


def _check_pairs(op, srcs, dsts, dev) -> None:
    _checks.tensor_list(op, "srcs", srcs, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor_list(op, "dsts", dsts, dtypes=_checks.FLOAT_DTYPES, device=dev)
    _check_sizes(op, srcs, dsts)


def multi_tensor_cast(srcs: Sequence[torch.Tensor], dsts: Optional[Sequence[torch.Tensor]] = None, *,
                      dtype: Optional[torch.dtype] = None, scale: Union[float, torch.Tensor] = 1.0,
                      found_inf: Optional[torch.Tensor] = None,
                      backend: Optional[str] = None) -> List[torch.Tensor]:
    """Cast every ``srcs[i]`` (times ``scale``) into ``dsts[i]``; allocate ``dsts`` of ``dtype`` if not given.

    Pass ``found_inf`` (a 1-element float32 tensor) to learn whether any output overflowed.
    Returns ``dsts``.
    """
    op = "multi_tensor_cast"
    first = srcs[0] if isinstance(srcs, (list, tuple)) and srcs else None
    native = _backend.checks_inputs(op, getattr(first, "device", None), backend)
    srcs = _checks.tensor_list(op, "srcs", srcs, dtypes=_checks.FLOAT_DTYPES, kernel_checks=native)
    if dsts is None:
        if dtype is None:
            raise ValueError(f"{op}: pass dsts, or dtype= to allocate them")
        if dtype not in _checks.FLOAT_DTYPES:
            raise TypeError(f"{op}: dtype={dtype} is not one of float32, bfloat16, float16")
        dsts = [torch.empty_like(s, dtype=dtype) for s in srcs]
    dev = srcs[0].device if srcs else None
    dsts = _checks.tensor_list(op, "dsts", dsts, dtypes=_checks.FLOAT_DTYPES, device=dev, kernel_checks=native)
    if len(dsts) != len(srcs):
        raise ValueError(f"{op}: got {len(srcs)} srcs but {len(dsts)} dsts")
    if dtype is not None and dsts and dsts[0].dtype != dtype:
        raise TypeError(f"{op}: dtype={dtype} but dsts have dtype {dsts[0].dtype}")
    if not native:
        _check_sizes(op, srcs, dsts)
    if not srcs:
        return dsts
    scale_t = _checks.scalar_tensor(op, "scale", scale, dev)
    if found_inf is None:
        found_inf = torch.zeros(1, dtype=torch.float32, device=dev)
    inf_t = _checks.scalar_tensor(op, "found_inf", found_inf, dev)
    impl = _backend.kernel(op, dev, backend, reference_multi_tensor_cast)
    _checks.explain_kernel_error(lambda: impl(srcs, dsts, scale_t, inf_t), lambda: _check_pairs(op, srcs, dsts, dev))
    return dsts
