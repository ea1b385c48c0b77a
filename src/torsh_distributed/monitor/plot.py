"""The loss curve of a run as an image (``torsh-dist train --plot FILE``).

:func:`plot_loss_curve` draws the training loss of every step and the validation points, and
writes the figure through a temporary file and a rename (never half an image). It draws on a
bare :class:`matplotlib.figure.Figure` with the Agg canvas, so no GUI backend, display or
``pyplot`` global state is involved. matplotlib is an optional dependency (the ``plot`` extra):
:func:`check_available` lets configuration code refuse ``--plot`` before a run starts.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FORMATS", "check_available", "plot_loss_curve"]

FORMATS = (".png", ".svg", ".pdf")
"""File suffixes :func:`plot_loss_curve` writes (the format follows the suffix)."""


def check_available(what: str = "--plot") -> None:
    """Raise ``ValueError`` naming ``what`` when matplotlib cannot be imported."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(
            f"{what} needs matplotlib, which is not installed: "
            "pip install 'torsh-distributed[plot]' (or pip install matplotlib)"
        )


def plot_loss_curve(
    path: str | Path,
    *,
    losses: Sequence[float],
    val_points: Sequence[tuple[int, float]] = (),
    title: str = "",
) -> Path:
    """Write the loss curve to ``path`` (PNG, SVG or PDF by its suffix); return the path.

    Args:
        path: Output file; its directory is created if missing.
        losses: Training loss of steps 1, 2, ... (``TrainResult.losses``).
        val_points: ``(step, validation loss)`` pairs (``TrainResult.val_history``); NaN
            values (no validation set) are left out.
        title: Figure title (e.g. the model and layout).

    Raises:
        ValueError: an unsupported suffix, or no losses; matplotlib is missing.
    """
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"plot file must end in {', '.join(FORMATS)}, got {out.name!r}")
    if not losses:
        raise ValueError("no training losses to plot")
    check_available()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    steps = range(1, len(losses) + 1)
    ax.plot(steps, list(losses), color="tab:blue", linewidth=1.2, label="train loss")
    val = [(s, v) for s, v in val_points if math.isfinite(v)]
    if val:
        ax.plot(
            [s for s, _ in val], [v for _, v in val],
            color="tab:orange", marker="o", linestyle="--", label="validation loss",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    if title:
        ax.set_title(title)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{out.suffix}")  # the suffix names the format
    fig.savefig(tmp)
    tmp.replace(out)
    return out
