"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): keys with a *low* L2 norm attract the most attention, so the tokens with the
lowest key norm are kept. kvpress: `KnormPress` (score = −‖k‖₂, no window, no parameters)."""

from __future__ import annotations

import dataclasses

from kvjax.policies._keyscored import KeyScoredPolicy, key_norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class KnormPolicy(KeyScoredPolicy):
    """Keep the lowest key norms (per KV head; a token's score is fixed when it is written).

    Attributes: `budget` and `window` (KeyScoredPolicy's; kvpress has no window).
    """

    name = "knorm"

    def key_scores(self, layer, k_new, pos_new, valid):
        del layer, pos_new, valid
        return None, -key_norm(k_new).swapaxes(1, 2)  # [B, Hkv, T]
