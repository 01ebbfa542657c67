"""The loss of a step as torch defines it: the mean over the counted (non-ignored) labels of the whole batch.

Averaging per-micro-batch (or per-rank) means gives another number as soon as the ignored labels
(``-100``: padding, prompts in supervised fine-tuning) are spread unevenly: a micro-batch with 3 counted
tokens then weighs as much as one with 300, and a micro-batch with none gives ``nan`` (the "gradient
accumulation loss" bug several frameworks shipped). Here every micro-batch contributes
``sum of its token losses / D``, where ``D`` is the number of counted labels of the whole batch, so the
contributions add up to the batch mean and their gradients to its gradient.

**Where the count comes from: the labels.** A label counts when it is not ``ignore_index`` (default
``-100``; ``None``: every label counts; floating-point targets always count every element). The count of
the global batch is known before the step on every rank (every rank holds the global batch's labels),
so the loss is normalised before backward, with no extra collective and no second pass.

**What a loss function returns** (``loss_fn(logits, targets)`` on the last pipeline stage), either

- a scalar: the *mean* over the micro-batch's counted labels, what ``F.cross_entropy(..., ignore_index=-100)``
  returns. It is weighted by the micro-batch's count; a micro-batch with no counted label contributes 0
  (its ``nan`` is never used, and torch's cross entropy gives zero gradients there);
- or ``(sum, count)``: the sum of the token losses and how many tokens it covers
  (:func:`token_cross_entropy` does this). Never divides by zero. ``count`` must equal the labels' count
  (checked once per step, see :class:`TokenLoss`).
"""
from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
NO_LABEL = -(2 ** 62)     # an ignore_index no label equals (``ignore_index=None``: every label counts)


def count_labels(targets: Optional[torch.Tensor], ignore_index: Optional[int] = IGNORE_INDEX) -> int:
    """How many labels of ``targets`` count (are not ``ignore_index``); every element of float targets."""
    return count_labels_each([targets], ignore_index)[0]


def count_labels_each(targets: List[Optional[torch.Tensor]], ignore_index: Optional[int] = IGNORE_INDEX) -> List[int]:
    """:func:`count_labels` of each tensor, read to the host in one transfer."""
    counts = [t.new_tensor(t.numel() if ignore_index is None or t.is_floating_point() else 0, dtype=torch.int64)
              if t is not None else None for t in targets]
    for i, t in enumerate(targets):
        if t is not None and not (ignore_index is None or t.is_floating_point()):
            counts[i] = (t != ignore_index).sum()
    present = [c for c in counts if c is not None]
    values = iter(torch.stack(present).tolist() if present else [])
    return [next(values) if c is not None else 0 for c in counts]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                        ignore_index: int = IGNORE_INDEX) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(sum of the token cross entropies, number of counted tokens)``: the default loss of
    ``Parallel3D`` for a model whose last stage returns logits ``[..., vocab]`` and targets ``[...]``.
    The sum is in fp32 (the logits are upcast, as the losses of Megatron-LM and HF do)."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = targets.reshape(-1)
    total = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return total, (labels != ignore_index).sum()


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 -> fp32 (a sum of many low-precision terms loses the digits); fp32 and fp64 unchanged."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class TokenLoss:
    """One step's loss accounting: ``weigh`` turns each micro-batch's loss output into its contribution
    ``sum / denominator`` (what backward runs on), ``total`` is their sum (fp32) and ``check`` compares the
    counts that ``(sum, count)`` losses returned with the labels' count.

    ``denominator``: the number of counted labels the contributions are divided by (for a data-parallel
    replica of a global batch of ``N`` counted labels over ``dp`` replicas whose gradients are averaged:
    ``N / dp``); ``None``: the count of the batch this accounting covers (the sum of ``counts``, one per
    micro-batch, from :func:`count_labels_each`)."""

    def __init__(self, counts: List[int], denominator: Optional[float], ignore_index: Optional[int], where: str):
        self.counts, self.counted = list(counts), sum(counts)
        self.ignore_index, self.where = ignore_index, where
        self.denominator = float(denominator if denominator is not None else self.counted)
        self.parts: List[torch.Tensor] = []
        self.returned_counts: List[torch.Tensor] = []

    def weigh(self, out: Union[torch.Tensor, tuple], mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s contribution (a 0-dim tensor, fp32 or fp64, attached to the graph)."""
        if isinstance(out, (tuple, list)):
            if len(out) != 2:
                raise ValueError(f"{self.where}: the loss returned a {type(out).__name__} of {len(out)} items; "
                                 f"return a scalar mean or (sum, count)")
            total, count = out
            self.returned_counts.append(torch.as_tensor(count, device=total.device).detach().reshape(()).double())
            total = _at_least_fp32(total).reshape(())
            part = total / self.denominator if self.denominator else total * 0
        else:
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise ValueError(f"{self.where}: the loss must be a scalar (the mean over the micro-batch's "
                                 f"counted labels) or (sum, count); got "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
            out, count = _at_least_fp32(out).reshape(()), self.counts[mb]
            if count:       # mean x (count / D): with equal micro-batches exactly mean / m
                part = out * (count / self.denominator)
            else:           # no counted label: the mean is nan (0/0) and contributes nothing
                part = torch.where(torch.isfinite(out), out, torch.zeros_like(out)) * 0
        self.parts.append(part.detach())
        return part

    def total(self, device=None) -> Optional[torch.Tensor]:
        """The sum of the contributions, or None when this rank computed no loss."""
        if not self.parts:
            return None
        return torch.stack(self.parts).sum().to(device) if device is not None else torch.stack(self.parts).sum()

    def check(self) -> None:
        """The counts returned by ``(sum, count)`` losses must add up to the labels' count: the
        denominator was computed from the labels before the step."""
        if not self.returned_counts:
            return
        got = int(torch.stack(self.returned_counts).sum().item())
        if got != self.counted:
            raise ValueError(f"{self.where}: the loss returned counts summing to {got} tokens over the step, but the "
                             f"labels hold {self.counted} that are not ignore_index={self.ignore_index}; the loss "
                             f"is divided by the labels' count. Pass the ignore_index your loss uses (or "
                             f"ignore_index=None to count every label), or return a scalar mean")


__all__ = ["IGNORE_INDEX", "count_labels", "count_labels_each", "token_cross_entropy", "TokenLoss"]
