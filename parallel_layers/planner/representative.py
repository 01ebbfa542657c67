"""The planner's fast path: probe a layout at a representative depth and scale it to the real one.

A probe runs the package's own code (:mod:`.probe`), and its cost grows with the blocks it builds and runs:
seconds to minutes a layout at 80 blocks. But what it counts is linear in the blocks of a chunk: every
block of a stage is the same module on the same shapes, so each adds the same parameters, gradient and
optimizer bytes, FLOPs, memory traffic, operator calls, collectives and bytes kept for backward, while the
embedding, the head and the loss add theirs once. So a stage of ``k`` blocks is probed, with the real
code, at a few blocks a chunk (the same mesh, ZeRO stage, micro-batch, checkpointing: what a rank holds at 1
and 2, what a micro-batch costs at 2 and 3, or at its own 1-3 where a stage has no more) and every count ``x``
extrapolated from the last two: ``x(k) = x(a) + (k - a) (x(a + 1) - x(a))`` (a = 1 for a rank's holdings, 2 for
a micro-batch); at a probed depth that is the probe itself.

What a micro-batch costs does not depend on dp, the pipeline depth, the schedule or the micro-batch count
beyond the micro-batch's size, only on the stage's shape: first (embedding + blocks), middle (blocks),
last (blocks + head + loss) or, at pp = 1, all of them. So the micro-batch probe is of those shapes, on a
3-stage (pp = 1: 1-stage) mesh of the layout's tp, cp and ep, shared by every layout with the same
micro-batch whatever its dp, pp, chunks, schedule or ZeRO stage (but ZeRO-3, which keeps full
gradients), and each real chunk takes its shape's (:func:`stage_shape`). What a rank holds (static terms)
is probed at 1 and 2 blocks a chunk on the layout's own mesh.

Exact: FLOPs, traffic, operator calls, collectives (the second block's calls, as a multiset, added k - 2
times), bytes kept for backward, ZeRO-3's full gradients, parameters and optimizer state, data-parallel
sync bytes. A micro-batch's peak is the 3-block probe's plus, per extra block, one block's kept bytes (and
ZeRO-3 gradients): exact where the peak is a moment with every block's activations alive (the loss, the
start of backward). From 3 blocks on the peak grows at that steady rate; from 1 and 2 it need not (ZeRO-3
with checkpointing at pp 1 came out 60% over, 3.10 against 1.90 MB), which is why a third depth is probed.
Where buffers are padded (ZeRO shards to a multiple of dp, buckets), the padding is
extrapolated too: at most dp elements a buffer off. ``tests/test_planner_speed.py`` holds every term to the
full probe's on a model where both run.

Layers that do not split evenly into the stages: each stage takes its own count (:func:`stage_blocks`, the
package's split), a micro-batch's costs scaled to it, a rank's static terms to its chunks' total.

A streaming ZeRO-2 rank (pp 1) holds, instead of its stage's full gradients, the most buckets in flight at
once: not linear in the blocks, but a window sliding over more blocks of the same buckets. Its static terms
are probed at 2 and 3 blocks (:func:`scale_streaming`) and scaled where those bytes are the same at both;
else at full depth.

Where the argument does not hold the layout is probed at full depth (:func:`why_exact`): FP8 training (its
account of converted GEMMs is per layer), tied embeddings on a V schedule (the first and the last chunk
share one weight on rank 0) and Hugging Face configs whose layers differ (a per-layer list, such as
``layer_types``).
"""
from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Dict, List, Optional

from ..composition.layout import Layout
from ..pipeline.schedules import schedule_spec, stage_of
from ..pipeline.stage import partition_layers
from .probe import ChunkCost
from .spec import Request

STATIC_BLOCKS = (1, 2)           # blocks a chunk the static probes run; the real count is extrapolated from them
STREAM_BLOCKS = (2, 3)           # the same for a streaming ZeRO-2 rank (pp 1): see scale_streaming
SHAPE_BLOCKS = (1, 2, 3)         # blocks the micro-batch probes of a stage shape run


def stage_blocks(req: Request, layout: Layout) -> List[int]:
    """The blocks of every global stage, as the package splits them (``pipeline.stage.partition_layers`` by
    count: the first ``n_layer % stages`` stages one more)."""
    return [end - start for start, end in partition_layers(req.n_layer(), layout.pp * layout.num_chunks)]


def rank_blocks(req: Request, layout: Layout, pp_rank: int) -> List[int]:
    """The blocks of each chunk of pipeline rank ``pp_rank``, in chunk order."""
    blocks, placement = stage_blocks(req, layout), schedule_spec(layout.schedule).layout
    return [blocks[stage_of(pp_rank, c, layout.pp, layout.num_chunks, placement)] for c in range(layout.num_chunks)]


def _tied(model) -> bool:
    return bool(getattr(model, "tie_embeddings", False) or getattr(model, "tie_word_embeddings", False))


def why_exact(req: Request, layout: Layout) -> Optional[str]:
    """Why ``layout`` is probed at full depth (None: at 1 and 2 blocks a chunk, scaled)."""
    n = req.n_layer()
    if req.fp8:
        return "FP8 training: its converted GEMMs are accounted layer by layer"
    if _tied(req.model) and layout.pp > 1 and schedule_spec(layout.schedule).layout == "v":
        return "tied embeddings on a V schedule: rank 0's first and last chunk share the embedding"
    if not callable(getattr(req.model, "build", None)):
        per_layer = [k for k, v in vars(req.model).items() if isinstance(v, (list, tuple)) and len(v) == n]
        if per_layer:
            return f"the model's layers differ ({', '.join(per_layer)})"
    return None


def streams(layout: Layout) -> bool:
    """Whether the rank may stream ZeRO-2 gradients (``probe.streams_gradients``: pp = 1): its static terms
    are scaled by :func:`scale_streaming`, not :func:`scale_static`."""
    return layout.zero == 2 and layout.pp == 1


def with_layers(req: Request, n_layer: int) -> Request:
    """``req`` for the same model with ``n_layer`` blocks (a GPTConfig or a Hugging Face config)."""
    model = req.model
    if dataclasses.is_dataclass(model):
        model = dataclasses.replace(model, n_layer=n_layer)
    else:
        model = copy.deepcopy(model)
        model.num_hidden_layers = n_layer
    return dataclasses.replace(req, model=model)


def stage_shape(stage: int, n_stages: int) -> str:
    """The shape of pipeline stage ``stage`` of ``n_stages``: ``"first"``, ``"middle"``, ``"last"``, or
    ``"only"`` (one stage: embedding, blocks and head)."""
    if n_stages == 1:
        return "only"
    return "first" if stage == 0 else "last" if stage == n_stages - 1 else "middle"


def shape_layout(layout: Layout, precision: str) -> Layout:
    """The mesh a micro-batch's stage shapes are probed on: dp 1, 3 stages (1 where the layout has one),
    one chunk each, ZeRO 0 (1 for bf16/fp16, which need fp32 master weights) or 3, as the layout keeps."""
    pp = 1 if layout.pp == 1 else 3
    plain = 0 if precision == "fp32" else 1
    return Layout(tp=layout.tp, cp=layout.cp, ep=layout.ep, pp=pp, zero=3 if layout.zero == 3 else plain,
                  num_microbatches=pp, schedule="1f1b", num_chunks=1, checkpoint=layout.checkpoint)


def _line(a: int, b: int, k: int) -> int:
    return a + (k - 1) * (b - a)


def _colls(a: Dict[str, List[int]], b: Dict[str, List[int]], k: int) -> Dict[str, List[int]]:
    """Collectives at ``k`` blocks from those at 1 (``a``) and 2 (``b``): ``a``'s calls and ``k - 1`` times
    the calls the second block added."""
    out = {}
    for name in set(a) | set(b):
        one, two = Counter(a.get(name, [])), Counter(b.get(name, []))
        if one - two:
            raise RuntimeError(f"planner: a second block removed {name} calls ({dict(one - two)}): the probe "
                               f"is not linear in the blocks")
        extra = list((two - one).elements())
        calls = list(a.get(name, [])) + extra * (k - 1)
        if calls:
            out[name] = calls
    return out


def shape_depths(blocks: List[int]) -> List[int]:
    """The depths a layout's stage shapes are probed at: each stage's own count where it is 1-3 blocks, and 2
    and 3 where a stage has more (scaled from those two)."""
    deepest = SHAPE_BLOCKS[-1]
    return sorted({k for k in blocks if k <= deepest} | (set(SHAPE_BLOCKS[1:]) if max(blocks) > deepest else set()))


def scale_chunk(costs: Dict[int, ChunkCost], k: int) -> ChunkCost:
    """One chunk of ``k`` blocks from its probes at (depth -> cost) 2 and 3 blocks, or its own depth where
    that was probed (the module docstring says how)."""
    if k in costs:
        return costs[k]
    c2, c3 = costs[2], costs[3]
    line = {f: _line(getattr(c2, f), getattr(c3, f), k - 1)
            for f in ("saved", "persist", "flops_f", "flops_b", "traffic_f", "traffic_b", "ops_f", "ops_b",
                      "persist_untallied", "fused_traffic_f", "fused_traffic_b", "fused_ops_f", "fused_ops_b",
                      "recomputable")}
    for f in ("shape_f", "shape_b"):
        line[f] = tuple(_line(a, b, k - 1) for a, b in zip(getattr(c2, f), getattr(c3, f)))
    kept = c3.saved - c2.saved                 # what one more block keeps for backward
    return dataclasses.replace(c3, peak=c3.peak + (k - 3) * (kept + c3.persist - c2.persist),
                               first_peak=c3.first_peak + (k - 3) * kept,
                               coll_f=_colls(c2.coll_f, c3.coll_f, k - 1), coll_b=_colls(c2.coll_b, c3.coll_b, k - 1),
                               **line)


def scale_static(r1: tuple, r2: tuple, blocks: List[int], first: int = 1) -> tuple:
    """One rank's static probe (terms, sync bytes, streamed, reduction shard, per unit, step tail ops, sync calls) for
    chunks of
    ``blocks`` blocks from its probes at ``first`` and ``first + 1`` blocks in every chunk: the second probe
    adds one block to each chunk, so each block beyond the ``first`` of a chunk adds ``1 / chunks`` of the
    difference."""
    if len(set(blocks)) == 1 and blocks[0] - first in (0, 1):
        return (r1, r2)[blocks[0] - first]
    (s1, y1, _, red1, _, ops1, c1), (s2, y2, streamed, red2, per_unit, ops2, c2) = r1, r2
    extra = (sum(blocks) - first * len(blocks)) / len(blocks)

    def line(a, b):
        return a + round(extra * (b - a))
    static = {t: line(s1.get(t, 0), s2.get(t, 0)) for t in s2}
    sync = {t: line(y1.get(t, 0), y2.get(t, 0)) for t in y2}
    calls = {t: line(c1.get(t, 0), c2.get(t, 0)) for t in c2}
    return static, sync, streamed, line(red1, red2), per_unit, line(ops1, ops2), calls


def scale_streaming(r2: tuple, r3: tuple, in_flight: int, k: int) -> tuple:
    """A streaming ZeRO-2 rank's static probe at ``k`` blocks (one chunk, pp 1) from its probes at 2 and 3
    blocks, whose streamed bucket bytes were both ``in_flight``. Every term but those bytes is linear in the
    blocks (parameters, optimizer state, the gradient shard, sync bytes); the streamed bytes are the most
    gradient memory of a few consecutive buckets in flight at once, a window that a deeper model slides over
    more blocks of the same buckets: constant once it is constant from 2 blocks to 3 (where it is not, the
    caller probes at full depth)."""
    def linear_part(r):
        return (dict(r[0], gradients=r[0]["gradients"] - in_flight),) + tuple(r[1:])
    static, *rest = scale_static(linear_part(r2), linear_part(r3), [k], first=STREAM_BLOCKS[0])
    return (dict(static, gradients=static["gradients"] + in_flight), *rest)


__all__ = ["STATIC_BLOCKS", "STREAM_BLOCKS", "SHAPE_BLOCKS", "why_exact", "streams", "with_layers", "stage_shape",
           "shape_layout", "stage_blocks", "rank_blocks", "shape_depths", "scale_chunk", "scale_static",
           "scale_streaming"]
