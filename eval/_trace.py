"""Per-step telemetry plot: CONF-KV's sawtooth memory against the model's confidence."""

from __future__ import annotations

import numpy as np


def plot_trace(telemetry, path: str, *, title: str, tau: float | None = None, row: int = 0) -> None:
    """Write a PNG: live KV bytes per tier (top) and confidence + chosen budget (bottom).

    Args:
        telemetry: kvjax.generate.Telemetry of one generation.
        path: output PNG path.
        title: figure title.
        tau: the confidence threshold to draw (CONF-KV), or None.
        row: which sequence of the batch.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = int(telemetry.steps)
    slots = np.asarray(telemetry.live_slots)[:n, row]  # [N, L, 3]
    unit = np.asarray(telemetry.slot_bytes, np.int64)  # [L, 3]
    per_tier = (slots.astype(np.int64) * unit[None]).sum(axis=1) / 2**20  # [N, 3] MiB
    conf = np.asarray(telemetry.confidence)[:n, row]
    budget = np.asarray(telemetry.budget)[:n, row]
    steps = np.arange(n)
    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax0.stackplot(
        steps,
        per_tier[:, 0],
        per_tier[:, 1],
        per_tier[:, 2],
        labels=["full precision", "INT8", "low-bit"],
        alpha=0.8,
    )
    ax0.set_ylabel("live KV (MiB)")
    ax0.legend(loc="upper left")
    ax0.set_title(title)
    ax1.plot(steps, conf, lw=1, color="tab:green", label="confidence c")
    if tau is not None:
        ax1.axhline(tau, ls="--", color="gray", lw=1, label=f"τ = {tau}")
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("confidence")
    ax1.set_xlabel("decode step")
    if (budget >= 0).any():
        ax2 = ax1.twinx()
        ax2.step(steps, budget, where="post", color="tab:red", lw=1, label="budget (tokens)")
        ax2.set_ylabel("budget (tokens / head / layer)")
        ax2.legend(loc="lower right")
    ax1.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
