"""Random numbers under tensor parallelism: named RNG streams and seeded, sharded initialisation.

Two kinds of randomness live in a tensor-parallel model (Megatron-LM's split):

* **Replicated work** (dropout on the residual stream, which every TP rank holds whole; the weights'
  initial values) must draw the *same* numbers on every TP rank. That is the default generator,
  seeded identically on every rank; nothing here touches it.
* **Sharded work** (dropout on the attention probabilities of *this rank's* heads, on the local slice
  of an MLP's hidden units) must draw *different* numbers on each TP rank, or the ranks' masks are
  copies of one another and the model is not the dense model's distribution. That runs inside
  ``tracker.fork()``, which swaps in a stream seeded ``seed + 2718 + tp_rank``
  (:func:`tensor_parallel_rng_tracker`) and swaps the default state back on exit.

:class:`RNGStatesTracker` follows Megatron's ``CudaRNGStatesTracker`` but keeps both the CPU generator
and, where CUDA is present, the current CUDA device's generator, so the same code runs under gloo and
NCCL.

Seeded initialisation (:func:`linear_default_init_`, :func:`embedding_default_init_`, :func:`shard`): the sharded
layers build the *full* weight with
the dense layer's own init, from the default generator, then keep their slice (Megatron's "master
weight then split" CPU init). Every rank, seeded alike, gets exactly its slice of what
``nn.Linear``/``nn.Embedding`` would hold, and the generator advances exactly as the dense layer's
would, so a whole model built from these layers equals the dense model at any TP size. The price is
memory: for a moment each rank holds the full weight (``out x in`` elements of the layer's dtype, on
the layer's device) besides its shard. For a 50k x 4k embedding in fp32 that is 800 MB per rank; build
huge layers on ``device="meta"`` and load a checkpoint, or use ``from_dense``, where that is too much.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, Optional

import torch

from ..distributed import collectives as C

TENSOR_PARALLEL_RNG = "tensor-parallel"
_TP_SEED_OFFSET = 2718  # Megatron's offset: the TP stream never equals the default stream's seed


def _cuda_in_use() -> bool:
    return torch.cuda.is_available()


class RNGStatesTracker:
    """Named RNG streams, each a saved (CPU, CUDA) generator state, swapped in by :meth:`fork`.

    ``add(name, seed)`` creates a stream without disturbing the current generators. ``fork(name)``
    is a context manager: inside it the default CPU generator (and the current CUDA device's
    generator) continue that stream; on exit the stream's advanced state is saved and the previous
    default state restored, so code outside the ``with`` draws as if the fork never happened.
    ``get_states``/``set_states`` save and restore every stream (activation recomputation must replay
    the same dropout masks).
    """

    def __init__(self):
        self._states: Dict[str, dict] = {}
        self._seeds: Dict[str, int] = {}

    # ------------------------------------------------------------------ streams
    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNGStatesTracker: stream {name!r} already exists")
        if seed in self._seeds.values():
            raise ValueError(f"RNGStatesTracker: seed {seed} is already used by another stream; two streams "
                             f"with one seed draw the same numbers")
        cpu = torch.Generator(device="cpu")
        cpu.manual_seed(seed)
        state = {"cpu": cpu.get_state()}
        if _cuda_in_use():
            device = torch.cuda.current_device()
            saved = torch.cuda.get_rng_state(device)
            torch.cuda.manual_seed(seed)
            state["cuda"] = (device, torch.cuda.get_rng_state(device))
            torch.cuda.set_rng_state(saved, device)
        self._states[name] = state
        self._seeds[name] = seed

    def seed(self, name: str) -> int:
        return self._seeds[name]

    def __contains__(self, name: str) -> bool:
        return name in self._states

    def reset(self) -> None:
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> Dict[str, dict]:
        """A copy of every stream's state (for checkpointing or recomputation)."""
        def copy(state):
            out = {"cpu": state["cpu"].clone()}
            if "cuda" in state:
                out["cuda"] = (state["cuda"][0], state["cuda"][1].clone())
            return out
        return {name: copy(state) for name, state in self._states.items()}

    def set_states(self, states: Dict[str, dict]) -> None:
        missing = set(states) - set(self._states)
        if missing:
            raise ValueError(f"RNGStatesTracker.set_states: unknown streams {sorted(missing)}; add them first")
        for name, state in states.items():
            self._states[name] = state

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG):
        """Draw from stream ``name`` inside the ``with`` block; the default generators are untouched."""
        if name not in self._states:
            raise KeyError(f"RNGStatesTracker: no stream {name!r}; known streams: {sorted(self._states)} "
                           f"(create it with add(name, seed) or tensor_parallel_rng_tracker(seed, tp_group))")
        state = self._states[name]
        saved_cpu = torch.get_rng_state()
        saved_cuda = None
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            device, cuda_state = state["cuda"]
            saved_cuda = torch.cuda.get_rng_state(device)
            torch.cuda.set_rng_state(cuda_state, device)
        try:
            yield
        finally:
            new = {"cpu": torch.get_rng_state()}
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                new["cuda"] = (device, torch.cuda.get_rng_state(device))
                torch.cuda.set_rng_state(saved_cuda, device)
            self._states[name] = new


def tensor_parallel_rng_tracker(seed: int, tp_group) -> RNGStatesTracker:
    """A tracker whose ``"tensor-parallel"`` stream is seeded ``seed + 2718 + tp_rank``.

    Call it with the same ``seed`` on every rank (after ``torch.manual_seed(seed)``, which stays in
    charge of the default stream: equal across TP ranks). Dropout on sharded activations runs in
    ``with tracker.fork():`` and so differs across TP ranks; dropout on replicated activations runs
    outside and is the same on every TP rank.
    """
    tracker = RNGStatesTracker()
    tracker.add(TENSOR_PARALLEL_RNG, seed + _TP_SEED_OFFSET + C.rank(tp_group))
    return tracker


# ---------------------------------------------------------------------- seeded initialisation
def linear_default_init_(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    """``nn.Linear.reset_parameters`` on a full ``[out, in]`` weight, same calls, same order."""
    with torch.no_grad():
        torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            fan_in, _ = torch.nn.init._calculate_fan_in_and_fan_out(weight)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            torch.nn.init.uniform_(bias, -bound, bound)


def embedding_default_init_(weight: torch.Tensor, padding_idx: Optional[int]) -> None:
    """``nn.Embedding.reset_parameters`` on a full ``[V, D]`` weight."""
    with torch.no_grad():
        torch.nn.init.normal_(weight)
        if padding_idx is not None:
            weight[padding_idx].fill_(0)


def shard(full: torch.Tensor, dim: int, rank: int, world: int, padded_size: Optional[int] = None) -> torch.Tensor:
    """Rank ``rank``'s contiguous 1/``world`` slice of ``full`` along ``dim``, as a fresh tensor.

    With ``padded_size``, ``full`` is first padded with zeros along ``dim`` up to that size (the
    vocabulary padding of :class:`VocabParallelEmbedding`)."""
    size = full.shape[dim]
    if padded_size is not None and padded_size != size:
        pad_shape = list(full.shape)
        pad_shape[dim] = padded_size - size
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
        size = padded_size
    if size % world:
        raise ValueError(f"shard: dimension {dim} of size {size} does not divide by {world} ranks")
    part = size // world
    return full.narrow(dim, rank * part, part).clone()


__all__ = ["RNGStatesTracker", "tensor_parallel_rng_tracker", "TENSOR_PARALLEL_RNG",
           "linear_default_init_", "embedding_default_init_", "shard"]
