"""FP8 training in the planner: what converting a model's Linear layers to ``FP8Linear`` changes in a
layout's step time and memory, as ``parallel_layers.fp8`` runs it (and as torchtitan's float8 / Transformer
Engine's per-tensor recipes do).

Which layers: every Linear of the model (``nn.Linear``, ``ColumnParallelLinear``, ``RowParallelLinear``) but the
LM head and the MoE router/gates (:func:`converted_linears`; torchtitan's filter). Attention's score and value
matmuls, the embeddings, the tied head and the MoE experts' grouped GEMMs stay in the model dtype.

Per converted GEMM call of ``M`` tokens, ``K`` inputs, ``N`` outputs (this rank's shard), input and gradient
``e_x`` bytes an element (the model dtype), weight ``e_w``; ``dgrad``/``wgrad``: the input's / weight's gradient
is wanted; ``r``: passes that read a tensor to cast it (2 for current scaling, "tensor", "row", "block": the
amax pass, then the cast; 1 for "delayed", whose cast records the amax in the same pass); ``t_x``, ``t_w``,
``t_g``: 1 where the cast writes the transposed copy too (per-tensor recipes, where the other GEMM wants it:
``t_x = wgrad`` without sequence parallelism, ``t_w = dgrad``, ``t_g = wgrad``; 0 for "row" / "block", whose
backward transposes the FP8 data instead, 1 byte read and 1 written an element):

* FLOPs: ``2MKN`` forward, ``2MKN`` each for dgrad and wgrad, at ``profile.flops["fp8"]`` (the data sheet's
  fp8 peak times the profile's matmul efficiency, as its bf16 rate); the rest of the phase's FLOPs at the
  model dtype's rate as before. A profile without an fp8 rate (CPU, A100) is refused (:func:`fp8_rate`).
* cast bytes (memory-bound, at ``profile.mem_bw``), :func:`cast_bytes`:
  forward ``MK (r e_x + 1 + t_x) + NK (r e_w + 1 + t_w)``;
  backward ``MN (r e_x + 1 + t_g)`` plus, where no transposed copy was written, ``2NK`` (dgrad) and
  ``2MN + 2MK`` (wgrad); a checkpointed backward adds its recomputed forward's. In a compiled step
  (``Request.compiled``) the input's and the gradient's casts are fused into the kernels that make them: they
  write the FP8 copies, ``1 + t`` bytes an element, instead of the model dtype's ``e_x`` (charged by the fused
  tally already), so the ``MK`` and ``MN`` terms become ``max(1 + t - e_x, 0)``.
* saved for backward (:func:`saved_bytes`, what ``FP8LinearFunction`` keeps on its ``ctx``: the input's and
  one layout of the input's and the weight's ``Quantized``, the transposed copy where the cast made one, since
  backward reads only x^T and W^T): ``MK + 8 g_x + NK + 8 g_w`` with ``g`` the scale blocks
  (1 per tensor, a row each per row, ``MK/128`` / ``NK/128^2`` per block; a float32 scale and amax each),
  instead of the high-precision input a Linear keeps (:func:`linear_calls` finds which inputs only the converted
  Linears keep: those are freed; an input another op keeps too, SDPA's output, stays). With checkpointing
  nothing of a block is kept across its forward; the recomputed block's FP8 copies are added to the peak.
* parameters, gradients and optimizer state are unchanged (the weight stays the model-dtype parameter, fp32
  master weights where the precision keeps them); so are collectives, but for ``Request.fp8_gather``: ZeRO-3's
  gather of the converted weights at 1 byte an element.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, List, Tuple

import torch
import torch.nn as nn

from .accounting import NO_SHAPE, OpTally, add_gemm_shape

# the last name of a module that is not converted: the LM head, the MoE router and gates
NOT_CONVERTED = re.compile(r"(^|\.)(lm_head|head|output|router|gate|shared_expert_gate|score)$")


@dataclasses.dataclass
class FP8Gemm:
    """One converted Linear's call in a micro-batch's forward."""
    name: str
    m: int
    k: int
    n: int
    x_size: int = 2           # bytes an element of the input (and of the output gradient)
    w_size: int = 2           # bytes an element of the weight
    dgrad: bool = True
    wgrad: bool = True
    seq_parallel: bool = False

    @property
    def flops_f(self) -> int:
        return 2 * self.m * self.k * self.n

    @property
    def flops_b(self) -> int:
        return 2 * self.m * self.k * self.n * (int(self.dgrad) + int(self.wgrad))


@dataclasses.dataclass
class FP8Account:
    """A chunk's converted GEMMs (one micro-batch) and the high-precision saved bytes they free."""
    gemms: List[FP8Gemm]
    freed: int = 0            # bytes of the inputs only converted Linears keep for backward (no checkpointing)

    def block_of(self, g: FP8Gemm) -> str:
        hit = re.search(r"(^|.*?\.)\d+(?=\.)", g.name)
        return hit.group(0) if hit else g.name


def _per_tensor(recipe: str) -> bool:
    return recipe in ("tensor", "delayed")


def _blocks(recipe: str, rows: int, cols: int, weight: bool, block: int = 128) -> int:
    if _per_tensor(recipe):
        return 1
    if recipe == "row":
        return rows
    return (rows // block) * (cols // block) if weight else rows * (cols // block)


def _transposes(g: FP8Gemm, recipe: str) -> Tuple[int, int, int]:
    """(t_x, t_w, t_g): whether the casts of the input, weight and gradient write the transposed copy too."""
    if not _per_tensor(recipe):
        return 0, 0, 0
    return int(g.wgrad and not g.seq_parallel), int(g.dgrad), int(g.wgrad)


def cast_bytes(g: FP8Gemm, recipe: str, fused: bool = False) -> Tuple[int, int]:
    """(forward, backward) bytes the casts of one converted GEMM call read and write (see the module docstring).
    ``fused`` (a compiled step): the input's and the gradient's casts are part of the kernel that makes them,
    which writes the FP8 copies instead of the model-dtype tensor the fused tally already charges (nothing
    more where those are no larger); the weight's cast stays a pass of its own."""
    r = 1 if recipe == "delayed" else 2
    t_x, t_w, t_g = _transposes(g, recipe)
    mk, nk, mn = g.m * g.k, g.n * g.k, g.m * g.n
    act_x = max(1 + t_x - g.x_size, 0) if fused else r * g.x_size + 1 + t_x
    act_g = max(1 + t_g - g.x_size, 0) if fused else r * g.x_size + 1 + t_g
    fwd = mk * act_x + nk * (r * g.w_size + 1 + t_w)
    bwd = mn * act_g
    if g.dgrad and not t_w:
        bwd += 2 * nk
    if g.wgrad:
        bwd += (0 if t_g else 2 * mn) + (0 if t_x else 2 * mk)
    return fwd, bwd


def saved_bytes(g: FP8Gemm, recipe: str, block: int = 128) -> int:
    """Bytes ``FP8LinearFunction`` keeps from one forward to its backward: one layout of the FP8 input and of the
    weight (the transposed copy where the cast made one, else the data: backward reads x^T and W^T only), a
    float32 scale inverse and amax per scale block of each."""
    x = g.m * g.k + 8 * _blocks(recipe, g.m, g.k, False, block)
    w = g.n * g.k + 8 * _blocks(recipe, g.n, g.k, True, block)
    return x + w


def converted_linears(module: nn.Module) -> List[Tuple[str, nn.Module]]:
    """The Linear layers FP8 training converts: every ``nn.Linear``, ``ColumnParallelLinear`` and
    ``RowParallelLinear`` but the LM head and the MoE router / gates (:data:`NOT_CONVERTED`), with a weight whose
    dimensions divide by 16 (``torch._scaled_mm``'s rule on CUDA; torchtitan skips the others too)."""
    from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    out = []
    for name, mod in module.named_modules():
        if not isinstance(mod, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) or NOT_CONVERTED.search(name):
            continue
        w = getattr(mod, "weight", None)
        if w is None or w.dim() != 2 or w.shape[0] % 16 or w.shape[1] % 16:
            continue
        out.append((name, mod))
    return out


def _key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage()._cdata


def linear_calls(chunk: nn.Module, run: Callable[[], torch.Tensor]) -> FP8Account:
    """Run ``run`` (one forward of ``chunk``) recording every converted Linear's call and which tensors autograd
    saves inside them and outside them (``saved_tensors_hooks``; parameters left out); the forward's output is
    then run backward (a ZeRO-3 unit gathered in the forward is released by its backward hooks). The inputs saved
    only inside converted Linears are what FP8 frees. Under checkpointing the blocks' tensors are saved by the
    checkpoint's own hooks, not these: ``freed`` is then 0, as it should be (nothing of a block is kept)."""
    mods = converted_linears(chunk)
    params = {_key(p) for p in chunk.parameters()}
    gemms: List[FP8Gemm] = []
    inside: List[str] = []
    mine, others, sizes = set(), set(), {}

    recording = [True]                 # the forward's calls only, not a checkpointed backward's recomputation

    def pre(name):
        def hook(mod, args):
            inside.append(mod.weight.shape[1])
        return hook

    def post(name):
        def hook(mod, args, out):
            inside.pop()
            if not recording[0]:
                return
            x = args[0]
            y = out[0] if isinstance(out, (tuple, list)) else out
            w = mod.weight
            m = max(x.numel() // x.shape[-1], y.numel() // y.shape[-1])
            gemms.append(FP8Gemm(name, m, w.shape[1], w.shape[0], x.element_size(), w.element_size(),
                                 dgrad=x.requires_grad, wgrad=w.requires_grad,
                                 seq_parallel=bool(getattr(mod, "sequence_parallel", False))))
        return hook

    def pack(t):
        k = _key(t)
        if k not in params:
            # inside a converted Linear, its GEMM's input (last dim K); a fused activation's pre-activation
            # output stays saved in FP8 too (by the activation, which FP8 layers do not fuse)
            (mine if inside and t.dim() and t.shape[-1] == inside[-1] else others).add(k)
            with torch._C.DisableTorchFunctionSubclass():
                sizes[k] = t.untyped_storage().nbytes()
        return t

    handles = [h for name, mod in mods for h in (mod.register_forward_pre_hook(pre(name)),
                                                 mod.register_forward_hook(post(name)))]
    try:
        with OpTally(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()     # (the tally answers host reads of meta tensors: an embedding's bounds check)
        recording[0] = False
        if out.requires_grad:
            with OpTally():
                torch.autograd.backward(out, None if out.numel() == 1 else torch.ones_like(out))
        del out
    finally:
        for h in handles:
            h.remove()
    return FP8Account(gemms, sum(sizes[k] for k in mine - others))


def fp8_rate(prof, req) -> float:
    """The profile's FP8 matmul rate, or a ValueError naming the profile and what to use instead."""
    rate = prof.flops.get("fp8")
    if not rate:
        raise ValueError(f"planner: profile {prof.name!r} has no fp8 matmul rate (flops['fp8']): it has no FP8 tensor "
                         f"cores to plan FP8 training for (a CPU, an A100); use a profile that has one (--profile "
                         f"h100 or h200), add an 'fp8' rate to the profile's JSON, or plan without --fp8")
    return rate


def chunk_terms(acct: FP8Account, recipe: str, checkpoint: bool, fused: bool = False) -> dict:
    """A chunk's FP8 terms for one micro-batch: GEMM FLOPs and cast bytes per phase (``fused``: a compiled
    step's, :func:`cast_bytes`), and the change of its saved bytes and of its peak."""
    ff = sum(g.flops_f for g in acct.gemms)
    fb = sum(g.flops_b for g in acct.gemms) + (ff if checkpoint else 0)
    casts = [cast_bytes(g, recipe, fused) for g in acct.gemms]
    cf = sum(c[0] for c in casts)
    cb = sum(c[1] for c in casts) + (cf if checkpoint else 0)
    if checkpoint:
        per_block: dict = {}
        for g in acct.gemms:
            per_block[acct.block_of(g)] = per_block.get(acct.block_of(g), 0) + saved_bytes(g, recipe)
        d_saved, d_peak = 0, max(per_block.values(), default=0)
    else:
        d_saved = sum(saved_bytes(g, recipe) for g in acct.gemms) - acct.freed
        d_peak = d_saved
    weights = {g.name: g.n * g.k * (g.w_size - 1) for g in acct.gemms}   # what an FP8 gather saves
    shape_f, shape_b = gemm_shapes(acct.gemms)
    if checkpoint:
        shape_b = tuple(a + b for a, b in zip(shape_b, shape_f))
    return dict(flops_f=ff, flops_b=fb, cast_f=cf, cast_b=cb, saved=d_saved, peak=d_peak,
                gather_saved=sum(weights.values()), shape_f=shape_f, shape_b=shape_b)


def gemm_shapes(gemms: List[FP8Gemm]):
    """The FP8 GEMMs' shape tallies (FLOPs over K, N, M, as ``accounting.FlopTally.shape``) forward and backward:
    forward [m, k] x [k, n]; dgrad [m, n] x [n, k]; wgrad [n, m] x [m, k]."""
    fwd, bwd = list(NO_SHAPE), list(NO_SHAPE)
    for g in gemms:
        f = 2.0 * g.m * g.k * g.n
        add_gemm_shape(fwd, f, g.m, g.k, g.n)
        if g.dgrad:
            add_gemm_shape(bwd, f, g.m, g.n, g.k)
        if g.wgrad:
            add_gemm_shape(bwd, f, g.n, g.m, g.k)
    return tuple(fwd), tuple(bwd)


__all__ = ["FP8Gemm", "FP8Account", "cast_bytes", "saved_bytes", "converted_linears", "linear_calls", "fp8_rate",
           "chunk_terms", "NOT_CONVERTED"]
