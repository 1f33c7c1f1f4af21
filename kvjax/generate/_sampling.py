"""Token sampling: greedy, temperature, nucleus (top-p)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
        top_p: nucleus mass in (0, 1]; 1 disables it.
    """

    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"Sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")


GREEDY = Sampling()


def row_keys(key: Array, batch: int) -> Array:
    """[B] per-row keys from one key: row i gets fold_in(key, i), so a row's samples depend only
    on its own key, never on how many rows share the batch."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(batch, dtype=jnp.uint32))


def sample(logits: Array, key: Array, sampling: Sampling) -> Array:
    """Pick one token per row. logits: [B, V] float32 → [B] int32.

    key: [B] per-row keys (row b draws with key[b] alone), or one key (split into B rows).
    """
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        n_keep = jnp.maximum(jnp.sum(before < sampling.top_p, axis=-1), 1)
        cutoff = jnp.take_along_axis(sorted_logits, (n_keep - 1)[:, None], axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    keys = key if key.ndim == 1 else jax.random.split(key, logits.shape[0])
    draw = jax.vmap(lambda k, row: jax.random.categorical(k, row))
    return draw(keys, logits).astype(jnp.int32)
