"""A NaN (or an infinity) fails every comparison of runs: the demo's parity check and the benchmarks' loss
difference. Python's ``max`` over a list returns a NaN only when it comes first, so a check built on it
passes a diverged run."""
import json
import math

import pytest

from benchmarks import harness
from parallel_layers.cli.demo import build_parser, relative_difference, summarize, within_tolerance

NAN, INF = math.nan, math.inf


def test_relative_difference_of_a_non_finite_loss_is_nan():
    assert relative_difference(2.02, 2.0) == pytest.approx(0.01)
    assert relative_difference(0.0, 0.0) == 0.0 and relative_difference(1.0, 0.0) == INF
    for got, want in ((NAN, 1.0), (1.0, NAN), (NAN, NAN), (INF, INF), (1.0, INF), (-INF, 1.0)):
        assert math.isnan(relative_difference(got, want)), (got, want)


@pytest.mark.parametrize("diffs", [[1e-8, NAN], [NAN, 1e-8], [1e-8, NAN, 1e-9], [NAN, NAN]])
def test_within_tolerance_fails_on_nan_wherever_it_is(diffs):
    agree, worst = within_tolerance(diffs, 1e-4)
    assert agree is False and math.isnan(worst)


def test_within_tolerance_agrees_and_disagrees_on_finite_differences():
    assert within_tolerance([1e-8, 5e-5], 1e-4) == (True, 5e-5)
    assert within_tolerance([1e-8, 2e-4], 1e-4) == (False, 2e-4)
    assert within_tolerance([1e-8, INF], 1e-4) == (False, INF)


def _par(losses, val=()):
    return {"losses": list(losses), "val_losses": [list(v) for v in val], "first_step": 1, "tokens_per_s": 1.0,
            "step_time_s": 1.0, "per_rank": [{"rss_mb": 1.0}], "bubble_fraction": None, "timeline_png": None}


def _summarize(tmp_path, par, ref, *argv):
    args = build_parser().parse_args(["--steps", str(len(par["losses"])), "--out", str(tmp_path), *argv])
    summary = summarize(args, par, ref, 1000, "test")
    assert json.loads((tmp_path / "summary.json").read_text())["agree"] is summary["agree"]
    return summary


def test_demo_check_fails_a_run_whose_losses_are_nan(tmp_path, capsys):
    """The run of ``demo --lr 1e6 --max-grad-norm 1e30``: a finite first step, then NaN on both sides."""
    losses = [5.558772, NAN, NAN, NAN, NAN, NAN]
    ref = ([5.5587722, NAN, NAN, NAN, NAN, NAN], [[6, NAN]])
    summary = _summarize(tmp_path, _par(losses, [[6, NAN]]), ref)
    assert summary["agree"] is False and math.isnan(summary["max_rel_diff"])
    out = capsys.readouterr().out
    assert "DISAGREE" in out and "NaN or infinite loss at step(s) 2, 3, 4, 5, 6, val 6" in out, out


@pytest.mark.parametrize("side", ["parallel", "reference", "validation"])
def test_demo_check_fails_one_nan(tmp_path, side):
    losses, ref_losses, val, ref_val = [3.0, 2.0, 1.0], [3.0, 2.0, 1.0], [[3, 1.5]], [[3, 1.5]]
    {"parallel": losses, "reference": ref_losses, "validation": val[0]}[side][-1] = NAN
    assert _summarize(tmp_path, _par(losses, val), (ref_losses, ref_val))["agree"] is False


def test_demo_check_agrees_on_close_losses_and_refuses_missing_steps(tmp_path):
    assert _summarize(tmp_path, _par([3.0, 2.0], [[2, 1.5]]), ([3.0, 2.0000001], [[2, 1.5]]))["agree"] is True
    with pytest.raises(RuntimeError, match="2 losses but the single process 3"):
        _summarize(tmp_path, _par([3.0, 2.0]), ([3.0, 2.0, 1.0], []))


@pytest.mark.parametrize("ours,theirs", [([1.0, NAN, 1.0], [1.0, 1.0, 1.0]), ([1.0, 1.0], [NAN, 1.0]),
                                         ([1.0, NAN], [1.0, NAN]), ([INF, 1.0], [INF, 1.0])])
def test_benchmark_loss_difference_is_nan_when_a_run_diverged(ours, theirs):
    assert math.isnan(harness.max_abs_diff(ours, theirs))


def test_benchmark_loss_difference_of_finite_runs():
    assert harness.max_abs_diff([1.0, 2.0, 3.0], [1.0, 2.5, 2.9]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="3 values against 2"):
        harness.max_abs_diff([1.0, 2.0, 3.0], [1.0, 2.0])
