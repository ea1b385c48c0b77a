"""The federated run's plot: loss (and accuracy, when the server measures it) per round."""

from __future__ import annotations

from typing import Any

__all__ = ["plot_rounds"]


def plot_rounds(summary: dict[str, Any], path: str) -> None:
    """Write a PNG of the summary's rounds (failed rounds marked).

    Raises:
        ValueError: the summary has no rounds.
    """
    rounds = summary.get("rounds", [])
    if not rounds:
        raise ValueError("the summary has no rounds to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["round"] for r in rounds]
    acc = [r.get("accuracy") for r in rounds]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["loss"] for r in rounds], marker="o", label="loss")
    failed = [r["round"] for r in rounds if r.get("failed")]
    if failed:
        ax.scatter(failed, [r["loss"] for r in rounds if r.get("failed")], color="red", zorder=3,
                   label="failed round (model kept)")
    ax.set_xlabel("round")
    ax.set_ylabel("loss (server's held-out set when it has one)")
    if any(a is not None for a in acc):
        ax2 = ax.twinx()
        ax2.plot(xs, [a if a is not None else float("nan") for a in acc], color="tab:green",
                 marker="s", label="accuracy")
        ax2.set_ylabel("accuracy")
    ax.set_title(f"{summary.get('strategy', '')}, {summary.get('clients', '?')} clients")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
