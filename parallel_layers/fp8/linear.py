"""``FP8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in FP8.

The parameter stays the master weight (float32 or bfloat16); every forward quantizes the input and the weight
(``recipe.fwd_format``, E4M3 by default) and the backward quantizes the output gradient (``recipe.grad_format``,
E5M2 by default), with the recipe's scaling (see :mod:`.recipes`). The GEMMs:

=======  ========================  ==========================================================================
GEMM     operands                  kernel
=======  ========================  ==========================================================================
fprop    ``x @ W^T``               ``torch._scaled_mm`` for per-tensor and row-wise scales
dgrad    ``g @ W`` (``W^T`` cast)  ``torch._scaled_mm`` for per-tensor scales
wgrad    ``g^T @ x``               ``torch._scaled_mm`` for per-tensor scales
=======  ========================  ==========================================================================

Fallback: where ``_scaled_mm`` cannot take the scales (row-wise scales along the contraction dimension in
dgrad/wgrad; 1x128 / 128x128 blocks, which the CPU ``_scaled_mm`` does not implement) the FP8 operands are
dequantized to float32 and multiplied in float32: the same FP8 values, with float32 accumulation, like the
scaled GEMM. The bias is added in the output dtype, and its gradient is the unquantized sum of ``g``.

A non-finite amax anywhere (input, weight, gradient) sets ``layer.fp8_nonfinite`` (a 1-element float tensor,
no host sync); :meth:`FP8Linear.check_finite` raises if it is set.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed import collectives as C
from ..ops.fp8_cast import dequantize
from ..tensor_parallel.random import linear_default_init_
from .recipes import DelayedScaling, FP8Recipe, Quantized, quantize

OUT_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _cpu_takes_rowwise_scales() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.13's does; 2.11's, the GPU image's,
    refuses all but per-tensor ones with an internal assert)."""
    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def fp8_gemm(a: torch.Tensor, a_sinv: torch.Tensor, b: torch.Tensor, b_sinv: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
    """``(a * a_sinv) @ (b * b_sinv)^T`` for FP8 ``a`` [M, K], ``b`` [N, K] with per-block ``*_sinv``."""
    M, N = a.shape[0], b.shape[0]
    ga, gb = tuple(a_sinv.shape), tuple(b_sinv.shape)
    cuda_shape_ok = a.device.type != "cuda" or (a.shape[1] % 16 == 0 and N % 16 == 0)
    if ga == (1, 1) and gb == (1, 1) and cuda_shape_ok:
        return torch._scaled_mm(a, b.t(), scale_a=a_sinv.reshape(()), scale_b=b_sinv.reshape(()),
                                out_dtype=out_dtype)
    rowwise_ok = a.device.type != "cpu" or _cpu_takes_rowwise_scales()
    if ga in ((M, 1), (1, 1)) and gb in ((N, 1), (1, 1)) and cuda_shape_ok and rowwise_ok:
        return torch._scaled_mm(a, b.t(), scale_a=a_sinv.expand(M, 1).contiguous(),
                                scale_b=b_sinv.expand(N, 1).reshape(1, N).contiguous(), out_dtype=out_dtype)
    return (dequantize(a, a_sinv) @ dequantize(b, b_sinv).t()).to(out_dtype)


def _t(q: Quantized):
    """The transposed layout of ``q``: (data^T contiguous, scale grid^T)."""
    data_t = q.data_t if q.data_t is not None else q.data.t().contiguous()
    return data_t, q.scale_inv.t().contiguous()


def _backward_layout(q: Quantized) -> Quantized:
    """``q`` as the backward keeps it: the transposed copy alone where the cast made one (``_t`` reads it), else
    the data (``_t`` transposes it then)."""
    return Quantized(None, q.scale_inv, q.data_t, q.amax) if q.data_t is not None else q


def _seq_gather(t: torch.Tensor, lead, group) -> torch.Tensor:
    """Rows of a [b*s_local, k] matrix gathered along the sequence over ``group`` -> [b*s, k]."""
    b, s_local = lead
    raw = t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t
    full = C.all_gather_dim0(raw.reshape(b, s_local, -1).movedim(1, 0).contiguous(), group).movedim(0, 1)
    full = full.reshape(-1, t.shape[-1])
    return full.view(t.dtype) if raw is not t else full


@dataclass
class FP8Plan:
    """Where the tensors of one FP8 GEMM live: groups and sharded matrix dims for the amax reductions, and the
    sequence-parallel gather / reduce-scatter of the input (``seq_group``) or the all-reduce of ``dx``."""
    recipe: FP8Recipe
    states: dict = field(default_factory=dict)
    out_dtype: Optional[torch.dtype] = None
    backend: Optional[str] = None
    input_group: object = None
    input_shard_dim: Optional[int] = None
    weight_group: object = None
    weight_shard_dim: Optional[int] = None
    grad_group: object = None
    grad_shard_dim: Optional[int] = None
    seq_group: object = None
    dgrad_allreduce_group: object = None
    row_group: object = None      # the tokens are also split over this group (context parallelism)
    # the weight already quantized (per-tensor current scaling; ZeroStage3(fp8_gather=True) all-gathers it in
    # FP8): the forward uses it and reads no element of ``weight``
    weight_q: Optional[Quantized] = None


class FP8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, plan: FP8Plan, flag):
        r, st = plan.recipe, plan.states
        out_dtype = plan.out_dtype or x.dtype
        lead = list(x.shape[:-1])
        per_tensor = r.block("input") == (-1, -1)
        qx, bad_x = quantize(x, r.fwd_format, r.block("input"), group=plan.input_group,
                             shard_dim=plan.input_shard_dim, row_group=plan.row_group, state=st.get("input"),
                             margin=r.margin,
                             transpose=per_tensor and weight.requires_grad and plan.seq_group is None,
                             backend=plan.backend)
        if plan.seq_group is not None:  # scale first (amax reduced over the sequence), gather FP8 bytes
            world = C.world_size(plan.seq_group)
            sinv = qx.scale_inv
            if sinv.shape[0] == qx.data.shape[0]:
                sinv = _seq_gather(sinv, lead, plan.seq_group)
            qx = Quantized(_seq_gather(qx.data, lead, plan.seq_group), sinv, None, qx.amax)
            lead = [lead[0], lead[1] * world]
        if plan.weight_q is not None:
            qw = plan.weight_q
            if r.scaling != "tensor" or tuple(qw.data.shape) != tuple(weight.shape):
                raise ValueError(f"FP8LinearFunction: a pre-quantized weight of shape {tuple(qw.data.shape)} for a "
                                 f"weight of shape {tuple(weight.shape)}, recipe scaling {r.scaling!r}; it must be "
                                 f"the weight's own, per-tensor current scaling ('tensor')")
            bad_w = ~torch.isfinite(qw.amax).all()    # what quantize reports for that amax
        else:
            qw, bad_w = quantize(weight, r.fwd_format, r.block("weight"), group=plan.weight_group,
                                 shard_dim=plan.weight_shard_dim, state=st.get("weight"), margin=r.margin,
                                 transpose=per_tensor and x.requires_grad, backend=plan.backend)
        y = fp8_gemm(qx.data, qx.scale_inv, qw.data, qw.scale_inv, out_dtype)
        if bias is not None:
            y = y + bias.to(out_dtype)
        torch.maximum(flag, (bad_x | bad_w).reshape(1), out=flag)
        # backward reads x^T (wgrad) and W^T (dgrad) only: keep one layout of each, and nothing it will not use
        ctx.plan, ctx.flag = plan, flag
        ctx.qx = _backward_layout(qx) if weight.requires_grad else None
        ctx.qw = _backward_layout(qw) if x.requires_grad else None
        ctx.x_dtype, ctx.x_shape, ctx.has_bias = x.dtype, x.shape, bias is not None
        ctx.w_dtype = weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*lead, y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        plan, r = ctx.plan, ctx.plan.recipe
        g2 = gy.reshape(-1, gy.shape[-1])
        per_tensor = r.block("grad") == (-1, -1)
        # under sequence parallelism the gradient's rows are whole over tp here (the output was gathered)
        qg, bad = quantize(g2, r.grad_format, r.block("grad"), group=plan.grad_group,
                           shard_dim=plan.grad_shard_dim, row_group=plan.row_group, state=plan.states.get("grad"),
                           margin=r.margin,
                           transpose=per_tensor and ctx.needs_input_grad[1], backend=plan.backend)
        torch.maximum(ctx.flag, bad.reshape(1), out=ctx.flag)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(qg.data, qg.scale_inv, *_t(ctx.qw), ctx.x_dtype)
            if plan.seq_group is not None:
                b = ctx.x_shape[0]
                full = dx.reshape(b, -1, dx.shape[-1]).movedim(1, 0).contiguous()
                dx = C.reduce_scatter_dim0(full, plan.seq_group).movedim(0, 1)
            elif plan.dgrad_allreduce_group is not None and C.world_size(plan.dgrad_allreduce_group) > 1:
                C.all_reduce(dx, plan.dgrad_allreduce_group)
            dx = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            g_t, g_sinv_t = _t(qg)
            x_t, x_sinv_t = _t(ctx.qx)
            dw = fp8_gemm(g_t, g_sinv_t, x_t, x_sinv_t, ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(ctx.bias_dtype)
        # ctx keeps qx/qw until the graph goes: a zero-bubble schedule runs this backward twice (B, then W)
        return dx, dw, db, None, None


def delayed_states(recipe: FP8Recipe, device=None, update: str = "cast") -> dict:
    """One :class:`DelayedScaling` per tensor of a layer (input, weight, grad) for the delayed recipe, else {}.
    ``update``: ``"cast"`` (the history takes every cast's amax) or ``"step"`` (once per optimizer step, from
    :func:`.recipes.commit_delayed`)."""
    if recipe.scaling != "delayed":
        return {}
    fmts = {"input": recipe.fwd_format, "weight": recipe.fwd_format, "grad": recipe.grad_format}
    return {k: DelayedScaling(recipe.history_len, f, recipe.margin, device, update) for k, f in fmts.items()}


class FP8Mixin:
    """What every FP8 layer shares: the recipe, the delayed-scaling states and the non-finite flag."""

    def init_fp8(self, recipe: Optional[FP8Recipe], out_dtype, backend, device) -> None:
        self.recipe = recipe if recipe is not None else FP8Recipe()
        if not isinstance(self.recipe, FP8Recipe):
            raise TypeError(f"{type(self).__name__}: recipe must be an FP8Recipe, got {type(recipe).__name__}")
        if out_dtype is not None and out_dtype not in OUT_DTYPES:
            raise ValueError(f"{type(self).__name__}: out_dtype={out_dtype} must be float32 or bfloat16 "
                             f"(what torch._scaled_mm writes)")
        self.out_dtype, self.backend = out_dtype, backend
        self.fp8_states = delayed_states(self.recipe, device if device != "meta" else None)
        self.register_buffer("fp8_nonfinite", torch.zeros(1, device=device), persistent=False)
        self.row_group = None

    def set_row_group(self, group) -> None:
        """The tokens reaching this layer are split over ``group`` too (context parallelism's sequence shards):
        per-tensor amaxes of the input and the output gradient are max-reduced over it as well."""
        self.row_group = group

    def set_delayed_update(self, update: str) -> None:
        """``"step"``: the delayed-scaling histories take one amax per optimizer step (committed by
        :func:`.recipes.commit_delayed`), ``"cast"``: one per cast. The histories start empty again."""
        self.fp8_states = delayed_states(self.recipe, self.fp8_nonfinite.device, update)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dtype not in OUT_DTYPES:
            raise ValueError(f"{type(self).__name__}: input dtype {x.dtype}; FP8 layers take float32 or bfloat16 "
                             f"activations (cast with x.float() or x.bfloat16())")

    def check_finite(self) -> None:
        """Raise if any amax seen since the last :meth:`reset_nonfinite` was inf or NaN (one host sync)."""
        if self.fp8_nonfinite.item():
            raise FloatingPointError(f"{type(self).__name__}: an FP8 amax was inf or NaN (the input, weight or "
                                     f"gradient holds non-finite values); the scales kept their fallback values")

    def reset_nonfinite(self) -> None:
        self.fp8_nonfinite.zero_()

    # ZeRO-3's FP8 all-gather (ZeroStage3(fp8_gather=True), per-tensor current scaling): while the weight's unit is
    # gathered, the wrapper hands the layer its weight as FP8 bytes, quantized with the whole weight's amax (the
    # bytes the layer would make from the gathered full-precision weight); the forward uses them.
    fp8_gathered_weight: Optional[Quantized] = None

    def use_gathered_fp8_weight(self, q: Optional[Quantized]) -> None:
        """Use ``q`` (the weight quantized per tensor with the layer's ``fwd_format`` and ``margin``) in the
        forwards from now on instead of quantizing ``weight``; None: quantize ``weight`` again."""
        self.fp8_gathered_weight = q

    def weight_amax_group(self):
        """The group the weight's per-tensor amax is max-reduced over: the tensor-parallel group of a
        tensor-parallel layer (its weight is a TP shard), else None."""
        return getattr(self, "tp_group", None)


class FP8Linear(FP8Mixin, nn.Module):
    """``nn.Linear`` with FP8 GEMMs. ``recipe``: :class:`FP8Recipe`; ``out_dtype``: the output's dtype (default:
    the input's); ``backend``: the cast kernels' backend (see ``parallel_layers.ops``); ``activation``: None,
    ``"gelu"`` or ``"silu"`` applied to the output (not fused into the GEMM)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 recipe: Optional[FP8Recipe] = None, out_dtype=None, backend=None, dtype=None, device=None,
                 activation: Optional[str] = None):
        super().__init__()
        if activation not in (None, "gelu", "silu"):
            raise ValueError(f"FP8Linear: activation={activation!r} is not one of None, 'gelu', 'silu'")
        self.in_features, self.out_features, self.activation = in_features, out_features, activation
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        linear_default_init_(self.weight, self.bias)
        self.init_fp8(recipe, out_dtype, backend, device)

    @classmethod
    def from_linear(cls, module: nn.Linear, **kwargs) -> "FP8Linear":
        """An FP8Linear sharing ``module``'s parameters (and its ``activation``, where it has one)."""
        kwargs.setdefault("activation", getattr(module, "activation", None))
        layer = cls(module.in_features, module.out_features, module.bias is not None, dtype=module.weight.dtype,
                    device="meta", **kwargs)
        layer.weight = module.weight
        layer.bias = module.bias
        layer.fp8_nonfinite = torch.zeros(1, device=module.weight.device)
        layer.fp8_states = delayed_states(layer.recipe, module.weight.device)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear: input has last dimension {x.shape[-1]}, expected {self.in_features}")
        plan = FP8Plan(self.recipe, self.fp8_states, self.out_dtype, self.backend, row_group=self.row_group,
                       weight_q=self.fp8_gathered_weight)
        y = FP8LinearFunction.apply(x, self.weight, self.bias, plan, self.fp8_nonfinite)
        if self.activation is not None:
            y = F.gelu(y) if self.activation == "gelu" else F.silu(y)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"recipe={self.recipe}" + (f", activation={self.activation}" if self.activation else ""))


__all__ = ["FP8Linear", "FP8LinearFunction", "FP8Plan", "FP8Mixin", "fp8_gemm", "delayed_states"]
