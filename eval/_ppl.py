"""Perplexity of the first N tokens of an essay, teacher-forced through a policy's cache."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from kvjax.cache import physical_bytes, slot_bytes_per_layer, slots_to_bytes
from kvjax.generate import score_tokens
from kvjax.policies import Policy
from kvjax.weights import LoadedModel, essay_text


@dataclasses.dataclass(frozen=True, kw_only=True)
class PplResult:
    """One perplexity measurement (JSON-ready via dataclasses.asdict)."""

    policy: str
    budget: int | None
    text: str
    tokens: int
    ppl: float
    mean_nll: float
    live_bytes_mean: float
    live_bytes_peak: int
    physical_bytes: int
    seconds: float
    tokens_per_s: float


def essay_tokens(model: LoadedModel, n_tokens: int, name: str = "avg.txt") -> np.ndarray:
    """The first `n_tokens` token ids of an essay (no BOS)."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; cannot tokenize essays")
    ids = model.tokenizer.encode(essay_text(name))
    if len(ids) < n_tokens:
        raise ValueError(f"essay {name} has only {len(ids)} tokens; asked for {n_tokens}")
    return np.asarray(ids[:n_tokens], np.int32)


def run_ppl(
    model: LoadedModel,
    policy: Policy,
    *,
    n_tokens: int,
    text: str = "avg.txt",
    chunk: int = 1,
    segment: int = 256,
    budget: int | None = None,
    cache_dtype=None,
    progress: bool = True,
    scan_layers: bool = False,
) -> PplResult:
    """Teacher-forced perplexity over tokens 1..N-1 of an essay through `policy`'s cache
    (`scan_layers`: the layers in one `lax.scan`, `score_tokens(scan_layers=True)`)."""
    if n_tokens < 2:
        raise ValueError(f"--tokens must be >= 2, got {n_tokens}")
    tokens = essay_tokens(model, n_tokens, text)
    t0 = time.perf_counter()
    out = score_tokens(
        model.config,
        model.params,
        tokens,
        policy=policy,
        chunk=chunk,
        segment=segment,
        cache_dtype=cache_dtype,
        progress=progress,
        scan_layers=scan_layers,
    )
    nll = np.asarray(out.nll, np.float64)[0]
    seconds = time.perf_counter() - t0
    live = slots_to_bytes(np.asarray(out.live_slots)[:, 0], slot_bytes_per_layer(out.cache))
    return PplResult(
        policy=policy.name,
        budget=budget,
        text=text,
        tokens=n_tokens,
        ppl=math.exp(nll.mean()),
        mean_nll=float(nll.mean()),
        live_bytes_mean=float(live.mean()),
        live_bytes_peak=int(live.max()),
        physical_bytes=physical_bytes(out.cache),
        seconds=seconds,
        tokens_per_s=(n_tokens - 1) / seconds,
    )
