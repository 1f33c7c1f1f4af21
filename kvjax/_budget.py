"""Policy arguments of the convenience API: a name or a policy object, and a budget given as
tokens per KV head or as a compression ratio of the prompt."""

from __future__ import annotations

import numbers

from kvjax.policies import BUDGETLESS, Policy, make_policy


def budget_from_compression(compression: float, prompt_tokens: int) -> int:
    """Tokens kept per KV head when `compression` of a `prompt_tokens`-token prompt is removed.

    As kvpress's `compression_ratio`: 0.75 keeps ⌊0.25 · prompt_tokens⌋ tokens (at least 1).

    Raises:
        ValueError: compression outside [0, 1).
    """
    if isinstance(compression, bool) or not isinstance(compression, numbers.Real):
        raise TypeError(f"compression must be a number in [0, 1), got {compression!r}")
    if not 0.0 <= compression < 1.0:
        raise ValueError(
            f"compression must be in [0, 1) (the fraction of the prompt removed), got {compression}"
        )
    return max(1, int((1.0 - compression) * prompt_tokens))


def resolve_policy(
    policy: str | Policy,
    *,
    budget: int | None,
    compression: float | None,
    prompt_tokens: int,
) -> Policy:
    """The policy a call runs: `policy` itself when it is a policy object, else the named policy
    with its budget (tokens per KV head, or from `compression` of the longest prompt).

    Layer counts are not set here: the functional core takes them from the model.

    Raises:
        TypeError: policy is neither a name nor a Policy; budget is not an int.
        ValueError: budget and compression both given, either out of range, a budget for a
            policy object or a budgetless policy, an unknown name, or invalid hyperparameters.
    """
    if budget is not None and compression is not None:
        raise ValueError(
            "give budget (tokens per KV head) or compression (fraction of the prompt removed), "
            "not both"
        )
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, numbers.Integral):
            raise TypeError(f"budget must be an int (tokens per KV head), got {budget!r}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1 token per KV head, got {budget}")
    if isinstance(policy, Policy):
        if budget is not None or compression is not None:
            raise ValueError(
                f"policy {policy.name!r} is a policy object and carries its own budget; pass "
                "budget= or compression= with a policy name (e.g. policy='h2o', budget=256)"
            )
        return policy
    if not isinstance(policy, str):
        raise TypeError(
            f"policy must be a name (e.g. 'h2o') or a kvjax.policies.Policy, got "
            f"{type(policy).__name__}"
        )
    if compression is None:
        return make_policy(policy, None if budget is None else int(budget))
    budget = budget_from_compression(compression, prompt_tokens)
    if policy in BUDGETLESS:
        raise ValueError(f"policy {policy!r} keeps every token and takes no compression")
    try:
        return make_policy(policy, budget)
    except ValueError as e:
        raise ValueError(
            f"compression={compression} of a {prompt_tokens}-token prompt gives a budget of "
            f"{budget} tokens: {e}"
        ) from None
