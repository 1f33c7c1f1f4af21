"""Reporting for `kvjax confidence-kl`: table rows and the scatter plot."""

from __future__ import annotations

import numpy as np

from ._confkl import SIGNALS, ConfKLResult


def confidence_kl_rows(res: ConfKLResult) -> list[dict[str, float | str]]:
    """One table row per signal: Pearson r with its 95% CI, Spearman rho with its CI."""
    return [
        {
            "signal": k,
            "pearson_r": res.pearson[k],
            "r_ci_lo": res.pearson_ci[k][0],
            "r_ci_hi": res.pearson_ci[k][1],
            "spearman_rho": res.spearman[k],
            "rho_ci_lo": res.spearman_ci[k][0],
            "rho_ci_hi": res.spearman_ci[k][1],
        }
        for k in SIGNALS
    ]


def plot_confidence_kl(res: ConfKLResult, path: str) -> None:
    """PNG scatter of c vs KL per essay, with the least-squares line and r in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c, kl = np.asarray(res.values["c"]), np.asarray(res.kl)
    texts = np.asarray(res.sample_text)
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    for name in res.texts:
        m = texts == name
        ax.scatter(c[m], kl[m], s=10, alpha=0.6, label=name)
    slope, intercept = np.polyfit(c, kl, 1)
    xs = np.linspace(c.min(), c.max(), 2)
    ax.plot(xs, slope * xs + intercept, "k-", lw=1.5, label="least squares")
    lo, hi = res.pearson_ci["c"]
    ax.set_title(
        f"{res.model}: r = {res.pearson['c']:.3f} [{lo:.3f}, {hi:.3f}], "
        f"ρ = {res.spearman['c']:.3f}, n = {res.n}, R = {res.ablate}\n"
        f"(CONF-KV paper: r = -0.77)",
        fontsize=9,
    )
    ax.set_xlabel("confidence c = 0.4(1-Ĥ) + 0.3σ(m) + 0.3p₁ (full context)")
    ax.set_ylabel(f"KL(p_full ‖ p_ablated), last {res.ablate} tokens ablated (nats)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
