"""Attention dispatch: models call `attend(..., implementation=...)`, never a kernel directly."""

from kvjax.attention._api import IMPLEMENTATIONS, Implementation, attend, resolve_implementation
from kvjax.attention._types import AttnStats, KeyShift, turn_keys
from kvjax.attention._xla import attend_xla

__all__ = [
    "IMPLEMENTATIONS",
    "AttnStats",
    "Implementation",
    "KeyShift",
    "attend",
    "attend_xla",
    "resolve_implementation",
    "turn_keys",
]
