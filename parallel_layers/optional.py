"""Optional packages stay optional: tqdm draws progress bars and matplotlib draws plots where they are
installed; without them the same calls run with no bar and no picture (and say so once)."""
from __future__ import annotations

import importlib.util
import sys
import warnings


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class _NoBar:
    """tqdm's surface that the package uses, doing nothing."""

    def __init__(self, *args, **kwargs):
        self.n = kwargs.get("initial", 0)

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, *args, **kwargs) -> None:
        pass

    def set_postfix(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(text: str, file=None) -> None:
        print(text, file=file or sys.stdout)


def progress_bar(*args, **kwargs):
    """``tqdm(*args, **kwargs)`` where tqdm is installed, else a bar that draws nothing."""
    if have("tqdm"):
        from tqdm import tqdm
        return tqdm(*args, **kwargs)
    return _NoBar(*args, **kwargs)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None (with one warning) where matplotlib is missing."""
    if not have("matplotlib"):
        warnings.warn("matplotlib is not installed: no plot is drawn (pip install matplotlib)", stacklevel=3)
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


__all__ = ["have", "progress_bar", "pyplot"]
