"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"): when the cache is full, drop
the token that the *current* query attends to least. Per KV head here (the paper averages over
all heads of a layer; kvjax keeps every decision local to a KV head, averaging its query heads)."""

from __future__ import annotations

import dataclasses

from kvjax.policies._ranked import RankedPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class TOVAPolicy(RankedPolicy):
    """Evict the lowest current-step attention.

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one included).
        recent: newest tokens exempt from eviction (1: only the token just written).
        position_shift: attend each kept key at its position within the cache, the query
            one past them (StreamingLLM §3.2 over the kept set; `RankedPolicy`), for streams
            past the model's trained context. Default False: original positions.
    """

    name = "tova"
    budget: int
    recent: int = 1

    def __post_init__(self) -> None:
        self._check()

    @property
    def ring(self) -> int:
        return self.recent

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del score, pos, cur, state, layer_index
        return mass  # only the current query counts
