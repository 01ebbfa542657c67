"""The CPU calibration's per-operator-kind rates (issue 50, item 4) and the step tail the planner now charges.

* ``step_tail_ops``: the reduction and optimizer step after the last backward, counted on meta: torch's AdamW
  (ZeRO 0) steps parameter by parameter, the package's ZeRO optimizers a flat buffer; nothing left on the model.
* ``step_rates``: a training step's per-call and per-byte cost fitted on the reference GPT: positive, and the
  fit reproduces the runs it was fitted on.
* ``calibrate``: the profile carries the fp32 GEMM curve, attention's efficiency and the oversubscription
  exponent, and survives its JSON file.
"""
import pytest
import torch

from parallel_layers.composition.layout import Layout
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import Request
from parallel_layers.planner.calibrate import step_rates
from parallel_layers.planner.calibrate_gpu import attention_shapes, gemm_shapes
from parallel_layers.planner.hardware import Profile, load_profile
from parallel_layers.planner.probe import build_rank, fake_world, global_rank, static_terms, step_tail_ops


def _tail(zero: int):
    layout = Layout(dp=2, zero=zero, num_microbatches=1)
    req = Request(GPTConfig(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=32), world=2,
                  global_batch=4, seq_len=32, memory_bytes=1e12)
    with fake_world(global_rank(layout, 0), layout.world):
        p3d = build_rank(req, layout, 0)
        static_terms(p3d)
        ops = step_tail_ops(p3d)
        params = [p for g in p3d.optimizer.param_groups for p in g["params"]]
        left = [p for p in params if p.grad is not None]
    return ops, len(params), left


def test_step_tail_counts_torchs_adamw_per_parameter_and_leaves_no_gradients():
    ops, n_params, left = _tail(0)
    assert ops >= 5 * n_params, (ops, n_params)          # torch's single-tensor AdamW: ~10 calls a parameter
    assert not left
    flat_ops, _, left = _tail(1)
    assert flat_ops == 0, flat_ops                        # ZeRO-1: a flat fused step, not counted
    assert not left


def test_cpu_shapes_are_small_model_projections():
    shapes = gemm_shapes("cpu")
    assert len(shapes) >= 20 and all(m <= 2048 and n <= 2048 and k <= 2048 for m, n, k in shapes)
    assert all(s <= 512 for _b, _h, s, _d in attention_shapes("cpu"))


def test_step_rates_fit_the_runs_they_are_fitted_on():
    torch.set_num_threads(1)
    prof = load_profile("h100")
    cpu = Profile(name="cpu", flops={"fp32": 5e10}, peak_flops={"fp32": 5e10}, mem_bw=1e10, intra=prof.intra,
                  inter=prof.inter)
    sizes = ((1, 32, 2, 64), (1, 64, 4, 64), (1, 128, 4, 128))
    got = step_rates(cpu, reps=3, sizes=sizes)
    assert 0 < got["op_overhead"] < 1e-3, got
    assert 1e8 < got["mem_bw"] < 1e13, got


@pytest.mark.slow
def test_calibrated_profile_has_the_cpu_curves_and_round_trips(tmp_path):
    from parallel_layers.planner import calibrate
    prof = calibrate(world=2, reps=2, collective_reps=10)
    assert set(prof.gemm_curve) == {"fp32"} and len(prof.gemm_curve["fp32"]) == 5
    assert all(c >= 0 for c in prof.gemm_curve["fp32"])
    assert 0 < prof.attention_efficiency <= 1.5
    assert 0.0 <= prof.shared_wait_exponent <= 1.0
    # the curve is what charges a matmul: a tiny GEMM runs below the peak
    tiny = prof.matmul_seconds("fp32", 2 * 64 * 64 * 64, (2 * 64 * 64 * 64 / 64,) * 3 + (0.0, 0.0, 1.0))
    assert tiny > 2 * 64 ** 3 / prof.peak_flops["fp32"]
    path = tmp_path / "p.json"
    prof.save(str(path))
    again = load_profile(str(path))
    assert again.shared_wait_exponent == prof.shared_wait_exponent and again.gemm_curve == prof.gemm_curve
