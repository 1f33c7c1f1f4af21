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


def masked_logits(config, params, tokens, mask: np.ndarray) -> np.ndarray:
    """[S, V] float64 logits of a Llama-family model over tokens [S] where query i attends the
    positions j with mask[i, j]."""
    f = lambda a: None if a is None else np.asarray(a, np.float64)
    hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    g = hq // hkv
    tokens = np.asarray(tokens)
    s = len(tokens)
    x = f(params.embed)[tokens]
    for lp in params.layers:
        h = _rms(x, f(lp.attn_norm), config.norm_eps)
        lin = lambda w, b, h=h: h @ f(w) + (0 if b is None else f(b))
        q = _rope(lin(lp.wq, lp.bq).reshape(s, hq, d), config.rope_theta)
        k = _rope(lin(lp.wk, lp.bk).reshape(s, hkv, d), config.rope_theta)
        v = lin(lp.wv, lp.bv).reshape(s, hkv, d)
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # [S, Hq, D]
        logits = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(d)
        logits = np.where(mask[None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        o = np.einsum("hij,jhd->ihd", p, v).reshape(s, hq * d)
        x = x + o @ f(lp.wo)
        h = _rms(x, f(lp.mlp_norm), config.norm_eps)
        gate, up = h @ f(lp.w_gate), h @ f(lp.w_up)
        x = x + (gate / (1 + np.exp(-gate)) * up) @ f(lp.w_down)
    x = _rms(x, f(params.final_norm), config.norm_eps)
    head = f(params.embed).T if params.lm_head is None else f(params.lm_head)
    return x @ head


def masked_nll(config, params, tokens, mask: np.ndarray) -> np.ndarray:
    """[S-1] float64 NLL of tokens 1..S-1 under `masked_logits`."""
    logits = masked_logits(config, params, tokens, mask)[:-1]
    m = logits.max(-1, keepdims=True)
    logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return -logp[np.arange(len(tokens) - 1), np.asarray(tokens)[1:]]
