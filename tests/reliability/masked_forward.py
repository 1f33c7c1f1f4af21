"""An independent reference for positional policies: the full-attention forward of a Llama-family
model with an explicit [S, S] mask of which positions each query may see (no cache, no slots),
written from the model's definition in float64 NumPy."""

import numpy as np


def window_mask(s: int, budget: int) -> np.ndarray:
    """[S, S] bool: query i sees the `budget` most recent positions, itself included."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return (j <= i) & (j > i - budget)


def streaming_mask(s: int, budget: int, sinks: int) -> np.ndarray:
    """[S, S] bool: the first `sinks` positions plus the `budget - sinks` most recent (itself
    included), StreamingLLM's cache of `budget` tokens."""
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    return (j <= i) & ((j < sinks) | (j > i - (budget - sinks)))


def cache_positions(s: int, budget: int, sinks: int) -> tuple[np.ndarray, np.ndarray]:
    """StreamingLLM's positions within the cache (Xiao et al., 2023, §3.2), written from the
    paper's rule: the cache holds the sinks 0..sinks-1 and then the R = budget-1-sinks most
    recent tokens in order; query i sits at cache position min(i, sinks + R), a sink j at j,
    a recent token at its index in the cache (its position minus the tokens dropped before
    it, i - min(i, sinks + R)).

    Returns:
        query_pos [S] and key_pos [S, S] (key j as query i sees it; only entries that
        `streaming_mask` lets query i see are meaningful) int64.
    """
    full = budget - 1  # sinks + R tokens cached
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    query_pos = np.minimum(np.arange(s), full)
    dropped = i - query_pos[:, None]
    return query_pos, np.where(j < sinks, j, j - dropped)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):
    """x: [S, H, D], half-split rotary embedding at positions 0..S-1."""
    s, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(s, dtype=np.float64)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_at(x, pos, theta):
    """x: [..., H, D] rotated to positions pos [...] (half-split rotary embedding)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, np.float64)[..., None, None] * inv  # [..., 1, D/2]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1
    )


def _f64(a):
    return None if a is None else np.asarray(a, np.float64)


def _forward(config, params, tokens, attention_logits) -> np.ndarray:
    """[S, V] float64 logits of a Llama-family model over tokens [S], each layer's attention
    logits given by `attention_logits(layer, q, k)`: the layer's q [S, Hq, D] and k [S, Hkv, D]
    (float64, before RoPE) to [Hq, S, S] scaled logits, -inf where a query may not look."""
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    g = hq // hkv
    tokens = np.asarray(tokens)
    s = len(tokens)
    x = _f64(params.embed)[tokens]
    for layer, lp in enumerate(params.layers):
        h = _rms(x, _f64(lp.attn_norm), config.norm_eps)
        lin = lambda w, b, h=h: h @ _f64(w) + (0 if b is None else _f64(b))
        q, k = lin(lp.wq, lp.bq).reshape(s, hq, d), lin(lp.wk, lp.bk).reshape(s, hkv, d)
        v = np.repeat(lin(lp.wv, lp.bv).reshape(s, hkv, d), g, axis=1)  # [S, Hq, D]
        logits = attention_logits(layer, q, k)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", p, v).reshape(s, hq * d)
        x = x + o @ _f64(lp.wo)
        h = _rms(x, _f64(lp.mlp_norm), config.norm_eps)
        gate, up = h @ _f64(lp.w_gate), h @ _f64(lp.w_up)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ _f64(lp.w_down)
    x = _rms(x, _f64(params.final_norm), config.norm_eps)
    head = _f64(params.embed).T if params.lm_head is None else _f64(params.lm_head)
    return x @ head


def _nll(logits, tokens) -> np.ndarray:
    """[S-1] float64 NLL of tokens [S] 1..S-1 under logits [S, V] float64."""
    logits = logits[:-1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return -logp[np.arange(len(tokens) - 1), np.asarray(tokens)[1:]]


def masked_logits(config, params, tokens, mask: np.ndarray, positions=None) -> np.ndarray:
    """[S, V] float64 logits of a Llama-family model over tokens [S] where query i attends the
    positions j with mask[i, j]. `positions`: None (token i at RoPE position i), or
    (query_pos [S], key_pos [S, S]) giving each (query, key) pair its RoPE positions
    (`cache_positions`; the per-pair keys cost S·S·Hkv·D, for short sequences)."""
    g = config.num_heads // config.num_kv_heads

    def attention_logits(layer, q, k):
        s, d = len(q), config.head_dim
        if positions is None:
            q, k = _rope(q, config.rope_theta), _rope(k, config.rope_theta)
            logits = np.einsum("ihd,jhd->hij", q, np.repeat(k, g, axis=1)) / np.sqrt(d)
        else:
            q = _rope_at(q, positions[0], config.rope_theta)
            k = _rope_at(np.broadcast_to(k, (s, *k.shape)), positions[1], config.rope_theta)
            logits = np.einsum("ihd,ijhd->hij", q, np.repeat(k, g, axis=2)) / np.sqrt(d)
        return np.where(mask[None], logits, -np.inf)

    return _forward(config, params, tokens, attention_logits)


def masked_nll(config, params, tokens, mask: np.ndarray, positions=None) -> np.ndarray:
    """[S-1] float64 NLL of tokens 1..S-1 under `masked_logits`."""
    return _nll(masked_logits(config, params, tokens, mask, positions), tokens)


def rank_positions(kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions within the cache for any kept set, StreamingLLM's rule (§3.2) read off the
    mask: query i attends the keys j with kept[..., i, j] (itself included); a kept key of rank
    r among them (by position) sits at r, and the query, the last of its row, at the count of
    the others.

    Args:
        kept: [..., S, S] bool, query i attends key j (j <= i, kept[..., i, i] True).

    Returns:
        query_pos [..., S] and key_pos [..., S, S] int64 (only kept entries are meaningful).
    """
    key_pos = np.cumsum(kept, axis=-1) - 1
    query_pos = np.diagonal(key_pos, axis1=-2, axis2=-1)
    return query_pos, key_pos


def _rope_per(x, pos, theta):
    """x: [..., D] rotated to positions pos [...] (one position per vector)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate(
        [x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1
    )


def per_head_nll(config, params, tokens, kept, positions=None) -> np.ndarray:
    """[S-1] float64 NLL of tokens 1..S-1 of a Llama-family model where each layer's KV head
    attends its own kept set: query i of the KV head h of layer l sees key j iff
    kept[l, h, i, j] (its G query heads share it, as they share the cache).

    Args:
        kept: [L, Hkv, S, S] bool.
        positions: None (token i at RoPE position i), or (query_pos [L, Hkv, S], key_pos
            [L, Hkv, S, S]) giving each (query, key) pair its RoPE positions (`rank_positions`).
    """
    hq, d = config.num_heads, config.head_dim
    g = hq // config.num_kv_heads
    s = len(tokens)
    idx = np.arange(s)
    if positions is None:
        positions = (np.broadcast_to(idx, kept.shape[:-1]), np.broadcast_to(idx, kept.shape))

    def attention_logits(layer, q, k):
        mask = np.repeat(kept[layer], g, axis=0)  # [Hq, S, S]
        qpos = np.repeat(positions[0][layer], g, axis=0)  # [Hq, S]
        kpos = np.repeat(positions[1][layer], g, axis=0)  # [Hq, S, S]
        q = _rope_per(q.transpose(1, 0, 2), qpos, config.rope_theta)  # [Hq, S, D]
        k = np.repeat(k, g, axis=1).transpose(1, 0, 2)  # [Hq, S, D]
        k = _rope_per(np.broadcast_to(k[:, None], (hq, s, s, d)), kpos, config.rope_theta)
        logits = np.einsum("hid,hijd->hij", q, k) / np.sqrt(d)
        return np.where(mask, logits, -np.inf)

    return _nll(_forward(config, params, tokens, attention_logits), tokens)
