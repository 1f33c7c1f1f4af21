"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of
Large Language Models"): keep the recent window plus the "heavy hitters", the older tokens with
the largest attention mass accumulated over every query so far."""

from __future__ import annotations

import dataclasses

from kvjax.policies._base import cached_tokens
from kvjax.policies._ranked import RankedPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class H2OPolicy(RankedPolicy):
    """Recent window + heavy hitters by accumulated attention (column sums).

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one included).
        recent_ratio: share of the cached tokens (budget - 1) given to the recent window
            (paper: half).
        position_shift: attend each kept key at its position within the cache, the query
            one past them (StreamingLLM §3.2 over the kept set; `RankedPolicy`), for streams
            past the model's trained context. Default False: original positions.
    """

    name = "h2o"
    budget: int
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.recent_ratio < 1:
            raise ValueError(f"H2OPolicy.recent_ratio must be in (0, 1), got {self.recent_ratio}")
        if self.budget < 3:
            raise ValueError(
                f"H2OPolicy.budget must be >= 3 (the current token, one recent, one heavy "
                f"hitter), got {self.budget}"
            )
        self._check()

    @property
    def ring(self) -> int:
        return max(1, round(cached_tokens(self.budget) * self.recent_ratio))
