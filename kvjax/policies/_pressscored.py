"""Ranked policies scored by a press outside the generate loop (KVzip, ExpectedAttention): their
scores need the model (reconstruction passes, the context's queries), which policies never see,
so `kvjax.eval.press_context` computes them and writes them into the cache. In the generate loop
on its own such a policy has no scores: like SnapKV's decode, it never evicts a kept token and a
token leaving the window enters only a free slot."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from kvjax.policies._ranked import RankedPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class PressScoredPolicy(RankedPolicy):
    """Base of press-scored policies: sinks and a window kept, scores frozen.

    Attributes:
        budget: tokens attended per step per KV head per layer (the current one, sinks and
            window included); the press keeps `cached_tokens(budget)` = budget - 1.
        n_sink: first tokens never evicted (kvpress: 4).
        window: newest tokens never evicted (the engine needs >= 1).
    """

    budget: int
    n_sink: int = 4
    window: int = 1
    frozen_in_decode = True
    uses_attention_mass: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.n_sink < 0:
            raise ValueError(f"{type(self).__name__}: n_sink must be >= 0, got {self.n_sink}")
        self._check()

    @property
    def ring(self) -> int:
        return self.window

    @property
    def sinks(self) -> int:
        return self.n_sink

    def update_score(self, score, mass, pos, cur, state, layer_index):
        del mass, pos, cur, state, layer_index
        return score

    def init_score(self, mass, pos, state, layer_index):
        del pos, state, layer_index
        return jnp.zeros_like(mass)
