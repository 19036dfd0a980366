"""PNG plots of a run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

__all__ = ["curves_png", "epsilon_png", "figure", "png_bytes"]


def figure(width: float, height: float) -> tuple[Any, Any]:
    """(pyplot, a new figure) on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt, plt.figure(figsize=(width, height), dpi=100, layout="constrained")


def png_bytes(plt: Any, fig: Any) -> bytes:
    """The figure as PNG bytes; the figure is closed."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def epsilon_png(curve: Sequence[tuple[int, float]], target: float, steps_done: int, delta: float) -> bytes:
    """ε spent (at δ) against the step number; the target as a dashed line."""
    plt, fig = figure(6.0, 3.6)
    ax = fig.add_subplot(1, 1, 1)
    xs = [s for s, _ in curve]
    ys = [e for _, e in curve]
    ax.plot(xs, ys, marker=".", label="ε spent")
    ax.axhline(target, linestyle="--", color="tab:red", label=f"target ε = {target:g}")
    if steps_done and xs:
        ax.axvline(steps_done, linestyle=":", color="gray", label=f"steps taken = {steps_done}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"ε (δ = {delta:g})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Privacy spent during training")
    return png_bytes(plt, fig)


def curves_png(dp: Sequence[dict[str, float]], baseline: Sequence[dict[str, float]]) -> bytes:
    """Test loss and test accuracy per epoch, DP against the non-private baseline."""
    plt, fig = figure(9.0, 3.6)
    for i, (key, label) in enumerate((("test_loss", "test loss"), ("test_accuracy", "test accuracy"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for rows, name in ((dp, "DP"), (baseline, "non-private baseline")):
            points = [(r["epoch"], r[key]) for r in rows if key in r]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=name)
        ax.set_xlabel("epoch")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Utility: DP training against the non-private baseline")
    return png_bytes(plt, fig)
