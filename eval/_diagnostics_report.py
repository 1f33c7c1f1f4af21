"""Cache diagnostics per policy: the shadow pass reduced to FMM, churn and Global LIR, the table
rows and the PNG."""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Sequence

import numpy as np

from kvjax.eval._diagnostics import (
    complete_windows,
    global_lir,
    ratio_mean,
    selection_churn,
    window_activity,
)
from kvjax.eval._diagnostics_pass import ShadowRecord, shadow_pass
from kvjax.policies import Policy
from kvjax.weights import LoadedModel, essay_text


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagnosticsSettings:
    """How a diagnostics run was made (JSON-ready)."""

    model: str
    text: str
    tokens: int
    prompt_tokens: int
    budget: int | None
    window: int
    horizon: int
    lir_m: int
    lir_h: int
    lir_k: int
    generate: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyDiagnostics:
    """One policy's diagnostics; scalars are means over events, then (layer, KV head) pairs.

    Attributes:
        fmm: future missed mass (events with a full horizon).
        churn: Jaccard distance of kept windows (any tier) between consecutive events.
        fp_churn: the same on windows with a full-precision position.
        global_lir: reactivations / candidates (mean over heads with candidates).
        reactivations_lost: lost / reactivations (mean over heads with reactivations).
        candidates, reactivations, lost: totals over all heads.
        event_pos: position of each event; fmm_per_event, churn_per_event,
            fp_churn_per_event: per-event means over heads (NaN: no full horizon; churn
            event e compares e and e + 1).
    """

    policy: str
    fmm: float
    churn: float
    fp_churn: float
    global_lir: float
    reactivations_lost: float
    candidates: int
    reactivations: int
    lost: int
    seconds: float
    event_pos: list[int]
    fmm_per_event: list[float | None]
    churn_per_event: list[float]
    fp_churn_per_event: list[float]


def summarize(
    record: ShadowRecord, *, name: str, window: int, top_k: int, m: int, h: int, seconds: float
) -> PolicyDiagnostics:
    """Reduce one shadow pass to the diagnostics (see eval/_diagnostics.py for definitions)."""
    n = complete_windows(record.event_pos, window)
    churn = selection_churn(record.held, n)  # [L, Hkv, E-1]
    fp_churn = selection_churn(record.held_fp, n)
    lir = global_lir(window_activity(record.window_mass, top_k=top_k), m=m, h=h, kept=record.held)
    full_horizon = np.isfinite(record.fmm[0, 0])  # the same events for every head
    fmm = float(record.fmm[..., full_horizon].mean()) if full_horizon.any() else float("nan")
    as_list = lambda x: [float(v) if np.isfinite(v) else None for v in x]
    return PolicyDiagnostics(
        policy=name,
        fmm=fmm,
        churn=float(churn.mean()) if churn.size else 0.0,
        fp_churn=float(fp_churn.mean()) if fp_churn.size else 0.0,
        global_lir=ratio_mean(lir.reactivations, lir.candidates),
        reactivations_lost=ratio_mean(lir.lost, lir.reactivations),
        candidates=int(lir.candidates.sum()),
        reactivations=int(lir.reactivations.sum()),
        lost=int(lir.lost.sum()),
        seconds=seconds,
        event_pos=[int(t) for t in record.event_pos],
        fmm_per_event=as_list(record.fmm.mean(axis=(0, 1))),
        churn_per_event=as_list(churn.mean(axis=(0, 1))),
        fp_churn_per_event=as_list(fp_churn.mean(axis=(0, 1))),
    )


def text_tokens(model: LoadedModel, text: str, n_tokens: int) -> np.ndarray:
    """The first `n_tokens` ids of a text file (an existing path) or an essay name (no BOS)."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; cannot tokenize {text}")
    path = pathlib.Path(text)
    body = path.read_text(encoding="utf-8") if path.is_file() else essay_text(text)
    ids = model.tokenizer.encode(body)
    if len(ids) < n_tokens:
        raise ValueError(f"text {text} has only {len(ids)} tokens; --tokens asks for {n_tokens}")
    return np.asarray(ids[:n_tokens], np.int32)


def check_diagnostics_args(
    *, tokens: int, prompt_tokens: int, window: int, horizon: int, m: int, h: int, top_k: int
) -> None:
    """Raise ValueError with a clear message for settings that cannot give any number."""
    for flag, value in (("--window", window), ("--horizon", horizon), ("--lir-m", m)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if h < 1 or top_k < 1:
        raise ValueError(f"--lir-h and the LIR top-k must be >= 1, got {h} and {top_k}")
    if prompt_tokens < 1:
        raise ValueError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    need = prompt_tokens + window + horizon
    if tokens < need:
        raise ValueError(
            f"--tokens ({tokens}) must be >= prompt tokens + window + horizon ({need}) so that "
            "one routing event has a full FMM horizon"
        )


def run_diagnostics(
    model: LoadedModel,
    policies: Sequence[Policy],
    settings: DiagnosticsSettings,
    *,
    cache_dtype=None,
    progress: bool = True,
) -> list[PolicyDiagnostics]:
    """Shadow pass + reduction for each policy on the same text."""
    s = settings
    check_diagnostics_args(
        tokens=s.tokens,
        prompt_tokens=s.prompt_tokens,
        window=s.window,
        horizon=s.horizon,
        m=s.lir_m,
        h=s.lir_h,
        top_k=s.lir_k,
    )
    tokens = text_tokens(model, s.text, s.tokens)
    out = []
    for policy in policies:
        t0 = time.perf_counter()
        rec = shadow_pass(
            model.config,
            model.params,
            tokens,
            policy=policy,
            prompt_tokens=s.prompt_tokens,
            window=s.window,
            horizon=s.horizon,
            generate=s.generate,
            cache_dtype=cache_dtype,
            progress=progress,
        )
        out.append(
            summarize(
                rec,
                name=policy.name,
                window=s.window,
                top_k=s.lir_k,
                m=s.lir_m,
                h=s.lir_h,
                seconds=time.perf_counter() - t0,
            )
        )
    return out


_SCALARS = ("fmm", "churn", "fp_churn", "global_lir", "reactivations_lost")


def diagnostics_rows(results: Sequence[PolicyDiagnostics]) -> list[dict]:
    """Table rows: policy and the five scalars."""
    return [{"policy": r.policy, **{k: getattr(r, k) for k in _SCALARS}} for r in results]


def plot_diagnostics(results: Sequence[PolicyDiagnostics], path: str, *, title: str) -> None:
    """FMM and churn per event over time (one line per policy) and a bar chart of the scalars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for r in results:
        axes[0].plot(r.event_pos, r.fmm_per_event, label=r.policy)
        axes[1].plot(r.event_pos[:-1], r.churn_per_event, label=r.policy)
    axes[0].set(xlabel="event position t", ylabel="FMM (per event)", title="future missed mass")
    axes[1].set(xlabel="event position t", ylabel="Jaccard distance", title="selection churn")
    width = 0.8 / max(len(results), 1)
    x = np.arange(len(_SCALARS))
    for i, r in enumerate(results):
        vals = [np.nan_to_num(getattr(r, k)) for k in _SCALARS]
        axes[2].bar(x + i * width, vals, width, label=r.policy)
    axes[2].set_xticks(
        x + width * (len(results) - 1) / 2, ["FMM", "churn", "fp-churn", "LIR", "lost"]
    )
    axes[2].set_title("summary")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
