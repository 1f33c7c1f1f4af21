"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction"): after the context is prefilled, the model is asked to repeat it ("Repeat the
previous context exactly.") and every context KV pair is scored by the largest attention it
receives from any reconstruction query of its KV head's query group; the top pairs are kept,
whatever the question will be. kvpress: `KVzipPress` (n_sink=4, reconstruction in chunks of
2048 context tokens, each chunk's softmax over the sinks, that chunk and the repeat).

The reconstruction passes need the model, which policies never see: `kvzip_scores` is the
scoring rule over arrays, and `kvjax.eval.press_context` runs the passes through the public
`forward` and writes the scores into the cache (their time is part of its timing). The policy
keeps per KV head the top scores (kvpress by default thresholds over all layers and heads at
once, a head-adaptive budget it implements by masking; `adakv` is the per-layer form here).
In the generate loop on its own the policy has no reconstruction scores: like SnapKV's decode,
it then never evicts a kept token and a token leaving the window enters only a free slot.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvjax.policies._pressscored import PressScoredPolicy

Array = jax.Array
RECONSTRUCT_PROMPT = "\n\nRepeat the previous context exactly."
RECONSTRUCT_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVzipPolicy(PressScoredPolicy):
    """Keep the KV pairs that context reconstruction attends to most (scores from the press).

    Attributes:
        budget: tokens attended per step per KV head per layer (sinks and window included).
        n_sink: first tokens never evicted (kvpress: 4, scored 1.0, the largest).
        window: newest tokens never evicted (the engine needs >= 1).
        chunk: context tokens reconstructed per pass (kvpress: 2048).
    """

    name = "kvzip"
    chunk: int = 2048

    def __post_init__(self) -> None:
        if self.chunk < 1:
            raise ValueError(f"KVzipPolicy: chunk must be >= 1, got {self.chunk}")
        super().__post_init__()


def kvzip_scores(q: Array, k_sink: Array, k_ctx: Array, k_rep: Array) -> Array:
    """The attention each context key gets from reconstruction: max over queries and the KV
    head's query group of the softmax over (sinks, context chunk, causal repeat).

    Args:
        q: [B, T, Hq, D] reconstruction queries after RoPE.
        k_sink: [B, Hkv, N0, D] sink keys (N0 may be 0).
        k_ctx: [B, Hkv, S, D] the context chunk's keys.
        k_rep: [B, T, Hkv, D] the reconstruction's own keys (causal among themselves).

    Returns:
        [B, Hkv, S] float32 scores.
    """
    b, t, hq, d = q.shape
    hkv = k_ctx.shape[1]
    g = hq // hkv
    qg = q.astype(jnp.float32).reshape(b, t, hkv, g, d)
    f32 = lambda x: x.astype(jnp.float32)
    logit = lambda k: jnp.einsum("bthgd,bhsd->bhgts", qg, f32(k)) / jnp.sqrt(jnp.float32(d))
    causal = jnp.tril(jnp.ones((t, t), bool))
    rep = jnp.where(causal, logit(jnp.swapaxes(k_rep, 1, 2)), -jnp.inf)
    logits = jnp.concatenate([logit(k_sink), logit(k_ctx), rep], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    n0, s = k_sink.shape[2], k_ctx.shape[2]
    return jnp.max(probs[..., n0 : n0 + s], axis=(2, 3))
