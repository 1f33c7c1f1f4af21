"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context
LLM Inference in Resource-Constrained Environments"): keep the keys least similar to the others.
The anchor is the mean of the unit-normalized keys held (cache and this call's tokens); a
token's score is minus its key's cosine similarity to the anchor. kvpress: `KeyDiffPress`
(the same score over the whole context, no window, no parameters)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._keyscored import KeyScoredPolicy, key_norm

_EPS = 1e-8  # torch's cosine_similarity / normalize floor on norms


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyDiffPolicy(KeyScoredPolicy):
    """Keep the most diverse keys: the lowest cosine similarity to the mean unit key.

    Every call rescores every held token against the new anchor (O(C·D) per layer and step:
    the anchor moves with each token, as the method demands).

    Attributes: `budget` and `window` (KeyScoredPolicy's; kvpress has no window).
    """

    name = "keydiff"

    def key_scores(self, layer, k_new, pos_new, valid):
        del pos_new
        k_old = layer.k.astype(jnp.float32)  # [B, H, C, D]
        k_in = k_new.swapaxes(1, 2).astype(jnp.float32)  # [B, H, T, D]
        live_old = (layer.pos >= 0)[..., None]
        live_new = jnp.broadcast_to(valid[:, None, :, None], k_in.shape[:3] + (1,))
        unit = lambda k: k / jnp.maximum(key_norm(k), _EPS)[..., None]
        total = jnp.sum(jnp.where(live_old, unit(k_old), 0.0), axis=2) + jnp.sum(
            jnp.where(live_new, unit(k_in), 0.0), axis=2
        )
        count = jnp.sum(live_old, axis=2) + jnp.sum(live_new, axis=2)  # [B, H, 1]
        anchor = total / jnp.maximum(count, 1).astype(jnp.float32)  # [B, H, D]
        a_norm = jnp.maximum(key_norm(anchor), _EPS)[..., None]  # [B, H, 1]

        def cos(k):
            dot = jnp.einsum("bhnd,bhd->bhn", k, anchor)
            return dot / (jnp.maximum(key_norm(k), _EPS) * a_norm)

        return -cos(k_old), -cos(k_in)
