"""Policies by name, for the CLI and for the generic tests."""

from __future__ import annotations

from typing import Any

from kvjax.policies._base import Policy
from kvjax.policies._full import FullPolicy
from kvjax.policies._streaming import StreamingPolicy
from kvjax.policies._window import WindowPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (FullPolicy, WindowPolicy, StreamingPolicy)
}
BUDGETLESS = frozenset({"full"})


def make_policy(name: str, budget: int | None = None, **kwargs: Any) -> Policy:
    """Build a policy by name.

    Args:
        name: one of POLICIES.
        budget: tokens kept per KV head per layer; required by every policy except `full`.
        **kwargs: the policy's other hyperparameters.

    Raises:
        ValueError: unknown name, missing/unexpected budget, or invalid hyperparameters.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
    cls = POLICIES[name]
    if name in BUDGETLESS:
        if budget is not None:
            raise ValueError(f"policy {name!r} keeps every token and takes no budget")
        return cls(**kwargs)
    if budget is None:
        raise ValueError(f"policy {name!r} needs a budget (tokens kept per KV head)")
    return cls(budget=budget, **kwargs)
