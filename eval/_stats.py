"""Statistics for the evaluations: KL divergence, Pearson/Spearman correlation, bootstrap CIs
(plain NumPy, float64)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) over the last axis, float64 (a NumPy reference)."""
    logp = _log_softmax(np.asarray(p_logits, np.float64))
    logq = _log_softmax(np.asarray(q_logits, np.float64))
    return np.sum(np.exp(logp) * (logp - logq), axis=-1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two [n] samples (nan if either is constant)."""
    x = np.asarray(x, np.float64) - np.mean(x)
    y = np.asarray(y, np.float64) - np.mean(y)
    denom = np.sqrt(np.sum(x * x) * np.sum(y * y))
    return float(np.sum(x * y) / denom) if denom > 0 else float("nan")


def rankdata(x: np.ndarray) -> np.ndarray:
    """[n] float64 1-based ranks; ties share their average rank."""
    _, inverse, counts = np.unique(np.asarray(x), return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # the highest rank in each group of ties
    return (last - (counts - 1) / 2.0)[inverse]


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation: Pearson of the (tie-averaged) ranks."""
    return pearson(rankdata(x), rankdata(y))


def bootstrap_ci(
    x: np.ndarray,
    y: np.ndarray,
    stat: Callable[[np.ndarray, np.ndarray], float] = pearson,
    *,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of stat(x, y), resampling (x_i, y_i) pairs with replacement."""
    x, y = np.asarray(x), np.asarray(y)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(resamples, len(x)))
    stats = np.array([stat(x[i], y[i]) for i in idx])
    lo, hi = np.nanquantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
