"""Training outputs for people: the loss curve as a PNG, the run as JSON."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any


def plot_loss_curve(
    history: Sequence[dict[str, float]],
    evals: Sequence[dict[str, float]],
    path: str | pathlib.Path,
    *,
    title: str,
) -> None:
    """Write a PNG: training loss per step (and its running mean), held-out loss and accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.array([h["step"] for h in history])
    loss = np.array([h["loss"] for h in history])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, loss, lw=0.8, alpha=0.4, color="tab:blue", label="train loss (per step)")
    if len(loss) >= 10:
        n = max(len(loss) // 20, 5)
        smooth = np.convolve(loss, np.ones(n) / n, mode="valid")
        ax.plot(steps[n - 1 :], smooth, color="tab:blue", label=f"train loss ({n}-step mean)")
    if evals:
        ax.plot(
            [e["step"] for e in evals],
            [e["loss"] for e in evals],
            "o-",
            color="tab:red",
            label="held-out loss",
        )
        acc = ax.twinx()
        acc.plot(
            [e["step"] for e in evals],
            [e["accuracy"] for e in evals],
            "s--",
            color="tab:green",
            label="held-out boundary accuracy",
        )
        acc.set_ylabel("boundary accuracy")
        acc.legend(loc="upper right")
    ax.set_xlabel("step")
    ax.set_ylabel("boundary logistic loss")
    ax.set_title(title)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str | pathlib.Path, record: dict[str, Any]) -> None:
    pathlib.Path(path).write_text(json.dumps(record, indent=2) + "\n")
