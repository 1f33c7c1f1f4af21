"""Attention dispatch: models call `attend(..., implementation=...)`, never a kernel directly."""

from kvjax.attention._api import IMPLEMENTATIONS, Implementation, attend, resolve_implementation
from kvjax.attention._types import AttnStats
from kvjax.attention._xla import attend_xla

__all__ = [
    "IMPLEMENTATIONS",
    "AttnStats",
    "Implementation",
    "attend",
    "attend_xla",
    "resolve_implementation",
]
