"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling"): SnapKV's selection with budgets that shrink linearly with depth (lower
layers attend broadly, upper layers to a few tokens). kvpress: `PyramidKVPress` (a SnapKVPress
with window_size=64, kernel_size=5, beta=20; its layer budgets are ours).

Layer l of L keeps round(max − l·(max − min)/(L − 1)) tokens, where min = N/β and
max = 2N − min for the mean budget N (window included), so the layers' mean is N. As in kvpress,
budgets too small for the pyramid (the smallest layer's share would not exceed the window) fall
back to SnapKV's flat N; kvpress's other fallback (max > prompt length) needs the prompt length,
which a bounded cache does not know: its slots would only stay empty. At the defaults the
pyramid is on from N = 1291 (round(N/20) > 64); below, this is SnapKV with window 64.

Decode (one token per call) is frozen as in SnapKV: on a stream of one-token calls and no
prefill (teacher-forced perplexity, `kvjax compare`) each layer keeps its first
`max_budget(l) − 1 − window` tokens and the window, so with the pyramid off it keeps exactly
what `chunkkv` with the same window does (docs/policies.md, "Prefill-time presses on one-token
streams").
"""

from __future__ import annotations

import dataclasses

from kvjax.policies._snapkv import SnapKVPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class PyramidKVPolicy(SnapKVPolicy):
    """SnapKV with pyramidal per-layer budgets.

    Attributes:
        budget: N, the mean over layers of the tokens kept per KV head (window included).
        window, observation, pool: SnapKV's (kvpress: window_size=64 both, kernel_size=5).
        beta: the pyramid's steepness β >= 1 (smallest layer: N/β; kvpress: 20).
        num_layers: L (set by the caller / CLI from the model).
    """

    name = "pyramidkv"
    window: int = 64
    observation: int = 64
    pool: int = 5
    beta: float = 20.0
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.beta < 1:
            raise ValueError(f"PyramidKVPolicy.beta must be >= 1, got {self.beta}")
        if self.num_layers < 1:
            raise ValueError(f"PyramidKVPolicy.num_layers must be >= 1, got {self.num_layers}")
        super().__post_init__()

    def _pyramid(self) -> bool:
        return self.num_layers > 1 and round(self.budget / self.beta) > self.window

    def scans_layers(self) -> bool:
        return not self._pyramid()

    def max_budget(self, layer_index: int) -> int:
        if not self._pyramid():
            return self.budget
        low = self.budget / self.beta
        high = 2 * self.budget - low
        step = (high - low) / (self.num_layers - 1)
        return round(high - layer_index * step)
