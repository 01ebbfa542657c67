"""The layouts a freeze-training run went through, as one PNG: a panel per layout, each the recorded
pipeline timeline of that layout's last step (one row per pipeline rank of the first replica; forward
blue, backward green, waiting grey), titled with its steps, ``dp x pp``, the frozen blocks and the
stages' blocks. Panels share the time axis, so a step getting shorter as blocks freeze shows as such."""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..pipeline.timeline import Timeline, bubble_fraction

_COLORS = {"F": "#4c72b0", "B": "#55a868"}


def _draw_one(ax, timelines: Sequence[Timeline], total_ms: float) -> None:
    n = len(timelines)
    for t in timelines:
        y = n - 1 - t.rank
        for e in t.events:
            start, width = e.start * 1e3, (e.end - e.start) * 1e3
            if e.op == "W":
                ax.broken_barh([(start, width)], (y - 0.15, 0.3), facecolors="#cccccc")
            else:
                ax.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=_COLORS[e.op], edgecolor="white",
                               linewidth=0.5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"pp rank {n - 1 - i}" for i in range(n)], fontsize=8)
    ax.set_xlim(0, total_ms * 1.01)


def draw_panels(panels: List[Tuple[str, Sequence[Timeline]]], path: str, title: str = "") -> Optional[str]:
    """One panel per ``(title, timelines)``, stacked; None without matplotlib (or with nothing recorded)."""
    from ..optional import pyplot
    plt = pyplot()
    if plt is None or not panels:
        return None
    heights = [0.6 * len(tls) + 0.9 for _, tls in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, sum(heights) + 0.8), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    total = max(max(t.t_end for t in tls) for _, tls in panels) * 1e3
    for ax, (label, tls) in zip(axes[:, 0], panels):
        _draw_one(ax, tls, total)
        ax.set_title(f"{label}  (bubble {bubble_fraction(tls):.1%})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time in the step (ms)")
    fig.suptitle(f"{title}  (blue forward, green backward, grey waiting)".strip(), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["draw_panels"]
