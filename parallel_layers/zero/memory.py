"""Memory accounting for ZeRO: what a rank actually holds, and what the ZeRO paper says it should.

The ZeRO paper (Rajbhandari et al., 2020, section 5) counts, per parameter, in mixed-precision Adam:
2 bytes of fp16/bf16 parameters, 2 bytes of fp16/bf16 gradients and K = 12 bytes of optimizer state
(fp32 master weights, exp_avg, exp_avg_sq). With ``N_d`` data-parallel ranks:

========  ===========================  =================================
stage     per rank, bytes / parameter  what is divided by N_d
========  ===========================  =================================
0 (DP)    2 + 2 + 12                   nothing
1 (P_os)  2 + 2 + 12 / N_d             optimizer state
2 (+g)    2 + (2 + 12) / N_d           optimizer state and gradients
3 (+p)    (2 + 2 + 12) / N_d           everything
========  ===========================  =================================

Our layout differs from the paper's idealisation in ways the report makes visible instead of hiding:

* padding: every bucket is padded to a multiple of lcm(N_d, 64) elements, so "bytes per parameter" is
  measured against the *real* parameter count and is slightly above the formula on tiny models;
* gradients are accumulated in the DataParallel buffer's dtype (fp32 by default, Megatron's "main
  grads"), so a bf16 model holds 4-byte gradients, not 2, unless ``grad_dtype=bf16`` is chosen;
* a bf16/fp16 model needs a low-precision staging shard (the kernel's ``param_copy``, then all-gathered
  into the parameters): ``param_bytes / N_d`` more, reported as ``staging_bytes``;
* an fp32 model still gets a separate fp32 master shard (12 bytes / N_d of state, like the paper);
* the reduce-scatter writes each bucket's averaged shard straight into one flat fp32 tensor
  (``DataParallel.grad_shard``) that the optimizer steps on: stage 2 holds exactly ONE persistent copy of
  the rank's gradient shard (4 bytes / N_d with fp32 main grads); stage 1 holds it beside the full buffer;
  low-precision communication buffers exist only while a bucket is in flight (``comm_bytes`` is 0 between steps);
* stage 2 gives every bucket its own gradient memory, allocated when its first gradient of a backward
  lands and freed as soon as its reduce-scatter is done (DeepSpeed's ZeRO-2). During a synced backward a
  rank holds the shard plus at most ``max_buckets_in_flight + 2`` buckets (in flight, being filled, and a
  tied embedding's, whose LM-head share lands first): ``transient_grad_bytes`` is that bound, and
  ``backward_grad_bytes`` what the last backward held. Micro-batches under ``no_sync`` keep their buckets
  until the synced backward (one reduction per step): that peak is stage 1's.

So, with bf16 parameters and fp32 main grads, a stage-2 rank holds ``2 + (4 + 12 + 2) / N_d`` bytes per
parameter (params, grad shard, optimizer state, bf16 staging shard) between steps against the paper's
``2 + (2 + 12) / N_d``, and at the peak of a synced backward that plus the buckets above.

The report *measures* the tensors (distinct storages, so views are not double counted); the formulas
here are the independent expectation the tests compare it with.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

PAPER_PARAM_BYTES = 2
PAPER_GRAD_BYTES = 2
PAPER_K = 12


def paper_bytes_per_param(stage: int, dp_size: int, *, param_bytes: float = PAPER_PARAM_BYTES,
                          grad_bytes: float = PAPER_GRAD_BYTES, k: float = PAPER_K) -> Dict[str, float]:
    """The ZeRO paper's bytes per parameter held by one rank at ``stage`` (0-3) on ``dp_size`` ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"paper_bytes_per_param: stage={stage!r} must be 0, 1, 2 or 3")
    if dp_size < 1:
        raise ValueError(f"paper_bytes_per_param: dp_size={dp_size} must be >= 1")
    d = float(dp_size)
    out = {"params": param_bytes / (d if stage >= 3 else 1.0),
           "grads": grad_bytes / (d if stage >= 2 else 1.0),
           "optimizer": k / (d if stage >= 1 else 1.0)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def expected_bytes(stage: int, dp_size: int, padded_numel: int, *, param_dtype: torch.dtype,
                   grad_dtype: torch.dtype = torch.float32, comm_dtype: Optional[torch.dtype] = None,
                   n_buckets: int = 1, reduce_op: str = "reduce_scatter") -> Dict[str, int]:
    """Bytes a rank holds between steps with our layout (stages 1 and 2), from the padded buffer size.

    ``padded_numel`` is the sum of the (padded) bucket sizes; it divides by ``dp_size``. Keys match
    ``ZeroOptimizer.memory_report()``. ``comm_dtype`` does not change anything between steps (its buffers
    are transient); it is accepted so callers can pass their DataParallel settings as they are.
    """
    if stage not in (1, 2):
        raise ValueError(f"expected_bytes: stage={stage!r}; ZeroOptimizer implements stages 1 and 2")
    if padded_numel % dp_size:
        raise ValueError(f"expected_bytes: padded_numel={padded_numel} does not divide by dp_size={dp_size}")
    shard = padded_numel // dp_size

    def size(dt):
        return torch.empty(0, dtype=dt).element_size()

    if reduce_op not in ("reduce_scatter", "all_reduce") or (stage == 2 and reduce_op != "reduce_scatter"):
        raise ValueError(f"expected_bytes: reduce_op={reduce_op!r} with stage {stage}; stage 2 uses "
                         f"'reduce_scatter', stage 1 'reduce_scatter' or 'all_reduce'")
    pb, gb = size(param_dtype), size(grad_dtype)
    low = param_dtype != torch.float32
    scattered = reduce_op == "reduce_scatter"
    out = {"param_bytes": padded_numel * pb,
           # the reduced fp32 shard (one copy) + stage 1's full buffer
           "grad_bytes": (shard * 4 if scattered else 0) + (padded_numel * gb if stage == 1 else 0),
           "comm_bytes": 0,                                                   # transient: launch to wait
           "optimizer_bytes": 3 * 4 * shard,                                  # master, exp_avg, exp_avg_sq
           "staging_bytes": (shard * pb if low else 0) + (shard * 4 if not scattered and n_buckets > 1 else 0)}
    out["total_bytes"] = sum(out.values())
    return out


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        key = (st.data_ptr(), t.device)
        if key in seen or st.nbytes() == 0:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


def format_report(rows: List[Dict[str, object]]) -> str:
    """A fixed-width table of ``memory_report()`` dicts (one row each): ours vs the paper, bytes/param."""
    head = (f"{'stage':>5} {'dp':>3} {'params':>10} {'ours p/g/comm/os/staging B/param':>34} "
            f"{'ours total':>10} {'paper p/g/os':>20} {'paper total':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        b, p = r["bytes_per_param"], r["paper_bytes_per_param"]
        ours = f"{b['params']:.2f}/{b['grads']:.2f}/{b['comm']:.2f}/{b['optimizer']:.2f}/{b['staging']:.2f}"
        paper = f"{p['params']:.2f}/{p['grads']:.2f}/{p['optimizer']:.2f}"
        lines.append(f"{r['stage']:>5} {r['dp_size']:>3} {r['num_params']:>10} {ours:>34} "
                     f"{b['total']:>10.2f} {paper:>20} {p['total']:>11.2f}")
    return "\n".join(lines)


__all__ = ["paper_bytes_per_param", "expected_bytes", "storage_bytes", "format_report"]
