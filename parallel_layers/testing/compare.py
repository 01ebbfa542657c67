"""NaN-aware reductions for pass/fail comparisons in tests and probes.

Python's ``max`` keeps a NaN only when it comes first (every comparison with NaN is False), so
``max(errs) <= tol`` passes a diverged run whose NaN is not the first error, and a running
``worst = max(worst, err)`` drops every NaN. :func:`worst` counts a NaN as larger than anything,
infinity included, and returns it; ``worst(errs) <= tol`` then fails as it should. The demo's parity
check uses it too (``parallel_layers.cli.demo.within_tolerance``).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional


def error_of(item: Any) -> float:
    """The error an item carries: the item itself, or the first element of an ``(error, name, ...)``
    tuple or list."""
    return float(item[0] if isinstance(item, (tuple, list)) else item)


def worst(items: Iterable[Any], key: Optional[Callable[[Any], float]] = None) -> Any:
    """The item with the largest error, a NaN error counting as the largest (the first NaN is returned).

    ``items``: errors, or ``(error, name)`` pairs (``key`` defaults to :func:`error_of`), or anything
    with ``key`` giving its error, e.g. ``worst(errs.items(), key=lambda kv: kv[1])``. No items is an
    error, not a pass: a comparison that compared nothing proves nothing.
    """
    key = error_of if key is None else key
    found, largest, best = False, -math.inf, None
    for item in items:
        err = float(key(item))
        if math.isnan(err):
            return item
        if not found or err > largest:
            found, largest, best = True, err, item
    if not found:
        raise ValueError("worst(): no values to compare; the comparison would prove nothing")
    return best


__all__ = ["error_of", "worst"]
