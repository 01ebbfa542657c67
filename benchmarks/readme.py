"""Regenerate the tables of benchmarks/README.md (and the PNGs it shows) from the CSVs under benchmarks/results/.

    python -m benchmarks.readme          # redraws the plots, rewrites the text between the BENCHMARKS markers
    python -m parallel_layers bench --quick --readme     # measure first, then the same

Nothing between the markers is typed by hand: for each CSV and device, the newest row of every case from
the most complete mode (full, else quick) is turned into a table, with the machine, versions, date and
the command that measured it, and every missed target is listed plainly.
"""
from __future__ import annotations

import os
import sys
from typing import Dict, List

from .harness import latest_rows, read_csv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "benchmarks", "README.md")
BEGIN, END = "<!-- BENCHMARKS:BEGIN -->", "<!-- BENCHMARKS:END -->"


BENCH = "python -m parallel_layers bench"
SECTIONS = [("kernels.csv", "Fused kernels", f"{BENCH} --only kernels"),
            ("tp.csv", "Tensor parallel (2 ranks)", f"{BENCH} --only tp"),
            ("dp.csv", "Data parallel", f"{BENCH} --only dp"),
            ("zero_offload.csv", "ZeRO-Infinity: optimizer state on disk", f"{BENCH} --only zero"),
            ("cpu_adam.csv", "CPU AdamW (the ZeRO-Offload step) against torch's", f"{BENCH} --only zero"),
            ("parameter_server.csv", "Parameter servers against the ring all-reduce", f"{BENCH} --only dp"),
            ("zero.csv", "ZeRO", f"{BENCH} --only zero"),
            ("pipeline.csv", "Pipeline", f"{BENCH} --only pipeline"),
            ("demo.csv", "Demo layouts, 8 processes on 2 cores (ours ms = step time)", f"{BENCH} --only demo"),
            ("replica_check.csv", "Replica check: checksum bandwidth, a step checked every step against none",
             f"{BENCH} --only demo"),
            ("freeze_training.csv", "Freeze training (PipeTransformer): time to the same loss", f"{BENCH} --only demo"),
            ("torch_native_3d.csv", "Llama dp2 x tp2 x pp2 against FSDP2 + DTensor + torch pipelining",
             f"{BENCH} --only demo"),
            ("matmul.csv", "Fused matmul epilogue (GPU)", f"{BENCH} --only kernels"),
            ("moe_kernels.csv", "MoE routing kernels: router top-k, permute / unpermute, grouped GEMM",
             f"{BENCH} --only kernels"),
            ("fp8_cast.csv", "FP8 casts (amax, transpose, blockwise scales) against torch's ops",
             f"{BENCH} --only kernels"),
            ("dispatch.csv", "Dispatch tax: host time per call of every op and TP layer against its torch code "
             "(tiny tensors, 1 thread)", f"{BENCH} --only kernels"),
            ("fp8_layers.csv", "FP8Linear training step (4 recipes) and fp32 against bf16 nn.Linear, saved bytes",
             f"{BENCH} --only kernels"),
            ("fp8_convergence.csv", "FP8 training (4 recipes) against bf16 and fp32: losses over 200 steps",
             f"{BENCH} --only fp8"),
            ("moe.csv", "Mixture of experts: block step at ep 1/2/4, all-to-all bytes, load balance",
             f"{BENCH} --only moe"),
            ("context_parallel.csv", "Context parallelism: activation memory and step time against cp 1 (Llama)",
             f"{BENCH} --only cp"),
            ("single_process_dp.csv", "Single-process multi-device data parallelism: five exchanges against one",
             f"{BENCH} --only dp"),
            ("checkpoint_policy.csv", "Activation checkpoint placement, partitioned and offloaded checkpoint inputs",
             f"{BENCH} --only pipeline"),
            ("checkpoint.csv", "Checkpoints: time lost per save, asynchronous against synchronous",
             f"{BENCH} --only resilience"),
            ("planner.csv", "Layout planner: predicted against measured memory and step time (26 layouts, 2-8 ranks)",
             f"{BENCH} --only plan"),
            ("planner_device.csv", "Layout planner on one GPU: predicted against measured peak memory and step time",
             "python -m benchmarks.planner_device --quick"),
            ("host_offload.csv", "ZeRO-Offload on a GPU: optimizer state in host memory against in GPU memory",
             "python -m benchmarks.host_offload --quick")]
SCALING = ("scaling.csv", "Scaling curves", f"{BENCH} --only scaling")
PLOTS = [("ratios.png", "every case against its baseline"),
         ("speedup.png", "kernel speedup per backend"),
         ("bandwidth_fraction.png", "kernel bandwidth as a fraction of the copy bandwidth"),
         ("scaling_world.png", "step time and per-rank memory against world size"),
         ("scaling_model.png", "step time and per-rank memory against model size"),
         ("scaling_elements.png", "kernel time against element count")]


def met_text(value: str) -> str:
    """Benchmarks write yes/no or True/False; the tables say yes/no."""
    return {"true": "yes", "false": "no"}.get((value or "").lower(), value or "-")


def fmt(value: str, digits: int = 3) -> str:
    try:
        return f"{float(value):.{digits}g}"
    except (TypeError, ValueError):
        return value or "-"


def _header(title: str, command: str, device: str, run: List[Dict[str, str]]) -> List[str]:
    r0 = run[0]
    dates = sorted({r["date"][:16].replace("T", " ") for r in run})
    copy = {r.get("copy_gbps") for r in run if r.get("copy_gbps")}
    return [f"#### {title}: {device}", "",
            f"torch {r0['torch']}, triton {r0['triton']}, {r0['threads']} thread(s) per process, "
            f"{r0['mode']} sizes, measured {', '.join(dates)} UTC by `{command}`."
            + (f" Copy bandwidth measured in the same run: {', '.join(fmt(c) for c in sorted(copy))} GB/s."
               if copy else ""), ""]


def missed_in(run: List[Dict[str, str]]) -> List[str]:
    return [f"{r['case']} {r['sizes']} ({r['backend']})" for r in run if met_text(r.get("met")) == "no"]


def render_section(title: str, command: str, per_device: Dict[str, List[Dict[str, str]]]) -> List[str]:
    out = []
    for device, run in per_device.items():
        out += _header(title, command, device, run)
        out.append("| case | sizes | dtype | backend | ours ms | baseline | baseline ms | speedup | GB/s | "
                   "of copy BW | target | met |")
        out.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in run:
            ratio = fmt(r['speedup']) + 'x' if r.get('speedup') else '-'
            out.append(f"| {r['case']} | {r['sizes']} | {r['dtype']} | {r['backend']} | {fmt(r['ours_median_ms'])} "
                       f"| {r['baseline']} | {fmt(r['base_median_ms'])} | {ratio} "
                       f"| {fmt(r.get('gbps', ''))} | {fmt(r.get('bw_fraction', ''), 2)} | {r['target'] or '-'} "
                       f"| {met_text(r['met'])} |")
        missed = missed_in(run)
        out.append("")
        out.append("Targets missed: " + (", ".join(missed) if missed else "none") + ".")
        out.append("")
    return out


def render_scaling(title: str, command: str, per_device: Dict[str, List[Dict[str, str]]]) -> List[str]:
    """Scaling rows have no target: the curve is the result. x is the swept quantity (world size,
    parameter count, element count); memory is per rank. The baseline column keeps the baseline's name
    (the text before the first ';'); the details stay in the CSV."""
    out = []
    for device, run in per_device.items():
        out += _header(title, command, device, run)
        out.append("| case | x | sizes | ours ms (p20-p80) | MB per rank | baseline | baseline ms | speedup "
                   "| of copy BW |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in sorted(run, key=lambda r: (r["case"], float(r.get("x") or 0))):
            out.append(f"| {r['case']} | {fmt(r.get('x', ''))} | {r['sizes']} | {fmt(r['ours_median_ms'])} "
                       f"({fmt(r['ours_p20_ms'])}-{fmt(r['ours_p80_ms'])}) | {fmt(r.get('mem_mb', ''))} "
                       f"| {(r['baseline'] or '-').split(';')[0]} | {fmt(r['base_median_ms'])} "
                       f"| {fmt(r['speedup']) + 'x' if r.get('speedup') else '-'} "
                       f"| {fmt(r.get('bw_fraction', ''), 2)} |")
        out.append("")
    return out


def render(results: str = os.path.join(ROOT, "benchmarks", "results")) -> str:
    body, machines, all_missed = [], set(), []
    def on_paper(r):        # the planner's --published rows: a run of their own, rendered as their own table
        return r.get("case", "").startswith("planner_published")

    published = [r for r in read_csv(os.path.join(results, "planner.csv")) if on_paper(r)]
    for name, title, command in SECTIONS:
        per_device = latest_rows([r for r in read_csv(os.path.join(results, name)) if not on_paper(r)])
        for device, run in per_device.items():
            machines.add(device)
            all_missed += [f"{title} on {device}: {m}" for m in missed_in(run)]
        body += render_section(title, command, per_device)
    scaling = latest_rows(read_csv(os.path.join(results, SCALING[0])))
    machines.update(scaling)
    body += render_scaling(SCALING[1], SCALING[2], scaling)
    if published:
        from .planner import render_published
        body += ["#### Layout planner at scale, on paper: Narayanan et al. 2021 (Megatron-LM), Table 1", "",
                 "Computed by `python -m benchmarks.planner --published` (`--quick`: their layouts only; the full "
                 "mode adds the planner's own search over tp x pp meshes and where it ranks their layout: 129 s for "
                 "the ten runs on the 2-core Intel Xeon, 2026-11-30); nothing is timed.", ""]
        body += render_published(published)
    if not body:
        return "(no results yet: run `make bench`, then `python -m benchmarks.readme`)"
    gpu = any(any(k in m for k in ("NVIDIA", "H100", "H200", "A100", "AMD Instinct")) for m in machines)
    out = [f"Machines measured: {'; '.join(sorted(machines))}."
           + ("" if gpu else " No GPU results under benchmarks/results/ yet: the CUDA and Triton GPU "
                             "backends are compile-checked and tested, not timed."),
           "",
           "Speedup = baseline time / our time (median of the timed repetitions, ours and the baseline "
           "back to back in one run; above 1 means ours is faster). Bandwidth as a fraction of the copy "
           "bandwidth measured in the same run.",
           "",
           f"**Targets missed ({len(all_missed)}):**" if all_missed else "**Targets missed: none.**", ""]
    out += [f"- {m}" for m in all_missed] + ([""] if all_missed else [])
    out += body
    for png, caption in PLOTS:
        if os.path.exists(os.path.join(results, png)):
            out.append(f"![{caption}](results/{png})")   # relative to benchmarks/README.md
    return "\n".join(out).rstrip()


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__.split("\n")[0])
    ap.add_argument("--no-plots", action="store_true", help="do not redraw the PNGs first")
    ap.add_argument("--quiet", action="store_true", help="do not print the section")
    args = ap.parse_args(argv)
    text = open(README).read()
    if BEGIN not in text or END not in text:
        print(f"{os.path.relpath(README)} has no {BEGIN} ... {END} section", file=sys.stderr)
        return 1
    if not args.no_plots:
        from . import plots
        plots.draw_all()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    section = render()
    with open(README, "w") as fh:
        fh.write(head + BEGIN + "\n" + section + "\n" + END + tail)
    if not args.quiet:
        print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
