"""Context parallelism: activation memory per rank and step time against cp 1, on a small Llama.

For each sequence length ``S`` and ``cp`` in 1, 2, 4, fresh gloo ranks train one step of a Hugging Face
``LlamaForCausalLM`` through ``Parallel3D`` on a mesh of ``cp`` ranks (batch 1, ring attention; at cp 1
transformers' own SDPA attention, what a user runs without cp). Measured on every rank, the largest
reported:

- **saved activations**: the bytes autograd keeps for backward during the step, counted exactly with
  ``torch.autograd.graph.saved_tensors_hooks`` (each storage once);
- **peak RSS**: the process's high-water mark over the step (``/proc/self/status`` VmHWM, reset before);
- **step time**: the slowest rank's, median over the repetitions.

Rows compare each cp with cp 1 at the same ``S`` (same global batch). Targets: saved activations per rank
<= 0.55x (cp 2) and <= 0.3x (cp 4) of cp 1's. The longest-sequence row reads off the same grid: the
per-rank peak memory cp 1 needs at its longest ``S``, and the longest ``S`` cp 4 trains within it (cp 4
also runs at the longer lengths of the profile for it).

torch's own ``context_parallel`` (``torch.distributed.tensor.experimental``) is tried on this machine's
CPU in the same processes; its row says what happened. On 2 cores, cp 4 runs 4 ranks on 2 cores: step
times there measure contention as much as the method.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from . import harness

CSV_NAME = "context_parallel.csv"
CSV_PATH = os.path.join(harness.RESULTS_DIR, CSV_NAME)
MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)
PROFILES = {   # seqs x cps, then ``longer``: cp 4 alone past cp 1's longest (the longest-sequence row)
    "full": dict(seqs=[4096, 8192], cps=[1, 2, 4], longer=[16384, 28672, 32768], reps=3, model=MODEL),
    "quick": dict(seqs=[2048, 4096], cps=[1, 2, 4], longer=[8192, 14336, 16384], reps=2, model=MODEL),
    "smoke": dict(seqs=[64], cps=[1, 2], longer=[], reps=1, model=dict(MODEL, hidden_size=32, intermediate_size=64)),
}


def _rank(rank, world, seq, model_size, reps, try_torch):
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallel_layers.composition.config import DataParallelConfig, OptimizerConfig, PipelineConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model_size, max_position_embeddings=seq, tie_word_embeddings=False))
    model.config._attn_implementation = "sdpa"
    mesh = ParallelMesh(dp=1, cp=world)
    p3d = Parallel3D(model, mesh, optimizer=OptimizerConfig(lr=1e-4, max_grad_norm=1.0),
                     pipeline=PipelineConfig(num_microbatches=1), data_parallel=DataParallelConfig(zero=1))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model_size["vocab_size"], (1, seq + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    p3d.train_step(x, y)                                  # warm-up: buffers, optimizer state
    saved: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    harness.reset_peak_rss()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        p3d.train_step(x, y)
    peak_mb = harness.status_mb("VmHWM")
    times = [harness.slowest_rank_ms(lambda: p3d.train_step(x, y)) for _ in range(reps)]
    out = {"saved_mb": sum(saved.values()) / 2 ** 20, "peak_mb": peak_mb, "ms": times}
    if try_torch:
        out["torch"] = _try_torch_context_parallel(world, seq, F)
    return out


def _try_torch_context_parallel(world, seq, F):
    """torch's ring attention over SDPA on this device: ``"ok <ms>"`` or why it did not run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        q, k, v = (torch.randn(1, 4, seq, 32, requires_grad=True) for _ in range(3))
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.sum().backward()
        return f"ran: attention forward+backward {1e3 * (time.perf_counter() - t0):.0f} ms"
    except Exception as exc:  # noqa: BLE001 - the outcome is the finding
        return f"does not run on CPU: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def collect(profile: str, device: Optional[torch.device] = None,
            progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    """The rows of one run (``device`` is ignored: the ranks run on CPU over gloo)."""
    p = PROFILES[profile]
    common = harness.common_fields(profile, torch.device("cpu"), torch.get_num_threads())
    res = {}
    grid = [(seq, cp) for seq in p["seqs"] for cp in p["cps"]] + [(seq, max(p["cps"])) for seq in p["longer"]]
    for seq, cp in grid:
        if progress is not None:
            progress(f"S={seq} cp={cp}")
        outs = harness.run_ranks(_rank, cp, (seq, p["model"], p["reps"], cp == 2 and seq == p["seqs"][0]))
        res[(seq, cp)] = {"saved_mb": max(o["saved_mb"] for o in outs), "peak_mb": max(o["peak_mb"] for o in outs),
                          "ms": outs[0]["ms"], "torch": outs[0].get("torch")}
    rows = []
    for (seq, cp), r in res.items():
        base = res.get((seq, 1))
        if base is None:          # past cp 1's longest: read by the longest-sequence row
            rows.append(dict(common, case=f"llama S={seq} cp={cp}", sizes=f"S={seq}", ours_median_ms=min(r["ms"]),
                             saved_mb=round(r["saved_mb"], 1), peak_rss_mb=round(r["peak_mb"], 1),
                             baseline=f"saved activations {r['saved_mb']:.1f} MB, peak RSS {r['peak_mb']:.0f} MB "
                                      f"per rank (cp=1 not run at this length)"))
            continue
        target = {2: 0.55, 4: 0.3}.get(cp)
        ratio = r["saved_mb"] / base["saved_mb"]
        row = harness.comparison_row(
            common, f"llama S={seq} cp={cp} vs cp=1", r["ms"], base["ms"], sizes=f"S={seq}",
            saved_mb=round(r["saved_mb"], 1), saved_ratio=round(ratio, 3), peak_rss_mb=round(r["peak_mb"], 1),
            base_saved_mb=round(base["saved_mb"], 1), base_peak_rss_mb=round(base["peak_mb"], 1),
            target="" if target is None else f"saved<={target}x", met="" if target is None else
            ("yes" if ratio <= target else "no"),
            baseline=f"saved activations {r['saved_mb']:.1f} vs {base['saved_mb']:.1f} MB ({ratio:.2f}x), peak RSS "
                     f"{r['peak_mb']:.0f} vs {base['peak_mb']:.0f} MB per rank")
        rows.append(row)
        if r["torch"] is not None:
            rows.append(dict(common, case=f"torch context_parallel S={seq} cp={cp}", sizes=f"S={seq}",
                             baseline=r["torch"]))
    cps = sorted({cp for _, cp in res})
    if 1 in cps and max(cps) > 1:
        top = max(cps)
        s1 = max(s for s, c in res if c == 1)
        budget = res[(s1, 1)]["peak_mb"]
        fits = [s for s, c in res if c == top and res[(s, c)]["peak_mb"] <= budget]
        longest = max(fits) if fits else None
        rows.append(dict(common, case="longest S within cp=1's per-rank peak at its longest S",
                         sizes=f"cp={top}", target="cp4/cp1>=3.5",
                         met="" if longest is None else ("yes" if longest / s1 >= 3.5 else "no"),
                         baseline=f"cp={top}: {longest} tokens ({'-' if longest is None else f'{longest / s1:.1f}x'}"
                                  f" cp=1's {s1}) within {budget:.0f} MB/rank, cp=1's peak at S={s1}, on the "
                                  f"measured grid {sorted({s for s, _ in res})}"))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_profile_args(parser, "tiny sizes; never writes CSV", "2k and 4k tokens (a few minutes)")
    harness.add_csv_args(parser, CSV_PATH)
    args = parser.parse_args(argv)
    harness.print_and_append(collect(harness.profile_of(args)), harness.csv_target(args, args.csv))


if __name__ == "__main__":
    sys.exit(main())
