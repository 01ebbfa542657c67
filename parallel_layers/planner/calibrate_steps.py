"""The CPU calibration's rates by operator kind, measured inside real training steps.

A matmul timed alone runs faster than the same matmul inside a training step: alone its operands stay in
cache and it always has the forward's layout; in a step they come back from memory after the other ops, and
the backward's GEMMs reduce over the tokens with transposed operands (on the 2-core CI machine the benchmark's
GEMMs ran 0.5-0.95x their isolated rate, attention at 18 GFLOP/s against 31 isolated). A fit of the whole
step on ``calls x op_overhead + bytes / mem_bw`` after taking the isolated matmul time off then charges the
missing matmul time to the small ops, by an amount that depends on how much of the reference model's step is
matmul: the package's GPT came out at 23 us a call, a Llama at 13.8.

So each kind is measured where it runs: ``Parallel3D`` training steps of reference models (the package's GPT,
and a Llama-style Hugging Face model where ``transformers`` is installed: SwiGLU, RMSNorm, rotary, grouped
queries) on one gloo rank, one thread, each

* timed as a whole (the median of ``reps`` steps),
* tallied as the planner's probe tallies it (:class:`.accounting.OpTally`: operator calls and non-matmul
  traffic; :class:`.accounting.FlopTally`: FLOPs and the GEMM shape terms),
* and profiled (``torch.profiler``) for the time its GEMM calls and its attention kernels take.

Then the GEMM curve is fitted on the steps' own GEMM calls (``gemm_scale`` says how much slower they ran than
the curve measured alone predicts), attention's rate on its kernels' time by head dim and sequence length, and
what is left of each step (its time less its GEMMs and attention) as ``calls x op_overhead + bytes / mem_bw``.

Two link figures are fitted the same way, on measured steps of reference layouts (:func:`fit_send_latency`,
:func:`fit_wait_exponent`): a pipeline message's latency and how much longer collectives take on ranks that
share cores. Timed in a loop, both said more than steps show.
"""
from __future__ import annotations

import statistics
import time
from typing import Dict, List, Tuple

import torch

from .accounting import ATTENTION_OPS
from .hardware import Link, Profile, fit_relative_nonnegative

# (n_layer, d_model, batch, seq) of the reference steps: from dispatch-bound (d 32, 256 tokens) to
# traffic-bound (d 256, 4,096 tokens)
GPT_SIZES = ((2, 32, 2, 128), (2, 64, 4, 64), (2, 128, 8, 128), (2, 256, 16, 256), (2, 128, 2, 512))
LLAMA_SIZES = ((2, 64, 8, 64), (2, 128, 4, 128), (2, 256, 8, 128))
_GEMM_OPS = {"mm", "addmm", "bmm", "baddbmm"}


def reference_config(n_layer: int, d: int, s: int):
    """The reference GPT (heads of 32) the step rates and the core contention are measured on."""
    from ..models.gpt import GPTConfig
    return GPTConfig(vocab_size=256, n_layer=n_layer, n_head=max(1, d // 32), d_model=d, max_seq_len=s)


def _llama_model(n_layer: int, d: int, s: int):
    """A Llama-style model (heads of 16, two query heads per key/value head, SwiGLU of 2d)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    heads = max(2, d // 16)
    cfg = LlamaConfig(hidden_size=d, intermediate_size=2 * d, num_hidden_layers=n_layer, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, vocab_size=256, max_position_embeddings=s)
    return LlamaForCausalLM(cfg)


def reference_steps() -> List[Tuple[str, tuple]]:
    """(architecture, sizes) of every reference step: the GPT's always, the Llama's where ``transformers``
    is installed (an optional dependency: without it the fit has one architecture)."""
    steps = [("gpt", size) for size in GPT_SIZES]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return steps
    return steps + [("llama", size) for size in LLAMA_SIZES]


def _kind_seconds(step) -> Dict[str, object]:
    """Seconds one step spends in its GEMM calls and in its attention kernels (self time, the profiler's), and
    each GEMM call as (M, N, K, FLOPs, seconds) in the shape terms the probe tallies (``add_gemm_shape``)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    out = {"gemm": 0.0, "attention": 0.0, "gemm_calls": []}
    for event in prof.events():
        name = event.name.split("::")[-1]
        seconds = event.self_cpu_time_total / 1e6
        if name in ATTENTION_OPS:
            out["attention"] += seconds
        elif name in _GEMM_OPS and seconds > 0:
            out["gemm"] += seconds
            shapes = event.input_shapes
            a, b = (shapes[1], shapes[2]) if name in ("addmm", "baddbmm") else (shapes[0], shapes[1])
            batch = a[0] if len(a) == 3 else 1
            m, k, n = a[-2], a[-1], b[-1]
            out["gemm_calls"].append((m, n, k, 2.0 * batch * m * n * k, seconds))
    return out


def _step_rank(rank: int, world: int, steps, reps: int) -> List[Dict[str, object]]:
    """On a 1-rank gloo group: each reference step built as ``Parallel3D``, tallied, timed and profiled."""
    from ..composition.layout import Layout
    from ..composition.parallel3d import Parallel3D
    from ..mesh import ParallelMesh
    from .accounting import FlopTally, OpTally, attention_flop_formulas
    torch.set_num_threads(1)
    rows = []
    for arch, (n_layer, d, b, s) in steps:
        torch.manual_seed(0)
        model = reference_config(n_layer, d, s) if arch == "gpt" else _llama_model(n_layer, d, s)
        p3d = Parallel3D(model, ParallelMesh(dp=1, tp=1, pp=1, cp=1), replica_check=None,
                         **Layout(num_microbatches=1).parallel3d_kwargs())
        x = torch.randint(0, 256, (b, s))

        def step(p3d=p3d, x=x):
            p3d.train_step(x, x)
        step()
        with OpTally() as tally, FlopTally(attention_flop_formulas()) as flops:
            step()
        # timed and profiled steps in turn, so that a slow spell of a shared host touches both alike
        times, kinds = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            kinds.append(_kind_seconds(step))
        rows.append(dict(arch=arch, size=(n_layer, d, b, s), ops=float(tally.ops), traffic=float(tally.traffic),
                         flops=float(flops.get_total_flops()), shape=tuple(flops.shape),
                         step_s=statistics.median(times), gemm=statistics.median(k["gemm"] for k in kinds),
                         attention=statistics.median(k["attention"] for k in kinds),
                         gemm_calls=[c for k in kinds for c in k["gemm_calls"]]))
    return rows


def measure_steps(reps: int = 5, steps=None) -> List[Dict[str, object]]:
    """The reference steps' tallies and times (``steps``: (architecture, sizes) pairs, default
    :func:`reference_steps`), measured on one gloo rank started here."""
    from ..testing.workers import WorkerPool
    with WorkerPool(1, pg_timeout_s=120) as pool:
        return pool.run(_step_rank, tuple(steps or reference_steps()), reps, timeout=900)[0]


def _gemm_seconds(profile: Profile, row) -> float:
    """What ``profile`` charges for a row's GEMMs alone (its attention FLOPs and shape terms left out)."""
    shape = tuple(0.0 if i in (3, 4) else v for i, v in enumerate(row["shape"]))
    return profile.matmul_seconds("fp32", max(row["flops"] - row["shape"][3], 0.0), shape)


def gemm_samples(rows, peak: float) -> List[Tuple[int, int, int, float]]:
    """(M, N, K, efficiency) of each GEMM shape the steps ran: the FLOPs of its calls over their time, over
    ``peak``."""
    calls: Dict[tuple, List[float]] = {}
    for row in rows:
        for m, n, k, flops, seconds in row["gemm_calls"]:
            acc = calls.setdefault((m, n, k), [0.0, 0.0])
            acc[0] += flops
            acc[1] += seconds
    return [(m, n, k, flops / seconds / peak) for (m, n, k), (flops, seconds) in sorted(calls.items())]


def fit_attention_curve(rows, peak: float):
    """(a0, aD, aS) of ``Profile.attention_curve`` fitted to the steps' attention time from their shape tallies
    (least squares on the relative error; a term fitted below zero is dropped and the rest refitted), or None
    where fewer steps than terms ran attention."""
    rows = [r for r in rows if r["attention"] > 0 and r["shape"][4] > 0]
    if len(rows) < 3:
        return None
    y = torch.tensor([r["attention"] * peak for r in rows], dtype=torch.float64)
    cols = {i: torch.tensor([r["shape"][term] for r in rows], dtype=torch.float64) for i, term in enumerate((4, 6, 7))}
    got = fit_relative_nonnegative(cols, 1.0 / y)
    return [got[i] for i in range(3)]


def fit_step_rates(profile: Profile, rows) -> Dict[str, object]:
    """Per-kind rates from measured steps (``measure_steps``' rows) for ``profile`` (its fp32 peak): the GEMM
    curve fitted on the steps' own GEMM calls (``gemm_curve``; ``gemm_scale``: the steps' GEMM time over what
    ``profile``'s curve, measured alone, predicts for them), ``attention_efficiency`` (the FLOPs the steps'
    attention kernels compute over their time, of the peak) and ``attention_curve`` (the same by head dim and
    sequence length: :func:`fit_attention_curve`), and ``op_overhead`` / ``mem_bw`` fitted by least
    squares on the relative error of what is left of each step."""
    from .hardware import fit_gemm_curve
    peak = profile.peak_flops.get("fp32") or profile.flops["fp32"]
    predicted = sum(_gemm_seconds(profile, r) for r in rows)
    measured = sum(r["gemm"] for r in rows)
    gemm_scale = measured / predicted if predicted > 0 and measured > 0 else 1.0
    samples = gemm_samples(rows, peak)
    curve = fit_gemm_curve(samples) if len(samples) >= 3 else None
    computed, attn_s = sum(r["shape"][4] for r in rows), sum(r["attention"] for r in rows)
    attention = computed / attn_s / peak if computed > 0 and attn_s > 0 else profile.attention_efficiency
    attention_curve = fit_attention_curve(rows, peak)
    a = torch.tensor([(r["ops"], r["traffic"]) for r in rows], dtype=torch.float64)
    # what the GEMMs and attention leave of a step (never below a tenth of it: the profiler's self times
    # and the unprofiled step come from different runs)
    rest = torch.tensor([max(r["step_s"] - r["gemm"] - r["attention"], 0.1 * r["step_s"]) for r in rows],
                        dtype=torch.float64).unsqueeze(1)
    scale = a.abs().max(0).values.clamp_min(1.0)   # columns of order one: calls and bytes differ by 1e5
    w = 1.0 / rest
    coef = torch.linalg.lstsq(a / scale * w, rest * w).solution.squeeze(1) / scale
    per_op, per_byte = (float(c) for c in coef)
    if per_byte <= 0.0:                              # one term fitted below zero: the other alone
        per_byte = 1.0 / profile.mem_bw
        per_op = max(float(((rest.squeeze(1) - a[:, 1] * per_byte) / a[:, 0]).median()), 0.0)
    elif per_op <= 0.0:
        per_op = 0.0
        per_byte = float((rest.squeeze(1) / a[:, 1]).median())
    return {"gemm_curve": curve, "gemm_scale": gemm_scale, "attention_efficiency": attention,
            "attention_curve": attention_curve,
            "op_overhead": per_op, "mem_bw": 1.0 / per_byte}


def apply_step_rates(profile: Profile, rates: Dict[str, object]) -> None:
    """Charge ``profile``'s fp32 GEMMs, attention and small ops at the rates of real steps."""
    if rates["gemm_curve"] is not None:
        profile.gemm_curve = dict(profile.gemm_curve or {}, fp32=list(rates["gemm_curve"]))
    else:
        profile.flops = dict(profile.flops, fp32=profile.flops["fp32"] / rates["gemm_scale"])
    profile.attention_efficiency = rates["attention_efficiency"]
    profile.attention_curve = rates["attention_curve"]
    profile.op_overhead, profile.mem_bw = rates["op_overhead"], rates["mem_bw"]


# the reference model the links' figures are fitted on in real steps: the reference GPT at d 64 (2 blocks,
# 4 sequences of 128 tokens a replica): not one of the models the planner benchmark measures
LINK_REFERENCE = dict(n_layer=2, d=64, batch=4, seq=128)


def _link_reference(kind: str, slots: int):
    """(request, layout) of a reference step: ``"send"`` a 2-stage 1F1B pipeline of 4 micro-batches (its
    messages' latency); ``"wait"`` data (``slots``) x tensor (2) x pipeline (2) parallel, ZeRO-1, 1F1B of 2
    micro-batches: four times as many ranks as ``slots`` cores, each dimension's communication among them."""
    from ..composition.layout import Layout
    from .spec import Request
    r = LINK_REFERENCE
    if kind == "send":
        layout, replicas = Layout(pp=2, schedule="1f1b", num_microbatches=4), 1
    else:
        layout, replicas = Layout(dp=slots, tp=2, pp=2, zero=1, schedule="1f1b", num_microbatches=2), slots
    req = Request(reference_config(r["n_layer"], r["d"], r["seq"]), world=layout.world,
                  global_batch=r["batch"] * replicas, seq_len=r["seq"], memory_bytes=1e12)
    return req, layout


def _link_rank(rank: int, world: int, kind: str, slots: int, reps: int) -> float:
    """On every rank of a reference layout: its measured step (the slowest rank's median)."""
    from ..composition.parallel3d import Parallel3D
    from ..mesh import ParallelMesh
    from .measure import measure_layout
    torch.set_num_threads(1)
    req, layout = _link_reference(kind, slots)
    torch.manual_seed(0)
    p3d = Parallel3D(req.model, ParallelMesh(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=1), replica_check=None,
                     **layout.parallel3d_kwargs())
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (req.global_batch, req.seq_len), generator=gen)
    return measure_layout(p3d, (x, x), reps)["step_s"]


def _fit_to_step(profile: Profile, kind: str, reps: int, with_value, hi: float) -> float:
    """The value in [0, ``hi``] at which ``predict`` (with the profile ``with_value(value)`` makes) gives the
    reference ``kind`` step's measured time (bisection: the prediction grows with the value)."""
    from ..testing.workers import WorkerPool
    from .model import predict
    slots = profile.compute_slots or 1
    req, layout = _link_reference(kind, slots)
    with WorkerPool(layout.world, pg_timeout_s=120) as pool:
        measured = pool.run(_link_rank, kind, slots, reps, timeout=600)[0]
    cache: dict = {}

    def predicted(value: float) -> float:
        return predict(req, layout, with_value(value), cache).step_s
    lo = 0.0
    if predicted(lo) >= measured:
        return lo
    if predicted(hi) <= measured:
        return hi
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if predicted(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def fit_send_latency(profile: Profile, reps: int = 5) -> float:
    """The latency of a pipeline's message (``Link.alpha`` of ``"pipeline_send"``) fitted on a real pipeline step
    (:func:`_link_reference`), searched up to 3x the send's that ``profile`` has (timed in a loop, that varied
    0.7-1.9 ms between calibrations minutes apart on the 2-core CI machine and put the pipeline layouts up to 100%
    off: a loop of messages meets each slow wake-up, a step's messages overlap the peer's work). Context
    parallelism's ring exchanges, which send and receive at once as the loop does, keep the loop's ``"send"``."""
    base = profile.to_json()

    def with_alpha(alpha: float) -> Profile:
        trial = Profile.from_json(base)
        for links in (trial.intra, trial.inter):
            links["pipeline_send"] = Link(alpha=alpha, beta=links["send"].beta)
        return trial
    return _fit_to_step(profile, "send", reps, with_alpha, 3 * profile.intra["send"].alpha)


def fit_wait_exponent(profile: Profile, reps: int = 5) -> float:
    """``Profile.shared_wait_exponent`` fitted on a real step: the ``"wait"`` reference layout
    (:func:`_link_reference`: four times as many gloo ranks as ``profile.compute_slots``) measured here, and the
    exponent in [0, 1] at which ``predict`` gives its step.

    Collectives timed in a loop with twice as many ranks as cores waited 1.2-3.5x as long as alone (an exponent
    of 1-1.3: every rank calls one each millisecond), but in training steps the 4- and 8-rank layouts of the
    planner benchmark on 2 cores ran as an exponent of about 0.5 predicts: between collectives the peers
    compute, and a rank that waits leaves its core to another. On the 2-core CI machine this fit gave 0.36-0.48
    (three runs); the same fit on a data x tensor parallel step of 4 ranks gave 0.86-1.0, and the exponent that
    predicted the benchmark's 8-rank layouts within 10% was 0.5: the stretch does not grow as one power of the
    oversubscription, and the fit is made where the planner's many-rank layouts are."""
    base = profile.to_json()
    return _fit_to_step(profile, "wait", reps, lambda e: Profile.from_json(dict(base, shared_wait_exponent=e)), 1.0)


def step_rates(profile: Profile, reps: int = 5, steps=None) -> Dict[str, float]:
    """Measure the reference steps and fit their per-kind rates for ``profile`` (:func:`fit_step_rates`)."""
    return fit_step_rates(profile, measure_steps(reps, steps))


__all__ = ["GPT_SIZES", "LLAMA_SIZES", "LINK_REFERENCE", "reference_config", "reference_steps", "measure_steps",
           "gemm_samples", "fit_attention_curve", "fit_step_rates", "apply_step_rates", "step_rates",
           "fit_send_latency", "fit_wait_exponent"]
