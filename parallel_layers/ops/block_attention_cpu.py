"""The CPU implementation of ``ops.block_attention``: ATen's CPU flash-attention kernels
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward: vectorised, tiled, no score matrix kept,
both returning and taking the log-sum-exp), fed the block's mask as an additive bias in ``q``'s dtype.

They compute exactly the op's contract: the forward returns the block's ``(out_b, lse_b)``, merged here into
the running result; the backward, given the FINAL ``out`` and ``lse`` of the queries, returns this block's
share of the gradients (flash attention's backward uses ``out`` only for ``rowsum(dout * out)``, the
``delta`` of the contract). Two details the kernels do differently: a query row that sees no key of the
block comes back with ``lse = 0`` (set to -inf here), and the backward must not be handed ``lse = -inf``
(a row that saw no key at all: its scores are -inf in every block, so any finite value gives P = 0).
Measured against the torch reference on one core (``n = 1024`` queries and keys, 4 heads of 32): forward
17.8 ms against 147 ms.
"""
from __future__ import annotations

import torch

_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
DTYPES = (torch.float32, torch.bfloat16)


def available(q: torch.Tensor) -> bool:
    return _FWD is not None and _BWD is not None and q.device.type == "cpu" and q.dtype in DTYPES


def _visible(q_pos, k_pos, q_seg, k_seg, causal):
    ok = (q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0)
    if causal:
        ok = ok & (k_pos[None, None, :] <= q_pos[None, :, None])
    return ok


def _bias(vis: torch.Tensor, dtype) -> torch.Tensor:
    return torch.zeros(vis.shape, dtype=dtype).masked_fill_(~vis, float("-inf"))[:, None]


def _expand(t: torch.Tensor, hq: int) -> torch.Tensor:
    group = hq // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _fold(t: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, s, d = t.shape
    return t if hq == hkv else t.view(b, hkv, hq // hkv, s, d).sum(2)


def forward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, out, lse) -> None:
    """Merge the block into ``(out, lse)`` in place (fp32)."""
    b, hq, sq, d = q.shape
    if min(b, hq, sq, k.shape[2]) == 0:
        return
    vis = _visible(q_pos, k_pos, q_seg, k_seg, causal)
    sees = vis.any(-1)                                             # [b, sq]
    if not bool(sees.any()):
        return
    out_b, lse_b = _FWD(q, _expand(k, hq), _expand(v, hq), 0.0, False, attn_mask=_bias(vis, q.dtype), scale=scale)
    lse_b = lse_b.float().masked_fill(~sees[:, None, :], float("-inf"))
    new = torch.logaddexp(lse, lse_b)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    wa = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    wb = torch.where(finite, torch.exp(lse_b - safe), torch.zeros_like(new))
    out.mul_(wa[..., None]).add_(out_b.float() * wb[..., None])
    lse.copy_(new)


def backward(q, k, v, q_pos, k_pos, q_seg, k_seg, causal, scale, lse, dout, out, dq, dk, dv) -> None:
    """Add the block's share of the gradients to ``dq``, ``dk``, ``dv`` (fp32); ``out``: the queries' final
    output (any float dtype)."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    if min(b, hq, sq, k.shape[2]) == 0:
        return
    vis = _visible(q_pos, k_pos, q_seg, k_seg, causal)
    if not bool(vis.any()):
        return
    gq, gk, gv = _BWD(dout.to(q.dtype), q, _expand(k, hq), _expand(v, hq), out.to(q.dtype),
                      lse.masked_fill(torch.isinf(lse), 0.0), 0.0, False, attn_mask=_bias(vis, q.dtype), scale=scale)
    dq += gq.float()
    dk += _fold(gk.float(), hkv)
    dv += _fold(gv.float(), hkv)


__all__ = ["available", "forward", "backward", "DTYPES"]
