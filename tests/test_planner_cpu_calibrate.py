"""The CPU calibration's per-operator-kind rates (issue 50, item 4) and the step tail the planner now charges.

* ``step_tail_ops``: the reduction and optimizer step after the last backward, counted on meta: torch's AdamW
  (ZeRO 0) steps parameter by parameter, the package's ZeRO optimizers a flat buffer; nothing left on the model.
* ``calibrate_steps``: each operator kind's rate fitted on its own time in real steps (GEMM calls, attention
  kernels by head dim and sequence, the rest per call and per byte): recovered exactly from steps made of known
  rates; a measured step's profiled GEMMs are the ones the planner's tally counts.
* ``calibrate``: the profile carries the fp32 GEMM curve, attention's efficiency and the oversubscription
  exponent, and survives its JSON file.
"""
import pytest
import torch

from parallel_layers.composition.layout import Layout
from parallel_layers.models.gpt import GPTConfig
from parallel_layers.planner import Request
from parallel_layers.planner.accounting import FlopTally, add_gemm_shape, attention_flop_formulas
from parallel_layers.planner.calibrate_gpu import attention_shapes, gemm_shapes
from parallel_layers.planner.calibrate_steps import apply_step_rates, fit_step_rates, measure_steps, reference_steps
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


def _synthetic_rows(prof: Profile, per_op: float, bw: float):
    """Steps whose every kind costs exactly what ``prof`` (curves set) and ``per_op`` / ``bw`` say."""
    rows = []
    sizes = [(128, 64, 32, 16, 64, 500, 1e7), (512, 256, 64, 32, 128, 800, 5e7), (2048, 512, 256, 64, 512, 600, 3e8),
             (256, 128, 128, 16, 256, 900, 2e7)]
    for i, (m, n, k, d, s, ops, traffic) in enumerate(sizes):
        calls = [(m, n, k), (m, k, n), (n, k, m)]            # forward, data and weight gradients
        shape = [0.0] * 8
        gemm_calls = []
        for mm, nn, kk in calls:
            f = 2.0 * mm * nn * kk
            add_gemm_shape(shape, f, mm, kk, nn)
            alone = [0.0] * 8
            add_gemm_shape(alone, f, mm, kk, nn)
            gemm_calls.append((mm, nn, kk, f, prof.matmul_seconds("fp32", f, tuple(alone))))
        computed = 1e7 * (i + 1)
        shape[3], shape[4], shape[6], shape[7] = 2 * computed, computed, computed / d, computed / s
        gemm = sum(c[4] for c in gemm_calls)
        attention = prof.matmul_seconds("fp32", 2 * computed,
                                        (0.0,) * 3 + (2 * computed, computed, 0.0, computed / d, computed / s))
        rows.append(dict(ops=ops, traffic=traffic, flops=sum(c[3] for c in gemm_calls) + 2 * computed,
                         shape=tuple(shape), gemm=gemm, attention=attention, gemm_calls=gemm_calls,
                         step_s=gemm + attention + ops * per_op + traffic / bw))
    return rows


def test_step_rates_recover_the_rates_steps_were_made_of():
    """Each kind is fitted on its own time: the GEMM curve on the GEMM calls, attention's curve on the attention
    kernels' time by head dim and sequence, the per-call and per-byte costs on the rest."""
    true = Profile(name="t", flops={"fp32": 1e11}, peak_flops={"fp32": 1e11}, mem_bw=2e10, intra={}, inter={},
                   gemm_curve={"fp32": [1.2, 20.0, 8.0, 4.0, 0.0]}, attention_curve=[2.0, 30.0, 60.0])
    rows = _synthetic_rows(true, per_op=6e-6, bw=1.5e10)
    start = Profile(name="alone", flops={"fp32": 1e11}, peak_flops={"fp32": 1e11}, mem_bw=1e10, intra={}, inter={},
                    gemm_curve={"fp32": [1.0, 10.0, 4.0, 2.0, 0.0]}, attention_efficiency=0.5)
    got = fit_step_rates(start, rows)
    assert got["op_overhead"] == pytest.approx(6e-6, rel=1e-6) and got["mem_bw"] == pytest.approx(1.5e10, rel=1e-6)
    assert got["attention_curve"] == pytest.approx([2.0, 30.0, 60.0], rel=1e-6)
    assert got["gemm_scale"] > 1.0                         # the steps' GEMMs ran slower than the curve alone said
    apply_step_rates(start, got)
    for row in rows:
        assert start.matmul_seconds("fp32", row["flops"], row["shape"]) == pytest.approx(
            true.matmul_seconds("fp32", row["flops"], row["shape"]), rel=1e-3)
    # short heads cost more a FLOP than long ones at the same sequence
    short, long_ = ((0.0,) * 3 + (2e9, 1e9, 0.0, 1e9 / d, 1e9 / 128) for d in (16, 128))
    assert start.matmul_seconds("fp32", 2e9, short) > 1.5 * start.matmul_seconds("fp32", 2e9, long_)


def test_flop_tally_shape_terms_hold_attentions_head_dim_and_sequence():
    import torch.nn.functional as F
    q, k, v = (torch.randn(2, 4, 64, 16, requires_grad=True) for _ in range(3))
    with FlopTally(attention_flop_formulas()) as flops:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    shape = flops.shape
    assert shape[4] > 0 and shape[4] == pytest.approx(shape[3] / 2)      # causal: half the square computed
    assert shape[6] == pytest.approx(shape[4] / 16) and shape[7] == pytest.approx(shape[4] / 64)


def test_measured_steps_profile_the_gemms_the_tally_counts():
    """One small reference step of each architecture, measured: the profiler's GEMM calls are the ones the
    planner's tally counts (shape terms' call count), and each kind took time."""
    torch.set_num_threads(1)
    steps = [("gpt", (1, 32, 2, 64))] + [s for s in reference_steps() if s[0] == "llama"][:1]
    rows = measure_steps(reps=1, steps=[(arch, (1,) + size[1:]) for arch, size in steps])
    for row in rows:
        assert len(row["gemm_calls"]) == row["shape"][5], (row["arch"], len(row["gemm_calls"]), row["shape"][5])
        assert 0 < row["gemm"] and 0 < row["attention"] and row["gemm"] + row["attention"] < 2 * row["step_s"]
        assert row["ops"] > 0 and row["traffic"] > 0


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
    assert again.attention_curve == prof.attention_curve and len(prof.attention_curve) == 3
    assert prof.intra["send"].alpha > 0 and prof.op_overhead > 0
