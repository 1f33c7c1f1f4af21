"""Fit a policy to a model: the layer count always comes from the model."""

from __future__ import annotations

import dataclasses

from kvjax.models import ModelConfig, rope_rotation
from kvjax.policies import Policy


def fit_policy(policy: Policy, config: ModelConfig) -> Policy:
    """`policy` with its per-layer settings taken from `config`.

    A policy with a `num_layers` field (per-layer budgets, e.g. CONF-KV-L) left None gets the
    model's layer count; one built for another count is refused, since its per-layer budgets
    would be laid out for a different model. Policies without the field are returned as they are.

    Raises:
        TypeError: `policy` is not a `kvjax.policies.Policy`.
        ValueError: `policy.num_layers` differs from `config.num_layers`, or the policy moves
            keys by RoPE positions (`Policy.repositions_keys`, `Policy.shifts_key_positions`)
            and the model has no RoPE.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            f"policy must be a kvjax.policies.Policy (e.g. make_policy('h2o', 256)), "
            f"got {type(policy).__name__}"
        )
    moves_keys = policy.repositions_keys() or policy.shifts_key_positions()
    if moves_keys and rope_rotation(config) is None:
        raise ValueError(
            f"{type(policy).__name__} moves cached keys to new RoPE positions, but the model "
            f"{config.name or ''} has no RoPE (learned absolute positions); use it without "
            "position_shift"
        )
    if "num_layers" not in {f.name for f in dataclasses.fields(policy)}:
        return policy
    layers = policy.num_layers
    if layers is None:
        return dataclasses.replace(policy, num_layers=config.num_layers)
    if layers != config.num_layers:
        raise ValueError(
            f"{type(policy).__name__}.num_layers is {layers} but the model "
            f"{config.name or ''} has {config.num_layers} layers; leave num_layers unset (None) "
            "and the policy takes the model's"
        )
    return policy
