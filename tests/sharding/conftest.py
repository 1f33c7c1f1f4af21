"""Fixtures of the sharding tests: the tiny 8-head model and the shared policy list built for it."""

import dataclasses

import jax
import pytest
from policy_cases import CASES, build
from sharding_cases import BUDGET, CONFIG8

from kvjax.models import init_params
from kvjax.scorers import ScorerConfig, init_scorer_params, save_scorer


@pytest.fixture(scope="session")
def model8():
    return CONFIG8, init_params(CONFIG8, jax.random.key(0))


@pytest.fixture(scope="session")
def scorers8(tmp_path_factory):
    """Random-init KVpop scorers shaped for CONFIG8 (the shared ones fit TINY_LLAMA's 2 heads)."""
    root = tmp_path_factory.mktemp("scorers8")
    paths = {}
    for kind in ("mlstm", "mlp"):
        cfg = ScorerConfig(kind=kind, num_layers=2, num_kv_heads=8, head_dim=16)
        paths[kind] = root / f"{kind}.msgpack"
        save_scorer(paths[kind], cfg, init_scorer_params(cfg, jax.random.key(3)))
    return paths


@pytest.fixture(scope="session")
def policy8(scorers8):
    """case name → the shared case's policy, built for CONFIG8."""

    def make(case: str, budget: int = BUDGET, **changes):
        if case.startswith("kvpop"):
            from kvjax.policies import make_policy

            kind = "mlp" if case == "kvpop-mlp" else "mlstm"
            kwargs = CASES[case] | {"scorer": str(scorers8[kind])}
            policy = make_policy("kvpop", budget, **kwargs)
        else:
            policy = build(case, budget)
        return dataclasses.replace(policy, **changes) if changes else policy

    return make
