"""``parallel_layers.testing.compare.worst``: a NaN error is the worst wherever it sits, so no tolerance
check built on it passes a diverged run (Python's ``max`` keeps a NaN only when it comes first)."""
import math

import pytest

from parallel_layers.testing.compare import worst

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("errs", [[NAN, 1e-9, 2e-9], [1e-9, 2e-9, NAN], [1e-9, NAN, INF], [INF, NAN]],
                         ids=["nan-first", "nan-last", "nan-before-inf", "nan-after-inf"])
def test_nan_is_the_worst_anywhere(errs):
    assert math.isnan(worst(errs))
    assert not worst(errs) <= 1e-5


def test_nan_in_a_pair_is_the_worst_and_keeps_its_name():
    pairs = [(1e-9, "a"), (3e-9, "b"), (NAN, "c"), (2e-9, "d")]
    assert max(pairs)[1] != "c"                   # the trap: tuple max skips the NaN here
    err, name = worst(pairs)
    assert math.isnan(err) and name == "c"


def test_key_picks_the_error_of_other_items():
    errs = {"w": 1e-9, "b": NAN, "g": 5e-9}
    name, err = worst(errs.items(), key=lambda kv: kv[1])
    assert name == "b" and math.isnan(err)


def test_finite_and_infinite_errors():
    assert worst([1e-9, 5e-5, 2e-6]) == 5e-5
    assert worst([(1e-9, "a"), (INF, "b"), (1.0, "c")]) == (INF, "b")
    assert worst([-INF, -1.0]) == -1.0            # the first item counts even when it is -inf
    assert worst([-INF]) == -INF


def test_nothing_compared_is_an_error():
    with pytest.raises(ValueError, match="no values to compare"):
        worst([])
