"""Hardware profiles: what the time model charges for a FLOP, a byte of memory traffic and a byte of
each collective.

Built-in profiles come from vendor data sheets (dense tensor-core peaks, no sparsity):

* A100 SXM 80GB: 312 TFLOP/s bf16, 156 TF32, 19.5 fp32; HBM2e 2,039 GB/s; NVLink 3 600 GB/s
  (300 GB/s each way); HDR InfiniBand 200 Gb/s per GPU (25 GB/s).
* H100 SXM: 989 TFLOP/s bf16, 1,979 fp8, 495 TF32, 67 fp32; HBM3 3.35 TB/s; NVLink 4 900 GB/s (450
  each way); NDR InfiniBand 400 Gb/s per GPU (50 GB/s).
* H200 SXM: H100's compute; HBM3e 4.8 TB/s, 141 GB.

The achieved fraction of those peaks is not on a data sheet. The Hopper profiles (H100, H200) charge each
matmul by its shape with rates measured on an H200 (``HOPPER_GEMM_CURVE``: bf16 31-76% of peak, FP8 15-69%,
the small reduction dims slowest) and attention at 50% of the FLOPs it computes (half the square where
causal) and memory traffic at 0.8 of HBM bandwidth (the H200's copy, measured); the A100's assumes
``efficiency`` 0.5 of peak for every matmul and 0.7 of HBM bandwidth (no A100 has been measured). All assume
NCCL-like link latencies (5 us
per ring step over NVLink, 10 us over InfiniBand): assumptions, said so in the output; ``--calibrate``
(:mod:`.calibrate`) replaces every figure with one measured on the machine.

Collective cost (alpha-beta, ring algorithms, as NCCL's defaults for large messages): over a group of
``n`` ranks, all-reduce ``2(n-1)`` steps of ``alpha`` plus ``2(n-1)/n * bytes * beta``; reduce-scatter and
all-gather ``(n-1)`` steps and ``(n-1)/n * bytes * beta``; a send ``alpha + bytes * beta``. A group whose
ranks span more than one node pays the inter-node link's alpha and beta (its slowest link). There, where the
profile says NCCL runs it (``tree_all_reduce``: the GPU profiles), an all-reduce costs the faster of the ring and
NCCL's tree: ``2 ((local - 1) alpha_intra + ceil(log2 nodes) alpha_inter)`` (a chain through each node's
``local`` ranks, a binary tree over the nodes, reduced up and broadcast down) plus the ring's bandwidth term;
a 32-node data-parallel all-reduce pays 10 latencies instead of 62.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Dict, List, Optional

RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1,
              "all_gather": lambda n: n - 1, "send": lambda n: 1, "all_to_all": lambda n: n - 1,
              "pipeline_send": lambda n: 1}
RING_BYTES = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
              "all_gather": lambda n: (n - 1) / n, "send": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n,
              "pipeline_send": lambda n: 1.0}


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
    # measured GPU matmul rates by shape (None: every matmul FLOP at ``flops``): per precision the coefficients
    # (c0, cK, cN, cM) of peak seconds per FLOP, 1 / efficiency = c0 + cK / K + cN / N + cM / M for a GEMM
    # [M, K] x [K, N]; attention's FLOPs at ``attention_efficiency`` of the peak
    gemm_curve: Optional[Dict[str, List[float]]] = None
    attention_efficiency: Optional[float] = None
    # attention's rate by shape where measured (a CPU's calibration: at head dim 16 and 64 tokens it ran at 0.6x
    # its rate at head dim 32 and 512 tokens): (a0, aD, aS) of peak seconds per FLOP computed,
    # 1 / efficiency = a0 + aD / head_dim + aS / seq; it replaces ``attention_efficiency`` where set
    attention_curve: Optional[List[float]] = None
    # ranks sharing cores (``compute_slots``): compute stretches by ``slow`` = ranks / slots, a collective's time
    # by ``slow ** shared_wait_exponent`` (a waiting rank sleeps and gives its core away; it is the peers' turn
    # to run that it waits for), measured by ``--calibrate`` from collectives at 2x oversubscription
    shared_wait_exponent: float = 1.0
    # how much slower a rank computes while every core computes than alone (hyperthreads of one core, shared
    # caches and memory bandwidth): what ``--calibrate`` measures on a CPU host; 1.0: nothing shared
    core_contention: float = 1.0
    # an all-reduce across nodes may run as NCCL's tree (its tuner picks the faster of ring and tree): a chain
    # through each node's ranks and a binary tree over the nodes, up and down, at the ring's bandwidth. gloo's
    # (a CPU host's) stays the ring
    tree_all_reduce: bool = False

    def compute_stretch(self, ranks: int) -> float:
        """How much slower each of ``ranks`` ranks on this host computes than one rank alone: ranks beyond
        ``compute_slots`` take turns on the cores, and cores that all compute are each ``core_contention``
        slower."""
        if not self.compute_slots or ranks <= 1:
            return 1.0
        busy = min(ranks, self.compute_slots)
        shared = 1.0 + (self.core_contention - 1.0) * (busy - 1) / max(self.compute_slots - 1, 1)
        return max(1.0, ranks / self.compute_slots) * shared

    def link(self, kind: str, inter_node: bool) -> Link:
        """The link ``kind`` runs on: its own, else (a pipeline's messages, ``"pipeline_send"``, where the profile
        has no figure of theirs) a send's, else ``"*"``'s."""
        table = self.inter if inter_node else self.intra
        return table.get(kind) or (table.get("send") if kind == "pipeline_send" else None) or table["*"]

    def collective_s(self, kind: str, n: int, nbytes: float, inter_node: bool = False, per_node: int = 1) -> float:
        """Seconds of one ``kind`` collective of ``nbytes`` (the full buffer) over ``n`` ranks, ``per_node`` of
        them on each node where the group crosses nodes (``inter_node``)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(kind, inter_node)
        ring = RING_STEPS[kind](n) * link.alpha + RING_BYTES[kind](n) * nbytes * link.beta
        if kind != "all_reduce" or not (self.tree_all_reduce and inter_node):
            return ring
        local = max(1, min(per_node, n))
        nodes = math.ceil(n / local)
        tree = (2 * ((local - 1) * self.link(kind, False).alpha + math.ceil(math.log2(nodes)) * link.alpha)
                + RING_BYTES[kind](n) * nbytes * link.beta)
        return min(ring, tree)

    def matmul_rate(self, precision: str) -> float:
        return self.flops.get(precision) or self.flops["fp32"]

    def matmul_seconds(self, precision: str, flops: float, shape=None) -> float:
        """Seconds of ``flops`` matmul and attention FLOPs; ``shape``: the probe's tallies of them
        (``accounting.SHAPE_TERMS``: their FLOPs over K, N and M, the attention FLOPs counted and computed, the
        GEMM calls, the attention FLOPs over head dim and sequence), which the measured curves
        read. Without a curve for ``precision`` (or with no tallies)
        every FLOP goes at ``flops``."""
        curve = (self.gemm_curve or {}).get(precision)
        if curve is None or flops <= 0 or not shape or not any(shape):
            return flops / self.matmul_rate(precision) if flops > 0 else 0.0
        peak = self.peak_flops.get(precision) or self.peak_flops["fp32"]
        counted, computed = min(shape[3], flops), min(shape[4], flops)
        c0, ck, cn, cm = curve[:4]
        calls = shape[5] if len(shape) > 5 else 0.0
        per_call = curve[4] * 2 * GEMM_CALL_SCALE if len(curve) > 4 else 0.0       # peak FLOPs' time per call
        gemm = c0 * (flops - counted) + ck * shape[0] + cn * shape[1] + cm * shape[2] + per_call * calls
        if self.attention_curve and len(shape) > 7 and computed > 0:
            a0, ad, a_s = self.attention_curve
            attention = a0 * computed + ad * min(shape[6], computed) + a_s * min(shape[7], computed)
        else:
            attention = computed / (self.attention_efficiency or 1.0 / c0)
        return (gemm + attention) / peak

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


# the per-call column of the curve's fit, 1 / (M N K) scaled to order one at the shapes measured
GEMM_CALL_SCALE = 1e9


def fit_relative_nonnegative(columns, row_scale, keep=()) -> Dict[str, float]:
    """Coefficients ``c`` of ``sum_j c_j columns[j] = 1 / row_scale`` (an inverse rate: a time per unit of work)
    by least squares on the relative error (each row's equation scaled by ``row_scale``), none below zero: the
    most negative term outside ``keep`` is dropped and the rest refitted, until none is negative or one term is
    left. Dropped terms come back as 0; a last term below zero is clipped to 0."""
    import torch
    cols = dict(columns)
    while True:
        a = torch.stack(list(cols.values()), 1) * row_scale.unsqueeze(1)
        coef = torch.linalg.lstsq(a, torch.ones_like(row_scale).unsqueeze(1)).solution.squeeze(1).tolist()
        got = dict(zip(cols, coef))
        free = [name for name in cols if name not in keep]
        worst = min(free, key=got.get) if free else None
        if worst is None or got[worst] >= 0 or len(cols) == 1:
            break
        del cols[worst]
    return {name: max(got.get(name, 0.0), 0.0) if name not in keep else got[name] for name in columns}


def fit_gemm_curve(samples) -> List[float]:
    """(c0, cK, cN, cM, cCall) of ``1 / efficiency = c0 + cK / K + cN / N + cM / M + cCall * 1e9 / (M N K)``
    fitted to ``samples`` of (M, N, K, efficiency) by least squares on the relative error of the predicted time
    (each row's equation scaled by its efficiency: the slow small shapes would otherwise outweigh the large ones
    a training step is made of). The last term is a fixed time per GEMM call (launch, the last partial wave):
    what makes the smallest shapes slower than the others predict; fitted where there are more samples than
    terms, else 0. Where every sample has the same M the M term cannot be told from c0: it is taken equal to
    the N term (the output's two dims tile alike) and c0 keeps the rest."""
    import torch
    m, n, k, eff = (torch.tensor([float(s[i]) for s in samples], dtype=torch.float64) for i in range(4))
    one_m = bool((m == m[0]).all())
    cols = {"c0": torch.ones_like(k), "K": 1 / k, "N": 1 / n}
    if not one_m:
        cols["M"] = 1 / m
    if len(samples) > len(cols) + 1:
        cols["call"] = GEMM_CALL_SCALE / (m * n * k)
    # no term may be negative (a shape smaller than those measured would get a negative time)
    got = fit_relative_nonnegative(cols, eff, keep=("c0",))
    c0, ck, cn = got["c0"], got.get("K", 0.0), got.get("N", 0.0)
    if one_m:
        return [c0 - cn / float(m[0]), ck, cn, cn, got.get("call", 0.0)]
    return [c0, ck, cn, got.get("M", 0.0), got.get("call", 0.0)]


# Hopper's matmul and attention rates by shape, fitted on one H200 (benchmarks/results/gemm_efficiency.csv,
# ``python -m benchmarks.gemm_efficiency --quick`` under gpu-check, two runs of 2026-11-29/30, torch 2.11 cuBLAS):
# over 72 projection shapes per dtype (hidden 2048-8192, tp 1 and 4, M 2048 and 8192), median |error| 6.5% (bf16)
# / 5.6% (fp8), worst 26% / 44% (the smallest, 2048 x 2048 x 512). The M term fitted below zero and was dropped;
# the per-call term is 12 us (bf16) / 18 us (fp8) of peak-rate time per GEMM. The H100 shares the SMs and the
# library; its lower HBM bandwidth touches memory-bound work, not these compute-bound shapes. Causal flash
# attention forward + backward at head dim 128: 44-56% of peak on the FLOPs it computes (0.5 here).
# ``plan --calibrate`` on a GPU measures the same (``calibrate_gpu``).
# (fit_gemm_curve of those rows; tests/test_planner_gemm_curve.py refits them)
HOPPER_GEMM_CURVE = {
    "bf16": [1.246653, 650.274372, 181.427796, 0.0, 5.875377],
    "fp8": [1.282643, 1199.562877, 600.667176, 0.0, 17.587493],
}
HOPPER_GEMM_CURVE["fp16"] = HOPPER_GEMM_CURVE["bf16"]
HOPPER_EFFICIENCY = {"bf16": 0.66, "fp16": 0.66, "fp8": 0.52}   # the measured medians: what a flat rate uses
# the copy bandwidth measured on the H200 over HBM3e's 4.8 TB/s: median 3,830 GB/s of 19 measurements
# (3,713-3,960; benchmarks/results/planner_device.csv, the planner_device_profile rows)
HOPPER_HBM_FRACTION = 0.8


def _gpu(name, peaks, hbm, nvlink_each_way, ib_per_gpu, efficiency=0.5, notes="", measured_curve=None):
    flat = {k: v * efficiency for k, v in peaks.items()}
    hbm_fraction = 0.7
    if measured_curve is not None:
        flat.update({k: peaks[k] * e for k, e in HOPPER_EFFICIENCY.items() if k in peaks})
        hbm_fraction = HOPPER_HBM_FRACTION
        notes = notes or ("data-sheet peaks; matmul and attention rates by shape and 80% of HBM bandwidth measured "
                          "on an H200 (bf16 median 66% of peak, fp8 52%), ring collectives (all-reduce across "
                          "nodes: the faster of ring and tree) with NCCL-like latencies")
    return Profile(name=name, flops=flat, peak_flops=dict(peaks),
                   mem_bw=hbm * hbm_fraction, intra={"*": Link(5e-6, 1.0 / nvlink_each_way)},
                   inter={"*": Link(10e-6, 1.0 / ib_per_gpu)}, fragmentation=0.05, measured=False, async_dispatch=True,
                   gemm_curve=measured_curve, attention_efficiency=0.5 if measured_curve else None,
                   tree_all_reduce=True,
                   notes=notes or f"data-sheet peaks; assumed {efficiency:.0%} matmul efficiency, 70% of HBM "
                                  f"bandwidth, ring collectives (all-reduce across nodes: the faster of ring and "
                                  f"tree) with NCCL-like latencies")


BUILTIN: Dict[str, Profile] = {
    "a100": _gpu("A100 SXM 80GB", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
                 2039e9, 300e9, 25e9),
    "h100": _gpu("H100 SXM", {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
                 3350e9, 450e9, 50e9, measured_curve=HOPPER_GEMM_CURVE),
    "h200": _gpu("H200 SXM", {"fp32": 67e12, "tf32": 495e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12},
                 4800e9, 450e9, 50e9, measured_curve=HOPPER_GEMM_CURVE),
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


__all__ = ["Link", "Profile", "BUILTIN", "load_profile", "RING_STEPS", "RING_BYTES", "fit_gemm_curve",
           "fit_relative_nonnegative",
           "HOPPER_GEMM_CURVE", "GEMM_CALL_SCALE"]
