"""The experts of a Mixture-of-Experts layer: ``E`` gated MLPs run as grouped matrix products.

Each expert is a SwiGLU MLP (``down(silu(gate(x)) * up(x))``; ``activation="gelu"`` makes it GeGLU), its
weights stacked over the experts: ``gate_proj, up_proj [E, I, H]`` and ``down_proj [E, H, I]``, expert ``e``'s
slice laid out as an ``nn.Linear`` weight (``[out, in]``), each initialised as ``nn.Linear`` would. Gate and
up are kept apart (not one fused ``[E, 2I, H]``) so that a tensor-parallel split of ``I`` is a plain slice.

The input is :func:`~.permute.permute`'s: rows grouped by expert, ``counts[e]`` rows for expert ``e``.
:func:`grouped_mm` multiplies each block by its expert's weight, by one of two backends:

- ``"grouped_mm"``: ``torch._grouped_mm``, one kernel for all experts, offsets on the device (no host sync).
  It takes fp32, bf16 and fp16 with row strides that are multiples of 16 bytes; on CUDA it needs compute
  capability 8.0 or newer. torch's CPU kernel exists too, but its backward checks the gradient's strides
  only when it runs (too late to fall back), so ``"auto"`` uses it on CUDA only.
- ``"triton"``: the Triton grouped kernel of :mod:`parallel_layers.ops.grouped_mm`, one launch for all experts
  (tiles mapped to (expert, row tile, column tile) on the device, no host sync), fp32/bf16/fp16 of one dtype;
  CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (how its tests run). Its sums run in tile order:
  equal to the loop to float32 rounding, not bit for bit.
- ``"loop"``: one ``F.linear`` per expert over its contiguous block (the CPU path, and any dtype).

``"auto"`` (the default) picks ``torch._grouped_mm`` where it qualifies, else on CUDA the Triton kernel when
Triton can run, else the loop (always the loop on CPU).
:func:`grouped_mm_reference` (row by row) is the oracle both are tested against.
"""
from __future__ import annotations

import math
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import resolve_backend
from ..ops.grouped_mm import BACKENDS as TRITON_BACKENDS
from ..ops.grouped_mm import DTYPES as TRITON_DTYPES
from ..ops.grouped_mm import OP as TRITON_OP
from ..ops.grouped_mm import grouped_mm as triton_grouped_mm
from .meta import sizes_of

BACKENDS = ("auto", "grouped_mm", "triton", "loop")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
_GROUPED_MM = getattr(torch, "_grouped_mm", None)
_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_unsupported(x: torch.Tensor, weight: torch.Tensor, cpu: bool = False) -> str:
    """Why ``torch._grouped_mm`` cannot take ``x [N, in]`` and ``weight [E, out, in]``, or '' when it can.
    ``cpu=True`` accepts CPU tensors too (the ``"grouped_mm"`` backend when asked for by name)."""
    if _GROUPED_MM is None:
        return f"torch {torch.__version__} has no torch._grouped_mm"
    if x.dtype != weight.dtype or x.dtype not in _GROUPED_DTYPES:
        return f"it takes fp32, bf16 or fp16 inputs of one dtype; got {x.dtype} and {weight.dtype}"
    size = x.element_size()
    if (weight.shape[1] * size) % 16 or (weight.shape[2] * size) % 16:
        return (f"its rows must be multiples of 16 bytes; got {weight.shape[2]} -> {weight.shape[1]} features of "
                f"{size} bytes")
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return "it needs a GPU of compute capability 8.0 or newer"
        return ""
    if cpu and x.device.type == "cpu":
        return ""
    return f"it is used on CUDA only (got a {x.device.type} tensor)"


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    blocks = [F.linear(block, weight[e]) for e, block in enumerate(x.split(sizes)) if sizes[e]]
    if not blocks:                                         # no rows: still a product, so the graph reaches weight
        return F.linear(x, weight[0])
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0]


def _grouped_kernel(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return _GROUPED_MM(x, weight.transpose(-2, -1), offs=offsets)


def _triton_unsupported(x: torch.Tensor, weights) -> str:
    """Why the Triton grouped kernel cannot take these tensors, or '' when it can."""
    if any(w.dtype != x.dtype for w in weights) or x.dtype not in TRITON_DTYPES:
        return f"it takes fp32, bf16 or fp16 inputs of one dtype; got {x.dtype} and {[str(w.dtype) for w in weights]}"
    try:
        resolve_backend(TRITON_OP, x.device, "triton", TRITON_BACKENDS)
    except (RuntimeError, ValueError) as err:
        return str(err)
    return ""


def _choose(backend: str, x: torch.Tensor, weights) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"grouped_mm: backend={backend!r} must be one of {BACKENDS}")
    if backend == "loop":
        return "loop"
    if backend == "triton":
        why = _triton_unsupported(x, weights)
        if why:
            raise ValueError(f"grouped_mm: backend='triton' cannot run here: {why}; use backend='auto' or 'loop'")
        return "triton"
    why = next((w for w in (grouped_mm_unsupported(x, wt, cpu=backend == "grouped_mm") for wt in weights) if w), "")
    if backend == "grouped_mm" and why:
        raise ValueError(f"grouped_mm: backend='grouped_mm' cannot run here: {why}; use backend='auto' or 'loop'")
    if not why:
        return "grouped_mm"
    if x.device.type == "cuda" and not _triton_unsupported(x, weights):
        return "triton"
    return "loop"


def _product(choice: str, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """One grouped product by a device-side backend (no host sync)."""
    if choice == "grouped_mm":
        return _grouped_kernel(x, weight, counts)
    return triton_grouped_mm(x, weight, counts, backend="triton")


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``x [N, in]`` (``counts[e]`` rows per expert, in expert order), ``weight [E, out, in]`` -> ``[N, out]``:
    each block times its expert's weight, ``x_e @ weight[e].T``."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or counts.shape != weight.shape[:1]:
        raise ValueError(f"grouped_mm: x must be [N, in], weight [E, out, in] and counts [E]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}, counts {tuple(counts.shape)}")
    choice = _choose(backend, x, [weight])
    if choice != "loop":
        return _product(choice, x, weight, counts)
    return _loop_mm(x, weight, sizes_of(counts, x.shape[0]))


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_mm` row by row: row ``i`` of expert ``e`` is ``weight[e] @ x[i]``."""
    expert_of_row = torch.repeat_interleave(torch.arange(weight.shape[0]), counts.cpu())
    rows = [weight[int(e)] @ x[i] for i, e in enumerate(expert_of_row)]
    return torch.stack(rows) if rows else x.new_zeros(0, weight.shape[1])


class GroupedExperts(nn.Module):
    """``num_experts`` gated MLPs ``hidden -> intermediate -> hidden`` (see the module docstring).

    ``forward(permuted [N, hidden], counts [E]) -> [N, hidden]``, the rows grouped by expert as
    :func:`~.permute.permute` returns them."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, activation: str = "silu",
                 backend: str = "auto", device=None, dtype=None):
        super().__init__()
        for name, size in (("num_experts", num_experts), ("hidden_size", hidden_size),
                           ("intermediate_size", intermediate_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"{type(self).__name__}: {name}={size!r} must be a positive integer")
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation={activation!r} must be one of {tuple(ACTIVATIONS)}")
        if backend not in BACKENDS:
            raise ValueError(f"{type(self).__name__}: backend={backend!r} must be one of {BACKENDS}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation, self.backend = activation, backend
        kw = dict(device=device, dtype=dtype)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``nn.Linear(bias=False)`` initialises its weight."""
        with torch.no_grad():
            for weight in (self.gate_proj, self.up_proj, self.down_proj):
                if weight.device.type == "meta":
                    continue
                for e in range(self.num_experts):
                    nn.init.kaiming_uniform_(weight[e], a=math.sqrt(5))

    def forward(self, permuted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if permuted.dim() != 2 or permuted.shape[1] != self.hidden_size:
            raise ValueError(f"{type(self).__name__}: input must be [tokens, hidden_size={self.hidden_size}]; got "
                             f"{tuple(permuted.shape)}")
        if counts.shape != (self.num_experts,):
            raise ValueError(f"{type(self).__name__}: counts must be [num_experts={self.num_experts}]; got "
                             f"{tuple(counts.shape)}")
        act = ACTIVATIONS[self.activation]
        choice = _choose(self.backend, permuted, [self.gate_proj, self.down_proj])
        if choice != "loop":
            gate = _product(choice, permuted, self.gate_proj, counts)
            up = _product(choice, permuted, self.up_proj, counts)
            return _product(choice, act(gate) * up, self.down_proj, counts)
        sizes = sizes_of(counts, permuted.shape[0])       # one host sync for the three products
        hidden = act(_loop_mm(permuted, self.gate_proj, sizes)) * _loop_mm(permuted, self.up_proj, sizes)
        return _loop_mm(hidden, self.down_proj, sizes)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation!r}, "
                f"backend={self.backend!r}")


class GatedMLP(nn.Module):
    """A dense SwiGLU (or GeGLU) MLP, ``down(act(gate(x)) * up(x))`` with no biases: the shared experts of
    Qwen2-MoE and DeepSeek, which every token passes through beside its routed ones. Parameter names are
    transformers' (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, activation: str = "silu", device=None,
                 dtype=None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation={activation!r} must be one of {tuple(ACTIVATIONS)}")
        self.activation = activation
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ACTIVATIONS[self.activation](self.gate_proj(x)) * self.up_proj(x))
