"""Activation offload: a tensor moved to host memory while it waits for backward, and back for it.

Used by :class:`~parallel_layers.activations.partitioned_checkpoint.SavedInputs` for the inputs of checkpointed
blocks (ZeRO-R's CPU checkpointing): at the end of a block's forward its input is copied to host memory and
the device copy is freed; the block's recomputation in backward copies it back.

On CUDA the host buffer is pinned and both copies run on a side stream, so the device-to-host copy overlaps
the next block's forward: the side stream first waits for the compute stream (the input is complete), the
source's memory is marked as used by the side stream (``record_stream``, so the caching allocator does not
hand it out before the copy has read it), and an event marks the copy's end. The copy back waits for that
event, runs on the side stream, and the compute stream waits for it before the recomputation reads it.

On CPU there is no device memory to free: the "host" copy is a plain copy into a new tensor, which keeps the
code path (and its cost, a memcpy where a GPU would transfer over PCIe) exercised by the CPU tests. Nothing
here synchronises the host with the device.
"""
from __future__ import annotations

from typing import Optional

import torch


class OnHost:
    """A tensor's copy in host memory, with what is needed to bring it back: the device, and on CUDA the
    event that marks the end of the copy to the host."""

    __slots__ = ("host", "device", "event", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, event):
        self.host, self.device, self.event = host, device, event

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class HostOffload:
    """Copies tensors to host memory and back; one side stream per CUDA device (made on first use)."""

    def __init__(self, pin_memory: Optional[bool] = None):
        self.pin_memory = pin_memory            # None: pinned when the tensor is on a CUDA device
        self._streams = {}

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def to_host(self, t: torch.Tensor) -> OnHost:
        """``t``'s values in host memory (``t`` itself is not changed; drop it to free its memory)."""
        t = t.detach()
        if t.device.type != "cuda":
            return OnHost(t.clone(memory_format=torch.contiguous_format), t.device, None)
        pin = True if self.pin_memory is None else bool(self.pin_memory)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        side = self._side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))   # t is fully written before it is read
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        t.record_stream(side)       # t's memory is not reused until the side stream has read it
        return OnHost(host, t.device, event)

    def to_device(self, held: OnHost) -> torch.Tensor:
        """The values back on their device, ready for the current stream."""
        if held.device.type != "cuda":
            return held.host.clone()
        side = self._side_stream(held.device)
        with torch.cuda.stream(side):
            side.wait_event(held.event)
            out = held.host.to(held.device, non_blocking=True)
        current = torch.cuda.current_stream(held.device)
        current.wait_stream(side)
        out.record_stream(current)
        return out


__all__ = ["HostOffload", "OnHost"]
