"""``plan --calibrate`` on a GPU (``planner.calibrate_gpu``): the same measurements run on CPU tensors at tiny
shapes, so the profile it writes is checked here; the GPU run itself is gpu-check's planner-device step."""
import math

import torch

from parallel_layers.composition.layout import Layout
from parallel_layers.planner import Request, predict
from parallel_layers.planner.calibrate_gpu import calibrate_device, gemm_shapes, measure_rates
from parallel_layers.planner.hardware import Profile


def test_device_calibration_writes_a_curve_and_rates_the_planner_reads(tmp_path):
    torch.manual_seed(0)
    prof = calibrate_device(torch.device("cpu"), "smoke", name="cpu smoke")
    assert prof.measured and prof.name == "cpu smoke"
    curve = prof.gemm_curve["fp32"]
    assert len(curve) == 5 and all(math.isfinite(c) and c >= 0 for c in curve[1:])
    # an unknown device: its best measured rate stands for the peak, so no shape is above 100%
    assert prof.peak_flops["fp32"] >= prof.flops["fp32"] > 0
    assert 0 < prof.attention_efficiency and prof.mem_bw > 0 and prof.op_overhead > 0
    assert "the best rate measured here" in prof.notes
    path = tmp_path / "p.json"
    prof.save(str(path))
    again = Profile.from_json(__import__("json").loads(path.read_text()))
    assert again.gemm_curve == prof.gemm_curve
    from parallel_layers.models.gpt import GPTConfig
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_head=2, n_layer=2)
    req = Request(cfg, world=1, global_batch=2, seq_len=16, memory_bytes=1e12, precision="fp32")
    pred = predict(req, Layout(dp=1, tp=1, pp=1), again)
    assert pred.step_s > 0


def test_rates_cover_every_shape_and_vary_m():
    shapes = gemm_shapes("quick")
    assert len({m for m, _, _ in shapes}) == 2          # M varies: the curve's M term is measured
    rates = measure_rates(torch.device("cpu"), "smoke", reps=1)
    assert [s[:3] for s in rates["gemm"]["fp32"]] == gemm_shapes("smoke")
    assert all(r > 0 for *_, r in rates["gemm"]["fp32"]) and rates["attention"]
