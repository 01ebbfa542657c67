"""Every layout worth predicting for a request, each predicted, ranked; JSON and a picture of them."""
from __future__ import annotations

import contextlib
import gc
import itertools
from typing import Dict, Iterable, List, Optional, Sequence

from ..composition.layout import Layout
from ..pipeline.schedules import SCHEDULE_SPECS, schedule_spec
from .fp8 import fp8_rate
from .hardware import Profile
from .model import Prediction, predict, probe_layout
from .spec import Request

# the time model prices a whole backward per micro-batch, not B and W apart: the schedules it searches unasked
PLANNED_SCHEDULES = tuple(spec.name for spec in SCHEDULE_SPECS.values() if not spec.splits_backward)


def divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def why_not(req: Request, tp: int, pp: int, cp: int, v: int) -> Optional[str]:
    """Why a mesh cannot run the model (None: it can)."""
    if req.heads() % tp or req.kv_heads() % tp or req.ffn() % tp:
        return f"tp={tp} does not divide the heads ({req.heads()}, kv {req.kv_heads()}) and FFN ({req.ffn()})"
    if req.seq_len % (2 * cp) and cp > 1:
        return f"cp={cp}: the sequence ({req.seq_len}) must split into 2 x cp zigzag chunks"
    if req.n_layer() % (pp * v) and (v > 1 or req.n_layer() < pp):
        return f"{req.n_layer()} layers do not fill pp={pp} x {v} chunk(s)"
    return None


def zero_allowed(req: Request, zero: int) -> Optional[str]:
    """Why ``Parallel3D`` refuses ZeRO stage ``zero`` for the request's precision (None: it takes it): its
    own check, so the planner offers what the package runs (bf16/fp16 need fp32 master weights: ZeRO 1-3)."""
    from ..composition.config import DataParallelConfig, OptimizerConfig, PrecisionConfig, check_together
    try:
        check_together(OptimizerConfig(), DataParallelConfig(zero=zero), PrecisionConfig(dtype=req.dtype))
    except ValueError as exc:
        return str(exc)
    return None


def candidate_layouts(req: Request, zero: Sequence[int] = (0, 1, 2, 3),
                      schedules: Sequence[str] = PLANNED_SCHEDULES,
                      checkpoint: Sequence[bool] = (False, True), microbatch_factors: Sequence[int] = (1, 2, 4),
                      cp: Optional[Sequence[int]] = None, ep: Optional[Sequence[int]] = None,
                      dp: Optional[Sequence[int]] = None, tp: Optional[Sequence[int]] = None,
                      pp: Optional[Sequence[int]] = None):
    """``(layout, None)`` for every layout to predict and ``(layout, reason)`` for those that cannot run:
    dp x ep x tp x pp x cp = world; ZeRO stages the precision allows (:func:`zero_allowed`: fp32 0-3, bf16/fp16
    1-3, which keep fp32 master weights); with pp > 1, every schedule at ``pp x microbatch_factors``
    micro-batches; with pp = 1 one micro-batch; checkpointing off and on; ``cp``: the context-parallel sizes
    to consider (None: every one the world allows; ``(1,)`` leaves context parallelism out); ``ep``: the
    expert-parallel sizes (None: for an MoE model every one that divides both the world and its experts; a
    dense model has ep 1); ``dp``, ``tp``, ``pp``: the sizes of those to consider (None: every divisor of the
    world). A size list that leaves nothing, for the world and the others, raises ValueError saying so."""
    wanted = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
    for name, sizes in wanted.items():
        if sizes is not None and not [s for s in sizes if s >= 1 and req.world % s == 0]:
            every = ", ".join(map(str, divisors(req.world)))
            raise ValueError(f"planner: --{name} {','.join(map(str, sizes))}: no size divides the world of "
                             f"{req.world} ranks; name divisors of {req.world} ({every})")
    refused = {z: zero_allowed(req, z) for z in zero}
    zeros = [z for z in zero if refused[z] is None]
    if not zeros:
        raise ValueError(f"planner: no ZeRO stage asked for can run {req.precision}: "
                         + "; ".join(f"zero={z}: {why}" for z, why in refused.items())
                         + " (ask for other stages, e.g. --zero 1,2,3, or another precision)")
    experts = req.experts()
    ep_sizes = [e for e in divisors(req.world) if experts and experts % e == 0] if experts else [1]
    if ep is not None:
        ep_sizes = [e for e in ep_sizes if e in ep]
    sizes = {name: [s for s in divisors(req.world) if wanted[name] is None or s in wanted[name]]
             for name in ("dp", "tp", "pp")}
    for dp, tp, pp, ep_size in itertools.product(sizes["dp"], sizes["tp"], sizes["pp"], ep_sizes):
        if req.world % (dp * tp * pp * ep_size):
            continue
        cp_size = req.world // (dp * tp * pp * ep_size)
        if cp is not None and cp_size not in cp:
            continue
        for sched in (schedules if pp > 1 else ("1f1b",)):
            v = schedule_spec(sched).chunks
            reason = why_not(req, tp, pp, cp_size, v)
            ms = sorted({pp * f for f in microbatch_factors}) if pp > 1 else [1]
            for m, z, ck in itertools.product(ms, zeros, checkpoint):
                lay = Layout(dp=dp, ep=ep_size, tp=tp, pp=pp, cp=cp_size, zero=z, schedule=sched,
                             num_microbatches=m, num_chunks=v, checkpoint=ck)
                r = reason
                if r is None and req.global_batch % (dp * ep_size * m):
                    split = f"dp={dp}" + (f" x ep={ep_size}" if ep_size > 1 else "")
                    r = f"the global batch ({req.global_batch}) does not split into {split} x {m} micro-batches"
                yield lay, r


@contextlib.contextmanager
def _earlier_objects_frozen():
    """The objects alive now (torch's, sympy's, the package's modules: about a million) set aside from the
    garbage collector (``gc.freeze``) while the probes run, and given back after (``gc.unfreeze``). A probe
    collects before each phase it counts, and each full collection walked all of them: half of a search's
    time on a small model. What the search keeps is frozen after each layout (the loops below); nothing a probe
    makes is frozen while it runs, so what the collections free, and what the probes count, is the same. A
    process that froze objects of its own before (a test session) keeps everything frozen."""
    # the probes' meta ops import torch._dynamo at their first call: imported first, so it is frozen too
    import torch._dynamo  # noqa: F401
    frozen_by_caller = gc.get_freeze_count() > 0      # a process that set its own objects aside keeps them so
    gc.collect()                  # garbage made before the search is freed, not kept frozen
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_by_caller:
            gc.unfreeze()


def _probe_group(req: Request, group: List[Layout]) -> dict:
    """In a worker process: the probes of ``group`` (layouts that share their micro-batch probe), as the
    cache entries :func:`~.model.probe_layout` fills."""
    cache: dict = {}
    with _earlier_objects_frozen():
        for lay in group:
            probe_layout(req, lay, cache)
            gc.freeze()
    return cache


def probe_in_parallel(req: Request, layouts: Sequence[Layout], jobs: int, cache: dict, progress=None) -> None:
    """Fill ``cache`` with the probes of ``layouts`` over ``jobs`` processes (each probe is seconds of
    single-threaded Python on the meta device, so a search scales with the cores). Layouts that share a
    micro-batch probe go to the same process, so nothing expensive is probed twice; each process plays its
    ranks under its own fake process group."""
    import concurrent.futures
    import multiprocessing
    groups: Dict[tuple, List[Layout]] = {}
    for lay in layouts:
        key = (lay.tp, lay.pp, lay.cp, lay.ep, lay.num_chunks, lay.checkpoint, lay.num_microbatches * lay.dp,
               lay.zero == 3)
        groups.setdefault(key, []).append(lay)
    ctx = multiprocessing.get_context("spawn")     # a fresh interpreter: no process group, no forked threads
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_probe_group, req, group) for group in groups.values()]
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            cache.update(future.result())
            if progress:
                progress(f"(probed {done} of {len(futures)} groups of layouts)")


def plan(req: Request, profile: Profile, layouts: Optional[Iterable] = None, progress=None,
         cache: Optional[dict] = None, jobs: int = 1) -> List[Prediction]:
    """Predict every candidate; feasible ones first, fastest first, then the infeasible ones with why
    (``cache``: probes shared with other calls for the same request, see :func:`~.model.probe_layout`;
    ``jobs`` > 1: probe in that many processes first, see :func:`probe_in_parallel`)."""
    cache = {} if cache is None else cache
    if req.fp8:
        fp8_rate(profile, req)          # a profile without FP8 tensor cores: refused before any probe
    layouts = list(layouts if layouts is not None else candidate_layouts(req))
    if jobs > 1:
        probe_in_parallel(req, [lay for lay, reason in layouts if reason is None], jobs, cache, progress)
    out = []
    with _earlier_objects_frozen():
        for lay, reason in layouts:
            if reason is not None:
                out.append(Prediction(lay, [], 0, 0.0, {}, 0.0, 0.0, 0.0, False, reason))
                continue
            if progress:
                progress(lay.name())
            out.append(predict(req, lay, profile, cache))
            # what the search keeps (its cache: a schedule's instructions are 400k objects at 1,024 ranks) set
            # aside as it grows, or every probe's collections walk it (44% of a 70B search's time)
            gc.freeze()
    return sorted(out, key=lambda p: (not p.feasible, -p.tokens_per_s))


def to_json(req: Request, profile: Profile, ranked: List[Prediction]) -> dict:
    from ..composition.layout import model_to_json
    return {"request": {"model": model_to_json(req.model), "world": req.world, "global_batch": req.global_batch,
                        "seq_len": req.seq_len, "memory_bytes": req.memory_bytes,
                        "devices_per_node": req.devices_per_node, "precision": req.precision, "fp8": req.fp8,
                        "fp8_recipe": req.fp8_recipe, "fp8_gather": req.fp8_gather},
            "profile": profile.to_json(),
            "best": ranked[0].as_dict() if ranked and ranked[0].feasible else None,
            "layouts": [p.as_dict() for p in ranked]}


def draw(ranked: List[Prediction], path: str, memory_bytes: float, top: int = 16) -> str:
    """Stacked per-rank memory (the largest rank of each layout) and predicted step time, the ``top``
    feasible layouts and the infeasible ones closest to fitting."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [p for p in ranked if p.memory][:top]
    names = [p.layout.name() + ("" if p.feasible else " (no fit)") for p in shown]
    terms = ["parameters", "gradients", "optimizer", "activations"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.35 * len(shown) + 1.5), sharey=True)
    left = [0.0] * len(shown)
    for term in terms:
        vals = [max(p.memory, key=lambda t: sum(t.values())).get(term, 0) / 2**30 for p in shown]
        ax1.barh(names, vals, left=left, label=term)
        left = [a + b for a, b in zip(left, vals)]
    ax1.axvline(memory_bytes / 2**30, color="k", ls="--", lw=1)
    ax1.set_xlabel("GiB, largest rank (dashed: device memory)")
    ax1.legend(fontsize=7)
    ax1.invert_yaxis()
    ax2.barh(names, [p.step_s * 1e3 for p in shown], color=["C2" if p.feasible else "C7" for p in shown])
    ax2.set_xlabel("predicted step time, ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["PLANNED_SCHEDULES", "candidate_layouts", "zero_allowed", "plan", "probe_in_parallel", "to_json", "draw"]
