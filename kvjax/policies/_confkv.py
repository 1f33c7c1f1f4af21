"""CONF-KV: a confidence-gated KV budget with mixed precision (the seed summary in
shared/seeds/000_*.txt; details in shared/METHODS.md).

Each decode step the next-token distribution's confidence
c = 0.4·(1 − Ĥ) + 0.3·σ(log p1 − log p2) + 0.3·p1 picks the budget: the tight N_high when
c ≥ τ, the loose N_low otherwise, so memory follows a sawtooth. Tokens older than the protected
window are ranked by an EMA of their attention mass plus a recency bonus; the lowest go, for
good. The most recent W tokens stay in full precision, older retained tokens in INT8 (quantized
once, when they leave the window). CONF-KV-L scales budgets per layer (pyramid, deeper = smaller).

Parameters the sources do not publish (τ, N_high, N_low, EMA decay, recency weight, P, W) are
fields with our defaults, documented in docs/decisions.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kvjax.policies._base import cached_tokens
from kvjax.policies._confidence import confidence
from kvjax.policies._ranked import RankedPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfKVPolicy(RankedPolicy):
    """Confidence-gated budget, EMA + recency ranking, protected window, INT8 older tokens.

    Attributes:
        budget: N_low, the loose budget (tokens attended per step per KV head per layer, the
            current one included), used when uncertain.
        tight_ratio: N_high = round(tight_ratio · budget), used when confident (ours: 0.5).
        tau: confidence threshold τ (ours: 0.5).
        weights: (w_H, w_m, w_p) of the confidence score (paper: 0.4, 0.3, 0.3).
        ema_decay: decay of the attention-mass EMA (ours: 0.9).
        recency_weight: λ in priority = EMA + λ · (pos + 1) / (cur + 1) (ours: 0, the best of
            0/0.01/0.1/1 in the sweep of docs/results.md; recency still protects the window).
        protected: P, newest tokens never evicted (ours: 32).
        fp_window: W, newest tokens kept in full precision when int8 is on (ours: 64).
        int8: store retained tokens older than W in INT8 (per token and KV head).
        pyramid: CONF-KV-L slope α: layer l gets budget · (1 + α (1 − 2l/(L−1))); 0 = flat.
        num_layers: L, the model's layer count, for pyramid budgets. None (the default): taken
            from the model by the generate loop / `new_cache`; a count that differs from the
            model's is refused there (ValueError).
        position_shift: attend each kept key at its position within the cache, the query
            one past them (StreamingLLM §3.2 over the kept set; `RankedPolicy`), for streams
            past the model's trained context. Default False: original positions.
    """

    name = "confkv"
    budget: int
    tight_ratio: float = 0.5
    tau: float = 0.5
    weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
    ema_decay: float = 0.9
    recency_weight: float = 0.0
    protected: int = 32
    fp_window: int = 64
    int8: bool = True
    pyramid: float = 0.0
    num_layers: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("tight_ratio", 0 < self.tight_ratio <= 1, "(0, 1]"),
            ("tau", 0 <= self.tau <= 1, "[0, 1]"),
            ("ema_decay", 0 <= self.ema_decay < 1, "[0, 1)"),
            ("recency_weight", self.recency_weight >= 0, ">= 0"),
            ("protected", self.protected >= 1, ">= 1"),
            ("fp_window", self.fp_window >= 1, ">= 1"),
            ("pyramid", 0 <= self.pyramid < 1, "[0, 1)"),
            ("num_layers", self.num_layers is None or self.num_layers >= 1, ">= 1 or None"),
        ]
        for field, ok, allowed in checks:
            if not ok:
                raise ValueError(
                    f"ConfKVPolicy.{field} must be in {allowed}, got {getattr(self, field)}"
                )
        if len(self.weights) != 3 or min(self.weights) < 0:
            raise ValueError(
                f"ConfKVPolicy.weights must be 3 non-negative numbers, got {self.weights}"
            )
        # Unknown layer count: check the smallest layer any pyramid of >= 2 layers has.
        layers = range(self.num_layers) if self.num_layers else (None,)
        for li in layers:
            tight = self._tight(li)
            where = "the deepest layer" if li is None else f"layer {li}"
            if cached_tokens(tight) - self.ring < 1:
                raise ValueError(
                    f"ConfKVPolicy: budget {self.budget} is too small — the tight budget "
                    f"{tight} ({where}) must exceed the current token + the protected "
                    f"window {self.ring} "
                    f"(protected={self.protected}, fp_window={self.fp_window if self.int8 else 0})"
                )
        self._check()

    @property
    def ring(self) -> int:
        return max(self.protected, self.fp_window) if self.int8 else self.protected

    def _scale(self, layer_index: int | None) -> float:
        """Budget scale of a layer; None = the deepest layer (the smallest budget)."""
        if self.pyramid == 0 or self.num_layers == 1:
            return 1.0
        if layer_index is None or (self.num_layers is None and layer_index == 0):
            # The first and deepest layers' scales do not depend on the layer count.
            return 1.0 + self.pyramid * (-1.0 if layer_index is None else 1.0)
        if self.num_layers is None:
            raise ValueError(
                "ConfKVPolicy.num_layers is None: pyramid budgets need the model's layer count "
                "(kvjax.generate, new_cache and model_step fill it in; or set num_layers)"
            )
        return 1.0 + self.pyramid * (1.0 - 2.0 * layer_index / (self.num_layers - 1))

    def scans_layers(self) -> bool:
        return self.pyramid == 0 or self.num_layers == 1

    def max_budget(self, layer_index: int) -> int:
        return max(1, round(self.budget * self._scale(layer_index)))

    def _tight(self, layer_index: int) -> int:
        return max(1, round(self.budget * self.tight_ratio * self._scale(layer_index)))

    # Policy-wide state: [B] bool, "confident" at the last step (tight budget in force).
    def init_state(self, batch):
        return jnp.zeros((batch,), bool)

    def begin_step(self, state, logits, valid):
        c = confidence(logits).score(*self.weights)
        return jnp.where(valid, c >= self.tau, state)

    def current_budget(self, state, batch):
        return jnp.where(state, self._tight(0), self.max_budget(0)).astype(jnp.int32)

    def ranked_budget(self, state, layer_index, batch):
        n = jnp.where(state, self._tight(layer_index), self.max_budget(layer_index))
        return (cached_tokens(n) - self.ring).astype(jnp.int32)

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del pos, cur, state, layer_index
        return self.ema_decay * score + (1.0 - self.ema_decay) * mass

    def init_score(self, mass, pos, state, layer_index):
        del pos, state, layer_index
        return (1.0 - self.ema_decay) * mass

    def priority(self, score, pos, cur, layer_index):
        del layer_index
        recency = (pos.astype(jnp.float32) + 1.0) / (cur.astype(jnp.float32) + 1.0)
        return score + self.recency_weight * recency
