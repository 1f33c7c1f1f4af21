"""Long-stream evaluation: perplexity per chunk of a token stream far past the model's context
(the essays concatenated, looped), teacher-forced one token per decode step through each policy's
cache, with live/physical bytes and step time per chunk (StreamingLLM's figure)."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache import (
    attended_slots_per_layer,
    physical_bytes,
    slot_bytes_per_layer,
    slots_to_bytes,
)
from kvjax.generate import model_step, new_cache
from kvjax.policies import BUDGETLESS, Policy
from kvjax.weights import LoadedModel, essay_names, essay_text


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamChunk:
    """One chunk of one policy's stream (JSON-ready via dataclasses.asdict)."""

    policy: str
    budget: int | None
    chunk: int
    start: int
    end: int
    ppl: float
    live_bytes_mean: float
    live_bytes_peak: int
    physical_bytes: int
    ms_per_token: float


def stream_tokens(model: LoadedModel, n_tokens: int) -> np.ndarray:
    """[n_tokens] int32: every essay's tokens, concatenated in name order, looped as needed."""
    if model.tokenizer is None:
        raise ValueError(f"model {model.source} has no tokenizer; cannot tokenize essays")
    ids: list[int] = []
    for name in essay_names():
        ids += model.tokenizer.encode(essay_text(name))
    if not ids:
        raise ValueError("the essays tokenize to nothing")
    reps = math.ceil(n_tokens / len(ids))
    return np.asarray((ids * reps)[:n_tokens], np.int32)


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _segment(config, policy, params, cache, tokens, targets):
    """Feed tokens [1, T] one decode step each → cache, NLL [T], attended units [T, L, 3]."""

    def body(cache, xs):
        tok, tgt = xs
        logits, cache = model_step(
            config, policy, params, cache, tok[:, None], jnp.ones((1, 1), bool)
        )
        nll = -jax.nn.log_softmax(logits[0, 0])[tgt[0]]
        return cache, (nll, attended_slots_per_layer(cache)[0])

    return jax.lax.scan(body, cache, (tokens.T, targets.T))


def run_stream(
    model: LoadedModel,
    policy: Policy,
    tokens: np.ndarray,
    *,
    budget: int | None = None,
    chunk: int = 4096,
    segment: int = 512,
    max_full: int = 8192,
    cache_dtype=None,
    progress: bool = True,
    on_chunk=None,
) -> list[StreamChunk]:
    """Perplexity per `chunk` tokens of `tokens` [N] through `policy`, one token per step.

    The policies that take no budget (`full`, `kivi`: their caches grow with the stream, and past
    the model's context their positions break it) stop at `max_full` tokens.
    Progress (one line per chunk) goes to stderr; `on_chunk(rows)`, if given, is called with the
    rows so far after each chunk (the CLI saves them, so a run cut short keeps what it measured).
    """
    if chunk < 1 or segment < 1 or chunk % segment:
        raise ValueError(f"chunk ({chunk}) must be a positive multiple of segment ({segment})")
    n = len(tokens) - 1
    if policy.name in BUDGETLESS:
        n = min(n, max_full)
    n = n // segment * segment
    if n < segment:
        raise ValueError(f"{len(tokens)} tokens are fewer than one segment ({segment} + 1)")
    dtype = cache_dtype or jax.tree_util.tree_leaves(model.params)[0].dtype
    cache = new_cache(model.config, policy, batch=1, max_len=n, dtype=dtype)
    unit = slot_bytes_per_layer(cache)
    phys = physical_bytes(cache)
    inp, tgt = tokens[:-1], tokens[1:]
    rows, nll_c, live_c, t_c = [], [], [], 0.0
    for start in range(0, n, segment):
        sl = slice(start, start + segment)
        t0 = time.perf_counter()
        cache, (nll, live) = _segment(
            model.config, policy, model.params, cache, inp[None, sl], tgt[None, sl]
        )
        nll = np.asarray(nll, np.float64)
        t_c += time.perf_counter() - t0 if start else 0.0  # the first segment compiles
        nll_c.append(nll)
        live_c.append(slots_to_bytes(np.asarray(live), unit))
        end = start + segment
        if end % chunk == 0 or end == n:
            c_nll, c_live = np.concatenate(nll_c), np.concatenate(live_c)
            timed = len(c_nll) - (segment if len(rows) == 0 else 0)
            rows.append(
                StreamChunk(
                    policy=policy.name,
                    budget=budget,
                    chunk=len(rows),
                    start=end - len(c_nll),
                    end=end,
                    ppl=math.exp(c_nll.mean()),
                    live_bytes_mean=float(c_live.mean()),
                    live_bytes_peak=int(c_live.max()),
                    physical_bytes=phys,
                    ms_per_token=1e3 * t_c / timed if timed > 0 else float("nan"),
                )
            )
            if progress:
                r = rows[-1]
                print(
                    f"stream [{policy.name}] tokens {r.start}-{r.end} of {n}: ppl {r.ppl:.3f}, "
                    f"live {r.live_bytes_peak / 2**20:.2f} MiB, {r.ms_per_token:.2f} ms/token",
                    file=sys.stderr,
                    flush=True,
                )
            if on_chunk is not None:
                on_chunk(list(rows))
            nll_c, live_c, t_c = [], [], 0.0
    return rows


def plot_stream(rows: list[StreamChunk], path: str, *, title: str) -> None:
    """PPL per chunk, one line per policy (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for name in dict.fromkeys(r.policy for r in rows):
        mine = [r for r in rows if r.policy == name]
        ax.plot([r.end for r in mine], [r.ppl for r in mine], marker=".", label=name)
    ax.set_xlabel("tokens streamed")
    ax.set_ylabel("perplexity of the chunk")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
