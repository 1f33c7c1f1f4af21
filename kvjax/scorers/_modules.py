"""KVpop's learned eviction scorers (METHODS.md, "KVpop"): Flax modules for training and the same
math as pure functions of one layer's parameters for the cache policy.

Both predict r̂_t, the log future attention mass of token t, per (layer, KV head), from the
token's cached key (after RoPE) and value:

* `mlp` — stateless: a per-head 2-layer SiLU MLP on the token's features;
* `mlstm` — stateful: a per-head matrix-LSTM memory updated with every new K/V; token t is read
  *delayed*, when it leaves the protected window of w tokens (its query against the memory after
  token t + w), so its score sees the w tokens that followed it. `delayed=False` is the
  immediate-read ablation (read right after its own update).

Parameters are one pytree with leading [L, Hkv] axes on every leaf, separate from the model's.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

Array = jax.Array
Params = dict[str, Array]


class ScorerKind(enum.StrEnum):
    MLP = "mlp"
    MLSTM = "mlstm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScorerConfig:
    """Static shape of a scorer.

    Attributes:
        kind: `mlp` or `mlstm`.
        num_layers: L of the model it scores.
        num_kv_heads: Hkv of the model.
        head_dim: D of the model.
        hidden: width of the SiLU readout MLP.
        memory: mLSTM memory width (its matrix state is memory × memory per head).
        delayed: mLSTM reads a token when it leaves the protected window (False: immediately).
    """

    kind: ScorerKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden: int = 32
    memory: int = 16
    delayed: bool = True

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ScorerKind(self.kind))
        except ValueError:
            raise ValueError(
                f"ScorerConfig.kind must be one of {[k.value for k in ScorerKind]}, "
                f"got {self.kind!r}"
            ) from None
        for f in ("num_layers", "num_kv_heads", "head_dim", "hidden", "memory"):
            if getattr(self, f) <= 0:
                raise ValueError(f"ScorerConfig.{f} must be > 0, got {getattr(self, f)}")

    @property
    def feature_dim(self) -> int:
        """F = 2·D + 2: RMS-normalised key and value plus their log RMS."""
        return 2 * self.head_dim + 2

    @property
    def readout_dim(self) -> int:
        return self.feature_dim + (self.memory if self.kind == ScorerKind.MLSTM else 0)


@struct.dataclass
class MlstmState:
    """One layer's mLSTM memories.

    Attributes:
        c: [B, Hkv, M, M] float32 matrix memory (value × key).
        n: [B, Hkv, M] float32 normaliser.
        m: [B, Hkv] float32 log-scale stabiliser.
    """

    c: Array
    n: Array
    m: Array


def init_mlstm_state(config: ScorerConfig, batch: int) -> MlstmState:
    """Empty memories of one layer for `batch` sequences."""
    h, m = config.num_kv_heads, config.memory
    return MlstmState(
        c=jnp.zeros((batch, h, m, m), jnp.float32),
        n=jnp.zeros((batch, h, m), jnp.float32),
        m=jnp.zeros((batch, h), jnp.float32),
    )


def features(k: Array, v: Array) -> Array:
    """[..., D] key and value (any float dtype) → [..., 2D + 2] float32 scorer features."""
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    rk = jnp.sqrt(jnp.mean(k * k, axis=-1, keepdims=True) + 1e-6)
    rv = jnp.sqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6)
    return jnp.concatenate([k / rk, v / rv, jnp.log(rk), jnp.log(rv)], axis=-1)


def layer_params(params: Params, layer: int) -> Params:
    """One layer's parameters (every leaf has leading [L, Hkv] axes); `layer` may be a traced
    int32 scalar (a layer scan)."""
    if isinstance(layer, int):
        return jax.tree.map(lambda a: a[layer], params)
    at = lambda a: jax.lax.dynamic_index_in_dim(jnp.asarray(a), layer, 0, keepdims=False)
    return jax.tree.map(at, params)


def _add(x: Array, bias: Array) -> Array:
    """x + bias, bias broadcast over x's leading axes (rank promotion stays explicit)."""
    return x + bias.reshape((1,) * (x.ndim - bias.ndim) + bias.shape)


def readout(p: Params, x: Array) -> Array:
    """Per-head SiLU MLP: x [..., Hkv, F'] float32 → [..., Hkv] (p: one layer's params)."""
    h = jax.nn.silu(_add(jnp.einsum("...hf,hfk->...hk", x, p["w1"]), p["b1"]))
    return _add(jnp.einsum("...hk,hk->...h", h, p["w2"]), p["b2"])


def mlp_score(p: Params, k: Array, v: Array) -> Array:
    """MLP scores of tokens: k, v [B, T, Hkv, D] → [B, Hkv, T] float32 (p: one layer's params)."""
    return jnp.swapaxes(readout(p, features(k, v)), 1, 2)


def mlstm_step(p: Params, state: MlstmState, x_new: Array, x_read: Array):
    """Add one token to the memories, then read them with another token's query.

    Args:
        p: one layer's parameters.
        state: the layer's memories.
        x_new: [B, Hkv, F] features of the token entering the memory.
        x_read: [B, Hkv, F] features of the token being scored.

    Returns:
        (new state, [B, Hkv] scores of the read tokens).
    """
    mem = p["wk"].shape[-1]
    # The four projections of the entering token as one product (one kernel, not four)
    w = jnp.concatenate([p["wk"], p["wv"], p["wi"][..., None], p["wf"][..., None]], axis=-1)
    y = jnp.einsum("bhf,hfm->bhm", x_new, w)
    k, v = y[..., :mem] / math.sqrt(mem), y[..., mem : 2 * mem]
    i_gate = _add(y[..., 2 * mem], p["bi"])
    log_f = jax.nn.log_sigmoid(_add(y[..., 2 * mem + 1], p["bf"]))
    m = jnp.maximum(log_f + state.m, i_gate)
    i_s, f_s = jnp.exp(i_gate - m), jnp.exp(log_f + state.m - m)
    c = f_s[..., None, None] * state.c + i_s[..., None, None] * v[..., :, None] * k[..., None, :]
    n = f_s[..., None] * state.n + i_s[..., None] * k
    q = jnp.einsum("bhf,hfm->bhm", x_read, p["wq"])
    denom = jnp.maximum(jnp.abs(jnp.sum(n * q, axis=-1)), jnp.exp(-m))
    h = jnp.einsum("bhvk,bhk->bhv", c, q) / denom[..., None]
    score = readout(p, jnp.concatenate([h, x_read], axis=-1))
    return MlstmState(c=c, n=n, m=m), score


def mlstm_scan(p: Params, state: MlstmState, x_new: Array, x_read: Array):
    """`mlstm_step` over T tokens: x_new, x_read [B, T, Hkv, F] → (state, scores [B, Hkv, T])."""

    def body(st, xs):
        return mlstm_step(p, st, *xs)

    state, scores = jax.lax.scan(
        body, state, (jnp.swapaxes(x_new, 0, 1), jnp.swapaxes(x_read, 0, 1))
    )
    return state, jnp.transpose(scores, (1, 2, 0))


def _normal(scale: float):
    return lambda key, shape: scale * jax.random.normal(key, shape, jnp.float32)


class _Scorer(nn.Module):
    """Shared parameter creation: the readout MLP with leading [L, Hkv] axes."""

    config: ScorerConfig

    def _readout_params(self) -> Params:
        c = self.config
        lh = (c.num_layers, c.num_kv_heads)
        return {
            "w1": self.param("w1", _normal(c.readout_dim**-0.5), (*lh, c.readout_dim, c.hidden)),
            "b1": self.param("b1", nn.initializers.zeros, (*lh, c.hidden)),
            "w2": self.param("w2", _normal(c.hidden**-0.5), (*lh, c.hidden)),
            "b2": self.param("b2", nn.initializers.zeros, lh),
        }


class MlpScorer(_Scorer):
    """KVpop_mlp. Call on k, v [B, S, L, Hkv, D] → scores [B, L, Hkv, S] float32."""

    @nn.compact
    def __call__(self, k: Array, v: Array, *, window: int = 0) -> Array:
        del window
        p = self._readout_params()
        x = jnp.moveaxis(features(k, v), 2, 0)  # [L, B, S, H, F]
        out = jax.vmap(readout)(p, x)  # [L, B, S, H]
        return jnp.transpose(out, (1, 0, 3, 2))


class MlstmScorer(_Scorer):
    """KVpop (mLSTM). Call on k, v [B, S, L, Hkv, D] → scores [B, L, Hkv, S] float32.

    With `delayed`, token t's score is read after token t + window entered the memory; tokens
    that never leave the window (t > S − 1 − window) get score 0 (they are never ranked).
    """

    @nn.compact
    def __call__(self, k: Array, v: Array, *, window: int = 0) -> Array:
        c = self.config
        lh = (c.num_layers, c.num_kv_heads)
        fm = (*lh, c.feature_dim, c.memory)
        f = c.feature_dim
        p = self._readout_params() | {
            "wq": self.param("wq", _normal(f**-0.5), fm),
            "wk": self.param("wk", _normal(f**-0.5), fm),
            "wv": self.param("wv", _normal(f**-0.5), fm),
            "wi": self.param("wi", nn.initializers.zeros, (*lh, f)),
            "bi": self.param("bi", nn.initializers.zeros, lh),
            "wf": self.param("wf", nn.initializers.zeros, (*lh, f)),
            "bf": self.param("bf", nn.initializers.constant(3.0), lh),
        }
        b, s = k.shape[:2]
        delay = window if c.delayed else 0
        if not 0 <= delay < s:
            raise ValueError(f"window {window} must be in [0, {s}) for {s} tokens")
        x = jnp.moveaxis(features(k, v), 2, 0)  # [L, B, S, H, F]
        # Step τ reads token τ − delay; the first `delay` steps read a dummy (discarded).
        x_read = jnp.concatenate([jnp.zeros_like(x[:, :, :delay]), x[:, :, : s - delay]], axis=2)
        state = init_mlstm_state(c, b)
        run = lambda pl, xl, rl: mlstm_scan(pl, state, xl, rl)[1]
        out = jax.vmap(run)(p, x, x_read)  # [L, B, H, S] indexed by read step
        out = jnp.concatenate([out[..., delay:], jnp.zeros_like(out[..., :delay])], axis=-1)
        return jnp.swapaxes(out, 0, 1)


def make_scorer(config: ScorerConfig) -> _Scorer:
    """The Flax module of a config."""
    return (MlpScorer if config.kind == ScorerKind.MLP else MlstmScorer)(config=config)


def init_scorer_params(config: ScorerConfig, key: Array) -> Params:
    """Fresh parameters (the inner dict of the module's `params` collection)."""
    b, s = 1, 2
    x = jnp.zeros((b, s, config.num_layers, config.num_kv_heads, config.head_dim), jnp.float32)
    return make_scorer(config).init(key, x, x, window=0)["params"]
