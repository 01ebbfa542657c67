"""Run one layout's rank of the package on the meta device, to read what it allocates and computes.

The planner does not keep a second, hand-written copy of what each layout holds: it builds the
rank with the package's own code (``Parallel3D`` on ``device="meta"``: the same stage split, tensor
parallel sharding, ZeRO partitioning, gradient buckets and padding) inside a *fake* process group of the
layout's world size (``torch.distributed``'s ``fake`` backend: every collective returns at once, so one
process can play any rank), then

* :func:`static_terms`: the bytes it holds once a step has begun (parameters, gradient buffers and
  shards, optimizer state, ZeRO-3's gathered parameters), read from its tensors' storages;
* :func:`microbatch_probe`: runs two micro-batches of each of the rank's stages forward and backward
  under :class:`~.accounting.OpTally` and :class:`~.accounting.FlopTally`: the bytes kept
  for backward, the peak of one micro-batch, the FLOPs, the memory traffic of the other ops and every
  tensor-parallel / context-parallel collective, each per phase.

Symmetry: ranks that differ only in their dp, cp or tp coordinate hold the same shapes, so one rank per
pipeline stage (dp = cp = tp coordinate 0) stands for all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .accounting import (
    FlopTally,
    OpTally,
    attention_flop_formulas,
    fused_attention_on_meta,
    held_bytes,
    tensors_reachable,
)
from .spec import Layout, Request

META = torch.device("meta")


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as rank ``rank`` of ``world`` under the fake backend (no peers, no data moved)."""
    if dist.is_initialized():
        raise RuntimeError("planner: torch.distributed is already initialised in this process; the planner plays "
                           "every rank itself under a fake process group, so run it in a process of its own "
                           "(python -m parallel_layers plan, or Parallel3D(layout='auto'), which does that)")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    # meta too: collectives and point-to-point batches on meta tensors ask for the backend of "meta"
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_rank(req: Request, layout: Layout, pp_rank: int, device: torch.device = META):
    """``Parallel3D`` of ``layout``'s pipeline rank ``pp_rank`` on meta (call inside :func:`fake_world`;
    ``device``: another one to check the probe against real tensors)."""
    from ..composition.config import PrecisionConfig
    from ..composition.parallel3d import Parallel3D
    from ..mesh import ParallelMesh
    mesh = ParallelMesh(dp=layout.dp, tp=layout.tp, pp=layout.pp, cp=layout.cp, timeout=60)
    kw = dict(layout.parallel3d_kwargs(), precision=PrecisionConfig(dtype=req.dtype))
    if req.is_gpt:
        return Parallel3D(req.model, mesh, device=device, **kw)
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(req.model, torch_dtype=req.dtype)
    return Parallel3D(model, mesh, device=device, **kw)


def global_rank(layout: Layout, pp_rank: int) -> int:
    """The global rank at (pp_rank, dp 0, cp 0, tp 0): the mesh is (pp, dp, cp, tp), tp fastest."""
    return pp_rank * layout.dp * layout.cp * layout.tp


def _keys(tensors) -> set:
    return {t.untyped_storage()._cdata for t in tensors}


def static_terms(p3d) -> Dict[str, int]:
    """Bytes this rank holds with a step begun (``mode.begin_step()`` run: ZeRO-2's full gradient buffer
    back, ZeRO-3's parameters gathered), split into parameters (ZeRO-3: its shard too), gradients (what
    the data-parallel wrapper holds besides the parameters: buffers, shards) and optimizer state (the
    rest the optimizer holds). torch's AdamW (``zero=0``) makes its state at the first step: exp_avg and
    exp_avg_sq like each parameter and a float32 step count, added here as that rule."""
    p3d.mode.begin_step()
    params = [p for p in p3d.model.parameters()] + list(p3d.model.buffers())
    wrapper = getattr(p3d.mode, "dp", None) or getattr(p3d.mode, "z", None)
    if getattr(wrapper, "shard_buffer", None) is not None:
        params.append(wrapper.shard_buffer)
    pkeys = _keys(params)
    grads = [t for t in tensors_reachable([wrapper]) if t.untyped_storage()._cdata not in pkeys]
    taken = pkeys | _keys(grads)
    optim = [t for t in tensors_reachable([p3d.optimizer]) if t.untyped_storage()._cdata not in taken]
    out = {"parameters": held_bytes(params), "gradients": held_bytes(grads), "optimizer": held_bytes(optim)}
    if isinstance(p3d.optimizer, torch.optim.AdamW) and not p3d.optimizer.state:
        out["optimizer"] += sum(2 * p.numel() * p.element_size() + 4 for g in p3d.optimizer.param_groups
                                for p in g["params"])
    return out


@dataclasses.dataclass
class ChunkCost:
    """One stage (chunk) of a rank, per micro-batch."""
    saved: int                 # bytes kept from a forward until its backward (the received input included)
    peak: int                  # the most bytes one micro-batch has live at once, forward or backward
    persist: int               # bytes left after backward that stay for the step (ZeRO-3's full gradients)
    flops_f: float
    flops_b: float
    traffic_f: int             # bytes read + written by the non-matmul ops
    traffic_b: int
    ops_f: int                 # operator calls of a forward / backward (their launch or dispatch overhead)
    ops_b: int
    coll_f: Dict[str, List[int]]   # collective -> bytes per call
    coll_b: Dict[str, List[int]]
    out_shape: tuple
    out_bytes: int


def _run_forward(chunk, x, y, is_last, side):
    if is_last:
        out = chunk(x, y, **side)
        return out[0] if isinstance(out, (tuple, list)) else out
    return chunk(x, **side)


def _cp_side(p3d, b: int, s: int, dev) -> dict:
    """A Hugging Face model under cp takes its shard's positions and the sequence's segment ids as side
    inputs: made by the same function ``Parallel3D`` cuts a batch with (the reference GPT needs none)."""
    from ..models.gpt import GPTConfig
    cp = getattr(p3d, "cp", 1)
    if cp == 1 or isinstance(p3d.config, GPTConfig):
        return {}
    from ..context_parallel.batch import shard_batch
    full = torch.zeros(b, s * cp, dtype=torch.long, device=dev)
    return shard_batch(full, None, {}, cp, 0)[2]


def sync_bytes(p3d) -> Dict[str, int]:
    """Bytes each data-parallel collective of a step moves on this rank: the gradient buffer reduced over
    dp (``all_reduce`` for ZeRO 0, ``reduce_scatter`` for 1, 2: its padded size), ZeRO-3's gather of every
    unit's parameters and reduce-scatter of their gradients (padded sizes), and the tied embedding's
    all-reduce between the first and last stage."""
    out: Dict[str, int] = {}
    dp = getattr(p3d.mode, "dp", None)
    if dp is not None:
        g = dp.buffer.grad_buffer
        out["all_reduce" if p3d.zero == 0 else "reduce_scatter"] = g.numel() * g.element_size()
    z = getattr(p3d.mode, "z", None)
    if z is not None:
        full = sum(u.padded for u in z.units) * z.shard_buffer.element_size()
        out["all_gather"] = full
        grad_size = torch.empty(0, dtype=z.grad_dtype).element_size()
        out["reduce_scatter"] = full * grad_size // z.shard_buffer.element_size()
    tied = getattr(p3d.mode, "tied", [])
    if tied and p3d.tied_group is not None:
        out["tied_all_reduce"] = sum(p.numel() * 4 for p in tied)
    return out


def microbatch_probe(p3d, b: int, s: int, hidden_shape: Optional[tuple]) -> List[ChunkCost]:
    """Every chunk of the rank, two micro-batches of ``b`` sequences of ``s`` tokens (this rank's share
    under cp) forward and backward each, on meta. ``hidden_shape``: (shape, dtype) of what stage 0 sends
    (None when this rank holds stage 0: it is found here)."""
    costs = []
    dev = next(p3d.model.parameters()).device       # meta when planning; a real device to check the probe itself
    side = _cp_side(p3d, b, s, dev)
    p3d.mode.begin_step()            # ZeRO-3 gathers its parameters here (outside the tally: held, not activations)
    import torch.fx.experimental._config as fx_config
    # nonzero on meta (the ignore-index rows of the loss): assume every row counts, the most memory
    with p3d.mode.accumulating(), fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        for chunk in p3d.chunks:
            is_first, is_last = bool(getattr(chunk, "is_first", False)), bool(getattr(chunk, "is_last", False))
            tally, flops = OpTally(), FlopTally(attention_flop_formulas())
            phases = []
            with fused_attention_on_meta(), flops, tally:
                for _mb in range(2):
                    for phase in ("F", "B"):
                        # what the last phase dropped in cycles is gone before we count (a full pass before a
                        # forward: a checkpointed backward leaves its recomputation's tensors to the collector)
                        gc.collect() if phase == "F" else gc.collect(0)
                        before_flops = flops.get_total_flops()
                        before_traffic, before_ops = tally.traffic, tally.ops
                        before_coll = {k: len(v) for k, v in tally.collectives.items()}
                        tally.reset_peak()
                        if phase == "F":
                            x = (torch.zeros(b, s, dtype=torch.long, device=dev) if is_first
                                 else torch.zeros(hidden_shape[0], dtype=hidden_shape[1], device=dev,
                                                  requires_grad=True))
                            y = torch.zeros(b, s, dtype=torch.long, device=dev)
                            start = tally.live
                            out = _run_forward(chunk, x, y, is_last, side)
                            del y
                            saved = tally.live - start
                            if not is_last:
                                shape = (tuple(out.shape), out.dtype)
                        else:
                            grad = None if is_last else torch.ones_like(out)
                            torch.autograd.backward(out, grad)
                            del out, grad, x
                            saved = None
                        coll = {k: v[before_coll.get(k, 0):] for k, v in tally.collectives.items()
                                if len(v) > before_coll.get(k, 0)}
                        phases.append(dict(peak=tally.peak - start, live=tally.live - start, saved=saved,
                                           flops=flops.get_total_flops() - before_flops,
                                           traffic=tally.traffic - before_traffic, coll=coll,
                                           ops=tally.ops - before_ops))
            f1, b1, f2, b2 = phases
            # what stays for the step: ZeRO-3's full gradients (autograd's .grad, held across micro-batches);
            # other stages' gradients live in the data-parallel buffers, counted with the rank's tensors.
            # (Read off the parameters themselves: the gradients are what stays, whatever else the tally saw.)
            persist = (held_bytes([q.grad for q in chunk.parameters() if q.grad is not None])
                       if p3d.zero == 3 else 0)
            if not is_last:
                hidden_shape = shape
            costs.append(ChunkCost(
                saved=f2["saved"], peak=max(f1["peak"], b1["peak"], f2["peak"] + persist, b2["peak"] + persist),
                persist=persist, flops_f=f2["flops"], flops_b=b2["flops"], traffic_f=f2["traffic"],
                traffic_b=b2["traffic"], ops_f=f2["ops"], ops_b=b2["ops"], coll_f=f2["coll"], coll_b=b2["coll"],
                out_shape=hidden_shape[0] if hidden_shape else (),
                out_bytes=(torch.Size(hidden_shape[0]).numel() * torch.empty(0, dtype=hidden_shape[1]).element_size()
                           if hidden_shape else 0)))
    return costs, hidden_shape


__all__ = ["fake_world", "build_rank", "static_terms", "sync_bytes", "microbatch_probe", "ChunkCost", "global_rank",
           "META"]
