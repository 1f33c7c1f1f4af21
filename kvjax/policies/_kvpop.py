"""KVpop (METHODS.md, "KVpop"): eviction decided by a learned scorer trained to predict each
token's future attention. Per KV head a fixed budget B = s + w + k: s attention sinks, a protected
window of the w newest tokens, and k long-range slots that keep the highest static priorities.

A token's priority is computed once, when it leaves the window: the `mlp` scorer reads its key and
value; the `mlstm` scorer reads it (delayed) against a per-head matrix memory that has absorbed
every token up to the current one (LayerCache.aux holds the memories). A scorer trained with
immediate reads (the ablation) is read as each token arrives instead. Priorities never change
afterwards, so a running top-k is exact: a leaving token replaces the lowest kept priority if it
beats it — O(B) per decode step (RankedPolicy's engine), no sort of the history.

The scorer's parameters come from a scorer file: a shipped one for the embedded SmolLM2-135M
(`scorer="mlstm"` or `"mlp"`) or any file written by `kvjax train-scorer`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.cache import CacheSpec
from kvjax.policies._base import Policy
from kvjax.policies._ranked import RankedPolicy
from kvjax.scorers import (
    ScorerConfig,
    ScorerKind,
    features,
    init_mlstm_state,
    layer_params,
    load_scorer,
    mlstm_step,
    readout,
    resolve_scorer,
)

Array = jax.Array


@functools.cache
def _scorer(path: str) -> tuple[ScorerConfig, dict]:
    config, params, _ = load_scorer(path)
    return config, params


@struct.dataclass
class _NewScores:
    """Stand-in for the policy state inside RankedPolicy.write: scores [B, Hkv, T] of this call's
    tokens (those that already left the window in this call; 0 for the rest); at a decode step
    of a stacked cache also (priority, scored) [B, Hkv, 1] of the ring token leaving now, given
    to the ranked write instead of written into its ring slot, which the new token overwrites
    in the same step."""

    scores: Array
    leaving: tuple[Array, Array] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVpopPolicy(RankedPolicy):
    """Sinks + protected window + learned top-k.

    Attributes:
        budget: B = 1 + sinks + window + k, tokens attended per step per KV head per layer
            (the current token included).
        sinks: s, first tokens never evicted (paper: 4).
        window: w, newest tokens never evicted (paper: 256 at B = 2048; ours: 32, the window the
            shipped scorers were trained with — their mLSTM reads a token w tokens late).
        scorer: shipped scorer name (`mlstm`, `mlp`) or a scorer file path.
        decay: λ, temporal decay: priority = r̂_t + λ·t, METHODS' "+ temporal decay" (−λ·(q − t)
            ranks like +λ·t at any q, so priorities stay static). Ours: 0.005 per token, the best
            of {0, 0.005, 0.01, 0.02} on a tuning essay (docs/results.md).
        position_shift: attend each kept key at its position within the cache, the query
            one past them (StreamingLLM §3.2 over the kept set; `RankedPolicy`), for streams
            past the model's trained context. Default False: original positions.
    """

    name = "kvpop"
    uses_attention_mass: ClassVar[bool] = False  # priorities come from the scorer
    budget: int
    sinks: int = 4
    window: int = 32
    scorer: str = "mlstm"
    decay: float = 0.005

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"KVpopPolicy.sinks must be >= 0, got {self.sinks}")
        if self.window < 1:
            raise ValueError(f"KVpopPolicy.window must be >= 1, got {self.window}")
        if self.budget <= 1 + self.sinks + self.window:
            raise ValueError(
                f"KVpopPolicy.budget ({self.budget}) must exceed the current token + sinks + "
                f"window (1 + {self.sinks} + {self.window}): no long-range slots are left"
            )
        if not self.decay >= 0:
            raise ValueError(f"KVpopPolicy.decay must be >= 0, got {self.decay}")
        self._check()
        _scorer(str(resolve_scorer(self.scorer)))  # a missing or bad file fails here

    @property
    def ring(self) -> int:
        return self.window

    @property
    def scorer_config(self) -> ScorerConfig:
        return _scorer(str(resolve_scorer(self.scorer)))[0]

    def _fit(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        c = self.scorer_config
        want = (c.num_layers, c.num_kv_heads, c.head_dim)
        if (num_layers, num_kv_heads, head_dim) != want:
            raise ValueError(
                f"kvpop scorer {self.scorer!r} was trained for a model with (layers, KV heads, "
                f"head_dim) = {want}, not {(num_layers, num_kv_heads, head_dim)}; train one "
                "for this model with `kvjax train-scorer --model ...`"
            )

    def init_layer_aux(self, spec: CacheSpec):
        self._fit(spec.num_layers, spec.num_kv_heads, spec.head_dim)
        if self.scorer_config.kind != ScorerKind.MLSTM:
            return None
        return tuple(init_mlstm_state(self.scorer_config, spec.batch) for _ in spec.capacities)

    # Priorities are static: attention mass never changes them; new tokens get theirs on leaving.
    def priority(self, score, pos, cur, layer_index):
        del cur, layer_index
        if self.decay == 0:
            return score
        return score + jnp.float32(self.decay) * pos.astype(jnp.float32)

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del mass, pos, cur, state, layer_index
        return score

    def init_score(self, mass, pos, state, layer_index):
        del mass, pos, layer_index
        return state.scores

    def write(self, layer, k_new, v_new, pos_new, valid, stats, state, *, layer_index):
        del state  # kvpop keeps no policy-wide state
        layer, scores, aux = self._prepare(layer, k_new, v_new, pos_new, valid, layer_index)
        out = super().write(
            layer, k_new, v_new, pos_new, valid, stats, _NewScores(scores), layer_index=layer_index
        )
        return out.replace(aux=aux)

    def write_stack(self, layers, k_new, v_new, pos_new, valid, stats, state):
        """A decode step over a stacked cache: the scorer's work vmapped over the layers, then
        the ranked engine's stacked decode (one budget-shrink cond for all layers, where a
        vmapped `write` would run the eviction's sort every step as a select)."""
        if k_new.shape[2] != 1:
            return Policy.write_stack(self, layers, k_new, v_new, pos_new, valid, stats, state)
        n = layers.pos.shape[0]
        lis = jnp.arange(n, dtype=jnp.int32)
        # Every layer's scorer parameters, mapped over as they are stacked (indexing them by
        # the mapped layer index was a gather per leaf)
        params = _scorer(str(resolve_scorer(self.scorer)))[1]
        if jax.tree.leaves(params)[0].shape[0] != n:
            self._fit(n, *k_new.shape[-2:])  # raises: the scorer's layer count differs
        # The ring token this step pushes out, read once for every layer: the scorer reads it
        # and the ranked write moves it
        ring = self.leaving_stack(layers, pos_new)
        prep = lambda ly, k, v, li, p, r: self._prepare(ly, k, v, pos_new, valid, li, p, r)
        layers, (scores, scored), aux = jax.vmap(prep)(layers, k_new, v_new, lis, params, ring)
        new = _NewScores(scores, scored)
        out = self._decode_stack(
            layers, k_new, v_new, pos_new, valid, stats, new, state_axis=0, leaving=ring
        )
        return out.replace(aux=aux)

    def _leaving(self, leaving, state):
        if state.leaving is None:
            return leaving
        score, scored = state.leaving
        return leaving.replace(score=jnp.where(scored, score, leaving.score))

    def _prepare(self, layer, k_new, v_new, pos_new, valid, layer_index, p=None, ring=None):
        """The scorer's part of a write: (layer with its leaving ring tokens' priorities set,
        scores [B, Hkv, T] of this call's tokens for the ranked write, the scorer's new aux).
        `p`: the layer's scorer parameters (None: taken at `layer_index`). `ring` (a one-token
        decode step): the ring token it pushes out, [B, Hkv, 1] Tokens read by the caller; its
        priority is then not written into its slot (the new token takes that slot now) but
        returned with the scores, as (scores, (priority, scored) [B, Hkv, 1]), for
        `_leaving`."""
        b, t, h, d = k_new.shape
        config, params = _scorer(str(resolve_scorer(self.scorer)))
        # A layer scan passes layer_index traced (the scorer's layer count was checked when
        # the cache was made, `init_layer_aux`).
        deep = isinstance(layer_index, int) and layer_index >= config.num_layers
        if deep or (h, d) != (config.num_kv_heads, config.head_dim):
            self._fit(layer_index + 1 if deep else config.num_layers, h, d)  # raises
        if p is None:
            p = layer_params(params, layer_index)
        if config.kind == ScorerKind.MLSTM and not config.delayed:
            # The immediate-read ablation: each token is scored right after its own update and
            # carries that score through the window.
            x = features(k_new, v_new)
            aux, r = self._mlstm(p, layer.aux, x, x, valid)
            if ring is not None:  # the leaving token was scored when it arrived
                return layer, (r, (r[..., :1], jnp.zeros_like(r[..., :1], bool))), aux
            return layer, r, aux
        w = self.window
        # Step τ of this call writes token pos_new[τ] and pushes out token pos_new[τ] − w: the new
        # token τ − w if τ >= w, else the ring token in slot (pos_new[τ] − w) mod w.
        leave_pos = pos_new - w  # [B, T]
        from_new = jnp.broadcast_to(jnp.arange(t)[None, :] >= w, (b, t))
        ring_slot = jnp.mod(leave_pos, w)
        ring_tok = lambda a: jnp.take_along_axis(
            a[:, :, :w],
            jnp.broadcast_to(ring_slot[:, None, :, None], (b, h, t, a.shape[-1])),
            2,
            mode="clip",  # in range (mod w): no bounds mask
        )  # [B, H, T, D]
        new_tok = jnp.take(k_new, jnp.clip(jnp.arange(t) - w, 0, t - 1), axis=1, mode="clip")
        new_val = jnp.take(v_new, jnp.clip(jnp.arange(t) - w, 0, t - 1), axis=1, mode="clip")
        sel = from_new[:, :, None, None]
        ring_k, ring_v = (
            (ring_tok(layer.k), ring_tok(layer.v)) if ring is None else (ring.k, ring.v)
        )
        k_out = jnp.where(sel, new_tok, jnp.swapaxes(ring_k, 1, 2).astype(k_new.dtype))
        v_out = jnp.where(sel, new_val, jnp.swapaxes(ring_v, 1, 2).astype(v_new.dtype))
        x_out = features(k_out, v_out)  # [B, T, H, F] features of the leaving tokens
        aux = layer.aux
        if config.kind == ScorerKind.MLSTM:
            aux, r = self._mlstm(p, aux, features(k_new, v_new), x_out, valid)
        else:
            r = jnp.swapaxes(readout(p, x_out), 1, 2)  # [B, H, T]
        # Leaving ring tokens get their priority in place; leaving new tokens through _NewScores.
        if ring is None:
            ring_pos = jnp.take_along_axis(
                layer.pos[:, :, :w], ring_slot[:, None, :], axis=2, mode="clip"
            )
        else:
            ring_pos = ring.pos
        old = valid & ~from_new & (leave_pos >= 0)
        old = old[:, None, :] & (ring_pos == leave_pos[:, None, :])  # [B, H, T]
        shifted = jnp.take(r, jnp.clip(jnp.arange(t) + w, 0, t - 1), axis=2, mode="clip")
        gone = (jnp.arange(t) + w < t)[None, None, :]
        scores = jnp.where(gone, shifted, 0.0)
        if ring is not None:
            return layer, (scores, (r, old)), aux
        slot = jnp.where(old, ring_slot[:, None, :], layer.capacity)
        bi, hi = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
        layer = layer.replace(score=layer.score.at[bi, hi, slot].set(r, mode="drop"))
        return layer, scores, aux

    @staticmethod
    def _mlstm(p, state, x_new: Array, x_read: Array, valid: Array):
        """Absorb this call's valid tokens one by one; after each, read the token it pushed out.
        x_new, x_read: [B, T, H, F]; valid [B, T]. Returns (state, scores [B, H, T])."""

        def body(st, xs):
            xn, xr, ok = xs
            new, score = mlstm_step(p, st, xn, xr)
            keep = lambda a, o: jnp.where(ok.reshape((-1,) + (1,) * (a.ndim - 1)), a, o)
            return jax.tree.map(keep, new, st), score

        xs = (jnp.swapaxes(x_new, 0, 1), jnp.swapaxes(x_read, 0, 1), jnp.swapaxes(valid, 0, 1))
        if x_new.shape[1] == 1:  # a decode step: the body once, no loop (fewer kernels)
            state, score = body(state, jax.tree.map(lambda a: a[0], xs))
            return state, score[..., None]
        state, scores = jax.lax.scan(body, state, xs)
        return state, jnp.transpose(scores, (1, 2, 0))
