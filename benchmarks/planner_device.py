"""The layout planner on one GPU: predicted against measured peak memory and step time (issue 33's check
where the allocator's count is exact and the time model meets real kernels).

    python -m benchmarks.planner_device --quick --csv PATH   # on a GPU (make gpu-check runs this)
    python -m benchmarks.planner_device --smoke              # tiny, on CPU: the same code path, no CSV

One process, a 1-rank process group (NCCL on a GPU, gloo on CPU), the reference GPT under ``Parallel3D`` in
bf16 (fp32 master weights, fused AdamW), layouts of one rank (micro-batches, checkpointing, ZeRO 1 and 2).

* predicted: ``parallel_layers.planner.predict`` (the package's own code on the meta device) for the same
  request and layout, with two profiles: the built-in data-sheet one of the GPU (``h100``: 50% of the bf16
  peak, 70% of HBM bandwidth), and one calibrated here: this GPU's measured bf16 matmul rate at the model's
  shape, copy bandwidth and per-operator time; and a third, what ``plan --calibrate`` writes on a GPU
  (``planner.calibrate_gpu``: the matmul curve over projection shapes, attention, copy and per-op time).
* measured: memory, ``torch.cuda.max_memory_allocated`` over a step after a warm-up step, above what the
  process held before the model was built (on CPU: the planner's own ``measure`` accounting); time, the
  median of the timed steps, each ending in a device synchronisation.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

import torch

from parallel_layers.planner.calibrate import op_overhead
from parallel_layers.planner.calibrate_gpu import calibrate_device

from . import harness

CSV_PATH = os.path.join(harness.RESULTS_DIR, "planner_device.csv")
PROFILES = {
    "quick": dict(gpts=[dict(vocab_size=50304, n_layer=12, d_model=768, n_head=12),
                        dict(vocab_size=50304, n_layer=24, d_model=1024, n_head=16),
                        dict(vocab_size=50304, n_layer=24, d_model=2048, n_head=16)],
                  batch=8, seq=1024, steps=5),
    "smoke": dict(gpts=[dict(vocab_size=256, n_layer=2, d_model=64, n_head=4)], batch=4, seq=32, steps=2),
}
PROFILES["full"] = PROFILES["quick"]


def sheet_for(device: torch.device) -> str:
    """The built-in data-sheet profile of this GPU (h200, a100, else h100); a100 for the CPU smoke run."""
    name = torch.cuda.get_device_name(device).upper() if device.type == "cuda" else "A100"
    return next((p for p in ("h200", "a100") if p.upper() in name), "h100")


def layouts():
    from parallel_layers.composition.layout import Layout
    # bf16 needs the fp32 master weights of ZeRO 1 or 2 (Parallel3D refuses bf16 at stage 0 and 3)
    return [Layout(zero=1, num_microbatches=1), Layout(zero=1, num_microbatches=2),
            Layout(zero=1, num_microbatches=1, checkpoint=True), Layout(zero=2, num_microbatches=1)]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device, reps: int) -> float:
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def calibrated_profile(base, device: torch.device, rows: int, d_model: int, dtype=torch.bfloat16):
    """``base`` with this device's measured matmul rate (a block's first MLP matmul, [rows, d] x [d, 4d]),
    copy bandwidth and seconds per operator call."""
    a = torch.randn(rows, d_model, dtype=dtype, device=device)
    w = torch.randn(d_model, 4 * d_model, dtype=dtype, device=device)
    rate = 2 * rows * d_model * 4 * d_model / _median_s(lambda: a @ w, device, 10)
    bw = harness.copy_bandwidth(device) * 1e9
    per_op = op_overhead(device=device)
    prec = "bf16" if dtype == torch.bfloat16 else "fp32"
    return dataclasses.replace(base, name=f"{harness.device_name(device)} (measured here)",
                               flops=dict(base.flops, **{prec: rate}), mem_bw=bw, op_overhead=per_op,
                               fragmentation=0.0, measured=True, async_dispatch=device.type == "cuda",
                               notes=f"bf16 matmul {rate / 1e12:.0f} TFLOP/s at [{rows}x{d_model}]x[{d_model}x"
                                     f"{4 * d_model}], copy {bw / 1e9:.0f} GB/s, {per_op * 1e6:.1f} us per op")


def measure(cfg, layout, device: torch.device, batch, steps: int, dtype=torch.bfloat16) -> dict:
    """Peak bytes of one step (after a warm-up step) above what the process held before, and the median
    step time, of ``layout`` on the 1-rank group already initialised."""
    from parallel_layers.composition.config import PrecisionConfig
    from parallel_layers.composition.parallel3d import Parallel3D
    from parallel_layers.mesh import ParallelMesh
    from parallel_layers.planner.measure import live_tensor_bytes, step_growth
    x, y = batch
    harness.free_memory(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else live_tensor_bytes()
    torch.manual_seed(0)
    p3d = Parallel3D(cfg, ParallelMesh(dp=1, tp=1, pp=1), device=device,
                     precision=PrecisionConfig(dtype=dtype), **layout.parallel3d_kwargs())
    p3d.train_step(x, y)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        p3d.train_step(x, y)
        _sync(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        start = live_tensor_bytes() - before
        peak = start + step_growth(lambda: p3d.train_step(x, y))
    step = _median_s(lambda: p3d.train_step(x, y), device, steps)
    p3d = None                           # dropped before the next layout is built
    harness.free_memory(device)
    return dict(peak_bytes=peak, step_s=step)


def collect(mode: str, device: torch.device, progress: Optional[Callable[[str], None]] = None) -> List[dict]:
    import torch.distributed as dist

    from parallel_layers.models.gpt import GPTConfig
    from parallel_layers.planner import Request, load_profile, predict
    from parallel_layers.testing.workers import free_port
    prof = PROFILES[mode]
    b, s = prof["batch"], prof["seq"]
    gpu = device.type == "cuda"
    sheet = load_profile(sheet_for(device))
    cases, calibrated = [], {}
    if progress:
        progress("calibrating as plan --calibrate does (matmul curve, attention, copy, per-op)")
    whole = calibrate_device(device, "quick" if gpu else "smoke")
    for size in prof["gpts"]:
        cfg = GPTConfig(max_seq_len=s, **size)
        for layout in layouts():
            req = Request(cfg, world=1, global_batch=b, seq_len=s, memory_bytes=1e15, precision="bf16")
            key = (cfg.d_model, b * s // layout.num_microbatches)
            if key not in calibrated:
                if progress:
                    progress(f"calibrating at d {key[0]}, {key[1]} rows")
                calibrated[key] = calibrated_profile(sheet, device, key[1], key[0])
            cases.append((cfg, layout, req, calibrated[key]))
    harness.free_memory(device)
    preds = []
    for _cfg, layout, req, cal in cases:     # before the real group: the planner plays its own (fake) world
        if progress:
            progress(f"predicting {req.describe_model()} {layout.name()}")
        cache: dict = {}
        preds.append((predict(req, layout, sheet, cache), predict(req, layout, cal, cache),
                      predict(req, layout, whole, cache)))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    if gpu:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows, common = [], dict(harness.common_fields(mode, device, torch.get_num_threads()), dtype="bf16",
                            backend="nccl" if gpu else "gloo")
    try:
        for (cfg, layout, req, _cal), (p_sheet, p_cal, p_whole) in zip(cases, preds):
            label = f"{req.describe_model()} b{b} s{s} {layout.name()}"
            if progress:
                progress(f"measuring {label}")
            gen = torch.Generator().manual_seed(1)
            x = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(device)
            y = torch.randint(0, cfg.vocab_size, (b, s), generator=gen).to(device)
            got = measure(cfg, layout, device, (x, y), prof["steps"])
            rows += _rows(common, label, p_sheet, p_cal, p_whole, got)
    finally:
        dist.destroy_process_group()
    rows += summary_rows(common, rows)
    for (d_model, m_rows), cal in calibrated.items():      # what the calibrated predictions used
        rows.append(dict(common, case="planner_device_profile", sizes=f"d {d_model}, {m_rows} rows",
                         x=cal.flops["bf16"] / 1e12, gbps=cal.mem_bw / 1e9, baseline=cal.notes))
    rows.append(dict(common, case="planner_device_profile", sizes="plan --calibrate",
                     x=whole.matmul_rate("bf16") / 1e12, gbps=whole.mem_bw / 1e9,
                     baseline=f"{whole.notes}; curve {whole.gemm_curve}"))
    return rows


def _rows(common, label, pred_sheet, pred_cal, pred_whole, got) -> List[dict]:
    pred_mem = sum(pred_sheet.memory[0].values())
    mem_err = (pred_mem - got["peak_bytes"]) / got["peak_bytes"]
    out = [dict(common, case="planner_device_memory", sizes=label, mem_mb=got["peak_bytes"] / 2**20,
                x=pred_mem / 2**20,
                baseline=f"predicted {pred_mem / 2**20:.0f} MiB ({mem_err:+.1%}); measured "
                         f"max_memory_allocated {got['peak_bytes'] / 2**20:.0f} MiB")]
    for name, pred in (("data sheet", pred_sheet), ("calibrated", pred_cal), ("plan --calibrate", pred_whole)):
        err = (pred.step_s - got["step_s"]) / got["step_s"]
        out.append(dict(common, case="planner_device_time", sizes=f"{label} [{name}]",
                        ours_median_ms=got["step_s"] * 1e3, base_median_ms=pred.step_s * 1e3,
                        baseline=f"predicted {pred.step_s * 1e3:.1f} ms ({err:+.0%}) with the {name} profile"))
    print(f"{label:44s} memory {got['peak_bytes'] / 2**20:8.0f} MiB, predicted {pred_mem / 2**20:8.0f} "
          f"({mem_err:+.1%}) | step {got['step_s'] * 1e3:8.1f} ms, predicted {pred_sheet.step_s * 1e3:8.1f} "
          f"(sheet) {pred_cal.step_s * 1e3:8.1f} (calibrated) {pred_whole.step_s * 1e3:8.1f} (plan --calibrate)",
          flush=True)
    return out


def summary_rows(common, rows) -> List[dict]:
    """Median and worst memory error; per profile the time error and Spearman's rank correlation."""
    from .planner import spearman
    mem = [abs(r["x"] - r["mem_mb"]) / r["mem_mb"] for r in rows if r["case"] == "planner_device_memory"]
    where = "1 GPU" if common.get("backend") == "nccl" else "1 CPU process"
    out = [dict(common, case="planner_device_memory_error", sizes=f"{len(mem)} layouts, {where}",
                x=statistics.median(mem), target="median <= 5%, worst <= 15%",
                met=bool(statistics.median(mem) <= 0.05 and max(mem) <= 0.15),
                baseline=f"median |error| {statistics.median(mem):.1%}, worst {max(mem):.1%}")]
    for name in ("data sheet", "calibrated", "plan --calibrate"):
        t = [r for r in rows if r["case"] == "planner_device_time" and r["sizes"].endswith(f"[{name}]")]
        pred, meas = [r["base_median_ms"] for r in t], [r["ours_median_ms"] for r in t]
        rho = spearman(pred, meas) if len(t) > 1 else float("nan")
        med = statistics.median(abs(p - m) / m for p, m in zip(pred, meas))
        out.append(dict(common, case="planner_device_time_rank", sizes=f"{len(t)} layouts, {where} [{name}]", x=rho,
                        target="Spearman >= 0.8, median error <= 20%", met=bool(rho >= 0.8 and med <= 0.2),
                        baseline=f"Spearman {rho:.2f}; median |error| {med:.0%}"))
    for r in out:
        print(f"{r['case']} {r['sizes']}: {r['baseline']}", flush=True)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.planner_device", description=__doc__.split("\n")[0])
    harness.add_profile_args(ap, smoke_help="tiny GPT on CPU (or the GPU); never writes CSV",
                             quick_help="GPT 124M, 350M and 1.3B, b 8, s 1024")
    harness.add_csv_args(ap, CSV_PATH)
    args = ap.parse_args(argv)
    mode = harness.profile_of(args)
    # an indexed device: torch.cuda.set_device and NCCL's device_id refuse a bare "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu" and mode != "smoke":
        print("no CUDA device: this check compares the planner with one GPU's allocator and clock; on CPU run "
              "--smoke (the same code path) or python -m benchmarks.planner (gloo ranks)")
        return 0
    rows = collect(mode, device, progress=lambda what: print(what, file=sys.stderr, flush=True))
    harness.append_and_report(rows, harness.csv_target(args, args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
