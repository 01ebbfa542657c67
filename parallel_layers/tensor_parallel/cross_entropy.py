"""Cross entropy over logits whose vocabulary is split across the tensor-parallel group.

The last layer of a tensor-parallel language model (a ``ColumnParallelLinear`` or a tied
``VocabParallelEmbedding``) leaves each rank holding a contiguous slice of the vocabulary: rank ``r``
of ``tp`` owns columns ``[r * V_pad/tp, (r + 1) * V_pad/tp)``. Gathering the logits to compute the loss
would move ``rows x V`` numbers per rank and materialise them all on each; Megatron-LM's algorithm
needs only three numbers per row from each rank:

1. one local pass over the shard (``ops.cross_entropy.ce_forward_stats``, a fused kernel): per row,
   the local max ``m_r``, ``s_r = sum exp(x - m_r)`` (online softmax), the target logit if this rank
   owns the target (else 0), and the sum of the logits (for label smoothing);
2. all-reduce MAX of the row maxima -> ``M``; rescale ``s_r *= exp(m_r - M)``;
3. one all-reduce SUM of ``[s, target logit, sum of logits]`` -> ``logsumexp = M + log s``, and
   ``loss = logsumexp - x_target`` (plus the label-smoothing term).

The backward needs no communication: ``d loss / d x_j = g * (softmax_j - (1 - ls) [j == target] - ls/V)``
on this rank's columns (``ops.cross_entropy.ce_backward``), with ``softmax_j = exp(x_j - logsumexp)``
recomputed from the saved logits and the saved per-row ``logsumexp``. Nothing of size ``rows x V`` is
allocated besides the gradient itself, and with ``inplace_backward=True`` not even that: the gradient is
written over the saved logits, as Megatron does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import collectives as C
from ..mesh import check_group
from ..ops import cross_entropy as K

_NAME = "vocab_parallel_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


def _validate(logits, target, tp_group, label_smoothing, reduction, vocab_size):
    """Returns (tp size, tp rank, vocab_size)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"{_NAME}: logits_shard must be a floating-point tensor, got "
                        f"{getattr(logits, 'dtype', type(logits).__name__)}")
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex() \
            or target.dtype == torch.bool:
        raise TypeError(f"{_NAME}: target must be an integer tensor of class ids (torch.int64), got "
                        f"{getattr(target, 'dtype', type(target).__name__)}")
    if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"{_NAME}: target has shape {tuple(target.shape)} but logits_shard has shape "
                         f"{tuple(logits.shape)}; the target must have the logits' shape without the last "
                         f"(vocabulary) dimension, i.e. {tuple(logits.shape[:-1])}")
    if target.device != logits.device:
        raise ValueError(f"{_NAME}: target is on {target.device} but logits_shard is on {logits.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{_NAME}: reduction={reduction!r} is not one of {REDUCTIONS}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{_NAME}: label_smoothing={label_smoothing} must be in [0, 1]")
    tp = check_group(_NAME, tp_group)
    local = logits.shape[-1]
    padded = local * tp
    if vocab_size is None:
        vocab_size = padded
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= padded:
        raise ValueError(f"{_NAME}: vocab_size={vocab_size!r} must be an integer in [1, {padded}]: each of the "
                         f"tp={tp} ranks of tp_group holds {local} vocabulary columns, so the padded vocabulary "
                         f"is {padded}. Were the logits sharded over a different group than tp_group?")
    return tp, C.rank(tp_group), vocab_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, tp_rank, vocab_size, ignore_index, label_smoothing, reduction,
                inplace_backward, backend):
        local = logits.shape[-1]
        x = logits.reshape(-1, local)            # a view of the caller's tensor when it is contiguous
        if x.shape[0] and x.stride(-1) != 1:
            x = x.contiguous()
        t = target.reshape(-1).to(torch.int64)
        valid = t != ignore_index
        if t.device.type == "cpu":  # free on CPU; on CUDA it would cost a host sync every step
            bad = valid & ((t < 0) | (t >= vocab_size))
            if bool(bad.any()):
                raise IndexError(f"{_NAME}: target {int(t[bad][0])} is out of range for vocab_size={vocab_size} "
                                 f"(and is not ignore_index={ignore_index})")
        vocab_start = tp_rank * local
        n_valid = max(0, min(local, vocab_size - vocab_start))

        row_max, stats = K.ce_forward_stats(x, t, vocab_start, n_valid, backend=backend)
        global_max = row_max.clone()
        C.all_reduce(global_max, group, op=dist.ReduceOp.MAX)
        shift = K.safe_max(global_max)
        stats[:, 0] *= torch.exp(row_max - shift)   # rescale to the global max (0 for -inf rows)
        C.all_reduce(stats, group)                  # [sum exp, target logit, sum of logits]
        lse = torch.log(stats[:, 0]) + shift
        loss = lse - stats[:, 1]
        if label_smoothing:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - stats[:, 2] / vocab_size)
        loss = torch.where(valid, loss, torch.zeros_like(loss))
        count = valid.sum()
        if reduction == "none":
            out = loss.view(target.shape)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / count

        ctx.save_for_backward(x, t, lse, valid, count)
        ctx.meta = (logits.shape, vocab_start, n_valid, vocab_size, float(label_smoothing), reduction,
                    bool(inplace_backward), backend)
        ctx.consumed = False
        return out.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        shape, vocab_start, n_valid, vocab_size, ls, reduction, inplace, backend = ctx.meta
        if inplace and ctx.consumed:
            raise RuntimeError(f"{_NAME}: backward ran twice with inplace_backward=True, but the first one "
                               f"overwrote the saved logits with their gradient; pass inplace_backward=False "
                               f"to backpropagate through the loss more than once")
        ctx.consumed = True
        x, t, lse, valid, count = ctx.saved_tensors
        g = grad_output.to(lse.dtype)
        if reduction == "none":
            g = g.reshape(-1)
        else:
            if reduction == "mean":
                g = g / count
            g = g.expand(t.shape[0])
        g = torch.where(valid, g, torch.zeros_like(g)).contiguous()
        out = x if inplace else torch.empty_like(x)
        K.ce_backward(x, t, lse, g, vocab_start, n_valid, ls / vocab_size, 1.0 - ls, out, backend=backend)
        return out.view(shape), None, None, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, *, tp_group,
                                 ignore_index: int = -100, label_smoothing: float = 0.0,
                                 reduction: str = "mean", vocab_size: Optional[int] = None,
                                 inplace_backward: bool = True, backend: Optional[str] = None) -> torch.Tensor:
    """Cross entropy of logits sharded over the vocabulary, equal to ``F.cross_entropy`` on the gathered logits.

    ``logits_shard``: ``[..., V_pad / tp]``, this rank's contiguous slice of the (padded) vocabulary, the
    class dimension *last* (``[batch, seq, V/tp]`` straight out of the LM head). ``target``: ``[...]``
    (the logits' shape without the last dimension), integer global class ids. The result equals
    ``F.cross_entropy(full_logits[..., :vocab_size].reshape(-1, vocab_size), target.reshape(-1), ...)``
    (reshaped to ``target.shape`` for ``reduction="none"``), in the logits' dtype, on every rank.

    ``vocab_size``: the true vocabulary (default ``V_pad``); columns at or past it are padding and never
    contribute (their gradient is 0). ``ignore_index``, ``label_smoothing`` (spread over the
    ``vocab_size`` true classes) and ``reduction`` have ``F.cross_entropy``'s meaning; "mean" averages over
    the non-ignored targets. ``backend``: force the local kernels' backend (see ``parallel_layers.ops``).

    Communication: two all-reduces of ``rows`` and ``3 x rows`` numbers over ``tp_group`` in the forward,
    none in the backward. Every rank of ``tp_group`` must call this with the same targets.

    ``inplace_backward=True`` (Megatron's choice) writes the gradient over the saved logits: **after
    backward, the caller's ``logits_shard`` holds its gradient**, and the gradient handed back by autograd
    is that same memory. This saves a logits-sized buffer (the largest activation of a language model),
    but the logits must not be used afterwards, nor saved for backward by any other op, and backward can
    run only once. (A non-contiguous ``logits_shard`` is copied first, and the copy is what gets
    overwritten.) Pass ``False`` to get the gradient in a new tensor.

    Out-of-range targets raise ``IndexError`` for CPU tensors; on CUDA they are not checked (a check would
    cost a host sync per step) and such a row's loss is its logsumexp.
    """
    tp, tp_rank, vocab_size = _validate(logits_shard, target, tp_group, label_smoothing, reduction, vocab_size)
    return _VocabParallelCrossEntropy.apply(logits_shard, target, tp_group, tp_rank, vocab_size, int(ignore_index),
                                            float(label_smoothing), reduction, bool(inplace_backward), backend)


__all__ = ["vocab_parallel_cross_entropy"]
