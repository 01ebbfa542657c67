"""A position in the data that survives a restart on any number of ranks.

torchtitan's users report resumes that break when the world size changes: each data-parallel rank saved
where *its* shard of the data stood, and a run with another dp size has other shards. Here the position is
global: the order of the samples is one permutation per epoch drawn from ``(seed, epoch)``, the position is
``(epoch, offset)`` into it, and every rank draws the same global batch; ``Parallel3D.train_step`` takes
the global batch and gives each data-parallel rank its slice. So any dp size continues the same sample
order, and the state is a small JSON dict for ``AsyncCheckpointer.save(iteration, data=...)``.
"""
from __future__ import annotations

import torch


class GlobalBatches:
    """Global batches of ``batch`` sample indices out of ``num_samples``, epoch after epoch, each epoch a
    permutation seeded by ``(seed, epoch)``; a batch that crosses an epoch's end continues into the next."""

    def __init__(self, num_samples: int, batch: int, seed: int = 0):
        if num_samples < 1 or batch < 1:
            raise ValueError(f"GlobalBatches: num_samples={num_samples} and batch={batch} must be >= 1")
        self.num_samples, self.batch, self.seed = num_samples, batch, seed
        self.epoch, self.offset = 0, 0

    def _order(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def next_batch(self) -> torch.Tensor:
        """The next global batch's sample indices (int64, ``batch`` of them)."""
        parts, need = [], self.batch
        while need:
            take = min(need, self.num_samples - self.offset)
            parts.append(self._order(self.epoch)[self.offset:self.offset + take])
            self.offset += take
            need -= take
            if self.offset == self.num_samples:
                self.epoch, self.offset = self.epoch + 1, 0
        return torch.cat(parts)

    def state_dict(self) -> dict:
        return {"num_samples": self.num_samples, "batch": self.batch, "seed": self.seed, "epoch": self.epoch,
                "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the sample count and seed must be this order's (the batch may change)."""
        mine = {"num_samples": self.num_samples, "seed": self.seed}
        differ = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if differ:
            raise ValueError(f"GlobalBatches.load_state_dict: the saved position belongs to another order "
                             f"(saved, here): {differ}; build GlobalBatches with the saved num_samples and seed")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])


__all__ = ["GlobalBatches"]
