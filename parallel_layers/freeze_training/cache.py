"""AutoCache: the frozen prefix's output per sample, computed once and reused in later epochs.

Once the bottom blocks are frozen their output is a function of the sample alone (the prefix runs in
eval mode, without dropout), so a sample seen again needs no prefix forward at all. The cache maps a
sample index (the caller's: ``FreezeTrainer.train_step(..., sample_ids=...)``) to that output.

* **Bounded**: at most ``max_bytes`` (default 256 MiB) of outputs; when the next one would not fit the
  cache stops accepting (no eviction: with epochs that visit every sample once, evicting one entry for
  another only trades a hit for a hit) and the rest are computed every time.
* **Invalidated when the prefix grows**: the outputs of ``k`` frozen blocks are not those of ``k + 1``;
  :meth:`reset` empties it for the new depth.
* **The same on every first-stage rank**: the trainer fills it from the whole global batch (not only
  the replica's own slice) in global batch order, so every replica's cache holds the same samples, and
  a later epoch hits whatever the data-parallel size has become since.
"""
from __future__ import annotations

from typing import Dict, Hashable, Optional

import torch

DEFAULT_MAX_BYTES = 256 << 20


class PrefixCache:
    """Prefix outputs by sample index, for one prefix depth; ``hits`` / ``misses`` count lookups."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes={max_bytes} must be >= 0 (0 turns caching off)")
        self.max_bytes = int(max_bytes)
        self.depth = 0
        self._entries: Dict[Hashable, torch.Tensor] = {}
        self.bytes = 0
        self.accepting = self.max_bytes > 0
        self.hits = self.misses = 0

    def reset(self, depth: int) -> None:
        """Empty the cache for outputs of ``depth`` frozen blocks."""
        self._entries.clear()
        self.depth, self.bytes, self.accepting = depth, 0, self.max_bytes > 0

    def __contains__(self, sample: Hashable) -> bool:
        return sample in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sample: Hashable) -> Optional[torch.Tensor]:
        out = self._entries.get(sample)
        if out is None:
            self.misses += 1
        else:
            self.hits += 1
        return out

    def put(self, sample: Hashable, output: torch.Tensor) -> bool:
        """Keep ``output`` (copied: not a view into the batch it came from) for ``sample``; False, and no
        more accepted from then on, once it would pass ``max_bytes``."""
        size = output.numel() * output.element_size()
        if not self.accepting or self.bytes + size > self.max_bytes:
            self.accepting = False
            return False
        self._entries[sample] = output.detach().clone()
        self.bytes += size
        return True

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "misses": self.misses, "depth": self.depth, "accepting": self.accepting}


__all__ = ["PrefixCache", "DEFAULT_MAX_BYTES"]
