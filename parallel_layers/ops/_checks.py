"""Argument checks shared by the ops: every error names the op, the argument and the fix."""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Union

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _short(dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor(op: str, name: str, t, *, dtypes=None, device=None, numel=None, flat=False, contiguous=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(_short(d) for d in dtypes)
        raise TypeError(f"{op}: {name} has dtype {_short(t.dtype)}; expected one of {allowed}")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other tensors are on {device}; "
                         f"move it with .to({str(device)!r})")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{op}: {name} has {t.numel()} elements, expected {numel} (all flat buffers of one "
                         f"step must have the same size)")
    if flat and t.dim() != 1:
        raise ValueError(f"{op}: {name} must be a 1-D flat buffer, got shape {tuple(t.shape)}; "
                         f"pass .view(-1) of a contiguous tensor")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (shape {tuple(t.shape)}, stride {t.stride()}); "
                         f"call .contiguous() first")
    return t


def tensor_list(op: str, name: str, ts, *, dtypes=None, device=None, kernel_checks: bool = False) -> list:
    """A non-nested list of contiguous tensors sharing one dtype and one device.

    ``kernel_checks``: the kernel about to run checks every item itself before any work (the C++ backends):
    only the list is checked here, since a Python pass costs ~0.3-0.6 us a tensor, which on a GPU is most
    of a multi-tensor op's time over thousands of small tensors. Wrap the call in ``explain_kernel_error``."""
    if isinstance(ts, torch.Tensor) or not isinstance(ts, (list, tuple)):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got {type(ts).__name__}")
    ts = list(ts)
    if not ts or (kernel_checks and isinstance(ts[0], torch.Tensor)):
        return ts
    first = ts[0]
    dev = device if device is not None else getattr(first, "device", None)
    if _uniform(ts, dtypes, dev):
        return ts
    for i, t in enumerate(ts):  # something is wrong: find it and say which
        tensor(op, f"{name}[{i}]", t, dtypes=dtypes, device=dev)
        if t.dtype != first.dtype:
            raise TypeError(f"{op}: {name}[{i}] has dtype {_short(t.dtype)} but {name}[0] has "
                            f"{_short(first.dtype)}; call the op once per dtype")
    return ts


def explain_kernel_error(call, recheck):
    """Run ``call()``, a kernel that validated its own arguments (``tensor_list(kernel_checks=True)``); if it
    refuses them, ``recheck()`` runs the full Python checks, which raise the usual error naming the fault
    (a TypeError or ValueError with the fix); where they find none the kernel's own error stands."""
    try:
        return call()
    except (RuntimeError, TypeError):      # TypeError: pybind11 refusing a list item that is no tensor
        recheck()
        raise


def _uniform(ts, dtypes, device) -> bool:
    """One pass over the common case (every item a contiguous tensor of the first one's dtype, on
    ``device``): an optimizer calls a multi-tensor op on hundreds of tensors every step, and the
    per-item checks with their messages cost ~0.6 us a tensor."""
    first = ts[0]
    if not isinstance(first, torch.Tensor) or (dtypes is not None and first.dtype not in dtypes):
        return False
    dtype = first.dtype
    return all(isinstance(t, torch.Tensor) and t.dtype == dtype and t.device == device and t.is_contiguous()
               for t in ts)


def scalar_tensor(op: str, name: str, value: Union[float, int, torch.Tensor, None], device: torch.device,
                  default: Optional[float] = None, convert: bool = False) -> torch.Tensor:
    """A 1-element float32 tensor on ``device`` from a Python number or a tensor (kept on device: no sync).

    ``convert=False`` (the public ops): a tensor on another device or of another dtype is an error, because
    moving it would hide a host sync from the caller. ``convert=True`` (optimizers, whose ``step`` takes
    what ``GradScaler`` hands over): it is moved and cast, asynchronously.
    """
    if value is None:
        value = default
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must hold exactly one element, got shape {tuple(value.shape)}")
        if convert:
            return value.to(device=device, dtype=torch.float32, non_blocking=True).reshape(1)
        if value.device != device:
            raise ValueError(f"{op}: {name} is on {value.device} but the data is on {device}; keep it on "
                             f"{device} so the kernel reads it without a host sync")
        if value.dtype != torch.float32:
            raise TypeError(f"{op}: {name} must be float32, got {value.dtype}")
        return value.reshape(1)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number or a 1-element float32 tensor, got {type(value).__name__}")
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def hyper(op: str, name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{op}: {name} must be a number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
    value = float(value)
    if value != value:
        raise ValueError(f"{op}: {name} is NaN")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{op}: {name}={value} must be {'>' if low_open else '>='} {low}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{op}: {name}={value} must be {'<' if high_open else '<='} {high}")
    return value


def offsets_for(op: str, sizes: Sequence[int], offsets: Optional[Iterable[int]], capacity: Optional[int]):
    """Default offsets pack tensors back to back; explicit ones must fit and not overlap."""
    if offsets is None:
        out, pos = [], 0
        for n in sizes:
            out.append(pos)
            pos += n
        if capacity is not None and pos > capacity:
            raise ValueError(f"{op}: the tensors need {pos} elements of bucket but it has {capacity}")
        return out, pos
    offsets = [int(o) for o in offsets]
    if len(offsets) != len(sizes):
        raise ValueError(f"{op}: got {len(offsets)} offsets for {len(sizes)} tensors")
    spans = sorted((o, o + n, i) for i, (o, n) in enumerate(zip(offsets, sizes)))
    end = 0
    for start, stop, i in spans:
        if start < 0:
            raise ValueError(f"{op}: offsets[{i}]={start} is negative")
        if start < end and stop > start:
            raise ValueError(f"{op}: tensor {i} at offset {start} overlaps the previous one (ends at {end})")
        end = max(end, stop)
    if capacity is not None and end > capacity:
        raise ValueError(f"{op}: the tensors need {end} elements of bucket but it has {capacity}")
    return offsets, end
