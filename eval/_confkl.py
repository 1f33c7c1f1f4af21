"""CONF-KV's mechanistic check: does confidence predict how much a prediction needs recent context?

METHODS.md (CONF-KV) quotes Pearson r = -0.77 between the confidence c of the next-token
distribution and the KL shift caused by ablating recent context. At evenly spaced positions t of
held-out essays we compare p_full = p(.|x_0..x_t) with p_ablated, where x_t at its own position t
attends only to x_0..x_{t-R-1} and itself, and correlate c_t with KL_t = KL(p_full || p_ablated).

The ablation is exact and costs one extra one-token model call: the `full` cache stores original
positions and attention masks slots by them, so a copy of the cache whose `pos` >= t - R are set
to EMPTY, with `length` = t, holds exactly the tokens [0, t - R).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import EMPTY, Cache
from kvjax.generate import model_step, new_cache
from kvjax.models import ModelConfig, Params
from kvjax.policies import confidence, make_policy
from kvjax.weights import LoadedModel, essay_names, essay_text

from ._ppl import essay_tokens
from ._stats import bootstrap_ci, pearson, spearman

Array = jax.Array

FULL = make_policy("full")
SIGNALS = ("c", "one_minus_entropy", "sigmoid_margin", "top1")  # c and its three components


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfKLResult:
    """Correlation of confidence with the KL shift from ablating recent context (JSON-ready).

    `pearson`, `spearman` and their 95% bootstrap intervals are keyed by signal (SIGNALS); the
    per-sample lists are aligned: sample i is position `positions[i]` of essay `sample_text[i]`.
    """

    model: str
    texts: list[str]
    tokens: int
    samples: int
    ablate: int
    min_context: int
    n: int
    pearson: dict[str, float]
    pearson_ci: dict[str, list[float]]
    spearman: dict[str, float]
    spearman_ci: dict[str, list[float]]
    mean_kl: float
    median_kl: float
    resamples: int
    seed: int
    seconds: float
    sample_text: list[str]
    positions: list[int]
    kl: list[float]
    values: dict[str, list[float]]  # SIGNALS -> per-sample values


def check_confidence_kl_args(
    *,
    n_tokens: int,
    samples: int,
    ablate: int,
    min_context: int,
    texts: Sequence[str] | None = None,
    essays: int = 4,
) -> None:
    """Raise ValueError with a clear message for settings the check cannot run with."""
    if ablate < 1:
        raise ValueError(f"--ablate must be >= 1 recent token, got {ablate}")
    if min_context <= ablate:
        raise ValueError(
            f"--min-context ({min_context}) must exceed --ablate ({ablate}) so that "
            f"some context is left after ablation"
        )
    if n_tokens <= min_context:
        raise ValueError(f"--tokens ({n_tokens}) must exceed --min-context ({min_context})")
    if not 3 <= samples <= n_tokens - min_context:
        raise ValueError(
            f"--samples must be in [3, tokens - min_context = "
            f"{n_tokens - min_context}], got {samples}"
        )
    if texts is None and essays < 1:
        raise ValueError(f"--essays must be >= 1, got {essays}")
    unknown = sorted(set(texts or ()) - set(essay_names()))
    if unknown:
        raise ValueError(
            f"unknown essay name(s) {unknown}; see kvjax.weights.essay_names(), "
            f"e.g. {essay_names()[-3:]}"
        )


def sample_positions(n_tokens: int, samples: int, min_context: int) -> np.ndarray:
    """[samples] int64 distinct, evenly spaced positions t in [min_context, n_tokens - 1]."""
    t = np.floor(np.linspace(min_context, n_tokens - 1, samples)).astype(np.int64)
    assert len(np.unique(t)) == samples, (n_tokens, samples, min_context)
    return t


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _advance(
    config: ModelConfig, params: Params, cache: Cache, tokens: Array, valid: Array, ablate: Array
) -> tuple[Cache, Array, Array]:
    """Feed a segment ending at token x_t; its logits with full and with ablated context.

    Args:
        tokens: [B, W] int32, x_{t-n+1} .. x_t then padding.
        valid: [B, W] bool, the first n True.
        ablate: [] int32, R.

    Returns:
        the cache (donated, updated in place) and full, ablated logits [B, V] float32 of x_t.
    """
    logits, cache = model_step(config, FULL, params, cache, tokens, valid)
    last = jnp.sum(valid, axis=1, dtype=jnp.int32) - 1  # [B]
    full = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    x_t = jnp.take_along_axis(tokens, last[:, None], axis=1)  # [B, 1]
    t = cache.length - 1  # [B]
    cut = (t - ablate)[:, None, None]  # [B, 1, 1]
    # `full` has no INT8 tier; slots with pos >= t - R (x_t's own included) become invisible.
    layers = tuple(
        layer.replace(pos=jnp.where(layer.pos >= cut, EMPTY, layer.pos)) for layer in cache.layers
    )
    # This step's cache write is unused, so XLA drops it: the real cache is never copied.
    ablated, _ = model_step(
        config,
        FULL,
        params,
        cache.replace(layers=layers, length=t),
        x_t,
        jnp.ones_like(x_t, dtype=bool),
    )
    return cache, full, ablated[:, 0]


def iter_ablation_logits(
    config: ModelConfig,
    params: Params,
    tokens: np.ndarray,
    positions: Sequence[int],
    *,
    ablate: int,
) -> Iterator[tuple[int, Array, Array]]:
    """For each sample position t (ascending): (t, full logits, ablated logits), [B, V] float32.

    Tokens are fed incrementally through a `full` cache in chunks of the widest gap between
    positions (one compilation); each chunk that ends at a sample position also runs x_t once
    more over the cache restricted to [0, t - R).

    Args:
        tokens: [B, N] int32 token ids (N > max(positions)).
        positions: ascending sample positions t with t >= ablate.
        ablate: R, recent tokens hidden from x_t (0 gives the full context again).
    """
    tokens = np.asarray(tokens, np.int32)
    pos = np.asarray(positions, np.int64)
    if (
        pos.ndim != 1
        or len(pos) == 0
        or np.any(np.diff(pos) <= 0)
        or ablate < 0
        or pos[0] < ablate
        or pos[-1] >= tokens.shape[1]
    ):
        raise ValueError(
            f"positions must ascend within [ablate={ablate}, {tokens.shape[1]}), got {pos.tolist()}"
        )
    b = tokens.shape[0]
    dtype = jax.tree.leaves(params)[0].dtype
    cache = new_cache(config, FULL, batch=b, max_len=int(pos[-1]) + 1, dtype=dtype)
    width = int(np.max(np.diff(pos), initial=1))
    r = jnp.asarray(ablate, jnp.int32)
    start = 0
    for t in pos.tolist():
        # Chunks of <= width tokens ending at ..., t - width, t (several before the first t).
        for end in range(t - width * ((t - start) // width), t + 1, width):
            seg = tokens[:, max(start, end - width + 1) : end + 1]
            padded = np.zeros((b, width), np.int32)
            padded[:, : seg.shape[1]] = seg
            valid = np.broadcast_to(np.arange(width)[None, :] < seg.shape[1], (b, width))
            cache, full, ablated = _advance(
                config, params, cache, jnp.asarray(padded), jnp.asarray(valid), r
            )
            start = end + 1
        yield t, full, ablated


@jax.jit
def _signals(full: Array, ablated: Array) -> Array:
    """[5, B] float32: c, 1 - H, sigmoid(m), p1 of `full` [B, V]; KL(full || ablated)."""
    conf = confidence(full)
    logp = jax.nn.log_softmax(full, axis=-1)
    logq = jax.nn.log_softmax(ablated, axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)  # unclamped: ~-1e-7 when equal
    return jnp.stack(
        [conf.score(), 1.0 - conf.entropy_norm, jax.nn.sigmoid(conf.margin), conf.top1, kl]
    )


def held_out_essays(model: LoadedModel, n_essays: int, n_tokens: int) -> list[str]:
    """The last `n_essays` of essay_names() with at least `n_tokens` tokens (sorted order).

    The first essays are used for tuning elsewhere; short ones (e.g. weird.txt, 462 tokens) are
    skipped so that every essay gives the same positions.
    """
    picked = []
    for name in reversed(essay_names()):
        if len(model.tokenizer.encode(essay_text(name))) >= n_tokens:
            picked.append(name)
            if len(picked) == n_essays:
                return picked[::-1]
    raise ValueError(f"only {len(picked)} essays have >= {n_tokens} tokens; asked for {n_essays}")


def run_confidence_kl(
    model: LoadedModel,
    *,
    texts: Sequence[str] | None = None,
    essays: int = 4,
    n_tokens: int = 1024,
    samples: int = 128,
    ablate: int = 32,
    min_context: int = 256,
    resamples: int = 1000,
    seed: int = 0,
    progress: bool = True,
) -> ConfKLResult:
    """Correlate CONF-KV's confidence with KL(p_full || p_ablated) over held-out essays.

    Args:
        model: a loaded model with a tokenizer.
        texts: essay file names; None takes `held_out_essays(model, essays, n_tokens)`.
        n_tokens: first N tokens of each essay (no BOS).
        samples: positions per essay, evenly spaced in [min_context, N - 1].
        ablate: R, recent tokens removed from x_t's context.
        resamples, seed: bootstrap of the 95% intervals.
    """
    from tqdm.auto import tqdm

    check_confidence_kl_args(
        n_tokens=n_tokens,
        samples=samples,
        ablate=ablate,
        min_context=min_context,
        texts=texts,
        essays=essays,
    )
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; cannot tokenize essays")
    names = list(texts) if texts else held_out_essays(model, essays, n_tokens)
    tokens = np.stack([essay_tokens(model, n_tokens, name) for name in names])  # [B, N]
    positions = sample_positions(n_tokens, samples, min_context)
    t0 = time.perf_counter()
    steps = iter_ablation_logits(model.config, model.params, tokens, positions, ablate=ablate)
    sig = [
        _signals(full, abl)
        for _, full, abl in tqdm(
            steps, total=samples, desc="conf-kl", unit="pos", disable=not progress
        )
    ]
    sig = np.asarray(jax.device_get(jnp.stack(sig, axis=2)), np.float64)  # [5, B, S]
    seconds = time.perf_counter() - t0
    flat = sig.reshape(5, -1)  # essay-major: sample i is essay i // S, position i % S
    kl, values = flat[4], dict(zip(SIGNALS, flat[:4], strict=True))
    ci = lambda stat: {
        k: list(bootstrap_ci(v, kl, stat, resamples=resamples, seed=seed))
        for k, v in values.items()
    }
    return ConfKLResult(
        model=model.config.name,
        texts=names,
        tokens=n_tokens,
        samples=samples,
        ablate=ablate,
        min_context=min_context,
        n=len(kl),
        pearson={k: pearson(v, kl) for k, v in values.items()},
        pearson_ci=ci(pearson),
        spearman={k: spearman(v, kl) for k, v in values.items()},
        spearman_ci=ci(spearman),
        mean_kl=float(kl.mean()),
        median_kl=float(np.median(kl)),
        resamples=resamples,
        seed=seed,
        seconds=seconds,
        sample_text=[n for n in names for _ in positions],
        positions=[int(t) for _ in names for t in positions],
        kl=kl.tolist(),
        values={k: v.tolist() for k, v in values.items()},
    )
