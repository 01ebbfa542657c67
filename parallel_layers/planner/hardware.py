"""Hardware profiles: what the time model charges for a FLOP, a byte of memory traffic and a byte of
each collective.

Built-in profiles come from vendor data sheets (dense tensor-core peaks, no sparsity):

* A100 SXM 80GB: 312 TFLOP/s bf16, 156 TF32, 19.5 fp32; HBM2e 2,039 GB/s; NVLink 3 600 GB/s
  (300 GB/s each way); HDR InfiniBand 200 Gb/s per GPU (25 GB/s).
* H100 SXM: 989 TFLOP/s bf16, 1,979 fp8, 495 TF32, 67 fp32; HBM3 3.35 TB/s; NVLink 4 900 GB/s (450
  each way); NDR InfiniBand 400 Gb/s per GPU (50 GB/s).
* H200 SXM: H100's compute; HBM3e 4.8 TB/s, 141 GB.

The achieved fraction of those peaks is not on a data sheet: the built-ins assume ``efficiency`` 0.5
of peak for matmuls and 0.7 of HBM bandwidth, and NCCL-like link latencies (5 us per ring step over
NVLink, 10 us over InfiniBand). Those are assumptions, said so in the output; ``--calibrate``
(:mod:`.calibrate`) replaces every figure with one measured on the machine.

Collective cost (alpha-beta, ring algorithms, as NCCL's defaults for large messages): over a group of
``n`` ranks, all-reduce ``2(n-1)`` steps of ``alpha`` plus ``2(n-1)/n * bytes * beta``; reduce-scatter and
all-gather ``(n-1)`` steps and ``(n-1)/n * bytes * beta``; a send ``alpha + bytes * beta``. A group whose
ranks span more than one node pays the inter-node link's alpha and beta (its slowest link).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Dict, Optional

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1,
              "all_gather": lambda n: n - 1, "send": lambda n: 1, "all_to_all": lambda n: n - 1}
RING_BYTES = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "send": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}


@dataclasses.dataclass
class Link:
    alpha: float           # seconds per ring step
    beta: float            # seconds per byte


@dataclasses.dataclass
class Profile:
    """``flops``: matmul FLOP/s a rank achieves, per precision; ``peak_flops``: the data sheet's (MFU's
    denominator); ``mem_bw``: bytes/s of memory traffic; ``intra``/``inter``: links inside a node and
    between nodes, per collective kind (``"*"``: every kind); ``compute_slots``: ranks that compute at
    once on the machine (None: one device per rank; a CPU host with fewer cores than ranks shares them);
    ``fragmentation``: fraction added to the predicted peak for the allocator's unusable gaps;
    ``op_overhead``: seconds each operator call costs besides its work (kernel launch, host dispatch);
    ``measured``: whether the figures were measured here (``--calibrate``) or assumed; ``async_dispatch``: the
    host queues operators ahead of the device (a GPU's stream), so a phase takes the longer of the device's
    work and the host's dispatch rather than their sum (a CPU rank does both in turn); ``sends_held``: a
    pipeline send keeps its tensor until the step ends (gloo reports a send complete only once waited for,
    and the engine waits for sends at the end of the step; NCCL's finish on their own)."""
    name: str
    flops: Dict[str, float]
    peak_flops: Dict[str, float]
    mem_bw: float
    intra: Dict[str, Link]
    inter: Dict[str, Link]
    compute_slots: Optional[int] = None
    fragmentation: float = 0.05
    op_overhead: float = 5e-6
    measured: bool = False
    notes: str = ""
    async_dispatch: bool = False
    sends_held: bool = False

    def link(self, kind: str, inter_node: bool) -> Link:
        table = self.inter if inter_node else self.intra
        return table.get(kind) or table["*"]

    def collective_s(self, kind: str, n: int, nbytes: float, inter_node: bool = False) -> float:
        """Seconds of one ``kind`` collective of ``nbytes`` (the full buffer) over ``n`` ranks."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(kind, inter_node)
        return RING_STEPS[kind](n) * link.alpha + RING_BYTES[kind](n) * nbytes * link.beta

    def matmul_rate(self, precision: str) -> float:
        return self.flops.get(precision) or self.flops["fp32"]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        d = dict(d)
        for key in ("intra", "inter"):
            d[key] = {k: Link(**v) for k, v in d[key].items()}
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_json(), fh, indent=1)


def _gpu(name, peaks, hbm, nvlink_each_way, ib_per_gpu, efficiency=0.5, notes=""):
    return Profile(name=name, flops={k: v * efficiency for k, v in peaks.items()}, peak_flops=dict(peaks),
                   mem_bw=hbm * 0.7, intra={"*": Link(5e-6, 1.0 / nvlink_each_way)},
                   inter={"*": Link(10e-6, 1.0 / ib_per_gpu)}, fragmentation=0.05, measured=False, async_dispatch=True,
                   notes=notes or f"data-sheet peaks; assumed {efficiency:.0%} matmul efficiency, 70% of HBM "
                                  f"bandwidth, ring collectives with NCCL-like latencies")


BUILTIN: Dict[str, Profile] = {
    "a100": _gpu("A100 SXM 80GB", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
                 2039e9, 300e9, 25e9),
    "h100": _gpu("H100 SXM", {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
                 3350e9, 450e9, 50e9),
    "h200": _gpu("H200 SXM", {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
                 4800e9, 450e9, 50e9),
}


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (a100, h100, h200) or a JSON file written by ``--calibrate``."""
    if name_or_path.lower() in BUILTIN:
        return BUILTIN[name_or_path.lower()]
    try:
        with open(name_or_path) as fh:
            return Profile.from_json(json.load(fh))
    except FileNotFoundError:
        raise ValueError(f"planner: no profile {name_or_path!r}: name a built-in one ({', '.join(BUILTIN)}) or a "
                         f"JSON file that python -m parallel_layers plan --calibrate PATH wrote") from None


__all__ = ["Link", "Profile", "BUILTIN", "load_profile", "RING_STEPS", "RING_BYTES"]
