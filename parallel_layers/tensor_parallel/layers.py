"""Column- and row-parallel linear layers (Megatron-LM's pair), with sequence parallelism.

A transformer MLP is ``Row(act(Column(x)))``: the column layer splits the *output* features, so each
rank computes ``act(x @ W_r.T + b_r)`` for its slice of the hidden units with no communication; the
row layer splits the *input* features to match, each rank's product is a partial sum of the output,
and one all-reduce finishes it. One all-reduce forward, one backward, per MLP (or attention block).

=======================  ==============  ================================  =============================
layer                    weight shard    forward in / out                   communication (fwd / bwd)
=======================  ==============  ================================  =============================
ColumnParallelLinear     ``[out/tp, in]`` ``[..., in]`` -> ``[..., out/tp]`` identity / all-reduce
  + sequence_parallel                    ``[b, s/tp, in]`` -> ``[b, s, out/tp]`` all-gather s / reduce-scatter s
  + gather_output                        ... -> ``[..., out]``             all-gather last / split last
RowParallelLinear        ``[out, in/tp]`` ``[..., in/tp]`` -> ``[..., out]`` all-reduce / identity
  + sequence_parallel                    ``[b, s, in/tp]`` -> ``[b, s/tp, out]`` reduce-scatter s / all-gather s
=======================  ==============  ================================  =============================

Sequence parallelism (Korthikanti et al. 2022) replaces each all-reduce by a reduce-scatter plus an
all-gather of the same total volume, so the activations *between* TP regions (LayerNorm, dropout,
residual) are held as ``[b, s/tp, h]``: 1/tp of the memory. The price: a parameter applied to
sequence-sharded activations (the row layer's bias, LayerNorm weights) sees only this rank's tokens, so
its gradient is partial; such parameters carry ``param.sequence_parallel = True`` and
:func:`allreduce_sequence_parallel_grads` sums them over the TP group after backward.

Every sharded parameter carries ``tensor_parallel = True`` and ``partition_dim`` (the dimension it
is split along); replicated ones do not (gradient-norm code counts those once, not tp times).

Initialisation: see :mod:`.random`: the full dense weight is built with ``nn.Linear``'s own init
from the default generator and sliced, so a model seeded alike on every rank equals the dense model.
That costs one full ``[out, in]`` weight of transient memory per layer at construction.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..distributed import collectives as C
from ..mesh import check_group
from ..ops import fused_linear
from ..ops.linear import ACTIVATIONS
from .mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from .random import linear_default_init_, shard


# ---------------------------------------------------------------------- shared checks and helpers
def check_positive(layer: str, **sizes) -> None:
    """Each of ``sizes`` is a positive int (not a bool), else a ValueError naming ``layer`` and the size."""
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"{layer}: {name}={size!r} must be a positive integer")


def divisibility_error(layer: str, name: str, size: int, tp: int) -> ValueError:
    """``name=size`` does not divide by the TP size: name the sizes and suggest ones that divide."""
    below = (size // tp) * tp
    above = below + tp
    sizes = " or ".join(str(s) for s in (below, above) if s > 0)
    tps = [d for d in range(1, size + 1) if size % d == 0 and d <= max(tp * 2, 8)]
    return ValueError(f"{layer}: {name}={size} does not divide by the tensor-parallel size {tp}; choose "
                      f"{name} a multiple of {tp} (e.g. {sizes}) or a tensor-parallel size that divides "
                      f"{size} (e.g. {', '.join(map(str, tps))})")


def check_sequence_input(layer: str, x: torch.Tensor, tp: int, what: str, min_dim: int = 3) -> None:
    """Sequence-parallel inputs are batch-first ``[b, s, ...]``; ``s`` must divide by ``tp`` when the
    layer reduce-scatters it (``what`` names that dimension; empty: no divisibility check)."""
    if x.dim() < min_dim:
        layout = "[batch, seq, hidden]" if min_dim == 3 else "[batch, seq]"
        raise ValueError(f"{layer}: sequence parallelism needs batch-first input {layout}; got shape "
                         f"{tuple(x.shape)}")
    if what and x.shape[1] % tp:
        raise ValueError(f"{layer}: sequence length {x.shape[1]} ({what}) does not divide by the "
                         f"tensor-parallel size {tp}; pad the sequence to a multiple of {tp}")


def set_parameter(module: nn.Module, name: str, data: Optional[torch.Tensor], requires_grad: bool = True,
                  **attrs) -> None:
    """Register ``data`` as parameter ``name`` (or ``None``) and tag it with ``attrs``."""
    if data is None:
        module.register_parameter(name, None)
        return
    param = nn.Parameter(data, requires_grad=requires_grad)
    for key, value in attrs.items():
        setattr(param, key, value)
    module.register_parameter(name, param)


def _linear_shards(in_features: int, out_features: int, bias: bool, init_method, dtype, device,
                   dim: int, rank: int, world: int):
    """Full ``nn.Linear`` init (or ``init_method(weight)`` and a zero bias), then this rank's slices.

    The weight is split along ``dim``; the bias along dim 0 when the weight is split along 0 (column),
    else it is kept whole (row)."""
    weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
    full_bias = torch.empty(out_features, dtype=dtype, device=device) if bias else None
    if weight.device.type != "meta":  # meta: shapes only, no values, no random numbers drawn
        if init_method is None:
            linear_default_init_(weight, full_bias)
        else:
            with torch.no_grad():
                init_method(weight)
                if full_bias is not None:
                    full_bias.zero_()
    w = shard(weight, dim, rank, world)
    b = None if full_bias is None else (shard(full_bias, 0, rank, world) if dim == 0 else full_bias)
    return w, b


def _from_dense_kwargs(cls_name: str, kwargs: dict) -> None:
    for key in ("dtype", "device", "init_method"):
        if key in kwargs:
            raise TypeError(f"{cls_name}.from_dense: {key!r} comes from the dense module; do not pass it")


# ---------------------------------------------------------------------- column parallel
class ColumnParallelLinear(nn.Module):
    """``Y = act(X A^T + b)`` with ``A`` split by rows (output features) over the TP group.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``out_features`` must divide by tp.
        tp_group: the tensor-parallel process group (``mesh.tp_group``).
        gather_output: all-gather the output so every rank holds ``[..., out]`` (else ``[..., out/tp]``,
            what a following :class:`RowParallelLinear` with ``input_is_parallel=True`` takes).
        sequence_parallel: input is ``[b, s/tp, in]``, all-gathered along the sequence first.
        input_gathered: the input is a sequence-parallel activation the caller all-gathered, whose backward
            reduce-scatters its gradient (several projections of one input gathered once:
            :mod:`~parallel_layers.tensor_parallel.sequence_parallel`): this layer's partial input gradient
            is passed on unreduced.
        activation: ``None``, ``"gelu"`` or ``"silu"``, fused into the matmul epilogue on GPU (valid
            because the activation is elementwise and each rank holds whole output features).
        init_method: ``fn(full_weight)`` in place; the bias then starts at zero. Default: nn.Linear's.
        mesh: optional :class:`ParallelMesh`; when given, ``tp_group`` must be its TP group.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group,
                 gather_output: bool = False, sequence_parallel: bool = False, activation: Optional[str] = None,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, dtype=None, device=None,
                 mesh=None, input_gathered: bool = False):
        super().__init__()
        name = type(self).__name__
        if input_gathered and sequence_parallel:
            raise ValueError(f"{name}: input_gathered=True (the caller gathered the sequence) and "
                             f"sequence_parallel=True (this layer gathers it) exclude each other")
        self.input_gathered = bool(input_gathered)
        check_positive(name, in_features=in_features, out_features=out_features)
        world = check_group(name, tp_group, mesh)
        if out_features % world:
            raise divisibility_error(name, "out_features", out_features, world)
        if activation not in ACTIVATIONS:
            raise ValueError(f"{name}: activation={activation!r} is not one of {ACTIVATIONS}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = tp_group, world, C.rank(tp_group)
        self.out_features_per_partition = out_features // world
        self.gather_output, self.sequence_parallel, self.activation = gather_output, sequence_parallel, activation
        w, b = _linear_shards(in_features, out_features, bias, init_method, dtype, device, 0,
                              self.tp_rank, world)
        set_parameter(self, "weight", w, tensor_parallel=True, partition_dim=0)
        set_parameter(self, "bias", b, tensor_parallel=True, partition_dim=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and not self.sequence_parallel:  # nothing to gather or copy
            return _local_linear(x, self.weight, self.bias, self.activation, self._input_error)
        error = self._input_error(x)
        if error is not None:
            raise error
        if self.sequence_parallel:
            check_sequence_input(type(self).__name__, x, self.tp_size, "")
            x = gather_from_sequence_parallel_region(x, self.tp_group, dim=1)
        elif self.tp_size > 1 and not self.input_gathered:
            # (at tp 1 the copy and the gather are identities: their Functions' host time skipped)
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = fused_linear(x, self.weight, self.bias, activation=self.activation)
        if self.gather_output and self.tp_size > 1:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y

    def _input_error(self, x: torch.Tensor) -> Optional[ValueError]:
        if x.shape[-1] == self.in_features:
            return None
        return ValueError(f"{type(self).__name__}: input has last dimension {x.shape[-1]}, expected "
                          f"in_features={self.in_features} (input shape {tuple(x.shape)})")

    @classmethod
    def from_dense(cls, module: nn.Linear, *, tp_group, **kwargs) -> "ColumnParallelLinear":
        """A column-parallel copy of ``module``: this rank keeps rows ``[r*out/tp, (r+1)*out/tp)``."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense: expected an nn.Linear, got {type(module).__name__}")
        _from_dense_kwargs(cls.__name__, kwargs)
        w = module.weight
        layer = cls(module.in_features, module.out_features, module.bias is not None, tp_group=tp_group,
                    dtype=w.dtype, device="meta", **kwargs)
        r, n = layer.tp_rank, layer.tp_size
        set_parameter(layer, "weight", shard(w.detach(), 0, r, n), w.requires_grad,
                      tensor_parallel=True, partition_dim=0)
        if module.bias is not None:
            set_parameter(layer, "bias", shard(module.bias.detach(), 0, r, n), module.bias.requires_grad,
                          tensor_parallel=True, partition_dim=0)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_features_per_partition} on this rank of {self.tp_size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}, "
                f"activation={self.activation}")


def _local_linear(x, weight, bias, activation, input_error: Callable[[torch.Tensor], Optional[ValueError]]):
    """A TP layer's linear where there is nothing to communicate (tp 1, no sequence parallelism), its input
    checked only if the linear fails (host time per call): ``input_error(x)``, the layer's own message, is
    raised then, where it names a cause."""
    try:
        return fused_linear(x, weight, bias, activation=activation)
    except (ValueError, RuntimeError) as exc:
        error = input_error(x)
        if error is None:
            raise
        raise error from exc


# ---------------------------------------------------------------------- row parallel
class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A`` split by columns (input features) over the TP group.

    Each rank computes ``X_r A_r^T`` (a partial sum of ``Y``); the partial sums are all-reduced, or
    reduce-scattered along the sequence under ``sequence_parallel`` (output ``[b, s/tp, out]``). The
    bias is whole on every rank and added once, after the reduction.

    Args:
        in_features, out_features, bias: as ``nn.Linear``; ``in_features`` must divide by tp.
        input_is_parallel: the input is already this rank's ``[..., in/tp]`` slice (the output of a
            :class:`ColumnParallelLinear`); else the full ``[..., in]`` input is split here.
        sequence_parallel: reduce-scatter the output along dim 1; requires ``input_is_parallel``.
            The bias then gets a partial gradient per rank and is marked ``sequence_parallel = True``
            for :func:`allreduce_sequence_parallel_grads`.
        init_method, dtype, device, mesh: as :class:`ColumnParallelLinear`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_method: Optional[Callable[[torch.Tensor], None]] = None, dtype=None, device=None,
                 mesh=None):
        super().__init__()
        name = type(self).__name__
        check_positive(name, in_features=in_features, out_features=out_features)
        world = check_group(name, tp_group, mesh)
        if in_features % world:
            raise divisibility_error(name, "in_features", in_features, world)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(f"{name}: sequence_parallel=True requires input_is_parallel=True (the input must be "
                             f"the [b, s, in/tp] output of a ColumnParallelLinear)")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.tp_size, self.tp_rank = tp_group, world, C.rank(tp_group)
        self.in_features_per_partition = in_features // world
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        w, b = _linear_shards(in_features, out_features, bias, init_method, dtype, device, 1,
                              self.tp_rank, world)
        set_parameter(self, "weight", w, tensor_parallel=True, partition_dim=1)
        set_parameter(self, "bias", b, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and not self.sequence_parallel:  # nothing to scatter or reduce: the bias fused too
            return _local_linear(x, self.weight, self.bias, None, self._input_error)
        error = self._input_error(x)
        if error is not None:
            raise error
        name = type(self).__name__
        if self.sequence_parallel:
            check_sequence_input(name, x, self.tp_size, "dim 1 of the input, reduce-scattered over the TP group")
        if not self.input_is_parallel and self.tp_size > 1:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        y = fused_linear(x, self.weight, None)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, dim=1)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias

    def _input_error(self, x: torch.Tensor) -> Optional[ValueError]:
        name = type(self).__name__
        expected = self.in_features_per_partition if self.input_is_parallel else self.in_features
        if x.shape[-1] != expected:
            what = (f"in_features/tp = {self.in_features}/{self.tp_size}" if self.input_is_parallel
                    else f"in_features={self.in_features}")
            hint = ""
            if self.input_is_parallel and x.shape[-1] == self.in_features:
                hint = ("; it got the dense width: the code before it (attention that reads head counts from its "
                        "config, an MLP that splits a fused output) works in dense sizes on the local shard: "
                        "give that module local sizes in the plan, {'style': 'divide', 'attrs': [...], "
                        "'config_attrs': ['num_attention_heads', 'num_key_value_heads']} (see "
                        "tensor_parallel.parallelize; Parallel3D takes it as tp_plan=), and sections for a "
                        "fused projection")
            return ValueError(f"{name}: input has last dimension {x.shape[-1]}, expected {expected} ({what}; "
                              f"input_is_parallel={self.input_is_parallel}, input shape {tuple(x.shape)}){hint}")
        return None

    @classmethod
    def from_dense(cls, module: nn.Linear, *, tp_group, **kwargs) -> "RowParallelLinear":
        """A row-parallel copy of ``module``: this rank keeps columns ``[r*in/tp, (r+1)*in/tp)``."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_dense: expected an nn.Linear, got {type(module).__name__}")
        _from_dense_kwargs(cls.__name__, kwargs)
        w = module.weight
        layer = cls(module.in_features, module.out_features, module.bias is not None, tp_group=tp_group,
                    dtype=w.dtype, device="meta", **kwargs)
        set_parameter(layer, "weight", shard(w.detach(), 1, layer.tp_rank, layer.tp_size), w.requires_grad,
                      tensor_parallel=True, partition_dim=1)
        if module.bias is not None:
            set_parameter(layer, "bias", module.bias.detach().clone(), module.bias.requires_grad,
                          sequence_parallel=layer.sequence_parallel)
        return layer

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_features_per_partition} on this rank of "
                f"{self.tp_size}), out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


# ---------------------------------------------------------------------- sequence-parallel gradients
def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor on the same memory. Under ZeRO ``p.grad`` is a guard that refuses to be
    read (its values are this rank's, not the data-parallel sum); summing the sequence-parallel partial
    gradients over TP is right on exactly those local values, before the data-parallel reduction."""
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def allreduce_sequence_parallel_grads(module: Union[nn.Module, Iterable[nn.Module]], tp_group) -> int:
    """Sum over the TP group the gradients of every parameter marked ``sequence_parallel = True``.

    Under sequence parallelism a replicated parameter applied to sequence-sharded activations (the
    row layer's bias, LayerNorm weight and bias) gets a gradient from this rank's tokens only; the
    true gradient is the sum over the TP group. Call this after backward and before the data-parallel
    reduction / optimizer step (Megatron does it in ``finalize_model_grads``). One flat all-reduce per
    dtype; the results are copied back into the existing ``.grad`` tensors (so gradients that are views
    of a bucket stay views). ``module`` may be a list of modules (pipeline chunks). Returns the number
    of gradients reduced. Parameters without a gradient are skipped; every rank must agree on which.
    """
    modules = [module] if isinstance(module, nn.Module) else list(module)
    seen, grads = set(), []
    for m in modules:
        for p in m.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                grads.append(_plain(p.grad))
    if not grads or C.world_size(tp_group) == 1:
        return len(grads)
    buckets: dict = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for group_grads in buckets.values():
        flat = _flatten_dense_tensors(group_grads)
        C.all_reduce(flat, tp_group)
        for g, reduced in zip(group_grads, _unflatten_dense_tensors(flat, group_grads)):
            g.copy_(reduced)
    return len(grads)


__all__ = ["ColumnParallelLinear", "RowParallelLinear", "allreduce_sequence_parallel_grads"]
