"""Cache policies: which tokens stay, where, and at what precision."""

from kvjax.policies._base import Policy, PositionalPolicy
from kvjax.policies._full import FullPolicy
from kvjax.policies._registry import BUDGETLESS, POLICIES, make_policy
from kvjax.policies._streaming import StreamingPolicy
from kvjax.policies._window import WindowPolicy

__all__ = [
    "BUDGETLESS",
    "POLICIES",
    "FullPolicy",
    "Policy",
    "PositionalPolicy",
    "StreamingPolicy",
    "WindowPolicy",
    "make_policy",
]
