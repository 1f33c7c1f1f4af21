"""Cache diagnostics as pure NumPy functions: future missed mass (FMM), selection churn, Global
LIR (QEvict's item 8 in METHODS.md), usable on any policy.

Conventions (docs/decisions.md, "Cache diagnostics"). Positions 0..S-1; window j holds positions
[jω, (j+1)ω). Event e is a routing point at position t_e: the cache as it is right after the token
at t_e was written. `attn[d, τ]` is the mass the *full* model's query at position d puts on
position τ, summed over the query heads of a KV head and divided by their number G (a row sums to
1). Every array may carry leading axes (e.g. [L, Hkv]); metrics are computed per leading index.
"""

from __future__ import annotations

import dataclasses

import numpy as np


def future_missed_mass(
    attn: np.ndarray, cached: np.ndarray, event_pos: np.ndarray, *, horizon: int
) -> np.ndarray:
    """FMM_e = (1/H) Σ_{d=t+1}^{t+H} Σ_{τ < t, τ not cached at e} attn[d, τ], with t = t_e.

    Args:
        attn: [..., S, S] float, row d = the full model's attention of query d (rows of
            positions that were never queried are ignored unless a horizon covers them).
        cached: [..., E, S] bool, position held by the policy (any tier) at event e.
        event_pos: [E] int, t_e.
        horizon: H >= 1.

    Returns:
        [..., E] float64; NaN for events whose horizon runs past S - 1.
    """
    s = attn.shape[-1]
    out = np.full(cached.shape[:-1], np.nan)
    for e, t in enumerate(np.asarray(event_pos)):
        if t + horizon > s - 1:
            continue
        miss = ~cached[..., e, :] & (np.arange(s) < t)
        future = attn[..., t + 1 : t + 1 + horizon, :].sum(axis=-2, dtype=np.float64)
        out[..., e] = np.sum(future * miss, axis=-1) / horizon
    return out


class FmmStream:
    """The same FMM, computed as attention rows stream in, holding only the pending events' miss
    masks (at most ⌈H/ω⌉ + 1 of them) instead of the S×S attention matrix.

    Feed `add_rows` for query positions in increasing order and `add_event(t, ...)` once the
    rows up to t have been fed; `result()` equals `future_missed_mass` on the whole stream.
    """

    def __init__(self, horizon: int) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self.horizon = horizon
        self._pending: list[tuple[int, int, np.ndarray, np.ndarray]] = []  # (e, t, miss, acc)
        self._values: dict[int, np.ndarray] = {}
        self._events = 0
        self._next_pos = 0

    def add_rows(self, first_pos: int, rows: np.ndarray) -> None:
        """rows: [n, ..., S] float, the attention of queries first_pos .. first_pos + n - 1."""
        if first_pos != self._next_pos and self._pending:
            raise ValueError(f"rows must be contiguous: expected {self._next_pos}, got {first_pos}")
        self._next_pos = first_pos + rows.shape[0]
        still = []
        for e, t, miss, acc in self._pending:
            lo, hi = max(t + 1, first_pos), min(t + self.horizon, self._next_pos - 1)
            if lo <= hi:
                future = rows[lo - first_pos : hi - first_pos + 1].sum(axis=0, dtype=np.float64)
                acc = acc + np.sum(future * miss, axis=-1)
            if t + self.horizon <= self._next_pos - 1:
                self._values[e] = acc / self.horizon
            else:
                still.append((e, t, miss, acc))
        self._pending = still

    def add_event(self, t: int, cached: np.ndarray) -> None:
        """cached: [..., S] bool, the policy's held positions at event position t."""
        if t >= self._next_pos:
            raise ValueError(f"event at {t} before its row was fed (next row {self._next_pos})")
        miss = ~cached & (np.arange(cached.shape[-1]) < t)
        self._pending.append((self._events, t, miss, np.zeros(cached.shape[:-1])))
        self._events += 1

    def result(self) -> np.ndarray:
        """[..., E] float64 FMM per event; NaN where the horizon was not complete."""
        shape = next(iter(self._values.values())).shape if self._values else None
        if shape is None and self._pending:
            shape = self._pending[0][3].shape
        out = np.full((*(shape or ()), self._events), np.nan)
        for e, v in self._values.items():
            out[..., e] = v
        return out


def window_of_positions(mask: np.ndarray, window: int) -> np.ndarray:
    """[..., S] bool -> [..., ⌈S/ω⌉] bool: window holds at least one True position."""
    s = mask.shape[-1]
    n = -(-s // window)
    padded = np.zeros((*mask.shape[:-1], n * window), bool)
    padded[..., :s] = mask
    return padded.reshape(*mask.shape[:-1], n, window).any(axis=-1)


def window_sums(mass: np.ndarray, window: int) -> np.ndarray:
    """[..., S] float -> [..., ⌈S/ω⌉] float32: mass per window."""
    s = mass.shape[-1]
    n = -(-s // window)
    padded = np.zeros((*mass.shape[:-1], n * window), np.float32)
    padded[..., :s] = mass
    return padded.reshape(*mass.shape[:-1], n, window).sum(axis=-1)


def complete_windows(event_pos: np.ndarray, window: int) -> np.ndarray:
    """[E] int: windows whose last position is <= t_e (window j counts iff j < result[e])."""
    return (np.asarray(event_pos) + 1) // window


def kept_windows(cached: np.ndarray, event_pos: np.ndarray, *, window: int) -> np.ndarray:
    """K_e: complete windows with at least one cached position.

    Args:
        cached: [..., E, S] bool held positions per event (any tier, or one tier).
        event_pos: [E] int.
        window: ω.

    Returns:
        [..., E, ⌈S/ω⌉] bool.
    """
    kept = window_of_positions(cached, window)
    n = complete_windows(event_pos, window)
    return kept & (np.arange(kept.shape[-1])[None, :] < n[:, None])


def selection_churn(kept: np.ndarray, n_complete: np.ndarray) -> np.ndarray:
    """churn_e = 1 - |K_e ∩ K'_{e+1}| / |K_e ∪ K'_{e+1}| (0 if both empty), where K'_{e+1} is
    K_{e+1} restricted to the windows complete at e (a window completed later is growth, not
    churn, so `full` scores 0).

    Args:
        kept: [..., E, W] bool kept windows per event.
        n_complete: [E] int, windows complete at each event.

    Returns:
        [..., E-1] float64.
    """
    universe = np.arange(kept.shape[-1])[None, :] < np.asarray(n_complete)[:-1, None]  # [E-1, W]
    a = kept[..., :-1, :] & universe
    b = kept[..., 1:, :] & universe
    inter = np.sum(a & b, axis=-1)
    union = np.sum(a | b, axis=-1)
    return np.where(union > 0, 1.0 - inter / np.maximum(union, 1), 0.0)


def window_activity(window_mass: np.ndarray, *, top_k: int) -> np.ndarray:
    """Active windows: the top-k by mass received during the event's ω steps (ties: lower index
    first); a window with zero mass is never active.

    Args:
        window_mass: [..., E, W] float.
        top_k: k >= 1.

    Returns:
        [..., E, W] bool.
    """
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    order = np.argsort(-window_mass, axis=-1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(order.shape[-1]), axis=-1)
    return (rank < top_k) & (window_mass > 0)


@dataclasses.dataclass(frozen=True)
class LirCounts:
    """Global LIR counts per leading index (e.g. [L, Hkv]).

    Attributes:
        candidates: int, windows that were active, then inactive for m consecutive events, with
            the whole h-event look-ahead inside the stream (one per inactivity run).
        reactivations: int, candidates active again within the next h events.
        lost: int, reactivations whose window had no cached position at the reactivation event.
    """

    candidates: np.ndarray
    reactivations: np.ndarray
    lost: np.ndarray


def global_lir(active: np.ndarray, *, m: int, h: int, kept: np.ndarray | None = None) -> LirCounts:
    """Reactivations of windows inactive for >= m events, counted within h events.

    A candidate is (window, e) with the window active at e - m, inactive at e-m+1 .. e; it is a
    reactivation if the window is active at some event in e+1 .. e+h (the first one is the
    reactivation event). Candidates with e + h > E - 1 are left out.

    Args:
        active: [..., E, W] bool activity per event.
        m: inactivity length >= 1.
        h: look-ahead >= 1.
        kept: [..., E, W] bool windows held by the policy (for `lost`), or None (lost = 0).
    """
    if m < 1 or h < 1:
        raise ValueError(f"m and h must be >= 1, got m={m}, h={h}")
    n_events = active.shape[-2]
    # run[e]: consecutive inactive events ending at e since the last active one (-1 before any).
    run = np.full(active.shape, -1, np.int64)
    prev = np.full(active.shape[:-2] + active.shape[-1:], -1, np.int64)
    for e in range(n_events):
        prev = np.where(active[..., e, :], 0, np.where(prev >= 0, prev + 1, -1))
        run[..., e, :] = prev
    cand = run == m
    cand[..., max(n_events - h, 0) :, :] = False
    # First active event in e+1 .. e+h, found offset by offset.
    react_at = np.full(active.shape, -1, np.int64)
    for off in range(min(h, n_events - 1), 0, -1):
        shifted = np.zeros_like(active)
        shifted[..., : n_events - off, :] = active[..., off:, :]
        react_at = np.where(shifted, np.arange(n_events)[:, None] + off, react_at)
    react = cand & (react_at >= 0)
    lost = np.zeros(active.shape[:-2], np.int64)
    if kept is not None:
        at = np.maximum(react_at, 0)
        held = np.take_along_axis(kept, at, axis=-2)
        lost = np.sum(react & ~held, axis=(-2, -1))
    return LirCounts(
        candidates=np.sum(cand, axis=(-2, -1)),
        reactivations=np.sum(react, axis=(-2, -1)),
        lost=lost,
    )


def ratio_mean(num: np.ndarray, den: np.ndarray) -> float:
    """Mean over leading indices of num/den where den > 0 (NaN if none)."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    ok = den > 0
    return float(np.mean(num[ok] / den[ok])) if ok.any() else float("nan")
