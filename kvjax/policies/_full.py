"""Full KV cache: every token kept. The quality ceiling; memory grows with length."""

from __future__ import annotations

import dataclasses

from kvjax.policies._base import PositionalPolicy


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullPolicy(PositionalPolicy):
    """Keeps every token; capacity equals the longest sequence (prompt + generated)."""

    name = "full"

    def capacity(self, max_len: int) -> int:
        return max_len

    def slot_of(self, pos, capacity):
        del capacity
        return pos
